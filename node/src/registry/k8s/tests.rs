//! The Kubernetes node source with the real `kube` client against
//! `rcni_fakeapi` (list, chunked watch, bookmarks, 410 Gone, merge patch),
//! on 127.0.0.1 inside a network namespace of the test's own.

use std::collections::BTreeMap;
use std::future::Future;

use k8s_openapi::api::core::v1::{Namespace, Node as KNode, NodeAddress, NodeSpec, NodeStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use rcni_fakeapi::FakeApi;
use rcni_testkit::TestNs;

use super::*;
use crate::registry::cluster::{Backend, parse_net_conf};

fn knode(name: &str, ip: &str, cidr: Option<&str>, ann: &[(&str, &str)]) -> KNode {
    KNode {
        metadata: ObjectMeta {
            name: Some(name.into()),
            annotations: (!ann.is_empty()).then(|| {
                ann.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>()
            }),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            pod_cidr: cidr.map(str::to_string),
            pod_cidrs: cidr.map(|c| vec![c.to_string()]),
            ..Default::default()
        }),
        status: Some(NodeStatus {
            addresses: Some(vec![
                NodeAddress {
                    type_: "Hostname".into(),
                    address: name.into(),
                },
                NodeAddress {
                    type_: "InternalIP".into(),
                    address: ip.into(),
                },
            ]),
            ..Default::default()
        }),
    }
}

fn net() -> NetConf {
    parse_net_conf(r#"{"network": "10.244.0.0/16", "backend": "vxlan"}"#).unwrap()
}

/// Runs `f` with a fake API server on 127.0.0.1 in a fresh network
/// namespace, on a tokio runtime whose sockets are made in it too.
pub(crate) fn with_api<F, Fut>(f: F)
where
    F: FnOnce(FakeApi, std::path::PathBuf) -> Fut + Send,
    Fut: Future<Output = ()>,
{
    let ns = TestNs::new();
    rcni_testkit::ip(&ns.ns, "link set lo up");
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    ns.ns
        .run(move || {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let api = FakeApi::start(listener);
            std::fs::write(&kubeconfig, api.kubeconfig()).unwrap();
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(f(api, kubeconfig));
        })
        .unwrap();
}

async fn registry(kubeconfig: &std::path::Path, me: &str) -> KubeRegistry {
    let client = client(Some(kubeconfig)).await.unwrap();
    let r = KubeRegistry::start(client, net(), me.into(), None);
    r.synced().await;
    r
}

/// Polls until `f` holds (bounded: it panics with `what` after ~10 s).
pub(crate) async fn until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..500 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{what} never happened");
}

/// Loads until the cluster satisfies `f`.
async fn settle(r: &mut KubeRegistry, what: &str, f: impl Fn(&Cluster) -> bool) -> Cluster {
    for _ in 0..500 {
        if let Ok(c) = r.load()
            && f(&c)
        {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{what}: never reached; last {:?}", r.load());
}

fn names(c: &Cluster) -> Vec<&str> {
    c.nodes.iter().map(|n| n.name.as_str()).collect()
}

fn addr(c: &Cluster, n: &str) -> String {
    c.node(n).unwrap().address.unwrap().to_string()
}

#[test]
fn nodes_added_modified_deleted_and_own_annotations_published() {
    with_api(async |api, kc| {
        api.put(&knode("n1", "192.168.50.1", Some("10.244.1.0/24"), &[]));
        api.put(&knode("n2", "192.168.50.2", Some("10.244.2.0/24"), &[]));
        // Not yet assigned a subnet: skipped, not fatal.
        api.put(&knode("n4", "192.168.50.4", None, &[]));
        let mut r = registry(&kc, "n1").await;
        let c = r.load().unwrap();
        assert_eq!(names(&c), ["n1", "n2"]);
        assert_eq!(c.backend, Backend::Vxlan);
        assert_eq!(
            c.node("n2").unwrap().pod_cidr.unwrap().to_string(),
            "10.244.2.0/24"
        );
        assert_eq!(addr(&c, "n2"), "192.168.50.2");
        assert_eq!(c.node("n2").unwrap().vtep_mac, None);

        // Its own Node gets what peers need, by one merge patch.
        until("n1's annotations", || {
            api.get::<KNode>(None, "n1")
                .and_then(|n| n.metadata.annotations)
                .is_some_and(|a| a.contains_key(ANN_VTEP_MAC))
        })
        .await;
        let p = api.patches();
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(p[0].path, "/api/v1/nodes/n1");
        assert_eq!(p[0].content_type, "application/merge-patch+json");
        let a = &p[0].body["metadata"]["annotations"];
        assert_eq!(a[ANN_VTEP_MAC], desired::vtep_mac("n1", 1).to_string());
        assert_eq!(a[ANN_PUBLIC_IP], "192.168.50.1");
        assert_eq!(a[ANN_BACKEND], "vxlan");
        assert!(a.get(ANN_WIREGUARD_KEY).is_none());
        // Bookmarks were asked for.
        let reqs = api.requests();
        assert!(
            reqs.iter()
                .any(|q| q.contains("watch=true") && q.contains("allowWatchBookmarks=true")),
            "{reqs:?}"
        );

        // A peer's published address and MAC are what is programmed.
        let mac = "02:11:22:33:44:55";
        api.put(&knode(
            "n2",
            "192.168.50.2",
            Some("10.244.2.0/24"),
            &[(ANN_PUBLIC_IP, "192.168.50.22"), (ANN_VTEP_MAC, mac)],
        ));
        let c = settle(&mut r, "n2 modified", |c| addr(c, "n2") == "192.168.50.22").await;
        assert_eq!(c.node("n2").unwrap().vtep_mac.unwrap().to_string(), mac);

        // A flannel node: its public-ip and backend-data's VNIMAC.
        api.put(&knode(
            "f3",
            "192.168.50.3",
            Some("10.244.3.0/24"),
            &[
                (FLANNEL_PUBLIC_IP, "192.168.50.33"),
                (FLANNEL_BACKEND_DATA, r#"{"VNIMAC":"0a:bb:cc:dd:ee:ff"}"#),
                ("flannel.alpha.coreos.com/backend-type", "vxlan"),
            ],
        ));
        let c = settle(&mut r, "f3 added", |c| c.node("f3").is_some()).await;
        let f3 = c.node("f3").unwrap();
        assert_eq!(f3.address.unwrap().to_string(), "192.168.50.33");
        assert_eq!(f3.vtep_mac.unwrap().to_string(), "0a:bb:cc:dd:ee:ff");

        // n4 gets its subnet: it joins.
        api.put(&knode("n4", "192.168.50.4", Some("10.244.4.0/24"), &[]));
        settle(&mut r, "n4 assigned", |c| c.node("n4").is_some()).await;

        // Deleted: gone from the cluster.
        api.delete::<KNode>(None, "n2");
        let c = settle(&mut r, "n2 deleted", |c| c.node("n2").is_none()).await;
        assert_eq!(names(&c), ["n1", "f3", "n4"]);

        // A status heartbeat (nothing the agent uses) is no change.
        let g0 = lock(&r.shared).generation;
        let mut n4 = api.get::<KNode>(None, "n4").unwrap();
        n4.status.as_mut().unwrap().phase = Some("Running".into());
        api.put(&n4);
        api.put(&knode("n5", "192.168.50.5", Some("10.244.5.0/24"), &[]));
        settle(&mut r, "n5", |c| c.node("n5").is_some()).await;
        assert_eq!(lock(&r.shared).generation, g0 + 1);
        // Still one patch: the MODIFIED event of our own patch asked for
        // none.
        assert_eq!(api.patches().len(), 1);
    });
}

#[test]
fn dropped_watches_bookmarks_410_and_a_down_server() {
    with_api(async |api, kc| {
        api.put(&knode("n1", "192.168.50.1", Some("10.244.1.0/24"), &[]));
        api.put(&knode("n2", "192.168.50.2", Some("10.244.2.0/24"), &[]));
        let mut r = registry(&kc, "n1").await;
        assert_eq!(names(&r.load().unwrap()), ["n1", "n2"]);
        let lists = || api.lists_of("/api/v1/nodes");
        assert_eq!(lists(), 1);

        // A watch cut mid-stream resumes from its resourceVersion: no list.
        api.drop_watches();
        api.put(&knode("n3", "192.168.50.3", Some("10.244.3.0/24"), &[]));
        settle(&mut r, "n3 after a cut", |c| c.node("n3").is_some()).await;
        assert_eq!(lists(), 1);

        // A bookmark carries the resourceVersion past changes the watch
        // does not see (another kind's): after a compaction, a resumed
        // watch from it is not too old, so no list either.
        api.put(&Namespace {
            metadata: ObjectMeta {
                name: Some("other".into()),
                ..Default::default()
            },
            ..Default::default()
        });
        let sent = api.bookmarks_sent();
        api.bookmark();
        until("a bookmark sent", || api.bookmarks_sent() > sent).await;
        let rv = api.resource_version();
        api.compact();
        api.drop_watches();
        api.put(&knode("n5", "192.168.50.5", Some("10.244.5.0/24"), &[]));
        settle(&mut r, "n5 after a bookmark", |c| c.node("n5").is_some()).await;
        assert_eq!(lists(), 1);
        let want = format!("resourceVersion={rv}");
        assert!(
            api.requests()
                .iter()
                .any(|q| q.contains("watch=true") && q.contains(&want)),
            "{:?}",
            api.requests()
        );

        // 410 Gone as an ERROR event: listed again, and what was missed is
        // there.
        api.expire_watches();
        until("a relist after 410", || lists() == 2).await;
        api.put(&knode("n6", "192.168.50.6", Some("10.244.6.0/24"), &[]));
        settle(&mut r, "n6", |c| c.node("n6").is_some()).await;

        // The server goes away: nothing is removed, however long.
        let before = r.load().unwrap();
        api.set_down(true);
        // Changes the agent cannot see while down: n3 deleted, n2 moved.
        api.delete::<KNode>(None, "n3");
        api.put(&knode("n2", "192.168.50.20", Some("10.244.2.0/24"), &[]));
        let n = api.requests().len();
        // Several failed attempts at least (each one is a request the
        // server dropped before logging it: count connection attempts
        // by waiting for backoff rounds instead).
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(api.requests().len(), n, "down serves nothing");
        assert!(!r.maybe_changed());
        assert_eq!(r.load().unwrap(), before);

        // Back, with the history gone (the answer to the resumed watch is
        // an HTTP 410 this time): a fresh list, n3 removed, n2 moved.
        api.compact();
        api.set_http_gone(true);
        api.set_down(false);
        let c = settle(&mut r, "relisted after the outage", |c| {
            c.node("n3").is_none() && addr(c, "n2") == "192.168.50.20"
        })
        .await;
        assert_eq!(names(&c), ["n1", "n2", "n5", "n6"]);
        assert!(lists() >= 3);
    });
}

#[test]
fn this_nodes_lease_and_address() {
    with_api(async |api, kc| {
        api.put(&knode("n2", "192.168.50.2", Some("10.244.2.0/24"), &[]));
        // Not there at all.
        let mut r = registry(&kc, "n1").await;
        match r.load() {
            Err(ClusterError::ThisNode(m)) => assert!(m.contains("no Node \"n1\""), "{m}"),
            other => panic!("{other:?}"),
        }
        // There without a podCIDR: advice.
        api.put(&knode("n1", "192.168.50.1", None, &[]));
        until("n1 seen", || r.maybe_changed()).await;
        match r.load() {
            Err(ClusterError::ThisNode(m)) => assert!(
                m.contains("no spec.podCIDRs") && m.contains("--allocate-node-cidrs"),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
        // Outside the net-conf's network.
        api.put(&knode("n1", "192.168.50.1", Some("10.99.1.0/24"), &[]));
        until("n1 changed", || r.maybe_changed()).await;
        match r.load() {
            Err(ClusterError::ThisNode(m)) => assert!(
                m.contains("outside \"network\" 10.244.0.0/16") && m.contains("--cluster-cidr"),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
        // The overwrite annotation is the address, and what is published.
        api.put(&knode(
            "n1",
            "192.168.50.1",
            Some("10.244.1.0/24"),
            &[(ANN_PUBLIC_IP_OVERWRITE, "192.168.60.1")],
        ));
        let c = settle(&mut r, "n1 usable", |c| c.node("n1").is_some()).await;
        assert_eq!(addr(&c, "n1"), "192.168.60.1");
        until("public-ip published", || {
            api.get::<KNode>(None, "n1")
                .and_then(|n| n.metadata.annotations)
                .is_some_and(|a| a.get(ANN_PUBLIC_IP).map(String::as_str) == Some("192.168.60.1"))
        })
        .await;
    });
}

#[test]
fn net_conf_is_the_cluster_file_without_nodes() {
    let n = parse_net_conf(
        r#"{"network": "10.244.0.0/16", "backend": "host-gw", "vni": 4, "port": 4789}"#,
    )
    .unwrap();
    assert_eq!((n.backend, n.vni, n.port), (Backend::HostGw, 4, 4789));
    let e = parse_net_conf(r#"{"network": "10.244.0.0/16", "nodes": []}"#).unwrap_err();
    assert!(e.to_string().contains("Node objects"), "{e}");
    let e = parse_net_conf(r#"{"network": "10.244.0.0/16", "backnd": "vxlan"}"#).unwrap_err();
    assert!(e.to_string().contains("unknown key \"backnd\""), "{e}");
    // host-gw publishes no VTEP MAC, and removes one published before.
    let s = seen(&knode(
        "n1",
        "192.168.50.1",
        Some("10.244.1.0/24"),
        &[(ANN_VTEP_MAC, "02:00:00:00:00:01")],
    ));
    let p = patch_for(&n, "n1", &s, None).unwrap();
    assert_eq!(p["metadata"]["annotations"][ANN_VTEP_MAC], Value::Null);
    assert_eq!(p["metadata"]["annotations"][ANN_BACKEND], "host-gw");
}

#[test]
fn wireguard_keys_published_and_read_from_annotations() {
    let n = net();
    let key = "HIgo9xNzJMWLKASShiTqIybxZ0U3wGLiUeJ1PKf8ykw=";
    let s = seen(&knode("n1", "192.168.50.1", Some("10.244.1.0/24"), &[]));
    let p = patch_for(&n, "n1", &s, Some(key)).unwrap();
    assert_eq!(p["metadata"]["annotations"][ANN_WIREGUARD_KEY], key);
    // Published once, nothing more to patch for it; removed when the
    // cluster stops encrypting.
    let s = seen(&knode(
        "n1",
        "192.168.50.1",
        Some("10.244.1.0/24"),
        &[(ANN_WIREGUARD_KEY, key)],
    ));
    let again = patch_for(&n, "n1", &s, Some(key));
    assert!(
        again.as_ref().is_none_or(|p| p["metadata"]["annotations"]
            .get(ANN_WIREGUARD_KEY)
            .is_none()),
        "{again:?}"
    );
    let p = patch_for(&n, "n1", &s, None).unwrap();
    assert_eq!(p["metadata"]["annotations"][ANN_WIREGUARD_KEY], Value::Null);
    // A peer's key comes from its annotation, checked as the cluster file's.
    let peer = node_of(&n, "n1", &s, false).unwrap();
    assert_eq!(peer.wireguard_key, Some(crate::wgkey::decode(key).unwrap()));
    let bad = seen(&knode(
        "n2",
        "192.168.50.2",
        Some("10.244.2.0/24"),
        &[(ANN_WIREGUARD_KEY, "not base64")],
    ));
    let e = node_of(&n, "n2", &bad, false).unwrap_err();
    assert!(e.contains("wireguardPublicKey"), "{e}");
}

#[test]
fn bgp_overrides_come_from_annotations_and_the_bgp_address_is_published() {
    let n = parse_net_conf(r#"{"network": "10.244.0.0/16", "backend": "bgp"}"#).unwrap();
    let s = seen(&knode(
        "n1",
        "192.168.50.1",
        Some("10.244.1.0/24"),
        &[
            (ANN_BGP_AS_NUMBER, "65101"),
            (
                ANN_BGP_PEERS,
                r#"[{"peerIP": "192.168.50.254", "asNumber": 65001}]"#,
            ),
        ],
    ));
    let me = node_of(&n, "n1", &s, true).unwrap();
    assert_eq!(me.bgp_as, Some(65101));
    assert_eq!(me.bgp_peers.len(), 1);
    assert_eq!(me.bgp_peers[0].ip.to_string(), "192.168.50.254");
    let p = patch_for(&n, "n1", &s, None).unwrap();
    assert_eq!(
        p["metadata"]["annotations"][ANN_BGP_ADDRESS],
        "192.168.50.1"
    );
    assert_eq!(p["metadata"]["annotations"][ANN_BACKEND], "bgp");
    for bad in [
        (ANN_BGP_PEERS, "not json"),
        (ANN_BGP_PEERS, r#"[{"peerIP": "x", "asNumber": 1}]"#),
        (ANN_BGP_AS_NUMBER, "AS65101"),
    ] {
        let s = seen(&knode("n2", "192.168.50.2", Some("10.244.2.0/24"), &[bad]));
        let e = node_of(&n, "n2", &s, false).unwrap_err();
        assert!(
            e.contains(bad.0) || e.contains("peerIP") || e.contains("asNumber"),
            "{e}"
        );
    }
}

#[test]
fn an_ipv6_only_net_conf_takes_nodes_by_their_ipv6_address_and_publishes_ipv6() {
    let n = parse_net_conf(r#"{"network": "fd00::/48", "backend": "vxlan"}"#).unwrap();
    // A dual-stack Node: its IPv6 address and subnet are this cluster's.
    let mut k = knode("n1", "192.168.50.1", Some("10.244.1.0/24"), &[]);
    k.spec.as_mut().unwrap().pod_cidrs =
        Some(vec!["10.244.1.0/24".into(), "fd00:0:0:1::/64".into()]);
    k.status
        .as_mut()
        .unwrap()
        .addresses
        .as_mut()
        .unwrap()
        .push(NodeAddress {
            type_: "InternalIP".into(),
            address: "fd50::1".into(),
        });
    let s = seen(&k);
    let me = node_of(&n, "n1", &s, true).unwrap();
    assert_eq!((me.address, me.pod_cidr), (None, None));
    assert_eq!(me.address6.unwrap().to_string(), "fd50::1");
    assert_eq!(me.pod_cidr6.unwrap().to_string(), "fd00:0:0:1::/64");
    // It publishes its IPv6 address and IPv6 VTEP MAC only.
    let p = patch_for(&n, "n1", &s, None).unwrap();
    let a = &p["metadata"]["annotations"];
    assert_eq!(a[ANN_PUBLIC_IP6], "fd50::1", "{p}");
    assert_eq!(
        a[ANN_VTEP_MAC6],
        desired::vtep_mac6("n1", 1).to_string(),
        "{p}"
    );
    assert!(
        a.get(ANN_PUBLIC_IP).is_none() && a.get(ANN_VTEP_MAC).is_none(),
        "{p}"
    );
    // An IPv6-only peer, by its InternalIP.
    let s = seen(&knode("n2", "fd50::2", Some("fd00:0:0:2::/64"), &[]));
    let peer = node_of(&n, "n2", &s, false).unwrap();
    assert_eq!(peer.address6.unwrap().to_string(), "fd50::2");
    assert_eq!(peer.address, None);
    // A flannel IPv6-only peer: its public-ipv6 and backend-v6-data.
    let s = seen(&knode(
        "f3",
        "fd50::3",
        Some("fd00:0:0:3::/64"),
        &[
            (FLANNEL_PUBLIC_IP6, "fd50::33"),
            (FLANNEL_BACKEND_DATA6, r#"{"VNIMAC":"0a:bb:cc:dd:ee:ff"}"#),
        ],
    ));
    let f3 = node_of(&n, "f3", &s, false).unwrap();
    assert_eq!(f3.address6.unwrap().to_string(), "fd50::33");
    assert_eq!(f3.vtep_mac6.unwrap().to_string(), "0a:bb:cc:dd:ee:ff");
    // This node's address overwritten (flannel's IPv6 annotation).
    let s = seen(&knode(
        "n1",
        "fd50::1",
        Some("fd00:0:0:1::/64"),
        &[(FLANNEL_PUBLIC_IP6_OVERWRITE, "fd60::1")],
    ));
    let me = node_of(&n, "n1", &s, true).unwrap();
    assert_eq!(me.address6.unwrap().to_string(), "fd60::1");
    // No IPv6 address, or only an IPv4 subnet: said so.
    let s = seen(&knode("n4", "192.168.50.4", Some("fd00:0:0:4::/64"), &[]));
    let e = node_of(&n, "n4", &s, true).unwrap_err();
    assert!(e.contains("no IPv6 InternalIP"), "{e}");
    let s = seen(&knode("n5", "fd50::5", Some("10.244.5.0/24"), &[]));
    let e = node_of(&n, "n5", &s, false).unwrap_err();
    assert!(e.contains("no IPv6 spec.podCIDRs (10.244.5.0/24)"), "{e}");
    let s = seen(&knode("n6", "fd50::6", None, &[]));
    let e = node_of(&n, "n6", &s, true).unwrap_err();
    assert!(e.contains("--cluster-cidr=fd00::/48"), "{e}");
    // BGP: the one address it peers from.
    let nb = parse_net_conf(r#"{"network": "fd00::/48", "backend": "bgp"}"#).unwrap();
    let s = seen(&knode("n1", "fd50::1", Some("fd00:0:0:1::/64"), &[]));
    let p = patch_for(&nb, "n1", &s, None).unwrap();
    assert_eq!(p["metadata"]["annotations"][ANN_BGP_ADDRESS], "fd50::1");
}

#[test]
fn a_conflicting_peer_is_skipped_not_the_cluster() {
    with_api(async |api, kc| {
        api.put(&knode("n1", "192.168.50.1", Some("10.244.1.0/24"), &[]));
        api.put(&knode("n2", "192.168.50.2", Some("10.244.2.0/24"), &[]));
        // A replacement VM reusing n2's address, and a subnet inside n1's.
        api.put(&knode("n3", "192.168.50.2", Some("10.244.3.0/24"), &[]));
        api.put(&knode("n4", "192.168.50.4", Some("10.244.1.0/25"), &[]));
        let mut r = registry(&kc, "n1").await;
        let c = r.load().unwrap();
        assert_eq!(names(&c), ["n1", "n2"]);
        assert!(
            r.skipped
                .iter()
                .any(|m| m.contains("\"n3\" has the same address")),
            "{:?}",
            r.skipped
        );
    });
}
