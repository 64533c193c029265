//! `vlan`: an 802.1Q link on a master interface of the node (or, with
//! `linkInContainer`, of the container), moved into the container under
//! CNI_IFNAME, with the reference plugin's result shape.
//!
//! Unlike the reference, DEL needs neither the master nor the netns (the
//! reference looks the master up to validate the MTU and fails once it is
//! gone) and ADD undoes the link when IPAM or addressing fails. A config
//! without IPAM (or with `"ipam": {}`) is an L2-only attachment, as since
//! v1.10.0: the link up without addresses, IPAM skipped by every command.

mod conf;

use conf::Conf;
use rcni_attach::lower::{
    check_lower, create_lower_link, del_lower, finish_lower_add, open_master,
};
use rcni_attach::{Attachment, start_ipam_add};
use rcni_cni::rollback::Rollback;
use rcni_cni::skel::{About, CmdArgs};
use rcni_cni::{CniError, CniResult};

pub struct Vlan;

impl Attachment for Vlan {
    type Conf = Conf;

    fn about(&self) -> About {
        About::all_versions("vlan", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs, conf: &Conf) -> Result<CniResult, CniError> {
        let (ns, master, ()) = open_master(args, &conf.lower, &conf.lower.master, |m| {
            conf.check_mtu(m.mtu)
        })?;
        if conf.lower.ipam.is_none() {
            // An L2 result has no addresses, so no 0.1.0/0.2.0 form: refused
            // before the link is made (v1.10.0 fails converting its result,
            // after making it, and leaves it in the pod).
            CniResult::new(args.version()).to_value(args.version())?;
        }
        // Once the config is known good, IPAM runs alongside the link work.
        // Declared before the rollback: dropped after it, so a failed ADD
        // releases its addresses after removing the link that used them.
        let ipam = start_ipam_add(conf.lower.ipam.as_deref(), args);
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
        finish_lower_add(&ns, args, &link, None, false, ipam, undo)
    }

    /// IPAM's release alongside the link's removal if the netns is still
    /// there; a missing master, netns or link is success.
    fn del(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        del_lower(args, conf.lower.ipam.as_deref())
    }

    fn check(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        check_lower(args, &conf.lower, "vlan", false, async |ct, link| {
            let id = ct.vlan_id(link.index).await?;
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
            Ok(())
        })
    }
}
