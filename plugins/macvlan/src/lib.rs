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
use rcni_attach::lower::{
    check_lower, create_lower_link, del_lower, finish_lower_add, open_master,
};
use rcni_attach::{Attachment, lower, start_ipam_add};
use rcni_cni::rollback::Rollback;
use rcni_cni::skel::{About, CmdArgs};
use rcni_cni::{CniError, CniResult};
use rcni_netlink::LowerOpts;

pub struct Macvlan;

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
        let (ns, master, mtu) = open_master(args, &conf.lower, &conf.lower.master, |m| {
            lower::check_mtu(conf.mtu, m)
        })?;
        // Declared before the rollback: dropped after it, so a failed ADD
        // releases its addresses after removing the link that used them.
        let ipam = start_ipam_add(conf.lower.ipam.as_deref(), args);
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
        finish_lower_add(&ns, args, &link, None, true, ipam, undo)
    }

    /// IPAM's release alongside the link's removal if the netns is still
    /// there; a missing master, netns or link is success.
    fn del(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        del_lower(args, conf.lower.ipam.as_deref())
    }

    fn check(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        check_lower(args, &conf.lower, "macvlan", false, async |ct, link| {
            lower::check_mode("macvlan", ct.macvlan_mode(link.index).await?, conf.mode)
        })
    }
}
