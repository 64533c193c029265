//! The vrf binary, chained after bridge and ptp, with real VRF devices. This
//! host's kernel has no vrf module; scripts/test runs this binary under
//! scripts/vm-run (Debian's full kernel).

use rcni_integration::{Node, ip, nl};
use rcni_netlink::Family;
use rcni_netns::NetNs;
use rcni_testkit::{
    Call, Output, PersistentNs, TestNs, bin, normalized_result, reference_bin, reference_v191_bin,
};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

/// `plugin` with `cmd` for `ifname` in `pod`, run from the node.
fn call(node: &Node, plugin: &Path, cmd: &str, pod: &str, ifname: &str, conf: &Value) -> Output {
    Call::new(plugin, cmd)
        .env("CNI_PATH", &node.cni_path)
        .env("CNI_CONTAINERID", "vrf-pod")
        .env("CNI_IFNAME", ifname)
        .netns(pod)
        .stdin(conf)
        .run_in(&node.ns.ns)
}

/// The vrf plugin's config chained after `prev`.
fn vrf_conf(version: &str, vrf: &str, table: u32, prev: &Value) -> Value {
    let mut c = json!({"cniVersion": version, "name": "podnet", "type": "vrf", "vrfname": vrf});
    if table != 0 {
        c["table"] = json!(table);
    }
    if !prev.is_null() {
        c["prevResult"] = prev.clone();
    }
    c
}

/// The bridge network of `node` (10.88.0.0/24 and fd88::/64, default
/// routes via the bridge) with an IPAM route to 10.123.0.0/16.
fn bridge_conf(node: &Node, version: &str) -> Value {
    let mut c = node.conf(version, json!({}));
    c["ipam"]["routes"] = json!([{"dst": "10.123.0.0/16"}]);
    c
}

/// A ptp network (10.99.0.0/24) with an IPAM route to 10.124.0.0/16.
fn ptp_conf(node: &Node, version: &str) -> Value {
    json!({"cniVersion": version, "name": "side", "type": "ptp",
        "ipam": {"type": "host-local", "dataDir": node.data.path(),
                 "ranges": [[{"subnet": "10.99.0.0/24"}]],
                 "routes": [{"dst": "10.124.0.0/16"}]}})
}

/// `ip -j -d link show dev` fields: (kind, master's name, VRF table).
fn link_info(ns: &NetNs, dev: &str) -> (Option<String>, Option<String>, Option<u32>) {
    nl(ns, async |n| {
        let Some(l) = n.find_link(dev).await.unwrap() else {
            return (None, None, None);
        };
        let master = match l.master {
            Some(m) => Some(n.link_by_index(m).await.unwrap().name),
            None => None,
        };
        (l.kind, master, n.vrf_table(l.index).await.unwrap())
    })
}

/// The routes of `table` (every table: `None`), but link-local IPv6 and
/// local ones, as sorted lines naming the interface.
fn table_routes(ns: &NetNs, table: Option<u32>) -> Vec<String> {
    nl(ns, async |n| {
        let links = n.links().await.unwrap();
        let name = |i: Option<u32>| {
            links
                .iter()
                .find(|l| Some(l.index) == i)
                .map(|l| l.name.clone())
                .unwrap_or_default()
        };
        let mut v: Vec<String> = n
            .routes_in_table(Family::All, table)
            .await
            .unwrap()
            .iter()
            .filter(|r| r.table != 255 && !r.dst.ip().to_string().starts_with("fe80"))
            .map(|r| {
                let gw = r.gateway.map(|g| format!(" via {g}")).unwrap_or_default();
                format!(
                    "table {} {}{gw} dev {} scope {} proto {:?} metric {:?}",
                    r.table,
                    r.dst,
                    name(r.oif),
                    r.scope,
                    r.protocol,
                    r.metric
                )
            })
            .collect();
        v.sort();
        v
    })
}

/// The global addresses of `dev`, sorted.
fn global_addrs(ns: &NetNs, dev: &str) -> Vec<String> {
    nl(ns, async |n| {
        let l = n.link_by_name(dev).await.unwrap();
        let mut v: Vec<String> = n
            .addresses(Some(l.index))
            .await
            .unwrap()
            .iter()
            .filter(|a| a.scope == 0)
            .map(|a| a.addr.to_string())
            .collect();
        v.sort();
        v
    })
}

/// One ICMP echo from `ns` to `dst`, bound to `dev` (a VRF: its table) or
/// not; true if answered.
fn ping_via(ns: &NetNs, dev: Option<&str>, dst: &str) -> bool {
    let mut cmd = rcni_testkit::command_in(ns, "ping");
    cmd.args(["-c", "1", "-W", "2", "-n", "-q"]);
    if let Some(d) = dev {
        cmd.args(["-I", d]);
    }
    cmd.arg(dst)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A pod whose `a0` is one end of a veth pair (the other `a1`), addressed
/// `10.5.0.5/24`, with the prevResult a main plugin would have given.
fn veth_pod(version: &str) -> (TestNs, Value) {
    let pod = TestNs::new();
    ip(&pod.ns, "link add a0 type veth peer name a1");
    ip(&pod.ns, "addr add 10.5.0.5/24 dev a0");
    ip(&pod.ns, "link set a1 up");
    ip(&pod.ns, "link set a0 up");
    let prev = json!({"cniVersion": version,
        "interfaces": [{"name": "a0", "sandbox": pod.path()}],
        "ips": [{"address": "10.5.0.5/24", "gateway": "10.5.0.1", "interface": 0}]});
    (pod, prev)
}

/// Ours, then v1.9.1's where at hand, then Debian's 1.1.1: (label, binary).
fn implementations() -> Vec<(&'static str, PathBuf)> {
    let mut v = vec![("rcni", bin("vrf"))];
    match reference_v191_bin("vrf") {
        Some(p) => v.push(("v1.9.1", p)),
        None => eprintln!("SKIP: the v1.9.1 half of the comparison"),
    }
    v.push(("1.1.1", reference_bin("vrf")));
    v
}

#[test]
fn two_interfaces_share_a_vrf_and_its_traffic_uses_its_table() {
    let node = Node::new();
    // Addresses the node answers for behind the pod's IPAM routes.
    ip(&node.ns.ns, "addr add 10.123.0.1/32 dev lo");
    ip(&node.ns.ns, "addr add 10.124.0.1/32 dev lo");
    let pod = TestNs::new();
    let br = bridge_conf(&node, "1.0.0");
    let r0 = call(&node, &bin("bridge"), "ADD", &pod.path(), "eth0", &br).ok();
    // The kernel drops the IPv6 addresses of a link it takes down unless
    // keep_addr_on_down: ADD must put them back itself.
    rcni_netlink::sysctl::set(&pod.ns, "net/ipv6/conf/eth0/keep_addr_on_down", "0").unwrap();
    let v6 = rcni_integration::addr_of(&r0, false);
    let before = global_addrs(&pod.ns, "eth0");
    let c0 = vrf_conf("1.0.0", "blue", 0, &r0);
    let out = call(&node, &bin("vrf"), "ADD", &pod.path(), "eth0", &c0).ok();
    assert_eq!(out, r0, "prevResult passed through");
    assert_eq!(
        link_info(&pod.ns, "blue"),
        (Some("vrf".into()), None, Some(1)),
        "the first free table"
    );
    assert_eq!(link_info(&pod.ns, "eth0").1.as_deref(), Some("blue"));
    assert_eq!(global_addrs(&pod.ns, "eth0"), before, "IPv6 {v6} kept");
    let t = table_routes(&pod.ns, Some(1));
    for want in [
        "table 1 0.0.0.0/0 via 10.88.0.1 dev eth0",
        "table 1 10.123.0.0/16 via 10.88.0.1 dev eth0",
        "table 1 ::/0 via fd88::1 dev eth0",
        "table 1 10.88.0.0/24 dev eth0 scope 253 proto Some(2)",
    ] {
        assert!(t.iter().any(|r| r.starts_with(want)), "{want} in {t:#?}");
    }
    assert_eq!(table_routes(&pod.ns, Some(254)), Vec::<String>::new());

    // A second interface, from ptp, into the same VRF: its route to the
    // gateway moves with the routes via it.
    let pt = ptp_conf(&node, "1.0.0");
    let r1 = call(&node, &bin("ptp"), "ADD", &pod.path(), "net1", &pt).ok();
    let c1 = vrf_conf("1.0.0", "blue", 1, &r1);
    call(&node, &bin("vrf"), "ADD", &pod.path(), "net1", &c1).ok();
    assert_eq!(link_info(&pod.ns, "net1").1.as_deref(), Some("blue"));
    let t = table_routes(&pod.ns, Some(1));
    assert!(
        t.iter()
            .any(|r| r.starts_with("table 1 10.124.0.0/16 via 10.99.0.1 dev net1")),
        "{t:#?}"
    );

    // Traffic: in the VRF through both interfaces; the main table has no
    // route any more.
    for dst in [
        "10.88.0.1",
        "fd88::1",
        "10.123.0.1",
        "10.99.0.1",
        "10.124.0.1",
    ] {
        assert!(ping_via(&pod.ns, Some("blue"), dst), "{dst} in the VRF");
    }
    assert!(!ping_via(&pod.ns, None, "10.123.0.1"), "nothing in main");

    // CHECK: both members; net1 taken out fails, put back passes.
    call(&node, &bin("vrf"), "CHECK", &pod.path(), "eth0", &c0).ok();
    call(&node, &bin("vrf"), "CHECK", &pod.path(), "net1", &c1).ok();
    ip(&pod.ns, "link set net1 nomaster");
    let (code, msg) = call(&node, &bin("vrf"), "CHECK", &pod.path(), "net1", &c1).err();
    assert_eq!(
        (code, msg.as_str()),
        (106, "failed to find net1 associated to vrf blue")
    );
    ip(&pod.ns, "link set net1 master blue");
    call(&node, &bin("vrf"), "CHECK", &pod.path(), "net1", &c1).ok();

    // DEL: the VRF stays with a member left, goes with the last; twice.
    call(&node, &bin("vrf"), "DEL", &pod.path(), "eth0", &c0).ok();
    assert_eq!(link_info(&pod.ns, "eth0").1, None, "eth0 out");
    assert_eq!(link_info(&pod.ns, "blue").2, Some(1), "net1 still in it");
    call(&node, &bin("vrf"), "DEL", &pod.path(), "eth0", &c0).ok();
    call(&node, &bin("vrf"), "DEL", &pod.path(), "net1", &c1).ok();
    assert_eq!(link_info(&pod.ns, "blue"), (None, None, None), "VRF gone");
    assert_eq!(link_info(&pod.ns, "net1").1, None);
    call(&node, &bin("vrf"), "DEL", &pod.path(), "net1", &c1).ok();
    call(
        &node,
        &bin("ptp"),
        "DEL",
        &pod.path(),
        "net1",
        &Node::with_prev(&pt, &r1),
    )
    .ok();
    call(
        &node,
        &bin("bridge"),
        "DEL",
        &pod.path(),
        "eth0",
        &Node::with_prev(&br, &r0),
    )
    .ok();
    node.assert_nothing_left();
}

#[test]
fn table_choice_and_conflicts_as_the_reference() {
    for (who, vrf) in implementations() {
        // Table 0: the lowest no VRF has (red holds 1).
        let (pod, prev) = veth_pod("1.0.0");
        ip(&pod.ns, "link add red type vrf table 1");
        let node = Node::new();
        let c = vrf_conf("1.0.0", "blue", 0, &prev);
        call(&node, &vrf, "ADD", &pod.path(), "a0", &c).ok();
        assert_eq!(link_info(&pod.ns, "blue").2, Some(2), "{who}");
        // An existing VRF on another table than the config's.
        ip(&pod.ns, "link add b0 type veth peer name b1");
        let other = vrf_conf("1.0.0", "blue", 1001, &prev);
        let (code, msg) = call(&node, &vrf, "ADD", &pod.path(), "b0", &other).err();
        assert_eq!(
            msg, "cmdAdd failed: VRF blue already exist with different routing table 2",
            "{who}"
        );
        assert_eq!(code, if who == "rcni" { 7 } else { 999 }, "{who}");
        assert_eq!(link_info(&pod.ns, "b0").1, None, "{who}: b0 not enslaved");
        // Its own table given: joins it.
        let same = vrf_conf("1.0.0", "blue", 2, &prev);
        call(&node, &vrf, "ADD", &pod.path(), "b0", &same).ok();
        assert_eq!(link_info(&pod.ns, "b0").1.as_deref(), Some("blue"), "{who}");
        // Another VRF on a table already used: the kernel allows it.
        ip(&pod.ns, "link add c0 type veth peer name c1");
        let shared = vrf_conf("1.0.0", "green", 1, &prev);
        call(&node, &vrf, "ADD", &pod.path(), "c0", &shared).ok();
        assert_eq!(link_info(&pod.ns, "green").2, Some(1), "{who}");
        // A link of that name that is no VRF.
        let (code, msg) = call(
            &node,
            &vrf,
            "ADD",
            &pod.path(),
            "c1",
            &vrf_conf("1.0.0", "a1", 0, &prev),
        )
        .err();
        assert_eq!(msg, "cmdAdd failed: Netlink a1 is not a VRF", "{who}");
        assert!(code == 7 || code == 999, "{who}");
    }
}

#[test]
fn failed_add_leaves_nothing_behind() {
    let node = Node::new();
    // No such interface: the reference leaves the VRF it created.
    let (pod, prev) = veth_pod("1.0.0");
    let c = vrf_conf("1.0.0", "blue", 0, &prev);
    let (code, msg) = call(&node, &bin("vrf"), "ADD", &pod.path(), "nope0", &c).err();
    assert_eq!(
        (code, msg.as_str()),
        (7, "cmdAdd failed: could not get link by name nope0")
    );
    assert_eq!(link_info(&pod.ns, "blue").0, None, "VRF removed");
    if let Some(v191) = reference_v191_bin("vrf") {
        let (_, msg) = call(&node, &v191, "ADD", &pod.path(), "nope0", &c).err();
        assert_eq!(msg, "cmdAdd failed: could not get link by name nope0");
        assert_eq!(
            link_info(&pod.ns, "blue").0.as_deref(),
            Some("vrf"),
            "v1.9.1 leaks it"
        );
        ip(&pod.ns, "link del blue");
    }

    // Enslaved elsewhere already.
    ip(&pod.ns, "link add br0 type bridge");
    ip(&pod.ns, "link set a1 master br0");
    let (code, msg) = call(&node, &bin("vrf"), "ADD", &pod.path(), "a1", &c).err();
    assert_eq!(
        (code, msg.as_str()),
        (
            7,
            "cmdAdd failed: interface a1 has already a master set: br0"
        )
    );
    assert_eq!(link_info(&pod.ns, "blue").0, None, "VRF removed");
    assert_eq!(link_info(&pod.ns, "a1").1.as_deref(), Some("br0"));

    // Failing after the enslaving: an IPv6 address that cannot finish
    // DAD (no carrier) never gets its local route back in the VRF. The
    // interface comes out again with its address and routes.
    let (pod, prev) = veth_pod("1.0.0");
    ip(&pod.ns, "link set a1 down");
    ip(&pod.ns, "addr add fd05::5/64 dev a0");
    ip(&pod.ns, "route add 10.6.0.0/16 via 10.5.0.1 dev a0");
    let main_before = table_routes(&pod.ns, Some(254));
    let addrs_before = global_addrs(&pod.ns, "a0");
    let c = vrf_conf("1.0.0", "blue", 0, &prev);
    let (code, msg) = call(&node, &bin("vrf"), "ADD", &pod.path(), "a0", &c).err();
    assert_eq!(code, 103, "{msg}");
    assert!(
        msg.starts_with("cmdAdd failed: failed getting local/host addresses for a0 in table 1 with dst fd05::5/64"),
        "{msg}"
    );
    assert_eq!(link_info(&pod.ns, "blue").0, None, "VRF removed");
    assert_eq!(link_info(&pod.ns, "a0").1, None, "a0 out of it");
    assert_eq!(global_addrs(&pod.ns, "a0"), addrs_before);
    let main_after = table_routes(&pod.ns, Some(254));
    assert!(
        main_after
            .iter()
            .any(|r| r.starts_with("table 254 10.6.0.0/16 via 10.5.0.1 dev a0")),
        "{main_after:#?} (before {main_before:#?})"
    );
}

#[test]
fn every_version_del_without_netns_gc_and_status() {
    let node = Node::new();
    for v in ["0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
        let (pod, prev) = veth_pod(v);
        let c = vrf_conf(v, "blue", 0, &prev);
        let out = call(&node, &bin("vrf"), "ADD", &pod.path(), "a0", &c).ok();
        // The reference's DEL of our ADD, and its ADD's result: v1.9.1's
        // where at hand, else Debian's 1.1.1 (which stops at 1.0.0).
        let reference = match reference_v191_bin("vrf") {
            Some(p) => p,
            None if v == "1.1.0" => bin("vrf"),
            None => reference_bin("vrf"),
        };
        let del = call(&node, &reference, "DEL", &pod.path(), "a0", &c);
        assert_eq!(del.code, 0, "{v}: {}", del.stdout);
        assert_eq!(link_info(&pod.ns, "blue").0, None, "{v}");
        let again = call(&node, &reference, "ADD", &pod.path(), "a0", &c).ok();
        assert_eq!(
            normalized_result(&out, v),
            normalized_result(&again, v),
            "{v}: the reference's result"
        );
        assert_eq!(out["cniVersion"], json!(v));
        if v != "0.3.1" {
            call(&node, &bin("vrf"), "CHECK", &pod.path(), "a0", &c).ok();
        }
        call(&node, &bin("vrf"), "DEL", &pod.path(), "a0", &c).ok();
        assert_eq!(link_info(&pod.ns, "blue").0, None, "{v}");
        // The VRF gone already, without prevResult.
        call(
            &node,
            &bin("vrf"),
            "DEL",
            &pod.path(),
            "a0",
            &vrf_conf(v, "blue", 0, &Value::Null),
        )
        .ok();
    }
    // Versions before 0.3.1 fail as the reference's.
    for v in ["0.2.0", "0.3.0"] {
        let (pod, prev) = veth_pod(v);
        let c = vrf_conf(v, "blue", 0, &prev);
        for imp in [bin("vrf"), reference_bin("vrf")] {
            let (code, msg) = call(&node, &imp, "ADD", &pod.path(), "a0", &c).err();
            assert_eq!(
                (code, msg.as_str()),
                (1, "incompatible CNI versions"),
                "{v}"
            );
        }
    }
    // Without prevResult ADD and CHECK fail as the reference's (code 7 here).
    let (pod, _) = veth_pod("1.0.0");
    let bare = vrf_conf("1.0.0", "blue", 0, &Value::Null);
    for cmd in ["ADD", "CHECK"] {
        let (code, msg) = call(&node, &bin("vrf"), cmd, &pod.path(), "a0", &bare).err();
        assert_eq!(
            (code, msg.as_str()),
            (7, "missing prevResult from earlier plugin")
        );
    }
    let (code, msg) = call(
        &node,
        &bin("vrf"),
        "ADD",
        &pod.path(),
        "a0",
        &json!({"cniVersion": "1.0.0", "name": "n", "type": "vrf"}),
    )
    .err();
    assert_eq!(
        (code, msg.as_str()),
        (7, "configuration is expected to have a valid vrf name")
    );

    // DEL with the netns gone, or not given.
    let gone = PersistentNs::new();
    let path = gone.path.display().to_string();
    ip(
        &NetNs::open(&gone.path).unwrap(),
        "link add a0 type veth peer name a1",
    );
    let prev = json!({"cniVersion": "1.0.0", "interfaces": [{"name": "a0", "sandbox": path}],
        "ips": [{"address": "10.5.0.5/24", "interface": 0}]});
    let c = vrf_conf("1.0.0", "blue", 0, &prev);
    call(&node, &bin("vrf"), "ADD", &path, "a0", &c).ok();
    gone.delete();
    call(&node, &bin("vrf"), "DEL", &path, "a0", &c).ok();
    call(&node, &bin("vrf"), "DEL", "", "a0", &c).ok();

    // GC and STATUS: nothing outside the netns to collect or wait for, from 1.1.0.
    let c = vrf_conf("1.1.0", "blue", 0, &Value::Null);
    node.gc(&bin("vrf"), &c, json!([])).ok();
    node.status(&bin("vrf"), &c).ok();
    let old = vrf_conf("1.0.0", "blue", 0, &Value::Null);
    assert_eq!(node.gc(&bin("vrf"), &old, json!([])).err().0, 1);
    assert_eq!(node.status(&bin("vrf"), &old).err().0, 1);
}

#[test]
fn same_result_and_kernel_state_as_the_references() {
    let mut seen = Vec::new();
    for (who, vrf) in implementations() {
        let node = Node::new();
        let pod = TestNs::new();
        let br = bridge_conf(&node, "0.4.0");
        let r0 = call(&node, &bin("bridge"), "ADD", &pod.path(), "eth0", &br).ok();
        rcni_netlink::sysctl::set(&pod.ns, "net/ipv6/conf/eth0/keep_addr_on_down", "0").unwrap();
        let c = vrf_conf("0.4.0", "blue", 0, &r0);
        let r = call(&node, &vrf, "ADD", &pod.path(), "eth0", &c).ok();
        let state = (
            link_info(&pod.ns, "blue"),
            link_info(&pod.ns, "eth0").1,
            global_addrs(&pod.ns, "eth0"),
            // Every table: what moved where.
            table_routes(&pod.ns, None),
        );
        seen.push((who, normalized_result(&r, "0.4.0"), state));
        call(&node, &vrf, "CHECK", &pod.path(), "eth0", &c).ok();
        call(&node, &vrf, "DEL", &pod.path(), "eth0", &c).ok();
        assert_eq!(link_info(&pod.ns, "blue").0, None, "{who}");
        assert_eq!(link_info(&pod.ns, "eth0").1, None, "{who}");
        call(
            &node,
            &bin("bridge"),
            "DEL",
            &pod.path(),
            "eth0",
            &Node::with_prev(&br, &r0),
        )
        .ok();
    }
    // After ptp: its route to the gateway is link-scoped and static, so
    // v1.9.1 leaves it behind and then fails re-adding the routes via that
    // gateway; 1.1.1 moves no route (the pod keeps none).
    for (who, vrf) in implementations() {
        let node = Node::new();
        let pod = TestNs::new();
        let pt = ptp_conf(&node, "1.0.0");
        let r1 = call(&node, &bin("ptp"), "ADD", &pod.path(), "net1", &pt).ok();
        let c = vrf_conf("1.0.0", "blue", 0, &r1);
        let out = call(&node, &vrf, "ADD", &pod.path(), "net1", &c);
        let t = table_routes(&pod.ns, Some(1));
        let gw_route = t
            .iter()
            .any(|r| r.starts_with("table 1 10.99.0.1/32 dev net1 scope 253"));
        let ipam_route = t
            .iter()
            .any(|r| r.starts_with("table 1 10.124.0.0/16 via 10.99.0.1 dev net1"));
        match who {
            "rcni" => {
                out.ok();
                assert!(gw_route && ipam_route, "{t:#?}");
            }
            "v1.9.1" => {
                let (_, msg) = out.err();
                assert!(msg.contains("could not add route"), "{msg}");
            }
            _ => {
                out.ok();
                assert!(!gw_route && !ipam_route, "{who}: {t:#?}");
            }
        }
        call(&node, &vrf, "DEL", &pod.path(), "net1", &c).ok();
        call(
            &node,
            &bin("ptp"),
            "DEL",
            &pod.path(),
            "net1",
            &Node::with_prev(&pt, &r1),
        )
        .ok();
    }

    let (_, ours_r, ours) = &seen[0];
    for (who, r, state) in &seen[1..] {
        assert_eq!(ours_r, r, "{who}: result");
        if *who == "1.1.1" {
            // 1.1.1 moved no route: the enslaving dropped the default and
            // IPAM routes (the kernel's connected ones came back in the
            // VRF's table).
            let kept: Vec<&String> = ours
                .3
                .iter()
                .filter(|l| l.contains(" scope 253 ") || l.contains("fd88::/64"))
                .collect();
            let theirs: Vec<&String> = state.3.iter().collect();
            assert_eq!(kept, theirs, "{who}: routes");
            assert_eq!(
                (&ours.0, &ours.1, &ours.2),
                (&state.0, &state.1, &state.2),
                "{who}"
            );
        } else {
            assert_eq!(ours, state, "{who}: kernel state");
        }
    }
}
