//! Side by side with the reference: /usr/lib/cni/bridge (v1.1.1) with
//! ipMasq makes the iptables rules; ours must write the same text, accept
//! theirs in CHECK, and remove them in teardown; the reference's DEL must
//! remove ours. A drop-in switch in both directions.

mod common;

use common::{nat_lines, sh};
use ipnetwork::IpNetwork;
use rcni_netfilter::{Backend, Masq, check, setup, teardown};
use rcni_testkit::{Call, REFERENCE_DIR, TestNs, reference_bin};
use serde_json::{Value, json};

/// The container ID `Call` uses.
const CID: &str = "rcni-test-container";

fn bridge_conf(data_dir: &str) -> Value {
    json!({
        "cniVersion": "0.4.0",
        "name": "mynet",
        "type": "bridge",
        "bridge": "cni0",
        "isGateway": true,
        "ipMasq": true,
        "ipam": {
            "type": "host-local",
            "dataDir": data_dir,
            "ranges": [[{"subnet": "10.22.0.0/16"}], [{"subnet": "fd00:22::/64"}]]
        }
    })
}

fn reference_bridge(cmd: &str, host: &TestNs, pod: &TestNs, conf: &Value) -> Value {
    Call::new(reference_bin("bridge"), cmd)
        .netns(&pod.path())
        .env("CNI_PATH", REFERENCE_DIR)
        .stdin(conf)
        .run_in(&host.ns)
        .ok()
}

#[test]
fn same_rules_as_the_reference_and_drop_in_both_ways() {
    let (host, pod) = (TestNs::new(), TestNs::new());
    let data = tempfile::tempdir().unwrap();
    let conf = bridge_conf(&data.path().display().to_string());
    let result = reference_bridge("ADD", &host, &pod, &conf);
    let addrs: Vec<IpNetwork> = result["ips"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ip| ip["address"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(addrs.len(), 2, "{result}");
    let theirs = (
        nat_lines(&host, "iptables-save"),
        nat_lines(&host, "ip6tables-save"),
    );
    assert_eq!(theirs.0.len(), 4, "{theirs:?}");

    // Ours in a namespace of its own: the same lines, in the same order.
    let ours_ns = TestNs::new();
    let m = Masq {
        network: "mynet",
        container_id: CID,
        ifname: "eth0",
        ips: &addrs,
    };
    setup(&ours_ns.ns, Backend::Iptables, &m).unwrap();
    let ours = (
        nat_lines(&ours_ns, "iptables-save"),
        nat_lines(&ours_ns, "ip6tables-save"),
    );
    assert_eq!(ours, theirs);

    // The reference's rules pass our CHECK, and our teardown (knowing only
    // network and container, as in a DEL without netns) removes them.
    check(&host.ns, Backend::Iptables, &m).unwrap();
    let bare = Masq { ips: &[], ..m };
    teardown(&host.ns, &bare).unwrap();
    assert!(nat_lines(&host, "iptables-save").is_empty());
    assert!(nat_lines(&host, "ip6tables-save").is_empty());

    // Now ours in the host namespace; the reference's DEL removes them.
    setup(&host.ns, Backend::Iptables, &m).unwrap();
    assert_eq!(nat_lines(&host, "iptables-save"), theirs.0);
    reference_bridge("DEL", &host, &pod, &conf);
    assert!(nat_lines(&host, "iptables-save").is_empty());
    assert!(nat_lines(&host, "ip6tables-save").is_empty());
    // And no nft table was made along the way.
    assert!(!sh(&host, "nft", &["list", "tables"]).contains(rcni_netfilter::NFT_TABLE));
}
