//! polbench: what network policy costs the datapath, and how fast a policy
//! change reaches the pods, for the policy plugin's eBPF and nftables
//! backends side by side, in one run.
//!
//! Per backend, a node namespace with the bridge network (bridge ->
//! policy): a server pod (app=server), a client pod (app=client) and a pod
//! the policy must keep out (app=other). The policy selecting the server
//! allows the client (a podSelector) on the test ports, plus N `ipBlock`
//! peers (distinct /24s and /32s in 100.64.0.0/10, outside the pod
//! subnet): the N CIDR rules of the server's rule set. N moves between the
//! `--rules` values by rewriting the policy file and running `policy sync`
//! (timed too). Every round measures every (backend, N), and a bridge
//! without the policy plugin for context, in a rotated order: TCP
//! request/response latency (1-byte ping-pong on one connection, p50 and
//! p99), connect/request/response/close latency (every connection's first
//! packet is looked up in the rules; after it, conntrack answers), and
//! iperf3 throughput on one stream. The ratios N/0 are taken within each
//! round (paired) and reported as median and spread over the rounds.
//!
//! Then the time `policy sync` takes to apply a changed policy to
//! `--sync-pods` pods (a port of the rule moves), checked by connecting to
//! the first and the last pod on the new port.
//!
//! Everything lives in namespaces this process holds; the eBPF backend pins
//! under a bpffs mounted on a temporary directory and unmounted on drop, the
//! nftables table lives in its node namespace: nothing survives the run.

use clap::Parser;
use rcni_bench::{
    Bpffs, IperfServer, addr, call, connects, crr, iperf_server, iperf_with, is_root, order, pct,
    rr, rr_server, spread,
};
use rcni_netns::NetNs;
use serde_json::{Value, json};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(
    about = "network policy cost: eBPF and nftables backends with 0..10k CIDR rules, and sync time"
)]
struct Args {
    /// Directory with our plugins (bridge, host-local, policy).
    #[arg(long, default_value = "target/bench-bin")]
    ours: PathBuf,
    /// Policy backends to compare.
    #[arg(long, value_delimiter = ',', default_value = "ebpf,nftables")]
    backends: Vec<String>,
    /// Numbers of CIDR rules (ipBlock peers) in the server's policy; 0 is
    /// always measured (the paired ratios are against it).
    #[arg(long, value_delimiter = ',', default_value = "0,100,1000,10000")]
    rules: Vec<usize>,
    /// Rounds (each measures every setup once, in a rotated order).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// TCP request/response exchanges per setup and round.
    #[arg(long, default_value_t = 2000)]
    rr_count: usize,
    /// TCP connections (connect, 1-byte exchange, close) per setup and
    /// round (0 skips).
    #[arg(long, default_value_t = 300)]
    crr_count: usize,
    /// Seconds per iperf3 run (0 skips throughput).
    #[arg(long, default_value_t = 3)]
    tput_secs: u64,
    /// Pods for the sync timing (0 skips it).
    #[arg(long, default_value_t = 100)]
    sync_pods: usize,
    /// Policy changes synced to those pods.
    #[arg(long, default_value_t = 5)]
    sync_runs: usize,
    /// Leave out the bridge without the policy plugin.
    #[arg(long)]
    no_baseline: bool,
    /// Instead: what flow events cost (bench/flows.sh): per backend, flow
    /// events off ("flowEvents": "none") against on ("deny", with the
    /// collector running) while nothing is denied, and both while another
    /// pod floods the server with denied datagrams.
    #[arg(long)]
    flows: bool,
    /// The flood's datagrams per second (a new flow each).
    #[arg(long, default_value_t = 20000)]
    flood_pps: u64,
    /// CPU that the latency client and server run on (-1: anywhere).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    cpu: i32,
    /// iperf3 -A: CPUs of the throughput client and server ("" leaves
    /// them to the scheduler).
    #[arg(long, default_value = "")]
    iperf_cpus: String,
}

const NET: &str = "podnet";
const IPERF_PORT: u16 = 5201;
/// Distinct /24s and /32s for this many rules fit in 100.64.0.0/10.
const MAX_RULES: usize = 16384;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    Ebpf,
    Nftables,
}

impl Backend {
    fn parse(s: &str) -> Backend {
        match s {
            "ebpf" => Backend::Ebpf,
            "nftables" | "nft" => Backend::Nftables,
            _ => panic!("unknown backend {s:?} (ebpf, nftables)"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Backend::Ebpf => "ebpf",
            Backend::Nftables => "nftables",
        }
    }
}

/// Rule `i`'s CIDR: even rules /24s from 100.64.0.0, odd ones /32s from
/// 100.96.0.0; none overlaps another or the pod subnets.
fn extra_cidr(i: usize) -> String {
    let base = u32::from(Ipv4Addr::new(100, 64, 0, 0));
    let half = (i / 2) as u32;
    if i.is_multiple_of(2) {
        format!("{}/24", Ipv4Addr::from(base + half * 256))
    } else {
        format!("{}/32", Ipv4Addr::from(base + (32 << 16) + half))
    }
}

/// Selects app=server; lets app=client in on `ports`, and `n` CIDRs.
fn server_policy(n: usize, ports: &[u16]) -> Value {
    let mut from = vec![json!({"podSelector": {"matchLabels": {"app": "client"}}})];
    from.extend((0..n).map(|i| json!({"ipBlock": {"cidr": extra_cidr(i)}})));
    let ports: Vec<Value> = ports.iter().map(|p| json!({"port": p})).collect();
    json!({"name": "bench", "podSelector": {"matchLabels": {"app": "server"}},
           "ingress": [{"from": from, "ports": ports}]})
}

struct Pod {
    ns: NetNs,
    cid: String,
    app: String,
    bridge: Value,
    ip: IpAddr,
}

/// A node namespace with the bridge network, chained to policy when
/// `backend` is set. Drop takes everything with it: the pods' and the
/// node's namespaces, the bpffs, the state directories.
struct Node {
    backend: Option<Backend>,
    /// The policy config's flowEvents, when set.
    flow_events: Option<&'static str>,
    ours: PathBuf,
    pods: Vec<Pod>,
    ns: NetNs,
    subnet: &'static str,
    fs: Option<Bpffs>,
    ipam: tempfile::TempDir,
    state: tempfile::TempDir,
    policy_dir: tempfile::TempDir,
}

impl Node {
    fn new(backend: Option<Backend>, ours: &Path, subnet: &'static str) -> Node {
        let ns = NetNs::new_anonymous().unwrap();
        // New namespaces start with br_netfilter's bridge-nf-call-* on:
        // bridged packets then take netfilter's IP hooks, which only the
        // nftables backend needs (and turns on itself).
        if backend != Some(Backend::Nftables) {
            for key in [
                "net.bridge.bridge-nf-call-iptables",
                "net.bridge.bridge-nf-call-ip6tables",
            ] {
                if rcni_netlink::sysctl::get(&ns, key).is_ok() {
                    rcni_netlink::sysctl::set(&ns, key, "0").unwrap();
                }
            }
        }
        Node {
            backend,
            flow_events: None,
            ours: ours.to_path_buf(),
            pods: vec![],
            ns,
            subnet,
            fs: backend.map(|_| Bpffs::mount()),
            ipam: tempfile::tempdir().unwrap(),
            state: tempfile::tempdir().unwrap(),
            policy_dir: tempfile::tempdir().unwrap(),
        }
    }

    fn bridge_conf(&self) -> Value {
        json!({"cniVersion": "1.1.0", "name": NET, "type": "bridge",
            "bridge": "cni0", "isGateway": true,
            "ipam": {"type": "host-local", "dataDir": self.ipam.path(),
                     "ranges": [[{"subnet": self.subnet}]]}})
    }

    /// A pod on the bridge (policy not yet attached).
    fn add_pod(&mut self, app: &str) -> usize {
        let ns = NetNs::new_anonymous().unwrap();
        let cid = format!("{app}-{}", self.pods.len());
        let path = ns.proc_path().display().to_string();
        let conf = self.bridge_conf();
        let (bridge, ok, _) = call(
            &self.ns,
            &self.ours.join("bridge"),
            &self.ours,
            "ADD",
            &cid,
            &path,
            &conf,
        );
        assert!(ok, "bridge ADD");
        let ip = addr(&bridge, true);
        self.pods.push(Pod {
            ns,
            cid,
            app: app.into(),
            bridge,
            ip,
        });
        self.pods.len() - 1
    }

    /// policy ADD for pod `i` (chained after its bridge ADD): wall µs.
    fn attach(&self, i: usize) -> f64 {
        let b = self.backend.expect("a policy node");
        let p = &self.pods[i];
        let mut conf = json!({"cniVersion": "1.1.0", "name": NET, "type": "policy",
            "backend": b.name(), "pinRoot": self.fs.as_ref().unwrap().root(),
            "dataDir": self.state.path(), "policyDir": self.policy_dir.path(),
            "args": {"cni": {"labels": [{"key": "app", "value": p.app}],
                             "namespace": "default"}},
            "prevResult": p.bridge});
        if let Some(f) = self.flow_events {
            conf["flowEvents"] = json!(f);
        }
        let path = p.ns.proc_path().display().to_string();
        let (out, ok, wall) = call(
            &self.ns,
            &self.ours.join("policy"),
            &self.ours,
            "ADD",
            &p.cid,
            &path,
            &conf,
        );
        assert!(ok, "policy ADD ({})", b.name());
        assert_eq!(
            out["ips"], p.bridge["ips"],
            "policy must pass prevResult through"
        );
        wall
    }

    /// Writes policy `file` (aside, then renamed, as an operator's tooling
    /// would).
    fn write_policy(&self, file: &str, v: &Value) {
        let tmp = self.policy_dir.path().join(format!(".{file}.tmp"));
        std::fs::write(&tmp, serde_json::to_vec(v).unwrap()).unwrap();
        std::fs::rename(&tmp, self.policy_dir.path().join(file)).unwrap();
    }

    fn remove_policy(&self, file: &str) {
        let _ = std::fs::remove_file(self.policy_dir.path().join(file));
    }

    fn policy_cmd(&self, args: &[&str]) -> String {
        let dd = self.state.path().display().to_string();
        rcni_testkit::stdout_of(self.ns.command(self.ours.join("policy")).args(args).args([
            "--network",
            NET,
            "--data-dir",
            &dd,
        ]))
    }

    /// `policy sync`: (wall ms, the time it reports itself in ms, its line).
    fn sync(&self) -> (f64, f64, String) {
        let t = Instant::now();
        let line = self.policy_cmd(&["sync"]);
        let wall = t.elapsed().as_secs_f64() * 1e3;
        let own = line
            .rsplit_once(" in ")
            .and_then(|(_, r)| r.trim().trim_end_matches("ms").trim().parse().ok())
            .unwrap_or(f64::NAN);
        (wall, own, line.trim().to_string())
    }

    /// The most prefixes any rule set holds (what `policy show` reports).
    fn prefixes(&self) -> usize {
        let v: Value = serde_json::from_str(&self.policy_cmd(&["show", "--json"])).unwrap();
        v["rulesets"]
            .as_object()
            .into_iter()
            .flat_map(|m| m.values())
            .filter_map(|r| r["cidrs"].as_array().map(Vec::len))
            .max()
            .unwrap_or(0)
    }
}

/// A server and a client on one node, with the servers running.
struct Pair {
    name: String,
    node: Node,
    server: usize,
    client: usize,
    /// A pod the policy keeps out (policy nodes only).
    other: Option<usize>,
    rr: SocketAddr,
    rules: usize,
    _iperf: Option<IperfServer>,
}

impl Pair {
    fn new(args: &Args, backend: Option<Backend>) -> Pair {
        Pair::with_flows(args, backend, None)
    }

    fn with_flows(args: &Args, backend: Option<Backend>, flows: Option<&'static str>) -> Pair {
        let mut node = Node::new(backend, &args.ours, "10.203.0.0/24");
        node.flow_events = flows;
        let server = node.add_pod("server");
        let client = node.add_pod("client");
        let other = backend.map(|_| node.add_pod("other"));
        let s = &node.pods[server];
        let rr = rr_server(&s.ns, s.ip, args.cpu);
        let iperf = (args.tput_secs > 0).then(|| iperf_server(&s.ns));
        if backend.is_some() {
            node.write_policy("bench.json", &server_policy(0, &[IPERF_PORT, rr.port()]));
            for i in [server, client].into_iter().chain(other) {
                node.attach(i);
            }
        }
        Pair {
            name: backend.map_or("bridge, no policy", Backend::name).into(),
            node,
            server,
            client,
            other,
            rr,
            rules: 0,
            _iperf: iperf,
        }
    }

    /// Puts `n` CIDR rules in force: the sync's wall ms, if one was needed.
    fn set_rules(&mut self, n: usize) -> Option<f64> {
        if self.node.backend.is_none() || n == self.rules {
            return None;
        }
        self.node.write_policy(
            "bench.json",
            &server_policy(n, &[IPERF_PORT, self.rr.port()]),
        );
        let (wall, _, _) = self.node.sync();
        self.rules = n;
        Some(wall)
    }

    /// One round's figures for the client talking to the server: request/
    /// response latency, connection latency, throughput (as `args` asks).
    fn measure(&self, args: &Args, f: &mut Figures) {
        let client = &self.node.pods[self.client].ns;
        let v = rr(client, self.rr, args.rr_count, args.cpu);
        f.rr50.push(pct(&v, 0.5));
        f.rr99.push(pct(&v, 0.99));
        if args.crr_count > 0 {
            let v = crr(client, self.rr, args.crr_count, args.cpu);
            f.crr50.push(pct(&v, 0.5));
        }
        if args.tput_secs > 0 {
            let dst = self.node.pods[self.server].ip;
            let pin = ["-A", args.iperf_cpus.as_str()];
            let extra: &[&str] = if args.iperf_cpus.is_empty() {
                &[]
            } else {
                &pin
            };
            f.tput
                .push(iperf_with(client, dst, 1, args.tput_secs, extra));
        }
    }

    /// That the policy is in force: the client gets in, the other pod not.
    fn assert_enforced(&self) {
        let Some(other) = self.other else { return };
        let pods = &self.node.pods;
        assert!(
            connects(&pods[self.client].ns, self.rr, Duration::from_secs(2)),
            "{} with {} rules: the client cannot reach the server",
            self.name,
            self.rules
        );
        assert!(
            !connects(&pods[other].ns, self.rr, Duration::from_millis(300)),
            "{} with {} rules: a pod outside the policy reaches the server",
            self.name,
            self.rules
        );
    }
}

/// Picks one metric's per-round values.
type Metric = fn(&Figures) -> &Vec<f64>;

/// Per setup (pair, rules), per round.
#[derive(Clone, Default)]
struct Figures {
    tput: Vec<f64>,
    rr50: Vec<f64>,
    rr99: Vec<f64>,
    crr50: Vec<f64>,
    sync_ms: Vec<f64>,
    prefixes: usize,
}

fn main() {
    let mut args = Args::parse();
    assert!(is_root(), "polbench needs root (namespaces, bpffs, eBPF)");
    // Its bpffs mounts must not outlive a run killed by a signal.
    rcni_testkit::private_mounts();
    for p in ["bridge", "host-local", "policy"] {
        assert!(
            args.ours.join(p).is_file(),
            "{} missing (bench/policy.sh installs the plugins)",
            args.ours.join(p).display()
        );
    }
    args.rules.push(0);
    args.rules.sort_unstable();
    args.rules.dedup();
    assert!(
        *args.rules.last().unwrap() <= MAX_RULES,
        "at most {MAX_RULES} rules"
    );
    let backends: Vec<Backend> = args.backends.iter().map(|b| Backend::parse(b)).collect();
    println!(
        "polbench: {} rounds; per setup and round {} TCP request/response exchanges and {} \
         connections (client and server on CPU {}), iperf3 1 stream for {} s; rules {:?}",
        args.rounds, args.rr_count, args.crr_count, args.cpu, args.tput_secs, args.rules
    );

    if args.flows {
        flows(&args, &backends);
        return;
    }
    datapath(&args, &backends);
    if args.sync_pods > 0 {
        for &b in &backends {
            sync_to_pods(&args, b);
        }
    }
}

fn datapath(args: &Args, backends: &[Backend]) {
    let t = Instant::now();
    let mut pairs = vec![];
    if !args.no_baseline {
        pairs.push(Pair::new(args, None));
    }
    for &b in backends {
        pairs.push(Pair::new(args, Some(b)));
    }
    eprintln!("setup: {:.1} s", t.elapsed().as_secs_f64());
    // (pair, rules) in a fixed order; every round visits them rotated.
    let setups: Vec<(usize, usize)> = pairs
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            let rules: &[usize] = if p.other.is_some() { &args.rules } else { &[0] };
            rules.iter().map(move |&n| (i, n))
        })
        .collect();
    let mut figs = vec![Figures::default(); setups.len()];
    for p in &pairs {
        p.assert_enforced();
    }
    for r in 0..args.rounds {
        for k in order(setups.len(), r) {
            let (i, n) = setups[k];
            let p = &mut pairs[i];
            let f = &mut figs[k];
            if let Some(ms) = p.set_rules(n) {
                f.sync_ms.push(ms);
            }
            if r == 0 && p.other.is_some() {
                p.assert_enforced();
                f.prefixes = p.node.prefixes();
            }
            p.measure(args, f);
        }
        eprint!(".");
    }
    eprintln!();
    for p in &pairs {
        p.assert_enforced();
    }

    let med = |v: &[f64]| pct(v, 0.5);
    // Per-round ratios of setup k to its backend's 0 rules.
    let base_of = |k: usize| {
        setups
            .iter()
            .position(|&(i, n)| i == setups[k].0 && n == 0)
            .unwrap()
    };
    let paired = |k: usize, m: Metric| -> Vec<f64> {
        let (a, b) = (m(&figs[k]), m(&figs[base_of(k)]));
        a.iter().zip(b).map(|(x, y)| x / y).collect()
    };
    println!(
        "\n== datapath: median over rounds (min-max); x0 = median of the per-round ratios to the \
         same backend with 0 rules =="
    );
    println!(
        "{:<17} {:>6} {:>8} {:>8} | {:>6} {:>11} {:>6} | {:>7} {:>11} {:>6} | {:>7} {:>6} | {:>7} {:>6}",
        "setup",
        "rules",
        "prefixes",
        "sync ms",
        "Gbit/s",
        "spread",
        "x0",
        "rr p50",
        "spread",
        "x0",
        "rr p99",
        "x0",
        "crr p50",
        "x0"
    );
    for (k, &(i, n)) in setups.iter().enumerate() {
        let f = &figs[k];
        let policy = pairs[i].other.is_some();
        let x0 = |m: Metric| {
            let v = paired(k, m);
            if policy && !v.is_empty() {
                format!("{:.3}", med(&v))
            } else {
                "-".into()
            }
        };
        let dash = |v: &[f64], s: String| if v.is_empty() { "-".into() } else { s };
        println!(
            "{:<17} {:>6} {:>8} {:>8} | {:>6} {:>11} {:>6} | {:>7} {:>11} {:>6} | {:>7} {:>6} | {:>7} {:>6}",
            pairs[i].name,
            if policy { n.to_string() } else { "-".into() },
            if policy {
                f.prefixes.to_string()
            } else {
                "-".into()
            },
            dash(&f.sync_ms, format!("{:.0}", med(&f.sync_ms))),
            dash(&f.tput, format!("{:.2}", med(&f.tput))),
            dash(&f.tput, spread(&f.tput)),
            x0(|f| &f.tput),
            format!("{:.1}", med(&f.rr50)),
            spread(&f.rr50),
            x0(|f| &f.rr50),
            format!("{:.1}", med(&f.rr99)),
            x0(|f| &f.rr99),
            dash(&f.crr50, format!("{:.1}", med(&f.crr50))),
            x0(|f| &f.crr50),
        );
    }
    if !args.no_baseline {
        let b = &figs[0];
        println!(
            "(x0 of the policy rows is against their own 0 rules; 0 rules against the bridge \
             without policy: {})",
            setups
                .iter()
                .enumerate()
                .filter(|&(_, &(i, n))| n == 0 && pairs[i].other.is_some())
                .map(|(k, &(i, _))| {
                    let f = &figs[k];
                    let r = |a: &[f64], b: &[f64]| {
                        let v: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
                        if v.is_empty() {
                            "-".to_string()
                        } else {
                            format!("{:.3}", med(&v))
                        }
                    };
                    format!(
                        "{} tput {}, rr p50 {}, crr p50 {}",
                        pairs[i].name,
                        r(&f.tput, &b.tput),
                        r(&f.rr50, &b.rr50),
                        r(&f.crr50, &b.crr50)
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        );
    }

    let max = *args.rules.last().unwrap();
    if max == 0 {
        return;
    }
    println!("\n== {max} rules vs 0, paired rounds (median of per-round ratios, min-max) ==");
    for (k, &(i, n)) in setups.iter().enumerate() {
        if n != max || pairs[i].other.is_none() {
            continue;
        }
        let metrics: [(&str, Metric, bool); 4] = [
            ("throughput", |f| &f.tput, true),
            ("RR p50", |f| &f.rr50, false),
            ("RR p99", |f| &f.rr99, false),
            ("CRR p50", |f| &f.crr50, false),
        ];
        let mut parts = vec![];
        let mut met = true;
        for (name, m, higher_better) in metrics {
            let v = paired(k, m);
            if v.is_empty() || v.iter().any(|x| !x.is_finite()) {
                continue;
            }
            let q = med(&v);
            // A loss: less throughput, more latency.
            let loss = if higher_better { 1.0 - q } else { q - 1.0 };
            if name == "throughput" || name == "RR p50" {
                met &= loss < 0.05;
            }
            parts.push(format!(
                "{name} {} {:.1} % ({:.3}-{:.3})",
                if higher_better { "loss" } else { "added" },
                loss * 100.0,
                pct(&v, 0.0),
                pct(&v, 1.0)
            ));
        }
        println!("{:<9} {max} vs 0: {}", pairs[i].name, parts.join(", "));
        if pairs[i].name == "ebpf" {
            println!(
                "  target (eBPF loses < 5 % throughput and RR latency with {max} rules): {}",
                if met { "met" } else { "NOT met" }
            );
        }
    }
}

/// The time `policy sync` takes to bring a changed policy to `--sync-pods`
/// pods, for two kinds of change: a port of the ingress policy moves (the
/// pods share one rule set, which changes), and an egress policy selecting
/// every pod comes and goes (each pod's own entry changes). Every sync is
/// checked with connections to and from the first and the last pod.
fn sync_to_pods(args: &Args, b: Backend) {
    let mut node = Node::new(Some(b), &args.ours, "10.204.0.0/16");
    let ingress = |port: u16| {
        json!({"name": "bench", "podSelector": {"matchLabels": {"app": "server"}},
               "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}],
                            "ports": [{"port": port}]}]})
    };
    // Replies to allowed ingress still pass; new connections out do not.
    let egress = json!({"name": "egress", "podSelector": {"matchLabels": {"app": "server"}},
        "policyTypes": ["Egress"], "egress": [{"to": [{"ipBlock": {"cidr": "192.0.2.0/24"}}]}]});
    node.write_policy("bench.json", &ingress(80));
    let client = node.add_pod("client");
    node.attach(client);
    let t = Instant::now();
    let mut adds = vec![];
    for _ in 0..args.sync_pods {
        let i = node.add_pod("server");
        adds.push(node.attach(i));
    }
    eprintln!(
        "{}: {} pods added in {:.1} s",
        b.name(),
        args.sync_pods,
        t.elapsed().as_secs_f64()
    );
    let (first, last) = (client + 1, node.pods.len() - 1);
    // Listeners (the handshake completes in the backlog; nothing needs to
    // accept).
    let mut listeners = vec![];
    for (i, port) in [
        (first, 80),
        (first, 81),
        (last, 80),
        (last, 81),
        (client, 90),
    ] {
        let ip = node.pods[i].ip;
        listeners.push(
            node.pods[i]
                .ns
                .run(move || TcpListener::bind((ip, port)))
                .unwrap()
                .unwrap(),
        );
    }
    // Whether from -> to:port is open as expected.
    let expect = |from: usize, to: usize, port: u16, open: bool| {
        let to_addr = SocketAddr::new(node.pods[to].ip, port);
        let wait = Duration::from_millis(if open { 2000 } else { 300 });
        let got = connects(&node.pods[from].ns, to_addr, wait);
        assert_eq!(
            got,
            open,
            "{}: pod {from} -> pod {to} port {port}: expected {}",
            b.name(),
            if open { "open" } else { "blocked" }
        );
    };
    expect(client, last, 80, true);
    expect(client, last, 81, false);
    expect(last, client, 90, true);
    println!(
        "\n== {}: changed policies synced to {} pods ({} syncs each, each checked on the first \
         and the last pod) ==",
        b.name(),
        args.sync_pods,
        args.sync_runs
    );
    let mut worst = 0.0f64;
    for kind in ["ingress port moves", "egress policy comes/goes"] {
        let (mut wall, mut own, mut line) = (vec![], vec![], String::new());
        for run in 0..args.sync_runs {
            let on = run % 2 == 0;
            let (new, old) = if on { (81, 80) } else { (80, 81) };
            if kind == "ingress port moves" {
                node.write_policy("bench.json", &ingress(new));
            } else if on {
                node.write_policy("egress.json", &egress);
            } else {
                node.remove_policy("egress.json");
            }
            let (w, o, l) = node.sync();
            wall.push(w);
            own.push(o);
            line = l;
            if kind == "ingress port moves" {
                expect(client, first, new, true);
                expect(client, last, new, true);
                expect(client, last, old, false);
            } else {
                expect(first, client, 90, !on);
                expect(last, client, 90, !on);
                expect(client, last, 80, true);
            }
        }
        // Back to the start for the next kind.
        node.write_policy("bench.json", &ingress(80));
        node.remove_policy("egress.json");
        node.sync();
        worst = worst.max(pct(&wall, 1.0));
        println!(
            "{kind:<25} sync wall median {:>5.0} ms (min {:.0}, max {:.0}); by its own clock {:.0} ms",
            pct(&wall, 0.5),
            pct(&wall, 0.0),
            pct(&wall, 1.0),
            pct(&own, 0.5)
        );
        println!("  last: {line}");
    }
    println!(
        "target (a sync of a changed policy reaches {} pods in under a second): {} \
         (slowest sync {worst:.0} ms); policy ADD per pod median {:.1} ms (p99 {:.1})",
        args.sync_pods,
        if worst < 1000.0 { "met" } else { "NOT met" },
        pct(&adds, 0.5) / 1e3,
        pct(&adds, 0.99) / 1e3
    );
    drop(listeners);
}

/// A setup of the flow event comparison.
struct FlowSetup {
    pair: Pair,
    backend: Backend,
    logging: bool,
    flood: bool,
    _collector: Option<std::process::Child>,
}

/// `policy flows --follow` for the pair's node: the collector a node runs
/// (rcni-node's), reading the kernel's events and writing the flow log.
fn collector(p: &Pair) -> std::process::Child {
    let dd = p.node.state.path().display().to_string();
    let child = rcni_testkit::tied_command_in(&p.node.ns, p.node.ours.join("policy"))
        .args(["flows", "--follow", "--network", NET, "--data-dir", &dd])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("policy flows");
    std::thread::sleep(Duration::from_millis(300));
    child
}

fn flows(args: &Args, backends: &[Backend]) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let t = Instant::now();
    let mut setups = vec![];
    for &b in backends {
        for (logging, flood) in [(false, false), (true, false), (false, true), (true, true)] {
            let pair = Pair::with_flows(args, Some(b), Some(if logging { "deny" } else { "none" }));
            pair.assert_enforced();
            let c = logging.then(|| collector(&pair));
            setups.push(FlowSetup {
                pair,
                backend: b,
                logging,
                flood,
                _collector: c,
            });
        }
    }
    eprintln!("setup: {:.1} s", t.elapsed().as_secs_f64());
    let mut figs = vec![Figures::default(); setups.len()];
    let mut sent = vec![0u64; setups.len()];
    for r in 0..args.rounds {
        for k in order(setups.len(), r) {
            let s = &setups[k];
            let p = &s.pair;
            let f = &mut figs[k];
            let stop = AtomicBool::new(false);
            std::thread::scope(|sc| {
                let flooder = s.flood.then(|| {
                    let other = &p.node.pods[p.other.unwrap()].ns;
                    let to = p.node.pods[p.server].ip;
                    let stop = &stop;
                    let pps = args.flood_pps;
                    sc.spawn(move || {
                        other
                            .run(|| {
                                let sock = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
                                let mut n = 0u64;
                                let start = Instant::now();
                                let mut port = 20000u16;
                                while !stop.load(Ordering::Relaxed) {
                                    for _ in 0..100 {
                                        port = if port >= 60000 { 20000 } else { port + 1 };
                                        let _ = sock.send_to(b"x", (to, port));
                                        n += 1;
                                    }
                                    // Paced: the flood must not take a CPU
                                    // by itself, or it measures the CPU.
                                    let due = Duration::from_secs_f64(n as f64 / pps as f64);
                                    if let Some(d) = due.checked_sub(start.elapsed()) {
                                        std::thread::sleep(d);
                                    }
                                }
                                n
                            })
                            .unwrap()
                    })
                });
                p.measure(args, f);
                stop.store(true, Ordering::Relaxed);
                if let Some(h) = flooder {
                    sent[k] += h.join().unwrap();
                }
            });
        }
        eprint!(".");
    }
    eprintln!();
    for s in &setups {
        s.pair.assert_enforced();
    }
    let med = |v: &[f64]| pct(v, 0.5);
    let name = |s: &FlowSetup| {
        format!(
            "{} {}{}",
            s.backend.name(),
            if s.logging { "events on" } else { "events off" },
            if s.flood { " + flood" } else { "" }
        )
    };
    println!(
        "\n== flow events: median over {} rounds (min-max) ==",
        args.rounds
    );
    println!(
        "{:<28} | {:>6} {:>11} | {:>7} {:>11} | {:>7} | {:>7} | {:>10} {:>9}",
        "setup", "Gbit/s", "spread", "rr p50", "spread", "rr p99", "crr p50", "flood pps", "events"
    );
    for (k, s) in setups.iter().enumerate() {
        let f = &figs[k];
        let events = if s.logging {
            let log = s.pair.node.state.path().join(NET).join("flows.jsonl");
            std::fs::read_to_string(log)
                .map_or(0, |t| t.lines().count())
                .to_string()
        } else {
            "-".into()
        };
        println!(
            "{:<28} | {:>6.2} {:>11} | {:>7.1} {:>11} | {:>7.1} | {:>7.1} | {:>10} {:>9}",
            name(s),
            med(&f.tput),
            spread(&f.tput),
            med(&f.rr50),
            spread(&f.rr50),
            med(&f.rr99),
            med(&f.crr50),
            if s.flood {
                sent[k].to_string()
            } else {
                "-".into()
            },
            events
        );
    }
    println!("\n== events on vs off, paired rounds (median of per-round ratios, min-max) ==");
    for &b in backends {
        let find = |logging: bool, flood: bool| {
            setups
                .iter()
                .position(|s| s.backend == b && s.logging == logging && s.flood == flood)
                .unwrap()
        };
        for flood in [false, true] {
            let (on, off) = (find(true, flood), find(false, flood));
            let ratio = |m: Metric| -> Vec<f64> {
                m(&figs[on])
                    .iter()
                    .zip(m(&figs[off]))
                    .map(|(x, y)| x / y)
                    .collect()
            };
            let tput = ratio(|f| &f.tput);
            let rr50 = ratio(|f| &f.rr50);
            let crr = ratio(|f| &f.crr50);
            let spread = |v: &[f64]| format!("{:.3}-{:.3}", pct(v, 0.0), pct(v, 1.0));
            let tput_loss = 1.0 - med(&tput);
            let rr_added = med(&rr50) - 1.0;
            let met = tput_loss <= 0.05 && rr_added <= 0.05;
            println!(
                "{:<9} {:<22}: throughput {:.3} ({}), rr p50 {:.3} ({}), crr p50 {:.3} ({}) -> \
                 target (<= 5 % cost{}): {}",
                b.name(),
                if flood {
                    "while denials flood"
                } else {
                    "nothing denied"
                },
                med(&tput),
                spread(&tput),
                med(&rr50),
                spread(&rr50),
                med(&crr),
                spread(&crr),
                if flood { " to allowed traffic" } else { "" },
                if met { "met" } else { "NOT met" }
            );
        }
    }
}
