//! `macvlan`: a macvlan link (bridge, private, vepa or passthru) on a
//! master of the node (by default the interface of its default route) or,
//! with `linkInContainer`, of the container, under CNI_IFNAME in the
//! container, with the reference plugin's result shape.
//!
//! Unlike the reference, DEL needs neither the master nor the netns (the
//! reference looks the master up first and fails once it is gone), and ADD
//! removes the link and releases IPAM's addresses whatever step fails.

mod conf;

use conf::Conf;
use rcni_attach::lower::{create_lower_link, del_lower, finish_lower_add};
use rcni_attach::{
    Attachment, Namespaces, check, ensure_ifname_free, ipam_config, lower, sandbox, start_ipam_add,
};
use rcni_cni::rollback::Rollback;
use rcni_cni::skel::{About, CmdArgs};
use rcni_cni::{CniError, CniResult};
use rcni_netlink::{Link, LowerOpts, Netlink};

pub struct Macvlan;

/// The macvlan link is the result's only interface.
const IDX_CONTAINER: usize = 0;

impl Attachment for Macvlan {
    type Conf = Conf;

    fn about(&self) -> About {
        About::all_versions("macvlan", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs, conf: &Conf) -> Result<CniResult, CniError> {
        // The reference reads CNI_ARGS with Go's LoadArgs: only `MAC` is
        // known, anything else needs IgnoreUnknown.
        args.args.check_known(&["MAC"])?;
        let mac = conf.mac()?;
        let ns = Namespaces::open(args)?;
        let master = ns
            .rt
            .block_on(conf.lower.find_master(&ns, &conf.lower.master))?;
        let mtu = lower::check_mtu(conf.mtu, &master)?;
        ns.rt.block_on(ensure_ifname_free(&ns.ct, &args.ifname))?;
        // Declared before the rollback: dropped after it, so a failed ADD
        // releases its addresses after removing the link that used them.
        let mut ipam = start_ipam_add(conf.lower.ipam.as_deref(), args);
        let mut undo = Rollback::new();

        let link = create_lower_link(
            &ns,
            args,
            "macvlan",
            conf.lower.link_in_container,
            &mut undo,
            async |nl, name, target| {
                let opts = LowerOpts {
                    mtu,
                    mac,
                    ns: target,
                    bc_queue_len: conf.bc_queue_len,
                };
                nl.create_macvlan_with(name, master.index, conf.mode, opts)
                    .await
            },
        )?;

        let result = match &mut ipam {
            Some(ipam) => Some(ipam_config(args.version(), ipam.wait()?, IDX_CONTAINER)?),
            None => None,
        };
        finish_lower_add(&ns, args, &link, result, true, undo, ipam)
    }

    /// IPAM's release alongside the link's removal if the netns is still
    /// there; a missing master, netns or link is success.
    fn del(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        del_lower(args, conf.lower.ipam.as_deref())
    }

    fn check(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        rcni_attach::delegate_ipam(conf.lower.ipam.as_deref(), "CHECK", args)?;
        let prev = args.conf.required_prev_result(check::PREV_RESULT_MISSING)?;
        let ns = Namespaces::open(args)?;
        let ct_if = check::container_interface(&prev, &args.ifname, &sandbox(args))?;
        ns.rt.block_on(async {
            let master = conf
                .lower
                .find_master(&ns, &conf.lower.master)
                .await
                .map_err(|e| CniError::check_failed(e.msg))?;
            let link = check::validate_link(&ns.ct, ct_if, Some("macvlan")).await?;
            check_lower(&ns.ct, &link, &master, conf).await?;
            check::validate_ips(&ns.ct, &link, &prev.ips, IDX_CONTAINER).await?;
            check::validate_routes(&ns.ct, &prev.routes).await
        })
    }
}

/// CHECK of the link against the config: on the master, in the mode.
async fn check_lower(
    ct: &Netlink,
    link: &Link,
    master: &Link,
    conf: &Conf,
) -> Result<(), CniError> {
    if link.link != Some(master.index) {
        return Err(CniError::check_failed(format!(
            "macvlan: {} is not on master {}",
            link.name, master.name
        )));
    }
    let mode = ct.macvlan_mode(link.index).await?;
    if mode != Some(conf.mode) {
        return Err(CniError::check_failed(format!(
            "Container macvlan mode {} does not match expected value: {}",
            mode.map_or("unknown".into(), |m| m.to_string()),
            conf.mode
        )));
    }
    Ok(())
}
