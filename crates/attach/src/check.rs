//! CHECK: the attachment in the kernel against the `prevResult` the runtime
//! recorded. Every mismatch is code 106 (CheckFailed) with the reference's
//! wording where it has one.

use ipnetwork::IpNetwork;
use rcni_cni::{CniError, CniResult, Interface, IpConfig, Route};
use rcni_netlink::{Family, Link, Netlink, TABLE_MAIN};

/// The error CHECK gives without the result of ADD (`NetConf::required_prev_result`).
pub const PREV_RESULT_MISSING: &str = "Required prevResult missing";

/// The container interface of `prev`: named CNI_IFNAME, in CNI_NETNS.
pub fn container_interface<'a>(
    prev: &'a CniResult,
    ifname: &str,
    sandbox: &str,
) -> Result<&'a Interface, CniError> {
    prev.interfaces
        .iter()
        .find(|i| i.name == ifname && i.sandbox == sandbox)
        .ok_or_else(|| {
            CniError::check_failed(format!(
                "Sandbox in prevResult doesn't match configured netns: {sandbox}"
            ))
        })
}

/// The container link exists, is of `kind` (when given) and has the MAC
/// recorded in `iface`.
pub async fn validate_link(
    ct: &Netlink,
    iface: &Interface,
    kind: Option<&str>,
) -> Result<Link, CniError> {
    let link = ct.find_link(&iface.name).await?.ok_or_else(|| {
        CniError::check_failed(format!(
            "Container Interface name in prevResult: {} not found",
            iface.name
        ))
    })?;
    link_matches(&link, iface, kind)?;
    Ok(link)
}

/// `link` is of `kind` (when given; "veth" takes netkit too) and has the
/// MAC recorded in `iface`.
pub fn link_matches(link: &Link, iface: &Interface, kind: Option<&str>) -> Result<(), CniError> {
    // "veth" stands for the pairs ADD makes: netkit with linkType netkit.
    let pair = kind == Some("veth") && crate::is_pair_kind(link.kind.as_deref());
    if let Some(kind) = kind
        && link.kind.as_deref() != Some(kind)
        && !pair
    {
        return Err(CniError::check_failed(format!(
            "Error: Container interface {} not of type {kind}",
            link.name
        )));
    }
    let mac = link.mac.map(|m| m.to_string()).unwrap_or_default();
    if !iface.mac.is_empty() && mac != iface.mac {
        return Err(CniError::check_failed(format!(
            "Interface {} Mac {} doesn't match container Mac: {mac}",
            link.name, iface.mac
        )));
    }
    Ok(())
}

/// The host end of the container veth `link`: its peer, in `host`.
/// `missing` is the failure when there is none.
pub async fn veth_peer(host: &Netlink, link: &Link, missing: &str) -> Result<Link, CniError> {
    let peer = link
        .link
        .ok_or_else(|| CniError::check_failed("container veth has no peer"))?;
    host.link_by_index(peer)
        .await
        .map_err(|_| CniError::check_failed(missing))
}

/// Every address of `ips` that belongs to interface `index` of the result
/// (or to no interface in particular) is on `link`.
pub async fn validate_ips(
    ct: &Netlink,
    link: &Link,
    ips: &[IpConfig],
    index: usize,
) -> Result<(), CniError> {
    let have: Vec<IpNetwork> = ct
        .addresses(Some(link.index))
        .await?
        .into_iter()
        .map(|a| a.addr)
        .collect();
    for ip in ips
        .iter()
        .filter(|i| i.interface.is_none_or(|i| i == index))
    {
        if !have.contains(&ip.address) {
            return Err(CniError::check_failed(format!(
                "Failed to match addr {} on interface {}",
                ip.address, link.name
            )));
        }
    }
    Ok(())
}

/// Every route of `routes` is in the main table. A route without `gw` was
/// sent via the interface's gateway by ADD, so any gateway matches it (the
/// reference demands a gateway-less route there and fails its own ADD). A
/// `gw` of 0.0.0.0 or :: is on-link (dhcp's option-121 routes): the kernel
/// keeps no gateway for it.
pub async fn validate_routes(ct: &Netlink, routes: &[Route]) -> Result<(), CniError> {
    // Every table: a route with `table` is set up in it (configure_iface,
    // host-device's useInterfaceNetwork).
    let have = ct.routes_in_table(Family::All, None).await?;
    for r in routes {
        let dst = IpNetwork::new(r.dst.network(), r.dst.prefix()).unwrap_or(r.dst);
        let table = r.table.unwrap_or(TABLE_MAIN);
        let gw_matches = |k: &rcni_netlink::Route| match r.gw {
            None => true,
            Some(g) if g.is_unspecified() => k.gateway.is_none(),
            g => k.gateway == g,
        };
        if !have
            .iter()
            .any(|k| k.table == table && k.dst == dst && gw_matches(k))
        {
            return Err(CniError::check_failed(format!(
                "Failed to find a route to {} in the container",
                r.dst
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_interface_needs_name_and_sandbox() {
        let mut r = CniResult::new("1.0.0");
        r.interfaces.push(Interface {
            name: "eth0".into(),
            sandbox: "/run/netns/a".into(),
            ..Default::default()
        });
        assert!(container_interface(&r, "eth0", "/run/netns/a").is_ok());
        let e = container_interface(&r, "eth0", "/run/netns/b").unwrap_err();
        assert_eq!(e.code, 106);
        assert!(container_interface(&r, "eth1", "/run/netns/a").is_err());
    }
}
