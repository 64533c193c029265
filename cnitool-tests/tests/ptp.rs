//! conf/30-ptp.conflist through cnitool, ours against the reference: the
//! same result (apart from random veth names and MACs), the same kernel
//! state in pod and node, the same masquerade rules; DEL leaves nothing.

use rcni_cnitool_tests::{Harness, Plugins, ip_lines, masq_rules, normalized_result};
use rcni_testkit::{TestNs, ping};
use serde_json::Value;

fn addr(r: &Value, i: usize) -> String {
    r["ips"][i]["address"]
        .as_str()
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_string()
}

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
    let mut seen = Vec::new();
    for plugins in [Plugins::Ours, Plugins::Reference] {
        let h = Harness::new(plugins, &[file]).with_node();
        let node = &h.node.as_ref().unwrap().ns;
        let (a, b) = (TestNs::new(), TestNs::new());
        let ra = h.cnitool(&["add", net, &a.path()]).ok();
        let rb = h.cnitool(&["add", net, &b.path()]).ok();
        for i in [0, 1] {
            assert!(
                reaches(plugins, &a.ns, &addr(&rb, i)),
                "{plugins:?}: pod to pod {}",
                addr(&rb, i)
            );
        }
        assert!(
            reaches(plugins, node, &addr(&ra, 0)),
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
        seen.push((normalized_result(&ra, version), state));
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
    }
    assert_eq!(seen[0].0, seen[1].0, "{file}: result");
    assert_eq!(seen[0].1, seen[1].1, "{file}: kernel state");
}
