//! The dummy binary with real dummy links. This host's kernel has no dummy
//! module; scripts/test runs this binary under scripts/vm-run (Debian's
//! full kernel). Side by side with upstream's v1.9.1 at every spec version
//! (result, link, addresses, routes, sysctls), the missing-IPAM error,
//! CHECK after damage, DEL twice and with the netns gone, rollback of a
//! failed ADD, STATUS and GC reaching IPAM, and the address answering.

use rcni_integration::{
    Node, addrs_of, delete_pod_eth0, ip, link_names, merged, nl, ours_and_upstream,
    remove_pod_address, routes_of,
};
use rcni_netns::NetNs;
use rcni_testkit::{TestNs, bin, normalized_result, ping};
use serde_json::{Value, json};

const VERSIONS: [&str; 6] = ["0.1.0", "0.2.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// Static IPv4 and IPv6 with a default route; DNS from IPAM and the config.
fn conf(version: &str) -> Value {
    json!({"cniVersion": version, "name": "podnet", "type": "dummy",
        "dns": {"nameservers": ["10.73.0.53"]},
        "ipam": {"type": "static",
            "addresses": [{"address": "10.73.0.2/24", "gateway": "10.73.0.1"},
                          {"address": "fd73::2/64"}],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dns": {"search": ["ipam.example"]}}})
}

/// host-local on `node`'s data dir (network `podnet`, for its reservations).
fn host_local(node: &Node, version: &str, ipam_extra: Value) -> Value {
    let ipam = merged(
        json!({"type": "host-local", "dataDir": node.data.path(),
               "ranges": [[{"subnet": "10.74.0.0/24"}]]}),
        ipam_extra,
    );
    json!({"cniVersion": version, "name": "podnet", "type": "dummy", "ipam": ipam})
}

fn sysctl(ns: &NetNs, key: &str) -> String {
    rcni_netlink::sysctl::get(ns, key)
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|_| "absent".into())
}

#[test]
fn same_result_and_state_as_v191_at_every_version() {
    for v in VERSIONS {
        let mut seen = Vec::new();
        for (dummy, path) in ours_and_upstream("dummy") {
            let node = Node::with_path(path);
            let pod = TestNs::new();
            let c = conf(v);
            let r = node.call(&dummy, "ADD", &pod.path(), "diff", &c).ok();
            let l = nl(&pod.ns, async |n| n.link_by_name("eth0").await.unwrap());
            let state = json!({
                "kind": l.kind, "mtu": l.mtu, "up": l.admin_up,
                "addrs": addrs_of(&pod.ns, "eth0"), "routes": routes_of(&pod.ns),
                "keep_addr_on_down": sysctl(&pod.ns, "net/ipv6/conf/eth0/keep_addr_on_down"),
            });
            if v == "1.0.0" {
                assert_eq!(
                    r["interfaces"],
                    json!([{"name": "eth0", "mac": l.mac.unwrap().to_string(), "sandbox": pod.path()}]),
                    "{dummy:?}"
                );
            }
            seen.push((normalized_result(&r, v), state));
            let with = Node::with_prev(&c, &r);
            if !matches!(v, "0.1.0" | "0.2.0" | "0.3.1") {
                node.call(&dummy, "CHECK", &pod.path(), "diff", &with).ok();
            }
            node.call(&dummy, "DEL", &pod.path(), "diff", &with).ok();
            node.call(&dummy, "DEL", &pod.path(), "diff", &with).ok();
            assert_eq!(link_names(&pod.ns), ["lo"], "{v} {dummy:?}");
        }
        if let [ours, theirs] = &seen[..] {
            assert_eq!(ours.0, theirs.0, "{v}: result");
            assert_eq!(ours.1, theirs.1, "{v}: kernel state");
        }
    }
}

/// ADD and CHECK without IPAM fail with the reference's message (its code
/// is 999, ours 7: a config error) and make nothing; DEL succeeds (the
/// reference's fails looking for an IPAM plugin named "").
#[test]
fn missing_ipam_is_refused_as_v191() {
    let c = json!({"cniVersion": "1.0.0", "name": "podnet", "type": "dummy"});
    let mut msgs = Vec::new();
    for (dummy, path) in ours_and_upstream("dummy") {
        let node = Node::with_path(path);
        let pod = TestNs::new();
        let (code, msg) = node.call(&dummy, "ADD", &pod.path(), "noipam", &c).err();
        assert_eq!(link_names(&pod.ns), ["lo"], "{dummy:?}");
        let check = node.call(&dummy, "CHECK", &pod.path(), "noipam", &c).err();
        assert_eq!(check.1, msg, "{dummy:?}");
        msgs.push(msg.clone());
        if dummy == bin("dummy") {
            assert_eq!(code, 7);
            assert_eq!(msg, "dummy interface requires an IPAM configuration");
            node.call(&dummy, "DEL", &pod.path(), "noipam", &c).ok();
        } else {
            assert_eq!(code, 999);
        }
    }
    assert!(msgs.windows(2).all(|w| w[0] == w[1]), "{msgs:?}");
}

fn set_down(_: &NetNs, pod: &NetNs, _: &Value) {
    ip(pod, "link set eth0 down");
}

fn change_mac(_: &NetNs, pod: &NetNs, _: &Value) {
    ip(pod, "link set eth0 address 02:00:00:00:99:99");
}

fn replace_with_bridge(_: &NetNs, pod: &NetNs, r: &Value) {
    let mac = r["interfaces"][0]["mac"].as_str().unwrap().to_string();
    ip(pod, "link del eth0");
    ip(pod, &format!("link add eth0 address {mac} type bridge"));
    ip(pod, "link set eth0 up");
}

#[test]
fn check_del_rollback_status_and_gc() {
    let node = Node::new();
    node.check_catches(
        &bin("dummy"),
        &conf("1.0.0"),
        &[
            ("address removed", remove_pod_address),
            ("eth0 deleted", delete_pod_eth0),
            ("eth0 down", set_down),
            ("mac changed", change_mac),
            ("not a dummy", replace_with_bridge),
        ],
    );
    node.del_survives_repeats_and_a_deleted_netns(
        &bin("dummy"),
        &host_local(&node, "1.0.0", json!({})),
    );

    // A route the kernel refuses (its gateway is on no link): the link is
    // removed, the address released.
    let bad = host_local(
        &node,
        "1.0.0",
        json!({"routes": [{"dst": "192.168.0.0/16", "gw": "172.31.0.1"}]}),
    );
    let pod = TestNs::new();
    let (code, msg) = node
        .call(&bin("dummy"), "ADD", &pod.path(), "rb", &bad)
        .err();
    assert_eq!(code, 103, "{msg}");
    assert_eq!(link_names(&pod.ns), ["lo"], "the dummy rolled back");
    assert!(node.reservations().is_empty(), "IPAM released");
    // CNI_IFNAME taken: code 4, the link untouched.
    ip(&pod.ns, "link add eth0 type bridge");
    let ok = host_local(&node, "1.0.0", json!({}));
    let (code, _) = node
        .call(&bin("dummy"), "ADD", &pod.path(), "rb", &ok)
        .err();
    assert_eq!(code, 4);
    assert!(node.reservations().is_empty());

    node.ipam_status_and_gc("dummy", &host_local(&node, "1.1.0", json!({})), "10.74.5");
}

/// The addresses answer inside the pod, through the dummy link, and the
/// IPAM route is there.
#[test]
fn addresses_answer_in_the_pod() {
    let node = Node::new();
    let pod = TestNs::new();
    let c = conf("1.0.0");
    let r = node
        .call(&bin("dummy"), "ADD", &pod.path(), "ping", &c)
        .ok();
    ip(&pod.ns, "link set lo up");
    assert!(ping(&pod.ns, "10.73.0.2"));
    assert!(ping(&pod.ns, "fd73::2"));
    assert!(
        routes_of(&pod.ns).contains(&"0.0.0.0/0 via 10.73.0.1 scope 0".to_string()),
        "{:?}",
        routes_of(&pod.ns)
    );
    node.check_and_del(&bin("dummy"), &pod, "ping", &c, &r);
    assert_eq!(link_names(&pod.ns), ["lo"]);
}
