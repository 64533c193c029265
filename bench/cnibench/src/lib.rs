//! Shared pieces of the datapath benchmarks (fpbench, polbench): running a
//! plugin inside a node namespace, a bpffs of the run's own, TCP
//! request/response latency with CPU pinning, iperf3 throughput, and the
//! round order and statistics that make side-by-side runs comparable.

use rcni_netns::NetNs;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Pins the calling thread (or a child between fork and exec) to `cpu`.
pub fn pin_to(cpu: i32) {
    if cpu < 0 {
        return;
    }
    // SAFETY: cpu_set_t is plain data; sched_setaffinity(0) acts on the
    // calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

pub use rcni_testkit::Bpffs;

/// A plugin call from inside `node` as a runtime makes it: only the CNI_*
/// variables (eth0) and a plain PATH, stdin and stdout piped.
pub fn plugin_command(
    node: &NetNs,
    plugin: &Path,
    cni_path: &Path,
    cmd: &str,
    cid: &str,
    pod: &str,
) -> std::process::Command {
    let mut c = node.command(plugin);
    rcni_testkit::keep_probe_dir(c.env_clear())
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("CNI_COMMAND", cmd)
        .env("CNI_CONTAINERID", cid)
        .env("CNI_NETNS", pod)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", cni_path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    c
}

/// Runs a plugin from inside `node`: (stdout, success, wall µs).
pub fn call(
    node: &NetNs,
    plugin: &Path,
    cni_path: &Path,
    cmd: &str,
    cid: &str,
    pod: &str,
    conf: &Value,
) -> (Value, bool, f64) {
    let mut c = plugin_command(node, plugin, cni_path, cmd, cid, pod);
    c.stderr(Stdio::piped());
    let t0 = Instant::now();
    let mut child = c.spawn().expect("spawn plugin");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&serde_json::to_vec(conf).unwrap())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let wall = t0.elapsed().as_secs_f64() * 1e6;
    let v = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    if !out.status.success() {
        eprintln!(
            "{} {cmd} failed: {} {}",
            plugin.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    (v, out.status.success(), wall)
}

/// The pod address of family v4/v6 in a CNI result.
pub fn addr(result: &Value, v4: bool) -> IpAddr {
    result["ips"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["address"].as_str())
        .map(|a| a.split('/').next().unwrap().parse::<IpAddr>().unwrap())
        .find(|a| a.is_ipv4() == v4)
        .unwrap()
}

/// A runtime for netlink calls.
pub fn rt() -> tokio::runtime::Runtime {
    rcni_netlink::runtime().unwrap()
}

/// A 1-byte TCP echo server in `ns` on `addr`, for the whole run.
pub fn rr_server(ns: &NetNs, addr: IpAddr, cpu: i32) -> SocketAddr {
    rcni_testkit::tcp_server(ns, addr, move |mut s| {
        s.set_nodelay(true).unwrap();
        pin_to(cpu);
        let mut b = [0u8; 1];
        while let Ok(1) = s.read(&mut b) {
            if s.write_all(&b).is_err() {
                return;
            }
        }
    })
}

/// `n` request/response exchanges of 1 byte: sorted round-trip times (µs).
pub fn rr(ns: &NetNs, to: SocketAddr, n: usize, cpu: i32) -> Vec<f64> {
    std::thread::scope(|sc| sc.spawn(|| rr_pinned(ns, to, n, cpu)).join().unwrap())
}

fn rr_pinned(ns: &NetNs, to: SocketAddr, n: usize, cpu: i32) -> Vec<f64> {
    pin_to(cpu);
    let mut s = ns
        .run(move || TcpStream::connect_timeout(&to, Duration::from_secs(3)))
        .unwrap()
        .unwrap();
    s.set_nodelay(true).unwrap();
    let mut b = [7u8; 1];
    for _ in 0..200 {
        s.write_all(&b).unwrap();
        s.read_exact(&mut b).unwrap();
    }
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        s.write_all(&b).unwrap();
        s.read_exact(&mut b).unwrap();
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v
}

/// `n` connections, each a connect, a 1-byte exchange and an abortive close
/// (RST: no TIME_WAIT piles up over many rounds): sorted times (µs). Every
/// connection's first packet meets the policy rules; later ones the
/// conntrack entry its first one made.
pub fn crr(ns: &NetNs, to: SocketAddr, n: usize, cpu: i32) -> Vec<f64> {
    // On a thread of its own inside `ns` (pinned with it).
    ns.run(|| {
        pin_to(cpu);
        let warm = n / 10 + 5;
        let mut v = Vec::with_capacity(n);
        for i in 0..n + warm {
            let t = Instant::now();
            let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(3)).unwrap();
            s.set_nodelay(true).unwrap();
            let mut b = [7u8; 1];
            s.write_all(&b).unwrap();
            s.read_exact(&mut b).unwrap();
            abort(s);
            if i >= warm {
                v.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v
    })
    .unwrap()
}

/// Closes `s` with a RST (SO_LINGER 0).
fn abort(s: TcpStream) {
    use std::os::fd::AsRawFd;
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt with a linger of the right size on a live socket.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &l as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as u32,
        )
    };
}

/// Whether a TCP connection from `ns` to `to` opens within `timeout`.
pub fn connects(ns: &NetNs, to: SocketAddr, timeout: Duration) -> bool {
    ns.run(move || TcpStream::connect_timeout(&to, timeout).map(abort).is_ok())
        .unwrap()
}

/// The `p` quantile (0..=1) of `v`, nearest rank.
pub fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

pub use rcni_testkit::IperfServer;

/// Starts iperf3 -s on port 5201 in `ns`.
pub fn iperf_server(ns: &NetNs) -> IperfServer {
    IperfServer::start(ns, None, 5201)
}

/// Gbit/s received over `secs` with `streams` parallel streams.
pub fn iperf(ns: &NetNs, dst: IpAddr, streams: usize, secs: u64) -> f64 {
    iperf_with(ns, dst, streams, secs, &[])
}

/// [`iperf`] with more iperf3 client options (`-A 0,1` to pin both ends).
pub fn iperf_with(ns: &NetNs, dst: IpAddr, streams: usize, secs: u64, extra: &[&str]) -> f64 {
    for _ in 0..3 {
        let out = rcni_testkit::tied_command_in(ns, "iperf3")
            .args([
                "-c",
                &dst.to_string(),
                "-p",
                "5201",
                "-t",
                &secs.to_string(),
                "-P",
                &streams.to_string(),
                "-J",
            ])
            .args(extra)
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        if let Some(bps) = v["end"]["sum_received"]["bits_per_second"].as_f64() {
            return bps / 1e9;
        }
        // The server takes one test at a time; retry if it was busy.
        std::thread::sleep(Duration::from_millis(300));
    }
    f64::NAN
}

/// Round `r`'s order of `n` setups: rotated by r, reversed every other
/// cycle, so each setup takes each position equally often.
pub fn order(n: usize, r: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).map(|i| (i + r) % n).collect();
    if (r / n) % 2 == 1 {
        v.reverse();
    }
    v
}

/// "min-max" of `v`.
pub fn spread(v: &[f64]) -> String {
    format!("{:.1}-{:.1}", pct(v, 0.0), pct(v, 1.0))
}

/// Whether we run as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions.
    unsafe { libc::geteuid() == 0 }
}
