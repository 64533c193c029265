//! `loopback`: brings `lo` up in the container's namespace. containerd calls
//! it (at 0.3.1) for every pod; CNI_IFNAME is ignored, as in the reference.

use rcni_attach::{open_container, open_container_for_del};
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, ErrorCode, Interface, IpConfig};
use rcni_netlink::Netlink;
use rcni_netns::NetNs;

pub struct Loopback;

/// Brings `lo` up and returns its addresses. Anything but 127.0.0.0/8 and
/// ::1 there means this is not the loopback device we think it is (the
/// reference checks the same).
fn lo_up(ns: &NetNs) -> Result<Vec<ipnetwork::IpNetwork>, CniError> {
    rcni_netlink::runtime()?.block_on(async {
        let nl = Netlink::connect(ns).await?;
        let lo = nl.link_by_name("lo").await?;
        nl.set_up(lo.index).await?;
        let addrs: Vec<_> = nl
            .addresses(Some(lo.index))
            .await?
            .into_iter()
            .map(|a| a.addr)
            .collect();
        if let Some(bad) = addrs.iter().find(|a| !a.ip().is_loopback()) {
            return Err(CniError::internal(format!(
                "loopback interface found with non-loopback address \"{}\"",
                bad.ip()
            )));
        }
        Ok(addrs)
    })
}

impl Plugin for Loopback {
    fn about(&self) -> About {
        About::all_versions("loopback", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let addrs = lo_up(&open_container(args)?)?;
        // Chained after another plugin: pass its result through unchanged.
        if let Some(prev) = args.conf.prev_result()? {
            return Ok(prev);
        }
        let mut r = CniResult::new(args.version());
        r.interfaces.push(Interface {
            name: "lo".into(),
            mac: "00:00:00:00:00:00".into(),
            sandbox: args
                .netns
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            ..Default::default()
        });
        // The first address of each family, as the reference reports them.
        for v4 in [true, false] {
            if let Some(a) = addrs.iter().find(|a| a.is_ipv4() == v4) {
                r.ips.push(IpConfig {
                    interface: Some(0),
                    address: *a,
                    gateway: None,
                });
            }
        }
        Ok(r)
    }

    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        // A vanished namespace has nothing left to undo.
        let Some(ns) = open_container_for_del(args)? else {
            return Ok(());
        };
        rcni_netlink::runtime()?.block_on(async {
            let nl = Netlink::connect(&ns).await?;
            match nl.link_by_name("lo").await {
                Ok(lo) => Ok(nl.set_down(lo.index).await?),
                Err(e) if e.is_not_found() => Ok(()),
                Err(e) => Err(e.into()),
            }
        })
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let ns = open_container(args)?;
        rcni_netlink::runtime()?.block_on(async {
            let nl = Netlink::connect(&ns).await?;
            let lo = nl.link_by_name("lo").await?;
            if !lo.admin_up {
                return Err(CniError::new(
                    ErrorCode::CheckFailed,
                    "loopback interface is down",
                ));
            }
            let addrs = nl.addresses(Some(lo.index)).await?;
            if !addrs
                .iter()
                .any(|a| a.addr.ip() == std::net::Ipv4Addr::LOCALHOST)
            {
                return Err(CniError::new(
                    ErrorCode::CheckFailed,
                    "loopback interface has no 127.0.0.1 address",
                ));
            }
            Ok(())
        })
    }
}
