//! The soak, bounded for CI (`bench/soak.sh` runs 10,000 cycles with the
//! agent alongside): ADD/DEL cycles of the full chain (bridge + host-local,
//! portmap, firewall, tuning, bandwidth, fastpath, policy) ten at a time,
//! one in five also cycling a pod of a dhcp network through the daemon;
//! then the runtime's GC. No command may fail, nothing may be left, the
//! daemon must hold the fds it held at the start, and no process may be
//! left in the nodes' namespaces but the daemon.

use rcni_netns::NetNs;
use rcni_testkit::bin_dir;
use rcni_testkit::chaos::{Harness, Kill, Plugin};
use std::os::unix::fs::MetadataExt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

#[test]
fn full_chain_cycles_leave_nothing_and_the_daemon_stays_flat() {
    const CYCLES: usize = 80;
    let full = Harness::plugin(Plugin::Bridge, Kill::Add, &bin_dir(), 1, None, 1);
    let dhcp = Harness::plugin(Plugin::Dhcp, Kill::Add, &bin_dir(), 1, None, 1);
    let daemon = dhcp.dhcp_daemon_pid().unwrap();
    let inodes: Vec<u64> = [&full.node, &dhcp.node]
        .iter()
        .map(|ns: &&NetNs| std::fs::metadata(ns.proc_path()).unwrap().ino())
        .collect();
    // Detached helpers of the calibration's last commands finish first.
    let settle = || {
        for _ in 0..50 {
            if rcni_testkit::processes_in(&inodes).len() <= 1 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        rcni_testkit::processes_in(&inodes)
    };
    let procs_start = settle();
    // The daemon closes a connection once it reads its end, after the
    // plugin has gone: its count is taken once it stops moving.
    let steady_fds = || {
        let mut n = fds(daemon);
        for _ in 0..50 {
            std::thread::sleep(std::time::Duration::from_millis(100));
            let m = fds(daemon);
            if m == n {
                break;
            }
            n = m;
        }
        n
    };
    let fds_start = steady_fds();
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..10 {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= CYCLES {
                        break;
                    }
                    let cid = format!("soak{i:04}");
                    let mut runs = vec![("full", full.cycle(&cid))];
                    if i.is_multiple_of(5) {
                        runs.push(("dhcp", dhcp.cycle(&cid)));
                    }
                    for (what, (add, del)) in runs {
                        for (cmd, o) in [("ADD", add), ("DEL", del)] {
                            if !o.ok {
                                failures
                                    .lock()
                                    .unwrap()
                                    .push(format!("{cid} {what} {cmd}: {}", o.message()));
                            }
                        }
                    }
                }
            });
        }
    });
    for h in [&full, &dhcp] {
        let gc = h.gc();
        assert!(gc.ok, "GC: {}", gc.message());
    }
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{failures:#?}");
    let (lf, ld) = (full.leftovers(), dhcp.leftovers());
    assert!(lf.is_empty(), "full chain left {lf:?}");
    assert!(ld.is_empty(), "dhcp network left {ld:?}");
    rcni_testkit::wait_for(
        std::time::Duration::from_secs(10),
        &format!("the daemon's open fds back to {fds_start}"),
        || fds(daemon) <= fds_start,
    );
    assert_eq!(settle(), procs_start, "processes in the nodes' namespaces");
}
