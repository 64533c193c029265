//! What a cross-node agent programs: VXLAN devices, permanent neighbour and
//! FDB entries on them, and routes it owns (tagged with a route protocol of
//! its own, so it finds and removes exactly its routes and never another
//! program's).

use std::net::IpAddr;

use ipnetwork::IpNetwork;
use rtnetlink::packet_core::{NLM_F_CREATE, NLM_F_REPLACE};
use rtnetlink::packet_route::link::{InfoData, InfoVxlan};
use rtnetlink::packet_route::route::{RouteFlags, RouteMessage, RouteProtocol};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::{LinkVxlan, LinkWireguard};

use crate::links::info_data;
use crate::routes::{parse_route, route_message};
use crate::{Error, MacAddr, Netlink, Result, Route, TABLE_MAIN};

/// A VXLAN device as an agent wants it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VxlanSpec {
    pub name: String,
    pub vni: u32,
    /// UDP destination port (8472 for flannel's layout, 4789 IANA).
    pub port: u16,
    /// Source address of the outer packets: the node's underlay address
    /// (IPv6 for a dual-stack node's second device, flannel's `flannel-v6`).
    pub local: IpAddr,
    /// The underlay link the outer packets leave by.
    pub dev: u32,
    pub mtu: u32,
    pub mac: MacAddr,
}

/// The VXLAN attributes of an existing device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VxlanInfo {
    pub vni: Option<u32>,
    pub port: Option<u16>,
    pub local: Option<IpAddr>,
    pub dev: Option<u32>,
    pub learning: Option<bool>,
}

impl VxlanInfo {
    /// True if the device carries what `spec` asks for in the attributes
    /// that can only be set at creation.
    pub fn matches(&self, spec: &VxlanSpec) -> bool {
        self.vni == Some(spec.vni)
            && self.port == Some(spec.port)
            && self.local == Some(spec.local)
            && self.dev == Some(spec.dev)
            && self.learning == Some(false)
    }
}

/// A VXLAN FDB entry (`bridge fdb ... dev <vxlan> dst <ip> self`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FdbEntry {
    pub mac: MacAddr,
    pub dst: Option<IpAddr>,
}

/// A route an agent owns: recognised by its protocol.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnedRoute {
    pub dst: IpNetwork,
    pub gateway: Option<IpAddr>,
    pub oif: Option<u32>,
    /// `RTNH_F_ONLINK`: the gateway is reachable on `oif` without a
    /// covering prefix (a VTEP's peer `.0` address).
    pub onlink: bool,
}

impl std::fmt::Display for OwnedRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.dst)?;
        if let Some(gw) = self.gateway {
            write!(f, " via {gw}")?;
        }
        if let Some(oif) = self.oif {
            write!(f, " dev {oif}")?;
        }
        if self.onlink {
            f.write_str(" onlink")?;
        }
        Ok(())
    }
}

impl Netlink {
    /// Creates a VXLAN device, down, with learning off (the agent programs
    /// every entry; learnt ones would go stale when a peer moves).
    pub async fn create_vxlan(&self, spec: &VxlanSpec) -> Result<()> {
        let b = LinkVxlan::new(&spec.name, spec.vni)
            .dev(spec.dev)
            .port(spec.port);
        let b = match spec.local {
            IpAddr::V4(a) => b.local(a),
            IpAddr::V6(a) => b.local6(a),
        };
        let msg = b
            .learning(false)
            .mtu(spec.mtu)
            .address(spec.mac.0.to_vec())
            .build();
        self.handle.link().add(msg).execute().await.map_err(|e| {
            Error::netlink(
                format!(
                    "create vxlan {} (vni {}, port {})",
                    spec.name, spec.vni, spec.port
                ),
                e,
            )
        })
    }

    /// Creates a WireGuard device, down, with no key or peers (those are set
    /// through the `wireguard` generic netlink family).
    pub async fn create_wireguard(&self, name: &str, mtu: u32) -> Result<()> {
        let msg = LinkWireguard::new(name).mtu(mtu).build();
        self.handle
            .link()
            .add(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink(format!("create wireguard {name}"), e))
    }

    /// The VXLAN attributes of link `index`; `None` if it is not VXLAN.
    pub async fn vxlan_info(&self, index: u32) -> Result<Option<VxlanInfo>> {
        let msg = self.link_message(index).await?;
        let Some(InfoData::Vxlan(data)) = info_data(&msg) else {
            return Ok(None);
        };
        let mut info = VxlanInfo {
            vni: None,
            port: None,
            local: None,
            dev: None,
            learning: None,
        };
        for a in data {
            match a {
                InfoVxlan::Id(v) => info.vni = Some(*v),
                InfoVxlan::Port(p) => info.port = Some(*p),
                InfoVxlan::Local(ip) => info.local = Some(IpAddr::V4(*ip)),
                InfoVxlan::Local6(ip) => info.local = Some(IpAddr::V6(*ip)),
                InfoVxlan::Link(l) => info.dev = Some(*l),
                InfoVxlan::Learning(l) => info.learning = Some(*l),
                _ => {}
            }
        }
        Ok(Some(info))
    }

    /// The main table's routes of `family` (`Inet`/`Inet6`) whose protocol
    /// is `proto`.
    pub async fn owned_routes(&self, v6: bool, proto: u8) -> Result<Vec<OwnedRoute>> {
        let family = if v6 {
            AddressFamily::Inet6
        } else {
            AddressFamily::Inet
        };
        Ok(self
            .route_messages(family)
            .await?
            .iter()
            .filter_map(|m| {
                let r = parse_route(m)?;
                (r.protocol == Some(proto) && r.table == TABLE_MAIN).then_some(OwnedRoute {
                    dst: r.dst,
                    gateway: r.gateway,
                    oif: r.oif,
                    onlink: m.header.flags.contains(RouteFlags::Onlink),
                })
            })
            .collect())
    }

    /// Creates or replaces (same destination in the main table) an owned
    /// route, tagged with `proto`.
    pub async fn replace_owned_route(&self, route: &OwnedRoute, proto: u8) -> Result<()> {
        let op = format!("replace route {route}");
        let msg = owned_route_message(route, proto, false).map_err(|m| Error::other(&op, m))?;
        self.acked_request(
            &op,
            RouteNetlinkMessage::NewRoute(msg),
            NLM_F_CREATE | NLM_F_REPLACE,
        )
        .await
    }

    /// Deletes an owned route; a missing one is an error with
    /// `is_not_found()`. A route of another protocol is never deleted.
    pub async fn del_owned_route(&self, route: &OwnedRoute, proto: u8) -> Result<()> {
        let op = format!("delete route {route}");
        let msg = owned_route_message(route, proto, true).map_err(|m| Error::other(&op, m))?;
        self.acked_request(&op, RouteNetlinkMessage::DelRoute(msg), 0)
            .await
    }
}

/// The route message of an owned route: a main-table unicast route with
/// protocol `proto`, which a delete must match too (the kernel compares a
/// non-zero protocol).
fn owned_route_message(
    route: &OwnedRoute,
    proto: u8,
    delete: bool,
) -> std::result::Result<RouteMessage, String> {
    let mut r = Route::new(route.dst);
    r.gateway = route.gateway;
    r.oif = route.oif;
    r.protocol = Some(proto);
    let mut msg = route_message(&r, delete)?;
    msg.header.protocol = RouteProtocol::from(proto);
    if route.onlink {
        msg.header.flags = RouteFlags::Onlink;
    }
    Ok(msg)
}
