//! conf/70-podman-chain.conflist (bridge + portmap + firewall + tuning)
//! through cnitool with a port mapping, ours against the reference: the
//! same result, the pod reachable, CHECK passing, and DEL leaving no
//! per-pod rule in either backend's tables.

use rcni_cnitool_tests::{Plugins, ip_lines, ours_and_reference};
use rcni_testkit::{TestNs, normalized_result, ping, result_ips};

/// Lines of the node's nftables and iptables rules that name a pod
/// address or a port mapping.
fn pod_rules(node: &rcni_netns::NetNs) -> Vec<String> {
    let mut text = String::new();
    for (tool, args) in [
        ("nft", &["list", "ruleset"][..]),
        ("iptables-save", &[][..]),
    ] {
        let out = rcni_testkit::command_in(node, tool)
            .args(args)
            .output()
            .unwrap();
        text.push_str(&String::from_utf8_lossy(&out.stdout));
    }
    text.lines()
        .filter(|l| l.contains("dnat to") || l.contains("CNI-DN-") || l.contains("10.88.0."))
        .map(String::from)
        .collect()
}

#[test]
fn podman_chain_matches_the_reference() {
    let (file, net, version) = ("70-podman-chain.conflist", "podnet", "1.0.0");
    let caps = r#"{"portMappings":[{"hostPort":8080,"containerPort":80,"protocol":"tcp"}]}"#;
    let seen = ours_and_reference(&[file], |plugins, h| {
        let node = h.node_ns();
        let pod = TestNs::new();
        let env = [("CAP_ARGS", caps)];
        let r = h.cnitool_env(&["add", net, &pod.path()], &env).ok();
        let ip = result_ips(&r)[0].clone();
        assert!(ping(node, &ip), "{plugins:?}: node to pod");
        assert!(
            pod_rules(node).iter().any(|l| l.contains(&ip)),
            "{plugins:?}: no rule for {ip}"
        );
        // The reference's portmap (v1.1.1) fails CHECK of its own ADD: it
        // looks for the IPv4 chain in ip6tables as well.
        if plugins == Plugins::Ours {
            h.cnitool_env(&["check", net, &pod.path()], &env).ok();
        }
        let state = (
            ip_lines(&pod.ns, &["-br", "addr"]),
            ip_lines(&pod.ns, &["route"]),
        );
        h.cnitool_env(&["del", net, &pod.path()], &env).ok();
        h.cnitool_env(&["del", net, &pod.path()], &env).ok();
        assert_eq!(pod_rules(node), Vec::<String>::new(), "{plugins:?}");
        assert_eq!(h.reservations(net), Vec::<String>::new(), "{plugins:?}");
        (normalized_result(&r, version), state)
    });
    assert_eq!(seen[0].0, seen[1].0, "{file}: result");
    assert_eq!(seen[0].1, seen[1].1, "{file}: pod state");
}
