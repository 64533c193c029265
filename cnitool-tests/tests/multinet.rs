//! conf/00-multinet.conflist (the default network conf/10-bridge.conflist
//! plus conf/multinet.d/20-macvlan.conflist, asked for through the pod
//! annotation) through cnitool and through a libcni client: both give the
//! pod eth0 on the bridge and net1 on macvlan, each reaching its own
//! network, and DEL leaves nothing, also with the macvlan conflist deleted
//! in between. multinet has no reference counterpart; macvlan comes from
//! the reference where rcni does not ship it.

use rcni_cnitool_tests::{Harness, Plugins, conf_dir, ip_lines};
use rcni_testkit::{REFERENCE_DIR, TestNs, bin_dir, ping, result_ips};
use serde_json::{Value, json};

const CAPS: &str =
    r#"{"io.kubernetes.cri.pod-annotations": {"k8s.v1.cni.cncf.io/networks": "macvlan-net"}}"#;

#[test]
fn pod_on_bridge_and_macvlan_through_cnitool_and_libcni() {
    let h = Harness::new(
        Plugins::Ours,
        &["00-multinet.conflist", "10-bridge.conflist"],
    )
    .with_node();
    let node = h.node_ns();
    let lan = TestNs::new();
    rcni_testkit::ip(node, "link add eth1 type veth peer name lan0");
    rcni_testkit::ip(node, &format!("link set lan0 netns {}", lan.path()));
    rcni_testkit::ip(node, "link set eth1 up");
    rcni_testkit::ip(&lan.ns, "addr add 10.30.0.1/24 dev lan0");
    rcni_testkit::ip(&lan.ns, "link set lan0 up");

    // The example's directories, pointed into the test's own.
    let extra = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let mut mv: Value = serde_json::from_slice(
        &std::fs::read(conf_dir().join("multinet.d/20-macvlan.conflist")).unwrap(),
    )
    .unwrap();
    mv["plugins"][0]["ipam"]["dataDir"] = json!(h.data.path());
    let mv_file = extra.path().join("20-macvlan.conflist");
    let mut mn: Value = serde_json::from_slice(
        &std::fs::read(h.confdir.path().join("00-multinet.conflist")).unwrap(),
    )
    .unwrap();
    let p = &mut mn["plugins"][0];
    p["defaultConfDir"] = json!(h.confdir.path());
    p["confDir"] = json!(extra.path());
    p["cacheDir"] = json!(state.path().join("cache"));
    p["statusDir"] = json!(state.path().join("status"));
    h.write_conf("00-multinet.conflist", &mn);

    let path = format!("{}:{REFERENCE_DIR}", bin_dir().display());
    let env = [("CAP_ARGS", CAPS), ("CNI_PATH", path.as_str())];
    for client in ["cnitool", "libcni"] {
        std::fs::write(&mv_file, serde_json::to_vec(&mv).unwrap()).unwrap();
        let pod = TestNs::new();
        let run = |cmd: &str| match client {
            "cnitool" => h.cnitool_env(
                &[cmd, "multinet", &pod.path(), "--container-id", "c1"],
                &env,
            ),
            _ => h.libcni_env(cmd, "multinet", &pod.path(), "c1", "eth0", &env),
        };
        let r = run("add").ok();
        let ips = result_ips(&r);
        assert!(ips[0].starts_with("10.22.0."), "{client}: {r}");
        let addrs = ip_lines(&pod.ns, &["-br", "-4", "addr"]);
        let net1 = addrs
            .iter()
            .find(|l| l.starts_with("net1"))
            .unwrap_or_else(|| panic!("{client}: no net1: {addrs:?}"));
        assert!(
            net1.contains(" 10.30.0.") && net1.contains("/24"),
            "{client}: {net1}"
        );
        assert!(ping(&pod.ns, "10.30.0.1"), "{client}: pod -> LAN over net1");
        assert!(ping(node, &ips[0]), "{client}: node -> pod over eth0");
        run("check").ok();
        std::fs::remove_file(&mv_file).unwrap();
        run("del").ok();
        run("del").ok();
        assert!(h.reservations("bridge-net").is_empty(), "{client}");
        assert!(h.reservations("macvlan-net").is_empty(), "{client}");
        let left = ip_lines(&pod.ns, &["-br", "link"]);
        assert_eq!(left.len(), 1, "{client}: only lo stays: {left:?}");
    }
}
