//! portmap: real TCP and UDP through mapped host ports, from outside the
//! node, from another pod (hairpin), from the pod itself and from the node
//! (its own address and 127.0.0.1); both backends; CHECK, DEL (also without
//! portMappings), GC, conntrack flushing; and interop with the reference
//! plugin's iptables rules.

mod chain;

use chain::*;
use rcni_netlink::nfnl::{IPPROTO_UDP, Nfnl};
use rcni_testkit::{Call, TestNs, bin, reference_bin};
use serde_json::{Value, json};

fn mappings() -> Value {
    json!([
        {"hostPort": 8080, "containerPort": 80, "protocol": "tcp"},
        {"hostPort": 8081, "containerPort": 81, "protocol": "tcp", "hostIP": NODE_UPLINK_V4},
        {"hostPort": 5353, "containerPort": 53, "protocol": "udp"}
    ])
}

fn chain(lan: &Lan, version: &str, portmap: Value) -> Chain {
    let mut pm = json!({"type": "portmap", "capabilities": {"portMappings": true}});
    for (k, v) in portmap.as_object().unwrap() {
        pm[k] = v.clone();
    }
    let mut br = lan.bridge_conf(version);
    br.as_object_mut().unwrap().remove("name");
    Chain::new(version, vec![br, pm]).caps(json!({"portMappings": mappings()}))
}

/// A pod with servers on 80 and 81 (TCP) and 53 (UDP) answering `tag`.
fn pod_with_servers(tag: &str) -> TestNs {
    let pod = TestNs::new();
    tcp_server(&pod.ns, 80, tag);
    tcp_server(&pod.ns, 81, tag);
    udp_server(&pod.ns, 53, tag);
    pod
}

fn assert_from(got: Option<String>, tag: &str, peer: &str, what: &str) {
    let got = got.unwrap_or_else(|| panic!("{what}: no answer"));
    assert_eq!(got, format!("{tag} {peer}"), "{what}");
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

fn traffic_works(lan: &Lan, result_a: &Value) {
    let a4 = ip_of(result_a, true);
    let _ = a4;
    // From outside, both families: the client's own address arrives.
    assert_from(
        tcp_get(&lan.client.ns, "10.99.0.1:8080"),
        "A",
        CLIENT_V4,
        "outside v4",
    );
    assert_from(
        tcp_get(&lan.client.ns, "[fd99::1]:8080"),
        "A",
        CLIENT_V6,
        "outside v6",
    );
    // hostIP: only that address maps 8081.
    assert_from(
        tcp_get(&lan.client.ns, "10.99.0.1:8081"),
        "A",
        CLIENT_V4,
        "hostIP",
    );
    assert_eq!(
        tcp_get(&lan.client.ns, "10.88.0.1:8081"),
        None,
        "8081 mapped on another address"
    );
    // Any local address maps 8080.
    assert_from(
        tcp_get(&lan.client.ns, "10.88.0.1:8080"),
        "A",
        CLIENT_V4,
        "bridge address",
    );
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
    assert_from(
        tcp_get(&pod_b.ns, "10.99.0.1:8080"),
        "A",
        BRIDGE_V4,
        "hairpin from pod B",
    );
    // The pod itself through its host port (hairpin on the bridge port).
    assert_from(
        tcp_get(&pod_a.ns, "10.99.0.1:8080"),
        "A",
        BRIDGE_V4,
        "hairpin from pod A itself",
    );
    // The node: its own address, and localhost (route_localnet + masq).
    assert!(
        tcp_get(&lan.node.ns, "10.99.0.1:8080").is_some_and(|s| s.starts_with("A ")),
        "node to its own address"
    );
    assert_from(
        tcp_get(&lan.node.ns, "127.0.0.1:8080"),
        "A",
        BRIDGE_V4,
        "node via 127.0.0.1",
    );
}

#[test]
fn nftables_mapped_ports_reach_the_pod_from_everywhere() {
    let lan = Lan::new();
    let c = chain(&lan, "1.0.0", json!({"backend": "nftables"}));
    let pod_a = pod_with_servers("A");
    let pod_b = TestNs::new();
    let ra = c.add(&lan, &pod_a.path(), "pod-a", "eth0");
    let rb_chain = Chain::new("1.0.0", vec![c.plugins[0].clone()]);
    let rb = rb_chain.add(&lan, &pod_b.path(), "pod-b", "eth0");
    let _ = rb;
    traffic_works(&lan, &ra);
    hairpin_and_node(&lan, &pod_a, &pod_b);
    let rules = ruleset(&lan.node.ns);
    assert!(
        rules.contains("table ip cni_hostport") && rules.contains("table ip6 cni_hostport"),
        "{rules}"
    );
    assert!(
        !rules.contains("CNI-DN-"),
        "nftables backend wrote iptables rules: {rules}"
    );
    c.check(&lan, &pod_a.path(), "pod-a", "eth0", &ra)
        .unwrap_or_else(|(i, o)| panic!("CHECK {i}: {}", o.stdout));

    c.del(&lan, Some(&pod_a.path()), "pod-a", "eth0", Some(&ra));
    assert!(
        portmap_rules(&lan).is_empty(),
        "left behind: {:?}",
        portmap_rules(&lan)
    );
    assert_eq!(tcp_get(&lan.client.ns, "10.99.0.1:8080"), None);
    // DEL is idempotent.
    c.del(&lan, Some(&pod_a.path()), "pod-a", "eth0", Some(&ra));
    rb_chain.del(&lan, Some(&pod_b.path()), "pod-b", "eth0", None);
}

#[test]
fn iptables_backend_traffic_and_layout_of_the_reference() {
    let lan = Lan::new();
    let c = chain(&lan, "1.0.0", json!({"backend": "iptables"}));
    let pod_a = pod_with_servers("A");
    let pod_b = TestNs::new();
    let ra = c.add(&lan, &pod_a.path(), "pod-a", "eth0");
    let b_only = Chain::new("1.0.0", vec![c.plugins[0].clone()]);
    b_only.add(&lan, &pod_b.path(), "pod-b", "eth0");
    traffic_works(&lan, &ra);
    hairpin_and_node(&lan, &pod_a, &pod_b);
    let (_, v4) = sh(&lan.node.ns, "iptables-save", &["-t", "nat"]);
    assert!(v4.contains("-A CNI-HOSTPORT-DNAT -p tcp -m comment --comment \"dnat name: \\\"podnet\\\" id: \\\"pod-a\\\"\" -m multiport --dports 8080,8081 -j CNI-DN-"), "{v4}");
    assert!(
        !sh(&lan.node.ns, "nft", &["list", "tables"])
            .1
            .contains("cni_hostport")
    );

    // (The reference's CHECK cannot judge a dual-stack attachment: v1.1.1
    // looks for the IPv4 rules in ip6tables too and fails on its own rules.)
    let pm_conf = c.stdin(1, Some(&ra));
    // The reference's DEL removes them.
    let out = lan.call(
        &reference_bin("portmap"),
        "DEL",
        Some(&pod_a.path()),
        "pod-a",
        "eth0",
        &pm_conf,
    );
    assert_eq!(out.code, 0, "{}", out.stdout);
    assert!(
        !sh(&lan.node.ns, "iptables-save", &["-t", "nat"])
            .1
            .contains("CNI-DN-")
    );

    // The reference's rules pass our CHECK, and our DEL removes them even
    // without portMappings (the reference's own DEL leaks them then).
    let out = lan.call(
        &reference_bin("portmap"),
        "ADD",
        Some(&pod_a.path()),
        "pod-a",
        "eth0",
        &pm_conf,
    );
    assert_eq!(out.code, 0, "{}", out.stdout);
    let out = lan.call(
        &bin("portmap"),
        "CHECK",
        Some(&pod_a.path()),
        "pod-a",
        "eth0",
        &pm_conf,
    );
    assert_eq!(
        out.code, 0,
        "our CHECK of the reference's rules: {}",
        out.stdout
    );
    assert_from(
        tcp_get(&lan.client.ns, "10.99.0.1:8080"),
        "A",
        CLIENT_V4,
        "reference rules",
    );
    let mut no_maps = pm_conf.clone();
    no_maps.as_object_mut().unwrap().remove("runtimeConfig");
    let out = lan.call(
        &reference_bin("portmap"),
        "DEL",
        Some(&pod_a.path()),
        "pod-a",
        "eth0",
        &no_maps,
    );
    assert_eq!(out.code, 0);
    assert!(
        sh(&lan.node.ns, "iptables-save", &["-t", "nat"])
            .1
            .contains("CNI-DN-"),
        "the reference leaks without portMappings"
    );
    let out = lan.call(
        &bin("portmap"),
        "DEL",
        Some(&pod_a.path()),
        "pod-a",
        "eth0",
        &no_maps,
    );
    assert_eq!(out.code, 0, "{}", out.stdout);
    for tool in ["iptables-save", "ip6tables-save"] {
        let t = sh(&lan.node.ns, tool, &["-t", "nat"]).1;
        assert!(!t.contains("CNI-DN-"), "{tool}: {t}");
    }
    assert_eq!(tcp_get(&lan.client.ns, "10.99.0.1:8080"), None);
}

#[test]
fn del_without_port_mappings_or_netns_removes_the_rules() {
    let lan = Lan::new();
    let c = chain(&lan, "1.0.0", json!({}));
    let pod = pod_with_servers("A");
    let r = c.add(&lan, &pod.path(), "pod-a", "eth0");
    assert!(!portmap_rules(&lan).is_empty());
    let mut conf = c.stdin(1, Some(&r));
    conf.as_object_mut().unwrap().remove("runtimeConfig");
    conf.as_object_mut().unwrap().remove("prevResult");
    let out = lan.call(&bin("portmap"), "DEL", None, "pod-a", "eth0", &conf);
    assert_eq!(out.code, 0, "{}", out.stdout);
    assert!(portmap_rules(&lan).is_empty(), "{:?}", portmap_rules(&lan));
    c.del(&lan, Some(&pod.path()), "pod-a", "eth0", Some(&r));
}

#[test]
fn check_fails_when_a_rule_is_gone() {
    let lan = Lan::new();
    let c = chain(&lan, "1.0.0", json!({"backend": "nftables"}));
    let pod = TestNs::new();
    let r = c.add(&lan, &pod.path(), "pod-a", "eth0");
    c.check(&lan, &pod.path(), "pod-a", "eth0", &r).unwrap();
    // Flush the DNAT chain behind the plugin's back.
    let (ok, msg) = sh(
        &lan.node.ns,
        "nft",
        &["flush", "chain", "ip", "cni_hostport", "hostports"],
    );
    assert!(ok, "{msg}");
    let (i, out) = c.check(&lan, &pod.path(), "pod-a", "eth0", &r).unwrap_err();
    assert_eq!(i, 1);
    let (code, msg) = out.err();
    assert_eq!(code, 106, "{msg}");
    assert!(msg.contains("hostports"), "{msg}");
    c.del(&lan, Some(&pod.path()), "pod-a", "eth0", Some(&r));
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
        let pm_only = Chain {
            plugins: vec![c.plugins[1].clone()],
            ..chain(&lan, "1.1.0", json!({"backend": backend}))
        };
        pm_only.gc(&lan, &[("pod-a", "eth0")]);
        let after = ruleset(&lan.node.ns);
        assert!(
            !after.contains("9090"),
            "{backend}: B's mapping survived GC: {after}"
        );
        assert_from(
            tcp_get(&lan.client.ns, "10.99.0.1:8080"),
            "A",
            CLIENT_V4,
            "A after GC",
        );
        c.del(&lan, Some(&a.path()), "pod-a", "eth0", Some(&ra));
        cb.del(&lan, Some(&b.path()), "pod-b", "eth0", Some(&rb));
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
    nl.conntrack_flows(false)
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
    c.del(&lan, Some(&pod.path()), "pod-a", "eth0", Some(&r));
    assert_eq!(
        udp_flows_to(&lan, &pod_ip),
        0,
        "DEL leaves a UDP flow to the deleted pod"
    );
}

#[test]
fn every_version_passes_prev_result_through() {
    let lan = Lan::new();
    for version in ["0.2.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
        let c = chain(&lan, version, json!({}));
        let pod = TestNs::new();
        let cid = format!("pod-{}", version.replace('.', "-"));
        let br = lan
            .call(
                &bin("bridge"),
                "ADD",
                Some(&pod.path()),
                &cid,
                "eth0",
                &c.stdin(0, None),
            )
            .ok();
        let out = lan.call(
            &bin("portmap"),
            "ADD",
            Some(&pod.path()),
            &cid,
            "eth0",
            &c.stdin(1, Some(&br)),
        );
        let pm = out.ok();
        assert_eq!(pm, br, "{version}: portmap changed the result");
        c.del(&lan, Some(&pod.path()), &cid, "eth0", Some(&pm));
    }
    assert!(portmap_rules(&lan).is_empty());
}

#[test]
fn chained_only_and_config_errors() {
    let lan = Lan::new();
    let c = chain(&lan, "1.0.0", json!({}));
    let pod = TestNs::new();
    let out = lan.call(
        &bin("portmap"),
        "ADD",
        Some(&pod.path()),
        "x",
        "eth0",
        &c.stdin(1, None),
    );
    let (code, msg) = out.err();
    assert_eq!(code, 7);
    assert!(msg.contains("chained"), "{msg}");
    let mut bad = c.stdin(1, Some(&json!({"cniVersion": "1.0.0"})));
    bad["runtimeConfig"] =
        json!({"portMappings": [{"hostPort": 1, "containerPort": 1, "protocol": "icmp"}]});
    let (code, _) = lan
        .call(&bin("portmap"), "ADD", Some(&pod.path()), "x", "eth0", &bad)
        .err();
    assert_eq!(code, 2);
    // VERSION with empty stdin.
    let v = Call::new(bin("portmap"), "VERSION").run().ok();
    assert!(v["supportedVersions"].as_array().unwrap().len() >= 6);
}

#[test]
fn conditions_go_through_nft_and_limit_who_is_mapped() {
    let lan = Lan::new();
    // Only clients of the uplink's subnet get the mapping.
    let c = chain(
        &lan,
        "1.0.0",
        json!({"conditionsV4": ["ip saddr 10.99.0.0/24"]}),
    );
    let pod_a = pod_with_servers("A");
    let pod_b = TestNs::new();
    let ra = c.add(&lan, &pod_a.path(), "pod-a", "eth0");
    let b_only = Chain::new("1.0.0", vec![c.plugins[0].clone()]);
    let rb = b_only.add(&lan, &pod_b.path(), "pod-b", "eth0");
    assert_from(
        tcp_get(&lan.client.ns, "10.99.0.1:8080"),
        "A",
        CLIENT_V4,
        "matching client",
    );
    assert!(
        tcp_blocked(&pod_b.ns, "10.99.0.1:8080"),
        "pod B matched a condition it does not meet"
    );
    let rules = sh(
        &lan.node.ns,
        "nft",
        &["list", "table", "ip", "cni_hostport"],
    )
    .1;
    assert!(
        rules.contains("ip saddr 10.99.0.0/24 jump hostip_hostports"),
        "{rules}"
    );
    c.check(&lan, &pod_a.path(), "pod-a", "eth0", &ra).unwrap();
    c.del(&lan, Some(&pod_a.path()), "pod-a", "eth0", Some(&ra));
    b_only.del(&lan, Some(&pod_b.path()), "pod-b", "eth0", Some(&rb));
    assert!(portmap_rules(&lan).is_empty());
}

#[test]
fn rules_written_over_netlink_read_back_as_nft_would_write_them() {
    let lan = Lan::new();
    let c = chain(&lan, "1.0.0", json!({}));
    let pod = TestNs::new();
    let r = c.add(&lan, &pod.path(), "pod-a", "eth0");
    let ip = ip_of(&r, true);
    let v4 = sh(
        &lan.node.ns,
        "nft",
        &["list", "table", "ip", "cni_hostport"],
    )
    .1;
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
    let v6 = sh(
        &lan.node.ns,
        "nft",
        &["list", "table", "ip6", "cni_hostport"],
    )
    .1;
    let ip6 = ip_of(&r, false);
    assert!(
        v6.contains(&format!("tcp dport 8080 dnat to [{ip6}]:80")),
        "{v6}"
    );
    c.del(&lan, Some(&pod.path()), "pod-a", "eth0", Some(&r));
}
