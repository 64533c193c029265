//! Cloud mode with the meta plugins chained after ptp + vpc-ipam, as they
//! run after bridge or ptp elsewhere: fastpath, policy (NetworkPolicy on
//! the pods' VPC addresses) and portmap (a host port on the node's primary
//! address), on the VPC lab with the agent against the EC2 model: each test
//! twice, against ec2_model.py and against stock moto (`..._stock_moto`),
//! none needing its additions.

use std::path::Path;
use std::time::Duration;

use rcni_integration::lab::chain::{tcp_get, tcp_get_within, tcp_server};
use rcni_integration::lab::vpc::{Model, VPC_HOST, Vpc, pod_ip, python};
use rcni_testkit::{Bpffs, Call, TestNs, bin, require_root};
use serde_json::{Value, json};

/// The VPC lab against `model` with one t3.medium node (its index);
/// `None`, after saying so, where the EC2 model cannot run.
fn one_node_vpc(model: Model) -> Option<(Vpc, usize)> {
    require_root();
    if python().is_none() {
        eprintln!("SKIP: no moto[server] (scripts/setup --for test)");
        return None;
    }
    let mut vpc = Vpc::with_model(model);
    let k = vpc.add_node("t3.medium");
    Some((vpc, k))
}

/// Whether `ns` has a routing rule to `ip` (a pod's, as the agent makes
/// them).
fn has_rule(ns: &rcni_netns::NetNs, ip: std::net::Ipv4Addr) -> bool {
    rcni_integration::nl(ns, async |n| {
        n.rules(rcni_netlink::Family::V4).await.unwrap()
    })
    .iter()
    .any(|r| r.dst.is_some_and(|d| d.ip() == std::net::IpAddr::V4(ip)))
}

/// The agent's ptp + vpc-ipam, then fastpath, policy and portmap.
fn chain(agent_list: &Value, pins: &Bpffs, data: &Path, policy_dir: &Path) -> Vec<Value> {
    let mut ptp = agent_list["plugins"][0].clone();
    assert_eq!(ptp["ipam"]["type"], "vpc-ipam");
    ptp["cniVersion"] = json!("1.1.0");
    ptp["name"] = json!("rcni");
    let base = |v: Value| {
        let mut v = v;
        v["cniVersion"] = json!("1.1.0");
        v["name"] = json!("rcni");
        v
    };
    vec![
        ptp,
        base(json!({"type": "fastpath", "pinRoot": pins.root()})),
        base(
            json!({"type": "policy", "backend": "ebpf", "pinRoot": pins.root(),
                    "dataDir": data.join("policy"), "policyDir": policy_dir}),
        ),
        base(json!({"type": "portmap", "capabilities": {"portMappings": true}})),
    ]
}

struct Pod {
    ns: TestNs,
    cid: String,
    result: Value,
}

/// ADD through the chain; `labels` as the runtime's CNI args, `ports` as
/// the runtime config's portMappings.
fn add(
    node_ns: &rcni_netns::NetNs,
    plugins: &[Value],
    cid: &str,
    labels: Value,
    ports: Value,
) -> Pod {
    let ns = TestNs::new();
    let mut prev: Option<Value> = None;
    for p in plugins {
        let mut c = p.clone();
        if let Some(r) = &prev {
            c["prevResult"] = r.clone();
        }
        match c["type"].as_str().unwrap() {
            "policy" => c["args"] = json!({"cni": {"labels": labels, "namespace": "default"}}),
            "portmap" => c["runtimeConfig"] = json!({"portMappings": ports}),
            _ => {}
        }
        let ty = c["type"].as_str().unwrap().to_string();
        let r = Call::new(bin(&ty), "ADD")
            .env("CNI_CONTAINERID", cid)
            .netns(&ns.path())
            .stdin(&c)
            .run_in(node_ns)
            .ok();
        prev = Some(r);
    }
    Pod {
        ns,
        cid: cid.into(),
        result: prev.unwrap(),
    }
}

fn del(node_ns: &rcni_netns::NetNs, plugins: &[Value], p: &Pod, labels: Value, ports: Value) {
    for c in plugins.iter().rev() {
        let mut c = c.clone();
        c["prevResult"] = p.result.clone();
        match c["type"].as_str().unwrap() {
            "policy" => c["args"] = json!({"cni": {"labels": labels, "namespace": "default"}}),
            "portmap" => c["runtimeConfig"] = json!({"portMappings": ports}),
            _ => {}
        }
        let ty = c["type"].as_str().unwrap().to_string();
        Call::new(bin(&ty), "DEL")
            .env("CNI_CONTAINERID", &p.cid)
            .netns(&p.ns.path())
            .stdin(&c)
            .run_in(node_ns)
            .ok();
    }
}

#[test]
fn fastpath_policy_and_portmap_chained_after_vpc_ipam() {
    fastpath_policy_and_portmap_chained_after_vpc_ipam_in(Model::Patched);
}

#[test]
fn fastpath_policy_and_portmap_chained_after_vpc_ipam_stock_moto() {
    fastpath_policy_and_portmap_chained_after_vpc_ipam_in(Model::Stock);
}

fn fastpath_policy_and_portmap_chained_after_vpc_ipam_in(model: Model) {
    let Some((vpc, k)) = one_node_vpc(model) else {
        return;
    };
    let node = &vpc.nodes[k];
    node.start_agent(&[]);
    let pins = Bpffs::empty();
    let policy_dir = tempfile::tempdir().unwrap();
    // web (app=web) takes 8080 from app=client pods only.
    std::fs::write(
        policy_dir.path().join("web.json"),
        serde_json::to_vec(
            &json!({"kind": "NetworkPolicy", "apiVersion": "networking.k8s.io/v1",
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"podSelector": {"matchLabels": {"app": "web"}},
                     "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}],
                                  "ports": [{"port": 8080}]}]}}),
        )
        .unwrap(),
    )
    .unwrap();
    let plugins = chain(&node.conflist(), &pins, node.dir.path(), policy_dir.path());
    let ns = &node.ns.ns;
    // ADD may meet an empty pool right after the start: the test waits for
    // the warm pool (the default WARM_ENI_TARGET fills the primary ENI).
    rcni_testkit::wait_for(Duration::from_secs(60), "the warm pool", || {
        vpc.assigned(k).len() >= 4
    });
    let none = json!([]);
    let web_l = json!({"app": "web"});
    let client_l = json!({"app": "client"});
    let other_l = json!({"app": "other"});
    let other_ports = json!([{"hostPort": 19090, "containerPort": 9090, "protocol": "tcp"}]);
    let web = add(ns, &plugins, "web", web_l.clone(), none.clone());
    let client = add(ns, &plugins, "client", client_l.clone(), none.clone());
    let other = add(ns, &plugins, "other", other_l.clone(), other_ports.clone());
    let (w, o) = (pod_ip(&web.result), pod_ip(&other.result));
    // The addresses are the node's per the API.
    let assigned = vpc.assigned(k);
    for p in [&web, &client, &other] {
        assert!(assigned.contains_key(&pod_ip(&p.result)), "{}", p.result);
    }
    tcp_server(&web.ns.ns, 8080, "web");
    tcp_server(&other.ns.ns, 9090, "other");
    // The servers answer with the peer's address: inside the VPC nothing
    // is translated.
    let c = pod_ip(&client.result);
    assert_eq!(
        tcp_get(&client.ns.ns, &format!("{w}:8080")),
        Some(format!("web {c}")),
        "client -> web:8080 (policy allows)\n{}",
        node.agent_log()
    );
    assert!(
        tcp_get_within(
            &other.ns.ns,
            &format!("{w}:8080"),
            Duration::from_millis(800)
        )
        .is_none(),
        "other -> web:8080 must be dropped by policy"
    );
    assert!(
        tcp_get_within(
            &vpc.host.ns,
            &format!("{w}:8080"),
            Duration::from_millis(800)
        )
        .is_none(),
        "the VPC host -> web:8080 must be dropped by policy"
    );
    // other is selected by no policy: the VPC host reaches it on its own
    // address, and through the node's host port (portmap).
    assert_eq!(
        tcp_get(&vpc.host.ns, &format!("{o}:9090")),
        Some(format!("other {VPC_HOST}"))
    );
    assert!(
        tcp_get(&vpc.host.ns, &format!("{}:19090", node.primary_ip))
            .is_some_and(|r| r.starts_with("other ")),
        "host port 19090 on the node's primary address -> other:9090"
    );
    // fastpath has the pods as endpoints.
    assert!(
        std::fs::read_dir(pins.path()).unwrap().count() > 0,
        "fastpath pinned nothing"
    );
    del(ns, &plugins, &other, other_l, other_ports);
    del(ns, &plugins, &client, client_l, none.clone());
    del(ns, &plugins, &web, web_l, none);
    // The addresses went back to the pool: no rules of these pods remain.
    for a in [w, o] {
        assert!(!has_rule(ns, a), "{a}'s rules remain");
    }
}

/// vpc-ipam's other commands end to end: CHECK (through ptp, which asks
/// its IPAM), GC releasing what no valid attachment holds (its rules gone,
/// the checkpoint without it), STATUS; with the agent gone, STATUS is 50
/// and ADD and DEL are 11 (the runtime retries), never a made-up address.
#[test]
fn vpc_ipam_check_gc_status_and_a_missing_agent() {
    vpc_ipam_check_gc_status_and_a_missing_agent_in(Model::Patched);
}

#[test]
fn vpc_ipam_check_gc_status_and_a_missing_agent_stock_moto() {
    vpc_ipam_check_gc_status_and_a_missing_agent_in(Model::Stock);
}

fn vpc_ipam_check_gc_status_and_a_missing_agent_in(model: Model) {
    let Some((vpc, k)) = one_node_vpc(model) else {
        return;
    };
    let node = &vpc.nodes[k];
    node.start_agent(&[("WARM_IP_TARGET", "4"), ("MINIMUM_IP_TARGET", "4")]);
    let ns = &node.ns.ns;
    let list = node.conflist();
    let mut ptp = list["plugins"][0].clone();
    ptp["cniVersion"] = list["cniVersion"].clone();
    ptp["name"] = list["name"].clone();
    // What a runtime hands the IPAM plugin: the network's config.
    let mut ipam = ptp.clone();
    ipam["cniVersion"] = json!("1.1.0");
    let (pa, ra, a, _) = node.add_pod_retrying("keep", Duration::from_secs(30));
    let (pb, _, b, _) = node.add_pod_retrying("lost", Duration::from_secs(30));
    // CHECK through ptp: its IPAM's CHECK agrees with prevResult.
    let mut c = ptp.clone();
    c["prevResult"] = ra.clone();
    Call::new(bin("ptp"), "CHECK")
        .env("CNI_CONTAINERID", "keep")
        .netns(&pa.path())
        .stdin(&c)
        .run_in(ns)
        .ok();
    let has_rule = |ip| has_rule(ns, ip);
    assert!(has_rule(a) && has_rule(b));
    // GC with only "keep" valid: "lost" (a pod whose DEL never came)
    // goes back to the pool.
    let mut g = ipam.clone();
    g["cni.dev/valid-attachments"] = json!([{"containerID": "keep", "ifname": "eth0"}]);
    Call::new(bin("vpc-ipam"), "GC").stdin(&g).run_in(ns).ok();
    assert!(has_rule(a) && !has_rule(b), "GC left {b}'s rules");
    let cp = node.checkpoint().unwrap();
    let held: Vec<&str> = cp["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["containerID"].as_str().unwrap())
        .collect();
    assert_eq!(held, ["keep"], "{cp}");
    // GC without the key is refused (an empty list would release all).
    let out = Call::new(bin("vpc-ipam"), "GC").stdin(&ipam).run_in(ns);
    assert_eq!(out.code, 1, "{}", out.stdout);
    assert!(out.stdout.contains("\"code\": 7"), "{}", out.stdout);
    Call::new(bin("vpc-ipam"), "STATUS")
        .stdin(&ipam)
        .run_in(ns)
        .ok();
    // The agent gone: 50 for STATUS, 11 for ADD and DEL.
    node.kill_agent();
    let _ = std::fs::remove_file(node.socket());
    let out = Call::new(bin("vpc-ipam"), "STATUS").stdin(&ipam).run_in(ns);
    assert!(out.stdout.contains("\"code\": 50"), "{}", out.stdout);
    let pod = TestNs::new();
    let out = Call::new(bin("vpc-ipam"), "ADD")
        .env("CNI_CONTAINERID", "late")
        .netns(&pod.path())
        .stdin(&ipam)
        .run_in(ns);
    assert!(out.stdout.contains("\"code\": 11"), "{}", out.stdout);
    let out = Call::new(bin("vpc-ipam"), "DEL")
        .env("CNI_CONTAINERID", "keep")
        .netns(&pa.path())
        .stdin(&ipam)
        .run_in(ns);
    assert!(out.stdout.contains("\"code\": 11"), "{}", out.stdout);
    // Back, the agent still knows "keep" (its checkpoint) and DEL works.
    node.restart_agent();
    node.del_pod(&pa, "keep");
    assert!(!has_rule(a));
    drop(pb);
}

/// The agent's passes read the pool and make the pods' rules from it,
/// while vpc-ipam's ADD, DEL and GC change both: a pass must never put back
/// the rules of an address just released, nor take away those of one just
/// given (the agent holds one lock over each change and over a pass's
/// read-and-apply). Here the passes run back to back (a 1 ms resync), each
/// waiting 150 ms between its read and its rules (a test knob), so every
/// request lands in a pass's window: without the lock, a GC or DEL saw its
/// rules back within that pass, and a new pod's rules went.
#[test]
fn ipam_changes_racing_the_agents_passes_leave_the_pools_rules() {
    ipam_changes_racing_the_agents_passes_leave_the_pools_rules_in(Model::Patched);
}

#[test]
fn ipam_changes_racing_the_agents_passes_leave_the_pools_rules_stock_moto() {
    ipam_changes_racing_the_agents_passes_leave_the_pools_rules_in(Model::Stock);
}

fn ipam_changes_racing_the_agents_passes_leave_the_pools_rules_in(model: Model) {
    let Some((vpc, k)) = one_node_vpc(model) else {
        return;
    };
    let node = &vpc.nodes[k];
    node.start_agent(&[
        ("WARM_IP_TARGET", "6"),
        ("MINIMUM_IP_TARGET", "6"),
        ("RCNI_CLOUD_RESYNC_MS", "1"),
        ("RCNI_CLOUD_PASS_DELAY_MS", "150"),
    ]);
    let ns = &node.ns.ns;
    let list = node.conflist();
    let mut ipam = list["plugins"][0].clone();
    ipam["cniVersion"] = json!("1.1.0");
    ipam["name"] = list["name"].clone();
    let has_rule = |ip| has_rule(ns, ip);
    let pod = TestNs::new();
    let call = |cmd: &str, cid: &str, conf: &Value| {
        Call::new(bin("vpc-ipam"), cmd)
            .env("CNI_CONTAINERID", cid)
            .netns(&pod.path())
            .stdin(conf)
            .run_in(ns)
    };
    let mut gc = ipam.clone();
    gc["cni.dev/valid-attachments"] = json!([]);
    for i in 0..6 {
        let cid = format!("race-{i}");
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let r = loop {
            let out = call("ADD", &cid, &ipam);
            if out.code == 0 {
                break out.ok();
            }
            // 11: the pool refills (released addresses cool down first).
            assert!(out.stdout.contains("\"code\": 11"), "{}", out.stdout);
            assert!(std::time::Instant::now() < deadline, "{}", out.stdout);
            std::thread::sleep(Duration::from_millis(200));
        };
        let a = pod_ip(&r);
        for _ in 0..10 {
            assert!(has_rule(a), "round {i}: a pass took {a}'s new rules away");
            std::thread::sleep(Duration::from_millis(30));
        }
        if i % 2 == 0 {
            Call::new(bin("vpc-ipam"), "GC").stdin(&gc).run_in(ns).ok();
        } else {
            call("DEL", &cid, &ipam).ok();
        }
        for _ in 0..10 {
            assert!(!has_rule(a), "round {i}: a pass put {a}'s rules back");
            std::thread::sleep(Duration::from_millis(30));
        }
    }
}
