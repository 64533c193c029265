//! `ptp`: a veth pair per container and routes instead of a bridge, with
//! the reference plugin's kernel layout and result shape.
//!
//! Container side: the IPAM address with its prefix, but the connected
//! subnet route replaced by a link route to the gateway and `subnet via
//! gateway`, so that every packet leaves through the gateway (a veth cannot
//! be IFF_POINTTOPOINT). Host side: the gateway address as /32 (/128) on the
//! host veth (the same address on every pod's veth) and a /32 (/128) route
//! to the container address through it.

mod conf;

use conf::Conf;
use ipnetwork::IpNetwork;
use rcni_attach::check;
use rcni_attach::masq::Masq;
use rcni_attach::{
    Attachment, Dad, Namespaces, configure_iface, delete_veth, enable_forwarding,
    ensure_ifname_free, finish_add, interface, ipam_config, rt, sandbox, sysctl_best_effort,
};
use rcni_cni::first_error;
use rcni_cni::invoke::PendingAdd;
use rcni_cni::rollback::Rollback;
use rcni_cni::skel::{About, CmdArgs};
use rcni_cni::{CniError, CniResult, subnet};
use rcni_netlink::{Family, Link, Netlink, Route, SCOPE_HOST, SCOPE_LINK};
use rcni_netns::NetNs;
use std::net::IpAddr;

pub struct Ptp;

/// Interface indexes in the result, as the reference lays them out.
const IDX_HOST: usize = 0;
const IDX_CONTAINER: usize = 1;

/// `ip/32` or `ip/128`.
fn host_prefix(ip: IpAddr) -> IpNetwork {
    IpNetwork::new(ip, if ip.is_ipv4() { 32 } else { 128 }).expect("full-length prefix")
}

/// (address, gateway) of every IP; ptp routes everything through the
/// gateway, so an IPAM result without one cannot be applied.
fn addresses_with_gateways(result: &CniResult) -> Result<Vec<(IpNetwork, IpAddr)>, CniError> {
    result
        .ips
        .iter()
        .map(|ip| match ip.gateway {
            Some(gw) if gw.is_ipv4() == ip.address.is_ipv4() => Ok((ip.address, gw)),
            _ => Err(CniError::config(format!(
                "IPAM returned no gateway of the same family for {}: ptp routes the container through it",
                ip.address
            ))),
        })
        .collect()
}

/// The container routes that replace the connected subnet route.
fn container_routes(index: u32, addr: &IpNetwork, gw: IpAddr) -> [Route; 2] {
    [
        Route::new(host_prefix(gw))
            .oif(index)
            .scope(SCOPE_LINK)
            .src(addr.ip()),
        Route::new(subnet(addr))
            .oif(index)
            .gateway(gw)
            .src(addr.ip()),
    ]
}

/// The host route to a container address (scope host, as the reference's
/// `AddHostRoute`, so both suites leave the same table).
fn host_route(index: u32, addr: &IpNetwork) -> Route {
    Route::new(host_prefix(addr.ip()))
        .oif(index)
        .scope(SCOPE_HOST)
}

async fn setup_container_routes(
    ct: &Netlink,
    link: &Link,
    ips: &[(IpNetwork, IpAddr)],
) -> Result<(), CniError> {
    for (addr, gw) in ips {
        let connected = Route::new(subnet(addr)).oif(link.index);
        match ct.del_route(&connected).await {
            Err(e) if !e.is_not_found() => return Err(e.into()),
            _ => {}
        }
        for r in container_routes(link.index, addr, *gw) {
            match ct.add_route(&r).await {
                Err(e) if !e.is_exists() => return Err(e.into()),
                _ => {}
            }
        }
    }
    Ok(())
}

async fn setup_host_veth(
    host: &Netlink,
    veth: &Link,
    ips: &[(IpNetwork, IpAddr)],
) -> Result<(), CniError> {
    for (addr, gw) in ips {
        host.ensure_address_nodad(veth.index, host_prefix(*gw))
            .await?;
        match host.add_route(&host_route(veth.index, addr)).await {
            Err(e) if !e.is_exists() => return Err(e.into()),
            _ => {}
        }
    }
    Ok(())
}

/// Whether the host veth `l` named in a prevResult is the attachment's: it
/// carries one of the result's gateways. DEL removes it when the container
/// end is out of reach, or the host routes would send a reused address to
/// the dead pod until the kernel gets to destroying the namespace.
async fn holds_gateway_of(host: &Netlink, l: &Link, prev: &CniResult) -> Result<bool, CniError> {
    let gws: Vec<IpNetwork> = prev
        .ips
        .iter()
        .filter_map(|i| i.gateway.map(host_prefix))
        .collect();
    let addrs = host.addresses(Some(l.index)).await?;
    Ok(addrs.iter().any(|a| gws.contains(&a.addr)))
}

impl Attachment for Ptp {
    type Conf = Conf;

    fn about(&self) -> About {
        About::all_versions("ptp", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs, conf: &Conf) -> Result<CniResult, CniError> {
        let ipam = conf.required_ipam()?;
        let ns = Namespaces::open(args)?;
        // Before IPAM: a repeated ADD finds its interface there and must not
        // cost (or, undone, release) the reservation the first one holds.
        ns.rt.block_on(ensure_ifname_free(&ns.ct, &args.ifname))?;
        // IPAM runs alongside the link work where it may (the reference
        // runs it first). Declared before the rollback: dropped after it, so a failed ADD
        // releases its addresses after removing the links that used them.
        let mut ipam = PendingAdd::start(ipam, &args.stdin, &args.path, args.version());
        let mut undo = Rollback::new();

        let (host_veth, ct_veth) = ns.rt.block_on(ns.setup_pair(
            &mut undo,
            &args.ifname,
            conf.mtu,
            conf.link_type,
            "ptp",
        ))?;

        let mut result = ipam_config(args.version(), ipam.wait_into(&mut undo)?, IDX_CONTAINER)?;
        let ips = addresses_with_gateways(&result)?;
        let addrs: Vec<IpNetwork> = ips.iter().map(|(a, _)| *a).collect();

        // Set before the links go up, so after IPAM: what the host veth
        // needs depends on the families it gave.
        let hv = &host_veth.name;
        if addrs.iter().any(|a| a.is_ipv6()) {
            // Both ends own their addresses by construction, so no duplicate
            // address detection: the global addresses are added without it (a
            // tentative address is no route source), and the link-local ones
            // must not wait for it either, because the kernel sends no
            // neighbour solicitation while a link's link-local address is
            // tentative (the reference's pods cannot reach each other over
            // IPv6 for a second or two after ADD). Router advertisements must
            // not add routes to what the plugin routes itself.
            sysctl_best_effort(
                &ns.host_ns,
                &[
                    (format!("net/ipv6/conf/{hv}/accept_ra"), "0"),
                    (format!("net/ipv6/conf/{hv}/accept_dad"), "0"),
                ],
            );
            let key = format!("net/ipv6/conf/{}/accept_dad", args.ifname);
            sysctl_best_effort(&ns.ct_ns, &[(key, "0")]);
        } else {
            // An IPv4-only pod's host veth carries no IPv6: with it, each
            // gets a link-local address and a fe80::/64 and ff00::/8 route
            // in the node's IPv6 table, and every link going up or down on
            // the node walks that whole table under the RTNL lock
            // (fib6_ifup, fib6_ifdown), so each ADD and DEL slows with the
            // pods already there (ADD 2.0x at 1000 pods against 10,
            // bench/ptpscale.sh). Nothing is routed over it: the pod's
            // routes are IPv4, and it takes no router advertisement from the
            // pod either.
            sysctl_best_effort(
                &ns.host_ns,
                &[(format!("net/ipv6/conf/{hv}/disable_ipv6"), "1")],
            );
        }
        ns.rt.block_on(ns.host.set_up(host_veth.index))?;

        enable_forwarding(&ns.host_ns, &addrs)
            .map_err(|e| e.context("Could not enable IP forwarding"))?;
        ns.rt.block_on(async {
            configure_iface(&ns.ct, &ns.ct_ns, &ct_veth, &result, Dad::Skip).await?;
            setup_container_routes(&ns.ct, &ct_veth, &ips).await?;
            setup_host_veth(&ns.host, &host_veth, &ips).await
        })?;

        if conf.ip_masq {
            let m = Masq::of(&ns.host_ns, args, conf.ip_masq_backend.as_deref());
            m.setup(&addrs)?;
            undo.push("masquerade rules", move || m.teardown());
        }

        let sandbox = sandbox(args);
        let (host_veth, ct_veth) = ns.rt.block_on(async {
            Ok::<_, CniError>((
                ns.host.link_by_index(host_veth.index).await?,
                ns.ct.link_by_index(ct_veth.index).await?,
            ))
        })?;
        result.interfaces = vec![interface(&host_veth, ""), interface(&ct_veth, &sandbox)];
        Ok(finish_add(result, args, undo, Some(ipam)))
    }

    /// IPAM's release alongside the link's removal, then the masquerade
    /// rules; each step runs even if another failed, and IPAM's failure is
    /// reported first (the reference releases first).
    fn del(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        let ipam = rcni_attach::start_ipam_del(conf.ipam.as_deref(), args);
        let prev = args.conf.prev_result().ok().flatten();
        let links =
            rt().and_then(|rt| rt.block_on(delete_veth(args, prev.as_ref(), holds_gateway_of)));
        let ipam = rcni_attach::wait_ipam(ipam);
        let masq = match conf.ip_masq {
            true => NetNs::current()
                .map_err(CniError::from)
                .and_then(|host_ns| {
                    Masq::of(&host_ns, args, conf.ip_masq_backend.as_deref()).teardown()
                }),
            false => Ok(()),
        };
        first_error([ipam, links, masq])
    }

    fn check(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        rcni_attach::delegate_ipam(Some(conf.required_ipam()?), "CHECK", args)?;
        let prev = args.conf.required_prev_result(check::PREV_RESULT_MISSING)?;
        let ns = Namespaces::open(args)?;
        let ct_if = check::container_interface(&prev, &args.ifname, &sandbox(args))?;
        let ips = addresses_with_gateways(&prev).map_err(|e| CniError::check_failed(e.msg))?;
        ns.rt.block_on(async {
            let link = check::validate_link(&ns.ct, ct_if, Some("veth")).await?;
            check::validate_ips(&ns.ct, &link, &prev.ips, IDX_CONTAINER).await?;
            check::validate_routes(&ns.ct, &prev.routes).await?;
            let routes = ns.ct.routes(Family::All).await?;
            for (addr, gw) in &ips {
                for want in container_routes(link.index, addr, *gw) {
                    if !routes.iter().any(|r| {
                        r.dst == want.dst && r.gateway == want.gateway && r.oif == want.oif
                    }) {
                        return Err(CniError::check_failed(format!(
                            "ptp: route {want} missing in the container"
                        )));
                    }
                }
            }
            // The host end holds the gateways and the routes back to the
            // container.
            let host_veth =
                check::veth_peer(&ns.host, &link, "ptp: host veth of the container not found")
                    .await?;
            if let Some(hi) = prev.interfaces.get(IDX_HOST)
                && hi.sandbox.is_empty()
                && hi.name != host_veth.name
            {
                return Err(CniError::check_failed(format!(
                    "ptp: host veth is {}, prevResult names {}",
                    host_veth.name, hi.name
                )));
            }
            let host_addrs: Vec<IpNetwork> = ns
                .host
                .addresses(Some(host_veth.index))
                .await?
                .into_iter()
                .map(|a| a.addr)
                .collect();
            let host_routes = ns.host.routes(Family::All).await?;
            for (addr, gw) in &ips {
                if !host_addrs.contains(&host_prefix(*gw)) {
                    return Err(CniError::check_failed(format!(
                        "ptp: gateway {gw} missing on host veth {}",
                        host_veth.name
                    )));
                }
                let want = host_route(host_veth.index, addr);
                if !host_routes
                    .iter()
                    .any(|r| r.dst == want.dst && r.oif == want.oif)
                {
                    return Err(CniError::check_failed(format!(
                        "ptp: host route {want} missing"
                    )));
                }
            }
            Ok::<_, CniError>(())
        })?;
        if conf.ip_masq {
            let addrs: Vec<IpNetwork> = ips.iter().map(|(a, _)| *a).collect();
            Masq::of(&ns.host_ns, args, conf.ip_masq_backend.as_deref()).check(&addrs)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcni_cni::IpConfig;

    #[test]
    fn routes_replace_the_connected_subnet() {
        let addr: IpNetwork = "10.1.2.5/24".parse().unwrap();
        let gw: IpAddr = "10.1.2.1".parse().unwrap();
        let [to_gw, via_gw] = container_routes(7, &addr, gw);
        assert_eq!(to_gw.to_string(), "10.1.2.1/32 dev 7");
        assert_eq!(to_gw.scope, SCOPE_LINK);
        assert_eq!(to_gw.src, Some(addr.ip()));
        assert_eq!(via_gw.to_string(), "10.1.2.0/24 via 10.1.2.1 dev 7");
        let h = host_route(3, &"fd00::5/64".parse().unwrap());
        assert_eq!(h.to_string(), "fd00::5/128 dev 3");
        assert_eq!(h.scope, SCOPE_HOST);
    }

    #[test]
    fn every_address_needs_a_gateway_of_its_family() {
        let mut r = CniResult::new("1.0.0");
        r.ips.push(IpConfig {
            interface: None,
            address: "10.1.2.5/24".parse().unwrap(),
            gateway: Some("10.1.2.1".parse().unwrap()),
        });
        assert_eq!(addresses_with_gateways(&r).unwrap().len(), 1);
        r.ips.push(IpConfig {
            interface: None,
            address: "fd00::5/64".parse().unwrap(),
            gateway: Some("10.1.2.1".parse().unwrap()),
        });
        assert_eq!(addresses_with_gateways(&r).unwrap_err().code, 7);
        r.ips[1].gateway = None;
        assert!(addresses_with_gateways(&r).is_err());
    }
}
