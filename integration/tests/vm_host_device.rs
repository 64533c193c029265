//! host-device with a dummy device, which this host's kernel lacks:
//! scripts/test runs this binary under scripts/vm-run.

use rcni_integration::{Node, ip, ipv6_addrs, nl};
use rcni_testkit::{Call, TestNs, bin};
use serde_json::json;

#[test]
fn a_dummy_moves_in_with_ipv6_and_comes_back_intact() {
    let node = Node::new();
    ip(&node.ns.ns, "link add dm0 mtu 9000 type dummy");
    let before = nl(&node.ns.ns, async |n| n.link_by_name("dm0").await.unwrap());
    let pod = TestNs::new();
    let c = json!({"cniVersion": "1.1.0", "name": "hd", "type": "host-device", "device": "dm0",
        "ipam": {"type": "static", "addresses": [{"address": "fd62::2/64"}, {"address": "10.62.9.2/24"}]}});
    let call = |cmd: &str, conf: &serde_json::Value| {
        Call::new(bin("host-device"), cmd)
            .env("CNI_PATH", &node.cni_path)
            .env("CNI_IFNAME", "net1")
            .netns(&pod.path())
            .stdin(conf)
            .run_in(&node.ns.ns)
    };
    let r = call("ADD", &c).ok();
    assert_eq!(r["interfaces"][0]["name"], "net1");
    // Duplicate address detection ran and finished before ADD returned.
    assert_eq!(
        ipv6_addrs(&pod.ns, "net1"),
        [("fd62::2/64".to_string(), false)]
    );
    nl(&pod.ns, async |n| {
        let l = n.link_by_name("net1").await.unwrap();
        assert_eq!(
            (l.kind.as_deref(), l.mtu, l.mac, l.alias.as_deref()),
            (Some("dummy"), 9000, before.mac, Some("dm0"))
        );
    });
    let with = Node::with_prev(&c, &r);
    call("CHECK", &with).ok();
    call("DEL", &with).ok();
    call("DEL", &with).ok();
    let after = nl(&node.ns.ns, async |n| n.link_by_name("dm0").await.unwrap());
    assert_eq!(
        (after.kind, after.mtu, after.mac, after.alias),
        (before.kind, before.mtu, before.mac, None)
    );
    nl(&pod.ns, async |n| {
        assert!(n.find_link("net1").await.unwrap().is_none())
    });
}
