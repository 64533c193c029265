//! What the kernel should hold, computed from the cluster alone, and the
//! difference to what it holds: pure, so every decision is unit-tested.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnetwork::{IpNetwork, Ipv4Network, Ipv6Network};
use rcni_netlink::MacAddr;
use rcni_netlink::overlay::{FdbEntry, OwnedRoute};
use sha2::{Digest, Sha256};

use crate::registry::cluster::{Backend, Cluster, Encryption, Node, VxlanMode};
use crate::wg;

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

/// VXLAN over an IPv6 underlay: 40 bytes of IPv6 header instead of 20.
pub const VXLAN6_OVERHEAD: u32 = 70;

/// The IPv6 VXLAN device of a dual-stack node, as flannel's second device
/// `flannel-v6.<VNI>`: IPv6 pod traffic is carried between the nodes'
/// `address6`es (one device per underlay family; a VXLAN device has one
/// local address). "rcni6.16777215" fits IFNAMSIZ.
pub fn vtep_name6(vni: u32) -> String {
    format!("rcni6.{vni}")
}

/// The IPv6 device's MAC: its own, as flannel's v6 VTEP has its own.
pub fn vtep_mac6(node: &str, vni: u32) -> MacAddr {
    vtep_mac(&format!("{node}\0v6"), vni)
}

/// The IPv6 VTEP's address: the IPv6 pod subnet's `::0`, as flannel.
pub fn vtep_addr6(pod_cidr6: Ipv6Network) -> Ipv6Addr {
    pod_cidr6.network()
}

/// WireGuard's encapsulation over an IPv4 underlay: outer IPv4 (20) + UDP
/// (8) + WireGuard header (16) + authentication tag (16).
pub const WIREGUARD_OVERHEAD: u32 = 60;
/// Over an IPv6 underlay (an IPv6-only cluster's endpoints): 40 bytes of
/// IPv6 header instead of 20. A dual-stack cluster's endpoints are its
/// nodes' IPv4 addresses.
pub const WIREGUARD6_OVERHEAD: u32 = 80;

/// The WireGuard device's name.
pub const WG_NAME: &str = "rcni-wg";

/// The pods' MTU with WireGuard: its overhead over the (IPv4) underlay the
/// peers' endpoints are on.
pub fn wg_mtu(uplink_mtu: u32) -> u32 {
    uplink_mtu.saturating_sub(WIREGUARD_OVERHEAD)
}

/// The same over an IPv6 underlay.
pub fn wg_mtu6(uplink_mtu: u32) -> u32 {
    uplink_mtu.saturating_sub(WIREGUARD6_OVERHEAD)
}

/// The peers the WireGuard device should hold: every other node with a
/// published key, at its underlay address (IPv4, or an IPv6-only node's
/// IPv6 one), owning its pod subnets (both families). Peers without a key yet are refused (not reachable until
/// they publish one).
pub fn wg_peers(cluster: &Cluster, me: &Node) -> (Vec<wg::Peer>, Vec<String>) {
    let mut peers = Vec::new();
    let mut refused = Vec::new();
    for n in cluster.nodes.iter().filter(|n| n.name != me.name) {
        let Some(key) = n.wireguard_key else {
            refused.push(format!(
                "node {:?}: no WireGuard public key (\"wireguardPublicKey\" in the cluster file, or its Node annotation) yet",
                n.name
            ));
            continue;
        };
        let mut allowed: Vec<IpNetwork> = n.pod_cidr.map(IpNetwork::V4).into_iter().collect();
        allowed.extend(n.pod_cidr6.map(IpNetwork::V6));
        allowed.sort();
        peers.push(wg::Peer {
            key,
            endpoint: Some(std::net::SocketAddr::new(
                n.underlay(),
                cluster.wireguard_port,
            )),
            allowed,
        });
    }
    (peers, refused)
}

/// What the node knows about its uplink.
#[derive(Debug, Clone)]
pub struct Uplink {
    pub index: u32,
    pub mtu: u32,
    /// The uplink's prefixes (of the family it was found by): peers
    /// inside one are on-link.
    pub nets: Vec<IpNetwork>,
}

impl Uplink {
    pub fn on_link(&self, ip: IpAddr) -> bool {
        self.nets.iter().any(|n| {
            let host = if n.is_ipv4() { 32 } else { 128 };
            n.prefix() < host && n.contains(ip)
        })
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

/// The VXLAN-over-IPv6 device's MTU.
pub fn pod_mtu6(backend: Backend, uplink_mtu: u32) -> u32 {
    if backend.uses_vxlan() {
        uplink_mtu.saturating_sub(VXLAN6_OVERHEAD)
    } else {
        uplink_mtu
    }
}

/// How one peer is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Vxlan,
    HostGw,
    WireGuard,
    /// A route BIRD learned over BGP, mirrored from its kernel table.
    Bgp,
}

/// Everything the node programs for one remote node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerEntries {
    pub name: String,
    pub via: Via,
    /// VXLAN: the peer's `.0` -> its VTEP MAC, permanent.
    pub neighbour: Option<(IpAddr, MacAddr)>,
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

/// One family's view of a peer: where it is on the underlay, its pod
/// subnet, its VTEP's address and MAC.
struct Far {
    address: IpAddr,
    pods: IpNetwork,
    gw: IpAddr,
    mac: MacAddr,
}

fn far(n: &Node, vni: u32, v6: bool) -> Option<Far> {
    if v6 {
        let (a, p) = (n.address6?, n.pod_cidr6?);
        Some(Far {
            address: IpAddr::V6(a),
            pods: IpNetwork::V6(p),
            gw: IpAddr::V6(vtep_addr6(p)),
            mac: n.vtep_mac6.unwrap_or_else(|| vtep_mac6(&n.name, vni)),
        })
    } else {
        // An IPv6-only node has no IPv4 side.
        let (a, p) = (n.address?, n.pod_cidr?);
        Some(Far {
            address: IpAddr::V4(a),
            pods: IpNetwork::V4(p),
            gw: IpAddr::V4(vtep_addr(p)),
            mac: n.vtep_mac.unwrap_or_else(|| vtep_mac(&n.name, vni)),
        })
    }
}

/// Entries for every node but `me`, for one family (`v6`: the peers'
/// IPv6 pod subnets over their `address6`; peers without one are
/// single-stack and get no IPv6 entries). `vtep` is that family's VXLAN
/// device's index when the backend uses it, or, with WireGuard, the
/// WireGuard device's: then every peer with a key is routed into it.
pub fn peers(cluster: &Cluster, me: &Node, uplink: &Uplink, vtep: Option<u32>, v6: bool) -> Peers {
    let mut out = Peers::default();
    for n in cluster.nodes.iter().filter(|n| n.name != me.name) {
        let Some(f) = far(n, cluster.vni, v6) else {
            continue;
        };
        if cluster.encryption == Encryption::WireGuard {
            // A peer without a key has no WireGuard peer entry: no route
            // either, so its pods' traffic is never sent in the clear
            // (`wg_peers` reports it).
            if let (Some(wg), Some(_)) = (vtep, n.wireguard_key) {
                out.entries.push(PeerEntries {
                    name: n.name.clone(),
                    via: Via::WireGuard,
                    neighbour: None,
                    fdb: None,
                    route: OwnedRoute {
                        dst: f.pods,
                        gateway: None,
                        oif: Some(wg),
                        onlink: false,
                    },
                });
            }
            continue;
        }
        let on_link = uplink.on_link(f.address);
        let via = match cluster.backend {
            Backend::Vxlan => Via::Vxlan,
            Backend::HostGw if on_link => Via::HostGw,
            Backend::HostGw => {
                out.refused.push(format!(
                    "node {:?}: host-gw needs peers on the same L2, and {} is not on-link from this node's uplink ({}); use \"backend\": \"vxlan\" or \"auto\"",
                    n.name,
                    f.address,
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
            // The BGP-learned routes reach these (`bgp_entries`).
            Backend::Bgp(VxlanMode::Never) => continue,
            Backend::Bgp(VxlanMode::CrossSubnet) if on_link => continue,
            Backend::Bgp(_) => Via::Vxlan,
        };
        let dst = f.pods;
        let e = match (via, vtep) {
            (Via::Vxlan, Some(vtep)) => {
                let (gw, mac) = (f.gw, f.mac);
                PeerEntries {
                    name: n.name.clone(),
                    via,
                    neighbour: Some((gw, mac)),
                    fdb: Some(FdbEntry {
                        mac,
                        dst: Some(f.address),
                    }),
                    route: OwnedRoute {
                        dst,
                        gateway: Some(gw),
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
            (Via::WireGuard | Via::Bgp, _) => unreachable!("made elsewhere"),
            (Via::HostGw, _) => PeerEntries {
                name: n.name.clone(),
                via,
                neighbour: None,
                fdb: None,
                route: OwnedRoute {
                    dst,
                    gateway: Some(f.address),
                    oif: Some(uplink.index),
                    onlink: false,
                },
            },
        };
        out.entries.push(e);
    }
    out
}

/// The VXLAN peers' own addresses in their pod subnets, the source of a
/// node's own traffic into the tunnel, each with the underlay address it
/// stands for: the VTEP's (`.0`, what IPv4 picks) and the bridge's (`::1`,
/// what IPv6 picks, since the VTEP's `::` is the subnet's anycast address;
/// `.1` alike). Pods never hold either.
pub fn tunnels(entries: &[PeerEntries]) -> Vec<(IpAddr, IpAddr)> {
    let mut out = Vec::new();
    for e in entries.iter().filter(|e| e.via == Via::Vxlan) {
        let (Some((vtep, _)), Some(node)) = (e.neighbour, e.fdb.as_ref().and_then(|f| f.dst))
        else {
            continue;
        };
        let bridge = match e.route.dst {
            IpNetwork::V4(n) => IpAddr::V4(Ipv4Addr::from(u32::from(n.network()).wrapping_add(1))),
            IpNetwork::V6(n) => IpAddr::V6(Ipv6Addr::from(u128::from(n.network()).wrapping_add(1))),
        };
        out.push((vtep, node));
        out.push((bridge, node));
    }
    out
}

/// What the kernel holds of ours: permanent neighbours and FDB entries on
/// the VXLAN device, routes with our protocol.
#[derive(Debug, Clone, Default)]
pub struct Actual {
    pub neighbours: Vec<(IpAddr, Option<MacAddr>)>,
    pub fdb: Vec<FdbEntry>,
    pub routes: Vec<OwnedRoute>,
}

/// One kernel change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    SetNeighbour(IpAddr, MacAddr),
    DelNeighbour(IpAddr),
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
    let neigh: BTreeMap<IpAddr, Option<MacAddr>> = actual.neighbours.iter().copied().collect();
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
        let have = routes.get(&p.route.dst).copied();
        if have != Some(&p.route) {
            // IPv6 refuses to replace a route with an onlink one whose
            // gateway the old route covers on another device (the kernel's
            // onlink check looks the gateway up first: EINVAL), as when a
            // BGP-learned route to a peer becomes its VXLAN route; the old
            // one goes first.
            if let Some(old) = have
                && old.dst.is_ipv6()
                && p.route.onlink
                && old.oif != p.route.oif
            {
                ops.push(Op::DelRoute(old.clone()));
            }
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
    use crate::registry::cluster;

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
        peers(&c, &me, &uplink(), Some(9), false)
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

    #[test]
    fn ipv6_peers_use_address6_and_skip_single_stack_nodes() {
        let c = cluster::parse(
            r#"{"network": "10.244.0.0/16", "network6": "fd00::/48", "backend": "auto", "nodes": [
                {"name": "n1", "address": "192.168.50.1", "address6": "fd50::1", "podCIDRs": ["10.244.1.0/24", "fd00:0:0:1::/64"]},
                {"name": "n2", "address": "192.168.50.2", "address6": "fd50::2", "podCIDRs": ["10.244.2.0/24", "fd00:0:0:2::/64"]},
                {"name": "n3", "address": "192.168.50.3", "address6": "fd60::3", "podCIDRs": ["10.244.3.0/24", "fd00:0:0:3::/64"]},
                {"name": "n4", "address": "192.168.50.4", "podCIDR": "10.244.4.0/24"}]}"#,
        )
        .unwrap();
        let me = c.node("n1").unwrap().clone();
        let up6 = Uplink {
            index: 2,
            mtu: 1500,
            nets: vec![
                "fd50::1/64".parse().unwrap(),
                "fd50::9/128".parse().unwrap(),
            ],
        };
        let p = peers(&c, &me, &up6, Some(7), true);
        assert!(p.refused.is_empty());
        let got: Vec<String> = p.entries.iter().map(|e| e.route.to_string()).collect();
        // n2 on-link over IPv6: host-gw; n3 off-link: the IPv6 VTEP, its
        // ::0 as gateway, its own MAC, FDB to its address6; n4 has no IPv6.
        assert_eq!(
            got,
            [
                "fd00:0:0:2::/64 via fd50::2 dev 2",
                "fd00:0:0:3::/64 via fd00:0:0:3:: dev 7 onlink"
            ]
        );
        let n3 = &p.entries[1];
        assert_eq!(n3.neighbour.unwrap().1, vtep_mac6("n3", 1));
        assert_ne!(vtep_mac6("n3", 1), vtep_mac("n3", 1));
        assert_eq!(
            n3.fdb.as_ref().unwrap().dst,
            Some("fd60::3".parse().unwrap())
        );
        assert_eq!(vtep_name6(16_777_215).len(), 14);
        assert_eq!(pod_mtu6(Backend::Vxlan, 1500), 1430);
    }

    #[test]
    fn ipv6_only_peers_have_only_ipv6_entries_and_ipv6_endpoints() {
        let text = |backend: &str, extra: &str| {
            format!(
                r#"{{"network": "fd00::/48", "backend": "{backend}" {extra}, "nodes": [
                {{"name": "n1", "address": "fd50::1", "podCIDR": "fd00:0:0:1::/64"}},
                {{"name": "n2", "address": "fd50::2", "podCIDR": "fd00:0:0:2::/64", "wireguardPublicKey": "HIgo9xNzJMWLKASShiTqIybxZ0U3wGLiUeJ1PKf8ykw="}},
                {{"name": "n3", "address": "fd60::3", "podCIDR": "fd00:0:0:3::/64"}}]}}"#
            )
        };
        let up6 = Uplink {
            index: 2,
            mtu: 1500,
            nets: vec!["fd50::1/64".parse().unwrap()],
        };
        let c = cluster::parse(&text("vxlan", "")).unwrap();
        let me = c.node("n1").unwrap().clone();
        // No IPv4 side at all.
        let p4 = peers(&c, &me, &up6, Some(9), false);
        assert!(p4.entries.is_empty() && p4.refused.is_empty());
        let p = peers(&c, &me, &up6, Some(7), true);
        let got: Vec<String> = p.entries.iter().map(|e| e.route.to_string()).collect();
        assert_eq!(
            got,
            [
                "fd00:0:0:2::/64 via fd00:0:0:2:: dev 7 onlink",
                "fd00:0:0:3::/64 via fd00:0:0:3:: dev 7 onlink"
            ]
        );
        assert_eq!(p.entries[0].neighbour.unwrap().1, vtep_mac6("n2", 1));
        assert_eq!(
            p.entries[1].fdb.as_ref().unwrap().dst,
            Some("fd60::3".parse().unwrap())
        );
        // host-gw: via the on-link peer's address; the other refused.
        let c = cluster::parse(&text("host-gw", "")).unwrap();
        let p = peers(&c, &me, &up6, None, true);
        assert_eq!(p.entries.len(), 1);
        assert_eq!(
            p.entries[0].route.to_string(),
            "fd00:0:0:2::/64 via fd50::2 dev 2"
        );
        assert!(p.refused[0].contains("fd60::3"), "{:?}", p.refused);
        // WireGuard: the endpoint is the peer's IPv6 address, the allowed
        // IPs its IPv6 subnet alone; 80 bytes of overhead.
        let c = cluster::parse(&text("vxlan", r#", "encryption": "wireguard""#)).unwrap();
        let (w, refused) = wg_peers(&c, &me);
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].endpoint.unwrap().to_string(), "[fd50::2]:51820");
        assert_eq!(
            w[0].allowed,
            vec!["fd00:0:0:2::/64".parse::<IpNetwork>().unwrap()]
        );
        assert_eq!((wg_mtu(1500), wg_mtu6(1500)), (1440, 1420));
        assert!(peers(&c, &me, &up6, Some(5), false).entries.is_empty());
        assert_eq!(peers(&c, &me, &up6, Some(5), true).entries.len(), 1);
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

    #[test]
    fn an_ipv6_route_moving_to_an_onlink_tunnel_route_is_removed_first() {
        let old = OwnedRoute {
            dst: "fd00:0:0:3::/64".parse().unwrap(),
            gateway: Some("fd50::fe".parse().unwrap()),
            oif: Some(2),
            onlink: false,
        };
        let new = OwnedRoute {
            dst: old.dst,
            gateway: Some("fd00:0:0:3::".parse().unwrap()),
            oif: Some(5),
            onlink: true,
        };
        let want = PeerEntries {
            name: "n3".into(),
            via: Via::Vxlan,
            neighbour: None,
            fdb: None,
            route: new.clone(),
        };
        let actual = Actual {
            routes: vec![old.clone()],
            ..Default::default()
        };
        let ops = &diff(std::slice::from_ref(&want), &actual)[0].ops;
        assert_eq!(ops, &vec![Op::DelRoute(old.clone()), Op::SetRoute(new)]);
        // IPv4 replaces in place, as it always did.
        let old4 = OwnedRoute {
            dst: "10.244.3.0/24".parse().unwrap(),
            gateway: Some("192.168.50.254".parse().unwrap()),
            ..old
        };
        let new4 = OwnedRoute {
            dst: old4.dst,
            gateway: Some("10.244.3.0".parse().unwrap()),
            ..want.route.clone()
        };
        let actual = Actual {
            routes: vec![old4],
            ..Default::default()
        };
        let want4 = PeerEntries {
            route: new4.clone(),
            ..want
        };
        assert_eq!(diff(&[want4], &actual)[0].ops, vec![Op::SetRoute(new4)]);
    }
}
