//! VRF devices (L3 master devices with a routing table of their own) and
//! what enslaving a link to one takes: the kernel cycles the link down and
//! up, so its IPv6 addresses go (unless `keep_addr_on_down`) and its routes
//! leave every table; the caller puts back what it saved with these.

use std::net::IpAddr;

use ipnetwork::IpNetwork;
use rtnetlink::LinkVrf;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags};
use rtnetlink::packet_route::link::{InfoData, InfoVrf};
use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute};

use crate::links::info_data;
use crate::{Address, Error, Family, Link, Netlink, Result, family_of};

/// The address flags a new address may carry (what `inet6_rtm_newaddr`
/// keeps of a request's): the rest (tentative, permanent, ...) is state the
/// kernel reports, not a request.
const REQUESTABLE_FLAGS: u32 = 0x02 | 0x04 | 0x10 | 0x100 | 0x200 | 0x400;

impl Netlink {
    /// Creates VRF `name` (down) on routing table `table`.
    pub async fn create_vrf(&self, name: &str, table: u32) -> Result<Link> {
        self.add_link(
            &format!("create vrf {name} (table {table})"),
            LinkVrf::new(name, table).build(),
        )
        .await?;
        self.link_by_name(name).await
    }

    /// The routing table of VRF `index`; `None` if the link is no VRF.
    pub async fn vrf_table(&self, index: u32) -> Result<Option<u32>> {
        let msg = self.link_message(index).await?;
        Ok(match info_data(&msg) {
            Some(InfoData::Vrf(v)) => v.iter().find_map(|i| match i {
                InfoVrf::TableId(t) => Some(*t),
                _ => None,
            }),
            _ => None,
        })
    }

    /// Every VRF of the namespace with its routing table.
    pub async fn vrfs(&self) -> Result<Vec<(Link, u32)>> {
        let mut out = Vec::new();
        for l in self.links().await? {
            if l.kind.as_deref() != Some("vrf") {
                continue;
            }
            match self.vrf_table(l.index).await {
                Ok(Some(t)) => out.push((l, t)),
                Ok(None) => {}
                // Deleted in between.
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// The addresses of link `index` in `family` with their `IFA_F_*` flags.
    pub async fn addresses_with_flags(
        &self,
        index: u32,
        family: Family,
    ) -> Result<Vec<(Address, u32)>> {
        let mut out = Vec::new();
        let families = match family {
            Family::V4 => &[AddressFamily::Inet][..],
            Family::V6 => &[AddressFamily::Inet6][..],
            Family::All => &[AddressFamily::Inet, AddressFamily::Inet6][..],
        };
        for &f in families {
            for m in self.address_messages(Some(index), f).await? {
                let flags = m
                    .attributes
                    .iter()
                    .find_map(|a| match a {
                        AddressAttribute::Flags(f) => Some(f.bits()),
                        _ => None,
                    })
                    .unwrap_or_else(|| u32::from(m.header.flags.bits()));
                let ip = m.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Local(ip) => Some(*ip),
                    _ => None,
                });
                let ip = ip.or_else(|| {
                    m.attributes.iter().find_map(|a| match a {
                        AddressAttribute::Address(ip) => Some(*ip),
                        _ => None,
                    })
                });
                let Some(addr) = ip.and_then(|ip| IpNetwork::new(ip, m.header.prefix_len).ok())
                else {
                    continue;
                };
                out.push((
                    Address {
                        index: m.header.index,
                        addr,
                        scope: m.header.scope.into(),
                    },
                    flags,
                ));
            }
        }
        Ok(out)
    }

    /// Adds an address with the requestable ones of `flags` (`nodad`,
    /// `noprefixroute`, ...; others are ignored): an address put back as it
    /// was listed.
    pub async fn add_address_with_flags(
        &self,
        index: u32,
        addr: IpNetwork,
        flags: u32,
    ) -> Result<()> {
        let flags = flags & REQUESTABLE_FLAGS;
        let mut req = self.handle.address().add(index, addr.ip(), addr.prefix());
        let m = req.message_mut();
        // The header holds the low byte; IFA_FLAGS all of them.
        m.header.flags = AddressHeaderFlags::from_bits_retain(flags as u8);
        m.attributes
            .push(AddressAttribute::Flags(AddressFlags::from_bits_retain(
                flags,
            )));
        req.execute().await.map_err(|e| {
            Error::netlink(
                format!("add address {addr} (flags {flags:#x}) to link {index}"),
                e,
            )
        })
    }

    /// Whether table `table` holds a route of any type (a VRF's `local`
    /// routes included) to the single address `ip` through link `oif`.
    pub async fn has_host_route(&self, ip: IpAddr, table: u32, oif: u32) -> Result<bool> {
        let family = family_of(ip);
        let host = if ip.is_ipv4() { 32 } else { 128 };
        let msgs = self.route_dump(family).await?;
        Ok(msgs.iter().any(|m| {
            let mut t = u32::from(m.header.table);
            let (mut dst, mut dev) = (None, None);
            for a in &m.attributes {
                match a {
                    RouteAttribute::Table(x) => t = *x,
                    RouteAttribute::Destination(RouteAddress::Inet(a)) => {
                        dst = Some(IpAddr::V4(*a))
                    }
                    RouteAttribute::Destination(RouteAddress::Inet6(a)) => {
                        dst = Some(IpAddr::V6(*a))
                    }
                    RouteAttribute::Oif(i) => dev = Some(*i),
                    _ => {}
                }
            }
            m.header.address_family == family
                && m.header.destination_prefix_length == host
                && t == table
                && dst == Some(ip)
                && dev == Some(oif)
        }))
    }
}
