//! bandwidth: iperf3 transfers through the shaped veth measure the
//! configured rates in both directions; CHECK, DEL, GC; and interop with
//! the reference's TBF/IFB layout.

use rcni_integration::lab::chain::*;
use rcni_testkit::{TestNs, bin, reference_bin};
use serde_json::{Value, json};

const MBIT: u64 = 1_000_000;

fn chain(lan: &Lan, version: &str, bw: Value) -> Chain {
    let b = json!({"type": "bandwidth", "capabilities": {"bandwidth": true}});
    lan.chain_with(version, b, bw)
}

/// Bits per second the receiving side saw in a 2 s iperf3 TCP run from
/// `pod` to the client (`reverse`: from the client to the pod).
fn iperf(lan: &Lan, pod: &TestNs, port: u16, reverse: bool) -> u64 {
    let _server = rcni_testkit::IperfServer::start(&lan.client.ns, None, port);
    let mut args = vec!["-c", CLIENT_V4, "-p", "", "-t", "2", "-J"];
    let p = port.to_string();
    args[3] = &p;
    if reverse {
        args.push("-R");
    }
    let out = rcni_testkit::command_in(&pod.ns, "iperf3")
        .args(&args)
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "iperf3 output ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or_else(|| panic!("no result: {v}")) as u64
}

#[test]
fn iperf3_measures_the_configured_rates() {
    let lan = Lan::new();
    let c = chain(&lan, "1.0.0", json!({})).caps(json!({"bandwidth": {
        "ingressRate": 20 * MBIT, "ingressBurst": 256_000,
        "egressRate": 10 * MBIT, "egressBurst": 256_000}}));
    let pod = TestNs::new();
    let r = c.add(&lan, &pod.path(), "pod-bw", "eth0");
    let ifb = super_ifb(&r);
    assert!(ifb.starts_with("bwp"), "{r}");
    let egress = iperf(&lan, &pod, 5301, false);
    let ingress = iperf(&lan, &pod, 5302, true);
    assert!(
        (5 * MBIT..13 * MBIT).contains(&egress),
        "egress measured {egress} bit/s for a 10 Mbit/s limit"
    );
    assert!(
        (10 * MBIT..26 * MBIT).contains(&ingress),
        "ingress measured {ingress} bit/s for a 20 Mbit/s limit"
    );
    c.check_ok(&lan, &pod, "pod-bw", &r);
    c.del_pod(&lan, &pod, "pod-bw", &r);
    assert!(!node_links(&lan).contains("bwp"));

    // Unshaped, the same path is far faster: the limits were the cause.
    let plain = c.only(0);
    let pod2 = TestNs::new();
    let r2 = plain.add(&lan, &pod2.path(), "pod-plain", "eth0");
    let free = iperf(&lan, &pod2, 5303, false);
    assert!(free > 100 * MBIT, "unshaped transfer only {free} bit/s");
    plain.del_pod(&lan, &pod2, "pod-plain", &r2);
}

fn super_ifb(r: &Value) -> String {
    r["interfaces"].as_array().unwrap().last().unwrap()["name"]
        .as_str()
        .unwrap()
        .to_string()
}

fn qdiscs(lan: &Lan, dev: &str) -> String {
    lan.on_node("tc", &["qdisc", "show", "dev", dev])
}

/// Whether `dev` has a TBF qdisc, with the qdiscs it has.
fn tbf_on(lan: &Lan, dev: &str) -> (bool, String) {
    let q = qdiscs(lan, dev);
    (q.contains("tbf"), q)
}

fn node_links(lan: &Lan) -> String {
    lan.on_node("ip", &["link"])
}

#[test]
fn check_del_and_the_references_layout() {
    let lan = Lan::new();
    let limits = json!({"ingressRate": 8 * MBIT, "ingressBurst": 80_000, "egressRate": 4 * MBIT, "egressBurst": 40_000});
    let c = chain(&lan, "1.0.0", limits);
    let pod = TestNs::new();
    let br_only = c.only(0);
    let br = br_only.add(&lan, &pod.path(), "pod-x", "eth0");
    let veth = host_veth(&br);
    let conf = c.stdin(1, Some(&br));
    for (adder, checker, deleter) in [
        (
            bin("bandwidth"),
            reference_bin("bandwidth"),
            reference_bin("bandwidth"),
        ),
        (
            reference_bin("bandwidth"),
            bin("bandwidth"),
            bin("bandwidth"),
        ),
    ] {
        let r = lan.run(&adder, "ADD", &pod, "pod-x", &conf).ok();
        let ifb = super_ifb(&r);
        let (shaped, q) = tbf_on(&lan, &veth);
        assert!(shaped, "{q}");
        assert!(tbf_on(&lan, &ifb).0);
        let filters = lan.on_node("tc", &["filter", "show", "dev", &veth, "ingress"]);
        assert!(
            filters.contains("protocol all") && filters.contains(&ifb),
            "{filters}"
        );
        let mut check_conf = c.stdin(1, Some(&r));
        check_conf["cniVersion"] = json!("1.0.0");
        assert_checks(&lan, &checker, &adder, &pod, "pod-x", &check_conf);
        assert_success(&lan.run(&deleter, "DEL", &pod, "pod-x", &check_conf));
        assert!(
            !node_links(&lan).contains(&ifb),
            "{} left {ifb}",
            deleter.display()
        );
        // Ours also leaves the surviving veth unshaped.
        if deleter == bin("bandwidth") {
            let (shaped, q) = tbf_on(&lan, &veth);
            assert!(!shaped, "{q}");
        } else {
            for parent in ["root", "ingress"] {
                lan.on_node("tc", &["qdisc", "del", "dev", &veth, parent]);
            }
        }
    }

    // CHECK notices a changed rate.
    let r = lan.run(&bin("bandwidth"), "ADD", &pod, "pod-x", &conf).ok();
    lan.on_node_ok(
        "tc",
        &[
            "qdisc", "change", "dev", &veth, "root", "handle", "1:", "tbf", "rate", "1mbit",
            "burst", "10kb", "latency", "25ms",
        ],
    );
    let (code, msg) = c.run(&lan, 1, "CHECK", &pod, "pod-x", Some(&r)).err();
    assert_eq!(code, 106, "{msg}");
    // DEL twice, and without netns.
    for netns in [Some(pod.path()), None] {
        let conf = c.stdin(1, Some(&r));
        let out = lan.call(
            &bin("bandwidth"),
            "DEL",
            netns.as_deref(),
            "pod-x",
            "eth0",
            &conf,
        );
        assert_success(&out);
    }
    br_only.del_pod(&lan, &pod, "pod-x", &br);
}

#[test]
fn gc_removes_ifbs_of_stale_attachments() {
    let lan = Lan::new();
    let limits = json!({"egressRate": 4 * MBIT, "egressBurst": 40_000});
    let c = chain(&lan, "1.1.0", limits);
    let (a, b) = (TestNs::new(), TestNs::new());
    let ra = c.add(&lan, &a.path(), "pod-a", "eth0");
    let rb = c.add(&lan, &b.path(), "pod-b", "eth0");
    let (ifa, ifb) = (super_ifb(&ra), super_ifb(&rb));
    c.only(1).gc(&lan, &[("pod-a", "eth0")]);
    let links = node_links(&lan);
    assert!(links.contains(&ifa) && !links.contains(&ifb), "{links}");
    c.del_pod(&lan, &a, "pod-a", &ra);
    c.del_pod(&lan, &b, "pod-b", &rb);
}

#[test]
fn validation_versions_and_pass_through() {
    let lan = Lan::new();
    let pod = TestNs::new();
    let c = chain(&lan, "1.0.0", json!({"egressRate": 1000}));
    let br_only = c.only(0);
    let br = br_only.add(&lan, &pod.path(), "pod-v", "eth0");
    let (code, msg) = c.run(&lan, 1, "ADD", &pod, "pod-v", Some(&br)).err();
    assert_eq!(code, 7);
    assert!(msg.contains("burst"), "{msg}");
    // No limits: the result passes through unchanged, nothing is made.
    let none = chain(&lan, "1.0.0", json!({}));
    let out = none.run(&lan, 1, "ADD", &pod, "pod-v", Some(&br)).ok();
    assert_eq!(out, br);
    let mut old = none.stdin(1, Some(&br));
    old["cniVersion"] = json!("0.2.0");
    old.as_object_mut().unwrap().remove("prevResult");
    let (code, _) = lan.run(&bin("bandwidth"), "ADD", &pod, "pod-v", &old).err();
    assert_eq!(code, 1);
    let v = version_of("bandwidth");
    assert_eq!(v["supportedVersions"][0], "0.3.0");
    br_only.del_pod(&lan, &pod, "pod-v", &br);
}

/// A runtime whose ADD was killed has no result to pass to DEL. The
/// egress redirect must still go before the IFB it points at: left behind,
/// the kernel's mirred drops everything the pod sends until its veth is
/// deleted, a dhcp IPAM's DHCPRELEASE later in the same DEL included (how
/// dnsmasq kept leases of killed pods).
#[test]
fn del_without_a_cached_result_leaves_the_pods_egress_working() {
    let lan = Lan::new();
    let limits = json!({"ingressRate": 8 * MBIT, "ingressBurst": 80_000,
                        "egressRate": 4 * MBIT, "egressBurst": 40_000});
    let c = chain(&lan, "1.0.0", limits);
    let pod = TestNs::new();
    let r = c.add(&lan, &pod.path(), "pod-k", "eth0");
    let (veth, ifb) = (host_veth(&r), super_ifb(&r));
    assert!(rcni_testkit::ping(&pod.ns, CLIENT_V4));
    let no_result = c.stdin(1, None);
    assert_success(&lan.run(&bin("bandwidth"), "DEL", &pod, "pod-k", &no_result));
    assert!(!node_links(&lan).contains(&ifb));
    let q = qdiscs(&lan, &veth);
    assert!(!q.contains("tbf") && !q.contains("ingress"), "{q}");
    assert!(
        rcni_testkit::ping(&pod.ns, CLIENT_V4),
        "the pod's packets went to the deleted {ifb}"
    );
    // Again, with nothing left to remove.
    assert_success(&lan.run(&bin("bandwidth"), "DEL", &pod, "pod-k", &no_result));
    c.only(0).del_pod(&lan, &pod, "pod-k", &r);
}
