//! The programs' decisions and rewrites, run by the kernel on hand-built
//! packets with BPF_PROG_TEST_RUN: the fast path, then network policy.
//! Needs root (CAP_BPF); loads a private, unpinned copy of the programs per
//! test and touches no interface (the last tests make their own in a
//! throwaway namespace, and a bpffs of their own).
//!
//! In a test run the packet arrives on the loopback device of the test's
//! namespace (ifindex 1), so the pods whose host veth the program runs on
//! sit behind ifindex 1.

use aya::programs::{TestRun, TestRunOptions};
use rcni_ebpf::{
    AttachmentId, CT_EGRESS, CT_INGRESS, CtKey, Datapath, EP_FASTPATH, EP_POLICY, Endpoint,
    EndpointKey, Hook, PORT_FASTPATH, PORT_POLICY, PORTSET_ALL, PORTSET_NONE, PortRange, Program,
    RemoteHop, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC, Verdict,
};
use rcni_testkit::{Bpffs, require_root};
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
    ipv4_proto(dst_mac, src, dst, ttl, 1, payload)
}

/// Ethernet + IPv4 (DF, TTL `ttl`, protocol `proto`) + `payload`.
fn ipv4_proto(
    dst_mac: [u8; 6],
    src: &str,
    dst: &str,
    ttl: u8,
    proto: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut p = eth(dst_mac, POD_A, 0x0800);
    let total = (20 + payload.len()) as u16;
    let mut h = vec![0x45, 0];
    h.extend_from_slice(&total.to_be_bytes());
    h.extend_from_slice(&[0, 1, 0x40, 0, ttl, proto, 0, 0]);
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
/// [`ICMP_ECHO`] from another socket (identifier 1).
const ICMP_ECHO_ID1: &[u8] = &[8, 0, 0xf6, 0xff, 0, 1, 0, 0, b'r', b'c', b'n', b'i'];

/// Runs the fast path on `pkt`: (return value, packet after the run).
fn run(dp: &mut Datapath, pkt: &[u8]) -> (u32, Vec<u8>) {
    run_prog(dp, Program::Fastpath, pkt, 0)
}

/// Runs `prog` on `pkt`, as if it had come into the node on
/// `ingress_ifindex` (0: sent by the node itself).
fn run_prog(dp: &mut Datapath, prog: Program, pkt: &[u8], ingress_ifindex: u32) -> (u32, Vec<u8>) {
    run_prog_on(dp, prog, pkt, ingress_ifindex, 0)
}

/// [`run_prog`] on the device with index `ifindex` of the calling thread's
/// namespace (0 or 1: its lo).
fn run_prog_on(
    dp: &mut Datapath,
    prog: Program,
    pkt: &[u8],
    ingress_ifindex: u32,
    ifindex: u32,
) -> (u32, Vec<u8>) {
    let mut out = vec![0u8; pkt.len() + 256];
    // struct __sk_buff up to ifindex: ingress_ifindex at offset 36, ifindex
    // at 40, the rest zero (what the kernel requires of a test run's
    // context).
    let mut ctx = [0u8; 44];
    ctx[36..40].copy_from_slice(&ingress_ifindex.to_ne_bytes());
    ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
    let r = dp
        .program_of(prog)
        .test_run(TestRunOptions {
            data_in: Some(pkt),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx),
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

#[test]
fn shaped_endpoints_and_foreign_source_macs_keep_the_normal_path() {
    let mut dp = datapath();
    let (a, b) = (
        EndpointKey::new(ip("10.0.0.2")),
        EndpointKey::new(ip("10.0.0.3")),
    );
    let pkt = ipv4(POD_B, "10.0.0.2", "10.0.0.3", 64, ICMP_ECHO);
    // A source MAC not the pod's: the bridge judges it (macspoofchk).
    let mut spoofed = pkt.clone();
    spoofed[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 0x99]);
    let (ret, out) = run(&mut dp, &spoofed);
    assert_eq!((ret, out), (TC_ACT_UNSPEC, spoofed));
    assert_eq!(verdict(&dp, Verdict::Other), 1);
    // B shaped: nothing is redirected to it...
    let b_ep = Endpoint::new(B_IFINDEX, POD_B, GW_B, 2);
    dp.insert_endpoint(b, b_ep.normal_path(true)).unwrap();
    assert_eq!(run(&mut dp, &pkt), (TC_ACT_UNSPEC, pkt.clone()));
    // ... A shaped instead (bandwidth after fastpath): nothing from it.
    dp.insert_endpoint(b, b_ep).unwrap();
    assert_eq!(dp.keep_on_normal_path(LO).unwrap(), 2, "A's two addresses");
    assert_eq!(run(&mut dp, &pkt).0, TC_ACT_UNSPEC);
    assert_eq!(verdict(&dp, Verdict::NormalPath), 2);
    assert_eq!(verdict(&dp, Verdict::Redirect), 0);
    // The policy plugin's writes keep the mark; the fast path's own ADD
    // sets it as it finds the veth.
    dp.set_policy_endpoint(&[a], LO, 1, 7, 0, 0).unwrap();
    assert!(dp.endpoint(&a).unwrap().unwrap().keeps_normal_path());
    dp.insert_endpoint(a, Endpoint::new(LO, POD_A, GW_A, 1))
        .unwrap();
    let now = dp.endpoint(&a).unwrap().unwrap();
    assert!(!now.keeps_normal_path() && now.identity == 7);
    assert_eq!(run(&mut dp, &pkt).0, TC_ACT_REDIRECT);
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

// ---- policy ----
//
// A (10.0.0.2, fd00::2) sits behind lo, where the programs run: rcni_pol_out
// sees what A sends (A's egress point), rcni_pol_in what A receives (A's
// ingress point), and the fast path redirects from A to B.

const A_ID: u32 = 100;
const B_ID: u32 = 200;
const A_OWNER: u64 = 1;
const B_OWNER: u64 = 2;
const TCP: u8 = 6;
const UDP: u8 = 17;

/// [`datapath`] with both pods known to the policy plugin as well, selected
/// by no rule set.
fn policy_datapath() -> Datapath {
    let mut dp = datapath();
    for (a, b) in [("10.0.0.2", "10.0.0.3"), ("fd00::2", "fd00::3")] {
        dp.set_policy_endpoint(&[key(a)], LO, A_OWNER, A_ID, 0, 0)
            .unwrap();
        dp.set_policy_endpoint(&[key(b)], B_IFINDEX, B_OWNER, B_ID, 0, 0)
            .unwrap();
    }
    dp.set_enforcing(true).unwrap();
    dp
}

fn key(a: &str) -> EndpointKey {
    EndpointKey::new(ip(a))
}

/// Gives A rule sets (0: not selected), for both its addresses.
fn select_a(dp: &mut Datapath, ingress_rs: u32, egress_rs: u32) {
    dp.set_policy_endpoint(
        &[key("10.0.0.2"), key("fd00::2")],
        LO,
        A_OWNER,
        A_ID,
        ingress_rs,
        egress_rs,
    )
    .unwrap();
}

/// [`policy_datapath`] with A selected by these rule sets.
fn a_selected(ingress_rs: u32, egress_rs: u32) -> Datapath {
    let mut dp = policy_datapath();
    select_a(&mut dp, ingress_rs, egress_rs);
    dp
}

fn ports(sport: u16, dport: u16) -> Vec<u8> {
    let mut p = sport.to_be_bytes().to_vec();
    p.extend_from_slice(&dport.to_be_bytes());
    p
}

/// A UDP datagram (8-byte header, checksum 0).
fn udp(src: &str, dst: &str, sport: u16, dport: u16) -> Vec<u8> {
    let mut h = ports(sport, dport);
    h.extend_from_slice(&[0, 12, 0, 0, b'r', b'c', b'n', b'i']);
    if ip(src).is_ipv4() {
        ipv4_proto(GW_A, src, dst, 64, UDP, &h)
    } else {
        ipv6(GW_A, src, dst, UDP, &h)
    }
}

/// A TCP SYN (the checksum is not checked on this path).
fn tcp(src: &str, dst: &str, sport: u16, dport: u16) -> Vec<u8> {
    let mut h = ports(sport, dport);
    h.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0]);
    if ip(src).is_ipv4() {
        ipv4_proto(GW_A, src, dst, 64, TCP, &h)
    } else {
        ipv6(GW_A, src, dst, TCP, &h)
    }
}

/// An ICMP echo request (8) or reply (0) with identifier `id`.
fn echo(src: &str, dst: &str, ty: u8, id: u16) -> Vec<u8> {
    let mut h = vec![ty, 0, 0, 0];
    h.extend_from_slice(&id.to_be_bytes());
    h.extend_from_slice(&[0, 1]);
    ipv4(GW_A, src, dst, 64, &h)
}

/// A's egress point: rcni_pol_out on a packet A sends.
fn out(dp: &mut Datapath, pkt: &[u8]) -> u32 {
    let (ret, after) = run_prog(dp, Program::PolicyOut, pkt, 0);
    assert_eq!(after, pkt, "policy never rewrites");
    ret
}

/// A's ingress point: rcni_pol_in on a packet forwarded to A from B's
/// host veth.
fn into_a(dp: &mut Datapath, pkt: &[u8]) -> u32 {
    run_prog(dp, Program::PolicyIn, pkt, B_IFINDEX).0
}

const PASS: u32 = TC_ACT_UNSPEC;
const DROP: u32 = TC_ACT_SHOT;

/// The packet of a flow, written much as tcpdump sums one up: "tcp
/// 10.0.0.2:40000 > 10.0.0.3:80" (a SYN), "udp [fd00::2]:53 >
/// [fd00::3]:5353", and ICMP echo requests and replies "echo 10.0.0.2 >
/// 10.0.0.3 id 7", "reply 10.0.0.3 > 10.0.0.2 id 0x1234".
fn flow(spec: &str) -> Vec<u8> {
    let sock = |s: &str| {
        let a: std::net::SocketAddr = s.parse().unwrap_or_else(|e| panic!("{s}: {e}"));
        (a.ip().to_string(), a.port())
    };
    match spec.split_whitespace().collect::<Vec<_>>()[..] {
        [proto @ ("tcp" | "udp"), src, ">", dst] => {
            let ((s, sport), (d, dport)) = (sock(src), sock(dst));
            let make = if proto == "tcp" { tcp } else { udp };
            make(&s, &d, sport, dport)
        }
        [kind @ ("echo" | "reply"), src, ">", dst, "id", id] => {
            let id = match id.strip_prefix("0x") {
                Some(hex) => u16::from_str_radix(hex, 16),
                None => id.parse(),
            };
            echo(src, dst, if kind == "echo" { 8 } else { 0 }, id.unwrap())
        }
        _ => panic!("not a flow: {spec:?}"),
    }
}

/// Policy verdicts checked from a table.
trait Check {
    /// Runs each case's packet at its point, in turn (earlier packets
    /// record the flows later ones meet), and asserts its verdict. A case
    /// is "<point> <flow>" ([`flow`]); the points: `out`, A's egress
    /// ([`out`]); `in`, A's ingress ([`into_a`]); `node-in`, A's ingress
    /// for a packet the node itself sends.
    fn check(&mut self, cases: &[(&str, u32)]);
}

impl Check for Datapath {
    fn check(&mut self, cases: &[(&str, u32)]) {
        for (case, want) in cases {
            let (point, spec) = case.split_once(' ').expect("<point> <flow>");
            let pkt = flow(spec);
            let got = match point {
                "out" => out(self, &pkt),
                "in" => into_a(self, &pkt),
                "node-in" => run_prog(self, Program::PolicyIn, &pkt, 0).0,
                _ => panic!("no point {point:?} in {case:?}"),
            };
            assert_eq!(got, *want, "{case}");
        }
    }
}

/// The points of the tracked flows `pick` selects, in the map's order.
fn ct_points(dp: &Datapath, pick: impl Fn(&CtKey) -> bool) -> Vec<u8> {
    dp.ct_entries()
        .unwrap()
        .iter()
        .filter(|(k, _)| pick(k))
        .map(|(k, _)| k.point)
        .collect()
}

#[test]
fn unselected_pods_pass_both_points_untracked() {
    let mut dp = policy_datapath();
    dp.check(&[
        ("out tcp 10.0.0.2:40000 > 10.0.0.3:80", PASS),
        ("out udp [fd00::2]:40000 > [2001:db8::1]:53", PASS),
        ("in tcp 10.0.0.3:40000 > 10.0.0.2:80", PASS),
        ("in udp [fd00::3]:53 > [fd00::2]:40000", PASS),
        // Not for A at all: this program has nothing to say.
        ("in tcp 10.0.0.2:1 > 10.0.0.3:2", PASS),
    ]);
    assert!(dp.ct_entries().unwrap().is_empty());
    assert_eq!(verdict(&dp, Verdict::PolicyDenyOut), 0);
    assert_eq!(verdict(&dp, Verdict::PolicyDenyIn), 0);
}

#[test]
fn egress_without_a_matching_rule_is_dropped_except_to_the_node() {
    // Rule set 10 has no entries: deny all.
    let mut dp = a_selected(0, 10);
    dp.check(&[
        ("out tcp 10.0.0.2:40000 > 10.0.0.3:80", DROP),
        ("out udp 10.0.0.2:40000 > 192.0.2.1:53", DROP),
        ("out udp [fd00::2]:40000 > [fd00::3]:53", DROP),
        ("out echo 10.0.0.2 > 10.0.0.1 id 7", DROP),
    ]);
    assert_eq!(verdict(&dp, Verdict::PolicyDenyOut), 4);
    // The node's own addresses stay reachable.
    dp.set_node_addrs(&[ip("10.0.0.1"), ip("fd00::1")]).unwrap();
    assert_eq!(dp.node_addrs().unwrap(), [ip("10.0.0.1"), ip("fd00::1")]);
    dp.check(&[
        ("out echo 10.0.0.2 > 10.0.0.1 id 7", PASS),
        ("out udp [fd00::2]:40000 > [fd00::1]:53", PASS),
    ]);
    dp.set_node_addrs(&[ip("fd00::1")]).unwrap();
    assert_eq!(dp.node_addrs().unwrap(), [ip("fd00::1")]);
    dp.check(&[("out tcp 10.0.0.2:40001 > 10.0.0.1:22", DROP)]);
    assert_eq!(verdict(&dp, Verdict::PolicyDenyOut), 5);
    // ARP, neighbour discovery and group MACs are not policy's business.
    let mut arp = eth([0xff; 6], POD_A, 0x0806);
    arp.extend_from_slice(&[0; 28]);
    assert_eq!(out(&mut dp, &arp), PASS);
    let mut ns = vec![135, 0, 0, 0, 0, 0, 0, 0];
    ns.extend_from_slice(&ip6_octets("fd00::3"));
    assert_eq!(
        out(&mut dp, &ipv6(POD_B, "fd00::2", "fd00::3", 58, &ns)),
        PASS
    );
    let mut bcast = udp("10.0.0.2", "10.0.0.255", 68, 67);
    bcast[0..6].copy_from_slice(&[0xff; 6]);
    assert_eq!(out(&mut dp, &bcast), PASS);
}

#[test]
fn peers_are_allowed_by_identity_on_their_ports() {
    let mut dp = a_selected(0, 10);
    dp.put_portset(
        2,
        &[PortRange::new(TCP, 8000, 8080), PortRange::new(UDP, 53, 53)],
    )
    .unwrap();
    dp.put_peer(10, B_ID, 2).unwrap();
    dp.check(&[
        ("out tcp 10.0.0.2:40000 > 10.0.0.3:8000", PASS),
        ("out tcp 10.0.0.2:40001 > 10.0.0.3:8080", PASS),
        ("out udp [fd00::2]:40002 > [fd00::3]:53", PASS),
        ("out tcp 10.0.0.2:40003 > 10.0.0.3:8081", DROP),
        ("out tcp 10.0.0.2:40004 > 10.0.0.3:7999", DROP),
        ("out udp 10.0.0.2:40005 > 10.0.0.3:8000", DROP),
        // Ping carries no port: port rules do not allow it.
        ("out echo 10.0.0.2 > 10.0.0.3 id 9", DROP),
        // An address with no identity is no such peer.
        ("out tcp 10.0.0.2:40006 > 10.0.0.99:8000", DROP),
    ]);
    assert_eq!(verdict(&dp, Verdict::PolicyDenyOut), 5);
    // Every port of every protocol, and back to none.
    dp.put_peer(10, B_ID, PORTSET_ALL).unwrap();
    dp.check(&[("out echo 10.0.0.2 > 10.0.0.3 id 10", PASS)]);
    dp.put_peer(10, B_ID, PORTSET_NONE).unwrap();
    dp.check(&[("out echo 10.0.0.2 > 10.0.0.3 id 11", DROP)]);
    assert_eq!(
        dp.peers().unwrap(),
        [(
            rcni_ebpf::PeerKey {
                rs: 10,
                identity: B_ID
            },
            PORTSET_NONE
        )]
    );
    dp.remove_peer(10, B_ID).unwrap();
    dp.remove_peer(10, B_ID).unwrap();
    assert!(dp.peers().unwrap().is_empty());
    // Port sets: listed back, bounded, reserved ids refused.
    assert_eq!(
        dp.portsets().unwrap(),
        [(
            2,
            vec![PortRange::new(TCP, 8000, 8080), PortRange::new(UDP, 53, 53)]
        )]
    );
    let many = vec![PortRange::new(TCP, 1, 1); rcni_ebpf::MAX_PORT_RANGES + 1];
    assert!(dp.put_portset(3, &many).is_err());
    assert!(dp.put_portset(3, &many[1..]).is_ok());
    assert!(dp.put_portset(PORTSET_NONE, &[]).is_err());
    assert!(dp.put_portset(PORTSET_ALL, &[]).is_err());
    dp.remove_portset(2).unwrap();
    dp.remove_portset(2).unwrap();
    assert_eq!(dp.portsets().unwrap().len(), 1);
}

#[test]
fn cidrs_allow_by_longest_prefix_with_excepts() {
    let mut dp = a_selected(0, 11);
    dp.put_portset(2, &[PortRange::new(TCP, 443, 443)]).unwrap();
    // 192.0.2.0/24 except 192.0.2.128/25: the except is a longer prefix
    // allowing nothing.
    dp.put_cidrs(
        11,
        &[
            (ip("192.0.2.0"), 24, PORTSET_ALL),
            (ip("192.0.2.128"), 25, PORTSET_NONE),
            (ip("2001:db8::"), 32, 2),
        ],
    )
    .unwrap();
    // Another rule set's entries do not count for A.
    dp.put_cidr(12, ip("198.51.100.0"), 24, PORTSET_ALL)
        .unwrap();
    dp.check(&[
        ("out udp 10.0.0.2:40000 > 192.0.2.5:53", PASS),
        ("out echo 10.0.0.2 > 192.0.2.127 id 1", PASS),
        ("out udp 10.0.0.2:40000 > 192.0.2.200:53", DROP),
        ("out udp 10.0.0.2:40000 > 198.51.100.1:53", DROP),
        ("out tcp [fd00::2]:40000 > [2001:db8::1]:443", PASS),
        ("out tcp [fd00::2]:40001 > [2001:db8::1]:80", DROP),
        ("out tcp [fd00::2]:40002 > [2001:db9::1]:443", DROP),
        // B is matched by address too, not only by identity.
        ("out udp 10.0.0.2:40000 > 10.0.0.3:53", DROP),
    ]);
    dp.put_cidr(11, ip("10.0.0.0"), 24, PORTSET_ALL).unwrap();
    dp.check(&[("out udp 10.0.0.2:40000 > 10.0.0.3:53", PASS)]);
    // Listed back masked and sorted, per rule set.
    let listed = dp.cidrs(Some(11)).unwrap();
    assert_eq!(
        listed,
        [
            (11, ip("10.0.0.0"), 24, PORTSET_ALL),
            (11, ip("192.0.2.0"), 24, PORTSET_ALL),
            (11, ip("192.0.2.128"), 25, PORTSET_NONE),
            (11, ip("2001:db8::"), 32, 2),
        ]
    );
    assert_eq!(dp.cidrs(None).unwrap().len(), 5);
    // Host bits are ignored, removal is idempotent.
    dp.remove_cidr(11, ip("192.0.2.255"), 25).unwrap();
    dp.remove_cidr(11, ip("192.0.2.128"), 25).unwrap();
    dp.check(&[("out udp 10.0.0.2:40001 > 192.0.2.200:53", PASS)]);
    dp.remove_cidrs(11, &[(ip("192.0.2.0"), 24), (ip("10.0.0.0"), 24)])
        .unwrap();
    dp.check(&[("out udp 10.0.0.2:40002 > 192.0.2.5:53", DROP)]);
    assert!(dp.put_cidr(11, ip("10.0.0.0"), 33, PORTSET_ALL).is_err());
}

#[test]
fn replies_to_what_the_ingress_accepted_pass_the_egress() {
    // A: ingress from B on 5432 only, egress deny-all.
    let mut dp = a_selected(20, 21);
    dp.put_portset(2, &[PortRange::new(TCP, 5432, 5432)])
        .unwrap();
    dp.put_peer(20, B_ID, 2).unwrap();
    dp.check(&[
        ("in tcp 10.0.0.3:40000 > 10.0.0.2:5432", PASS),
        ("in tcp 10.0.0.3:40000 > 10.0.0.2:22", DROP),
    ]);
    assert_eq!(verdict(&dp, Verdict::PolicyDenyIn), 1);
    let ct = dp.ct_entries().unwrap();
    assert_eq!(ct.len(), 1);
    let (k, when) = ct[0];
    assert_eq!(
        (k.point, k.proto, k.sport, k.dport),
        (CT_INGRESS, TCP, 40000, 5432)
    );
    assert_eq!((k.src(), k.dst()), (key("10.0.0.3"), key("10.0.0.2")));
    assert!(when > 0);
    // The reply passes A's egress deny-all; nothing else from A does.
    dp.check(&[
        ("out tcp 10.0.0.2:5432 > 10.0.0.3:40000", PASS),
        ("out tcp 10.0.0.2:5432 > 10.0.0.3:40001", DROP),
        ("out tcp 10.0.0.2:40000 > 10.0.0.3:5432", DROP),
    ]);
    // Later packets of the flow pass on the record alone.
    dp.remove_peer(20, B_ID).unwrap();
    dp.check(&[("in tcp 10.0.0.3:40000 > 10.0.0.2:5432", PASS)]);
    // Flushed, the flow is decided afresh: now denied both ways.
    assert_eq!(dp.flush_ct(|k| k.dst() == key("10.0.0.9")).unwrap(), 0);
    assert_eq!(dp.flush_ct(|k| k.dst() == key("10.0.0.2")).unwrap(), 1);
    dp.check(&[
        ("in tcp 10.0.0.3:40000 > 10.0.0.2:5432", DROP),
        ("out tcp 10.0.0.2:5432 > 10.0.0.3:40000", DROP),
        // The node's own packets always reach A.
        ("node-in tcp 10.0.0.1:40000 > 10.0.0.2:8080", PASS),
    ]);
}

#[test]
fn a_pod_with_only_an_ingress_policy_gets_its_replies() {
    // A: ingress deny-all, egress not selected.
    let mut dp = a_selected(30, 0);
    // A's own connections are recorded at its egress point...
    dp.check(&[
        ("out udp 10.0.0.2:5353 > 10.0.0.3:53", PASS),
        ("out tcp [fd00::2]:40000 > [fd00::3]:80", PASS),
        ("out echo 10.0.0.2 > 192.0.2.1 id 0x1234", PASS),
    ]);
    assert_eq!(ct_points(&dp, |_| true), [CT_EGRESS; 3]);
    dp.check(&[
        // ... so their replies come in.
        ("in udp 10.0.0.3:53 > 10.0.0.2:5353", PASS),
        ("in tcp [fd00::3]:80 > [fd00::2]:40000", PASS),
        ("in reply 192.0.2.1 > 10.0.0.2 id 0x1234", PASS),
        // New connections to A do not.
        ("in udp 10.0.0.3:53 > 10.0.0.2:5354", DROP),
        ("in tcp [fd00::3]:40000 > [fd00::2]:80", DROP),
        ("in echo 192.0.2.1 > 10.0.0.2 id 0x1234", PASS),
        ("in reply 192.0.2.1 > 10.0.0.2 id 0x1235", DROP),
    ]);
    assert_eq!(verdict(&dp, Verdict::PolicyDenyIn), 3);
}

#[test]
fn spoofed_sources_are_dropped_at_the_pods_egress() {
    let mut dp = policy_datapath();
    // B's address from A's veth, and an address that is no pod's: dropped
    // whether or not A is selected.
    dp.check(&[
        ("out udp 10.0.0.3:1 > 10.0.0.2:2", DROP),
        ("out udp 10.0.0.50:1 > 192.0.2.1:2", DROP),
        ("out tcp [fd00::3]:1 > [2001:db8::1]:2", DROP),
    ]);
    assert_eq!(verdict(&dp, Verdict::PolicySpoof), 3);
    // Unspecified and link-local sources are not checked.
    dp.check(&[
        ("out udp 0.0.0.0:68 > 10.0.0.1:67", PASS),
        ("out udp 169.254.3.4:1 > 10.0.0.3:2", PASS),
        ("out udp [fe80::1]:1 > [fd00::3]:2", PASS),
        ("out udp [::]:1 > [fd00::3]:2", PASS),
    ]);
    assert_eq!(verdict(&dp, Verdict::PolicySpoof), 3);
    assert_eq!(verdict(&dp, Verdict::PolicyDenyOut), 0);
}

/// Until the network has a policy (`POL_ENFORCE`, which the policy plugin
/// sets after the rule sets), both points pass every packet: no decision
/// reads an address yet. Once it has, sources are checked and rule sets
/// decide.
#[test]
fn nothing_is_checked_until_the_network_has_a_policy() {
    let mut dp = policy_datapath();
    select_a(&mut dp, 41, 41);
    dp.set_enforcing(false).unwrap();
    dp.check(&[
        ("out udp 10.0.0.50:1 > 192.0.2.1:2", PASS),
        ("out tcp 10.0.0.2:40000 > 10.0.0.3:80", PASS),
        ("in udp 10.0.0.3:53 > 10.0.0.2:5354", PASS),
    ]);
    assert_eq!(verdict(&dp, Verdict::PolicySpoof), 0);
    assert_eq!(dp.flow_config().unwrap().flags, 0);
    dp.set_enforcing(true).unwrap();
    dp.check(&[
        ("out udp 10.0.0.50:1 > 192.0.2.1:2", DROP),
        ("out tcp 10.0.0.2:40000 > 10.0.0.3:80", DROP),
        ("in udp 10.0.0.3:53 > 10.0.0.2:5354", DROP),
    ]);
    assert_eq!(verdict(&dp, Verdict::PolicySpoof), 1);
    // The flow event settings are kept apart from the flag.
    dp.set_flow_config(rcni_ebpf::EVENTS_DENY, 7).unwrap();
    let c = dp.flow_config().unwrap();
    assert_eq!(
        (c.events, c.rate, c.flags),
        (rcni_ebpf::EVENTS_DENY, 7, rcni_ebpf::POL_ENFORCE)
    );
}

/// rcni_pod, both plugins' one program on the clsact ingress hook, runs
/// the parts the port's entry names (BPF_PROG_TEST_RUN runs it on lo, A's
/// veth here), policy's egress check first.
#[test]
fn the_pods_program_runs_the_parts_its_port_has() {
    in_fresh_netns(|| {
        let mut dp = policy_datapath();
        let pod = |dp: &mut Datapath, pkt: &[u8]| run_prog(dp, Program::Pod, pkt, 0).0;
        let mut to_b = tcp("10.0.0.2", "10.0.0.3", 40000, 80);
        to_b[0..6].copy_from_slice(&POD_B);
        let spoofed = udp("10.0.0.50", "192.0.2.1", 1, 2);
        // No entry: nothing runs.
        assert_eq!(pod(&mut dp, &to_b), PASS);
        assert_eq!(pod(&mut dp, &spoofed), PASS);
        assert_eq!(verdict(&dp, Verdict::Redirect), 0);
        // The fast path alone: a foreign source takes the normal path.
        dp.attach_pod("lo", PORT_FASTPATH, Hook::Tc).unwrap();
        assert_eq!(pod(&mut dp, &to_b), TC_ACT_REDIRECT);
        assert_eq!(pod(&mut dp, &spoofed), PASS);
        assert_eq!(verdict(&dp, Verdict::PolicySpoof), 0);
        // Both: policy decides first.
        dp.attach_pod("lo", PORT_POLICY, Hook::Tc).unwrap();
        assert_eq!(pod(&mut dp, &spoofed), DROP);
        assert_eq!(pod(&mut dp, &to_b), TC_ACT_REDIRECT);
        select_a(&mut dp, 0, 41);
        assert_eq!(pod(&mut dp, &to_b), DROP);
        assert_eq!(verdict(&dp, Verdict::PolicyDenyOut), 1);
        // Policy alone: checks, never redirects.
        dp.release_pod(LO, PORT_FASTPATH).unwrap();
        select_a(&mut dp, 0, 0);
        assert_eq!(pod(&mut dp, &to_b), PASS);
        assert_eq!(pod(&mut dp, &spoofed), DROP);
        assert_eq!(verdict(&dp, Verdict::Redirect), 2);
        assert_eq!(verdict(&dp, Verdict::PolicySpoof), 2);
        assert_eq!(dp.port_parts(LO).unwrap(), PORT_POLICY);
        // A veth whose index is past the array: its parts are in the hash.
        ip_cmd(&[
            "link", "add", "x0", "index", "20000", "type", "veth", "peer", "name", "x1",
        ]);
        let on_x0 = |dp: &mut Datapath, pkt: &[u8]| run_prog_on(dp, Program::Pod, pkt, 0, 20000).0;
        assert_eq!(on_x0(&mut dp, &spoofed), PASS);
        dp.attach_pod("x0", PORT_POLICY, Hook::Tc).unwrap();
        assert_eq!(on_x0(&mut dp, &spoofed), DROP);
        assert_eq!(verdict(&dp, Verdict::PolicySpoof), 3);
    });
}

/// bandwidth's node-side egress policer (`PORT_POLICE`, behind the pod's
/// own shaping): rcni_pod, and rcni_fastpath where it runs alone (netkit),
/// drop what runs further ahead of the rate than the horizon, after the
/// burst, and count both; GC takes a gone device's policer.
#[test]
fn the_port_policer_drops_what_runs_past_the_rate() {
    let mut dp = datapath();
    let pkt = ipv4(POD_B, "10.0.0.2", "10.0.0.3", 64, ICMP_ECHO);
    // A second of the rate per packet, a second and a half ahead allowed:
    // the test's runs come well within half a second of each other.
    let police = |burst_s: u64| rcni_ebpf::Police {
        rate: pkt.len() as u64,
        burst_ns: burst_s * 1_000_000_000,
        horizon_ns: 1_500_000_000,
        ..Default::default()
    };
    let pod = |dp: &mut Datapath| run_prog(dp, Program::Pod, &pkt, 0).0;
    // The account runs on the real clock: a sequence slower than the
    // horizon's half second of slack (a preempted thread) rightly lets one
    // more by, so it is run again on a fresh policer.
    fn timed<T>(dp: &mut Datapath, p: rcni_ebpf::Police, f: impl Fn(&mut Datapath) -> T) -> T {
        for _ in 0..10 {
            dp.police_port(LO, p).unwrap();
            let t = std::time::Instant::now();
            let v = f(dp);
            if t.elapsed() < std::time::Duration::from_millis(500) {
                return v;
            }
        }
        panic!("10 sequences in a row took half a second or more");
    }
    assert_eq!(dp.policer(LO).unwrap(), None);
    // No burst: one packet within the horizon, then drops.
    let runs: Vec<u32> = timed(&mut dp, police(0), |dp| (0..3).map(|_| pod(dp)).collect());
    assert_eq!(dp.port_parts(LO).unwrap(), rcni_ebpf::PORT_POLICE);
    assert_eq!(runs, [PASS, DROP, DROP]);
    let p = dp.policer(LO).unwrap().unwrap();
    assert_eq!((p.passed, p.dropped), (1, 2));
    // Three seconds of burst: three packets paid off in the past, one
    // ahead within the horizon.
    let runs: Vec<u32> = timed(&mut dp, police(3), |dp| (0..6).map(|_| pod(dp)).collect());
    assert_eq!(runs, [PASS, PASS, PASS, PASS, DROP, DROP]);
    // rcni_fastpath (netkit's peer hook): policed, then redirected.
    let (runs, redirected) = timed(&mut dp, police(0), |dp| {
        let before = verdict(dp, Verdict::Redirect);
        let runs: Vec<u32> = (0..2).map(|_| run(dp, &pkt).0).collect();
        (runs, verdict(dp, Verdict::Redirect) - before)
    });
    assert_eq!(runs, [TC_ACT_REDIRECT, TC_ACT_SHOT]);
    assert_eq!(redirected, 1);
    // Off: everything passes again.
    dp.unpolice_port(LO).unwrap();
    assert_eq!(dp.policer(LO).unwrap(), None);
    assert_eq!(dp.port_parts(LO).unwrap(), 0);
    assert_eq!(pod(&mut dp), PASS);
    assert_eq!(run(&mut dp, &pkt).0, TC_ACT_REDIRECT);
    dp.unpolice_port(LO).unwrap();
    // A device gone without bandwidth's DEL (an index no device has, past
    // the ports' array): GC takes its policer and its part.
    const GONE: u32 = 1_000_000;
    dp.police_port(GONE, police(0)).unwrap();
    assert!(dp.policer(GONE).unwrap().is_some());
    assert_eq!(dp.sweep_ports().unwrap(), 1);
    assert_eq!(dp.port_parts(GONE).unwrap(), 0);
    assert_eq!(dp.policer(GONE).unwrap(), None);
}

#[test]
fn the_fast_path_decides_both_ends_before_redirecting() {
    let mut dp = policy_datapath();
    dp.put_portset(2, &[PortRange::new(TCP, 80, 80)]).unwrap();
    // B: ingress from A's identity on TCP 80.
    dp.put_peer(40, A_ID, 2).unwrap();
    dp.set_policy_endpoint(&[key("10.0.0.3")], B_IFINDEX, B_OWNER, B_ID, 40, 0)
        .unwrap();
    let to_b = |sport, dport| {
        let mut p = tcp("10.0.0.2", "10.0.0.3", sport, dport);
        p[0..6].copy_from_slice(&POD_B);
        p
    };
    assert_eq!(run(&mut dp, &to_b(40000, 80)).0, TC_ACT_REDIRECT);
    let (ret, after) = run(&mut dp, &to_b(40001, 81));
    assert_eq!((ret, after), (TC_ACT_SHOT, to_b(40001, 81)));
    assert_eq!(verdict(&dp, Verdict::PolicyDenyIn), 1);
    assert_eq!(verdict(&dp, Verdict::Redirect), 1);
    // Recorded at B's ingress point (A, not selected, records nothing).
    assert_eq!(ct_points(&dp, |_| true), [CT_INGRESS]);
    // A's egress decides too. Deny-all: A's flows stop (it recorded none
    // while no rule set selected it).
    select_a(&mut dp, 0, 41);
    assert_eq!(run(&mut dp, &to_b(40000, 80)).0, TC_ACT_SHOT);
    assert_eq!(verdict(&dp, Verdict::PolicyDenyOut), 1);
    // Allowed at both ends: recorded at both points.
    dp.put_peer(41, B_ID, 2).unwrap();
    assert_eq!(run(&mut dp, &to_b(40002, 80)).0, TC_ACT_REDIRECT);
    assert_eq!(
        ct_points(&dp, |k| k.sport == 40002),
        [CT_EGRESS, CT_INGRESS]
    );
    // Routed through the gateway: dropped before anything is rewritten.
    let routed = tcp("10.0.0.2", "10.0.0.3", 40003, 81);
    assert_eq!(run(&mut dp, &routed), (TC_ACT_SHOT, routed.clone()));
    assert_eq!(verdict(&dp, Verdict::PolicyDenyOut), 2);
    // Counters count only what was redirected.
    let b = dp.stats(&key("10.0.0.3")).unwrap();
    assert_eq!(b.rx_packets, 2);
    // An address only the policy plugin knows has no MACs: no redirect.
    dp.set_policy_endpoint(&[key("10.0.0.7")], B_IFINDEX, 7, 300, 0, 0)
        .unwrap();
    let mut to_7 = tcp("10.0.0.2", "10.0.0.7", 40000, 80);
    to_7[0..6].copy_from_slice(&POD_B);
    assert_eq!(run(&mut dp, &to_7).0, TC_ACT_UNSPEC);
    assert_eq!(verdict(&dp, Verdict::UnknownDst), 1);
}

#[test]
fn fastpath_and_policy_share_endpoint_entries() {
    require_root();
    let mut dp = Datapath::load().unwrap();
    let k = key("10.0.0.5");
    // Policy first, then the fast path: one entry with both parts.
    dp.set_policy_endpoint(&[k], 9, 5, 123, 1, 2).unwrap();
    let slot = dp.endpoint(&k).unwrap().unwrap().slot;
    dp.insert_endpoint(k, Endpoint::new(9, POD_A, GW_A, 5))
        .unwrap();
    let both = dp.endpoint(&k).unwrap().unwrap();
    assert_eq!(both.flags, EP_FASTPATH | EP_POLICY);
    assert_eq!(
        (both.slot, both.identity, both.ingress_rs, both.egress_rs),
        (slot, 123, 1, 2)
    );
    assert_eq!(both.pod_mac, POD_A);
    // The fast path leaves: the policy's part stays, its slot too.
    dp.remove_endpoint(&k).unwrap();
    let pol = dp.endpoint(&k).unwrap().unwrap();
    assert_eq!(
        (pol.flags, pol.slot, pol.identity, pol.pod_mac),
        (EP_POLICY, slot, 123, [0; 6])
    );
    // Another owner's clear leaves it alone; the owner's removes it.
    dp.clear_policy_endpoint(&[k], 6).unwrap();
    assert!(dp.endpoint(&k).unwrap().is_some());
    dp.clear_policy_endpoint(&[k], 5).unwrap();
    dp.clear_policy_endpoint(&[k], 5).unwrap();
    assert_eq!(dp.endpoint(&k).unwrap(), None);
    // Its slot is free again.
    dp.insert_endpoint(key("10.0.0.6"), Endpoint::new(9, POD_A, GW_A, 6))
        .unwrap();
    assert_eq!(dp.endpoint(&key("10.0.0.6")).unwrap().unwrap().slot, slot);
}

#[test]
fn pins_of_another_layout_are_refused_with_advice() {
    use aya::maps::{Array, HashMap, IterableMap, MapData};
    let fs = Bpffs::mount();
    let dir = fs.path().join("net");
    let mut dp = Datapath::open_or_load(&dir).unwrap();
    dp.set_policy_endpoint(&[key("10.0.0.5")], 9, 5, 1, 0, 0)
        .unwrap();
    drop(dp);
    for pin in [
        "prog",
        "prog-pol-in",
        "prog-pol-out",
        "rcni_pol_ct",
        "rcni_version",
    ] {
        assert!(dir.join(pin).exists(), "{pin} pinned");
    }
    let dp = Datapath::open(&dir).unwrap().expect("pinned");
    assert_eq!(dp.endpoints().unwrap().len(), 1);
    drop(dp);
    // The flow event ring is pinned with the rest; a datapath loaded
    // again has another one (a collector of the old must start over).
    let ring = rcni_ebpf::flow_events_id(&dir).expect("ring pinned");
    assert_eq!(rcni_ebpf::flow_events_id(&dir), Some(ring));

    // Another layout version.
    let mut version: Array<MapData, u32> = Array::try_from(aya::maps::Map::Array(
        MapData::from_pin(dir.join("rcni_version")).unwrap(),
    ))
    .unwrap();
    version.set(0, 1, 0).unwrap();
    let e = Datapath::open(&dir).err().expect("refused");
    assert!(e.to_string().contains("another version of rcni"), "{e}");
    assert!(e.to_string().contains("layout version 1"), "{e}");
    assert!(e.is_incompatible());
    assert!(Datapath::open_or_load(&dir).is_err());
    version.set(0, rcni_ebpf::DATAPATH_VERSION, 0).unwrap();
    assert!(Datapath::open(&dir).unwrap().is_some());

    // The fast path's endpoints of before policy: 32-byte values.
    let old: HashMap<MapData, EndpointKey, [u8; 32]> = HashMap::create(16, 0).unwrap();
    std::fs::remove_file(dir.join("rcni_endpoints")).unwrap();
    old.map().pin(dir.join("rcni_endpoints")).unwrap();
    let e = Datapath::open(&dir).err().expect("refused");
    assert!(e.to_string().contains("map rcni_endpoints"), "{e}");
    assert!(e.to_string().contains("32-byte values"), "{e}");
    // A load that died before pinning the programs left such a map: not
    // reused either.
    std::fs::remove_file(dir.join("prog")).unwrap();
    let e = Datapath::open_or_load(&dir).err().expect("refused");
    assert!(e.to_string().contains("map rcni_endpoints"), "{e}");
    rcni_ebpf::remove_network(&dir).unwrap();
    assert!(!dir.exists());
    assert_eq!(rcni_ebpf::flow_events_id(&dir), None);
    Datapath::open_or_load(&dir).unwrap();
    let again = rcni_ebpf::flow_events_id(&dir).expect("ring pinned");
    assert_ne!(again, ring);
    rcni_ebpf::remove_network(&dir).unwrap();
}

/// Runs `ip args` in the calling thread's namespace; it must succeed.
fn ip_cmd(args: &[&str]) {
    let st = std::process::Command::new("ip")
        .args(args)
        .status()
        .unwrap();
    assert!(st.success(), "ip {args:?}");
}

/// Runs `f` on a thread of its own in a fresh network namespace, with
/// veth pairs v0/v1 and w0/w1 (made by `ip`, which inherits the thread's
/// namespace); the namespace goes with the thread.
fn in_fresh_netns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    require_root();
    std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        for [a, b] in [["v0", "v1"], ["w0", "w1"]] {
            ip_cmd(&["link", "add", a, "type", "veth", "peer", "name", b]);
        }
        f()
    })
    .join()
    .unwrap()
}

/// `tc filter show dev <dev> <hook>`: (priority, program name) per filter.
fn tc_filters(dev: &str, hook: &str) -> Vec<(u16, String)> {
    let out = std::process::Command::new("tc")
        .args(["filter", "show", "dev", dev, hook])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let mut v = Vec::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let pref = words.iter().position(|w| *w == "pref");
        let name = words.iter().find(|w| w.starts_with("rcni_"));
        if let (Some(p), Some(n)) = (pref, name) {
            v.push((
                words[p + 1].parse().unwrap(),
                n.split(':').next().unwrap().to_string(),
            ));
        }
    }
    v.sort();
    v.dedup();
    v
}

#[test]
fn policy_programs_attach_in_front_of_the_fast_path() {
    in_fresh_netns(|| {
        let mut dp = Datapath::load().unwrap();
        let id = AttachmentId::new("c", "eth0");
        let pin = dp.program_id_of(Program::PolicyIn).unwrap();
        let pod = dp.program_id_of(Program::Pod).unwrap();
        let v0 = nix::net::if_::if_nametoindex("v0").unwrap();
        let both = rcni_ebpf::PORT_FASTPATH | rcni_ebpf::PORT_POLICY;
        // tcx: one program on the ingress hook for both plugins, as on
        // clsact (one attach, one RCU grace period, fewer); policy's
        // rcni_pol_in alone on egress.
        dp.attach("v0", id, Hook::Tcx).unwrap();
        assert!(!dp.policy_tcx_attached("v0").unwrap());
        dp.attach_policy("v0", id, Hook::Tcx).unwrap();
        assert_eq!(rcni_ebpf::tcx_programs("v0").unwrap(), [pod]);
        assert_eq!(rcni_ebpf::tcx_egress_programs("v0").unwrap(), [pin]);
        assert_eq!(dp.port_parts(v0).unwrap(), both);
        assert!(dp.pod_attached("v0", rcni_ebpf::PORT_POLICY).unwrap());
        assert!(
            !dp.tcx_attached("v0").unwrap(),
            "no rcni_fastpath of its own"
        );
        assert!(tc_filters("v0", "ingress").is_empty());
        // Unpinned links (no directory): policy_attached wants the pins.
        let nowhere = std::path::Path::new("/nonexistent");
        assert!(!dp.policy_attached(nowhere, "v0", id, Hook::Tcx).unwrap());
        assert!(!dp.policy_attached(nowhere, "w0", id, Hook::Tc).unwrap());
        // Either part out first keeps the program for the other; the
        // last takes it off the hook.
        dp.release_pod(v0, rcni_ebpf::PORT_FASTPATH).unwrap();
        assert_eq!(rcni_ebpf::tcx_programs("v0").unwrap(), [pod]);
        dp.attach("v0", id, Hook::Tcx).unwrap();
        assert_eq!(rcni_ebpf::tcx_programs("v0").unwrap(), [pod]);
        dp.release_pod(v0, rcni_ebpf::PORT_POLICY).unwrap();
        assert!(dp.pod_attached("v0", rcni_ebpf::PORT_FASTPATH).unwrap());
        dp.release_pod(v0, rcni_ebpf::PORT_FASTPATH).unwrap();
        assert!(rcni_ebpf::tcx_programs("v0").unwrap().is_empty());
        assert!(dp.ports().unwrap().is_empty());
        // tc: one program on the ingress hook for both plugins, whatever
        // the order, each part in the port's entry.
        let w0 = nix::net::if_::if_nametoindex("w0").unwrap();
        dp.attach("w0", id, Hook::Tc).unwrap();
        assert_eq!(dp.port_parts(w0).unwrap(), rcni_ebpf::PORT_FASTPATH);
        dp.attach_policy("w0", id, Hook::Tc).unwrap();
        assert_eq!(
            tc_filters("w0", "ingress"),
            [(10, rcni_ebpf::POD_PROGRAM.to_string())]
        );
        assert_eq!(
            tc_filters("w0", "egress"),
            [(10, "rcni_pol_in".to_string())]
        );
        assert_eq!(
            dp.port_parts(w0).unwrap(),
            rcni_ebpf::PORT_FASTPATH | rcni_ebpf::PORT_POLICY
        );
        assert!(dp.pod_attached("w0", rcni_ebpf::PORT_FASTPATH).unwrap());
        assert!(dp.policy_attached(nowhere, "w0", id, Hook::Tc).unwrap());
        assert!(!dp.policy_attached(nowhere, "v0", id, Hook::Tc).unwrap());
        assert!(!dp.policy_attached(nowhere, "gone", id, Hook::Tc).unwrap());
        // The fast path's part out first: the program stays for policy;
        // back again, no second filter.
        dp.release_pod(w0, rcni_ebpf::PORT_FASTPATH).unwrap();
        assert!(dp.policy_attached(nowhere, "w0", id, Hook::Tc).unwrap());
        assert!(!dp.pod_attached("w0", rcni_ebpf::PORT_FASTPATH).unwrap());
        dp.attach("w0", id, Hook::Tc).unwrap();
        assert!(dp.pod_attached("w0", rcni_ebpf::PORT_FASTPATH).unwrap());
        // The policy part out: the program stays for the fast path.
        dp.release_pod(w0, rcni_ebpf::PORT_POLICY).unwrap();
        assert!(rcni_ebpf::detach_policy_tc("w0").unwrap());
        assert!(!rcni_ebpf::detach_policy_tc("w0").unwrap());
        assert!(!dp.policy_attached(nowhere, "w0", id, Hook::Tc).unwrap());
        assert!(dp.pod_attached("w0", rcni_ebpf::PORT_FASTPATH).unwrap());
        // Whatever the mode, on devices with and without filters, or gone.
        rcni_ebpf::detach_policy(nowhere, id, "w0").unwrap();
        rcni_ebpf::detach_policy(nowhere, id, "v0").unwrap();
        rcni_ebpf::detach_policy(nowhere, id, "gone").unwrap();
        assert_eq!(
            tc_filters("w0", "ingress"),
            [(10, rcni_ebpf::POD_PROGRAM.to_string())]
        );
        assert!(tc_filters("w0", "egress").is_empty());
        // The last part takes the program off; again is fine.
        dp.release_pod(w0, rcni_ebpf::PORT_FASTPATH).unwrap();
        dp.release_pod(w0, rcni_ebpf::PORT_FASTPATH).unwrap();
        assert!(tc_filters("w0", "ingress").is_empty());
        assert!(dp.ports().unwrap().is_empty());
        // An index past the array: the hash holds its parts.
        ip_cmd(&[
            "link", "add", "x0", "index", "20000", "type", "veth", "peer", "name", "x1",
        ]);
        dp.attach("x0", id, Hook::Tc).unwrap();
        assert_eq!(dp.ports().unwrap(), [(20000, rcni_ebpf::PORT_FASTPATH)]);
        assert!(dp.pod_attached("x0", rcni_ebpf::PORT_FASTPATH).unwrap());
        dp.release_pod(20000, rcni_ebpf::PORT_FASTPATH).unwrap();
        assert!(dp.ports().unwrap().is_empty());
        assert!(tc_filters("x0", "ingress").is_empty());
        // A gone device: its entry goes by index, and GC sweeps one left.
        dp.release_pod(999_999, rcni_ebpf::PORT_FASTPATH).unwrap();
        dp.attach("v0", id, Hook::Tc).unwrap();
        ip_cmd(&["link", "del", "v0"]);
        assert_eq!(dp.ports().unwrap().len(), 1);
        assert_eq!(dp.sweep_ports().unwrap(), 1);
        assert!(dp.ports().unwrap().is_empty());
    });
}

#[test]
fn pinned_policy_links_detach_without_touching_the_fast_path() {
    let fs = Bpffs::mount();
    let dir = fs.path().join("net");
    let d = dir.clone();
    in_fresh_netns(move || {
        let mut dp = Datapath::open_or_load(&d).unwrap();
        let id = AttachmentId::new("c", "eth0");
        let v0 = nix::net::if_::if_nametoindex("v0").unwrap();
        dp.attach("v0", id, Hook::Tcx).unwrap();
        dp.attach_policy("v0", id, Hook::Tcx).unwrap();
        let pod = dp.program_id_of(Program::Pod).unwrap();
        // One link for both plugins' rcni_pod, pinned as the port's, and
        // policy's egress link as the attachment's.
        assert!(rcni_ebpf::pinned_links(&d).unwrap().is_empty());
        assert_eq!(rcni_ebpf::pinned_port_links(&d).unwrap(), [v0]);
        assert_eq!(rcni_ebpf::pinned_policy_links(&d).unwrap(), [id]);
        assert!(dp.policy_attached(&d, "v0", id, Hook::Tcx).unwrap());
        let other = AttachmentId::new("c2", "eth0");
        assert!(!dp.policy_attached(&d, "v0", other, Hook::Tcx).unwrap());
        let kept = rcni_ebpf::detach_policy_links_except(&d, |i| i == id);
        assert_eq!(kept.unwrap(), 0);
        let swept = rcni_ebpf::detach_policy_links_except(&d, |i| i == other);
        assert_eq!(swept.unwrap(), 1);
        assert!(!rcni_ebpf::detach_policy_tcx(&d, id).unwrap());
        assert!(!dp.policy_attached(&d, "v0", id, Hook::Tcx).unwrap());
        assert!(rcni_ebpf::pinned_policy_links(&d).unwrap().is_empty());
        assert!(rcni_ebpf::tcx_egress_programs("v0").unwrap().is_empty());
        // Policy's part out: the port's link stays for the fast path.
        dp.release_pod(v0, rcni_ebpf::PORT_POLICY).unwrap();
        assert_eq!(rcni_ebpf::tcx_programs("v0").unwrap(), [pod]);
        assert!(dp.pod_attached("v0", rcni_ebpf::PORT_FASTPATH).unwrap());
        // The device deleted without a DEL, its index taken by a new one:
        // neither the old link's pin nor the old parts (policy's, which
        // would drop the new pod's traffic) carry over.
        dp.attach_policy("v0", id, Hook::Tcx).unwrap();
        ip_cmd(&["link", "del", "v0"]);
        let idx = v0.to_string();
        ip_cmd(&[
            "link", "add", "n0", "index", &idx, "type", "veth", "peer", "name", "n1",
        ]);
        assert_eq!(
            dp.port_parts(v0).unwrap(),
            rcni_ebpf::PORT_FASTPATH | rcni_ebpf::PORT_POLICY
        );
        dp.attach("n0", id, Hook::Tcx).unwrap();
        assert_eq!(dp.port_parts(v0).unwrap(), rcni_ebpf::PORT_FASTPATH);
        assert_eq!(rcni_ebpf::tcx_programs("n0").unwrap(), [pod]);
        assert_eq!(rcni_ebpf::pinned_port_links(&d).unwrap(), [v0]);
        // The last part takes the link off and its pin away.
        dp.release_pod(v0, rcni_ebpf::PORT_FASTPATH).unwrap();
        assert!(rcni_ebpf::tcx_programs("n0").unwrap().is_empty());
        assert!(rcni_ebpf::pinned_port_links(&d).unwrap().is_empty());
        // GC: a gone device's entry and pin, and a pin without parts.
        dp.attach("n0", id, Hook::Tcx).unwrap();
        ip_cmd(&["link", "del", "n0"]);
        // (bpffs renames pins: the gone device's pin, as another port's.)
        std::fs::rename(
            d.join(rcni_ebpf::port_link_pin(v0)),
            d.join(rcni_ebpf::port_link_pin(4242)),
        )
        .unwrap();
        assert_eq!(dp.sweep_ports().unwrap(), 1);
        assert!(dp.ports().unwrap().is_empty());
        assert!(rcni_ebpf::pinned_port_links(&d).unwrap().is_empty());
    });
    rcni_ebpf::remove_network(&dir).unwrap();
}

/// The programs' own cost per packet (the kernel's average over a million
/// runs): `cargo nextest run -p rcni-ebpf --run-ignored only program_cost`.
#[test]
#[ignore = "a measurement, not a check"]
fn program_cost() {
    let mut dp = policy_datapath();
    // The kernel runs the program `repeat` times on one skb, whose edits
    // stay. A bridged packet leaves the program unchanged: 50 runs per call
    // (the whole path each time), the median of 2,000 calls. A routed one
    // is rewritten by its first run (the MACs to the receiver's, as the
    // node's forwarding would), and a second run would take it for a foreign
    // frame and pass it: one run per call for those, the median of 20,000
    // calls, each figure then holding the kernel's two clock reads around
    // the run as well (what "empty run" below costs).
    let cost = |dp: &mut Datapath, what: &str, prog: Program, pkt: &[u8]| {
        let (repeat, calls) = match what.starts_with("routed") || what.starts_with("empty") {
            true => (1, 20_000),
            false => (50, 2_000),
        };
        // As run_prog: a zeroed context up to ifindex (sent by the node).
        let ctx = [0u8; 44];
        let mut ns = Vec::new();
        let mut ret = 0;
        for _ in 0..calls {
            let r = dp
                .program_of(prog)
                .test_run(TestRunOptions {
                    data_in: Some(pkt),
                    ctx_in: Some(&ctx),
                    repeat,
                    ..TestRunOptions::new()
                })
                .unwrap();
            ns.push(r.duration.as_nanos());
            ret = r.return_value;
        }
        ns.sort_unstable();
        eprintln!(
            "{what}: {} ns per run (returns {}, {repeat} run(s) per call)",
            ns[ns.len() / 2],
            ret as i32
        );
    };
    // The floor of the one-run figures: a packet the program passes at
    // its first check (not IP).
    cost(
        &mut dp,
        "empty run (not IP)",
        Program::Fastpath,
        &eth(POD_B, POD_A, 0x0806),
    );
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
        cost(&mut dp, what, Program::Fastpath, &pkt);
    }
    // Across nodes (bench/crossnode.sh's eBPF variants): a pod's TCP
    // segment to another node's pod, and one from there to a local pod.
    let mut fp = datapath();
    with_remote(&mut fp, 1500);
    let mut to_remote = tcp("10.0.0.2", "10.1.0.7", 40000, 5301);
    to_remote[0..6].copy_from_slice(&GW_A);
    cost(&mut fp, "to remote v4 tcp", Program::Fastpath, &to_remote);
    let from_remote = from_peer(tcp("10.1.0.7", "10.0.0.2", 5301, 40000));
    cost(&mut fp, "from net v4 tcp", Program::FromNet, &from_remote);
    drop(fp);
    let flow = tcp("10.0.0.2", "10.0.0.3", 40000, 8080);
    let mut bridged_flow = flow.clone();
    bridged_flow[0..6].copy_from_slice(&POD_B);
    cost(
        &mut dp,
        "pol_out, pod not selected",
        Program::PolicyOut,
        &flow,
    );
    // Selected both ways, the allowing range last of eight.
    let mut ranges: Vec<PortRange> = (1..8)
        .map(|p| PortRange::new(TCP, p * 100, p * 100))
        .collect();
    ranges.push(PortRange::new(TCP, 8000, 8080));
    dp.put_portset(2, &ranges).unwrap();
    dp.put_peer(10, B_ID, 2).unwrap();
    dp.put_peer(11, A_ID, 2).unwrap();
    select_a(&mut dp, 11, 10);
    dp.set_policy_endpoint(&[key("10.0.0.3")], B_IFINDEX, B_OWNER, B_ID, 11, 10)
        .unwrap();
    cost(&mut dp, "pol_out, tracked flow", Program::PolicyOut, &flow);
    let denied = tcp("10.0.0.2", "10.0.0.3", 40000, 9000);
    cost(
        &mut dp,
        "pol_out, rules deny (all lookups)",
        Program::PolicyOut,
        &denied,
    );
    cost(
        &mut dp,
        "fastpath bridged v4, both selected, tracked",
        Program::Fastpath,
        &bridged_flow,
    );
    drop(dp);
    // rcni_pod, both plugins' one program on clsact: its port lookup on
    // top of the parts it runs, against rcni_fastpath alone and
    // rcni_pol_out then rcni_fastpath (two filters before). In a namespace
    // of its own: the port entry wants a device, here that namespace's lo.
    in_fresh_netns(move || {
        let mut dp = policy_datapath();
        let pkt = ipv4(POD_B, "10.0.0.2", "10.0.0.3", 64, ICMP_ECHO);
        cost(&mut dp, "fastpath bridged v4", Program::Fastpath, &pkt);
        cost(&mut dp, "pod, no entry, bridged v4", Program::Pod, &pkt);
        dp.attach_pod("lo", PORT_FASTPATH, Hook::Tc).unwrap();
        cost(&mut dp, "pod, fast path, bridged v4", Program::Pod, &pkt);
        cost(&mut dp, "pol_out, bridged v4", Program::PolicyOut, &pkt);
        dp.attach_pod("lo", PORT_POLICY, Hook::Tc).unwrap();
        cost(&mut dp, "pod, both parts, bridged v4", Program::Pod, &pkt);
    });
}

/// `ip -s link show <dev>`: the TX packets counter.
fn tx_packets(dev: &str) -> u64 {
    let out = std::process::Command::new("ip")
        .args(["-s", "link", "show", "dev", dev])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("TX:"));
    lines.next();
    let counters = lines.next().expect("TX counters");
    counters.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// With real packets: what the node itself sends reaches a pod whose
/// ingress denies everything (rcni_pol_in sees ingress_ifindex 0 for it;
/// forwarded packets are the integration tests' business).
#[test]
fn the_nodes_own_packets_reach_a_pod_whatever_its_ingress() {
    in_fresh_netns(|| {
        ip_cmd(&["addr", "add", "10.0.0.1/24", "dev", "v0"]);
        ip_cmd(&["link", "set", "v0", "up"]);
        ip_cmd(&["link", "set", "v1", "up"]);
        ip_cmd(&[
            "neigh",
            "add",
            "10.0.0.2",
            "lladdr",
            "0a:58:00:00:00:02",
            "dev",
            "v0",
        ]);
        let v0 = nix::net::if_::if_nametoindex("v0").unwrap();
        let mut dp = Datapath::load().unwrap();
        // Rule set 5 has no entries: nothing may come in.
        dp.set_policy_endpoint(&[key("10.0.0.2")], v0, 1, A_ID, 5, 0)
            .unwrap();
        dp.attach_policy("v0", AttachmentId::new("c", "eth0"), Hook::Tcx)
            .unwrap();
        let pin = dp.program_id_of(Program::PolicyIn).unwrap();
        assert_eq!(rcni_ebpf::tcx_egress_programs("v0").unwrap(), [pin]);
        let before = tx_packets("v0");
        let sock = std::net::UdpSocket::bind("10.0.0.1:0").unwrap();
        for _ in 0..3 {
            sock.send_to(b"rcni", "10.0.0.2:9").unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(tx_packets("v0") >= before + 3, "sent through the hook");
        assert_eq!(verdict(&dp, Verdict::PolicyDenyIn), 0);
    });
}

// ---- cross-node: to other nodes' pods, and from them ----

/// The node's MAC in a test run: loopback's, all zero, so that the kernel's
/// eth_type_trans marks the frame PACKET_HOST as a frame to the uplink's
/// own MAC would be.
const NODE_MAC: [u8; 6] = [0; 6];
const UPLINK: u32 = 77;

/// [`datapath`] with another node's pod subnets (10.1.0.0/24, fd01::/64)
/// behind UPLINK, MTU `mtu`.
fn with_remote(dp: &mut Datapath, mtu: u32) {
    dp.set_remote_route(
        "10.1.0.0/24".parse().unwrap(),
        RemoteHop::new(UPLINK, mtu, ip("192.168.50.2")),
    )
    .unwrap();
    dp.set_remote_route(
        "fd01::/64".parse().unwrap(),
        RemoteHop::new(UPLINK, mtu, ip("fd50::2")),
    )
    .unwrap();
}

/// `pkt` as if it arrived from another node for this node's MAC.
fn from_peer(mut pkt: Vec<u8>) -> Vec<u8> {
    pkt[0..6].copy_from_slice(&NODE_MAC);
    pkt
}

fn from_net(dp: &mut Datapath, pkt: &[u8]) -> (u32, Vec<u8>) {
    run_prog(dp, Program::FromNet, pkt, 0)
}

#[test]
fn to_another_nodes_pod_leaves_by_redirect_neigh_ttl_decremented() {
    let mut dp = datapath();
    with_remote(&mut dp, 1500);
    assert_eq!(dp.remote_routes().unwrap().len(), 2);
    let pkt = ipv4(GW_A, "10.0.0.2", "10.1.0.7", 64, ICMP_ECHO);
    let (ret, out) = run(&mut dp, &pkt);
    assert_eq!(ret, TC_ACT_REDIRECT);
    // The neighbour subsystem writes the MACs; routing's TTL decrement here.
    assert_eq!(&out[..12], &pkt[..12]);
    assert_eq!(out[14 + 8], 63);
    assert_eq!(csum(&out[14..34]), 0, "IPv4 header checksum still valid");
    assert_eq!(&out[34..], &pkt[34..]);
    assert_eq!(verdict(&dp, Verdict::ToRemote), 1);
    let a = dp.stats(&EndpointKey::new(ip("10.0.0.2"))).unwrap();
    assert_eq!((a.tx_packets, a.tx_bytes), (1, pkt.len() as u64));

    let pkt6 = ipv6(GW_A, "fd00::2", "fd01::9", 58, ICMPV6_ECHO);
    let (ret, out) = run(&mut dp, &pkt6);
    assert_eq!(ret, TC_ACT_REDIRECT);
    assert_eq!(out[14 + 7], 63, "hop limit decremented");
    assert_eq!(verdict(&dp, Verdict::ToRemote), 2);

    for (why, pkt) in [
        // Not routed: sent to another MAC than the gateway's.
        (
            "bridged",
            ipv4(POD_B, "10.0.0.2", "10.1.0.7", 64, ICMP_ECHO),
        ),
        // No node's pod subnet: the node, the outside world. (Another
        // ping socket: this one's flows would keep the normal path now.)
        (
            "unknown",
            ipv4(GW_A, "10.0.0.2", "10.2.0.7", 64, ICMP_ECHO_ID1),
        ),
        // Expiring: the normal path answers with ICMP.
        ("ttl 1", ipv4(GW_A, "10.0.0.2", "10.1.0.7", 1, ICMP_ECHO)),
        // Another source address than the veth's pod.
        ("spoofed", ipv4(GW_A, "10.0.0.9", "10.1.0.7", 64, ICMP_ECHO)),
    ] {
        let (ret, out) = run(&mut dp, &pkt);
        assert_eq!((ret, &out), (TC_ACT_UNSPEC, &pkt), "{why}");
    }
    assert_eq!(verdict(&dp, Verdict::ToRemote), 2);

    // Over the out device's MTU (and not GSO): the normal path, which
    // answers "fragmentation needed".
    with_remote(&mut dp, 100);
    let big = ipv4(GW_A, "10.0.0.2", "10.1.0.7", 64, &[0u8; 81]);
    assert_eq!(run(&mut dp, &big).0, TC_ACT_UNSPEC);
    assert_eq!(verdict(&dp, Verdict::TooBig), 1);
    let fits = ipv4(GW_A, "10.0.0.2", "10.1.0.7", 64, &[0u8; 80]);
    assert_eq!(run(&mut dp, &fits).0, TC_ACT_REDIRECT);

    // Per peer subnet: what was redirected to it (rewriting an entry keeps
    // its counters).
    let per_peer: Vec<(String, u64, u64)> = dp
        .remote_stats()
        .unwrap()
        .into_iter()
        .map(|(n, _, s)| (n.to_string(), s.tx_packets, s.tx_bytes))
        .collect();
    assert_eq!(
        per_peer,
        [
            ("10.1.0.0/24".into(), 2, (pkt.len() + fits.len()) as u64),
            ("fd01::/64".into(), 1, pkt6.len() as u64)
        ]
    );
    let slots: Vec<u32> = dp
        .remote_routes()
        .unwrap()
        .iter()
        .map(|(_, h)| h.slot)
        .collect();
    assert_eq!(slots.len(), 2);
    assert_ne!(slots[0], slots[1], "a slot each");

    // Gone from the map: the normal path.
    dp.remove_remote_route("10.1.0.0/24".parse().unwrap())
        .unwrap();
    dp.remove_remote_route("10.1.0.0/24".parse().unwrap())
        .unwrap();
    assert_eq!(run(&mut dp, &pkt).0, TC_ACT_UNSPEC);
    assert_eq!(dp.remote_routes().unwrap().len(), 1);
    // A new peer may get the freed slot: it starts from zero.
    dp.set_remote_route(
        "10.3.0.0/24".parse().unwrap(),
        RemoteHop::new(UPLINK, 1500, ip("192.168.50.3")),
    )
    .unwrap();
    let fresh = dp
        .remote_stats()
        .unwrap()
        .into_iter()
        .find(|(n, _, _)| n.to_string() == "10.3.0.0/24")
        .unwrap();
    assert_eq!(fresh.2, rcni_ebpf::RemoteStats::default());
}

/// The fast path on `pkt` as a GSO packet of `segs` segments of `size`
/// bytes (what a pod's TCP hands its veth).
fn run_gso(dp: &mut Datapath, pkt: &[u8], segs: u32, size: u32) -> u32 {
    let mut out = vec![0u8; pkt.len() + 256];
    // struct __sk_buff up to gso_size: gso_segs at 164, gso_size at 176
    // (<linux/bpf.h>).
    let mut ctx = [0u8; 180];
    ctx[164..168].copy_from_slice(&segs.to_ne_bytes());
    ctx[176..180].copy_from_slice(&size.to_ne_bytes());
    dp.program_of(Program::Fastpath)
        .test_run(TestRunOptions {
            data_in: Some(pkt),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx),
            ..TestRunOptions::new()
        })
        .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN (GSO): {e:?}"))
        .return_value
}

#[test]
fn gso_packets_leave_when_their_segments_fit_the_out_device() {
    let mut dp = datapath();
    with_remote(&mut dp, 1450);
    // A 2-segment TCP packet (20-byte TCP header: data offset 5; a test
    // run's packet must fit a page).
    let mut seg = tcp("10.0.0.2", "10.1.0.7", 40000, 80);
    seg.extend(std::iter::repeat_n(0u8, 2 * 1410));
    // 1410 + 20 + 20 = 1450: each segment fits.
    assert_eq!(run_gso(&mut dp, &seg, 2, 1410), TC_ACT_REDIRECT);
    // One byte more per segment does not: the normal path says so.
    assert_eq!(run_gso(&mut dp, &seg, 2, 1411), TC_ACT_UNSPEC);
    assert_eq!(verdict(&dp, Verdict::TooBig), 1);
    // IPv6: 40-byte header.
    let mut seg6 = tcp("fd00::2", "fd01::9", 40000, 80);
    seg6.extend(std::iter::repeat_n(0u8, 2 * 1390));
    assert_eq!(run_gso(&mut dp, &seg6, 2, 1390), TC_ACT_REDIRECT);
    assert_eq!(run_gso(&mut dp, &seg6, 2, 1391), TC_ACT_UNSPEC);
}

#[test]
fn from_another_node_to_a_local_pod_is_delivered_as_routing_would() {
    let mut dp = datapath();
    with_remote(&mut dp, 1500);
    let pkt = from_peer(ipv4(GW_A, "10.1.0.7", "10.0.0.3", 64, ICMP_ECHO));
    let (ret, out) = from_net(&mut dp, &pkt);
    assert_eq!(ret, TC_ACT_REDIRECT);
    // As the node would send it to B: from B's gateway to B's MAC.
    assert_eq!(&out[0..6], &POD_B);
    assert_eq!(&out[6..12], &GW_B);
    assert_eq!(out[14 + 8], 63);
    assert_eq!(csum(&out[14..34]), 0);
    assert_eq!(&out[34..], &pkt[34..]);
    let b = dp.stats(&EndpointKey::new(ip("10.0.0.3"))).unwrap();
    assert_eq!((b.rx_packets, b.rx_bytes), (1, pkt.len() as u64));
    let pkt6 = from_peer(ipv6(GW_A, "fd01::9", "fd00::3", 58, ICMPV6_ECHO));
    let (ret, out) = from_net(&mut dp, &pkt6);
    assert_eq!(ret, TC_ACT_REDIRECT);
    assert_eq!((&out[0..6], out[14 + 7]), (&POD_B[..], 63));
    assert_eq!(verdict(&dp, Verdict::FromRemote), 2);

    // Everything else continues unchanged.
    dp.insert_endpoint(
        EndpointKey::new(ip("10.0.0.4")),
        Endpoint::new(B_IFINDEX + 1, POD_B, GW_B, 3).normal_path(true),
    )
    .unwrap();
    for (why, pkt) in [
        // Another host's frame (PACKET_OTHERHOST).
        (
            "not ours",
            ipv4(POD_B, "10.1.0.7", "10.0.0.3", 64, ICMP_ECHO),
        ),
        // The node's own traffic.
        (
            "the node's",
            from_peer(ipv4(GW_A, "192.168.50.2", "192.168.50.1", 64, ICMP_ECHO)),
        ),
        // Not another node's pod: the pod's replies take the normal path,
        // so its packets do too.
        (
            "from outside the pods",
            from_peer(ipv4(GW_A, "192.168.60.9", "10.0.0.3", 64, ICMP_ECHO)),
        ),
        (
            "ttl 1",
            from_peer(ipv4(GW_A, "10.1.0.7", "10.0.0.3", 1, ICMP_ECHO)),
        ),
        (
            "shaped pod",
            from_peer(ipv4(GW_A, "10.1.0.7", "10.0.0.4", 64, ICMP_ECHO)),
        ),
        (
            "neighbour solicitation",
            from_peer(ipv6(GW_A, "fd01::9", "fd00::3", 58, &[135, 0, 0, 0])),
        ),
        ("arp", from_peer(eth(NODE_MAC, POD_A, 0x0806))),
    ] {
        let (ret, out) = from_net(&mut dp, &pkt);
        assert_eq!((ret, &out), (TC_ACT_UNSPEC, &pkt), "{why}");
    }
    assert_eq!(verdict(&dp, Verdict::FromRemote), 2);
}

#[test]
fn from_another_node_the_receivers_ingress_policy_decides() {
    // A admits TCP 5432 from 10.1.0.0/24 only, and sends anywhere.
    let mut dp = a_selected(20, 0);
    with_remote(&mut dp, 1500);
    dp.set_remote_route(
        "10.2.0.0/24".parse().unwrap(),
        RemoteHop::new(UPLINK, 1500, ip("192.168.50.3")),
    )
    .unwrap();
    dp.put_portset(2, &[PortRange::new(TCP, 5432, 5432)])
        .unwrap();
    dp.put_cidr(20, ip("10.1.0.0"), 24, 2).unwrap();
    let syn = |src: &str, sport: u16, dport: u16| from_peer(tcp(src, "10.0.0.2", sport, dport));
    assert_eq!(
        from_net(&mut dp, &syn("10.1.0.7", 40000, 5432)).0,
        TC_ACT_REDIRECT
    );
    assert_eq!(from_net(&mut dp, &syn("10.1.0.7", 40001, 22)).0, DROP);
    assert_eq!(from_net(&mut dp, &syn("10.2.0.7", 40002, 5432)).0, DROP);
    assert_eq!(verdict(&dp, Verdict::PolicyDenyIn), 2);
    // A's replies to the admitted flow leave for the other node.
    let reply = tcp("10.0.0.2", "10.1.0.7", 5432, 40000);
    assert_eq!(run(&mut dp, &reply).0, TC_ACT_REDIRECT);
    // And a pod not selected by any policy takes everything.
    assert_eq!(
        from_net(&mut dp, &from_peer(tcp("10.2.0.7", "10.0.0.3", 1, 22))).0,
        TC_ACT_REDIRECT
    );
}

/// [`tcp`] with the flags byte `flags` (SYN 0x02, ACK 0x10), IPv4.
fn tcp_with(src: &str, dst: &str, sport: u16, dport: u16, flags: u8) -> Vec<u8> {
    let mut p = tcp(src, dst, sport, dport);
    p[14 + 20 + 13] = flags;
    p
}

#[test]
fn a_socket_that_opened_a_flow_past_the_pods_keeps_the_normal_path_both_ways() {
    let mut dp = datapath();
    with_remote(&mut dp, 1500);
    // A's server answers its node (a kubelet's probe): that opens no flow,
    // and another node's pod still reaches the server by the fast path.
    let (ret, _) = run(
        &mut dp,
        &tcp_with("10.0.0.2", "192.168.50.1", 5432, 40000, 0x12),
    );
    assert_eq!(ret, TC_ACT_UNSPEC);
    let syn = from_peer(tcp("10.1.0.7", "10.0.0.2", 40000, 5432));
    assert_eq!(from_net(&mut dp, &syn).0, TC_ACT_REDIRECT);
    // A's client socket opens a flow to a service address (a bare SYN):
    // the node's NAT translates it, and every flow of that socket, to
    // pods too, keeps the node's path both ways.
    let (ret, _) = run(
        &mut dp,
        &tcp_with("10.0.0.2", "10.96.0.10", 40001, 80, 0x02),
    );
    assert_eq!(ret, TC_ACT_UNSPEC);
    assert_eq!(verdict(&dp, Verdict::NatFlow), 0);
    let (ret, _) = run(&mut dp, &tcp_with("10.0.0.2", "10.1.0.7", 40001, 81, 0x02));
    assert_eq!(ret, TC_ACT_UNSPEC, "to a pod from that socket");
    let back = from_peer(tcp_with("10.1.0.7", "10.0.0.2", 81, 40001, 0x12));
    assert_eq!(from_net(&mut dp, &back).0, TC_ACT_UNSPEC, "back to it");
    assert_eq!(verdict(&dp, Verdict::NatFlow), 2);
    // A's other sockets keep the fast path.
    let (ret, _) = run(&mut dp, &tcp_with("10.0.0.2", "10.1.0.7", 40002, 81, 0x02));
    assert_eq!(ret, TC_ACT_REDIRECT);
}

#[test]
fn a_pods_egress_policy_decides_before_it_leaves_for_another_node() {
    // A may send to 10.1.0.0/24 on UDP 53 only.
    let mut dp = a_selected(0, 21);
    with_remote(&mut dp, 1500);
    dp.put_portset(3, &[PortRange::new(UDP, 53, 53)]).unwrap();
    dp.put_cidr(21, ip("10.1.0.0"), 24, 3).unwrap();
    assert_eq!(
        run(&mut dp, &udp("10.0.0.2", "10.1.0.7", 4000, 53)).0,
        TC_ACT_REDIRECT
    );
    assert_eq!(run(&mut dp, &udp("10.0.0.2", "10.1.0.7", 4000, 54)).0, DROP);
    assert_eq!(verdict(&dp, Verdict::PolicyDenyOut), 1);
    // The reply comes back past A's ingress (no ingress rules: allowed).
    let back = from_peer(udp("10.1.0.7", "10.0.0.2", 53, 4000));
    assert_eq!(from_net(&mut dp, &back).0, TC_ACT_REDIRECT);
}

#[test]
fn flows_the_node_translates_keep_the_normal_path_both_ways() {
    let mut dp = datapath();
    with_remote(&mut dp, 1500);
    // A connects to a service address (no pod's): the node DNATs it, maybe
    // to a pod on another node. Its replies must meet the node's conntrack.
    assert_eq!(
        run(&mut dp, &tcp("10.0.0.2", "10.96.0.10", 40000, 80)).0,
        PASS
    );
    let reply = from_peer(tcp("10.1.0.7", "10.0.0.2", 8080, 40000));
    assert_eq!(from_net(&mut dp, &reply), (PASS, reply.clone()));
    assert_eq!(verdict(&dp, Verdict::NatFlow), 1);
    // Another socket of A's is not concerned.
    let other = from_peer(tcp("10.1.0.7", "10.0.0.2", 8080, 40001));
    assert_eq!(from_net(&mut dp, &other).0, TC_ACT_REDIRECT);
    // A remote pod reaching a hostPort (the node's address, DNATed to A):
    // A's replies to that socket take the normal path (the node un-DNATs).
    let to_node = from_peer(tcp("10.1.0.8", "192.168.50.1", 33000, 8080));
    assert_eq!(from_net(&mut dp, &to_node).0, PASS);
    assert_eq!(
        run(&mut dp, &tcp("10.0.0.2", "10.1.0.8", 80, 33000)).0,
        PASS
    );
    assert_eq!(verdict(&dp, Verdict::NatFlow), 2);
    assert_eq!(
        run(&mut dp, &tcp("10.0.0.2", "10.1.0.8", 80, 33001)).0,
        TC_ACT_REDIRECT
    );
}

/// A connects to a service address that the node DNATs to B, a pod of the
/// same node: B's replies carry B's address where A's socket waits for the
/// service's, so they must meet the node's conntrack, never the redirect.
#[test]
fn replies_to_a_service_flow_from_a_local_pod_keep_the_normal_path() {
    in_fresh_netns(|| {
        ip_cmd(&[
            "link", "add", "b0", "index", "4242", "type", "veth", "peer", "name", "b1",
        ]);
        let mut dp = datapath();
        assert_eq!(
            run(&mut dp, &tcp("10.0.0.2", "10.96.0.10", 40000, 80)).0,
            PASS
        );
        // B answers through its gateway, from its own veth.
        let from_b = |sport: u16, dport: u16| {
            let mut p = tcp("10.0.0.3", "10.0.0.2", sport, dport);
            p[0..6].copy_from_slice(&GW_B);
            p[6..12].copy_from_slice(&POD_B);
            p
        };
        let on_b =
            |dp: &mut Datapath, p: &[u8]| run_prog_on(dp, Program::Fastpath, p, 0, B_IFINDEX).0;
        assert_eq!(on_b(&mut dp, &from_b(8080, 40000)), PASS);
        assert_eq!(verdict(&dp, Verdict::NatFlow), 1);
        // B's own connections to A keep the fast path.
        assert_eq!(on_b(&mut dp, &from_b(8080, 40001)), TC_ACT_REDIRECT);
    });
}

/// The flow events A's points wrote, drained.
fn events(ring: &mut rcni_ebpf::FlowEvents) -> Vec<rcni_ebpf::FlowEvent> {
    ring.read(10_000)
}

#[test]
fn denials_audits_and_asked_for_allows_become_flow_events() {
    let mut dp = a_selected(0, 41);
    let mut ring = dp.take_flow_events().unwrap();
    // Nothing is reported before the plugin writes the config.
    assert_eq!(
        out(&mut dp, &flow("tcp 10.0.0.2:40000 > 10.0.0.3:80")),
        DROP
    );
    assert!(events(&mut ring).is_empty());
    dp.set_flow_config(rcni_ebpf::EVENTS_DENY, 10).unwrap();
    // A's egress denies everything: one event per flow, not per packet.
    for _ in 0..3 {
        assert_eq!(
            out(&mut dp, &flow("tcp 10.0.0.2:40001 > 10.0.0.3:80")),
            DROP
        );
    }
    assert_eq!(
        out(&mut dp, &flow("udp [fd00::2]:5000 > [fd00::3]:53")),
        DROP
    );
    let ev = events(&mut ring);
    assert_eq!(ev.len(), 2, "{ev:?}");
    assert_eq!(
        (
            ev[0].verdict,
            ev[0].point,
            ev[0].proto,
            ev[0].sport,
            ev[0].dport,
            ev[0].rs
        ),
        (rcni_ebpf::EV_DENY, CT_EGRESS, TCP, 40001, 80, 41)
    );
    assert_eq!((ev[0].src(), ev[0].dst()), (ip("10.0.0.2"), ip("10.0.0.3")));
    assert_eq!((ev[1].proto, ev[1].dst()), (UDP, ip("fd00::3")));
    // Allowed flows only when asked.
    dp.put_portset(2, &[PortRange::new(TCP, 443, 443)]).unwrap();
    dp.put_peer(41, B_ID, 2).unwrap();
    assert_eq!(
        out(&mut dp, &flow("tcp 10.0.0.2:40002 > 10.0.0.3:443")),
        PASS
    );
    assert!(events(&mut ring).is_empty());
    dp.set_flow_config(rcni_ebpf::EVENTS_DENY | rcni_ebpf::EVENTS_ALLOW, 10)
        .unwrap();
    assert_eq!(
        out(&mut dp, &flow("tcp 10.0.0.2:40003 > 10.0.0.3:443")),
        PASS
    );
    // The flow's later packets are connection tracking hits: no event.
    assert_eq!(
        out(&mut dp, &flow("tcp 10.0.0.2:40003 > 10.0.0.3:443")),
        PASS
    );
    let ev = events(&mut ring);
    assert_eq!(ev.len(), 1);
    assert_eq!((ev[0].verdict, ev[0].dport), (rcni_ebpf::EV_ALLOW, 443));
    // Audit: what the rule set denies passes, reported once.
    dp.set_policy_endpoint_audited(
        &[key("10.0.0.2"), key("fd00::2")],
        LO,
        A_OWNER,
        A_ID,
        0,
        41,
        rcni_ebpf::POL_AUDIT_OUT,
    )
    .unwrap();
    assert_eq!(
        out(&mut dp, &flow("tcp 10.0.0.2:40004 > 10.0.0.3:22")),
        PASS
    );
    assert_eq!(
        out(&mut dp, &flow("tcp 10.0.0.2:40004 > 10.0.0.3:22")),
        PASS
    );
    let ev = events(&mut ring);
    assert_eq!(ev.len(), 1);
    assert_eq!((ev[0].verdict, ev[0].dport), (rcni_ebpf::EV_AUDIT, 22));
    assert_eq!(verdict(&dp, Verdict::PolicyDenyOut), 5);
}

#[test]
fn a_flood_of_denials_stays_within_the_pods_rate_limit() {
    let mut dp = a_selected(0, 41);
    let mut ring = dp.take_flow_events().unwrap();
    dp.set_flow_config(rcni_ebpf::EVENTS_DENY, 5).unwrap();
    for sport in 1000..1100 {
        let spec = format!("udp 10.0.0.2:{sport} > 10.0.0.3:53");
        assert_eq!(out(&mut dp, &flow(&spec)), DROP);
    }
    let ev = events(&mut ring);
    // One window (the loop takes well under a second): 5 events.
    assert_eq!(ev.len(), 5, "{ev:?}");
    assert_eq!(verdict(&dp, Verdict::EventLimited), 95);
    // The next window's first event carries the count.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    assert_eq!(out(&mut dp, &flow("udp 10.0.0.2:2000 > 10.0.0.3:53")), DROP);
    let ev = events(&mut ring);
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].suppressed, 95);
    // B is another pod: a window of its own.
    assert_eq!(
        into_a(&mut dp, &flow("udp 10.0.0.3:1 > 10.0.0.2:2")),
        PASS,
        "A's ingress is not selected"
    );
}
