//! Helpers shared by the privileged integration tests in tests/: the labs
//! they run in ([`lab`]: a node namespace with pods on one bridge,
//! [`Node`], and the labs of tests that need more), and kernel state read
//! back (addresses, routes, links, masquerade rules). A library so that
//! each test binary takes what it uses and nothing counts as dead code.

use rcni_netlink::{Family, Netlink, Route};
use rcni_netns::NetNs;
use rcni_testkit::{Call, REFERENCE_DIR, TestNs, bin, bin_dir, reference_bin};
use serde_json::{Value, json};
use std::path::PathBuf;

pub use rcni_testkit::ip;

pub mod lab;

pub use lab::Node;

/// `base` with the keys of `extra` set: a test's variation of a config.
pub fn merged(mut base: Value, extra: Value) -> Value {
    for (k, v) in extra.as_object().expect("extra keys") {
        base[k] = v.clone();
    }
    base
}

/// Our plugin `name` with our plugins as CNI_PATH, then the reference's with
/// the reference's: what a side-by-side test runs.
pub fn ours_and_reference(name: &str) -> [(PathBuf, String); 2] {
    [
        (bin(name), bin_dir().display().to_string()),
        (reference_bin(name), REFERENCE_DIR.to_string()),
    ]
}

/// Ours with our plugins as CNI_PATH, then upstream's v1.9.1 and its
/// newest release, v1.10.0, each with its own, where they are at hand
/// (`reference_v191_bin` and `reference_v110_bin` say why one skips).
pub fn ours_and_upstream(name: &str) -> Vec<(PathBuf, String)> {
    let mut v = vec![(bin(name), bin_dir().display().to_string())];
    let releases = [
        rcni_testkit::reference_v191_bin(name),
        rcni_testkit::reference_v110_bin(name),
    ];
    for p in releases.into_iter().flatten() {
        let dir = p.parent().unwrap().display().to_string();
        v.push((p, dir));
    }
    v
}

/// ipMasq over two attachments' lives, with each backend: ADD puts rules
/// for the addresses of `pod_ips` (pod a's, pod b's) in place and CHECK
/// finds them; DEL without CNI_NETNS still removes a's (the reference leaks
/// them); GC with an empty valid set removes b's and reaches IPAM, after
/// which CHECK of b fails.
pub fn masq_follows_attachments(
    plugin: &str,
    conf: impl Fn(&Node, Value) -> Value,
    pod_ips: [&[&str]; 2],
) {
    let plugin = bin(plugin);
    for backend in ["iptables", "nftables"] {
        let node = Node::new();
        let c = conf(&node, json!({"ipMasq": true, "ipMasqBackend": backend}));
        let (a, b) = (TestNs::new(), TestNs::new());
        let ra = node.call(&plugin, "ADD", &a.path(), "masq-a", &c).ok();
        let rb = node.call(&plugin, "ADD", &b.path(), "masq-b", &c).ok();
        let rules = masq_rules(&node.ns.ns);
        for ip in pod_ips.concat() {
            assert!(rules.contains(ip), "{backend}: {ip} in {rules}");
        }
        let with_a = Node::with_prev(&c, &ra);
        node.call(&plugin, "CHECK", &a.path(), "masq-a", &with_a)
            .ok();
        node.call(&plugin, "DEL", "", "masq-a", &with_a).ok();
        let rules = masq_rules(&node.ns.ns);
        for ip in pod_ips[0] {
            assert!(
                !rules.contains(&format!("{ip}/")) && !rules.contains(&format!("{ip} ")),
                "{backend}: {ip} in {rules}"
            );
        }
        for ip in pod_ips[1] {
            assert!(rules.contains(ip), "{backend}: the other pod keeps {ip}");
        }
        node.gc(&plugin, &c, json!([])).ok();
        let rules = masq_rules(&node.ns.ns);
        for ip in pod_ips[1] {
            assert!(!rules.contains(ip), "{backend}: {ip} in {rules}");
        }
        assert!(node.reservations().is_empty(), "GC reached IPAM");
        let with_b = Node::with_prev(&c, &rb);
        let (code, msg) = node
            .call(&plugin, "CHECK", &b.path(), "masq-b", &with_b)
            .err();
        assert!(code == 106 || code == 107, "{backend}: {code} {msg}");
        node.call(&plugin, "DEL", &b.path(), "masq-b", &with_b).ok();
    }
}

/// Damage done to an attachment (node namespace, pod namespace, ADD's
/// result) that CHECK must notice.
pub type Damage = fn(&NetNs, &NetNs, &Value);

/// The result's first address, removed from the pod's eth0.
pub fn remove_pod_address(_: &NetNs, pod: &NetNs, r: &Value) {
    let a = r["ips"][0]["address"].as_str().unwrap().parse().unwrap();
    nl(pod, async |n| {
        let l = n.link_by_name("eth0").await.unwrap();
        n.del_address(l.index, a).await.unwrap();
    });
}

pub fn delete_pod_eth0(_: &NetNs, pod: &NetNs, _: &Value) {
    nl(pod, async |n| {
        let l = n.link_by_name("eth0").await.unwrap();
        n.delete_link(l.index).await.unwrap();
    });
}

/// Deletes the first IPv4 route of the main table in `ns` that `which`
/// picks.
pub fn remove_route(ns: &NetNs, which: impl Fn(&Route) -> bool) {
    nl(ns, async |n| {
        let r = n
            .routes(Family::V4)
            .await
            .unwrap()
            .into_iter()
            .find(|r| which(r))
            .unwrap();
        n.del_route(&r).await.unwrap();
    });
}

/// The names of the links in `ns`.
pub fn link_names(ns: &NetNs) -> Vec<String> {
    nl(ns, async |n| n.links().await.unwrap())
        .into_iter()
        .map(|l| l.name)
        .collect()
}

/// The addresses of `dev` in `ns` but link-local IPv6, sorted.
pub fn addrs_of(ns: &NetNs, dev: &str) -> Vec<String> {
    nl(ns, async |n| {
        let l = n.link_by_name(dev).await.unwrap();
        let mut v: Vec<String> = n
            .addresses(Some(l.index))
            .await
            .unwrap()
            .iter()
            .filter(|a| !a.addr.ip().to_string().starts_with("fe80"))
            .map(|a| a.addr.to_string())
            .collect();
        v.sort();
        v
    })
}

/// The main table of `ns` but link-local IPv6, as sorted lines with
/// gateway, preferred source and scope.
pub fn routes_of(ns: &NetNs) -> Vec<String> {
    nl(ns, async |n| {
        let mut v: Vec<String> = n
            .routes(Family::All)
            .await
            .unwrap()
            .iter()
            .filter(|r| !r.dst.ip().to_string().starts_with("fe80"))
            .map(|r| {
                let gw = r.gateway.map(|g| format!(" via {g}")).unwrap_or_default();
                let src = r.src.map(|s| format!(" src {s}")).unwrap_or_default();
                format!("{}{gw}{src} scope {}", r.dst, r.scope)
            })
            .collect();
        v.sort();
        v
    })
}

pub fn nl<T>(ns: &NetNs, f: impl AsyncFnOnce(&Netlink) -> T) -> T {
    let rt = rcni_netlink::runtime().unwrap();
    rt.block_on(async {
        let n = Netlink::connect(ns).await.unwrap();
        f(&n).await
    })
}

/// The result's first IPv4 (`v4`) or IPv6 address, without its prefix.
pub fn addr_of(result: &Value, v4: bool) -> String {
    rcni_testkit::result_ips(result)
        .into_iter()
        .find(|a| a.contains('.') == v4)
        .unwrap()
}

/// `ip -d -j link show dev` inside a namespace, as JSON.
pub fn ip_link_json(ns: &NetNs, dev: &str) -> Value {
    let v = json_out(ns, "ip", &["-d", "-j", "link", "show", "dev", dev]);
    v.unwrap_or(Value::Null)[0].clone()
}

/// What `prog args` printed inside a namespace, if it is JSON.
fn json_out(ns: &NetNs, prog: &str, args: &[&str]) -> Option<Value> {
    let out = rcni_testkit::command_in(ns, prog)
        .args(args)
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).ok()
}

pub fn bridge_vlans(ns: &NetNs, dev: &str) -> Vec<(u64, bool)> {
    let v = json_out(ns, "bridge", &["-j", "vlan", "show", "dev", dev]).unwrap_or(json!([]));
    let mut res = vec![];
    for port in v.as_array().into_iter().flatten() {
        for vl in port["vlans"].as_array().into_iter().flatten() {
            let flags = vl["flags"]
                .as_array()
                .map(|f| f.iter().any(|x| x == "PVID"))
                .unwrap_or(false);
            res.push((vl["vlan"].as_u64().unwrap(), flags));
        }
    }
    res
}

/// (address/prefix, tentative) of the IPv6 global addresses of `dev`.
pub fn ipv6_addrs(ns: &NetNs, dev: &str) -> Vec<(String, bool)> {
    let args = ["-j", "-6", "addr", "show", "dev", dev, "scope", "global"];
    let v = json_out(ns, "ip", &args).unwrap_or(json!([]));
    let mut res = vec![];
    for l in v.as_array().into_iter().flatten() {
        // `ip -j` lists an empty object for an address filtered out.
        for a in l["addr_info"].as_array().into_iter().flatten() {
            if let Some(local) = a["local"].as_str() {
                res.push((
                    format!("{local}/{}", a["prefixlen"]),
                    a["tentative"].as_bool().unwrap_or(false),
                ));
            }
        }
    }
    res
}

/// The masquerade rules in `ns` (iptables for both families, and the whole
/// nftables ruleset), as text.
pub fn masq_rules(ns: &NetNs) -> String {
    let mut text = String::new();
    for (tool, args) in [
        ("iptables-save", &["-t", "nat"][..]),
        ("ip6tables-save", &["-t", "nat"][..]),
        ("nft", &["list", "ruleset"][..]),
    ] {
        let out = rcni_testkit::command_in(ns, tool)
            .args(args)
            .output()
            .unwrap();
        text.push_str(&String::from_utf8_lossy(&out.stdout));
    }
    text.lines()
        .filter(|l| l.contains("masq") || l.contains("MASQ") || l.contains("CNI-"))
        .collect::<Vec<_>>()
        .join("\n")
}

pub use rcni_testkit::Bpffs;

/// `linkInContainer` for a plugin of a link on a lower device (macvlan,
/// ipvlan): with `conf` naming the master `inner0`, a veth that lives only
/// in a fresh pod namespace, ADD puts the pod's `eth0` on it, CHECK passes
/// and DEL removes it. Returns the pod for the caller's own checks.
pub fn lower_in_container(node: &Node, plugin: &str, conf: &Value) -> TestNs {
    let p = TestNs::new();
    ip(&p.ns, "link add inner0 type veth peer name inner1");
    ip(&p.ns, "link set inner0 up");
    let r = node.call(&bin(plugin), "ADD", &p.path(), "lic", conf).ok();
    let inner = nl(&p.ns, async |n| n.link_by_name("inner0").await.unwrap());
    nl(&p.ns, async |n| {
        assert_eq!(
            n.link_by_name("eth0").await.unwrap().link,
            Some(inner.index)
        )
    });
    let with = Node::with_prev(conf, &r);
    node.call(&bin(plugin), "CHECK", &p.path(), "lic", &with)
        .ok();
    node.call(&bin(plugin), "DEL", &p.path(), "lic", &with).ok();
    p
}

/// An IPAM plugin `fake-ipam` in a new directory (put it first in
/// CNI_PATH) whose ADD hands out 10.70.0.5/24 with a route via 10.99.0.1,
/// which no pod can reach (so the main plugin's ADD fails after IPAM), and
/// whose DEL appends `present` or `gone` to the returned log: whether the
/// pod's interface still existed when it ran.
pub fn release_order_ipam() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("del.log");
    let script = dir.path().join("fake-ipam");
    std::fs::write(
        &script,
        format!(
            r#"#!/bin/sh
cat >/dev/null
case "$CNI_COMMAND" in
ADD) echo '{{"cniVersion":"1.0.0","ips":[{{"address":"10.70.0.5/24"}}],"routes":[{{"dst":"10.80.0.0/16","gw":"10.99.0.1"}}]}}' ;;
DEL) if nsenter --net="$CNI_NETNS" ip link show "$CNI_IFNAME" >/dev/null 2>&1; then echo present; else echo gone; fi >>{} ;;
esac
"#,
            log.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    (dir, log)
}

/// Whether this kernel creates netkit links (tried in a throwaway
/// namespace): `linkType: netkit` gives netkit pairs, or veth pairs where
/// not.
pub fn kernel_has_netkit() -> bool {
    let ns = TestNs::new();
    nl(&ns.ns, async |n| {
        n.create_netkit("nk0", "nk1", &ns.ns, None).await.is_ok()
    })
}

/// Whether this kernel has the fq qdisc (tried on a throwaway namespace's
/// loopback), which rcni's bandwidth shapes fast path pods with; without
/// it they are shaped with TBFs, off the fast path.
pub fn kernel_has_fq() -> bool {
    let ns = TestNs::new();
    nl(&ns.ns, async |n| {
        let lo = n.link_by_name("lo").await.unwrap();
        n.add_fq(lo.index, 0x0001_0000).await.is_ok()
    })
}

/// The kind of pod link `eth0` a `linkType: netkit` pod gets on this
/// kernel.
pub fn netkit_or_veth() -> &'static str {
    if kernel_has_netkit() {
        "netkit"
    } else {
        "veth"
    }
}

/// Bits per second the receiver saw in a 5 s iperf3 TCP run from `from`
/// to the server on `to` (`reverse`: the server sends), the first second
/// (the token bucket's burst, TCP's start) left out.
pub fn iperf_rate(from: &NetNs, to_ns: &NetNs, to: &str, port: u16, reverse: bool) -> u64 {
    let _server = rcni_testkit::IperfServer::start(to_ns, Some(to), port);
    let p = port.to_string();
    let mut args = vec!["-c", to, "-p", &p, "-t", "5", "-O", "1", "-J"];
    if reverse {
        args.push("-R");
    }
    let out = rcni_testkit::command_in(from, "iperf3")
        .args(&args)
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("iperf3 ({e}): {}", String::from_utf8_lossy(&out.stdout)));
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or_else(|| panic!("no result: {v}")) as u64
}

/// What a pod with `CAP_NET_ADMIN` could do to bandwidth's departure-time
/// shaping of its egress: deletes the root qdisc and clsact of `eth0` in
/// `from`, each of which must be there. Then its egress to `to` (iperf3's
/// goodput, bit/s, `to_ns` serving on `port`) must still be held to
/// `limit` bit/s by the node side, at most 5 % past it: returned.
pub fn egress_without_own_shaping(
    from: &NetNs,
    to_ns: &NetNs,
    to: &str,
    port: u16,
    limit: u64,
) -> u64 {
    for q in ["root", "clsact"] {
        rcni_testkit::stdout_of(
            rcni_testkit::command_in(from, "tc").args(["qdisc", "del", "dev", "eth0", q]),
        );
    }
    let rate = iperf_rate(from, to_ns, to, port, false);
    eprintln!("unshaped by itself: egress {rate} bit/s of goodput (limit {limit})");
    assert!(
        rate as f64 <= limit as f64 * 1.05,
        "past the egress limit without its own shaping: {rate} bit/s"
    );
    rate
}

/// Bytes `ifname` in `ns` has received (`rx`) or sent so far.
pub fn wire_bytes(ns: &NetNs, ifname: &str, rx: bool) -> u64 {
    let out = rcni_testkit::command_in(ns, "ip")
        .args(["-s", "-j", "link", "show", ifname])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v[0]["stats64"][if rx { "rx" } else { "tx" }]["bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("no counters: {v}"))
}

/// `count` pings at a 10 ms interval from `ns`, all answered.
pub fn pings(ns: &NetNs, dst: &str, count: u32) {
    let count = count.to_string();
    let out = rcni_testkit::command_in(ns, "ping")
        .args(["-c", &count, "-i", "0.01", "-W", "2", "-n", "-q", dst])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ping {dst}: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// The TTL (hop limit) of the reply to one ping from `ns`.
pub fn reply_ttl(ns: &NetNs, dst: &str) -> u32 {
    let out = rcni_testkit::command_in(ns, "ping")
        .args(["-c", "1", "-W", "2", "-n", dst])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .find_map(|w| w.strip_prefix("ttl=").or_else(|| w.strip_prefix("hlim=")))
        .unwrap_or_else(|| panic!("no ttl in {text}"))
        .parse()
        .unwrap()
}

/// `fastpath SUB --json --pin-root PIN_ROOT` run in `ns`: its rows.
pub fn fastpath_json(ns: &NetNs, pin_root: &std::path::Path, sub: &str) -> Vec<Value> {
    let out = rcni_testkit::command_in(ns, rcni_testkit::bin("fastpath"))
        .args([sub, "--json", "--pin-root"])
        .arg(pin_root)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "fastpath {sub}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice::<Value>(&out.stdout)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

/// A plugin of a link on a lower device (vlan, macvlan, ipvlan) with
/// host-local, master `m1` of a [`Node::wired`] node and `extra` keys, its
/// ADD and its DEL killed on entry to each of their lasting system calls
/// in turn (`killpoints`: every moment a runtime could kill them, the IPAM
/// child's included), each followed by the runtime's DEL without a cached
/// result: the node keeps exactly its links, the container holds only lo,
/// no address stays reserved.
pub fn lower_killed_at_every_point(plugin: &str, extra: Value) {
    use rcni_testkit::killpoints::{Ending, at_every_point};
    let node = Node::new().wired();
    let pod = TestNs::new();
    let c = merged(
        json!({"cniVersion": "1.0.0", "name": "podnet", "type": plugin, "master": "m1",
            "ipam": {"type": "host-local", "dataDir": node.data.path(),
                     "ranges": [[{"subnet": "10.60.7.0/24"}]]}}),
        extra,
    );
    let call = |cmd: &str| {
        Call::new(bin(plugin), cmd)
            .env("CNI_PATH", &node.cni_path)
            .env("CNI_CONTAINERID", "lk")
            .netns(&pod.path())
            .stdin(&c)
    };
    let node_links = link_names(&node.ns.ns);
    let settled = |k: u32, ending: &Ending, what: &str| {
        let out = call("DEL").run_in(&node.ns.ns);
        let at = format!("{plugin} {what} killed at {k} ({ending:?})");
        assert_eq!(
            out.code, 0,
            "{at}: DEL failed: {} {}",
            out.stdout, out.stderr
        );
        assert_eq!(
            link_names(&node.ns.ns),
            node_links,
            "{at}: the node's links"
        );
        assert_eq!(link_names(&pod.ns), ["lo"], "{at}: the container's links");
        let left = node.reservations();
        assert!(left.is_empty(), "{at}: reserved {left:?}");
    };
    let add_points = at_every_point(
        || call("ADD").command_in(&node.ns.ns),
        400,
        |k, ending| settled(k, ending, "ADD"),
    );
    let del_points = at_every_point(
        || {
            let out = call("ADD").run_in(&node.ns.ns);
            assert_eq!(out.code, 0, "ADD failed: {} {}", out.stdout, out.stderr);
            call("DEL").command_in(&node.ns.ns)
        },
        400,
        |k, ending| settled(k, ending, "DEL"),
    );
    eprintln!("{plugin}: {add_points} ADD and {del_points} DEL kill points");
    assert!(add_points > 3 && del_points > 3);
}
