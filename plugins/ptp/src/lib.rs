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
use rcni_attach::check::{self, check_failed};
use rcni_attach::masq::{self, Masq};
use rcni_attach::{
    Dad, configure_iface, create_veth, delete_container_link, delete_link, enable_forwarding,
    host_veths_in, interface, is_global_unicast, open_container, open_container_for_del, rt,
    sandbox, sysctl_best_effort,
};
use rcni_cni::invoke::{delegate_add, delegate_cmd};
use rcni_cni::rollback::Rollback;
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, version};
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

/// The subnet of an address, host bits cleared.
fn subnet(a: &IpNetwork) -> IpNetwork {
    IpNetwork::new(a.network(), a.prefix()).expect("same prefix")
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

impl Ptp {
    fn add_inner(&self, args: &CmdArgs, conf: &Conf) -> Result<CniResult, CniError> {
        let ipam = conf.required_ipam()?;
        let rt = rt()?;
        let host_ns = NetNs::current()?;
        let ct_ns = open_container(args)?;
        let host = rt.block_on(Netlink::connect(&host_ns))?;
        let ct = rt.block_on(Netlink::connect(&ct_ns))?;
        // Before IPAM: a name clash must not cost a reservation.
        rt.block_on(rcni_attach::ensure_ifname_free(&ct, &args.ifname))?;
        let mut undo = Rollback::new();

        let r = delegate_add(ipam, &args.stdin, &args.path, args.version())?;
        undo.push(format!("IPAM {ipam}"), || {
            delegate_cmd(ipam, "DEL", &args.stdin, &args.path)
        });
        if r.ips.is_empty() {
            return Err(CniError::internal("IPAM plugin returned missing IP config"));
        }
        let mut result = CniResult::new(args.version());
        result.ips = r.ips;
        result.routes = r.routes;
        result.dns = r.dns;
        let ips = addresses_with_gateways(&result)?;
        let addrs: Vec<IpNetwork> = ips.iter().map(|(a, _)| *a).collect();
        enable_forwarding(&host_ns, &addrs)?;

        let (host_veth, ct_veth) =
            rt.block_on(create_veth(&host, &ct, &host_ns, &args.ifname, conf.mtu))?;
        let (ct_index, rt_ref, ct_ref) = (ct_veth.index, &rt, &ct);
        undo.push(format!("veth {}", args.ifname), move || {
            // Deleting one end of a veth deletes both.
            rt_ref.block_on(delete_link(ct_ref, ct_index))
        });

        // Both ends own their addresses by construction, so no duplicate
        // address detection: the global addresses are added without it (a
        // tentative address is no route source), and the link-local ones
        // must not wait for it either, because the kernel sends no neighbour
        // solicitation while a link's link-local address is tentative (the
        // reference's pods cannot reach each other over IPv6 for a second
        // or two after ADD). Router advertisements must not add routes to
        // what the plugin routes itself. Set before the links go up.
        let hv = &host_veth.name;
        sysctl_best_effort(
            &host_ns,
            &[
                (format!("net/ipv6/conf/{hv}/accept_ra"), "0"),
                (format!("net/ipv6/conf/{hv}/accept_dad"), "0"),
            ],
        );
        let key = format!("net/ipv6/conf/{}/accept_dad", args.ifname);
        sysctl_best_effort(&ct_ns, &[(key, "0")]);
        rt.block_on(host.set_up(host_veth.index))?;

        for ip in &mut result.ips {
            ip.interface = Some(IDX_CONTAINER);
        }
        rt.block_on(async {
            configure_iface(&ct, &ct_ns, &ct_veth, &result, Dad::Skip).await?;
            setup_container_routes(&ct, &ct_veth, &ips).await?;
            setup_host_veth(&host, &host_veth, &ips).await
        })?;

        if conf.ip_masq {
            let m = Masq::of(&host_ns, args, conf.ip_masq_backend.as_deref());
            m.setup(&addrs)?;
            let addrs = addrs.clone();
            undo.push("masquerade rules", move || m.teardown(&addrs));
        }

        let sandbox = sandbox(args);
        let (host_veth, ct_veth) = rt.block_on(async {
            Ok::<_, CniError>((
                host.link_by_index(host_veth.index).await?,
                ct.link_by_index(ct_veth.index).await?,
            ))
        })?;
        result.interfaces = vec![interface(&host_veth, ""), interface(&ct_veth, &sandbox)];
        if let Some(dns) = &conf.dns {
            result.dns = dns.clone();
        }
        undo.commit();
        Ok(result)
    }
}

/// Deletes the host veths named in `prev` that carry one of its gateways:
/// when the container end is out of reach the kernel removes the pair only
/// once it gets to destroying the namespace, and until then the host
/// routes would send a reused address to the dead pod.
async fn delete_stale_host_veths(host: &Netlink, prev: &CniResult) -> Result<(), CniError> {
    let gws: Vec<IpNetwork> = prev
        .ips
        .iter()
        .filter_map(|i| i.gateway.map(host_prefix))
        .collect();
    for l in host_veths_in(host, prev).await? {
        let addrs = host.addresses(Some(l.index)).await?;
        if addrs.iter().any(|a| gws.contains(&a.addr)) {
            delete_link(host, l.index).await?;
        }
    }
    Ok(())
}

impl Plugin for Ptp {
    fn about(&self) -> About {
        About {
            name: "ptp",
            version: env!("CARGO_PKG_VERSION"),
            supported_versions: version::ALL,
        }
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let conf = Conf::load(args)?;
        self.add_inner(args, &conf)
    }

    /// IPAM first (as the reference: the address is free again whatever
    /// happens next), then the link, then the masquerade rules; each step
    /// runs even if an earlier one failed.
    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let mut errors = Vec::new();
        if let Err(e) = rcni_attach::delegate_ipam(conf.ipam.as_deref(), "DEL", args) {
            errors.push(e);
        }
        let prev = args.conf.prev_result().ok().flatten();
        // Addresses to unmasquerade: what the runtime recorded, plus what is
        // still on the interface.
        let mut ips: Vec<IpNetwork> = prev
            .iter()
            .flat_map(|p| p.ips.iter().map(|i| i.address))
            .collect();
        let r = rt().and_then(|rt| {
            rt.block_on(async {
                let mut link_found = false;
                if let Some(ct_ns) = open_container_for_del(args)? {
                    let ct = Netlink::connect(&ct_ns).await?;
                    if let Some(addrs) = delete_container_link(&ct, &args.ifname).await? {
                        link_found = true;
                        for a in addrs {
                            if !ips.contains(&a) {
                                ips.push(a);
                            }
                        }
                    }
                }
                if !link_found && let Some(prev) = &prev {
                    let host = Netlink::connect_current().await?;
                    delete_stale_host_veths(&host, prev).await?;
                }
                Ok::<_, CniError>(())
            })
        });
        if let Err(e) = r {
            errors.push(e);
        }
        if conf.ip_masq {
            ips.retain(|a| is_global_unicast(a.ip()));
            let r = NetNs::current()
                .map_err(CniError::from)
                .and_then(|host_ns| {
                    Masq::of(&host_ns, args, conf.ip_masq_backend.as_deref()).teardown(&ips)
                });
            if let Err(e) = r {
                errors.push(e);
            }
        }
        rcni_attach::first_error(errors)
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        delegate_cmd(conf.required_ipam()?, "CHECK", &args.stdin, &args.path)?;
        let prev = check::prev_result(args)?;
        let ct_ns = open_container(args)?;
        let host_ns = NetNs::current()?;
        let ct_if = check::container_interface(&prev, &args.ifname, &sandbox(args))?;
        let ips = addresses_with_gateways(&prev).map_err(|e| check_failed(e.msg))?;
        rt()?.block_on(async {
            let host = Netlink::connect(&host_ns).await?;
            let ct = Netlink::connect(&ct_ns).await?;
            let link = check::validate_link(&ct, ct_if, Some("veth")).await?;
            check::validate_ips(&ct, &link, &prev.ips, IDX_CONTAINER).await?;
            check::validate_routes(&ct, &prev.routes).await?;
            let routes = ct.routes(Family::All).await?;
            for (addr, gw) in &ips {
                for want in container_routes(link.index, addr, *gw) {
                    if !routes.iter().any(|r| {
                        r.dst == want.dst && r.gateway == want.gateway && r.oif == want.oif
                    }) {
                        return Err(check_failed(format!(
                            "ptp: route {want} missing in the container"
                        )));
                    }
                }
            }
            // The host end: the container veth's peer, holding the gateways
            // and the routes back to the container.
            let peer = link
                .link
                .ok_or_else(|| check_failed("container veth has no peer"))?;
            let host_veth = host
                .link_by_index(peer)
                .await
                .map_err(|_| check_failed("ptp: host veth of the container not found"))?;
            if let Some(hi) = prev.interfaces.get(IDX_HOST)
                && hi.sandbox.is_empty()
                && hi.name != host_veth.name
            {
                return Err(check_failed(format!(
                    "ptp: host veth is {}, prevResult names {}",
                    host_veth.name, hi.name
                )));
            }
            let host_addrs: Vec<IpNetwork> = host
                .addresses(Some(host_veth.index))
                .await?
                .into_iter()
                .map(|a| a.addr)
                .collect();
            let host_routes = host.routes(Family::All).await?;
            for (addr, gw) in &ips {
                if !host_addrs.contains(&host_prefix(*gw)) {
                    return Err(check_failed(format!(
                        "ptp: gateway {gw} missing on host veth {}",
                        host_veth.name
                    )));
                }
                let want = host_route(host_veth.index, addr);
                if !host_routes
                    .iter()
                    .any(|r| r.dst == want.dst && r.oif == want.oif)
                {
                    return Err(check_failed(format!("ptp: host route {want} missing")));
                }
            }
            Ok::<_, CniError>(())
        })?;
        if conf.ip_masq {
            let addrs: Vec<IpNetwork> = ips.iter().map(|(a, _)| *a).collect();
            Masq::of(&host_ns, args, conf.ip_masq_backend.as_deref()).check(&addrs)?;
        }
        Ok(())
    }

    fn status(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        rcni_attach::delegate_ipam(conf.ipam.as_deref(), "STATUS", args)
    }

    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let mut errors = Vec::new();
        if conf.ip_masq
            && let Err(e) = NetNs::current()
                .map_err(CniError::from)
                .and_then(|h| masq::gc(&h, args))
        {
            errors.push(e);
        }
        if let Err(e) = rcni_attach::delegate_ipam(conf.ipam.as_deref(), "GC", args) {
            errors.push(e);
        }
        rcni_attach::first_error(errors)
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
