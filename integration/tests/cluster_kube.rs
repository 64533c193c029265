//! A simulated cluster (rcni_integration::lab::cluster) whose agents read
//! the Kubernetes API instead of a cluster file: the real kube-apiserver
//! where scripts/k8s-build's cache holds it, the stand-in for the faults.

use rcni_integration::ip;
use rcni_integration::ip_link_json as link_json;
use rcni_integration::lab::cluster::{Cluster, SETTLE, VTEP};
use rcni_integration::lab::kube::{KubeApi, agent_log, knode};
use rcni_testkit::{bin, command_in, ping, poll, wait_for};

#[test]
fn every_agent_reads_the_kubernetes_api_instead_of_the_file() {
    use k8s_openapi::api::core::v1::Node as KNode;
    let c = Cluster::new(&[0, 0, 0]);
    // The stand-in: it stops answering at once and comes back with its
    // history compacted, and it keeps the patches it received.
    let k = KubeApi::fake(&c, r#"{"network": "10.244.0.0/16", "backend": "vxlan"}"#);
    let api = k.api.fake();
    for i in 0..3 {
        api.put(&knode(
            &c.nodes[i].name,
            &c.address(i),
            &format!("10.244.{}.0/24", i + 1),
        ));
    }
    // The node's name the DaemonSet way.
    let _agents = k.spawn_agents(&c, |cmd, n| {
        cmd.env("NODE_NAME", &n.name);
    });
    let log_of = |i: usize| agent_log(&c.nodes[i]);
    for (i, n) in c.nodes.iter().enumerate() {
        wait_for(SETTLE, &format!("{}'s two peers", n.name), || {
            n.entries().2.len() == 2 && n.conf_dir().join("10-rcni.conflist").exists()
        });
        let _ = i;
    }
    let (n1, n2, n3) = (&c.nodes[0], &c.nodes[1], &c.nodes[2]);
    let (neigh, fdb, routes) = n1.entries();
    assert_eq!((neigh.len(), fdb.len()), (2, 2), "{neigh:?} {fdb:?}");
    assert!(
        routes.contains("10.244.3.0/24 via 10.244.3.0 onlink"),
        "{routes:?}"
    );
    assert_eq!(
        n1.plugin_conf()["ipam"]["ranges"][0][0]["subnet"],
        "10.244.1.0/24"
    );

    // Each node published its VTEP's MAC and its address on its Node; the
    // MAC is the device's, and what its peers programmed for it.
    for (i, n) in c.nodes.iter().enumerate() {
        wait_for(SETTLE, &format!("{}'s annotations", n.name), || {
            api.get::<KNode>(None, &n.name)
                .and_then(|k| k.metadata.annotations)
                .is_some_and(|a| a.contains_key("rcni.io/vtep-mac"))
        });
        let a = api
            .get::<KNode>(None, &n.name)
            .unwrap()
            .metadata
            .annotations
            .unwrap();
        let mac = link_json(&n.ns.ns, VTEP)["address"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(a["rcni.io/vtep-mac"], mac, "{}", n.name);
        assert_eq!(a["rcni.io/public-ip"], c.address(i));
        assert_eq!(a["rcni.io/backend"], "vxlan");
        let other = &c.nodes[(i + 1) % 3];
        assert!(
            other
                .entries()
                .1
                .contains(&format!("{mac} {}", c.address(i))),
            "{:?}",
            other.entries()
        );
    }
    assert!(
        api.patches()
            .iter()
            .all(|p| p.content_type == "application/merge-patch+json")
    );

    let (p1, a1) = n1.pod("p1");
    let (p2, a2) = n2.pod("p2");
    let (p3, a3) = n3.pod("p3");
    for (from, to) in [(&p1, &a2), (&p1, &a3), (&p2, &a3), (&p3, &a1), (&p2, &a1)] {
        assert!(ping(&from.ns, to), "ping {to}");
    }

    // The API server goes away: every agent notices, and nothing is
    // removed: traffic keeps flowing on what was programmed.
    let before: Vec<_> = c.nodes.iter().map(|n| n.entries()).collect();
    api.set_down(true);
    api.delete::<KNode>(None, "n2");
    for i in 0..3 {
        let l = log_of(i);
        let seen = l.matches("Kubernetes API:").count();
        wait_for(SETTLE, &format!("n{} sees the API gone", i + 1), || {
            log_of(i).matches("Kubernetes API:").count() > seen
        });
    }
    let after: Vec<_> = c.nodes.iter().map(|n| n.entries()).collect();
    assert_eq!(before, after);
    assert!(ping(&p1.ns, &a2) && ping(&p3.ns, &a1));

    // Back, with its history gone: every agent lists again and learns that
    // n2 was deleted meanwhile; exactly n2's entries go.
    api.compact();
    api.set_down(false);
    for n in [n1, n3] {
        wait_for(
            SETTLE,
            &format!("n2's entries gone from {}", n.name),
            || {
                let (neigh, fdb, routes) = n.entries();
                (neigh.len(), fdb.len(), routes.len()) == (1, 1, 1)
            },
        );
        let (neigh, fdb, routes) = n.entries();
        assert_eq!((neigh.len(), fdb.len()), (1, 1), "{}", n.name);
        assert!(
            !routes.iter().any(|r| r.starts_with("10.244.2.")),
            "{routes:?}"
        );
    }
    assert!(ping(&p1.ns, &a3) && ping(&p3.ns, &a1));

    // n2 comes back at another address (its Node re-registered): the
    // others follow without a stale FDB entry, and pods reach it again.
    // The old address stays on the link: n2's agent's watch connection
    // comes from it (a watch whose source address vanished is only noticed
    // at the watch's idle timeout, minutes later).
    ip(&n2.ns.ns, "addr add 192.168.50.22/24 dev eth0");
    api.put(&knode("n2", "192.168.50.22", "10.244.2.0/24"));
    for n in [n1, n3] {
        wait_for(SETTLE, &format!("n2 back on {}", n.name), || {
            let (neigh, fdb, routes) = n.entries();
            (neigh.len(), fdb.len(), routes.len()) == (2, 2, 2)
                && fdb.iter().any(|f| f.ends_with(" 192.168.50.22"))
        });
        assert!(!n.entries().1.iter().any(|f| f.ends_with(" 192.168.50.2")));
    }
    let republished = || {
        api.get::<KNode>(None, "n2")
            .and_then(|k| k.metadata.annotations)
            .is_some_and(|a| {
                a.get("rcni.io/public-ip").map(String::as_str) == Some("192.168.50.22")
            })
    };
    assert!(
        poll(SETTLE, republished),
        "n2 never republished: {}",
        log_of(1)
    );
    // n2's own agent re-makes its VTEP on the new local address and
    // programs its peers again.
    wait_for(SETTLE, "n2's VTEP on its new address", || {
        let l = link_json(&n2.ns.ns, VTEP);
        let (neigh, fdb, routes) = n2.entries();
        l["linkinfo"]["info_data"]["local"] == "192.168.50.22"
            && (neigh.len(), fdb.len(), routes.len()) == (2, 2, 2)
    });
    assert!(ping(&p1.ns, &a2), "after n2 came back: {}", log_of(1));
    assert!(ping(&p2.ns, &a3), "after n2 came back: {}", log_of(1));
}

#[test]
fn kubernetes_once_and_a_node_without_a_pod_subnet() {
    use k8s_openapi::api::core::v1::Node as KNode;
    let c = Cluster::new(&[0, 0]);
    let k = KubeApi::new(&c, r#"{"network": "10.244.0.0/16"}"#);
    let (api, kubeconfig, net_conf) = (&k.api, &k.kubeconfig, &k.net_conf);
    let n1 = &c.nodes[0];
    let once = || {
        let out = command_in(&n1.ns.ns, bin("rcni-node"))
            .args(["run", "--kubernetes", "--once", "--node", "n1"])
            .arg("--net-conf")
            .arg(net_conf)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--cni-conf-dir")
            .arg(n1.conf_dir())
            .arg("--state-dir")
            .arg(n1.dir.path().join("state"))
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // No Node yet, then one without a pod subnet: exit 4, with advice;
    // nothing programmed.
    let (code, err) = once();
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("no Node \"n1\""), "{err}");
    let mut k = knode("n1", &c.address(0), "10.244.1.0/24");
    k.spec = None;
    api.put(&k);
    let (code, err) = once();
    assert_eq!(code, 4, "{err}");
    assert!(
        err.contains("no spec.podCIDRs") && err.contains("--allocate-node-cidrs=true"),
        "{err}"
    );
    assert!(!n1.conf_dir().join("10-rcni.conflist").exists());
    // Assigned: one reconcile, the conflist on its subnet, and the Node
    // annotated.
    api.put(&knode("n1", &c.address(0), "10.244.1.0/24"));
    api.put(&knode("n2", &c.address(1), "10.244.2.0/24"));
    let (code, err) = once();
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        n1.plugin_conf()["ipam"]["ranges"][0][0]["subnet"],
        "10.244.1.0/24"
    );
    assert_eq!(n1.entries().2.len(), 1);
    let a = api
        .get::<KNode>(None, "n1")
        .unwrap()
        .metadata
        .annotations
        .unwrap();
    assert_eq!(a["rcni.io/public-ip"], c.address(0));
    // A net-conf with "nodes" is refused (exit 2), naming the mistake.
    std::fs::write(net_conf, r#"{"network": "10.244.0.0/16", "nodes": []}"#).unwrap();
    let (code, err) = once();
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("\"nodes\" does not belong"), "{err}");
}

const TO_REMOTE: &str = "redirected to another node";
const FROM_REMOTE: &str = "redirected from another node";

/// `"backend": "bgp"` from the net-conf, with a per-node AS from a Node
/// annotation: the agents run BIRD in a full mesh (n3 over eBGP, AS 65003),
/// mirror what it learns into the main table, publish their BGP address,
/// and feed the eBPF datapath's other-node map from the learned routes.
#[test]
fn bgp_from_the_net_conf_and_node_annotations_with_ebpf() {
    use k8s_openapi::api::core::v1::Node as KNode;
    let c = Cluster::new(&[0, 0, 0]);
    let k = KubeApi::new(
        &c,
        r#"{"network": "10.244.0.0/16", "backend": "bgp", "ebpf": true,
            "bgp": {"asNumber": 64512}}"#,
    );
    let api = &k.api;
    for i in 0..3 {
        let mut n = knode(
            &c.nodes[i].name,
            &c.address(i),
            &format!("10.244.{}.0/24", i + 1),
        );
        if i == 2 {
            n.metadata.annotations = Some(
                [("rcni.io/bgp-as-number".to_string(), "65003".to_string())]
                    .into_iter()
                    .collect(),
            );
        }
        api.put(&n);
    }
    let _agents = k.spawn_agents(&c, |cmd, n| {
        cmd.args(["--node", &n.name])
            .arg("--bpf-pin-root")
            .arg(n.bpffs.path());
    });
    let log_of = |i: usize| agent_log(&c.nodes[i]);
    let birdc = |i: usize, what: &str| {
        let out = command_in(&c.nodes[i].ns.ns, "birdc")
            .arg("-s")
            .arg(c.nodes[i].dir.path().join("state/bird/bird.ctl"))
            .args(what.split(' '))
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    for (i, n) in c.nodes.iter().enumerate() {
        let want: std::collections::BTreeSet<String> = (0..3)
            .filter(|&j| j != i)
            .map(|j| format!("10.244.{}.0/24 via {}", j + 1, c.address(j)))
            .collect();
        assert!(
            poll(SETTLE, || n.entries().2 == want),
            "{}: routes {:?}, want {want:?}; log:\n{}\n{}\n{}",
            n.name,
            n.entries().2,
            log_of(i),
            birdc(i, "show protocols all"),
            birdc(i, "show route all")
        );
        // No tunnel: BGP routes only.
        assert!(
            rcni_integration::link_names(&n.ns.ns)
                .iter()
                .all(|l| l != VTEP),
            "{}",
            n.name
        );
    }
    // n3's sessions are eBGP: its AS came from its annotation.
    let conf = std::fs::read_to_string(c.nodes[0].dir.path().join("state/bird/bird.conf")).unwrap();
    assert!(
        conf.contains(&format!("neighbor {} as 65003;", c.address(2))),
        "{conf}"
    );
    for (i, n) in c.nodes.iter().enumerate() {
        wait_for(SETTLE, &format!("{}'s bgp-address", n.name), || {
            api.get::<KNode>(None, &n.name)
                .and_then(|k| k.metadata.annotations)
                .is_some_and(|a| a.get("rcni.io/bgp-address") == Some(&c.address(i)))
        });
    }
    // The datapath's other-node map from the learned routes.
    let map = c.nodes[0].remote_map();
    assert!(
        map.iter()
            .any(|r| r.starts_with(&format!("10.244.2.0/24 via {} dev eth0", c.address(1)))),
        "{map:?}"
    );
    let (p1, a1) = c.nodes[0].pod("p1");
    let (p3, a3) = c.nodes[2].pod("p3");
    assert!(
        ping(&p1.ns, &a3),
        "ping {a3}\n{}\n{}\n{}",
        log_of(0),
        birdc(0, "show protocols all node_n3"),
        birdc(0, "show route all")
    );
    assert!(ping(&p3.ns, &a1), "ping {a1}");
    // Forwarded by the datapath, not the bridge.
    assert!(c.nodes[0].verdict(TO_REMOTE) > 0, "{map:?}");
    assert!(c.nodes[2].verdict(FROM_REMOTE) > 0);
}
