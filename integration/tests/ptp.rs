//! The ptp binary with our IPAM plugins: a node namespace routes between
//! pods; real packets, the kernel layout, CHECK after damage, every DEL
//! path, rollback, ipMasq, GC and STATUS, and the reference side by side.

mod common;

use common::{Node, addr_of, masq_rules, nl};
use rcni_netlink::Family;
use rcni_netns::NetNs;
use rcni_testkit::{
    Call, PersistentNs, TestNs, bin, bin_dir, normalize_result, ping, reference_bin,
};
use serde_json::{Value, json};
use std::path::Path;

/// A ptp config on the node's host-local data dir; `extra` keys merged in.
fn conf(node: &Node, version: &str, extra: Value) -> Value {
    let mut c = json!({
        "cniVersion": version, "name": "podnet", "type": "ptp",
        "ipam": {"type": "host-local", "dataDir": node.data.path(),
                 "ranges": [[{"subnet": "10.77.0.0/24"}], [{"subnet": "fd77::/64"}]],
                 "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}
    });
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    c
}

fn add(node: &Node, pod: &TestNs, cid: &str, conf: &Value) -> Value {
    node.call(&bin("ptp"), "ADD", &pod.path(), cid, conf).ok()
}

fn routes_of(ns: &NetNs) -> Vec<String> {
    nl(ns, async |n| {
        let mut v: Vec<String> = n
            .routes(Family::All)
            .await
            .unwrap()
            .iter()
            .filter(|r| !r.dst.ip().to_string().starts_with("fe80"))
            .map(|r| {
                let gw = r.gateway.map(|g| format!(" via {g}")).unwrap_or_default();
                let src = r.src.map(|s| format!(" src {s}")).unwrap_or_default();
                format!("{}{gw}{src} scope {}", r.dst, r.scope)
            })
            .collect();
        v.sort();
        v
    })
}

fn addrs_of(ns: &NetNs, dev: &str) -> Vec<String> {
    nl(ns, async |n| {
        let l = n.link_by_name(dev).await.unwrap();
        let mut v: Vec<String> = n
            .addresses(Some(l.index))
            .await
            .unwrap()
            .iter()
            .filter(|a| !a.addr.ip().to_string().starts_with("fe80"))
            .map(|a| a.addr.to_string())
            .collect();
        v.sort();
        v
    })
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
        let with = Node::with_prev(&c, r);
        node.call(&bin("ptp"), "CHECK", &pod.path(), cid, &with)
            .ok();
        node.call(&bin("ptp"), "DEL", &pod.path(), cid, &with).ok();
    }
    assert!(node.reservations().is_empty());
    assert_eq!(node.host_veths(), Vec::<String>::new());
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
    let c = conf(&node, "1.0.0", json!({}));
    type Damage = fn(&NetNs, &NetNs, &Value);
    let damage: [(&str, Damage); 5] = [
        ("address removed", |_, pod, r| {
            let a = r["ips"][0]["address"].as_str().unwrap().parse().unwrap();
            nl(pod, async |n| {
                let l = n.link_by_name("eth0").await.unwrap();
                n.del_address(l.index, a).await.unwrap();
            });
        }),
        ("route to the gateway removed", |_, pod, _| {
            nl(pod, async |n| {
                let r = n
                    .routes(Family::V4)
                    .await
                    .unwrap()
                    .into_iter()
                    .find(|r| r.dst.prefix() == 32)
                    .unwrap();
                n.del_route(&r).await.unwrap();
            });
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
            nl(node, async |n| {
                let r = n
                    .routes(Family::V4)
                    .await
                    .unwrap()
                    .into_iter()
                    .find(|r| r.dst.to_string() == dst)
                    .unwrap();
                n.del_route(&r).await.unwrap();
            });
        }),
        ("container interface deleted", |_, pod, _| {
            nl(pod, async |n| {
                let l = n.link_by_name("eth0").await.unwrap();
                n.delete_link(l.index).await.unwrap();
            });
        }),
    ];
    for (what, f) in damage {
        let pod = TestNs::new();
        let r = add(&node, &pod, "ctr", &c);
        let with = Node::with_prev(&c, &r);
        node.call(&bin("ptp"), "CHECK", &pod.path(), "ctr", &with)
            .ok();
        f(&node.ns.ns, &pod.ns, &r);
        let (code, msg) = node
            .call(&bin("ptp"), "CHECK", &pod.path(), "ctr", &with)
            .err();
        assert_eq!(code, 106, "{what}: {msg}");
        node.call(&bin("ptp"), "DEL", &pod.path(), "ctr", &with)
            .ok();
    }
    let pod = TestNs::new();
    add(&node, &pod, "ctr", &c);
    assert_eq!(
        node.call(&bin("ptp"), "CHECK", &pod.path(), "ctr", &c)
            .err()
            .0,
        7,
        "CHECK without prevResult"
    );
    node.call(&bin("ptp"), "DEL", &pod.path(), "ctr", &c).ok();
    assert!(node.reservations().is_empty());
}

#[test]
fn del_is_idempotent_and_works_without_the_netns() {
    let node = Node::new();
    let c = conf(&node, "1.0.0", json!({}));
    let pod = TestNs::new();
    let r = add(&node, &pod, "twice", &c);
    let with = Node::with_prev(&c, &r);
    node.call(&bin("ptp"), "DEL", &pod.path(), "twice", &with)
        .ok();
    node.call(&bin("ptp"), "DEL", &pod.path(), "twice", &with)
        .ok();

    // Empty CNI_NETNS: the reservation is released and, from prevResult,
    // the host veth and its routes go too (the reference keeps them, and a
    // reused address would be routed to the old veth).
    let pod = TestNs::new();
    let r = add(&node, &pod, "nonetns", &c);
    assert_eq!(node.reservations().len(), 2);
    node.call(&bin("ptp"), "DEL", "", "nonetns", &Node::with_prev(&c, &r))
        .ok();
    assert!(node.reservations().is_empty());
    assert_eq!(node.host_veths(), Vec::<String>::new());
    nl(&pod.ns, async |n| {
        assert!(n.find_link("eth0").await.unwrap().is_none())
    });

    // The netns deleted before DEL.
    let gone = PersistentNs::new();
    let path = gone.path.display().to_string();
    let r = node.call(&bin("ptp"), "ADD", &path, "gone", &c).ok();
    gone.delete();
    node.call(&bin("ptp"), "DEL", &path, "gone", &Node::with_prev(&c, &r))
        .ok();
    node.call(&bin("ptp"), "DEL", &path, "gone", &c).ok();
    assert!(node.reservations().is_empty());
    assert_eq!(node.host_veths(), Vec::<String>::new());

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
    assert!(node.reservations().is_empty(), "IPAM released on failure");
    assert_eq!(node.host_veths(), Vec::<String>::new());
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

#[test]
fn ip_masq_rules_follow_the_attachment_even_without_netns() {
    for backend in ["iptables", "nftables"] {
        let node = Node::new();
        let c = conf(
            &node,
            "1.1.0",
            json!({"ipMasq": true, "ipMasqBackend": backend}),
        );
        let (a, b) = (TestNs::new(), TestNs::new());
        let ra = add(&node, &a, "masq-a", &c);
        let rb = add(&node, &b, "masq-b", &c);
        let rules = masq_rules(&node.ns.ns);
        for ip in ["10.77.0.2", "10.77.0.3", "fd77::2", "fd77::3"] {
            assert!(rules.contains(ip), "{backend}: {ip} in {rules}");
        }
        node.call(
            &bin("ptp"),
            "CHECK",
            &a.path(),
            "masq-a",
            &Node::with_prev(&c, &ra),
        )
        .ok();
        // DEL with an empty CNI_NETNS: the rules still go.
        node.call(&bin("ptp"), "DEL", "", "masq-a", &Node::with_prev(&c, &ra))
            .ok();
        let rules = masq_rules(&node.ns.ns);
        assert!(
            !rules.contains("10.77.0.2/") && !rules.contains("10.77.0.2 "),
            "{backend}: {rules}"
        );
        assert!(
            rules.contains("10.77.0.3"),
            "{backend}: the other pod keeps its rules"
        );
        // CHECK notices missing rules: GC with an empty valid set removes them.
        let mut gc = c.clone();
        gc["cni.dev/valid-attachments"] = json!([]);
        Call::new(bin("ptp"), "GC")
            .env("CNI_PATH", &node.cni_path)
            .env("CNI_CONTAINERID", "")
            .env("CNI_IFNAME", "")
            .stdin(&gc)
            .run_in(&node.ns.ns)
            .ok();
        let rules = masq_rules(&node.ns.ns);
        assert!(!rules.contains("10.77.0.3"), "{backend}: {rules}");
        assert!(node.reservations().is_empty(), "GC reached IPAM");
        let (code, msg) = node
            .call(
                &bin("ptp"),
                "CHECK",
                &b.path(),
                "masq-b",
                &Node::with_prev(&c, &rb),
            )
            .err();
        assert!(code == 106 || code == 107, "{backend}: {code} {msg}");
        node.call(
            &bin("ptp"),
            "DEL",
            &b.path(),
            "masq-b",
            &Node::with_prev(&c, &rb),
        )
        .ok();
    }
}

#[test]
fn status_reaches_ipam() {
    let node = Node::new();
    let c = conf(&node, "1.1.0", json!({}));
    Call::new(bin("ptp"), "STATUS")
        .env("CNI_PATH", &node.cni_path)
        .stdin(&c)
        .run_in(&node.ns.ns)
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
    let (code, _) = Call::new(bin("ptp"), "STATUS")
        .env("CNI_PATH", &node.cni_path)
        .stdin(&small)
        .run_in(&node.ns.ns)
        .err();
    assert_eq!(code, 50);
    node.call(&bin("ptp"), "DEL", &pod.path(), "only", &small)
        .ok();
}

#[test]
fn same_result_and_state_as_the_reference() {
    for v in ["0.3.1", "0.4.0", "1.0.0"] {
        let mut seen = Vec::new();
        for (ptp, path) in [
            (bin("ptp"), bin_dir()),
            (
                reference_bin("ptp"),
                Path::new("/usr/lib/cni").to_path_buf(),
            ),
        ] {
            let node = Node::with_path(path.display().to_string());
            let pod = TestNs::new();
            let c = conf(&node, v, json!({"mtu": 1450, "ipMasq": true}));
            let r = node.call(&ptp, "ADD", &pod.path(), "diff", &c).ok();
            let mut n = normalize_result(&r, v);
            for i in &mut n.interfaces {
                i.mac.clear();
                if i.name.starts_with("veth") {
                    i.name = "veth".into();
                }
                i.sandbox.clear();
            }
            let host_veth = r["interfaces"][0]["name"].as_str().unwrap().to_string();
            let state = (
                routes_of(&pod.ns),
                addrs_of(&pod.ns, "eth0"),
                addrs_of(&node.ns.ns, &host_veth),
                routes_of(&node.ns.ns),
                masq_rules(&node.ns.ns),
            );
            seen.push((n, state));
            let with = Node::with_prev(&c, &r);
            if v != "0.3.1" {
                node.call(&ptp, "CHECK", &pod.path(), "diff", &with).ok();
            }
            node.call(&ptp, "DEL", &pod.path(), "diff", &with).ok();
            assert!(node.reservations().is_empty());
            assert_eq!(node.host_veths(), Vec::<String>::new());
            assert_eq!(masq_rules(&node.ns.ns), "", "{v}");
        }
        assert_eq!(seen[0].0, seen[1].0, "{v}: result");
        assert_eq!(seen[0].1, seen[1].1, "{v}: kernel state");
    }
}
