//! Bridged pods: which attachments are bridge ports, and br_netfilter on
//! for them.

use super::{current_ns, netfilter};
use rcni_cni::CniError;

/// Whether each attachment's host veth is a bridge port. A veth that is
/// gone is not (its pod is on its way out).
pub(super) fn bridged_ports(ports: &[(String, String)]) -> Result<Vec<(String, bool)>, CniError> {
    // A thread of our own for the runtime, in case the caller runs in one
    // already; it inherits this thread's network namespace.
    std::thread::scope(|sc| {
        sc.spawn(|| -> Result<Vec<(String, bool)>, CniError> {
            let rt = rcni_netlink::runtime()?;
            rt.block_on(async {
                let nl = rcni_netlink::Netlink::connect_current().await?;
                let mut out = Vec::with_capacity(ports.len());
                for (key, ifname) in ports {
                    let link = match nl.link_by_name(ifname).await {
                        Ok(l) => l,
                        Err(e) if e.is_not_found() => {
                            out.push((key.clone(), false));
                            continue;
                        }
                        Err(e) => return Err(e.into()),
                    };
                    let bridged = match link.master {
                        None => false,
                        Some(m) => match nl.link_by_index(m).await {
                            Ok(master) => master.kind.as_deref() == Some("bridge"),
                            Err(e) if e.is_not_found() => false,
                            Err(e) => return Err(e.into()),
                        },
                    };
                    out.push((key.clone(), bridged));
                }
                Ok(out)
            })
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

const BRIDGE_SYSCTLS: [&str; 2] = [
    "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
];

/// Bridged pod-to-pod traffic meets the inet forward hook only through
/// br_netfilter, with these (per-namespace) sysctls on; without them the
/// policy would silently not apply to pods on the same bridge.
pub(super) fn ensure_bridge_netfilter() -> Result<(), CniError> {
    let ns = current_ns()?;
    // /proc/sys/net resolves against the calling thread's namespace.
    let present = || std::path::Path::new("/proc/sys/net/bridge").is_dir();
    if !present() {
        if let Some(modprobe) = rcni_netfilter::exec::find_tool("modprobe") {
            let _ = std::process::Command::new(modprobe)
                .arg("br_netfilter")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
        }
        if !present() {
            return Err(netfilter(
                "policy: pods are attached to a bridge but br_netfilter is not available \
                 (/proc/sys/net/bridge is missing and `modprobe br_netfilter` did not help): \
                 traffic between them would bypass the nftables policy",
            ));
        }
    }
    for key in BRIDGE_SYSCTLS {
        let cur = rcni_netlink::sysctl::get(&ns, key).map_err(CniError::from)?;
        if cur != "1" {
            rcni_netlink::sysctl::set(&ns, key, "1")
                .map_err(|e| netfilter(format!("policy: bridged pods need {key}=1: {e}")))?;
        }
    }
    Ok(())
}
