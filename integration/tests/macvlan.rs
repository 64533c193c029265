//! The macvlan binary on a veth master (macvlan on a veth works in this
//! kernel): every mode with real packets, the reference's result and
//! kernel state at 0.3.1 and 1.0.0, config errors, rollback, DEL without
//! master or netns, CHECK after damage, STATUS and GC reaching IPAM.

use rcni_integration::{
    Node, addrs_of, ip, link_names, merged, nl, ours_and_reference, ours_and_upstream, routes_of,
};
use rcni_netlink::MacvlanMode;
use rcni_testkit::{Call, PersistentNs, TestNs, bin, normalized_result, ping, reference_bin};
use serde_json::{Value, json};

fn conf(master: &str, mode: &str, addr: &str, extra: Value) -> Value {
    let c = json!({
        "cniVersion": "1.0.0", "name": "mv", "type": "macvlan", "master": master, "mode": mode,
        "ipam": {"type": "static", "addresses": [{"address": addr}]}
    });
    merged(c, extra)
}

/// macvlan links left in the node namespace.
fn node_macvlans(node: &Node) -> Vec<String> {
    nl(&node.ns.ns, async |n| n.links().await.unwrap())
        .into_iter()
        .filter(|l| l.kind.as_deref() == Some("macvlan"))
        .map(|l| l.name)
        .collect()
}

/// Pods `a` and `b` on m1, `c` on m2 (bridge mode), `mode` on m1.
/// Returns whether a reaches b and whether a reaches c across the wire.
fn reach(mode: &str) -> (bool, bool) {
    let node = Node::new().wired();
    let pods: Vec<(TestNs, Value, Value)> = [
        ("m1", mode, "10.62.0.1/24"),
        ("m1", mode, "10.62.0.2/24"),
        ("m2", "bridge", "10.62.0.3/24"),
    ]
    .into_iter()
    .enumerate()
    .filter(|(i, _)| mode != "passthru" || *i != 1)
    .map(|(i, (master, mode, addr))| {
        let p = TestNs::new();
        let c = conf(master, mode, addr, json!({}));
        let r = node
            .call(&bin("macvlan"), "ADD", &p.path(), &format!("c{i}"), &c)
            .ok();
        (p, c, r)
    })
    .collect();
    let a = &pods[0].0;
    let m1 = nl(&node.ns.ns, async |n| n.link_by_name("m1").await.unwrap());
    nl(&a.ns, async |n| {
        let l = n.link_by_name("eth0").await.unwrap();
        assert_eq!(l.kind.as_deref(), Some("macvlan"));
        assert_eq!(l.link, Some(m1.index), "on master m1");
        assert_eq!(
            n.macvlan_mode(l.index).await.unwrap(),
            Some(mode.parse::<MacvlanMode>().unwrap())
        );
        assert!(l.admin_up);
    });
    let ab = mode != "passthru" && ping(&a.ns, "10.62.0.2");
    let ac = ping(&a.ns, "10.62.0.3");
    for (i, (p, c, r)) in pods.iter().enumerate() {
        let with = Node::with_prev(c, r);
        let cid = format!("c{i}");
        node.call(&bin("macvlan"), "CHECK", &p.path(), &cid, &with)
            .ok();
        node.call(&bin("macvlan"), "DEL", &p.path(), &cid, &with)
            .ok();
        node.call(&bin("macvlan"), "DEL", &p.path(), &cid, &with)
            .ok();
        assert_eq!(link_names(&p.ns), ["lo"]);
    }
    assert!(node_macvlans(&node).is_empty());
    (ab, ac)
}

#[test]
fn every_mode_with_packets() {
    // bridge: macvlans of one master reach each other inside it.
    assert_eq!(reach("bridge"), (true, true));
    // private and vepa: not inside the master (a veth peer does not send
    // frames back the way a VEPA switch would); the wire is open.
    assert_eq!(reach("private"), (false, true));
    assert_eq!(reach("vepa"), (false, true));
    // passthru: the one macvlan the master may have.
    assert_eq!(reach("passthru"), (false, true));
}

#[test]
fn result_and_kernel_state_match_the_reference() {
    let cases = [
        // L3, MTU below the master's, a gateway, routes and DNS.
        json!({"mode": "private", "mtu": 1450, "dns": {"nameservers": ["10.63.0.1"]},
            "ipam": {"type": "static",
                "addresses": [{"address": "10.63.0.5/24", "gateway": "10.63.0.1"},
                              {"address": "fd63::5/64"}],
                "routes": [{"dst": "0.0.0.0/0"}, {"dst": "192.168.63.0/24", "gw": "10.63.0.254"}]}}),
        // L2 only, default mode, a MAC from runtimeConfig over the config's.
        json!({"ipam": {}, "mac": "02:00:00:63:00:01",
            "runtimeConfig": {"mac": "02:00:00:63:00:02"}}),
        // The MAC from CNI_ARGS (the test sets MAC=...) over the config's.
        json!({"mode": "vepa", "mac": "02:00:00:63:00:01"}),
    ];
    for v in ["0.3.1", "1.0.0"] {
        for (i, case) in cases.iter().enumerate() {
            let mut seen = Vec::new();
            for (plugin, path) in ours_and_reference("macvlan") {
                let node = Node::with_path(path).wired();
                let pod = TestNs::new();
                let c = merged(
                    conf("m1", "bridge", "10.63.1.5/24", json!({"cniVersion": v})),
                    case.clone(),
                );
                let call = |cmd: &str, c: &Value| {
                    let mut call = Call::new(&plugin, cmd)
                        .env("CNI_PATH", &node.cni_path)
                        .env("CNI_CONTAINERID", "diff")
                        .netns(&pod.path())
                        .stdin(c);
                    if i == 2 {
                        call = call.env("CNI_ARGS", "IgnoreUnknown=1;MAC=02:00:00:63:00:03");
                    }
                    call.run_in(&node.ns.ns)
                };
                let r = call("ADD", &c).ok();
                let l = nl(&pod.ns, async |n| n.link_by_name("eth0").await.unwrap());
                let mode = nl(&pod.ns, async |n| n.macvlan_mode(l.index).await.unwrap());
                let state = (
                    l.kind,
                    l.mtu,
                    l.admin_up,
                    mode,
                    // A configured MAC is the link's; a random one is not compared.
                    (i > 0).then_some(l.mac),
                    addrs_of(&pod.ns, "eth0"),
                    routes_of(&pod.ns),
                );
                let mut norm = normalized_result(&r, v);
                if i > 0 {
                    norm.interfaces[0].mac = r["interfaces"][0]["mac"].as_str().unwrap().into();
                }
                seen.push((norm, state));
                if v != "0.3.1" {
                    call("CHECK", &Node::with_prev(&c, &r)).ok();
                }
                call("DEL", &Node::with_prev(&c, &r)).ok();
                assert_eq!(link_names(&pod.ns), ["lo"]);
            }
            assert_eq!(seen[0].0, seen[1].0, "{v} case {i}: result");
            assert_eq!(seen[0].1, seen[1].1, "{v} case {i}: kernel state");
        }
    }
}

#[test]
fn default_master_and_link_in_container() {
    let node = Node::new().wired();
    // No master: the interface of the node's default route.
    ip(&node.ns.ns, "addr add 10.64.0.1/24 dev m2");
    ip(&node.ns.ns, "route add default via 10.64.0.254 dev m2");
    let p = TestNs::new();
    let mut c = conf("", "bridge", "10.64.0.5/24", json!({}));
    c.as_object_mut().unwrap().remove("master");
    let r = node.call(&bin("macvlan"), "ADD", &p.path(), "dm", &c).ok();
    let m2 = nl(&node.ns.ns, async |n| n.link_by_name("m2").await.unwrap());
    nl(&p.ns, async |n| {
        assert_eq!(n.link_by_name("eth0").await.unwrap().link, Some(m2.index))
    });
    let with = Node::with_prev(&c, &r);
    node.call(&bin("macvlan"), "CHECK", &p.path(), "dm", &with)
        .ok();
    node.call(&bin("macvlan"), "DEL", &p.path(), "dm", &with)
        .ok();

    // The master inside the container.
    let c = conf(
        "inner0",
        "bridge",
        "10.64.1.1/24",
        json!({"linkInContainer": true}),
    );
    let p = rcni_integration::lower_in_container(&node, "macvlan", &c);
    assert_eq!(link_names(&p.ns), ["lo", "inner1", "inner0"]);
    assert!(node_macvlans(&node).is_empty());
}

#[test]
fn config_errors_touch_nothing() {
    let node = Node::new().wired();
    let pod = TestNs::new();
    let hl = |extra: Value| {
        merged(
            json!({"cniVersion": "1.0.0", "name": "podnet", "type": "macvlan", "master": "m1",
                "ipam": {"type": "host-local", "dataDir": node.data.path(),
                         "ranges": [[{"subnet": "10.65.0.0/24"}]]}}),
            extra,
        )
    };
    for (extra, want_code, want) in [
        (json!({"mode": "source"}), 2, "\"mode\""),
        (
            json!({"mtu": 9000}),
            7,
            "invalid MTU 9000, must be [0, master MTU(1500)]",
        ),
        (json!({"mtu": -1}), 7, "invalid MTU -1"),
        (
            json!({"master": "nosuch0"}),
            7,
            "failed to lookup master \"nosuch0\"",
        ),
        (json!({"master": ""}), 7, "no default route interface found"),
        (
            json!({"linkInContainer": true}),
            7,
            "failed to lookup master \"m1\"",
        ),
        (
            json!({"mac": "02:00:00"}),
            7,
            "invalid args 02:00:00 for MAC addr",
        ),
    ] {
        let (code, msg) = node
            .call(
                &bin("macvlan"),
                "ADD",
                &pod.path(),
                "ctr",
                &hl(extra.clone()),
            )
            .err();
        assert_eq!(code, want_code, "{extra}: {msg}");
        assert!(msg.contains(want), "{extra}: {msg}");
    }
    // Go's LoadArgs: unknown CNI_ARGS keys need IgnoreUnknown.
    let (code, _) = Call::new(bin("macvlan"), "ADD")
        .env("CNI_CONTAINERID", "ctr")
        .env("CNI_ARGS", "FOO=bar")
        .netns(&pod.path())
        .stdin(&hl(json!({})))
        .run_in(&node.ns.ns)
        .err();
    assert_eq!(code, 4);
    // An existing CNI_IFNAME: code 4.
    let q = TestNs::new();
    ip(&q.ns, "link add eth0 type veth peer name x0");
    let (code, _) = node
        .call(&bin("macvlan"), "ADD", &q.path(), "dup", &hl(json!({})))
        .err();
    assert_eq!(code, 4);
    assert!(node.reservations().is_empty());
    assert_eq!(link_names(&pod.ns), ["lo"]);
    assert!(node_macvlans(&node).is_empty());
}

#[test]
fn failed_add_rolls_back() {
    let node = Node::new().wired();
    // Addressing fails after the link exists and IPAM reserved: both undone.
    let p = TestNs::new();
    let c = json!({"cniVersion": "1.0.0", "name": "podnet", "type": "macvlan", "master": "m1",
        "ipam": {"type": "host-local", "dataDir": node.data.path(), "ranges": [[{"subnet": "10.66.0.0/24"}]],
                 "routes": [{"dst": "192.168.0.0/16", "gw": "172.31.0.1"}]}});
    let (code, msg) = node.call(&bin("macvlan"), "ADD", &p.path(), "rb", &c).err();
    assert_eq!(code, 103, "{msg}");
    assert!(node.reservations().is_empty(), "IPAM released");
    assert_eq!(link_names(&p.ns), ["lo"], "the macvlan is rolled back");
    assert!(node_macvlans(&node).is_empty());
    // Passthru takes the master whole: a second passthru fails, and
    // leaves nothing.
    let c = conf("m1", "passthru", "10.66.1.1/24", json!({}));
    let first = TestNs::new();
    let r = node
        .call(&bin("macvlan"), "ADD", &first.path(), "pt1", &c)
        .ok();
    let second = TestNs::new();
    let (code, msg) = node
        .call(&bin("macvlan"), "ADD", &second.path(), "pt2", &c)
        .err();
    assert_eq!(code, 103, "{msg}");
    assert_eq!(link_names(&second.ns), ["lo"]);
    node.call(
        &bin("macvlan"),
        "DEL",
        &first.path(),
        "pt1",
        &Node::with_prev(&c, &r),
    )
    .ok();
}

/// An ADD killed before its rename, with no DEL since, left the pod's link
/// under its temporary name: the next ADD of that attachment removes it and
/// makes its own, and the pod ends with its one eth0.
#[test]
fn add_takes_over_a_killed_adds_temporary_link() {
    let node = Node::new().wired();
    let p = TestNs::new();
    let tmp = rcni_attach::temp_name("rerun", "eth0");
    ip(
        &p.ns,
        &format!("link add {tmp} type veth peer name leftover"),
    );
    let c = conf("m1", "bridge", "10.66.2.1/24", json!({}));
    let r = node
        .call(&bin("macvlan"), "ADD", &p.path(), "rerun", &c)
        .ok();
    let mut names = link_names(&p.ns);
    names.sort();
    assert_eq!(names, ["eth0", "lo"]);
    node.call(
        &bin("macvlan"),
        "DEL",
        &p.path(),
        "rerun",
        &Node::with_prev(&c, &r),
    )
    .ok();
    assert_eq!(link_names(&p.ns), ["lo"]);
}

#[test]
fn del_without_master_or_netns_and_check_after_damage() {
    let node = Node::new().wired();
    let c = json!({"cniVersion": "1.0.0", "name": "podnet", "type": "macvlan", "master": "m1",
        "ipam": {"type": "host-local", "dataDir": node.data.path(), "ranges": [[{"subnet": "10.67.0.0/24"}]]}});
    let p = TestNs::new();
    let r = node.call(&bin("macvlan"), "ADD", &p.path(), "a", &c).ok();
    let gone = PersistentNs::new();
    let path = gone.path.display().to_string();
    let rg = node.call(&bin("macvlan"), "ADD", &path, "g", &c).ok();
    gone.delete();
    assert_eq!(node.reservations().len(), 2);
    // The master removed (its macvlans go with it): the reference's DEL
    // fails looking the master up, ours succeeds and releases IPAM.
    ip(&node.ns.ns, "link del m1");
    let with = Node::with_prev(&c, &r);
    let (code, msg) = node
        .call(&reference_bin("macvlan"), "DEL", &p.path(), "a", &with)
        .err();
    assert!(code > 0 && msg.contains("not found"), "{code} {msg}");
    node.call(&bin("macvlan"), "DEL", &p.path(), "a", &with)
        .ok();
    node.call(&bin("macvlan"), "DEL", &p.path(), "a", &with)
        .ok();
    let with = Node::with_prev(&c, &rg);
    node.call(&bin("macvlan"), "DEL", &path, "g", &with).ok();
    node.call(&bin("macvlan"), "DEL", &path, "g", &with).ok();
    node.call(&bin("macvlan"), "DEL", "", "g", &with).ok();
    assert!(node.reservations().is_empty());

    let node = Node::new().wired();
    let c = merged(
        c,
        json!({"ipam": {"type": "host-local", "dataDir": node.data.path(),
        "ranges": [[{"subnet": "10.67.1.0/24"}]], "routes": [{"dst": "10.99.0.0/16"}]}}),
    );
    node.check_catches(
        &bin("macvlan"),
        &c,
        &[
            ("address removed", rcni_integration::remove_pod_address),
            ("link deleted", rcni_integration::delete_pod_eth0),
            ("route removed", |_, pod, _| {
                rcni_integration::remove_route(pod, |r| r.dst.to_string() == "10.99.0.0/16")
            }),
            ("MAC changed", |_, pod, _| {
                ip(pod, "link set eth0 address 02:00:00:67:00:09")
            }),
            ("mode changed", |_, pod, _| {
                ip(pod, "link set eth0 type macvlan mode private")
            }),
        ],
    );
    assert!(node.reservations().is_empty());
}

#[test]
fn status_and_gc_reach_ipam() {
    let node = Node::new().wired();
    let c = json!({"cniVersion": "1.1.0", "name": "podnet", "type": "macvlan", "master": "m1"});
    node.ipam_status_and_gc("macvlan", &c, "10.68.0");
}

/// A failed ADD lets an IPAM plugin other than host-local and static
/// release while the pod's link is still there, as the reference's
/// deferred `ipam.ExecDel` does (dhcp sends its DHCPRELEASE on that link),
/// and removes the link after: IPAM is a script whose DEL records whether
/// the link is still in the pod when it runs, and ADD fails after IPAM (a
/// route via a gateway the pod cannot reach).
#[test]
fn failed_add_releases_ipam_before_removing_the_link() {
    let (ipam, log) = rcni_integration::release_order_ipam();
    let node = Node::with_path(format!(
        "{}:{}",
        ipam.path().display(),
        rcni_testkit::bin_dir().display()
    ))
    .wired();
    let pod = TestNs::new();
    let c = json!({"cniVersion": "1.0.0", "name": "mv", "type": "macvlan", "master": "m1",
        "ipam": {"type": "fake-ipam"}});
    node.call(&bin("macvlan"), "ADD", &pod.path(), "ctr", &c)
        .err();
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "present\n");
    assert_eq!(link_names(&pod.ns), ["lo"]);
}

/// A result's DNS, `{}` when it has none (Go prints an empty struct, we
/// leave the key out).
fn dns_of(r: &Value) -> Value {
    r.get("dns").cloned().unwrap_or(json!({}))
}

/// What upstream changed after 1.1.1, side by side with v1.9.1: with IPAM
/// the link gets `ndisc_notify=1` beside `arp_notify=1` (v1.4.0: neighbours
/// learn the new MAC of an IPv6 address at once) and, having an IPv6
/// address, `keep_addr_on_down=1` (v1.7.0); an L2-only link gets neither.
/// The result's DNS is the config's `dns`, never IPAM's.
#[test]
fn notify_sysctls_keep_addr_and_dns_as_v191() {
    let get = |pod: &TestNs, key: &str| rcni_netlink::sysctl::get(&pod.ns, key).unwrap();
    let sysctls = |pod: &TestNs| {
        [
            "net/ipv4/conf/eth0/arp_notify",
            "net/ipv6/conf/eth0/ndisc_notify",
            "net/ipv6/conf/eth0/keep_addr_on_down",
        ]
        .map(|k| get(pod, k))
    };
    let ipam_dns = json!({"nameservers": ["10.65.0.53"], "search": ["ipam.example"]});
    for (plugin, path) in ours_and_upstream("macvlan") {
        let node = Node::with_path(path).wired();
        let what = plugin.display().to_string();
        let mut c = conf("m1", "bridge", "10.65.0.5/24", json!({}));
        c["ipam"]["addresses"] = json!([{"address": "10.65.0.5/24"}, {"address": "fd65::5/64"}]);
        c["ipam"]["dns"] = ipam_dns.clone();
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
            addrs_of(&pod.ns, "eth0").contains(&"fd65::5/64".to_string()),
            "{what}"
        );
        node.call(&plugin, "DEL", &pod.path(), "l3", &Node::with_prev(&c, &r))
            .ok();

        // The config's dns is the result's.
        let mut cd = c.clone();
        cd["dns"] = json!({"nameservers": ["10.65.0.1"]});
        let pod = TestNs::new();
        let r = node.call(&plugin, "ADD", &pod.path(), "dns", &cd).ok();
        assert_eq!(dns_of(&r), json!({"nameservers": ["10.65.0.1"]}), "{what}");
        node.call(
            &plugin,
            "DEL",
            &pod.path(),
            "dns",
            &Node::with_prev(&cd, &r),
        )
        .ok();

        // L2 only: no sysctl written.
        let l2 = conf("m1", "bridge", "unused", json!({"ipam": {}}));
        let pod = TestNs::new();
        let r = node.call(&plugin, "ADD", &pod.path(), "l2", &l2).ok();
        assert_eq!(sysctls(&pod), ["0", "0", "0"], "{what}");
        node.call(&plugin, "DEL", &pod.path(), "l2", &Node::with_prev(&l2, &r))
            .ok();
        assert!(node_macvlans(&node).is_empty());
    }
}
