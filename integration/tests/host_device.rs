//! The host-device binary moving veth, tap and macvlan links of a node
//! namespace into pods (this kernel has no dummy; vm_host_device.rs uses
//! one): real packets through the moved device, the device back intact
//! after DEL, every DEL path, rollback, and the reference side by side.

use rcni_integration::{
    Node, addrs_of, ip, merged, nl, ours_and_reference, ours_and_upstream, routes_of,
};
use rcni_netlink::Link;
use rcni_netns::NetNs;
use rcni_testkit::{PersistentNs, REFERENCE_DIR, TestNs, bin, normalized_result, ping};
use serde_json::{Value, json};

fn conf(extra: Value) -> Value {
    let c = json!({
        "cniVersion": "1.0.0", "name": "podnet", "type": "host-device", "device": "hd0",
        "ipam": {"type": "static", "addresses": [{"address": "10.62.0.2/24", "gateway": "10.62.0.1"}],
                 "routes": [{"dst": "10.63.0.0/16"}]}
    });
    merged(c, extra)
}

/// A node whose device hd0 is wired (veth) to hd0p, which holds 10.62.0.1.
fn node_with_device() -> Node {
    let node = Node::new();
    ip(
        &node.ns.ns,
        "link add hd0 mtu 1450 address 0a:62:00:00:00:02 type veth peer name hd0p",
    );
    ip(&node.ns.ns, "addr add 10.62.0.1/24 dev hd0p");
    ip(&node.ns.ns, "link set hd0p up");
    node
}

fn link(ns: &NetNs, name: &str) -> Option<Link> {
    nl(ns, async |n| n.find_link(name).await.unwrap())
}

/// What must survive the round trip: name, kind, MAC, MTU, no alias.
fn identity(l: &Link) -> (String, Option<String>, Option<String>, u32, Option<String>) {
    (
        l.name.clone(),
        l.kind.clone(),
        l.mac.map(|m| m.to_string()),
        l.mtu,
        l.alias.clone(),
    )
}

#[test]
fn a_moved_veth_carries_traffic_and_comes_back_intact() {
    let node = node_with_device();
    let before = identity(&link(&node.ns.ns, "hd0").unwrap());
    let pod = TestNs::new();
    let c = conf(json!({}));
    for round in 0..2 {
        let r = Call(&node).add(&pod, "ctr", &c, "net1");
        assert_eq!(
            r["interfaces"],
            json!([{"name": "net1", "mac": "0a:62:00:00:00:02", "sandbox": pod.path()}]),
            "round {round}"
        );
        assert_eq!(
            r["ips"],
            json!([{"interface": 0, "address": "10.62.0.2/24", "gateway": "10.62.0.1"}])
        );
        assert!(link(&node.ns.ns, "hd0").is_none(), "gone from the node");
        let moved = link(&pod.ns, "net1").unwrap();
        assert_eq!(
            moved.alias.as_deref(),
            Some("hd0"),
            "original name in the alias"
        );
        assert_eq!((moved.mtu, moved.admin_up), (1450, true));
        assert!(ping(&pod.ns, "10.62.0.1"), "pod to node through the device");
        assert!(ping(&node.ns.ns, "10.62.0.2"), "node to pod");
        nl(&pod.ns, async |n| {
            let routes = n.routes(rcni_netlink::Family::V4).await.unwrap();
            assert!(routes.iter().any(|r| r.dst.to_string() == "10.63.0.0/16"
                && r.gateway == Some("10.62.0.1".parse().unwrap())));
        });
        let with = Node::with_prev(&c, &r);
        Call(&node).run("CHECK", &pod, "ctr", &with, "net1").ok();
        Call(&node).run("DEL", &pod, "ctr", &with, "net1").ok();
        assert!(link(&pod.ns, "net1").is_none());
        let back = link(&node.ns.ns, "hd0").expect("back in the node under its name");
        assert_eq!(identity(&back), before, "round {round}");
        nl(&node.ns.ns, async |n| {
            assert!(
                n.addresses(Some(back.index))
                    .await
                    .unwrap()
                    .iter()
                    .all(|a| !a.addr.is_ipv4())
            )
        });
        // Repeated DEL: nothing to move, success.
        Call(&node).run("DEL", &pod, "ctr", &with, "net1").ok();
    }
}

#[test]
fn tap_by_hwaddr_and_macvlan_without_ipam() {
    let node = node_with_device();
    // A tap found by its MAC, with IPAM.
    ip(&node.ns.ns, "tuntap add dev tap7 mode tap");
    ip(&node.ns.ns, "link set tap7 address 0a:62:00:00:00:07");
    let before = identity(&link(&node.ns.ns, "tap7").unwrap());
    let pod = TestNs::new();
    let mut c = conf(json!({"device": "", "hwaddr": "0A:62:00:00:00:07"}));
    c["ipam"]["dns"] = json!({"nameservers": ["10.62.0.53"]});
    let r = Call(&node).add(&pod, "tap", &c, "eth0");
    assert_eq!(r["interfaces"][0]["mac"], "0a:62:00:00:00:07");
    assert!(
        r.get("dns").is_none(),
        "the config's DNS (none), not IPAM's, as v1.9.1: {r}"
    );
    assert_eq!(link(&pod.ns, "eth0").unwrap().kind.as_deref(), Some("tun"));
    Call(&node)
        .run("DEL", &pod, "tap", &Node::with_prev(&c, &r), "eth0")
        .ok();
    assert_eq!(identity(&link(&node.ns.ns, "tap7").unwrap()), before);

    // A macvlan on the node's hd0p, no IPAM: L2 only, up, the result has
    // just the interface.
    ip(
        &node.ns.ns,
        "link add mv0 link hd0p type macvlan mode bridge",
    );
    let before = identity(&link(&node.ns.ns, "mv0").unwrap());
    let pod = TestNs::new();
    let mut l2 = conf(json!({"device": "mv0"}));
    l2.as_object_mut().unwrap().remove("ipam");
    let r = Call(&node).add(&pod, "mv", &l2, "eth0");
    assert!(r.get("ips").is_none(), "{r}");
    assert_eq!(r["interfaces"][0]["name"], "eth0");
    assert!(link(&pod.ns, "eth0").unwrap().admin_up);
    Call(&node)
        .run("CHECK", &pod, "mv", &Node::with_prev(&l2, &r), "eth0")
        .ok();
    Call(&node)
        .run("DEL", &pod, "mv", &Node::with_prev(&l2, &r), "eth0")
        .ok();
    assert_eq!(identity(&link(&node.ns.ns, "mv0").unwrap()), before);
}

#[test]
fn del_releases_ipam_without_the_netns_and_repeats() {
    let node = node_with_device();
    let c = conf(
        json!({"ipam": {"type": "host-local", "dataDir": node.data.path(),
        "ranges": [[{"subnet": "10.62.0.0/24"}]]}}),
    );
    // Empty CNI_NETNS: the reference returns at once and leaks the
    // reservation (cni #1167); ours releases it.
    for (plugin, path) in ours_and_reference("host-device") {
        let leaks = plugin.starts_with(REFERENCE_DIR);
        let node = Node::with_path(path);
        ip(&node.ns.ns, "link add hd0 type veth peer name hd0p");
        let c = conf(
            json!({"ipam": {"type": "host-local", "dataDir": node.data.path(),
            "ranges": [[{"subnet": "10.62.0.0/24"}]]}}),
        );
        let pod = TestNs::new();
        node.call(&plugin, "ADD", &pod.path(), "ctr", &c).ok();
        assert_eq!(node.reservations().len(), 1);
        node.call(&plugin, "DEL", "", "ctr", &c).ok();
        assert_eq!(
            node.reservations().len(),
            usize::from(leaks),
            "{}",
            plugin.display()
        );
    }

    // The netns deleted before DEL (the veth dies with it): the reference
    // fails to open it; ours succeeds, releases, and succeeds again.
    let gone = PersistentNs::new();
    let path = gone.path.display().to_string();
    node.call(&bin("host-device"), "ADD", &path, "gone", &c)
        .ok();
    gone.delete();
    assert_eq!(node.reservations().len(), 1);
    node.call(&bin("host-device"), "DEL", &path, "gone", &c)
        .ok();
    node.call(&bin("host-device"), "DEL", &path, "gone", &c)
        .ok();
    assert!(node.reservations().is_empty());
}

#[test]
fn failed_add_puts_the_device_back() {
    let node = node_with_device();
    let before = identity(&link(&node.ns.ns, "hd0").unwrap());
    let pod = TestNs::new();
    // Addressing fails after the move and the reservation: both undone.
    let c = conf(
        json!({"ipam": {"type": "host-local", "dataDir": node.data.path(),
        "ranges": [[{"subnet": "10.62.0.0/24"}]],
        "routes": [{"dst": "192.168.0.0/16", "gw": "172.31.0.1"}]}}),
    );
    let (code, msg) = Call(&node).run("ADD", &pod, "ctr", &c, "net1").err();
    assert_eq!(code, 103, "{msg}");
    assert!(node.reservations().is_empty());
    assert!(link(&pod.ns, "net1").is_none());
    assert_eq!(identity(&link(&node.ns.ns, "hd0").unwrap()), before);

    // CNI_IFNAME taken in the pod: code 4, the device never moves.
    ip(&pod.ns, "link add net1 type veth peer name x0");
    let (code, _) = Call(&node)
        .run("ADD", &pod, "ctr", &conf(json!({})), "net1")
        .err();
    assert_eq!(code, 4);
    assert_eq!(identity(&link(&node.ns.ns, "hd0").unwrap()), before);

    // No such device, no selector, a kernelpath outside /sys/devices: code 7.
    for (extra, want) in [
        (json!({"device": "nosuch0"}), "failed to find host device"),
        (json!({"device": ""}), "specify either"),
        (
            json!({"device": "", "kernelpath": "/etc"}),
            "must be absolute and begin with /sys/devices/",
        ),
        (
            json!({"device": "", "hwaddr": "0a:62:00:00:00:99"}),
            "no link with MAC address",
        ),
    ] {
        let (code, msg) = Call(&node)
            .run("ADD", &TestNs::new(), "x", &conf(extra.clone()), "eth0")
            .err();
        assert_eq!(code, 7, "{extra}: {msg}");
        assert!(msg.contains(want), "{extra}: {msg}");
    }
}

#[test]
fn same_result_and_state_as_the_reference() {
    for v in ["0.4.0", "1.0.0"] {
        let mut seen = Vec::new();
        for (plugin, path) in ours_and_reference("host-device") {
            let node = Node::with_path(path);
            ip(
                &node.ns.ns,
                "link add hd0 mtu 1400 type veth peer name hd0p",
            );
            let pod = TestNs::new();
            // DNS in the config: the reference (1.1.1) drops IPAM's.
            let c = conf(json!({"cniVersion": v, "dns": {"nameservers": ["10.62.0.53"]}}));
            let r = node.call(&plugin, "ADD", &pod.path(), "diff", &c).ok();
            let l = link(&pod.ns, "eth0").unwrap();
            let state = (
                l.alias.clone(),
                l.mtu,
                l.admin_up,
                addrs_of(&pod.ns, "eth0"),
                routes_of(&pod.ns),
            );
            seen.push((normalized_result(&r, v), state));
            let with = Node::with_prev(&c, &r);
            let check = node.call(&plugin, "CHECK", &pod.path(), "diff", &with);
            let reference = plugin.starts_with(REFERENCE_DIR);
            if reference {
                // The reference's CHECK fails its own ADD: it wants the
                // gateway-less IPAM route without the gateway ADD gave it.
                assert!(check.err().1.contains("not found in routing table"));
            } else {
                check.ok();
            }
            node.call(&plugin, "DEL", &pod.path(), "diff", &with).ok();
            let back = link(&node.ns.ns, "hd0").unwrap();
            // Deliberate difference: the reference leaves the alias set.
            assert_eq!(back.alias.is_some(), reference, "{v}");
        }
        assert_eq!(seen[0].0, seen[1].0, "{v}: result");
        assert_eq!(seen[0].1, seen[1].1, "{v}: kernel state");
    }
}

/// host-device calls from the node with a chosen CNI_IFNAME.
struct Call<'a>(&'a Node);

impl Call<'_> {
    fn run(
        &self,
        cmd: &str,
        pod: &TestNs,
        cid: &str,
        conf: &Value,
        ifname: &str,
    ) -> rcni_testkit::Output {
        rcni_testkit::Call::new(bin("host-device"), cmd)
            .env("CNI_PATH", &self.0.cni_path)
            .env("CNI_CONTAINERID", cid)
            .env("CNI_IFNAME", ifname)
            .netns(&pod.path())
            .stdin(conf)
            .run_in(&self.0.ns.ns)
    }

    fn add(&self, pod: &TestNs, cid: &str, conf: &Value, ifname: &str) -> Value {
        self.run("ADD", pod, cid, conf, ifname).ok()
    }
}

#[test]
fn every_spec_version_gets_its_result_shape() {
    let node = node_with_device();
    let pod = TestNs::new();
    for v in rcni_cni::version::ALL {
        let c = conf(json!({"cniVersion": v}));
        let r = Call(&node).add(&pod, "ctr", &c, "net1");
        assert_eq!(r["cniVersion"], *v);
        match *v {
            "0.1.0" | "0.2.0" => assert_eq!(r["ip4"]["ip"], "10.62.0.2/24", "{r}"),
            _ => {
                assert_eq!(r["interfaces"][0]["name"], "net1", "{v}: {r}");
                assert_eq!(
                    r["ips"][0]["version"].is_string(),
                    v.starts_with("0."),
                    "{v}: {r}"
                );
            }
        }
        assert!(ping(&pod.ns, "10.62.0.1"), "{v}");
        Call(&node).run("DEL", &pod, "ctr", &c, "net1").ok();
        assert!(link(&node.ns.ns, "hd0").is_some(), "{v}");
    }
}

/// As v1.9.1: the result's DNS is the config's `dns` (IPAM's is dropped),
/// and the moved device, given an IPv6 address, keeps it over a link
/// down/up (`keep_addr_on_down=1`, v1.7.0).
#[test]
fn dns_from_the_config_and_ipv6_kept_on_down_as_v191() {
    for (plugin, path) in ours_and_upstream("host-device") {
        let what = plugin.display().to_string();
        let node = Node::with_path(path);
        ip(&node.ns.ns, "link add hd0 type veth peer name hd0p");
        ip(&node.ns.ns, "link set hd0p up");
        let mut c = conf(json!({}));
        c["ipam"]["addresses"] = json!([{"address": "10.62.0.2/24"}, {"address": "fd62::2/64"}]);
        c["ipam"]["dns"] = json!({"nameservers": ["10.62.0.53"]});
        let pod = TestNs::new();
        let r = node.call(&plugin, "ADD", &pod.path(), "hd", &c).ok();
        let dns = r.get("dns").cloned().unwrap_or(json!({}));
        assert_eq!(dns, json!({}), "{what}: IPAM's DNS is not the result's");
        assert_eq!(
            rcni_netlink::sysctl::get(&pod.ns, "net/ipv6/conf/eth0/keep_addr_on_down").unwrap(),
            "1",
            "{what}"
        );
        ip(&pod.ns, "link set eth0 down");
        ip(&pod.ns, "link set eth0 up");
        assert!(
            addrs_of(&pod.ns, "eth0").contains(&"fd62::2/64".to_string()),
            "{what}"
        );
        node.call(&plugin, "DEL", &pod.path(), "hd", &Node::with_prev(&c, &r))
            .ok();
        assert!(
            link(&node.ns.ns, "hd0").is_some(),
            "{what}: back on the node"
        );
    }
}

/// hd0's own L3 setup on the node, as a cloud or a VM would provision it:
/// addresses (IPv6 permanent), routes via 10.62.0.1 and fd62::99 in main
/// (IPv6 refuses a gateway the namespace holds itself, so an on-link
/// address nobody holds), a default route in table 100 with its source
/// rule; besides, what
/// `useInterfaceNetwork` leaves out: a route learned from router
/// advertisements and a rule to a table none of hd0's routes is in.
fn provision(node: &Node) {
    let n = &node.ns.ns;
    ip(n, "link set hd0 up");
    ip(n, "addr add 10.62.0.5/24 dev hd0");
    ip(n, "-6 addr add fd62::5/64 dev hd0 nodad");
    ip(n, "route add 10.64.0.0/16 via 10.62.0.1 dev hd0");
    ip(n, "route add default via 10.62.0.1 dev hd0 table 100");
    ip(n, "-6 route add 2001:db8:8::/64 via fd62::99 dev hd0");
    ip(
        n,
        "-6 route add 2001:db8:9::/64 via fd62::99 dev hd0 proto ra",
    );
    ip(n, "rule add from 10.62.0.5 lookup 100");
    ip(n, "rule add from 10.62.0.5 lookup 200");
}

/// `from SRC lookup TABLE` rules of `ns`.
fn rules_of(ns: &NetNs) -> Vec<String> {
    nl(ns, async |n| {
        n.rules(rcni_netlink::Family::All).await.unwrap()
    })
    .iter()
    .map(|r| r.to_string())
    .collect()
}

/// Upstream v1.10.0's `useInterfaceNetwork`: the device's addresses,
/// routes (of every table) and source rules go with it into the pod and
/// into the result, without IPAM and after IPAM's; a failed ADD puts the
/// device back on the node with its setup.
#[test]
fn use_interface_network_takes_the_device_setup_along() {
    let node = node_with_device();
    provision(&node);
    let pod = TestNs::new();
    let bare = json!({"cniVersion": "1.1.0", "name": "podnet", "type": "host-device",
        "device": "hd0", "useInterfaceNetwork": true});
    let r = Call(&node).add(&pod, "ctr", &bare, "net1");
    assert_eq!(
        r["interfaces"],
        json!([{"name": "net1", "mac": "0a:62:00:00:00:02", "sandbox": pod.path()}])
    );
    assert_eq!(
        r["ips"],
        json!([{"interface": 0, "address": "10.62.0.5/24"},
               {"interface": 0, "address": "fd62::5/64"}])
    );
    let routes = r["routes"].as_array().unwrap();
    for want in [
        json!({"dst": "0.0.0.0/0", "gw": "10.62.0.1", "table": 100}),
        json!({"dst": "10.64.0.0/16", "gw": "10.62.0.1", "table": 254}),
        json!({"dst": "2001:db8:8::/64", "gw": "fd62::99", "priority": 1024, "table": 254}),
    ] {
        assert!(routes.contains(&want), "{want} not in {routes:?}");
    }
    assert_eq!(routes.len(), 3, "{routes:?}");
    assert!(r.get("dns").is_none(), "{r}");

    assert_eq!(addrs_of(&pod.ns, "net1"), ["10.62.0.5/24", "fd62::5/64"]);
    let main = routes_of(&pod.ns);
    assert!(
        main.contains(&"10.64.0.0/16 via 10.62.0.1 scope 0".to_string()),
        "{main:?}"
    );
    assert!(
        !main.iter().any(|l| l.starts_with("2001:db8:9::")),
        "{main:?}"
    );
    let rl = rules_of(&pod.ns);
    assert!(
        rl.iter()
            .any(|l| l.ends_with("from 10.62.0.5/32 lookup 100")),
        "{rl:?}"
    );
    assert!(!rl.iter().any(|l| l.ends_with("lookup 200")), "{rl:?}");
    assert!(ping(&pod.ns, "10.62.0.1"), "the copied address works");
    let with_prev = merged(bare.clone(), json!({"prevResult": r}));
    Call(&node)
        .run("CHECK", &pod, "ctr", &with_prev, "net1")
        .ok();
    Call(&node).run("DEL", &pod, "ctr", &with_prev, "net1").ok();
    assert!(link(&node.ns.ns, "hd0").is_some(), "back on the node");

    // With IPAM: IPAM's addresses and routes first, then the device's.
    provision_again(&node);
    let with_ipam = merged(
        bare.clone(),
        json!({"ipam": {"type": "static", "addresses": [{"address": "10.62.0.2/24"}]}}),
    );
    let r = Call(&node).add(&pod, "ctr", &with_ipam, "net1");
    assert_eq!(
        r["ips"],
        json!([{"interface": 0, "address": "10.62.0.2/24"},
               {"interface": 0, "address": "10.62.0.5/24"},
               {"interface": 0, "address": "fd62::5/64"}])
    );
    Call(&node).run("DEL", &pod, "ctr", &with_ipam, "net1").ok();

    // IPAM fails after the move: hd0 comes back with its setup.
    provision_again(&node);
    let failing = merged(bare, json!({"ipam": {"type": "no-such-ipam"}}));
    let (code, msg) = Call(&node).run("ADD", &pod, "ctr", &failing, "net1").err();
    assert_eq!(code, 101, "{msg}");
    assert_eq!(addrs_of(&node.ns.ns, "hd0"), ["10.62.0.5/24", "fd62::5/64"]);
    assert!(
        routes_of(&node.ns.ns).contains(&"10.64.0.0/16 via 10.62.0.1 scope 0".to_string()),
        "{:?}",
        routes_of(&node.ns.ns)
    );
}

/// hd0's addresses and routes again after a move took them (its rules
/// stayed on the node).
fn provision_again(node: &Node) {
    let n = &node.ns.ns;
    ip(n, "link set hd0 up");
    ip(n, "addr add 10.62.0.5/24 dev hd0");
    ip(n, "-6 addr add fd62::5/64 dev hd0 nodad");
    ip(n, "route add 10.64.0.0/16 via 10.62.0.1 dev hd0");
    ip(n, "route add default via 10.62.0.1 dev hd0 table 100");
    ip(n, "-6 route add 2001:db8:8::/64 via fd62::99 dev hd0");
}
