//! conf/30-ptp.conflist through cnitool, ours against the reference: the
//! same result (apart from random veth names and MACs), the same kernel
//! state in pod and node, the same masquerade rules; DEL leaves nothing.

use rcni_cnitool_tests::{Plugins, ip_lines, masq_rules, ours_and_reference};
use rcni_testkit::{TestNs, normalized_result, ping, result_ips};

/// The reference's host veth gateway goes through IPv6 duplicate address
/// detection after ADD returns: give it the seconds it needs. Ours must
/// answer at once.
fn reaches(plugins: Plugins, from: &rcni_netns::NetNs, dst: &str) -> bool {
    let tries = if plugins == Plugins::Ours { 1 } else { 5 };
    (0..tries).any(|_| ping(from, dst))
}

#[test]
fn ptp_conflist_matches_the_reference() {
    let (file, net, version) = ("30-ptp.conflist", "ptp-net", "1.0.0");
    let seen = ours_and_reference(&[file], |plugins, h| {
        let node = h.node_ns();
        let (a, b) = (TestNs::new(), TestNs::new());
        let ra = h.cnitool(&["add", net, &a.path()]).ok();
        let rb = h.cnitool(&["add", net, &b.path()]).ok();
        for dst in result_ips(&rb) {
            assert!(
                reaches(plugins, &a.ns, &dst),
                "{plugins:?}: pod to pod {dst}"
            );
        }
        assert!(
            reaches(plugins, node, &result_ips(&ra)[0]),
            "{plugins:?}: node to pod"
        );
        h.cnitool(&["check", net, &a.path()]).ok();
        let state = (
            ip_lines(&a.ns, &["-br", "addr"]),
            ip_lines(&a.ns, &["route"]),
            ip_lines(&a.ns, &["-6", "route"]),
            ip_lines(node, &["-br", "addr"]),
            ip_lines(node, &["route"]),
            ip_lines(node, &["-6", "route"]),
            masq_rules(node),
        );
        let run = (normalized_result(&ra, version), state);
        h.cnitool(&["del", net, &a.path()]).ok();
        h.cnitool(&["del", net, &b.path()]).ok();
        h.cnitool(&["del", net, &a.path()]).ok();
        let left = ip_lines(node, &["-o", "link", "show", "type", "veth"]);
        assert!(left.is_empty(), "{plugins:?}: {left:?}");
        assert!(
            masq_rules(node).is_empty(),
            "{plugins:?}: {:?}",
            masq_rules(node)
        );
        assert_eq!(h.reservations(net), Vec::<String>::new(), "{plugins:?}");
        run
    });
    assert_eq!(seen[0].0, seen[1].0, "{file}: result");
    assert_eq!(seen[0].1, seen[1].1, "{file}: kernel state");
}
