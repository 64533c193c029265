//! conf/40-vlan.conflist through cnitool, ours against the reference: the
//! same result (apart from the MAC), the same state in the pod, a real
//! packet to the VLAN's router; DEL leaves nothing. Needs 802.1Q: runs
//! under scripts/vm-run (see scripts/test).

use rcni_cnitool_tests::{ip_lines, ours_and_reference};
use rcni_testkit::{TestNs, ip, normalized_result, ping};

#[test]
fn vlan_conflist_matches_the_reference() {
    let (file, net, version) = ("40-vlan.conflist", "vlan-net", "1.0.0");
    let seen = ours_and_reference(&[file], |plugins, h| {
        let node = h.node_ns();
        // The node's uplink eth1 is wired to a router that holds the VLAN's
        // gateway address on its own VLAN 100 link.
        let router = TestNs::new();
        ip(node, "link add eth1 type veth peer name up0");
        ip(node, &format!("link set up0 netns {}", router.path()));
        ip(node, "link set eth1 up");
        ip(&router.ns, "link set up0 up");
        ip(
            &router.ns,
            "link add link up0 name up0.100 type vlan id 100",
        );
        ip(&router.ns, "addr add 10.25.0.1/24 dev up0.100");
        ip(&router.ns, "link set up0.100 up");

        let pod = TestNs::new();
        let r = h.cnitool(&["add", net, &pod.path()]).ok();
        assert!(
            ping(&pod.ns, "10.25.0.1"),
            "{plugins:?}: pod to router over VLAN 100"
        );
        h.cnitool(&["check", net, &pod.path()]).ok();
        let state = (
            ip_lines(&pod.ns, &["-br", "addr"]),
            ip_lines(&pod.ns, &["route"]),
            ip_lines(&pod.ns, &["-d", "-o", "link", "show", "eth0"])
                .iter()
                .map(|l| l.contains("vlan protocol 802.1Q id 100") && l.contains("mtu 1400"))
                .collect::<Vec<_>>(),
        );
        let run = (normalized_result(&r, version), state);
        h.cnitool(&["del", net, &pod.path()]).ok();
        h.cnitool(&["del", net, &pod.path()]).ok();
        assert!(ip_lines(&pod.ns, &["-o", "link", "show", "eth0"]).is_empty());
        assert_eq!(h.reservations(net), Vec::<String>::new(), "{plugins:?}");
        run
    });
    assert_eq!(seen[0].1.2, [true], "eth0 is VLAN 100 with MTU 1400");
    assert_eq!(seen[0].0, seen[1].0, "{file}: result");
    assert_eq!(seen[0].1, seen[1].1, "{file}: pod state");
}
