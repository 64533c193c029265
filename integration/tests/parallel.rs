//! Concurrency, bounded for CI: 20 ADDs of the full chain (bridge +
//! host-local, portmap, firewall, tuning, bandwidth, fastpath, policy) at
//! once on one node, then 20 DELs at once: all succeed (no busy or
//! generation-conflict error reaches the runtime), no address twice, every
//! pod with exactly a lone pod's rules, and nothing left afterwards.
//! `bench/parallel.sh` runs 100 with timings against the reference.

use rcni_testkit::bin_dir;
use rcni_testkit::parallel::{Chain, Node};

#[test]
fn twenty_concurrent_full_chain_adds_and_dels() {
    let bins = bin_dir();
    let mut node = Node::new("rcni full", Chain::Full, &bins.join("cnitool"), &bins);
    assert!(node.rules_per_pod > 0, "a pod alone has no rules naming it");
    for _ in 0..2 {
        let r = node.round(20);
        assert!(r.problems.is_empty(), "{:#?}", r.problems);
    }
}
