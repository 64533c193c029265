//! Layer 5: IPv6-only clusters. The lab's nodes keep only IPv6 on their
//! underlay (`Cluster::make_v6only`), the cluster file has an IPv6
//! `"network"` alone and IPv6 `"address"`es (`Cluster::write_v6only`), and
//! pods get only IPv6 addresses: pods talk across nodes with each backend,
//! and the agent writes nothing of IPv4 (no VTEP, route, masquerade table,
//! conflist range or address).

use std::collections::BTreeSet;

use rcni_integration::lab::cluster::{Cluster, ClusterNode, SETTLE, VTEP, VTEP6};
use rcni_integration::lab::kube::{Agent, KubeApi, knode};
use rcni_integration::lab::traffic::{df_ping, echo, echo_stream, ping6, source_seen};
use rcni_integration::{addrs_of, ip_link_json, link_names};
use rcni_netns::NetNs;
use rcni_testkit::{command_in, stdout_of, wait_for};
use serde_json::json;

fn nft_tables(ns: &NetNs) -> String {
    stdout_of(command_in(ns, "nft").args(["list", "tables"]))
}

/// Nothing of IPv4 on the node but loopback: no address on any other link
/// (the bridge, the VTEPs, the uplink), no IPv4 route, no route or
/// masquerade of the agent's for IPv4.
fn assert_no_ipv4(n: &ClusterNode) {
    for l in link_names(&n.ns.ns).iter().filter(|l| *l != "lo") {
        let a = addrs_of(&n.ns.ns, l);
        assert!(a.iter().all(|a| a.contains(':')), "{} {l}: {a:?}", n.name);
    }
    let routes = stdout_of(command_in(&n.ns.ns, "ip").args(["-4", "route", "show"]));
    assert!(routes.trim().is_empty(), "{}: {routes}", n.name);
    assert!(n.entries().2.is_empty(), "{}", n.name);
    assert!(!link_names(&n.ns.ns).contains(&VTEP.to_string()));
    let tables = nft_tables(&n.ns.ns);
    assert!(!tables.contains("table ip rcni_node"), "{tables}");
}

#[test]
fn vxlan_over_ipv6_carries_ipv6_only_pods_and_writes_nothing_ipv4() {
    let c = Cluster::new(&[0, 0, 0]);
    c.make_v6only();
    c.write_v6only("vxlan", &[0, 1, 2]);
    c.reconcile_all();
    let (n1, n2, n3) = (&c.nodes[0], &c.nodes[1], &c.nodes[2]);

    // One VXLAN device, the IPv6 one (flannel's flannel-v6.<VNI>): VNI 1,
    // port 8472, learning off, over fd50::1, MTU uplink - 70, the pod
    // subnet's ::0 as /128.
    let l = ip_link_json(&n1.ns.ns, VTEP6);
    let d = &l["linkinfo"]["info_data"];
    assert_eq!(
        (d["id"].as_u64(), d["port"].as_u64()),
        (Some(1), Some(8472))
    );
    assert_eq!(d["learning"], false, "{l}");
    // iproute2 names an IPv6 local address "local6" in JSON.
    assert!(d["local6"] == "fd50::1" || d["local"] == "fd50::1", "{l}");
    assert_eq!(l["mtu"], 1430, "{l}");
    assert_eq!(addrs_of(&n1.ns.ns, VTEP6), ["fd00:0:0:1::/128"]);
    // host-local gets the IPv6 subnet alone, the bridge the IPv6 MTU.
    let conf = n1.plugin_conf();
    assert_eq!(conf["mtu"], 1430, "{conf}");
    assert_eq!(
        conf["ipam"]["ranges"],
        json!([[{"subnet": "fd00:0:0:1::/64"}]]),
        "{conf}"
    );

    let (neigh, fdb, routes) = n1.entries6();
    assert_eq!((neigh.len(), fdb.len()), (2, 2), "{neigh:?} {fdb:?}");
    assert_eq!(
        routes,
        BTreeSet::from([
            "fd00:0:0:2::/64 via fd00:0:0:2:: onlink".to_string(),
            "fd00:0:0:3::/64 via fd00:0:0:3:: onlink".to_string()
        ])
    );
    assert!(fdb.iter().any(|f| f.ends_with(" fd50::3")), "{fdb:?}");

    let (p1, b1) = n1.pod6("p1");
    let (p2, b2) = n2.pod6("p2");
    let (p3, b3) = n3.pod6("p3");
    assert!(b1.starts_with("fd00:0:0:1:"), "{b1}");
    for (from, to) in [(&p1, &b2), (&p1, &b3), (&p2, &b3), (&p3, &b1), (&p2, &b1)] {
        assert!(ping6(&from.ns, to), "ping {to}");
    }
    // A DF packet of the pod MTU crosses the tunnel (40 + 8 of headers).
    let (ok, out) = df_ping(&p1.ns, &b2, 1430 - 48);
    assert!(ok, "{out}");
    let mut stream = echo_stream(&p1.ns, &p3.ns, &b3);
    echo(&mut stream);

    // Pod traffic leaving the network is masqueraded to the node's
    // address (the router has no route back to the pods): the IPv6 table
    // only.
    assert_eq!(source_seen(&c.router.ns, "fd50::fe", &p1.ns), "fd50::1");
    assert!(nft_tables(&n1.ns.ns).contains("table ip6 rcni_node"));
    for n in [n1, n2, n3] {
        assert_no_ipv4(n);
    }

    let again = n1.reconcile(&c.file);
    assert!(again.contains(": 0 kernel changes"), "{again}");
    echo(&mut stream);

    // A node's own connection to another node's pod shows its address.
    assert_eq!(source_seen(&p2.ns, &b2, &n1.ns.ns), "fd50::1");

    // n3 leaves: its route, FDB entry, neighbour and tunnel address's rule
    // go; n2's stay.
    c.write_v6only("vxlan", &[0, 1]);
    let out = n1.reconcile(&c.file);
    assert!(out.contains(": 4 kernel changes"), "{out}");
    let (neigh, fdb, routes) = n1.entries6();
    assert_eq!((neigh.len(), fdb.len(), routes.len()), (1, 1, 1));
    assert!(ping6(&p1.ns, &b2));
}

#[test]
fn host_gw_and_auto_route_ipv6_only_pods_via_the_peers_ipv6_address() {
    // n3 on another subnet behind the router.
    let c = Cluster::new(&[0, 0, 1]);
    c.make_v6only();
    let (n1, n2, n3) = (&c.nodes[0], &c.nodes[1], &c.nodes[2]);
    assert_eq!(c.address(2), "fd51::3");

    // host-gw: a route via each on-link peer's address, no VXLAN device;
    // the off-link peer is refused, named with its address.
    c.write_v6only("host-gw", &[0, 1, 2]);
    let (code, log) = n1.run_once(&c.file);
    assert_ne!(code, 0, "{log}");
    assert!(log.contains("\"n3\"") && log.contains("fd51::3"), "{log}");
    n1.assert_host_gw(true, &["fd00:0:0:2::/64 via fd50::2"]);
    n2.run_once(&c.file);
    assert_eq!(n1.plugin_conf()["mtu"], 1500);
    let (p1, b1) = n1.pod6("p1");
    let (p2, b2) = n2.pod6("p2");
    assert!(ping6(&p1.ns, &b2) && ping6(&p2.ns, &b1));
    for n in [n1, n2] {
        assert_no_ipv4(n);
        assert!(!link_names(&n.ns.ns).contains(&VTEP6.to_string()));
    }

    // auto: the on-link peer natively, the far one through the IPv6
    // VXLAN device across the router.
    c.write_v6only("auto", &[0, 1, 2]);
    c.reconcile_all();
    let (_, fdb, routes) = n1.entries6();
    assert_eq!(
        routes,
        BTreeSet::from([
            "fd00:0:0:2::/64 via fd50::2".to_string(),
            "fd00:0:0:3::/64 via fd00:0:0:3:: onlink".to_string()
        ])
    );
    assert!(fdb.iter().any(|f| f.ends_with(" fd51::3")), "{fdb:?}");
    let (p3, b3) = n3.pod6("p3");
    assert!(ping6(&p1.ns, &b3) && ping6(&p3.ns, &b1) && ping6(&p1.ns, &b2));
    for n in [n1, n2, n3] {
        assert_no_ipv4(n);
    }
}

#[test]
fn a_dual_stack_node_turned_ipv6_only_drops_its_ipv4_state_and_back() {
    // Both families on the underlay: the same nodes take either file.
    let c = Cluster::new(&[0, 0]);
    c.add_ipv6();
    c.write_dual("vxlan", &[0, 1]);
    c.reconcile_all();
    let (n1, n2) = (&c.nodes[0], &c.nodes[1]);
    assert!(link_names(&n1.ns.ns).contains(&VTEP.to_string()));
    assert_eq!(n1.entries().2.len(), 1);

    // The same nodes, IPv6-only: "address" is the node's IPv6 address.
    let file = json!({"network": "fd00::/48", "backend": "vxlan", "nodes": [
        {"name": "n1", "address": "fd50::1", "podCIDR": "fd00:0:0:1::/64"},
        {"name": "n2", "address": "fd50::2", "podCIDR": "fd00:0:0:2::/64"}]});
    std::fs::write(&c.file, serde_json::to_vec(&file).unwrap()).unwrap();
    let out = n1.reconcile(&c.file);
    assert!(out.contains(&format!("deleted {VTEP}")), "{out}");
    assert!(out.contains("masquerade: IPv4 table removed"), "{out}");
    n2.reconcile(&c.file);
    // The IPv6 device and entries stay as they were; the IPv4 ones go.
    assert!(!link_names(&n1.ns.ns).contains(&VTEP.to_string()));
    assert!(n1.entries().2.is_empty());
    assert_eq!(n1.entries6().2.len(), 1);
    let tables = nft_tables(&n1.ns.ns);
    assert!(
        !tables.contains("table ip rcni_node") && tables.contains("table ip6 rcni_node"),
        "{tables}"
    );
    let conf = n1.plugin_conf();
    assert_eq!(
        conf["ipam"]["ranges"].as_array().unwrap().len(),
        1,
        "{conf}"
    );
    let (p1, b1) = n1.pod6("p1");
    let (p2, b2) = n2.pod6("p2");
    assert!(ping6(&p1.ns, &b2) && ping6(&p2.ns, &b1));
    let again = n1.reconcile(&c.file);
    assert!(again.contains(": 0 kernel changes"), "{again}");

    // Back to dual-stack: the IPv4 side comes back.
    c.write_dual("vxlan", &[0, 1]);
    n1.reconcile(&c.file);
    assert!(link_names(&n1.ns.ns).contains(&VTEP.to_string()));
    assert_eq!(n1.entries().2.len(), 1);
    assert!(nft_tables(&n1.ns.ns).contains("table ip rcni_node"));
}

#[test]
fn pods_cross_nodes_whose_ip6tables_forward_drops_and_iptables_is_left_alone() {
    let c = Cluster::new(&[0, 0]);
    c.make_v6only();
    let ipt = |ns: &NetNs, tool: &str, args: &str| {
        command_in(ns, tool)
            .args(args.split_whitespace())
            .output()
            .unwrap()
    };
    // Docker's policy on both families: only the IPv6 one concerns an
    // IPv6-only cluster.
    for n in &c.nodes {
        for tool in ["iptables", "ip6tables"] {
            assert!(ipt(&n.ns.ns, tool, "-w -P FORWARD DROP").status.success());
        }
    }
    c.write_v6only("host-gw", &[0, 1]);
    let log = c.nodes[0].reconcile(&c.file);
    assert!(
        log.contains("forward: ip6tables accepts fd00::/48"),
        "{log}"
    );
    assert!(!log.contains("forward: iptables "), "{log}");
    c.nodes[1].reconcile(&c.file);
    let (p1, b1) = c.nodes[0].pod6("p1");
    let (p2, b2) = c.nodes[1].pod6("p2");
    assert!(ping6(&p1.ns, &b2) && ping6(&p2.ns, &b1));
    for n in &c.nodes {
        let v4 = ipt(&n.ns.ns, "iptables", "-w -S");
        let v4 = String::from_utf8_lossy(&v4.stdout);
        assert!(!v4.contains("RCNI-FWD"), "{v4}");
        let v6 = ipt(&n.ns.ns, "ip6tables", "-w -S RCNI-FWD");
        assert_eq!(
            String::from_utf8_lossy(&v6.stdout)
                .matches("-A RCNI-FWD")
                .count(),
            2
        );
    }
}

#[test]
fn mixed_and_inconsistent_files_are_refused_naming_the_field() {
    let c = Cluster::new(&[0]);
    c.make_v6only();
    let n1 = &c.nodes[0];
    let cases: &[(&str, i32, &[&str])] = &[
        (
            r#"{"network": "fd00::/48", "nodes": [{"name": "n1", "address": "192.168.50.1", "podCIDR": "fd00:0:0:1::/64"}]}"#,
            2,
            &["node \"n1\" (nodes[0])", "\"address\"", "IPv6-only"],
        ),
        (
            r#"{"network": "fd00::/48", "nodes": [{"name": "n1", "address": "fd50::1", "podCIDR": "10.244.1.0/24"}]}"#,
            2,
            &["node \"n1\" (nodes[0])", "10.244.1.0/24", "IPv6-only"],
        ),
        (
            r#"{"network": "fd00::/48", "network6": "fd01::/48", "nodes": [{"name": "n1", "address": "fd50::1", "podCIDR": "fd00:0:0:1::/64"}]}"#,
            2,
            &["\"network6\"", "dual-stack"],
        ),
        (
            r#"{"network": "fd00::/48", "nodes": [{"name": "n1", "address": "fd50::1", "podCIDR": "fd01:0:0:1::/64"}]}"#,
            2,
            &["node \"n1\" (nodes[0])", "outside \"network\" fd00::/48"],
        ),
        (
            r#"{"network": "fd00::/48", "nodes": [{"name": "n1", "address": "fd50::9", "podCIDR": "fd00:0:0:1::/64"}]}"#,
            4,
            &["no interface holds its address fd50::9"],
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
    assert!(link_names(&n1.ns.ns).iter().all(|l| l != VTEP6));
    assert!(!n1.conf_dir().join("10-rcni.conflist").exists());
}

#[test]
fn kubernetes_takes_ipv6_only_nodes_by_their_ipv6_internal_ip() {
    use k8s_openapi::api::core::v1::Node as KNode;
    let c = Cluster::new(&[0, 0]);
    c.make_v6only();
    let k = KubeApi::new_v6(&c, r#"{"network": "fd00::/48", "backend": "vxlan"}"#);
    // Node objects as an IPv6-only cluster's kubelet and controller
    // manager make them: an IPv6 InternalIP, an IPv6 podCIDR.
    for i in 0..2 {
        k.api.put(&knode(
            &c.nodes[i].name,
            &c.address(i),
            &format!("fd00:0:0:{}::/64", i + 1),
        ));
    }
    let _agents: Vec<Agent> = c
        .nodes
        .iter()
        .map(|n| {
            let mut cmd = k.agent_command(n);
            cmd.env("NODE_NAME", &n.name)
                .stderr(std::fs::File::create(n.dir.path().join("agent.log")).unwrap());
            Agent(cmd.spawn().unwrap())
        })
        .collect();
    let log = |n: &ClusterNode| {
        std::fs::read_to_string(n.dir.path().join("agent.log")).unwrap_or_default()
    };
    // Each node publishes its IPv6 address and its IPv6 VTEP's MAC (the
    // device's), nothing IPv4; its peer tunnels to that address.
    for (i, n) in c.nodes.iter().enumerate() {
        // The annotations are published from the watch, the device made by
        // the first reconcile: either may come first.
        wait_for(
            SETTLE,
            &format!("{}'s annotations and VTEP", n.name),
            || {
                k.api
                    .get::<KNode>(None, &n.name)
                    .and_then(|k| k.metadata.annotations)
                    .is_some_and(|a| a.contains_key("rcni.io/vtep-mac6"))
                    && link_names(&n.ns.ns).contains(&VTEP6.to_string())
            },
        );
        let a = k
            .api
            .get::<KNode>(None, &n.name)
            .unwrap()
            .metadata
            .annotations
            .unwrap();
        let mac = ip_link_json(&n.ns.ns, VTEP6)["address"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(a["rcni.io/vtep-mac6"], mac, "{a:?}");
        assert_eq!(a["rcni.io/public-ip6"], c.address(i), "{a:?}");
        assert!(
            !a.contains_key("rcni.io/public-ip") && !a.contains_key("rcni.io/vtep-mac"),
            "{a:?}"
        );
        let other = &c.nodes[1 - i];
        wait_for(SETTLE, &format!("{}'s entries", other.name), || {
            other
                .entries6()
                .1
                .contains(&format!("{mac} {}", c.address(i)))
                && other.entries6().2.len() == 1
                && other.conf_dir().join("10-rcni.conflist").exists()
        });
    }
    let (n1, n2) = (&c.nodes[0], &c.nodes[1]);
    assert_eq!(
        n1.entries6().2,
        BTreeSet::from(["fd00:0:0:2::/64 via fd00:0:0:2:: onlink".to_string()]),
        "{}",
        log(n1)
    );
    let (p1, b1) = n1.pod6("p1");
    let (p2, b2) = n2.pod6("p2");
    assert!(ping6(&p1.ns, &b2) && ping6(&p2.ns, &b1));
    for n in [n1, n2] {
        assert_no_ipv4(n);
    }
}

// ---- eBPF cross-node forwarding ----

const TO_REMOTE: &str = "redirected to another node";
const FROM_REMOTE: &str = "redirected from another node";

/// `"ebpf": true` on an IPv6-only cluster of two nodes with `backend`:
/// the other-node map holds the peer's IPv6 subnet via `hop`, the agent's
/// program sits on `devs`, pods talk and the datapath carries it.
fn ebpf_v6only(backend: &str, devs: &[&str], hop: &str) {
    let c = Cluster::new(&[0, 0]);
    c.make_v6only();
    c.write_v6only_with(backend, &[0, 1], json!({"ebpf": true}));
    c.reconcile_all();
    let (n1, n2) = (&c.nodes[0], &c.nodes[1]);
    let list: serde_json::Value =
        serde_json::from_slice(&std::fs::read(n1.conf_dir().join("10-rcni.conflist")).unwrap())
            .unwrap();
    assert_eq!(list["plugins"][1]["type"], "fastpath", "{list}");
    assert_eq!(n1.remote_map(), BTreeSet::from([hop.to_string()]));
    let want: BTreeSet<String> = devs.iter().map(|d| d.to_string()).collect();
    assert_eq!(n1.net_program_on(), want);

    let (p1, b1) = n1.pod6("p1");
    let (p2, b2) = n2.pod6("p2");
    assert!(ping6(&p1.ns, &b2) && ping6(&p2.ns, &b1));
    let mut stream = echo_stream(&p1.ns, &p2.ns, &b2);
    echo(&mut stream);
    assert!(n1.verdict(TO_REMOTE) > 0 && n2.verdict(FROM_REMOTE) > 0);
    assert!(n1.counter(&b1, "txPackets") > 0 && n2.counter(&b2, "rxPackets") > 0);
    for n in [n1, n2] {
        assert_no_ipv4(n);
    }
    let again = n1.reconcile(&c.file);
    assert!(again.contains(": 0 kernel changes"), "{again}");
    echo(&mut stream);
}

#[test]
fn ebpf_vxlan_ipv6_only_maps_the_peer_through_the_ipv6_tunnel() {
    ebpf_v6only(
        "vxlan",
        &[VTEP6],
        "fd00:0:0:2::/64 via fd00:0:0:2:: dev rcni6.1 mtu 1430",
    );
}

#[test]
fn ebpf_host_gw_ipv6_only_maps_the_peer_via_its_address() {
    ebpf_v6only(
        "host-gw",
        &["eth0"],
        "fd00:0:0:2::/64 via fd50::2 dev eth0 mtu 1500",
    );
}
