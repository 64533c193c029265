//! soakbench: ADD/DEL cycles of the full chain (bridge + host-local,
//! portmap, firewall, tuning, bandwidth, fastpath, policy), N at a time,
//! through cnitool, with the dhcp daemon serving a second network
//! (bridge + dhcp, portmap, firewall, tuning, bandwidth; one cycle in
//! `--dhcp-every` also cycles a pod there) and the `rcni-node` agent
//! running on a cluster file in a namespace of its own. At the start and
//! the end (and every tenth of the run): RSS and open fds of the daemon
//! and the agent, and the processes in the run's namespaces (the plugins'
//! detached helpers included); at the end what the nodes hold that they
//! did not before (`rcni_testkit::chaos::Leftovers`) and every failed
//! command. Exits 1 on a failure or a leftover.

use clap::Parser;
use rcni_netns::NetNs;
use rcni_testkit::chaos::{Harness, Kill, Plugin};
use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(about = "ADD/DEL cycles of the full chain with the dhcp daemon and the agent running")]
struct Args {
    /// Directory with cnitool, the plugins and rcni-node.
    #[arg(long, default_value = "target/release")]
    bins: PathBuf,
    /// ADD/DEL cycles of the full chain.
    #[arg(long, default_value_t = 10_000)]
    cycles: usize,
    /// Cycles running at once.
    #[arg(long, default_value_t = 20)]
    concurrent: usize,
    /// One full-chain cycle in this many also cycles a dhcp pod.
    #[arg(long, default_value_t = 5)]
    dhcp_every: usize,
    /// Nodes in the agent's cluster file.
    #[arg(long, default_value_t = 100)]
    agent_nodes: usize,
}

/// The keys of the BPF map entries under a bpffs (rcni_ebpf::entry_keys_under,
/// inside the node's namespace).
fn bpf_entries(node: &NetNs, pins: &Path) -> Vec<String> {
    let p = pins.to_path_buf();
    node.run(move || rcni_ebpf::entry_keys_under(&p))
        .expect("enter the node namespace")
        .unwrap_or_else(|e| panic!("list the BPF entries under {}: {e}", pins.display()))
}

/// The agent: rcni-node on a cluster file of `n` nodes (vxlan), as node
/// n0 in a namespace whose uplink holds n0's address; tied to this process.
struct Agent {
    ns: NetNs,
    dir: tempfile::TempDir,
    child: std::process::Child,
}

impl Agent {
    fn start(bins: &Path, n: usize) -> Agent {
        let ns = NetNs::new_anonymous().expect("agent namespace");
        rcni_testkit::ip(&ns, "link add uplink0 type veth peer name uplink1");
        rcni_testkit::ip(&ns, "addr add 10.200.0.1/16 dev uplink0");
        rcni_testkit::ip(&ns, "link set uplink0 up");
        rcni_testkit::ip(&ns, "link set uplink1 up");
        let dir = tempfile::Builder::new()
            .prefix("rcni-soak-agent-")
            .tempdir()
            .unwrap();
        let nodes: Vec<serde_json::Value> = (0..n)
            .map(|i| {
                serde_json::json!({"name": format!("n{i}"),
                    "address": format!("10.200.{}.{}", i / 250, i % 250 + 1),
                    "podCIDR": format!("10.{}.{}.0/24", 100 + i / 256, i % 256)})
            })
            .collect();
        let cluster = serde_json::json!({"network": "10.96.0.0/11", "backend": "vxlan",
            "nodes": nodes});
        let file = dir.path().join("cluster.json");
        std::fs::write(&file, serde_json::to_vec_pretty(&cluster).unwrap()).unwrap();
        std::fs::create_dir_all(dir.path().join("net.d")).unwrap();
        let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
        let child = rcni_testkit::tied_command_in(&ns, bins.join("rcni-node"))
            .arg("run")
            .arg("--cluster")
            .arg(&file)
            .args(["--node", "n0"])
            .arg("--cni-conf-dir")
            .arg(dir.path().join("net.d"))
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start rcni-node");
        let a = Agent { ns, dir, child };
        let until = Instant::now() + Duration::from_secs(20);
        while !a.dir.path().join("net.d/10-rcni.conflist").exists() {
            assert!(
                Instant::now() < until,
                "the agent wrote no conflist: {}",
                std::fs::read_to_string(a.dir.path().join("agent.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        a
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// (RSS in KiB, open fds) of a process.
fn usage(pid: u32) -> (u64, usize) {
    let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0);
    (rss, fds)
}

fn main() {
    let a = Args::parse();
    // Its bpffs mounts must not outlive a run killed by a signal.
    rcni_testkit::private_mounts();
    let seed = 1;
    let full = Harness::plugin(
        Plugin::Bridge,
        Kill::Add,
        &a.bins,
        seed,
        Some(bpf_entries),
        3,
    );
    let dhcp = Harness::plugin(Plugin::Dhcp, Kill::Add, &a.bins, seed, None, 3);
    let agent = Agent::start(&a.bins, a.agent_nodes);
    let daemon = dhcp.dhcp_daemon_pid().expect("the dhcp daemon");
    let agent_pid = agent.child.id();
    let inodes: BTreeSet<u64> = [&full.node, &dhcp.node, &agent.ns]
        .iter()
        .map(|ns| std::fs::metadata(ns.proc_path()).unwrap().ino())
        .collect();
    // Every process in the run's namespaces at the start and the end; in
    // between (commands in flight) counts by name.
    let report = |label: &str, full_list: bool| {
        let (drss, dfd) = usage(daemon);
        let (arss, afd) = usage(agent_pid);
        let procs = rcni_testkit::processes_in(&inodes.iter().copied().collect::<Vec<_>>());
        let shown = if full_list {
            procs.join(" ")
        } else {
            let mut by: std::collections::BTreeMap<&str, usize> = Default::default();
            for p in &procs {
                *by.entry(p.split('(').next().unwrap_or("")).or_default() += 1;
            }
            by.iter()
                .map(|(n, c)| format!("{n} {c}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "{label:<13} dhcp daemon RSS {drss:>6} KiB fds {dfd:>3} | agent RSS {arss:>6} KiB fds {afd:>3} | processes in the run's namespaces {:>3}: {shown}",
            procs.len(),
        );
    };
    println!(
        "{} cycles of the full chain, {} at a time; a dhcp-network cycle with every {}th; agent on {} nodes",
        a.cycles, a.concurrent, a.dhcp_every, a.agent_nodes
    );
    report("start", true);
    let next = AtomicUsize::new(0);
    let finished = AtomicUsize::new(0);
    let dhcp_cycles = AtomicUsize::new(0);
    let failures: Mutex<Vec<String>> = Mutex::default();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..a.concurrent.max(1) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= a.cycles {
                        break;
                    }
                    let cid = format!("soak{i:06}");
                    let (add, del) = full.cycle(&cid);
                    for (what, o) in [("full ADD", &add), ("full DEL", &del)] {
                        if !o.ok {
                            failures
                                .lock()
                                .unwrap()
                                .push(format!("{cid} {what}: {}", o.message()));
                        }
                    }
                    if a.dhcp_every > 0 && i.is_multiple_of(a.dhcp_every) {
                        dhcp_cycles.fetch_add(1, Ordering::Relaxed);
                        let (add, del) = dhcp.cycle(&cid);
                        for (what, o) in [("dhcp ADD", &add), ("dhcp DEL", &del)] {
                            if !o.ok {
                                failures
                                    .lock()
                                    .unwrap()
                                    .push(format!("{cid} {what}: {}", o.message()));
                            }
                        }
                    }
                    let done = finished.fetch_add(1, Ordering::Relaxed) + 1;
                    let tenth = (a.cycles / 10).max(1);
                    if done.is_multiple_of(tenth) && done < a.cycles {
                        report(&format!("{done} done"), false);
                    }
                }
            });
        }
    });
    let took = t0.elapsed();
    // Anything the last DELs left running (a detached helper) gets a moment
    // to finish, as it would between two pods.
    std::thread::sleep(Duration::from_secs(1));
    report("end", true);
    let mut failures = failures.into_inner().unwrap();
    // The runtime's periodic GC (nothing valid): fastpath keeps a
    // network's datapath pinned after its last DEL until then.
    for (what, h) in [("full", &full), ("dhcp", &dhcp)] {
        let gc = h.gc();
        if !gc.ok {
            failures.push(format!("{what} GC: {}", gc.message()));
        }
    }
    let (lf, ld) = (full.leftovers(), dhcp.leftovers());
    println!(
        "{} full-chain cycles and {} dhcp cycles in {:.0} s ({:.1} cycles/s); failed commands: {}",
        a.cycles,
        dhcp_cycles.load(Ordering::Relaxed),
        took.as_secs_f64(),
        a.cycles as f64 / took.as_secs_f64(),
        failures.len()
    );
    for f in failures.iter().take(20) {
        println!("  {f}");
    }
    println!(
        "leftovers on the full chain's node: {}",
        if lf.is_empty() {
            "none".to_string()
        } else {
            format!("{lf:?}")
        }
    );
    println!(
        "leftovers on the dhcp network's node: {}",
        if ld.is_empty() {
            "none".to_string()
        } else {
            format!("{ld:?}")
        }
    );
    // exit() runs no destructor: the nodes' state directories go first.
    drop(agent);
    drop(full);
    drop(dhcp);
    std::process::exit(if failures.is_empty() && lf.is_empty() && ld.is_empty() {
        0
    } else {
        1
    });
}
