//! conf/ loopback networks through our cnitool and a libcni client, with our
//! plugins and with the reference plugins.

use rcni_cnitool_tests::{Harness, Plugins};
use rcni_netns::NetNs;
use rcni_testkit::{TestNs, normalize_result, ping, unique_name};
use serde_json::{Value, json};

/// `lo` admin state, read with `ip` inside the namespace (a second opinion
/// next to our netlink crate, which the plugin itself uses).
fn lo_up(ns: &NetNs) -> bool {
    let out = rcni_testkit::command_in(ns, "ip")
        .args(["-o", "link", "show", "lo"])
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    s.contains("<LOOPBACK,UP")
}

fn result_without_sandbox(v: &Value, version: &str) -> rcni_cni::CniResult {
    let mut r = normalize_result(v, version);
    for i in &mut r.interfaces {
        i.sandbox.clear();
    }
    r
}

/// (file, network, version, has CHECK)
const CASES: &[(&str, &str, &str, bool)] = &[
    ("99-loopback.conf", "cni-loopback", "0.3.1", false),
    ("loopback.conflist", "loopback-net", "1.0.0", true),
    ("loopback-chain.conflist", "loopback-chain", "0.4.0", true),
];

#[test]
fn conf_examples_behave_like_the_reference_through_cnitool() {
    for &(file, net, version, has_check) in CASES {
        let mut results = Vec::new();
        for plugins in Plugins::BOTH {
            let h = Harness::new(plugins, &[file]);
            let pod = TestNs::new();
            let add = h.cnitool(&["add", net, &pod.path()]);
            let result = add.ok();
            assert_eq!(result["cniVersion"], version, "{file} {plugins:?}");
            assert!(lo_up(&pod.ns), "{file} {plugins:?}: lo up");
            assert!(
                ping(&pod.ns, "127.0.0.1"),
                "{file} {plugins:?}: real packet on lo"
            );
            // The cache is libcni's.
            let cid = cnitool::runtime::container_id_for(&pod.path());
            let cached: Value =
                serde_json::from_slice(&std::fs::read(h.cache_file(net, &cid, "eth0")).unwrap())
                    .unwrap();
            assert_eq!(cached["kind"], "cniCacheV1");
            assert_eq!(cached["containerId"], cid);
            assert_eq!(cached["networkName"], net);
            assert_eq!(
                result_without_sandbox(&cached["result"], version),
                result_without_sandbox(&result, version)
            );

            let check = h.cnitool(&["check", net, &pod.path()]);
            if has_check {
                check.ok();
            } else {
                assert_ne!(check.code, 0);
                assert!(
                    check.stderr.contains("does not support the CHECK command"),
                    "{}",
                    check.stderr
                );
            }
            h.cnitool(&["del", net, &pod.path()]).ok();
            assert!(!lo_up(&pod.ns), "{file} {plugins:?}: lo down after DEL");
            assert!(
                !h.cache_file(net, &cid, "eth0").exists(),
                "cache removed after DEL"
            );
            h.cnitool(&["del", net, &pod.path()]).ok();
            results.push(result_without_sandbox(&result, version));
        }
        assert_eq!(
            results[0], results[1],
            "{file}: our result and the reference's"
        );
    }
}

#[test]
fn libcni_client_gets_the_same_from_ours_and_the_reference() {
    let mut results = Vec::new();
    for plugins in Plugins::BOTH {
        let h = Harness::new(plugins, &["loopback.conflist"]);
        let pod = TestNs::new();
        let r = h
            .libcni("add", "loopback-net", &pod.path(), "ctr1", "eth0")
            .ok();
        assert!(lo_up(&pod.ns));
        h.libcni("check", "loopback-net", &pod.path(), "ctr1", "eth0")
            .ok();
        h.libcni("del", "loopback-net", &pod.path(), "ctr1", "eth0")
            .ok();
        assert!(!lo_up(&pod.ns));
        results.push(result_without_sandbox(&r, "1.0.0"));
    }
    assert_eq!(results[0], results[1]);
}

#[test]
fn cnitool_and_libcni_share_the_cache() {
    let h = Harness::new(Plugins::Ours, &["loopback.conflist"]);
    // ADD by cnitool, CHECK and DEL by libcni (reading our cache file).
    let pod = TestNs::new();
    let ours = h
        .cnitool(&[
            "add",
            "loopback-net",
            &pod.path(),
            "--container-id",
            "shared1",
        ])
        .ok();
    h.libcni("check", "loopback-net", &pod.path(), "shared1", "eth0")
        .ok();
    h.libcni("del", "loopback-net", &pod.path(), "shared1", "eth0")
        .ok();
    assert!(
        !h.cache_file("loopback-net", "shared1", "eth0").exists(),
        "libcni removed our cache entry"
    );
    assert!(!lo_up(&pod.ns));
    // ADD by libcni, CHECK and DEL by cnitool.
    let pod2 = TestNs::new();
    let theirs = h
        .libcni("add", "loopback-net", &pod2.path(), "shared2", "eth0")
        .ok();
    h.cnitool(&[
        "check",
        "loopback-net",
        &pod2.path(),
        "--container-id",
        "shared2",
    ])
    .ok();
    h.cnitool(&[
        "del",
        "loopback-net",
        &pod2.path(),
        "--container-id",
        "shared2",
    ])
    .ok();
    assert!(!h.cache_file("loopback-net", "shared2", "eth0").exists());
    assert_eq!(
        result_without_sandbox(&ours, "1.0.0"),
        result_without_sandbox(&theirs, "1.0.0")
    );
}

#[test]
fn gc_deletes_stale_attachments_and_keeps_valid_ones() {
    for (plugins, file, net) in [
        (Plugins::Ours, "loopback-v1.1.conflist", "loopback-v11"),
        (Plugins::Reference, "loopback.conflist", "loopback-net"),
    ] {
        // The reference has no GC: with a 1.0.0 list only libcni's synthesized DEL runs.
        let h = Harness::new(plugins, &[file]);
        let (a, b) = (TestNs::new(), TestNs::new());
        h.cnitool(&["add", net, &a.path(), "--container-id", "ctr-a"])
            .ok();
        h.cnitool(&["add", net, &b.path(), "--container-id", "ctr-b"])
            .ok();
        h.cnitool(&["gc", net, "--valid", "ctr-a/eth0"]).ok();
        assert!(
            h.cache_file(net, "ctr-a", "eth0").exists(),
            "{plugins:?}: valid attachment kept"
        );
        assert!(lo_up(&a.ns));
        assert!(
            !h.cache_file(net, "ctr-b", "eth0").exists(),
            "{plugins:?}: stale attachment gone"
        );
        assert!(!lo_up(&b.ns), "{plugins:?}: stale attachment got its DEL");
        h.cnitool(&["gc", net]).ok();
        assert!(
            !h.cache_file(net, "ctr-a", "eth0").exists(),
            "no valid set: everything goes"
        );
        assert!(!lo_up(&a.ns));
    }
}

#[test]
fn status_and_version() {
    let h = Harness::new(
        Plugins::Ours,
        &["loopback-v1.1.conflist", "loopback.conflist"],
    );
    let st = h.cnitool(&["status", "loopback-v11"]);
    assert_eq!(
        (st.code, st.stdout.as_str(), st.stderr.as_str()),
        (0, "", "")
    );
    let st = h.cnitool(&["status", "loopback-net"]);
    assert_eq!(st.code, 0);
    assert!(st.stderr.contains("no STATUS"), "{}", st.stderr);
    let v = h.cnitool(&["version", "loopback-net"]).ok();
    assert_eq!(
        v["loopback"]["supportedVersions"],
        json!(rcni_cni::version::ALL)
    );
}

#[test]
fn failures_name_the_plugin_and_the_step() {
    let h = Harness::new(Plugins::Ours, &[]);
    h.write_conf(
        "10-broken.conflist",
        &json!({"cniVersion":"1.0.0","name":"broken","plugins":[{"type":"loopback"},{"type":"no-such-plugin","name":"x"}]}),
    );
    h.write_conf(
        "20-old.conflist",
        &json!({"cniVersion":"0.3.1","name":"old","plugins":[{"type":"loopback"}]}),
    );
    let pod = TestNs::new();
    let add = h.cnitool(&["add", "broken", &pod.path()]);
    assert_eq!(add.code, 1);
    assert!(
        add.stderr.contains(r#"plugin type="no-such-plugin" name="x" failed (add): failed to find plugin "no-such-plugin""#),
        "{}",
        add.stderr
    );
    assert!(add.stdout.is_empty());
    // Missing network, bad env.
    let e = h.cnitool(&["add", "nope", &pod.path()]);
    assert!(
        e.stderr
            .contains(r#"no net configuration with name "nope""#),
        "{}",
        e.stderr
    );
    let e = h.cnitool_env(&["add", "old", &pod.path()], &[("CAP_ARGS", "{nope")]);
    assert!(
        e.stderr.contains("CAP_ARGS is not valid JSON"),
        "{}",
        e.stderr
    );
    let e = h.cnitool_env(
        &["add", "old", &pod.path()],
        &[("CNI_IFNAME", "way-too-long-ifname")],
    );
    assert!(
        e.stderr.contains("interface name is too long"),
        "{}",
        e.stderr
    );
    // A plugin's own error reaches the user with its text.
    let e = h.cnitool(&["add", "old", "/etc/hostname"]);
    assert!(
        e.stderr
            .contains(r#"plugin type="loopback" failed (add): failed to open netns"#),
        "{}",
        e.stderr
    );
    // DEL stops at the first failing plugin, as libcni does, and names it.
    let del = h.cnitool(&["del", "broken", &pod.path()]);
    assert!(del.stderr.contains("failed (delete)"), "{}", del.stderr);
}

#[test]
fn netns_add_list_del() {
    let name = unique_name("cnitool");
    struct Guard(String);
    impl Drop for Guard {
        fn drop(&mut self) {
            let _ = rcni_netns::delete_named(&self.0);
        }
    }
    let _g = Guard(name.clone());
    let h = Harness::new(Plugins::Ours, &["loopback.conflist"]);
    h.cnitool(&["netns", "add", &name]).ok();
    assert!(
        h.cnitool(&["netns", "list"])
            .stdout
            .lines()
            .any(|l| l == name)
    );
    assert_ne!(
        h.cnitool(&["netns", "add", &name]).code,
        0,
        "adding twice fails"
    );
    // A bare name means /run/netns/<name>.
    h.cnitool(&["add", "loopback-net", &name]).ok();
    let ns = NetNs::open(rcni_netns::named_path(&name)).unwrap();
    assert!(lo_up(&ns));
    h.cnitool(&["del", "loopback-net", &name]).ok();
    drop(ns);
    h.cnitool(&["netns", "del", &name]).ok();
    h.cnitool(&["netns", "del", &name]).ok();
    assert!(
        !h.cnitool(&["netns", "list"])
            .stdout
            .lines()
            .any(|l| l == name)
    );
    rcni_testkit::assert_no_leaks();
}
