//! The ptp binary with our IPAM plugins: a node namespace routes between
//! pods; real packets, the kernel layout, CHECK after damage, every DEL
//! path, rollback, ipMasq, GC and STATUS, and the reference side by side.

use rcni_integration::{
    Damage, Node, addr_of, addrs_of, delete_pod_eth0, ip, masq_rules, merged, nl,
    ours_and_reference, ours_and_upstream, remove_pod_address, remove_route, routes_of,
};
use rcni_testkit::{TestNs, bin, normalized_result, ping};
use serde_json::{Value, json};

/// A ptp config on the node's host-local data dir; `extra` keys merged in.
fn conf(node: &Node, version: &str, extra: Value) -> Value {
    let c = json!({
        "cniVersion": version, "name": "podnet", "type": "ptp",
        "ipam": {"type": "host-local", "dataDir": node.data.path(),
                 "ranges": [[{"subnet": "10.77.0.0/24"}], [{"subnet": "fd77::/64"}]],
                 "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}
    });
    merged(c, extra)
}

fn add(node: &Node, pod: &TestNs, cid: &str, conf: &Value) -> Value {
    node.call(&bin("ptp"), "ADD", &pod.path(), cid, conf).ok()
}

#[test]
fn pods_reach_each_other_through_the_node_routes_dual_stack() {
    let node = Node::new();
    let (a, b) = (TestNs::new(), TestNs::new());
    let c = conf(
        &node,
        "1.0.0",
        json!({"mtu": 1400, "dns": {"nameservers": ["10.77.0.53"]}}),
    );
    let ra = add(&node, &a, "ctr-a", &c);
    let rb = add(&node, &b, "ctr-b", &c);

    // The reference shape: [host veth, container veth(sandbox)], ips on 1.
    let ifs = ra["interfaces"].as_array().unwrap();
    assert_eq!(ifs.len(), 2);
    let host_veth = ifs[0]["name"].as_str().unwrap().to_string();
    assert!(host_veth.starts_with("veth") && ifs[0].get("sandbox").is_none());
    assert_eq!(
        ifs[1],
        json!({"name": "eth0", "mac": ifs[1]["mac"], "sandbox": a.path()})
    );
    assert_eq!(
        ra["ips"],
        json!([{"interface": 1, "address": "10.77.0.2/24", "gateway": "10.77.0.1"},
               {"interface": 1, "address": "fd77::2/64", "gateway": "fd77::1"}])
    );
    assert_eq!(ra["routes"], json!([{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]));
    assert_eq!(ra["dns"], json!({"nameservers": ["10.77.0.53"]}));

    // Container: no connected subnet route; the gateway on the link, the
    // subnet and the IPAM routes via the gateway.
    assert_eq!(
        routes_of(&a.ns),
        [
            "0.0.0.0/0 via 10.77.0.1 scope 0",
            "10.77.0.0/24 via 10.77.0.1 src 10.77.0.2 scope 0",
            "10.77.0.1/32 src 10.77.0.2 scope 253",
            "::/0 via fd77::1 scope 0",
            "fd77::/64 via fd77::1 src fd77::2 scope 0",
            "fd77::1/128 src fd77::2 scope 0",
        ]
    );
    // Node: the gateway on every host veth, a host route per pod address.
    assert_eq!(
        addrs_of(&node.ns.ns, &host_veth),
        ["10.77.0.1/32", "fd77::1/128"]
    );
    // A dual-stack pod's host veth keeps IPv6, without duplicate address
    // detection or router advertisements from the pod.
    let v6 = |k: &str| {
        let key = format!("net/ipv6/conf/{host_veth}/{k}");
        rcni_netlink::sysctl::get(&node.ns.ns, &key).unwrap()
    };
    assert_eq!(
        [v6("disable_ipv6"), v6("accept_ra"), v6("accept_dad")],
        ["0", "0", "0"]
    );
    let node_routes = routes_of(&node.ns.ns);
    for r in [
        "10.77.0.2/32 scope 254",
        "10.77.0.3/32 scope 254",
        "fd77::2/128 scope 0",
    ] {
        assert!(node_routes.contains(&r.to_string()), "{r}: {node_routes:?}");
    }
    nl(&a.ns, async |n| {
        assert_eq!(n.link_by_name("eth0").await.unwrap().mtu, 1400)
    });
    nl(&node.ns.ns, async |n| {
        let l = n.link_by_name(&host_veth).await.unwrap();
        assert_eq!(l.mtu, 1400);
        assert!(l.admin_up);
    });
    for key in ["net.ipv4.ip_forward", "net/ipv6/conf/all/forwarding"] {
        assert_eq!(
            rcni_netlink::sysctl::get(&node.ns.ns, key).unwrap().trim(),
            "1"
        );
    }

    // Right after ADD, with no settling delay: IPv6 addresses are usable
    // at once on both ends.
    for (from, to) in [(&a, &rb), (&b, &ra)] {
        assert!(ping(&from.ns, &addr_of(to, true)), "pod to pod over IPv4");
        assert!(ping(&from.ns, &addr_of(to, false)), "pod to pod over IPv6");
    }
    assert!(
        ping(&a.ns, "10.77.0.1") && ping(&a.ns, "fd77::1"),
        "pod to gateway"
    );
    assert!(
        ping(&node.ns.ns, "10.77.0.3") && ping(&node.ns.ns, "fd77::3"),
        "node to pod"
    );

    for (pod, cid, r) in [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)] {
        node.check_and_del(&bin("ptp"), pod, cid, &c, r);
    }
    node.assert_nothing_left();
    let left: Vec<String> = routes_of(&node.ns.ns)
        .into_iter()
        .filter(|r| r.contains("10.77") || r.contains("fd77"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn ipv4_only_and_every_spec_version() {
    let node = Node::new();
    for v in rcni_cni::version::ALL {
        let pod = TestNs::new();
        let c = conf(
            &node,
            v,
            json!({"ipam": {"type": "host-local", "dataDir": node.data.path(),
                "ranges": [[{"subnet": "10.78.0.0/24"}]]}}),
        );
        let r = add(&node, &pod, "ctr", &c);
        assert_eq!(r["cniVersion"], *v);
        match *v {
            "0.1.0" | "0.2.0" => {
                assert!(
                    r["ip4"]["ip"].as_str().unwrap().starts_with("10.78.0."),
                    "{r}"
                );
                assert_eq!(r["ip4"]["gateway"], "10.78.0.1");
            }
            _ => {
                assert_eq!(r["interfaces"].as_array().unwrap().len(), 2);
                // No IPv6 on an IPv4-only pod's host veth: no link-local
                // address and routes for every link change on the node to
                // walk (bench/ptpscale.sh).
                let hv = r["interfaces"][0]["name"].as_str().unwrap();
                let key = format!("net/ipv6/conf/{hv}/disable_ipv6");
                let off = rcni_netlink::sysctl::get(&node.ns.ns, &key).unwrap();
                assert_eq!(off, "1", "{v}");
                assert_eq!(r["ips"][0]["interface"], 1);
                assert_eq!(
                    r["ips"][0]["version"].is_string(),
                    v.starts_with("0."),
                    "{v}: {r}"
                );
            }
        }
        assert!(ping(&pod.ns, "10.78.0.1"), "{v}: pod to gateway");
        node.call(&bin("ptp"), "DEL", &pod.path(), "ctr", &c).ok();
        assert!(node.reservations().is_empty(), "{v}");
    }
    assert_eq!(node.host_veths(), Vec::<String>::new());
}

#[test]
fn check_passes_after_add_and_fails_after_damage() {
    let node = Node::new();
    let damage: [(&str, Damage); 5] = [
        ("address removed", remove_pod_address),
        ("route to the gateway removed", |_, pod, _| {
            remove_route(pod, |r| r.dst.prefix() == 32)
        }),
        ("gateway removed from the host veth", |node, _, r| {
            let name = r["interfaces"][0]["name"].as_str().unwrap().to_string();
            nl(node, async |n| {
                let l = n.link_by_name(&name).await.unwrap();
                n.del_address(l.index, "fd77::1/128".parse().unwrap())
                    .await
                    .unwrap();
            });
        }),
        ("host route removed", |node, _, r| {
            let dst = format!("{}/32", addr_of(r, true));
            remove_route(node, |r| r.dst.to_string() == dst)
        }),
        ("container interface deleted", delete_pod_eth0),
    ];
    node.check_catches(&bin("ptp"), &conf(&node, "1.0.0", json!({})), &damage);
    assert!(node.reservations().is_empty());
}

#[test]
fn del_is_idempotent_and_works_without_the_netns() {
    let node = Node::new();
    let c = conf(&node, "1.0.0", json!({}));
    node.del_survives_repeats_and_a_deleted_netns(&bin("ptp"), &c);

    // Empty CNI_NETNS: the reservation is released and, from prevResult,
    // the host veth and its routes go too (the reference keeps them, and a
    // reused address would be routed to the old veth).
    let pod = TestNs::new();
    let r = add(&node, &pod, "nonetns", &c);
    assert_eq!(node.reservations().len(), 2);
    node.call(&bin("ptp"), "DEL", "", "nonetns", &Node::with_prev(&c, &r))
        .ok();
    node.assert_nothing_left();
    nl(&pod.ns, async |n| {
        assert!(n.find_link("eth0").await.unwrap().is_none())
    });

    // DEL of a config without IPAM (which ADD refuses) still succeeds.
    let bare = json!({"cniVersion": "1.0.0", "name": "podnet", "type": "ptp"});
    node.call(&bin("ptp"), "DEL", "", "never", &bare).ok();
}

#[test]
fn failed_add_rolls_back_link_and_reservation() {
    let node = Node::new();
    // A route whose gateway is unreachable fails after IPAM reserved and
    // the veth exists.
    let c = conf(
        &node,
        "1.0.0",
        json!({"ipMasq": true, "ipam": {"type": "host-local", "dataDir": node.data.path(),
            "ranges": [[{"subnet": "10.77.0.0/24"}]],
            "routes": [{"dst": "192.168.0.0/16", "gw": "172.31.0.1"}]}}),
    );
    let pod = TestNs::new();
    let (code, msg) = node.call(&bin("ptp"), "ADD", &pod.path(), "ctr", &c).err();
    assert_eq!(code, 103, "{msg}");
    node.assert_nothing_left();
    nl(&pod.ns, async |n| {
        assert!(n.find_link("eth0").await.unwrap().is_none())
    });

    // An existing interface of that name: code 4, before IPAM.
    nl(&pod.ns, async |n| {
        n.create_veth("eth0", "other0", None, None).await.unwrap();
    });
    let c = conf(&node, "1.0.0", json!({}));
    assert_eq!(
        node.call(&bin("ptp"), "ADD", &pod.path(), "ctr", &c)
            .err()
            .0,
        4
    );
    assert!(node.reservations().is_empty());

    // No IPAM: an invalid config.
    let bare = json!({"cniVersion": "1.0.0", "name": "podnet", "type": "ptp"});
    assert_eq!(
        node.call(&bin("ptp"), "ADD", &TestNs::new().path(), "x", &bare)
            .err()
            .0,
        7
    );
}

/// An IPAM plugin that dies printing only to stderr: the error reaches the
/// runtime as libcni v1.3.1 (upstream v1.10.0) words it, stderr quoted
/// whole and the exit status after it, and ADD leaves nothing behind.
#[test]
fn ipam_dying_on_stderr_names_its_exit_status() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("dying-ipam");
    std::fs::write(
        &script,
        "#!/bin/sh\ncat >/dev/null\necho 'ipam broke' >&2\nexit 3\n",
    )
    .unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let node = Node::with_path(format!(
        "{}:{}",
        dir.path().display(),
        rcni_testkit::bin_dir().display()
    ));
    let c = json!({"cniVersion": "1.0.0", "name": "podnet", "type": "ptp",
        "ipam": {"type": "dying-ipam"}});
    let pod = TestNs::new();
    let (code, msg) = node.call(&bin("ptp"), "ADD", &pod.path(), "ctr", &c).err();
    assert_eq!(code, 102, "{msg}");
    assert_eq!(msg, r#"netplugin failed: "ipam broke\n": exit status 3"#);
    node.assert_nothing_left();
    nl(&pod.ns, async |n| {
        assert!(n.find_link("eth0").await.unwrap().is_none())
    });
}

#[test]
fn ip_masq_rules_follow_the_attachment_even_without_netns() {
    rcni_integration::masq_follows_attachments(
        "ptp",
        |node, extra| conf(node, "1.1.0", extra),
        [&["10.77.0.2", "fd77::2"], &["10.77.0.3", "fd77::3"]],
    );
}

#[test]
fn status_reaches_ipam() {
    let node = Node::new();
    node.status(&bin("ptp"), &conf(&node, "1.1.0", json!({})))
        .ok();
    // A /30 holds one address (gateway .1, .2 for the pod): then STATUS is 50.
    let small = conf(
        &node,
        "1.1.0",
        json!({"name": "tiny", "ipam": {"type": "host-local", "dataDir": node.data.path(),
            "ranges": [[{"subnet": "10.79.0.0/30"}]]}}),
    );
    let pod = TestNs::new();
    add(&node, &pod, "only", &small);
    assert_eq!(node.status(&bin("ptp"), &small).err().0, 50);
    node.call(&bin("ptp"), "DEL", &pod.path(), "only", &small)
        .ok();
}

#[test]
fn same_result_and_state_as_the_reference() {
    for v in ["0.3.1", "0.4.0", "1.0.0"] {
        let mut seen = Vec::new();
        for (ptp, path) in ours_and_reference("ptp") {
            let node = Node::with_path(path);
            let pod = TestNs::new();
            let c = conf(&node, v, json!({"mtu": 1450, "ipMasq": true}));
            let r = node.call(&ptp, "ADD", &pod.path(), "diff", &c).ok();
            let host_veth = r["interfaces"][0]["name"].as_str().unwrap().to_string();
            let state = (
                routes_of(&pod.ns),
                addrs_of(&pod.ns, "eth0"),
                addrs_of(&node.ns.ns, &host_veth),
                routes_of(&node.ns.ns),
                masq_rules(&node.ns.ns),
            );
            seen.push((normalized_result(&r, v), state));
            let with = Node::with_prev(&c, &r);
            if v != "0.3.1" {
                node.call(&ptp, "CHECK", &pod.path(), "diff", &with).ok();
            }
            node.call(&ptp, "DEL", &pod.path(), "diff", &with).ok();
            node.assert_nothing_left();
            assert_eq!(masq_rules(&node.ns.ns), "", "{v}");
        }
        assert_eq!(seen[0].0, seen[1].0, "{v}: result");
        assert_eq!(seen[0].1, seen[1].1, "{v}: kernel state");
    }
}

/// Upstream since v1.7.0 (ConfigureIface): an interface that gets an IPv6
/// address from IPAM gets `keep_addr_on_down=1`, so a link down/up inside
/// the pod keeps the address; an IPv4-only pod's interface is left as it is.
#[test]
fn ipam_ipv6_addresses_survive_a_link_down_up_as_v191() {
    let key = "net/ipv6/conf/eth0/keep_addr_on_down";
    for (ptp, path) in ours_and_upstream("ptp") {
        let node = Node::with_path(path);
        let pod = TestNs::new();
        let c = conf(&node, "1.0.0", json!({}));
        let r = node.call(&ptp, "ADD", &pod.path(), "keep", &c).ok();
        let v6 = format!("{}/64", addr_of(&r, false));
        assert_eq!(
            rcni_netlink::sysctl::get(&pod.ns, key).unwrap(),
            "1",
            "{}",
            ptp.display()
        );
        ip(&pod.ns, "link set eth0 down");
        assert!(addrs_of(&pod.ns, "eth0").contains(&v6), "kept while down");
        ip(&pod.ns, "link set eth0 up");
        assert!(addrs_of(&pod.ns, "eth0").contains(&v6), "{}", ptp.display());

        let pod4 = TestNs::new();
        let mut c4 = c.clone();
        c4["ipam"]["ranges"] = json!([[{"subnet": "10.77.0.0/24"}]]);
        c4["ipam"]["routes"] = json!([{"dst": "0.0.0.0/0"}]);
        node.call(&ptp, "ADD", &pod4.path(), "keep4", &c4).ok();
        assert_eq!(
            rcni_netlink::sysctl::get(&pod4.ns, key).unwrap(),
            "0",
            "IPv4 only: {}",
            ptp.display()
        );
        for (p, cid, c, r) in [(&pod, "keep", &c, Some(&r)), (&pod4, "keep4", &c4, None)] {
            let with = r.map_or(c.clone(), |r| Node::with_prev(c, r));
            node.call(&ptp, "DEL", &p.path(), cid, &with).ok();
        }
    }
}

/// The AWS VPC CNI's layout, which vpc-ipam returns: a /32 address behind
/// 169.254.1.1. The reference fails ADD there (the default route's gateway
/// is unreachable); ours makes the gateway on-link first, and two pods so
/// attached reach each other through the node.
#[test]
fn a_host_address_behind_a_link_local_gateway() {
    let c = |node: &Node, a: &str| {
        json!({"cniVersion": "1.0.0", "name": "vpc", "type": "ptp",
               "ipam": {"type": "static", "dataDir": node.data.path(),
                        "addresses": [{"address": a, "gateway": "169.254.1.1"}],
                        "routes": [{"dst": "0.0.0.0/0"}]}})
    };
    for (plugin, path) in ours_and_upstream("ptp") {
        let ours = plugin == bin("ptp");
        let node = Node::with_path(path);
        let (a, b) = (TestNs::new(), TestNs::new());
        let out = node.call(
            &plugin,
            "ADD",
            &a.path(),
            "ctr-a",
            &c(&node, "10.0.16.5/32"),
        );
        if !ours {
            assert_ne!(out.code, 0, "the reference now takes it: {}", out.stdout);
            assert!(out.stdout.contains("unreachable"), "{}", out.stdout);
            continue;
        }
        let ra = out.ok();
        let rb = add(&node, &b, "ctr-b", &c(&node, "10.0.16.6/32"));
        assert_eq!(
            routes_of(&a.ns),
            [
                "0.0.0.0/0 via 169.254.1.1 scope 0",
                "10.0.16.5/32 via 169.254.1.1 src 10.0.16.5 scope 0",
                "169.254.1.1/32 scope 253"
            ],
            "{ra}"
        );
        assert!(ping(&a.ns, "10.0.16.6"), "{ra} {rb}");
        for (pod, cid, r, ip) in [
            (&a, "ctr-a", &ra, "10.0.16.5/32"),
            (&b, "ctr-b", &rb, "10.0.16.6/32"),
        ] {
            let mut d = c(&node, ip);
            d["prevResult"] = r.clone();
            node.call(&plugin, "CHECK", &pod.path(), cid, &d).ok();
            node.call(&plugin, "DEL", &pod.path(), cid, &d).ok();
        }
        node.assert_nothing_left();
    }
}

#[test]
fn link_type_netkit_falls_back_to_veth_where_the_kernel_has_none() {
    if rcni_integration::kernel_has_netkit() {
        eprintln!("this kernel has netkit: vm_netkit.rs covers it, no fallback to test");
        return;
    }
    let node = Node::new();
    let (a, b) = (TestNs::new(), TestNs::new());
    let c = conf(&node, "1.1.0", json!({"linkType": "netkit"}));
    let out = node.call(&bin("ptp"), "ADD", &a.path(), "ctr-a", &c);
    let ra = out.ok();
    assert!(
        out.stderr.contains("no netkit") && out.stderr.contains("veth pair instead"),
        "{}",
        out.stderr
    );
    let rb = add(&node, &b, "ctr-b", &c);
    let l = nl(&a.ns, async |n| n.link_by_name("eth0").await.unwrap());
    assert_eq!(l.kind.as_deref(), Some("veth"));
    assert!(
        ra["interfaces"][0]["name"]
            .as_str()
            .unwrap()
            .starts_with("veth")
    );
    assert!(ping(&a.ns, &addr_of(&rb, true)));
    for (pod, cid, r) in [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)] {
        node.check_and_del(&bin("ptp"), pod, cid, &c, r);
    }
    node.assert_nothing_left();
    // Any other value is the config's error, before anything is made.
    let bad = conf(&node, "1.1.0", json!({"linkType": "tap"}));
    let (code, msg) = node
        .call(&bin("ptp"), "ADD", &a.path(), "ctr-a", &bad)
        .err();
    assert_eq!(code, 2, "{msg}");
    assert!(msg.contains("linkType"), "{msg}");
    node.assert_nothing_left();
}
