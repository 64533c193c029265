//! sbr on a pod on two bridge networks: replies from the second network's
//! address leave by its interface (the node drops them on the wrong one,
//! strict reverse-path filtering), the reference's rules and tables, DEL
//! without netns or interface, CHECK, and ADD's rollback.

use rcni_integration::{Node, ip, nl};
use rcni_netlink::Family;
use rcni_netns::NetNs;
use rcni_testkit::{Call, Output, TestNs, bin, ping, reference_bin};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;

/// A node with two bridge networks and an outside namespace (`ext`,
/// 192.168.77.2) routed through the node, which filters by reverse path.
struct Lab {
    node: Node,
    ext: TestNs,
}

impl Lab {
    fn new() -> Lab {
        let node = Node::new();
        let ext = TestNs::new();
        ip(&node.ns.ns, "link add up0 type veth peer name eth0");
        ip(&node.ns.ns, &format!("link set eth0 netns {}", ext.path()));
        ip(&node.ns.ns, "addr add 192.168.77.1/24 dev up0");
        ip(&node.ns.ns, "link set up0 up");
        ip(&ext.ns, "addr add 192.168.77.2/24 dev eth0");
        ip(&ext.ns, "link set eth0 up");
        ip(&ext.ns, "route add default via 192.168.77.1");
        rcni_netlink::sysctl::set(&node.ns.ns, "net/ipv4/conf/all/rp_filter", "1").unwrap();
        Lab { node, ext }
    }

    /// Network `n` (0: eth0, default route; 1: net1, dual-stack, no
    /// default route) on bridge `cni<n>`.
    fn net(&self, n: u8) -> Value {
        let mut ranges = vec![json!([{"subnet": format!("10.7{n}.0.0/24")}])];
        if n == 1 {
            ranges.push(json!([{"subnet": "fd71::/64"}]));
        }
        json!({"cniVersion": "1.0.0", "name": format!("net{n}"), "type": "bridge",
            "bridge": format!("cni{n}"), "isGateway": true, "isDefaultGateway": n == 0,
            "ipam": {"type": "host-local", "dataDir": self.node.data.path(), "ranges": ranges}})
    }

    fn call(&self, plugin: &Path, cmd: &str, pod: &str, ifname: &str, conf: &Value) -> Output {
        Call::new(plugin, cmd)
            .env("CNI_CONTAINERID", "sbr-pod")
            .env("CNI_IFNAME", ifname)
            .netns(pod)
            .stdin(conf)
            .run_in(&self.node.ns.ns)
    }

    /// The pod on both networks; returns the two bridge results.
    fn pod(&self, pod: &TestNs) -> (Value, Value) {
        let r0 = self
            .call(&bin("bridge"), "ADD", &pod.path(), "eth0", &self.net(0))
            .ok();
        let r1 = self
            .call(&bin("bridge"), "ADD", &pod.path(), "net1", &self.net(1))
            .ok();
        (r0, r1)
    }
}

/// The sbr config chained after network 1's bridge.
fn sbr_conf(prev: &Value) -> Value {
    json!({"cniVersion": "1.0.0", "name": "net1", "type": "sbr", "prevResult": prev})
}

fn addr(r: &Value, v4: bool) -> String {
    rcni_integration::addr_of(r, v4)
}

/// `prio: from SRC lookup TABLE` of every rule, both families.
fn rules(ns: &NetNs) -> Vec<String> {
    nl(ns, async |n| n.rules(Family::All).await.unwrap())
        .iter()
        .map(|r| r.to_string())
        .collect()
}

/// Every route of every table but `local`, as sorted lines naming the
/// interface, with protocol, scope, source and metric.
fn tables(ns: &NetNs) -> Vec<String> {
    nl(ns, async |n| {
        let names: BTreeMap<u32, String> = n
            .links()
            .await
            .unwrap()
            .into_iter()
            .map(|l| (l.index, l.name))
            .collect();
        let mut v: Vec<String> = n
            .routes_in_table(Family::All, None)
            .await
            .unwrap()
            .iter()
            .filter(|r| r.table != 255)
            .map(|r| {
                format!(
                    "table {} {} via {:?} dev {:?} src {:?} scope {} proto {:?} metric {:?}",
                    r.table,
                    r.dst,
                    r.gateway,
                    r.oif.and_then(|i| names.get(&i)),
                    r.src,
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

#[test]
fn replies_leave_by_the_interface_of_their_source() {
    let lab = Lab::new();
    let pod = TestNs::new();
    let (r0, r1) = lab.pod(&pod);
    let (a0, a1) = (addr(&r0, true), addr(&r1, true));
    // Without sbr, the reply from net1's address takes the default route
    // out of eth0, and the node drops it (its route to that source is cni1).
    assert!(ping(&lab.ext.ns, &a0), "eth0's address");
    assert!(!ping(&lab.ext.ns, &a1), "asymmetric reply dropped");

    let c = sbr_conf(&r1);
    let out = lab.call(&bin("sbr"), "ADD", &pod.path(), "net1", &c).ok();
    assert_eq!(out, r1, "the previous result passed on");
    assert!(ping(&lab.ext.ns, &a1), "net1's address answers by net1");
    assert!(ping(&lab.ext.ns, &a0), "eth0's address still by eth0");
    let a16 = addr(&r1, false);
    let rl = rules(&pod.ns);
    assert!(
        rl.contains(&format!("32765: from {a1}/32 lookup 100")),
        "{rl:?}"
    );
    assert!(
        rl.contains(&format!("32765: from {a16}/128 lookup 101")),
        "{rl:?}"
    );
    let t = tables(&pod.ns);
    assert!(
        t.iter()
            .any(|l| l.starts_with("table 100 0.0.0.0/0 via Some(10.71.0.1) dev Some(\"net1\")")),
        "{t:?}"
    );
    assert!(
        !t.iter()
            .any(|l| l.starts_with("table 254") && l.contains("\"net1\"")),
        "net1's routes left the main table: {t:?}"
    );
    let with = sbr_conf(&r1);
    lab.call(&bin("sbr"), "CHECK", &pod.path(), "net1", &with)
        .ok();
    ip(&pod.ns, &format!("rule del from {a1} lookup 100"));
    let (code, msg) = lab
        .call(&bin("sbr"), "CHECK", &pod.path(), "net1", &with)
        .err();
    assert_eq!(code, 106, "{msg}");
    ip(&pod.ns, &format!("rule add from {a1} lookup 100"));

    // DEL: the rules and the routes left in the tables go; twice is fine.
    lab.call(&bin("sbr"), "DEL", &pod.path(), "net1", &with)
        .ok();
    lab.call(&bin("sbr"), "DEL", &pod.path(), "net1", &with)
        .ok();
    assert!(
        !rules(&pod.ns).iter().any(|r| r.contains("lookup 10")),
        "{:?}",
        rules(&pod.ns)
    );
    let t = tables(&pod.ns);
    assert!(!t.iter().any(|l| l.starts_with("table 10")), "{t:?}");
    // net1 anew, sbr again: table 100 is free again.
    lab.call(&bin("bridge"), "DEL", &pod.path(), "net1", &lab.net(1))
        .ok();
    let r1 = lab
        .call(&bin("bridge"), "ADD", &pod.path(), "net1", &lab.net(1))
        .ok();
    let with = sbr_conf(&r1);
    let a1 = addr(&r1, true);
    lab.call(&bin("sbr"), "ADD", &pod.path(), "net1", &with)
        .ok();
    assert!(rules(&pod.ns).contains(&format!("32765: from {a1}/32 lookup 100")));
    // The interface gone: the rules of prevResult's addresses still go.
    ip(&pod.ns, "link del net1");
    lab.call(&bin("sbr"), "DEL", &pod.path(), "net1", &with)
        .ok();
    assert!(!rules(&pod.ns).iter().any(|r| r.contains("lookup 10")));
    // Without a netns: nothing to do, success (the reference fails).
    lab.call(&bin("sbr"), "DEL", "", "net1", &with).ok();
    lab.call(
        &bin("sbr"),
        "DEL",
        "/proc/self/nonexistent/ns",
        "net1",
        &with,
    )
    .ok();
    // The reference locks the path it is given, creating the file: a
    // directory of the test's own.
    let dir = tempfile::tempdir().unwrap();
    let gone = dir.path().join("gone").display().to_string();
    let (code, _) = lab
        .call(&reference_bin("sbr"), "DEL", &gone, "net1", &with)
        .err();
    assert!(code > 0);
    lab.call(&bin("bridge"), "DEL", &pod.path(), "eth0", &lab.net(0))
        .ok();
}

#[test]
fn rules_and_tables_match_the_reference() {
    let mut seen = Vec::new();
    for plugin in [bin("sbr"), reference_bin("sbr")] {
        let lab = Lab::new();
        let pod = TestNs::new();
        let (_, r1) = lab.pod(&pod);
        let c = sbr_conf(&r1);
        let out = lab.call(&plugin, "ADD", &pod.path(), "net1", &c).ok();
        assert!(ping(&lab.ext.ns, &addr(&r1, true)), "{plugin:?}");
        let after_add = (
            rcni_testkit::normalized_result(&out, "1.0.0"),
            rules(&pod.ns),
            tables(&pod.ns),
        );
        lab.call(&plugin, "DEL", &pod.path(), "net1", &c).ok();
        seen.push((after_add, rules(&pod.ns)));
    }
    assert_eq!(seen[0].0.0, seen[1].0.0, "result");
    assert_eq!(seen[0].0.1, seen[1].0.1, "rules");
    assert_eq!(seen[0].0.2, seen[1].0.2, "tables");
    assert_eq!(seen[0].1, seen[1].1, "rules after DEL");
}

#[test]
fn errors_and_rollback() {
    let lab = Lab::new();
    let pod = TestNs::new();
    let (_, r1) = lab.pod(&pod);
    let before = (rules(&pod.ns), tables(&pod.ns));
    let base = json!({"cniVersion": "1.0.0", "name": "net1", "type": "sbr"});
    // Not chained, and a prevResult without addresses: code 7.
    let (code, msg) = lab
        .call(&bin("sbr"), "ADD", &pod.path(), "net1", &base)
        .err();
    assert_eq!(code, 7, "{msg}");
    assert!(msg.contains("chained"), "{msg}");
    let empty = json!({"cniVersion": "1.0.0", "interfaces": [{"name": "net1"}]});
    let (code, _) = lab
        .call(&bin("sbr"), "ADD", &pod.path(), "net1", &sbr_conf(&empty))
        .err();
    assert_eq!(code, 7);
    let (code, _) = lab
        .call(
            &bin("sbr"),
            "ADD",
            &pod.path(),
            "net1",
            &rcni_integration::merged(sbr_conf(&r1), json!({"table": -1})),
        )
        .err();
    assert_eq!(code, 2);
    // A gateway the interface cannot reach: the default route fails after
    // the rule was made, and everything is undone.
    let mut bad = r1.clone();
    bad["ips"][0]["gateway"] = json!("172.31.9.1");
    let (code, msg) = lab
        .call(&bin("sbr"), "ADD", &pod.path(), "net1", &sbr_conf(&bad))
        .err();
    assert_eq!(code, 103, "{msg}");
    assert_eq!((rules(&pod.ns), tables(&pod.ns)), before, "rolled back");

    // `table`: rules only, to that table.
    let c = rcni_integration::merged(sbr_conf(&r1), json!({"table": 500}));
    lab.call(&bin("sbr"), "ADD", &pod.path(), "net1", &c).ok();
    let a1 = addr(&r1, true);
    assert!(rules(&pod.ns).contains(&format!("32765: from {a1}/32 lookup 500")));
    assert_eq!(tables(&pod.ns), before.1, "routes untouched");
    lab.call(&bin("sbr"), "CHECK", &pod.path(), "net1", &c).ok();
    lab.call(&bin("sbr"), "DEL", &pod.path(), "net1", &c).ok();
    assert_eq!(rules(&pod.ns), before.0);
}

/// Routes of table `t` through `dev` (as `tables` prints them).
fn routes_in(ns: &NetNs, t: u32, dev: &str) -> Vec<String> {
    let want = format!("table {t} ");
    let dev = format!("dev Some({dev:?})");
    tables(ns)
        .into_iter()
        .filter(|l| l.starts_with(&want) && l.contains(&dev))
        .collect()
}

/// Upstream v1.10.0's `gateways`: its checks and texts (before anything
/// changes), the static gateway over prevResult's per family, a default
/// route even where prevResult has no gateway, and the key ignored with
/// `table`.
#[test]
fn static_gateways_override_and_fill_in() {
    let lab = Lab::new();
    let pod = TestNs::new();
    let (_, r1) = lab.pod(&pod);
    let before = (rules(&pod.ns), tables(&pod.ns));
    let with = |prev: &Value, gws: Value| {
        rcni_integration::merged(sbr_conf(prev), json!({"gateways": gws}))
    };
    for (gws, text) in [
        (
            json!(["10.71.0.254", "fd71::fe", "10.71.0.253"]),
            "gateways list cannot contain more than 2 entries (one IPv4, one IPv6)",
        ),
        (
            json!(["router"]),
            "invalid static gateway IP address: router",
        ),
        (
            json!(["10.71.0.254", "10.71.0.253"]),
            "gateways list contains multiple IPv4 addresses: 10.71.0.254 and 10.71.0.253",
        ),
        (
            json!(["fd71::fe", "fd71::fd"]),
            "gateways list contains multiple IPv6 addresses: fd71::fe and fd71::fd",
        ),
    ] {
        let (code, msg) = lab
            .call(&bin("sbr"), "ADD", &pod.path(), "net1", &with(&r1, gws))
            .err();
        assert_eq!((code, msg.as_str()), (7, text));
        assert_eq!((rules(&pod.ns), tables(&pod.ns)), before, "{text}");
    }
    // A static gateway the interface cannot reach: undone as any failure.
    let (code, msg) = lab
        .call(
            &bin("sbr"),
            "ADD",
            &pod.path(),
            "net1",
            &with(&r1, json!(["172.31.9.1"])),
        )
        .err();
    assert_eq!(code, 103, "{msg}");
    assert_eq!((rules(&pod.ns), tables(&pod.ns)), before, "rolled back");
    // With `table` the key is not even read.
    let t = rcni_integration::merged(with(&r1, json!(["router"])), json!({"table": 500}));
    lab.call(&bin("sbr"), "ADD", &pod.path(), "net1", &t).ok();
    assert_eq!(tables(&pod.ns), before.1, "routes untouched");
    lab.call(&bin("sbr"), "DEL", &pod.path(), "net1", &t).ok();
    assert_eq!(rules(&pod.ns), before.0);

    // The node answers on a second address of net1's bridge: the static
    // IPv4 gateway. prevResult's IPv6 address has no gateway at all.
    ip(&lab.node.ns.ns, "addr add 10.71.0.254/24 dev cni1");
    let mut prev = r1.clone();
    for ipc in prev["ips"].as_array_mut().unwrap() {
        if ipc["address"].as_str().unwrap().contains(':') {
            ipc.as_object_mut().unwrap().remove("gateway");
        }
    }
    let c = with(&prev, json!(["fd71::fe", "10.71.0.254"]));
    let out = lab.call(&bin("sbr"), "ADD", &pod.path(), "net1", &c).ok();
    assert_eq!(out, prev, "the previous result passed on");
    let t100 = routes_in(&pod.ns, 100, "net1");
    assert!(
        t100.iter()
            .any(|l| l.starts_with("table 100 0.0.0.0/0 via Some(10.71.0.254) ")),
        "{t100:?}"
    );
    assert!(
        !t100.iter().any(|l| l.contains("Some(10.71.0.1)")),
        "{t100:?}"
    );
    let t101 = routes_in(&pod.ns, 101, "net1");
    assert!(
        t101.iter()
            .any(|l| l.starts_with("table 101 ::/0 via Some(fd71::fe) ")),
        "{t101:?}"
    );
    // Replies from net1's address go by the static gateway.
    let a1 = addr(&r1, true);
    assert!(ping(&lab.ext.ns, &a1), "net1's address answers via .254");
    let neigh = nl(&pod.ns, async |n| n.neighbours(None).await.unwrap());
    assert!(
        neigh
            .iter()
            .any(|e| e.ip == "10.71.0.254".parse::<std::net::IpAddr>().unwrap()),
        "{neigh:?}"
    );
    lab.call(&bin("sbr"), "DEL", &pod.path(), "net1", &c).ok();
    lab.call(&bin("sbr"), "DEL", &pod.path(), "net1", &c).ok();
    assert_eq!(rules(&pod.ns), before.0);
    assert!(!tables(&pod.ns).iter().any(|l| l.starts_with("table 10")));
}

/// `ip route get DST` in `ns` (no source given): the route the kernel
/// picks by destination alone.
fn route_get(ns: &NetNs, dst: &str) -> String {
    let out = rcni_testkit::command_in(ns, "ip")
        .args(["route", "get", dst])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Upstream v1.10.0's `addSourceHints`: the subnet routes stay in the main
/// table with the address as source (link scope), the interface's other
/// main routes leave it, and traffic that chooses its source by
/// destination takes net1 from net1's address; ignored with `table`.
#[test]
fn source_hints_keep_the_subnets_in_the_main_table() {
    let lab = Lab::new();
    let pod = TestNs::new();
    let (_, r1) = lab.pod(&pod);
    let (a1, a16) = (addr(&r1, true), addr(&r1, false));
    let before = tables(&pod.ns);
    let hints = rcni_integration::merged(sbr_conf(&r1), json!({"addSourceHints": true}));
    let t = rcni_integration::merged(hints.clone(), json!({"table": 500}));
    lab.call(&bin("sbr"), "ADD", &pod.path(), "net1", &t).ok();
    assert_eq!(tables(&pod.ns), before, "ignored with table");
    lab.call(&bin("sbr"), "DEL", &pod.path(), "net1", &t).ok();

    let out = lab
        .call(&bin("sbr"), "ADD", &pod.path(), "net1", &hints)
        .ok();
    assert_eq!(out, r1);
    let main = routes_in(&pod.ns, 254, "net1");
    assert_eq!(main.len(), 2, "{main:?}");
    assert!(
        main[0].starts_with(&format!(
            "table 254 10.71.0.0/24 via None dev Some(\"net1\") src Some({a1}) scope 253 "
        )),
        "{main:?}"
    );
    assert!(
        main[1].starts_with(&format!(
            "table 254 fd71::/64 via None dev Some(\"net1\") src Some({a16}) "
        )),
        "{main:?}"
    );
    // The per-address tables as without hints.
    let rl = rules(&pod.ns);
    assert!(
        rl.contains(&format!("32765: from {a1}/32 lookup 100")),
        "{rl:?}"
    );
    assert!(
        routes_in(&pod.ns, 100, "net1")
            .iter()
            .any(|l| l.starts_with("table 100 0.0.0.0/0 via Some(10.71.0.1) ")),
        "{:?}",
        tables(&pod.ns)
    );
    assert!(ping(&lab.ext.ns, &a1), "net1's address answers by net1");
    let got = route_get(&pod.ns, "10.71.0.9");
    assert!(
        got.contains("dev net1") && got.contains(&format!("src {a1}")),
        "{got}"
    );
    let got = route_get(&pod.ns, "fd71::9");
    assert!(
        got.contains("dev net1") && got.contains(&format!("src {a16}")),
        "{got}"
    );
    // DEL as without hints: the rules and the tables go, the hint routes
    // stay with the interface (as upstream's DEL).
    lab.call(&bin("sbr"), "DEL", &pod.path(), "net1", &hints)
        .ok();
    lab.call(&bin("sbr"), "DEL", &pod.path(), "net1", &hints)
        .ok();
    assert!(!rules(&pod.ns).iter().any(|r| r.contains("lookup 10")));
    assert!(!tables(&pod.ns).iter().any(|l| l.starts_with("table 10")));
    assert_eq!(routes_in(&pod.ns, 254, "net1").len(), 2);
}
