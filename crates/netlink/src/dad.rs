//! IPv6 duplicate address detection: skipped for addresses that are ours by
//! construction (the ends of a point-to-point veth), waited out for
//! addresses on a shared segment (vlan, a moved host device).
//!
//! An IPv6 address is "tentative" from the moment it is added until DAD
//! completes (about a second); the kernel refuses it as a route's preferred
//! source and does not answer for it meanwhile. Even with the interface's
//! `accept_dad` at 0 it stays tentative until the DAD work item has run, so
//! a sysctl alone leaves a race; `IFA_F_NODAD` never makes it tentative.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use ipnetwork::IpNetwork;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::address::{
    AddressAttribute, AddressFlags, AddressHeaderFlags, AddressMessage,
};

use crate::{Error, Netlink, Result};

/// How often [`Netlink::wait_dad`] looks, as the reference's SettleAddresses.
const SETTLE_INTERVAL: Duration = Duration::from_millis(50);

pub(crate) fn flags_of(m: &AddressMessage) -> AddressFlags {
    m.attributes
        .iter()
        .find_map(|a| match a {
            AddressAttribute::Flags(f) => Some(*f),
            _ => None,
        })
        .unwrap_or_else(|| AddressFlags::from_bits_retain(u32::from(m.header.flags.bits())))
}

fn ip_of(m: &AddressMessage) -> Option<IpAddr> {
    m.attributes.iter().find_map(|a| match a {
        AddressAttribute::Address(ip) => Some(*ip),
        _ => None,
    })
}

impl Netlink {
    /// Adds an address without duplicate address detection (IPv6; IPv4 has
    /// none): usable as a source and answered for at once.
    pub async fn add_address_nodad(&self, index: u32, addr: IpNetwork) -> Result<()> {
        let mut req = self.handle.address().add(index, addr.ip(), addr.prefix());
        if addr.is_ipv6() {
            let m = req.message_mut();
            m.header.flags |= AddressHeaderFlags::Nodad;
            m.attributes
                .push(AddressAttribute::Flags(AddressFlags::Nodad));
        }
        req.execute()
            .await
            .map_err(|e| Error::netlink(format!("add address {addr} (nodad) to link {index}"), e))
    }

    /// [`Netlink::add_address_nodad`]; an existing address is success.
    pub async fn ensure_address_nodad(&self, index: u32, addr: IpNetwork) -> Result<()> {
        match self.add_address_nodad(index, addr).await {
            Err(e) if e.is_exists() => Ok(()),
            r => r,
        }
    }

    /// Waits until none of `addrs` on link `index` is tentative any more.
    /// An address whose DAD failed (another host holds it) is an error at
    /// once, and so is one still tentative after `timeout`.
    pub async fn wait_dad(&self, index: u32, addrs: &[IpAddr], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let msgs = self
                .address_messages(Some(index), AddressFamily::Inet6)
                .await?;
            let mut tentative = false;
            for m in msgs
                .iter()
                .filter(|m| ip_of(m).is_some_and(|ip| addrs.contains(&ip)))
            {
                let f = flags_of(m);
                if f.contains(AddressFlags::Dadfailed) {
                    let ip = ip_of(m).expect("filtered on it");
                    return Err(Error::other(
                        format!("add address {ip} to link {index}"),
                        "duplicate address detected: another host on the link holds it",
                    ));
                }
                tentative |= f.contains(AddressFlags::Tentative);
            }
            if !tentative {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::other(
                    format!("wait for addresses of link {index}"),
                    format!("still tentative after {} seconds", timeout.as_secs()),
                ));
            }
            tokio::time::sleep(SETTLE_INTERVAL).await;
        }
    }
}
