//! The vlan binary with real 802.1Q links. This host's kernel has no
//! 802.1Q; scripts/test runs this binary under scripts/vm-run
//! (Debian's full kernel).

use rcni_integration::{
    Node, addrs_of, ip, ipv6_addrs, link_names, merged, nl, ours_and_reference, routes_of,
};
use rcni_testkit::{TestNs, bin, normalized_result, ping, reference_bin};
use serde_json::{Value, json};

fn conf(master: &str, vlan: u32, addr: &str, extra: Value) -> Value {
    let c = json!({
        "cniVersion": "1.0.0", "name": "vl", "type": "vlan", "master": master, "vlanId": vlan,
        "ipam": {"type": "static", "addresses": [{"address": addr}]}
    });
    merged(c, extra)
}

#[test]
fn pods_on_one_vlan_reach_each_other_and_not_other_vlans() {
    let node = Node::new().wired();
    // A kernel allows one link per (master, VLAN ID): the same VLAN on both
    // ends of the wire.
    let pods: Vec<(TestNs, Value, Value)> = [
        ("m1", 10, "10.60.0.1/24"),
        ("m2", 10, "10.60.0.2/24"),
        ("m2", 20, "10.60.0.3/24"),
        ("m1", 20, "10.60.0.4/24"),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (master, vlan, addr))| {
        let p = TestNs::new();
        let c = conf(master, vlan, addr, json!({}));
        let r = node
            .call(&bin("vlan"), "ADD", &p.path(), &format!("c{i}"), &c)
            .ok();
        (p, c, r)
    })
    .collect();

    let (a, _, ra) = &pods[0];
    assert_eq!(
        ra["interfaces"],
        json!([{"name": "eth0", "mac": ra["interfaces"][0]["mac"], "sandbox": a.path()}])
    );
    assert_eq!(
        ra["ips"],
        json!([{"interface": 0, "address": "10.60.0.1/24"}])
    );
    let m1 = nl(&node.ns.ns, async |n| n.link_by_name("m1").await.unwrap());
    nl(&a.ns, async |n| {
        let l = n.link_by_name("eth0").await.unwrap();
        assert_eq!(l.kind.as_deref(), Some("vlan"));
        assert_eq!(l.link, Some(m1.index), "on master m1");
        assert_eq!(n.vlan_id(l.index).await.unwrap(), Some(10));
        assert_eq!(l.mac, m1.mac, "a VLAN link takes its master's MAC");
        assert!(l.admin_up);
    });

    assert!(ping(&pods[0].0.ns, "10.60.0.2"), "VLAN 10 across the wire");
    assert!(ping(&pods[2].0.ns, "10.60.0.4"), "VLAN 20 across the wire");
    assert!(
        !ping(&pods[0].0.ns, "10.60.0.3"),
        "VLAN 10 must not reach VLAN 20"
    );
    assert!(
        !ping(&pods[0].0.ns, "10.60.0.4"),
        "VLAN 10 must not reach VLAN 20"
    );

    for (i, (p, c, r)) in pods.iter().enumerate() {
        let with = Node::with_prev(c, r);
        let cid = format!("c{i}");
        node.call(&bin("vlan"), "CHECK", &p.path(), &cid, &with)
            .ok();
        node.call(&bin("vlan"), "DEL", &p.path(), &cid, &with).ok();
        node.call(&bin("vlan"), "DEL", &p.path(), &cid, &with).ok();
        nl(&p.ns, async |n| {
            assert!(n.find_link("eth0").await.unwrap().is_none())
        });
    }
    nl(&node.ns.ns, async |n| {
        let kinds: Vec<String> = n
            .links()
            .await
            .unwrap()
            .into_iter()
            .filter(|l| l.kind.as_deref() == Some("vlan"))
            .map(|l| l.name)
            .collect();
        assert!(kinds.is_empty(), "{kinds:?}");
    });
}

#[test]
fn mtu_ipv6_link_in_container_and_check_after_damage() {
    let node = Node::new().wired();
    // MTU below the master's; IPv6 with duplicate address detection done
    // before ADD returns (the VLAN is a shared segment).
    let p = TestNs::new();
    let mut c = conf("m1", 30, "fd60::1/64", json!({"mtu": 1400}));
    c["ipam"]["dns"] = json!({"search": ["vl.example"]});
    let r = node.call(&bin("vlan"), "ADD", &p.path(), "v6", &c).ok();
    assert!(
        r.get("dns").is_none(),
        "the config's DNS (none), not IPAM's, as v1.9.1: {r}"
    );
    // IPAM's IPv6 address survives a link down/up (v1.7.0).
    assert_eq!(
        rcni_netlink::sysctl::get(&p.ns, "net/ipv6/conf/eth0/keep_addr_on_down").unwrap(),
        "1"
    );
    assert_eq!(
        ipv6_addrs(&p.ns, "eth0"),
        [("fd60::1/64".to_string(), false)]
    );
    nl(&p.ns, async |n| {
        assert_eq!(n.link_by_name("eth0").await.unwrap().mtu, 1400)
    });
    let with = Node::with_prev(&c, &r);
    node.call(&bin("vlan"), "CHECK", &p.path(), "v6", &with)
        .ok();
    ip(&p.ns, "link set eth0 mtu 1300");
    let (code, msg) = node
        .call(&bin("vlan"), "CHECK", &p.path(), "v6", &with)
        .err();
    assert_eq!(code, 106, "{msg}");
    ip(&p.ns, "link set eth0 mtu 1400");
    ip(&p.ns, "addr del fd60::1/64 dev eth0");
    let (code, msg) = node
        .call(&bin("vlan"), "CHECK", &p.path(), "v6", &with)
        .err();
    assert_eq!(code, 106, "{msg}");
    node.call(&bin("vlan"), "DEL", &p.path(), "v6", &with).ok();

    // The master inside the container.
    let p = TestNs::new();
    ip(&p.ns, "link add inner0 type veth peer name inner1");
    ip(&p.ns, "link set inner0 up");
    let c = conf(
        "inner0",
        40,
        "10.60.1.1/24",
        json!({"linkInContainer": true}),
    );
    let r = node.call(&bin("vlan"), "ADD", &p.path(), "lic", &c).ok();
    let inner = nl(&p.ns, async |n| n.link_by_name("inner0").await.unwrap());
    nl(&p.ns, async |n| {
        let l = n.link_by_name("eth0").await.unwrap();
        assert_eq!(
            (l.link, n.vlan_id(l.index).await.unwrap()),
            (Some(inner.index), Some(40))
        );
    });
    let with = Node::with_prev(&c, &r);
    node.call(&bin("vlan"), "CHECK", &p.path(), "lic", &with)
        .ok();
    node.call(&bin("vlan"), "DEL", &p.path(), "lic", &with).ok();
    nl(&p.ns, async |n| {
        assert!(n.find_link("eth0").await.unwrap().is_none());
        assert!(
            n.find_link("inner0").await.unwrap().is_some(),
            "the master stays"
        );
    });
}

#[test]
fn failed_add_rolls_back_and_del_survives_a_missing_master() {
    let node = Node::new().wired();
    // Addressing fails after the link exists and IPAM reserved: both undone.
    let p = TestNs::new();
    let c = json!({"cniVersion": "1.0.0", "name": "podnet", "type": "vlan", "master": "m1", "vlanId": 50,
        "ipam": {"type": "host-local", "dataDir": node.data.path(), "ranges": [[{"subnet": "10.60.2.0/24"}]],
                 "routes": [{"dst": "192.168.0.0/16", "gw": "172.31.0.1"}]}});
    let (code, msg) = node.call(&bin("vlan"), "ADD", &p.path(), "rb", &c).err();
    assert_eq!(code, 103, "{msg}");
    assert!(node.reservations().is_empty(), "IPAM released");
    assert_eq!(link_names(&p.ns), ["lo"], "the vlan link is rolled back");
    // The same VLAN again on the same master now works: nothing was left.
    let ok = conf("m1", 50, "10.60.2.9/24", json!({}));
    let r = node.call(&bin("vlan"), "ADD", &p.path(), "rb", &ok).ok();

    // An existing CNI_IFNAME: code 4.
    let q = TestNs::new();
    ip(&q.ns, "link add eth0 type veth peer name x0");
    let (code, _) = node
        .call(
            &bin("vlan"),
            "ADD",
            &q.path(),
            "dup",
            &conf("m2", 51, "10.60.2.10/24", json!({})),
        )
        .err();
    assert_eq!(code, 4);

    // The master removed (its VLAN links go with it): the reference's DEL
    // fails looking the master up, ours succeeds.
    ip(&node.ns.ns, "link del m1");
    let with = Node::with_prev(&ok, &r);
    let (code, msg) = node
        .call(&reference_bin("vlan"), "DEL", &p.path(), "rb", &with)
        .err();
    assert!(code > 0 && msg.contains("not found"), "{code} {msg}");
    node.call(&bin("vlan"), "DEL", &p.path(), "rb", &with).ok();
}

#[test]
fn same_result_and_state_as_the_reference() {
    for v in ["0.4.0", "1.0.0"] {
        let mut seen = Vec::new();
        for (vlan, path) in ours_and_reference("vlan") {
            let node = Node::with_path(path);
            ip(&node.ns.ns, "link add m1 type veth peer name m2");
            ip(&node.ns.ns, "link set m1 up");
            let pod = TestNs::new();
            let c = json!({"cniVersion": v, "name": "vl", "type": "vlan", "master": "m1", "vlanId": 7,
                "mtu": 1450, "dns": {"nameservers": ["10.60.3.1"]},
                "ipam": {"type": "static", "addresses": [{"address": "10.60.3.5/24", "gateway": "10.60.3.1"}],
                         "routes": [{"dst": "0.0.0.0/0"}]}});
            let r = node.call(&vlan, "ADD", &pod.path(), "diff", &c).ok();
            let l = nl(&pod.ns, async |n| n.link_by_name("eth0").await.unwrap());
            let vlan_id = nl(&pod.ns, async |n| n.vlan_id(l.index).await.unwrap());
            let state = (
                l.kind,
                l.mtu,
                l.admin_up,
                vlan_id,
                addrs_of(&pod.ns, "eth0"),
                routes_of(&pod.ns),
            );
            seen.push((normalized_result(&r, v), state));
            let with = Node::with_prev(&c, &r);
            node.call(&vlan, "CHECK", &pod.path(), "diff", &with).ok();
            node.call(&vlan, "DEL", &pod.path(), "diff", &with).ok();
            nl(&pod.ns, async |n| {
                assert!(n.find_link("eth0").await.unwrap().is_none())
            });
        }
        assert_eq!(seen[0].0, seen[1].0, "{v}: result");
        assert_eq!(seen[0].1, seen[1].1, "{v}: kernel state");
    }
}

/// L2 mode (no `ipam`, or `"ipam": {}`; v1.10.0, where v1.9.1 failed ADD
/// with "failed to execute IPAM delegate: no plugin name provided"): the
/// link made, moved and up, without addresses; the result its interface
/// and the config's DNS, no ips or routes; CHECK, STATUS and DEL never look
/// for an IPAM plugin; CHECK after DEL fails (106).
#[test]
fn l2_without_ipam_add_check_status_del() {
    let node = Node::new().wired();
    for (i, ipam) in [None, Some(json!({}))].into_iter().enumerate() {
        let vid = 80 + i as u16;
        let mut c = json!({"cniVersion": "1.1.0", "name": "vl", "type": "vlan", "master": "m1",
            "vlanId": vid, "dns": {"nameservers": ["10.60.9.1"]}});
        if let Some(ipam) = ipam {
            c["ipam"] = ipam;
        }
        let p = TestNs::new();
        let cid = format!("l2-{i}");
        let r = node.call(&bin("vlan"), "ADD", &p.path(), &cid, &c).ok();
        assert_eq!(
            r["interfaces"],
            json!([{"name": "eth0", "mac": r["interfaces"][0]["mac"], "sandbox": p.path()}])
        );
        assert!(r.get("ips").is_none() && r.get("routes").is_none(), "{r}");
        assert_eq!(r["dns"], json!({"nameservers": ["10.60.9.1"]}));
        nl(&p.ns, async |n| {
            let l = n.link_by_name("eth0").await.unwrap();
            assert_eq!(l.kind.as_deref(), Some("vlan"));
            assert_eq!(n.vlan_id(l.index).await.unwrap(), Some(vid));
            assert!(l.admin_up);
        });
        assert_eq!(addrs_of(&p.ns, "eth0"), Vec::<String>::new());
        let with = Node::with_prev(&c, &r);
        node.call(&bin("vlan"), "CHECK", &p.path(), &cid, &with)
            .ok();
        node.status(&bin("vlan"), &c).ok();
        node.call(&bin("vlan"), "DEL", &p.path(), &cid, &with).ok();
        assert_eq!(link_names(&p.ns), ["lo"]);
        node.call(&bin("vlan"), "DEL", &p.path(), &cid, &with).ok();
        let (code, msg) = node
            .call(&bin("vlan"), "CHECK", &p.path(), &cid, &with)
            .err();
        assert_eq!(code, 106, "CHECK after DEL: {msg}");
    }
}

/// vlan + host-local killed at every point of ADD and of DEL, then DEL:
/// nothing left (see `lower_killed_at_every_point`). An ADD killed between
/// the link's creation and its rename left it in the container under a
/// random temporary name no DEL could find.
#[test]
fn killed_at_every_point_leaves_nothing() {
    rcni_integration::lower_killed_at_every_point("vlan", json!({"vlanId": 70}));
}
