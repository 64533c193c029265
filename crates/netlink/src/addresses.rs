//! Interface addresses.

use futures::TryStreamExt;
use ipnetwork::IpNetwork;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags, AddressMessage};

use crate::{Address, Error, Netlink, Result, family_of};

impl Netlink {
    /// Addresses of one link, or of all links.
    pub async fn addresses(&self, index: Option<u32>) -> Result<Vec<Address>> {
        // One dump per family: the kernel dumps a single family without
        // rtnl (6.9 and later), while AF_UNSPEC goes through rtnl_dump_all,
        // which waits for the lock behind every link change on the node.
        // In turn: a socket runs one dump at a time (EBUSY).
        let mut v = self.addresses_of(index, AddressFamily::Inet).await?;
        v.extend(self.addresses_of(index, AddressFamily::Inet6).await?);
        Ok(v)
    }

    async fn addresses_of(
        &self,
        index: Option<u32>,
        family: AddressFamily,
    ) -> Result<Vec<Address>> {
        let msgs = self.address_messages(index, family).await?;
        Ok(msgs.iter().filter_map(parse_address).collect())
    }

    /// A dump of one family's addresses (of link `index` only, if given),
    /// as the kernel sends them.
    pub(crate) async fn address_messages(
        &self,
        index: Option<u32>,
        family: AddressFamily,
    ) -> Result<Vec<AddressMessage>> {
        let mut req = self.handle.address().get();
        req.message_mut().header.family = family;
        if let Some(index) = index {
            req.message_mut().header.index = index;
            req = req.set_link_index_filter(index);
        }
        let msgs: Vec<AddressMessage> = req
            .execute()
            .try_collect()
            .await
            .map_err(|e| Error::netlink("list addresses", e))?;
        // A kernel without IPv6 answers an AF_INET6 dump with every family.
        Ok(msgs
            .into_iter()
            .filter(|m| m.header.family == family)
            .collect())
    }

    /// The addresses of link `index`, each with whether it is permanent
    /// (`IFA_F_PERMANENT`): put there by a configuration, not by SLAAC or a
    /// DHCPv6 lease, which carry lifetimes.
    pub async fn addresses_with_permanence(&self, index: u32) -> Result<Vec<(Address, bool)>> {
        let mut v = Vec::new();
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            for m in self.address_messages(Some(index), family).await? {
                if let Some(a) = parse_address(&m) {
                    let permanent = crate::dad::flags_of(&m).contains(AddressFlags::Permanent);
                    v.push((a, permanent));
                }
            }
        }
        Ok(v)
    }

    /// Add an address, keeping its host bits (`10.0.0.2/24`). The kernel
    /// adds the prefix route with it.
    pub async fn add_address(&self, index: u32, addr: IpNetwork) -> Result<()> {
        self.handle
            .address()
            .add(index, addr.ip(), addr.prefix())
            .execute()
            .await
            .map_err(|e| Error::netlink(format!("add address {addr} to link {index}"), e))
    }

    /// Like [`Netlink::add_address`], but an existing address is success.
    pub async fn ensure_address(&self, index: u32, addr: IpNetwork) -> Result<()> {
        match self.add_address(index, addr).await {
            Err(e) if e.is_exists() => Ok(()),
            r => r,
        }
    }

    /// Delete an address; a missing one is an error with `is_not_found()`
    /// (EADDRNOTAVAIL).
    pub async fn del_address(&self, index: u32, addr: IpNetwork) -> Result<()> {
        let mut msg = AddressMessage::default();
        msg.header.index = index;
        msg.header.prefix_len = addr.prefix();
        msg.header.family = family_of(addr.ip());
        msg.attributes.push(AddressAttribute::Local(addr.ip()));
        msg.attributes.push(AddressAttribute::Address(addr.ip()));
        self.handle
            .address()
            .del(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink(format!("delete address {addr} from link {index}"), e))
    }
}

fn parse_address(m: &AddressMessage) -> Option<Address> {
    // For IPv4, IFA_LOCAL is the interface's own address and IFA_ADDRESS the
    // peer on point-to-point links; IPv6 only sends IFA_ADDRESS.
    let local = m.attributes.iter().find_map(|a| match a {
        AddressAttribute::Local(ip) => Some(*ip),
        _ => None,
    });
    let address = m.attributes.iter().find_map(|a| match a {
        AddressAttribute::Address(ip) => Some(*ip),
        _ => None,
    });
    let ip = local.or(address)?;
    Some(Address {
        index: m.header.index,
        addr: IpNetwork::new(ip, m.header.prefix_len).ok()?,
        scope: m.header.scope.into(),
    })
}
