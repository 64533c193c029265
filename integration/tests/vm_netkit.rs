//! `linkType: netkit` in ptp and bridge, and the fast path on netkit's own
//! hooks. This host's kernel has no netkit; scripts/test runs this binary
//! under scripts/vm-run (Debian's 6.12 kernel has it). Pods born with
//! netkit pairs route and bridge as veth pods do (both families, TTL, CHECK,
//! DEL twice, nothing left); fastpath chained after them attaches to the
//! primary's peer hook (no tc filter, no tcx program), and traffic between
//! two netkit pods, and between a netkit pod and a veth pod, is redirected
//! both ways; DEL takes the link off the hook.

use rcni_integration::{
    Bpffs, Node, addr_of, fastpath_json, iperf_rate, nl, pings, reply_ttl, wire_bytes,
};
use rcni_netns::NetNs;
use rcni_testkit::{TestNs, bin};
use serde_json::{Value, json};

fn ptp_conf(node: &Node, link_type: &str) -> Value {
    json!({"cniVersion": "1.1.0", "name": "podnet", "type": "ptp", "linkType": link_type,
           "ipam": {"type": "host-local", "dataDir": node.data.path(),
                    "ranges": [[{"subnet": "10.79.0.0/24"}], [{"subnet": "fd79::/64"}]],
                    "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}})
}

fn fp_conf(fs: &Bpffs, prev: &Value) -> Value {
    json!({"cniVersion": "1.1.0", "name": "podnet", "type": "fastpath",
           "pinRoot": fs.root(), "prevResult": prev})
}

/// The kind of link `name` in `ns`.
fn kind(ns: &NetNs, name: &str) -> Option<String> {
    let name = name.to_string();
    nl(ns, async |n| n.find_link(&name).await.unwrap()).and_then(|l| l.kind)
}

/// Packets the fast path redirected to (`rxPackets`) or from
/// (`txPackets`) address `addr`.
fn counter(node: &Node, fs: &Bpffs, addr: &str, key: &str) -> u64 {
    fastpath_json(&node.ns.ns, fs.path(), "list")
        .iter()
        .find(|r| r["address"] == addr)
        .map(|r| r[key].as_u64().unwrap())
        .unwrap_or(0)
}

/// The programs on the node's netkit primary `dev`'s peer hook.
fn peer_progs(node: &Node, dev: &str) -> Vec<u32> {
    let dev = dev.to_string();
    node.ns
        .ns
        .run(move || rcni_ebpf::netkit_peer_programs(&dev))
        .unwrap()
        .unwrap()
}

fn host_dev(result: &Value, idx: usize) -> String {
    result["interfaces"][idx]["name"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn ptp_netkit_pairs_route_as_veth_pairs_do() {
    let node = Node::new();
    let (a, b) = (TestNs::new(), TestNs::new());
    let pc = ptp_conf(&node, "netkit");
    let ptp = bin("ptp");
    let ra = node.call(&ptp, "ADD", &a.path(), "ctr-a", &pc).ok();
    let rb = node.call(&ptp, "ADD", &b.path(), "ctr-b", &pc).ok();
    let ha = host_dev(&ra, 0);
    assert!(ha.starts_with("nk"), "{ra}");
    assert_eq!(kind(&node.ns.ns, &ha).as_deref(), Some("netkit"));
    assert_eq!(kind(&a.ns, "eth0").as_deref(), Some("netkit"));
    // L2: both ends have MACs, in the result as for a veth.
    assert!(
        ra["interfaces"][0]["mac"].as_str().unwrap().len() == 17,
        "{ra}"
    );
    assert!(
        ra["interfaces"][1]["mac"].as_str().unwrap().len() == 17,
        "{ra}"
    );
    for v4 in [true, false] {
        pings(&a.ns, &addr_of(&rb, v4), 5);
        pings(&b.ns, &addr_of(&ra, v4), 5);
        // Routed by the node once.
        assert_eq!(reply_ttl(&a.ns, &addr_of(&rb, v4)), 63);
    }
    for (pod, cid, r) in [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)] {
        let with = Node::with_prev(&pc, r);
        node.call(&ptp, "CHECK", &pod.path(), cid, &with).ok();
        node.call(&ptp, "DEL", &pod.path(), cid, &with).ok();
        node.call(&ptp, "DEL", &pod.path(), cid, &with).ok();
        assert_eq!(kind(&pod.ns, "eth0"), None);
    }
    node.assert_nothing_left();
}

#[test]
fn bridge_netkit_ports_bridge_as_veth_ports_do() {
    let node = Node::new();
    let (a, b) = (TestNs::new(), TestNs::new());
    let bc = node.conf("1.1.0", json!({"linkType": "netkit"}));
    let ra = node.add(&a, "ctr-a", &bc);
    let rb = node.add(&b, "ctr-b", &bc);
    let port = host_dev(&rb, 1);
    assert_eq!(kind(&node.ns.ns, &port).as_deref(), Some("netkit"));
    let master = nl(&node.ns.ns, async |n| {
        let l = n.link_by_name(&port).await.unwrap();
        n.link_by_index(l.master.unwrap()).await.unwrap().name
    });
    assert_eq!(master, "cni0");
    for v4 in [true, false] {
        pings(&a.ns, &addr_of(&rb, v4), 5);
        // Bridged: no hop.
        assert_eq!(reply_ttl(&a.ns, &addr_of(&rb, v4)), 64);
    }
    for (pod, cid, r) in [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)] {
        node.check_and_del(&bin("bridge"), pod, cid, &bc, r);
    }
    node.assert_nothing_left();
}

#[test]
fn fastpath_runs_on_the_netkit_peer_hook() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let (a, b, c) = (TestNs::new(), TestNs::new(), TestNs::new());
    let (nk, veth) = (ptp_conf(&node, "netkit"), ptp_conf(&node, "veth"));
    let ptp = bin("ptp");
    let fastpath = bin("fastpath");
    let pods = [
        (&a, "ctr-a", &nk),
        (&b, "ctr-b", &nk),
        // A veth pod beside them: its program sits on clsact.
        (&c, "ctr-c", &veth),
    ];
    let mut results = Vec::new();
    for (pod, cid, conf) in pods {
        let r = node.call(&ptp, "ADD", &pod.path(), cid, conf).ok();
        node.call(&fastpath, "ADD", &pod.path(), cid, &fp_conf(&fs, &r))
            .ok();
        results.push(r);
    }
    let [ra, rb, rc] = &results[..] else {
        unreachable!()
    };
    let (ha, hc) = (host_dev(ra, 0), host_dev(rc, 0));
    assert_eq!(
        peer_progs(&node, &ha).len(),
        1,
        "fast path on {ha}'s peer hook"
    );
    let filters = nl(&node.ns.ns, async |n| {
        let l = n.link_by_name(&ha).await.unwrap();
        n.ingress_bpf_filters(l.index).await.unwrap()
    });
    assert!(
        filters.is_empty(),
        "no tc filter on a netkit pod: {filters:?}"
    );
    assert_eq!(kind(&node.ns.ns, &hc).as_deref(), Some("veth"));
    let rows = fastpath_json(&node.ns.ns, fs.path(), "list");
    let hook_of = |r: &Value| {
        let a = addr_of(r, true);
        rows.iter().find(|x| x["address"] == a).unwrap()["hook"].clone()
    };
    assert_eq!(
        (hook_of(ra), hook_of(rc)),
        (json!("netkit"), json!("ingress"))
    );
    for (i, (pod, cid, _)) in pods.iter().enumerate() {
        let fc = fp_conf(&fs, &results[i]);
        node.call(&fastpath, "CHECK", &pod.path(), cid, &fc).ok();
    }

    // netkit to netkit, and netkit to veth and back: redirected both ways,
    // routed as the node would (TTL 63).
    for (from, from_r, to) in [(&a, ra, rb), (&a, ra, rc), (&c, rc, ra)] {
        for v4 in [true, false] {
            let (src, dst) = (addr_of(from_r, v4), addr_of(to, v4));
            let to_dst = counter(&node, &fs, &dst, "rxPackets");
            let to_src = counter(&node, &fs, &src, "rxPackets");
            pings(&from.ns, &dst, 50);
            let requests = counter(&node, &fs, &dst, "rxPackets") - to_dst;
            let replies = counter(&node, &fs, &src, "rxPackets") - to_src;
            assert!(requests >= 50, "{src} -> {dst}: {requests} redirected");
            assert!(replies >= 50, "{dst} -> {src}: {replies} redirected");
            assert_eq!(reply_ttl(&from.ns, &dst), 63);
        }
    }

    // DEL: the link off the hook, its pin gone; DEL again is fine.
    for (i, (pod, cid, conf)) in pods.iter().enumerate() {
        let fc = fp_conf(&fs, &results[i]);
        node.call(&fastpath, "DEL", &pod.path(), cid, &fc).ok();
        node.call(&fastpath, "DEL", &pod.path(), cid, &fc).ok();
        assert_eq!(
            node.call(&fastpath, "CHECK", &pod.path(), cid, &fc).err().0,
            106
        );
        node.call(&ptp, "DEL", &pod.path(), cid, conf).ok();
    }
    assert!(peer_progs(&node, &ha).is_empty());
    assert!(fastpath_json(&node.ns.ns, fs.path(), "list").is_empty());
    node.assert_nothing_left();
}

#[test]
fn attach_mode_netkit_needs_a_netkit_pod() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let a = TestNs::new();
    let pc = ptp_conf(&node, "veth");
    let r = node.call(&bin("ptp"), "ADD", &a.path(), "ctr-a", &pc).ok();
    let mut fc = fp_conf(&fs, &r);
    fc["attachMode"] = json!("netkit");
    let (code, msg) = node
        .call(&bin("fastpath"), "ADD", &a.path(), "ctr-a", &fc)
        .err();
    assert_eq!(code, 7, "{msg}");
    assert!(msg.contains("linkType netkit"), "{msg}");
    assert!(fastpath_json(&node.ns.ns, fs.path(), "list").is_empty());
    node.call(&bin("ptp"), "DEL", &a.path(), "ctr-a", &pc).ok();
    node.assert_nothing_left();
}

#[test]
fn policy_holds_for_netkit_pods_on_the_fast_path() {
    let node = Node::new();
    let fs = Bpffs::empty();
    let (state, policy_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let nk = ptp_conf(&node, "netkit");
    let policies = json!([{"name": "web", "podSelector": {"matchLabels": {"app": "web"}},
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}]}]}]);
    let policy_conf = |app: &str, prev: &Value| {
        json!({"cniVersion": "1.1.0", "name": "podnet", "type": "policy", "backend": "ebpf",
               "pinRoot": fs.root(), "dataDir": state.path(), "policyDir": policy_dir.path(),
               "policies": policies,
               "args": {"cni": {"labels": [{"key": "app", "value": app}], "namespace": "default"}},
               "prevResult": prev})
    };
    let apps = ["web", "client", "other"];
    let pods: Vec<TestNs> = apps.iter().map(|_| TestNs::new()).collect();
    let mut results = Vec::new();
    for (pod, app) in pods.iter().zip(apps) {
        let r = node.call(&bin("ptp"), "ADD", &pod.path(), app, &nk).ok();
        node.call(&bin("fastpath"), "ADD", &pod.path(), app, &fp_conf(&fs, &r))
            .ok();
        node.call(
            &bin("policy"),
            "ADD",
            &pod.path(),
            app,
            &policy_conf(app, &r),
        )
        .ok();
        node.call(
            &bin("policy"),
            "CHECK",
            &pod.path(),
            app,
            &policy_conf(app, &r),
        )
        .ok();
        results.push(r);
    }
    let (web, client, other) = (&pods[0], &pods[1], &pods[2]);
    for v4 in [true, false] {
        let to_web = addr_of(&results[0], v4);
        let redirected = counter(&node, &fs, &to_web, "rxPackets");
        pings(&client.ns, &to_web, 10);
        assert!(counter(&node, &fs, &to_web, "rxPackets") >= redirected + 10);
        assert!(
            !rcni_testkit::ping(&other.ns, &to_web),
            "other reached web past its policy ({})",
            if v4 { "IPv4" } else { "IPv6" }
        );
        // Nothing selects other: web reaches it.
        pings(&web.ns, &addr_of(&results[2], v4), 5);
    }
    for (i, (pod, app)) in pods.iter().zip(apps).enumerate() {
        let r = &results[i];
        node.call(
            &bin("policy"),
            "DEL",
            &pod.path(),
            app,
            &policy_conf(app, r),
        )
        .ok();
        node.call(&bin("fastpath"), "DEL", &pod.path(), app, &fp_conf(&fs, r))
            .ok();
        node.call(&bin("ptp"), "DEL", &pod.path(), app, &nk).ok();
    }
    node.assert_nothing_left();
}

/// bandwidth after fastpath on a netkit pod (10 Mbit/s each way): shaped
/// by departure time on the pod's netkit device and the node's primary,
/// the pod keeps the fast path (its packets redirected, deliveries to it
/// through the primary's fq), and the limits hold within 5 %: the bytes
/// on the wire at most the limit and the burst, the goodput at least 95 %
/// of what full frames carry at the limit. CHECK passes; DEL takes it all
/// off.
#[test]
fn bandwidth_shapes_netkit_pods_on_the_fast_path() {
    const MBIT: u64 = 1_000_000;
    let node = Node::new();
    let fs = Bpffs::empty();
    let (a, b) = (TestNs::new(), TestNs::new());
    let nk = ptp_conf(&node, "netkit");
    let (ptp, fastpath, bandwidth) = (bin("ptp"), bin("fastpath"), bin("bandwidth"));
    let ra = node.call(&ptp, "ADD", &a.path(), "ctr-a", &nk).ok();
    let rb = node.call(&ptp, "ADD", &b.path(), "ctr-b", &nk).ok();
    for (pod, cid, r) in [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)] {
        node.call(&fastpath, "ADD", &pod.path(), cid, &fp_conf(&fs, r))
            .ok();
    }
    let mut bw = json!({"cniVersion": "1.1.0", "name": "podnet", "type": "bandwidth",
        "ingressRate": 10 * MBIT, "ingressBurst": 256_000,
        "egressRate": 10 * MBIT, "egressBurst": 256_000});
    bw["prevResult"] = ra.clone();
    let r = node.call(&bandwidth, "ADD", &a.path(), "ctr-a", &bw).ok();
    assert_eq!(r["interfaces"], ra["interfaces"], "no IFB: {r}");
    node.call(&bandwidth, "CHECK", &a.path(), "ctr-a", &bw).ok();
    let ha = host_dev(&ra, 0);
    // Each side as `bandwidth` CHECK reads it: our fq, and an rcni_edt
    // instance whose configuration map can be read.
    let shaped_sides = || {
        [(&node.ns.ns, ha.clone()), (&a.ns, "eth0".to_string())].map(|(ns, dev)| {
            ns.run(move || rcni_ebpf::shape::shaping(&dev))
                .unwrap()
                .unwrap()
                .is_some()
        })
    };
    assert_eq!(shaped_sides(), [true, true], "host veth, pod");
    let (a_ip, b_ip) = (addr_of(&ra, true), addr_of(&rb, true));
    let tx0 = wire_bytes(&a.ns, "eth0", false);
    let t = std::time::Instant::now();
    let egress = iperf_rate(&a.ns, &b.ns, &b_ip, 5401, false);
    let tx_secs = t.elapsed().as_secs_f64();
    let (tx1, rx1) = (
        wire_bytes(&a.ns, "eth0", false),
        wire_bytes(&a.ns, "eth0", true),
    );
    let t = std::time::Instant::now();
    let ingress = iperf_rate(&a.ns, &b.ns, &b_ip, 5402, true);
    let rx_secs = t.elapsed().as_secs_f64();
    let rx2 = wire_bytes(&a.ns, "eth0", true);
    eprintln!("netkit pod shaped: egress {egress} bit/s, ingress {ingress} bit/s");
    for (what, bytes, secs, rate) in [
        ("egress", tx1 - tx0, tx_secs, egress),
        ("ingress", rx2 - rx1, rx_secs, ingress),
    ] {
        let bits = bytes as f64 * 8.0;
        let limit = 10.0 * MBIT as f64 * secs + 256_000.0;
        assert!(bits <= limit * 1.05, "{what}: {bits} bits in {secs:.1} s");
        assert!(
            rate as f64 >= 10.0 * MBIT as f64 * 0.95 * 1448.0 / 1514.0,
            "{what}: {rate} bit/s of goodput for a 10 Mbit/s limit"
        );
    }
    let rows = fastpath_json(&node.ns.ns, fs.path(), "list");
    let row = rows.iter().find(|r| r["address"] == a_ip).unwrap();
    assert_eq!(
        (&row["path"], &row["shaped"]),
        (&json!("fast"), &json!(true))
    );
    assert!(counter(&node, &fs, &a_ip, "rxPackets") > 1000);
    assert!(counter(&node, &fs, &a_ip, "txPackets") > 1000);

    // A takes its own shaping off (a pod with CAP_NET_ADMIN could): the
    // node's primary still polices the egress limit, in rcni_fastpath on
    // the peer hook.
    let primary = {
        let ha = ha.clone();
        node.ns
            .ns
            .run(move || nix::net::if_::if_nametoindex(ha.as_str()).unwrap())
            .unwrap()
    };
    let policer = || {
        rcni_ebpf::Datapath::open(&fs.path().join("podnet"))
            .unwrap()
            .unwrap()
            .policer(primary)
            .unwrap()
    };
    assert_eq!(policer().expect("no policer on the primary").dropped, 0);
    rcni_integration::egress_without_own_shaping(&a.ns, &b.ns, &b_ip, 5403, 10 * MBIT);
    assert!(policer().unwrap().dropped > 0);

    node.call(&bandwidth, "DEL", &a.path(), "ctr-a", &bw).ok();
    node.call(&bandwidth, "DEL", &a.path(), "ctr-a", &bw).ok();
    assert_eq!(policer(), None, "the policer outlived DEL");
    assert_eq!(shaped_sides(), [false, false], "host veth, pod");
    let rows = fastpath_json(&node.ns.ns, fs.path(), "list");
    let row = rows.iter().find(|r| r["address"] == a_ip).unwrap();
    assert_eq!(row["shaped"], false);
    for (pod, cid, r) in [(&a, "ctr-a", &ra), (&b, "ctr-b", &rb)] {
        node.call(&fastpath, "DEL", &pod.path(), cid, &fp_conf(&fs, r))
            .ok();
        node.call(&ptp, "DEL", &pod.path(), cid, &nk).ok();
    }
    node.assert_nothing_left();
}
