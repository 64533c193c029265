//! `loopback`: brings `lo` up in the container's namespace. containerd calls
//! it (at 0.3.1) for every pod; CNI_IFNAME is ignored, as in the reference.

use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, ErrorCode, Interface, IpConfig, version};
use rcni_netlink::Netlink;
use rcni_netns::NetNs;

pub struct Loopback;

fn open_netns(args: &CmdArgs) -> Result<NetNs, CniError> {
    let path = args.netns.as_ref().ok_or_else(|| {
        CniError::new(
            ErrorCode::InvalidEnvironmentVariables,
            "required env variables [CNI_NETNS] missing",
        )
    })?;
    NetNs::open(path).map_err(|e| {
        CniError::with_code(e.cni_code(), format!("failed to open netns {path:?}: {e}"))
    })
}

fn nl_err(e: rcni_netlink::Error) -> CniError {
    CniError::with_code(e.cni_code(), e.to_string())
}

/// Addresses `lo` may carry: 127.0.0.0/8 and ::1. Anything else means this
/// is not the loopback device we think it is, as the reference checks.
fn is_loopback(ip: std::net::IpAddr) -> bool {
    ip.is_loopback()
}

/// Brings `lo` up and returns its addresses.
fn lo_up(ns: &NetNs) -> Result<Vec<ipnetwork::IpNetwork>, CniError> {
    let rt = rcni_netlink::runtime().map_err(nl_err)?;
    rt.block_on(async {
        let nl = Netlink::connect(ns).await.map_err(nl_err)?;
        let lo = nl.link_by_name("lo").await.map_err(nl_err)?;
        nl.set_up(lo.index).await.map_err(nl_err)?;
        let addrs: Vec<_> = nl
            .addresses(Some(lo.index))
            .await
            .map_err(nl_err)?
            .into_iter()
            .map(|a| a.addr)
            .collect();
        if let Some(bad) = addrs.iter().find(|a| !is_loopback(a.ip())) {
            return Err(CniError::internal(format!(
                "loopback interface found with non-loopback address {:?}",
                bad.ip().to_string()
            )));
        }
        Ok(addrs)
    })
}

impl Plugin for Loopback {
    fn about(&self) -> About {
        About {
            name: "loopback",
            version: env!("CARGO_PKG_VERSION"),
            supported_versions: version::ALL,
        }
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let ns = open_netns(args)?;
        let addrs = lo_up(&ns)?;
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
        let Some(path) = &args.netns else {
            return Ok(());
        };
        let ns = match NetNs::open(path) {
            Ok(ns) => ns,
            // A vanished namespace (or a stale file whose bind mount is gone) has
            // nothing left to undo.
            Err(e) if e.is_not_found() || matches!(e, rcni_netns::Error::NotNetns(_)) => {
                return Ok(());
            }
            Err(e) => {
                return Err(CniError::with_code(
                    e.cni_code(),
                    format!("failed to open netns {path:?}: {e}"),
                ));
            }
        };
        let rt = rcni_netlink::runtime().map_err(nl_err)?;
        rt.block_on(async {
            let nl = Netlink::connect(&ns).await.map_err(nl_err)?;
            match nl.link_by_name("lo").await {
                Ok(lo) => nl.set_down(lo.index).await.map_err(nl_err),
                Err(e) if e.is_not_found() => Ok(()),
                Err(e) => Err(nl_err(e)),
            }
        })
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let ns = open_netns(args)?;
        let rt = rcni_netlink::runtime().map_err(nl_err)?;
        rt.block_on(async {
            let nl = Netlink::connect(&ns).await.map_err(nl_err)?;
            let lo = nl.link_by_name("lo").await.map_err(nl_err)?;
            if !lo.admin_up {
                return Err(CniError::new(
                    ErrorCode::CheckFailed,
                    "loopback interface is down",
                ));
            }
            let addrs = nl.addresses(Some(lo.index)).await.map_err(nl_err)?;
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
