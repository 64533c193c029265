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
