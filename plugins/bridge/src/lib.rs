//! `bridge`: pods on a Linux bridge through veth pairs, with the reference
//! plugin's options and result shape.

mod conf;
mod spoofchk;

use conf::Conf;
use ipnetwork::IpNetwork;
use rcni_attach::check;
use rcni_attach::masq::Masq;
use rcni_attach::{
    Attachment, Dad, Namespaces, configure_iface, delete_veth, enable_forwarding, finish_add,
    interface, ipam_config, random_veth_name, rt, sandbox, start_ipam_add, sysctl_best_effort,
};
use rcni_cni::first_error;
use rcni_cni::rollback::Rollback;
use rcni_cni::skel::{About, CmdArgs};
use rcni_cni::{CniError, CniResult, Route};
use rcni_netlink::{Link, MacAddr, Netlink};
use rcni_netns::NetNs;
use spoofchk::Spoofchk;
use std::net::IpAddr;
use std::time::Duration;

pub struct Bridge;

/// Interface indexes in the result, as the reference lays them out.
const IDX_CONTAINER: usize = 2;

/// The first address of the subnet, the reference's default gateway.
fn first_host(net: &IpNetwork) -> IpAddr {
    match net.network() {
        IpAddr::V4(a) => IpAddr::V4((u32::from(a).wrapping_add(1)).into()),
        IpAddr::V6(a) => IpAddr::V6((u128::from(a).wrapping_add(1)).into()),
    }
}

fn default_dst(v4: bool) -> IpNetwork {
    if v4 {
        "0.0.0.0/0".parse().expect("valid")
    } else {
        "::/0".parse().expect("valid")
    }
}

/// Fills gateways and default routes as the reference's calcGateways does;
/// returns the gateway addresses (with the pod subnet's prefix) to put on the
/// bridge.
fn calc_gateways(result: &mut CniResult, conf: &Conf) -> Result<Vec<IpNetwork>, CniError> {
    let mut gws = Vec::new();
    let mut default_found = [false, false];
    for i in 0..result.ips.len() {
        let v4 = result.ips[i].address.is_ipv4();
        if result.ips[i].gateway.is_none() && conf.is_gateway {
            result.ips[i].gateway = Some(first_host(&result.ips[i].address));
        }
        let fam = usize::from(!v4);
        if conf.is_default_gateway && !default_found[fam] {
            let dst = default_dst(v4);
            default_found[fam] = result.routes.iter().any(|r| r.gw.is_some() && r.dst == dst);
            if !default_found[fam] {
                result.routes.push(Route::new(dst, result.ips[i].gateway));
                default_found[fam] = true;
            }
        }
        if conf.is_gateway
            && let Some(gw) = result.ips[i].gateway
        {
            let net = IpNetwork::new(gw, result.ips[i].address.prefix())
                .map_err(|e| CniError::internal(format!("gateway {gw}: {e}")))?;
            gws.push(net);
        }
    }
    Ok(gws)
}

/// Puts a gateway address on the bridge (or its vlan interface), replacing a
/// different one only with forceAddress, and pins the link's MAC; returns
/// the MAC pinned.
async fn ensure_gateway_addr(
    nl: &Netlink,
    link: &Link,
    gw: IpNetwork,
    force: bool,
) -> Result<MacAddr, CniError> {
    let addrs = nl.addresses(Some(link.index)).await?;
    let mut found = false;
    for a in addrs.iter().filter(|a| a.addr.is_ipv4() == gw.is_ipv4()) {
        if a.addr == gw {
            found = true;
            break;
        }
        // Several IPv6 addresses may share a bridge if their subnets do not
        // overlap; IPv4 gets one gateway address.
        let conflicts = gw.is_ipv4() || a.addr.contains(gw.ip()) || gw.contains(a.addr.ip());
        if conflicts {
            if !force {
                return Err(CniError::config(format!(
                    "{:?} already has an IP address different from {gw}",
                    link.name
                )));
            }
            nl.del_address(link.index, a.addr).await?;
        }
    }
    if !found {
        nl.ensure_address(link.index, gw).await?;
    }
    // Pin the MAC on every ADD, the address there already or not (v1.10.0;
    // v1.9.1 pinned only when it added the address): unpinned, a bridge
    // takes its lowest port's MAC, so it changes as pods come and go, and
    // turns all-zero when its last port leaves. `link` was read before this
    // ADD's port joined: its MAC is the one the pods already there know the
    // gateway by.
    let mac = mac_to_pin(link.mac);
    nl.set_mac(link.index, mac).await?;
    Ok(mac)
}

/// The MAC read before the port joined; an all-zero one (or none) replaced
/// by a random locally administered unicast one, as the kernel makes them:
/// no neighbour can hold the old one, the bridge had no port.
fn mac_to_pin(cached: Option<MacAddr>) -> MacAddr {
    cached
        .filter(|m| m.0 != [0; 6])
        .unwrap_or_else(MacAddr::random_local)
}

/// How a host veth joins the bridge.
struct PortOptions<'a> {
    hairpin: bool,
    isolated: bool,
    preserve_default_vlan: bool,
    /// Access VLAN (0: none).
    vlan: u16,
    trunk: &'a [u16],
}

impl<'a> PortOptions<'a> {
    fn of(conf: &'a Conf) -> Self {
        PortOptions {
            hairpin: conf.hairpin,
            isolated: conf.port_isolation,
            preserve_default_vlan: conf.preserve_default_vlan,
            vlan: conf.vlan,
            trunk: &conf.trunk,
        }
    }
}

/// An IPv6 devconf value the link reports as set (not 0); `None`, IPv6 off,
/// needs no write either.
fn on(v: Option<i32>) -> bool {
    v.is_some_and(|v| v != 0)
}

/// Enslaves the host veth, applies port flags and VLANs, and brings it up.
async fn setup_port(
    host: &Netlink,
    port: &Link,
    br: &Link,
    o: &PortOptions<'_>,
) -> Result<(), CniError> {
    host.set_master(port.index, br.index).await?;
    if o.hairpin || o.isolated {
        host.set_bridge_port(port.index, Some(o.hairpin), o.isolated.then_some(true))
            .await?;
    }
    if (o.vlan != 0 || !o.trunk.is_empty()) && !o.preserve_default_vlan {
        for (vid, _) in host.bridge_vlans(port.index).await? {
            host.bridge_vlan_del(port.index, vid).await?;
        }
    }
    if o.vlan != 0 {
        host.bridge_vlan_add(port.index, o.vlan, true).await?;
    }
    // The kernel updates an entry that exists: a trunk VLAN equal to `vlan`
    // ends tagged and without PVID, as with the reference (same order).
    for v in o.trunk {
        host.bridge_vlan_add(port.index, *v, false).await?;
    }
    // A trunk without `vlan` carries VLAN 1 untagged (upstream v1.8.0):
    // its native VLAN also where the default VLAN was removed above.
    if o.vlan == 0 && !o.trunk.is_empty() {
        host.bridge_vlan_add(port.index, 1, true).await?;
    }
    // A bridge port's own IPv6 stack never receives (the bridge takes its
    // frames), yet with a link-local address it sends DAD, router
    // solicitations and MLD reports into the pod, and each port's fe80::/64
    // route is one more sibling that every IPv6 route insertion on the node
    // walks under rtnl: at a thousand pods, most of an ADD. Best effort: a
    // node without IPv6 refuses it.
    let _ = host.set_ipv6_addr_gen_none(port.index).await;
    host.set_up(port.index).await?;
    Ok(())
}

/// `<bridge>.<vlan>`: a veth in the host namespace whose peer is an access
/// port of the VLAN, carrying the gateway address for that VLAN.
async fn ensure_vlan_interface(host: &Netlink, br: &Link, conf: &Conf) -> Result<Link, CniError> {
    let name = format!("{}.{}", br.name, conf.vlan);
    if let Some(l) = host.find_link(&name).await? {
        return Ok(l);
    }
    if name.len() > 15 {
        return Err(CniError::config(format!(
            "vlan gateway interface name {name:?} is longer than 15 bytes"
        )));
    }
    let peer = random_veth_name();
    let gw = host
        .create_veth(&name, &peer, None, (br.mtu > 0).then_some(br.mtu))
        .await?;
    let port = host.link_by_name(&peer).await?;
    // The gateway's own port: an access port of the VLAN, nothing else.
    let opts = PortOptions {
        hairpin: false,
        isolated: false,
        trunk: &[],
        ..PortOptions::of(conf)
    };
    setup_port(host, &port, br, &opts).await?;
    host.set_up(gw.index).await?;
    Ok(host.link_by_index(gw.index).await?)
}

/// The reference waits for the host port to come up (a bridge port can sit
/// in a transitional state); same schedule.
async fn wait_port_up(host: &Netlink, index: u32) -> Result<Link, CniError> {
    for (i, ms) in [0u64, 50, 500, 1000, 1000].iter().enumerate() {
        // tokio's timer wheel rounds even a zero sleep up to its next 1 ms tick.
        if *ms > 0 {
            tokio::time::sleep(Duration::from_millis(*ms)).await;
        }
        let l = host.link_by_index(index).await?;
        if l.oper_up {
            return Ok(l);
        }
        if i == 4 {
            return Err(CniError::internal(format!(
                "bridge port in error state: {} is not up",
                l.name
            )));
        }
    }
    unreachable!("the loop returns")
}

/// Whether the host veth `l` named in a prevResult is a port of our bridge.
async fn is_our_port(host: &Netlink, bridge: &str, l: &Link) -> Result<bool, CniError> {
    Ok(host
        .find_link(bridge)
        .await?
        .is_some_and(|br| l.master == Some(br.index)))
}

impl Attachment for Bridge {
    type Conf = Conf;

    fn about(&self) -> About {
        About::all_versions("bridge", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs, conf: &Conf) -> Result<CniResult, CniError> {
        if conf.ipam.is_none() {
            // An L2 result has no addresses, so no 0.1.0/0.2.0 form: refused
            // before any link is made (the reference fails converting its
            // result, after making them, and leaves them behind).
            CniResult::new(args.version()).to_value(args.version())?;
        }
        // IPAM runs alongside the link work below where it may (the
        // reference runs it after). Declared before the rollback: dropped
        // after it, so a failed ADD releases host-local's or static's
        // addresses after removing the links that used them (any other
        // IPAM, dhcp's included, releases first: `wait_into`).
        let mut ipam = start_ipam_add(conf.ipam.as_deref(), args);
        let ns = Namespaces::open(args)?;
        let mut undo = Rollback::new();

        // One runtime entry for the whole command: the synchronous steps in
        // between (sysctls, nft, IPAM's wait) block it as they blocked the
        // caller before, and nothing else runs on it meanwhile.
        let result = ns.rt.block_on(async {
            // A bridge not up yet gets its IPv6 sysctls before it comes up.
            // Its link-local address comes with its first carrier; were DAD
            // already running on it, it would stay tentative for a second or
            // two, and meanwhile the node sends no neighbour solicitation on
            // the bridge for forwarded IPv6 packets (the kernel wants a
            // link-local source that is not tentative): the first packets
            // from other nodes to the node's first pods wait or are lost.
            let br = ns
                .host
                .ensure_bridge_with(&conf.bridge, conf.mtu, conf.vlan_filtering, |br| {
                    let br_conf = format!("net/ipv6/conf/{}", br.name);
                    sysctl_best_effort(
                        &ns.host_ns,
                        &[
                            (format!("{br_conf}/accept_ra"), "0"),
                            (format!("{br_conf}/accept_dad"), "0"),
                        ],
                    );
                })
                .await?;
            if conf.promisc && !br.promisc {
                ns.host.set_promisc(br.index, true).await?;
            }
            // Written only where the link says otherwise (IPv6 on and not 0
            // yet): after the bridge's first pod, no /proc/sys open at all.
            let br_conf = format!("net/ipv6/conf/{}", br.name);
            let br_sysctls: Vec<(String, &str)> = [
                // We own the bridge's routes: router advertisements must not add any.
                (on(br.ipv6_accept_ra), format!("{br_conf}/accept_ra")),
                // The gateway address is ours by construction; DAD would only
                // leave it unusable ("tentative") for the first pod's first second.
                (on(br.ipv6_accept_dad), format!("{br_conf}/accept_dad")),
            ]
            .into_iter()
            .filter_map(|(w, k)| w.then_some((k, "0")))
            .collect();
            sysctl_best_effort(&ns.host_ns, &br_sysctls);

            let (host_veth, ct_veth) = ns
                .setup_pair(&mut undo, &args.ifname, conf.mtu, conf.link_type, "bridge")
                .await?;
            if let Some(mac) = conf.mac {
                ns.ct.set_mac(ct_veth.index, mac).await?;
            }
            setup_port(&ns.host, &host_veth, &br, &PortOptions::of(conf)).await?;

            if conf.mac_spoof_chk {
                let mac = conf.mac.or(ct_veth.mac).ok_or_else(|| {
                    CniError::internal(format!("{} has no MAC address", args.ifname))
                })?;
                let (rules, host_ns) =
                    (Spoofchk::of(&args.container_id, &args.ifname), &ns.host_ns);
                rules.setup(host_ns, &host_veth.name, mac)?;
                undo.push("macspoofchk rules", move || rules.teardown(host_ns));
            }
            let mut result = CniResult::new(args.version());
            if let Some(ipam) = &mut ipam {
                result = ipam_config(args.version(), ipam.wait_into(&mut undo)?, IDX_CONTAINER)?;
                let gws = calc_gateways(&mut result, conf)?;
                let ips: Vec<IpNetwork> = result.ips.iter().map(|i| i.address).collect();

                // DAD delays ADD by seconds; the reference turns it off unless
                // asked, and when asked waits for it (its SettleAddresses).
                let ifn = &args.ifname;
                let (dad, dad_sysctls) = if conf.enable_dad {
                    (
                        Dad::Wait,
                        vec![
                            (format!("net/ipv6/conf/{ifn}/enhanced_dad"), "1"),
                            (format!("net/ipv6/conf/{ifn}/accept_dad"), "1"),
                        ],
                    )
                } else {
                    let key = format!("net/ipv6/conf/{ifn}/accept_dad");
                    let dad_on = on(ct_veth.ipv6_accept_dad);
                    (
                        Dad::NoWait,
                        dad_on.then_some((key, "0")).into_iter().collect(),
                    )
                };
                sysctl_best_effort(&ns.ct_ns, &dad_sysctls);
                // Best effort as the reference's write of arp_notify.
                let _ = ns
                    .ct
                    .set_ipv4_devconf(ct_veth.index, &[(rcni_netlink::IPV4_DEVCONF_ARP_NOTIFY, 1)])
                    .await;
                let ct_link = ns.ct.link_by_index(ct_veth.index).await?;
                configure_iface(&ns.ct, &ns.ct_ns, &ct_link, &result, dad).await?;

                if conf.is_gateway && !gws.is_empty() {
                    let mut target = if conf.vlan != 0 {
                        let v = ensure_vlan_interface(&ns.host, &br, conf).await?;
                        result.interfaces.push(interface(&v, ""));
                        v
                    } else {
                        br.clone()
                    };
                    for gw in &gws {
                        // Dual-stack: the second family keeps the MAC the
                        // first pinned (a zero one is replaced only once).
                        target.mac = Some(
                            ensure_gateway_addr(&ns.host, &target, *gw, conf.force_address).await?,
                        );
                    }
                    enable_forwarding(&ns.host_ns, &gws)?;
                }
                if conf.ip_masq {
                    let m = Masq::of(&ns.host_ns, args, conf.ip_masq_backend.as_deref());
                    m.setup(&ips)?;
                    undo.push("masquerade rules", move || m.teardown());
                }
            } else if !conf.disable_container_interface {
                ns.ct.set_up(ct_veth.index).await?;
            }

            let host_veth = if conf.disable_container_interface {
                ns.host.link_by_index(host_veth.index).await?
            } else {
                wait_port_up(&ns.host, host_veth.index).await?
            };
            // The bridge's MAC may change when its first port joins.
            let br = ns.host.link_by_index(br.index).await?;
            let ct_veth = ns.ct.link_by_index(ct_veth.index).await?;
            let mut interfaces = vec![
                interface(&br, ""),
                interface(&host_veth, ""),
                interface(&ct_veth, &sandbox(args)),
            ];
            interfaces.append(&mut result.interfaces);
            result.interfaces = interfaces;
            Ok::<_, CniError>(result)
        })?;
        Ok(finish_add(result, args, undo, ipam))
    }

    fn del(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        let ipam = rcni_attach::start_ipam_del(conf.ipam.as_deref(), args);
        // Without the netns the kernel removes the veth only when it gets to
        // destroying the namespace; remove the host end now, by the name the
        // runtime recorded, if it is still our port. With no CNI_NETNS at
        // all, as the reference, only what lives outside the node's links.
        let prev = args.conf.prev_result().ok().flatten();
        let stale = prev.as_ref().filter(|_| args.netns.is_some());
        let links = rt().and_then(|rt| {
            rt.block_on(delete_veth(args, stale, async |host, l, _| {
                is_our_port(host, &conf.bridge, l).await
            }))
        });
        let ipam = rcni_attach::wait_ipam(ipam);
        let spoofchk = match conf.mac_spoof_chk {
            true => NetNs::current()
                .map_err(CniError::from)
                .and_then(|host_ns| {
                    Spoofchk::of(&args.container_id, &args.ifname).teardown(&host_ns)
                }),
            false => Ok(()),
        };
        // The rules are found by network and attachment: prevResult or not,
        // netns or not, they go (the reference leaks them without the netns).
        let masq = match conf.ip_masq && conf.ipam.is_some() {
            true => NetNs::current()
                .map_err(CniError::from)
                .and_then(|host_ns| {
                    Masq::of(&host_ns, args, conf.ip_masq_backend.as_deref()).teardown()
                }),
            false => Ok(()),
        };
        first_error([links, ipam, spoofchk, masq])
    }

    fn check(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        rcni_attach::delegate_ipam(conf.ipam.as_deref(), "CHECK", args)?;
        let prev = args.conf.required_prev_result(check::PREV_RESULT_MISSING)?;
        let ns = Namespaces::open(args)?;
        let sandbox = sandbox(args);
        let (host_veth, ct_mac) = ns.rt.block_on(async {
            let br_if = prev.interfaces.iter().find(|i| i.name == conf.bridge);
            let br = ns.host.find_link(&conf.bridge).await?.ok_or_else(|| {
                CniError::check_failed(format!(
                    "CNI created bridge {} in host namespace was not found",
                    conf.bridge
                ))
            })?;
            if br.kind.as_deref() != Some("bridge") {
                return Err(CniError::check_failed(format!(
                    "Interface {} does not have link type of bridge",
                    br.name
                )));
            }
            if let Some(bi) = br_if
                && !bi.mac.is_empty()
                && br.mac.map(|m| m.to_string()) != Some(bi.mac.clone())
            {
                return Err(CniError::check_failed(format!(
                    "Bridge interface {} Mac doesn't match: {}",
                    br.name, bi.mac
                )));
            }
            if br.promisc != conf.promisc {
                return Err(CniError::check_failed(format!(
                    "Bridge interface {} configured Promisc Mode {} doesn't match current state: {}",
                    br.name, conf.promisc, br.promisc
                )));
            }
            let ct_if = check::container_interface(&prev, &args.ifname, &sandbox)?;
            let ct_link = ns.ct.find_link(&args.ifname).await?.ok_or_else(|| {
                CniError::check_failed(format!(
                    "CNI created interface in container {} not found",
                    args.ifname
                ))
            })?;
            check::link_matches(&ct_link, ct_if, Some("veth"))?;
            // The host end: the container veth's peer, enslaved to the bridge.
            let missing = format!("CNI veth created for bridge {} was not found", conf.bridge);
            let host_veth = check::veth_peer(&ns.host, &ct_link, &missing).await?;
            if host_veth.master != Some(br.index) || host_veth.link != Some(ct_link.index) {
                return Err(CniError::check_failed(missing));
            }
            check::validate_ips(&ns.ct, &ct_link, &prev.ips, IDX_CONTAINER).await?;
            check::validate_routes(&ns.ct, &prev.routes).await?;
            Ok::<_, CniError>((host_veth.name, ct_link.mac))
        })?;
        if conf.mac_spoof_chk {
            let mac = ct_mac.ok_or_else(|| {
                CniError::check_failed(format!("{} has no MAC address", args.ifname))
            })?;
            Spoofchk::of(&args.container_id, &args.ifname).check(&ns.host_ns, &host_veth, mac)?;
        }
        if conf.ip_masq && conf.ipam.is_some() {
            let ips: Vec<IpNetwork> = prev.ips.iter().map(|i| i.address).collect();
            Masq::of(&ns.host_ns, args, conf.ip_masq_backend.as_deref()).check(&ips)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_mac_is_the_cached_one_or_a_random_local_unicast() {
        let m = MacAddr([0x0a, 0x58, 0x0a, 0, 0, 1]);
        assert_eq!(mac_to_pin(Some(m)), m);
        for cached in [Some(MacAddr([0; 6])), None] {
            let a = mac_to_pin(cached);
            assert!(a.0 != [0; 6] && a.is_local() && !a.is_multicast(), "{a}");
            assert_ne!(a, mac_to_pin(cached), "random each time");
        }
    }
}
