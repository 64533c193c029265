//! The figure of issue 31 that bench/cloud.sh prints: a pod's ADD (and
//! DEL) in cloud mode, its address from the agent's warm pool, against the
//! reference's bridge + host-local, side by side in one run, on the VPC lab
//! (the agent against the EC2 model, as in cloud_aws.rs). Ignored: run by
//! bench/cloud.sh on the static release build
//! (`RCNI_BIN_DIR=target/bench-bin`), not by the test suite.
//!
//! Four chains, alternated within each round so that drift hits them all:
//! - `ours`: the agent's conflist's ptp with vpc-ipam (the pod's path: a
//!   socket exchange with the agent, no cloud call);
//! - `ref bridge`: the reference bridge + host-local (v1.9.1 where at hand,
//!   else Debian's 1.1.1): the target's anchor;
//! - `ref ptp`: the reference ptp + host-local, the same layout as ours
//!   without the pool: what the pool itself costs;
//! - `our ptp`: ours, ptp + host-local: the pool's cost against it;
//! - `our bridge`: ours, bridge + host-local.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rcni_integration::lab::vpc::{Vpc, python};
use rcni_testkit::{Call, TestNs, bin, require_root};
use serde_json::{Value, json};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn p90(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[(v.len() * 9 / 10).min(v.len() - 1)]
}

struct Chain {
    name: &'static str,
    bin: PathBuf,
    path: String,
    conf: Value,
    add_ms: Vec<f64>,
    del_ms: Vec<f64>,
}

fn timed(c: &Call, ns: &rcni_netns::NetNs) -> (f64, Value) {
    let t = Instant::now();
    let out = c.run_in(ns);
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    (ms, out.ok())
}

#[test]
#[ignore = "a benchmark: bench/cloud.sh runs it"]
fn bench_pod_add_from_warm_pool() {
    require_root();
    if python().is_none() {
        eprintln!("SKIP: no moto[server] (scripts/setup --for test)");
        return;
    }
    let rounds: usize = std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let (ref_dir, ref_name) = match rcni_testkit::reference_v191_bin("bridge") {
        Some(p) => (p.parent().unwrap().to_path_buf(), "v1.9.1"),
        None => (PathBuf::from(rcni_testkit::REFERENCE_DIR), "Debian 1.1.1"),
    };
    let mut vpc = Vpc::new();
    let k = vpc.add_node("m5.4xlarge");
    let node = &vpc.nodes[k];
    // Every address up front and none asked for during the run: the EC2
    // model's work would otherwise share the CPUs with what is measured.
    let warm = (rounds + 2).to_string();
    node.start_agent(&[
        ("WARM_IP_TARGET", "1"),
        ("MINIMUM_IP_TARGET", warm.as_str()),
    ]);
    let t0 = Instant::now();
    rcni_testkit::wait_for(Duration::from_secs(120), "the warm pool", || {
        vpc.assigned(k).len() > rounds + 1
    });
    eprintln!(
        "pool warm: {} addresses in {:.1} s",
        vpc.assigned(k).len(),
        t0.elapsed().as_secs_f64()
    );
    vpc.settle();
    let list = node.conflist();
    let mut ours = list["plugins"][0].clone();
    ours["cniVersion"] = list["cniVersion"].clone();
    ours["name"] = list["name"].clone();
    assert_eq!(ours["ipam"]["type"], "vpc-ipam");
    let data = node.dir.path().join("bench-ipam");
    let host_local = |subnet: &str, d: &str| {
        json!({"type": "host-local", "ranges": [[{"subnet": subnet}]],
               "dataDir": data.join(d)})
    };
    let our_dir = rcni_testkit::bin_dir().display().to_string();
    let mut chains = vec![
        Chain {
            name: "ours (ptp + vpc-ipam, warm pool)",
            bin: bin("ptp"),
            path: our_dir.clone(),
            conf: ours,
            add_ms: vec![],
            del_ms: vec![],
        },
        Chain {
            name: "ref bridge + host-local",
            bin: ref_dir.join("bridge"),
            path: ref_dir.display().to_string(),
            conf: json!({"cniVersion": "1.0.0", "name": "refbr", "type": "bridge",
                "bridge": "refbr0", "isGateway": true,
                "ipam": host_local("10.88.0.0/16", "refbr")}),
            add_ms: vec![],
            del_ms: vec![],
        },
        Chain {
            name: "ref ptp + host-local",
            bin: ref_dir.join("ptp"),
            path: ref_dir.display().to_string(),
            conf: json!({"cniVersion": "1.0.0", "name": "refptp", "type": "ptp",
                "ipam": host_local("10.89.0.0/16", "refptp")}),
            add_ms: vec![],
            del_ms: vec![],
        },
        Chain {
            name: "our ptp + host-local",
            bin: bin("ptp"),
            path: our_dir.clone(),
            conf: json!({"cniVersion": "1.0.0", "name": "ourptp", "type": "ptp",
                "ipam": host_local("10.91.0.0/16", "ourptp")}),
            add_ms: vec![],
            del_ms: vec![],
        },
        Chain {
            name: "our bridge + host-local",
            bin: bin("bridge"),
            path: our_dir,
            conf: json!({"cniVersion": "1.0.0", "name": "ourbr", "type": "bridge",
                "bridge": "ourbr0", "isGateway": true,
                "ipam": host_local("10.90.0.0/16", "ourbr")}),
            add_ms: vec![],
            del_ms: vec![],
        },
    ];
    let mut pods: Vec<Vec<(TestNs, String, Value)>> = chains.iter().map(|_| Vec::new()).collect();
    for r in 0..rounds {
        for (i, c) in chains.iter_mut().enumerate() {
            let pod = TestNs::new();
            let cid = format!("bench-{i}-{r}");
            let call = Call::new(&c.bin, "ADD")
                .env("CNI_CONTAINERID", &cid)
                .env("CNI_PATH", &c.path)
                .netns(&pod.path())
                .stdin(&c.conf);
            let (ms, res) = timed(&call, &node.ns.ns);
            c.add_ms.push(ms);
            pods[i].push((pod, cid, res));
        }
    }
    for r in 0..rounds {
        for (c, pods) in chains.iter_mut().zip(&pods) {
            let (pod, cid, res) = &pods[r];
            let mut conf = c.conf.clone();
            conf["prevResult"] = res.clone();
            let call = Call::new(&c.bin, "DEL")
                .env("CNI_CONTAINERID", cid)
                .env("CNI_PATH", &c.path)
                .netns(&pod.path())
                .stdin(&conf);
            let t = Instant::now();
            let out = call.run_in(&node.ns.ns);
            c.del_ms.push(t.elapsed().as_secs_f64() * 1000.0);
            assert_eq!(out.code, 0, "{}: DEL: {}", c.name, out.stderr);
        }
    }
    let anchor_add = median(&mut chains[1].add_ms.clone());
    let anchor_del = median(&mut chains[1].del_ms.clone());
    println!(
        "pod ADD / DEL, {rounds} pods each, the reference {ref_name}, binaries from {}:",
        rcni_testkit::bin_dir().display()
    );
    println!(
        "{:<36} {:>10} {:>10} {:>9} {:>10} {:>9}",
        "chain", "ADD p50 ms", "ADD p90", "vs ref br", "DEL p50 ms", "vs ref br"
    );
    for c in &mut chains {
        let a = median(&mut c.add_ms);
        let a90 = p90(&mut c.add_ms);
        let d = median(&mut c.del_ms);
        println!(
            "{:<36} {:>10.2} {:>10.2} {:>8.2}x {:>10.2} {:>8.2}x",
            c.name,
            a,
            a90,
            a / anchor_add,
            d,
            d / anchor_del
        );
    }
    let calls = vpc.ec2.agent_calls();
    println!("EC2 calls by the agent over the run (pool warm-up included): {calls:?}");
}
