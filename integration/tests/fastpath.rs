//! The fastpath plugin chained after bridge and ptp, with real traffic
//! between pods of a throwaway node namespace: ICMP and TCP over IPv4 and
//! IPv6 take the eBPF fast path (the counters rise, the destination host
//! veth's TX counters do not), CHECK, DEL (also mid-flow, while traffic
//! keeps flowing), GC, STATUS, and the clsact fallback. With other chain
//! members: bandwidth (ours before and after fastpath, the reference's
//! before it; tcx and clsact) measured with iperf3, portIsolation,
//! macspoofchk and firewall's isolated policy, each also against a pod that
//! pins its peer's MAC to get past the bridge.
//!
//! Each test pins under a bpffs of its own, mounted (by the plugin, as it
//! does where /sys/fs/bpf is missing) on a fresh temporary directory and
//! unmounted on drop: nothing in /sys/fs/bpf is touched.

use rcni_integration::{Bpffs, Node, addr_of, iperf_rate, nl, pings, reply_ttl, wire_bytes};
use rcni_netns::NetNs;
use rcni_testkit::{Output, TestNs, bin, command_in, normalize_result, ping};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn fp_conf(fs: &Bpffs, prev: &Value, extra: Value) -> Value {
    let mut c = json!({"cniVersion": "1.1.0", "name": "podnet", "type": "fastpath",
                       "pinRoot": fs.root()});
    if !prev.is_null() {
        c["prevResult"] = prev.clone();
    }
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    c
}

fn fp(node: &Node, cmd: &str, pod: &str, cid: &str, conf: &Value) -> Output {
    node.call(&bin("fastpath"), cmd, pod, cid, conf)
}

/// A pod, its container ID and the result of its interface plugin.
type Pod<'a> = (&'a TestNs, &'a str, &'a Value);

/// `fastpath CMD` for `pod`, chained on its result, with `extra` keys.
fn fp_on(node: &Node, fs: &Bpffs, cmd: &str, (pod, cid, prev): Pod, extra: Value) -> Output {
    fp(node, cmd, &pod.path(), cid, &fp_conf(fs, prev, extra))
}

/// `fastpath CMD` for each pod in turn, every call succeeding.
fn fp_each(node: &Node, fs: &Bpffs, cmd: &str, pods: [Pod; 2], extra: &Value) {
    for p in pods {
        fp_on(node, fs, cmd, p, extra.clone()).ok();
    }
}

/// `fastpath ADD` chained on `prev`; asserts prevResult came back unchanged.
fn fp_add(node: &Node, fs: &Bpffs, pod: &TestNs, cid: &str, prev: &Value, extra: Value) {
    let out = fp_on(node, fs, "ADD", (pod, cid, prev), extra).ok();
    assert_eq!(
        normalize_result(&out, "1.1.0"),
        normalize_result(prev, "1.1.0"),
        "fastpath must pass prevResult through"
    );
}

/// `fastpath ADD` for each pod, as [`fp_add`].
fn fp_add_each(node: &Node, fs: &Bpffs, pods: [Pod; 2], extra: &Value) {
    for (pod, cid, prev) in pods {
        fp_add(node, fs, pod, cid, prev, extra.clone());
    }
}

/// Pods A (`ctr-a`) and B (`ctr-b`) added to the node's bridge network:
/// the pods, the bridge config and their results.
fn bridge_pods(node: &Node) -> (TestNs, TestNs, Value, Value, Value) {
    let (a, b) = (TestNs::new(), TestNs::new());
    let bc = node.conf("1.1.0", json!({}));
    let ra = node.add(&a, "ctr-a", &bc);
    let rb = node.add(&b, "ctr-b", &bc);
    (a, b, bc, ra, rb)
}

/// The addresses of the fast path's endpoints.
fn addresses(rows: &[Value]) -> Vec<&str> {
    rows.iter()
        .map(|r| r["address"].as_str().unwrap())
        .collect()
}

/// The row of the endpoint with `address`.
fn row<'a>(rows: &'a [Value], address: &str) -> &'a Value {
    rows.iter().find(|r| r["address"] == address).unwrap()
}

fn ptp_conf(node: &Node) -> Value {
    json!({"cniVersion": "1.1.0", "name": "podnet", "type": "ptp",
           "ipam": {"type": "host-local", "dataDir": node.data.path(),
                    "ranges": [[{"subnet": "10.77.0.0/24"}], [{"subnet": "fd77::/64"}]],
                    "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}})
}

/// The pod's host veth in a bridge (index 1) or ptp (index 0) result.
fn host_veth(result: &Value, idx: usize) -> String {
    result["interfaces"][idx]["name"]
        .as_str()
        .unwrap()
        .to_string()
}

/// What `prog args` did inside `ns`.
fn output_in(ns: &NetNs, prog: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> std::process::Output {
    command_in(ns, prog).args(args).output().unwrap()
}

/// `fastpath SUB --json` run in the node namespace: its rows.
fn fastpath_json(node: &Node, fs: &Bpffs, sub: &str) -> Vec<Value> {
    rcni_integration::fastpath_json(&node.ns.ns, fs.path(), sub)
}

/// `fastpath list --json` run in the node namespace.
fn list(node: &Node, fs: &Bpffs) -> Vec<Value> {
    fastpath_json(node, fs, "list")
}

fn counter(rows: &[Value], addr: &str, key: &str) -> u64 {
    rows.iter()
        .find(|r| r["address"] == addr)
        .map(|r| r[key].as_u64().unwrap())
        .unwrap_or(0)
}

fn redirected(node: &Node, fs: &Bpffs) -> u64 {
    fastpath_json(node, fs, "stats")
        .iter()
        .map(|n| n["verdicts"]["redirected"].as_u64().unwrap())
        .sum()
}

/// The cls_bpf filters on the node's link `veth`'s ingress hook.
fn ingress_filters(node: &Node, veth: &str) -> Vec<rcni_netlink::tc::BpfFilter> {
    nl(&node.ns.ns, async |n| {
        let l = n.link_by_name(veth).await.unwrap();
        n.ingress_bpf_filters(l.index).await.unwrap()
    })
}

/// The programs on the node's link `veth`'s tcx ingress hook.
fn tcx_progs(node: &Node, veth: &str) -> Vec<u32> {
    let veth = veth.to_string();
    node.ns
        .ns
        .run(move || rcni_ebpf::tcx_programs(&veth))
        .unwrap()
        .unwrap()
}

/// TX packets of a node-side link (`ip -s`): what the node sent into the pod.
fn tx_packets(ns: &NetNs, dev: &str) -> u64 {
    let out = output_in(ns, "ip", &["-j", "-s", "link", "show", "dev", dev]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v[0]["stats64"]["tx"]["packets"].as_u64().unwrap()
}

/// A TCP echo server in `ns` on `addr`; returns its address.
fn echo_server(ns: &NetNs, addr: IpAddr) -> SocketAddr {
    rcni_testkit::tcp_server(ns, addr, |mut s| {
        let mut buf = [0u8; 65536];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if s.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            }
        }
    })
}

fn connect(ns: &NetNs, to: SocketAddr) -> TcpStream {
    let s = ns
        .run(move || TcpStream::connect_timeout(&to, Duration::from_secs(3)))
        .unwrap()
        .unwrap_or_else(|e| panic!("connect {to}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// One request/response of `len` bytes.
fn roundtrip(s: &mut TcpStream, len: usize) -> std::io::Result<()> {
    let msg = vec![0x5a; len];
    s.write_all(&msg)?;
    let mut back = vec![0; len];
    s.read_exact(&mut back)?;
    assert_eq!(back, msg);
    Ok(())
}

/// 200 small round trips and one 1 MiB echo over TCP from `from` to `to`.
fn tcp_traffic(from: &NetNs, to_ns: &NetNs, to: IpAddr) {
    let srv = echo_server(to_ns, to);
    let mut s = connect(from, srv);
    for _ in 0..200 {
        roundtrip(&mut s, 64).unwrap();
    }
    roundtrip(&mut s, 1 << 20).unwrap();
}

/// Pods A and B on a network, both chained to fastpath; checks that ICMP
/// and TCP in both families take the fast path.
fn traffic_takes_the_fast_path(
    node: &Node,
    fs: &Bpffs,
    (a, ra): (&TestNs, &Value),
    (b, rb): (&TestNs, &Value),
    b_veth: &str,
) {
    for v4 in [true, false] {
        let (a_ip, b_ip) = (addr_of(ra, v4), addr_of(rb, v4));
        let before = list(node, fs);
        let tx_before = tx_packets(&node.ns.ns, b_veth);
        pings(&a.ns, &b_ip, 50);
        tcp_traffic(&a.ns, &b.ns, b_ip.parse().unwrap());
        tcp_traffic(&b.ns, &a.ns, a_ip.parse().unwrap());
        let after = list(node, fs);
        let tx_after = tx_packets(&node.ns.ns, b_veth);
        let to_b = counter(&after, &b_ip, "rxPackets") - counter(&before, &b_ip, "rxPackets");
        let from_a = counter(&after, &a_ip, "txPackets") - counter(&before, &a_ip, "txPackets");
        let to_a = counter(&after, &a_ip, "rxPackets") - counter(&before, &a_ip, "rxPackets");
        // 50 echo requests, 400 requests and responses (200 each way),
        // the bulk transfer's segments and every ACK of B's to A's data.
        assert!(to_b >= 450, "{} packets redirected to {b_ip}", to_b);
        assert!(from_a >= 450, "{} packets redirected from {a_ip}", from_a);
        assert!(to_a >= 450, "{} packets redirected to {a_ip}", to_a);
        assert!(counter(&after, &b_ip, "rxBytes") > (1 << 20));
        // What still reaches B through its host veth: neighbour
        // resolution and multicast, not the traffic.
        let via_veth = tx_after - tx_before;
        assert!(
            via_veth < 20,
            "{via_veth} packets went through {b_veth} while {to_b} were redirected"
        );
    }
}

#[test]
fn bridge_pods_talk_over_the_fast_path_dual_stack() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let (a, b, bc, ra, rb) = bridge_pods(&node);
    let pods = [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)];
    let status = fp_conf(&fs, &Value::Null, json!({}));
    fp(&node, "STATUS", "", "", &status).ok();
    fp_add_each(&node, &fs, pods, &json!({}));
    // The plugin mounted the bpffs on the empty pin root.
    assert!(rcni_ebpf::bpffs::is_bpffs(fs.path()).unwrap());
    let rows = list(&node, &fs);
    assert_eq!(rows.len(), 4, "{rows:?}");
    let a_row = row(&rows, &addr_of(&ra, true));
    assert_eq!(a_row["hostVeth"], host_veth(&ra, 1));
    assert_eq!(a_row["podMac"], ra["interfaces"][2]["mac"]);
    // Routed packets would come from the bridge's MAC.
    assert_eq!(a_row["gatewayMac"], ra["interfaces"][0]["mac"]);

    fp_each(&node, &fs, "CHECK", pods, &json!({}));
    traffic_takes_the_fast_path(&node, &fs, (&a, &ra), (&b, &rb), &host_veth(&rb, 1));
    // Bridged: nothing routes, the TTL stays.
    assert_eq!(reply_ttl(&a.ns, &addr_of(&rb, true)), 64);

    // DEL: entries and attachment gone, repeatable; CHECK then fails.
    for p in pods {
        fp_on(&node, &fs, "DEL", p, json!({})).ok();
        fp_on(&node, &fs, "DEL", p, json!({})).ok();
        assert_eq!(fp_on(&node, &fs, "CHECK", p, json!({})).err().0, 106);
    }
    assert!(list(&node, &fs).is_empty());
    let progs = tcx_progs(&node, &host_veth(&ra, 1));
    assert!(progs.is_empty(), "still attached: {progs:?}");
    // The normal path again.
    let redirected_before = redirected(&node, &fs);
    pings(&a.ns, &addr_of(&rb, true), 5);
    pings(&a.ns, &addr_of(&rb, false), 5);
    assert_eq!(redirected(&node, &fs), redirected_before);
    for (pod, cid) in [(&a, "ctr-a"), (&b, "ctr-b")] {
        node.call(&bin("bridge"), "DEL", &pod.path(), cid, &bc).ok();
    }
}

#[test]
fn ptp_pods_talk_over_the_fast_path_dual_stack() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let (a, b) = (TestNs::new(), TestNs::new());
    let pc = ptp_conf(&node);
    let ra = node.call(&bin("ptp"), "ADD", &a.path(), "ctr-a", &pc).ok();
    let rb = node.call(&bin("ptp"), "ADD", &b.path(), "ctr-b", &pc).ok();
    let pods = [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)];
    // The normal path routes once: TTL 63.
    assert_eq!(reply_ttl(&a.ns, &addr_of(&rb, true)), 63);
    fp_add_each(&node, &fs, pods, &json!({}));
    let rows = list(&node, &fs);
    let b_row = row(&rows, &addr_of(&rb, true));
    // ptp: B's gateway is B's own host veth.
    assert_eq!(b_row["hostVeth"], host_veth(&rb, 0));
    assert_eq!(b_row["gatewayMac"], rb["interfaces"][0]["mac"]);
    fp_each(&node, &fs, "CHECK", pods, &json!({}));
    traffic_takes_the_fast_path(&node, &fs, (&a, &ra), (&b, &rb), &host_veth(&rb, 0));
    // The fast path routes as the node would: TTL and hop limit 63 too.
    let before = redirected(&node, &fs);
    assert_eq!(reply_ttl(&a.ns, &addr_of(&rb, true)), 63);
    assert_eq!(reply_ttl(&a.ns, &addr_of(&rb, false)), 63);
    assert!(redirected(&node, &fs) >= before + 4);
    for p @ (pod, cid, _) in pods {
        fp_on(&node, &fs, "DEL", p, json!({})).ok();
        node.call(&bin("ptp"), "DEL", &pod.path(), cid, &pc).ok();
    }
    assert!(list(&node, &fs).is_empty());
}

#[test]
fn removing_and_adding_fastpath_mid_flow_keeps_traffic_flowing() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let (a, b, _bc, ra, rb) = bridge_pods(&node);
    let pods = [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)];
    fp_add_each(&node, &fs, pods, &json!({}));

    // A client doing round trips without pause, on one connection.
    let srv = echo_server(&b.ns, addr_of(&rb, true).parse().unwrap());
    let mut s = connect(&a.ns, srv);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let client = {
        let (stop, done) = (stop.clone(), done.clone());
        std::thread::spawn(move || -> std::io::Result<()> {
            while !stop.load(Ordering::Relaxed) {
                roundtrip(&mut s, 100)?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        })
    };
    let wait_progress = |what: &str| {
        let n = done.load(Ordering::Relaxed);
        let t = Instant::now();
        while done.load(Ordering::Relaxed) < n + 200 {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "traffic stalled {what}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    wait_progress("on the fast path");
    let fast = redirected(&node, &fs);
    assert!(fast > 200, "{fast}");
    fp_each(&node, &fs, "DEL", pods, &json!({}));
    wait_progress("after DEL");
    let after_del = redirected(&node, &fs);
    wait_progress("on the normal path");
    assert_eq!(
        redirected(&node, &fs),
        after_del,
        "DEL left the fast path on"
    );
    // And back: ADD mid-flow.
    fp_add_each(&node, &fs, pods, &json!({}));
    wait_progress("after ADD");
    wait_progress("back on the fast path");
    assert!(redirected(&node, &fs) > after_del + 200);
    stop.store(true, Ordering::Relaxed);
    client.join().unwrap().expect("no round trip failed");
}

#[test]
fn clsact_fallback_attaches_checks_and_detaches() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let (a, b, _bc, ra, rb) = bridge_pods(&node);
    let pods = [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)];
    let tc = json!({"attachMode": "tc"});
    fp_add_each(&node, &fs, pods, &tc);
    // ADD again (a retried runtime call) keeps one filter.
    fp_add(&node, &fs, &a, "ctr-a", &ra, tc.clone());
    let veth_a = host_veth(&ra, 1);
    let filters = |veth: &str| ingress_filters(&node, veth);
    let f = filters(&veth_a);
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!(f[0].name.as_deref(), Some(rcni_ebpf::POD_PROGRAM));
    // No tcx link pinned in this mode.
    let dir = fs.path().join("podnet");
    assert!(rcni_ebpf::pinned_links(&dir).unwrap().is_empty());
    assert!(rcni_ebpf::pinned_port_links(&dir).unwrap().is_empty());
    fp_each(&node, &fs, "CHECK", pods, &tc);
    let before = redirected(&node, &fs);
    pings(&a.ns, &addr_of(&rb, true), 20);
    pings(&a.ns, &addr_of(&rb, false), 20);
    tcp_traffic(&a.ns, &b.ns, addr_of(&rb, true).parse().unwrap());
    assert!(redirected(&node, &fs) >= before + 80);
    let c = fp_conf(&fs, &ra, tc.clone());
    fp(&node, "DEL", &a.path(), "ctr-a", &c).ok();
    assert!(filters(&veth_a).is_empty());
    assert_eq!(fp(&node, "CHECK", &a.path(), "ctr-a", &c).err().0, 106);
    fp(&node, "DEL", &a.path(), "ctr-a", &c).ok();
    pings(&a.ns, &addr_of(&rb, true), 3);
}

#[test]
fn gc_keeps_valid_attachments_and_unloads_an_empty_network() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let (a, b, _bc, ra, rb) = bridge_pods(&node);
    let pod_a = (&a, "ctr-a", &ra);
    // tcx: a link pinned per port, which GC takes off with the port's
    // last part.
    let tcx = json!({"attachMode": "tcx"});
    fp_add_each(&node, &fs, [pod_a, (&b, "ctr-b", &rb)], &tcx);
    let dir = fs.path().join("podnet");
    assert_eq!(rcni_ebpf::pinned_port_links(&dir).unwrap().len(), 2);
    assert!(rcni_ebpf::pinned_links(&dir).unwrap().is_empty());

    let gc = |valid: Value| {
        let c = fp_conf(
            &fs,
            &Value::Null,
            json!({"cni.dev/valid-attachments": valid}),
        );
        fp(&node, "GC", "", "", &c)
    };
    gc(json!([{"containerID": "ctr-a", "ifname": "eth0"}])).ok();
    let rows = list(&node, &fs);
    let addrs = addresses(&rows);
    assert_eq!(addrs.len(), 2);
    assert!(addrs.contains(&addr_of(&ra, true).as_str()));
    assert_eq!(rcni_ebpf::pinned_port_links(&dir).unwrap().len(), 1);
    assert!(tcx_progs(&node, &host_veth(&rb, 1)).is_empty());
    fp_on(&node, &fs, "CHECK", pod_a, tcx.clone()).ok();
    // Again: nothing more to do.
    gc(json!([{"containerID": "ctr-a", "ifname": "eth0"}])).ok();
    // Nothing valid: the network's program and maps go too.
    gc(json!([])).ok();
    assert!(!dir.exists());
    pings(&a.ns, &addr_of(&rb, true), 3);
    // The key is required.
    let c = fp_conf(&fs, &Value::Null, json!({}));
    assert_eq!(fp(&node, "GC", "", "", &c).err().0, 7);
    // DEL after GC is fine, and ADD loads the network afresh.
    fp_on(&node, &fs, "DEL", pod_a, json!({})).ok();
    fp_add(&node, &fs, &a, "ctr-a", &ra, tcx);
    assert!(dir.join("prog").exists());
}

#[test]
fn add_needs_a_prev_result_with_the_pods_veth() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let a = TestNs::new();
    let c = fp_conf(&fs, &Value::Null, json!({}));
    let (code, msg) = fp(&node, "ADD", &a.path(), "ctr-a", &c).err();
    assert_eq!(code, 7);
    assert!(msg.contains("prevResult"), "{msg}");
    // A prevResult naming an interface that is not there.
    let prev = json!({"cniVersion": "1.1.0",
        "interfaces": [{"name": "eth0", "sandbox": a.path()}],
        "ips": [{"address": "10.9.0.2/24", "interface": 0}]});
    let c = fp_conf(&fs, &prev, json!({}));
    let (code, _) = fp(&node, "ADD", &a.path(), "ctr-a", &c).err();
    assert_eq!(code, 103, "netlink: no such link");
    // An eth0 that is not a veth (a bridge, as dummy needs a module).
    rcni_integration::ip(&a.ns, "link add eth0 type bridge");
    let (code, msg) = fp(&node, "ADD", &a.path(), "ctr-a", &c).err();
    assert_eq!(code, 7);
    assert!(msg.contains("not a veth"), "{msg}");
    // Nothing was loaded by the failed ADDs.
    assert!(!fs.path().join("podnet").join("prog").exists());
}

#[test]
fn check_finds_a_lost_attachment() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let (a, _b, _bc, ra, _rb) = bridge_pods(&node);
    let veth = host_veth(&ra, 1);
    // auto (a cls_bpf filter on clsact), then tcx (a pinned link).
    for mode in [json!({}), json!({"attachMode": "tcx"})] {
        fp_add(&node, &fs, &a, "ctr-a", &ra, mode.clone());
        let c = fp_conf(&fs, &ra, mode.clone());
        fp(&node, "CHECK", &a.path(), "ctr-a", &c).ok();
        // The filter removed, or the link unpinned, behind the plugin's
        // back: detached.
        if mode == json!({}) {
            let v = veth.clone();
            node.ns
                .ns
                .run(move || rcni_ebpf::detach_tc(&v))
                .unwrap()
                .unwrap();
        } else {
            let dir = fs.path().join("podnet");
            let ports = rcni_ebpf::pinned_port_links(&dir).unwrap();
            assert_eq!(ports.len(), 1);
            assert!(rcni_ebpf::detach_port_link(&dir, ports[0]).unwrap());
        }
        let (code, msg) = fp(&node, "CHECK", &a.path(), "ctr-a", &c).err();
        assert_eq!(code, 106, "{mode}");
        assert!(msg.contains("not attached"), "{msg}");
        // ADD repairs it.
        fp_add(&node, &fs, &a, "ctr-a", &ra, mode.clone());
        fp(&node, "CHECK", &a.path(), "ctr-a", &c).ok();
        fp(&node, "DEL", &a.path(), "ctr-a", &c).ok();
    }
}

/// attachMode auto: a cls_bpf filter on clsact (a tcx attach waits for an
/// RCU grace period under rtnl); tcx where the veth has a plain `ingress`
/// qdisc (the reference bandwidth plugin's, earlier in the chain), which
/// leaves clsact no place; and a pod attached on tcx before (an older
/// default, or attachMode tcx) stays attached for CHECK and ADD, and DEL
/// takes its link off.
#[test]
fn auto_attaches_on_clsact_and_keeps_tcx_attachments() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let (a, b, bc, ra, rb) = bridge_pods(&node);
    let filters = |veth: &str| ingress_filters(&node, veth);
    let tcx_progs = |veth: &str| tcx_progs(&node, veth);
    let dir = fs.path().join("podnet");
    let (va, vb) = (host_veth(&ra, 1), host_veth(&rb, 1));

    // A: auto on a bare veth is clsact.
    fp_add(&node, &fs, &a, "ctr-a", &ra, json!({}));
    assert_eq!(filters(&va).len(), 1);
    assert!(tcx_progs(&va).is_empty());
    assert!(rcni_ebpf::pinned_links(&dir).unwrap().is_empty());
    assert!(rcni_ebpf::pinned_port_links(&dir).unwrap().is_empty());

    // B: an `ingress` qdisc already there: tcx.
    nl(&node.ns.ns, async |n| {
        let l = n.link_by_name(&vb).await.unwrap();
        n.add_ingress_qdisc(l.index).await.unwrap();
    });
    fp_add(&node, &fs, &b, "ctr-b", &rb, json!({}));
    assert_eq!(tcx_progs(&vb).len(), 1);
    assert_eq!(rcni_ebpf::pinned_port_links(&dir).unwrap().len(), 1);
    for (pod, cid, r) in [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)] {
        fp_on(&node, &fs, "CHECK", (pod, cid, r), json!({})).ok();
    }
    pings(&a.ns, &addr_of(&rb, true), 3);
    // A's clsact hook carries real traffic: to a third pod on the fast
    // path (B, shaped, keeps the normal path), A's packets are redirected.
    let c = TestNs::new();
    let rc = node.add(&c, "ctr-c", &bc);
    fp_add(&node, &fs, &c, "ctr-c", &rc, json!({}));
    let before = redirected(&node, &fs);
    pings(&a.ns, &addr_of(&rc, true), 5);
    assert!(redirected(&node, &fs) >= before + 5);
    fp_on(&node, &fs, "DEL", (&c, "ctr-c", &rc), json!({})).ok();
    node.call(&bin("bridge"), "DEL", &c.path(), "ctr-c", &bc)
        .ok();

    // A again, attached on tcx (as the old default did): auto's CHECK and
    // ADD accept it, without a second hook.
    fp_on(&node, &fs, "DEL", (&a, "ctr-a", &ra), json!({})).ok();
    assert!(filters(&va).is_empty());
    fp_add(&node, &fs, &a, "ctr-a", &ra, json!({"attachMode": "tcx"}));
    fp_on(&node, &fs, "CHECK", (&a, "ctr-a", &ra), json!({})).ok();
    fp_add(&node, &fs, &a, "ctr-a", &ra, json!({}));
    assert!(filters(&va).is_empty());
    assert_eq!(tcx_progs(&va).len(), 1);
    // auto's DEL takes tcx links off.
    for (pod, cid, r) in [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)] {
        fp_on(&node, &fs, "DEL", (pod, cid, r), json!({})).ok();
    }
    assert!(tcx_progs(&va).is_empty() && tcx_progs(&vb).is_empty());
    assert!(rcni_ebpf::pinned_links(&dir).unwrap().is_empty());
    assert!(rcni_ebpf::pinned_port_links(&dir).unwrap().is_empty());
}

#[test]
fn status_tells_whether_the_program_can_load() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let c = fp_conf(&fs, &Value::Null, json!({}));
    fp(&node, "STATUS", "", "", &c).ok();
    // A pin root that no bpffs can serve: not available.
    let elsewhere = tempfile::tempdir().unwrap();
    let bad = json!({"cniVersion": "1.1.0", "name": "podnet", "type": "fastpath",
                     "pinRoot": elsewhere.path().join("a/b").display().to_string()});
    let (code, msg) = fp(&node, "STATUS", "", "", &bad).err();
    assert_eq!(code, 50);
    assert!(msg.contains("bpffs"), "{msg}");
    // bestEffort: ADD would still succeed, so STATUS says ready.
    let mut be = bad.clone();
    be["bestEffort"] = json!(true);
    fp(&node, "STATUS", "", "", &be).ok();
}

#[test]
fn best_effort_add_passes_through_when_the_datapath_cannot_load() {
    let node = Node::new();
    let (a, _b, _bc, ra, rb) = bridge_pods(&node);
    let elsewhere = tempfile::tempdir().unwrap();
    let mut c = json!({"cniVersion": "1.1.0", "name": "podnet", "type": "fastpath",
                       "pinRoot": elsewhere.path().join("a/b").display().to_string(),
                       "prevResult": ra});
    let (code, _) = fp(&node, "ADD", &a.path(), "ctr-a", &c).err();
    assert_eq!(code, 112);
    c["bestEffort"] = json!(true);
    let out = fp(&node, "ADD", &a.path(), "ctr-a", &c).ok();
    assert_eq!(
        normalize_result(&out, "1.1.0"),
        normalize_result(&ra, "1.1.0")
    );
    assert!(ping(&a.ns, &addr_of(&rb, true)));
    fp(&node, "DEL", &a.path(), "ctr-a", &c).ok();
}

/// conf/11-bridge-fastpath.conflist and conf/31-ptp-fastpath.conflist as a
/// runtime runs them (cnitool: ADD in order, CHECK, STATUS, GC, DEL in
/// reverse), with host-local's state and the pins in the test's own
/// directories.
#[test]
fn example_conflists_run_through_cnitool() {
    for (file, net) in [
        ("11-bridge-fastpath.conflist", "bridge-fast"),
        ("31-ptp-fastpath.conflist", "ptp-fast"),
    ] {
        let node = Node::new();
        let fs = Bpffs::empty();
        let (confdir, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../conf")
            .join(file);
        let mut v: Value = serde_json::from_slice(&std::fs::read(src).unwrap()).unwrap();
        for p in v["plugins"].as_array_mut().unwrap() {
            if p["type"] == "fastpath" {
                p["pinRoot"] = json!(fs.root());
            } else {
                p["ipam"]["dataDir"] = json!(node.data.path());
            }
        }
        std::fs::write(confdir.path().join(file), v.to_string()).unwrap();
        let run = |args: &[&str]| node.cnitool(confdir.path(), cache.path(), args, &[]);
        let (a, b) = (TestNs::new(), TestNs::new());
        let ra = run(&["add", net, &a.path(), "--container-id", "ctr-a"]).ok();
        let rb = run(&["add", net, &b.path(), "--container-id", "ctr-b"]).ok();
        run(&["check", net, &a.path(), "--container-id", "ctr-a"]).ok();
        run(&["status", net]).ok();
        let before = redirected(&node, &fs);
        for v4 in [true, false] {
            pings(&a.ns, &addr_of(&rb, v4), 10);
            pings(&b.ns, &addr_of(&ra, v4), 10);
        }
        assert!(
            redirected(&node, &fs) >= before + 80,
            "{file}: fast path not taken"
        );
        // GC with A the only valid attachment: B's entries go.
        run(&["gc", net, "--valid", "ctr-a/eth0"]).ok();
        let rows = list(&node, &fs);
        assert_eq!(rows.len(), 2, "{file}: {rows:?}");
        run(&["del", net, &a.path(), "--container-id", "ctr-a"]).ok();
        run(&["del", net, &a.path(), "--container-id", "ctr-a"]).ok();
        assert!(list(&node, &fs).is_empty(), "{file}");
        assert!(
            node.host_veths().is_empty(),
            "{file}: {:?}",
            node.host_veths()
        );
    }
}

/// DEL after the pod's veth and netns are gone (the runtime lost the pod,
/// or ran the chain's DELs out of order): success, nothing left behind.
#[test]
fn del_succeeds_when_the_veth_and_netns_are_gone() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let (a, b, bc, ra, rb) = bridge_pods(&node);
    fp_add_each(
        &node,
        &fs,
        [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)],
        &json!({"attachMode": "tcx"}),
    );
    node.call(&bin("bridge"), "DEL", &a.path(), "ctr-a", &bc)
        .ok();
    drop(a);
    let c = fp_conf(&fs, &ra, json!({}));
    fp(&node, "DEL", "", "ctr-a", &c).ok();
    fp(&node, "DEL", "", "ctr-a", &c).ok();
    let rows = list(&node, &fs);
    let addrs = addresses(&rows);
    assert_eq!(addrs.len(), 2, "only B's entries are left: {addrs:?}");
    // A's port link went with its part, although its veth was gone.
    let dir = fs.path().join("podnet");
    assert_eq!(rcni_ebpf::pinned_port_links(&dir).unwrap().len(), 1);
    // The same without prevResult (a runtime that lost its cache).
    let bare = fp_conf(&fs, &Value::Null, json!({}));
    fp(&node, "DEL", &b.path(), "ctr-b", &bare).ok();
    assert!(list(&node, &fs).is_empty());
    assert!(rcni_ebpf::pinned_port_links(&dir).unwrap().is_empty());
}

// ---- other chain members: what the fast path must not skip ----

const MBIT: u64 = 1_000_000;

/// `plugin CMD` chained on `prev` for `pod`, in the node namespace. The
/// reference plugins (1.1.1) know results up to 1.0.0, which 1.1.0's are
/// shaped like.
fn chained(node: &Node, plugin: &Path, cmd: &str, pod: Pod, conf: &Value) -> Output {
    let (ns, cid, prev) = pod;
    let mut c = rcni_integration::Node::with_prev(conf, prev);
    if plugin.starts_with(rcni_testkit::REFERENCE_DIR) {
        c["cniVersion"] = json!("1.0.0");
        c["prevResult"]["cniVersion"] = json!("1.0.0");
    }
    node.call(plugin, cmd, &ns.path(), cid, &c)
}

/// Where fastpath sits relative to bandwidth, and whose bandwidth it is.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Order {
    /// bridge, bandwidth, fastpath: fastpath finds the qdiscs.
    BandwidthThenFastpath,
    /// bridge, fastpath, bandwidth: bandwidth takes the pod off the fast path.
    FastpathThenBandwidth,
    /// bridge, the reference's bandwidth, fastpath.
    ReferenceThenFastpath,
}

/// bridge + bandwidth (10 Mbit/s each way) + fastpath in `order` for pod
/// S, bridge + fastpath for pods U and V of the same network: S measures
/// its limits both ways, and its traffic is never redirected, while U and V
/// keep the fast path. With fastpath first on a kernel with the fq qdisc,
/// bandwidth shapes S by departure time instead and S keeps the fast path:
/// its limits then hold within 5 % (wire bytes at the pod's interface), and
/// its traffic is redirected. CHECK passes, DEL in reverse order leaves
/// nothing.
fn shaped_pod_stays_shaped(order: Order, extra: Value) {
    let edt = order == Order::FastpathThenBandwidth && rcni_integration::kernel_has_fq();
    let node = Node::new();
    let fs = Bpffs::empty();
    let bc = node.conf("1.1.0", json!({}));
    let (s, u, v) = (TestNs::new(), TestNs::new(), TestNs::new());
    let bw_bin = match order {
        Order::ReferenceThenFastpath => rcni_testkit::reference_bin("bandwidth"),
        _ => bin("bandwidth"),
    };
    let bw = json!({"cniVersion": "1.0.0", "name": "podnet", "type": "bandwidth",
        "ingressRate": 10 * MBIT, "ingressBurst": 256_000,
        "egressRate": 10 * MBIT, "egressBurst": 256_000});
    let fpc = fp_conf(&fs, &Value::Null, extra.clone());
    // The chain of S: each plugin's result is the next one's prevResult.
    let rs0 = node.add(&s, "ctr-s", &bc);
    let rs = match order {
        Order::FastpathThenBandwidth => {
            let r = chained(&node, &bin("fastpath"), "ADD", (&s, "ctr-s", &rs0), &fpc).ok();
            chained(&node, &bw_bin, "ADD", (&s, "ctr-s", &r), &bw).ok()
        }
        _ => {
            let r = chained(&node, &bw_bin, "ADD", (&s, "ctr-s", &rs0), &bw).ok();
            chained(&node, &bin("fastpath"), "ADD", (&s, "ctr-s", &r), &fpc).ok()
        }
    };
    let ru = node.add(&u, "ctr-u", &bc);
    let rv = node.add(&v, "ctr-v", &bc);
    fp_add_each(&node, &fs, [(&u, "ctr-u", &ru), (&v, "ctr-v", &rv)], &extra);
    // CHECK of the whole chain, in order.
    let check_bw = chained(&node, &bw_bin, "CHECK", (&s, "ctr-s", &rs), &bw);
    assert_eq!(
        check_bw.code, 0,
        "{order:?}: bandwidth CHECK: {}",
        check_bw.stdout
    );
    fp_on(&node, &fs, "CHECK", (&s, "ctr-s", &rs), extra.clone()).ok();

    let (s_ip, u_ip, v_ip) = (addr_of(&rs, true), addr_of(&ru, true), addr_of(&rv, true));

    // S to U: S's egress limit; U to S: S's ingress limit.
    let wire = |rx: bool| wire_bytes(&s.ns, "eth0", rx);
    let tx0 = wire(false);
    let started = std::time::Instant::now();
    let egress = iperf_rate(&s.ns, &u.ns, &u_ip, 5401, false);
    let tx_secs = started.elapsed().as_secs_f64();
    let (tx1, rx1) = (wire(false), wire(true));
    let started = std::time::Instant::now();
    let ingress = iperf_rate(&s.ns, &u.ns, &u_ip, 5402, true);
    let rx_secs = started.elapsed().as_secs_f64();
    let rx2 = wire(true);
    eprintln!("{order:?}: shaped pod egress {egress} bit/s, ingress {ingress} bit/s");
    for (what, rate) in [("egress", egress), ("ingress", ingress)] {
        assert!(
            (3 * MBIT..=12 * MBIT).contains(&rate),
            "{order:?}: {what} of the shaped pod measured {rate} bit/s for a 10 Mbit/s limit"
        );
    }
    if edt {
        // The bytes on the wire while iperf3 ran (its start and end
        // included, which only lowers the figure): at most the limit plus
        // the burst, and within 5 % of the limit over the run.
        for (what, bytes, secs) in [
            ("egress", tx1 - tx0, tx_secs),
            ("ingress", rx2 - rx1, rx_secs),
        ] {
            let bits = bytes as f64 * 8.0;
            let limit = 10.0 * MBIT as f64 * secs + 256_000.0;
            assert!(
                bits <= limit * 1.05,
                "{what}: {bits} bits on the wire in {secs:.1} s for a 10 Mbit/s limit"
            );
        }
        for (what, rate) in [("egress", egress), ("ingress", ingress)] {
            // iperf3's goodput: the payload of 1514-byte frames is 1448.
            assert!(
                rate as f64 >= 10.0 * MBIT as f64 * 0.95 * 1448.0 / 1514.0,
                "{what}: {rate} bit/s of goodput for a 10 Mbit/s limit"
            );
        }
        let rows = list(&node, &fs);
        let r = row(&rows, &s_ip);
        assert_eq!(r["path"], "fast", "{rows:?}");
        assert_eq!(r["shaped"], true, "{rows:?}");
        for k in ["rxPackets", "txPackets"] {
            assert!(
                counter(&rows, &s_ip, k) > 1000,
                "S not redirected ({k}): {rows:?}"
            );
        }
        // S takes its own shaping off (a pod with CAP_NET_ADMIN could): its
        // host-side port still polices the egress limit.
        let policed = |what: &str| {
            let dp = rcni_ebpf::Datapath::open(&fs.path().join("podnet"))
                .unwrap()
                .unwrap();
            let ports = dp.ports().unwrap();
            let p: Vec<_> = ports
                .iter()
                .filter(|(_, parts)| parts & rcni_ebpf::PORT_POLICE != 0)
                .map(|&(i, _)| dp.policer(i).unwrap().unwrap())
                .collect();
            assert!(p.len() <= 1, "{what}: {ports:?}");
            p.first().copied()
        };
        let before = policed("shaped");
        rcni_integration::egress_without_own_shaping(&s.ns, &u.ns, &u_ip, 5403, 10 * MBIT);
        let before = before.expect("S's port has no policer");
        assert_eq!(
            before.dropped, 0,
            "the policer dropped what S's shaping let go"
        );
        assert!(policed("unshaped").unwrap().dropped > 0);
        let check = chained(&node, &bw_bin, "CHECK", (&s, "ctr-s", &rs), &bw);
        assert_ne!(check.code, 0, "CHECK passed without S's shaping");
    }
    let rows = list(&node, &fs);
    if !edt {
        assert_eq!(row(&rows, &s_ip)["path"], "normal", "{order:?}: {rows:?}");
        assert_eq!(row(&rows, &u_ip)["path"], "fast", "{order:?}: {rows:?}");
        for k in ["rxPackets", "txPackets"] {
            assert_eq!(counter(&rows, &s_ip, k), 0, "{order:?}: S redirected ({k})");
        }
        let normal: u64 = fastpath_json(&node, &fs, "stats")
            .iter()
            .map(|n| {
                n["verdicts"][rcni_ebpf::Verdict::NormalPath.name()]
                    .as_u64()
                    .unwrap()
            })
            .sum();
        // Packets as the program sees them: GRO and GSO batches, fewer
        // where the CPU is slow (844 under the VM's emulation).
        assert!(
            normal > 200,
            "{order:?}: {normal} packets passed as normal path"
        );
    }

    // U and V, on the same network, keep the fast path.
    let before = counter(&rows, &v_ip, "rxPackets");
    pings(&u.ns, &v_ip, 20);
    tcp_traffic(&u.ns, &v.ns, v_ip.parse().unwrap());
    let after = counter(&list(&node, &fs), &v_ip, "rxPackets");
    assert!(
        after >= before + 220,
        "{order:?}: U to V redirected {}",
        after - before
    );

    // DEL in reverse order; nothing of S is left.
    match order {
        Order::FastpathThenBandwidth => {
            chained(&node, &bw_bin, "DEL", (&s, "ctr-s", &rs), &bw).ok();
            fp_on(&node, &fs, "DEL", (&s, "ctr-s", &rs), extra.clone()).ok();
        }
        _ => {
            fp_on(&node, &fs, "DEL", (&s, "ctr-s", &rs), extra.clone()).ok();
            chained(&node, &bw_bin, "DEL", (&s, "ctr-s", &rs), &bw).ok();
        }
    }
    node.call(&bin("bridge"), "DEL", &s.path(), "ctr-s", &bc)
        .ok();
    // bandwidth's DEL took S's policer (S had dropped its shaping).
    let dp = rcni_ebpf::Datapath::open(&fs.path().join("podnet"))
        .unwrap()
        .unwrap();
    let ports = dp.ports().unwrap();
    assert!(
        ports.iter().all(|(_, p)| p & rcni_ebpf::PORT_POLICE == 0),
        "{order:?}: {ports:?}"
    );
    let rows = list(&node, &fs);
    assert_eq!(addresses(&rows).len(), 4, "{order:?}: {rows:?}");
    assert!(!addresses(&rows).contains(&s_ip.as_str()));
    for (pod, cid, r) in [(&u, "ctr-u", &ru), (&v, "ctr-v", &rv)] {
        fp_on(&node, &fs, "DEL", (pod, cid, r), extra.clone()).ok();
        node.call(&bin("bridge"), "DEL", &pod.path(), cid, &bc).ok();
    }
}

#[test]
fn bandwidth_holds_with_fastpath_after_it() {
    shaped_pod_stays_shaped(Order::BandwidthThenFastpath, json!({}));
}

#[test]
fn bandwidth_holds_with_fastpath_before_it() {
    shaped_pod_stays_shaped(Order::FastpathThenBandwidth, json!({}));
}

/// The clsact fallback: bandwidth's ingress qdisc and fastpath's clsact
/// share the veth's ingress hook, in either order.
#[test]
fn bandwidth_holds_with_fastpath_on_clsact() {
    for order in [Order::BandwidthThenFastpath, Order::FastpathThenBandwidth] {
        shaped_pod_stays_shaped(order, json!({"attachMode": "tc"}));
    }
}

#[test]
fn reference_bandwidth_holds_with_fastpath_after_it() {
    shaped_pod_stays_shaped(Order::ReferenceThenFastpath, json!({}));
}

/// fastpath, then the reference's bandwidth, which knows nothing of it: the
/// pod stays on the fast path (its limits skipped), and fastpath's CHECK
/// says so.
#[test]
fn check_finds_a_pod_shaped_behind_the_fast_paths_back() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let (a, _b, _bc, ra, _rb) = bridge_pods(&node);
    fp_add(&node, &fs, &a, "ctr-a", &ra, json!({}));
    let bw = json!({"cniVersion": "1.0.0", "name": "podnet", "type": "bandwidth",
        "ingressRate": 10 * MBIT, "ingressBurst": 256_000});
    let reference = rcni_testkit::reference_bin("bandwidth");
    let r = chained(&node, &reference, "ADD", (&a, "ctr-a", &ra), &bw).ok();
    let (code, msg) = fp_on(&node, &fs, "CHECK", (&a, "ctr-a", &r), json!({})).err();
    assert_eq!(code, 106);
    assert!(
        msg.contains("shaped") && msg.contains("before fastpath"),
        "{msg}"
    );
    // Our bandwidth, run on the same pod, takes it off the fast path (our
    // DEL first: the reference's leaves its TBF on the veth).
    chained(&node, &bin("bandwidth"), "DEL", (&a, "ctr-a", &r), &bw).ok();
    let r = chained(&node, &bin("bandwidth"), "ADD", (&a, "ctr-a", &ra), &bw).ok();
    fp_on(&node, &fs, "CHECK", (&a, "ctr-a", &r), json!({})).ok();
    assert_eq!(
        row(&list(&node, &fs), &addr_of(&ra, true))["path"],
        "normal"
    );
}

/// A UDP datagram from `from` to `to`:`port` is or is not received; the
/// sender first pins the receiver's MAC in its neighbour table, as a pod
/// that wants past the bridge's isolation would.
fn udp_gets_through(from: &NetNs, to_ns: &NetNs, to: &str, to_mac: &str) -> bool {
    rcni_integration::ip(
        from,
        &format!("neigh replace {to} lladdr {to_mac} dev eth0 nud permanent"),
    );
    let dst: SocketAddr = format!("{to}:5499").parse().unwrap();
    let rx = to_ns
        .run(move || {
            let s = std::net::UdpSocket::bind(dst).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            s
        })
        .unwrap();
    from.run(move || {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..5 {
            s.send_to(b"past the bridge?", dst).unwrap();
        }
    })
    .unwrap();
    let mut buf = [0u8; 64];
    rx.recv_from(&mut buf).is_ok()
}

/// bridge `portIsolation`: isolated ports reach no other isolated port,
/// with fastpath in the chain too, even for a pod that knows its peer's MAC.
#[test]
fn port_isolation_holds_with_fastpath() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let bc = node.conf("1.1.0", json!({"portIsolation": true}));
    let (a, b) = (TestNs::new(), TestNs::new());
    let ra = node.add(&a, "ctr-a", &bc);
    let rb = node.add(&b, "ctr-b", &bc);
    fp_add_each(
        &node,
        &fs,
        [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)],
        &json!({}),
    );
    fp_each(
        &node,
        &fs,
        "CHECK",
        [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)],
        &json!({}),
    );
    assert!(!ping(&a.ns, &addr_of(&rb, true)));
    let b_mac = rb["interfaces"][2]["mac"].as_str().unwrap();
    assert!(
        !udp_gets_through(&a.ns, &b.ns, &addr_of(&rb, true), b_mac),
        "past the isolated port"
    );
    assert_eq!(redirected(&node, &fs), 0);
    let rows = list(&node, &fs);
    assert_eq!(
        row(&rows, &addr_of(&ra, true))["path"],
        "normal",
        "{rows:?}"
    );
}

/// bridge `macspoofchk`: with fastpath, honest pods take the fast path, and
/// a pod sending from another MAC is judged by the bridge (dropped), not
/// redirected past it.
#[test]
fn macspoofchk_holds_with_fastpath() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let bc = node.conf("1.1.0", json!({"macspoofchk": true}));
    let (a, b) = (TestNs::new(), TestNs::new());
    let ra = node.add(&a, "ctr-a", &bc);
    let rb = node.add(&b, "ctr-b", &bc);
    fp_add_each(
        &node,
        &fs,
        [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)],
        &json!({}),
    );
    let b_ip = addr_of(&rb, true);
    pings(&a.ns, &b_ip, 10);
    assert!(redirected(&node, &fs) >= 20);
    let b_mac = rb["interfaces"][2]["mac"].as_str().unwrap();
    assert!(udp_gets_through(&a.ns, &b.ns, &b_ip, b_mac), "honest MAC");
    rcni_integration::ip(&a.ns, "link set eth0 address 02:00:00:00:00:99");
    let to_b = counter(&list(&node, &fs), &b_ip, "rxPackets");
    assert!(
        !udp_gets_through(&a.ns, &b.ns, &b_ip, b_mac),
        "spoofed MAC got through"
    );
    assert_eq!(counter(&list(&node, &fs), &b_ip, "rxPackets"), to_b);
}

/// firewall `ingressPolicy: isolated` (nftables) before fastpath: pods of
/// the bridge do not reach each other, even one that knows its peer's MAC.
/// After fastpath, CHECK tells.
#[test]
fn firewall_isolation_holds_with_fastpath() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let bc = node.conf("1.1.0", json!({}));
    let fw = json!({"cniVersion": "1.1.0", "name": "podnet", "type": "firewall",
                    "backend": "nftables", "ingressPolicy": "isolated"});
    let (a, b) = (TestNs::new(), TestNs::new());
    let mut results = vec![];
    for (pod, cid) in [(&a, "ctr-a"), (&b, "ctr-b")] {
        let r = node.add(pod, cid, &bc);
        let r = chained(&node, &bin("firewall"), "ADD", (pod, cid, &r), &fw).ok();
        fp_add(&node, &fs, pod, cid, &r, json!({}));
        results.push(r);
    }
    let (ra, rb) = (&results[0], &results[1]);
    assert!(!ping(&a.ns, &addr_of(rb, true)));
    assert!(!ping(&b.ns, &addr_of(ra, false)));
    let b_mac = rb["interfaces"][2]["mac"].as_str().unwrap();
    assert!(
        !udp_gets_through(&a.ns, &b.ns, &addr_of(rb, true), b_mac),
        "past the firewall's isolation"
    );
    assert_eq!(redirected(&node, &fs), 0);
    let rows = list(&node, &fs);
    assert_eq!(row(&rows, &addr_of(ra, true))["path"], "normal", "{rows:?}");
    fp_on(&node, &fs, "CHECK", (&a, "ctr-a", ra), json!({})).ok();
    for (pod, cid, r) in [(&a, "ctr-a", ra), (&b, "ctr-b", rb)] {
        fp_on(&node, &fs, "DEL", (pod, cid, r), json!({})).ok();
        chained(&node, &bin("firewall"), "DEL", (pod, cid, r), &fw).ok();
        node.call(&bin("bridge"), "DEL", &pod.path(), cid, &bc).ok();
    }
    // firewall after fastpath: fastpath's CHECK finds the pod redirected.
    let c = TestNs::new();
    let rc = node.add(&c, "ctr-c", &bc);
    fp_add(&node, &fs, &c, "ctr-c", &rc, json!({}));
    let r = chained(&node, &bin("firewall"), "ADD", (&c, "ctr-c", &rc), &fw).ok();
    let (code, msg) = fp_on(&node, &fs, "CHECK", (&c, "ctr-c", &r), json!({})).err();
    assert_eq!(code, 106);
    assert!(msg.contains("firewall isolates"), "{msg}");
    chained(&node, &bin("firewall"), "DEL", (&c, "ctr-c", &r), &fw).ok();
}

/// bandwidth after a fastpath whose pins it cannot find (the pin root too
/// deep below the bpffs mount): ADD fails with 112 and leaves nothing: the
/// veth unshaped, no IFB.
#[test]
fn bandwidth_after_fastpath_out_of_reach_fails_and_rolls_back() {
    let node = Node::new();
    let fs = Bpffs::empty();
    rcni_ebpf::bpffs::ensure_root(fs.path()).unwrap();
    let deep = fs.path().join("a/b/c").display().to_string();
    let (a, _b, _bc, ra, _rb) = bridge_pods(&node);
    let fpc = json!({"cniVersion": "1.1.0", "name": "podnet", "type": "fastpath",
                     "pinRoot": deep});
    let r = chained(&node, &bin("fastpath"), "ADD", (&a, "ctr-a", &ra), &fpc).ok();
    let bw = json!({"cniVersion": "1.0.0", "name": "podnet", "type": "bandwidth",
        "ingressRate": 10 * MBIT, "ingressBurst": 256_000,
        "egressRate": 10 * MBIT, "egressBurst": 256_000});
    let (code, msg) = chained(&node, &bin("bandwidth"), "ADD", (&a, "ctr-a", &r), &bw).err();
    assert_eq!(code, 112, "{msg}");
    assert!(msg.contains("cannot find the fast path"), "{msg}");
    let veth = host_veth(&ra, 1);
    let qdiscs = nl(&node.ns.ns, async |n| {
        let l = n.link_by_name(&veth).await.unwrap();
        n.qdiscs(l.index).await.unwrap()
    });
    // fastpath's clsact stays (attachMode auto), with only its filter.
    assert!(
        qdiscs
            .iter()
            .all(|q| q.kind == "noqueue" || q.kind == "clsact"),
        "{qdiscs:?}"
    );
    let filters = ingress_filters(&node, &veth);
    assert!(
        filters
            .iter()
            .all(|f| f.name.as_deref() == Some(rcni_ebpf::POD_PROGRAM)),
        "{filters:?}"
    );
    assert!(
        !rcni_integration::link_names(&node.ns.ns)
            .iter()
            .any(|l| l.starts_with("bwp"))
    );
    chained(&node, &bin("fastpath"), "DEL", (&a, "ctr-a", &r), &fpc).ok();
}
