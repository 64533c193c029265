//! chaosbench: ADD killed with SIGKILL to its whole process group at a
//! random moment (uniform over a normal ADD's length), then DEL and GC as a
//! runtime runs them; counts what each trial left behind and every failed
//! DEL or GC (`rcni_testkit::chaos`). Setups: host-local alone, and the
//! podman chain (bridge + host-local, portmap, firewall, tuning) with the
//! nftables and the iptables backends named explicitly. With `--plugins`,
//! each plugin inside a full chain, its ADD or its DEL killed at a moment
//! drawn uniformly over that plugin's run within the command, several
//! plugins at once (`--jobs`), each in namespaces of its own.

use clap::Parser;
use rcni_netns::NetNs;
use rcni_testkit::chaos::{Backend, Harness, Kill, Plugin, Report, Setup};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

#[derive(Parser)]
#[command(about = "SIGKILL in the middle of ADD or DEL, then DEL and GC: what is left")]
struct Args {
    /// Directory with cnitool and the plugins.
    #[arg(long, default_value = "target/release")]
    bins: PathBuf,
    /// Trials per setup (per plugin and command with --plugins).
    #[arg(long, default_value_t = 1000)]
    trials: usize,
    /// Setups to run: host-local, chain-nftables, chain-iptables,
    /// chain-mixed (bridge masquerading on iptables, portmap and firewall
    /// on nftables); none with --plugins unless named.
    #[arg(long, value_delimiter = ',')]
    setups: Option<Vec<String>>,
    /// Plugins to kill inside a full chain: `all`, or names (bridge, ptp,
    /// vlan, host-device, dhcp, portmap, firewall, tuning, bandwidth,
    /// fastpath, policy, multinet).
    #[arg(long, value_delimiter = ',')]
    plugins: Vec<String>,
    /// Commands killed with --plugins: add, del.
    #[arg(long, value_delimiter = ',', default_value = "add,del")]
    kill: Vec<String>,
    /// Plugin runs at once (each in namespaces of its own).
    #[arg(long, default_value_t = 1)]
    jobs: usize,
    /// Stop each plugin's trials after this many minutes from the start
    /// (the report counts the trials run).
    #[arg(long)]
    minutes: Option<f64>,
    /// Seed of the kill delays (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Run ADD and DEL with this libcni client (cnitool-tests' Go client,
    /// built against Debian's libcni) instead of cnitool.
    #[arg(long)]
    libcni: Option<PathBuf>,
}

/// The keys of the BPF map entries under a bpffs (rcni_ebpf::entry_keys_under,
/// inside the node's namespace).
fn bpf_entries(node: &NetNs, pins: &Path) -> Vec<String> {
    let p = pins.to_path_buf();
    node.run(move || rcni_ebpf::entry_keys_under(&p))
        .expect("enter the node namespace")
        .unwrap_or_else(|e| panic!("list the BPF entries under {}: {e}", pins.display()))
}

/// A plugin run's line of the final table: plugin, command killed, trials,
/// trials with leftovers, failed DELs, failed GCs, failed ADDs (before a
/// killed DEL).
type Row = (Plugin, Kill, usize, usize, usize, usize, usize);

fn main() {
    let a = Args::parse();
    // Its bpffs mounts must not outlive a run killed by a signal.
    rcni_testkit::private_mounts();
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    });
    println!("seed {seed}, {} trials per setup", a.trials);
    let mut bad = 0;
    let setups = a.setups.clone().unwrap_or_else(|| {
        if a.plugins.is_empty() {
            [
                "host-local",
                "chain-nftables",
                "chain-iptables",
                "chain-mixed",
            ]
            .map(String::from)
            .to_vec()
        } else {
            Vec::new()
        }
    });
    for name in &setups {
        let setup = match name.as_str() {
            "host-local" => Setup::HostLocal,
            "chain-nftables" => Setup::Chain(Backend::Nftables),
            "chain-iptables" => Setup::Chain(Backend::Iptables),
            "chain-mixed" => Setup::Chain(Backend::Mixed),
            other => {
                eprintln!("unknown setup {other:?}");
                std::process::exit(2);
            }
        };
        let mut h = Harness::with_runtime(setup, &a.bins, seed, a.libcni.as_deref());
        let r = h.run(a.trials);
        print!("{}", r.summary());
        bad += r.leaky().len() + r.del_failures().len() + r.gc_failures().len();
    }
    let plugins: Vec<Plugin> = if a.plugins.iter().any(|p| p == "all") {
        Plugin::ALL.to_vec()
    } else {
        a.plugins
            .iter()
            .map(|p| {
                Plugin::parse(p).unwrap_or_else(|| {
                    eprintln!("unknown plugin {p:?}");
                    std::process::exit(2)
                })
            })
            .collect()
    };
    let kills: Vec<Kill> = a
        .kill
        .iter()
        .map(|k| match k.as_str() {
            "add" => Kill::Add,
            "del" => Kill::Del,
            other => {
                eprintln!("unknown command {other:?} (add, del)");
                std::process::exit(2)
            }
        })
        .collect();
    let mut todo = Vec::new();
    for &p in &plugins {
        if let Some(why) = p.unavailable() {
            println!("== plugin/{}: skipped: {why}", p.name());
            continue;
        }
        for &k in &kills {
            todo.push((p, k));
        }
    }
    let deadline = a
        .minutes
        .map(|m| std::time::Instant::now() + std::time::Duration::from_secs_f64(m * 60.0));
    // Popped from the end: the first named run first.
    todo.reverse();
    let todo = Mutex::new(todo.into_iter().enumerate().collect::<Vec<_>>());
    let done: Mutex<Vec<Row>> = Mutex::default();
    std::thread::scope(|s| {
        for _ in 0..a.jobs.max(1) {
            s.spawn(|| {
                loop {
                    let Some((i, (p, k))) = todo.lock().unwrap().pop() else {
                        break;
                    };
                    let mut h = Harness::plugin(
                        p,
                        k,
                        &a.bins,
                        seed ^ (i as u64 + 1),
                        Some(bpf_entries),
                        10,
                    );
                    let r: Report = h.run_until(a.trials, deadline);
                    print!("{}", r.summary());
                    done.lock().unwrap().push((
                        p,
                        k,
                        r.trials.len(),
                        r.leaky().len(),
                        r.del_failures().len(),
                        r.gc_failures().len(),
                        r.add_failures().len(),
                    ));
                }
            });
        }
    });
    let mut done = done.into_inner().unwrap();
    if !done.is_empty() {
        done.sort_by_key(|d| (Plugin::ALL.iter().position(|p| *p == d.0), d.1.name()));
        println!(
            "\nplugin        killed  trials  with leftovers  DEL failed  GC failed  ADD failed"
        );
        for (p, k, n, leaky, del, gc, add) in &done {
            println!(
                "{:<13} {:<6} {n:>7} {leaky:>15} {del:>11} {gc:>10} {add:>11}",
                p.name(),
                k.name()
            );
            bad += leaky + del + gc + add;
        }
    }
    std::process::exit(if bad == 0 { 0 } else { 1 });
}
