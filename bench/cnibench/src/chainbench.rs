//! chainbench: podman's default chain (bridge + portmap + firewall +
//! tuning, `conf/70-podman-chain.conflist`), ours and the reference side by
//! side. Each round runs the whole chain's ADD (in order, each plugin
//! getting the previous result) and DEL (in reverse) for one pod, for both
//! suites, alternating which goes first. Reported: median and p99 wall
//! time of chain ADD and chain DEL, the CPU time of everything the chain
//! started (plugins, IPAM, nft/iptables processes), the per-plugin medians,
//! and the ratios. Each suite has its own throwaway node namespace. With
//! the conflist as podman writes it both suites take the reference's
//! defaults (iptables for portmap and firewall); with
//! `bench/podman-chain-nftables.conflist` ours writes nftables while the
//! reference (which in v1.1.1 knows no nftables backend and treats the key
//! as its default) still writes iptables.

use clap::Parser;
use rcni_netns::NetNs;
use serde_json::{Value, json};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Instant;

#[derive(Parser)]
#[command(about = "bridge + portmap + firewall + tuning: rcni against the reference plugins")]
struct Args {
    /// Directory with our plugins.
    #[arg(long, default_value = "target/release")]
    ours: PathBuf,
    /// Directory with the reference plugins.
    #[arg(long, default_value = "/usr/lib/cni")]
    reference: PathBuf,
    /// The conflist to run.
    #[arg(long, default_value = "conf/70-podman-chain.conflist")]
    conf: PathBuf,
    /// Chain ADD+DEL rounds per suite.
    #[arg(long, default_value_t = 100)]
    rounds: usize,
    /// The reference runs only the conflist's plugins of these types (e.g.
    /// `bridge`: ours with fastpath and policy against the reference's
    /// bridge alone, which has neither).
    #[arg(long, value_delimiter = ',')]
    reference_only: Vec<String>,
}

/// One suite: its plugins, node namespace and state directory.
struct Suite {
    name: &'static str,
    dir: PathBuf,
    node: NetNs,
    state: tempfile::TempDir,
    /// The eBPF plugins' pin root (a bpffs of the bench's own).
    pins: Option<rcni_testkit::Bpffs>,
}

/// The CPU time (user + system, µs) of every reaped descendant so far.
fn reaped_cpu() -> f64 {
    use nix::sys::resource::{UsageWho, getrusage};
    use nix::sys::time::TimeValLike;
    let Ok(ru) = getrusage(UsageWho::RUSAGE_CHILDREN) else {
        return 0.0;
    };
    (ru.user_time().num_microseconds() + ru.system_time().num_microseconds()) as f64
}

fn median_p99(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

impl Suite {
    /// The plugin list with this suite's state directories put in (the
    /// conflist's defaults would write to the machine's /var/lib/cni).
    fn plugins(&self, list: &Value) -> Vec<Value> {
        let mut out = Vec::new();
        for p in list["plugins"].as_array().expect("plugins") {
            let mut p = p.clone();
            if p.get("ipam").is_some() {
                p["ipam"]["dataDir"] = json!(self.state.path().join("ipam"));
            }
            if p["type"] == "tuning" {
                p["dataDir"] = json!(self.state.path().join("tuning"));
            }
            if p["type"] == "fastpath" || p["type"] == "policy" {
                let pins = self.pins.as_ref().expect("a bpffs for the eBPF plugins");
                p["pinRoot"] = json!(pins.root());
            }
            if p["type"] == "policy" {
                p["dataDir"] = json!(self.state.path().join("policy"));
                p["policyDir"] = json!(self.state.path().join("policy.d"));
                // The pod as a runtime's Kubernetes args describe it: in
                // the namespace the conflist's policies select.
                p["args"] = json!({"cni": {"labels": {"app": "bench"}, "namespace": "prod"}});
            }
            out.push(p);
        }
        out
    }

    /// Runs one plugin inside the node namespace; (stdout, wall µs).
    fn call(&self, cmd: &str, plugin: &Value, pod: &str, stdin: &Value) -> (Value, f64) {
        let bin = self.dir.join(plugin["type"].as_str().unwrap());
        let mut c = rcni_bench::plugin_command(&self.node, &bin, &self.dir, cmd, "bench", pod);
        c.stderr(Stdio::piped());
        let start = Instant::now();
        let mut child = c
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
        child
            .stdin
            .take()
            .unwrap()
            .write_all(&serde_json::to_vec(stdin).unwrap())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let took = start.elapsed().as_secs_f64() * 1e6;
        assert!(
            out.status.success(),
            "{} {cmd} {} failed: {}{}",
            self.name,
            plugin["type"],
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let v = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        (v, took)
    }
}

/// A plugin's stdin as libcni builds it.
fn stdin_of(plugin: &Value, list: &Value, caps: &Value, prev: Option<&Value>) -> Value {
    let mut p = plugin.clone();
    p["name"] = list["name"].clone();
    p["cniVersion"] = list["cniVersion"].clone();
    if let Some(c) = p.get("capabilities").and_then(Value::as_object) {
        let rc: serde_json::Map<String, Value> = c
            .iter()
            .filter(|(k, on)| on.as_bool() == Some(true) && caps.get(k.as_str()).is_some())
            .map(|(k, _)| (k.clone(), caps[k.as_str()].clone()))
            .collect();
        if !rc.is_empty() {
            p["runtimeConfig"] = Value::Object(rc);
        }
    }
    if let Some(prev) = prev {
        p["prevResult"] = prev.clone();
    }
    p
}

/// Per-round figures of one suite: chain ADD, chain DEL (wall and CPU),
/// and each plugin's ADD and DEL wall time.
#[derive(Default)]
struct Figures {
    add: Vec<f64>,
    del: Vec<f64>,
    add_cpu: Vec<f64>,
    del_cpu: Vec<f64>,
    per_plugin: Vec<(Vec<f64>, Vec<f64>)>,
}

fn round(s: &Suite, plugins: &[Value], list: &Value, caps: &Value, f: &mut Figures) {
    let pod = NetNs::new_anonymous().expect("pod namespace");
    let path = pod.proc_path().display().to_string();
    if f.per_plugin.is_empty() {
        f.per_plugin = vec![Default::default(); plugins.len()];
    }
    let (c0, t0) = (reaped_cpu(), Instant::now());
    let mut prev: Option<Value> = None;
    for (i, p) in plugins.iter().enumerate() {
        let (out, us) = s.call("ADD", p, &path, &stdin_of(p, list, caps, prev.as_ref()));
        f.per_plugin[i].0.push(us);
        prev = Some(out);
    }
    f.add.push(t0.elapsed().as_secs_f64() * 1e6);
    let (c1, t1) = (reaped_cpu(), Instant::now());
    f.add_cpu.push(c1 - c0);
    for (i, p) in plugins.iter().enumerate().rev() {
        let (_, us) = s.call("DEL", p, &path, &stdin_of(p, list, caps, prev.as_ref()));
        f.per_plugin[i].1.push(us);
    }
    f.del.push(t1.elapsed().as_secs_f64() * 1e6);
    f.del_cpu.push(reaped_cpu() - c1);
}

/// What a suite left in its node after the last DEL: per-pod rules and
/// address reservations.
fn leftovers(s: &Suite) -> String {
    let mut text = String::new();
    for (tool, args) in [
        ("nft", &["list", "ruleset"][..]),
        ("iptables-save", &[][..]),
        ("ip6tables-save", &[][..]),
    ] {
        if let Ok(o) = s.node.command(tool).args(args).output() {
            text.push_str(&String::from_utf8_lossy(&o.stdout));
        }
    }
    let rules = text
        .lines()
        .filter(|l| {
            l.contains("dnat to")
                || l.contains("CNI-DN-")
                || l.contains("accept comment")
                || (l.contains("10.88.") && !l.starts_with('#'))
        })
        .count();
    let reservations = std::fs::read_dir(s.state.path().join("ipam/podnet"))
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    n != "lock" && !n.starts_with("last_reserved") && !n.starts_with('.')
                })
                .count()
        })
        .unwrap_or(0);
    format!("{rules} per-pod rules, {reservations} reservations")
}

fn main() {
    let a = Args::parse();
    let list: Value = serde_json::from_slice(
        &std::fs::read(&a.conf).unwrap_or_else(|e| panic!("{}: {e}", a.conf.display())),
    )
    .expect("conflist JSON");
    let caps = json!({"portMappings": [
        {"hostPort": 8080, "containerPort": 80, "protocol": "tcp"},
        {"hostPort": 8443, "containerPort": 443, "protocol": "tcp"}]});
    let ebpf = list["plugins"]
        .as_array()
        .expect("plugins")
        .iter()
        .any(|p| p["type"] == "fastpath" || p["type"] == "policy");
    if ebpf {
        // Its bpffs mount must not outlive a run killed by a signal.
        rcni_testkit::private_mounts();
    }
    let suite = |name, dir: &Path| Suite {
        name,
        dir: dir.to_path_buf(),
        node: NetNs::new_anonymous().expect("node namespace"),
        state: tempfile::tempdir().unwrap(),
        pins: ebpf.then(rcni_testkit::Bpffs::mount),
    };
    let suites = [suite("rcni", &a.ours), suite("reference", &a.reference)];
    let mut plugins: Vec<Vec<Value>> = suites.iter().map(|s| s.plugins(&list)).collect();
    if !a.reference_only.is_empty() {
        plugins[1].retain(|p| {
            a.reference_only
                .iter()
                .any(|t| p["type"].as_str() == Some(t.as_str()))
        });
    }
    for (s, ps) in suites.iter().zip(&plugins) {
        for p in ps {
            let b = s.dir.join(p["type"].as_str().unwrap());
            assert!(b.is_file(), "{} missing", b.display());
        }
        // The node forwards, as a podman host does.
        let _ = s
            .node
            .command("sysctl")
            .args(["-qw", "net.ipv4.ip_forward=1"])
            .status();
    }
    let mut figs = [Figures::default(), Figures::default()];
    let warmup = 3;
    for r in 0..a.rounds + warmup {
        // Alternate who goes first, so drift hits both alike.
        let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let mut f = Figures::default();
            let target = if r < warmup { &mut f } else { &mut figs[i] };
            round(&suites[i], &plugins[i], &list, &caps, target);
        }
    }
    let types_of = |ps: &[Value]| -> Vec<String> {
        ps.iter()
            .map(|p| p["type"].as_str().unwrap().to_string())
            .collect()
    };
    let types = types_of(&plugins[0]);
    println!(
        "{} ({}), {} rounds per suite, microseconds; CPU = every process the chain started",
        a.conf.display(),
        types.join(" + "),
        a.rounds
    );
    if !a.reference_only.is_empty() {
        println!(
            "the reference runs only {}",
            types_of(&plugins[1]).join(" + ")
        );
    }
    println!(
        "{:<10} {:<4} {:>9} {:>9} {:>9}",
        "", "op", "median", "p99", "cpu"
    );
    let mut med = [[0.0; 2]; 2];
    let mut p99 = [[0.0; 2]; 2];
    let mut cpu = [[0.0; 2]; 2];
    for (i, s) in suites.iter().enumerate() {
        let f = &figs[i];
        for (k, (op, wall, c)) in [("ADD", &f.add, &f.add_cpu), ("DEL", &f.del, &f.del_cpu)]
            .into_iter()
            .enumerate()
        {
            let (m, p) = median_p99(wall.clone());
            let (cm, _) = median_p99(c.clone());
            println!("{:<10} {op:<4} {m:>9.0} {p:>9.0} {cm:>9.0}", s.name);
            (med[i][k], p99[i][k], cpu[i][k]) = (m, p, cm);
        }
    }
    for (k, op) in ["ADD", "DEL"].iter().enumerate() {
        println!(
            "ratio rcni/reference chain {op}: median {:.3}  p99 {:.3}  cpu {:.3}",
            med[0][k] / med[1][k],
            p99[0][k] / p99[1][k],
            cpu[0][k] / cpu[1][k]
        );
    }
    println!("\nper plugin, median microseconds (ADD / DEL)");
    for t in &types {
        let mut line = format!("{t:<10}");
        for (i, s) in suites.iter().enumerate() {
            // The reference may run fewer plugins (--reference-only).
            let Some(k) = types_of(&plugins[i]).iter().position(|x| x == t) else {
                continue;
            };
            let (a, _) = median_p99(figs[i].per_plugin[k].0.clone());
            let (d, _) = median_p99(figs[i].per_plugin[k].1.clone());
            line += &format!("  {}: {a:>7.0} / {d:>7.0}", s.name);
        }
        println!("{line}");
    }
    for s in &suites {
        println!("{:<10} after the last DEL: {}", s.name, leftovers(s));
    }
}
