//! The ipvlan binary with real ipvlan links. This host's kernel has no
//! ipvlan; scripts/test runs this binary under scripts/vm-run
//! (Debian's full kernel).

use rcni_integration::{
    Node, addrs_of, ip, link_names, merged, nl, ours_and_reference, ours_and_upstream, routes_of,
};
use rcni_netlink::IpvlanMode;
use rcni_testkit::{PersistentNs, TestNs, bin, normalized_result, ping, reference_bin};
use serde_json::{Value, json};

fn conf(master: &str, mode: &str, addr: &str, extra: Value) -> Value {
    let c = json!({
        "cniVersion": "1.0.0", "name": "ipv", "type": "ipvlan", "master": master, "mode": mode,
        "ipam": {"type": "static", "addresses": [{"address": addr}]}
    });
    merged(c, extra)
}

#[test]
fn every_mode_with_packets_check_and_del() {
    let node = Node::new().wired();
    for (i, mode) in ["l2", "l3", "l3s"].into_iter().enumerate() {
        let pods: Vec<(TestNs, Value, Value, String)> = [1, 2]
            .into_iter()
            .map(|host| {
                let p = TestNs::new();
                let c = conf("m1", mode, &format!("10.72.{i}.{host}/24"), json!({}));
                let cid = format!("{mode}-{host}");
                let r = node.call(&bin("ipvlan"), "ADD", &p.path(), &cid, &c).ok();
                (p, c, r, cid)
            })
            .collect();
        let (a, _, ra, _) = &pods[0];
        let m1 = nl(&node.ns.ns, async |n| n.link_by_name("m1").await.unwrap());
        assert_eq!(
            ra["interfaces"],
            json!([{"name": "eth0", "mac": m1.mac.unwrap().to_string(), "sandbox": a.path()}]),
            "an ipvlan has its master's MAC"
        );
        nl(&a.ns, async |n| {
            let l = n.link_by_name("eth0").await.unwrap();
            assert_eq!(l.kind.as_deref(), Some("ipvlan"));
            assert_eq!(l.link, Some(m1.index));
            assert_eq!(
                n.ipvlan_mode(l.index).await.unwrap(),
                Some(mode.parse::<IpvlanMode>().unwrap())
            );
        });
        assert!(
            ping(&a.ns, &format!("10.72.{i}.2")),
            "{mode}: ipvlans of one master"
        );
        for (p, c, r, cid) in &pods {
            let with = Node::with_prev(c, r);
            node.call(&bin("ipvlan"), "CHECK", &p.path(), cid, &with)
                .ok();
            node.call(&bin("ipvlan"), "DEL", &p.path(), cid, &with).ok();
            node.call(&bin("ipvlan"), "DEL", &p.path(), cid, &with).ok();
            assert_eq!(link_names(&p.ns), ["lo"]);
        }
    }
    // l2 across the wire, to an ipvlan of the other end.
    let (a, b) = (TestNs::new(), TestNs::new());
    node.call(
        &bin("ipvlan"),
        "ADD",
        &a.path(),
        "w1",
        &conf("m1", "l2", "10.72.9.1/24", json!({})),
    )
    .ok();
    node.call(
        &bin("ipvlan"),
        "ADD",
        &b.path(),
        "w2",
        &conf("m2", "l2", "10.72.9.2/24", json!({})),
    )
    .ok();
    assert!(ping(&a.ns, "10.72.9.2"), "l2 across the wire");

    // CHECK notices a changed mode and a removed address.
    let p = TestNs::new();
    let c = conf("m1", "l2", "10.72.8.1/24", json!({}));
    let r = node.call(&bin("ipvlan"), "ADD", &p.path(), "dmg", &c).ok();
    let with = Node::with_prev(&c, &r);
    ip(&p.ns, "link set eth0 type ipvlan mode l3");
    let (code, msg) = node
        .call(&bin("ipvlan"), "CHECK", &p.path(), "dmg", &with)
        .err();
    assert_eq!(code, 106, "{msg}");
    ip(&p.ns, "link set eth0 type ipvlan mode l2");
    node.call(&bin("ipvlan"), "CHECK", &p.path(), "dmg", &with)
        .ok();
    ip(&p.ns, "addr del 10.72.8.1/24 dev eth0");
    let (code, msg) = node
        .call(&bin("ipvlan"), "CHECK", &p.path(), "dmg", &with)
        .err();
    assert_eq!(code, 106, "{msg}");
    node.call(&bin("ipvlan"), "DEL", &p.path(), "dmg", &with)
        .ok();
}

#[test]
fn result_and_kernel_state_match_the_reference() {
    let cases = [
        json!({"mode": "l3", "mtu": 1450, "dns": {"nameservers": ["10.73.0.1"]},
            "ipam": {"type": "static",
                "addresses": [{"address": "10.73.0.5/24", "gateway": "10.73.0.1"}, {"address": "fd73::5/64"}],
                "routes": [{"dst": "0.0.0.0/0"}, {"dst": "192.168.73.0/24", "gw": "10.73.0.254"}]}}),
        json!({}),
        // Chained: master and addresses from prevResult (no master, no ipam).
        json!({"master": "", "ipam": {}, "prevResult": {"cniVersion": "1.0.0",
            "interfaces": [{"name": "m1"}],
            "ips": [{"address": "10.73.2.5/24", "gateway": "10.73.2.1", "interface": 0}],
            "routes": [{"dst": "10.99.0.0/16"}]}}),
    ];
    for v in ["0.3.1", "1.0.0"] {
        for (i, case) in cases.iter().enumerate() {
            let mut seen = Vec::new();
            for (plugin, path) in ours_and_reference("ipvlan") {
                let node = Node::with_path(path).wired();
                let pod = TestNs::new();
                let mut c = merged(
                    conf("m1", "", "10.73.1.5/24", json!({"cniVersion": v})),
                    case.clone(),
                );
                if let Some(p) = c.get_mut("prevResult") {
                    p["cniVersion"] = json!(v);
                    if v == "0.3.1" {
                        p["ips"][0]["version"] = json!("4");
                    }
                }
                let r = node.call(&plugin, "ADD", &pod.path(), "diff", &c).ok();
                let l = nl(&pod.ns, async |n| n.link_by_name("eth0").await.unwrap());
                let m1 = nl(&node.ns.ns, async |n| n.link_by_name("m1").await.unwrap());
                let mode = nl(&pod.ns, async |n| n.ipvlan_mode(l.index).await.unwrap());
                let state = (
                    l.kind,
                    l.mtu,
                    l.admin_up,
                    mode,
                    l.mac == m1.mac,
                    addrs_of(&pod.ns, "eth0"),
                    routes_of(&pod.ns),
                );
                seen.push((normalized_result(&r, v), state));
                let with = Node::with_prev(&c, &r);
                // The reference's CHECK looks up a master named "" when
                // the config names none, and fails.
                if v != "0.3.1" && i != 2 {
                    node.call(&plugin, "CHECK", &pod.path(), "diff", &with).ok();
                }
                node.call(&plugin, "DEL", &pod.path(), "diff", &with).ok();
                assert_eq!(link_names(&pod.ns), ["lo"]);
            }
            assert_eq!(seen[0].0, seen[1].0, "{v} case {i}: result");
            assert_eq!(seen[0].1, seen[1].1, "{v} case {i}: kernel state");
        }
    }
}

#[test]
fn chained_check_errors_rollback_and_del() {
    let node = Node::new().wired();
    // Chained without master: our CHECK passes, the reference's cannot.
    let p = TestNs::new();
    let c = json!({"cniVersion": "1.0.0", "name": "ipv", "type": "ipvlan",
        "prevResult": {"cniVersion": "1.0.0", "interfaces": [{"name": "m1"}],
            "ips": [{"address": "10.74.0.5/24", "interface": 0}]}});
    let r = node.call(&bin("ipvlan"), "ADD", &p.path(), "ch", &c).ok();
    let with = Node::with_prev(&c, &r);
    node.call(&bin("ipvlan"), "CHECK", &p.path(), "ch", &with)
        .ok();
    let (code, msg) = node
        .call(&reference_bin("ipvlan"), "CHECK", &p.path(), "ch", &with)
        .err();
    assert!(code > 0 && msg.contains("master"), "{code} {msg}");
    node.call(&bin("ipvlan"), "DEL", &p.path(), "ch", &with)
        .ok();

    let hl = |extra: Value| {
        merged(
            json!({"cniVersion": "1.0.0", "name": "podnet", "type": "ipvlan", "master": "m1",
                "ipam": {"type": "host-local", "dataDir": node.data.path(),
                         "ranges": [[{"subnet": "10.74.1.0/24"}]]}}),
            extra,
        )
    };
    let q = TestNs::new();
    for (extra, want_code, want) in [
        (json!({"mode": "l4"}), 2, "\"mode\""),
        (json!({"mtu": 9000}), 7, "invalid MTU 9000"),
        (
            json!({"master": "nosuch0"}),
            7,
            "failed to lookup master \"nosuch0\"",
        ),
        (json!({"master": ""}), 7, "no default route interface found"),
        (json!({"ipam": {}}), 7, "prevResult"),
        (
            json!({"master": "", "prevResult": {"cniVersion": "1.0.0",
                "interfaces": [{"name": "a"}, {"name": "b"}]}}),
            7,
            "chained master failure",
        ),
        // Addressing fails after the link exists and IPAM reserved.
        (
            json!({"ipam": {"type": "host-local", "dataDir": node.data.path(),
                "ranges": [[{"subnet": "10.74.1.0/24"}]],
                "routes": [{"dst": "192.168.0.0/16", "gw": "172.31.0.1"}]}}),
            103,
            "",
        ),
    ] {
        let (code, msg) = node
            .call(&bin("ipvlan"), "ADD", &q.path(), "ctr", &hl(extra.clone()))
            .err();
        assert_eq!(code, want_code, "{extra}: {msg}");
        assert!(msg.contains(want), "{extra}: {msg}");
    }
    assert!(node.reservations().is_empty(), "IPAM released");
    assert_eq!(link_names(&q.ns), ["lo"]);

    // The master in the container.
    let c = conf(
        "inner0",
        "l2",
        "10.74.2.1/24",
        json!({"linkInContainer": true}),
    );
    let _lic = rcni_integration::lower_in_container(&node, "ipvlan", &c);

    // DEL: twice, without the netns, without the master.
    let c = hl(json!({}));
    let gone = PersistentNs::new();
    let path = gone.path.display().to_string();
    let rg = node.call(&bin("ipvlan"), "ADD", &path, "g", &c).ok();
    gone.delete();
    let with = Node::with_prev(&c, &rg);
    node.call(&bin("ipvlan"), "DEL", &path, "g", &with).ok();
    node.call(&bin("ipvlan"), "DEL", &path, "g", &with).ok();
    node.call(&bin("ipvlan"), "DEL", "", "g", &with).ok();
    let p = TestNs::new();
    let r = node.call(&bin("ipvlan"), "ADD", &p.path(), "m", &c).ok();
    ip(&node.ns.ns, "link del m1");
    node.call(
        &bin("ipvlan"),
        "DEL",
        &p.path(),
        "m",
        &Node::with_prev(&c, &r),
    )
    .ok();
    assert!(node.reservations().is_empty());
    // STATUS and GC reach IPAM.
    let c = merged(c, json!({"cniVersion": "1.1.0"}));
    node.status(&bin("ipvlan"), &c).ok();
    node.gc(&bin("ipvlan"), &c, json!([])).ok();
}

/// What upstream changed after 1.1.1, side by side with v1.9.1: the link
/// gets `ndisc_notify=1` beside `arp_notify=1` (v1.4.0) and, with an IPv6
/// address, `keep_addr_on_down=1` (v1.7.0); the result's DNS is the
/// config's `dns`, neither IPAM's nor, chained, prevResult's.
#[test]
fn notify_sysctls_keep_addr_and_dns_as_v191() {
    let sysctls = |pod: &TestNs| {
        [
            "net/ipv4/conf/eth0/arp_notify",
            "net/ipv6/conf/eth0/ndisc_notify",
            "net/ipv6/conf/eth0/keep_addr_on_down",
        ]
        .map(|k| rcni_netlink::sysctl::get(&pod.ns, k).unwrap())
    };
    let dns_of = |r: &Value| r.get("dns").cloned().unwrap_or(json!({}));
    for (plugin, path) in ours_and_upstream("ipvlan") {
        let what = plugin.display().to_string();
        let node = Node::with_path(path).wired();
        let mut c = conf("m1", "l2", "10.74.0.5/24", json!({}));
        c["ipam"]["addresses"] = json!([{"address": "10.74.0.5/24"}, {"address": "fd74::5/64"}]);
        c["ipam"]["dns"] = json!({"nameservers": ["10.74.0.53"]});
        let pod = TestNs::new();
        let r = node.call(&plugin, "ADD", &pod.path(), "l3", &c).ok();
        assert_eq!(sysctls(&pod), ["1", "1", "1"], "{what}");
        assert_eq!(
            dns_of(&r),
            json!({}),
            "{what}: IPAM's DNS is not the result's"
        );
        ip(&pod.ns, "link set eth0 down");
        ip(&pod.ns, "link set eth0 up");
        assert!(
            addrs_of(&pod.ns, "eth0").contains(&"fd74::5/64".to_string()),
            "{what}"
        );
        node.call(&plugin, "DEL", &pod.path(), "l3", &Node::with_prev(&c, &r))
            .ok();

        // Chained: prevResult's addresses; its DNS is dropped for the
        // config's (none here), as v1.9.1's `result.DNS = n.DNS`.
        let chained = merged(
            conf("m1", "l2", "unused", json!({})),
            json!({"ipam": {}, "prevResult": {"cniVersion": "1.0.0",
                "interfaces": [{"name": "m1"}],
                "ips": [{"address": "10.74.1.5/24", "interface": 0}],
                "dns": {"nameservers": ["10.74.1.53"]}}}),
        );
        let pod = TestNs::new();
        let r = node.call(&plugin, "ADD", &pod.path(), "ch", &chained).ok();
        assert_eq!(sysctls(&pod)[..2], ["1", "1"], "{what}");
        assert_eq!(
            dns_of(&r),
            json!({}),
            "{what}: prevResult's DNS is not the result's"
        );
        node.call(
            &plugin,
            "DEL",
            &pod.path(),
            "ch",
            &Node::with_prev(&chained, &r),
        )
        .ok();
    }
}
