//! Layer 5: a simulated cluster. Node namespaces joined by an underlay (one
//! L2: a bridge in an underlay namespace; or two subnets behind a router
//! namespace), `rcni-node` run in each node with its cluster file, pods
//! attached with our bridge plugin from the config the agent wrote, and
//! real traffic between pods on different nodes.

use std::collections::BTreeSet;
use std::io::Read;
use std::process::Stdio;

use rcni_integration::ip_link_json as link_json;
use rcni_integration::lab::cluster::{Cluster, SETTLE, VTEP, VTEP6};
use rcni_integration::lab::traffic::{df_ping, echo, echo_stream, ping6, source_seen};
use rcni_integration::{addrs_of, ip, link_names};
use rcni_netns::NetNs;
use rcni_testkit::{command_in, ping, stdout_of, wait_for};
use serde_json::Value;

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

#[test]
fn vxlan_on_one_l2_pods_talk_and_changes_touch_only_their_node() {
    let c = Cluster::new(&[0, 0, 0]);
    // Node 1 filters strictly, as RHEL does; the others not at all.
    // /proc/sys/net shows the reader's namespace.
    let sysctl = |ns: &NetNs, key: &str, value: Option<&str>| {
        let path = format!("/proc/sys/net/ipv4/conf/{key}/rp_filter");
        match value {
            Some(v) => stdout_of(command_in(ns, "sh").args(["-c", &format!("echo {v} > {path}")])),
            None => stdout_of(command_in(ns, "cat").arg(&path))
                .trim()
                .to_string(),
        }
    };
    for (node, v) in [(0, "1"), (1, "0"), (2, "0")] {
        for key in ["all", "default"] {
            sysctl(&c.nodes[node].ns.ns, key, Some(v));
        }
    }
    c.write("vxlan", &[0, 1, 2]);
    c.reconcile_all();
    let (n1, n2, n3) = (&c.nodes[0], &c.nodes[1], &c.nodes[2]);

    // flannel's device: VNI 1, port 8472, learning off, MTU uplink - 50,
    // the pod subnet's .0 as /32; rp_filter loose where the host is
    // strict (the kernel applies the larger of all and the device's), and
    // off where the host asked for none.
    flannel_vtep(&n1.ns.ns, VTEP, 1450);
    assert_eq!(addrs_of(&n1.ns.ns, VTEP), ["10.244.1.0/32"]);
    assert_eq!(sysctl(&n1.ns.ns, VTEP, None), "2");
    assert_eq!(sysctl(&n2.ns.ns, VTEP, None), "0");
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
    let peer = source_seen(&c.router.ns, "192.168.50.254", &p1.ns);
    assert_eq!(peer, "192.168.50.1");
    // A node's own connection to another node's pod leaves by the tunnel
    // from its VTEP's 10.244.1.0; the pod sees the node's address, as over
    // host-gw (kube-proxy's masquerade of an ETP=Local NodePort picks the
    // same tunnel address), and the replies return by the tunnel.
    let table = nft_table(&n2.ns.ns);
    assert!(
        table.contains("ip saddr 10.244.1.0 ip daddr 10.244.2.0/24 snat to 192.168.50.1"),
        "{table}"
    );
    assert!(
        table.contains("ip saddr 10.244.1.1 ip daddr 10.244.2.0/24 snat to 192.168.50.1"),
        "{table}"
    );
    assert_eq!(source_seen(&p2.ns, &a2, &n1.ns.ns), "192.168.50.1");
    assert_eq!(source_seen(&p3.ns, &a3, &n1.ns.ns), "192.168.50.1");
    // The node's own pods and other nodes' pods keep their addresses.
    assert_eq!(source_seen(&p2.ns, &a2, &p1.ns), a1);
    assert_eq!(source_seen(&p2.ns, &a2, &n2.ns.ns), "10.244.2.1");

    // The same file again: nothing changes, nothing is flushed.
    let again = n1.reconcile(&c.file);
    assert!(again.contains(": 0 kernel changes"), "{again}");
    assert!(ping(&p1.ns, &a2));

    // n3 leaves: on n1 exactly its three entries go and its tunnel
    // addresses' rules; n2's stay as they were.
    let before = n1.entries();
    c.write("vxlan", &[0, 1]);
    let out = n1.reconcile(&c.file);
    assert!(out.contains(": 4 kernel changes"), "{out}");
    assert!(!nft_table(&n1.ns.ns).contains("10.244.3.0"));
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
/// The agent's nat table, as nft lists it.
fn nft_table(ns: &NetNs) -> String {
    stdout_of(command_in(ns, "nft").args(["list", "table", "ip", "rcni_node"]))
}

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
    // Its routes and its conflist (written after them: a pod's ADD reads
    // it), or the pod below may find no conflist yet under load.
    wait_for(SETTLE, "first reconcile", || {
        n1.entries().2.len() == 1 && n1.conf_dir().join("10-rcni.conflist").exists()
    });
    let (p1, _) = n1.pod("p1");
    let (p2, a2) = c.nodes[1].pod("p2");
    assert!(ping(&p1.ns, &a2));

    // A long-lived connection from a pod on n1 to one on n2.
    let mut stream = echo_stream(&p1.ns, &p2.ns, &a2);
    echo(&mut stream);

    // n3 joins: the running agent picks it up.
    c.write("vxlan", &[0, 1, 2]);
    c.nodes[2].reconcile(&c.file);
    wait_for(SETTLE, "n3's entries on n1", || n1.entries().2.len() == 2);
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
    let peer = source_seen(&c.router.ns, "fd50::fe", &p1.ns);
    assert_eq!(peer, "fd50::1");
    // A node's own connection to another node's pod over the IPv6 tunnel
    // (from its bridge's fd00:0:0:1::1: the VTEP's fd00:0:0:1:: is the
    // subnet's anycast address) shows its address6, as over IPv4.
    assert_eq!(source_seen(&p2.ns, &b2, &n1.ns.ns), "fd50::1");

    let again = n1.reconcile(&c.file);
    assert!(again.contains(": 0 kernel changes"), "{again}");

    // n3 leaves: its IPv6 entries go with its IPv4 ones (3 + 3, and a
    // tunnel address's rule in each family's table), n2's stay.
    let before = n1.entries6();
    c.write_dual("vxlan", &[0, 1]);
    let out = n1.reconcile(&c.file);
    assert!(out.contains(": 8 kernel changes"), "{out}");
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

/// The first IPv6 packet from a pod to another node's new pod crosses at
/// once (one ping, no retry): the destination node's bridge, made by that
/// pod's ADD, gets its IPv6 sysctls before it comes up, so its link-local
/// address is never tentative while the node must solicit the new pod's
/// address for forwarded packets. Before, DAD kept it tentative for a
/// second or two and the first packets waited for the next probe (lost to
/// a one-second ping: about one run in two). Fresh clusters, both
/// backends, three times each.
#[test]
fn the_first_ipv6_packet_to_a_new_nodes_first_pod_crosses() {
    for backend in ["host-gw", "vxlan"] {
        for round in 0..3 {
            let c = Cluster::new(&[0, 0]);
            c.add_ipv6();
            c.write_dual(backend, &[0, 1]);
            c.reconcile_all();
            let (n1, n2) = (&c.nodes[0], &c.nodes[1]);
            let (p1, _, _) = n1.pod_dual("p1");
            let (_p2, _, b2) = n2.pod_dual("p2");
            assert!(
                ping(&p1.ns, &b2),
                "{backend}, round {round}: the first ping to {b2} was lost"
            );
        }
    }
}
