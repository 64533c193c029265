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
use rcni_attach::lower::{
    IDX_CONTAINER, check_lower, create_lower_link, del_lower, finish_lower_add, open_master,
};
use rcni_attach::{Attachment, lower, start_ipam_add};
use rcni_cni::rollback::Rollback;
use rcni_cni::skel::{About, CmdArgs};
use rcni_cni::{CniError, CniResult, IpConfig};
use rcni_netlink::LowerOpts;

pub struct Ipvlan;

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
        // The master's name before the namespaces: the reference's loadConf
        // takes it from prevResult.
        let name = conf.master_for_add()?.unwrap_or("");
        let (ns, master, mtu) =
            open_master(args, &conf.lower, name, |m| lower::check_mtu(conf.mtu, m))?;
        // Declared before the rollback: dropped after it, so a failed ADD
        // releases its addresses after removing the link that used them.
        let ipam = start_ipam_add(conf.lower.ipam.as_deref(), args);
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

        // The previous plugin's result, its addresses now this link's, as
        // the reference.
        let without_ipam = from_prev.map(|prev| {
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
        });
        finish_lower_add(&ns, args, &link, without_ipam, true, ipam, undo)
    }

    /// IPAM's release alongside the link's removal if the netns is still
    /// there; a missing master, netns or link is success.
    fn del(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        del_lower(args, conf.lower.ipam.as_deref())
    }

    /// Without `master` the one ADD used is not known any more (the
    /// prevResult ADD took it from is gone): the lower device is not
    /// checked then.
    fn check(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        check_lower(args, &conf.lower, "ipvlan", true, async |ct, link| {
            lower::check_mode("IPVlan", ct.ipvlan_mode(link.index).await?, conf.mode)
        })
    }
}
