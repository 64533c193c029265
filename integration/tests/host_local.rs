//! The host-local binary: results at every spec version, dual-stack,
//! requested addresses, exhaustion, DEL/CHECK/GC/STATUS, resolvConf, many
//! processes at once, and the reference binary side by side on the same
//! state directory. Every test has its own dataDir; host-local touches no
//! network namespace, so CNI_NETNS is a path nobody opens.

use rcni_cni::version::ALL;
use rcni_testkit::{Call, Output, bin, normalize_result, reference_bin};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tempfile::TempDir;

const NET: &str = "hl-net";
const NETNS: &str = "/run/rcni-host-local-test/netns-never-opened";

fn ours() -> PathBuf {
    bin("host-local")
}

fn theirs() -> PathBuf {
    reference_bin("host-local")
}

/// The full network config a main plugin would pass, with `ipam` completed
/// by type and dataDir.
fn conf(version: &str, data_dir: &Path, mut ipam: Value) -> Value {
    ipam["type"] = json!("host-local");
    ipam["dataDir"] = json!(data_dir);
    json!({"cniVersion": version, "name": NET, "type": "bridge", "ipam": ipam})
}

fn call(plugin: &Path, cmd: &str, stdin: &Value, cid: &str, ifname: &str) -> Call {
    Call::new(plugin, cmd)
        .env("CNI_CONTAINERID", cid)
        .env("CNI_IFNAME", ifname)
        .netns(NETNS)
        .env("CNI_NETNS_OVERRIDE", "1")
        .stdin(stdin)
}

fn add(plugin: &Path, stdin: &Value, cid: &str) -> Output {
    call(plugin, "ADD", stdin, cid, "eth0").run()
}

fn del(plugin: &Path, stdin: &Value, cid: &str) -> Output {
    call(plugin, "DEL", stdin, cid, "eth0").run()
}

/// Every file of the network's directory: name -> (content, mode).
fn snapshot(data_dir: &Path) -> BTreeMap<String, (String, u32)> {
    let dir = data_dir.join(NET);
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let e = e.unwrap();
        // Our owner index and the spares last_reserved_ip.N is swapped
        // with, files the reference neither writes nor reads (store::tests
        // covers them); everything else must match the reference.
        if e.file_name().to_string_lossy().starts_with(".rcni-") {
            continue;
        }
        let meta = e.metadata().unwrap();
        let content = std::fs::read_to_string(e.path()).unwrap();
        out.insert(
            e.file_name().to_string_lossy().into_owned(),
            (content, meta.permissions().mode() & 0o777),
        );
    }
    out
}

/// [`snapshot`] without modes: what a comparison with the 1.1.1 reference
/// looks at (its files are 0644; v1.4.0 and later write 0600, as we do:
/// `files_are_0600_as_v191`).
fn contents(data_dir: &Path) -> BTreeMap<String, String> {
    snapshot(data_dir)
        .into_iter()
        .map(|(n, (c, _))| (n, c))
        .collect()
}

/// The mode of every file in the network's directory, ours included.
fn modes(data_dir: &Path) -> BTreeMap<String, u32> {
    let dir = data_dir.join(NET);
    std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let mode = e.metadata().unwrap().permissions().mode() & 0o777;
            (e.file_name().to_string_lossy().into_owned(), mode)
        })
        .collect()
}

fn names(data_dir: &Path) -> Vec<String> {
    snapshot(data_dir).into_keys().collect()
}

/// Reservation files only (no lock, no last_reserved_ip.*).
fn reservations(data_dir: &Path) -> BTreeMap<String, String> {
    snapshot(data_dir)
        .into_iter()
        .filter(|(n, _)| n != "lock" && !n.starts_with("last_reserved_ip."))
        .map(|(n, (c, _))| (n, c))
        .collect()
}

fn address(result: &Value, i: usize) -> String {
    result["ips"][i]["address"].as_str().unwrap().to_string()
}

/// Go prints `"dns": {}` for an empty DNS (omitempty does not apply to
/// structs); our results leave it out. Everything else must be identical.
fn without_empty_dns(mut v: Value) -> Value {
    if let Some(m) = v.as_object_mut()
        && m.get("dns") == Some(&json!({}))
    {
        m.remove("dns");
    }
    v
}

fn v4_ipam() -> Value {
    json!({
        "ranges": [[{"subnet": "10.10.0.0/24"}]],
        "routes": [{"dst": "0.0.0.0/0"}, {"dst": "192.168.0.0/16", "gw": "10.10.0.254"}]
    })
}

fn dual_ipam() -> Value {
    json!({
        "ranges": [[{"subnet": "10.10.0.0/24"}], [{"subnet": "2001:db8:1::/64"}]],
        "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]
    })
}

#[test]
fn results_per_spec_version() {
    for v in ALL {
        let tmp = TempDir::new().unwrap();
        let c = conf(v, tmp.path(), v4_ipam());
        let out = add(&ours(), &c, "c1").ok();
        assert_eq!(out["cniVersion"], *v, "{out}");
        match *v {
            "0.1.0" | "0.2.0" => {
                assert_eq!(
                    out["ip4"],
                    json!({"ip": "10.10.0.2/24", "gateway": "10.10.0.1",
                        "routes": [{"dst": "0.0.0.0/0"}, {"dst": "192.168.0.0/16", "gw": "10.10.0.254"}]}),
                    "{v}"
                );
                assert!(
                    out.get("ips").is_none() && out.get("ip6").is_none(),
                    "{v}: {out}"
                );
            }
            _ => {
                let mut ip = json!({"address": "10.10.0.2/24", "gateway": "10.10.0.1"});
                if v.starts_with("0.") {
                    ip["version"] = json!("4");
                }
                assert_eq!(
                    out["ips"],
                    json!([ip]),
                    "{v}: ips[].version only before 1.0.0"
                );
                assert_eq!(
                    out["routes"],
                    json!([{"dst": "0.0.0.0/0"}, {"dst": "192.168.0.0/16", "gw": "10.10.0.254"}])
                );
                assert!(
                    out.get("interfaces").is_none(),
                    "IPAM results have no interfaces"
                );
            }
        }
        assert_eq!(
            reservations(tmp.path()),
            BTreeMap::from([("10.10.0.2".to_string(), "c1\r\neth0".to_string())])
        );
        if *v != "0.1.0" && *v != "0.2.0" && *v != "0.3.0" && *v != "0.3.1" {
            call(&ours(), "CHECK", &c, "c1", "eth0").run().ok();
        }
        del(&ours(), &c, "c1").ok();
        assert_eq!(names(tmp.path()), ["last_reserved_ip.0", "lock"], "{v}");
    }
}

#[test]
fn dual_stack_one_address_per_range_set() {
    let tmp = TempDir::new().unwrap();
    let c = conf("1.0.0", tmp.path(), dual_ipam());
    let out = add(&ours(), &c, "c1").ok();
    assert_eq!(
        out["ips"],
        json!([{"address": "10.10.0.2/24", "gateway": "10.10.0.1"},
               {"address": "2001:db8:1::2/64", "gateway": "2001:db8:1::1"}])
    );
    let out = add(&ours(), &c, "c2").ok();
    assert_eq!(address(&out, 1), "2001:db8:1::3/64");
    let snap = snapshot(tmp.path());
    assert_eq!(snap["2001:db8:1::2"].0, "c1\r\neth0");
    assert_eq!(snap["last_reserved_ip.0"].0, "10.10.0.3");
    assert_eq!(snap["last_reserved_ip.1"].0, "2001:db8:1::3");
    // 0.2.0 carries one address of each family.
    let tmp2 = TempDir::new().unwrap();
    let out = add(&ours(), &conf("0.2.0", tmp2.path(), dual_ipam()), "c1").ok();
    assert_eq!(out["ip4"]["ip"], "10.10.0.2/24");
    assert_eq!(out["ip6"]["ip"], "2001:db8:1::2/64");
    assert_eq!(out["ip6"]["routes"], json!([{"dst": "::/0"}]));
}

#[test]
fn requested_ips_from_every_source_and_precedence() {
    let tmp = TempDir::new().unwrap();
    let base = conf("1.0.0", tmp.path(), dual_ipam());

    let out = call(&ours(), "ADD", &base, "env", "eth0")
        .env(
            "CNI_ARGS",
            "IgnoreUnknown=1;K8S_POD_NAME=p;IP=10.10.0.50,2001:db8:1::50",
        )
        .run()
        .ok();
    assert_eq!(address(&out, 0), "10.10.0.50/24");
    assert_eq!(address(&out, 1), "2001:db8:1::50/64");

    let mut c = base.clone();
    c["args"] = json!({"cni": {"ips": ["10.10.0.51"]}});
    let out = add(&ours(), &c, "args").ok();
    assert_eq!(address(&out, 0), "10.10.0.51/24");
    assert_eq!(
        address(&out, 1),
        "2001:db8:1::51/64",
        "the other set continues after ::50"
    );

    let mut c = base.clone();
    c["runtimeConfig"] = json!({"ips": ["10.10.0.52/24"]});
    let out = add(&ours(), &c, "rt").ok();
    assert_eq!(address(&out, 0), "10.10.0.52/24");

    // runtimeConfig > args > CNI_ARGS.
    let mut c = base.clone();
    c["args"] = json!({"cni": {"ips": ["10.10.0.61"]}});
    c["runtimeConfig"] = json!({"ips": ["10.10.0.60"]});
    let out = call(&ours(), "ADD", &c, "all3", "eth0")
        .env("CNI_ARGS", "IP=10.10.0.62")
        .run()
        .ok();
    assert_eq!(address(&out, 0), "10.10.0.60/24");
    c.as_object_mut().unwrap().remove("runtimeConfig");
    let out = call(&ours(), "ADD", &c, "args-env", "eth0")
        .env("CNI_ARGS", "IP=10.10.0.62")
        .run()
        .ok();
    assert_eq!(address(&out, 0), "10.10.0.61/24");
    assert!(!reservations(tmp.path()).contains_key("10.10.0.62"));

    let before = reservations(tmp.path());
    let req = |cid: &str, ip: &str| {
        call(&ours(), "ADD", &base, cid, "eth0")
            .env("CNI_ARGS", &format!("IP={ip}"))
            .run()
            .err()
    };
    assert_eq!(
        req("x1", "192.168.7.7"),
        (
            7,
            "failed to allocate all requested IPs: 192.168.7.7".into()
        )
    );
    assert_eq!(
        req("x2", "10.10.0.1"),
        (
            7,
            "failed to allocate for range 0: requested ip 10.10.0.1 is subnet's gateway".into()
        )
    );
    assert_eq!(
        req("x3", "10.10.0.50"),
        (
            107,
            "failed to allocate for range 0: requested IP address 10.10.0.50 is not available in range set 10.10.0.1-10.10.0.254".into()
        )
    );
    assert_eq!(req("x4", "10.10.0.500").0, 4);
    let e = call(&ours(), "ADD", &base, "x5", "eth0")
        .env("CNI_ARGS", "IP=10.10.0.70;FOO=1")
        .run()
        .err();
    assert_eq!(e.0, 4, "unknown CNI_ARGS without IgnoreUnknown: {e:?}");
    assert_eq!(
        reservations(tmp.path()),
        before,
        "failed ADDs reserve nothing"
    );
}

#[test]
fn exhaustion_duplicate_and_status() {
    let tmp = TempDir::new().unwrap();
    let c = conf(
        "1.1.0",
        tmp.path(),
        json!({"ranges": [[{"subnet": "10.10.0.0/30"}]]}),
    );
    let status = || Call::new(ours(), "STATUS").stdin(&c).run();
    status().ok();
    assert!(!tmp.path().join(NET).exists(), "STATUS creates no state");

    assert_eq!(address(&add(&ours(), &c, "a").ok(), 0), "10.10.0.2/30");
    assert_eq!(
        add(&ours(), &c, "a").err(),
        (
            108,
            "failed to allocate for range 0: 10.10.0.2 has been allocated to a, duplicate allocation is not allowed".into()
        )
    );
    assert_eq!(
        add(&ours(), &c, "b").err(),
        (
            107,
            "failed to allocate for range 0: no IP addresses available in range set: 10.10.0.1-10.10.0.2".into()
        )
    );
    let (code, msg) = status().err();
    assert_eq!(code, 50);
    assert!(msg.contains("10.10.0.1-10.10.0.2"), "{msg}");
    del(&ours(), &c, "a").ok();
    assert_eq!(status().ok(), Value::Null, "free again: no output, exit 0");
    // STATUS needs 1.1.0.
    let old = conf(
        "1.0.0",
        tmp.path(),
        json!({"ranges": [[{"subnet": "10.10.0.0/30"}]]}),
    );
    assert_eq!(Call::new(ours(), "STATUS").stdin(&old).run().err().0, 1);
}

#[test]
fn del_is_idempotent_and_scoped_to_the_attachment() {
    let tmp = TempDir::new().unwrap();
    let c = conf("1.0.0", tmp.path(), v4_ipam());
    // A network that never had an address: success, nothing created.
    del(&ours(), &c, "nobody").ok();
    assert!(!tmp.path().join(NET).exists());

    add(&ours(), &c, "a").ok();
    call(&ours(), "ADD", &c, "a", "eth1").run().ok();
    del(&ours(), &c, "a").ok();
    assert_eq!(
        reservations(tmp.path()),
        BTreeMap::from([("10.10.0.3".to_string(), "a\r\neth1".to_string())])
    );
    del(&ours(), &c, "a").ok();
    // DEL without netns, with a config whose ranges no longer validate
    // and with unknown CNI_ARGS: still releases.
    let broken = conf("1.0.0", tmp.path(), json!({"subnet": "10.10.0.0/31"}));
    call(&ours(), "DEL", &broken, "a", "eth1")
        .without("CNI_NETNS")
        .env("CNI_ARGS", "FOO=bar")
        .run()
        .ok();
    assert!(reservations(tmp.path()).is_empty());
    call(&ours(), "DEL", &broken, "a", "eth1").run().ok();
}

#[test]
fn check_needs_a_reservation_matching_prev_result() {
    let tmp = TempDir::new().unwrap();
    let c = conf("1.0.0", tmp.path(), v4_ipam());
    let (code, msg) = call(&ours(), "CHECK", &c, "a", "eth0").run().err();
    assert_eq!(
        (code, msg.as_str()),
        (
            106,
            "host-local: Failed to find address added by container a"
        )
    );
    let result = add(&ours(), &c, "a").ok();
    add(&ours(), &c, "b").ok();
    let mut with_prev = c.clone();
    with_prev["prevResult"] = result.clone();
    call(&ours(), "CHECK", &with_prev, "a", "eth0").run().ok();
    // Another container's address in prevResult is a failure.
    with_prev["prevResult"]["ips"][0]["address"] = json!("10.10.0.3/24");
    let (code, msg) = call(&ours(), "CHECK", &with_prev, "a", "eth0").run().err();
    assert_eq!(code, 106, "{msg}");
    assert!(msg.contains("10.10.0.3"), "{msg}");
    // Addresses outside our ranges belong to someone else: not ours to judge.
    with_prev["prevResult"]["ips"][0]["address"] = json!("172.16.0.3/24");
    call(&ours(), "CHECK", &with_prev, "a", "eth0").run().ok();
    del(&ours(), &c, "a").ok();
    assert_eq!(call(&ours(), "CHECK", &c, "a", "eth0").run().err().0, 106);
    // The reference agrees on the first case.
    let (_, msg) = call(&theirs(), "CHECK", &c, "a", "eth0").run().err();
    assert_eq!(
        msg,
        "host-local: Failed to find address added by container a"
    );
}

#[test]
fn gc_releases_everything_outside_the_valid_set() {
    let tmp = TempDir::new().unwrap();
    let c = conf("1.1.0", tmp.path(), v4_ipam());
    add(&ours(), &c, "a").ok(); // .2
    add(&ours(), &c, "b").ok(); // .3
    call(&ours(), "ADD", &c, "a", "eth1").run().ok(); // .4
    let dir = tmp.path().join(NET);
    // Files from older host-local versions hold only the container ID.
    std::fs::write(dir.join("10.10.0.200"), "old").unwrap();
    std::fs::write(dir.join("10.10.0.201"), "keep").unwrap();
    // Content no attachment matches goes, as with v1.10.0; a file whose
    // name is no address reserves nothing and stays (v1.10.0 removes it).
    std::fs::write(dir.join("10.10.0.202"), "x\ny\nz").unwrap();
    std::fs::write(dir.join("notes.txt"), "b\r\neth0").unwrap();

    let gc = |valid: Value| {
        let mut g = c.clone();
        g["cni.dev/valid-attachments"] = valid.clone();
        g["cni.dev/attachments"] = valid;
        Call::new(ours(), "GC").stdin(&g).run()
    };
    assert_eq!(
        gc(json!([{"containerID": "a", "ifname": "eth0"}, {"containerID": "keep", "ifname": "eth9"}])).ok(),
        Value::Null
    );
    assert_eq!(
        names(tmp.path()),
        [
            "10.10.0.2",
            "10.10.0.201",
            "last_reserved_ip.0",
            "lock",
            "notes.txt"
        ]
    );
    // The runtime's "nothing is valid" (libcni sends null for none).
    gc(json!(null)).ok();
    assert_eq!(
        names(tmp.path()),
        ["last_reserved_ip.0", "lock", "notes.txt"]
    );
    // Without the key at all, as v1.10.0 reads it: nothing is valid.
    std::fs::write(dir.join("10.10.0.9"), "z\r\neth0").unwrap();
    Call::new(ours(), "GC").stdin(&c).run().ok();
    assert!(!dir.join("10.10.0.9").exists());
    // GC needs 1.1.0; on a network without state it is a no-op.
    let old = conf("1.0.0", tmp.path(), v4_ipam());
    assert_eq!(Call::new(ours(), "GC").stdin(&old).run().err().0, 1);
    let empty = TempDir::new().unwrap();
    let mut g = conf("1.1.0", empty.path(), v4_ipam());
    g["cni.dev/valid-attachments"] = json!([]);
    Call::new(ours(), "GC").stdin(&g).run().ok();
    assert!(!empty.path().join(NET).exists());
}

#[test]
fn resolv_conf_becomes_result_dns() {
    let tmp = TempDir::new().unwrap();
    let resolv = tmp.path().join("resolv.conf");
    std::fs::write(
        &resolv,
        "# generated\nnameserver 10.0.0.53\nnameserver 2001:db8::53\ndomain example.com\nsearch a.example b.example\noptions ndots:5\n",
    )
    .unwrap();
    let mut ipam = v4_ipam();
    ipam["resolvConf"] = json!(resolv);
    let state = TempDir::new().unwrap();
    let c = conf("1.0.0", state.path(), ipam.clone());
    let out = add(&ours(), &c, "a").ok();
    let want = json!({"nameservers": ["10.0.0.53", "2001:db8::53"], "domain": "example.com",
        "search": ["a.example", "b.example"], "options": ["ndots:5"]});
    assert_eq!(out["dns"], want);
    let ref_state = TempDir::new().unwrap();
    let theirs_out = add(
        &theirs(),
        &conf("1.0.0", ref_state.path(), ipam.clone()),
        "a",
    )
    .ok();
    assert_eq!(out, theirs_out);

    ipam["resolvConf"] = json!(tmp.path().join("missing"));
    let (code, msg) = add(&ours(), &conf("1.0.0", state.path(), ipam), "b").err();
    assert_eq!(code, 7, "{msg}");
    assert_eq!(
        reservations(state.path()).len(),
        1,
        "nothing reserved for b"
    );
}

/// Runs `n` calls at once, each in its own thread and process.
fn parallel(calls: Vec<Call>) -> Vec<Output> {
    std::thread::scope(|s| {
        let handles: Vec<_> = calls.iter().map(|c| s.spawn(|| c.run())).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn fifty_parallel_adds_get_distinct_addresses_and_dels_release_all() {
    let tmp = TempDir::new().unwrap();
    let c = conf(
        "1.0.0",
        tmp.path(),
        json!({"ranges": [[{"subnet": "10.10.0.0/24"}], [{"subnet": "2001:db8:1::/64"}]]}),
    );
    let adds: Vec<Call> = (0..50)
        .map(|i| call(&ours(), "ADD", &c, &format!("par-{i}"), "eth0"))
        .collect();
    let outs = parallel(adds);
    let mut v4 = BTreeSet::new();
    let mut v6 = BTreeSet::new();
    for o in &outs {
        let r = o.ok();
        v4.insert(address(&r, 0));
        v6.insert(address(&r, 1));
    }
    assert_eq!((v4.len(), v6.len()), (50, 50), "distinct addresses");
    let res = reservations(tmp.path());
    assert_eq!(res.len(), 100);
    let owners: BTreeSet<&String> = res.values().collect();
    assert_eq!(owners.len(), 50, "each container owns its two files");

    let dels: Vec<Call> = (0..50)
        .map(|i| call(&ours(), "DEL", &c, &format!("par-{i}"), "eth0"))
        .collect();
    for o in parallel(dels) {
        o.ok();
    }
    assert_eq!(
        names(tmp.path()),
        ["last_reserved_ip.0", "last_reserved_ip.1", "lock"]
    );
}

/// Ours for even `i`, the reference for odd.
fn alternate(i: usize) -> PathBuf {
    if i.is_multiple_of(2) {
        ours()
    } else {
        theirs()
    }
}

#[test]
fn parallel_adds_of_ours_and_the_reference_never_collide() {
    let tmp = TempDir::new().unwrap();
    let c = conf(
        "1.0.0",
        tmp.path(),
        json!({"ranges": [[{"subnet": "10.10.0.0/24"}]]}),
    );
    let adds: Vec<Call> = (0..40)
        .map(|i| call(&alternate(i), "ADD", &c, &format!("mix-{i}"), "eth0"))
        .collect();
    let addrs: BTreeSet<String> = parallel(adds).iter().map(|o| address(&o.ok(), 0)).collect();
    assert_eq!(addrs.len(), 40);
    assert_eq!(reservations(tmp.path()).len(), 40);
    // Each releases the other's.
    let dels: Vec<Call> = (0..40)
        .map(|i| call(&alternate(i + 1), "DEL", &c, &format!("mix-{i}"), "eth0"))
        .collect();
    for o in parallel(dels) {
        o.ok();
    }
    assert!(reservations(tmp.path()).is_empty());
}

#[test]
fn alternating_with_the_reference_shares_round_robin_and_releases() {
    let tmp = TempDir::new().unwrap();
    let c = conf("1.0.0", tmp.path(), dual_ipam());
    let plugin = alternate;
    let mut got = Vec::new();
    for i in 0..8 {
        let r = add(&plugin(i), &c, &format!("alt-{i}")).ok();
        got.push((address(&r, 0), address(&r, 1)));
    }
    // One shared walk: each continues where the other stopped.
    let want: Vec<(String, String)> = (2..10)
        .map(|n| (format!("10.10.0.{n}/24"), format!("2001:db8:1::{n}/64")))
        .collect();
    assert_eq!(got, want);
    // Each one's DEL releases the other's reservation; a second DEL by
    // the other is a no-op.
    for i in 0..8 {
        del(&plugin(i + 1), &c, &format!("alt-{i}")).ok();
        del(&plugin(i), &c, &format!("alt-{i}")).ok();
    }
    assert_eq!(
        names(tmp.path()),
        ["last_reserved_ip.0", "last_reserved_ip.1", "lock"]
    );
    // A reservation the reference made is a duplicate for ours, and the
    // reverse.
    add(&theirs(), &c, "dup").ok();
    assert_eq!(add(&ours(), &c, "dup").err().0, 108);
    del(&ours(), &c, "dup").ok();
    add(&ours(), &c, "dup2").ok();
    let (_, msg) = add(&theirs(), &c, "dup2").err();
    assert!(msg.contains("duplicate allocation is not allowed"), "{msg}");
    // Legacy files (container ID only) are released by both.
    let dir = tmp.path().join(NET);
    std::fs::write(dir.join("10.10.0.100"), "legacy-a").unwrap();
    std::fs::write(dir.join("10.10.0.101"), "legacy-b").unwrap();
    del(&ours(), &c, "legacy-a").ok();
    del(&theirs(), &c, "legacy-b").ok();
    assert!(!dir.join("10.10.0.100").exists() && !dir.join("10.10.0.101").exists());
}

#[test]
fn lock_file_is_shared_with_the_reference() {
    let tmp = TempDir::new().unwrap();
    let c = conf("1.0.0", tmp.path(), v4_ipam());
    // Create the directory and lock file, then hold the lock from outside.
    add(&ours(), &c, "first").ok();
    let lock = tmp.path().join(NET).join("lock");
    let marker = tmp.path().join("held");
    let mut holder = std::process::Command::new("flock")
        .arg(&lock)
        .arg("-c")
        .arg(format!("touch {}; sleep 3", marker.display()))
        .spawn()
        .expect("flock(1)");
    while !marker.exists() {
        std::thread::sleep(Duration::from_millis(10));
    }
    let start = Instant::now();
    let outs = parallel(vec![
        call(&ours(), "ADD", &c, "waits-ours", "eth0"),
        call(&theirs(), "ADD", &c, "waits-theirs", "eth0"),
    ]);
    let waited = start.elapsed();
    holder.wait().unwrap();
    for o in &outs {
        o.ok();
    }
    assert!(
        waited >= Duration::from_millis(1000),
        "both must wait for the flock on {}: {waited:?}",
        lock.display()
    );
    let lock_mode = snapshot(tmp.path())["lock"].1;
    assert_eq!(lock_mode, 0o750, "go-filemutex creates the lock 0750");
}

/// One step of a differential scenario.
enum Step {
    Add(&'static str),
    AddWith(&'static str, &'static str),
    Del(&'static str),
}

fn run_step(plugin: &Path, c: &Value, step: &Step) -> Output {
    match step {
        Step::Add(cid) => add(plugin, c, cid),
        Step::AddWith(cid, args) => call(plugin, "ADD", c, cid, "eth0")
            .env("CNI_ARGS", args)
            .run(),
        Step::Del(cid) => del(plugin, c, cid),
    }
}

#[test]
fn same_results_and_files_as_the_reference() {
    use Step::*;
    let scenarios: Vec<(Value, Vec<Step>)> = vec![
        (
            json!({"subnet": "10.20.0.0/24", "gateway": "10.20.0.254", "routes": [{"dst": "0.0.0.0/0"}]}),
            vec![
                Add("a"),
                Add("b"),
                Del("a"),
                Add("c"),
                AddWith("d", "IP=10.20.0.2"),
                Add("e"),
            ],
        ),
        (
            json!({"ranges": [
                [{"subnet": "10.30.0.0/24", "rangeStart": "10.30.0.252", "rangeEnd": "10.30.0.254"}, {"subnet": "10.31.0.0/30"}],
                [{"subnet": "2001:db8:30::/64", "rangeStart": "2001:db8:30::fffe", "rangeEnd": "2001:db8:30::1:2"}]
            ], "routes": [{"dst": "0.0.0.0/0", "gw": "10.30.0.1"}, {"dst": "::/0"}]}),
            vec![
                Add("a"),
                Add("b"),
                Add("c"),
                Add("d"),
                Del("b"),
                Add("e"),
                Add("f"),
            ],
        ),
        (
            json!({"ranges": [[{"subnet": "2001:db8:40::/120", "gateway": "2001:db8:40::ff"}]]}),
            vec![
                Add("a"),
                AddWith("b", "IgnoreUnknown=1;K8S_POD_NAME=x;IP=2001:db8:40::fe"),
                Add("c"),
                Del("a"),
                Add("a"),
            ],
        ),
        (
            json!({"ranges": [[{"subnet": "10.50.0.0/30"}]]}),
            vec![Add("a"), Add("b"), Del("a"), Add("b"), Add("a")],
        ),
    ];
    for version in ["0.2.0", "0.3.1", "0.4.0", "1.0.0"] {
        for (n, (ipam, steps)) in scenarios.iter().enumerate() {
            let ours_dir = TempDir::new().unwrap();
            let ref_dir = TempDir::new().unwrap();
            let c_ours = conf(version, ours_dir.path(), ipam.clone());
            let c_ref = conf(version, ref_dir.path(), ipam.clone());
            for (i, step) in steps.iter().enumerate() {
                let o = run_step(&ours(), &c_ours, step);
                let r = run_step(&theirs(), &c_ref, step);
                let ctx = format!("{version} scenario {n} step {i}");
                assert_eq!(
                    o.code == 0,
                    r.code == 0,
                    "{ctx}: ours {o:?} reference {r:?}"
                );
                if r.code == 0 {
                    let (ov, rv) = (o.ok(), r.ok());
                    assert_eq!(ov, without_empty_dns(rv.clone()), "{ctx}");
                    if !rv.is_null() {
                        assert_eq!(
                            normalize_result(&ov, version),
                            normalize_result(&rv, version),
                            "{ctx}"
                        );
                    }
                } else {
                    assert_eq!(o.err().1, r.err().1, "{ctx}: same message");
                }
                assert_eq!(
                    contents(ours_dir.path()),
                    contents(ref_dir.path()),
                    "{ctx}: same files"
                );
            }
        }
    }
}

#[test]
fn config_errors_match_the_reference() {
    let tmp = TempDir::new().unwrap();
    let cases: Vec<(&str, Value)> = vec![
        ("1.0.0", json!({"subnet": "10.0.0.0/31"})),
        ("1.0.0", json!({"subnet": "10.0.0.1/32"})),
        ("1.0.0", json!({"subnet": "2001:db8::/127"})),
        ("1.0.0", json!({"subnet": "10.0.0.5/24"})),
        (
            "1.0.0",
            json!({"subnet": "10.0.0.0/24", "rangeStart": "10.0.1.1"}),
        ),
        (
            "1.0.0",
            json!({"subnet": "10.0.0.0/24", "rangeEnd": "10.0.1.1"}),
        ),
        (
            "1.0.0",
            json!({"subnet": "10.0.0.0/24", "rangeStart": "10.0.0.50", "rangeEnd": "10.0.0.40"}),
        ),
        ("1.0.0", json!({"subnet": "::ffff:10.0.0.0/120"})),
        ("1.0.0", json!({})),
        ("1.0.0", json!({"ranges": [[]]})),
        ("1.0.0", json!({"ranges": [[{"rangeStart": "10.0.0.1"}]]})),
        (
            "1.0.0",
            json!({"ranges": [[{"subnet": "10.0.0.0/24"}, {"subnet": "2001:db8::/64"}]]}),
        ),
        (
            "1.0.0",
            json!({"ranges": [[{"subnet": "10.0.0.0/24"}, {"subnet": "10.0.0.0/25"}]]}),
        ),
        (
            "1.0.0",
            json!({"ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "10.0.0.128/25"}]]}),
        ),
        (
            "0.2.0",
            json!({"ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "10.1.0.0/24"}]]}),
        ),
        ("1.0.0", json!({"subnet": "10.0.0.0/24", "gateway": "nope"})),
        ("1.0.0", json!({"subnet": "10.0.0.0"})),
        ("1.0.0", json!({"subnet": ""})),
    ];
    for (version, ipam) in cases {
        let c = conf(version, tmp.path(), ipam.clone());
        let (code, msg) = add(&ours(), &c, "a").err();
        let (_, ref_msg) = add(&theirs(), &c, "a").err();
        assert_eq!(msg, ref_msg, "{ipam}");
        assert_eq!(code, 7, "{ipam}: {msg}");
    }
    let mut c = conf("1.0.0", tmp.path(), json!({}));
    c.as_object_mut().unwrap().remove("ipam");
    assert_eq!(
        add(&ours(), &c, "a").err(),
        (7, add(&theirs(), &c, "a").err().1)
    );
    // Requested addresses that cannot be had.
    let c = conf("1.0.0", tmp.path(), json!({"subnet": "10.0.0.0/24"}));
    for ip in ["192.168.0.1", "10.0.0.1", "10.0.0.255"] {
        let run = |p: &Path| {
            call(p, "ADD", &c, "a", "eth0")
                .env("CNI_ARGS", &format!("IP={ip}"))
                .run()
                .err()
                .1
        };
        assert_eq!(run(&ours()), run(&theirs()), "{ip}");
    }
    assert!(reservations(tmp.path()).is_empty());
}

#[test]
fn runtime_ip_ranges_are_prepended_like_the_reference() {
    // CONVENTIONS.md says ipRanges "replaces" the configured ranges; the
    // reference (and so every deployed conflist) prepends them.
    let ipam = json!({"ranges": [[{"subnet": "10.60.0.0/24"}]]});
    let with_rt = |dir: &Path| {
        let mut c = conf("1.0.0", dir, ipam.clone());
        c["runtimeConfig"] = json!({"ipRanges": [[{"subnet": "10.61.0.0/24"}]]});
        c
    };
    let (a, b) = (TempDir::new().unwrap(), TempDir::new().unwrap());
    let o = add(&ours(), &with_rt(a.path()), "a").ok();
    let r = add(&theirs(), &with_rt(b.path()), "a").ok();
    assert_eq!(o, without_empty_dns(r));
    assert_eq!(address(&o, 0), "10.61.0.2/24");
    assert_eq!(address(&o, 1), "10.60.0.2/24");
    assert_eq!(contents(a.path()), contents(b.path()));
}

/// Upstream writes reservations and `last_reserved_ip.N` 0600 since v1.4.0
/// (CIS Kubernetes 1.1.9: they name every container); so do we, and our
/// index (`.rcni-owners`, every reservation's content) too, also where an
/// earlier build left it 0644. The lock stays go-filemutex's 0750, as
/// upstream's. Files and modes side by side with v1.9.1 where it is at hand.
#[test]
fn files_are_0600_as_v191() {
    let steps = |plugin: &Path, dir: &Path| {
        let c = conf("1.0.0", dir, dual_ipam());
        for (cmd, cid) in [("ADD", "a"), ("ADD", "b"), ("DEL", "a"), ("ADD", "c")] {
            call(plugin, cmd, &c, cid, "eth0").run().ok();
        }
    };
    let tmp = TempDir::new().unwrap();
    steps(&ours(), tmp.path());
    let m = modes(tmp.path());
    assert!(m.contains_key(".rcni-owners"), "{m:?}");
    for (name, mode) in &m {
        let want = if name == "lock" { 0o750 } else { 0o600 };
        assert_eq!(*mode, want, "{name}: {mode:o} in {m:?}");
    }
    // An index an earlier build wrote 0644 is 0600 after the next change.
    let index = tmp.path().join(NET).join(".rcni-owners");
    std::fs::set_permissions(&index, std::fs::Permissions::from_mode(0o644)).unwrap();
    let c = conf("1.0.0", tmp.path(), dual_ipam());
    add(&ours(), &c, "d").ok();
    assert_eq!(modes(tmp.path())[".rcni-owners"], 0o600);

    if let Some(v191) = rcni_testkit::reference_v191_bin("host-local") {
        let (a, b) = (TempDir::new().unwrap(), TempDir::new().unwrap());
        steps(&ours(), a.path());
        steps(&v191, b.path());
        assert_eq!(snapshot(a.path()), snapshot(b.path()), "content and mode");
    }
}
