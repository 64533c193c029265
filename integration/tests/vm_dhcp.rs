//! conf/61-vlan-dhcp.conflist with real 802.1Q links: the vlan plugin makes
//! the pod's link on the node's `eth1`, and the dhcp IPAM gets its address
//! from dnsmasq serving VLAN 200 at the other end of the wire. This host's
//! kernel has no 802.1Q; scripts/test runs this binary under
//! scripts/vm-run.

use rcni_integration::lab::dhcp::Lab;
use rcni_integration::{ip, nl};
use rcni_testkit::{Call, TestNs, bin, ping};
use serde_json::{Value, json};

#[test]
fn vlan_chained_conflist_gets_a_lease_over_802_1q() {
    let list = rcni_integration::lab::dhcp::conflist("61-vlan-dhcp.conflist");
    let plugin = &list["plugins"][0];
    let master = plugin["master"].as_str().unwrap();
    let vid = plugin["vlanId"].as_u64().unwrap();

    // The node's uplink `eth1` is a veth whose other end is the server's
    // trunk; the server answers on VLAN `vid` of it.
    let mut lab = Lab::bare();
    ip(
        &lab.node.ns,
        &format!(
            "link add {master} type veth peer name trunk netns {}",
            lab.server.path()
        ),
    );
    ip(&lab.node.ns, &format!("link set {master} up"));
    ip(&lab.server.ns, "link set trunk up");
    ip(
        &lab.server.ns,
        &format!("link add link trunk name srv{vid} type vlan id {vid}"),
    );
    ip(
        &lab.server.ns,
        &format!("addr add 10.77.0.1/24 dev srv{vid}"),
    );
    ip(&lab.server.ns, &format!("link set srv{vid} up"));
    lab.server_if = format!("srv{vid}");
    lab.start_dnsmasq(&["--dhcp-option=option:router,10.77.0.1"]);
    lab.start_daemon(&[]);

    let conf = lab.first_plugin_conf(&list);
    let pod = TestNs::new();
    let call = |cmd: &str, stdin: &Value| {
        Call::new(bin("vlan"), cmd)
            .env("CNI_CONTAINERID", "vm1")
            .env("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAME=vlan-pod")
            .netns(&pod.path())
            .stdin(stdin)
            .run_in(&lab.node.ns)
    };
    let result = call("ADD", &conf).ok();
    let got = rcni_integration::lab::dhcp::addr_ip(&result);
    assert!(got.starts_with("10.77.0."), "{result}\n{}", lab.logs());
    assert_eq!(
        result["routes"],
        json!([{"dst": "0.0.0.0/0", "gw": "10.77.0.1"}])
    );
    nl(&pod.ns, async |n| {
        let l = n.link_by_name("eth0").await.unwrap();
        assert_eq!(l.kind.as_deref(), Some("vlan"));
        assert_eq!(n.vlan_id(l.index).await.unwrap(), Some(vid as u16));
    });
    assert!(ping(&pod.ns, "10.77.0.1"), "{}", lab.logs());
    assert_eq!(lab.lease_of(&got).expect("lease").2, "vlan-pod");

    let with_prev = lab.check_and_del(call, &conf, &result);
    call("DEL", &with_prev).ok();
    // dhcp's DEL runs before the vlan link goes (runs_beside_links), so
    // its RELEASE reaches the server.
    lab.assert_released(&got, "vlan DEL released the lease on the server");
}
