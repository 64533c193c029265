//! Bridge VLAN options. This host's kernel has no VLAN filtering on bridges;
//! scripts/test runs this binary under scripts/vm-run (Debian's
//! full kernel).

use rcni_integration::{Node, ip, ip_link_json, merged, ours_and_upstream};
use rcni_netns::NetNs;
use rcni_testkit::{TestNs, ping};
use serde_json::{Value, json};
use std::collections::BTreeMap;

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

/// `Icmp: InEchos` of a namespace: echo requests that reached its stack.
fn icmp_in_echos(ns: &NetNs) -> u64 {
    let out = rcni_testkit::command_in(ns, "cat")
        .arg("/proc/net/snmp")
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let icmp: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| l.starts_with("Icmp:"))
        .map(|l| l.split_whitespace().collect())
        .collect();
    let i = icmp[0].iter().position(|k| *k == "InEchos").unwrap();
    icmp[1][i].parse().unwrap()
}

/// Since upstream v1.8.0 `preserveDefaultVlan` defaults to false: an access
/// port leaves VLAN 1, so a host on the bridge's default VLAN sends nothing
/// into an access-VLAN pod. With `preserveDefaultVlan: true` the pod's port
/// stays an untagged member of VLAN 1 and every VLAN 1 frame reaches it
/// (its answers, classified into its own VLAN, never go back).
#[test]
fn vlan_1_hosts_do_not_reach_access_vlan_pods() {
    for (preserve, reaches) in [(None, false), (Some(false), false), (Some(true), true)] {
        let node = Node::new();
        let pod = |cid: &str, addr: &str, extra: Value| {
            let p = TestNs::new();
            let c = json!({"cniVersion": "1.0.0", "name": "vl", "type": "bridge", "bridge": "brd",
                "ipam": {"type": "static", "addresses": [{"address": addr}]}});
            let r = node.add(&p, cid, &merged(c, extra));
            (p, r)
        };
        let mut access = json!({"vlan": 100});
        if let Some(p) = preserve {
            access["preserveDefaultVlan"] = json!(p);
        }
        let (a, ra) = pod("access", "10.6.0.1/24", access);
        // A plain port: the bridge's default VLAN 1, untagged.
        let (h, _) = pod("vlan1", "10.6.0.2/24", json!({}));
        let (b, _) = pod("same", "10.6.0.3/24", json!({"vlan": 100}));
        assert!(ping(&b.ns, "10.6.0.1"), "same VLAN still talks");
        // A's MAC without ARP: its ARP answer could never come back.
        let mac = ra["interfaces"][2]["mac"].as_str().unwrap();
        ip(
            &h.ns,
            &format!("neigh replace 10.6.0.1 lladdr {mac} dev eth0 nud permanent"),
        );
        let before = icmp_in_echos(&a.ns);
        assert!(!ping(&h.ns, "10.6.0.1"), "no way back in any case");
        let got = icmp_in_echos(&a.ns) - before;
        assert_eq!(
            got > 0,
            reaches,
            "preserveDefaultVlan {preserve:?}: {got} echoes"
        );
    }
}

/// A port's VLANs and their flags, as `bridge vlan show`.
type Vlans = Vec<(u64, Vec<String>)>;

/// Every port of `bridge` (the bridge itself too) by role: "bridge", "pod"
/// (`pod_port`), or "other" (the VLAN gateway's veth); ranges expanded.
fn vlan_table(ns: &NetNs, bridge: &str, pod_port: &str) -> BTreeMap<String, Vlans> {
    let out = rcni_testkit::command_in(ns, "bridge")
        .args(["-j", "vlan", "show"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(json!([]));
    let mut table = BTreeMap::new();
    for port in v.as_array().into_iter().flatten() {
        let name = port["ifname"].as_str().unwrap();
        let role = match name {
            n if n == bridge => "bridge",
            n if n == pod_port => "pod",
            _ => "other",
        };
        let mut vlans = Vlans::new();
        for vl in port["vlans"].as_array().into_iter().flatten() {
            let mut flags: Vec<String> = vl["flags"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|f| f.as_str().unwrap().to_string())
                .collect();
            flags.sort();
            let lo = vl["vlan"].as_u64().unwrap();
            let hi = vl["vlanEnd"].as_u64().unwrap_or(lo);
            vlans.extend((lo..=hi).map(|id| (id, flags.clone())));
        }
        table.insert(role.to_string(), vlans);
    }
    table
}

/// Port VLANs as v1.9.1 leaves them (bridge.go's setupVeth): the default
/// VLAN removed from a port with `vlan` or `vlanTrunk` unless
/// `preserveDefaultVlan`; `vlan` the untagged PVID, trunk VLANs tagged, the
/// trunk's native VLAN 1 when there is no `vlan`; `"vlanTrunk": []` turns
/// VLAN filtering on and touches no port. Ours, then v1.9.1's where at hand.
#[test]
fn port_vlans_and_flags_as_v191() {
    let native = || vec!["Egress Untagged".to_string(), "PVID".to_string()];
    let tagged = Vec::<String>::new;
    let default_bridge = vec![(1, native())];
    let cases: Vec<(Value, Vlans, Option<Vlans>)> = vec![
        (json!({"vlan": 100}), vec![(100, native())], None),
        (
            json!({"vlan": 100, "preserveDefaultVlan": true}),
            vec![(1, vec!["Egress Untagged".into()]), (100, native())],
            None,
        ),
        (
            json!({"vlanTrunk": [{"minID": 100, "maxID": 102}, {"id": 200}]}),
            vec![
                (1, native()),
                (100, tagged()),
                (101, tagged()),
                (102, tagged()),
                (200, tagged()),
            ],
            None,
        ),
        (
            json!({"vlanTrunk": [{"id": 100}], "preserveDefaultVlan": true}),
            vec![(1, native()), (100, tagged())],
            None,
        ),
        (
            json!({"vlan": 7, "vlanTrunk": [{"id": 100}, {"id": 200}]}),
            vec![(7, native()), (100, tagged()), (200, tagged())],
            None,
        ),
        // The access VLAN inside the trunk: added again tagged, it loses
        // PVID and untagged (the kernel updates an existing entry's flags).
        (
            json!({"vlan": 7, "vlanTrunk": [{"minID": 6, "maxID": 8}]}),
            vec![(6, tagged()), (7, tagged()), (8, tagged())],
            None,
        ),
        (
            json!({"vlanTrunk": [{"id": 1}, {"id": 300}]}),
            vec![(1, native()), (300, tagged())],
            None,
        ),
        (json!({"vlanTrunk": []}), vec![(1, native())], None),
        // The gateway's own veth is an access port of the VLAN too.
        (
            json!({"vlan": 100, "isGateway": true}),
            vec![(100, native())],
            Some(vec![(100, native())]),
        ),
    ];
    for (i, (extra, pod_want, other_want)) in cases.iter().enumerate() {
        let mut seen = Vec::new();
        for (plugin, path) in ours_and_upstream("bridge") {
            let what = format!("case {i} {extra}: {}", plugin.display());
            let node = Node::with_path(path);
            let pod = TestNs::new();
            let c = merged(
                json!({"cniVersion": "1.0.0", "name": "vl", "type": "bridge", "bridge": "brs",
                    "ipam": {"type": "static", "addresses": [{"address": "10.7.0.2/24", "gateway": "10.7.0.1"}]}}),
                extra.clone(),
            );
            let r = node.call(&plugin, "ADD", &pod.path(), "vl", &c).ok();
            let port = r["interfaces"][1]["name"].as_str().unwrap();
            let filtering =
                ip_link_json(&node.ns.ns, "brs")["linkinfo"]["info_data"]["vlan_filtering"].clone();
            assert_eq!(filtering, 1, "{what}");
            let table = vlan_table(&node.ns.ns, "brs", port);
            assert_eq!(table["pod"], *pod_want, "{what}");
            assert_eq!(table["bridge"], default_bridge, "{what}");
            assert_eq!(table.get("other"), other_want.as_ref(), "{what}");
            node.call(&plugin, "DEL", &pod.path(), "vl", &Node::with_prev(&c, &r))
                .ok();
            seen.push(table);
        }
        if let [ours, theirs] = &seen[..] {
            assert_eq!(ours, theirs, "case {i} {extra}: ours and v1.9.1");
        }
    }
}
