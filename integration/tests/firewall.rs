//! firewall: ingress policies with real traffic between bridges, pods and
//! the outside (open, same-bridge, isolated), the admin chain, a
//! default-deny forward chain, CHECK, DEL, GC, and interop with the
//! reference's iptables rules.

mod chain;

use chain::*;
use rcni_testkit::{Call, TestNs, bin, ping, reference_bin};
use serde_json::{Value, json};

/// A bridge network `name` on `bridge` with `subnet` (v4 /24 and v6 /64
/// prefixes given without the host part), chained with firewall.
fn net(
    lan: &Lan,
    name: &str,
    bridge: &str,
    v4: &str,
    v6: &str,
    fw: Value,
    data: &std::path::Path,
) -> Chain {
    let br = json!({
        "type": "bridge", "bridge": bridge, "isGateway": true, "isDefaultGateway": true,
        "ipam": {"type": "host-local", "dataDir": data,
                 "ranges": [[{"subnet": format!("{v4}.0/24")}], [{"subnet": format!("{v6}::/64")}]]}
    });
    let mut f = json!({"type": "firewall"});
    for (k, v) in fw.as_object().unwrap() {
        f[k] = v.clone();
    }
    let _ = lan;
    let mut c = Chain::new("1.0.0", vec![br, f]);
    c.name = name.into();
    c
}

fn pod(tag: &str) -> TestNs {
    let p = TestNs::new();
    tcp_server(&p.ns, 80, tag);
    tcp_server(&p.ns, 81, tag);
    p
}

fn addr(ip: &str, port: u16) -> String {
    if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    }
}

fn reach(from: &TestNs, to_ip: &str, port: u16) -> bool {
    tcp_get(&from.ns, &addr(to_ip, port)).is_some()
}

fn blocked(from: &TestNs, to_ip: &str, port: u16) -> bool {
    tcp_blocked(&from.ns, &addr(to_ip, port))
}

fn nft_has(lan: &Lan, needle: &str) -> bool {
    sh(&lan.node.ns, "nft", &["list", "ruleset"])
        .1
        .contains(needle)
}

#[test]
fn same_bridge_blocks_other_bridges_and_nothing_else() {
    for backend in ["nftables", "iptables"] {
        let lan = Lan::new();
        tcp_server(&lan.client.ns, 80, "client");
        let data = tempfile::tempdir().unwrap();
        let fw = json!({"backend": backend, "ingressPolicy": "same-bridge"});
        let na = net(
            &lan,
            "neta",
            "cnia",
            "10.88.0",
            "fd88:0:0:a",
            fw.clone(),
            data.path(),
        );
        let nb = net(
            &lan,
            "netb",
            "cnib",
            "10.77.0",
            "fd77:0:0:b",
            fw.clone(),
            data.path(),
        );
        let (a1, a2, b1) = (pod("A1"), pod("A2"), pod("B1"));
        let ra1 = na.add(&lan, &a1.path(), "a1", "eth0");
        let ra2 = na.add(&lan, &a2.path(), "a2", "eth0");
        let rb1 = nb.add(&lan, &b1.path(), "b1", "eth0");
        let (a1_ip, b1_ip) = (ip_of(&ra1, true), ip_of(&rb1, true));
        assert!(
            blocked(&a1, &b1_ip, 80),
            "{backend}: bridge A reached bridge B"
        );
        assert!(
            blocked(&b1, &a1_ip, 80),
            "{backend}: bridge B reached bridge A"
        );
        assert!(
            blocked(&a1, &ip_of(&rb1, false), 80),
            "{backend}: v6 across bridges"
        );
        assert!(reach(&a2, &a1_ip, 80), "{backend}: same bridge blocked");
        assert!(
            reach(&a1, CLIENT_V4, 80),
            "{backend}: pod to outside blocked"
        );
        assert!(
            reach(&lan.client, &a1_ip, 80),
            "{backend}: outside to pod blocked"
        );
        for (c, p, r, cid) in [
            (&na, &a1, &ra1, "a1"),
            (&na, &a2, &ra2, "a2"),
            (&nb, &b1, &rb1, "b1"),
        ] {
            c.check(&lan, &p.path(), cid, "eth0", r)
                .unwrap_or_else(|(i, o)| panic!("{backend} CHECK {i}: {}", o.stdout));
        }
        na.del(&lan, Some(&a1.path()), "a1", "eth0", Some(&ra1));
        if backend == "nftables" {
            // a2 still needs bridge A's isolation.
            assert!(nft_has(&lan, "bridge cnia same-bridge"));
        }
        na.del(&lan, Some(&a2.path()), "a2", "eth0", Some(&ra2));
        nb.del(&lan, Some(&b1.path()), "b1", "eth0", Some(&rb1));
        if backend == "nftables" {
            let rules = sh(&lan.node.ns, "nft", &["list", "ruleset"]).1;
            assert!(
                !rules.contains("accept comment") && !rules.contains("drop comment"),
                "{rules}"
            );
        } else {
            let t = sh(&lan.node.ns, "iptables-save", &["-t", "filter"]).1;
            assert!(!t.contains("-s 10.") && !t.contains("-d 10."), "{t}");
        }
    }
}

#[test]
fn open_policy_lets_bridges_talk() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    let na = net(
        &lan,
        "neta",
        "cnia",
        "10.88.0",
        "fd88:0:0:a",
        json!({}),
        data.path(),
    );
    let nb = net(
        &lan,
        "netb",
        "cnib",
        "10.77.0",
        "fd77:0:0:b",
        json!({}),
        data.path(),
    );
    let (a1, b1) = (pod("A1"), pod("B1"));
    let ra1 = na.add(&lan, &a1.path(), "a1", "eth0");
    let rb1 = nb.add(&lan, &b1.path(), "b1", "eth0");
    assert!(reach(&a1, &ip_of(&rb1, true), 80));
    assert!(reach(&b1, &ip_of(&ra1, false), 80));
    // The default backend here is nftables.
    assert!(nft_has(&lan, "table inet cni_firewall"));
    na.del(&lan, Some(&a1.path()), "a1", "eth0", Some(&ra1));
    nb.del(&lan, Some(&b1.path()), "b1", "eth0", Some(&rb1));
}

#[test]
fn isolated_pod_is_cut_off_from_its_bridge_neighbours_only() {
    let lan = Lan::new();
    tcp_server(&lan.client.ns, 80, "client");
    let data = tempfile::tempdir().unwrap();
    let iso = net(
        &lan,
        "neta",
        "cnia",
        "10.88.0",
        "fd88:0:0:a",
        json!({"ingressPolicy": "isolated"}),
        data.path(),
    );
    let open = net(
        &lan,
        "neta",
        "cnia",
        "10.88.0",
        "fd88:0:0:a",
        json!({}),
        data.path(),
    );
    let (a1, a2) = (pod("A1"), pod("A2"));
    let ra1 = iso.add(&lan, &a1.path(), "a1", "eth0");
    let ra2 = open.add(&lan, &a2.path(), "a2", "eth0");
    let a1_ip = ip_of(&ra1, true);
    assert!(
        blocked(&a2, &a1_ip, 80),
        "neighbour reached the isolated pod"
    );
    assert!(
        blocked(&a1, &ip_of(&ra2, true), 80),
        "isolated pod reached its neighbour"
    );
    assert!(
        blocked(&a2, &ip_of(&ra1, false), 80),
        "neighbour reached the isolated pod over IPv6"
    );
    assert!(ping(&a1.ns, "10.88.0.1"), "isolated pod lost its gateway");
    assert!(reach(&a1, CLIENT_V4, 80), "isolated pod lost the outside");
    assert!(
        reach(&lan.client, &a1_ip, 80),
        "outside lost the isolated pod"
    );
    iso.check(&lan, &a1.path(), "a1", "eth0", &ra1).unwrap();
    iso.del(&lan, Some(&a1.path()), "a1", "eth0", Some(&ra1));
    let bridge_table = sh(
        &lan.node.ns,
        "nft",
        &["list", "table", "bridge", "cni_firewall"],
    )
    .1;
    assert!(!bridge_table.contains("drop"), "{bridge_table}");
    // Gone with the pod's rules: the neighbour is alone again and fine.
    open.del(&lan, Some(&a2.path()), "a2", "eth0", Some(&ra2));
}

#[test]
fn admin_chain_and_default_deny() {
    let lan = Lan::new();
    tcp_server(&lan.client.ns, 80, "client");
    let data = tempfile::tempdir().unwrap();
    let na = net(
        &lan,
        "neta",
        "cnia",
        "10.88.0",
        "fd88:0:0:a",
        json!({}),
        data.path(),
    );
    let a1 = pod("A1");
    let ra1 = na.add(&lan, &a1.path(), "a1", "eth0");
    let a1_ip = ip_of(&ra1, true);
    // The operator's override: drop port 81 of this pod.
    let rule = format!("ip daddr {a1_ip} tcp dport 81 drop");
    let (ok, msg) = sh(
        &lan.node.ns,
        "nft",
        &["add", "rule", "inet", "cni_firewall", "CNI-ADMIN", &rule],
    );
    assert!(ok, "{msg}");
    assert!(reach(&lan.client, &a1_ip, 80));
    assert!(blocked(&lan.client, &a1_ip, 81), "admin chain drop ignored");
    // Default deny: only what the plugin allows passes: the pod's own
    // connections, not new ones towards it.
    let (ok, msg) = sh(
        &lan.node.ns,
        "nft",
        &[
            "add",
            "chain",
            "inet",
            "cni_firewall",
            "forward",
            "{ policy drop ; }",
        ],
    );
    assert!(ok, "{msg}");
    assert!(reach(&a1, CLIENT_V4, 80), "pod's connection out dropped");
    assert!(
        blocked(&lan.client, &a1_ip, 80),
        "new inbound connection passed a default-deny forward"
    );
    // Another ADD keeps the operator's policy and admin rules.
    let a2 = pod("A2");
    let ra2 = na.add(&lan, &a2.path(), "a2", "eth0");
    let rules = sh(
        &lan.node.ns,
        "nft",
        &["list", "table", "inet", "cni_firewall"],
    )
    .1;
    assert!(
        rules.contains("policy drop") && rules.contains("dport 81 drop"),
        "{rules}"
    );
    na.del(&lan, Some(&a1.path()), "a1", "eth0", Some(&ra1));
    na.del(&lan, Some(&a2.path()), "a2", "eth0", Some(&ra2));
}

#[test]
fn iptables_rules_interoperate_with_the_reference() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    let na = net(
        &lan,
        "neta",
        "cnia",
        "10.88.0",
        "fd88:0:0:a",
        json!({"backend": "iptables", "ingressPolicy": "same-bridge"}),
        data.path(),
    );
    let a1 = pod("A1");
    let br = Chain {
        plugins: vec![na.plugins[0].clone()],
        ..net(
            &lan,
            "neta",
            "cnia",
            "10.88.0",
            "fd88:0:0:a",
            json!({}),
            data.path(),
        )
    };
    let r = br.add(&lan, &a1.path(), "a1", "eth0");
    let conf = na.stdin(1, Some(&r));
    let a1_ip = ip_of(&r, true);
    let per_ip = |lan: &Lan| {
        sh(&lan.node.ns, "iptables-save", &["-t", "filter"])
            .1
            .contains(&format!("-s {a1_ip}/32 -j ACCEPT"))
    };
    for (adder, checker, deleter) in [
        (
            bin("firewall"),
            reference_bin("firewall"),
            reference_bin("firewall"),
        ),
        (reference_bin("firewall"), bin("firewall"), bin("firewall")),
    ] {
        let out = lan.call(&adder, "ADD", Some(&a1.path()), "a1", "eth0", &conf);
        assert_eq!(out.code, 0, "{}", out.stdout);
        assert!(per_ip(&lan));
        let out = lan.call(&checker, "CHECK", Some(&a1.path()), "a1", "eth0", &conf);
        assert_eq!(
            out.code,
            0,
            "{} checking {}: {}",
            checker.display(),
            adder.display(),
            out.stdout
        );
        let out = lan.call(&deleter, "DEL", Some(&a1.path()), "a1", "eth0", &conf);
        assert_eq!(out.code, 0, "{}", out.stdout);
        assert!(
            !per_ip(&lan),
            "{} left {}'s rules",
            deleter.display(),
            adder.display()
        );
    }
    br.del(&lan, Some(&a1.path()), "a1", "eth0", Some(&r));
}

#[test]
fn check_del_gc() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    let mut na = net(
        &lan,
        "neta",
        "cnia",
        "10.88.0",
        "fd88:0:0:a",
        json!({"ingressPolicy": "same-bridge"}),
        data.path(),
    );
    na.version = "1.1.0".into();
    let (a1, a2) = (pod("A1"), pod("A2"));
    let ra1 = na.add(&lan, &a1.path(), "a1", "eth0");
    let ra2 = na.add(&lan, &a2.path(), "a2", "eth0");
    na.check(&lan, &a1.path(), "a1", "eth0", &ra1).unwrap();
    let (ok, msg) = sh(
        &lan.node.ns,
        "nft",
        &["flush", "chain", "inet", "cni_firewall", "containers"],
    );
    assert!(ok, "{msg}");
    let (i, out) = na.check(&lan, &a1.path(), "a1", "eth0", &ra1).unwrap_err();
    assert_eq!(i, 1);
    assert_eq!(out.err().0, 106);
    // ADD again repairs; GC keeps a1 and drops a2.
    let ra1 = lan
        .call(
            &bin("firewall"),
            "ADD",
            Some(&a1.path()),
            "a1",
            "eth0",
            &na.stdin(1, Some(&ra1)),
        )
        .ok();
    na.check(&lan, &a1.path(), "a1", "eth0", &ra1).unwrap();
    let ra2b = lan
        .call(
            &bin("firewall"),
            "ADD",
            Some(&a2.path()),
            "a2",
            "eth0",
            &na.stdin(1, Some(&ra2)),
        )
        .ok();
    let fw_only = Chain {
        plugins: vec![na.plugins[1].clone()],
        ..na.clone()
    };
    fw_only.gc(&lan, &[("a1", "eth0")]);
    na.check(&lan, &a1.path(), "a1", "eth0", &ra1).unwrap();
    let out = lan.call(
        &bin("firewall"),
        "CHECK",
        Some(&a2.path()),
        "a2",
        "eth0",
        &na.stdin(1, Some(&ra2b)),
    );
    assert_eq!(out.err().0, 106);
    // DEL without prevResult still finds the nftables rules.
    let mut bare = na.stdin(1, None);
    bare.as_object_mut().unwrap().remove("prevResult");
    let out = lan.call(&bin("firewall"), "DEL", None, "a1", "eth0", &bare);
    assert_eq!(out.code, 0, "{}", out.stdout);
    let rules = sh(&lan.node.ns, "nft", &["list", "ruleset"]).1;
    assert!(!rules.contains(&ip_of(&ra1, true)), "{rules}");
    na.del(&lan, Some(&a1.path()), "a1", "eth0", Some(&ra1));
    na.del(&lan, Some(&a2.path()), "a2", "eth0", Some(&ra2));
}

#[test]
fn versions_and_chained_only() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    for version in ["0.4.0", "1.0.0", "1.1.0"] {
        let mut c = net(
            &lan,
            "neta",
            "cnia",
            "10.88.0",
            "fd88:0:0:a",
            json!({}),
            data.path(),
        );
        c.version = version.into();
        let p = TestNs::new();
        let cid = format!("p{}", version.replace('.', ""));
        let br = lan
            .call(
                &bin("bridge"),
                "ADD",
                Some(&p.path()),
                &cid,
                "eth0",
                &c.stdin(0, None),
            )
            .ok();
        let fw = lan
            .call(
                &bin("firewall"),
                "ADD",
                Some(&p.path()),
                &cid,
                "eth0",
                &c.stdin(1, Some(&br)),
            )
            .ok();
        assert_eq!(fw, br, "{version}");
        c.del(&lan, Some(&p.path()), &cid, "eth0", Some(&fw));
    }
    let mut c = net(
        &lan,
        "neta",
        "cnia",
        "10.88.0",
        "fd88:0:0:a",
        json!({}),
        data.path(),
    );
    c.version = "0.3.1".into();
    let p = TestNs::new();
    let (code, _) = lan
        .call(
            &bin("firewall"),
            "ADD",
            Some(&p.path()),
            "x",
            "eth0",
            &c.stdin(1, None),
        )
        .err();
    assert_eq!(code, 1);
    c.version = "1.0.0".into();
    let (code, msg) = lan
        .call(
            &bin("firewall"),
            "ADD",
            Some(&p.path()),
            "x",
            "eth0",
            &c.stdin(1, None),
        )
        .err();
    assert_eq!(code, 7);
    assert!(msg.contains("prevResult"), "{msg}");
    let v = Call::new(bin("firewall"), "VERSION").run().ok();
    assert_eq!(v["supportedVersions"], json!(["0.4.0", "1.0.0", "1.1.0"]));
}

#[test]
fn rules_written_over_netlink_read_back_as_nft_would_write_them() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    let na = net(
        &lan,
        "neta",
        "cnia",
        "10.88.0",
        "fd88:0:0:a",
        json!({"ingressPolicy": "isolated"}),
        data.path(),
    );
    let a1 = pod("A1");
    let r = na.add(&lan, &a1.path(), "a1", "eth0");
    let (ip, ip6, veth) = (
        ip_of(&r, true),
        ip_of(&r, false),
        r["interfaces"][1]["name"].as_str().unwrap().to_string(),
    );
    let rules = sh(&lan.node.ns, "nft", &["list", "ruleset"]).1;
    for want in [
        format!("ip daddr {ip} ct state established,related accept"),
        format!("ip saddr {ip} accept"),
        format!("ip6 saddr {ip6} accept"),
        "iifname \"cnia\" oifname != \"cnia\" jump isolation_stage2".to_string(),
        "oifname \"cnia\" drop".to_string(),
        format!("iifname \"{veth}\" drop"),
        "type filter hook forward priority filter".to_string(),
        "jump CNI-ADMIN".to_string(),
    ] {
        assert!(rules.contains(&want), "missing {want:?} in {rules}");
    }
    na.del(&lan, Some(&a1.path()), "a1", "eth0", Some(&r));
}
