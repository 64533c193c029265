//! multinet with three networks under scripts/vm-run (this host's
//! kernel has no ipvlan): eth0 on bridge + host-local, net1 on macvlan to
//! one LAN, net2 on ipvlan to another; each network reaches its own peer
//! only, and DEL leaves nothing on any network, also with the extra
//! networks' conflists deleted between ADD and DEL.

use rcni_integration::lab::multinet::{Lab, addr_on, pod_ifnames};
use rcni_testkit::{TestNs, ip, ping, reservations};
use serde_json::json;

#[test]
fn pod_on_bridge_macvlan_and_ipvlan() {
    let lab = Lab::new();
    // A second LAN behind iv0 for the ipvlan network.
    let lan2 = TestNs::new();
    ip(&lab.node.ns.ns, "link add iv0 type veth peer name lan0");
    ip(
        &lab.node.ns.ns,
        &format!("link set lan0 netns {}", lan2.path()),
    );
    ip(&lab.node.ns.ns, "link set iv0 up");
    ip(&lan2.ns, "addr add 10.78.0.1/24 dev lan0");
    ip(&lan2.ns, "link set lan0 up");
    lab.write(
        lab.extra_dir.path(),
        "30-ipnet.conflist",
        &json!({"cniVersion": "1.0.0", "name": "ipnet", "plugins": [{
            "type": "ipvlan", "master": "iv0", "mode": "l2",
            "ipam": {"type": "host-local", "dataDir": lab.mac_data.path(),
                     "ranges": [[{"subnet": "10.78.0.0/24", "rangeStart": "10.78.0.10"}]]}
        }]}),
    );
    let pod = TestNs::new();
    let r = lab.run("add", &pod, "pod-a", Some("macnet, ipnet")).ok();
    assert_eq!(pod_ifnames(&r), ["eth0", "net1", "net2"], "{r}");
    let net1 = addr_on(&pod, "net1");
    let net2 = addr_on(&pod, "net2");
    assert!(net1.starts_with("10.77.0."), "{net1}");
    assert!(net2.starts_with("10.78.0."), "{net2}");
    assert!(ping(&pod.ns, "10.77.0.1"), "pod -> LAN 1 over net1");
    assert!(ping(&pod.ns, "10.78.0.1"), "pod -> LAN 2 over net2");
    assert!(ping(&lan2.ns, &net2), "LAN 2 -> pod over net2");
    // Each LAN reaches the pod on its own network only.
    assert!(!ping(&lan2.ns, &net1), "LAN 2 reached net1's address");
    let doc = lab.status_doc("pod-a").expect("network-status");
    assert_eq!(doc[2]["name"], "ipnet");
    assert_eq!(doc[2]["interface"], "net2");

    lab.run("check", &pod, "pod-a", Some("macnet, ipnet")).ok();
    std::fs::remove_file(lab.extra_dir.path().join("20-macnet.conflist")).unwrap();
    std::fs::remove_file(lab.extra_dir.path().join("30-ipnet.conflist")).unwrap();
    lab.run("del", &pod, "pod-a", None).ok();
    lab.run("del", &pod, "pod-a", None).ok();
    assert!(reservations(&lab.mac_data.path().join("ipnet")).is_empty());
    let links = rcni_testkit::stdout_of(pod.command("ip").args(["-o", "link"]));
    assert!(!links.contains("net2"), "{links}");
    lab.assert_nothing_left(&[&pod]);
}
