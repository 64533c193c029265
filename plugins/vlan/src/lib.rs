//! `vlan`: an 802.1Q link on a master interface of the node (or, with
//! `linkInContainer`, of the container), moved into the container under
//! CNI_IFNAME, with the reference plugin's result shape.
//!
//! Unlike the reference, DEL needs neither the master nor the netns (the
//! reference looks the master up to validate the MTU and fails once it is
//! gone), ADD undoes the link when IPAM or addressing fails, and a config
//! without IPAM is an L2-only attachment instead of an error.

mod conf;

use conf::Conf;
use rcni_attach::check;
use rcni_attach::lower::{create_lower_link, del_lower, finish_lower_add};
use rcni_attach::{
    Attachment, Namespaces, ensure_ifname_free, ipam_config, sandbox, start_ipam_add,
};
use rcni_cni::rollback::Rollback;
use rcni_cni::skel::{About, CmdArgs};
use rcni_cni::{CniError, CniResult};

pub struct Vlan;

/// The vlan link is the result's only interface.
const IDX_CONTAINER: usize = 0;

impl Attachment for Vlan {
    type Conf = Conf;

    fn about(&self) -> About {
        About::all_versions("vlan", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs, conf: &Conf) -> Result<CniResult, CniError> {
        let ns = Namespaces::open(args)?;
        let master = ns
            .rt
            .block_on(conf.lower.find_master(&ns, &conf.lower.master))?;
        conf.check_mtu(master.mtu)?;
        ns.rt.block_on(ensure_ifname_free(&ns.ct, &args.ifname))?;
        // Once the config is known good, IPAM runs alongside the link work.
        // Declared before the rollback: dropped after it, so a failed ADD
        // releases its addresses after removing the link that used them.
        let mut ipam = start_ipam_add(conf.lower.ipam.as_deref(), args);
        let mut undo = Rollback::new();

        let link = create_lower_link(
            &ns,
            args,
            "vlan",
            conf.lower.link_in_container,
            &mut undo,
            async |nl, name, target| {
                nl.create_vlan(name, master.index, conf.vlan_id, conf.mtu, target)
                    .await
            },
        )?;

        let result = match &mut ipam {
            Some(ipam) => Some(ipam_config(args.version(), ipam.wait()?, IDX_CONTAINER)?),
            None => None,
        };
        finish_lower_add(&ns, args, &link, result, false, undo, ipam)
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
            let link = check::validate_link(&ns.ct, ct_if, Some("vlan")).await?;
            if link.link != Some(master.index) {
                return Err(CniError::check_failed(format!(
                    "vlan: {} is not on master {}",
                    link.name, conf.lower.master
                )));
            }
            let id = ns.ct.vlan_id(link.index).await?;
            if id != Some(conf.vlan_id) {
                return Err(CniError::check_failed(format!(
                    "vlan: {} has VLAN ID {}, configured {}",
                    link.name,
                    id.map_or("none".into(), |i| i.to_string()),
                    conf.vlan_id
                )));
            }
            if let Some(mtu) = conf.mtu
                && mtu != link.mtu
            {
                return Err(CniError::check_failed(format!(
                    "vlan: configured MTU of {} is {mtu}, current value is {}",
                    link.name, link.mtu
                )));
            }
            check::validate_ips(&ns.ct, &link, &prev.ips, IDX_CONTAINER).await?;
            check::validate_routes(&ns.ct, &prev.routes).await
        })
    }
}
