//! tuning: sysctls and interface attributes appear in the pod, CHECK sees
//! them, DEL puts the originals back (also from the reference's backup,
//! and the reference restores from ours), a failed ADD changes nothing,
//! the allowlist refuses sysctls, GC drops stale backups.

use rcni_integration::lab::chain::*;
use rcni_netlink::Link;
use rcni_testkit::{TestNs, bin, file_names, reference_bin};
use serde_json::{Value, json};
use std::path::Path;

fn chain(lan: &Lan, version: &str, tuning: Value, data: &Path) -> Chain {
    let t = json!({"type": "tuning", "dataDir": data, "capabilities": {"mac": true}});
    lan.chain_with(version, t, tuning)
}

fn link(pod: &TestNs, name: &str) -> Link {
    let name = name.to_string();
    nl(&pod.ns, async move |n| n.link_by_name(&name).await.unwrap())
}

fn sysctl(pod: &TestNs, key: &str) -> String {
    rcni_netlink::sysctl::get(&pod.ns, key).unwrap()
}

fn full() -> Value {
    json!({
        "sysctl": {"net.ipv4.conf.IFNAME.arp_filter": "1", "net.core.somaxconn": "512"},
        "mac": "02:aa:bb:cc:dd:ee", "mtu": 1400, "promisc": true, "allmulti": true, "txQLen": 500
    })
}

#[test]
fn values_appear_in_the_pod_and_come_back_on_del() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    let c = chain(&lan, "1.0.0", full(), data.path());
    let pod = TestNs::new();
    // Attach as net1 so IFNAME is really substituted.
    let br_only = c.only(0);
    let on_net1 = |plugin: &str, cmd: &str, conf: &Value| {
        lan.call(&bin(plugin), cmd, Some(&pod.path()), "pod-t", "net1", conf)
    };
    let br = on_net1("bridge", "ADD", &br_only.stdin(0, None)).ok();
    let before = link(&pod, "net1");
    let somaxconn_before = sysctl(&pod, "net.core.somaxconn");
    assert_eq!(sysctl(&pod, "net.ipv4.conf.net1.arp_filter"), "0");
    let r = on_net1("tuning", "ADD", &c.stdin(1, Some(&br))).ok();

    let after = link(&pod, "net1");
    assert_eq!(after.mac.unwrap().to_string(), "02:aa:bb:cc:dd:ee");
    assert_eq!(
        (after.mtu, after.promisc, after.allmulti, after.txqlen),
        (1400, true, true, 500)
    );
    assert_eq!(sysctl(&pod, "net.ipv4.conf.net1.arp_filter"), "1");
    assert_eq!(sysctl(&pod, "net.core.somaxconn"), "512");
    // The result reports the new MAC on the container interface only.
    let ifaces = r["interfaces"].as_array().unwrap();
    let ct = ifaces.iter().find(|i| i["name"] == "net1").unwrap();
    assert_eq!(ct["mac"], "02:aa:bb:cc:dd:ee");
    assert_eq!(r["ips"], br["ips"]);
    // Traffic still flows with the new MAC.
    assert!(rcni_testkit::ping(&pod.ns, BRIDGE_V4));
    assert_eq!(file_names(data.path()), vec!["pod-t_net1.json"]);

    c.check(&lan, &pod.path(), "pod-t", "net1", &r)
        .unwrap_or_else(|(i, o)| panic!("CHECK {i}: {}", o.stdout));
    let (ok, _) = sh(&pod.ns, "ip", &["link", "set", "net1", "mtu", "1300"]);
    assert!(ok);
    let msg = c.check_fails(&lan, &pod, "pod-t", "net1", &r);
    assert!(msg.contains("MTU"), "{msg}");

    assert_success(&on_net1("tuning", "DEL", &c.stdin(1, Some(&r))));
    let restored = link(&pod, "net1");
    assert_eq!(restored.mac, before.mac);
    assert_eq!(
        (
            restored.mtu,
            restored.promisc,
            restored.allmulti,
            restored.txqlen
        ),
        (before.mtu, before.promisc, before.allmulti, before.txqlen)
    );
    assert_eq!(sysctl(&pod, "net.ipv4.conf.net1.arp_filter"), "0");
    assert_eq!(sysctl(&pod, "net.core.somaxconn"), somaxconn_before);
    assert!(file_names(data.path()).is_empty());
    // Again: nothing to do.
    assert_eq!(on_net1("tuning", "DEL", &c.stdin(1, Some(&r))).code, 0);
    br_only.del(&lan, Some(&pod.path()), "pod-t", "net1", Some(&br));
}

#[test]
fn runtime_config_and_args_override_the_config() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    let mut c = chain(
        &lan,
        "1.0.0",
        json!({"mac": "02:00:00:00:00:01", "mtu": 1450}),
        data.path(),
    );
    c.caps = json!({"mac": "02:00:00:00:00:02"});
    c.plugins[1]["args"] =
        json!({"cni": {"mtu": 1300, "sysctl": {"net.ipv4.conf.IFNAME.arp_ignore": "1"}}});
    let pod = TestNs::new();
    let r = c.add(&lan, &pod.path(), "pod-o", "eth0");
    let l = link(&pod, "eth0");
    assert_eq!(l.mac.unwrap().to_string(), "02:00:00:00:00:02");
    assert_eq!(l.mtu, 1300);
    assert_eq!(sysctl(&pod, "net.ipv4.conf.eth0.arp_ignore"), "1");
    // CNI_ARGS MAC loses to runtimeConfig.
    c.check_ok(&lan, &pod, "pod-o", &r);
    c.del_pod(&lan, &pod, "pod-o", &r);
    assert!(file_names(data.path()).is_empty());
}

#[test]
fn failed_add_changes_nothing() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    // The MAC and the sysctl go in, then the MTU is refused by the kernel.
    let c = chain(
        &lan,
        "1.0.0",
        json!({"sysctl": {"net.ipv4.conf.IFNAME.arp_filter": "1"}, "mac": "02:aa:00:00:00:01", "mtu": 70000}),
        data.path(),
    );
    let pod = TestNs::new();
    let br_only = c.only(0);
    let br = br_only.add(&lan, &pod.path(), "pod-f", "eth0");
    let before = link(&pod, "eth0");
    let (code, msg) = c.run(&lan, 1, "ADD", &pod, "pod-f", Some(&br)).err();
    assert_eq!(code, 103, "{msg}");
    let after = link(&pod, "eth0");
    assert_eq!((after.mac, after.mtu), (before.mac, before.mtu));
    assert_eq!(sysctl(&pod, "net.ipv4.conf.eth0.arp_filter"), "0");
    assert!(file_names(data.path()).is_empty());
    // Not a net.* key: refused before anything is touched.
    let c = chain(
        &lan,
        "1.0.0",
        json!({"sysctl": {"kernel.hostname": "x"}}),
        data.path(),
    );
    let (code, msg) = c.run(&lan, 1, "ADD", &pod, "pod-f", Some(&br)).err();
    assert_eq!(code, 7, "{msg}");
    br_only.del_pod(&lan, &pod, "pod-f", &br);
}

/// Runs tuning in a private mount namespace whose /etc is a tmpfs holding
/// only the allowlist, so the node's real /etc is never touched.
fn with_allowlist(dir: &Path, patterns: &str) -> std::path::PathBuf {
    let list = dir.join("allowlist.conf");
    std::fs::write(&list, patterns).unwrap();
    let wrapper = dir.join("tuning");
    let script = format!(
        "#!/bin/sh\nexec unshare --mount sh -c 'mount -t tmpfs rcni /etc && mkdir -p /etc/cni/tuning && cp {list} /etc/cni/tuning/allowlist.conf && exec {bin}'\n",
        list = list.display(),
        bin = bin("tuning").display()
    );
    std::fs::write(&wrapper, script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    wrapper
}

#[test]
fn the_node_allowlist_refuses_other_sysctls() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    let wrap = tempfile::tempdir().unwrap();
    let tuning = with_allowlist(
        wrap.path(),
        "# interface sysctls only\n^net\\.ipv4\\.conf\\.IFNAME\\.[a-z_]*$\n",
    );
    let pod = TestNs::new();
    let ok_conf = chain(
        &lan,
        "1.0.0",
        json!({"sysctl": {"net.ipv4.conf.IFNAME.arp_filter": "1"}}),
        data.path(),
    );
    let br_only = ok_conf.only(0);
    let br = br_only.add(&lan, &pod.path(), "pod-l", "eth0");
    let run = |cmd: &str, conf: &Value| lan.run(&tuning, cmd, &pod, "pod-l", conf);
    let r = run("ADD", &ok_conf.stdin(1, Some(&br))).ok();
    assert_eq!(sysctl(&pod, "net.ipv4.conf.eth0.arp_filter"), "1");
    let bad = chain(
        &lan,
        "1.0.0",
        json!({"sysctl": {"net.core.somaxconn": "5"}}),
        data.path(),
    );
    let (code, msg) = run("ADD", &bad.stdin(1, Some(&br))).err();
    assert_eq!(code, 7);
    assert!(
        msg.contains("net.core.somaxconn") && msg.contains("not allowed"),
        "{msg}"
    );
    assert_ne!(sysctl(&pod, "net.core.somaxconn"), "5");
    assert_success(&run("DEL", &ok_conf.stdin(1, Some(&r))));
    assert_eq!(sysctl(&pod, "net.ipv4.conf.eth0.arp_filter"), "0");
    br_only.del_pod(&lan, &pod, "pod-l", &br);
}

#[test]
fn backups_interoperate_with_the_reference() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    // The reference (v1.1.1) knows mac, mtu, promisc and allmulti.
    let conf = json!({"mac": "02:aa:bb:cc:dd:01", "mtu": 1380, "promisc": true, "allmulti": true});
    let c = chain(&lan, "1.0.0", conf, data.path());
    for (adder, deleter) in [
        (bin("tuning"), reference_bin("tuning")),
        (reference_bin("tuning"), bin("tuning")),
    ] {
        let pod = TestNs::new();
        let br_only = c.only(0);
        let br = br_only.add(&lan, &pod.path(), "pod-r", "eth0");
        let before = link(&pod, "eth0");
        let r = lan
            .run(&adder, "ADD", &pod, "pod-r", &c.stdin(1, Some(&br)))
            .ok();
        assert_eq!(link(&pod, "eth0").mtu, 1380);
        let conf = c.stdin(1, Some(&r));
        // Both CHECKs accept either's work.
        for checker in [bin("tuning"), reference_bin("tuning")] {
            assert_checks(&lan, &checker, &adder, &pod, "pod-r", &conf);
        }
        assert_success(&lan.run(&deleter, "DEL", &pod, "pod-r", &conf));
        let after = link(&pod, "eth0");
        assert_eq!(
            (after.mac, after.mtu, after.promisc, after.allmulti),
            (before.mac, before.mtu, before.promisc, before.allmulti),
            "{} restoring what {} saved",
            deleter.display(),
            adder.display()
        );
        assert!(file_names(data.path()).is_empty());
        br_only.del_pod(&lan, &pod, "pod-r", &br);
    }
}

#[test]
fn gc_drops_stale_backups_and_del_without_netns_too() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    let c = chain(&lan, "1.1.0", json!({"mtu": 1400}), data.path());
    let (a, b) = (TestNs::new(), TestNs::new());
    let ra = c.add(&lan, &a.path(), "pod-a", "eth0");
    let rb = c.add(&lan, &b.path(), "pod-b", "eth0");
    assert_eq!(
        file_names(data.path()),
        vec!["pod-a_eth0.json", "pod-b_eth0.json"]
    );
    // A file of another network (or the reference's, naming none) stays.
    std::fs::write(data.path().join("other_eth0.json"), r#"{"mtu":1500}"#).unwrap();
    c.only(1).gc(&lan, &[("pod-a", "eth0")]);
    assert_eq!(
        file_names(data.path()),
        vec!["other_eth0.json", "pod-a_eth0.json"]
    );
    // DEL without a netns removes the backup (nothing to restore).
    let conf = c.stdin(1, Some(&ra));
    assert_success(&lan.call(&bin("tuning"), "DEL", None, "pod-a", "eth0", &conf));
    assert_eq!(file_names(data.path()), vec!["other_eth0.json"]);
    // An ADD killed while writing pod-b's backup left its temporary file:
    // the DEL that follows removes it.
    // (rcni_statefile's temporary name: `.<name>.<pid>.<n>.rcni-tmp`)
    std::fs::write(data.path().join(".pod-b_eth0.json.4242.0.rcni-tmp"), "{").unwrap();
    c.del_pod(&lan, &a, "pod-a", &ra);
    c.del_pod(&lan, &b, "pod-b", &rb);
    assert_eq!(file_names(data.path()), vec!["other_eth0.json"]);
}

#[test]
fn every_version_and_chained_only() {
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    let versions = ["0.3.1", "0.4.0", "1.0.0", "1.1.0"];
    let mac = json!({"mac": "02:aa:bb:cc:dd:02"});
    let chain_of = |version: &str| chain(&lan, version, mac.clone(), data.path());
    chained_add_per_version(&lan, &versions, chain_of, |mut want| {
        for i in want["interfaces"].as_array_mut().unwrap() {
            if i["name"] == "eth0" {
                i["mac"] = json!("02:aa:bb:cc:dd:02");
            }
        }
        want
    });
    let c = chain(&lan, "1.0.0", json!({}), data.path());
    let (code, msg) = c.add_unchained(&lan, &TestNs::new());
    assert_eq!(code, 7);
    assert!(msg.contains("prevResult"), "{msg}");
    let v = version_of("tuning");
    assert!(v["supportedVersions"].as_array().unwrap().len() >= 6);
}

/// Issue 21: a tuning ADD SIGKILLed at any moment leaves DEL all it needs:
/// DEL succeeds, every value changed is back (the backup is on disk before
/// the first change, sysctls included) and nothing is left in the data
/// directory, not even the temporary of a backup never published. The
/// kills land on entry to each of ADD's lasting system calls in turn
/// (`killpoints`), which covers every moment.
#[test]
fn a_killed_add_leaves_del_everything_to_undo() {
    use rcni_testkit::killpoints::{Ending, at_every_point};
    let lan = Lan::new();
    let data = tempfile::tempdir().unwrap();
    let c = chain(&lan, "1.0.0", full(), data.path());
    let pod = TestNs::new();
    let br_only = c.only(0);
    let br = br_only.add(&lan, &pod.path(), "pod-k", "eth0");
    let values = || {
        let l = link(&pod, "eth0");
        (
            (l.mac, l.mtu, l.promisc, l.allmulti, l.txqlen),
            sysctl(&pod, "net.ipv4.conf.eth0.arp_filter"),
            sysctl(&pod, "net.core.somaxconn"),
        )
    };
    let before = values();
    let call = |cmd: &str| {
        rcni_testkit::Call::new(bin("tuning"), cmd)
            .env("CNI_CONTAINERID", "pod-k")
            .netns(&pod.path())
            .stdin(&c.stdin(1, Some(&br)))
    };
    let mut changed = false;
    let points = at_every_point(
        || call("ADD").command_in(&lan.node.ns),
        500,
        |k, ending| {
            if let Ending::Finished { code, .. } = ending {
                assert_eq!(*code, 0, "the unkilled ADD failed");
                changed = values() != before;
            }
            let out = call("DEL").run_in(&lan.node.ns);
            assert_eq!(
                out.code, 0,
                "killed at {k} ({ending:?}): DEL failed: {} {}",
                out.stdout, out.stderr
            );
            assert_eq!(
                values(),
                before,
                "killed at {k} ({ending:?}): DEL left a changed value"
            );
            assert_eq!(
                file_names(data.path()),
                Vec::<String>::new(),
                "killed at {k} ({ending:?}): DEL left files"
            );
        },
    );
    eprintln!("tuning ADD: {points} kill points");
    assert!(changed, "the whole ADD changed the values");
    assert!(points > 5, "{points} kill points");
    br_only.del_pod(&lan, &pod, "pod-k", &br);
}
