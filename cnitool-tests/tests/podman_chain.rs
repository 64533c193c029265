//! conf/70-podman-chain.conflist (bridge + portmap + firewall + tuning)
//! through cnitool with a port mapping, ours against the reference: the
//! same result, the pod reachable, CHECK passing, and DEL leaving no
//! per-pod rule in either backend's tables.

use rcni_cnitool_tests::{Harness, Plugins, ip_lines, libcni_client, ours_and_reference};
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

/// Issue 21's failed DEL: an ADD killed while libcni (Debian's 1.1) writes
/// its result cache, which it does by truncating the file and then writing
/// it, leaves an empty cache file; libcni's DEL then fails before it runs
/// any plugin ("failed to get network ... cached result: unexpected end of
/// JSON input") and every rule and the reservation of the fully attached
/// pod stay. Our cnitool's DEL (the runtime of this project) reads an
/// unreadable cache as none, runs the chain without prevResult, and
/// removes everything, the broken cache file included.
#[test]
fn del_after_a_truncated_libcni_cache_write() {
    let (file, net) = ("70-podman-chain.conflist", "podnet");
    let h = Harness::new(Plugins::Ours, &[file]).with_node();
    let node = h.node_ns();
    let pod = TestNs::new();
    let libcni = |cmd: &str| {
        let out = node
            .command(libcni_client())
            .arg(cmd)
            .arg(h.confdir.path())
            .args([net, &pod.path(), "ctr1", "eth0"])
            .arg(h.cache.path())
            .env("CNI_PATH", h.plugins.dir())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, err) = libcni("add");
    assert!(ok, "{err}");
    let ip = rcni_testkit::reservations(&h.data.path().join(net));
    assert_eq!(ip.len(), 1);
    assert!(!pod_rules(node).is_empty());
    // The kill came between the truncation and the write.
    let cache = h.cache_file(net, "ctr1", "eth0");
    std::fs::write(&cache, "").unwrap();
    let (ok, err) = libcni("del");
    assert!(!ok && err.contains("cached result"), "{err}");
    eprintln!("libcni DEL: {err}");
    assert!(!pod_rules(node).is_empty(), "libcni's DEL ran no plugin");
    h.cnitool(&["del", net, &pod.path(), "--container-id", "ctr1"])
        .ok();
    assert_eq!(pod_rules(node), Vec::<String>::new());
    assert_eq!(h.reservations(net), Vec::<String>::new());
    assert!(!cache.exists());
}
