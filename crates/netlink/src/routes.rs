//! Unicast routes: listing, adding, replacing, deleting.

use std::net::IpAddr;

use futures::TryStreamExt;
use ipnetwork::IpNetwork;
use rtnetlink::packet_core::{NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteMetric, RouteProtocol,
    RouteScope, RouteType, RouteVia,
};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};

use crate::{Error, Family, Netlink, Result, Route, TABLE_MAIN, family_of};

impl Netlink {
    /// Unicast routes of the main table.
    pub async fn routes(&self, family: Family) -> Result<Vec<Route>> {
        self.routes_in_table(family, Some(TABLE_MAIN)).await
    }

    /// Unicast routes of one table, or of all tables with `None`.
    pub async fn routes_in_table(&self, family: Family, table: Option<u32>) -> Result<Vec<Route>> {
        // Per family and in turn, for the reasons given in `addresses`.
        let mut v = Vec::new();
        if family != Family::V6 {
            v = self.routes_of(AddressFamily::Inet, table).await?;
        }
        if family != Family::V4 {
            v.extend(self.routes_of(AddressFamily::Inet6, table).await?);
        }
        Ok(v)
    }

    async fn routes_of(&self, family: AddressFamily, table: Option<u32>) -> Result<Vec<Route>> {
        Ok(self
            .route_messages(family)
            .await?
            .iter()
            .filter_map(parse_route)
            .filter(|r| table.is_none_or(|t| r.table == t))
            .collect())
    }

    /// The unicast routes of `family` (`Inet`, `Inet6`) in every table, as
    /// the kernel sends them.
    pub(crate) async fn route_messages(&self, family: AddressFamily) -> Result<Vec<RouteMessage>> {
        Ok(self
            .route_dump(family)
            .await?
            .into_iter()
            .filter(|m| m.header.kind == RouteType::Unicast)
            .collect())
    }

    /// The routes of `family` of every type (a VRF's `local` ones too) in
    /// every table.
    pub(crate) async fn route_dump(&self, family: AddressFamily) -> Result<Vec<RouteMessage>> {
        let mut msg = RouteMessage::default();
        msg.header.address_family = family;
        // Without NETLINK_GET_STRICT_CHK the kernel ignores every header
        // field but the family, so filtering happens here.
        let msgs: Vec<RouteMessage> = self
            .handle
            .route()
            .get(msg)
            .execute()
            .try_collect()
            .await
            .map_err(|e| Error::netlink("list routes", e))?;
        Ok(msgs
            .into_iter()
            .filter(|m| m.header.address_family == family)
            .collect())
    }

    /// Add a route; an identical one is an error with `is_exists()`.
    pub async fn add_route(&self, route: &Route) -> Result<()> {
        self.change_route("add", route, NLM_F_CREATE | NLM_F_EXCL)
            .await
    }

    /// Create the route or replace the one with the same destination, table
    /// and metric (`ip route replace`).
    pub async fn ensure_route(&self, route: &Route) -> Result<()> {
        self.change_route("replace", route, NLM_F_CREATE | NLM_F_REPLACE)
            .await
    }

    /// Delete a route matching destination, table and whichever of gateway,
    /// oif and metric are set (scope is ignored, as in `ip route del`). A
    /// missing one is an error with `is_not_found()` (ESRCH).
    pub async fn del_route(&self, route: &Route) -> Result<()> {
        self.change_route("delete", route, 0).await
    }

    /// `verb` is "add", "replace" or "delete".
    async fn change_route(&self, verb: &str, route: &Route, flags: u16) -> Result<()> {
        let op = format!("{verb} route {route}");
        let delete = verb == "delete";
        let msg = route_message(route, delete).map_err(|m| Error::other(&op, m))?;
        let msg = if delete {
            RouteNetlinkMessage::DelRoute(msg)
        } else {
            RouteNetlinkMessage::NewRoute(msg)
        };
        self.acked_request(&op, msg, flags).await
    }
}

fn route_addr(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(ip) => Some(IpAddr::V4(*ip)),
        RouteAddress::Inet6(ip) => Some(IpAddr::V6(*ip)),
        _ => None,
    }
}

pub(crate) fn parse_route(m: &RouteMessage) -> Option<Route> {
    let unspecified = match m.header.address_family {
        AddressFamily::Inet => IpAddr::from([0u8; 4]),
        AddressFamily::Inet6 => IpAddr::from([0u16; 8]),
        _ => return None,
    };
    let mut dst_ip = unspecified;
    let mut route = Route::new(IpNetwork::new(unspecified, 0).ok()?);
    route.table = u32::from(m.header.table);
    route.scope = m.header.scope.into();
    route.protocol = Some(m.header.protocol.into());
    for attr in &m.attributes {
        match attr {
            RouteAttribute::Destination(a) => dst_ip = route_addr(a)?,
            RouteAttribute::Gateway(a) => route.gateway = route_addr(a),
            RouteAttribute::Via(RouteVia::Inet(ip)) => route.gateway = Some(IpAddr::V4(*ip)),
            RouteAttribute::Via(RouteVia::Inet6(ip)) => route.gateway = Some(IpAddr::V6(*ip)),
            RouteAttribute::Oif(i) => route.oif = Some(*i),
            RouteAttribute::PrefSource(a) => route.src = route_addr(a),
            RouteAttribute::Table(t) => route.table = *t,
            RouteAttribute::Priority(p) => route.metric = Some(*p),
            RouteAttribute::Metrics(metrics) => {
                for metric in metrics {
                    match metric {
                        RouteMetric::Mtu(v) => route.mtu = Some(*v),
                        RouteMetric::Advmss(v) => route.advmss = Some(*v),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    route.dst = IpNetwork::new(dst_ip, m.header.destination_prefix_length).ok()?;
    Some(route)
}

/// Build the `RTM_NEWROUTE` / `RTM_DELROUTE` message for `route`.
pub(crate) fn route_message(
    route: &Route,
    delete: bool,
) -> std::result::Result<RouteMessage, String> {
    let family = family_of(route.dst.ip());
    // The kernel rejects IPv4 destinations with host bits set; the network
    // is what the caller means.
    let dst = route.dst.network();
    let mut msg = RouteMessage::default();
    msg.header.address_family = family;
    msg.header.destination_prefix_length = route.dst.prefix();
    if route.table < 256 {
        msg.header.table = route.table as u8;
    } else {
        msg.header.table = RouteHeader::RT_TABLE_UNSPEC;
    }
    msg.attributes.push(RouteAttribute::Table(route.table));
    if delete {
        // As `ip route del`: match any scope, protocol and type.
        msg.header.scope = RouteScope::NoWhere;
    } else {
        msg.header.scope = route.scope.into();
        msg.header.protocol = route
            .protocol
            .map_or(RouteProtocol::Boot, RouteProtocol::from);
        msg.header.kind = RouteType::Unicast;
    }
    if route.dst.prefix() > 0 {
        msg.attributes
            .push(RouteAttribute::Destination(RouteAddress::from(dst)));
    }
    if let Some(gw) = route.gateway {
        let attr = match (route.dst.ip(), gw) {
            (IpAddr::V4(_), IpAddr::V4(_)) | (IpAddr::V6(_), IpAddr::V6(_)) => {
                RouteAttribute::Gateway(RouteAddress::from(gw))
            }
            (IpAddr::V4(_), IpAddr::V6(v6)) => RouteAttribute::Via(RouteVia::Inet6(v6)),
            (IpAddr::V6(_), IpAddr::V4(_)) => {
                return Err(format!("IPv4 gateway {gw} for an IPv6 destination"));
            }
        };
        msg.attributes.push(attr);
    }
    if let Some(oif) = route.oif {
        msg.attributes.push(RouteAttribute::Oif(oif));
    }
    if let Some(src) = route.src {
        if family_of(src) != family {
            return Err(format!("source {src} is not of the destination's family"));
        }
        msg.attributes
            .push(RouteAttribute::PrefSource(RouteAddress::from(src)));
    }
    if let Some(metric) = route.metric {
        msg.attributes.push(RouteAttribute::Priority(metric));
    }
    if !delete {
        let mut metrics = Vec::new();
        if let Some(mtu) = route.mtu {
            metrics.push(RouteMetric::Mtu(mtu));
        }
        if let Some(advmss) = route.advmss {
            metrics.push(RouteMetric::Advmss(advmss));
        }
        if !metrics.is_empty() {
            msg.attributes.push(RouteAttribute::Metrics(metrics));
        }
    }
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_message_masks_host_bits_and_sets_table() {
        let r = Route::new("10.1.2.3/24".parse().unwrap())
            .gateway("10.1.2.1".parse().unwrap())
            .table(1000)
            .metric(7)
            .mtu(1400);
        let m = route_message(&r, false).unwrap();
        assert_eq!(m.header.destination_prefix_length, 24);
        assert_eq!(m.header.table, 0);
        assert!(m.attributes.contains(&RouteAttribute::Table(1000)));
        assert!(
            m.attributes
                .contains(&RouteAttribute::Destination(RouteAddress::Inet(
                    "10.1.2.0".parse().unwrap()
                )))
        );
        assert!(m.attributes.contains(&RouteAttribute::Priority(7)));
        assert!(
            m.attributes
                .contains(&RouteAttribute::Metrics(vec![RouteMetric::Mtu(1400)]))
        );
        let d = route_message(&r, true).unwrap();
        assert_eq!(d.header.scope, RouteScope::NoWhere);
        assert!(
            !d.attributes
                .iter()
                .any(|a| matches!(a, RouteAttribute::Metrics(_)))
        );
    }

    #[test]
    fn route_message_rejects_mixed_families() {
        let r = Route::new("2001:db8::/64".parse().unwrap()).gateway("10.0.0.1".parse().unwrap());
        assert!(route_message(&r, false).is_err());
        let r = Route::new("10.0.0.0/8".parse().unwrap()).src("::1".parse().unwrap());
        assert!(route_message(&r, false).is_err());
    }
}
