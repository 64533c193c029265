//! Kernel tests (root) of what enslaving a link to a VRF needs and this
//! host's kernel has: addresses put back with their flags, host routes
//! looked up in a table whatever their type. VRF devices themselves need
//! the vrf module: the vrf plugin's VM tests cover them.

use rcni_netlink::{Family, Netlink};
use rcni_netns::NetNs;
use rcni_testkit::{require_root, wait_for_async};
use std::time::Duration;

/// IFA_F_NODAD, IFA_F_TENTATIVE, IFA_F_PERMANENT.
const NODAD: u32 = 0x02;
const TENTATIVE: u32 = 0x40;
const PERMANENT: u32 = 0x80;

async fn fresh() -> (NetNs, Netlink) {
    require_root();
    let ns = NetNs::new_anonymous().expect("new anonymous netns");
    let nl = Netlink::connect(&ns).await.expect("connect netlink");
    (ns, nl)
}

#[tokio::test]
async fn addresses_come_back_with_their_flags() {
    let (_ns, nl) = fresh().await;
    let v = nl.create_veth("v0", "v1", None, None).await.unwrap();
    nl.add_address_nodad(v.index, "fd05::5/64".parse().unwrap())
        .await
        .unwrap();
    nl.add_address(v.index, "fd06::6/64".parse().unwrap())
        .await
        .unwrap();
    let listed = nl.addresses_with_flags(v.index, Family::V6).await.unwrap();
    let flags = |a: &str| {
        listed
            .iter()
            .find(|(x, _)| x.addr.to_string() == a)
            .map(|(_, f)| *f)
            .unwrap()
    };
    assert_eq!(flags("fd05::5/64") & (NODAD | PERMANENT), NODAD | PERMANENT);
    // A link that is down does no DAD yet: tentative until it is up.
    assert_eq!(flags("fd06::6/64") & (NODAD | TENTATIVE), TENTATIVE);
    assert!(
        nl.addresses_with_flags(v.index, Family::V4)
            .await
            .unwrap()
            .is_empty()
    );

    // Put back as listed: nodad kept; the state flags are not requests.
    for (a, f) in &listed {
        nl.del_address(v.index, a.addr).await.unwrap();
        nl.add_address_with_flags(v.index, a.addr, *f)
            .await
            .unwrap();
    }
    let nodad_of = |v: &[(rcni_netlink::Address, u32)]| {
        let mut v: Vec<(String, u32)> = v
            .iter()
            .map(|(a, f)| (a.addr.to_string(), f & NODAD))
            .collect();
        v.sort();
        v
    };
    let again = nl.addresses_with_flags(v.index, Family::V6).await.unwrap();
    assert_eq!(nodad_of(&again), nodad_of(&listed));
}

#[tokio::test]
async fn host_routes_of_any_type_in_a_table() {
    let (_ns, nl) = fresh().await;
    let v = nl.create_veth("v0", "v1", None, None).await.unwrap();
    let peer = nl.link_by_name("v1").await.unwrap();
    nl.add_address_nodad(v.index, "fd05::5/64".parse().unwrap())
        .await
        .unwrap();
    nl.add_address(v.index, "10.5.0.5/24".parse().unwrap())
        .await
        .unwrap();
    let ip6 = "fd05::5".parse().unwrap();
    let ip4 = "10.5.0.5".parse().unwrap();
    nl.set_up(peer.index).await.unwrap();
    nl.set_up(v.index).await.unwrap();
    // `local` routes, in the local table (a VRF's own table when enslaved).
    // The IPv6 one comes with the link up from addrconf's work queue, a
    // moment after the request returns.
    wait_for_async(
        Duration::from_secs(5),
        "the local route of fd05::5",
        || async {
            nl.has_host_route(ip6, 255, v.index)
                .await
                .unwrap()
                .then_some(())
        },
    )
    .await;
    assert!(nl.has_host_route(ip4, 255, v.index).await.unwrap());
    assert!(!nl.has_host_route(ip6, 254, v.index).await.unwrap());
    assert!(!nl.has_host_route(ip6, 255, peer.index).await.unwrap());
    assert!(
        !nl.has_host_route("fd05::6".parse().unwrap(), 255, v.index)
            .await
            .unwrap()
    );
}
