//! Layer 5: a simulated cluster. Node namespaces joined by an underlay (one
//! L2: a bridge in an underlay namespace; or two subnets behind a router
//! namespace), `rcni-node` run in each node with its cluster file, pods
//! attached with our bridge plugin from the config the agent wrote, and
//! real traffic between pods on different nodes.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::Stdio;

use rcni_integration::cluster_lab::{Cluster, ClusterNode};
use rcni_integration::ip_link_json as link_json;
use rcni_integration::{addr_of, addrs_of, ip, link_names, nl};
use rcni_netlink::NUD_PERMANENT;
use rcni_netns::NetNs;
use rcni_testkit::{Call, TestNs, bin, command_in, ping, stdout_of, tied_command_in};
use serde_json::{Value, json};

/// The agent's route protocol (agent::RTPROT_RCNI).
const RTPROT_RCNI: u8 = 0x52;
const VTEP: &str = "rcni.1";
/// The IPv6 VXLAN device of a dual-stack node.
const VTEP6: &str = "rcni6.1";

/// What the tests ask of a node beyond the lab's basics
/// (rcni_integration::cluster_lab).
trait Probe {
    fn fastpath_json(&self, sub: &str) -> Vec<Value>;
    fn verdict(&self, name: &str) -> u64;
    fn counter(&self, addr: &str, key: &str) -> u64;
    fn remote_map(&self) -> BTreeSet<String>;
    fn net_program_on(&self) -> BTreeSet<String>;
    fn entries(&self) -> (BTreeSet<String>, BTreeSet<String>, BTreeSet<String>);
    fn entries6(&self) -> (BTreeSet<String>, BTreeSet<String>, BTreeSet<String>);
    fn assert_host_gw(&self, v6: bool, routes: &[&str]);
    fn entries_of(
        &self,
        vtep: &str,
        v6: bool,
    ) -> (BTreeSet<String>, BTreeSet<String>, BTreeSet<String>);
}

impl Probe for ClusterNode {
    /// `fastpath <sub> --json` on this node's pin root.
    fn fastpath_json(&self, sub: &str) -> Vec<Value> {
        rcni_integration::fastpath_json(&self.ns.ns, self.bpffs.path(), sub)
    }

    /// A verdict counter of the node's datapath (by its name).
    fn verdict(&self, name: &str) -> u64 {
        self.fastpath_json("stats")
            .iter()
            .map(|n| n["verdicts"][name].as_u64().unwrap_or(0))
            .sum()
    }

    /// A per-address counter (`rxPackets`, `txPackets`).
    fn counter(&self, addr: &str, key: &str) -> u64 {
        self.fastpath_json("list")
            .iter()
            .find(|r| r["address"] == addr)
            .map_or(0, |r| r[key].as_u64().unwrap())
    }

    /// The datapath's other-node map: "subnet via next-hop dev mtu".
    fn remote_map(&self) -> BTreeSet<String> {
        let dir = self.bpffs.path().join("rcni");
        self.ns
            .ns
            .run(move || {
                let Some(dp) = rcni_ebpf::Datapath::open(&dir).unwrap() else {
                    return BTreeSet::new();
                };
                dp.remote_routes()
                    .unwrap()
                    .into_iter()
                    .map(|(net, h)| {
                        let dev = nix::net::if_::if_indextoname(h.ifindex)
                            .map(|n| n.to_string_lossy().into_owned())
                            .unwrap_or_default();
                        format!(
                            "{net} via {} dev {dev} mtu {}",
                            h.next_hop().unwrap(),
                            h.mtu
                        )
                    })
                    .collect()
            })
            .unwrap()
    }

    /// The devices with the agent's program on their tcx ingress, by the
    /// program's name (what the kernel says, not the pins).
    fn net_program_on(&self) -> BTreeSet<String> {
        self.ns
            .ns
            .run(|| {
                let progs: Vec<(u32, String)> = aya::programs::loaded_programs()
                    .filter_map(|p| p.ok())
                    .map(|p| (p.id(), p.name_as_str().unwrap_or("").to_string()))
                    .collect();
                let mut on = BTreeSet::new();
                for l in nix::net::if_::if_nameindex().unwrap().iter() {
                    let name = l.name().to_string_lossy().into_owned();
                    let ids = rcni_ebpf::tcx_programs(&name).unwrap();
                    if progs
                        .iter()
                        .any(|(id, n)| ids.contains(id) && n == "rcni_from_net")
                    {
                        on.insert(name);
                    }
                }
                on
            })
            .unwrap()
    }

    /// (permanent neighbours, FDB entries) on the VTEP and the agent's
    /// routes, as text.
    fn entries(&self) -> (BTreeSet<String>, BTreeSet<String>, BTreeSet<String>) {
        self.entries_of(VTEP, false)
    }

    /// The same for IPv6: the IPv6 VTEP and the agent's IPv6 routes.
    fn entries6(&self) -> (BTreeSet<String>, BTreeSet<String>, BTreeSet<String>) {
        self.entries_of(VTEP6, true)
    }

    /// host-gw for one family: no VTEP and no entries of one, only the
    /// agent's `routes`.
    fn assert_host_gw(&self, v6: bool, routes: &[&str]) {
        let vtep = if v6 { VTEP6 } else { VTEP };
        let (neigh, fdb, got) = self.entries_of(vtep, v6);
        assert!(neigh.is_empty() && fdb.is_empty());
        assert_eq!(got, routes.iter().map(|r| r.to_string()).collect());
        assert!(link_names(&self.ns.ns).iter().all(|l| l != vtep));
    }

    fn entries_of(
        &self,
        vtep: &str,
        v6: bool,
    ) -> (BTreeSet<String>, BTreeSet<String>, BTreeSet<String>) {
        nl(&self.ns.ns, async |n| {
            let routes = n
                .owned_routes(v6, RTPROT_RCNI)
                .await
                .unwrap()
                .iter()
                .map(|r| {
                    format!(
                        "{} via {}{}",
                        r.dst,
                        r.gateway.unwrap(),
                        if r.onlink { " onlink" } else { "" }
                    )
                })
                .collect();
            let Some(v) = n.find_link(vtep).await.unwrap() else {
                return (BTreeSet::new(), BTreeSet::new(), routes);
            };
            let neigh = n
                .neighbours(Some(v.index))
                .await
                .unwrap()
                .into_iter()
                .filter(|x| x.state & NUD_PERMANENT != 0 && x.ip.is_ipv6() == v6)
                .map(|x| format!("{} {}", x.ip, x.mac.unwrap()))
                .collect();
            let fdb = n
                .fdb_entries(v.index)
                .await
                .unwrap()
                .into_iter()
                .map(|f| format!("{} {}", f.mac, f.dst.unwrap()))
                .collect();
            (neigh, fdb, routes)
        })
    }
}

/// A TCP connection from `client` to an echo server in `server` on `addr`:
/// a stream whose life the tests follow across agent runs.
fn echo_stream(client: &NetNs, server: &NetNs, addr: &str) -> std::net::TcpStream {
    let dst = rcni_testkit::tcp_server(server, addr.parse().unwrap(), |mut s| {
        let mut b = [0u8; 64];
        while let Ok(n) = s.read(&mut b) {
            if n == 0 || s.write_all(&b[..n]).is_err() {
                return;
            }
        }
    });
    client
        .run(move || std::net::TcpStream::connect(dst).unwrap())
        .unwrap()
}

/// One round trip on an [`echo_stream`].
fn echo(s: &mut std::net::TcpStream) {
    s.write_all(b"ping").unwrap();
    let mut b = [0u8; 4];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"ping");
}

/// `ping -M do -s <size>` once: (success, output).
fn df_ping(from: &NetNs, to: &str, size: u32) -> (bool, String) {
    let out = command_in(from, "ping")
        .args([
            "-c",
            "1",
            "-W",
            "2",
            "-n",
            "-M",
            "do",
            "-s",
            &size.to_string(),
            to,
        ])
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// The VXLAN device `dev` as flannel makes it (VNI 1, port 8472, learning
/// off) with `mtu`; its `ip -j link` object.
fn flannel_vtep(ns: &NetNs, dev: &str, mtu: u64) -> Value {
    let l = link_json(ns, dev);
    let d = &l["linkinfo"]["info_data"];
    assert_eq!(
        (d["id"].as_u64(), d["port"].as_u64()),
        (Some(1), Some(8472)),
        "{l}"
    );
    assert_eq!(d["learning"], false, "{l}");
    assert_eq!(l["mtu"], mtu, "{l}");
    l
}

/// The source address the router's `addr` sees for a TCP connection from
/// `pod` (a server there writes back its peer's address).
fn source_seen_by_router(c: &Cluster, pod: &NetNs, addr: &str) -> String {
    let seen = rcni_testkit::tcp_server(&c.router.ns, addr.parse().unwrap(), |mut s| {
        let peer = s.peer_addr().unwrap().ip().to_string();
        let _ = s.write_all(peer.as_bytes());
    });
    pod.run(move || {
        let mut s = std::net::TcpStream::connect_timeout(&seen, std::time::Duration::from_secs(5))
            .expect("connect to the router from a pod");
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let mut b = String::new();
        s.read_to_string(&mut b).unwrap();
        b
    })
    .unwrap()
}

#[test]
fn vxlan_on_one_l2_pods_talk_and_changes_touch_only_their_node() {
    let c = Cluster::new(&[0, 0, 0]);
    c.write("vxlan", &[0, 1, 2]);
    c.reconcile_all();
    let (n1, n2, n3) = (&c.nodes[0], &c.nodes[1], &c.nodes[2]);

    // flannel's device: VNI 1, port 8472, learning off, MTU uplink - 50,
    // the pod subnet's .0 as /32, loose rp_filter.
    flannel_vtep(&n1.ns.ns, VTEP, 1450);
    assert_eq!(addrs_of(&n1.ns.ns, VTEP), ["10.244.1.0/32"]);
    // /proc/sys/net shows the reader's namespace.
    let rp =
        stdout_of(command_in(&n1.ns.ns, "cat").arg("/proc/sys/net/ipv4/conf/rcni.1/rp_filter"));
    assert_eq!(rp.trim(), "2");
    let conf = n1.plugin_conf();
    assert_eq!(conf["mtu"], 1450);
    assert_eq!(conf["ipam"]["ranges"][0][0]["subnet"], "10.244.1.0/24");

    // Two peers: a neighbour, an FDB entry and an onlink route each.
    let (neigh, fdb, routes) = n1.entries();
    assert_eq!((neigh.len(), fdb.len()), (2, 2), "{neigh:?} {fdb:?}");
    assert!(
        routes.contains("10.244.2.0/24 via 10.244.2.0 onlink"),
        "{routes:?}"
    );
    assert!(fdb.iter().any(|f| f.ends_with(" 192.168.50.3")), "{fdb:?}");

    let (p1, a1) = n1.pod("p1");
    let (p2, a2) = n2.pod("p2");
    let (p3, a3) = n3.pod("p3");
    for (from, to) in [(&p1, &a2), (&p1, &a3), (&p2, &a3), (&p3, &a1), (&p2, &a1)] {
        assert!(ping(&from.ns, to), "ping {to}");
    }
    // A DF packet of the pod MTU crosses; one byte more is refused with
    // the MTU, not silently lost.
    let (ok, out) = df_ping(&p1.ns, &a2, 1450 - 28);
    assert!(ok, "{out}");
    let (ok, out) = df_ping(&p1.ns, &a2, 1450 - 28 + 1);
    assert!(!ok, "{out}");
    assert!(
        out.contains("mtu=1450") || out.contains("Frag needed"),
        "{out}"
    );

    // Pod traffic leaving the cluster network is masqueraded: the router
    // sees the node's address (unmasqueraded, it could not answer: it has
    // no route back to the pods).
    let peer = source_seen_by_router(&c, &p1.ns, "192.168.50.254");
    assert_eq!(peer, "192.168.50.1");

    // The same file again: nothing changes, nothing is flushed.
    let again = n1.reconcile(&c.file);
    assert!(again.contains(": 0 kernel changes"), "{again}");
    assert!(ping(&p1.ns, &a2));

    // n3 leaves: on n1 exactly its three entries go; n2's stay as they were.
    let before = n1.entries();
    c.write("vxlan", &[0, 1]);
    let out = n1.reconcile(&c.file);
    assert!(out.contains(": 3 kernel changes"), "{out}");
    let after = n1.entries();
    for (b, a) in [
        (&before.0, &after.0),
        (&before.1, &after.1),
        (&before.2, &after.2),
    ] {
        assert_eq!(a.len(), 1, "{after:?}");
        assert!(b.is_superset(a), "{before:?} -> {after:?}");
    }
    assert!(
        !after.2.iter().any(|r| r.starts_with("10.244.3.")),
        "{after:?}"
    );
    assert!(ping(&p1.ns, &a2));

    // n2 moves to another underlay address: no FDB entry keeps the old one.
    ip(&n2.ns.ns, "addr flush dev eth0");
    ip(&n2.ns.ns, "addr add 192.168.50.22/24 dev eth0");
    ip(&n2.ns.ns, "route add default via 192.168.50.254");
    c.write("vxlan", &[0, 1]);
    n1.reconcile(&c.file);
    n2.reconcile(&c.file);
    let (_, fdb, _) = n1.entries();
    assert_eq!(fdb.len(), 1, "{fdb:?}");
    assert!(fdb.iter().all(|f| f.ends_with(" 192.168.50.22")), "{fdb:?}");
    assert!(ping(&p1.ns, &a2), "after n2 moved");
    assert!(ping(&p2.ns, &a1), "after n2 moved");
}

#[test]
fn host_gw_on_one_l2_routes_via_the_node() {
    let c = Cluster::new(&[0, 0, 0]);
    c.write("host-gw", &[0, 1, 2]);
    c.reconcile_all();
    let n1 = &c.nodes[0];
    n1.assert_host_gw(
        false,
        &[
            "10.244.2.0/24 via 192.168.50.2",
            "10.244.3.0/24 via 192.168.50.3",
        ],
    );
    assert_eq!(n1.plugin_conf()["mtu"], 1500);
    let (p1, a1) = n1.pod("p1");
    let (p3, a3) = c.nodes[2].pod("p3");
    assert!(ping(&p1.ns, &a3));
    assert!(ping(&p3.ns, &a1));
    let (ok, out) = df_ping(&p1.ns, &a3, 1500 - 28);
    assert!(ok, "{out}");

    // Switching the cluster to vxlan re-routes every peer through the
    // tunnel and traffic keeps flowing.
    c.write("vxlan", &[0, 1, 2]);
    c.reconcile_all();
    let (neigh, _, routes) = n1.entries();
    assert_eq!(neigh.len(), 2);
    assert!(routes.iter().all(|r| r.ends_with("onlink")), "{routes:?}");
    // The pods keep their MTU of 1500 from before; a full-size DF packet
    // gets an answer telling the MTU instead of vanishing.
    let (ok, out) = df_ping(&p1.ns, &a3, 1500 - 28);
    assert!(
        !ok && (out.contains("Frag needed") || out.contains("mtu")),
        "{out}"
    );
    assert!(ping(&p1.ns, &a3));
}

/// The node's iptables FORWARD rules (`iptables -S FORWARD` and our chain).
fn forward_rules(ns: &NetNs) -> String {
    let mut out = String::new();
    for chain in ["FORWARD", "RCNI-FWD"] {
        let o = command_in(ns, "iptables")
            .args(["-w", "-S", chain])
            .output()
            .unwrap();
        out.push_str(&String::from_utf8_lossy(&o.stdout));
    }
    out
}

#[test]
fn pods_cross_nodes_whose_iptables_forward_drops_as_dockers() {
    let c = Cluster::new(&[0, 0]);
    // n1 as Docker leaves it (policy DROP), n2 with a final REJECT rule.
    let ipt = |ns: &NetNs, args: &str| {
        let o = command_in(ns, "iptables")
            .args(args.split_whitespace())
            .output()
            .unwrap();
        assert!(o.status.success(), "iptables {args}: {o:?}");
    };
    ipt(&c.nodes[0].ns.ns, "-w -N DOCKER-USER");
    ipt(&c.nodes[0].ns.ns, "-w -A FORWARD -j DOCKER-USER");
    ipt(&c.nodes[0].ns.ns, "-w -P FORWARD DROP");
    ipt(&c.nodes[1].ns.ns, "-w -A FORWARD -j REJECT");
    c.write("vxlan", &[0, 1]);
    let log = c.nodes[0].reconcile(&c.file);
    assert!(
        log.contains("forward: iptables accepts 10.244.0.0/16"),
        "{log}"
    );
    c.nodes[1].reconcile(&c.file);
    let (p1, a1) = c.nodes[0].pod("p1");
    let (p2, a2) = c.nodes[1].pod("p2");
    assert!(ping(&p1.ns, &a2), "{}", forward_rules(&c.nodes[0].ns.ns));
    assert!(ping(&p2.ns, &a1), "{}", forward_rules(&c.nodes[1].ns.ns));
    let rules = forward_rules(&c.nodes[1].ns.ns);
    let lines: Vec<&str> = rules.lines().collect();
    let jump = lines.iter().position(|l| l.ends_with("-j RCNI-FWD"));
    let reject = lines.iter().position(|l| l.contains("-j REJECT"));
    assert!(jump.is_some() && jump < reject, "{rules}");
    // A second reconcile changes nothing: one jump, two accepts.
    for n in &c.nodes {
        let log = n.reconcile(&c.file);
        assert!(!log.contains("forward:"), "{log}");
        let rules = forward_rules(&n.ns.ns);
        assert_eq!(rules.matches("-j RCNI-FWD").count(), 1, "{rules}");
        assert_eq!(rules.matches("-A RCNI-FWD").count(), 2, "{rules}");
    }
}

#[test]
fn across_a_router_auto_tunnels_only_the_far_node_and_host_gw_refuses_it() {
    // n1 and n2 on 192.168.50.0/24, n3 on 192.168.60.0/24.
    let c = Cluster::new(&[0, 0, 1]);
    c.write("auto", &[0, 1, 2]);
    c.reconcile_all();
    let n1 = &c.nodes[0];
    let (neigh, fdb, routes) = n1.entries();
    assert_eq!(
        routes,
        BTreeSet::from([
            "10.244.2.0/24 via 192.168.50.2".to_string(),
            "10.244.3.0/24 via 10.244.3.0 onlink".to_string()
        ])
    );
    assert_eq!((neigh.len(), fdb.len()), (1, 1));
    assert!(fdb.iter().all(|f| f.ends_with(" 192.168.60.3")), "{fdb:?}");
    let (p1, a1) = n1.pod("p1");
    let (p2, a2) = c.nodes[1].pod("p2");
    let (p3, a3) = c.nodes[2].pod("p3");
    for (from, to) in [(&p1, &a2), (&p1, &a3), (&p3, &a1), (&p3, &a2), (&p2, &a3)] {
        assert!(ping(&from.ns, to), "ping {to}");
    }

    // host-gw cannot reach n3: the agent says so, naming it, and still
    // programs n2.
    c.write("host-gw", &[0, 1, 2]);
    let (code, err) = n1.run_once(&c.file);
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("\"n3\"") && err.contains("not on-link"),
        "{err}"
    );
    let (neigh, _, routes) = n1.entries();
    assert!(neigh.is_empty());
    assert_eq!(
        routes,
        BTreeSet::from(["10.244.2.0/24 via 192.168.50.2".to_string()])
    );
    c.nodes[1].run_once(&c.file);
    assert!(ping(&p1.ns, &a2));
}

#[test]
fn bad_cluster_files_and_unknown_nodes_are_refused_clearly() {
    let c = Cluster::new(&[0]);
    let n1 = &c.nodes[0];
    let cases: &[(&str, i32, &[&str])] = &[
        (
            r#"{"network": "10.244.0.0/16", "nodes": [{"name": "n2", "address": "192.168.50.2", "podCIDR": "10.244.2.0/24"}]}"#,
            4,
            &["\"n1\" is not in the cluster", "n2"],
        ),
        (
            r#"{"network": "10.244.0.0/16", "nodes": [{"name": "n1", "address": "192.168.50.1", "podCIDR": "10.244.1.0/24"}, {"name": "n2", "address": "192.168.50.2", "podCIDR": "10.244.1.128/25"}]}"#,
            2,
            &["overlapping", "\"n1\"", "\"n2\""],
        ),
        (
            r#"{"network": "10.244.0.0/16", "nodes": [{"name": "n1", "address": "192.168.50.1", "podCIDR": "10.99.1.0/24"}]}"#,
            2,
            &["node \"n1\" (nodes[0])", "outside \"network\""],
        ),
        (
            r#"{"network": "10.244.0.0/16", "nodes": [{"name": "n1", "address": "192.168.50.1", "podCIDR": 7}]}"#,
            2,
            &["node \"n1\" (nodes[0])", "\"podCIDR\""],
        ),
        (
            r#"{"network": "10.244.0.0/16", "ebpf": true, "encryption": "wireguard", "nodes": [{"name": "n1", "address": "192.168.50.1", "podCIDR": "10.244.1.0/24"}]}"#,
            2,
            &["\"ebpf\": true", "\"encryption\": \"wireguard\""],
        ),
        (
            r#"{"network": "10.244.0.0/16", "encryption": "wireguard", "wireguardPort": 0, "nodes": [{"name": "n1", "address": "192.168.50.1", "podCIDR": "10.244.1.0/24"}]}"#,
            2,
            &["\"wireguardPort\": 0 is not in 1..=65535"],
        ),
        (
            r#"{"network": "10.244.0.0/16", "nodes": [{"name": "n1", "address": "192.168.50.9", "podCIDR": "10.244.1.0/24"}]}"#,
            4,
            &["no interface holds its address 192.168.50.9"],
        ),
    ];
    for (text, want, words) in cases {
        std::fs::write(&c.file, text).unwrap();
        let (code, err) = n1.run_once(&c.file);
        assert_eq!(code, *want, "{text}: {err}");
        for w in *words {
            assert!(err.contains(w), "{text}: {w:?} not in {err}");
        }
    }
    // Nothing was programmed and no config written.
    assert!(link_names(&n1.ns.ns).iter().all(|l| l != VTEP));
    assert!(!n1.conf_dir().join("10-rcni.conflist").exists());
}

#[test]
fn the_agent_follows_file_changes_and_sigterm_keeps_the_kernel_state() {
    let c = Cluster::new(&[0, 0, 0]);
    c.write("vxlan", &[0, 1]);
    // n3 is not in the file yet: its agent is not run.
    c.nodes[1].reconcile(&c.file);
    let n1 = &c.nodes[0];
    let mut agent = n1
        .agent(&c.file)
        .args(["--poll-ms", "20"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let wait_for = |what: &str, f: &dyn Fn() -> bool| {
        for _ in 0..500 {
            if f() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        panic!("{what} never happened");
    };
    wait_for("first reconcile", &|| n1.entries().2.len() == 1);
    let (p1, _) = n1.pod("p1");
    let (p2, a2) = c.nodes[1].pod("p2");
    assert!(ping(&p1.ns, &a2));

    // A long-lived connection from a pod on n1 to one on n2.
    let mut stream = echo_stream(&p1.ns, &p2.ns, &a2);
    echo(&mut stream);

    // n3 joins: the running agent picks it up.
    c.write("vxlan", &[0, 1, 2]);
    c.nodes[2].reconcile(&c.file);
    wait_for("n3's entries on n1", &|| n1.entries().2.len() == 2);
    let (p3, a3) = c.nodes[2].pod("p3");
    assert!(ping(&p1.ns, &a3));
    c.nodes[1].reconcile(&c.file);
    assert!(ping(&p3.ns, &a2));

    // SIGTERM: the agent exits and leaves everything programmed; the
    // connection lives on, and an agent started again changes nothing.
    let before = n1.entries();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = agent.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let mut log = String::new();
    agent
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(log.contains("kernel state kept"), "{log}");
    assert_eq!(n1.entries(), before);
    echo(&mut stream);
    let out = n1.reconcile(&c.file);
    assert!(out.contains(": 0 kernel changes"), "{out}");
    echo(&mut stream);
    assert!(ping(&p1.ns, &a3));
}

/// One ping, retried twice: the very first IPv6 echo between freshly made
/// pods is sometimes unanswered (seen in about one run of three, cause not
/// yet pinned down: the node's or pod's neighbour discovery right after
/// the attachment); every later one crosses.
fn ping6(from: &NetNs, to: &str) -> bool {
    (0..3).any(|_| ping(from, to))
}

#[test]
fn dual_stack_pods_talk_over_ipv6_with_vxlan_and_host_gw() {
    let c = Cluster::new(&[0, 0, 0]);
    c.add_ipv6();
    c.write_dual("vxlan", &[0, 1, 2]);
    c.reconcile_all();
    let (n1, n2, n3) = (&c.nodes[0], &c.nodes[1], &c.nodes[2]);

    // A second VXLAN device for IPv6 (flannel's flannel-v6.<VNI>): same
    // VNI and port over the IPv6 underlay, MTU uplink - 70, the IPv6 pod
    // subnet's ::0 as /128; the pods get the smaller MTU of both paths.
    let l = flannel_vtep(&n1.ns.ns, VTEP6, 1430);
    assert!(
        addrs_of(&n1.ns.ns, VTEP6).contains(&"fd00:0:0:1::/128".to_string()),
        "{:?}",
        addrs_of(&n1.ns.ns, VTEP6)
    );
    assert_ne!(l["address"], link_json(&n1.ns.ns, VTEP)["address"]);
    let conf = n1.plugin_conf();
    assert_eq!(conf["mtu"], 1430);
    assert_eq!(conf["ipam"]["ranges"][1][0]["subnet"], "fd00:0:0:1::/64");

    let (neigh, fdb, routes) = n1.entries6();
    assert_eq!((neigh.len(), fdb.len()), (2, 2), "{neigh:?} {fdb:?}");
    assert!(
        routes.contains("fd00:0:0:2::/64 via fd00:0:0:2:: onlink"),
        "{routes:?}"
    );
    assert!(fdb.iter().any(|f| f.ends_with(" fd50::3")), "{fdb:?}");
    // The IPv4 side is as in a single-stack cluster.
    assert_eq!(n1.entries().2.len(), 2);

    let (p1, a1, b1) = n1.pod_dual("p1");
    let (p2, a2, b2) = n2.pod_dual("p2");
    let (p3, _, b3) = n3.pod_dual("p3");
    assert!(b1.starts_with("fd00:0:0:1:"), "{b1}");
    for (from, to) in [(&p1, &b2), (&p1, &b3), (&p2, &b3), (&p3, &b1), (&p2, &b1)] {
        assert!(ping6(&from.ns, to), "ping {to}");
    }
    assert!(ping(&p1.ns, &a2) && ping(&p2.ns, &a1));
    // A DF packet of the pod MTU crosses the IPv6 tunnel.
    let (ok, out) = df_ping(&p1.ns, &b2, 1430 - 48);
    assert!(ok, "{out}");

    // IPv6 pod traffic leaving network6 is masqueraded to the node's
    // address6 (the router has no route back to the pods).
    let peer = source_seen_by_router(&c, &p1.ns, "fd50::fe");
    assert_eq!(peer, "fd50::1");

    let again = n1.reconcile(&c.file);
    assert!(again.contains(": 0 kernel changes"), "{again}");

    // n3 leaves: its IPv6 entries go with its IPv4 ones (3 + 3), n2's stay.
    let before = n1.entries6();
    c.write_dual("vxlan", &[0, 1]);
    let out = n1.reconcile(&c.file);
    assert!(out.contains(": 6 kernel changes"), "{out}");
    let after = n1.entries6();
    for (b, a) in [
        (&before.0, &after.0),
        (&before.1, &after.1),
        (&before.2, &after.2),
    ] {
        assert_eq!(a.len(), 1, "{after:?}");
        assert!(b.is_superset(a), "{before:?} -> {after:?}");
    }
    assert!(ping6(&p1.ns, &b2));

    // host-gw: IPv6 routes via the peers' address6, no IPv6 VTEP.
    c.write_dual("host-gw", &[0, 1, 2]);
    c.reconcile_all();
    n1.assert_host_gw(
        true,
        &["fd00:0:0:2::/64 via fd50::2", "fd00:0:0:3::/64 via fd50::3"],
    );
    assert!(ping6(&p1.ns, &b3));
    assert!(ping6(&p3.ns, &b1));

    // Back to a single-stack file: the IPv6 routes and masquerade go.
    c.write("host-gw", &[0, 1, 2]);
    n1.reconcile(&c.file);
    assert!(n1.entries6().2.is_empty(), "{:?}", n1.entries6());
    assert_eq!(n1.entries().2.len(), 2);
}

/// An agent run in the background; killed (SIGKILL: nothing to clean, the
/// kernel state is the namespace's) when dropped.
struct Agent(std::process::Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A Node object as the kubelet and kube-controller-manager make it: the
/// node's address as InternalIP, its pod subnet in spec.podCIDRs.
fn knode(name: &str, ip: &str, cidr: &str) -> k8s_openapi::api::core::v1::Node {
    use k8s_openapi::api::core::v1::{NodeAddress, NodeSpec, NodeStatus};
    k8s_openapi::api::core::v1::Node {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            pod_cidr: Some(cidr.into()),
            pod_cidrs: Some(vec![cidr.into()]),
            ..Default::default()
        }),
        status: Some(NodeStatus {
            addresses: Some(vec![NodeAddress {
                type_: "InternalIP".into(),
                address: ip.into(),
            }]),
            ..Default::default()
        }),
    }
}

/// The stand-in API server, in the router namespace on the underlay
/// address every node reaches directly, with a kubeconfig for it and a
/// net-conf file.
struct KubeApi {
    api: rcni_fakeapi::FakeApi,
    kubeconfig: PathBuf,
    net_conf: PathBuf,
    _dir: tempfile::TempDir,
}

impl KubeApi {
    fn new(c: &Cluster, net_conf: &str) -> KubeApi {
        let listener = c
            .router
            .ns
            .run(|| std::net::TcpListener::bind("192.168.50.254:0").unwrap())
            .unwrap();
        let api = rcni_fakeapi::FakeApi::start(listener);
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(&kubeconfig, api.kubeconfig()).unwrap();
        let path = dir.path().join("net-conf.json");
        std::fs::write(&path, net_conf).unwrap();
        KubeApi {
            api,
            kubeconfig,
            net_conf: path,
            _dir: dir,
        }
    }
}

/// Polls `f` (bounded: panics with `what` after ~10 s).
fn wait_for(what: &str, f: impl Fn() -> bool) {
    for _ in 0..500 {
        if f() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    panic!("{what} never happened");
}

#[test]
fn every_agent_reads_the_kubernetes_api_instead_of_the_file() {
    use k8s_openapi::api::core::v1::Node as KNode;
    let c = Cluster::new(&[0, 0, 0]);
    let k = KubeApi::new(&c, r#"{"network": "10.244.0.0/16", "backend": "vxlan"}"#);
    let (api, kubeconfig, net_conf) = (&k.api, &k.kubeconfig, &k.net_conf);
    for i in 0..3 {
        api.put(&knode(
            &c.nodes[i].name,
            &c.address(i),
            &format!("10.244.{}.0/24", i + 1),
        ));
    }
    let logs: Vec<PathBuf> = c
        .nodes
        .iter()
        .map(|n| n.dir.path().join("agent.log"))
        .collect();
    let _agents: Vec<Agent> = c
        .nodes
        .iter()
        .zip(&logs)
        .map(|(n, log)| {
            let mut cmd = tied_command_in(&n.ns.ns, bin("rcni-node"));
            cmd.arg("run")
                .arg("--kubernetes")
                .arg("--net-conf")
                .arg(net_conf)
                .arg("--kubeconfig")
                .arg(kubeconfig)
                .arg("--cni-conf-dir")
                .arg(n.conf_dir())
                .arg("--state-dir")
                .arg(n.dir.path().join("state"))
                .arg("--ipam-data-dir")
                .arg(n.dir.path().join("ipam"))
                .args(["--poll-ms", "20"])
                // The node's name the DaemonSet way.
                .env("NODE_NAME", &n.name)
                .stderr(std::fs::File::create(log).unwrap());
            Agent(cmd.spawn().unwrap())
        })
        .collect();
    let log_of = |i: usize| std::fs::read_to_string(&logs[i]).unwrap_or_default();
    for (i, n) in c.nodes.iter().enumerate() {
        wait_for(&format!("{}'s two peers", n.name), || {
            n.entries().2.len() == 2 && n.conf_dir().join("10-rcni.conflist").exists()
        });
        let _ = i;
    }
    let (n1, n2, n3) = (&c.nodes[0], &c.nodes[1], &c.nodes[2]);
    let (neigh, fdb, routes) = n1.entries();
    assert_eq!((neigh.len(), fdb.len()), (2, 2), "{neigh:?} {fdb:?}");
    assert!(
        routes.contains("10.244.3.0/24 via 10.244.3.0 onlink"),
        "{routes:?}"
    );
    assert_eq!(
        n1.plugin_conf()["ipam"]["ranges"][0][0]["subnet"],
        "10.244.1.0/24"
    );

    // Each node published its VTEP's MAC and its address on its Node; the
    // MAC is the device's, and what its peers programmed for it.
    for (i, n) in c.nodes.iter().enumerate() {
        wait_for(&format!("{}'s annotations", n.name), || {
            api.get::<KNode>(None, &n.name)
                .and_then(|k| k.metadata.annotations)
                .is_some_and(|a| a.contains_key("rcni.io/vtep-mac"))
        });
        let a = api
            .get::<KNode>(None, &n.name)
            .unwrap()
            .metadata
            .annotations
            .unwrap();
        let mac = link_json(&n.ns.ns, VTEP)["address"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(a["rcni.io/vtep-mac"], mac, "{}", n.name);
        assert_eq!(a["rcni.io/public-ip"], c.address(i));
        assert_eq!(a["rcni.io/backend"], "vxlan");
        let other = &c.nodes[(i + 1) % 3];
        assert!(
            other
                .entries()
                .1
                .contains(&format!("{mac} {}", c.address(i))),
            "{:?}",
            other.entries()
        );
    }
    assert!(
        api.patches()
            .iter()
            .all(|p| p.content_type == "application/merge-patch+json")
    );

    let (p1, a1) = n1.pod("p1");
    let (p2, a2) = n2.pod("p2");
    let (p3, a3) = n3.pod("p3");
    for (from, to) in [(&p1, &a2), (&p1, &a3), (&p2, &a3), (&p3, &a1), (&p2, &a1)] {
        assert!(ping(&from.ns, to), "ping {to}");
    }

    // The API server goes away: every agent notices, and nothing is
    // removed: traffic keeps flowing on what was programmed.
    let before: Vec<_> = c.nodes.iter().map(|n| n.entries()).collect();
    api.set_down(true);
    api.delete::<KNode>(None, "n2");
    for i in 0..3 {
        let l = log_of(i);
        let seen = l.matches("Kubernetes API:").count();
        wait_for(&format!("n{} sees the API gone", i + 1), || {
            log_of(i).matches("Kubernetes API:").count() > seen
        });
    }
    let after: Vec<_> = c.nodes.iter().map(|n| n.entries()).collect();
    assert_eq!(before, after);
    assert!(ping(&p1.ns, &a2) && ping(&p3.ns, &a1));

    // Back, with its history gone: every agent lists again and learns that
    // n2 was deleted meanwhile; exactly n2's entries go.
    api.compact();
    api.set_down(false);
    for n in [n1, n3] {
        wait_for(&format!("n2's entries gone from {}", n.name), || {
            let (neigh, fdb, routes) = n.entries();
            (neigh.len(), fdb.len(), routes.len()) == (1, 1, 1)
        });
        let (neigh, fdb, routes) = n.entries();
        assert_eq!((neigh.len(), fdb.len()), (1, 1), "{}", n.name);
        assert!(
            !routes.iter().any(|r| r.starts_with("10.244.2.")),
            "{routes:?}"
        );
    }
    assert!(ping(&p1.ns, &a3) && ping(&p3.ns, &a1));

    // n2 comes back at another address (its Node re-registered): the
    // others follow without a stale FDB entry, and pods reach it again.
    // The old address stays on the link: n2's agent's watch connection
    // comes from it (a watch whose source address vanished is only noticed
    // at the watch's idle timeout, minutes later).
    ip(&n2.ns.ns, "addr add 192.168.50.22/24 dev eth0");
    api.put(&knode("n2", "192.168.50.22", "10.244.2.0/24"));
    for n in [n1, n3] {
        wait_for(&format!("n2 back on {}", n.name), || {
            let (neigh, fdb, routes) = n.entries();
            (neigh.len(), fdb.len(), routes.len()) == (2, 2, 2)
                && fdb.iter().any(|f| f.ends_with(" 192.168.50.22"))
        });
        assert!(!n.entries().1.iter().any(|f| f.ends_with(" 192.168.50.2")));
    }
    let republished = || {
        api.get::<KNode>(None, "n2")
            .and_then(|k| k.metadata.annotations)
            .is_some_and(|a| {
                a.get("rcni.io/public-ip").map(String::as_str) == Some("192.168.50.22")
            })
    };
    for _ in 0..500 {
        if republished() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(republished(), "n2 never republished: {}", log_of(1));
    // n2's own agent re-makes its VTEP on the new local address and
    // programs its peers again.
    wait_for("n2's VTEP on its new address", || {
        let l = link_json(&n2.ns.ns, VTEP);
        let (neigh, fdb, routes) = n2.entries();
        l["linkinfo"]["info_data"]["local"] == "192.168.50.22"
            && (neigh.len(), fdb.len(), routes.len()) == (2, 2, 2)
    });
    assert!(ping(&p1.ns, &a2), "after n2 came back: {}", log_of(1));
    assert!(ping(&p2.ns, &a3), "after n2 came back: {}", log_of(1));
}

#[test]
fn kubernetes_once_and_a_node_without_a_pod_subnet() {
    use k8s_openapi::api::core::v1::Node as KNode;
    let c = Cluster::new(&[0, 0]);
    let k = KubeApi::new(&c, r#"{"network": "10.244.0.0/16"}"#);
    let (api, kubeconfig, net_conf) = (&k.api, &k.kubeconfig, &k.net_conf);
    let n1 = &c.nodes[0];
    let once = || {
        let out = command_in(&n1.ns.ns, bin("rcni-node"))
            .args(["run", "--kubernetes", "--once", "--node", "n1"])
            .arg("--net-conf")
            .arg(net_conf)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--cni-conf-dir")
            .arg(n1.conf_dir())
            .arg("--state-dir")
            .arg(n1.dir.path().join("state"))
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // No Node yet, then one without a pod subnet: exit 4, with advice;
    // nothing programmed.
    let (code, err) = once();
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("no Node \"n1\""), "{err}");
    let mut k = knode("n1", &c.address(0), "10.244.1.0/24");
    k.spec = None;
    api.put(&k);
    let (code, err) = once();
    assert_eq!(code, 4, "{err}");
    assert!(
        err.contains("no spec.podCIDRs") && err.contains("--allocate-node-cidrs=true"),
        "{err}"
    );
    assert!(!n1.conf_dir().join("10-rcni.conflist").exists());
    // Assigned: one reconcile, the conflist on its subnet, and the Node
    // annotated.
    api.put(&knode("n1", &c.address(0), "10.244.1.0/24"));
    api.put(&knode("n2", &c.address(1), "10.244.2.0/24"));
    let (code, err) = once();
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        n1.plugin_conf()["ipam"]["ranges"][0][0]["subnet"],
        "10.244.1.0/24"
    );
    assert_eq!(n1.entries().2.len(), 1);
    let a = api
        .get::<KNode>(None, "n1")
        .unwrap()
        .metadata
        .annotations
        .unwrap();
    assert_eq!(a["rcni.io/public-ip"], c.address(0));
    // A net-conf with "nodes" is refused (exit 2), naming the mistake.
    std::fs::write(net_conf, r#"{"network": "10.244.0.0/16", "nodes": []}"#).unwrap();
    let (code, err) = once();
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("\"nodes\" does not belong"), "{err}");
}

/// A Pod object on `node` as the scheduler leaves it: labels, and a
/// container port named `http` (8080).
fn kpod(name: &str, node: &str, app: &str) -> k8s_openapi::api::core::v1::Pod {
    use k8s_openapi::api::core::v1::{Container, ContainerPort, Pod, PodSpec};
    Pod {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            labels: Some([("app".to_string(), app.to_string())].into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            containers: vec![Container {
                name: "c".into(),
                ports: Some(vec![ContainerPort {
                    name: Some("http".into()),
                    container_port: 8080,
                    ..Default::default()
                }]),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: None,
    }
}

/// A NetworkPolicy in `default` for app=web: ingress from the cluster
/// network on `port` (a number or a container port's name). [`kpod`]'s
/// Pods carry no address, so another node's pod is no selector peer: the
/// peer is an ipBlock.
fn knetpol(port: Value) -> k8s_openapi::api::networking::v1::NetworkPolicy {
    serde_json::from_value(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"ipBlock": {"cidr": "10.244.0.0/16"}}],
                              "ports": [{"port": port}]}]}
    }))
    .unwrap()
}

/// A TCP server in `ns` on every address, `port`, writing "ok".
fn listen_ok(ns: &NetNs, port: u16) {
    let l = ns
        .run(move || std::net::TcpListener::bind(("0.0.0.0", port)))
        .unwrap()
        .unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let _ = s.write_all(b"ok");
        }
    });
}

/// Whether a client in `ns` gets "ok" from `addr:port`.
fn talks(ns: &NetNs, addr: &str, port: u16) -> bool {
    let to = std::net::SocketAddr::new(addr.parse().unwrap(), port);
    ns.run(move || {
        let t = std::time::Duration::from_millis(300);
        let Ok(mut s) = std::net::TcpStream::connect_timeout(&to, t) else {
            return false;
        };
        s.set_read_timeout(Some(t)).unwrap();
        let mut buf = [0u8; 2];
        s.read_exact(&mut buf).is_ok() && &buf == b"ok"
    })
    .unwrap()
}

/// The Canal-style node: its conflist's bridge and policy plugins, the
/// policy plugin on a private bpffs (never the host's).
struct PolicyNode<'a> {
    n: &'a ClusterNode,
    fs: rcni_integration::Bpffs,
    /// The policy plugin's backend, when not the conflist's (auto).
    backend: Option<&'static str>,
}

impl PolicyNode<'_> {
    fn plugins(&self) -> (Value, Value) {
        let text = std::fs::read(self.n.conf_dir().join("10-rcni.conflist")).unwrap();
        let list: Value = serde_json::from_slice(&text).unwrap();
        let with = |mut c: Value| {
            c["cniVersion"] = list["cniVersion"].clone();
            c["name"] = list["name"].clone();
            c
        };
        assert_eq!(list["plugins"][1]["type"], "policy", "{list}");
        let mut pol = with(list["plugins"][1].clone());
        pol["pinRoot"] = json!(self.fs.root());
        if let Some(b) = self.backend {
            pol["backend"] = json!(b);
        }
        (with(list["plugins"][0].clone()), pol)
    }

    fn call(
        &self,
        plugin: &str,
        cmd: &str,
        pod: &TestNs,
        cid: &str,
        name: &str,
        conf: &Value,
    ) -> rcni_testkit::Output {
        Call::new(bin(plugin), cmd)
            .env("CNI_CONTAINERID", cid)
            .env(
                "CNI_ARGS",
                &format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name}"),
            )
            .netns(&pod.path())
            .stdin(conf)
            .run_in(&self.n.ns.ns)
    }

    /// bridge then policy, as a runtime runs the chain; on policy's
    /// failure the runtime's DEL of the chain. Ok(address) or Err((code,
    /// message)).
    fn add(&self, pod: &TestNs, cid: &str, name: &str) -> Result<String, (u64, String)> {
        let (br, pol) = self.plugins();
        let r = self.call("bridge", "ADD", pod, cid, name, &br).ok();
        let mut with = pol.clone();
        with["prevResult"] = r.clone();
        let out = self.call("policy", "ADD", pod, cid, name, &with);
        if out.code == 0 {
            return Ok(addr_of(&r, true));
        }
        let e = out.err();
        self.call("policy", "DEL", pod, cid, name, &with).ok();
        let mut brd = br.clone();
        brd["prevResult"] = r;
        self.call("bridge", "DEL", pod, cid, name, &brd).ok();
        Err(e)
    }

    /// The policy plugin's pods (attachment keys) on this node.
    fn policed(&self) -> Vec<String> {
        let out = command_in(&self.n.ns.ns, bin("policy"))
            .args(["show", "--network", "rcni", "--json", "--data-dir"])
            .arg(self.n.dir.path().join("policy-state"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["pods"].as_object().unwrap().keys().cloned().collect()
    }
}

/// Every node of `c` registered in `k`'s API, its Canal-style agent
/// running until its conflist and its two peers are there, and the
/// policy plugin's view of it (`backend`: the plugin's, when not auto).
fn policy_cluster<'a>(
    c: &'a Cluster,
    k: &KubeApi,
    backend: Option<&'static str>,
) -> (Vec<Agent>, Vec<PolicyNode<'a>>) {
    for (i, n) in c.nodes.iter().enumerate() {
        k.api.put(&knode(
            &n.name,
            &c.address(i),
            &format!("10.244.{}.0/24", i + 1),
        ));
    }
    let agents: Vec<Agent> = c.nodes.iter().map(|n| policy_agent(k, n)).collect();
    for n in &c.nodes {
        wait_for(&format!("{}'s conflist and peers", n.name), || {
            n.entries().2.len() == 2 && n.conf_dir().join("10-rcni.conflist").exists()
        });
    }
    let nodes = c
        .nodes
        .iter()
        .map(|n| PolicyNode {
            n,
            fs: rcni_integration::Bpffs::empty(),
            backend,
        })
        .collect();
    (agents, nodes)
}

#[test]
fn network_policies_from_the_api_reach_running_pods_across_nodes() {
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    let c = Cluster::new(&[0, 0, 0]);
    let k = KubeApi::new(&c, r#"{"network": "10.244.0.0/16", "backend": "vxlan"}"#);
    let api = &k.api;
    let (agents, nodes) = policy_cluster(&c, &k, None);
    let agent = |n: &ClusterNode| policy_agent(&k, n);
    let mut agents: Vec<Option<Agent>> = agents.into_iter().map(Some).collect();
    let log = |i: usize| {
        std::fs::read_to_string(c.nodes[i].dir.path().join("agent.log")).unwrap_or_default()
    };

    // The Pods are in the API before their sandboxes, as the kubelet
    // runs them: a client on n1, the web pod on n2.
    api.put(&kpod("client", "n1", "client"));
    api.put(&kpod("web", "n2", "web"));
    let client = TestNs::new();
    let web = TestNs::new();
    nodes[0].add(&client, "c-client", "client").unwrap();
    let web_addr = nodes[1].add(&web, "c-web", "web").unwrap();
    listen_ok(&web.ns, 8080);
    listen_ok(&web.ns, 9090);
    let policed = nodes[1].policed();
    assert_eq!(policed, ["c-web/eth0"]);
    let expect = |what: &str, http: bool, other: bool| {
        wait_for(what, || {
            talks(&client.ns, &web_addr, 8080) == http
                && talks(&client.ns, &web_addr, 9090) == other
        });
    };
    expect("no policy: all open", true, true);

    // Created, with the named port "http": only the web pod's 8080.
    api.put(&knetpol(json!("http")));
    expect("the policy with its named port", true, false);
    // Changed: 9090 by number.
    api.put(&knetpol(json!(9090)));
    expect("the changed policy", false, true);
    // The pod's label changes: no policy selects it any more.
    api.put(&kpod("web", "n2", "api"));
    expect("web relabeled out of the policy", true, true);
    api.put(&kpod("web", "n2", "web"));
    expect("web relabeled back", false, true);
    // Deleted: open again.
    assert!(api.delete::<NetworkPolicy>(Some("default"), "web"));
    expect("the policy deleted", true, true);
    // All of it without a re-add: the same attachment, and syncs did it.
    assert_eq!(nodes[1].policed(), policed);
    assert!(log(1).contains("policy sync: network rcni"), "{}", log(1));

    // n2's agent stops: a new pod is refused with "try again later", and
    // nothing of it stays (no veth, no address, no policy record).
    api.put(&kpod("late", "n2", "web"));
    agents[1] = None;
    let links_before = link_names(&c.nodes[1].ns.ns);
    let late = TestNs::new();
    let (code, msg) = nodes[1].add(&late, "c-late", "late").unwrap_err();
    assert_eq!(code, 11, "{msg}");
    assert!(msg.contains("rcni-node"), "{msg}");
    assert_eq!(link_names(&c.nodes[1].ns.ns), links_before);
    assert_eq!(nodes[1].policed(), policed);
    let ipam_dir = c.nodes[1].dir.path().join("ipam/rcni");
    let leases: Vec<String> = std::fs::read_dir(&ipam_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("10.244."))
        .collect();
    assert_eq!(leases, [web_addr.as_str()], "{ipam_dir:?}");
    // Back: the same pod goes in.
    agents[1] = Some(agent(&c.nodes[1]));
    // Listening, not only there: the killed agent's socket file stays.
    wait_for("n2's agent back", || {
        std::os::unix::net::UnixStream::connect(c.nodes[1].dir.path().join("run/agent.sock"))
            .is_ok()
    });
    let late_addr = nodes[1].add(&late, "c-late", "late");
    assert!(late_addr.is_ok(), "{late_addr:?}");
    drop(agents);
}

/// The Canal-style agent of `n`, reading `k`'s API, with the policy
/// inputs under the node's directory.
fn policy_agent(k: &KubeApi, n: &ClusterNode) -> Agent {
    let bin_dir = bin("policy").parent().unwrap().to_path_buf();
    let mut cmd = tied_command_in(&n.ns.ns, bin("rcni-node"));
    cmd.arg("run")
        .arg("--kubernetes")
        .arg("--net-conf")
        .arg(&k.net_conf)
        .arg("--kubeconfig")
        .arg(&k.kubeconfig)
        .arg("--cni-conf-dir")
        .arg(n.conf_dir())
        .arg("--state-dir")
        .arg(n.dir.path().join("state"))
        .arg("--ipam-data-dir")
        .arg(n.dir.path().join("ipam"))
        .arg("--policy-dir")
        .arg(n.dir.path().join("policy.d"))
        .arg("--agent-socket")
        .arg(n.dir.path().join("run/agent.sock"))
        .arg("--policy-data-dir")
        .arg(n.dir.path().join("policy-state"))
        .arg("--cni-bin-dir")
        .arg(&bin_dir)
        .args(["--poll-ms", "20", "--node", &n.name])
        .stderr(std::fs::File::create(n.dir.path().join("agent.log")).unwrap());
    Agent(cmd.spawn().unwrap())
}

/// [`kpod`] once its sandbox is up: the kubelet has written its address
/// into the status.
fn kpod_at(name: &str, node: &str, app: &str, addr: &str) -> k8s_openapi::api::core::v1::Pod {
    use k8s_openapi::api::core::v1::{PodIP, PodStatus};
    let mut p = kpod(name, node, app);
    p.status = Some(PodStatus {
        phase: Some("Running".into()),
        pod_ip: Some(addr.into()),
        pod_ips: Some(vec![PodIP { ip: addr.into() }]),
        ..Default::default()
    });
    p
}

/// Whether the policy the node enforces names `addr` as a peer (a host
/// prefix of a rule set, eBPF; an element of a set, nftables): read from
/// the kernel, not from the plugin's state.
fn kernel_names(node: &PolicyNode, backend: &str, addr: &str) -> bool {
    let a: std::net::IpAddr = addr.parse().unwrap();
    match backend {
        "ebpf" => rcni_ebpf::Datapath::open(&node.fs.path().join("rcni"))
            .unwrap()
            .is_some_and(|dp| {
                dp.cidrs(None)
                    .unwrap()
                    .iter()
                    .any(|(_, ip, len, _)| *ip == a && *len == 32)
            }),
        _ => {
            let out = command_in(&node.n.ns.ns, "nft")
                .args(["list", "table", "inet", "rcni_policy_rcni"])
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout)
                .split(|c: char| !(c.is_ascii_digit() || c == '.'))
                .any(|w| w == addr)
        }
    }
}

/// Milliseconds from now until `f` holds (polled every millisecond,
/// bounded at 10 s).
fn ms_until(what: &str, f: impl Fn() -> bool) -> f64 {
    let t = std::time::Instant::now();
    while !f() {
        assert!(t.elapsed().as_secs() < 10, "{what} never happened");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    t.elapsed().as_secs_f64() * 1e3
}

fn figure(what: &str, mut v: Vec<f64>) {
    v.sort_by(f64::total_cmp);
    println!(
        "figure: {what}: min {:.0} ms, median {:.0} ms, max {:.0} ms ({} runs)",
        v[0],
        v[v.len() / 2],
        v[v.len() - 1],
        v.len()
    );
}

#[test]
fn pod_selectors_from_the_api_admit_pods_of_other_nodes() {
    pod_selectors_across_nodes(None);
}

#[test]
fn pod_selectors_from_the_api_admit_pods_of_other_nodes_nftables() {
    pod_selectors_across_nodes(Some("nftables"));
}

fn pod_selectors_across_nodes(backend: Option<&'static str>) {
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    let c = Cluster::new(&[0, 0, 0]);
    let k = KubeApi::new(&c, r#"{"network": "10.244.0.0/16", "backend": "vxlan"}"#);
    let api = &k.api;
    let (agents, nodes) = policy_cluster(&c, &k, backend);

    // A client on n1, the web pod on n2, a pod that is no client on n3;
    // once each runs, the kubelet writes its address into the API.
    let (client, web, other) = (TestNs::new(), TestNs::new(), TestNs::new());
    let mut addrs = Vec::new();
    for (i, ns, name, app) in [
        (0, &client, "client", "client"),
        (1, &web, "web", "web"),
        (2, &other, "other", "other"),
    ] {
        let node = &c.nodes[i].name;
        api.put(&kpod(name, node, app));
        let a = nodes[i].add(ns, &format!("c-{name}"), name).unwrap();
        api.put(&kpod_at(name, node, app, &a));
        addrs.push(a);
    }
    let (client_addr, web_addr, other_addr) = (&addrs[0], &addrs[1], &addrs[2]);
    listen_ok(&web.ns, 8080);
    let policed = nodes[1].policed();
    let backend = {
        let out = command_in(&c.nodes[1].ns.ns, bin("policy"))
            .args(["show", "--network", "rcni", "--json", "--data-dir"])
            .arg(c.nodes[1].dir.path().join("policy-state"))
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["backend"].as_str().unwrap().to_string()
    };
    let expect = |what: &str, from_client: bool, from_other: bool| {
        wait_for(what, || {
            talks(&client.ns, web_addr, 8080) == from_client
                && talks(&other.ns, web_addr, 8080) == from_other
        });
    };
    expect("no policy: all open", true, true);

    // Ingress from podSelector app=client: the client on n1 is admitted
    // by its labels, the pod on n3 refused.
    let netpol: NetworkPolicy = serde_json::from_value(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}],
                              "ports": [{"port": 8080}]}]}
    }))
    .unwrap();
    api.put(&netpol);
    expect("the client on n1 admitted, n3's pod refused", true, false);
    assert!(kernel_names(&nodes[1], &backend, client_addr));
    assert!(!kernel_names(&nodes[1], &backend, other_addr));

    // The labels change on the API, the pods stay: n3's pod becomes a
    // client, n1's stops being one.
    api.put(&kpod_at("other", "n3", "client", other_addr));
    api.put(&kpod_at("client", "n1", "former", client_addr));
    expect("relabeled: n3's pod admitted, n1's refused", false, true);
    // Deleted from the API (its sandbox still up): refused too.
    assert!(api.delete::<k8s_openapi::api::core::v1::Pod>(Some("default"), "other"));
    expect("n3's pod gone from the API", false, false);
    api.put(&kpod_at("other", "n3", "client", other_addr));
    expect("n3's pod back", false, true);
    // None of it re-added a pod: the syncs did it.
    assert_eq!(nodes[1].policed(), policed);

    // How long from the API write to the kernel (not a bound: a figure).
    let (mut relabel_in, mut relabel_out, mut np_in, mut np_out) = (vec![], vec![], vec![], vec![]);
    for _ in 0..5 {
        api.put(&kpod_at("client", "n1", "client", client_addr));
        relabel_in.push(ms_until("relabeled in", || {
            kernel_names(&nodes[1], &backend, client_addr)
        }));
        api.put(&kpod_at("client", "n1", "former", client_addr));
        relabel_out.push(ms_until("relabeled out", || {
            !kernel_names(&nodes[1], &backend, client_addr)
        }));
        assert!(api.delete::<NetworkPolicy>(Some("default"), "web"));
        np_out.push(ms_until("policy deleted", || {
            !kernel_names(&nodes[1], &backend, other_addr)
        }));
        api.put(&netpol);
        np_in.push(ms_until("policy created", || {
            kernel_names(&nodes[1], &backend, other_addr)
        }));
    }
    println!("figure: backend {backend}, API write to kernel entry on the web pod's node");
    figure("a remote pod relabeled into the policy", relabel_in);
    figure("a remote pod relabeled out of it", relabel_out);
    figure("the NetworkPolicy deleted", np_out);
    figure("the NetworkPolicy created", np_in);

    // Egress: n1's pod (now app=former) may reach app=web pods only; the
    // web pod on n2 is one, n3's pod is not, until the labels say so.
    assert!(api.delete::<NetworkPolicy>(Some("default"), "web"));
    listen_ok(&other.ns, 8080);
    let egress = |to: &str| -> NetworkPolicy {
        serde_json::from_value(json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "former", "namespace": "default"},
            "spec": {"podSelector": {"matchLabels": {"app": "former"}}, "policyTypes": ["Egress"],
                     "egress": [{"to": [{"podSelector": {"matchLabels": {"app": to}}}],
                                 "ports": [{"port": 8080}]}]}
        }))
        .unwrap()
    };
    let reaches = |what: &str, web_ok: bool, other_ok: bool| {
        wait_for(what, || {
            talks(&client.ns, web_addr, 8080) == web_ok
                && talks(&client.ns, other_addr, 8080) == other_ok
        });
    };
    reaches("no policy: n1's pod reaches both", true, true);
    api.put(&egress("web"));
    reaches("egress to app=web: n2's web pod only", true, false);
    api.put(&kpod_at("web", "n2", "db", web_addr));
    api.put(&kpod_at("other", "n3", "web", other_addr));
    reaches("relabeled: n3's pod only", false, true);
    assert_eq!(nodes[0].policed(), ["c-client/eth0"]);
    drop(agents);
}

// ---- eBPF cross-node forwarding ("ebpf": true) ----

/// A counter in `ns`'s forward hook for pod-to-pod packets (both
/// families), in front of everything: how many the node's forwarding saw.
fn count_forwarded(ns: &NetNs) {
    // Pod to pod only: the pods' neighbour discovery (multicast, which the
    // forward hook also sees) is the link's business on either path.
    let rules = "table inet xnode_test {
        chain podfwd {
            type filter hook forward priority -500; policy accept;
            ip saddr 10.244.0.0/16 ip daddr 10.244.0.0/16 counter
            ip6 saddr fd00::/48 ip6 daddr fd00::/48 counter
        }
    }";
    nft_script(ns, rules);
}

/// Loads an nft script into `ns` (the plugins' own runner, failing with
/// nft's message and the script).
fn nft_script(ns: &NetNs, script: &str) {
    rcni_netfilter::exec::run_ok(ns, "nft", &["-f", "-"], Some(script)).unwrap();
}

fn forwarded(ns: &NetNs) -> u64 {
    let out = stdout_of(command_in(ns, "nft").args([
        "-j",
        "list",
        "chain",
        "inet",
        "xnode_test",
        "podfwd",
    ]));
    let v: Value = serde_json::from_str(&out).unwrap();
    v["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o["rule"]["expr"].as_array())
        .flatten()
        .filter_map(|e| e["counter"]["packets"].as_u64())
        .sum()
}

/// TCP from `from` to a server on `to` (a pod address) that sends 256 KiB:
/// all of it arrives.
fn tcp_bulk(from: &NetNs, to_ns: &NetNs, to: &str) {
    let srv = rcni_testkit::tcp_server(to_ns, to.parse().unwrap(), |mut s| {
        let _ = s.write_all(&vec![7u8; 256 * 1024]);
    });
    let got = from
        .run(move || {
            let mut s =
                std::net::TcpStream::connect_timeout(&srv, std::time::Duration::from_secs(5))
                    .expect("connect across nodes");
            s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
                .unwrap();
            let mut b = Vec::new();
            s.read_to_end(&mut b).unwrap();
            b.len()
        })
        .unwrap();
    assert_eq!(got, 256 * 1024, "TCP to {to}");
}

const TO_REMOTE: &str = "redirected to another node";
const FROM_REMOTE: &str = "redirected from another node";

/// Dual-stack, three nodes on one L2, `"ebpf": true` with `backend`: the
/// agent's program sits on `devs`, the map holds each peer's subnets via
/// `hops` (node 2's), and pod traffic between nodes never reaches the
/// node's forwarding (an nft counter there stays 0) while the datapath's
/// counters rise; a DF ping at the pod MTU crosses, one byte more is
/// refused with the MTU; a second agent run changes nothing; a removed
/// node's entries go; `"ebpf": false` takes it all off and the node's
/// forwarding carries the traffic again.
fn ebpf_forwarding(backend: &str, devs: &[&str], hops: &[&str]) {
    let c = Cluster::new(&[0, 0, 0]);
    c.add_ipv6();
    let on = json!({"ebpf": true});
    c.write_dual_with(backend, &[0, 1, 2], on.clone());
    c.reconcile_all();
    let (n1, n2) = (&c.nodes[0], &c.nodes[1]);

    let list: Value =
        serde_json::from_slice(&std::fs::read(n1.conf_dir().join("10-rcni.conflist")).unwrap())
            .unwrap();
    assert_eq!(list["plugins"][1]["type"], "fastpath", "{list}");
    assert_eq!(
        list["plugins"][1]["pinRoot"],
        n1.bpffs.path().display().to_string()
    );
    let want: BTreeSet<String> = devs.iter().map(|d| d.to_string()).collect();
    assert_eq!(n1.net_program_on(), want);
    let map = n1.remote_map();
    assert_eq!(map.len(), 4, "{map:?}");
    for h in hops {
        assert!(map.contains(*h), "{h} not in {map:?}");
    }
    let mtu = n1.plugin_conf()["mtu"].as_u64().unwrap() as u32;

    let (p1, a1, b1) = n1.pod_dual("p1");
    let (p2, a2, b2) = n2.pod_dual("p2");
    count_forwarded(&n1.ns.ns);
    count_forwarded(&n2.ns.ns);
    for (from, to) in [(&p1, &a2), (&p2, &a1)] {
        assert!(ping(&from.ns, to), "ping {to}");
    }
    for (from, to) in [(&p1, &b2), (&p2, &b1)] {
        assert!(ping6(&from.ns, to), "ping {to}");
    }
    tcp_bulk(&p1.ns, &p2.ns, &a2);
    tcp_bulk(&p2.ns, &p1.ns, &b1);
    let (ok, out) = df_ping(&p1.ns, &a2, mtu - 28);
    assert!(ok, "{out}");
    let (ok, out) = df_ping(&p1.ns, &a2, mtu - 28 + 1);
    assert!(!ok && out.contains(&format!("mtu={mtu}")), "{out}");

    // The fast path carried it, both ways, both families: the node's
    // forwarding saw none of it.
    for n in [n1, n2] {
        assert_eq!(
            forwarded(&n.ns.ns),
            0,
            "{}: {}\n{:?}",
            n.name,
            stdout_of(command_in(&n.ns.ns, "nft").args(["list", "table", "inet", "xnode_test"])),
            n.fastpath_json("stats")
        );
    }
    for (n, a, key) in [
        (n1, &a1, "txPackets"),
        (n1, &b1, "txPackets"),
        (n2, &a2, "rxPackets"),
        (n2, &b2, "rxPackets"),
        (n1, &a1, "rxPackets"),
        (n2, &a2, "txPackets"),
    ] {
        assert!(n.counter(a, key) > 0, "{} {a} {key}", n.name);
    }
    let sent = n1.verdict(TO_REMOTE);
    assert!(sent > 0 && n2.verdict(FROM_REMOTE) > 0);

    // A connection across the nodes lives through an agent's run and
    // SIGTERM, and another agent changes nothing: nothing is flushed, the
    // fast path keeps carrying it.
    let mut stream = echo_stream(&p1.ns, &p2.ns, &a2);
    echo(&mut stream);
    let map = n1.remote_map();
    let mut agent = n1.agent(&c.file).stderr(Stdio::piped()).spawn().unwrap();
    // Its first pass has nothing to do: wait for its report of that.
    let mut err = std::io::BufReader::new(agent.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("kernel changes") {
        line.clear();
        assert!(std::io::BufRead::read_line(&mut err, &mut line).unwrap() > 0);
    }
    assert!(line.contains(": 0 kernel changes"), "{line}");
    echo(&mut stream);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(agent.wait().unwrap().success());
    echo(&mut stream);
    assert_eq!(n1.remote_map(), map);
    assert_eq!(n1.net_program_on(), want);
    let again = n1.reconcile(&c.file);
    assert!(again.contains(": 0 kernel changes"), "{again}");
    echo(&mut stream);
    assert!(ping(&p1.ns, &a2));
    assert!(n1.verdict(TO_REMOTE) > sent);
    assert_eq!(forwarded(&n1.ns.ns), 0);

    // n3 leaves: its subnets leave the map, the rest stays.
    c.write_dual_with(backend, &[0, 1], on);
    let out = n1.reconcile(&c.file);
    let map = n1.remote_map();
    assert_eq!(map.len(), 2, "{map:?}\n{out}");
    assert!(
        map.iter()
            .all(|m| m.starts_with("10.244.2.") || m.starts_with("fd00:0:0:2:"))
    );
    assert!(ping(&p1.ns, &a2));

    // "ebpf": false: no program on the devices, no pinned link, no map
    // entry; the node's forwarding carries the pods' traffic again.
    c.write_dual(backend, &[0, 1]);
    n1.reconcile(&c.file);
    n2.reconcile(&c.file);
    for n in [n1, n2] {
        assert!(n.net_program_on().is_empty(), "{}", n.name);
        assert!(n.remote_map().is_empty(), "{}", n.name);
        let files = n.bpffs.files();
        assert!(!files.iter().any(|f| f.contains("link-net-")), "{files:?}");
    }
    assert!(ping(&p1.ns, &a2));
    assert!(ping6(&p2.ns, &b1));
    assert!(forwarded(&n1.ns.ns) > 0);
    assert!(forwarded(&n2.ns.ns) > 0);
}

#[test]
fn ebpf_host_gw_forwards_pods_past_the_node_stack() {
    ebpf_forwarding(
        "host-gw",
        &["eth0"],
        &[
            "10.244.2.0/24 via 192.168.50.2 dev eth0 mtu 1500",
            "fd00:0:0:2::/64 via fd50::2 dev eth0 mtu 1500",
        ],
    );
}

#[test]
fn ebpf_vxlan_forwards_pods_into_the_tunnel_past_the_node_stack() {
    ebpf_forwarding(
        "vxlan",
        &[VTEP, VTEP6],
        &[
            "10.244.2.0/24 via 10.244.2.0 dev rcni.1 mtu 1450",
            "fd00:0:0:2::/64 via fd00:0:0:2:: dev rcni6.1 mtu 1430",
        ],
    );
}

#[test]
fn ebpf_auto_across_a_router_natively_routes_the_near_node_and_tunnels_the_far_one() {
    // n1 and n2 on 192.168.50.0/24, n3 on 192.168.60.0/24.
    let c = Cluster::new(&[0, 0, 1]);
    c.write_with("auto", &[0, 1, 2], json!({"ebpf": true}));
    c.reconcile_all();
    let (n1, n2, n3) = (&c.nodes[0], &c.nodes[1], &c.nodes[2]);
    assert_eq!(
        n1.remote_map(),
        BTreeSet::from([
            "10.244.2.0/24 via 192.168.50.2 dev eth0 mtu 1500".to_string(),
            "10.244.3.0/24 via 10.244.3.0 dev rcni.1 mtu 1450".to_string(),
        ])
    );
    assert_eq!(
        n1.net_program_on(),
        BTreeSet::from(["eth0".to_string(), VTEP.to_string()])
    );
    assert_eq!(n3.net_program_on(), BTreeSet::from([VTEP.to_string()]));
    let (p1, a1) = n1.pod("p1");
    let (p2, a2) = n2.pod("p2");
    let (p3, a3) = n3.pod("p3");
    for n in [n1, n2, n3] {
        count_forwarded(&n.ns.ns);
    }
    for (from, to) in [(&p1, &a2), (&p2, &a1), (&p1, &a3), (&p3, &a1), (&p3, &a2)] {
        assert!(ping(&from.ns, to), "ping {to}");
    }
    tcp_bulk(&p1.ns, &p3.ns, &a3);
    tcp_bulk(&p3.ns, &p2.ns, &a2);
    for n in [n1, n2, n3] {
        assert_eq!(forwarded(&n.ns.ns), 0, "{}", n.name);
        assert!(
            n.verdict(TO_REMOTE) > 0 && n.verdict(FROM_REMOTE) > 0,
            "{}",
            n.name
        );
    }
    // The pod MTU is the tunnel's (some peers are tunnelled): a DF ping of
    // it crosses to either kind of peer.
    for to in [&a2, &a3] {
        let (ok, out) = df_ping(&p1.ns, to, 1450 - 28);
        assert!(ok, "{out}");
    }

    // The fastpath plugin's GC with no pod left valid on n2 unloads the
    // pods' part, never the agent's program and map: n2 keeps forwarding.
    let gc = json!({"cniVersion": "1.1.0", "name": "rcni", "type": "fastpath",
                    "pinRoot": n2.bpffs.path(), "cni.dev/valid-attachments": []});
    Call::new(bin("fastpath"), "GC")
        .stdin(&gc)
        .run_in(&n2.ns.ns)
        .ok();
    assert_eq!(n2.remote_map().len(), 2);
    assert_eq!(
        n2.net_program_on(),
        BTreeSet::from(["eth0".to_string(), VTEP.to_string()])
    );
    assert!(ping(&p1.ns, &a2));
    assert!(ping(&p3.ns, &a2));
}

#[test]
fn ebpf_cross_node_traffic_meets_the_receivers_network_policy() {
    let c = Cluster::new(&[0, 0, 0]);
    c.write_with("host-gw", &[0, 1, 2], json!({"ebpf": true}));
    c.reconcile_all();
    let (n1, n2, n3) = (&c.nodes[0], &c.nodes[1], &c.nodes[2]);
    // On n2 a pod "web" admitting TCP 80 from n1's pod subnet only (remote
    // pods are known by address: an ipBlock), policy on the network's
    // datapath (the same pins as the agent's map).
    let (web, r) = n2.add_pod("web");
    let w = addr_of(&r, true);
    let pol = json!({"cniVersion": "1.1.0", "name": "rcni", "type": "policy",
        "backend": "ebpf", "pinRoot": n2.bpffs.path(),
        "dataDir": n2.dir.path().join("policy"),
        "policies": [{"kind": "NetworkPolicy", "metadata": {"name": "web"},
            "spec": {"podSelector": {"matchLabels": {"app": "web"}},
                "ingress": [{"from": [{"ipBlock": {"cidr": "10.244.1.0/24"}}],
                             "ports": [{"protocol": "TCP", "port": 80}]}]}}],
        "args": {"cni": {"labels": {"app": "web"}, "namespace": "default"}},
        "prevResult": r});
    Call::new(bin("policy"), "ADD")
        .env("CNI_CONTAINERID", "web")
        .netns(&web.path())
        .stdin(&pol)
        .run_in(&n2.ns.ns)
        .ok();
    listen_ok(&web.ns, 80);
    listen_ok(&web.ns, 81);
    let (p1, _) = n1.pod("p1");
    let (p3, _) = n3.pod("p3");
    count_forwarded(&n2.ns.ns);
    let denied = "dropped: receiver's ingress policy";
    assert!(talks(&p1.ns, &w, 80), "n1's pod, port 80");
    assert!(!talks(&p1.ns, &w, 81), "n1's pod, port 81");
    assert!(!talks(&p3.ns, &w, 80), "n3's pod");
    // Decided by rcni_from_net before its redirect: nothing of it reached
    // n2's forwarding (where the policy's normal-path hook would sit after).
    assert_eq!(forwarded(&n2.ns.ns), 0);
    assert!(n2.verdict(denied) >= 2, "{}", n2.verdict(denied));
    assert!(n2.verdict(FROM_REMOTE) > 0);
    // Replies of the admitted connection went back by the fast path too.
    assert!(n2.verdict(TO_REMOTE) > 0);
}

#[test]
fn ebpf_pods_whose_mtu_exceeds_the_path_are_told_so_and_tcp_adapts() {
    let c = Cluster::new(&[0, 0]);
    let on = json!({"ebpf": true});
    c.write_with("host-gw", &[0, 1], on.clone());
    c.reconcile_all();
    let (n1, n2) = (&c.nodes[0], &c.nodes[1]);
    let (p1, _) = n1.pod("p1");
    let (p2, a2) = n2.pod("p2");
    assert!(ping(&p1.ns, &a2));
    // Switched to vxlan: the pods keep their MTU of 1500, the tunnel's is
    // 1450. A full-size DF packet is too big for the redirect: the normal
    // path answers with the MTU instead of a silent loss.
    c.write_with("vxlan", &[0, 1], on);
    c.reconcile_all();
    assert_eq!(n1.net_program_on(), BTreeSet::from([VTEP.to_string()]));
    let (ok, out) = df_ping(&p1.ns, &a2, 1500 - 28);
    assert!(
        !ok && (out.contains("Frag needed") || out.contains("mtu=1450")),
        "{out}"
    );
    assert!(n1.verdict("passed: over the out device's MTU") > 0);
    // TCP learns the path's MTU from that and then fits the fast path,
    // both ways.
    tcp_bulk(&p1.ns, &p2.ns, &a2);
    let sent = n2.verdict(TO_REMOTE);
    assert!(sent > 0, "{sent}");
    assert!(n1.verdict(FROM_REMOTE) > 0);
}

#[test]
fn ebpf_a_service_address_dnated_to_another_nodes_pod_gets_its_replies_untranslated() {
    let c = Cluster::new(&[0, 0]);
    c.write_with("host-gw", &[0, 1], json!({"ebpf": true}));
    c.reconcile_all();
    let (n1, n2) = (&c.nodes[0], &c.nodes[1]);
    let (p1, _) = n1.pod("p1");
    let (p2, a2) = n2.pod("p2");
    listen_ok(&p2.ns, 80);
    // A service address on n1, as kube-proxy would make it: DNAT to the
    // pod on n2.
    let rules = format!(
        "table ip xnode_svc {{
            chain pre {{
                type nat hook prerouting priority dstnat;
                ip daddr 10.96.0.10 tcp dport 80 dnat to {a2}:80
            }}
        }}"
    );
    nft_script(&n1.ns.ns, &rules);
    // The replies come back from n2 by the fast path, and n1 hands them to
    // its conntrack (which turns the source back into the service address)
    // instead of straight to p1.
    assert!(talks(&p1.ns, "10.96.0.10", 80));
    assert!(n1.verdict("passed: a flow the node's NAT translates") > 0);
    assert!(n2.verdict(TO_REMOTE) > 0);
    // Direct pod-to-pod traffic keeps the fast path both ways.
    let before = n1.verdict(FROM_REMOTE);
    assert!(talks(&p1.ns, &a2, 80));
    assert!(n1.verdict(FROM_REMOTE) > before);
}
