//! Cloud mode on AWS (issue 31): `rcni-node run --cloud aws` keeping a
//! warm pool of the VPC's own addresses on the node's interfaces, the
//! vpc-ipam plugin handing them to pods, against a model of EC2 nobody
//! here wrote (moto in server mode, integration/cloud/ec2_model.py) in the
//! VPC lab ([`rcni_integration::lab::vpc`]): a network that routes each
//! address to the interface the API assigns it to, so a pod is reachable
//! only if its address is really its node's.
//!
//! Skips with a message when moto is not installed (PyPI `moto[server]`).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::Duration;

use rcni_integration::ip;
use rcni_integration::lab::vpc::{
    self, GATEWAY, INTERNET, MODEL, SUBNET, VPC_HOST, Vpc, in_prefix, reaches,
};
use rcni_testkit::{command_in, ping};
use serde_json::json;

const REACH: Duration = Duration::from_secs(10);

fn lab() -> Option<Vpc> {
    if !vpc::moto_available() {
        eprintln!("SKIP: moto is not installed (pip install 'moto[server]')");
        return None;
    }
    Some(Vpc::new())
}

fn link_mac(ns: &rcni_netns::NetNs, dev: &str) -> Option<String> {
    let v = rcni_integration::ip_link_json(ns, dev);
    v["address"].as_str().map(String::from)
}

/// Packets the vpc namespace dropped for their source (strict rp_filter:
/// EC2's source/destination check).
fn rp_filter_drops(v: &Vpc) -> u64 {
    let out = command_in(&v.router.ns, "nstat")
        .args(["-asz", "TcpExtIPReversePathFilter"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("TcpExtIPReversePathFilter"))
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// The lab itself, driven through the API alone (no agent): instances,
/// interfaces attached and detached appear and vanish on the node with
/// their MACs, the VPC routes exactly the addresses the API assigns (and
/// /28 prefixes), EC2's source check drops an address sent from the wrong
/// interface, the VPC host and the internet host answer.
#[test]
fn lab_follows_the_api() {
    let Some(mut v) = lab() else { return };
    let a = v.add_node("t3.medium");
    let b = v.add_node("t3.medium");
    v.settle();
    let (na, nb) = (&v.nodes[a], &v.nodes[b]);
    assert_eq!(link_mac(&na.ns.ns, "eth0").unwrap(), na.primary_mac);
    let routes = v.fabric_routes();
    for (n, dev) in [(na, "n1e0"), (nb, "n2e0")] {
        assert!(
            routes.contains(&format!("{}/32 {dev}", n.primary_ip)),
            "{routes:?}"
        );
    }
    assert!(reaches(&na.ns.ns, &nb.primary_ip.to_string(), REACH));
    assert!(reaches(&na.ns.ns, VPC_HOST, REACH));
    assert!(reaches(&nb.ns.ns, INTERNET, REACH));
    assert!(ping(&na.ns.ns, MODEL.0));

    // A secondary address of a's primary interface, held by a's eth0 as a
    // pod's would be: b reaches it; once unassigned, no longer.
    let eni0 = &v.ec2.enis_of(&na.instance)[0];
    let out = v.ec2.call(
        "assign_private_ip_addresses",
        json!({"NetworkInterfaceId": eni0.id, "SecondaryPrivateIpAddressCount": 1}),
    );
    let s: Ipv4Addr = out["AssignedPrivateIpAddresses"][0]["PrivateIpAddress"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(in_prefix(SUBNET, s));
    ip(&na.ns.ns, &format!("addr add {s}/32 dev eth0"));
    v.settle();
    assert!(v.fabric_routes().contains(&format!("{s}/32 n1e0")));
    assert!(reaches(&nb.ns.ns, &s.to_string(), REACH));

    // EC2's source check: b sending from a's address is dropped where it
    // enters the VPC (not merely answered to a).
    let drops = rp_filter_drops(&v);
    ip(&nb.ns.ns, &format!("addr add {s}/32 dev lo"));
    let spoof = command_in(&nb.ns.ns, "ping")
        .args([
            "-c",
            "2",
            "-W",
            "1",
            "-n",
            "-q",
            "-I",
            &s.to_string(),
            VPC_HOST,
        ])
        .output()
        .unwrap();
    assert!(!spoof.status.success(), "a spoofed source got through");
    assert!(
        rp_filter_drops(&v) >= drops + 2,
        "not dropped by the source check"
    );
    ip(&nb.ns.ns, &format!("addr del {s}/32 dev lo"));

    v.ec2.call(
        "unassign_private_ip_addresses",
        json!({"NetworkInterfaceId": eni0.id, "PrivateIpAddresses": [s.to_string()]}),
    );
    v.settle();
    assert!(
        !v.fabric_routes()
            .iter()
            .any(|r| r.starts_with(&format!("{s}/")))
    );
    assert!(!ping(&nb.ns.ns, &s.to_string()), "unassigned yet reachable");

    // A second interface: plugged into a as eth1 with its MAC, its
    // address and a /28 prefix routed to it.
    let eni = v
        .ec2
        .call("create_network_interface", json!({"SubnetId": v.subnet_id}));
    let eni_id = eni["NetworkInterface"]["NetworkInterfaceId"]
        .as_str()
        .unwrap()
        .to_string();
    let mac = eni["NetworkInterface"]["MacAddress"]
        .as_str()
        .unwrap()
        .to_lowercase();
    let eni_ip = eni["NetworkInterface"]["PrivateIpAddress"]
        .as_str()
        .unwrap()
        .to_string();
    let att = v.ec2.call(
        "attach_network_interface",
        json!({"NetworkInterfaceId": eni_id, "InstanceId": na.instance, "DeviceIndex": 1}),
    );
    let out = v.ec2.call(
        "assign_private_ip_addresses",
        json!({"NetworkInterfaceId": eni_id, "Ipv4PrefixCount": 1}),
    );
    let prefix = out["AssignedIpv4Prefixes"][0]["Ipv4Prefix"]
        .as_str()
        .unwrap()
        .to_string();
    v.settle();
    assert_eq!(link_mac(&na.ns.ns, "eth1").as_deref(), Some(mac.as_str()));
    let routes = v.fabric_routes();
    assert!(routes.contains(&format!("{eni_ip}/32 n1e1")), "{routes:?}");
    assert!(routes.contains(&format!("{prefix} n1e1")), "{routes:?}");

    // An address of the prefix on a's eth1, answered through eth1 (the
    // agent's policy routing, by hand): b reaches it.
    let p1 = vpc::prefix_addresses(&prefix)[1];
    ip(&na.ns.ns, &format!("addr add {eni_ip}/20 dev eth1"));
    ip(&na.ns.ns, &format!("addr add {p1}/32 dev eth1"));
    ip(&na.ns.ns, "link set eth1 up");
    ip(
        &na.ns.ns,
        &format!("route add default via {GATEWAY} dev eth1 table 2"),
    );
    ip(&na.ns.ns, &format!("rule add from {p1} lookup 2"));
    assert!(reaches(&nb.ns.ns, &p1.to_string(), REACH));

    v.ec2.call(
        "detach_network_interface",
        json!({"AttachmentId": att["AttachmentId"]}),
    );
    v.settle();
    assert_eq!(link_mac(&na.ns.ns, "eth1"), None, "eth1 still plugged");
    let routes = v.fabric_routes();
    assert!(!routes.iter().any(|r| r.ends_with(" n1e1")), "{routes:?}");
    assert!(!ping(&nb.ns.ns, &p1.to_string()));
    assert_eq!(v.ec2.agent_calls(), BTreeMap::new(), "no agent ran");
}
