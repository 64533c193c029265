//! conf/50-host-device.conflist through cnitool, ours against the
//! reference: the node's `hostdev0` (here a veth wired to a router holding
//! 10.26.0.1) moves into the pod as eth0, carries a real packet, and comes
//! back under its name on DEL; same result and pod state.

use rcni_cnitool_tests::{Plugins, ip_lines, ours_and_reference};
use rcni_testkit::{TestNs, ip, normalized_result, ping};

#[test]
fn host_device_conflist_matches_the_reference() {
    let (file, net, version) = ("50-host-device.conflist", "hostdev-net", "1.0.0");
    let seen = ours_and_reference(&[file], |plugins, h| {
        let node = h.node_ns();
        ip(
            node,
            "link add hostdev0 mtu 1400 type veth peer name router0",
        );
        ip(node, "addr add 10.26.0.1/24 dev router0");
        ip(node, "link set router0 up");
        let device = ip_lines(node, &["-d", "link", "show", "hostdev0"]);

        let pod = TestNs::new();
        let r = h.cnitool(&["add", net, &pod.path()]).ok();
        assert!(ip_lines(node, &["link", "show", "hostdev0"]).is_empty());
        assert!(
            ping(&pod.ns, "10.26.0.1"),
            "{plugins:?}: pod to router through the device"
        );
        h.cnitool(&["check", net, &pod.path()]).ok();
        let state = (
            ip_lines(&pod.ns, &["-br", "addr"]),
            ip_lines(&pod.ns, &["route"]),
            ip_lines(&pod.ns, &["-d", "link", "show", "eth0"])
                .iter()
                .any(|l| l.contains("alias hostdev0")),
        );
        let run = (normalized_result(&r, version), state);
        h.cnitool(&["del", net, &pod.path()]).ok();
        assert!(ip_lines(&pod.ns, &["link", "show", "eth0"]).is_empty());
        let back = ip_lines(node, &["-d", "link", "show", "hostdev0"]);
        if plugins == Plugins::Ours {
            assert_eq!(back, device, "the device comes back as it was");
            // A repeated DEL (the reference fails it: the device is gone
            // from the pod).
            h.cnitool(&["del", net, &pod.path()]).ok();
        } else {
            // Deliberate difference: the reference leaves the alias set.
            assert!(
                back.iter().any(|l| l.contains("alias hostdev0")),
                "{back:?}"
            );
        }
        run
    });
    assert!(seen[0].1.2, "the original name is in the alias");
    assert_eq!(seen[0].0, seen[1].0, "{file}: result");
    assert_eq!(seen[0].1, seen[1].1, "{file}: pod state");
}
