//! What the kernel should hold, computed from the cluster alone, and the
//! difference to what it holds: pure, so every decision is unit-tested.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};

use ipnetwork::{IpNetwork, Ipv4Network};
use rcni_netlink::MacAddr;
use rcni_netlink::overlay::{FdbEntry, OwnedRoute};
use sha2::{Digest, Sha256};

use crate::cluster::{Backend, Cluster, Node};

/// VXLAN's encapsulation: outer IPv4 (20) + UDP (8) + VXLAN (8) + inner
/// Ethernet (14) bytes, flannel's `MTU - 50`.
pub const VXLAN_OVERHEAD: u32 = 50;

/// The VXLAN device's name. flannel calls it `flannel.<VNI>`; interop is at
/// the packet level (VNI, port, MAC and address scheme), which the name
/// does not take part in, and a name of our own keeps the two agents from
/// fighting over one device on a node that switches.
pub fn vtep_name(vni: u32) -> String {
    format!("rcni.{vni}")
}

/// A node's VTEP MAC, the same on every node that computes it: a cluster
/// file has nobody to publish the MAC a node picked (flannel keeps it in a
/// Node annotation), so it is derived from what every node knows. Locally
/// administered, unicast.
pub fn vtep_mac(node: &str, vni: u32) -> MacAddr {
    let h = Sha256::digest(format!("rcni-vtep\0{vni}\0{node}").as_bytes());
    let mut m = [0u8; 6];
    m.copy_from_slice(&h[..6]);
    m[0] = (m[0] & 0xfc) | 0x02;
    MacAddr(m)
}

/// The VTEP's address: the pod subnet's network address (`.0`), as flannel
/// assigns it (with prefix /32).
pub fn vtep_addr(pod_cidr: Ipv4Network) -> Ipv4Addr {
    pod_cidr.network()
}

/// What the node knows about its uplink.
#[derive(Debug, Clone)]
pub struct Uplink {
    pub index: u32,
    pub mtu: u32,
    /// The uplink's IPv4 prefixes: peers inside one are on-link.
    pub nets: Vec<Ipv4Network>,
}

impl Uplink {
    pub fn on_link(&self, ip: Ipv4Addr) -> bool {
        self.nets.iter().any(|n| n.prefix() < 32 && n.contains(ip))
    }
}

/// The pods' MTU (and the VXLAN device's): VXLAN's overhead comes off when
/// any peer may be reached through it.
pub fn pod_mtu(backend: Backend, uplink_mtu: u32) -> u32 {
    if backend.uses_vxlan() {
        uplink_mtu.saturating_sub(VXLAN_OVERHEAD)
    } else {
        uplink_mtu
    }
}

/// How one peer is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Vxlan,
    HostGw,
}

/// Everything the node programs for one remote node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerEntries {
    pub name: String,
    pub via: Via,
    /// VXLAN: the peer's `.0` -> its VTEP MAC, permanent.
    pub neighbour: Option<(Ipv4Addr, MacAddr)>,
    /// VXLAN: the peer's VTEP MAC -> its underlay address.
    pub fdb: Option<FdbEntry>,
    pub route: OwnedRoute,
}

/// The peers' entries, and the peers refused (with why).
#[derive(Debug, Clone, Default)]
pub struct Peers {
    pub entries: Vec<PeerEntries>,
    pub refused: Vec<String>,
}

/// Entries for every node but `me`. `vtep` is the VXLAN device's index when
/// the backend uses it.
pub fn peers(cluster: &Cluster, me: &Node, uplink: &Uplink, vtep: Option<u32>) -> Peers {
    let mut out = Peers::default();
    for n in cluster.nodes.iter().filter(|n| n.name != me.name) {
        let on_link = uplink.on_link(n.address);
        let via = match cluster.backend {
            Backend::Vxlan => Via::Vxlan,
            Backend::HostGw if on_link => Via::HostGw,
            Backend::HostGw => {
                out.refused.push(format!(
                    "node {:?}: host-gw needs peers on the same L2, and {} is not on-link from this node's uplink ({}); use \"backend\": \"vxlan\" or \"auto\"",
                    n.name,
                    n.address,
                    uplink
                        .nets
                        .iter()
                        .map(|n| n.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
                continue;
            }
            Backend::Auto if on_link => Via::HostGw,
            Backend::Auto => Via::Vxlan,
        };
        let dst = IpNetwork::V4(n.pod_cidr);
        let e = match (via, vtep) {
            (Via::Vxlan, Some(vtep)) => {
                let gw = vtep_addr(n.pod_cidr);
                let mac = vtep_mac(&n.name, cluster.vni);
                PeerEntries {
                    name: n.name.clone(),
                    via,
                    neighbour: Some((gw, mac)),
                    fdb: Some(FdbEntry {
                        mac,
                        dst: Some(IpAddr::V4(n.address)),
                    }),
                    route: OwnedRoute {
                        dst,
                        gateway: Some(IpAddr::V4(gw)),
                        oif: Some(vtep),
                        onlink: true,
                    },
                }
            }
            (Via::Vxlan, None) => {
                out.refused
                    .push(format!("node {:?}: no VXLAN device", n.name));
                continue;
            }
            (Via::HostGw, _) => PeerEntries {
                name: n.name.clone(),
                via,
                neighbour: None,
                fdb: None,
                route: OwnedRoute {
                    dst,
                    gateway: Some(IpAddr::V4(n.address)),
                    oif: Some(uplink.index),
                    onlink: false,
                },
            },
        };
        out.entries.push(e);
    }
    out
}

/// What the kernel holds of ours: permanent neighbours and FDB entries on
/// the VXLAN device, routes with our protocol.
#[derive(Debug, Clone, Default)]
pub struct Actual {
    pub neighbours: Vec<(Ipv4Addr, Option<MacAddr>)>,
    pub fdb: Vec<FdbEntry>,
    pub routes: Vec<OwnedRoute>,
}

/// One kernel change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    SetNeighbour(Ipv4Addr, MacAddr),
    DelNeighbour(Ipv4Addr),
    SetFdb(MacAddr, IpAddr),
    DelFdb(FdbEntry),
    SetRoute(OwnedRoute),
    DelRoute(OwnedRoute),
}

/// The changes for one peer (by name, or by the subnet its stale entries
/// point at), applied together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub peer: String,
    pub ops: Vec<Op>,
}

/// Only the differences, grouped per peer. A peer's entries are made in
/// flannel's order (neighbour, FDB, route: the route is the last piece, so
/// nothing is routed into a half-made path) and removed in the reverse.
pub fn diff(desired: &[PeerEntries], actual: &Actual) -> Vec<Change> {
    let neigh: BTreeMap<Ipv4Addr, Option<MacAddr>> = actual.neighbours.iter().copied().collect();
    let mut fdb_by_mac: BTreeMap<MacAddr, Vec<Option<IpAddr>>> = BTreeMap::new();
    for f in &actual.fdb {
        fdb_by_mac.entry(f.mac).or_default().push(f.dst);
    }
    let routes: BTreeMap<IpNetwork, &OwnedRoute> =
        actual.routes.iter().map(|r| (r.dst, r)).collect();

    let mut out = Vec::new();
    let (mut want_neigh, mut want_mac, mut want_dst) =
        (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
    for p in desired {
        let mut ops = Vec::new();
        if let Some((ip, mac)) = p.neighbour {
            want_neigh.insert(ip);
            if neigh.get(&ip) != Some(&Some(mac)) {
                ops.push(Op::SetNeighbour(ip, mac));
            }
        }
        if let Some(f) = &p.fdb {
            want_mac.insert(f.mac);
            let have = fdb_by_mac.get(&f.mac).map(Vec::as_slice).unwrap_or(&[]);
            if have != [f.dst] {
                // Other remotes of this MAC (the peer's old address) go
                // first; the replace then leaves exactly the wanted one.
                for d in have.iter().filter(|d| **d != f.dst) {
                    ops.push(Op::DelFdb(FdbEntry {
                        mac: f.mac,
                        dst: *d,
                    }));
                }
                if let Some(dst) = f.dst {
                    ops.push(Op::SetFdb(f.mac, dst));
                }
            }
        }
        want_dst.insert(p.route.dst);
        if routes.get(&p.route.dst).copied() != Some(&p.route) {
            ops.push(Op::SetRoute(p.route.clone()));
        }
        if !ops.is_empty() {
            out.push(Change {
                peer: p.name.clone(),
                ops,
            });
        }
    }

    // Stale entries, grouped by the peer subnet's `.0` they belong to:
    // route, then FDB (found through the neighbour's MAC), then neighbour.
    let mut stale: BTreeMap<String, Vec<Op>> = BTreeMap::new();
    let mut mac_owner: BTreeMap<MacAddr, String> = BTreeMap::new();
    for (ip, mac) in &actual.neighbours {
        if let Some(mac) = mac {
            mac_owner.insert(*mac, ip.to_string());
        }
    }
    for r in &actual.routes {
        if !want_dst.contains(&r.dst) {
            stale
                .entry(r.dst.network().to_string())
                .or_default()
                .push(Op::DelRoute(r.clone()));
        }
    }
    for f in &actual.fdb {
        if !want_mac.contains(&f.mac) {
            let key = mac_owner
                .get(&f.mac)
                .cloned()
                .unwrap_or_else(|| f.mac.to_string());
            stale.entry(key).or_default().push(Op::DelFdb(f.clone()));
        }
    }
    for (ip, _) in &actual.neighbours {
        if !want_neigh.contains(ip) {
            stale
                .entry(ip.to_string())
                .or_default()
                .push(Op::DelNeighbour(*ip));
        }
    }
    for (key, ops) in stale {
        out.push(Change {
            peer: format!("gone ({key})"),
            ops,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster;

    fn cluster(backend: &str) -> Cluster {
        cluster::parse(&format!(
            r#"{{"network": "10.244.0.0/16", "backend": "{backend}", "nodes": [
                {{"name": "n1", "address": "192.168.50.1", "podCIDR": "10.244.1.0/24"}},
                {{"name": "n2", "address": "192.168.50.2", "podCIDR": "10.244.2.0/24"}},
                {{"name": "n3", "address": "192.168.60.3", "podCIDR": "10.244.3.0/24"}}]}}"#
        ))
        .unwrap()
    }

    fn uplink() -> Uplink {
        Uplink {
            index: 2,
            mtu: 1500,
            nets: vec!["192.168.50.1/24".parse().unwrap()],
        }
    }

    fn peers_of(backend: &str) -> Peers {
        let c = cluster(backend);
        let me = c.node("n1").unwrap().clone();
        peers(&c, &me, &uplink(), Some(9))
    }

    #[test]
    fn vtep_mac_is_stable_local_unicast_and_per_node() {
        let a = vtep_mac("n1", 1);
        assert_eq!(a, vtep_mac("n1", 1));
        assert!(a.is_local() && !a.is_multicast(), "{a}");
        assert_ne!(a, vtep_mac("n2", 1));
        assert_ne!(a, vtep_mac("n1", 2));
        assert_eq!(vtep_name(1), "rcni.1");
        assert_eq!(pod_mtu(Backend::Vxlan, 1500), 1450);
        assert_eq!(pod_mtu(Backend::Auto, 9000), 8950);
        assert_eq!(pod_mtu(Backend::HostGw, 1500), 1500);
    }

    #[test]
    fn vxlan_peers_follow_flannels_layout() {
        let p = peers_of("vxlan");
        assert!(p.refused.is_empty());
        assert_eq!(p.entries.len(), 2);
        let n2 = &p.entries[0];
        assert_eq!(n2.name, "n2");
        let mac = vtep_mac("n2", 1);
        assert_eq!(n2.neighbour, Some(("10.244.2.0".parse().unwrap(), mac)));
        assert_eq!(
            n2.fdb,
            Some(FdbEntry {
                mac,
                dst: Some("192.168.50.2".parse().unwrap())
            })
        );
        assert_eq!(
            n2.route.to_string(),
            "10.244.2.0/24 via 10.244.2.0 dev 9 onlink"
        );
    }

    #[test]
    fn host_gw_refuses_off_link_peers_and_auto_tunnels_them() {
        let p = peers_of("host-gw");
        assert_eq!(p.entries.len(), 1);
        assert_eq!(
            p.entries[0].route.to_string(),
            "10.244.2.0/24 via 192.168.50.2 dev 2"
        );
        assert_eq!(p.refused.len(), 1);
        assert!(
            p.refused[0].contains("\"n3\"") && p.refused[0].contains("192.168.60.3"),
            "{}",
            p.refused[0]
        );
        let p = peers_of("auto");
        assert!(p.refused.is_empty());
        let via: Vec<_> = p.entries.iter().map(|e| (e.name.as_str(), e.via)).collect();
        assert_eq!(via, [("n2", Via::HostGw), ("n3", Via::Vxlan)]);
    }

    fn actual_of(entries: &[PeerEntries]) -> Actual {
        let mut a = Actual::default();
        for e in entries {
            if let Some((ip, mac)) = e.neighbour {
                a.neighbours.push((ip, Some(mac)));
            }
            a.fdb.extend(e.fdb.clone());
            a.routes.push(e.route.clone());
        }
        a
    }

    #[test]
    fn diff_creates_in_order_and_is_empty_when_done() {
        let p = peers_of("vxlan");
        let changes = diff(&p.entries, &Actual::default());
        assert_eq!(changes.len(), 2);
        let kinds: Vec<&str> = changes[0]
            .ops
            .iter()
            .map(|o| match o {
                Op::SetNeighbour(..) => "neigh",
                Op::SetFdb(..) => "fdb",
                Op::SetRoute(..) => "route",
                _ => "del",
            })
            .collect();
        assert_eq!(kinds, ["neigh", "fdb", "route"]);
        assert!(diff(&p.entries, &actual_of(&p.entries)).is_empty());
    }

    #[test]
    fn diff_touches_only_the_changed_peer() {
        let before = peers_of("vxlan");
        let actual = actual_of(&before.entries);
        // n3 leaves: its route, FDB entry and neighbour go, in that order,
        // as one change; n2 is not touched.
        let changes = diff(&before.entries[..1], &actual);
        assert_eq!(changes.len(), 1, "{changes:?}");
        let n3 = &before.entries[1];
        assert_eq!(
            changes[0].ops,
            [
                Op::DelRoute(n3.route.clone()),
                Op::DelFdb(n3.fdb.clone().unwrap()),
                Op::DelNeighbour(n3.neighbour.unwrap().0),
            ]
        );
        // n2 moves to another underlay address: its FDB entry is replaced
        // and nothing else changes.
        let mut moved = before.entries.clone();
        moved[0].fdb.as_mut().unwrap().dst = Some("192.168.50.22".parse().unwrap());
        let changes = diff(&moved, &actual);
        let mac = vtep_mac("n2", 1);
        assert_eq!(
            changes,
            [Change {
                peer: "n2".into(),
                ops: vec![
                    Op::DelFdb(FdbEntry {
                        mac,
                        dst: Some("192.168.50.2".parse().unwrap())
                    }),
                    Op::SetFdb(mac, "192.168.50.22".parse().unwrap()),
                ]
            }]
        );
    }

    #[test]
    fn diff_switches_a_peer_between_backends() {
        let vx = peers_of("vxlan");
        let auto = peers_of("auto");
        // n2 goes from VXLAN to host-gw: the route is replaced first, then
        // the tunnel's FDB entry and neighbour go.
        let changes = diff(&auto.entries, &actual_of(&vx.entries));
        assert_eq!(changes.len(), 2, "{changes:?}");
        assert_eq!(
            changes[0].ops,
            [Op::SetRoute(auto.entries[0].route.clone())]
        );
        assert_eq!(changes[1].ops.len(), 2);
        assert!(matches!(changes[1].ops[0], Op::DelFdb(_)));
        assert!(matches!(changes[1].ops[1], Op::DelNeighbour(_)));
    }
}
