//! BIRD 2's configuration for one node: what it announces (the node's pod
//! subnets, nothing else), whom it peers with (the full mesh and the
//! listed peers), what it accepts (subnets of the pod network only) and
//! where learned routes go (the kernel table the agent mirrors from).

use std::fmt::Write;
use std::net::{IpAddr, Ipv4Addr};

use ipnetwork::IpNetwork;
use sha2::{Digest, Sha256};

use crate::registry::cluster::{Cluster, Node};

/// The kernel table BIRD writes learned routes to; the agent mirrors it
/// into the main table with its own protocol, so nothing else in main is
/// BIRD's and the eBPF map can be fed from the same list.
pub const TABLE: u32 = 252;

/// How long peers keep this node's routes while its BGP speaker restarts
/// (RFC 4724's Restart Time; BIRD's default).
pub const RESTART_TIME_S: u32 = 120;

/// How long a restarted BIRD waits for its sessions before it writes its
/// kernel table again: a peer that never comes back cannot hold stale
/// routes longer than this.
pub const RECOVERY_WAIT_S: u32 = 60;

/// One BGP session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Neighbour {
    /// BIRD's protocol name (`[A-Za-z0-9_]`, unique).
    pub name: String,
    /// For the log: `node "n2"` or `peer`.
    pub what: String,
    pub local: IpAddr,
    pub ip: IpAddr,
    pub local_as: u32,
    pub peer_as: u32,
}

/// Everything the configuration is made from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub router_id: Ipv4Addr,
    pub networks: Vec<IpNetwork>,
    /// The node's own pod subnets: announced, never accepted.
    pub own: Vec<IpNetwork>,
    pub neighbours: Vec<Neighbour>,
    /// Peers that cannot be configured (no local address of their family).
    pub refused: Vec<String>,
}

fn family_addr(n: &Node, v6: bool) -> Option<IpAddr> {
    if v6 {
        n.address6.filter(|_| n.pod_cidr6.is_some()).map(IpAddr::V6)
    } else {
        n.address.filter(|_| n.pod_cidr.is_some()).map(IpAddr::V4)
    }
}

/// The router ID: the node's IPv4 address, or, on a node without one, 32
/// bits of a hash of its name (RFC 6286 only asks for uniqueness in the AS).
pub fn router_id(me: &Node) -> Ipv4Addr {
    if let Some(a) = me.address {
        return a;
    }
    let h = Sha256::digest(me.name.as_bytes());
    Ipv4Addr::new(h[0] | 1, h[1], h[2], h[3])
}

fn proto_name(prefix: &str, s: &str) -> String {
    let mut out = String::from(prefix);
    out.extend(
        s.chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }),
    );
    out
}

/// The sessions of node `me` in `cluster` (which must have a `bgp`).
pub fn plan(cluster: &Cluster, me: &Node) -> Plan {
    let bgp = cluster.bgp.clone().unwrap_or_default();
    let my_as = me.bgp_as.unwrap_or(bgp.as_number);
    let mut networks: Vec<IpNetwork> = cluster.network.map(IpNetwork::V4).into_iter().collect();
    let mut own: Vec<IpNetwork> = me.pod_cidr.map(IpNetwork::V4).into_iter().collect();
    if let Some(n6) = cluster.network6 {
        networks.push(IpNetwork::V6(n6));
    }
    if let Some(p6) = me.pod_cidr6 {
        own.push(IpNetwork::V6(p6));
    }
    let mut neighbours: Vec<Neighbour> = Vec::new();
    let mut refused = Vec::new();
    if bgp.mesh {
        for n in cluster.nodes.iter().filter(|n| n.name != me.name) {
            for v6 in [false, true] {
                let (Some(local), Some(ip)) = (family_addr(me, v6), family_addr(n, v6)) else {
                    continue;
                };
                neighbours.push(Neighbour {
                    name: proto_name(if v6 { "node6_" } else { "node_" }, &n.name),
                    what: format!("node {:?}", n.name),
                    local,
                    ip,
                    local_as: my_as,
                    peer_as: n.bgp_as.unwrap_or(bgp.as_number),
                });
            }
        }
    }
    for p in bgp.peers.iter().chain(&me.bgp_peers) {
        if neighbours.iter().any(|n| n.ip == p.ip) {
            continue;
        }
        let local = match p.ip {
            IpAddr::V4(_) => me.address.map(IpAddr::V4),
            IpAddr::V6(_) => me.address6.map(IpAddr::V6),
        };
        let Some(local) = local else {
            let key = if p.ip.is_ipv6() {
                "address6"
            } else {
                "address"
            };
            refused.push(format!(
                "BGP peer {} (AS {}): node {:?} has no {} address (\"{key}\") to speak from",
                p.ip,
                p.as_number,
                me.name,
                super::family(p.ip)
            ));
            continue;
        };
        neighbours.push(Neighbour {
            name: proto_name("peer_", &p.ip.to_string()),
            what: "peer".into(),
            local,
            ip: p.ip,
            local_as: my_as,
            peer_as: p.as_number,
        });
    }
    Plan {
        router_id: router_id(me),
        networks,
        own,
        neighbours,
        refused,
    }
}

fn set(nets: &[IpNetwork], v6: bool, within: bool) -> String {
    let items: Vec<String> = nets
        .iter()
        .filter(|n| n.is_ipv6() == v6)
        .map(|n| {
            if within {
                let max = if v6 { 128 } else { 32 };
                format!("{n}{{{},{max}}}", n.prefix())
            } else {
                n.to_string()
            }
        })
        .collect();
    items.join(", ")
}

/// BIRD 2's configuration text.
pub fn render(p: &Plan) -> String {
    let mut c = String::new();
    let _ = writeln!(
        c,
        "# Written by rcni-node on every change of the cluster: edits are lost.\n\
         log stderr {{ info, remote, warning, error, auth, fatal, bug }};\n\
         router id {};\n\
         graceful restart wait {RECOVERY_WAIT_S};\n\
         protocol device {{ scan time 10; }}",
        p.router_id
    );
    // Connected routes resolve the peers' next hops; those inside the pod
    // network (the pods' bridge holds the node's subnet) stay out: a
    // connected route is preferred to the static one, and would take the
    // announcement's place.
    let direct = |v6: bool| {
        let net = set(&p.networks, v6, true);
        if net.is_empty() {
            "import all".to_string()
        } else {
            format!("import where !(net ~ [ {net} ])")
        }
    };
    let _ = writeln!(
        c,
        "protocol direct {{\n  ipv4 {{ {}; }};\n  ipv6 {{ {}; }};\n}}",
        direct(false),
        direct(true)
    );
    for v6 in [false, true] {
        let (fam, tag) = if v6 { ("ipv6", "6") } else { ("ipv4", "4") };
        let net = set(&p.networks, v6, true);
        let own = set(&p.own, v6, false);
        let _ = writeln!(c);
        if !own.is_empty() {
            let _ = writeln!(
                c,
                "protocol static rcni_pods{tag} {{\n  {fam};\n{}}}",
                p.own
                    .iter()
                    .filter(|n| n.is_ipv6() == v6)
                    .map(|n| format!("  route {n} blackhole;\n"))
                    .collect::<String>()
            );
        }
        // A prefix outside the pod network (a default route, the
        // underlay's subnets) is never installed, whoever announces it.
        let net_test = if net.is_empty() {
            "false".to_string()
        } else {
            format!("net ~ [ {net} ]")
        };
        let own_test = if own.is_empty() {
            "false".to_string()
        } else {
            format!("net ~ [ {own} ]")
        };
        let outside = p
            .networks
            .iter()
            .filter(|n| n.is_ipv6() == v6)
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(
            c,
            "filter rcni_import{tag} {{\n  \
               if {own_test} then reject;\n  \
               if {net_test} then accept;\n  \
               print \"rcni: rejected \", net, \" from \", from, \": outside the pod network {}\";\n  \
               reject;\n\
             }}\n\
             filter rcni_export{tag} {{\n  \
               if source = RTS_STATIC && {own_test} then accept;\n  \
               reject;\n\
             }}\n\
             protocol kernel rcni_kernel{tag} {{\n  \
               {fam} {{ import none; export filter {{ if source = RTS_BGP then accept; reject; }}; }};\n  \
               kernel table {TABLE};\n  \
               graceful restart;\n\
             }}",
            if outside.is_empty() {
                "(none)".to_string()
            } else {
                outside
            }
        );
    }
    for n in &p.neighbours {
        let (fam, tag) = if n.ip.is_ipv6() {
            ("ipv6", "6")
        } else {
            ("ipv4", "4")
        };
        let _ = writeln!(
            c,
            "\nprotocol bgp {} {{\n  \
               description \"{}\";\n  \
               local {} as {};\n  \
               neighbor {} as {};\n  \
               graceful restart on;\n  \
               graceful restart time {RESTART_TIME_S};\n  \
               connect delay time 0;\n  \
               connect retry time 5;\n  \
               error wait time 1, 30;\n  \
               {fam} {{ import filter rcni_import{tag}; export filter rcni_export{tag}; }};\n\
             }}",
            n.name,
            n.what.replace('"', "'"),
            n.local,
            n.local_as,
            n.ip,
            n.peer_as
        );
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::cluster;

    fn cluster(extra: &str) -> Cluster {
        cluster::parse(&format!(
            r#"{{"network": "10.244.0.0/16", "network6": "fd00::/48", "backend": "bgp", {extra}
                "nodes": [
                {{"name": "n1", "address": "192.168.50.1", "address6": "fd50::1",
                  "podCIDRs": ["10.244.1.0/24", "fd00:0:0:1::/64"]}},
                {{"name": "n2", "address": "192.168.50.2", "podCIDR": "10.244.2.0/24", "asNumber": 65002}},
                {{"name": "n.3", "address": "192.168.60.3", "podCIDR": "10.244.3.0/24",
                  "peers": [{{"peerIP": "192.168.60.254", "asNumber": 65001}}]}}]}}"#
        ))
        .unwrap()
    }

    #[test]
    fn the_mesh_peers_every_other_node_in_each_family_they_share() {
        let c = cluster("");
        let p = plan(&c, c.node("n1").unwrap());
        let got: Vec<(String, String, u32, u32)> = p
            .neighbours
            .iter()
            .map(|n| (n.name.clone(), n.ip.to_string(), n.local_as, n.peer_as))
            .collect();
        assert_eq!(
            got,
            vec![
                ("node_n2".into(), "192.168.50.2".into(), 64512, 65002),
                ("node_n_3".into(), "192.168.60.3".into(), 64512, 64512),
            ]
        );
        assert_eq!(p.router_id, Ipv4Addr::new(192, 168, 50, 1));
        assert_eq!(p.own.len(), 2);
    }

    #[test]
    fn without_the_mesh_only_the_listed_peers() {
        let c = cluster(
            r#""bgp": {"nodeToNodeMeshEnabled": false, "asNumber": 65100,
                       "peers": [{"peerIP": "fd50::fe", "asNumber": 65001}]},"#,
        );
        let p = plan(&c, c.node("n.3").unwrap());
        let got: Vec<String> = p.neighbours.iter().map(|n| n.ip.to_string()).collect();
        // n.3 has no IPv6 address: the global IPv6 peer is refused, its
        // own peer kept.
        assert_eq!(got, vec!["192.168.60.254"]);
        assert_eq!(p.neighbours[0].local_as, 65100);
        assert_eq!(p.refused.len(), 1, "{:?}", p.refused);
        let p1 = plan(&c, c.node("n1").unwrap());
        assert_eq!(p1.neighbours[0].name, "peer_fd50__fe");
        assert_eq!(p1.neighbours[0].local.to_string(), "fd50::1");
    }

    #[test]
    fn the_configuration_announces_only_own_subnets_and_accepts_only_the_network() {
        let c = cluster("");
        let text = render(&plan(&c, c.node("n1").unwrap()));
        for want in [
            "router id 192.168.50.1;",
            "route 10.244.1.0/24 blackhole;",
            "route fd00:0:0:1::/64 blackhole;",
            "if net ~ [ 10.244.0.0/16{16,32} ] then accept;",
            "if net ~ [ fd00::/48{48,128} ] then accept;",
            "if net ~ [ 10.244.1.0/24 ] then reject;",
            "kernel table 252;",
            "ipv4 { import where !(net ~ [ 10.244.0.0/16{16,32} ]); };",
            "neighbor 192.168.50.2 as 65002;",
            "graceful restart on;",
        ] {
            assert!(text.contains(want), "{want:?} missing in:\n{text}");
        }
        // n1 and n2 share no IPv6: no IPv6 session.
        assert!(!text.contains("node6_"), "{text}");
    }

    #[test]
    fn a_node_without_ipv4_gets_a_stable_router_id_from_its_name() {
        let c = cluster("");
        let mut me = c.node("n1").unwrap().clone();
        me.address = None;
        let a = router_id(&me);
        assert_eq!(a, router_id(&me));
        assert!(!a.is_unspecified());
        me.name = "n9".into();
        assert_ne!(a, router_id(&me));
    }

    #[test]
    fn an_ipv6_only_node_speaks_over_ipv6_and_announces_its_ipv6_subnet() {
        let c = cluster::parse(
            r#"{"network": "fd00::/48", "backend": "bgp", "nodes": [
                {"name": "n1", "address": "fd50::1", "podCIDR": "fd00:0:0:1::/64"},
                {"name": "n2", "address": "fd50::2", "podCIDR": "fd00:0:0:2::/64"}]}"#,
        )
        .unwrap();
        let p = plan(&c, c.node("n1").unwrap());
        let got: Vec<(String, String)> = p
            .neighbours
            .iter()
            .map(|n| (n.local.to_string(), n.ip.to_string()))
            .collect();
        assert_eq!(got, vec![("fd50::1".to_string(), "fd50::2".to_string())]);
        let text = render(&p);
        assert!(text.contains("route fd00:0:0:1::/64 blackhole;"), "{text}");
        assert!(!text.contains("protocol static rcni_pods4"), "{text}");
        assert!(
            text.contains("ipv6 { import filter rcni_import6;"),
            "{text}"
        );
    }
}
