//! Kernel tests: need root. Every test works in anonymous namespaces held
//! only by fds, so all links, addresses and routes vanish with them, also
//! when a test fails. Root-namespace sysctls are only ever read.

use std::net::IpAddr;
use std::time::Duration;

use ipnetwork::IpNetwork;
use rcni_netlink::{
    Family, Link, MacAddr, MacvlanMode, NUD_REACHABLE, NUD_STALE, Netlink, Route, SCOPE_HOST,
    SCOPE_LINK, SCOPE_UNIVERSE, sysctl,
};
use rcni_netns::NetNs;
use rcni_testkit::{require_root, wait_for_async};

/// How long the kernel may take to reach a state on its own (carrier, ARP).
const SETTLE: Duration = Duration::from_secs(5);

async fn fresh() -> (NetNs, Netlink) {
    require_root();
    let ns = NetNs::new_anonymous().expect("new anonymous netns");
    let nl = Netlink::connect(&ns).await.expect("connect netlink");
    (ns, nl)
}

fn net(s: &str) -> IpNetwork {
    s.parse().unwrap()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[tokio::test]
async fn fresh_namespace_has_only_lo() {
    let (_ns, nl) = fresh().await;
    let links = nl.links().await.unwrap();
    assert_eq!(links.len(), 1, "{links:?}");
    let lo = &links[0];
    assert_eq!(lo.name, "lo");
    assert_eq!(lo.index, 1);
    assert!(lo.is_loopback);
    assert!(!lo.admin_up);
    assert_eq!(lo.kind, None);
    assert_eq!(lo.mac, Some(MacAddr([0; 6])));
    assert_eq!(lo.mtu, 65536);
    assert_eq!(lo.master, None);
    assert!(nl.addresses(None).await.unwrap().is_empty());
    assert!(nl.routes(Family::All).await.unwrap().is_empty());
    assert_eq!(nl.link_by_index(1).await.unwrap(), *lo);
    assert_eq!(nl.link_by_name("lo").await.unwrap(), *lo);
}

#[tokio::test]
async fn loopback_up_gets_addresses() {
    let (_ns, nl) = fresh().await;
    let lo = nl.link_by_name("lo").await.unwrap();
    nl.set_up(lo.index).await.unwrap();
    let lo = nl.link_by_name("lo").await.unwrap();
    assert!(lo.admin_up);
    assert!(lo.oper_up);

    let addrs = nl.addresses(Some(lo.index)).await.unwrap();
    let v4 = addrs.iter().find(|a| a.addr == net("127.0.0.1/8"));
    let v6 = addrs.iter().find(|a| a.addr == net("::1/128"));
    assert!(
        v4.is_some_and(|a| a.scope == SCOPE_HOST && a.index == 1),
        "{addrs:?}"
    );
    assert!(v6.is_some_and(|a| a.scope == SCOPE_HOST), "{addrs:?}");
    assert!(nl.addresses(Some(42)).await.unwrap().is_empty());

    nl.set_down(lo.index).await.unwrap();
    assert!(!nl.link_by_index(lo.index).await.unwrap().admin_up);
}

#[tokio::test]
async fn veth_across_namespaces() {
    let (ns_a, a) = fresh().await;
    let (ns_b, b) = fresh().await;

    let local = a
        .create_veth("veth-a", "veth-b", Some(&ns_b), Some(1400))
        .await
        .unwrap();
    assert_eq!(local.name, "veth-a");
    assert_eq!(local.kind.as_deref(), Some("veth"));
    assert_eq!(local.mtu, 1400);
    assert!(!local.admin_up);
    // The peer lives only in B.
    assert!(a.find_link("veth-b").await.unwrap().is_none());
    let peer = b.link_by_name("veth-b").await.unwrap();
    assert_eq!(peer.kind.as_deref(), Some("veth"));
    assert_eq!(peer.mtu, 1400);
    assert_eq!(
        local.link,
        Some(peer.index),
        "IFLA_LINK is the peer's index"
    );
    assert_eq!(peer.link, Some(local.index));
    assert!(b.find_link("veth-a").await.unwrap().is_none());

    // Rename (while down), MTU, MAC, alias, promisc, up.
    a.set_name(local.index, "eth-x").await.unwrap();
    assert!(a.find_link("veth-a").await.unwrap().is_none());
    a.set_mtu(local.index, 1300).await.unwrap();
    let mac: MacAddr = "02:11:22:33:44:55".parse().unwrap();
    a.set_mac(local.index, mac).await.unwrap();
    a.set_alias(local.index, "to b").await.unwrap();
    a.set_promisc(local.index, true).await.unwrap();
    a.set_up(local.index).await.unwrap();
    let l = a.link_by_name("eth-x").await.unwrap();
    assert_eq!(l.index, local.index);
    assert_eq!(l.mtu, 1300);
    assert_eq!(l.mac, Some(mac));
    assert_eq!(l.alias.as_deref(), Some("to b"));
    assert!(l.promisc);
    assert!(l.admin_up);
    assert!(!l.oper_up, "no carrier while the peer is down");

    // An MTU below the minimum is EINVAL: neither exists nor not-found.
    let err = a.set_mtu(local.index, 10).await.unwrap_err();
    assert_eq!(err.errno(), Some(libc::EINVAL), "{err}");
    assert!(!err.is_exists() && !err.is_not_found());
    assert_eq!(a.link_by_index(local.index).await.unwrap().mtu, 1300);

    b.set_up(peer.index).await.unwrap();
    wait_for_async(SETTLE, "carrier on eth-x", || async {
        a.link_by_index(local.index)
            .await
            .unwrap()
            .oper_up
            .then_some(())
    })
    .await;

    a.set_promisc(local.index, false).await.unwrap();
    assert!(!a.link_by_index(local.index).await.unwrap().promisc);

    // Move the peer from B into A.
    b.move_to_netns(peer.index, &ns_a).await.unwrap();
    assert!(b.find_link("veth-b").await.unwrap().is_none());
    let moved = a.link_by_name("veth-b").await.unwrap();
    assert!(!moved.admin_up, "a moved link arrives down");
    let l = a.link_by_index(local.index).await.unwrap();
    assert_eq!(l.link, Some(moved.index));
    assert_eq!(b.links().await.unwrap().len(), 1);

    // Deleting one end deletes the pair.
    assert!(a.ensure_link_deleted("eth-x").await.unwrap());
    assert!(a.find_link("veth-b").await.unwrap().is_none());
    assert!(!a.ensure_link_deleted("eth-x").await.unwrap());
    assert_eq!(a.links().await.unwrap().len(), 1);
}

#[tokio::test]
async fn veth_in_same_namespace() {
    let (_ns, nl) = fresh().await;
    let v = nl.create_veth("v0", "v1", None, None).await.unwrap();
    let p = nl.link_by_name("v1").await.unwrap();
    assert_eq!(v.link, Some(p.index));
    assert_eq!(v.mtu, 1500);
    let err = nl.create_veth("v0", "v2", None, None).await.unwrap_err();
    assert!(err.is_exists(), "{err}");
    assert_eq!(err.errno(), Some(libc::EEXIST));
}

#[tokio::test]
async fn bridge_create_ensure_and_ports() {
    let (_ns, nl) = fresh().await;
    let br = nl.create_bridge("br0", Some(1400)).await.unwrap();
    assert_eq!(br.kind.as_deref(), Some("bridge"));
    assert_eq!(br.mtu, 1400);
    assert!(!br.admin_up, "create_bridge leaves it down");

    let err = nl.create_bridge("br0", None).await.unwrap_err();
    assert!(err.is_exists(), "{err}");

    let ensured = nl.ensure_bridge("br0", Some(9000)).await.unwrap();
    assert_eq!(ensured.index, br.index);
    assert!(ensured.admin_up);
    assert_eq!(ensured.mtu, 1400, "an existing bridge keeps its MTU");
    let again = nl.ensure_bridge("br0", None).await.unwrap();
    assert_eq!(again.index, br.index);
    assert_eq!(nl.links().await.unwrap().len(), 2);

    let created = nl.ensure_bridge("br1", Some(1450)).await.unwrap();
    assert_eq!(created.kind.as_deref(), Some("bridge"));
    assert_eq!(created.mtu, 1450);
    assert!(created.admin_up);

    // A non-bridge of that name is an error, and is left alone.
    let v = nl
        .create_veth("notbr", "notbr-p", None, None)
        .await
        .unwrap();
    let err = nl.ensure_bridge("notbr", None).await.unwrap_err();
    assert!(err.to_string().contains("not a bridge"), "{err}");
    assert!(!err.is_exists() && !err.is_not_found());
    assert_eq!(
        nl.link_by_name("notbr").await.unwrap().kind.as_deref(),
        Some("veth")
    );

    nl.set_master(v.index, br.index).await.unwrap();
    assert_eq!(
        nl.link_by_index(v.index).await.unwrap().master,
        Some(br.index)
    );
    nl.set_nomaster(v.index).await.unwrap();
    assert_eq!(nl.link_by_index(v.index).await.unwrap().master, None);

    nl.delete_link(br.index).await.unwrap();
    assert!(nl.find_link("br0").await.unwrap().is_none());
    let err = nl.delete_link(br.index).await.unwrap_err();
    assert!(err.is_not_found(), "{err}");
}

#[tokio::test]
async fn macvlan_on_veth() {
    let (_ns, nl) = fresh().await;
    let lower = nl
        .create_veth("lower0", "lower1", None, None)
        .await
        .unwrap();
    let mv = nl
        .create_macvlan("mv0", lower.index, MacvlanMode::Bridge)
        .await
        .unwrap();
    assert_eq!(mv.kind.as_deref(), Some("macvlan"));
    assert_eq!(mv.link, Some(lower.index));
    assert_ne!(mv.mac, lower.mac);
    let err = nl
        .create_macvlan("mv1", 4242, MacvlanMode::Private)
        .await
        .unwrap_err();
    assert!(err.is_not_found(), "{err}");
}

#[tokio::test]
async fn addresses_add_ensure_del() {
    let (_ns, nl) = fresh().await;
    let v = nl.create_veth("a0", "a1", None, None).await.unwrap();
    nl.set_up(v.index).await.unwrap();

    let v4 = net("10.0.0.2/24");
    nl.add_address(v.index, v4).await.unwrap();
    let addrs = nl.addresses(Some(v.index)).await.unwrap();
    let found: Vec<_> = addrs.iter().filter(|a| a.addr.is_ipv4()).collect();
    assert_eq!(found.len(), 1, "{addrs:?}");
    assert_eq!(found[0].addr, v4, "host bits are kept");
    assert_eq!(found[0].scope, SCOPE_UNIVERSE);
    assert_eq!(found[0].index, v.index);

    // The kernel adds the connected route with the address.
    let routes = nl.routes(Family::V4).await.unwrap();
    let connected = routes
        .iter()
        .find(|r| r.dst == net("10.0.0.0/24"))
        .unwrap_or_else(|| panic!("no connected route in {routes:?}"));
    assert_eq!(connected.oif, Some(v.index));
    assert_eq!(connected.scope, SCOPE_LINK);
    assert_eq!(connected.src, Some(ip("10.0.0.2")));
    assert_eq!(connected.gateway, None);

    let err = nl.add_address(v.index, v4).await.unwrap_err();
    assert!(err.is_exists(), "{err}");
    assert_eq!(err.errno(), Some(libc::EEXIST));
    assert_eq!(err.cni_code(), 103);
    assert_eq!(
        err.to_string(),
        format!(
            "add address 10.0.0.2/24 to link {}: File exists (os error 17)",
            v.index
        )
    );
    nl.ensure_address(v.index, v4).await.unwrap();
    let count = |addrs: &[rcni_netlink::Address], a: IpNetwork| {
        addrs.iter().filter(|x| x.addr == a).count()
    };
    assert_eq!(count(&nl.addresses(Some(v.index)).await.unwrap(), v4), 1);

    let v6 = net("2001:db8::2/64");
    nl.ensure_address(v.index, v6).await.unwrap();
    nl.ensure_address(v.index, v6).await.unwrap();
    let addrs = nl.addresses(Some(v.index)).await.unwrap();
    assert_eq!(count(&addrs, v6), 1, "{addrs:?}");
    let all = nl.addresses(None).await.unwrap();
    assert_eq!(count(&all, v4), 1);

    nl.del_address(v.index, v4).await.unwrap();
    assert_eq!(count(&nl.addresses(Some(v.index)).await.unwrap(), v4), 0);
    let err = nl.del_address(v.index, v4).await.unwrap_err();
    assert!(err.is_not_found(), "{err}");
    assert_eq!(err.errno(), Some(libc::EADDRNOTAVAIL));
    nl.del_address(v.index, v6).await.unwrap();
    assert_eq!(count(&nl.addresses(Some(v.index)).await.unwrap(), v6), 0);

    let err = nl.add_address(4242, v4).await.unwrap_err();
    assert!(err.is_not_found(), "{err}");
}

#[tokio::test]
async fn routes_add_ensure_del() {
    let (_ns, nl) = fresh().await;
    let v = nl.create_veth("r0", "r1", None, None).await.unwrap();
    nl.set_up(v.index).await.unwrap();

    let on_v4 = |dst: &str| {
        let dst = net(dst);
        let nl = nl.clone();
        async move {
            nl.routes(Family::V4)
                .await
                .unwrap()
                .into_iter()
                .filter(|r| r.dst == dst)
                .collect::<Vec<Route>>()
        }
    };

    // A connected-style route, as plugins add for a /32 address.
    let link_route = Route::new(net("10.9.0.0/24"))
        .oif(v.index)
        .scope(SCOPE_LINK);
    nl.add_route(&link_route).await.unwrap();
    let got = on_v4("10.9.0.0/24").await;
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].oif, Some(v.index));
    assert_eq!(got[0].scope, SCOPE_LINK);
    assert_eq!(got[0].table, 254);
    let err = nl.add_route(&link_route).await.unwrap_err();
    assert!(err.is_exists(), "{err}");

    // A gateway route with a metric, resolved through the route above.
    let gw_route = Route::new(net("10.20.0.0/16"))
        .gateway(ip("10.9.0.1"))
        .oif(v.index)
        .metric(100);
    nl.add_route(&gw_route).await.unwrap();
    let got = on_v4("10.20.0.0/16").await;
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].gateway, Some(ip("10.9.0.1")));
    assert_eq!(got[0].metric, Some(100));
    assert_eq!(got[0].scope, SCOPE_UNIVERSE);
    assert_eq!(got[0].mtu, None);

    // ensure_route replaces the route with the same metric ...
    nl.ensure_route(&gw_route.clone().mtu(1400).advmss(1360))
        .await
        .unwrap();
    let got = on_v4("10.20.0.0/16").await;
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].mtu, Some(1400));
    assert_eq!(got[0].advmss, Some(1360));
    nl.ensure_route(&gw_route).await.unwrap();
    let got = on_v4("10.20.0.0/16").await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].mtu, None);
    // ... and adds one with another metric beside it.
    nl.ensure_route(&gw_route.clone().metric(200))
        .await
        .unwrap();
    let mut metrics: Vec<_> = on_v4("10.20.0.0/16")
        .await
        .iter()
        .map(|r| r.metric)
        .collect();
    metrics.sort();
    assert_eq!(metrics, [Some(100), Some(200)]);

    nl.del_route(&gw_route.clone().metric(200)).await.unwrap();
    let got = on_v4("10.20.0.0/16").await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].metric, Some(100));
    nl.del_route(&gw_route).await.unwrap();
    assert!(on_v4("10.20.0.0/16").await.is_empty());
    let err = nl.del_route(&gw_route).await.unwrap_err();
    assert!(err.is_not_found(), "{err}");
    assert_eq!(err.errno(), Some(libc::ESRCH));

    // Default route; host bits in the destination are masked.
    let default = Route::new(net("0.0.0.0/0")).gateway(ip("10.9.0.1"));
    nl.add_route(&default).await.unwrap();
    let got = on_v4("0.0.0.0/0").await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].gateway, Some(ip("10.9.0.1")));
    assert_eq!(got[0].oif, Some(v.index));
    nl.add_route(
        &Route::new(net("10.30.1.7/24"))
            .oif(v.index)
            .scope(SCOPE_LINK),
    )
    .await
    .unwrap();
    assert_eq!(on_v4("10.30.1.0/24").await.len(), 1);

    // Another table is not in routes(), but in routes_in_table().
    let t100 = Route::new(net("10.40.0.0/24"))
        .oif(v.index)
        .scope(SCOPE_LINK)
        .table(100);
    nl.add_route(&t100).await.unwrap();
    assert!(on_v4("10.40.0.0/24").await.is_empty());
    let in100 = nl.routes_in_table(Family::V4, Some(100)).await.unwrap();
    assert_eq!(in100.len(), 1, "{in100:?}");
    assert_eq!(in100[0].table, 100);
    let all = nl.routes_in_table(Family::All, None).await.unwrap();
    assert!(all.iter().any(|r| r.dst == net("10.40.0.0/24")));
    assert!(all.iter().any(|r| r.dst == net("10.9.0.0/24")));
    nl.del_route(&t100).await.unwrap();
    assert!(
        nl.routes_in_table(Family::V4, Some(100))
            .await
            .unwrap()
            .is_empty()
    );

    // Deleting ignores the scope, like `ip route del`.
    nl.del_route(&Route::new(net("10.9.0.0/24")).oif(v.index))
        .await
        .unwrap();
    assert!(on_v4("10.9.0.0/24").await.is_empty());

    // IPv6 device route with a metric and a table > 255.
    let r6 = Route::new(net("2001:db8:5::/64")).oif(v.index).metric(50);
    nl.add_route(&r6).await.unwrap();
    let got: Vec<_> = nl
        .routes(Family::V6)
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.dst == net("2001:db8:5::/64"))
        .collect();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].metric, Some(50));
    assert_eq!(got[0].oif, Some(v.index));
    assert!(
        nl.routes(Family::V4)
            .await
            .unwrap()
            .iter()
            .all(|r| r.dst.is_ipv4())
    );
    let big = Route::new(net("2001:db8:6::/64")).oif(v.index).table(1000);
    nl.add_route(&big).await.unwrap();
    let got = nl.routes_in_table(Family::V6, Some(1000)).await.unwrap();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].table, 1000);
    nl.del_route(&big).await.unwrap();
    nl.del_route(&r6).await.unwrap();
    let err = nl.del_route(&r6).await.unwrap_err();
    assert!(err.is_not_found(), "{err}");
}

#[tokio::test]
async fn neighbours_after_traffic() {
    let (_ns_a, a) = fresh().await;
    let (ns_b, b) = fresh().await;
    let va = a.create_veth("n0", "n1", Some(&ns_b), None).await.unwrap();
    let vb = b.link_by_name("n1").await.unwrap();
    a.add_address(va.index, net("10.5.0.1/24")).await.unwrap();
    b.add_address(vb.index, net("10.5.0.2/24")).await.unwrap();
    a.set_up(va.index).await.unwrap();
    b.set_up(vb.index).await.unwrap();
    wait_for_async(SETTLE, "carrier", || async {
        a.link_by_index(va.index)
            .await
            .unwrap()
            .oper_up
            .then_some(())
    })
    .await;

    // A datagram from A to B makes A resolve B's MAC over ARP.
    let ns_a = a.netns().try_clone().unwrap();
    ns_a.run(|| {
        let sock = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        sock.send_to(b"hi", "10.5.0.2:9").unwrap();
    })
    .unwrap();

    let entry = wait_for_async(SETTLE, "ARP entry for 10.5.0.2", || async {
        a.neighbours(Some(va.index))
            .await
            .unwrap()
            .into_iter()
            .find(|n| n.ip == ip("10.5.0.2") && n.mac.is_some())
    })
    .await;
    assert_eq!(entry.index, va.index);
    assert_eq!(entry.mac, vb.mac);
    assert!(
        entry.state & (NUD_REACHABLE | NUD_STALE) != 0,
        "state {:#x}",
        entry.state
    );
    assert!(
        a.neighbours(None)
            .await
            .unwrap()
            .iter()
            .any(|n| n.ip == ip("10.5.0.2"))
    );
    assert!(a.neighbours(Some(4242)).await.unwrap().is_empty());
}

#[tokio::test]
async fn sysctl_in_namespace_only() {
    require_root();
    let root = NetNs::current().unwrap();
    let root_before = sysctl::get(&root, "net.ipv4.ip_forward").unwrap();

    let ns = NetNs::new_anonymous().unwrap();
    assert_eq!(sysctl::get(&ns, "net.ipv4.ip_forward").unwrap(), "0");
    sysctl::set(&ns, "net.ipv4.ip_forward", "1").unwrap();
    assert_eq!(sysctl::get(&ns, "net.ipv4.ip_forward").unwrap(), "1");
    assert_eq!(
        sysctl::get(&root, "net.ipv4.ip_forward").unwrap(),
        root_before,
        "the root namespace must be untouched"
    );

    // Slash form, with an interface in the path.
    let key = "net/ipv4/conf/lo/arp_notify";
    assert_eq!(sysctl::get(&ns, key).unwrap(), "0");
    sysctl::set(&ns, key, "1").unwrap();
    assert_eq!(sysctl::get(&ns, key).unwrap(), "1");

    let err = sysctl::get(&ns, "net.ipv4.conf.nope0.forwarding").unwrap_err();
    assert!(err.is_not_found(), "{err}");
    let err = sysctl::set(&ns, "net/../kernel/hostname", "x").unwrap_err();
    assert!(err.to_string().contains("invalid key"), "{err}");
}

#[tokio::test]
async fn sysctl_set_each_writes_all_and_reports_each() {
    require_root();
    let root = NetNs::current().unwrap();
    let root_before = sysctl::get(&root, "net.ipv4.ip_forward").unwrap();
    let ns = NetNs::new_anonymous().unwrap();
    let r = sysctl::set_each(
        &ns,
        &[
            ("net.ipv4.ip_forward", "1"),
            ("net/ipv4/conf/nope0/arp_notify", "1"),
            ("net/ipv4/conf/lo/arp_notify", "1"),
        ],
    );
    assert!(r[0].is_ok() && r[2].is_ok(), "{r:?}");
    assert!(r[1].as_ref().unwrap_err().is_not_found(), "{r:?}");
    // The failing key in the middle did not stop the last one.
    assert_eq!(sysctl::get(&ns, "net.ipv4.ip_forward").unwrap(), "1");
    assert_eq!(
        sysctl::get(&ns, "net/ipv4/conf/lo/arp_notify").unwrap(),
        "1"
    );
    assert_eq!(
        sysctl::get(&root, "net.ipv4.ip_forward").unwrap(),
        root_before
    );
}

#[tokio::test]
async fn missing_links_are_not_found() {
    let (_ns, nl) = fresh().await;
    let err = nl.link_by_name("nope0").await.unwrap_err();
    assert!(err.is_not_found(), "{err}");
    assert_eq!(err.errno(), Some(libc::ENODEV));
    assert_eq!(err.cni_code(), 103);
    assert_eq!(
        err.to_string(),
        "get link nope0: No such device (os error 19)"
    );
    let err = nl
        .link_by_name("a-name-longer-than-ifnamsiz")
        .await
        .unwrap_err();
    assert!(err.is_not_found(), "{err}");
    let err = nl.link_by_index(4242).await.unwrap_err();
    assert!(err.is_not_found(), "{err}");
    assert_eq!(err.errno(), Some(libc::ENODEV));
    assert!(nl.find_link("nope0").await.unwrap().is_none());
    assert!(!nl.ensure_link_deleted("nope0").await.unwrap());
    for err in [
        nl.delete_link(4242).await.unwrap_err(),
        nl.set_up(4242).await.unwrap_err(),
        nl.set_mtu(4242, 1400).await.unwrap_err(),
        nl.set_master(4242, 1).await.unwrap_err(),
    ] {
        assert!(err.is_not_found(), "{err}");
    }
}

#[tokio::test]
async fn connections_are_per_namespace() {
    let (ns_a, a) = fresh().await;
    let (_ns_b, b) = fresh().await;
    a.create_bridge("only-a", None).await.unwrap();
    assert!(b.find_link("only-a").await.unwrap().is_none());
    assert!(a.netns().same_as(&ns_a));
    // A second connection to the same namespace sees the same state.
    let a2 = Netlink::connect(&ns_a).await.unwrap();
    assert!(a2.find_link("only-a").await.unwrap().is_some());
}

#[test]
fn sync_runtime_and_connect_current() {
    require_root();
    let ns = NetNs::new_anonymous().unwrap();
    // connect_current() talks to the calling thread's namespace.
    let links: Vec<Link> = ns
        .run(|| {
            let rt = rcni_netlink::runtime().unwrap();
            rt.block_on(async {
                let nl = Netlink::connect_current().await.unwrap();
                nl.create_bridge("cur0", None).await.unwrap();
                nl.links().await.unwrap()
            })
        })
        .unwrap();
    let names: Vec<_> = links.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["lo", "cur0"]);

    // Without a runtime, connect fails cleanly instead of panicking.
    let err = futures::executor::block_on(Netlink::connect(&ns)).unwrap_err();
    assert!(err.to_string().contains("no tokio runtime"), "{err}");
    assert_eq!(err.cni_code(), 100);
}

#[tokio::test]
async fn delete_link_unlisted_frees_both_ends_and_reports_refusals() {
    let (ns_b, b) = fresh().await;
    let (_ns_a, a) = fresh().await;
    let v = a
        .create_veth("eth0", "h0", Some(&ns_b), None)
        .await
        .unwrap();
    let p = b.link_by_name("h0").await.unwrap();
    a.set_up(v.index).await.unwrap();
    b.set_up(p.index).await.unwrap();

    a.delete_link_unlisted(v.index).await.unwrap();
    // Gone from view in both namespaces on return: the names are free.
    assert!(a.find_link("eth0").await.unwrap().is_none());
    assert!(b.find_link("h0").await.unwrap().is_none());
    a.create_veth("eth0", "h0", Some(&ns_b), None)
        .await
        .expect("the names are free again at once");

    // One already gone is gone.
    a.delete_link_unlisted(v.index).await.unwrap();
    // The kernel refuses to delete lo: its answer reaches the caller.
    let lo = a.link_by_name("lo").await.unwrap();
    let err = a.delete_link_unlisted(lo.index).await.unwrap_err();
    assert_eq!(err.errno(), Some(libc::EOPNOTSUPP), "{err}");
    assert!(a.find_link("lo").await.unwrap().is_some());
}

#[tokio::test]
async fn devconf_over_netlink_matches_the_sysctl_files() {
    let (ns, nl) = fresh().await;
    let v = nl.create_veth("v0", "v1", None, None).await.unwrap();
    let key = |k: &str| format!("net/ipv4/conf/v0/{k}");
    assert_eq!(sysctl::get(&ns, &key("arp_notify")).unwrap(), "0");
    nl.set_ipv4_devconf(v.index, &[(rcni_netlink::IPV4_DEVCONF_ARP_NOTIFY, 1)])
        .await
        .unwrap();
    assert_eq!(sysctl::get(&ns, &key("arp_notify")).unwrap(), "1");
    // Only the value named changes.
    assert_eq!(sysctl::get(&ns, &key("forwarding")).unwrap(), "0");

    // The link reports the IPv6 values the files hold.
    let dad = sysctl::get(&ns, "net/ipv6/conf/v0/accept_dad").unwrap();
    let l = nl.link_by_index(v.index).await.unwrap();
    assert_eq!(l.ipv6_accept_dad, Some(dad.parse().unwrap()));
    let res = sysctl::set_each(
        &ns,
        &[
            ("net/ipv6/conf/v0/accept_dad", "0"),
            ("net/ipv6/conf/v0/accept_ra", "0"),
            ("net/ipv6/conf/nosuch/accept_ra", "0"),
        ],
    );
    assert!(res[0].is_ok() && res[1].is_ok(), "{res:?}");
    assert!(res[2].as_ref().unwrap_err().is_not_found(), "{res:?}");
    let l = nl.link_by_index(v.index).await.unwrap();
    assert_eq!((l.ipv6_accept_dad, l.ipv6_accept_ra), (Some(0), Some(0)));
}

#[tokio::test]
async fn forwarding_over_netconf_matches_the_sysctl_files() {
    let (ns, _nl) = fresh().await;
    use rcni_netlink::netconf::forwarding;
    assert!(!forwarding(&ns, Family::V4).unwrap());
    assert!(!forwarding(&ns, Family::V6).unwrap());
    sysctl::set(&ns, "net/ipv4/ip_forward", "1").unwrap();
    assert!(forwarding(&ns, Family::V4).unwrap());
    assert!(!forwarding(&ns, Family::V6).unwrap());
    sysctl::set(&ns, "net/ipv6/conf/all/forwarding", "1").unwrap();
    assert!(forwarding(&ns, Family::V6).unwrap());
}

/// What a cross-node agent programs on a VXLAN device: owned routes (only
/// its protocol's, only the main table), permanent neighbours, FDB entries.
#[tokio::test]
async fn overlay_routes_neighbours_and_fdb() {
    use rcni_netlink::overlay::{FdbEntry, OwnedRoute, VxlanSpec};
    const PROTO: u8 = 199;
    let (_ns, nl) = fresh().await;
    let under = nl.create_veth("u0", "u1", None, None).await.unwrap();
    nl.add_address(under.index, net("192.168.77.1/24"))
        .await
        .unwrap();
    nl.set_up(under.index).await.unwrap();
    let mac: MacAddr = "02:00:00:00:77:01".parse().unwrap();
    let spec = VxlanSpec {
        name: "vx0".into(),
        vni: 7,
        port: 8472,
        local: ip("192.168.77.1"),
        dev: under.index,
        mtu: 1450,
        mac,
    };
    nl.create_vxlan(&spec).await.unwrap();
    let vx = nl.link_by_name("vx0").await.unwrap();
    assert_eq!(vx.mac, Some(mac));
    let info = nl.vxlan_info(vx.index).await.unwrap().unwrap();
    assert!(info.matches(&spec), "{info:?}");
    assert_eq!(nl.vxlan_info(under.index).await.unwrap(), None);
    nl.set_up(vx.index).await.unwrap();

    // Owned routes: onlink via the peer's VTEP address.
    let r = OwnedRoute {
        dst: net("10.244.3.0/24"),
        gateway: Some(ip("10.244.3.0")),
        oif: Some(vx.index),
        onlink: true,
    };
    nl.replace_owned_route(&r, PROTO).await.unwrap();
    nl.replace_owned_route(&r, PROTO).await.unwrap();
    // Another program's route, and one in another table: not ours.
    nl.add_route(
        &Route::new(net("10.245.0.0/24"))
            .oif(vx.index)
            .scope(SCOPE_LINK),
    )
    .await
    .unwrap();
    assert_eq!(
        nl.owned_routes(false, PROTO).await.unwrap(),
        std::slice::from_ref(&r)
    );
    assert!(nl.owned_routes(true, PROTO).await.unwrap().is_empty());
    assert!(nl.owned_routes(false, PROTO + 1).await.unwrap().is_empty());
    // A route of another protocol is not deleted as ours.
    let theirs = OwnedRoute {
        dst: net("10.245.0.0/24"),
        gateway: None,
        oif: Some(vx.index),
        onlink: false,
    };
    let err = nl.del_owned_route(&theirs, PROTO).await.unwrap_err();
    assert!(err.is_not_found(), "{err}");
    nl.del_owned_route(&r, PROTO).await.unwrap();
    assert!(nl.owned_routes(false, PROTO).await.unwrap().is_empty());
    let err = nl.del_owned_route(&r, PROTO).await.unwrap_err();
    assert!(err.is_not_found(), "{err}");

    // Permanent neighbours, IPv4 and IPv6.
    let peer: MacAddr = "02:00:00:00:77:02".parse().unwrap();
    for addr in [ip("10.244.3.0"), ip("fd00:244:3::")] {
        nl.replace_permanent_neighbour(vx.index, addr, peer)
            .await
            .unwrap();
        nl.replace_permanent_neighbour(vx.index, addr, peer)
            .await
            .unwrap();
    }
    let ns: Vec<_> = nl.neighbours(Some(vx.index)).await.unwrap();
    for addr in [ip("10.244.3.0"), ip("fd00:244:3::")] {
        let n = ns.iter().find(|n| n.ip == addr).expect("neighbour");
        assert_eq!(n.mac, Some(peer));
        assert_eq!(n.state, rcni_netlink::NUD_PERMANENT);
        nl.del_neighbour(vx.index, addr).await.unwrap();
        let err = nl.del_neighbour(vx.index, addr).await.unwrap_err();
        assert!(err.is_not_found(), "{err}");
    }

    // FDB entries toward two remotes, deleted one at a time.
    nl.replace_fdb(vx.index, peer, ip("192.168.77.2"))
        .await
        .unwrap();
    let other: MacAddr = "02:00:00:00:77:03".parse().unwrap();
    nl.replace_fdb(vx.index, other, ip("192.168.77.3"))
        .await
        .unwrap();
    let mut fdb = nl.fdb_entries(vx.index).await.unwrap();
    fdb.sort();
    let want = [
        FdbEntry {
            mac: peer,
            dst: Some(ip("192.168.77.2")),
        },
        FdbEntry {
            mac: other,
            dst: Some(ip("192.168.77.3")),
        },
    ];
    assert!(want.iter().all(|w| fdb.contains(w)), "{fdb:?}");
    nl.del_fdb(vx.index, peer, Some(ip("192.168.77.2")))
        .await
        .unwrap();
    let fdb = nl.fdb_entries(vx.index).await.unwrap();
    assert!(!fdb.contains(&want[0]) && fdb.contains(&want[1]), "{fdb:?}");
    let err = nl
        .del_fdb(vx.index, peer, Some(ip("192.168.77.2")))
        .await
        .unwrap_err();
    assert!(err.is_not_found(), "{err}");
}
