//! The static IPAM binary: every spec version, overrides, CHECK/DEL/GC,
//! error codes, and the reference /usr/lib/cni/static side by side.

use rcni_cni::version::ALL;
use rcni_testkit::{Call, Output, TestNs, bin, normalize_result, reference_bin};
use serde_json::{Value, json};

/// Versions the reference (v1.1.1) also speaks.
const SHARED: &[&str] = &["0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0"];

fn conf(v: &str, ipam: Value) -> Value {
    json!({"cniVersion": v, "name": "mynet", "type": "bridge", "ipam": ipam})
}

fn full_ipam(dual_v4: bool) -> Value {
    let mut addresses = vec![
        json!({"address": "10.10.0.1/24", "gateway": "10.10.0.254"}),
        json!({"address": "3ffe:ffff:0:01ff::1/64", "gateway": "3ffe:ffff:0::1"}),
    ];
    if dual_v4 {
        addresses.push(json!({"address": "10.20.0.1/16"}));
    }
    json!({
        "type": "static",
        "addresses": addresses,
        "routes": [
            {"dst": "0.0.0.0/0"},
            {"dst": "192.168.0.0/16", "gw": "10.10.5.1"},
            {"dst": "3ffe:ffff:0:01ff::1/64"}
        ],
        "dns": {"nameservers": ["8.8.8.8"], "domain": "example.com", "search": ["example.com"]}
    })
}

fn run(plugin: &str, cmd: &str, ns: &TestNs, stdin: &Value, cni_args: &str) -> Output {
    let bin = if plugin == "ours" {
        bin("static")
    } else {
        reference_bin("static")
    };
    Call::new(bin, cmd)
        .netns(&ns.path())
        .env("CNI_ARGS", cni_args)
        .stdin(stdin)
        .run()
}

fn add(ns: &TestNs, stdin: &Value, cni_args: &str) -> Value {
    run("ours", "ADD", ns, stdin, cni_args).ok()
}

/// Ours and the reference give the same result (compared through our
/// parser, so formatting differences such as the reference's empty
/// `"dns": {}` do not count).
fn same_as_reference(ns: &TestNs, stdin: &Value, cni_args: &str) -> Value {
    let v = stdin["cniVersion"].as_str().unwrap();
    let ours = add(ns, stdin, cni_args);
    let theirs = run("reference", "ADD", ns, stdin, cni_args).ok();
    assert_eq!(
        normalize_result(&ours, v),
        normalize_result(&theirs, v),
        "{v} {cni_args}: ours {ours} theirs {theirs}"
    );
    assert_eq!(ours["cniVersion"], v);
    ours
}

#[test]
fn add_at_every_version() {
    let ns = TestNs::new();
    for v in ALL {
        let old = matches!(*v, "0.1.0" | "0.2.0");
        let out = add(&ns, &conf(v, full_ipam(!old)), "");
        assert_eq!(out["cniVersion"], *v);
        assert!(
            out.get("interfaces").is_none(),
            "{v}: IPAM has no interfaces"
        );
        if old {
            assert_eq!(out["ip4"]["ip"], "10.10.0.1/24", "{v}: {out}");
            assert_eq!(out["ip4"]["gateway"], "10.10.0.254");
            assert_eq!(out["ip6"]["ip"], "3ffe:ffff:0:1ff::1/64");
            assert_eq!(out["ip4"]["routes"].as_array().unwrap().len(), 2);
        } else {
            let ips = out["ips"].as_array().unwrap();
            assert_eq!(ips.len(), 3, "{v}: {out}");
            assert!(ips.iter().all(|i| i.get("interface").is_none()));
            assert_eq!(ips[0]["version"].is_string(), v.starts_with("0."), "{v}");
            assert_eq!(out["routes"][1]["gw"], "10.10.5.1");
            assert_eq!(out["dns"]["domain"], "example.com");
        }
    }
}

#[test]
fn same_results_as_the_reference() {
    let ns = TestNs::new();
    for v in SHARED {
        let old = *v == "0.2.0";
        same_as_reference(&ns, &conf(v, full_ipam(!old)), "");
        if !old {
            // CNI_ARGS appended, gateways paired by subnet.
            let ipam = json!({"type": "static", "addresses": [{"address": "10.1.0.2/24", "gateway": "10.1.0.1"}]});
            same_as_reference(
                &ns,
                &conf(v, ipam.clone()),
                "IgnoreUnknown=1;K8S_POD_NAME=x;IP=10.0.0.5/24, fd00::5/64;GATEWAY=10.0.0.1,fd00::1",
            );
            // args.cni.ips beats CNI_ARGS, runtimeConfig.ips beats both.
            let mut c = conf(v, ipam);
            c["args"] = json!({"cni": {"ips": ["10.10.0.2/24", "3ffe:ffff:0:01ff::2/64"]}});
            let out = same_as_reference(&ns, &c, "IP=10.10.0.3/24;GATEWAY=10.10.0.254");
            assert_eq!(out["ips"][0]["address"], "10.10.0.2/24");
            c["RuntimeConfig"] = json!({"ips": ["10.10.0.1/24"]});
            let out = same_as_reference(&ns, &c, "IP=10.10.0.3/24");
            assert_eq!(out["ips"].as_array().unwrap().len(), 1);
            assert_eq!(out["ips"][0]["address"], "10.10.0.1/24");
        }
    }
}

#[test]
fn same_errors_as_the_reference() {
    let ns = TestNs::new();
    let v = "1.0.0";
    let cases: Vec<(Value, &str, u64)> = vec![
        (
            json!({"cniVersion": v, "name": "n", "type": "bridge"}),
            "",
            7,
        ),
        (
            conf(v, json!({"addresses": [{"address": "10.10.0.1"}]})),
            "",
            7,
        ),
        (
            conf(v, json!({"addresses": [{"address": "10.10.0.1/24"}]})),
            "IP=10.10.0.2",
            4,
        ),
        (
            conf(v, json!({"addresses": [{"address": "10.10.0.1/24"}]})),
            "GATEWAY=x",
            4,
        ),
        (
            {
                let mut c = conf(v, json!({"addresses": [{"address": "10.10.0.1/24"}]}));
                c["runtimeConfig"] = json!({"ips": ["10.10.0.9"]});
                c
            },
            "",
            7,
        ),
        (
            conf("0.2.0", json!({"addresses": [{"address": "10.0.0.1/24"}]})),
            "IP=10.1.0.1/24",
            1,
        ),
    ];
    for (stdin, cni_args, code) in cases {
        let (our_code, our_msg) = run("ours", "ADD", &ns, &stdin, cni_args).err();
        let (_, their_msg) = run("reference", "ADD", &ns, &stdin, cni_args).err();
        // The reference reports every failure as 999; ours carry a code.
        assert_eq!(our_code, code, "{stdin} {cni_args}: {our_msg}");
        assert_eq!(our_msg, their_msg, "{stdin} {cni_args}");
    }
    // Unknown CNI_ARGS keys need IgnoreUnknown (same rule, our own wording).
    let c = conf(v, json!({"addresses": [{"address": "10.10.0.1/24"}]}));
    assert_eq!(run("ours", "ADD", &ns, &c, "FOO=1").err().0, 4);
    run("reference", "ADD", &ns, &c, "FOO=1").err();
    // A config gateway that is no IP address is a config error.
    let c = conf(
        v,
        json!({"addresses": [{"address": "10.10.0.1/24", "gateway": "nope"}]}),
    );
    let (code, msg) = run("ours", "ADD", &ns, &c, "").err();
    assert_eq!(code, 7);
    assert!(msg.contains("invalid IP address: nope"), "{msg}");
}

#[test]
fn deliberate_differences_reject_what_cannot_work() {
    let ns = TestNs::new();
    let v = "1.0.0";
    // No address at all: the reference returns an empty result that every
    // interface plugin then rejects; we say so at once.
    let none = conf(
        v,
        json!({"type": "static", "routes": [{"dst": "0.0.0.0/0"}]}),
    );
    let theirs = run("reference", "ADD", &ns, &none, "").ok();
    assert!(theirs.get("ips").is_none());
    let (code, msg) = run("ours", "ADD", &ns, &none, "").err();
    assert_eq!(code, 7);
    assert!(msg.starts_with("no IP address configured"), "{msg}");
    // A gateway of the other family: the reference passes it on.
    let mixed = conf(
        v,
        json!({"addresses": [{"address": "10.0.0.2/24", "gateway": "fd00::1"}]}),
    );
    run("reference", "ADD", &ns, &mixed, "").ok();
    let (code, msg) = run("ours", "ADD", &ns, &mixed, "").err();
    assert_eq!(code, 7);
    assert_eq!(
        msg,
        "gateway fd00::1 is not of the same IP family as address 10.0.0.2/24"
    );
}

#[test]
fn check_del_gc_status() {
    let ns = TestNs::new();
    for v in ["0.4.0", "1.0.0", "1.1.0"] {
        let c = conf(v, full_ipam(true));
        let result = add(&ns, &c, "");
        let mut with_prev = c.clone();
        with_prev["prevResult"] = result.clone();
        assert_eq!(
            run("ours", "CHECK", &ns, &with_prev, "").ok(),
            Value::Null,
            "{v}"
        );
        if v != "1.1.0" {
            run("reference", "CHECK", &ns, &with_prev, "").ok();
        }

        // No prevResult: an error, as in the reference.
        let (code, msg) = run("ours", "CHECK", &ns, &c, "").err();
        assert_eq!((code, msg.as_str()), (7, "Required prevResult missing"));

        // A different gateway for a configured address.
        let mut wrong = with_prev.clone();
        wrong["prevResult"]["ips"][0]["gateway"] = json!("10.10.0.9");
        let (code, msg) = run("ours", "CHECK", &ns, &wrong, "").err();
        assert_eq!(
            (code, msg.as_str()),
            (
                106,
                "static: Failed to match addr 10.10.0.1 on interface eth0"
            )
        );
        if v != "1.1.0" {
            assert_eq!(run("reference", "CHECK", &ns, &wrong, "").err().1, msg);
        }

        // Deliberately stricter: an address missing from prevResult.
        let mut missing = with_prev.clone();
        missing["prevResult"]["ips"]
            .as_array_mut()
            .unwrap()
            .remove(2);
        let (code, msg) = run("ours", "CHECK", &ns, &missing, "").err();
        assert_eq!(code, 106);
        assert!(msg.contains("10.20.0.1"), "{msg}");

        // DEL: nothing to release; also fine without netns and twice.
        let del = Call::new(bin("static"), "DEL").stdin(&with_prev);
        assert_eq!(del.run().ok(), Value::Null);
        assert_eq!(del.run().ok(), Value::Null);
        // A config ADD would reject does not make DEL fail.
        let bad = conf(v, json!({"addresses": [{"address": "nonsense"}]}));
        Call::new(bin("static"), "DEL").stdin(&bad).run().ok();
    }
    // GC and STATUS (1.1.0 only) succeed silently: there is no state.
    let c = conf("1.1.0", full_ipam(true));
    for cmd in ["GC", "STATUS"] {
        let out = Call::new(bin("static"), cmd)
            .env("CNI_CONTAINERID", "")
            .env("CNI_IFNAME", "")
            .stdin(&c)
            .run();
        assert_eq!(out.ok(), Value::Null, "{cmd}");
        let old = Call::new(bin("static"), cmd)
            .stdin(&conf("1.0.0", full_ipam(true)))
            .run();
        assert_eq!(old.err().0, 1, "{cmd} needs 1.1.0");
    }
}

#[test]
fn add_needs_a_netns_that_is_not_the_plugins_own() {
    let c = conf("1.0.0", full_ipam(true));
    let (code, _) = Call::new(bin("static"), "ADD").stdin(&c).run().err();
    assert_eq!(code, 4);
    let ns = TestNs::new();
    let own = Call::new(bin("static"), "ADD")
        .netns("/proc/self/ns/net")
        .stdin(&c)
        .run_in(&ns.ns);
    assert_eq!(own.err().0, 8);
}
