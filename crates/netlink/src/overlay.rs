//! What a cross-node agent programs: VXLAN devices, permanent neighbour and
//! FDB entries on them, and routes it owns (tagged with a route protocol of
//! its own, so it finds and removes exactly its routes and never another
//! program's).

use std::net::IpAddr;

use futures::TryStreamExt;
use ipnetwork::IpNetwork;
use rtnetlink::LinkVxlan;
use rtnetlink::packet_core::{NLM_F_ACK, NLM_F_CREATE, NLM_F_REPLACE, NLM_F_REQUEST};
use rtnetlink::packet_route::link::{InfoData, InfoVxlan, LinkAttribute, LinkInfo};
use rtnetlink::packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};

use crate::{Error, MacAddr, Netlink, Result, TABLE_MAIN, family_of};

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

    /// The VXLAN attributes of link `index`; `None` if it is not VXLAN.
    pub async fn vxlan_info(&self, index: u32) -> Result<Option<VxlanInfo>> {
        let op = || format!("get link {index}");
        let mut stream = self.handle.link().get().match_index(index).execute();
        let msg = match stream.try_next().await {
            Ok(Some(m)) => m,
            Ok(None) => return Err(Error::not_found(op())),
            Err(e) => return Err(Error::netlink(op(), e)),
        };
        let data = msg.attributes.iter().find_map(|a| match a {
            LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
                LinkInfo::Data(InfoData::Vxlan(v)) => Some(v),
                _ => None,
            }),
            _ => None,
        });
        let Some(data) = data else { return Ok(None) };
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

    /// Adds or replaces a permanent neighbour entry `ip -> mac` on `index`
    /// (`ip neigh replace ... nud permanent`).
    pub async fn replace_permanent_neighbour(
        &self,
        index: u32,
        ip: IpAddr,
        mac: MacAddr,
    ) -> Result<()> {
        self.handle
            .neighbours()
            .add(index, ip)
            .state(NeighbourState::Permanent)
            .link_layer_address(&mac.0)
            .replace()
            .execute()
            .await
            .map_err(|e| Error::netlink(format!("replace neighbour {ip} {mac} on link {index}"), e))
    }

    /// Deletes the neighbour entry of `ip` on `index`; a missing one is an
    /// error with `is_not_found()`.
    pub async fn del_neighbour(&self, index: u32, ip: IpAddr) -> Result<()> {
        let mut msg = NeighbourMessage::default();
        msg.header.family = family_of(ip);
        msg.header.ifindex = index;
        msg.attributes
            .push(NeighbourAttribute::Destination(match ip {
                IpAddr::V4(v4) => NeighbourAddress::Inet(v4),
                IpAddr::V6(v6) => NeighbourAddress::Inet6(v6),
            }));
        self.handle
            .neighbours()
            .del(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink(format!("delete neighbour {ip} on link {index}"), e))
    }

    /// The FDB entries the device `index` itself holds (`NTF_SELF`), as
    /// `bridge fdb show dev <index>` lists them.
    pub async fn fdb_entries(&self, index: u32) -> Result<Vec<FdbEntry>> {
        // The whole AF_BRIDGE dump, filtered here: strict checking refuses
        // a neighbour dump request with header fields set.
        let msgs: Vec<NeighbourMessage> = self
            .handle
            .neighbours()
            .get()
            .set_address_family(AddressFamily::Bridge)
            .execute()
            .try_collect()
            .await
            .map_err(|e| Error::netlink("list fdb entries", e))?;
        Ok(msgs
            .iter()
            .filter(|m| m.header.ifindex == index && m.header.family == AddressFamily::Bridge)
            .filter_map(|m| {
                let mac = m.attributes.iter().find_map(|a| match a {
                    NeighbourAttribute::LinkLayerAddress(b) => MacAddr::from_slice(b),
                    _ => None,
                })?;
                let dst = m.attributes.iter().find_map(|a| match a {
                    NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)) => {
                        Some(IpAddr::V4(*ip))
                    }
                    NeighbourAttribute::Destination(NeighbourAddress::Inet6(ip)) => {
                        Some(IpAddr::V6(*ip))
                    }
                    // In an AF_BRIDGE message the parser cannot tell the
                    // address family from the header: the length does.
                    NeighbourAttribute::Destination(NeighbourAddress::Other(b)) => match b.len() {
                        4 => <[u8; 4]>::try_from(b.as_slice()).ok().map(IpAddr::from),
                        16 => <[u8; 16]>::try_from(b.as_slice()).ok().map(IpAddr::from),
                        _ => None,
                    },
                    _ => None,
                });
                Some(FdbEntry { mac, dst })
            })
            .collect())
    }

    /// Adds or replaces the VXLAN FDB entry `mac -> dst` on `index`
    /// (`bridge fdb replace <mac> dev <vxlan> dst <dst> self permanent`).
    pub async fn replace_fdb(&self, index: u32, mac: MacAddr, dst: IpAddr) -> Result<()> {
        self.handle
            .neighbours()
            .add_bridge(index, &mac.0)
            .flags(NeighbourFlags::Own)
            .state(NeighbourState::Permanent)
            .destination(dst)
            .replace()
            .execute()
            .await
            .map_err(|e| Error::netlink(format!("replace fdb {mac} dst {dst} on link {index}"), e))
    }

    /// Deletes the FDB entry `mac -> dst` of `index` (only that remote when
    /// the entry has several).
    pub async fn del_fdb(&self, index: u32, mac: MacAddr, dst: Option<IpAddr>) -> Result<()> {
        let mut msg = NeighbourMessage::default();
        msg.header.family = AddressFamily::Bridge;
        msg.header.ifindex = index;
        msg.header.flags = NeighbourFlags::Own;
        msg.attributes
            .push(NeighbourAttribute::LinkLayerAddress(mac.0.to_vec()));
        if let Some(ip) = dst {
            msg.attributes
                .push(NeighbourAttribute::Destination(match ip {
                    IpAddr::V4(v4) => NeighbourAddress::Inet(v4),
                    IpAddr::V6(v6) => NeighbourAddress::Inet6(v6),
                }));
        }
        self.handle
            .neighbours()
            .del(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink(format!("delete fdb {mac} on link {index}"), e))
    }

    /// The main table's routes of `family` (`Inet`/`Inet6`) whose protocol
    /// is `proto`.
    pub async fn owned_routes(&self, v6: bool, proto: u8) -> Result<Vec<OwnedRoute>> {
        let family = if v6 {
            AddressFamily::Inet6
        } else {
            AddressFamily::Inet
        };
        let mut msg = RouteMessage::default();
        msg.header.address_family = family;
        let msgs: Vec<RouteMessage> = self
            .handle
            .route()
            .get(msg)
            .execute()
            .try_collect()
            .await
            .map_err(|e| Error::netlink("list routes", e))?;
        Ok(msgs
            .iter()
            .filter(|m| {
                m.header.address_family == family
                    && m.header.kind == RouteType::Unicast
                    && u8::from(m.header.protocol) == proto
            })
            .filter(|m| {
                let table = m
                    .attributes
                    .iter()
                    .find_map(|a| match a {
                        RouteAttribute::Table(t) => Some(*t),
                        _ => None,
                    })
                    .unwrap_or(u32::from(m.header.table));
                table == TABLE_MAIN
            })
            .filter_map(|m| {
                let mut dst = None;
                let mut r = OwnedRoute {
                    dst: IpNetwork::new(unspecified(v6), 0).ok()?,
                    gateway: None,
                    oif: None,
                    onlink: m.header.flags.contains(RouteFlags::Onlink),
                };
                for a in &m.attributes {
                    match a {
                        RouteAttribute::Destination(a) => dst = route_ip(a),
                        RouteAttribute::Gateway(a) => r.gateway = route_ip(a),
                        RouteAttribute::Oif(i) => r.oif = Some(*i),
                        _ => {}
                    }
                }
                r.dst = IpNetwork::new(
                    dst.unwrap_or(unspecified(v6)),
                    m.header.destination_prefix_length,
                )
                .ok()?;
                Some(r)
            })
            .collect())
    }

    /// Creates or replaces (same destination in the main table) an owned
    /// route, tagged with `proto`.
    pub async fn replace_owned_route(&self, route: &OwnedRoute, proto: u8) -> Result<()> {
        let msg = owned_route_message(route, Some(proto));
        self.route_request(
            format!("replace route {route}"),
            RouteNetlinkMessage::NewRoute(msg),
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        )
        .await
    }

    /// Deletes an owned route; a missing one is an error with
    /// `is_not_found()`.
    pub async fn del_owned_route(&self, route: &OwnedRoute, proto: u8) -> Result<()> {
        let mut msg = owned_route_message(route, Some(proto));
        msg.header.scope = RouteScope::NoWhere;
        self.route_request(
            format!("delete route {route}"),
            RouteNetlinkMessage::DelRoute(msg),
            NLM_F_REQUEST | NLM_F_ACK,
        )
        .await
    }
}

fn unspecified(v6: bool) -> IpAddr {
    if v6 {
        IpAddr::from([0u16; 8])
    } else {
        IpAddr::from([0u8; 4])
    }
}

fn route_ip(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(ip) => Some(IpAddr::V4(*ip)),
        RouteAddress::Inet6(ip) => Some(IpAddr::V6(*ip)),
        _ => None,
    }
}

fn owned_route_message(route: &OwnedRoute, proto: Option<u8>) -> RouteMessage {
    let mut msg = RouteMessage::default();
    msg.header.address_family = family_of(route.dst.ip());
    msg.header.destination_prefix_length = route.dst.prefix();
    msg.header.table = TABLE_MAIN as u8;
    msg.header.kind = RouteType::Unicast;
    msg.header.scope = RouteScope::Universe;
    if let Some(p) = proto {
        msg.header.protocol = RouteProtocol::from(p);
    }
    if route.onlink {
        msg.header.flags = RouteFlags::Onlink;
    }
    if route.dst.prefix() > 0 {
        msg.attributes
            .push(RouteAttribute::Destination(RouteAddress::from(
                route.dst.network(),
            )));
    }
    if let Some(gw) = route.gateway {
        msg.attributes
            .push(RouteAttribute::Gateway(RouteAddress::from(gw)));
    }
    if let Some(oif) = route.oif {
        msg.attributes.push(RouteAttribute::Oif(oif));
    }
    msg
}
