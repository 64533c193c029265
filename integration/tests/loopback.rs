//! The loopback binary in fresh namespaces: every spec version, CHECK, DEL
//! (twice, without netns, after the netns vanished), errors, and the
//! reference loopback side by side.

use rcni_cni::version::ALL;
use rcni_netlink::Netlink;
use rcni_netns::NetNs;
use rcni_testkit::{Call, PersistentNs, TestNs, bin, normalize_result, ping, reference_bin};
use serde_json::{Value, json};

fn conf(v: &str) -> Value {
    json!({"cniVersion": v, "name": "lo-net", "type": "loopback"})
}

struct Lo {
    up: bool,
    addrs: Vec<String>,
}

fn lo_state(ns: &NetNs) -> Lo {
    let rt = rcni_netlink::runtime().unwrap();
    rt.block_on(async {
        let nl = Netlink::connect(ns).await.unwrap();
        let lo = nl.link_by_name("lo").await.unwrap();
        let mut addrs: Vec<String> = nl
            .addresses(Some(lo.index))
            .await
            .unwrap()
            .iter()
            .map(|a| a.addr.to_string())
            .collect();
        addrs.sort();
        Lo {
            up: lo.admin_up,
            addrs,
        }
    })
}

#[test]
fn add_check_del_at_every_version() {
    for v in ALL {
        let pod = TestNs::new();
        assert!(!lo_state(&pod.ns).up, "a fresh namespace has lo down");
        assert!(!ping(&pod.ns, "127.0.0.1"), "{v}: lo down must not answer");

        let out = Call::new(bin("loopback"), "ADD")
            .netns(&pod.path())
            .stdin(&conf(v))
            .run()
            .ok();
        assert_eq!(out["cniVersion"], *v);
        match *v {
            "0.1.0" | "0.2.0" => {
                assert_eq!(out["ip4"]["ip"], "127.0.0.1/8", "{v}: {out}");
                assert_eq!(out["ip6"]["ip"], "::1/128", "{v}: {out}");
                assert!(out.get("interfaces").is_none());
            }
            _ => {
                assert_eq!(
                    out["interfaces"],
                    json!([{"name":"lo","mac":"00:00:00:00:00:00","sandbox":pod.path()}])
                );
                assert_eq!(out["ips"][0]["address"], "127.0.0.1/8");
                assert_eq!(out["ips"][1]["address"], "::1/128");
                assert_eq!(out["ips"][0]["interface"], 0);
                let has_version = out["ips"][0].get("version").is_some();
                assert_eq!(
                    has_version,
                    v.starts_with("0."),
                    "{v}: ips[].version only before 1.0.0: {out}"
                );
            }
        }
        let lo = lo_state(&pod.ns);
        assert!(lo.up, "{v}: lo is up after ADD");
        assert_eq!(lo.addrs, ["127.0.0.1/8", "::1/128"]);
        assert!(
            ping(&pod.ns, "127.0.0.1"),
            "{v}: 127.0.0.1 answers after ADD"
        );
        assert!(ping(&pod.ns, "::1"), "{v}: ::1 answers after ADD");

        let check = Call::new(bin("loopback"), "CHECK")
            .netns(&pod.path())
            .stdin(&conf(v))
            .run();
        if rcni_cni::version::at_least(v, "0.4.0").unwrap() {
            check.ok();
        } else {
            assert_eq!(check.err().0, 1, "{v}: CHECK needs 0.4.0");
        }

        let del = Call::new(bin("loopback"), "DEL")
            .netns(&pod.path())
            .stdin(&conf(v));
        assert_eq!(del.run().ok(), Value::Null, "DEL prints nothing");
        assert!(!lo_state(&pod.ns).up, "{v}: lo is down after DEL");
        del.run().ok();
        if rcni_cni::version::at_least(v, "0.4.0").unwrap() {
            let (code, msg) = Call::new(bin("loopback"), "CHECK")
                .netns(&pod.path())
                .stdin(&conf(v))
                .run()
                .err();
            assert_eq!((code, msg.as_str()), (106, "loopback interface is down"));
        }
    }
}

#[test]
fn prev_result_passes_through_unchanged() {
    let pod = TestNs::new();
    for v in ["0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
        let prev = json!({
            "cniVersion": v,
            "interfaces": [{"name": "eth0", "mac": "0a:58:0a:00:00:02", "sandbox": pod.path()}],
            "ips": [{"interface": 0, "address": "10.0.0.2/24", "gateway": "10.0.0.1"}],
            "routes": [{"dst": "0.0.0.0/0", "gw": "10.0.0.1"}],
            "dns": {"nameservers": ["10.0.0.10"], "search": ["svc.cluster.local"]}
        });
        let mut c = conf(v);
        c["prevResult"] = prev.clone();
        let out = Call::new(bin("loopback"), "ADD")
            .netns(&pod.path())
            .stdin(&c)
            .run()
            .ok();
        assert_eq!(normalize_result(&out, v), normalize_result(&prev, v), "{v}");
        assert_eq!(out["cniVersion"], v);
        assert!(lo_state(&pod.ns).up);
    }
}

#[test]
fn del_succeeds_without_or_after_the_netns() {
    let pod = PersistentNs::new();
    let path = pod.path.display().to_string();
    Call::new(bin("loopback"), "ADD")
        .netns(&path)
        .stdin(&conf("0.3.1"))
        .run()
        .ok();
    pod.delete();
    assert!(!pod.path.exists());
    // Vanished path, then an empty CNI_NETNS (kubelet after a reboot).
    Call::new(bin("loopback"), "DEL")
        .netns(&path)
        .stdin(&conf("0.3.1"))
        .run()
        .ok();
    Call::new(bin("loopback"), "DEL")
        .netns("")
        .stdin(&conf("1.0.0"))
        .run()
        .ok();
    Call::new(bin("loopback"), "DEL")
        .stdin(&conf("1.0.0"))
        .run()
        .ok();
    // A plain file where the namespace was (its bind mount gone) is also "gone".
    let stale = tempfile::NamedTempFile::new().unwrap();
    Call::new(bin("loopback"), "DEL")
        .netns(&stale.path().display().to_string())
        .stdin(&conf("1.0.0"))
        .run()
        .ok();
    // ADD into a vanished namespace fails cleanly with our netns code.
    let (code, msg) = Call::new(bin("loopback"), "ADD")
        .netns(&path)
        .stdin(&conf("1.0.0"))
        .run()
        .err();
    assert_eq!(code, 104, "{msg}");
    rcni_testkit::assert_no_leaks();
}

#[test]
fn errors_are_json_with_the_right_code() {
    let pod = TestNs::new();
    let add = || Call::new(bin("loopback"), "ADD").netns(&pod.path());
    assert_eq!(add().stdin_raw(b"{not json").run().err().0, 6);
    assert_eq!(add().stdin_raw(b"").run().err().0, 6);
    let (code, msg) = add()
        .stdin(&json!({"cniVersion":"0.3.1","type":"loopback"}))
        .run()
        .err();
    assert_eq!((code, msg.as_str()), (7, "missing network name"));
    let (code, msg) = add().stdin(&conf("2.0.0")).run().err();
    assert_eq!((code, msg.as_str()), (1, "incompatible CNI versions"));
    let (code, msg) = Call::new(bin("loopback"), "ADD")
        .stdin(&conf("1.0.0"))
        .run()
        .err();
    assert_eq!(
        (code, msg.as_str()),
        (4, "required env variables [CNI_NETNS] missing")
    );
    let (code, msg) = Call::new(bin("loopback"), "ADD")
        .without("CNI_CONTAINERID")
        .without("CNI_PATH")
        .stdin(&conf("1.0.0"))
        .run()
        .err();
    assert_eq!(
        (code, msg.as_str()),
        (
            4,
            "required env variables [CNI_CONTAINERID,CNI_NETNS,CNI_PATH] missing"
        )
    );
    for bad in ["sixteen-chars-xx", "a/b", "a:b", "a b", ".."] {
        assert_eq!(
            add()
                .env("CNI_IFNAME", bad)
                .stdin(&conf("1.0.0"))
                .run()
                .err()
                .0,
            4,
            "{bad}"
        );
    }
    // Empty counts as missing, before the container ID rules (as Go's skel).
    let (code, msg) = add()
        .env("CNI_CONTAINERID", "")
        .stdin(&conf("1.0.0"))
        .run()
        .err();
    assert_eq!(
        (code, msg.as_str()),
        (4, "required env variables [CNI_CONTAINERID] missing")
    );
    assert_eq!(
        add()
            .env("CNI_CONTAINERID", "bad;id")
            .stdin(&conf("1.0.0"))
            .run()
            .err()
            .0,
        4
    );
    assert_eq!(
        add()
            .env("CNI_COMMAND", "FROB")
            .stdin(&conf("1.0.0"))
            .run()
            .err()
            .0,
        4
    );
    // The plugin's own namespace is refused (code 8) unless overridden.
    let own = Call::new(bin("loopback"), "ADD")
        .netns("/proc/self/ns/net")
        .stdin(&conf("1.0.0"));
    assert_eq!(own.run_in(&pod.ns).err().0, 8);
    // A path that is no namespace at all.
    assert_eq!(
        add()
            .netns("/etc/hostname")
            .stdin(&conf("1.0.0"))
            .run()
            .err()
            .0,
        104
    );
    // GC and STATUS gates; at 1.1.0 both succeed silently (loopback keeps no state).
    let gc = |v: &str| {
        Call::new(bin("loopback"), "GC")
            .env("CNI_CONTAINERID", "")
            .env("CNI_IFNAME", "")
            .stdin(&conf(v))
            .run()
    };
    assert_eq!(gc("1.0.0").err().0, 1);
    assert_eq!(gc("1.1.0").ok(), Value::Null);
    let st = |v: &str| Call::new(bin("loopback"), "STATUS").stdin(&conf(v)).run();
    assert_eq!(st("0.4.0").err().0, 1);
    assert_eq!(st("1.1.0").ok(), Value::Null);
    // Nothing was changed by the failed calls.
    assert!(!lo_state(&pod.ns).up);
}

#[test]
fn same_result_and_state_as_the_reference() {
    for v in ["0.3.0", "0.3.1", "0.4.0", "1.0.0"] {
        let ours_ns = TestNs::new();
        let ref_ns = TestNs::new();
        let ours = Call::new(bin("loopback"), "ADD")
            .netns(&ours_ns.path())
            .stdin(&conf(v))
            .run()
            .ok();
        let theirs = Call::new(reference_bin("loopback"), "ADD")
            .netns(&ref_ns.path())
            .stdin(&conf(v))
            .run()
            .ok();
        let mut a = normalize_result(&ours, v);
        let mut b = normalize_result(&theirs, v);
        // The sandbox is each one's own namespace path.
        a.interfaces[0].sandbox.clear();
        b.interfaces[0].sandbox.clear();
        assert_eq!(a, b, "{v}");
        if v == "1.0.0" {
            // At 1.0.0 the JSON is the same apart from the sandbox and the
            // empty "dns": {} that the reference's older library prints.
            let mut t = theirs.clone();
            t.as_object_mut().unwrap().remove("dns");
            t["interfaces"][0]["sandbox"] = ours["interfaces"][0]["sandbox"].clone();
            assert_eq!(ours, t);
        }
        let (sa, sb) = (lo_state(&ours_ns.ns), lo_state(&ref_ns.ns));
        assert_eq!(
            (sa.up, sa.addrs),
            (sb.up, sb.addrs),
            "{v}: same kernel state"
        );
        Call::new(bin("loopback"), "DEL")
            .netns(&ours_ns.path())
            .stdin(&conf(v))
            .run()
            .ok();
        Call::new(reference_bin("loopback"), "DEL")
            .netns(&ref_ns.path())
            .stdin(&conf(v))
            .run()
            .ok();
        assert_eq!(lo_state(&ours_ns.ns).up, lo_state(&ref_ns.ns).up);
    }
}

#[test]
fn deliberate_difference_old_versions_get_their_own_shape() {
    // The reference prints a 1.0-shaped result labelled 0.2.0 / 0.4.0 (it never
    // converts a result it built at the config's version). We convert, as
    // the spec requires: ip4/ip6 at 0.2.0, ips[].version at 0.3.x/0.4.0.
    let pod = TestNs::new();
    let theirs = Call::new(reference_bin("loopback"), "ADD")
        .netns(&pod.path())
        .stdin(&conf("0.2.0"))
        .run()
        .ok();
    assert!(theirs.get("ip4").is_none() && theirs.get("ips").is_some());
    let ours = Call::new(bin("loopback"), "ADD")
        .netns(&pod.path())
        .stdin(&conf("0.2.0"))
        .run()
        .ok();
    assert_eq!(ours["ip4"]["ip"], "127.0.0.1/8");
}
