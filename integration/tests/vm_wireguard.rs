//! `"encryption": "wireguard"`: three node namespaces, each on its own
//! underlay subnet behind a router namespace (so every node-to-node packet
//! crosses the router's forward hook, where nft counters look at it), an
//! agent per node, pods on each. This host's kernel has no wireguard
//! module: scripts/test runs this binary under scripts/vm-run.

use std::path::PathBuf;

use rcni_integration::lab::cluster::{Cluster, ClusterNode};
use rcni_integration::lab::traffic::ping6_retried as ping6;
use rcni_integration::{addr_of, ip};
use rcni_netns::NetNs;
use rcni_testkit::{TestNs, command_in, ping, stdout_of};
use serde_json::{Value, json};

const WG: &str = "rcni-wg";
const WG_PORT: u16 = 51820;

/// What the WireGuard tests ask of a lab node.
trait Wg {
    fn state(&self) -> PathBuf;
    fn public_key(&self) -> String;
    /// `wg show rcni-wg dump` peer lines: (public key, endpoint, allowed ips).
    fn peers(&self) -> Vec<(String, String, String)>;
    fn routes(&self) -> String;
}

impl Wg for ClusterNode {
    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn public_key(&self) -> String {
        std::fs::read_to_string(self.state().join("wireguard.pub"))
            .unwrap()
            .trim()
            .to_string()
    }

    fn peers(&self) -> Vec<(String, String, String)> {
        let out = stdout_of(command_in(&self.ns.ns, "wg").args(["show", WG, "dump"]));
        out.lines()
            .skip(1)
            .map(|l| {
                let f: Vec<&str> = l.split('\t').collect();
                (f[0].to_string(), f[2].to_string(), f[3].to_string())
            })
            .collect()
    }

    fn routes(&self) -> String {
        stdout_of(command_in(&self.ns.ns, "ip").args(["route", "show", "proto", "0x52"]))
    }
}

/// Node i alone on `192.168.<50+10i>.0/24` behind the router (so every
/// node-to-node packet crosses the router's forward hook), pods on
/// `10.244.<i+1>.0/24`.
fn wg_cluster(n: usize) -> Cluster {
    Cluster::new(&(0..n).collect::<Vec<_>>())
}

/// The cluster file with nodes `which`, each with its public key when
/// `keys` says so.
fn write_wg(c: &Cluster, which: &[usize], keys: bool) {
    let nodes: Vec<Value> = which
        .iter()
        .map(|&i| {
            let n = &c.nodes[i];
            let mut v = json!({"name": n.name,
                "address": format!("192.168.{}.{}", 50 + 10 * i, i + 1),
                "podCIDR": format!("10.244.{}.0/24", i + 1)});
            if keys {
                v["wireguardPublicKey"] = json!(n.public_key());
            }
            v
        })
        .collect();
    let f = json!({"network": "10.244.0.0/16", "backend": "auto",
                   "encryption": "wireguard", "nodes": nodes});
    std::fs::write(&c.file, serde_json::to_vec_pretty(&f).unwrap()).unwrap();
}

/// Counters in the router's forward hook: plain pod packets (pod
/// addresses visible on the wire) and WireGuard packets.
fn count_on_wire(c: &Cluster) {
    // Named counters are declared before the rules that use them.
    let rules = format!(
        "table inet wgtest {{\n\
         counter plain {{ }}\n\
         counter wg {{ }}\n\
         chain count {{\n\
         type filter hook forward priority 0; policy accept;\n\
         ip saddr 10.244.0.0/16 counter name \"plain\"\n\
         ip6 saddr fd00::/48 counter name \"plain\"\n\
         udp dport {WG_PORT} counter name \"wg\"\n\
         }}\n\
         }}\n"
    );
    let path = c.dir.path().join("count.nft");
    std::fs::write(&path, rules).unwrap();
    stdout_of(command_in(&c.router.ns, "nft").arg("-f").arg(&path));
}

fn counter(c: &Cluster, name: &str) -> u64 {
    let out = stdout_of(
        command_in(&c.router.ns, "nft").args(["-j", "list", "counter", "inet", "wgtest", name]),
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    v["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|o| o["counter"]["packets"].as_u64())
        .unwrap()
}

fn wg_link(ns: &NetNs) -> Value {
    rcni_integration::ip_link_json(ns, WG)
}

#[test]
fn pods_talk_across_nodes_only_through_wireguard() {
    let c = wg_cluster(3);
    // First pass without keys: every agent makes its key (0600) and its
    // device, and programs no peer it has no key for.
    write_wg(&c, &[0, 1, 2], false);
    for n in &c.nodes {
        // Refused peers make --once exit non-zero, as host-gw's do.
        let (_, log) = n.run_once(&c.file);
        assert!(log.contains("no WireGuard public key"), "{log}");
        let key = n.state().join("wireguard.key");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(n.peers().is_empty());
    }
    write_wg(&c, &[0, 1, 2], true);
    for n in &c.nodes {
        n.reconcile(&c.file);
    }
    let l = wg_link(&c.nodes[0].ns.ns);
    assert_eq!(l["linkinfo"]["info_kind"], "wireguard", "{l}");
    assert_eq!(l["mtu"], 1440, "uplink 1500 - 60: {l}");
    assert_eq!(c.nodes[0].plugin_conf()["mtu"], 1440);
    // No VXLAN device with encryption: WireGuard is the tunnel.
    assert!(
        rcni_integration::link_names(&c.nodes[0].ns.ns)
            .iter()
            .all(|n| !n.starts_with("rcni.")),
    );
    let mut peers = c.nodes[0].peers();
    peers.sort();
    let mut want = vec![
        (
            c.nodes[1].public_key(),
            format!("192.168.60.2:{WG_PORT}"),
            "10.244.2.0/24".to_string(),
        ),
        (
            c.nodes[2].public_key(),
            format!("192.168.70.3:{WG_PORT}"),
            "10.244.3.0/24".to_string(),
        ),
    ];
    want.sort();
    assert_eq!(peers, want);
    let routes = c.nodes[0].routes();
    assert!(
        routes.contains("10.244.2.0/24 dev rcni-wg")
            && routes.contains("10.244.3.0/24 dev rcni-wg"),
        "{routes}"
    );

    count_on_wire(&c);
    let pods: Vec<(TestNs, String)> = c
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| n.pod(&format!("p{i}")))
        .collect();
    assert!(ping(&pods[0].0.ns, &pods[1].1), "n1 pod -> n2 pod");
    assert!(ping(&pods[0].0.ns, &pods[2].1), "n1 pod -> n3 pod");
    assert!(ping(&pods[2].0.ns, &pods[1].1), "n3 pod -> n2 pod");
    // The node itself reaches remote pods, from its subnet's `.0` on the
    // device (another source would be outside its allowed-ips at the peer).
    assert!(
        rcni_integration::addrs_of(&c.nodes[0].ns.ns, WG).contains(&"10.244.1.0/32".to_string())
    );
    assert!(ping(&c.nodes[0].ns.ns, &pods[2].1), "n1 itself -> n3 pod");
    assert!(ping(&pods[1].0.ns, "10.244.1.0"), "n2 pod -> n1 itself");
    assert_eq!(counter(&c, "plain"), 0, "no pod address on the wire");
    assert!(counter(&c, "wg") > 0, "the pings crossed as WireGuard");

    // An agent restart: the same key, nothing changed, traffic flows.
    let key_before = std::fs::read(c.nodes[0].state().join("wireguard.key")).unwrap();
    let log = c.nodes[0].reconcile(&c.file);
    assert_eq!(
        std::fs::read(c.nodes[0].state().join("wireguard.key")).unwrap(),
        key_before
    );
    assert!(
        !log.contains("wireguard peer"),
        "restart touched peers: {log}"
    );
    assert!(!log.contains("created"), "{log}");
    assert!(ping(&pods[0].0.ns, &pods[1].1));

    // n3 leaves: its peer and route go on n1, n2's stay.
    write_wg(&c, &[0, 1], true);
    let log = c.nodes[0].reconcile(&c.file);
    assert!(log.contains("gone: wireguard peer"), "{log}");
    let peers = c.nodes[0].peers();
    assert_eq!(peers.len(), 1, "{peers:?}");
    assert_eq!(peers[0].0, c.nodes[1].public_key());
    let routes = c.nodes[0].routes();
    assert!(!routes.contains("10.244.3.0/24"), "{routes}");
    assert!(ping(&pods[0].0.ns, &pods[1].1));
    assert!(!ping(&pods[0].0.ns, &pods[2].1), "n3 is gone");
    assert_eq!(counter(&c, "plain"), 0, "nothing leaked in the clear");

    // Encryption off: the device goes, VXLAN comes back.
    let mut f: Value = serde_json::from_slice(&std::fs::read(&c.file).unwrap()).unwrap();
    f["encryption"] = json!("none");
    std::fs::write(&c.file, serde_json::to_vec(&f).unwrap()).unwrap();
    c.nodes[0].reconcile(&c.file);
    assert!(!rcni_integration::link_names(&c.nodes[0].ns.ns).contains(&WG.to_string()));
}

#[test]
fn dual_stack_pods_talk_over_wireguard() {
    let c = wg_cluster(2);
    // IPv6 on the underlay too (the agent finds each node's `address6`);
    // WireGuard's endpoints stay IPv4, and both families ride inside.
    for (i, n) in c.nodes.iter().enumerate() {
        ip(
            &c.router.ns,
            &format!("addr add fd5{i}::fe/64 dev ul{i} nodad"),
        );
        ip(
            &n.ns.ns,
            &format!("addr add fd5{i}::{}/64 dev eth0 nodad", i + 1),
        );
    }
    let write = || {
        let nodes: Vec<Value> = c
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                json!({"name": n.name,
                    "address": format!("192.168.{}.{}", 50 + 10 * i, i + 1),
                    "address6": format!("fd5{i}::{}", i + 1),
                    "podCIDRs": [format!("10.244.{}.0/24", i + 1),
                                 format!("fd00:0:0:{}::/64", i + 1)],
                    "wireguardPublicKey": n.public_key()})
            })
            .collect();
        let f = json!({"network": "10.244.0.0/16", "network6": "fd00::/48",
                       "backend": "vxlan", "encryption": "wireguard", "nodes": nodes});
        std::fs::write(&c.file, serde_json::to_vec_pretty(&f).unwrap()).unwrap();
    };
    // Keys first (the first pass makes them), then the real file.
    write_wg(&c, &[0, 1], false);
    for n in &c.nodes {
        let _ = n.run_once(&c.file);
    }
    write();
    for n in &c.nodes {
        n.reconcile(&c.file);
    }
    let peers = c.nodes[0].peers();
    assert_eq!(peers.len(), 1, "{peers:?}");
    assert!(
        peers[0].2.contains("10.244.2.0/24") && peers[0].2.contains("fd00:0:0:2::/64"),
        "{peers:?}"
    );
    let addrs = rcni_integration::addrs_of(&c.nodes[0].ns.ns, WG);
    assert!(addrs.contains(&"fd00:0:0:1::/128".to_string()), "{addrs:?}");
    count_on_wire(&c);
    let (p1, r1) = c.nodes[0].add_pod("d1");
    let (p2, r2) = c.nodes[1].add_pod("d2");
    let (a1, a2) = (addr_of(&r1, true), addr_of(&r2, true));
    let (b1, b2) = (addr_of(&r1, false), addr_of(&r2, false));
    assert!(ping(&p1.ns, &a2), "IPv4 pod -> pod");
    assert!(ping6(&p1.ns, &b2), "IPv6 pod -> pod");
    assert!(ping6(&p2.ns, &b1), "IPv6 pod -> pod, back");
    assert!(ping(&p2.ns, &a1));
    assert!(
        ping6(&c.nodes[0].ns.ns, &b2),
        "n1 itself -> n2 pod over IPv6"
    );
    assert_eq!(counter(&c, "plain"), 0, "no pod address on the wire");
    assert!(counter(&c, "wg") > 0);
}

#[test]
fn ipv6_only_pods_talk_over_wireguard_between_ipv6_endpoints() {
    let c = wg_cluster(2);
    // Only IPv6 on the underlay: node i at fd5<i>::<i+1>, the router
    // routing between the two subnets.
    c.make_v6only();
    let write = |keys: bool| {
        let nodes: Vec<Value> = c
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let mut v = json!({"name": n.name,
                    "address": format!("fd5{i}::{}", i + 1),
                    "podCIDR": format!("fd00:0:0:{}::/64", i + 1)});
                if keys {
                    v["wireguardPublicKey"] = json!(n.public_key());
                }
                v
            })
            .collect();
        let f = json!({"network": "fd00::/48", "backend": "vxlan",
                       "encryption": "wireguard", "nodes": nodes});
        std::fs::write(&c.file, serde_json::to_vec_pretty(&f).unwrap()).unwrap();
    };
    // Keys first (the first pass makes them), then the real file.
    write(false);
    for n in &c.nodes {
        let _ = n.run_once(&c.file);
    }
    write(true);
    for n in &c.nodes {
        n.reconcile(&c.file);
    }
    // The peer's endpoint is its IPv6 address; WireGuard over IPv6 costs
    // 80 bytes.
    let peers = c.nodes[0].peers();
    assert_eq!(
        peers,
        [(
            c.nodes[1].public_key(),
            format!("[fd51::2]:{WG_PORT}"),
            "fd00:0:0:2::/64".to_string()
        )]
    );
    let l = wg_link(&c.nodes[0].ns.ns);
    assert_eq!(l["mtu"], 1420, "uplink 1500 - 80: {l}");
    assert_eq!(c.nodes[0].plugin_conf()["mtu"], 1420);
    assert_eq!(
        rcni_integration::addrs_of(&c.nodes[0].ns.ns, WG),
        ["fd00:0:0:1::/128"]
    );
    count_on_wire(&c);
    let (p1, r1) = c.nodes[0].add_pod("s1");
    let (p2, r2) = c.nodes[1].add_pod("s2");
    let (b1, b2) = (addr_of(&r1, false), addr_of(&r2, false));
    assert!(
        rcni_testkit::result_ips(&r1)
            .iter()
            .all(|a| a.contains(':'))
    );
    assert!(ping6(&p1.ns, &b2), "IPv6 pod -> pod");
    assert!(ping6(&p2.ns, &b1), "IPv6 pod -> pod, back");
    assert!(
        ping6(&c.nodes[0].ns.ns, &b2),
        "n1 itself -> n2 pod over IPv6"
    );
    assert_eq!(counter(&c, "plain"), 0, "no pod address on the wire");
    assert!(counter(&c, "wg") > 0);
    let routes = stdout_of(command_in(&c.nodes[0].ns.ns, "ip").args(["-4", "route", "show"]));
    assert!(routes.trim().is_empty(), "{routes}");
}
