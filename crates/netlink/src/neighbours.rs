//! Neighbour (ARP / NDP) entries and the FDB entries a VXLAN device holds
//! itself: both are neighbour messages, of family inet/inet6 or bridge.

use std::net::IpAddr;

use futures::TryStreamExt;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};

use crate::overlay::FdbEntry;
use crate::{Error, MacAddr, Neighbour, Netlink, Result, family_of};

impl Netlink {
    /// IPv4 and IPv6 neighbour entries of one link, or of all links.
    pub async fn neighbours(&self, index: Option<u32>) -> Result<Vec<Neighbour>> {
        let msgs = self
            .neighbour_messages(AddressFamily::Unspec, "list neighbours")
            .await?;
        Ok(msgs
            .iter()
            .filter(|m| index.is_none_or(|i| m.header.ifindex == i))
            .filter_map(|m| {
                Some(Neighbour {
                    index: m.header.ifindex,
                    ip: destination(m)?,
                    mac: link_layer_address(m),
                    state: m.header.state.into(),
                })
            })
            .collect())
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
            .push(NeighbourAttribute::Destination(NeighbourAddress::from(ip)));
        self.del_neighbour_message(format!("delete neighbour {ip} on link {index}"), msg)
            .await
    }

    /// The FDB entries the device `index` itself holds (`NTF_SELF`), as
    /// `bridge fdb show dev <index>` lists them.
    pub async fn fdb_entries(&self, index: u32) -> Result<Vec<FdbEntry>> {
        // The whole AF_BRIDGE dump, filtered here: strict checking refuses
        // a neighbour dump request with header fields set.
        let msgs = self
            .neighbour_messages(AddressFamily::Bridge, "list fdb entries")
            .await?;
        Ok(msgs
            .iter()
            .filter(|m| m.header.ifindex == index && m.header.family == AddressFamily::Bridge)
            .filter_map(|m| {
                Some(FdbEntry {
                    mac: link_layer_address(m)?,
                    dst: destination(m),
                })
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
                .push(NeighbourAttribute::Destination(NeighbourAddress::from(ip)));
        }
        self.del_neighbour_message(format!("delete fdb {mac} on link {index}"), msg)
            .await
    }

    /// A neighbour dump of `family` (`Unspec`: IPv4 and IPv6).
    async fn neighbour_messages(
        &self,
        family: AddressFamily,
        op: &str,
    ) -> Result<Vec<NeighbourMessage>> {
        let mut req = self.handle.neighbours().get();
        if family != AddressFamily::Unspec {
            req = req.set_address_family(family);
        }
        req.execute()
            .try_collect()
            .await
            .map_err(|e| Error::netlink(op, e))
    }

    async fn del_neighbour_message(&self, op: String, msg: NeighbourMessage) -> Result<()> {
        self.handle
            .neighbours()
            .del(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink(op, e))
    }
}

fn link_layer_address(m: &NeighbourMessage) -> Option<MacAddr> {
    m.attributes.iter().find_map(|a| match a {
        NeighbourAttribute::LinkLayerAddress(b) => MacAddr::from_slice(b),
        _ => None,
    })
}

fn destination(m: &NeighbourMessage) -> Option<IpAddr> {
    m.attributes.iter().find_map(|a| match a {
        NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)) => Some(IpAddr::V4(*ip)),
        NeighbourAttribute::Destination(NeighbourAddress::Inet6(ip)) => Some(IpAddr::V6(*ip)),
        // In an AF_BRIDGE message the parser cannot tell the address
        // family from the header: the length does.
        NeighbourAttribute::Destination(NeighbourAddress::Other(b)) => match b.len() {
            4 => <[u8; 4]>::try_from(b.as_slice()).ok().map(IpAddr::from),
            16 => <[u8; 16]>::try_from(b.as_slice()).ok().map(IpAddr::from),
            _ => None,
        },
        _ => None,
    })
}
