//! Attaching an interface to a container: the pieces the main plugins
//! (bridge, ptp, vlan, host-device) share between ADD, CHECK, DEL, STATUS
//! and GC, so that each plugin is only its own topology.
//!
//! * opening CNI_NETNS (required for ADD/CHECK, optional and possibly gone
//!   for DEL),
//! * the veth pair born in the container with a random host-side name,
//! * applying an IPAM result to an interface (libcni's `ConfigureIface`),
//! * CHECK's comparisons against `prevResult` ([`check`]),
//! * ipMasq keyed like the reference ([`masq`]),
//! * forwarding STATUS and GC to IPAM.

pub mod check;
pub mod masq;

use ipnetwork::IpNetwork;
use rcni_cni::invoke::delegate_cmd;
use rcni_cni::skel::CmdArgs;
use rcni_cni::{CniError, CniResult, ErrorCode, Interface};
use rcni_netlink::{Link, MacAddr, Netlink, SCOPE_LINK, sysctl};
use rcni_netns::NetNs;
use std::net::IpAddr;
use tokio::runtime::Runtime;

/// A runtime for the netlink calls of one plugin run.
pub fn rt() -> Result<Runtime, CniError> {
    Ok(rcni_netlink::runtime()?)
}

/// CNI_NETNS for ADD and CHECK, where it is required.
pub fn open_container(args: &CmdArgs) -> Result<NetNs, CniError> {
    let path = args.netns.as_deref().ok_or_else(|| {
        CniError::new(
            ErrorCode::InvalidEnvironmentVariables,
            "required env variables [CNI_NETNS] missing",
        )
    })?;
    NetNs::open(path)
        .map_err(|e| CniError::from(e).context(format!("failed to open netns {path:?}")))
}

/// CNI_NETNS for DEL: `None` when the runtime sent none or the namespace is
/// gone (its file removed, or a bind-mount target left behind after the
/// namespace was unmounted). DEL must succeed in both cases.
pub fn open_container_for_del(args: &CmdArgs) -> Result<Option<NetNs>, CniError> {
    let Some(path) = args.netns.as_deref() else {
        return Ok(None);
    };
    match NetNs::open(path) {
        Ok(ns) => Ok(Some(ns)),
        Err(e) if e.is_not_found() || matches!(e, rcni_netns::Error::NotNetns(_)) => Ok(None),
        Err(e) => Err(CniError::from(e).context(format!("failed to open netns {path:?}"))),
    }
}

/// The `sandbox` of the container's interface in results: CNI_NETNS as given.
pub fn sandbox(args: &CmdArgs) -> String {
    args.netns
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

/// The IPAM plugin type of the config; `None` when there is no `ipam` or
/// its `type` is empty (an L2-only attachment where the plugin allows it).
pub fn ipam_type(args: &CmdArgs) -> Option<String> {
    args.conf
        .ipam
        .as_ref()
        .map(|i| i.ipam_type.clone())
        .filter(|t| !t.is_empty())
}

/// Runs a non-ADD command (DEL, CHECK, STATUS, GC) on the IPAM plugin, if
/// there is one.
pub fn delegate_ipam(ipam: Option<&str>, command: &str, args: &CmdArgs) -> Result<(), CniError> {
    match ipam {
        Some(ipam) => delegate_cmd(ipam, command, &args.stdin, &args.path),
        None => Ok(()),
    }
}

/// DEL and GC keep going past failures and report the first one.
pub fn first_error(errors: Vec<CniError>) -> Result<(), CniError> {
    errors.into_iter().next().map_or(Ok(()), Err)
}

/// `veth` + 8 random hex digits, the reference's host-side naming (which
/// NetworkManager knows to leave alone).
pub fn random_veth_name() -> String {
    let m = MacAddr::random_local().0;
    format!("veth{:02x}{:02x}{:02x}{:02x}", m[2], m[3], m[4], m[5])
}

/// A temporary name for a link created outside the container and renamed
/// there (vlan, host-device): the final name could clash on the way.
pub fn random_temp_name() -> String {
    let m = MacAddr::random_local().0;
    format!("tmp{:02x}{:02x}{:02x}{:02x}", m[2], m[3], m[4], m[5])
}

/// The spec: ADD fails when CNI_IFNAME already exists in the container.
pub async fn ensure_ifname_free(ct: &Netlink, ifname: &str) -> Result<(), CniError> {
    if ct.find_link(ifname).await?.is_some() {
        return Err(CniError::new(
            ErrorCode::InvalidEnvironmentVariables,
            format!("container interface name provided ({ifname}) already exists"),
        ));
    }
    Ok(())
}

/// Creates the veth pair from inside the container, so the container end is
/// born with its final name (a clash is detected there and nothing shows up
/// in the host under that name) and the host end under a random name.
/// `mtu` applies to both ends. Returns (host end, container end).
pub async fn create_veth(
    host: &Netlink,
    ct: &Netlink,
    host_ns: &NetNs,
    ifname: &str,
    mtu: Option<u32>,
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
        match ct.create_veth(ifname, &peer, Some(host_ns), mtu).await {
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

/// A link as a result interface; `sandbox` is empty for host-side links.
pub fn interface(l: &Link, sandbox: &str) -> Interface {
    Interface {
        name: l.name.clone(),
        mac: l.mac.map(|m| m.to_string()).unwrap_or_default(),
        sandbox: sandbox.to_string(),
        ..Default::default()
    }
}

/// Writes sysctls the reference sets best-effort: a kernel without IPv6 (or
/// a read-only /proc) must not fail the attachment.
pub fn sysctl_best_effort(ns: &NetNs, pairs: &[(String, &str)]) {
    let pairs: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    let _ = sysctl::set_each(ns, &pairs);
}

/// Turns on forwarding for the families of `ips` in `ns` (the node), writing
/// only when it is off, as the reference's `EnableForward`.
pub fn enable_forwarding(ns: &NetNs, ips: &[IpNetwork]) -> Result<(), CniError> {
    let keys = [
        (true, "net/ipv4/ip_forward"),
        (false, "net/ipv6/conf/all/forwarding"),
    ];
    for (v4, key) in keys {
        if ips.iter().any(|ip| ip.is_ipv4() == v4)
            && sysctl::get(ns, key)
                .map(|v| v.trim() != "1")
                .unwrap_or(true)
        {
            sysctl::set(ns, key, "1")
                .map_err(|e| CniError::from(e).context("Could not enable IP forwarding"))?;
        }
    }
    Ok(())
}

/// IPv6 duplicate address detection for the addresses of an IPAM result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dad {
    /// The link reaches nobody who could hold the address (a veth to the
    /// node): add it without DAD, usable at once.
    Skip,
    /// A shared segment: run DAD and wait for it before adding routes, as
    /// the reference's SettleAddresses (an address that loses fails ADD).
    Wait,
}

/// How long [`Dad::Wait`] waits, as the reference.
const DAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Applies an IPAM result to `link` as libcni's `ConfigureIface` does:
/// IPv6 enabled where it is needed, every address added, the link set up,
/// then every route, via the family's first gateway unless it names its own.
pub async fn configure_iface(
    ct: &Netlink,
    ct_ns: &NetNs,
    link: &Link,
    result: &CniResult,
    dad: Dad,
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
        match dad {
            Dad::Skip => ct.add_address_nodad(link.index, ip.address).await?,
            Dad::Wait => ct.add_address(link.index, ip.address).await?,
        }
        match ip.gateway {
            Some(g @ IpAddr::V4(_)) if gw4.is_none() => gw4 = Some(g),
            Some(g @ IpAddr::V6(_)) if gw6.is_none() => gw6 = Some(g),
            _ => {}
        }
    }
    ct.set_up(link.index).await?;
    let v6: Vec<IpAddr> = result
        .ips
        .iter()
        .map(|i| i.address.ip())
        .filter(IpAddr::is_ipv6)
        .collect();
    if dad == Dad::Wait && !v6.is_empty() {
        ct.wait_dad(link.index, &v6, DAD_TIMEOUT).await?;
    }
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

/// Deletes CNI_IFNAME in the container. Returns its global addresses (for
/// the masquerade teardown), or `None` when there was no such link.
pub async fn delete_container_link(
    ct: &Netlink,
    ifname: &str,
) -> Result<Option<Vec<IpNetwork>>, CniError> {
    let Some(l) = ct.find_link(ifname).await? else {
        return Ok(None);
    };
    let addrs = ct
        .addresses(Some(l.index))
        .await?
        .into_iter()
        .map(|a| a.addr)
        .filter(|a| is_global_unicast(a.ip()))
        .collect();
    match ct.delete_link(l.index).await {
        Err(e) if !e.is_not_found() => Err(e.into()),
        _ => Ok(Some(addrs)),
    }
}

/// Go's `IP.IsGlobalUnicast`: not loopback, link-local, multicast or
/// unspecified. Only such addresses were ever masqueraded.
pub fn is_global_unicast(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => {
            !(a.is_loopback()
                || a.is_link_local()
                || a.is_multicast()
                || a.is_unspecified()
                || a.is_broadcast())
        }
        IpAddr::V6(a) => {
            !(a.is_loopback()
                || a.is_multicast()
                || a.is_unspecified()
                || (a.segments()[0] & 0xffc0) == 0xfe80)
        }
    }
}

/// Host-side veths named in `prev` (interfaces without a sandbox) that still
/// exist: what DEL removes by name when the container end is out of reach.
/// The caller decides which of them are its own.
pub async fn host_veths_in(host: &Netlink, prev: &CniResult) -> Result<Vec<Link>, CniError> {
    let mut out = Vec::new();
    for i in prev.interfaces.iter().filter(|i| i.sandbox.is_empty()) {
        if let Some(l) = host.find_link(&i.name).await?
            && l.kind.as_deref() == Some("veth")
        {
            out.push(l);
        }
    }
    Ok(out)
}

/// Deletes a link; one already gone is success.
pub async fn delete_link(nl: &Netlink, index: u32) -> Result<(), CniError> {
    match nl.delete_link(index).await {
        Err(e) if !e.is_not_found() => Err(e.into()),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let v = random_veth_name();
        assert_eq!(v.len(), 12);
        assert!(v.starts_with("veth"));
        assert!(v[4..].bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(random_temp_name(), random_temp_name());
        assert!(random_temp_name().len() <= 15);
    }

    #[test]
    fn global_unicast_as_go() {
        for (ip, want) in [
            ("10.1.2.3", true),
            ("127.0.0.1", false),
            ("169.254.1.1", false),
            ("224.0.0.1", false),
            ("0.0.0.0", false),
            ("255.255.255.255", false),
            ("fd00::2", true),
            ("fe80::1", false),
            ("::1", false),
            ("ff02::1", false),
        ] {
            assert_eq!(is_global_unicast(ip.parse().unwrap()), want, "{ip}");
        }
    }
}
