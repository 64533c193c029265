//! A malformed CNI_ARGS (a pair without `=`, `CNI_ARGS=none` in upstream's
//! loopback suite) fails only the plugins that read CNI_ARGS, and only on
//! ADD and CHECK, as in the reference; DEL always cleans up (the
//! reference's bridge, tuning and host-local fail DEL there).

use rcni_integration::lab::chain::*;
use rcni_netlink::Netlink;
use rcni_netns::NetNs;
use rcni_testkit::{Call, Output, TestNs, bin, reference_bin, reservations};
use serde_json::{Value, json};
use std::path::Path;

/// The spec versions of upstream's loopback suite (`AllSpecVersions`,
/// v1.9.1; v1.1.1 stops at 1.0.0).
const UPSTREAM_VERSIONS: [&str; 7] = [
    "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0",
];

fn lo_up(ns: &NetNs) -> bool {
    let rt = rcni_netlink::runtime().unwrap();
    rt.block_on(async {
        let nl = Netlink::connect(ns).await.unwrap();
        nl.link_by_name("lo").await.unwrap().admin_up
    })
}

/// Upstream's loopback suite: ADD and DEL with its environment
/// (`CNI_ARGS=none`, ifname lo, a CNI_PATH that does not exist), each in a
/// fresh namespace; ADD prints a result and brings lo up, DEL takes it down.
#[test]
fn loopback_with_cni_args_none_as_upstreams_suite() {
    for v in UPSTREAM_VERSIONS {
        let mut plugins = vec![bin("loopback")];
        if v != "1.1.0" {
            plugins.push(reference_bin("loopback"));
        }
        for plugin in plugins {
            let call = |cmd: &str, pod: &TestNs| {
                Call::new(&plugin, cmd)
                    .env("CNI_CONTAINERID", "dummy")
                    .netns(&pod.path())
                    .env("CNI_IFNAME", "lo")
                    .env("CNI_ARGS", "none")
                    .env("CNI_PATH", "/some/test/path")
                    .stdin(&json!({"name": "loopback-test", "cniVersion": v}))
                    .run()
            };
            let what = format!("{v} {}", plugin.display());
            let pod = TestNs::new();
            let r = call("ADD", &pod).ok();
            assert!(r.is_object(), "{what}: {r}");
            assert!(lo_up(&pod.ns), "{what}: lo up after ADD");
            assert_eq!(call("DEL", &pod).ok(), Value::Null, "{what}");
            assert!(!lo_up(&pod.ns), "{what}: lo down after DEL");
            let fresh = TestNs::new();
            call("DEL", &fresh).ok();
            assert!(!lo_up(&fresh.ns), "{what}: DEL in a fresh namespace");
        }
    }
}

/// Runs `plugin` with `cmd` for `pod`'s eth0 from the node, with `cni_args`.
fn call(lan: &Lan, plugin: &Path, cmd: &str, pod: &TestNs, conf: &Value, cni_args: &str) -> Output {
    Call::new(plugin, cmd)
        .env("CNI_PATH", &lan.cni_path)
        .env("CNI_CONTAINERID", "pod-a")
        .env("CNI_ARGS", cni_args)
        .netns(&pod.path())
        .stdin(conf)
        .run_in(&lan.node.ns)
}

fn mtu(pod: &TestNs) -> u32 {
    nl(&pod.ns, async |n| n.link_by_name("eth0").await.unwrap().mtu)
}

/// Per plugin, ours fails ADD for `CNI_ARGS=none` exactly where the
/// reference fails (bridge through host-local, tuning: code 4 here, the
/// reference's 999), succeeds where it succeeds (portmap, firewall,
/// bandwidth), CHECK likewise; DEL with it always succeeds and cleans up:
/// tuning restores the interface, bridge removes the veth, host-local
/// releases the address.
#[test]
fn malformed_cni_args_fail_add_only_where_the_reference_does() {
    let lan = Lan::new();
    let tuning_data = tempfile::tempdir().unwrap();
    let chained = [
        (
            "portmap",
            json!({"type": "portmap", "capabilities": {"portMappings": true}}),
            true,
        ),
        ("firewall", json!({"type": "firewall"}), true),
        (
            "bandwidth",
            json!({"type": "bandwidth", "ingressRate": 8_000_000, "ingressBurst": 100_000,
                   "egressRate": 8_000_000, "egressBurst": 100_000}),
            true,
        ),
        (
            "tuning",
            json!({"type": "tuning", "dataDir": tuning_data.path(), "mtu": 1400}),
            false,
        ),
    ];
    let mut br = lan.bridge_conf("1.0.0");
    br.as_object_mut().unwrap().remove("name");
    let mut plugins = vec![br];
    plugins.extend(chained.iter().map(|(_, p, _)| {
        let mut p = p.clone();
        p.as_object_mut().unwrap().remove("name");
        p
    }));
    let c = Chain::new("1.0.0", plugins).caps(json!({"portMappings": [
        {"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}
    ]}));
    let pod = TestNs::new();
    let net_dir = lan.data.path().join("podnet");

    // bridge (and host-local, which it runs with the same CNI_ARGS).
    let br = c.stdin(0, None);
    let (_, msg) = call(&lan, &reference_bin("bridge"), "ADD", &pod, &br, "none").err();
    assert!(msg.contains(r#"invalid pair "none""#), "reference: {msg}");
    let ours = call(&lan, &bin("bridge"), "ADD", &pod, &br, "none").err();
    assert_eq!(ours, (4, r#"ARGS: invalid pair "none""#.into()));
    assert_eq!(reservations(&net_dir), Vec::<String>::new());
    let r = call(&lan, &bin("bridge"), "ADD", &pod, &br, "").ok();

    for (i, (name, _, reference_adds)) in chained.iter().enumerate() {
        let conf = c.stdin(i + 1, Some(&r));
        // The reference, undone at once where it succeeded (our DEL also
        // removes what the reference's leaves: bandwidth's TBF on the veth).
        let theirs = call(&lan, &reference_bin(name), "ADD", &pod, &conf, "none");
        assert_eq!(
            theirs.code == 0,
            *reference_adds,
            "reference {name}: {theirs:?}"
        );
        if theirs.code == 0 {
            call(&lan, &reference_bin(name), "DEL", &pod, &conf, "").ok();
            call(&lan, &bin(name), "DEL", &pod, &conf, "").ok();
        }
        let ours = call(&lan, &bin(name), "ADD", &pod, &conf, "none");
        if *reference_adds {
            ours.ok();
            call(&lan, &bin(name), "CHECK", &pod, &conf, "none").ok();
        } else {
            assert_eq!(
                ours.err(),
                (4, r#"ARGS: invalid pair "none""#.into()),
                "{name}"
            );
            call(&lan, &bin(name), "ADD", &pod, &conf, "").ok();
            let (code, _) = call(&lan, &bin(name), "CHECK", &pod, &conf, "none").err();
            assert_eq!(code, 4, "{name} CHECK");
        }
    }
    assert_eq!(mtu(&pod), 1400, "tuning applied");

    // DEL in reverse with CNI_ARGS=none: every plugin succeeds and cleans up.
    for (i, (name, _, _)) in chained.iter().enumerate().rev() {
        let conf = c.stdin(i + 1, Some(&r));
        call(&lan, &bin(name), "DEL", &pod, &conf, "none").ok();
    }
    assert_eq!(mtu(&pod), 1500, "tuning's DEL restored the MTU");
    assert!(
        !lan.on_node("iptables-save", &["-t", "nat"])
            .contains("CNI-DN-")
            && !lan.on_node("nft", &["list", "ruleset"]).contains("dnat to"),
        "portmap rules left"
    );
    let br_del = c.stdin(0, Some(&r));
    // The reference's bridge fails DEL here (LoadArgs), and so leaks.
    let (_, msg) = call(&lan, &reference_bin("bridge"), "DEL", &pod, &br_del, "none").err();
    assert!(msg.contains(r#"invalid pair "none""#), "{msg}");
    assert_eq!(reservations(&net_dir).len(), 2);
    call(&lan, &bin("bridge"), "DEL", &pod, &br_del, "none").ok();
    assert_eq!(
        reservations(&net_dir),
        Vec::<String>::new(),
        "host-local released the addresses"
    );
    let host_veth = host_veth(&r);
    assert!(
        nl(&lan.node.ns, async move |n| n
            .find_link(&host_veth)
            .await
            .unwrap())
        .is_none(),
        "bridge removed the veth"
    );
    // Idempotent, still with CNI_ARGS=none.
    call(&lan, &bin("bridge"), "DEL", &pod, &br_del, "none").ok();
}
