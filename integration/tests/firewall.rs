//! firewall: ingress policies with real traffic between bridges, pods and
//! the outside (open, same-bridge, isolated), the admin chain, a
//! default-deny forward chain, CHECK, DEL, GC, interop with the
//! reference's iptables rules, and the default backend (iptables here: no
//! firewalld) getting pods through iptables' `FORWARD` policy DROP.
//! firewalld itself: `firewalld.rs`.

use rcni_integration::lab::chain::*;
use rcni_testkit::{TestNs, bin, ping, reference_bin};
use serde_json::{Value, json};
use std::path::Path;

/// A bridge network `name` on `bridge` with `subnet` (v4 /24 and v6 /64
/// prefixes given without the host part), chained with firewall.
fn net(name: &str, bridge: &str, v4: &str, v6: &str, fw: Value, data: &Path) -> Chain {
    let br = json!({
        "type": "bridge", "bridge": bridge, "isGateway": true, "isDefaultGateway": true,
        "ipam": {"type": "host-local", "dataDir": data,
                 "ranges": [[{"subnet": format!("{v4}.0/24")}], [{"subnet": format!("{v6}::/64")}]]}
    });
    let mut c = Chain::new("1.0.0", vec![br, merged(json!({"type": "firewall"}), fw)]);
    c.name = name.into();
    c
}

/// Network A: bridge cnia, 10.88.0.0/24 and fd88:0:0:a::/64.
fn net_a(fw: Value, data: &Path) -> Chain {
    net("neta", "cnia", "10.88.0", "fd88:0:0:a", fw, data)
}

/// Network B: bridge cnib, 10.77.0.0/24 and fd77:0:0:b::/64.
fn net_b(fw: Value, data: &Path) -> Chain {
    net("netb", "cnib", "10.77.0", "fd77:0:0:b", fw, data)
}

/// A LAN whose client answers on port 80.
fn lan_with_client_server() -> Lan {
    let lan = Lan::new();
    tcp_server(&lan.client.ns, 80, "client");
    lan
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

fn assert_reaches(from: &TestNs, to_ip: &str, port: u16, what: &str) {
    assert!(tcp_get(&from.ns, &addr(to_ip, port)).is_some(), "{what}");
}

fn assert_blocked(from: &TestNs, to_ip: &str, port: u16, what: &str) {
    assert!(tcp_blocked(&from.ns, &addr(to_ip, port)), "{what}");
}

fn nft_ruleset(lan: &Lan) -> String {
    lan.on_node("nft", &["list", "ruleset"])
}

fn nft_has(lan: &Lan, needle: &str) -> bool {
    nft_ruleset(lan).contains(needle)
}

/// Our nftables table (empty when it does not exist); iptables-nft's
/// tables are in the ruleset too.
fn nft_ours(lan: &Lan) -> String {
    lan.on_node("nft", &["list", "table", "inet", "cni_firewall"])
}

#[test]
fn same_bridge_blocks_other_bridges_and_nothing_else() {
    for backend in ["nftables", "iptables"] {
        let lan = lan_with_client_server();
        let data = tempfile::tempdir().unwrap();
        let fw = json!({"backend": backend, "ingressPolicy": "same-bridge"});
        let na = net_a(fw.clone(), data.path());
        let nb = net_b(fw.clone(), data.path());
        let (a1, a2, b1) = (pod("A1"), pod("A2"), pod("B1"));
        let ra1 = na.add(&lan, &a1.path(), "a1", "eth0");
        let ra2 = na.add(&lan, &a2.path(), "a2", "eth0");
        let rb1 = nb.add(&lan, &b1.path(), "b1", "eth0");
        let (a1_ip, b1_ip) = (ip_of(&ra1, true), ip_of(&rb1, true));
        let b1_ip6 = ip_of(&rb1, false);
        for (from, to, what) in [
            (&a1, &b1_ip, "bridge A reached bridge B"),
            (&b1, &a1_ip, "bridge B reached bridge A"),
            (&a1, &b1_ip6, "v6 across bridges"),
        ] {
            assert_blocked(from, to, 80, &format!("{backend}: {what}"));
        }
        for (from, to, what) in [
            (&a2, a1_ip.as_str(), "same bridge blocked"),
            (&a1, CLIENT_V4, "pod to outside blocked"),
            (&lan.client, &a1_ip, "outside to pod blocked"),
        ] {
            assert_reaches(from, to, 80, &format!("{backend}: {what}"));
        }
        for (c, p, r, cid) in [
            (&na, &a1, &ra1, "a1"),
            (&na, &a2, &ra2, "a2"),
            (&nb, &b1, &rb1, "b1"),
        ] {
            c.check(&lan, &p.path(), cid, "eth0", r)
                .unwrap_or_else(|(i, o)| panic!("{backend} CHECK {i}: {}", o.stdout));
        }
        na.del_pod(&lan, &a1, "a1", &ra1);
        if backend == "nftables" {
            // a2 still needs bridge A's isolation.
            assert!(nft_has(&lan, "bridge cnia same-bridge"));
        }
        na.del_pod(&lan, &a2, "a2", &ra2);
        nb.del_pod(&lan, &b1, "b1", &rb1);
        if backend == "nftables" {
            let rules = nft_ruleset(&lan);
            assert!(
                !rules.contains("accept comment") && !rules.contains("drop comment"),
                "{rules}"
            );
        } else {
            let t = lan.on_node("iptables-save", &["-t", "filter"]);
            assert!(!t.contains("-s 10.") && !t.contains("-d 10."), "{t}");
        }
    }
}

#[test]
fn open_policy_lets_bridges_talk() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    let na = net_a(json!({}), data.path());
    let nb = net_b(json!({}), data.path());
    let (a1, b1) = (pod("A1"), pod("B1"));
    let ra1 = na.add(&lan, &a1.path(), "a1", "eth0");
    let rb1 = nb.add(&lan, &b1.path(), "b1", "eth0");
    assert_reaches(&a1, &ip_of(&rb1, true), 80, "bridge A to bridge B");
    assert_reaches(
        &b1,
        &ip_of(&ra1, false),
        80,
        "bridge B to bridge A over IPv6",
    );
    // The default backend without firewalld is iptables, as the reference's.
    assert!(!nft_has(&lan, "cni_firewall"));
    let t = lan.on_node("iptables-save", &["-t", "filter"]);
    assert!(
        t.contains(&format!(
            "-A CNI-FORWARD -s {}/32 -j ACCEPT",
            ip_of(&ra1, true)
        )),
        "{t}"
    );
    na.del_pod(&lan, &a1, "a1", &ra1);
    nb.del_pod(&lan, &b1, "b1", &rb1);
}

#[test]
fn isolated_pod_is_cut_off_from_its_bridge_neighbours_only() {
    let lan = lan_with_client_server();
    let data = tempfile::tempdir().unwrap();
    // Bridged traffic meets iptables only with br_netfilter; the nftables
    // backend isolates in a bridge table.
    let iso = net_a(
        json!({"backend": "nftables", "ingressPolicy": "isolated"}),
        data.path(),
    );
    let open = net_a(json!({"backend": "nftables"}), data.path());
    let (a1, a2) = (pod("A1"), pod("A2"));
    let ra1 = iso.add(&lan, &a1.path(), "a1", "eth0");
    let ra2 = open.add(&lan, &a2.path(), "a2", "eth0");
    let a1_ip = ip_of(&ra1, true);
    let (a2_ip, a1_ip6) = (ip_of(&ra2, true), ip_of(&ra1, false));
    for (from, to, what) in [
        (&a2, &a1_ip, "neighbour reached the isolated pod"),
        (&a1, &a2_ip, "isolated pod reached its neighbour"),
        (&a2, &a1_ip6, "neighbour reached the isolated pod over IPv6"),
    ] {
        assert_blocked(from, to, 80, what);
    }
    assert!(ping(&a1.ns, "10.88.0.1"), "isolated pod lost its gateway");
    assert_reaches(&a1, CLIENT_V4, 80, "isolated pod lost the outside");
    assert_reaches(&lan.client, &a1_ip, 80, "outside lost the isolated pod");
    iso.check_ok(&lan, &a1, "a1", &ra1);
    iso.del_pod(&lan, &a1, "a1", &ra1);
    let bridge_table = lan.on_node("nft", &["list", "table", "bridge", "cni_firewall"]);
    assert!(!bridge_table.contains("drop"), "{bridge_table}");
    // Gone with the pod's rules: the neighbour is alone again and fine.
    open.del_pod(&lan, &a2, "a2", &ra2);
}

#[test]
fn admin_chain_and_default_deny() {
    let lan = lan_with_client_server();
    let data = tempfile::tempdir().unwrap();
    let na = net_a(json!({"backend": "nftables"}), data.path());
    let a1 = pod("A1");
    let ra1 = na.add(&lan, &a1.path(), "a1", "eth0");
    let a1_ip = ip_of(&ra1, true);
    // The operator's override: drop port 81 of this pod.
    let rule = format!("ip daddr {a1_ip} tcp dport 81 drop");
    lan.on_node_ok(
        "nft",
        &["add", "rule", "inet", "cni_firewall", "CNI-ADMIN", &rule],
    );
    assert_reaches(&lan.client, &a1_ip, 80, "outside to pod");
    assert_blocked(&lan.client, &a1_ip, 81, "admin chain drop ignored");
    // Default deny: only what the plugin allows passes: the pod's own
    // connections, not new ones towards it.
    let policy = "{ policy drop ; }";
    lan.on_node_ok(
        "nft",
        &["add", "chain", "inet", "cni_firewall", "forward", policy],
    );
    assert_reaches(&a1, CLIENT_V4, 80, "pod's connection out dropped");
    assert_blocked(
        &lan.client,
        &a1_ip,
        80,
        "new inbound connection passed a default-deny forward",
    );
    // Another ADD keeps the operator's policy and admin rules.
    let a2 = pod("A2");
    let ra2 = na.add(&lan, &a2.path(), "a2", "eth0");
    let rules = lan.on_node("nft", &["list", "table", "inet", "cni_firewall"]);
    assert!(
        rules.contains("policy drop") && rules.contains("dport 81 drop"),
        "{rules}"
    );
    na.del_pod(&lan, &a1, "a1", &ra1);
    na.del_pod(&lan, &a2, "a2", &ra2);
}

#[test]
fn iptables_rules_interoperate_with_the_reference() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    let na = net_a(
        json!({"backend": "iptables", "ingressPolicy": "same-bridge"}),
        data.path(),
    );
    let a1 = pod("A1");
    let br = na.only(0);
    let r = br.add(&lan, &a1.path(), "a1", "eth0");
    let conf = na.stdin(1, Some(&r));
    let a1_ip = ip_of(&r, true);
    let per_ip = |lan: &Lan| {
        lan.on_node("iptables-save", &["-t", "filter"])
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
        assert_success(&lan.run(&adder, "ADD", &a1, "a1", &conf));
        assert!(per_ip(&lan));
        assert_checks(&lan, &checker, &adder, &a1, "a1", &conf);
        assert_success(&lan.run(&deleter, "DEL", &a1, "a1", &conf));
        assert!(
            !per_ip(&lan),
            "{} left {}'s rules",
            deleter.display(),
            adder.display()
        );
    }
    br.del_pod(&lan, &a1, "a1", &r);
}

/// The state an ADD killed after firewall (before the runtime cached the
/// chain's result) leaves: iptables rules and no prevResult for the DEL.
/// The per-address rules carry nothing but the address; DEL finds it on
/// the pod's interface, which the bridge's DEL removes only afterwards.
#[test]
fn iptables_del_without_prev_result_after_a_lost_add() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    let na = net_a(json!({"backend": "iptables"}), data.path());
    let a1 = pod("A1");
    let (r, _) = na.add_in_two(&lan, &a1, "a1");
    let rules = |lan: &Lan| {
        [
            ("iptables-save", ip_of(&r, true)),
            ("ip6tables-save", ip_of(&r, false)),
        ]
        .into_iter()
        .filter(|(tool, ip)| {
            lan.on_node(tool, &["-t", "filter"])
                .contains(&format!("{ip}/"))
        })
        .count()
    };
    assert_eq!(rules(&lan), 2, "ADD wrote rules for both families");
    let mut bare = na.stdin(1, None);
    bare.as_object_mut().unwrap().remove("prevResult");
    assert_success(&lan.run(&bin("firewall"), "DEL", &a1, "a1", &bare));
    assert_eq!(
        rules(&lan),
        0,
        "{}",
        lan.on_node("iptables-save", &["-t", "filter"])
    );
    na.del_pod(&lan, &a1, "a1", &r);
}

#[test]
fn check_del_gc() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    let mut na = net_a(
        json!({"backend": "nftables", "ingressPolicy": "same-bridge"}),
        data.path(),
    );
    na.version = "1.1.0".into();
    let (a1, a2) = (pod("A1"), pod("A2"));
    let ra1 = na.add(&lan, &a1.path(), "a1", "eth0");
    let ra2 = na.add(&lan, &a2.path(), "a2", "eth0");
    na.check_ok(&lan, &a1, "a1", &ra1);
    lan.on_node_ok(
        "nft",
        &["flush", "chain", "inet", "cni_firewall", "containers"],
    );
    na.check_fails(&lan, &a1, "a1", "eth0", &ra1);
    // ADD again repairs; GC keeps a1 and drops a2.
    let ra1 = na.run(&lan, 1, "ADD", &a1, "a1", Some(&ra1)).ok();
    na.check_ok(&lan, &a1, "a1", &ra1);
    let ra2b = na.run(&lan, 1, "ADD", &a2, "a2", Some(&ra2)).ok();
    na.only(1).gc(&lan, &[("a1", "eth0")]);
    na.check_ok(&lan, &a1, "a1", &ra1);
    let out = na.run(&lan, 1, "CHECK", &a2, "a2", Some(&ra2b));
    assert_eq!(out.err().0, 106);
    // DEL without prevResult still finds the nftables rules.
    let mut bare = na.stdin(1, None);
    bare.as_object_mut().unwrap().remove("prevResult");
    assert_success(&lan.call(&bin("firewall"), "DEL", None, "a1", "eth0", &bare));
    let rules = nft_ruleset(&lan);
    assert!(!rules.contains(&ip_of(&ra1, true)), "{rules}");
    na.del_pod(&lan, &a1, "a1", &ra1);
    na.del_pod(&lan, &a2, "a2", &ra2);
}

#[test]
fn versions_and_chained_only() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    let net = |version: &str| {
        let mut c = net_a(json!({}), data.path());
        c.version = version.into();
        c
    };
    chained_add_per_version(&lan, &["0.4.0", "1.0.0", "1.1.0"], net, |br| br);
    let p = TestNs::new();
    let (code, _) = net("0.3.1").add_unchained(&lan, &p);
    assert_eq!(code, 1);
    let (code, msg) = net("1.0.0").add_unchained(&lan, &p);
    assert_eq!(code, 7);
    assert!(msg.contains("prevResult"), "{msg}");
    let v = version_of("firewall");
    assert_eq!(v["supportedVersions"], json!(["0.4.0", "1.0.0", "1.1.0"]));
}

#[test]
fn rules_written_over_netlink_read_back_as_nft_would_write_them() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    let na = net_a(
        json!({"backend": "nftables", "ingressPolicy": "isolated"}),
        data.path(),
    );
    let a1 = pod("A1");
    let r = na.add(&lan, &a1.path(), "a1", "eth0");
    let (ip, ip6) = (ip_of(&r, true), ip_of(&r, false));
    let veth = host_veth(&r);
    let rules = nft_ruleset(&lan);
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
    na.del_pod(&lan, &a1, "a1", &r);
}

/// podman's firewall config (`"backend": ""`) and none at all on a node
/// whose iptables `filter FORWARD` policy is DROP, as Docker leaves it: the
/// default backend is iptables, whose CNI-FORWARD accept is what lets the
/// pod out (an accept in any other table cannot undo iptables' drop).
#[test]
fn default_backend_gets_pods_through_an_iptables_forward_drop() {
    for fw in [json!({"backend": ""}), json!({})] {
        let lan = lan_with_client_server();
        for tool in ["iptables", "ip6tables"] {
            lan.on_node_ok(tool, &["-P", "FORWARD", "DROP"]);
        }
        let data = tempfile::tempdir().unwrap();
        let na = net_a(fw.clone(), data.path());
        let a1 = pod("A1");
        let r = na.add(&lan, &a1.path(), "a1", "eth0");
        // The first packet of each family crosses: no neighbour is
        // resolved beforehand (the bridge's and the uplink's link-local
        // addresses are not tentative, see the bridge plugin).
        for dst in [CLIENT_V4, CLIENT_V6] {
            assert!(ping(&a1.ns, dst), "{fw}: pod to {dst} dropped");
        }
        assert_reaches(&a1, CLIENT_V4, 80, &format!("{fw}: pod's TCP out"));
        let t = lan.on_node("iptables-save", &["-t", "filter"]);
        for want in [
            ":CNI-FORWARD - ",
            "-A FORWARD -m comment --comment \"CNI firewall plugin rules\" -j CNI-FORWARD",
        ] {
            assert!(t.contains(want), "{fw}: missing {want:?} in {t}");
        }
        na.check_ok(&lan, &a1, "a1", &r);
        na.del_pod(&lan, &a1, "a1", &r);
        let t = lan.on_node("iptables-save", &["-t", "filter"]);
        assert!(!t.contains(&ip_of(&r, true)), "{fw}: {t}");
    }
}

/// `"backend": "nftables"` where iptables' `filter FORWARD` drops (policy
/// DROP as Docker sets it, or a final unconditional DROP/REJECT): the
/// reference reads that value as its default and writes its accept into
/// iptables, so the pod's traffic passes; ours must too, and does with the
/// reference's iptables rules (an accept in our nftables table cannot undo
/// iptables' drop). Where FORWARD accepts, the nftables table is used.
#[test]
fn nftables_backend_uses_iptables_where_its_forward_drops() {
    let fw = json!({"backend": "nftables"});
    let policy_drop: &[(&str, &[&str])] = &[
        ("iptables", &["-P", "FORWARD", "DROP"]),
        ("ip6tables", &["-P", "FORWARD", "DROP"]),
    ];
    let final_drop: &[(&str, &[&str])] = &[
        ("iptables", &["-A", "FORWARD", "-j", "DROP"]),
        ("ip6tables", &["-A", "FORWARD", "-j", "REJECT"]),
    ];
    let v6_reject: &[(&str, &[&str])] = &[("ip6tables", &["-A", "FORWARD", "-j", "REJECT"])];
    for (setup, drops) in [
        (policy_drop, true),
        (final_drop, true),
        (v6_reject, true),
        (&[][..], false),
    ] {
        let lan = lan_with_client_server();
        for (tool, args) in setup {
            lan.on_node_ok(tool, args);
        }
        let data = tempfile::tempdir().unwrap();
        let na = net_a(fw.clone(), data.path());
        let a1 = pod("A1");
        let r = na.add(&lan, &a1.path(), "a1", "eth0");
        let what = format!("{setup:?}");
        for (from, to) in [(&lan.node, CLIENT_V6), (&a1, "fd88:0:0:a::1")] {
            assert!((0..3).any(|_| ping(&from.ns, to)), "{to} never answered");
        }
        for dst in [CLIENT_V4, CLIENT_V6] {
            assert!(ping(&a1.ns, dst), "{what}: pod to {dst} dropped");
        }
        assert_reaches(&a1, CLIENT_V4, 80, &format!("{what}: pod's TCP out"));
        let ipt = lan.on_node("iptables-save", &["-t", "filter"]);
        let ip6t = lan.on_node("ip6tables-save", &["-t", "filter"]);
        let a1_ip = ip_of(&r, true);
        if drops {
            for t in [&ipt, &ip6t] {
                assert!(
                    t.contains(":CNI-FORWARD - "),
                    "{what}: no CNI-FORWARD in {t}"
                );
            }
            assert!(ipt.contains(&a1_ip), "{what}: {ipt}");
            assert!(
                !nft_ours(&lan).contains(&a1_ip),
                "{what}: {}",
                nft_ours(&lan)
            );
        } else {
            assert!(!ipt.contains("CNI-FORWARD"), "{what}: {ipt}");
            assert!(nft_ours(&lan).contains(&format!("ip saddr {a1_ip} accept")));
        }
        na.check_ok(&lan, &a1, "a1", &r);
        na.del_pod(&lan, &a1, "a1", &r);
        let ipt = lan.on_node("iptables-save", &["-t", "filter"]);
        assert!(!ipt.contains(&a1_ip), "{what}: {ipt}");
        assert!(
            !nft_ours(&lan).contains(&a1_ip),
            "{what}: {}",
            nft_ours(&lan)
        );
    }
}

/// The same where the node's iptables is legacy (x_tables): its FORWARD
/// policy DROP is read with `iptables-legacy -S`, and the reference's
/// iptables rules are chosen.
#[test]
fn nftables_backend_sees_a_legacy_iptables_forward_drop() {
    let lan = Lan::new();
    lan.on_node_ok("iptables-legacy", &["-P", "FORWARD", "DROP"]);
    let data = tempfile::tempdir().unwrap();
    let na = net_a(json!({"backend": "nftables"}), data.path());
    let a1 = pod("A1");
    let r = na.add(&lan, &a1.path(), "a1", "eth0");
    let a1_ip = ip_of(&r, true);
    let ipt = lan.on_node("iptables-save", &["-t", "filter"]);
    assert!(
        ipt.contains(":CNI-FORWARD - ") && ipt.contains(&a1_ip),
        "{ipt}"
    );
    assert!(!nft_ours(&lan).contains(&a1_ip), "{}", nft_ours(&lan));
    na.del_pod(&lan, &a1, "a1", &r);
}
