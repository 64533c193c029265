//! The BGP backend (`"backend": "bgp"`, issue 30) on a routed fabric
//! (rcni_integration::lab::fabric): racks of nodes behind top-of-rack
//! routers running BIRD 2 with the test's config, each node's agent running
//! its own BIRD and peering with its ToR; or the agents' full mesh on one
//! L2. Real sessions, real routes, real traffic between pods.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};

use rcni_integration::lab::cluster::{SETTLE, VTEP, VTEP6};
use rcni_integration::lab::fabric::{
    Agent, BIRD_TABLE, Bird, CONVERGE, Fabric, Stack, all_routes_text, birdc, node_as,
    node_bird_sock, parse_prefixes, pod_cidr, pod_cidr6, rcni_prefixes, rcni_routes, table_routes,
    tor_address, tunnels,
};
use rcni_integration::lab::traffic::{echo, echo_stream, listen_ok, ping6, talks_soon};
use rcni_netns::NetNs;
use rcni_testkit::{command_in, ping, poll, wait_for};
use serde_json::json;

fn mesh_off() -> serde_json::Value {
    json!({"nodeToNodeMeshEnabled": false})
}

fn agents(f: &Fabric, which: &[usize]) -> Vec<Agent> {
    which
        .iter()
        .map(|&i| Agent::start(&f.nodes[i], &f.file))
        .collect()
}

/// An [`echo_stream`] whose echoes fail the test when the path is lost
/// instead of blocking it.
fn stream(client: &NetNs, server: &NetNs, addr: &str) -> std::net::TcpStream {
    let s = echo_stream(client, server, addr);
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    s
}

/// `ip route show table main`, both families, but link-local and
/// multicast: what a test compares before and after.
fn main_table(ns: &NetNs) -> BTreeSet<String> {
    let mut s = BTreeSet::new();
    for fam in ["-4", "-6"] {
        let out = command_in(ns, "ip")
            .args([fam, "route", "show", "table", "main"])
            .output()
            .unwrap();
        s.extend(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| !l.starts_with("fe80") && !l.starts_with("multicast"))
                .map(str::to_string),
        );
    }
    s
}

/// The lab itself, with no agent: the ToRs peer, hand each other their
/// racks' subnets, and carry a pod prefix a stand-in node's BIRD
/// announces to the other rack (and a stand-in there installs it and
/// pods' addresses answer across); a prefix outside the pods' network is
/// filtered by the ToR.
#[test]
fn the_fabric_carries_pod_prefixes_between_racks_without_any_agent() {
    let f = Fabric::routed(&[0, 1], Stack::V4);
    // Established is not yet exchanged: the UPDATEs follow.
    wait_for(CONVERGE, "rack 2's subnet on ToR 1", || {
        f.tors[0].prefixes_from("tor2").contains("192.168.60.0/24")
    });
    wait_for(CONVERGE, "rack 1's subnet on ToR 2", || {
        f.tors[1].prefixes_from("tor1").contains("192.168.50.0/24")
    });

    let b1 = stand_in(&f, 0, "route 172.16.0.0/24 blackhole;");
    let b2 = stand_in(&f, 1, "");
    f.tors[0].wait_established(&["n1"]);
    f.tors[1].wait_established(&["n2"]);
    wait_for(CONVERGE, "n1's pod subnet on ToR 2", || {
        f.tors[1].pod_prefixes().contains("10.244.1.0/24")
    });
    wait_for(CONVERGE, "n2's pod subnet on ToR 1", || {
        f.tors[0].pod_prefixes().contains("10.244.2.0/24")
    });
    assert_eq!(
        f.tors[0].prefixes_from("n1"),
        BTreeSet::from(["10.244.1.0/24".to_string()]),
        "{}",
        f.tors[0].birdc("show route all")
    );
    for t in &f.tors {
        assert!(
            !t.prefixes().contains("172.16.0.0/24"),
            "{:?}",
            t.prefixes()
        );
    }
    let learned = parse_prefixes(&birdc(&f.nodes[1].ns.ns, &b2.sock, "show route"));
    assert!(learned.contains("10.244.1.0/24"), "{learned:?}");
    assert!(!learned.contains("192.168.50.0/24"), "{learned:?}");
    // The stand-ins' kernels have each other's pod subnet via their ToR:
    // pod addresses answer across the racks.
    wait_for(CONVERGE, "the route on n1", || {
        table_routes(&f.nodes[0].ns.ns, 254)
            .contains("10.244.2.0/24 via 192.168.50.254 dev eth0 proto 12")
    });
    wait_for(CONVERGE, "the route on n2", || {
        table_routes(&f.nodes[1].ns.ns, 254)
            .iter()
            .any(|r| r.starts_with("10.244.1.0/24 via 192.168.60.254"))
    });
    let out = command_in(&f.nodes[0].ns.ns, "ping")
        .args(["-c", "1", "-W", "2", "-I", "10.244.1.1", "10.244.2.1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}\n{}", b1.log());
}

/// What an agent's BIRD does, by hand, on node i of a lab with no agent:
/// announce the node's pod subnet (and `extra` static routes) to its ToR
/// over the node's family, install what it learns; the pod subnet's first
/// address on the node's lo.
fn stand_in(f: &Fabric, i: usize, extra: &str) -> Bird {
    let n = &f.nodes[i];
    let r = f.rack_of[i];
    let v6 = !f.stack.v4();
    let (fam, me, cidr, tor, first) = if v6 {
        let c = pod_cidr6(i);
        let first = c.replace("::/64", "::1/128");
        ("ipv6", f.address6(i), c, tor_address(r, true), first)
    } else {
        (
            "ipv4",
            f.address(i),
            pod_cidr(i),
            tor_address(r, false),
            format!("10.244.{}.1/32", i + 1),
        )
    };
    // A router ID is an IPv4 address even on an IPv6-only node.
    let conf = format!(
        "log stderr all;
router id 10.0.0.{id};
protocol device {{ }}
protocol static {{ {fam}; route {cidr} blackhole; {extra} }}
protocol kernel {{ {fam} {{ import none; export where source = RTS_BGP; }}; }}
protocol bgp tor {{
  local {me} as {nas}; neighbor {tor} as {tas};
  connect delay time 1; connect retry time 1;
  {fam} {{ import all; export where source = RTS_STATIC; }};
}}
",
        id = i + 1,
        nas = node_as(i),
        tas = f.tors[r].asn
    );
    ip_addr(&n.ns.ns, &first);
    Bird::start(&n.ns.ns, &conf)
}

/// The lab's IPv6-only fabric, with no agent: nodes without any IPv4
/// address peer with their ToRs over IPv6, and pod prefixes and traffic
/// cross the racks.
#[test]
fn the_ipv6_only_fabric_carries_pod_prefixes_without_any_agent() {
    let f = Fabric::routed(&[0, 1], Stack::V6);
    let b1 = stand_in(&f, 0, "");
    let _b2 = stand_in(&f, 1, "");
    f.tors[0].wait_established(&["n1v6"]);
    assert!(!f.tors[0].protocols().contains_key("n1"));
    wait_for(CONVERGE, "n1's pod subnet on ToR 2", || {
        f.tors[1].pod_prefixes().contains("fd00:0:0:1::/64")
    });
    wait_for(CONVERGE, "the route on n2", || {
        table_routes(&f.nodes[1].ns.ns, 254)
            .iter()
            .any(|r| r.starts_with("fd00:0:0:1::/64 via "))
    });
    wait_for(CONVERGE, "the route on n1", || {
        table_routes(&f.nodes[0].ns.ns, 254)
            .iter()
            .any(|r| r.starts_with("fd00:0:0:2::/64 via "))
    });
    let routes = all_routes_text(&f.nodes[0].ns.ns);
    assert!(!routes.contains("192.168."), "{routes}");
    let out = command_in(&f.nodes[0].ns.ns, "ping")
        .args([
            "-6",
            "-c",
            "1",
            "-W",
            "2",
            "-I",
            "fd00:0:0:1::1",
            "fd00:0:0:2::1",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}\n{}", b1.log());
}

/// What a failed ping needs explained: each node's routes, forwarding
/// and the agent's log.
fn state(f: &Fabric, a: &[Agent]) -> String {
    let mut s = String::new();
    for (i, n) in f.nodes.iter().enumerate() {
        let out = |args: &[&str]| {
            let o = command_in(&n.ns.ns, args[0])
                .args(&args[1..])
                .output()
                .unwrap();
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
        };
        let sock = node_bird_sock(n);
        let bird = ["show protocols all", "show route all"]
            .iter()
            .map(|c| out(&["birdc", "-s", sock.to_str().unwrap(), c]))
            .collect::<String>();
        s += &format!(
            "== {}\n{}{}{}{}{bird}--- agent:\n{}\n",
            n.name,
            out(&["ip", "route", "show", "table", "all"]),
            out(&["sysctl", "net.ipv4.ip_forward"]),
            out(&["iptables", "-w", "-S"]),
            out(&["iptables", "-w", "-t", "nat", "-S"]),
            a.get(i).map(Agent::log).unwrap_or_default()
        );
    }
    s
}

fn ip_addr(ns: &NetNs, a: &str) {
    rcni_integration::ip(ns, &format!("addr add {a} dev lo"));
}

/// Two racks, mesh off, each node peering with its ToR only: the ToRs
/// learn every pod subnet, each node gets the others' through its ToR as
/// the agent's routes (and nothing else), pods talk across racks without
/// any tunnel.
#[test]
fn pods_across_racks_talk_over_routes_learned_from_the_tors() {
    let f = Fabric::routed(&[0, 0, 1], Stack::V4);
    f.write(&[0, 1, 2], mesh_off());
    let before: Vec<BTreeSet<String>> = f.nodes.iter().map(|n| main_table(&n.ns.ns)).collect();
    let a = agents(&f, &[0, 1, 2]);
    f.wait_converged(&[0, 1, 2], &a);

    // Each node announces its pod subnet and nothing else.
    for (i, n) in ["n1", "n2"].iter().enumerate() {
        assert_eq!(
            f.tors[0].prefixes_from(n),
            BTreeSet::from([pod_cidr(i)]),
            "{}",
            f.tors[0].birdc("show route all")
        );
    }
    assert_eq!(f.tors[1].prefixes_from("n3"), BTreeSet::from([pod_cidr(2)]));
    // What is new in a node's main table is the agent's routes, and they
    // are BGP's next hops: the ToR for the other rack. BIRD's own table
    // holds the same prefixes.
    for (i, n) in f.nodes.iter().enumerate() {
        let new: Vec<String> = main_table(&n.ns.ns)
            .difference(&before[i])
            .cloned()
            .collect();
        assert!(
            new.len() == 2 && new.iter().all(|r| r.contains(" proto 82")),
            "{}: {new:?}",
            n.name
        );
        let t252: BTreeSet<String> = table_routes(&n.ns.ns, BIRD_TABLE)
            .iter()
            .map(|r| r.split(' ').next().unwrap().to_string())
            .collect();
        assert_eq!(t252, rcni_prefixes(&n.ns.ns), "{}", n.name);
        assert!(tunnels(&n.ns.ns).is_empty(), "{:?}", tunnels(&n.ns.ns));
    }
    let r1 = rcni_routes(&f.nodes[0].ns.ns);
    assert!(
        r1.contains("10.244.3.0/24 via 192.168.50.254 dev eth0"),
        "{r1:?}"
    );
    let r3 = rcni_routes(&f.nodes[2].ns.ns);
    assert!(
        r3.contains("10.244.1.0/24 via 192.168.60.254 dev eth0"),
        "{r3:?}"
    );

    let (p1, a1) = f.nodes[0].pod("p1");
    let (p2, a2) = f.nodes[1].pod("p2");
    let (p3, a3) = f.nodes[2].pod("p3");
    for (from, to) in [(&p1, &a3), (&p3, &a1), (&p2, &a3), (&p3, &a2), (&p1, &a2)] {
        assert!(ping(&from.ns, to), "ping {to}\n{}", state(&f, &a));
    }
    let mut s = stream(&p1.ns, &p3.ns, &a3);
    for _ in 0..20 {
        echo(&mut s);
    }
    for ag in a.iter() {
        assert!(!ag.log().contains("rejected"), "{}", ag.log());
    }
}

/// A node taken out of the cluster file while every agent runs: its
/// agent shuts its BGP speaker down cleanly, so both ToRs and every other
/// node drop its pod subnet at once (no graceful-restart wait), and the
/// other routes stay as they were.
#[test]
fn a_node_removed_from_the_cluster_file_is_withdrawn_from_the_fabric() {
    let f = Fabric::routed(&[0, 0, 1], Stack::V4);
    f.write(&[0, 1, 2], mesh_off());
    let mut a = agents(&f, &[0, 1, 2]);
    f.wait_converged(&[0, 1, 2], &a);
    let keep = |i: usize| -> BTreeSet<String> {
        rcni_routes(&f.nodes[i].ns.ns)
            .into_iter()
            .filter(|r| !r.starts_with("10.244.2."))
            .collect()
    };
    let (k1, k3) = (keep(0), keep(2));

    f.write(&[0, 2], mesh_off());
    let gone = || {
        f.tors
            .iter()
            .all(|t| !t.pod_prefixes().contains("10.244.2.0/24"))
            && [0, 2]
                .iter()
                .all(|&i| !rcni_prefixes(&f.nodes[i].ns.ns).contains("10.244.2.0/24"))
    };
    assert!(
        poll(SETTLE, gone),
        "n2's subnet still there: ToR 1 {:?}, ToR 2 {:?}\n{}",
        f.tors[0].pod_prefixes(),
        f.tors[1].pod_prefixes(),
        state(&f, &a)
    );
    assert_eq!(rcni_routes(&f.nodes[0].ns.ns), k1);
    assert_eq!(rcni_routes(&f.nodes[2].ns.ns), k3);
    for t in &f.tors {
        assert_eq!(t.pod_prefixes(), BTreeSet::from([pod_cidr(0), pod_cidr(2)]));
    }
    assert!(a[0].running() && a[2].running());
}

/// SIGKILL of a node's agent (and with it its BIRD) under a TCP stream
/// between pods in different racks, then a new agent: the peers keep the
/// node's routes (graceful restart), the node keeps the learned ones in
/// its kernel while nothing runs, and the stream never breaks.
#[test]
fn an_agent_killed_and_restarted_keeps_routes_and_streams_across_racks() {
    let f = Fabric::routed(&[0, 1], Stack::V4);
    f.write(&[0, 1], mesh_off());
    let mut a = agents(&f, &[0, 1]);
    f.wait_converged(&[0, 1], &a);
    let (n1, n2) = (&f.nodes[0], &f.nodes[1]);
    let (p1, _) = n1.pod("p1");
    let (p2, a2) = n2.pod("p2");
    let mut s = stream(&p1.ns, &p2.ns, &a2);
    echo(&mut s);
    let r1 = rcni_routes(&n1.ns.ns);
    let r2 = rcni_routes(&n2.ns.ns);
    f.tors[0].wait_established(&["n1"]);

    let stop = AtomicBool::new(false);
    let missing = std::thread::scope(|sc| {
        // The scope waits for the sampler: it must stop when an assertion
        // below fails too.
        let _stop = StopOnDrop(&stop);
        // Every 20 ms until the end: both nodes' routes to each other.
        let sampler = sc.spawn(|| {
            let mut missing = Vec::new();
            let mut samples = 0;
            while !stop.load(Ordering::Relaxed) {
                for (n, want) in [(n1, &r1), (n2, &r2)] {
                    let got = rcni_routes(&n.ns.ns);
                    if &got != want {
                        missing.push(format!("{}: {got:?}", n.name));
                    }
                }
                samples += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            (missing, samples)
        });

        a[0].kill();
        // The agent's BIRD died with it: the ToR's session is down, which
        // is what makes this a restart.
        wait_for(CONVERGE, "n1's BIRD gone", || {
            rcni_testkit::processes_in(&[n1.ns.ns.inode()]).is_empty()
        });
        wait_for(CONVERGE, "ToR 1 to see n1 go", || {
            !f.tors[0].established("n1")
        });
        // Nothing runs on n1: its kernel keeps the learned routes (BIRD's
        // table and the agent's copy in main), the ToRs keep n1's.
        let kept = || {
            assert!(
                table_routes(&n1.ns.ns, BIRD_TABLE)
                    .iter()
                    .any(|r| r.starts_with("10.244.2.0/24")),
                "n1's BIRD table: {:?}",
                table_routes(&n1.ns.ns, BIRD_TABLE)
            );
            for t in &f.tors {
                assert!(
                    t.pod_prefixes().contains("10.244.1.0/24"),
                    "a ToR dropped n1's subnet (no graceful restart?):\n{}",
                    t.birdc("show route")
                );
            }
        };
        kept();
        let mut echoed = 0;
        for _ in 0..10 {
            echo(&mut s);
            echoed += 4;
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        kept();

        a[0] = Agent::start(n1, &f.file);
        f.tors[0].wait_established(&["n1"]);
        f.wait_converged(&[0, 1], &a);
        // Past the new BIRD's first kernel sync and the agent's next
        // passes: data still flows both ways on the same connection.
        for _ in 0..10 {
            echo(&mut s);
            echoed += 4;
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        assert_eq!(echoed, 80);
        stop.store(true, Ordering::Relaxed);
        sampler.join().unwrap()
    });
    let (missing, samples) = missing;
    assert!(samples > 10, "{samples} samples");
    assert!(
        missing.is_empty(),
        "routes changed: {missing:?}\n{}",
        a[0].log()
    );
    assert!(a[0].running(), "{}", a[0].log());
    assert_eq!(rcni_routes(&n1.ns.ns), r1);
}

struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// No router: the agents' iBGP full mesh on one L2 (the default), every
/// node's routes via the other node's address.
#[test]
fn the_full_mesh_on_one_l2_routes_via_the_nodes() {
    let f = Fabric::one_l2(3);
    f.write(&[0, 1, 2], json!({}));
    let a = agents(&f, &[0, 1, 2]);
    f.wait_converged(&[0, 1, 2], &a);
    assert_eq!(
        rcni_routes(&f.nodes[0].ns.ns),
        BTreeSet::from([
            "10.244.2.0/24 via 192.168.50.2 dev eth0".to_string(),
            "10.244.3.0/24 via 192.168.50.3 dev eth0".to_string()
        ])
    );
    assert_eq!(
        rcni_routes(&f.nodes[2].ns.ns),
        BTreeSet::from([
            "10.244.1.0/24 via 192.168.50.1 dev eth0".to_string(),
            "10.244.2.0/24 via 192.168.50.2 dev eth0".to_string()
        ])
    );
    // Two iBGP sessions per node, both up, as BIRD on the node says.
    let protos = rcni_integration::lab::fabric::parse_protocols(&birdc(
        &f.nodes[0].ns.ns,
        &node_bird_sock(&f.nodes[0]),
        "show protocols",
    ));
    let up: Vec<&String> = protos
        .iter()
        .filter(|(_, (_, info))| info.starts_with("Established"))
        .map(|(n, _)| n)
        .collect();
    assert_eq!(up.len(), 2, "{protos:?}");
    let (p1, a1) = f.nodes[0].pod("p1");
    let (p2, a2) = f.nodes[1].pod("p2");
    let (p3, a3) = f.nodes[2].pod("p3");
    for (from, to) in [(&p1, &a2), (&p1, &a3), (&p3, &a1), (&p2, &a3)] {
        assert!(ping(&from.ns, to), "ping {to}\n{}", state(&f, &a));
    }
    listen_ok(&p3.ns, 8080);
    assert!(talks_soon(&p1.ns, &a3, 8080));
    for n in &f.nodes {
        assert!(tunnels(&n.ns.ns).is_empty());
    }
}

/// vxlanMode CrossSubnet across racks: the peer in the same rack is
/// routed by BGP (its address, no tunnel), the one in the other rack
/// through the VXLAN device; BGP still announces everything.
#[test]
fn cross_subnet_tunnels_only_to_the_other_rack() {
    let f = Fabric::routed(&[0, 0, 1], Stack::V4);
    // Underlay config, not the pods' path: VXLAN packets to the other
    // rack's node addresses need a route to its subnet, which a node
    // behind a ToR has as its default route.
    f.add_default_routes();
    f.write(
        &[0, 1, 2],
        json!({"nodeToNodeMeshEnabled": false, "vxlanMode": "CrossSubnet"}),
    );
    let a = agents(&f, &[0, 1, 2]);
    f.wait_converged(&[0, 1, 2], &a);
    let n1 = &f.nodes[0];
    let routes = rcni_routes(&n1.ns.ns);
    let to_n2 = routes
        .iter()
        .find(|r| r.starts_with("10.244.2.0/24"))
        .unwrap();
    assert!(
        to_n2.ends_with(" dev eth0") && to_n2.contains(" via 192.168.50."),
        "{routes:?}"
    );
    assert!(
        routes.contains(&format!("10.244.3.0/24 via 10.244.3.0 dev {VTEP}")),
        "{routes:?}"
    );
    let (_, fdb, _) = n1.entries();
    assert_eq!(
        fdb.iter()
            .map(|e| e.split(' ').nth(1).unwrap())
            .collect::<Vec<_>>(),
        ["192.168.60.3"],
        "{fdb:?}"
    );
    let r3 = rcni_routes(&f.nodes[2].ns.ns);
    assert!(
        r3.iter().all(|r| r.ends_with(&format!("dev {VTEP}"))),
        "{r3:?}"
    );
    for t in &f.tors {
        assert_eq!(t.pod_prefixes(), f.pod_prefixes(&[0, 1, 2]));
    }
    let (p1, a1) = n1.pod("p1");
    let (p2, a2) = f.nodes[1].pod("p2");
    let (p3, a3) = f.nodes[2].pod("p3");
    for (from, to) in [(&p1, &a2), (&p2, &a1), (&p1, &a3), (&p3, &a1), (&p3, &a2)] {
        assert!(ping(&from.ns, to), "ping {to}\n{}", state(&f, &a));
    }
}

/// Dual-stack nodes with IPv6 BGP sessions to their ToR: the IPv6 pod
/// subnets cross the fabric over them, IPv6 pods talk across racks.
#[test]
fn ipv6_pod_subnets_cross_the_fabric_over_ipv6_sessions() {
    let f = Fabric::routed(&[0, 0, 1], Stack::Dual);
    f.write(&[0, 1, 2], mesh_off());
    let a = agents(&f, &[0, 1, 2]);
    f.wait_converged(&[0, 1, 2], &a);
    f.tors[0].wait_established(&["n1v6", "n2v6"]);
    assert_eq!(
        f.tors[0].prefixes_from("n1v6"),
        BTreeSet::from(["fd00:0:0:1::/64".to_string()])
    );
    assert_eq!(
        f.tors[1].prefixes_from("n3v6"),
        BTreeSet::from(["fd00:0:0:3::/64".to_string()])
    );
    let r1 = rcni_routes(&f.nodes[0].ns.ns);
    let to3 = r1
        .iter()
        .find(|r| r.starts_with("fd00:0:0:3::/64"))
        .unwrap();
    assert!(to3.ends_with(" dev eth0"), "{r1:?}");
    let (p1, a1, b1) = f.nodes[0].pod_dual("p1");
    let (p2, _, b2) = f.nodes[1].pod_dual("p2");
    let (p3, a3, b3) = f.nodes[2].pod_dual("p3");
    for (from, to) in [(&p1, &b3), (&p3, &b1), (&p2, &b3), (&p1, &b2)] {
        assert!(ping6(&from.ns, to), "ping {to}\n{}", state(&f, &a));
    }
    assert!(ping(&p1.ns, &a3) && ping(&p3.ns, &a1));
    let mut s = stream(&p1.ns, &p3.ns, &b3);
    echo(&mut s);
}

/// Peers that are wrong: one with another AS than configured, one that
/// never answers, and one announcing prefixes outside "network" (a
/// subnet and a default route). The agent keeps running and says why;
/// nothing of theirs reaches the kernel; the good peer's routes do.
#[test]
fn bad_peers_are_refused_and_good_routes_still_installed() {
    let f = Fabric::routed(&[0, 1], Stack::V4);
    let n1 = (f.address(0), node_as(0));
    let rogue = f.add_speaker(
        0,
        253,
        65099,
        &["172.16.0.0/24 blackhole", "0.0.0.0/0 blackhole"],
        std::slice::from_ref(&n1),
    );
    // Really AS 65098, configured on n1 as 65097; what it announces is
    // inside "network": only the AS check keeps it out.
    let liar = f.add_speaker(
        0,
        252,
        65098,
        &["10.244.99.0/24 blackhole"],
        std::slice::from_ref(&n1),
    );
    f.write_with(&[0, 1], mesh_off(), |i, n| {
        if i == 0 {
            let peers = n["peers"].as_array_mut().unwrap();
            peers.push(json!({"peerIP": "192.168.50.253", "asNumber": 65099}));
            peers.push(json!({"peerIP": "192.168.50.252", "asNumber": 65097}));
            // Nobody has this address.
            peers.push(json!({"peerIP": "192.168.50.250", "asNumber": 65096}));
        }
    });
    let mut a = agents(&f, &[0, 1]);
    f.wait_converged(&[0, 1], &a);
    rogue.wait_established(&["peer0"]);
    // The rogue's routes were offered; the agent's import filter says it
    // rejected them, BIRD that the liar's AS is not the configured one.
    let said = |w: &[&str]| {
        let log = a[0].log();
        w.iter().all(|w| log.contains(w))
    };
    assert!(
        poll(CONVERGE, || said(&[
            "rejected 172.16.0.0/24",
            "rejected 0.0.0.0/0",
            "Bad peer AS"
        ])),
        "{}\n--- liar:\n{}",
        a[0].log(),
        liar.log()
    );
    // The unreachable peer is not up, and never was.
    let all = birdc(
        &f.nodes[0].ns.ns,
        &node_bird_sock(&f.nodes[0]),
        "show protocols all",
    );
    let block = all
        .split("\n\n")
        .find(|b| b.contains("192.168.50.250"))
        .unwrap_or_else(|| panic!("no protocol for 192.168.50.250:\n{all}"));
    assert!(!block.contains("Established"), "{block}");
    let log = a[0].log();
    assert!(log.contains("peer 192.168.50.250 (AS 65096): "), "{log}");
    assert!(
        !log.contains("peer 192.168.50.250 (AS 65096): Established"),
        "{log}"
    );

    let routes = all_routes_text(&f.nodes[0].ns.ns);
    for bad in ["172.16.", "default", "10.244.99."] {
        assert!(
            !routes.lines().any(|l| l.starts_with(bad)),
            "{bad} in\n{routes}"
        );
    }
    assert_eq!(
        rcni_prefixes(&f.nodes[0].ns.ns),
        BTreeSet::from([pod_cidr(1)])
    );
    // n1 passes on nothing it learned: the ToRs have n1's subnet from it
    // and no bad prefix.
    assert_eq!(f.tors[0].prefixes_from("n1"), BTreeSet::from([pod_cidr(0)]));
    assert!(a[0].running(), "{}", a[0].log());
    let (p1, _) = f.nodes[0].pod("p1");
    let (_p2, a2) = f.nodes[1].pod("p2");
    assert!(ping(&p1.ns, &a2), "{}", state(&f, &a));
}

/// IPv6-only nodes (no IPv4 on them at all): IPv6 sessions to the ToRs
/// carry the IPv6 pod subnets, pods talk across racks, and nothing of
/// IPv4 is written.
#[test]
fn ipv6_only_nodes_route_pods_across_racks_by_bgp() {
    let f = Fabric::routed(&[0, 0, 1], Stack::V6);
    f.write(&[0, 1, 2], mesh_off());
    let a = agents(&f, &[0, 1, 2]);
    f.wait_converged(&[0, 1, 2], &a);
    assert_eq!(
        f.tors[1].prefixes_from("n3v6"),
        BTreeSet::from([pod_cidr6(2)])
    );
    let r1 = rcni_routes(&f.nodes[0].ns.ns);
    assert!(
        r1.contains("fd00:0:0:3::/64 via fd50::fe dev eth0"),
        "{r1:?}"
    );
    for n in &f.nodes {
        let v4: Vec<String> = table_routes(&n.ns.ns, 254)
            .into_iter()
            .filter(|r| r.contains('.'))
            .collect();
        assert!(v4.is_empty(), "{}: {v4:?}", n.name);
        assert!(tunnels(&n.ns.ns).is_empty(), "{:?}", tunnels(&n.ns.ns));
    }
    let (p1, b1) = pod6(&f, 0, "p1");
    let (p2, b2) = pod6(&f, 1, "p2");
    let (p3, b3) = pod6(&f, 2, "p3");
    for (from, to) in [(&p1, &b3), (&p3, &b1), (&p2, &b3), (&p1, &b2)] {
        assert!(ping6(&from.ns, to), "ping {to}\n{}", state(&f, &a));
    }
    let mut s = stream(&p1.ns, &p3.ns, &b3);
    echo(&mut s);
}

/// IPv6-only nodes with "vxlanMode": "CrossSubnet": the same rack by BGP,
/// the other rack through the IPv6 VXLAN device.
/// The nodes start on "Never" and are switched while running: the
/// BGP-learned route to the far rack becomes the tunnel's (IPv6 refuses
/// that replace in place: the agent removes the old route first).
#[test]
fn ipv6_only_cross_subnet_tunnels_only_to_the_other_rack() {
    let f = Fabric::routed(&[0, 0, 1], Stack::V6);
    // Underlay config, not the pods' path: VXLAN packets to the other
    // rack's node addresses need a route, the default route via the ToR.
    f.add_default_routes();
    f.write(&[0, 1, 2], mesh_off());
    let a = agents(&f, &[0, 1, 2]);
    f.wait_converged(&[0, 1, 2], &a);
    assert!(
        rcni_routes(&f.nodes[0].ns.ns).contains("fd00:0:0:3::/64 via fd50::fe dev eth0"),
        "{}",
        state(&f, &a)
    );
    f.write(
        &[0, 1, 2],
        json!({"nodeToNodeMeshEnabled": false, "vxlanMode": "CrossSubnet"}),
    );
    let tunnelled = format!("fd00:0:0:3::/64 via fd00:0:0:3:: dev {VTEP6}");
    assert!(
        poll(CONVERGE, || rcni_routes(&f.nodes[0].ns.ns)
            .contains(&tunnelled)),
        "{}",
        state(&f, &a)
    );
    let r1 = rcni_routes(&f.nodes[0].ns.ns);
    assert!(
        r1.contains("fd00:0:0:2::/64 via fd50::2 dev eth0"),
        "{r1:?}"
    );
    assert!(
        r1.contains(&format!("fd00:0:0:3::/64 via fd00:0:0:3:: dev {VTEP6}")),
        "{r1:?}"
    );
    let (p1, b1) = pod6(&f, 0, "p1");
    let (p2, b2) = pod6(&f, 1, "p2");
    let (p3, b3) = pod6(&f, 2, "p3");
    for (from, to) in [(&p1, &b3), (&p3, &b1), (&p1, &b2), (&p2, &b3)] {
        assert!(ping6(&from.ns, to), "ping {to}\n{}", state(&f, &a));
    }
}

/// A pod on an IPv6-only node: its namespace and address.
fn pod6(f: &Fabric, i: usize, cid: &str) -> (rcni_testkit::TestNs, String) {
    let (ns, r) = f.nodes[i].add_pod(cid);
    (ns, rcni_integration::addr_of(&r, false))
}
