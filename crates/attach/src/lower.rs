//! What macvlan and ipvlan share: the master (lower device) named by the
//! config, or the interface of the default route when it names none, in
//! the node's namespace or, with `linkInContainer`, the container's.

use rcni_cni::CniError;
use rcni_netlink::{Family, Link, Netlink};

/// The interface of the first default route of the main table (IPv4
/// before IPv6), as the reference's `getDefaultRouteInterfaceName`.
pub async fn default_route_link(nl: &Netlink) -> Result<Link, CniError> {
    let routes = nl.routes(Family::All).await?;
    for r in routes.iter().filter(|r| r.dst.prefix() == 0) {
        if let Some(oif) = r.oif {
            return Ok(nl.link_by_index(oif).await?);
        }
    }
    Err(CniError::config("no default route interface found"))
}

/// The master: `name`, or the default route's interface when it is empty,
/// looked up in `nl`'s namespace.
pub async fn find_master(nl: &Netlink, name: &str) -> Result<Link, CniError> {
    if name.is_empty() {
        return default_route_link(nl).await;
    }
    nl.find_link(name).await?.ok_or_else(|| {
        CniError::config(format!("failed to lookup master {name:?}: link not found"))
    })
}

/// The `mtu` key of a link on a master: 0 (or absent) is the master's,
/// negative or above the master's is a config error, with the reference's
/// wording.
pub fn check_mtu(mtu: i64, master: &Link) -> Result<Option<u32>, CniError> {
    if mtu < 0 || mtu > i64::from(master.mtu) {
        return Err(CniError::config(format!(
            "invalid MTU {mtu}, must be [0, master MTU({})]",
            master.mtu
        )));
    }
    Ok((mtu > 0).then_some(mtu as u32))
}
