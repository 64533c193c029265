//! The bridge binary with our IPAM plugins: a node namespace holds the
//! bridge, pods are fresh namespaces; real packets, kernel state, CHECK
//! after damage, every DEL path, rollback, and the reference side by side.

use rcni_integration::{
    Damage, Node, addr_of, addrs_of, delete_pod_eth0, ip, ip_link_json, nl, ours_and_reference,
    ours_and_upstream, remove_pod_address, remove_route, routes_of,
};
use rcni_netlink::{Family, MacvlanMode};
use rcni_testkit::{Call, TestNs, bin, normalized_result, ping};
use serde_json::json;

#[test]
fn pods_reach_each_other_and_the_gateway_dual_stack() {
    let node = Node::new();
    let (a, b) = (TestNs::new(), TestNs::new());
    let conf = node.conf("1.0.0", json!({}));
    let ra = node.add(&a, "ctr-a", &conf);
    let rb = node.add(&b, "ctr-b", &conf);

    // The reference shape: [bridge, host veth, container veth(sandbox)], ips on 2.
    let ifs = ra["interfaces"].as_array().unwrap();
    assert_eq!(ifs.len(), 3);
    assert_eq!(ifs[0]["name"], "cni0");
    assert!(ifs[1]["name"].as_str().unwrap().starts_with("veth"));
    assert_eq!(
        ifs[2],
        json!({"name": "eth0", "mac": ifs[2]["mac"], "sandbox": a.path()})
    );
    assert!(
        ra["ips"]
            .as_array()
            .unwrap()
            .iter()
            .all(|i| i["interface"] == 2)
    );
    assert_eq!(ra["ips"][0]["gateway"], "10.88.0.1");
    assert_eq!(ra["ips"][1]["gateway"], "fd88::1");
    assert_eq!(
        ra["routes"],
        json!([{"dst":"0.0.0.0/0","gw":"10.88.0.1"},{"dst":"::/0","gw":"fd88::1"}])
    );

    // Kernel state: host veth enslaved to the bridge, gateway on the bridge.
    let host_veth = ifs[1]["name"].as_str().unwrap().to_string();
    nl(&node.ns.ns, async |n| {
        let br = n.link_by_name("cni0").await.unwrap();
        assert_eq!(br.kind.as_deref(), Some("bridge"));
        let v = n.link_by_name(&host_veth).await.unwrap();
        assert_eq!(v.master, Some(br.index));
        assert!(v.oper_up);
        // A port has no address of its own, not even IPv6 link-local.
        assert_eq!(n.addresses(Some(v.index)).await.unwrap(), vec![]);
        assert_eq!(ifs[0]["mac"], br.mac.unwrap().to_string());
    });
    let addrs = addrs_of(&node.ns.ns, "cni0");
    assert!(
        addrs.contains(&"10.88.0.1/24".into()) && addrs.contains(&"fd88::1/64".into()),
        "{addrs:?}"
    );
    nl(&a.ns, async |n| {
        let l = n.link_by_name("eth0").await.unwrap();
        assert_eq!(l.mac.unwrap().to_string(), ifs[2]["mac"].as_str().unwrap());
        let routes = n.routes(Family::All).await.unwrap();
        assert!(
            routes
                .iter()
                .any(|r| r.dst.prefix() == 0 && r.gateway == Some("10.88.0.1".parse().unwrap()))
        );
    });
    assert_eq!(
        rcni_netlink::sysctl::get(&node.ns.ns, "net.ipv4.ip_forward")
            .unwrap()
            .trim(),
        "1"
    );
    // The reference's sysctls: ours go over netlink or only where the
    // value differs, with the same outcome.
    let get = |ns, key: &str| rcni_netlink::sysctl::get(ns, key).unwrap();
    assert_eq!(get(&a.ns, "net/ipv6/conf/eth0/accept_dad"), "0");
    assert_eq!(get(&a.ns, "net/ipv4/conf/eth0/arp_notify"), "1");
    assert_eq!(get(&node.ns.ns, "net/ipv6/conf/cni0/accept_ra"), "0");
    assert_eq!(get(&node.ns.ns, "net/ipv6/conf/cni0/accept_dad"), "0");

    for (from, to) in [(&a, &rb), (&b, &ra)] {
        assert!(ping(&from.ns, &addr_of(to, true)), "pod to pod over IPv4");
        assert!(ping(&from.ns, &addr_of(to, false)), "pod to pod over IPv6");
    }
    assert!(
        ping(&a.ns, "10.88.0.1") && ping(&a.ns, "fd88::1"),
        "pod to gateway"
    );
    assert!(ping(&node.ns.ns, &addr_of(&rb, true)), "node to pod");

    for (pod, cid, r) in [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)] {
        node.check_and_del(&bin("bridge"), pod, cid, &conf, r);
    }
    node.assert_nothing_left();
}

#[test]
fn every_spec_version_gets_its_result_shape() {
    let node = Node::new();
    for v in rcni_cni::version::ALL {
        let pod = TestNs::new();
        let conf = node.conf(v, json!({}));
        let r = node.add(&pod, "ctr", &conf);
        assert_eq!(r["cniVersion"], *v);
        match *v {
            "0.1.0" | "0.2.0" => {
                assert!(
                    r["ip4"]["ip"].as_str().unwrap().starts_with("10.88.0."),
                    "{r}"
                );
                assert_eq!(r["ip4"]["gateway"], "10.88.0.1");
                assert_eq!(
                    r["ip4"]["routes"],
                    json!([{"dst":"0.0.0.0/0","gw":"10.88.0.1"}])
                );
                assert!(r["ip6"]["ip"].as_str().unwrap().starts_with("fd88::"));
            }
            _ => {
                assert_eq!(r["interfaces"].as_array().unwrap().len(), 3);
                assert_eq!(
                    r["ips"][0]["version"].is_string(),
                    v.starts_with("0."),
                    "{v}: {r}"
                );
            }
        }
        node.call(&bin("bridge"), "DEL", &pod.path(), "ctr", &conf)
            .ok();
        assert!(node.reservations().is_empty(), "{v}");
    }
}

#[test]
fn check_passes_after_add_and_fails_after_damage() {
    let node = Node::new();
    let damage: [(&str, Damage); 4] = [
        ("address removed", remove_pod_address),
        ("default route removed", |_, pod, _| {
            remove_route(pod, |r| r.dst.prefix() == 0)
        }),
        ("host veth taken off the bridge", |node, _, r| {
            let name = r["interfaces"][1]["name"].as_str().unwrap().to_string();
            nl(node, async |n| {
                let l = n.link_by_name(&name).await.unwrap();
                n.set_nomaster(l.index).await.unwrap();
            });
        }),
        ("container interface deleted", delete_pod_eth0),
    ];
    node.check_catches(&bin("bridge"), &node.conf("1.0.0", json!({})), &damage);
}

#[test]
fn del_is_idempotent_and_works_without_the_netns() {
    let node = Node::new();
    let conf = node.conf("1.0.0", json!({}));
    node.del_survives_repeats_and_a_deleted_netns(&bin("bridge"), &conf);
    // Empty CNI_NETNS: the reservation is still released.
    let pod = TestNs::new();
    let r = node.add(&pod, "nonetns", &conf);
    assert_eq!(node.reservations().len(), 2);
    node.call(
        &bin("bridge"),
        "DEL",
        "",
        "nonetns",
        &Node::with_prev(&conf, &r),
    )
    .ok();
    assert!(node.reservations().is_empty());
    node.call(&bin("bridge"), "DEL", &pod.path(), "nonetns", &conf)
        .ok();
    node.assert_nothing_left();
}

/// IPAM runs concurrently with the link setup, so a link failure can come
/// while the reservation is still being made: it must be released once made,
/// and an ADD that IPAM refused (a duplicate) must not release the address
/// the first ADD holds.
#[test]
fn failed_add_releases_a_concurrent_reservation_but_never_anothers() {
    let node = Node::new();
    let pod = TestNs::new();
    let conf = node.conf("1.0.0", json!({}));
    node.add(&pod, "first", &conf);
    let held = node.reservations();
    assert_eq!(held.len(), 2, "{held:?}");
    // Same attachment again: eth0 exists and IPAM reports a duplicate.
    let (code, msg) = node
        .call(&bin("bridge"), "ADD", &pod.path(), "first", &conf)
        .err();
    assert_eq!(code, 4, "{msg}");
    assert_eq!(
        node.reservations(),
        held,
        "the first ADD keeps its addresses"
    );
    // Another container into the same netns: IPAM succeeds, the link fails.
    let (code, msg) = node
        .call(&bin("bridge"), "ADD", &pod.path(), "second", &conf)
        .err();
    assert_eq!(code, 4, "{msg}");
    assert_eq!(node.reservations(), held, "the second ADD's are released");
    // A netns that does not exist fails before any link work.
    let (code, msg) = node
        .call(
            &bin("bridge"),
            "ADD",
            "/proc/self/nonexistent",
            "third",
            &conf,
        )
        .err();
    assert_eq!(code, 104, "{msg}");
    assert_eq!(node.reservations(), held);
    node.call(&bin("bridge"), "DEL", &pod.path(), "first", &conf)
        .ok();
    assert!(node.reservations().is_empty());
}

#[test]
fn failed_add_rolls_back_link_and_reservation() {
    let node = Node::new();
    // The bridge holds a different IPv4 address and forceAddress is off: ADD
    // fails after IPAM has reserved and the veth exists.
    nl(&node.ns.ns, async |n| {
        let br = n.ensure_bridge("cni0", None).await.unwrap();
        n.add_address(br.index, "10.88.0.254/24".parse().unwrap())
            .await
            .unwrap();
    });
    let pod = TestNs::new();
    let conf = node.conf("1.0.0", json!({}));
    let (code, msg) = node
        .call(&bin("bridge"), "ADD", &pod.path(), "ctr", &conf)
        .err();
    assert_eq!(code, 7, "{msg}");
    assert!(
        msg.contains("already has an IP address different from 10.88.0.1/24"),
        "{msg}"
    );
    assert!(node.reservations().is_empty(), "IPAM released on failure");
    nl(&pod.ns, async |n| {
        assert!(n.find_link("eth0").await.unwrap().is_none())
    });
    assert_eq!(
        node.host_veths(),
        Vec::<String>::new(),
        "the host veth is rolled back"
    );
    // forceAddress replaces it.
    let r = node.add(
        &pod,
        "ctr",
        &node.conf("1.0.0", json!({"forceAddress": true})),
    );
    let a = addrs_of(&node.ns.ns, "cni0");
    assert!(
        a.contains(&"10.88.0.1/24".into()) && !a.contains(&"10.88.0.254/24".into()),
        "{a:?}"
    );
    node.call(
        &bin("bridge"),
        "DEL",
        &pod.path(),
        "ctr",
        &Node::with_prev(&conf, &r),
    )
    .ok();
    // An existing interface of that name in the container: error, nothing touched.
    nl(&pod.ns, async |n| {
        n.create_veth("eth0", "other0", None, None).await.unwrap();
    });
    assert_eq!(
        node.call(&bin("bridge"), "ADD", &pod.path(), "ctr", &conf)
            .err()
            .0,
        4
    );
    assert!(node.reservations().is_empty());
}

/// Hairpin with real frames: a second address behind the same port (a
/// macvlan on the pod's eth0, in a namespace of its own) reaches the pod
/// only if the bridge sends frames back out of the port they came in on.
#[test]
fn hairpin_reflects_frames_back_into_the_port() {
    let node = Node::new();
    let conf = node.conf("1.0.0", json!({"hairpinMode": true}));
    let pod = TestNs::new();
    let r = node.add(&pod, "hp", &conf);
    let port = r["interfaces"][1]["name"].as_str().unwrap().to_string();
    let behind = TestNs::new();
    nl(&pod.ns, async |n| {
        let eth0 = n.link_by_name("eth0").await.unwrap();
        let mv = n
            .create_macvlan("mv0", eth0.index, MacvlanMode::Bridge)
            .await
            .unwrap();
        n.move_to_netns(mv.index, &behind.ns).await.unwrap();
    });
    nl(&behind.ns, async |n| {
        let mv = n.link_by_name("mv0").await.unwrap();
        n.add_address(mv.index, "10.88.0.200/24".parse().unwrap())
            .await
            .unwrap();
        n.set_up(mv.index).await.unwrap();
    });
    let pod_ip = addr_of(&r, true);
    assert!(ping(&behind.ns, &pod_ip), "hairpin on: reflected");
    // The same topology with the flag cleared: the bridge drops what would
    // go back out of the ingress port (neighbour entries flushed first, so
    // ARP has to cross the bridge again).
    rcni_testkit::ip(
        &node.ns.ns,
        &format!("link set {port} type bridge_slave hairpin off"),
    );
    rcni_testkit::ip(&behind.ns, "neigh flush all");
    rcni_testkit::ip(&pod.ns, "neigh flush all");
    assert!(!ping(&behind.ns, &pod_ip), "hairpin off: not reflected");
    node.call(&bin("bridge"), "DEL", &pod.path(), "hp", &conf)
        .ok();
}

#[test]
fn hairpin_and_port_isolation() {
    let node = Node::new();
    let conf = node.conf("1.0.0", json!({"hairpinMode": true}));
    let p = TestNs::new();
    let r = node.add(&p, "hp", &conf);
    let port = r["interfaces"][1]["name"].as_str().unwrap().to_string();
    assert_eq!(
        ip_link_json(&node.ns.ns, &port)["linkinfo"]["info_slave_data"]["hairpin"],
        true
    );
    node.call(&bin("bridge"), "DEL", &p.path(), "hp", &conf)
        .ok();

    let conf = node.conf("1.0.0", json!({"portIsolation": true}));
    let (a, b) = (TestNs::new(), TestNs::new());
    let ra = node.add(&a, "iso-a", &conf);
    let rb = node.add(&b, "iso-b", &conf);
    let port = ra["interfaces"][1]["name"].as_str().unwrap().to_string();
    assert_eq!(
        ip_link_json(&node.ns.ns, &port)["linkinfo"]["info_slave_data"]["isolated"],
        true
    );
    assert!(
        ping(&a.ns, "10.88.0.1"),
        "an isolated port still reaches the gateway"
    );
    assert!(
        !ping(&a.ns, &addr_of(&rb, true)),
        "isolated ports do not reach each other"
    );
    let _ = (ra, rb);
    let bad = node.conf("1.0.0", json!({"hairpinMode": true, "promiscMode": true}));
    assert_eq!(
        node.call(&bin("bridge"), "ADD", &TestNs::new().path(), "x", &bad)
            .err()
            .0,
        7
    );
}

#[test]
fn mtu_promisc_mac_dad_and_l2_options() {
    let node = Node::new();
    let p = TestNs::new();
    let mut conf = node.conf("1.0.0", json!({"bridge": "brm", "mtu": 1400, "promiscMode": true, "enabledad": true,
        "args": {"cni": {"mac": "0a:58:0a:00:00:02"}}, "runtimeConfig": {"mac": "0a:58:0a:00:00:03"}}));
    let r = Call::new(bin("bridge"), "ADD")
        .env("CNI_PATH", &node.cni_path)
        .env("CNI_ARGS", "IgnoreUnknown=1;MAC=0a:58:0a:00:00:01")
        .netns(&p.path())
        .stdin(&conf)
        .run_in(&node.ns.ns)
        .ok();
    assert_eq!(
        r["interfaces"][2]["mac"], "0a:58:0a:00:00:03",
        "runtimeConfig wins over args and CNI_ARGS"
    );
    nl(&p.ns, async |n| {
        assert_eq!(n.link_by_name("eth0").await.unwrap().mtu, 1400)
    });
    nl(&node.ns.ns, async |n| {
        let br = n.link_by_name("brm").await.unwrap();
        assert_eq!(br.mtu, 1400);
        assert!(br.promisc);
    });
    assert_eq!(
        rcni_netlink::sysctl::get(&p.ns, "net/ipv6/conf/eth0/accept_dad")
            .unwrap()
            .trim(),
        "1"
    );
    conf["prevResult"] = r;
    node.call(
        &bin("bridge"),
        "CHECK",
        &p.path(),
        "rcni-test-container",
        &conf,
    )
    .ok();

    // L2 only: no IPAM, interface up, no addresses.
    let p = TestNs::new();
    let l2 = json!({"cniVersion": "1.0.0", "name": "l2", "type": "bridge", "bridge": "brl2", "ipam": {}});
    let r = node.add(&p, "l2", &l2);
    assert!(r.get("ips").is_none());
    nl(&p.ns, async |n| {
        assert!(n.link_by_name("eth0").await.unwrap().admin_up)
    });
    // disableContainerInterface leaves it down; with IPAM it is refused.
    let p = TestNs::new();
    let down = json!({"cniVersion": "1.0.0", "name": "l2", "type": "bridge", "bridge": "brl2", "disableContainerInterface": true});
    node.add(&p, "down", &down);
    nl(&p.ns, async |n| {
        assert!(!n.link_by_name("eth0").await.unwrap().admin_up)
    });
    let bad = node.conf("1.0.0", json!({"disableContainerInterface": true}));
    assert_eq!(
        node.call(&bin("bridge"), "ADD", &TestNs::new().path(), "x", &bad)
            .err()
            .0,
        7
    );
    // dns from the config replaces IPAM's.
    let p = TestNs::new();
    let r = node.add(
        &p,
        "dns",
        &node.conf(
            "1.0.0",
            json!({"dns": {"nameservers": ["10.88.0.10"], "search": ["svc"]}}),
        ),
    );
    assert_eq!(
        r["dns"],
        json!({"nameservers": ["10.88.0.10"], "search": ["svc"]})
    );
}

#[test]
fn status_and_gc_reach_ipam() {
    let node = Node::new();
    let conf = node.conf("1.1.0", json!({}));
    let (a, b) = (TestNs::new(), TestNs::new());
    node.add(&a, "keep", &conf);
    node.add(&b, "stale", &conf);
    assert_eq!(node.reservations().len(), 4);
    let valid = json!([{"containerID": "keep", "ifname": "eth0"}]);
    node.gc(&bin("bridge"), &conf, valid).ok();
    assert_eq!(
        node.reservations().len(),
        2,
        "the stale attachment's addresses are released"
    );
    node.status(&bin("bridge"), &conf).ok();
    // A /30 holds one address (gateway .1, .2 for the pod): the next STATUS is 50.
    let small = node.conf(
        "1.1.0",
        json!({"name": "tiny", "bridge": "cni1", "ipam": {"type": "host-local", "dataDir": node.data.path(),
        "ranges": [[{"subnet": "10.99.0.0/30"}]]}}),
    );
    node.add(&TestNs::new(), "only", &small);
    assert_eq!(node.status(&bin("bridge"), &small).err().0, 50);
}

#[test]
fn same_result_and_state_as_the_reference() {
    // Our bridge + our host-local against the reference's, same config.
    for v in ["0.3.1", "0.4.0", "1.0.0"] {
        let mut results = Vec::new();
        let mut states = Vec::new();
        for (bridge, path) in ours_and_reference("bridge") {
            let node = Node::with_path(path);
            let pod = TestNs::new();
            let conf = node.conf(v, json!({"hairpinMode": true, "mtu": 1450}));
            let r = node.call(&bridge, "ADD", &pod.path(), "diff", &conf).ok();
            results.push(normalized_result(&r, v));
            let eth0 = nl(&pod.ns, async |n| n.link_by_name("eth0").await.unwrap());
            let pod_state = (
                eth0.mtu,
                eth0.admin_up,
                addrs_of(&pod.ns, "eth0"),
                routes_of(&pod.ns),
            );
            let br = nl(&node.ns.ns, async |n| n.link_by_name("cni0").await.unwrap());
            let node_state = (br.mtu, addrs_of(&node.ns.ns, "cni0"));
            let port = r["interfaces"][1]["name"].as_str().unwrap().to_string();
            let hairpin =
                ip_link_json(&node.ns.ns, &port)["linkinfo"]["info_slave_data"]["hairpin"].clone();
            states.push((pod_state, node_state, hairpin));
            node.call(
                &bridge,
                "DEL",
                &pod.path(),
                "diff",
                &Node::with_prev(&conf, &r),
            )
            .ok();
            assert!(node.reservations().is_empty());
        }
        assert_eq!(results[0], results[1], "{v}: result");
        assert_eq!(states[0], states[1], "{v}: kernel state");
    }
}

#[test]
fn macspoofchk_drops_frames_from_another_mac() {
    let node = Node::new();
    let conf = node.conf("1.0.0", json!({"macspoofchk": true}));
    let p = TestNs::new();
    let r = node.add(&p, "spoof", &conf);
    let with = Node::with_prev(&conf, &r);
    assert!(ping(&p.ns, "10.88.0.1"), "own MAC passes");
    node.call(&bin("bridge"), "CHECK", &p.path(), "spoof", &with)
        .ok();
    let set_mac = |mac: &str| {
        let st = rcni_testkit::command_in(&p.ns, "ip")
            .args(["link", "set", "eth0", "address", mac])
            .status()
            .unwrap();
        assert!(st.success());
    };
    set_mac("0a:58:de:ad:be:ef");
    assert!(
        !ping(&p.ns, "10.88.0.1"),
        "a spoofed MAC is dropped at the bridge"
    );
    set_mac(r["interfaces"][2]["mac"].as_str().unwrap());
    assert!(ping(&p.ns, "10.88.0.1"));
    node.call(&bin("bridge"), "DEL", &p.path(), "spoof", &with)
        .ok();
    let rules = rcni_testkit::command_in(&node.ns.ns, "nft")
        .args(["list", "table", "bridge", "nat"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&rules.stdout);
    assert!(
        !text.contains("macspoofchk-spoof-eth0") && !text.contains("cni-br-iface-spoof"),
        "{text}"
    );
    node.call(&bin("bridge"), "DEL", &p.path(), "spoof", &with)
        .ok();
}

/// macspoofchk rules are the reference's layout: our CHECK accepts the
/// reference's, and each side's DEL removes the other's.
#[test]
fn macspoofchk_rules_are_shared_with_the_reference() {
    let [(ours, _), (theirs, _)] = ours_and_reference("bridge");
    for (add, del) in [(&theirs, &ours), (&ours, &theirs)] {
        let node = Node::new();
        let conf = node.conf("1.0.0", json!({"macspoofchk": true}));
        let p = TestNs::new();
        let r = node.call(add, "ADD", &p.path(), "spoof", &conf).ok();
        let with = Node::with_prev(&conf, &r);
        let table = || {
            let out = rcni_testkit::command_in(&node.ns.ns, "nft")
                .args(["list", "table", "bridge", "nat"])
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        assert!(table().contains("macspoofchk-spoof-eth0"), "{}", table());
        node.call(&ours, "CHECK", &p.path(), "spoof", &with).ok();
        node.call(del, "DEL", &p.path(), "spoof", &with).ok();
        let left = table();
        assert!(
            !left.contains("macspoofchk-spoof-eth0") && !left.contains("cni-br-iface-spoof"),
            "{}: {left}",
            del.display()
        );
    }
}

#[test]
fn ip_masq_rules_follow_the_attachment_even_without_netns() {
    rcni_integration::masq_follows_attachments(
        "bridge",
        |node, extra| node.conf("1.1.0", extra),
        [&["10.88.0.2"], &["10.88.0.3"]],
    );
}

/// A failed ADD: an IPAM plugin other than host-local and static releases
/// while the pod's veth is still there (dhcp's DHCPRELEASE goes out on it),
/// as the reference's deferred `ipam.ExecDel`; then the veth goes.
#[test]
fn failed_add_releases_ipam_before_removing_the_veth() {
    let (ipam, log) = rcni_integration::release_order_ipam();
    let node = Node::with_path(format!(
        "{}:{}",
        ipam.path().display(),
        rcni_testkit::bin_dir().display()
    ));
    let pod = TestNs::new();
    let c = json!({"cniVersion": "1.0.0", "name": "rel", "type": "bridge", "bridge": "brrel",
        "ipam": {"type": "fake-ipam"}});
    node.call(&bin("bridge"), "ADD", &pod.path(), "ctr", &c)
        .err();
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "present\n");
    assert_eq!(rcni_integration::link_names(&pod.ns), ["lo"]);
}

/// Upstream since v1.7.0 (ConfigureIface): the pod interface of a
/// dual-stack attachment gets `keep_addr_on_down=1`, so a link down/up
/// inside the pod keeps its IPv6 address and the pod stays reachable.
#[test]
fn ipam_ipv6_addresses_survive_a_link_down_up_as_v191() {
    for (bridge, path) in ours_and_upstream("bridge") {
        let node = Node::with_path(path);
        let pod = TestNs::new();
        let c = node.conf("1.0.0", json!({}));
        let r = node.call(&bridge, "ADD", &pod.path(), "keep", &c).ok();
        let v6 = addr_of(&r, false);
        assert_eq!(
            rcni_netlink::sysctl::get(&pod.ns, "net/ipv6/conf/eth0/keep_addr_on_down").unwrap(),
            "1",
            "{}",
            bridge.display()
        );
        ip(&pod.ns, "link set eth0 down");
        ip(&pod.ns, "link set eth0 up");
        assert!(
            addrs_of(&pod.ns, "eth0").contains(&format!("{v6}/64")),
            "{}",
            bridge.display()
        );
        // The reference's bridge address may still be tentative (it leaves
        // duplicate address detection on there): a few seconds' grace.
        let reached = (0..10).any(|_| {
            ping(&node.ns.ns, &v6) || {
                std::thread::sleep(std::time::Duration::from_millis(300));
                false
            }
        });
        assert!(
            reached,
            "{}: node to pod over IPv6 after down/up",
            bridge.display()
        );
        let with = Node::with_prev(&c, &r);
        node.call(&bridge, "DEL", &pod.path(), "keep", &with).ok();
    }
}

/// ipMasq on the default backend costs one iptables process per ADD: the
/// probe's answer is kept for the boot, and a new container's chain, which
/// nfnetlink shows absent, is written without an `iptables-save` first.
/// Where the chain is there already (a second interface of the container),
/// the table is read and the rules merged as before. Each tool is a
/// wrapper that logs its call and runs the real one.
#[test]
fn default_ip_masq_adds_with_one_iptables_process() {
    let tools = tempfile::tempdir().unwrap();
    let log = tools.path().join("calls");
    for tool in ["iptables", "iptables-save", "iptables-restore"] {
        let real = rcni_netfilter::exec::find_tool(tool).expect("iptables is installed");
        let w = tools.path().join(tool);
        std::fs::write(
            &w,
            format!(
                "#!/bin/sh\necho \"{tool} $*\" >> {}\nexec {} \"$@\"\n",
                log.display(),
                real.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&w, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let probe = tempfile::tempdir().unwrap();
    let path = format!(
        "{}:{}",
        tools.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let node = Node::new();
    let conf = node.conf(
        "1.1.0",
        json!({"ipMasq": true, "ipam": {"type": "host-local", "dataDir": node.data.path(),
            "ranges": [[{"subnet": "10.88.0.0/24"}]]}}),
    );
    let call = |cmd: &str, pod: &TestNs, cid: &str, ifname: &str, c: &serde_json::Value| {
        Call::new(bin("bridge"), cmd)
            .env("CNI_PATH", &node.cni_path)
            .env("CNI_CONTAINERID", cid)
            .env("CNI_IFNAME", ifname)
            .env("PATH", &path)
            .env("RCNI_PROBE_DIR", probe.path().to_str().unwrap())
            .netns(&pod.path())
            .stdin(c)
            .run_in(&node.ns.ns)
    };
    let calls = || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let _ = std::fs::remove_file(&log);
        text.lines()
            .map(|l| l.split(' ').next().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    let (a, b) = (TestNs::new(), TestNs::new());
    // The first ADD of the boot probes, then writes.
    let ra = call("ADD", &a, "ctr-a", "eth0", &conf).ok();
    assert_eq!(calls(), ["iptables", "iptables-restore"]);
    // Later ADDs write only.
    let rb = call("ADD", &b, "ctr-b", "eth0", &conf).ok();
    assert_eq!(calls(), ["iptables-restore"]);
    for (pod, cid, r) in [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)] {
        call("CHECK", pod, cid, "eth0", &Node::with_prev(&conf, r)).ok();
    }
    let _ = calls();
    let rules = rcni_integration::masq_rules(&node.ns.ns);
    for ip in ["10.88.0.2/32", "10.88.0.3/32"] {
        assert!(
            rules.contains(&format!("-A POSTROUTING -s {ip}")),
            "{ip}: {rules}"
        );
    }
    // ctr-a's chain exists: its second interface reads the table first.
    let ra1 = call("ADD", &a, "ctr-a", "eth1", &conf).ok();
    assert_eq!(calls(), ["iptables-save", "iptables-restore"]);
    call("CHECK", &a, "ctr-a", "eth1", &Node::with_prev(&conf, &ra1)).ok();
    call("CHECK", &a, "ctr-a", "eth0", &Node::with_prev(&conf, &ra)).ok();
    for (pod, cid, ifname, r) in [
        (&a, "ctr-a", "eth1", &ra1),
        (&a, "ctr-a", "eth0", &ra),
        (&b, "ctr-b", "eth0", &rb),
    ] {
        call("DEL", pod, cid, ifname, &Node::with_prev(&conf, r)).ok();
    }
    assert_eq!(rcni_integration::masq_rules(&node.ns.ns), "");
    node.assert_nothing_left();
}

/// The bridge's MAC as the kernel has it now.
fn bridge_mac(node: &Node, name: &str) -> rcni_netlink::MacAddr {
    nl(&node.ns.ns, async |n| n.link_by_name(name).await.unwrap())
        .mac
        .expect("a bridge has a MAC")
}

/// v1.10.0: every gateway ADD pins the bridge's MAC, also when the gateway
/// address is there already (a bridge made and addressed by someone else;
/// v1.9.1 and rcni before pinned only when adding the address). The MAC it
/// had before the pod's port joined stays through ADD/DEL churn; unpinned,
/// the bridge took the port's MAC and turned all-zero when it left.
#[test]
fn gateway_add_pins_the_bridge_mac_when_the_address_exists() {
    let node = Node::new();
    ip(&node.ns.ns, "link add cni0 type bridge");
    ip(&node.ns.ns, "addr add 10.88.0.1/24 dev cni0");
    ip(&node.ns.ns, "link set cni0 up");
    let before = bridge_mac(&node, "cni0");
    assert_ne!(before.0, [0; 6], "a new bridge has a random MAC");
    let conf = node.conf(
        "1.0.0",
        json!({"ipam": {"type": "host-local", "dataDir": node.data.path(),
                        "ranges": [[{"subnet": "10.88.0.0/24"}]]}}),
    );
    for round in 0..2 {
        let p = TestNs::new();
        let r = node.add(&p, "churn", &conf);
        assert_eq!(r["interfaces"][0]["mac"], before.to_string(), "{round}");
        assert_eq!(bridge_mac(&node, "cni0"), before, "{round}");
        node.call(
            &bin("bridge"),
            "DEL",
            &p.path(),
            "churn",
            &Node::with_prev(&conf, &r),
        )
        .ok();
        assert_eq!(
            bridge_mac(&node, "cni0"),
            before,
            "{round}: no port left, the MAC stays"
        );
    }
    node.assert_nothing_left();
}

/// v1.10.0: a bridge whose last port left without it being pinned has an
/// all-zero MAC (the kernel's doing); the gateway ADD gives it a random
/// locally administered unicast one, not its new port's, once: dual-stack's
/// second family and later ADDs keep it.
#[test]
fn gateway_add_replaces_an_all_zero_bridge_mac() {
    let node = Node::new();
    ip(&node.ns.ns, "link add cni0 type bridge");
    ip(&node.ns.ns, "link set cni0 up");
    ip(&node.ns.ns, "link add z0 type veth peer name z1");
    ip(&node.ns.ns, "link set z0 master cni0");
    ip(&node.ns.ns, "link del z0");
    assert_eq!(
        bridge_mac(&node, "cni0").0,
        [0; 6],
        "the kernel zeroes an unpinned bridge's MAC with its last port"
    );
    let conf = node.conf("1.0.0", json!({}));
    let p = TestNs::new();
    let r = node.add(&p, "zero", &conf);
    let mac = bridge_mac(&node, "cni0");
    assert_eq!(r["interfaces"][0]["mac"], mac.to_string());
    assert!(
        mac.0 != [0; 6] && mac.is_local() && !mac.is_multicast(),
        "{mac}"
    );
    assert_ne!(
        r["interfaces"][1]["mac"],
        mac.to_string(),
        "not the port's MAC"
    );
    node.call(
        &bin("bridge"),
        "DEL",
        &p.path(),
        "zero",
        &Node::with_prev(&conf, &r),
    )
    .ok();
    assert_eq!(bridge_mac(&node, "cni0"), mac);
    let q = TestNs::new();
    let r = node.add(&q, "again", &conf);
    assert_eq!(r["interfaces"][0]["mac"], mac.to_string());
    node.call(
        &bin("bridge"),
        "DEL",
        &q.path(),
        "again",
        &Node::with_prev(&conf, &r),
    )
    .ok();
    assert_eq!(bridge_mac(&node, "cni0"), mac);
    node.assert_nothing_left();
}

/// An L2 bridge (no IPAM, or `"ipam": {}`): ADD, CHECK and DEL succeed
/// (v1.10.0's "configures and deconfigures a l2 bridge and veth with
/// ADD/DEL/CHECK"; v1.9.1's CHECK failed with "no plugin name provided"),
/// CHECK still catches a missing container interface, DEL twice is fine.
#[test]
fn l2_bridge_add_check_del() {
    let node = Node::new();
    for (i, ipam) in [None, Some(json!({}))].into_iter().enumerate() {
        let mut conf =
            json!({"cniVersion": "1.0.0", "name": "l2", "type": "bridge", "bridge": "brl2"});
        if let Some(ipam) = ipam {
            conf["ipam"] = ipam;
        }
        let cid = format!("l2-{i}");
        let p = TestNs::new();
        let r = node.add(&p, &cid, &conf);
        assert!(r.get("ips").is_none(), "{r}");
        assert_eq!(r["interfaces"][0]["name"], "brl2");
        assert_eq!(r["interfaces"][2]["sandbox"], p.path());
        let with = Node::with_prev(&conf, &r);
        node.call(&bin("bridge"), "CHECK", &p.path(), &cid, &with)
            .ok();
        ip(&p.ns, "link del eth0");
        let (code, msg) = node
            .call(&bin("bridge"), "CHECK", &p.path(), &cid, &with)
            .err();
        assert_eq!(code, 106, "{msg}");
        node.call(&bin("bridge"), "DEL", &p.path(), &cid, &with)
            .ok();
        node.call(&bin("bridge"), "DEL", &p.path(), &cid, &with)
            .ok();
        // No addresses, so no 0.1.0/0.2.0 result: refused with the
        // reference's text before a link is made.
        for version in ["0.1.0", "0.2.0"] {
            let mut old = conf.clone();
            old["cniVersion"] = json!(version);
            let (code, msg) = node
                .call(&bin("bridge"), "ADD", &p.path(), &cid, &old)
                .err();
            assert_eq!(
                (code, msg.as_str()),
                (1, "cannot convert: no valid IP addresses")
            );
            assert_eq!(rcni_integration::link_names(&p.ns), ["lo"], "{version}");
            assert_eq!(node.host_veths(), Vec::<String>::new(), "{version}");
        }
    }
    node.assert_nothing_left();
}
