//! eBPF cross-node forwarding (`"ebpf": true`): the datapath's other-node
//! map (`rcni_remote`: each peer's pod subnet -> out device, its MTU, next
//! hop) and `rcni_from_net` on the devices peers' traffic arrives on, kept
//! level-triggered like the routes: read what is there, change only the
//! difference, flush nothing. The datapath is the fastpath plugin's for the
//! agent's network (`<pin root>/rcni/`), loaded here when no pod has yet.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use ipnetwork::IpNetwork;
use rcni_ebpf::{Datapath, RemoteHop};

use crate::install::conflist::NETWORK_NAME;
use crate::sync::desired::{PeerEntries, Via};

/// Where the fastpath plugin pins its networks unless told otherwise.
pub const DEFAULT_PIN_ROOT: &str = "/sys/fs/bpf/rcni";

/// One peer subnet's entry: where its packets leave and through which next
/// hop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hop {
    pub dst: IpNetwork,
    pub oif: u32,
    pub mtu: u32,
    pub next_hop: IpAddr,
}

/// The hops for one family's peers: the route's device and gateway (the
/// peer's node address for host-gw, its VTEP address for VXLAN, whose
/// permanent neighbour entry the agent writes), with the MTU of the device
/// it leaves by. WireGuard peers have none (refused with ebpf).
pub fn hops(entries: &[PeerEntries], uplink_mtu: u32, vtep_mtu: u32) -> Vec<Hop> {
    entries
        .iter()
        .filter_map(|e| {
            let mtu = match e.via {
                Via::HostGw | Via::Bgp => uplink_mtu,
                Via::Vxlan => vtep_mtu,
                Via::WireGuard => return None,
            };
            Some(Hop {
                dst: e.route.dst,
                oif: e.route.oif?,
                mtu,
                next_hop: e.route.gateway?,
            })
        })
        .collect()
}

/// What the map and the links should be: `None` takes everything off.
pub struct Want {
    pub hops: Vec<Hop>,
    /// The devices (by name) peers' packets arrive on.
    pub devices: BTreeSet<String>,
}

/// The changes one sync made (for the report).
#[derive(Debug, Default)]
pub struct Synced {
    pub changes: usize,
    pub log: Vec<String>,
}

/// The map changes from `have` to `want`: (set, remove).
pub fn diff(
    have: &[(IpNetwork, RemoteHop)],
    want: &[Hop],
) -> (Vec<(IpNetwork, RemoteHop)>, Vec<IpNetwork>) {
    let have: BTreeMap<IpNetwork, RemoteHop> = have.iter().copied().collect();
    let want: BTreeMap<IpNetwork, RemoteHop> = want
        .iter()
        .map(|h| (h.dst, RemoteHop::new(h.oif, h.mtu, h.next_hop)))
        .collect();
    // The datapath picks the counter slot: equal hops differ in it.
    let set = want
        .iter()
        .filter(|(k, v)| !have.get(k).is_some_and(|h| h.same_hop(v)))
        .map(|(k, v)| (*k, *v))
        .collect();
    let remove = have
        .keys()
        .filter(|k| !want.contains_key(k))
        .copied()
        .collect();
    (set, remove)
}

/// The network's pin directory under `pin_root`.
pub fn network_dir(pin_root: &Path) -> PathBuf {
    pin_root.join(NETWORK_NAME)
}

/// A step of [`sync`] the eBPF side refused: what it was doing, and why.
#[derive(Debug, thiserror::Error)]
#[error("eBPF forwarding: {what}: {error}")]
pub struct EbpfError {
    pub what: &'static str,
    pub error: rcni_ebpf::Error,
}

/// Brings the map and the links to `want` (in the calling thread's network
/// namespace).
pub fn sync(pin_root: &Path, want: Option<&Want>) -> Result<Synced, EbpfError> {
    let dir = network_dir(pin_root);
    let mut out = Synced::default();
    let e = |what: &'static str, error: rcni_ebpf::Error| EbpfError { what, error };
    let Some(want) = want else {
        // Off: the links go, and the map entries of a datapath that pods
        // may still use (their own fast path stays theirs).
        for dev in rcni_ebpf::net_links(&dir).map_err(|x| e("links", x))? {
            if rcni_ebpf::detach_net(&dir, &dev).map_err(|x| e("detach", x))? {
                out.changes += 1;
                out.log.push(format!("ebpf: off {dev}"));
            }
        }
        if rcni_ebpf::bpffs::is_bpffs(pin_root).unwrap_or(false)
            && let Some(mut dp) = Datapath::open(&dir).map_err(|x| e("open", x))?
        {
            for (net, _) in dp.remote_routes().map_err(|x| e("read", x))? {
                dp.remove_remote_route(net).map_err(|x| e("remove", x))?;
                out.changes += 1;
                out.log.push(format!("ebpf: -{net}"));
            }
        }
        return Ok(out);
    };
    rcni_ebpf::bpffs::ensure_root(pin_root).map_err(|x| e("bpffs", x))?;
    let mut dp = Datapath::open_or_load(&dir).map_err(|x| e("load", x))?;
    let have = dp.remote_routes().map_err(|x| e("read", x))?;
    let (set, remove) = diff(&have, &want.hops);
    for (net, hop) in set {
        dp.set_remote_route(net, hop).map_err(|x| e("write", x))?;
        out.changes += 1;
        out.log.push(format!(
            "ebpf: {net} via {} dev #{} mtu {}",
            hop.next_hop().map(|a| a.to_string()).unwrap_or_default(),
            hop.ifindex,
            hop.mtu
        ));
    }
    for net in remove {
        dp.remove_remote_route(net).map_err(|x| e("remove", x))?;
        out.changes += 1;
        out.log.push(format!("ebpf: -{net}"));
    }
    for dev in rcni_ebpf::net_links(&dir).map_err(|x| e("links", x))? {
        if !want.devices.contains(&dev)
            && rcni_ebpf::detach_net(&dir, &dev).map_err(|x| e("detach", x))?
        {
            out.changes += 1;
            out.log.push(format!("ebpf: off {dev}"));
        }
    }
    for dev in &want.devices {
        if !dp.net_attached(dev).map_err(|x| e("query", x))? {
            dp.attach_net(dev).map_err(|x| e("attach", x))?;
            out.changes += 1;
            out.log.push(format!("ebpf: on {dev}"));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::desired::PeerEntries;
    use rcni_netlink::overlay::OwnedRoute;

    fn entry(via: Via, dst: &str, gw: &str, oif: u32) -> PeerEntries {
        PeerEntries {
            name: "n".into(),
            via,
            neighbour: None,
            fdb: None,
            route: OwnedRoute {
                dst: dst.parse().unwrap(),
                gateway: Some(gw.parse().unwrap()),
                oif: Some(oif),
                onlink: via == Via::Vxlan,
            },
        }
    }

    #[test]
    fn hops_follow_the_routes_with_their_devices_mtu() {
        let e = [
            entry(Via::HostGw, "10.244.2.0/24", "192.168.50.2", 2),
            entry(Via::Vxlan, "10.244.3.0/24", "10.244.3.0", 9),
            entry(Via::WireGuard, "10.244.4.0/24", "10.244.4.0", 7),
        ];
        let h = hops(&e, 1500, 1450);
        assert_eq!(h.len(), 2);
        assert_eq!(
            (h[0].oif, h[0].mtu, h[0].next_hop.to_string()),
            (2, 1500, "192.168.50.2".into())
        );
        assert_eq!(
            (h[1].oif, h[1].mtu, h[1].next_hop.to_string()),
            (9, 1450, "10.244.3.0".into())
        );
    }

    #[test]
    fn only_differences_are_written() {
        let a = Hop {
            dst: "10.244.2.0/24".parse().unwrap(),
            oif: 2,
            mtu: 1500,
            next_hop: "192.168.50.2".parse().unwrap(),
        };
        let b = Hop {
            dst: "10.244.3.0/24".parse().unwrap(),
            ..a
        };
        let ra = RemoteHop::new(2, 1500, a.next_hop);
        // The same: nothing.
        let (set, rm) = diff(&[(a.dst, ra)], &[a]);
        assert!(set.is_empty() && rm.is_empty());
        // One added, one gone, one changed next hop.
        let stale: IpNetwork = "10.244.9.0/24".parse().unwrap();
        let moved = Hop {
            next_hop: "192.168.50.22".parse().unwrap(),
            ..a
        };
        let (set, rm) = diff(&[(a.dst, ra), (stale, ra)], &[moved, b]);
        assert_eq!(set.len(), 2);
        assert_eq!(set[0].1.next_hop(), Some(moved.next_hop));
        assert_eq!(rm, vec![stale]);
    }
}
