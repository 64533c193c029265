//! parbench: N ADDs of a chain started at once on one node, then N DELs at
//! once (`rcni_testkit::parallel`), for three setups in one run: ours with
//! the full chain (bridge + host-local, portmap, firewall, tuning,
//! bandwidth, fastpath, policy), ours without fastpath and policy, and the
//! reference with that same common chain (it has neither). Prints p50 and
//! p99 of ADD and DEL under that concurrency, the like-for-like ratios, and
//! every broken expectation (failed command, busy/generation-conflict error
//! reaching the runtime, duplicate address, lost or doubled rule,
//! leftovers); exits 1 if there was one.

use clap::Parser;
use rcni_testkit::parallel::{Chain, Node, Round};
use std::path::PathBuf;

#[derive(Parser)]
#[command(about = "concurrent ADDs and DELs of the full chain: correctness and latency")]
struct Args {
    /// Directory with cnitool and our plugins.
    #[arg(long, default_value = "target/release")]
    ours: PathBuf,
    /// Directory with the reference plugins.
    #[arg(long, default_value = "/usr/lib/cni")]
    reference: PathBuf,
    /// Concurrent ADDs (then DELs) per round.
    #[arg(long, default_value_t = 100)]
    concurrent: usize,
    /// Rounds per setup.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

fn main() {
    let a = Args::parse();
    // Its bpffs mounts must not outlive a run killed by a signal.
    rcni_testkit::private_mounts();
    let cnitool = a.ours.join("cnitool");
    let mut nodes = [
        Node::new("rcni full", Chain::Full, &cnitool, &a.ours),
        Node::new("rcni common", Chain::Common, &cnitool, &a.ours),
        Node::new("reference", Chain::Common, &cnitool, &a.reference),
    ];
    let mut rounds: Vec<Vec<Round>> = vec![Vec::new(), Vec::new(), Vec::new()];
    for r in 0..a.rounds {
        // Rotate who goes first, so drift hits all alike.
        for k in 0..nodes.len() {
            let i = (k + r) % nodes.len();
            rounds[i].push(nodes[i].round(a.concurrent));
        }
    }
    println!(
        "{} concurrent chain ADDs (timed), then {} DELs racing {} new ADDs (checked), \
         then {} concurrent DELs (timed); {} rounds per setup (milliseconds per command, \
         through cnitool)",
        a.concurrent,
        a.concurrent / 2,
        a.concurrent / 2,
        a.concurrent,
        a.rounds
    );
    println!(
        "common chain: bridge + host-local, portmap, firewall, tuning, bandwidth; \
         full: + fastpath, policy (eBPF)"
    );
    println!(
        "{:<12} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "", "ADD p50", "ADD p99", "DEL p50", "DEL p99", "problems"
    );
    let mut figs = Vec::new();
    let mut bad = 0;
    for (node, rs) in nodes.iter().zip(&rounds) {
        let add: Vec<f64> = rs.iter().flat_map(Round::add_times).collect();
        let del: Vec<f64> = rs.iter().flat_map(Round::del_times).collect();
        let p = |v: &[f64], q| rcni_bench::pct(v, q) / 1e3;
        let f = [p(&add, 0.5), p(&add, 0.99), p(&del, 0.5), p(&del, 0.99)];
        let problems: usize = rs.iter().map(|r| r.problems.len()).sum();
        bad += problems;
        println!(
            "{:<12} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9}",
            node.label, f[0], f[1], f[2], f[3], problems
        );
        figs.push(f);
    }
    let names = ["ADD p50", "ADD p99", "DEL p50", "DEL p99"];
    for (i, label) in [(1, "rcni common / reference"), (0, "rcni full / reference")] {
        let r: Vec<String> = (0..4)
            .map(|k| format!("{} {:.2}", names[k], figs[i][k] / figs[2][k]))
            .collect();
        println!("ratio {label:<24} {}", r.join("  "));
    }
    for rs in &rounds {
        for r in rs {
            for p in r.problems.iter().take(20) {
                println!("{}: {p}", r.label);
            }
        }
    }
    // exit() runs no destructors: the nodes (namespaces, state, their
    // bpffs mounts) go first.
    drop(nodes);
    std::process::exit(if bad == 0 { 0 } else { 1 });
}
