//! `ipvlan`: an ipvlan link (l2, l3 or l3s) on a master of the node or,
//! with `linkInContainer`, of the container, under CNI_IFNAME in the
//! container, with the reference plugin's result shape. Chained after
//! another plugin it may take its master and its addresses from
//! `prevResult`, as the reference.
//!
//! Unlike the reference, DEL needs neither the master nor the netns, ADD
//! removes the link and releases IPAM's addresses whatever step fails, and
//! CHECK works without `master` (the reference's always fails there: it
//! looks up a master named "").

mod conf;

use conf::Conf;
use rcni_attach::lower::{create_lower_link, del_lower, finish_lower_add};
use rcni_attach::{
    Attachment, Namespaces, check, ensure_ifname_free, ipam_config, lower, sandbox, start_ipam_add,
};
use rcni_cni::rollback::Rollback;
use rcni_cni::skel::{About, CmdArgs};
use rcni_cni::{CniError, CniResult, IpConfig};
use rcni_netlink::{Link, LowerOpts, Netlink};

pub struct Ipvlan;

/// The ipvlan link is the result's only interface.
const IDX_CONTAINER: usize = 0;

impl Attachment for Ipvlan {
    type Conf = Conf;

    fn about(&self) -> About {
        About::all_versions("ipvlan", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs, conf: &Conf) -> Result<CniResult, CniError> {
        let from_prev = match conf.lower.ipam {
            Some(_) => None,
            None => Some(conf.prev_with_ips().ok_or_else(|| {
                CniError::config(
                    "ipvlan needs \"ipam\", or a prevResult with addresses when chained",
                )
            })?),
        };
        let ns = Namespaces::open(args)?;
        let master = ns.rt.block_on(
            conf.lower
                .find_master(&ns, conf.master_for_add()?.unwrap_or("")),
        )?;
        let mtu = lower::check_mtu(conf.mtu, &master)?;
        ns.rt.block_on(ensure_ifname_free(&ns.ct, &args.ifname))?;
        // Declared before the rollback: dropped after it, so a failed ADD
        // releases its addresses after removing the link that used them.
        let mut ipam = start_ipam_add(conf.lower.ipam.as_deref(), args);
        let mut undo = Rollback::new();

        let link = create_lower_link(
            &ns,
            args,
            "ipvlan",
            conf.lower.link_in_container,
            &mut undo,
            async |nl, name, target| {
                let opts = LowerOpts {
                    mtu,
                    ns: target,
                    ..Default::default()
                };
                nl.create_ipvlan(name, master.index, conf.mode, opts).await
            },
        )?;

        let result = match (&mut ipam, from_prev) {
            (Some(ipam), _) => ipam_config(args.version(), ipam.wait()?, IDX_CONTAINER)?,
            (None, Some(prev)) => {
                // The previous plugin's result, its addresses now this
                // link's, as the reference.
                let mut r = prev.clone();
                r.cni_version = args.version().to_string();
                r.interfaces.clear();
                for ip in &mut r.ips {
                    *ip = IpConfig {
                        interface: Some(IDX_CONTAINER),
                        ..ip.clone()
                    };
                }
                r
            }
            (None, None) => unreachable!("checked above"),
        };
        finish_lower_add(&ns, args, &link, Some(result), true, undo, ipam)
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
            // Without `master` the one ADD used is not known any more (the
            // prevResult ADD took it from is gone): the lower device is not
            // checked then.
            let master = match conf.lower.master.as_str() {
                "" => None,
                name => Some(
                    conf.lower
                        .find_master(&ns, name)
                        .await
                        .map_err(|e| CniError::check_failed(e.msg))?,
                ),
            };
            let link = check::validate_link(&ns.ct, ct_if, Some("ipvlan")).await?;
            check_lower(&ns.ct, &link, master.as_ref(), conf).await?;
            check::validate_ips(&ns.ct, &link, &prev.ips, IDX_CONTAINER).await?;
            check::validate_routes(&ns.ct, &prev.routes).await
        })
    }
}

/// CHECK of the link against the config: on the master, in the mode.
async fn check_lower(
    ct: &Netlink,
    link: &Link,
    master: Option<&Link>,
    conf: &Conf,
) -> Result<(), CniError> {
    if let Some(master) = master
        && link.link != Some(master.index)
    {
        return Err(CniError::check_failed(format!(
            "ipvlan: {} is not on master {}",
            link.name, master.name
        )));
    }
    let mode = ct.ipvlan_mode(link.index).await?;
    if mode != Some(conf.mode) {
        return Err(CniError::check_failed(format!(
            "Container IPVlan mode {} does not match expected value: {}",
            mode.map_or("unknown".into(), |m| m.to_string()),
            conf.mode
        )));
    }
    Ok(())
}
