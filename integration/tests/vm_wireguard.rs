//! `"encryption": "wireguard"`: three node namespaces, each on its own
//! underlay subnet behind a router namespace (so every node-to-node packet
//! crosses the router's forward hook, where nft counters look at it), an
//! agent per node, pods on each. This host's kernel has no wireguard
//! module: scripts/test runs this binary under ../shared/tools/vm-run.

use std::path::{Path, PathBuf};
use std::process::Command;

use rcni_integration::{addr_of, ip};
use rcni_netns::NetNs;
use rcni_testkit::{Call, TestNs, bin, command_in, ping, stdout_of};
use serde_json::{Value, json};

const WG: &str = "rcni-wg";
const WG_PORT: u16 = 51820;

struct WgNode {
    name: String,
    ns: TestNs,
    dir: tempfile::TempDir,
}

impl WgNode {
    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn agent(&self, file: &Path) -> Command {
        let mut c = rcni_testkit::tied_command_in(&self.ns.ns, bin("rcni-node"));
        c.arg("run")
            .arg("--cluster")
            .arg(file)
            .args(["--node", &self.name])
            .arg("--cni-conf-dir")
            .arg(self.dir.path().join("net.d"))
            .arg("--state-dir")
            .arg(self.state())
            .arg("--ipam-data-dir")
            .arg(self.dir.path().join("ipam"))
            .arg("--once");
        c
    }

    fn reconcile(&self, file: &Path) -> String {
        let out = self.agent(file).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{}: {err}", self.name);
        err
    }

    fn public_key(&self) -> String {
        std::fs::read_to_string(self.state().join("wireguard.pub"))
            .unwrap()
            .trim()
            .to_string()
    }

    fn conflist(&self) -> Value {
        let text = std::fs::read(self.dir.path().join("net.d/10-rcni.conflist")).unwrap();
        serde_json::from_slice(&text).unwrap()
    }

    fn pod(&self, cid: &str) -> (TestNs, String) {
        let (pod, r) = self.add_pod(cid);
        let a = addr_of(&r, true);
        (pod, a)
    }

    /// A pod and its bridge result.
    fn add_pod(&self, cid: &str) -> (TestNs, Value) {
        let list = self.conflist();
        let mut c = list["plugins"][0].clone();
        c["cniVersion"] = list["cniVersion"].clone();
        c["name"] = list["name"].clone();
        let pod = TestNs::new();
        let r = Call::new(bin("bridge"), "ADD")
            .env("CNI_CONTAINERID", cid)
            .netns(&pod.path())
            .stdin(&c)
            .run_in(&self.ns.ns)
            .ok();
        (pod, r)
    }

    /// `wg show rcni-wg dump` peer lines: (public key, endpoint, allowed ips).
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

struct WgCluster {
    router: TestNs,
    nodes: Vec<WgNode>,
    file: PathBuf,
    _dir: tempfile::TempDir,
}

impl WgCluster {
    /// Node i on `192.168.<50+10i>.0/24` (its own bridge in the router
    /// namespace, the router `.254`), pods on `10.244.<i+1>.0/24`.
    fn new(n: usize) -> WgCluster {
        let router = TestNs::new();
        ip(&router.ns, "link set lo up");
        rcni_netlink::sysctl::set(&router.ns, "net.ipv4.ip_forward", "1").unwrap();
        let mut nodes = Vec::new();
        for i in 0..n {
            let net = 50 + 10 * i;
            let ns = TestNs::new();
            ip(&router.ns, &format!("link add ul{i} type bridge"));
            ip(
                &router.ns,
                &format!("addr add 192.168.{net}.254/24 dev ul{i}"),
            );
            ip(&router.ns, &format!("link set ul{i} up"));
            let port = format!("u{i}");
            rcni_integration::nl(&router.ns, async |h| {
                h.create_veth(&port, "eth0", Some(&ns.ns), None)
                    .await
                    .unwrap()
            });
            ip(&router.ns, &format!("link set {port} master ul{i} up"));
            ip(&ns.ns, "link set lo up");
            ip(&ns.ns, "link set eth0 up");
            ip(
                &ns.ns,
                &format!("addr add 192.168.{net}.{}/24 dev eth0", i + 1),
            );
            ip(&ns.ns, &format!("route add default via 192.168.{net}.254"));
            nodes.push(WgNode {
                name: format!("n{}", i + 1),
                ns,
                dir: tempfile::tempdir().unwrap(),
            });
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cluster.json");
        WgCluster {
            router,
            nodes,
            file,
            _dir: dir,
        }
    }

    /// The cluster file with nodes `which`, each with its public key when
    /// `keys` says so.
    fn write(&self, which: &[usize], keys: bool) {
        let nodes: Vec<Value> = which
            .iter()
            .map(|&i| {
                let n = &self.nodes[i];
                let mut v = json!({"name": n.name,
                    "address": format!("192.168.{}.{}", 50 + 10 * i, i + 1),
                    "podCIDR": format!("10.244.{}.0/24", i + 1)});
                if keys {
                    v["wireguardPublicKey"] = json!(n.public_key());
                }
                v
            })
            .collect();
        let c = json!({"network": "10.244.0.0/16", "backend": "auto",
                       "encryption": "wireguard", "nodes": nodes});
        std::fs::write(&self.file, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
    }

    /// Counters in the router's forward hook: plain pod packets (pod
    /// addresses visible on the wire) and WireGuard packets.
    fn count_on_wire(&self) {
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
        let path = self._dir.path().join("count.nft");
        std::fs::write(&path, rules).unwrap();
        stdout_of(command_in(&self.router.ns, "nft").arg("-f").arg(&path));
    }

    fn counter(&self, name: &str) -> u64 {
        let out = stdout_of(
            command_in(&self.router.ns, "nft")
                .args(["-j", "list", "counter", "inet", "wgtest", name]),
        );
        let v: Value = serde_json::from_str(&out).unwrap();
        v["nftables"]
            .as_array()
            .unwrap()
            .iter()
            .find_map(|o| o["counter"]["packets"].as_u64())
            .unwrap()
    }
}

fn wg_link(ns: &NetNs) -> Value {
    rcni_integration::ip_link_json(ns, WG)
}

#[test]
fn pods_talk_across_nodes_only_through_wireguard() {
    let c = WgCluster::new(3);
    // First pass without keys: every agent makes its key (0600) and its
    // device, and programs no peer it has no key for.
    c.write(&[0, 1, 2], false);
    for n in &c.nodes {
        // Refused peers make --once exit non-zero, as host-gw's do.
        let out = n.agent(&c.file).output().unwrap();
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(log.contains("no WireGuard public key"), "{log}");
        let key = n.state().join("wireguard.key");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(n.peers().is_empty());
    }
    c.write(&[0, 1, 2], true);
    for n in &c.nodes {
        n.reconcile(&c.file);
    }
    let l = wg_link(&c.nodes[0].ns.ns);
    assert_eq!(l["linkinfo"]["info_kind"], "wireguard", "{l}");
    assert_eq!(l["mtu"], 1440, "uplink 1500 - 60: {l}");
    assert_eq!(c.nodes[0].conflist()["plugins"][0]["mtu"], 1440);
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

    c.count_on_wire();
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
    assert_eq!(c.counter("plain"), 0, "no pod address on the wire");
    assert!(c.counter("wg") > 0, "the pings crossed as WireGuard");

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
    c.write(&[0, 1], true);
    let log = c.nodes[0].reconcile(&c.file);
    assert!(log.contains("gone: wireguard peer"), "{log}");
    let peers = c.nodes[0].peers();
    assert_eq!(peers.len(), 1, "{peers:?}");
    assert_eq!(peers[0].0, c.nodes[1].public_key());
    let routes = c.nodes[0].routes();
    assert!(!routes.contains("10.244.3.0/24"), "{routes}");
    assert!(ping(&pods[0].0.ns, &pods[1].1));
    assert!(!ping(&pods[0].0.ns, &pods[2].1), "n3 is gone");
    assert_eq!(c.counter("plain"), 0, "nothing leaked in the clear");

    // Encryption off: the device goes, VXLAN comes back.
    let mut f: Value = serde_json::from_slice(&std::fs::read(&c.file).unwrap()).unwrap();
    f["encryption"] = json!("none");
    std::fs::write(&c.file, serde_json::to_vec(&f).unwrap()).unwrap();
    c.nodes[0].reconcile(&c.file);
    assert!(!rcni_integration::link_names(&c.nodes[0].ns.ns).contains(&WG.to_string()));
}

fn ping6(from: &NetNs, to: &str) -> bool {
    command_in(from, "ping")
        .args(["-6", "-c", "1", "-W", "2", to])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn dual_stack_pods_talk_over_wireguard() {
    let c = WgCluster::new(2);
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
    c.write(&[0, 1], false);
    for n in &c.nodes {
        let _ = n.agent(&c.file).output().unwrap();
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
    c.count_on_wire();
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
    assert_eq!(c.counter("plain"), 0, "no pod address on the wire");
    assert!(c.counter("wg") > 0);
}
