//! cnibench: the bridge + host-local chain, ours and the reference side by
//! side in one run, through the same runner (fork, setns into a throwaway
//! node namespace, exec with the CNI_* environment). Per operation it takes
//! wall time and, from wait4(2), the plugin processes' CPU time and peak RSS.
//! Everything lives in namespaces held by this process; nothing survives it.

use clap::Parser;
use rcni_netns::NetNs;
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Instant;

#[derive(Parser)]
#[command(about = "bridge + host-local: rcni against the reference plugins")]
struct Args {
    /// Directory with our plugins.
    #[arg(long, default_value = "target/release")]
    ours: PathBuf,
    /// Directory with the reference plugins.
    #[arg(long, default_value = "/usr/lib/cni")]
    reference: PathBuf,
    /// ADD+DEL rounds for the latency figures.
    #[arg(long, default_value_t = 200)]
    rounds: usize,
    /// Pod counts at which ADD latency is sampled.
    #[arg(long, value_delimiter = ',', default_value = "10,100,1000")]
    scale: Vec<usize>,
    /// Concurrent ADDs for the duplicate-address check.
    #[arg(long, default_value_t = 50)]
    concurrent: usize,
    /// Seconds to wait at each scale point before a second sample: every new
    /// pod's IPv6 start-up traffic (router solicitations, MLD reports) is
    /// flooded by the bridge to every port, and right after a burst of ADDs
    /// that flood, not the plugin, sets the latency of both suites.
    #[arg(long, default_value_t = 20)]
    settle: u64,
    /// Skip the ADD-latency-at-scale part.
    #[arg(long)]
    skip_scale: bool,
    /// Rounds of the concurrent ADDs (each timed per ADD: p50, p99).
    #[arg(long, default_value_t = 1)]
    concurrent_rounds: usize,
    /// `"ipMasq": true` with no `ipMasqBackend`: the reference's default
    /// backend (iptables where it works), as podman's and containerd's
    /// bridge configs have it.
    #[arg(long)]
    ip_masq: bool,
}

#[derive(Clone, Copy, Default)]
struct Sample {
    wall_us: f64,
    cpu_us: f64,
    rss_kib: i64,
}

struct Impl {
    name: &'static str,
    bridge: PathBuf,
    path: PathBuf,
    node: NetNs,
    data: tempfile::TempDir,
    /// `--ip-masq`.
    masq: bool,
}

impl Impl {
    fn conf(&self) -> Value {
        conf(self.data.path(), self.masq)
    }
}

fn conf(data: &Path, masq: bool) -> Value {
    json!({"cniVersion": "0.4.0", "name": "benchnet", "type": "bridge", "bridge": "cni0",
        "isGateway": true, "ipMasq": masq,
        "ipam": {"type": "host-local", "dataDir": data, "ranges": [[{"subnet": "10.66.0.0/16"}]]}})
}

/// Runs one plugin call from inside the node namespace; returns stdout,
/// success, and the sample (the plugin and the IPAM child it waited for).
fn run(im: &Impl, cmd: &str, cid: &str, pod: &str, stdin: &[u8]) -> (Vec<u8>, bool, Sample) {
    let mut c = rcni_bench::plugin_command(&im.node, &im.bridge, &im.path, cmd, cid, pod);
    c.stderr(Stdio::null());
    let t0 = Instant::now();
    // Reaped below with wait4(2), which also returns its rusage.
    #[allow(clippy::zombie_processes)]
    let mut child = c.spawn().expect("spawn plugin");
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let mut out = Vec::new();
    child.stdout.take().unwrap().read_to_end(&mut out).unwrap();
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value (plain integers).
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waiting for our own child; rusage is a plain out-parameter.
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut ru) };
    assert_eq!(pid, child.id() as i32, "wait4");
    let wall = t0.elapsed().as_secs_f64() * 1e6;
    let tv = |t: libc::timeval| t.tv_sec as f64 * 1e6 + t.tv_usec as f64;
    let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    (
        out,
        ok,
        Sample {
            wall_us: wall,
            cpu_us: tv(ru.ru_utime) + tv(ru.ru_stime),
            rss_kib: ru.ru_maxrss,
        },
    )
}

/// CPU time of all our reaped children so far. A plugin's IPAM child is
/// reaped by the plugin, and the kernel folds it into the plugin's totals,
/// which reach ours when we reap the plugin: the delta around one call is
/// plugin + IPAM.
fn children_cpu_us() -> f64 {
    use nix::sys::resource::{UsageWho, getrusage};
    use nix::sys::time::TimeValLike;
    let Ok(ru) = getrusage(UsageWho::RUSAGE_CHILDREN) else {
        return 0.0;
    };
    (ru.user_time().num_microseconds() + ru.system_time().num_microseconds()) as f64
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

struct Stats {
    median: f64,
    p99: f64,
    cpu: f64,
    rss: i64,
}

fn stats(s: &[Sample]) -> Stats {
    let mut w: Vec<f64> = s.iter().map(|x| x.wall_us).collect();
    let mut c: Vec<f64> = s.iter().map(|x| x.cpu_us).collect();
    Stats {
        median: pct(&mut w, 0.5),
        p99: pct(&mut w, 0.99),
        cpu: pct(&mut c, 0.5),
        rss: s.iter().map(|x| x.rss_kib).max().unwrap_or(0),
    }
}

/// A pod of the scale run: namespace, its path, container ID, ADD output
/// (the DEL's prevResult), and the ADD's sample.
type Pod = (NetNs, String, String, Vec<u8>, Sample);

fn pod() -> NetNs {
    NetNs::new_anonymous().expect("pod namespace")
}

fn ips_of(out: &[u8]) -> Vec<String> {
    let v: Value = serde_json::from_slice(out).unwrap_or(Value::Null);
    v["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| i["address"].as_str().map(String::from))
        .collect()
}

fn reservations(im: &Impl) -> usize {
    std::fs::read_dir(im.data.path().join("benchnet"))
        .map(|rd| {
            rd.flatten()
                .filter(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    n != "lock" && !n.starts_with("last_reserved_ip") && !n.starts_with(".rcni-")
                })
                .count()
        })
        .unwrap_or(0)
}

/// DEL of a scale pod, with its ADD's result as prevResult.
fn del_pod(im: &Impl, (_, path, cid, out, _): &Pod) {
    let mut c = im.conf();
    c["prevResult"] = serde_json::from_slice(out).unwrap();
    let (_, ok, _) = run(im, "DEL", cid, path, &serde_json::to_vec(&c).unwrap());
    assert!(ok, "{} DEL failed", im.name);
}

/// Multicast packets the node's bridge has received from its ports.
fn bridge_mcast(im: &Impl) -> u64 {
    let mut c = im.node.command("ip");
    c.args(["-s", "-j", "link", "show", "cni0"]);
    let v: Value = serde_json::from_slice(&c.output().unwrap().stdout).unwrap_or(Value::Null);
    v[0]["stats64"]["rx"]["multicast"].as_u64().unwrap_or(0)
}

fn veths_left(im: &Impl) -> usize {
    let mut c = im.node.command("ip");
    c.args(["-o", "link", "show", "type", "veth"]);
    String::from_utf8_lossy(&c.output().unwrap().stdout)
        .lines()
        .count()
}

fn main() {
    let a = Args::parse();
    let mk = |name, dir: &Path| Impl {
        name,
        bridge: dir.join("bridge"),
        path: dir.to_path_buf(),
        node: pod(),
        data: tempfile::tempdir().unwrap(),
        masq: a.ip_masq,
    };
    let impls = [mk("rcni", &a.ours), mk("reference", &a.reference)];
    for im in &impls {
        assert!(im.bridge.is_file(), "{} missing", im.bridge.display());
    }

    // 1. ADD and DEL latency, interleaved so drift hits both alike.
    let mut add: [Vec<Sample>; 2] = Default::default();
    let mut del: [Vec<Sample>; 2] = Default::default();
    let mut cpu_add = [0.0f64; 2];
    let mut cpu_del = [0.0f64; 2];
    for r in 0..a.rounds + 5 {
        for (i, im) in impls.iter().enumerate() {
            let p = pod();
            let path = p.proc_path().display().to_string();
            let stdin = serde_json::to_vec(&im.conf()).unwrap();
            let c0 = children_cpu_us();
            let (out, ok, s) = run(im, "ADD", "lat", &path, &stdin);
            let c1 = children_cpu_us();
            assert!(
                ok,
                "{} ADD failed: {}",
                im.name,
                String::from_utf8_lossy(&out)
            );
            let mut c = im.conf();
            c["prevResult"] = serde_json::from_slice(&out).unwrap();
            let (_, ok, d) = run(im, "DEL", "lat", &path, &serde_json::to_vec(&c).unwrap());
            let c2 = children_cpu_us();
            assert!(ok, "{} DEL failed", im.name);
            // The first rounds warm caches (page cache, the bridge's creation).
            if r >= 5 {
                add[i].push(Sample {
                    cpu_us: c1 - c0,
                    ..s
                });
                del[i].push(Sample {
                    cpu_us: c2 - c1,
                    ..d
                });
                cpu_add[i] += c1 - c0;
                cpu_del[i] += c2 - c1;
            }
        }
    }
    println!(
        "bridge + host-local{}, {} rounds each (microseconds; CPU = plugin + its IPAM child)",
        if a.ip_masq {
            " + ipMasq (default backend)"
        } else {
            ""
        },
        a.rounds
    );
    println!(
        "{:<10} {:<4} {:>9} {:>9} {:>9} {:>10}",
        "", "op", "median", "p99", "cpu", "peak RSS"
    );
    let mut st = Vec::new();
    for (i, im) in impls.iter().enumerate() {
        for (op, s) in [("ADD", &add[i]), ("DEL", &del[i])] {
            let x = stats(s);
            println!(
                "{:<10} {:<4} {:>9.0} {:>9.0} {:>9.0} {:>7} KiB",
                im.name, op, x.median, x.p99, x.cpu, x.rss
            );
            st.push(x);
        }
    }
    for (k, op) in [(0, "ADD"), (1, "DEL")] {
        let (o, r) = (&st[k], &st[k + 2]);
        println!(
            "ratio rcni/reference {op}: median {:.2}  p99 {:.2}  cpu {:.2}  peak RSS {:.2}",
            o.median / r.median,
            o.p99 / r.p99,
            o.cpu / r.cpu,
            o.rss as f64 / r.rss as f64
        );
    }

    // 2. ADD latency as the bridge fills up: 15 ADDs right after the pods
    // before them were added ("fresh"), then 15 more after `settle` seconds.
    if !a.skip_scale {
        scale(&a, &impls);
    }
    concurrent(&a, &impls);
}

/// ADD latency as the bridge fills up.
fn scale(a: &Args, impls: &[Impl]) {
    println!(
        "\nADD latency with N pods on the bridge (median of 15 ADDs, microseconds; \
         mcast = packets/s the bridge floods to its ports meanwhile)"
    );
    for im in impls {
        let stdin = serde_json::to_vec(&im.conf()).unwrap();
        let mut pods: Vec<Pod> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut add_pod = |pods: &mut Vec<Pod>| {
            let p = pod();
            let path = p.proc_path().display().to_string();
            let cid = format!("scale{}", pods.len());
            let (out, ok, s) = run(im, "ADD", &cid, &path, &stdin);
            assert!(
                ok,
                "{} ADD {cid} failed: {}",
                im.name,
                String::from_utf8_lossy(&out)
            );
            for ip in ips_of(&out) {
                assert!(
                    seen.insert(ip.clone()),
                    "{}: duplicate address {ip}",
                    im.name
                );
            }
            pods.push((p, path, cid, out, s));
        };
        let sample = |pods: &mut Vec<Pod>, add_pod: &mut dyn FnMut(&mut Vec<Pod>)| {
            let m0 = bridge_mcast(im);
            let t0 = Instant::now();
            let mut w: Vec<f64> = (0..15)
                .map(|_| {
                    add_pod(pods);
                    pods.last().unwrap().4.wall_us
                })
                .collect();
            let pps = (bridge_mcast(im) - m0) as f64 / t0.elapsed().as_secs_f64();
            (pct(&mut w, 0.5), pps)
        };
        // (pods, fresh (median µs, multicast pps), settled (same)).
        #[allow(clippy::type_complexity)]
        // Per scale point: (pods, [fresh, settled] as (median µs, mcast/s)).
        let mut rows: Vec<(usize, [(f64, f64); 2])> = Vec::new();
        for &target in &a.scale {
            while pods.len() < target {
                add_pod(&mut pods);
            }
            let fresh = sample(&mut pods, &mut add_pod);
            // The fresh sample's pods go again: a bridge takes at most 1023
            // ports (BR_MAX_PORTS), so 1000 + 2 x 15 would not fit.
            for p in pods.drain(target..) {
                del_pod(im, &p);
            }
            std::thread::sleep(std::time::Duration::from_secs(a.settle));
            let settled = sample(&mut pods, &mut add_pod);
            rows.push((target, [fresh, settled]));
        }
        for (k, label) in ["fresh", "settled"].iter().enumerate() {
            let mut line = format!("{:<10} {label:<8}", im.name);
            for (t, samples) in &rows {
                let (m, pps) = samples[k];
                line += &format!("  {t:>5} pods: {m:>6.0} ({pps:>5.0} mcast)");
            }
            if let (Some((_, first)), Some((_, last))) = (rows.first(), rows.last()) {
                line += &format!("  largest/smallest {:.2}", last[k].0 / first[k].0);
            }
            println!("{line}");
        }
        for p in &pods {
            del_pod(im, p);
        }
        println!(
            "{:<10} after {} ADD/DEL cycles: {} reservations, {} veths left",
            im.name,
            // The fresh samples' pods were deleted along the way.
            pods.len() + 15 * a.scale.len(),
            reservations(im),
            veths_left(im)
        );
    }
}

/// Concurrent ADDs, `concurrent_rounds` times: each ADD's latency (p50,
/// p99 over all rounds) and no address handed out twice.
fn concurrent(a: &Args, impls: &[Impl]) {
    println!(
        "\n{} concurrent ADDs, {} round(s) (milliseconds per ADD)",
        a.concurrent, a.concurrent_rounds
    );
    let mut p99s = Vec::new();
    for im in impls {
        let stdin = serde_json::to_vec(&im.conf()).unwrap();
        let mut times = Vec::new();
        for round in 0..a.concurrent_rounds {
            let pods: Vec<(NetNs, String)> = (0..a.concurrent)
                .map(|_| {
                    let p = pod();
                    let path = p.proc_path().display().to_string();
                    (p, path)
                })
                .collect();
            let t0 = Instant::now();
            let outs: Vec<(Vec<u8>, bool, Sample)> = std::thread::scope(|s| {
                let hs: Vec<_> = pods
                    .iter()
                    .enumerate()
                    .map(|(n, (_, path))| {
                        let stdin = &stdin;
                        s.spawn(move || run(im, "ADD", &format!("conc{round}-{n}"), path, stdin))
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let took = t0.elapsed().as_secs_f64() * 1e3;
            times.extend(outs.iter().map(|o| o.2.wall_us / 1e3));
            let failed = outs.iter().filter(|o| !o.1).count();
            let all: Vec<String> = outs.iter().flat_map(|o| ips_of(&o.0)).collect();
            let uniq: std::collections::HashSet<&String> = all.iter().collect();
            println!(
                "{:<10} round {round}: {} ok, {} failed, {} addresses, {} duplicates, {:.0} ms in all",
                im.name,
                outs.len() - failed,
                failed,
                all.len(),
                all.len() - uniq.len(),
                took
            );
            for (n, ((_, path), (out, _, _))) in pods.iter().zip(&outs).enumerate() {
                let mut c = im.conf();
                if let Ok(v) = serde_json::from_slice::<Value>(out) {
                    c["prevResult"] = v;
                }
                run(
                    im,
                    "DEL",
                    &format!("conc{round}-{n}"),
                    path,
                    &serde_json::to_vec(&c).unwrap(),
                );
            }
        }
        let (p50, p99) = (pct(&mut times, 0.5), pct(&mut times, 0.99));
        println!(
            "{:<10} ADD p50 {p50:.1} ms  p99 {p99:.1} ms; after DEL: {} reservations, {} veths left",
            im.name,
            reservations(im),
            veths_left(im)
        );
        p99s.push((p50, p99));
    }
    if let [o, r] = p99s[..] {
        println!(
            "ratio rcni/reference concurrent ADD: p50 {:.2}  p99 {:.2}",
            o.0 / r.0,
            o.1 / r.1
        );
    }
}
