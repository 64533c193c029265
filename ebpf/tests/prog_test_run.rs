//! The fast path program's decisions and rewrites, run by the kernel on
//! hand-built packets with BPF_PROG_TEST_RUN. Needs root (CAP_BPF); loads a
//! private, unpinned copy of the program per test and touches no interface.
//!
//! In a test run the packet arrives on the loopback device of the test's
//! namespace (ifindex 1), so the source pods sit behind ifindex 1.

use aya::programs::{TestRun, TestRunOptions};
use rcni_ebpf::{Datapath, Endpoint, EndpointKey, TC_ACT_REDIRECT, TC_ACT_UNSPEC, Verdict};
use std::net::IpAddr;

const LO: u32 = 1;
const POD_A: [u8; 6] = [0x0a, 0x58, 0, 0, 0, 0x02];
const POD_B: [u8; 6] = [0x0a, 0x58, 0, 0, 0, 0x03];
/// A's gateway (a bridge, or A's host veth on ptp).
const GW_A: [u8; 6] = [0x02, 0xaa, 0, 0, 0, 0x01];
/// B's gateway: the same as A's on a bridge, B's host veth on ptp.
const GW_B: [u8; 6] = [0x02, 0xbb, 0, 0, 0, 0x01];
const B_IFINDEX: u32 = 4242;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "BPF_PROG_TEST_RUN needs root (CAP_BPF)"
    );
}

/// A's and B's addresses in both families, A behind lo.
fn datapath() -> Datapath {
    require_root();
    let mut dp = Datapath::load().expect("load the fast path program");
    for (a, b) in [("10.0.0.2", "10.0.0.3"), ("fd00::2", "fd00::3")] {
        dp.insert_endpoint(EndpointKey::new(ip(a)), Endpoint::new(LO, POD_A, GW_A, 1))
            .unwrap();
        dp.insert_endpoint(
            EndpointKey::new(ip(b)),
            Endpoint::new(B_IFINDEX, POD_B, GW_B, 2),
        )
        .unwrap();
    }
    dp
}

fn eth(dst: [u8; 6], src: [u8; 6], proto: u16) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&dst);
    p.extend_from_slice(&src);
    p.extend_from_slice(&proto.to_be_bytes());
    p
}

fn csum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for c in data.chunks(2) {
        let w = if c.len() == 2 {
            u16::from_be_bytes([c[0], c[1]])
        } else {
            u16::from_be_bytes([c[0], 0])
        };
        sum += w as u32;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Ethernet + IPv4 (TTL 64, protocol ICMP) + `payload`.
fn ipv4(dst_mac: [u8; 6], src: &str, dst: &str, ttl: u8, payload: &[u8]) -> Vec<u8> {
    let mut p = eth(dst_mac, POD_A, 0x0800);
    let total = (20 + payload.len()) as u16;
    let mut h = vec![0x45, 0];
    h.extend_from_slice(&total.to_be_bytes());
    h.extend_from_slice(&[0, 1, 0x40, 0, ttl, 1, 0, 0]);
    let (IpAddr::V4(s), IpAddr::V4(d)) = (ip(src), ip(dst)) else {
        panic!("v4")
    };
    h.extend_from_slice(&s.octets());
    h.extend_from_slice(&d.octets());
    let c = csum(&h);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    p.extend_from_slice(&h);
    p.extend_from_slice(payload);
    p
}

/// Ethernet + IPv6 (hop limit 64) + `next` header with `payload`.
fn ipv6(dst_mac: [u8; 6], src: &str, dst: &str, next: u8, payload: &[u8]) -> Vec<u8> {
    let mut p = eth(dst_mac, POD_A, 0x86dd);
    p.extend_from_slice(&[0x60, 0, 0, 0]);
    p.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    p.push(next);
    p.push(64);
    let (IpAddr::V6(s), IpAddr::V6(d)) = (ip(src), ip(dst)) else {
        panic!("v6")
    };
    p.extend_from_slice(&s.octets());
    p.extend_from_slice(&d.octets());
    p.extend_from_slice(payload);
    p
}

const ICMP_ECHO: &[u8] = &[8, 0, 0xf7, 0xff, 0, 0, 0, 0, b'r', b'c', b'n', b'i'];
const ICMPV6_ECHO: &[u8] = &[128, 0, 0, 0, 0, 1, 0, 1, b'r', b'c', b'n', b'i'];

/// Runs the program on `pkt`: (return value, packet after the run).
fn run(dp: &mut Datapath, pkt: &[u8]) -> (u32, Vec<u8>) {
    let mut out = vec![0u8; pkt.len() + 256];
    let r = dp
        .program()
        .test_run(TestRunOptions {
            data_in: Some(pkt),
            data_out: Some(&mut out),
            ..TestRunOptions::new()
        })
        .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN on {} bytes: {e:?}", pkt.len()));
    out.truncate(r.data_size_out as usize);
    (r.return_value, out)
}

fn verdict(dp: &Datapath, v: Verdict) -> u64 {
    dp.verdicts()
        .unwrap()
        .into_iter()
        .find(|(k, _)| *k == v)
        .unwrap()
        .1
}

#[test]
fn local_ipv4_sent_to_the_pods_mac_is_redirected_unchanged() {
    let mut dp = datapath();
    let pkt = ipv4(POD_B, "10.0.0.2", "10.0.0.3", 64, ICMP_ECHO);
    let (ret, out) = run(&mut dp, &pkt);
    assert_eq!(ret, TC_ACT_REDIRECT);
    // Bridged: the bridge would forward the frame as it is.
    assert_eq!(out, pkt);
    let b = dp.stats(&EndpointKey::new(ip("10.0.0.3"))).unwrap();
    assert_eq!((b.rx_packets, b.rx_bytes), (1, pkt.len() as u64));
    let a = dp.stats(&EndpointKey::new(ip("10.0.0.2"))).unwrap();
    assert_eq!(
        (a.tx_packets, a.tx_bytes, a.rx_packets),
        (1, pkt.len() as u64, 0)
    );
    assert_eq!(verdict(&dp, Verdict::Redirect), 1);
}

#[test]
fn local_ipv4_via_the_gateway_is_routed_ttl_and_macs_rewritten() {
    let mut dp = datapath();
    let pkt = ipv4(GW_A, "10.0.0.2", "10.0.0.3", 64, ICMP_ECHO);
    let (ret, out) = run(&mut dp, &pkt);
    assert_eq!(ret, TC_ACT_REDIRECT);
    assert_eq!(out.len(), pkt.len());
    // As the node would send it to B: from B's gateway to B's MAC.
    assert_eq!(&out[0..6], &POD_B);
    assert_eq!(&out[6..12], &GW_B);
    assert_eq!(&out[12..14], &pkt[12..14]);
    let (h_in, h_out) = (&pkt[14..34], &out[14..34]);
    assert_eq!(h_out[8], 63, "TTL decremented");
    assert_eq!(csum(h_out), 0, "IPv4 header checksum still valid");
    // Nothing else in the header or payload changed.
    let mut h = h_out.to_vec();
    h[8] = h_in[8];
    h[10..12].copy_from_slice(&h_in[10..12]);
    assert_eq!(h, h_in);
    assert_eq!(&out[34..], &pkt[34..]);
    assert_eq!(
        dp.stats(&EndpointKey::new(ip("10.0.0.3")))
            .unwrap()
            .rx_packets,
        1
    );
}

#[test]
fn local_ipv6_routed_and_bridged() {
    let mut dp = datapath();
    let routed = ipv6(GW_A, "fd00::2", "fd00::3", 58, ICMPV6_ECHO);
    let (ret, out) = run(&mut dp, &routed);
    assert_eq!(ret, TC_ACT_REDIRECT);
    assert_eq!(&out[0..6], &POD_B);
    assert_eq!(&out[6..12], &GW_B);
    assert_eq!(out[14 + 7], 63, "hop limit decremented");
    let mut rest = out[14..].to_vec();
    rest[7] = 64;
    assert_eq!(rest, routed[14..]);

    let bridged = ipv6(POD_B, "fd00::2", "fd00::3", 58, ICMPV6_ECHO);
    let (ret, out) = run(&mut dp, &bridged);
    assert_eq!(ret, TC_ACT_REDIRECT);
    assert_eq!(out, bridged);
    let b = dp.stats(&EndpointKey::new(ip("fd00::3"))).unwrap();
    assert_eq!(b.rx_packets, 2);
    assert_eq!(b.rx_bytes, (routed.len() + bridged.len()) as u64);
}

#[test]
fn unknown_destination_takes_the_normal_path() {
    let mut dp = datapath();
    for pkt in [
        ipv4(GW_A, "10.0.0.2", "10.0.0.99", 64, ICMP_ECHO),
        // Another node's pod, the internet.
        ipv4(GW_A, "10.0.0.2", "192.0.2.1", 64, ICMP_ECHO),
        ipv6(GW_A, "fd00::2", "fd00::99", 58, ICMPV6_ECHO),
    ] {
        let (ret, out) = run(&mut dp, &pkt);
        assert_eq!(ret, TC_ACT_UNSPEC);
        assert_eq!(out, pkt, "passed packets are not touched");
    }
    assert_eq!(verdict(&dp, Verdict::UnknownDst), 3);
    assert_eq!(verdict(&dp, Verdict::Redirect), 0);
}

#[test]
fn arp_takes_the_normal_path() {
    let mut dp = datapath();
    let mut pkt = eth([0xff; 6], POD_A, 0x0806);
    // Who has 10.0.0.3? Tell 10.0.0.2.
    pkt.extend_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 1]);
    pkt.extend_from_slice(&POD_A);
    pkt.extend_from_slice(&[10, 0, 0, 2]);
    pkt.extend_from_slice(&[0; 6]);
    pkt.extend_from_slice(&[10, 0, 0, 3]);
    let (ret, out) = run(&mut dp, &pkt);
    assert_eq!(ret, TC_ACT_UNSPEC);
    assert_eq!(out, pkt);
    // Unicast ARP (a neighbour refresh) too.
    let mut uni = pkt.clone();
    uni[0..6].copy_from_slice(&POD_B);
    assert_eq!(run(&mut dp, &uni).0, TC_ACT_UNSPEC);
    assert_eq!(verdict(&dp, Verdict::NotIp), 2);
}

#[test]
fn too_short_packets_take_the_normal_path() {
    let mut dp = datapath();
    // A complete IPv6 header announcing ICMPv6, without the ICMPv6 type the
    // program reads to keep neighbour discovery on the normal path.
    let full6 = ipv6(POD_B, "fd00::2", "fd00::3", 58, ICMPV6_ECHO);
    let cut = &full6[..54];
    let (ret, out) = run(&mut dp, cut);
    assert_eq!(ret, TC_ACT_UNSPEC);
    assert_eq!(out, cut);
    // An IHL below 5 is no IPv4 header.
    let mut bad = ipv4(POD_B, "10.0.0.2", "10.0.0.3", 64, ICMP_ECHO);
    bad[14] = 0x44;
    assert_eq!(run(&mut dp, &bad).0, TC_ACT_UNSPEC);
    assert_eq!(verdict(&dp, Verdict::Short), 2);
    // Frames cut inside the IPv4 or IPv6 header: this kernel's test run
    // refuses them itself (EINVAL, it checks the network header); a kernel
    // that runs them must see them passed.
    let full = ipv4(POD_B, "10.0.0.2", "10.0.0.3", 64, &[]);
    for pkt in [&full[..24], &full[..15], &full6[..40]] {
        let mut out = vec![0u8; 512];
        match dp.program().test_run(TestRunOptions {
            data_in: Some(pkt),
            data_out: Some(&mut out),
            ..TestRunOptions::new()
        }) {
            Ok(r) => assert_eq!(r.return_value, TC_ACT_UNSPEC, "{} bytes", pkt.len()),
            Err(e) => assert!(format!("{e:?}").contains("code: 22"), "{e:?}"),
        }
    }
    assert_eq!(verdict(&dp, Verdict::Redirect), 0);
}

#[test]
fn neighbour_discovery_and_expiring_ttl_take_the_normal_path() {
    let mut dp = datapath();
    // A unicast neighbour solicitation to B (reachability probe).
    let mut ns = vec![135, 0, 0, 0, 0, 0, 0, 0];
    ns.extend_from_slice(&ip6_octets("fd00::3"));
    let pkt = ipv6(POD_B, "fd00::2", "fd00::3", 58, &ns);
    assert_eq!(run(&mut dp, &pkt).0, TC_ACT_UNSPEC);
    // TTL 1 through the gateway: the node must answer time exceeded.
    let pkt = ipv4(GW_A, "10.0.0.2", "10.0.0.3", 1, ICMP_ECHO);
    let (ret, out) = run(&mut dp, &pkt);
    assert_eq!(ret, TC_ACT_UNSPEC);
    assert_eq!(out, pkt);
    // ... but bridged, TTL 1 is fine: nothing routes it.
    let pkt = ipv4(POD_B, "10.0.0.2", "10.0.0.3", 1, ICMP_ECHO);
    assert_eq!(run(&mut dp, &pkt).0, TC_ACT_REDIRECT);
    // A group destination MAC goes to the bridge.
    let pkt = ipv4([0xff; 6], "10.0.0.2", "10.0.0.3", 64, ICMP_ECHO);
    assert_eq!(run(&mut dp, &pkt).0, TC_ACT_UNSPEC);
    assert_eq!(verdict(&dp, Verdict::Other), 3);
}

fn ip6_octets(s: &str) -> [u8; 16] {
    match ip(s) {
        IpAddr::V6(v) => v.octets(),
        IpAddr::V4(_) => panic!("v6"),
    }
}

#[test]
fn sources_that_are_not_the_veths_endpoint_take_the_normal_path() {
    let mut dp = datapath();
    // Not an endpoint at all.
    let pkt = ipv4(POD_B, "10.0.0.50", "10.0.0.3", 64, ICMP_ECHO);
    assert_eq!(run(&mut dp, &pkt).0, TC_ACT_UNSPEC);
    // B's address, but from A's veth (spoofed).
    let pkt = ipv4(POD_B, "10.0.0.3", "10.0.0.2", 64, ICMP_ECHO);
    assert_eq!(run(&mut dp, &pkt).0, TC_ACT_UNSPEC);
    assert_eq!(verdict(&dp, Verdict::UnknownSrc), 2);
    // A routed packet to a MAC that is neither B's nor A's gateway.
    let pkt = ipv4(GW_B, "10.0.0.2", "10.0.0.3", 64, ICMP_ECHO);
    assert_eq!(run(&mut dp, &pkt).0, TC_ACT_UNSPEC);
    // Hairpin: to an endpoint behind the same veth.
    dp.insert_endpoint(
        EndpointKey::new(ip("10.0.0.4")),
        Endpoint::new(LO, POD_A, GW_A, 1),
    )
    .unwrap();
    let pkt = ipv4(GW_A, "10.0.0.2", "10.0.0.4", 64, ICMP_ECHO);
    assert_eq!(run(&mut dp, &pkt).0, TC_ACT_UNSPEC);
    assert_eq!(verdict(&dp, Verdict::Other), 2);
}

#[test]
fn removed_endpoints_stop_the_redirect_and_their_counters() {
    let mut dp = datapath();
    let key = EndpointKey::new(ip("10.0.0.3"));
    let pkt = ipv4(POD_B, "10.0.0.2", "10.0.0.3", 64, ICMP_ECHO);
    assert_eq!(run(&mut dp, &pkt).0, TC_ACT_REDIRECT);
    assert!(dp.endpoint(&key).unwrap().is_some());
    dp.remove_endpoint(&key).unwrap();
    // Idempotent.
    dp.remove_endpoint(&key).unwrap();
    assert_eq!(dp.endpoint(&key).unwrap(), None);
    assert_eq!(run(&mut dp, &pkt).0, TC_ACT_UNSPEC);
    assert_eq!(dp.stats(&key).unwrap().rx_packets, 0);
    let listed: Vec<IpAddr> = dp
        .endpoints()
        .unwrap()
        .iter()
        .filter_map(|(k, _)| k.ip())
        .collect();
    assert_eq!(listed.len(), 3);
    assert!(!listed.contains(&ip("10.0.0.3")));
    // Back again: its old counter slot, counting from zero.
    let slots: Vec<u32> = dp
        .endpoints()
        .unwrap()
        .iter()
        .map(|(_, e)| e.slot)
        .collect();
    dp.insert_endpoint(key, Endpoint::new(B_IFINDEX, POD_B, GW_B, 2))
        .unwrap();
    let back = dp.endpoint(&key).unwrap().unwrap();
    assert!(!slots.contains(&back.slot), "slot {} is taken", back.slot);
    assert_eq!(dp.stats(&key).unwrap(), Default::default());
    assert_eq!(run(&mut dp, &pkt).0, TC_ACT_REDIRECT);
    assert_eq!(dp.stats(&key).unwrap().rx_packets, 1);
    // Replacing an endpoint keeps its slot.
    dp.insert_endpoint(key, Endpoint::new(B_IFINDEX, POD_B, GW_B, 3))
        .unwrap();
    let again = dp.endpoint(&key).unwrap().unwrap();
    assert_eq!((again.slot, again.owner), (back.slot, 3));
}

/// The program's own cost per packet (the kernel's average over a million
/// runs): `cargo nextest run -p rcni-ebpf --run-ignored only program_cost`.
#[test]
#[ignore = "a measurement, not a check"]
fn program_cost() {
    let mut dp = datapath();
    for (what, pkt) in [
        (
            "bridged v4",
            ipv4(POD_B, "10.0.0.2", "10.0.0.3", 64, ICMP_ECHO),
        ),
        (
            "routed v4",
            ipv4(GW_A, "10.0.0.2", "10.0.0.3", 64, ICMP_ECHO),
        ),
        (
            "routed v6",
            ipv6(GW_A, "fd00::2", "fd00::3", 58, ICMPV6_ECHO),
        ),
        (
            "unknown v4",
            ipv4(GW_A, "10.0.0.2", "10.0.0.99", 64, ICMP_ECHO),
        ),
    ] {
        let r = dp
            .program()
            .test_run(TestRunOptions {
                data_in: Some(&pkt),
                repeat: 1_000_000,
                ..TestRunOptions::new()
            })
            .unwrap();
        eprintln!("{what}: {} ns per run", r.duration.as_nanos());
    }
}
