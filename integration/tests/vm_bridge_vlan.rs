//! Bridge VLAN options. This host's kernel has no VLAN filtering on bridges;
//! scripts/test runs this binary under scripts/vm-run (Debian's
//! full kernel).

use rcni_integration::{Node, bridge_vlans, ip_link_json};
use rcni_testkit::{TestNs, bin, ping};
use serde_json::json;

#[test]
fn access_vlans_isolate_pods() {
    let node = Node::new();
    let pod = |vlan: u32, ip: &str| {
        let p = TestNs::new();
        let conf = json!({"cniVersion": "1.0.0", "name": "vl", "type": "bridge", "bridge": "brv",
            "vlan": vlan, "ipam": {"type": "static", "addresses": [{"address": ip}]}});
        node.add(&p, &format!("c{vlan}{}", ip.len()), &conf);
        p
    };
    let a = pod(10, "10.5.0.1/24");
    let b = pod(10, "10.5.0.2/24");
    let c = pod(20, "10.5.0.3/24");
    assert!(ping(&a.ns, "10.5.0.2"), "same VLAN");
    assert!(!ping(&a.ns, "10.5.0.3"), "other VLAN must not answer");
    assert!(!ping(&c.ns, "10.5.0.2"));
    assert_eq!(
        ip_link_json(&node.ns.ns, "brv")["linkinfo"]["info_data"]["vlan_filtering"],
        1
    );
    drop((a, b, c));
}

#[test]
fn vlan_trunk_and_default_vlan() {
    let node = Node::new();
    let p = TestNs::new();
    let conf = json!({"cniVersion": "1.0.0", "name": "tr", "type": "bridge", "bridge": "brt",
        "vlanTrunk": [{"minID": 100, "maxID": 102}, {"id": 200}], "preserveDefaultVlan": false, "ipam": {}});
    let r = node.add(&p, "trunk", &conf);
    let port = r["interfaces"][1]["name"].as_str().unwrap().to_string();
    let vl = bridge_vlans(&node.ns.ns, &port);
    assert_eq!(
        vl,
        [(100, false), (101, false), (102, false), (200, false)],
        "no default VLAN 1, trunk tagged"
    );
    let p2 = TestNs::new();
    let keep = json!({"cniVersion": "1.0.0", "name": "tr", "type": "bridge", "bridge": "brt", "vlan": 7, "ipam": {}});
    let r2 = node.add(&p2, "access", &keep);
    let port2 = r2["interfaces"][1]["name"].as_str().unwrap().to_string();
    let vl2 = bridge_vlans(&node.ns.ns, &port2);
    assert!(
        vl2.contains(&(7, true)),
        "access VLAN is the untagged PVID: {vl2:?}"
    );
    assert!(
        vl2.iter().any(|(v, _)| *v == 1),
        "default VLAN kept by default: {vl2:?}"
    );
    let bad = json!({"cniVersion": "1.0.0", "name": "tr", "type": "bridge", "vlan": 5, "vlanTrunk": [{"id": 3}]});
    assert_eq!(
        node.call(&bin("bridge"), "ADD", &TestNs::new().path(), "x", &bad)
            .err()
            .0,
        7
    );
}
