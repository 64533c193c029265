//! fpbench: pod-to-pod datapath cost with and without the eBPF fast path, in
//! one run: a direct veth pair between two namespaces (the physical limit),
//! bridge, bridge + fastpath, ptp, ptp + fastpath. Per setup: TCP
//! request/response latency (1-byte ping-pong, median and p99), ICMP echo
//! latency (back-to-back echoes answered by the kernel, as for ping, but
//! timed to the nanosecond; median), and iperf3 throughput with 1 and 4
//! streams; then
//! the per-pod ADD latency of the chain against the reference bridge.
//!
//! This machine is small and shared, and the order of setups within a round
//! moves the numbers (the first one runs on a colder machine): every round
//! rotates the order, so each setup takes each position equally often, and
//! the per-round ratios are reported as well as the medians and spreads.
//! Everything lives in namespaces this process holds, and the fast path pins
//! under a bpffs mounted on a temporary directory: nothing survives the run.

use clap::Parser;
use rcni_bench::{
    Bpffs, IperfServer, addr, call, iperf, iperf_server, is_root, order, pct, pin_to, rr,
    rr_server, rt, spread,
};
use rcni_netlink::Netlink;
use rcni_netns::NetNs;
use serde_json::{Value, json};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser)]
#[command(about = "pod-to-pod latency and throughput: direct veth, bridge, ptp, with fastpath")]
struct Args {
    /// Directory with our plugins (bridge, ptp, host-local, fastpath).
    #[arg(long, default_value = "target/release")]
    ours: PathBuf,
    /// Directory with the reference plugins (for the ADD comparison).
    #[arg(long, default_value = "/usr/lib/cni")]
    reference: PathBuf,
    /// Latency rounds (each runs every setup once, in a rotated order).
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// TCP request/response exchanges per setup and round.
    #[arg(long, default_value_t = 5000)]
    rr: usize,
    /// ICMP echoes per setup and round.
    #[arg(long, default_value_t = 2000)]
    pings: usize,
    /// Throughput rounds (0 skips iperf3).
    #[arg(long, default_value_t = 4)]
    tput_rounds: usize,
    /// Seconds per iperf3 run.
    #[arg(long, default_value_t = 2)]
    tput_secs: u64,
    /// Pods per implementation for the ADD latency (0 skips it).
    #[arg(long, default_value_t = 40)]
    add_pods: usize,
    /// CPU that the latency client, server and ping run on (-1: anywhere).
    /// One CPU for both ends takes cross-CPU wake-ups (and which CPU the
    /// scheduler picked) out of the numbers, leaving the datapath's cost.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    cpu: i32,
    /// The fast path's attachMode in the bridge+fastpath and ptp+fastpath
    /// setups (auto: the plugin's default).
    #[arg(long, default_value = "auto")]
    attach_mode: String,
    /// Adds a bridge+fastpath setup with the fast path on the other hook
    /// (tcx against tc, or tc against tcx), paired with the first.
    #[arg(long)]
    compare_attach: bool,
    /// Adds ptp with `linkType: netkit` (pods on netkit pairs, Linux 6.7+),
    /// without and with the fast path (on netkit's peer hook), with ratios
    /// to the direct veth pair and to ptp(+fastpath) on veth pairs.
    #[arg(long)]
    netkit: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Bridge,
    Ptp,
}

/// Two pods connected one way; for the fast path also where its pins are.
struct Setup {
    name: &'static str,
    a: NetNs,
    b: NetNs,
    b4: IpAddr,
    /// (node, pin root) of a fastpath setup, for its counters.
    fast: Option<(NetNs, String)>,
    _keep: Vec<Box<dyn std::any::Any>>,
}

fn direct() -> Setup {
    let (a, b) = (
        NetNs::new_anonymous().unwrap(),
        NetNs::new_anonymous().unwrap(),
    );
    rt().block_on(async {
        let na = Netlink::connect(&a).await.unwrap();
        let nb = Netlink::connect(&b).await.unwrap();
        let la = na
            .create_veth("eth0", "eth0", Some(&b), None)
            .await
            .unwrap();
        let lb = nb.link_by_name("eth0").await.unwrap();
        na.add_address_nodad(la.index, "10.99.0.1/24".parse().unwrap())
            .await
            .unwrap();
        nb.add_address_nodad(lb.index, "10.99.0.2/24".parse().unwrap())
            .await
            .unwrap();
        na.set_up(la.index).await.unwrap();
        nb.set_up(lb.index).await.unwrap();
    });
    Setup {
        name: "direct veth",
        a,
        b,
        b4: "10.99.0.2".parse().unwrap(),
        fast: None,
        _keep: vec![],
    }
}

fn plugin_setup(args: &Args, kind: Kind, fast: bool) -> Setup {
    plugin_setup_on(args, kind, fast, &args.attach_mode, None, None)
}

/// [`plugin_setup`] with the fast path on `mode`, under `label` if given.
fn plugin_setup_on(
    args: &Args,
    kind: Kind,
    fast: bool,
    mode: &str,
    label: Option<&'static str>,
    link_type: Option<&str>,
) -> Setup {
    let node = NetNs::new_anonymous().unwrap();
    let (a, b) = (
        NetNs::new_anonymous().unwrap(),
        NetNs::new_anonymous().unwrap(),
    );
    let data = tempfile::tempdir().unwrap();
    let net = match (kind, fast) {
        (Kind::Bridge, false) => "bridge",
        (Kind::Bridge, true) => "bridge-fp",
        (_, false) => "ptp",
        (_, true) => "ptp-fp",
    };
    let conf = match kind {
        Kind::Bridge => json!({"cniVersion": "1.1.0", "name": net, "type": "bridge",
            "bridge": "cni0", "isGateway": true,
            "ipam": {"type": "host-local", "dataDir": data.path(),
                     "ranges": [[{"subnet": "10.98.0.0/24"}]]}}),
        _ => json!({"cniVersion": "1.1.0", "name": net, "type": "ptp",
            "ipam": {"type": "host-local", "dataDir": data.path(),
                     "ranges": [[{"subnet": "10.97.0.0/24"}]]}}),
    };
    let mut conf = conf;
    if let Some(t) = link_type {
        conf["linkType"] = json!(t);
    }
    let plugin = args.ours.join(match kind {
        Kind::Bridge => "bridge",
        _ => "ptp",
    });
    let mut results = vec![];
    for (pod, cid) in [(&a, "a"), (&b, "b")] {
        let path = pod.proc_path().display().to_string();
        let (r, ok, _) = call(&node, &plugin, &args.ours, "ADD", cid, &path, &conf);
        assert!(ok, "{net} ADD");
        results.push((path, cid, r));
    }
    let b4 = addr(&results[1].2, true);
    let mut keep: Vec<Box<dyn std::any::Any>> = vec![Box::new(data)];
    let mut fast_info = None;
    if fast {
        let fs = Bpffs::mount();
        for (path, cid, prev) in &results {
            let c = json!({"cniVersion": "1.1.0", "name": net, "type": "fastpath",
                           "pinRoot": fs.root(), "attachMode": mode, "prevResult": prev});
            let (_, ok, _) = call(
                &node,
                &args.ours.join("fastpath"),
                &args.ours,
                "ADD",
                cid,
                path,
                &c,
            );
            assert!(ok, "fastpath ADD");
        }
        fast_info = Some((node.try_clone().unwrap(), fs.root()));
        keep.push(Box::new(fs));
    }
    keep.push(Box::new(node));
    Setup {
        name: label.unwrap_or(match (kind, fast) {
            (Kind::Bridge, false) => "bridge",
            (Kind::Bridge, true) => "bridge+fastpath",
            (_, false) => "ptp",
            (_, true) => "ptp+fastpath",
        }),
        a,
        b,
        b4,
        fast: fast_info,
        _keep: keep,
    }
}

/// Packets the fast path redirected in a setup (0 for the others).
fn redirected(args: &Args, s: &Setup) -> u64 {
    let Some((node, root)) = &s.fast else {
        return 0;
    };
    let out = node
        .command(args.ours.join("fastpath"))
        .args(["stats", "--json", "--pin-root", root])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    v.as_array()
        .into_iter()
        .flatten()
        .map(|n| n["verdicts"]["redirected"].as_u64().unwrap_or(0))
        .sum()
}

fn icmp_checksum(b: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for c in b.chunks(2) {
        sum += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// `n` ICMP echoes to `dst` (IPv4), back to back, each timed with the
/// monotonic clock: sorted round-trip times (µs). ping(8) prints
/// milliseconds with three decimals, a microsecond, which is a fifth of a
/// round trip here; the echo reply is the kernel's, as for ping.
fn ping(ns: &NetNs, dst: IpAddr, n: usize, cpu: i32) -> Vec<f64> {
    let IpAddr::V4(dst) = dst else {
        panic!("IPv4 only")
    };
    std::thread::scope(|sc| sc.spawn(|| icmp_pinned(ns, dst, n, cpu)).join().unwrap())
}

fn icmp_pinned(ns: &NetNs, dst: std::net::Ipv4Addr, n: usize, cpu: i32) -> Vec<f64> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    pin_to(cpu);
    // A raw socket belongs to the namespace it is created in.
    let fd = ns
        .run(|| {
            // SAFETY: socket(2); the result is checked below.
            unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_ICMP) }
        })
        .unwrap();
    assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh fd we own.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval {
        tv_sec: 1,
        tv_usec: 0,
    };
    // SAFETY: setsockopt with a timeval of the right size.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as u32,
        )
    };
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as u16,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(dst.octets()),
        },
        sin_zero: [0; 8],
    };
    let id = (std::process::id() as u16) ^ (cpu as u16);
    let warm = 50;
    let mut v = Vec::with_capacity(n);
    let mut buf = [0u8; 1500];
    for seq in 0..(n + warm) as u16 {
        let mut pkt = vec![8u8, 0, 0, 0];
        pkt.extend_from_slice(&id.to_be_bytes());
        pkt.extend_from_slice(&seq.to_be_bytes());
        pkt.extend_from_slice(&[0x5a; 48]);
        let c = icmp_checksum(&pkt);
        pkt[2..4].copy_from_slice(&c.to_be_bytes());
        let t = Instant::now();
        // SAFETY: sendto with a live buffer and a sockaddr_in.
        let r = unsafe {
            libc::sendto(
                sock.as_raw_fd(),
                pkt.as_ptr() as *const libc::c_void,
                pkt.len(),
                0,
                &sa as *const libc::sockaddr_in as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_in>() as u32,
            )
        };
        assert!(r > 0, "sendto: {}", std::io::Error::last_os_error());
        loop {
            // SAFETY: recv into our buffer.
            let r = unsafe {
                libc::recv(
                    sock.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    0,
                )
            };
            assert!(r > 0, "no echo reply: {}", std::io::Error::last_os_error());
            // IPv4 header, then ICMP: an echo reply (0) with our id, seq.
            let ihl = usize::from(buf[0] & 0x0f) * 4;
            let icmp = &buf[ihl..r as usize];
            if icmp.len() >= 8
                && icmp[0] == 0
                && icmp[4..6] == id.to_be_bytes()
                && icmp[6..8] == seq.to_be_bytes()
            {
                break;
            }
        }
        if usize::from(seq) >= warm {
            v.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v
}

fn main() {
    let args = Args::parse();
    assert!(is_root(), "fpbench needs root (namespaces, bpffs, eBPF)");
    // Its bpffs mounts must not outlive a run killed by a signal.
    rcni_testkit::private_mounts();
    for p in ["bridge", "ptp", "host-local", "fastpath"] {
        assert!(
            args.ours.join(p).is_file(),
            "{} missing",
            args.ours.join(p).display()
        );
    }
    println!(
        "fpbench: {} latency rounds ({} TCP exchanges, {} pings per setup and round; \
         client and server on CPU {}), {} throughput rounds of {} s",
        args.rounds, args.rr, args.pings, args.cpu, args.tput_rounds, args.tput_secs
    );
    let mut setups = vec![
        direct(),
        plugin_setup(&args, Kind::Bridge, false),
        plugin_setup(&args, Kind::Bridge, true),
        plugin_setup(&args, Kind::Ptp, false),
        plugin_setup(&args, Kind::Ptp, true),
    ];
    // The other hook: tc where the setups above use tcx (auto on 6.6+
    // kernels, or asked for), else tcx.
    let other = if args.attach_mode == "tc" {
        "tcx"
    } else {
        "tc"
    };
    if args.compare_attach {
        let label = if other == "tc" {
            "bridge+fp on tc"
        } else {
            "bridge+fp on tcx"
        };
        setups.push(plugin_setup_on(
            &args,
            Kind::Bridge,
            true,
            other,
            Some(label),
            None,
        ));
    }
    let netkit = args.netkit.then(|| {
        let at = setups.len();
        for (fast, label) in [(false, "ptp netkit"), (true, "ptp+fp netkit")] {
            let mode = args.attach_mode.clone();
            let s = plugin_setup_on(&args, Kind::Ptp, fast, &mode, Some(label), Some("netkit"));
            setups.push(s);
        }
        (at, at + 1)
    });
    let n = setups.len();
    let servers: Vec<SocketAddr> = setups
        .iter()
        .map(|s| rr_server(&s.b, s.b4, args.cpu))
        .collect();
    // Warm up neighbour caches and the fast path's entries.
    for s in &setups {
        ping(&s.a, s.b4, 3, args.cpu);
    }
    let redirected_before: Vec<u64> = setups.iter().map(|s| redirected(&args, s)).collect();

    // Per setup, per round: TCP p50, TCP p99, ping p50.
    let mut tcp50 = vec![vec![0.0; args.rounds]; n];
    let mut tcp99 = vec![vec![0.0; args.rounds]; n];
    let mut ping50 = vec![vec![0.0; args.rounds]; n];
    for r in 0..args.rounds {
        for i in order(n, r) {
            let s = &setups[i];
            let v = rr(&s.a, servers[i], args.rr, args.cpu);
            tcp50[i][r] = pct(&v, 0.5);
            tcp99[i][r] = pct(&v, 0.99);
            let p = ping(&s.a, s.b4, args.pings, args.cpu);
            ping50[i][r] = pct(&p, 0.5);
        }
        eprint!(".");
    }
    eprintln!();
    let taken: Vec<u64> = setups
        .iter()
        .zip(&redirected_before)
        .map(|(s, b)| redirected(&args, s) - b)
        .collect();

    println!(
        "\n== latency (µs): median over rounds of each round's p50/p99; spread = min-max of the per-round p50 =="
    );
    println!(
        "{:<16} {:>9} {:>12} {:>9} {:>8} {:>8}   {:>9} {:>12} {:>8} {:>8}",
        "setup",
        "tcp p50",
        "spread",
        "tcp p99",
        "/direct",
        "/bridge",
        "ping p50",
        "spread",
        "/direct",
        "/bridge"
    );
    let med = |v: &[f64]| pct(v, 0.5);
    let (d, br) = (0, 1);
    for i in 0..n {
        println!(
            "{:<16} {:>9.1} {:>12} {:>9.1} {:>8.3} {:>8.3}   {:>9.1} {:>12} {:>8.3} {:>8.3}",
            setups[i].name,
            med(&tcp50[i]),
            spread(&tcp50[i]),
            med(&tcp99[i]),
            med(&tcp50[i]) / med(&tcp50[d]),
            med(&tcp50[i]) / med(&tcp50[br]),
            med(&ping50[i]),
            spread(&ping50[i]),
            med(&ping50[i]) / med(&ping50[d]),
            med(&ping50[i]) / med(&ping50[br]),
        );
    }
    println!("\n== paired rounds (each ratio taken within one round) ==");
    let paired = |name: &str, x: usize, y: usize| {
        for (metric, m) in [("tcp p50", &tcp50), ("ping p50", &ping50)] {
            let ratios: Vec<f64> = (0..args.rounds).map(|r| m[x][r] / m[y][r]).collect();
            let below = ratios.iter().filter(|q| **q < 1.0).count();
            println!(
                "{name:<28} {metric:<9} ratio median {:.3} (min {:.3}, max {:.3}); below 1 in {below}/{} rounds",
                pct(&ratios, 0.5),
                pct(&ratios, 0.0),
                pct(&ratios, 1.0),
                args.rounds
            );
        }
    };
    paired("bridge+fastpath / direct", 2, d);
    paired("ptp+fastpath / direct", 4, d);
    paired("bridge+fastpath / bridge", 2, br);
    paired("ptp+fastpath / bridge", 4, br);
    paired("ptp+fastpath / ptp", 4, 3);
    paired("bridge / direct", br, d);
    if args.compare_attach {
        paired(&format!("fastpath on {other} / as above"), 5, 2);
    }
    if let Some((nk, nkf)) = netkit {
        paired("ptp netkit / direct", nk, d);
        paired("ptp+fp netkit / direct", nkf, d);
        paired("ptp netkit / ptp", nk, 3);
        paired("ptp+fp netkit / ptp+fastpath", nkf, 4);
        println!(
            "fast path taken: ptp+fp netkit redirected {} packets during the latency rounds",
            taken[nkf]
        );
    }
    println!(
        "fast path taken: bridge+fastpath redirected {} packets, ptp+fastpath {} during the latency rounds",
        taken[2], taken[4]
    );

    if args.tput_rounds > 0 {
        let _iperfs: Vec<IperfServer> = setups.iter().map(|s| iperf_server(&s.b)).collect();
        let mut t1 = vec![vec![0.0; args.tput_rounds]; n];
        let mut t4 = vec![vec![0.0; args.tput_rounds]; n];
        for r in 0..args.tput_rounds {
            for i in order(n, r) {
                let s = &setups[i];
                t1[i][r] = iperf(&s.a, s.b4, 1, args.tput_secs);
                t4[i][r] = iperf(&s.a, s.b4, 4, args.tput_secs);
            }
            eprint!(".");
        }
        eprintln!();
        println!("\n== throughput (Gbit/s, iperf3): median over rounds; spread = min-max ==");
        println!(
            "{:<16} {:>9} {:>12} {:>8} {:>8}   {:>9} {:>12} {:>8} {:>8}",
            "setup",
            "1 stream",
            "spread",
            "/direct",
            "/bridge",
            "4 streams",
            "spread",
            "/direct",
            "/bridge"
        );
        for i in 0..n {
            println!(
                "{:<16} {:>9.2} {:>12} {:>8.3} {:>8.3}   {:>9.2} {:>12} {:>8.3} {:>8.3}",
                setups[i].name,
                med(&t1[i]),
                spread(&t1[i]),
                med(&t1[i]) / med(&t1[d]),
                med(&t1[i]) / med(&t1[br]),
                med(&t4[i]),
                spread(&t4[i]),
                med(&t4[i]) / med(&t4[d]),
                med(&t4[i]) / med(&t4[br]),
            );
        }
        let mut pairs = vec![
            ("bridge+fastpath / bridge", 2, br),
            ("ptp+fastpath / bridge", 4, br),
        ];
        if let Some((nk, nkf)) = netkit {
            pairs.extend([
                ("ptp netkit / direct", nk, d),
                ("ptp+fp netkit / direct", nkf, d),
                ("ptp+fp netkit / ptp+fastpath", nkf, 4),
            ]);
        }
        for (name, x, y) in pairs {
            for (metric, m) in [("1 stream", &t1), ("4 streams", &t4)] {
                let ratios: Vec<f64> = (0..args.tput_rounds).map(|r| m[x][r] / m[y][r]).collect();
                println!(
                    "paired {name:<26} {metric:<9} ratio median {:.3} (min {:.3}, max {:.3})",
                    pct(&ratios, 0.5),
                    pct(&ratios, 0.0),
                    pct(&ratios, 1.0)
                );
            }
        }
    }
    drop(setups);

    if args.add_pods > 0 {
        add_latency(&args);
    }
}

/// Per-pod ADD wall time: the reference bridge alone, ours alone, and our
/// bridge + fastpath chain (the two calls a runtime makes in sequence), with
/// fastpath on clsact (attachMode auto) and on tcx (every tcx attach waits
/// for an RCU grace period in the kernel).
fn add_latency(args: &Args) {
    let fs = Bpffs::mount();
    let mut rows = vec![];
    for (name, dir, fast) in [
        ("reference bridge", args.reference.clone(), None),
        ("rcni bridge", args.ours.clone(), None),
        ("rcni bridge+fastpath", args.ours.clone(), Some("auto")),
        ("  ... attachMode tcx", args.ours.clone(), Some("tcx")),
    ] {
        let node = NetNs::new_anonymous().unwrap();
        let data = tempfile::tempdir().unwrap();
        let net = format!("addnet{}", rows.len());
        // 1.0.0: the newest version the reference (1.1.x packaging) takes.
        let conf = json!({"cniVersion": "1.0.0", "name": net, "type": "bridge",
            "bridge": "cni0", "isGateway": true,
            "ipam": {"type": "host-local", "dataDir": data.path(),
                     "ranges": [[{"subnet": "10.96.0.0/16"}]]}});
        let mut pods = vec![];
        let mut wall = vec![];
        let mut first_fast = f64::NAN;
        for i in 0..args.add_pods {
            let pod = NetNs::new_anonymous().unwrap();
            let path = pod.proc_path().display().to_string();
            let cid = format!("pod{i}");
            let (r, ok, t) = call(&node, &dir.join("bridge"), &dir, "ADD", &cid, &path, &conf);
            assert!(ok);
            let mut total = t;
            if let Some(mode) = fast {
                let c = json!({"cniVersion": "1.0.0", "name": net, "type": "fastpath",
                               "pinRoot": fs.root(), "attachMode": mode, "prevResult": r});
                let (_, ok, tf) = call(&node, &dir.join("fastpath"), &dir, "ADD", &cid, &path, &c);
                assert!(ok);
                if i == 0 {
                    first_fast = tf;
                }
                total += tf;
            }
            // The first ADD of a network (bridge creation; fastpath's
            // program load and pin) is reported apart.
            if i > 0 {
                wall.push(total);
            }
            pods.push(pod);
        }
        rows.push((name, pct(&wall, 0.5), pct(&wall, 0.99), first_fast));
        drop(pods);
    }
    println!(
        "\n== per-pod ADD latency (µs, wall, {} pods each, the network's first ADD excluded) ==",
        args.add_pods
    );
    let reference = rows[0].1;
    for (name, p50, p99, first) in &rows {
        print!(
            "{name:<22} median {p50:>8.0}  p99 {p99:>8.0}  ratio to reference bridge {:.3}",
            p50 / reference
        );
        if first.is_finite() {
            print!("  (first fastpath ADD, loading and pinning the program: {first:.0})");
        }
        println!();
    }
}
