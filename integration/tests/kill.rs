//! The kill test (issue 21), bounded for CI: ADD through cnitool killed
//! with SIGKILL to its whole process group at a random moment of its
//! length, then DEL and GC as a runtime runs them; nothing may be left
//! (reservations, empty ones included, links, netfilter rules, tuning
//! backups, cached results) and neither DEL nor GC may fail.
//! `bench/chaos.sh` runs the same with 1000 trials per setup.

use rcni_testkit::bin_dir;
use rcni_testkit::chaos::{Backend, Harness, Setup};

fn kill_trials(setup: Setup, trials: usize) {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let mut h = Harness::new(setup, &bin_dir(), seed);
    let r = h.run(trials);
    let summary = r.summary();
    eprintln!("seed {seed}\n{summary}");
    assert!(
        r.leaky().is_empty() && r.del_failures().is_empty() && r.gc_failures().is_empty(),
        "seed {seed}\n{summary}"
    );
}

#[test]
fn killed_host_local_add_leaves_nothing() {
    // Cheap trials, and the window of the leak is narrow (about 1 in 200
    // trials leaked an empty reservation before host-local published it
    // atomically).
    kill_trials(Setup::HostLocal, 400);
}

#[test]
fn killed_chain_add_leaves_nothing_nftables() {
    kill_trials(Setup::Chain(Backend::Nftables), 15);
}

#[test]
fn killed_chain_add_leaves_nothing_iptables() {
    kill_trials(Setup::Chain(Backend::Iptables), 15);
}
