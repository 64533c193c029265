//! `bridge`: pods on a Linux bridge through veth pairs, with the reference
//! plugin's options and result shape.

mod conf;
mod masq;
mod spoofchk;

use conf::Conf;
use ipnetwork::IpNetwork;
use rcni_cni::invoke::{PendingAdd, PendingCmd, delegate_cmd};
use rcni_cni::rollback::Rollback;
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, ErrorCode, Interface, Route, version};
use rcni_netlink::{Link, MacAddr, Netlink, SCOPE_LINK, sysctl};
use rcni_netns::NetNs;
use std::net::IpAddr;
use std::time::Duration;
use tokio::runtime::Runtime;

pub struct Bridge;

/// Interface indexes in the result, as the reference lays them out.
const IDX_CONTAINER: usize = 2;

fn check_failed(msg: impl Into<String>) -> CniError {
    CniError::new(ErrorCode::CheckFailed, msg)
}

fn open_container(args: &CmdArgs) -> Result<NetNs, CniError> {
    let path = args.netns.as_deref().ok_or_else(|| {
        CniError::new(
            ErrorCode::InvalidEnvironmentVariables,
            "required env variables [CNI_NETNS] missing",
        )
    })?;
    NetNs::open(path)
        .map_err(|e| CniError::from(e).context(format!("failed to open netns {path:?}")))
}

/// `veth` + 8 random hex digits, the reference's host-side naming.
fn random_veth_name() -> String {
    let m = MacAddr::random_local().0;
    format!("veth{:02x}{:02x}{:02x}{:02x}", m[2], m[3], m[4], m[5])
}

/// Sysctls the reference sets best-effort: a kernel without IPv6 (or a
/// read-only /proc) must not fail the attachment.
fn sysctl_best_effort(ns: &NetNs, pairs: &[(String, &str)]) {
    let pairs: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    let _ = sysctl::set_each(ns, &pairs);
}

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
        result.ips[i].interface = Some(IDX_CONTAINER);
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
/// different one only with forceAddress.
async fn ensure_gateway_addr(
    nl: &Netlink,
    link: &Link,
    gw: IpNetwork,
    force: bool,
) -> Result<(), CniError> {
    let addrs = nl.addresses(Some(link.index)).await?;
    for a in addrs.iter().filter(|a| a.addr.is_ipv4() == gw.is_ipv4()) {
        if a.addr == gw {
            return Ok(());
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
    nl.ensure_address(link.index, gw).await?;
    // Pin the bridge's MAC: otherwise it takes the lowest port MAC and
    // changes as pods come and go. Read it now: it changes as ports join.
    let now = nl.link_by_index(link.index).await?;
    if let Some(mac) = now.mac.filter(|m| m.0 != [0; 6]) {
        nl.set_mac(link.index, mac).await?;
    }
    Ok(())
}

/// Creates the veth pair from inside the container (so the container side is
/// born with its final name and a clash is detected there), host side with a
/// random name. Returns (host link, container link).
async fn create_veth(
    host: &Netlink,
    ct: &Netlink,
    host_ns: &NetNs,
    ifname: &str,
    conf: &Conf,
) -> Result<(Link, Link), CniError> {
    if ct.find_link(ifname).await?.is_some() {
        return Err(CniError::new(
            ErrorCode::InvalidEnvironmentVariables,
            format!("container veth name provided ({ifname}) already exists"),
        ));
    }
    let mut last = None;
    for _ in 0..10 {
        let peer = random_veth_name();
        match ct.create_veth(ifname, &peer, Some(host_ns), conf.mtu).await {
            Ok(c) => {
                let h = host.link_by_name(&peer).await?;
                return Ok((h, c));
            }
            // The random host name was taken: try another.
            Err(e) if e.is_exists() && ct.find_link(ifname).await?.is_none() => last = Some(e),
            Err(e) => return Err(e.into()),
        }
    }
    Err(last
        .map(CniError::from)
        .unwrap_or_else(|| CniError::internal("could not create a veth pair")))
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

/// Enslaves the host veth and applies port flags and VLANs.
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
    for v in o.trunk {
        host.bridge_vlan_add(port.index, *v, false).await?;
    }
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

fn iface(l: &Link, sandbox: &str) -> Interface {
    Interface {
        name: l.name.clone(),
        mac: l.mac.map(|m| m.to_string()).unwrap_or_default(),
        sandbox: sandbox.to_string(),
        ..Default::default()
    }
}

/// Adds addresses and routes in the container as libcni's ConfigureIface.
async fn configure_container(
    ct: &Netlink,
    ct_ns: &NetNs,
    link: &Link,
    result: &CniResult,
) -> Result<(), CniError> {
    let ifname = &link.name;
    if result.ips.iter().any(|i| i.address.is_ipv6()) {
        // A pod namespace may come with IPv6 disabled; the reference turns it on.
        for dev in ["lo", ifname.as_str()] {
            let key = format!("net/ipv6/conf/{dev}/disable_ipv6");
            if sysctl::get(ct_ns, &key)
                .map(|v| v.trim() != "0")
                .unwrap_or(false)
            {
                sysctl::set(ct_ns, &key, "0")?;
            }
        }
    }
    let (mut gw4, mut gw6) = (None, None);
    for ip in &result.ips {
        ct.add_address(link.index, ip.address).await?;
        match ip.gateway {
            Some(g @ IpAddr::V4(_)) if gw4.is_none() => gw4 = Some(g),
            Some(g @ IpAddr::V6(_)) if gw6.is_none() => gw6 = Some(g),
            _ => {}
        }
    }
    ct.set_up(link.index).await?;
    for r in &result.routes {
        let gw = r.gw.or(if r.dst.is_ipv4() { gw4 } else { gw6 });
        let mut route = rcni_netlink::Route::new(r.dst).oif(link.index);
        match gw {
            Some(g) => route = route.gateway(g),
            None => route = route.scope(SCOPE_LINK),
        }
        if let Some(s) = r.scope {
            route = route.scope(s as u8);
        }
        if let Some(t) = r.table {
            route = route.table(t);
        }
        if let Some(p) = r.priority {
            route = route.metric(p);
        }
        if let Some(m) = r.mtu {
            route = route.mtu(m);
        }
        if let Some(m) = r.advmss {
            route = route.advmss(m);
        }
        match ct.add_route(&route).await {
            Err(e) if !e.is_exists() => return Err(e.into()),
            _ => {}
        }
    }
    Ok(())
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

/// Deletes the host veth of `prev` if it is a veth port of our bridge.
fn delete_host_veth(conf: &Conf, prev: &CniResult) -> Result<(), CniError> {
    let host_ns = NetNs::current()?;
    rt()?.block_on(async {
        let host = Netlink::connect(&host_ns).await?;
        let Some(br) = host.find_link(&conf.bridge).await? else {
            return Ok(());
        };
        for i in prev
            .interfaces
            .iter()
            .filter(|i| i.sandbox.is_empty() && i.name != conf.bridge)
        {
            if let Some(l) = host.find_link(&i.name).await?
                && l.kind.as_deref() == Some("veth")
                && l.master == Some(br.index)
            {
                match host.delete_link(l.index).await {
                    Err(e) if !e.is_not_found() => return Err(CniError::from(e)),
                    _ => {}
                }
            }
        }
        Ok(())
    })
}

fn rt() -> Result<Runtime, CniError> {
    Ok(rcni_netlink::runtime()?)
}

impl Bridge {
    fn add_inner(&self, args: &CmdArgs, conf: &Conf) -> Result<CniResult, CniError> {
        // IPAM runs alongside the link work below (the reference runs it
        // after). Declared before the rollback: dropped after it, so a failed ADD
        // releases its addresses after removing the links that used them.
        let mut ipam = conf
            .ipam
            .as_deref()
            .map(|name| PendingAdd::start(name, &args.stdin, &args.path, args.version()));
        let rt = rt()?;
        let host_ns = NetNs::current()?;
        let ct_ns = open_container(args)?;
        let sandbox = args
            .netns
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        let host = rt.block_on(Netlink::connect(&host_ns))?;
        let ct = rt.block_on(Netlink::connect(&ct_ns))?;
        let mut undo = Rollback::new();

        let vlan_filtering = conf.vlan != 0 || !conf.trunk.is_empty();
        let br = rt.block_on(host.ensure_bridge_with(&conf.bridge, conf.mtu, vlan_filtering))?;
        if conf.promisc && !br.promisc {
            rt.block_on(host.set_promisc(br.index, true))?;
        }
        let br_conf = format!("net/ipv6/conf/{}", br.name);
        sysctl_best_effort(
            &host_ns,
            &[
                // We own the bridge's routes: router advertisements must not add any.
                (format!("{br_conf}/accept_ra"), "0"),
                // The gateway address is ours by construction; DAD would only
                // leave it unusable ("tentative") for the first pod's first second.
                (format!("{br_conf}/accept_dad"), "0"),
            ],
        );

        let (host_veth, ct_veth) =
            rt.block_on(create_veth(&host, &ct, &host_ns, &args.ifname, conf))?;
        let (ct_index, rt_ref, ct_ref) = (ct_veth.index, &rt, &ct);
        undo.push(format!("veth {}", args.ifname), move || {
            // Deleting one end of a veth deletes both.
            rt_ref
                .block_on(ct_ref.delete_link(ct_index))
                .map_err(CniError::from)
        });
        if let Some(mac) = conf.mac {
            rt.block_on(ct.set_mac(ct_veth.index, mac))?;
        }
        rt.block_on(setup_port(&host, &host_veth, &br, &PortOptions::of(conf)))?;

        if conf.mac_spoof_chk {
            let mac = ct_veth.mac.map(|m| m.to_string()).unwrap_or_default();
            let mac = conf.mac.map(|m| m.to_string()).unwrap_or(mac);
            spoofchk::setup(&host_veth.name, &mac, &args.container_id, &args.ifname)?;
            undo.push("macspoofchk rules", || {
                spoofchk::teardown(&args.container_id, &args.ifname)
            });
        }
        let mut result = CniResult::new(args.version());
        if let Some(ipam) = &mut ipam {
            let r = ipam.wait()?;
            if r.ips.is_empty() {
                return Err(CniError::internal("IPAM plugin returned missing IP config"));
            }
            result.ips = r.ips;
            result.routes = r.routes;
            result.dns = r.dns;
            let gws = calc_gateways(&mut result, conf)?;
            let ips: Vec<IpNetwork> = result.ips.iter().map(|i| i.address).collect();

            // DAD delays ADD by seconds; the reference turns it off unless asked.
            let ifn = &args.ifname;
            let dad = if conf.enable_dad {
                vec![
                    (format!("net/ipv6/conf/{ifn}/enhanced_dad"), "1"),
                    (format!("net/ipv6/conf/{ifn}/accept_dad"), "1"),
                ]
            } else {
                vec![(format!("net/ipv6/conf/{ifn}/accept_dad"), "0")]
            };
            let arp = (format!("net/ipv4/conf/{ifn}/arp_notify"), "1");
            sysctl_best_effort(&ct_ns, &[dad, vec![arp]].concat());
            let ct_link = rt.block_on(ct.link_by_index(ct_veth.index))?;
            rt.block_on(configure_container(&ct, &ct_ns, &ct_link, &result))?;

            if conf.is_gateway && !gws.is_empty() {
                let target = if conf.vlan != 0 {
                    let v = rt.block_on(ensure_vlan_interface(&host, &br, conf))?;
                    result.interfaces.push(iface(&v, ""));
                    v
                } else {
                    br.clone()
                };
                for gw in &gws {
                    rt.block_on(ensure_gateway_addr(&host, &target, *gw, conf.force_address))?;
                }
                if gws.iter().any(|g| g.is_ipv4()) {
                    sysctl::set(&host_ns, "net/ipv4/ip_forward", "1")?;
                }
                if gws.iter().any(|g| g.is_ipv6()) {
                    sysctl::set(&host_ns, "net/ipv6/conf/all/forwarding", "1")?;
                }
            }
            if conf.ip_masq {
                masq::setup(&host_ns, conf, &args.container_id, &args.ifname, &ips)?;
                let host_ns = &host_ns;
                undo.push("masquerade rules", move || {
                    masq::teardown(host_ns, conf, &args.container_id, &args.ifname, &ips)
                });
            }
        } else if !conf.disable_container_interface {
            rt.block_on(ct.set_up(ct_veth.index))?;
        }

        let host_veth = if conf.disable_container_interface {
            rt.block_on(host.link_by_index(host_veth.index))?
        } else {
            rt.block_on(wait_port_up(&host, host_veth.index))?
        };
        // The bridge's MAC may change when its first port joins.
        let br = rt.block_on(host.link_by_index(br.index))?;
        let ct_veth = rt.block_on(ct.link_by_index(ct_veth.index))?;
        let mut interfaces = vec![
            iface(&br, ""),
            iface(&host_veth, ""),
            iface(&ct_veth, &sandbox),
        ];
        interfaces.append(&mut result.interfaces);
        result.interfaces = interfaces;
        if let Some(dns) = &conf.dns {
            result.dns = dns.clone();
        }
        undo.commit();
        if let Some(ipam) = ipam {
            ipam.commit();
        }
        Ok(result)
    }
}

impl Plugin for Bridge {
    fn about(&self) -> About {
        About {
            name: "bridge",
            version: env!("CARGO_PKG_VERSION"),
            supported_versions: version::ALL,
        }
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let conf = Conf::load(args)?;
        self.add_inner(args, &conf)
    }

    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        // Releasing addresses does not depend on the links: it overlaps the
        // kernel's link removal (an RCU barrier, most of DEL's time).
        let ipam_del = conf
            .ipam
            .as_deref()
            .map(|ipam| PendingCmd::start(ipam, "DEL", &args.stdin, &args.path));
        let mut errors: Vec<CniError> = Vec::new();
        // Addresses to unmasquerade: what the runtime recorded, plus what is
        // still on the interface. prevResult covers the netns-gone case that
        // makes the reference leak its rules.
        let prev = args.conf.prev_result().ok().flatten();
        let mut ips: Vec<IpNetwork> = prev
            .iter()
            .flat_map(|p| p.ips.iter().map(|i| i.address))
            .collect();
        let mut container_link_gone = true;
        if let Some(path) = args.netns.as_deref() {
            match NetNs::open(path) {
                Ok(ct_ns) => {
                    let r = rt().and_then(|rt| {
                        rt.block_on(async {
                            let ct = Netlink::connect(&ct_ns).await?;
                            if let Some(l) = ct.find_link(&args.ifname).await? {
                                container_link_gone = false;
                                for a in ct.addresses(Some(l.index)).await? {
                                    if !a.addr.ip().is_loopback() && !ips.contains(&a.addr) {
                                        ips.push(a.addr);
                                    }
                                }
                                match ct.delete_link(l.index).await {
                                    Err(e) if !e.is_not_found() => return Err(CniError::from(e)),
                                    _ => {}
                                }
                            }
                            Ok(())
                        })
                    });
                    if let Err(e) = r {
                        errors.push(e);
                    }
                }
                Err(e) if e.is_not_found() || matches!(e, rcni_netns::Error::NotNetns(_)) => {}
                Err(e) => {
                    container_link_gone = false;
                    errors.push(CniError::from(e));
                }
            }
        }
        // Without the netns the kernel removes the veth only when it gets to
        // destroying the namespace; remove the host end now, by the name the
        // runtime recorded, if it is still our port.
        if container_link_gone
            && args.netns.is_some()
            && let Some(prev) = &prev
            && let Err(e) = delete_host_veth(&conf, prev)
        {
            errors.push(e);
        }
        if let Some(Err(e)) = ipam_del.map(PendingCmd::wait) {
            errors.push(e);
        }
        if conf.mac_spoof_chk
            && let Err(e) = spoofchk::teardown(&args.container_id, &args.ifname)
        {
            errors.push(e);
        }
        if conf.ip_masq && conf.ipam.is_some() {
            let host_ns = NetNs::current()?;
            // Link-local IPv6 addresses were never masqueraded.
            ips.retain(
                |a| !matches!(a.ip(), IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80),
            );
            if let Err(e) = masq::teardown(&host_ns, &conf, &args.container_id, &args.ifname, &ips)
            {
                errors.push(e);
            }
        }
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        if let Some(ipam) = &conf.ipam {
            delegate_cmd(ipam, "CHECK", &args.stdin, &args.path)?;
        }
        let prev = args
            .conf
            .prev_result()?
            .ok_or_else(|| CniError::config("Required prevResult missing"))?;
        let ct_ns = open_container(args)?;
        let host_ns = NetNs::current()?;
        let sandbox = args
            .netns
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        let rt = rt()?;
        rt.block_on(async {
            let host = Netlink::connect(&host_ns).await?;
            let ct = Netlink::connect(&ct_ns).await?;
            let br_if = prev.interfaces.iter().find(|i| i.name == conf.bridge);
            let br = host
                .find_link(&conf.bridge)
                .await?
                .ok_or_else(|| check_failed(format!("CNI created bridge {} in host namespace was not found", conf.bridge)))?;
            if br.kind.as_deref() != Some("bridge") {
                return Err(check_failed(format!("Interface {} does not have link type of bridge", br.name)));
            }
            if let Some(bi) = br_if
                && !bi.mac.is_empty()
                && br.mac.map(|m| m.to_string()) != Some(bi.mac.clone())
            {
                return Err(check_failed(format!("Bridge interface {} Mac doesn't match: {}", br.name, bi.mac)));
            }
            if br.promisc != conf.promisc {
                return Err(check_failed(format!(
                    "Bridge interface {} configured Promisc Mode {} doesn't match current state: {}",
                    br.name, conf.promisc, br.promisc
                )));
            }
            let ct_if = prev
                .interfaces
                .iter()
                .find(|i| i.name == args.ifname && i.sandbox == sandbox)
                .ok_or_else(|| check_failed(format!("Sandbox in prevResult doesn't match configured netns: {sandbox}")))?;
            let ct_link = ct
                .find_link(&args.ifname)
                .await?
                .ok_or_else(|| check_failed(format!("CNI created interface in container {} not found", args.ifname)))?;
            if ct_link.kind.as_deref() != Some("veth") {
                return Err(check_failed(format!("Error: Container interface {} not of type veth", ct_link.name)));
            }
            if !ct_if.mac.is_empty() && ct_link.mac.map(|m| m.to_string()) != Some(ct_if.mac.clone()) {
                return Err(check_failed(format!(
                    "Interface {} Mac {} doesn't match container Mac: {}",
                    ct_link.name,
                    ct_if.mac,
                    ct_link.mac.map(|m| m.to_string()).unwrap_or_default()
                )));
            }
            // The host end: the container veth's peer, enslaved to the bridge.
            let peer = ct_link.link.ok_or_else(|| check_failed("container veth has no peer"))?;
            let host_veth = host
                .link_by_index(peer)
                .await
                .map_err(|_| check_failed(format!("CNI veth created for bridge {} was not found", conf.bridge)))?;
            if host_veth.master != Some(br.index) || host_veth.link != Some(ct_link.index) {
                return Err(check_failed(format!("CNI veth created for bridge {} was not found", conf.bridge)));
            }
            let have: Vec<IpNetwork> = ct.addresses(Some(ct_link.index)).await?.into_iter().map(|a| a.addr).collect();
            for ip in prev.ips.iter().filter(|i| i.interface == Some(IDX_CONTAINER) || i.interface.is_none()) {
                if !have.contains(&ip.address) {
                    return Err(check_failed(format!("Failed to match addr {} on interface {}", ip.address, args.ifname)));
                }
            }
            let routes = ct.routes(rcni_netlink::Family::All).await?;
            for r in &prev.routes {
                let dst = IpNetwork::new(r.dst.network(), r.dst.prefix()).unwrap_or(r.dst);
                if !routes.iter().any(|k| k.dst == dst && (r.gw.is_none() || k.gateway == r.gw)) {
                    return Err(check_failed(format!("Failed to find a route to {} in the container", r.dst)));
                }
            }
            Ok(())
        })?;
        if conf.mac_spoof_chk {
            spoofchk::check(&args.container_id, &args.ifname)?;
        }
        if conf.ip_masq && conf.ipam.is_some() {
            let ips: Vec<IpNetwork> = prev.ips.iter().map(|i| i.address).collect();
            masq::check(&host_ns, &conf, &args.container_id, &args.ifname, &ips)?;
        }
        Ok(())
    }

    fn status(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        match &conf.ipam {
            Some(ipam) => delegate_cmd(ipam, "STATUS", &args.stdin, &args.path),
            None => Ok(()),
        }
    }

    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let mut first_err = None;
        if conf.ip_masq {
            let valid: Vec<(String, String)> = args
                .conf
                .gc_valid_attachments()
                .unwrap_or_default()
                .into_iter()
                .map(|a| (a.container_id, a.ifname))
                .collect();
            if let Err(e) = NetNs::current()
                .map_err(CniError::from)
                .and_then(|h| masq::gc(&h, &conf, &valid))
            {
                first_err = Some(e);
            }
        }
        if let Some(ipam) = &conf.ipam
            && let Err(e) = delegate_cmd(ipam, "GC", &args.stdin, &args.path)
        {
            first_err.get_or_insert(e);
        }
        first_err.map_or(Ok(()), Err)
    }
}
