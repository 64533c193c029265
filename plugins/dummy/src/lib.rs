//! `dummy`: a dummy link named CNI_IFNAME made directly in the container's
//! namespace and addressed by IPAM, which it requires, with the reference
//! plugin's result shape (v1.2.0+): the one interface, every address on it.
//!
//! As the reference's, the result carries IPAM's DNS (the config's `dns` is
//! not applied) and CHECK compares the link, its state and its addresses,
//! not routes. Unlike the reference, a config without IPAM is a config error
//! (code 7; the reference's 999), DEL without IPAM succeeds, DEL releases
//! IPAM's addresses alongside the link's removal, and GC goes to IPAM.

use rcni_attach::check::{self, link_matches};
use rcni_attach::{
    AttachConf, Attachment, Dad, configure_iface, delegate_ipam, delete_container_link,
    ensure_ifname_free, in_container_for_del, interface, ipam_config, open_container, rt, sandbox,
    start_ipam_del, undo_link, wait_ipam,
};
use rcni_cni::invoke::PendingAdd;
use rcni_cni::rollback::Rollback;
use rcni_cni::skel::{About, CmdArgs};
use rcni_cni::{CniError, CniResult, first_error};
use rcni_netlink::Netlink;

/// The reference's words for a config without `ipam` (ADD and CHECK).
pub const NO_IPAM: &str = "dummy interface requires an IPAM configuration";

/// CHECK without the result of ADD, in the reference's words.
const PREV_RESULT_MISSING: &str = "dummy: Required prevResult missing";

/// The dummy link is the result's only interface.
const IDX_CONTAINER: usize = 0;

/// dummy has no keys of its own: the common ones, IPAM's type.
#[derive(Debug)]
pub struct Conf {
    pub ipam: Option<String>,
}

impl AttachConf for Conf {
    fn load(args: &CmdArgs) -> Result<Conf, CniError> {
        Ok(Conf {
            ipam: rcni_attach::ipam_type(args),
        })
    }

    fn ipam(&self) -> Option<&str> {
        self.ipam.as_deref()
    }
}

impl Conf {
    /// ADD and CHECK need IPAM: a dummy link reaches nobody, its addresses
    /// are its whole purpose.
    fn required_ipam(&self) -> Result<&str, CniError> {
        self.ipam
            .as_deref()
            .ok_or_else(|| CniError::config(NO_IPAM))
    }
}

pub struct Dummy;

impl Attachment for Dummy {
    type Conf = Conf;

    fn about(&self) -> About {
        About::all_versions("dummy", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs, conf: &Conf) -> Result<CniResult, CniError> {
        let ipam_type = conf.required_ipam()?;
        let rt = rt()?;
        let ct_ns = open_container(args)?;
        let ct = rt.block_on(Netlink::connect(&ct_ns))?;
        rt.block_on(ensure_ifname_free(&ct, &args.ifname))?;
        // IPAM runs beside the link's creation. Declared before the
        // rollback: dropped after it, a failed ADD releases the addresses
        // after removing the link that held them.
        let mut ipam = PendingAdd::start(ipam_type, &args.stdin, &args.path, args.version());
        let mut undo = Rollback::new();

        let link = rt
            .block_on(ct.create_dummy(&args.ifname))
            .map_err(|e| CniError::from(e).context("failed to create dummy"))?;
        undo_link(
            &mut undo,
            format!("dummy {}", args.ifname),
            &rt,
            &ct,
            link.index,
        );
        let mut result = ipam_config(args.version(), ipam.wait_into(&mut undo)?, IDX_CONTAINER)?;
        // A dummy link is NOARP: the kernel skips IPv6 duplicate address
        // detection on it, so waiting costs nothing.
        rt.block_on(configure_iface(&ct, &ct_ns, &link, &result, Dad::Wait))?;
        let link = rt.block_on(ct.link_by_index(link.index))?;
        result.interfaces = vec![interface(&link, &sandbox(args))];
        undo.commit();
        ipam.commit();
        Ok(result)
    }

    /// IPAM's release alongside the link's removal if the netns is still
    /// there; a missing netns or link is success.
    fn del(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        let pending = start_ipam_del(conf.ipam(), args);
        let link = in_container_for_del(args, async |_, ct| {
            delete_container_link(ct, &args.ifname).await.map(|_| ())
        });
        first_error([wait_ipam(pending), link])
    }

    /// The reference's CHECK: IPAM's, then the link of `prevResult` (a
    /// dummy, with its MAC, up) and its addresses.
    fn check(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        let ipam_type = conf.required_ipam()?;
        let ct_ns = open_container(args)?;
        delegate_ipam(Some(ipam_type), "CHECK", args)?;
        let prev = args.conf.required_prev_result(PREV_RESULT_MISSING)?;
        let iface = check::container_interface(&prev, &args.ifname, &sandbox(args))?;
        rt()?.block_on(async {
            let ct = Netlink::connect(&ct_ns).await?;
            let link = ct.find_link(&iface.name).await?.ok_or_else(|| {
                CniError::check_failed(format!(
                    "Container Interface name in prevResult: {} not found",
                    iface.name
                ))
            })?;
            link_matches(&link, iface, Some("dummy"))?;
            if !link.admin_up {
                return Err(CniError::check_failed(format!(
                    "Interface {} is down",
                    link.name
                )));
            }
            check::validate_ips(&ct, &link, &prev.ips, IDX_CONTAINER).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ipam_is_required_by_add_and_check_only() {
        let c = Conf::from_json(&json!({"cniVersion": "1.0.0", "name": "n", "type": "dummy",
            "ipam": {"type": "host-local"}}))
        .unwrap();
        assert_eq!(c.required_ipam().unwrap(), "host-local");

        // Loading succeeds (DEL, STATUS and GC need no IPAM); ADD's and
        // CHECK's first step fails with the reference's message.
        for conf in [
            json!({"cniVersion": "1.0.0", "name": "n", "type": "dummy"}),
            json!({"cniVersion": "1.0.0", "name": "n", "type": "dummy", "ipam": {}}),
            json!({"cniVersion": "1.0.0", "name": "n", "type": "dummy", "ipam": {"type": ""}}),
        ] {
            let c = Conf::from_json(&conf).unwrap();
            let e = c.required_ipam().unwrap_err();
            assert_eq!((e.code, e.msg.as_str()), (7, NO_IPAM), "{conf}");
        }
    }
}
