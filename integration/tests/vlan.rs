//! The vlan binary where no 802.1Q link has to be made (this host's kernel
//! has none; vm_vlan.rs has the packets): config errors, DEL without master
//! or netns, STATUS and GC reaching IPAM.

use rcni_integration::{Node, ip, link_names, merged};
use rcni_testkit::{Call, PersistentNs, TestNs, bin, reference_bin};
use serde_json::{Value, json};

fn conf(node: &Node, extra: Value) -> Value {
    let c = json!({
        "cniVersion": "1.1.0", "name": "podnet", "type": "vlan", "master": "eth1", "vlanId": 100,
        "ipam": {"type": "host-local", "dataDir": node.data.path(),
                 "ranges": [[{"subnet": "10.61.0.0/24"}]]}
    });
    merged(c, extra)
}

#[test]
fn config_errors_are_code_7_and_touch_nothing() {
    let node = Node::new();
    ip(
        &node.ns.ns,
        "link add eth1 mtu 1500 type veth peer name eth1p",
    );
    let pod = TestNs::new();
    for (extra, want) in [
        (json!({"master": ""}), "\"master\" field is required"),
        (json!({"vlanId": 4095}), "invalid VLAN ID 4095"),
        (
            json!({"master": "nosuch0"}),
            "failed to lookup master \"nosuch0\"",
        ),
        (
            json!({"mtu": 9000}),
            "invalid MTU 9000, must be [0, master MTU(1500)]",
        ),
        (
            json!({"linkInContainer": true}),
            "failed to lookup master \"eth1\"",
        ),
    ] {
        let (code, msg) = node
            .call(
                &bin("vlan"),
                "ADD",
                &pod.path(),
                "ctr",
                &conf(&node, extra.clone()),
            )
            .err();
        assert_eq!(code, 7, "{extra}: {msg}");
        assert!(msg.contains(want), "{extra}: {msg}");
    }
    assert!(node.reservations().is_empty());
    assert_eq!(link_names(&pod.ns), ["lo"]);
}

#[test]
fn del_succeeds_without_master_or_netns_and_releases_ipam() {
    let node = Node::new();
    // 1.0.0: the reference (1.1.1) is run on it too.
    let c = conf(&node, json!({"cniVersion": "1.0.0"}));
    // A reservation as ADD would have made it (ADD itself needs 802.1Q).
    let pod = TestNs::new();
    Call::new(bin("host-local"), "ADD")
        .env("CNI_CONTAINERID", "ctr")
        .netns(&pod.path())
        .stdin(&c)
        .run_in(&node.ns.ns)
        .ok();
    assert_eq!(node.reservations().len(), 1);
    // No master "eth1" on the node, the netns gone: the reference fails here
    // (it looks the master up to validate the MTU); ours releases the address.
    let gone = PersistentNs::new();
    let path = gone.path.display().to_string();
    gone.delete();
    let (code, msg) = node
        .call(&reference_bin("vlan"), "DEL", &path, "ctr", &c)
        .err();
    assert!(code > 0 && msg.contains("not found"), "{code} {msg}");
    node.call(&bin("vlan"), "DEL", &path, "ctr", &c).ok();
    assert!(node.reservations().is_empty());
    node.call(&bin("vlan"), "DEL", &path, "ctr", &c).ok();
    node.call(&bin("vlan"), "DEL", "", "ctr", &c).ok();
    // A live netns without the link: nothing to delete, success.
    node.call(&bin("vlan"), "DEL", &TestNs::new().path(), "ctr", &c)
        .ok();
    // Without IPAM (L2 only).
    let mut l2 = c.clone();
    l2.as_object_mut().unwrap().remove("ipam");
    node.call(&bin("vlan"), "DEL", &TestNs::new().path(), "ctr", &l2)
        .ok();
}

#[test]
fn status_and_gc_reach_ipam() {
    let node = Node::new();
    node.ipam_status_and_gc("vlan", &conf(&node, json!({})), "10.61.0");
}

/// L2 (no `ipam`, or `"ipam": {}`): at 0.1.0/0.2.0 a result without
/// addresses has no shape, refused with the reference's text before the
/// link is made (v1.10.0 makes it first and leaves it in the pod); STATUS
/// and DEL never look for an IPAM plugin (v1.9.1's failed with "no plugin
/// name provided"). ADD and CHECK need 802.1Q: vm_vlan.rs.
#[test]
fn l2_skips_ipam_and_refuses_resultless_versions_first() {
    let node = Node::new();
    ip(
        &node.ns.ns,
        "link add eth1 mtu 1500 type veth peer name eth1p",
    );
    let pod = TestNs::new();
    for ipam in [None, Some(json!({}))] {
        let l2 = |version: &str| {
            let mut c = conf(&node, json!({"cniVersion": version}));
            match &ipam {
                Some(i) => c["ipam"] = i.clone(),
                None => {
                    c.as_object_mut().unwrap().remove("ipam");
                }
            }
            c
        };
        for version in ["0.1.0", "0.2.0"] {
            let (code, msg) = node
                .call(&bin("vlan"), "ADD", &pod.path(), "l2", &l2(version))
                .err();
            assert_eq!(
                (code, msg.as_str()),
                (1, "cannot convert: no valid IP addresses"),
                "{version} {ipam:?}"
            );
            assert_eq!(link_names(&pod.ns), ["lo"], "{version}: made nothing");
            node.call(&bin("vlan"), "DEL", &pod.path(), "l2", &l2(version))
                .ok();
        }
        node.status(&bin("vlan"), &l2("1.1.0")).ok();
        node.call(&bin("vlan"), "DEL", &pod.path(), "l2", &l2("1.1.0"))
            .ok();
    }
    assert!(node.reservations().is_empty());
}
