//! A simulated cluster (rcni_integration::lab::cluster) with eBPF
//! cross-node forwarding ("ebpf": true).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::process::Stdio;

use rcni_integration::addr_of;
use rcni_integration::lab::cluster::{Cluster, VTEP, VTEP6};
use rcni_integration::lab::traffic::{
    df_ping, echo, echo_stream, listen_ok, ping6, source_seen, talks, talks_from, talks_soon,
};
use rcni_netns::NetNs;
use rcni_testkit::{Call, bin, command_in, ping, stdout_of};
use serde_json::{Value, json};

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
    // The conflist asks for netkit pairs: netkit where the kernel has it
    // (scripts/test also runs this in the VM, whose kernel does), veth
    // here. On netkit the fast path runs on the pair's peer hook.
    let want_kind = rcni_integration::netkit_or_veth();
    for p in [&p1, &p2] {
        let l = rcni_integration::nl(&p.ns, async |n| n.link_by_name("eth0").await.unwrap());
        assert_eq!(l.kind.as_deref(), Some(want_kind));
    }
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

    // A node's own connection to the other node's pod shows the node's
    // address, as through the node's forwarding: over VXLAN the fast path
    // leaves it to the node's NAT, which translates the peer's tunnel
    // address (both families).
    assert_eq!(source_seen(&p2.ns, &a2, &n1.ns.ns), "192.168.50.1");
    assert_eq!(source_seen(&p2.ns, &b2, &n1.ns.ns), "fd50::1");

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
    assert!(talks_soon(&p1.ns, &w, 80), "n1's pod, port 80");
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

/// A service address in `node`, as kube-proxy would make it: 10.96.0.10,
/// TCP 80, DNATed to `backend`:80 (a pod of another node).
fn service_to(node: &NetNs, backend: &str) {
    nft_script(
        node,
        &format!(
            "table ip xnode_svc {{
                chain pre {{
                    type nat hook prerouting priority dstnat;
                    ip daddr 10.96.0.10 tcp dport 80 dnat to {backend}:80
                }}
            }}"
        ),
    );
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
    service_to(&n1.ns.ns, &a2);
    // The replies come back from n2 by the fast path, and n1 hands them to
    // its conntrack (which turns the source back into the service address)
    // instead of straight to p1.
    assert!(talks_soon(&p1.ns, "10.96.0.10", 80));
    assert!(n1.verdict("passed: a flow the node's NAT translates") > 0);
    assert!(n2.verdict(TO_REMOTE) > 0);
    // Direct pod-to-pod traffic keeps the fast path both ways.
    let before = n1.verdict(FROM_REMOTE);
    assert!(talks_soon(&p1.ns, &a2, 80));
    assert!(n1.verdict(FROM_REMOTE) > before);
}

/// kube-proxy's rule in the forward hook: a packet conntrack finds
/// INVALID (a connection the node saw only one direction of) is dropped.
fn drop_invalid_as_kube_proxy(ns: &NetNs) {
    nft_script(
        ns,
        "table inet kube_proxy_test {
            chain forward {
                type filter hook forward priority filter; policy accept;
                ct state invalid drop
            }
        }",
    );
}

#[test]
fn ebpf_a_socket_that_met_the_nodes_nat_keeps_one_path_both_ways() {
    let c = Cluster::new(&[0, 0]);
    c.write_with("host-gw", &[0, 1], json!({"ebpf": true}));
    c.reconcile_all();
    let (n1, n2) = (&c.nodes[0], &c.nodes[1]);
    let (p1, _) = n1.pod("p1");
    let (p2, a2) = n2.pod("p2");
    listen_ok(&p2.ns, 80);
    listen_ok(&p2.ns, 81);
    for n in [n1, n2] {
        drop_invalid_as_kube_proxy(&n.ns.ns);
    }

    // A server that answered its node (as a kubelet's probe or a
    // host-network client make it) opened nothing: a pod on another node
    // still reaches it, by the fast path. Sending that pod's packets
    // through n2's conntrack one way only, its ACK was INVALID there.
    assert!(talks_soon(&n2.ns.ns, &a2, 80));
    let before = n2.verdict(FROM_REMOTE);
    assert!(
        talks_soon(&p1.ns, &a2, 80),
        "a pod on n1 to a server that answered n2"
    );
    assert!(n2.verdict(FROM_REMOTE) > before);

    // A client port that went to a service address (DNATed by n1) and then
    // straight to a pod: n1's conntrack sees both directions of the second
    // connection too. With its SYN redirected and its SYN-ACK handed to the
    // node (the port was that of a translated flow), the SYN-ACK was
    // INVALID there.
    service_to(&n1.ns.ns, &a2);
    assert!(talks_from(&p1.ns, "10.96.0.10", 80, 40000));
    assert!(
        talks_from(&p1.ns, &a2, 81, 40000),
        "the same source port straight to the pod"
    );
}
