//! portmap: real TCP and UDP through mapped host ports, from outside the
//! node, from another pod (hairpin), from the pod itself and from the node
//! (its own address and 127.0.0.1); both backends, iptables the default as
//! upstream's; CHECK, DEL (also without portMappings), GC, conntrack
//! flushing; and interop with the reference plugin's iptables rules.

use rcni_integration::lab::chain::*;
use rcni_netfilter::nfnl::{IPPROTO_UDP, Nfnl};
use rcni_testkit::{TestNs, bin, reference_bin};
use serde_json::{Value, json};

fn mappings() -> Value {
    json!([
        {"hostPort": 8080, "containerPort": 80, "protocol": "tcp"},
        {"hostPort": 8081, "containerPort": 81, "protocol": "tcp", "hostIP": NODE_UPLINK_V4},
        {"hostPort": 5353, "containerPort": 53, "protocol": "udp"}
    ])
}

fn chain(lan: &Lan, version: &str, portmap: Value) -> Chain {
    let pm = json!({"type": "portmap", "capabilities": {"portMappings": true}});
    lan.chain_with(version, pm, portmap)
        .caps(json!({"portMappings": mappings()}))
}

/// A pod with servers on 80 and 81 (TCP) and 53 (UDP) answering `tag`.
fn pod_with_servers(tag: &str) -> TestNs {
    let pod = TestNs::new();
    tcp_server(&pod.ns, 80, tag);
    tcp_server(&pod.ns, 81, tag);
    udp_server(&pod.ns, 53, tag);
    pod
}

/// Pod A's server answers a connection from `ns` to `addr`, seeing `peer`.
fn assert_a_from(ns: &TestNs, addr: &str, peer: &str, what: &str) {
    let got = tcp_get(&ns.ns, addr).unwrap_or_else(|| panic!("{what}: no answer"));
    assert_eq!(got, format!("A {peer}"), "{what}");
}

/// Our rules in the node: nft comments and iptables chains of portmap.
fn portmap_rules(lan: &Lan) -> Vec<String> {
    ruleset(&lan.node.ns)
        .lines()
        .filter(|l| {
            l.contains("dnat to") || l.contains("masquerade comment") || l.contains("CNI-DN-")
        })
        .map(String::from)
        .collect()
}

/// Pod A (servers, attached through the chain) and pod B (attached by the
/// bridge alone).
struct TwoPods {
    a: TestNs,
    b: TestNs,
    ra: Value,
    rb: Value,
    b_only: Chain,
}

fn two_pods(lan: &Lan, c: &Chain) -> TwoPods {
    let a = pod_with_servers("A");
    let b = TestNs::new();
    let ra = c.add(lan, &a.path(), "pod-a", "eth0");
    let b_only = c.only(0);
    let rb = b_only.add(lan, &b.path(), "pod-b", "eth0");
    TwoPods {
        a,
        b,
        ra,
        rb,
        b_only,
    }
}

/// The chain with `backend`, and two pods on it whose mapped ports (pod
/// A's) answer from outside, from pod B, from A itself and from the node.
fn mapped_ports_work(lan: &Lan, backend: &str) -> (Chain, TwoPods) {
    let c = chain(lan, "1.0.0", json!({"backend": backend}));
    let pods = two_pods(lan, &c);
    traffic_works(lan);
    hairpin_and_node(lan, &pods.a, &pods.b);
    (c, pods)
}

fn traffic_works(lan: &Lan) {
    // From outside, both families: the client's own address arrives.
    assert_a_from(&lan.client, "10.99.0.1:8080", CLIENT_V4, "outside v4");
    assert_a_from(&lan.client, "[fd99::1]:8080", CLIENT_V6, "outside v6");
    // hostIP: only that address maps 8081.
    assert_a_from(&lan.client, "10.99.0.1:8081", CLIENT_V4, "hostIP");
    assert_eq!(
        tcp_get(&lan.client.ns, "10.88.0.1:8081"),
        None,
        "8081 mapped on another address"
    );
    // Any local address maps 8080.
    assert_a_from(&lan.client, "10.88.0.1:8080", CLIENT_V4, "bridge address");
    // UDP.
    let u = udp_client(&lan.client.ns, 40001);
    assert_eq!(
        udp_ask(&u, "10.99.0.1:5353").as_deref(),
        Some("A"),
        "udp from outside"
    );
}

fn hairpin_and_node(lan: &Lan, pod_a: &TestNs, pod_b: &TestNs) {
    // Another pod on the bridge: masqueraded to the bridge address so the
    // reply comes back through the node.
    assert_a_from(pod_b, "10.99.0.1:8080", BRIDGE_V4, "hairpin from pod B");
    // The pod itself through its host port (hairpin on the bridge port).
    assert_a_from(
        pod_a,
        "10.99.0.1:8080",
        BRIDGE_V4,
        "hairpin from pod A itself",
    );
    // The node: its own address, and localhost (route_localnet + masq).
    assert!(
        tcp_get(&lan.node.ns, "10.99.0.1:8080").is_some_and(|s| s.starts_with("A ")),
        "node to its own address"
    );
    assert_a_from(&lan.node, "127.0.0.1:8080", BRIDGE_V4, "node via 127.0.0.1");
}

#[test]
fn nftables_mapped_ports_reach_the_pod_from_everywhere() {
    let lan = Lan::new();
    let (c, p) = mapped_ports_work(&lan, "nftables");
    let rules = ruleset(&lan.node.ns);
    assert!(
        rules.contains("table ip cni_hostport") && rules.contains("table ip6 cni_hostport"),
        "{rules}"
    );
    assert!(
        !rules.contains("CNI-DN-"),
        "nftables backend wrote iptables rules: {rules}"
    );
    c.check_ok(&lan, &p.a, "pod-a", &p.ra);

    c.del_pod(&lan, &p.a, "pod-a", &p.ra);
    assert!(
        portmap_rules(&lan).is_empty(),
        "left behind: {:?}",
        portmap_rules(&lan)
    );
    assert_eq!(tcp_get(&lan.client.ns, "10.99.0.1:8080"), None);
    // DEL is idempotent.
    c.del_pod(&lan, &p.a, "pod-a", &p.ra);
    p.b_only.del(&lan, Some(&p.b.path()), "pod-b", "eth0", None);
}

#[test]
fn iptables_backend_traffic_and_layout_of_the_reference() {
    let lan = Lan::new();
    let (c, p) = mapped_ports_work(&lan, "iptables");
    let v4 = lan.on_node("iptables-save", &["-t", "nat"]);
    assert!(v4.contains("-A CNI-HOSTPORT-DNAT -p tcp -m comment --comment \"dnat name: \\\"podnet\\\" id: \\\"pod-a\\\"\" -m multiport --dports 8080,8081 -j CNI-DN-"), "{v4}");
    assert!(
        !lan.on_node("nft", &["list", "tables"])
            .contains("cni_hostport")
    );

    // (The reference's CHECK cannot judge a dual-stack attachment: v1.1.1
    // looks for the IPv4 rules in ip6tables too and fails on its own rules.)
    let pm_conf = c.stdin(1, Some(&p.ra));
    let reference = reference_bin("portmap");
    // The reference's DEL removes them.
    assert_success(&lan.run(&reference, "DEL", &p.a, "pod-a", &pm_conf));
    assert!(
        !lan.on_node("iptables-save", &["-t", "nat"])
            .contains("CNI-DN-")
    );

    // The reference's rules pass our CHECK, and our DEL removes them even
    // without portMappings (the reference's own DEL leaks them then).
    assert_success(&lan.run(&reference, "ADD", &p.a, "pod-a", &pm_conf));
    assert_checks(&lan, &bin("portmap"), &reference, &p.a, "pod-a", &pm_conf);
    assert_a_from(&lan.client, "10.99.0.1:8080", CLIENT_V4, "reference rules");
    let mut no_maps = pm_conf.clone();
    no_maps.as_object_mut().unwrap().remove("runtimeConfig");
    assert_eq!(lan.run(&reference, "DEL", &p.a, "pod-a", &no_maps).code, 0);
    assert!(
        lan.on_node("iptables-save", &["-t", "nat"])
            .contains("CNI-DN-"),
        "the reference leaks without portMappings"
    );
    assert_success(&lan.run(&bin("portmap"), "DEL", &p.a, "pod-a", &no_maps));
    for tool in ["iptables-save", "ip6tables-save"] {
        let t = lan.on_node(tool, &["-t", "nat"]);
        assert!(!t.contains("CNI-DN-"), "{tool}: {t}");
    }
    assert_eq!(tcp_get(&lan.client.ns, "10.99.0.1:8080"), None);
}

/// No `backend` key: upstream's default, iptables where it works, with
/// the per-attachment `CNI-DN-<hash>` chain upstream's suite looks for in
/// nat (hash of network + container ID), its DNAT rule, and the mappings
/// working from everywhere; nothing in nftables.
#[test]
fn default_backend_is_iptables_as_upstream() {
    let lan = Lan::new();
    let c = chain(&lan, "1.0.0", json!({}));
    let pods = two_pods(&lan, &c);
    let ip = ip_of(&pods.ra, true);
    let dn = "CNI-DN-b0dc9f1ea27aede9301c8";
    let nat = lan.on_node("iptables", &["-w", "-t", "nat", "-S", dn]);
    assert!(nat.contains(&format!("-N {dn}")), "{nat}");
    assert!(
        nat.contains(&format!(
            "-A {dn} -p tcp -m tcp --dport 8080 -j DNAT --to-destination {ip}:80"
        )),
        "{nat}"
    );
    let ip6 = ip_of(&pods.ra, false);
    let nat6 = lan.on_node("ip6tables", &["-w", "-t", "nat", "-S", dn]);
    assert!(
        nat6.contains(&format!("--to-destination [{ip6}]:80")),
        "{nat6}"
    );
    assert!(
        !lan.on_node("nft", &["list", "tables"])
            .contains("cni_hostport")
    );
    traffic_works(&lan);
    hairpin_and_node(&lan, &pods.a, &pods.b);
    c.check_ok(&lan, &pods.a, "pod-a", &pods.ra);
    c.del_pod(&lan, &pods.a, "pod-a", &pods.ra);
    assert!(portmap_rules(&lan).is_empty(), "{:?}", portmap_rules(&lan));
    assert_eq!(tcp_get(&lan.client.ns, "10.99.0.1:8080"), None);
    pods.b_only
        .del(&lan, Some(&pods.b.path()), "pod-b", "eth0", None);
}

#[test]
fn del_without_port_mappings_or_netns_removes_the_rules() {
    let lan = Lan::new();
    // The default backend (iptables here), then nftables: DEL's config
    // names no backend either way.
    for backend in [json!({}), json!({"backend": "nftables"})] {
        let c = chain(&lan, "1.0.0", backend.clone());
        let pod = pod_with_servers("A");
        let r = c.add(&lan, &pod.path(), "pod-a", "eth0");
        assert!(!portmap_rules(&lan).is_empty(), "{backend}");
        let mut conf = chain(&lan, "1.0.0", json!({})).stdin(1, Some(&r));
        conf.as_object_mut().unwrap().remove("runtimeConfig");
        conf.as_object_mut().unwrap().remove("prevResult");
        assert_success(&lan.call(&bin("portmap"), "DEL", None, "pod-a", "eth0", &conf));
        assert!(
            portmap_rules(&lan).is_empty(),
            "{backend}: {:?}",
            portmap_rules(&lan)
        );
        c.del_pod(&lan, &pod, "pod-a", &r);
    }
}

#[test]
fn check_fails_when_a_rule_is_gone() {
    let lan = Lan::new();
    let c = chain(&lan, "1.0.0", json!({"backend": "nftables"}));
    let pod = TestNs::new();
    let r = c.add(&lan, &pod.path(), "pod-a", "eth0");
    c.check_ok(&lan, &pod, "pod-a", &r);
    // Flush the DNAT chain behind the plugin's back.
    lan.on_node_ok(
        "nft",
        &["flush", "chain", "ip", "cni_hostport", "hostports"],
    );
    let msg = c.check_fails(&lan, &pod, "pod-a", "eth0", &r);
    assert!(msg.contains("hostports"), "{msg}");
    c.del_pod(&lan, &pod, "pod-a", &r);
}

#[test]
fn gc_removes_only_stale_attachments() {
    let lan = Lan::new();
    for backend in ["nftables", "iptables"] {
        let c = chain(&lan, "1.1.0", json!({"backend": backend}));
        let (a, b) = (pod_with_servers("A"), TestNs::new());
        let ra = c.add(&lan, &a.path(), "pod-a", "eth0");
        // B maps another port so both can coexist.
        let cb = Chain {
            caps: json!({"portMappings": [{"hostPort": 9090, "containerPort": 90, "protocol": "tcp"}]}),
            ..chain(&lan, "1.1.0", json!({"backend": backend}))
        };
        let rb = cb.add(&lan, &b.path(), "pod-b", "eth0");
        let before = portmap_rules(&lan);
        assert!(
            before
                .iter()
                .any(|l| l.contains("9090") || l.contains("CNI-DN-")),
            "{backend}: {before:?}"
        );
        // Only the portmap plugin: the bridge's GC would also release B's address.
        c.only(1).gc(&lan, &[("pod-a", "eth0")]);
        let after = ruleset(&lan.node.ns);
        assert!(
            !after.contains("9090"),
            "{backend}: B's mapping survived GC: {after}"
        );
        assert_a_from(&lan.client, "10.99.0.1:8080", CLIENT_V4, "A after GC");
        c.del_pod(&lan, &a, "pod-a", &ra);
        cb.del_pod(&lan, &b, "pod-b", &rb);
        assert!(
            portmap_rules(&lan).is_empty(),
            "{backend}: {:?}",
            portmap_rules(&lan)
        );
    }
}

fn udp_flows_to(lan: &Lan, ip: &str) -> usize {
    let mut nl = Nfnl::open(&lan.node.ns).unwrap();
    let ip: std::net::IpAddr = ip.parse().unwrap();
    nl.conntrack_flows(ip.is_ipv6())
        .unwrap()
        .iter()
        .filter(|f| f.proto == IPPROTO_UDP && f.reply_src == Some(ip))
        .count()
}

#[test]
fn stale_udp_conntrack_is_flushed_on_add_and_del() {
    let lan = Lan::new();
    // Conntrack tracks the node's traffic before any mapping exists.
    let script = "add table ip ct_on\nadd chain ip ct_on pre { type filter hook prerouting priority 0 ; }\nadd rule ip ct_on pre ct state new accept\n";
    let out = rcni_testkit::command_in(&lan.node.ns, "nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(script.as_bytes())?;
            c.wait()
        })
        .unwrap();
    assert!(out.success());
    let client = udp_client(&lan.client.ns, 40053);
    // Nothing listens yet: the flow is tracked without NAT.
    assert_eq!(udp_ask(&client, "10.99.0.1:5353"), None);
    let c = chain(&lan, "1.0.0", json!({}));
    let pod = pod_with_servers("A");
    let r = c.add(&lan, &pod.path(), "pod-a", "eth0");
    // The same flow (same ports) now reaches the pod: the stale entry went.
    assert_eq!(udp_ask(&client, "10.99.0.1:5353").as_deref(), Some("A"));
    let pod_ip = ip_of(&r, true);
    assert_eq!(udp_flows_to(&lan, &pod_ip), 1);
    c.del_pod(&lan, &pod, "pod-a", &r);
    assert_eq!(
        udp_flows_to(&lan, &pod_ip),
        0,
        "DEL leaves a UDP flow to the deleted pod"
    );
}

/// Upstream v1.10.0's DEL flush: the UDP entries of a mapped host port
/// go, IPv4 and IPv6 alike, and only when DEL carries the mappings (without
/// them there is no port to flush; upstream's DEL returns early).
#[test]
fn del_flushes_udp_conntrack_of_both_families() {
    let lan = Lan::new();
    let c = chain(&lan, "1.0.0", json!({"backend": "nftables"}));
    let pod = pod_with_servers("A");
    let r = c.add(&lan, &pod.path(), "pod-a", "eth0");
    let (pod4, pod6) = (ip_of(&r, true), ip_of(&r, false));
    let v4 = udp_client(&lan.client.ns, 40061);
    assert_eq!(udp_ask(&v4, "10.99.0.1:5353").as_deref(), Some("A"));
    // The pod's UDP server is IPv4 only: DNAT tracks the IPv6 datagram
    // all the same.
    let v6 = lan
        .client
        .ns
        .run(|| std::net::UdpSocket::bind("[::]:40062").unwrap())
        .unwrap();
    v6.send_to(b"hi", "[fd99::1]:5353").unwrap();
    let both = || (udp_flows_to(&lan, &pod4), udp_flows_to(&lan, &pod6));
    assert!(
        rcni_testkit::poll(std::time::Duration::from_secs(3), || both() == (1, 1)),
        "{:?}",
        both()
    );
    let mut bare = c.stdin(1, Some(&r));
    bare.as_object_mut().unwrap().remove("runtimeConfig");
    assert_success(&lan.call(&bin("portmap"), "DEL", None, "pod-a", "eth0", &bare));
    assert_eq!(both(), (1, 1), "flushed without portMappings");
    c.del_pod(&lan, &pod, "pod-a", &r);
    assert_eq!(both(), (0, 0), "DEL left UDP flows to the pod");
}

#[test]
fn every_version_passes_prev_result_through() {
    let lan = Lan::new();
    let versions = ["0.2.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
    chained_add_per_version(&lan, &versions, |v| chain(&lan, v, json!({})), |br| br);
    assert!(portmap_rules(&lan).is_empty());
}

#[test]
fn chained_only_and_config_errors() {
    let lan = Lan::new();
    let c = chain(&lan, "1.0.0", json!({}));
    let pod = TestNs::new();
    let (code, msg) = c.add_unchained(&lan, &pod);
    assert_eq!(code, 7);
    assert!(msg.contains("chained"), "{msg}");
    let mut bad = c.stdin(1, Some(&json!({"cniVersion": "1.0.0"})));
    bad["runtimeConfig"] =
        json!({"portMappings": [{"hostPort": 1, "containerPort": 1, "protocol": "icmp"}]});
    let (code, _) = lan.run(&bin("portmap"), "ADD", &pod, "x", &bad).err();
    assert_eq!(code, 2);
    // VERSION with empty stdin.
    let v = version_of("portmap");
    assert!(v["supportedVersions"].as_array().unwrap().len() >= 6);
}

#[test]
fn conditions_go_through_nft_and_limit_who_is_mapped() {
    let lan = Lan::new();
    // Only clients of the uplink's subnet get the mapping.
    let conditions = json!({"conditionsV4": ["ip saddr 10.99.0.0/24"]});
    let c = chain(&lan, "1.0.0", conditions);
    let TwoPods {
        a: pod_a,
        b: pod_b,
        ra,
        rb,
        b_only,
    } = two_pods(&lan, &c);
    assert_a_from(&lan.client, "10.99.0.1:8080", CLIENT_V4, "matching client");
    assert!(
        tcp_blocked(&pod_b.ns, "10.99.0.1:8080"),
        "pod B matched a condition it does not meet"
    );
    let rules = lan.on_node("nft", &["list", "table", "ip", "cni_hostport"]);
    assert!(
        rules.contains("ip saddr 10.99.0.0/24 jump hostip_hostports"),
        "{rules}"
    );
    c.check_ok(&lan, &pod_a, "pod-a", &ra);
    c.del_pod(&lan, &pod_a, "pod-a", &ra);
    b_only.del_pod(&lan, &pod_b, "pod-b", &rb);
    assert!(portmap_rules(&lan).is_empty());
}

/// `masqAll` with nftables (upstream v1.10.0): one masquerade rule per
/// family from every source, none from 127.0.0.1; CHECK accepts it, and a
/// client outside reaches the pod masqueraded to the bridge address.
#[test]
fn nftables_masq_all_masquerades_every_source() {
    let lan = Lan::new();
    let c = chain(
        &lan,
        "1.0.0",
        json!({"backend": "nftables", "masqAll": true}),
    );
    let pod = pod_with_servers("A");
    let r = c.add(&lan, &pod.path(), "pod-a", "eth0");
    let (ip4, ip6) = (ip_of(&r, true), ip_of(&r, false));
    let masq = |fam: &str| -> Vec<String> {
        lan.on_node(
            "nft",
            &["list", "chain", fam, "cni_hostport", "masquerading"],
        )
        .lines()
        .filter(|l| l.contains("masquerade"))
        .map(|l| l.trim().to_string())
        .collect()
    };
    let v4 = masq("ip");
    assert_eq!(v4.len(), 1, "{v4:?}");
    assert!(
        v4[0].starts_with(&format!(
            "ip saddr 0.0.0.0/0 ip daddr {ip4} ct status dnat masquerade"
        )),
        "{v4:?}"
    );
    let v6 = masq("ip6");
    assert_eq!(v6.len(), 1, "{v6:?}");
    assert!(
        v6[0].starts_with(&format!(
            "ip6 saddr ::/0 ip6 daddr {ip6} ct status dnat masquerade"
        )),
        "{v6:?}"
    );
    c.check_ok(&lan, &pod, "pod-a", &r);
    assert_a_from(
        &lan.client,
        "10.99.0.1:8080",
        BRIDGE_V4,
        "outside, masqueraded",
    );
    let seen = tcp_get(&lan.client.ns, "[fd99::1]:8080").expect("outside v6");
    assert!(
        seen.starts_with("A ") && !seen.ends_with(CLIENT_V6),
        "v6 client not masqueraded: {seen}"
    );
    c.del_pod(&lan, &pod, "pod-a", &r);
    assert!(portmap_rules(&lan).is_empty(), "{:?}", portmap_rules(&lan));
}

#[test]
fn rules_written_over_netlink_read_back_as_nft_would_write_them() {
    let lan = Lan::new();
    let c = chain(&lan, "1.0.0", json!({"backend": "nftables"}));
    let pod = TestNs::new();
    let r = c.add(&lan, &pod.path(), "pod-a", "eth0");
    let ip = ip_of(&r, true);
    let v4 = lan.on_node("nft", &["list", "table", "ip", "cni_hostport"]);
    for want in [
        format!("tcp dport 8080 dnat to {ip}:80"),
        format!("ip daddr {NODE_UPLINK_V4} tcp dport 8081 dnat to {ip}:81"),
        format!("udp dport 5353 dnat to {ip}:53"),
        "fib daddr type local jump hostports".to_string(),
        format!("ip saddr 10.88.0.0/24 ip daddr {ip} ct status dnat masquerade"),
        format!("ip saddr 127.0.0.1 ip daddr {ip} ct status dnat masquerade"),
        "type nat hook prerouting priority dstnat".to_string(),
        "type nat hook postrouting priority srcnat".to_string(),
    ] {
        assert!(v4.contains(&want), "missing {want:?} in {v4}");
    }
    let v6 = lan.on_node("nft", &["list", "table", "ip6", "cni_hostport"]);
    let ip6 = ip_of(&r, false);
    assert!(
        v6.contains(&format!("tcp dport 8080 dnat to [{ip6}]:80")),
        "{v6}"
    );
    c.del_pod(&lan, &pod, "pod-a", &r);
}
