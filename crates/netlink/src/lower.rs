//! Links on a lower device that share its wire: macvlan and ipvlan.

use std::os::fd::{AsFd, AsRawFd};

use rcni_netns::NetNs;
use rtnetlink::packet_route::link::{
    InfoData, InfoIpVlan, InfoKind, InfoMacVlan, IpVlanMode, LinkAttribute, LinkInfo, MacVlanMode,
};
use rtnetlink::{LinkMessageBuilder, LinkUnspec};

use crate::links::info_data;
use crate::{IpvlanMode, Link, MacAddr, MacvlanMode, Netlink, Result, describe_ns};

/// What a macvlan or ipvlan link is created with besides its lower device.
#[derive(Debug, Default, Clone, Copy)]
pub struct LowerOpts<'a> {
    /// `None` leaves the kernel's default, the lower device's MTU.
    pub mtu: Option<u32>,
    /// `None` lets the kernel pick a random one (macvlan) or take the
    /// lower device's (ipvlan, which cannot have its own).
    pub mac: Option<MacAddr>,
    /// Born in this namespace instead of the caller's: the name must then be
    /// free there (callers use a temporary one).
    pub ns: Option<&'a NetNs>,
    /// macvlan: the length of the queue of broadcast and multicast frames
    /// the lower device received for it (`IFLA_MACVLAN_BC_QUEUE_LEN`).
    pub bc_queue_len: Option<u32>,
}

fn macvlan_mode(mode: MacvlanMode) -> MacVlanMode {
    match mode {
        MacvlanMode::Private => MacVlanMode::Private,
        MacvlanMode::Vepa => MacVlanMode::Vepa,
        MacvlanMode::Bridge => MacVlanMode::Bridge,
        MacvlanMode::Passthru => MacVlanMode::Passthrough,
        MacvlanMode::Source => MacVlanMode::Source,
    }
}

impl Netlink {
    /// Create a macvlan on top of `master` (down).
    pub async fn create_macvlan(&self, name: &str, master: u32, mode: MacvlanMode) -> Result<Link> {
        self.create_macvlan_with(name, master, mode, LowerOpts::default())
            .await?;
        self.link_by_name(name).await
    }

    /// Creates macvlan `name` (down) on `lower`, a link of this namespace.
    pub async fn create_macvlan_with(
        &self,
        name: &str,
        lower: u32,
        mode: MacvlanMode,
        opts: LowerOpts<'_>,
    ) -> Result<()> {
        let mut data = vec![InfoMacVlan::Mode(macvlan_mode(mode))];
        if let Some(len) = opts.bc_queue_len {
            data.push(InfoMacVlan::BcQueueLen(len));
        }
        let info = LinkInfo::Data(InfoData::MacVlan(data));
        let op = format!("create macvlan {name} ({mode}) on link {lower}");
        self.add_lower(op, name, lower, InfoKind::MacVlan, info, opts)
            .await
    }

    /// Creates ipvlan `name` (down) on `lower`, a link of this namespace.
    pub async fn create_ipvlan(
        &self,
        name: &str,
        lower: u32,
        mode: IpvlanMode,
        opts: LowerOpts<'_>,
    ) -> Result<()> {
        let m = match mode {
            IpvlanMode::L2 => IpVlanMode::L2,
            IpvlanMode::L3 => IpVlanMode::L3,
            IpvlanMode::L3s => IpVlanMode::L3S,
        };
        let info = LinkInfo::Data(InfoData::IpVlan(vec![InfoIpVlan::Mode(m)]));
        let op = format!("create ipvlan {name} ({mode}) on link {lower}");
        self.add_lower(op, name, lower, InfoKind::IpVlan, info, opts)
            .await
    }

    async fn add_lower(
        &self,
        mut op: String,
        name: &str,
        lower: u32,
        kind: InfoKind,
        data: LinkInfo,
        opts: LowerOpts<'_>,
    ) -> Result<()> {
        let mut b = LinkMessageBuilder::<LinkUnspec>::new()
            .name(name)
            .link(lower)
            .append_extra_attribute(LinkAttribute::LinkInfo(vec![LinkInfo::Kind(kind), data]));
        if let Some(mtu) = opts.mtu {
            b = b.mtu(mtu);
        }
        if let Some(mac) = opts.mac {
            b = b.address(mac.0.to_vec());
        }
        if let Some(ns) = opts.ns {
            b = b.setns_by_fd(ns.as_fd().as_raw_fd());
            op = format!("{op} in {}", describe_ns(ns));
        }
        self.add_link(&op, b.build()).await
    }

    /// The mode of macvlan `index`; `None` if it is not a macvlan.
    pub async fn macvlan_mode(&self, index: u32) -> Result<Option<MacvlanMode>> {
        let msg = self.link_message(index).await?;
        Ok(info_data(&msg).and_then(|d| match d {
            InfoData::MacVlan(v) => v.iter().find_map(|x| match x {
                InfoMacVlan::Mode(m) => Some(match m {
                    MacVlanMode::Private => MacvlanMode::Private,
                    MacVlanMode::Vepa => MacvlanMode::Vepa,
                    MacVlanMode::Bridge => MacvlanMode::Bridge,
                    MacVlanMode::Passthrough => MacvlanMode::Passthru,
                    _ => MacvlanMode::Source,
                }),
                _ => None,
            }),
            _ => None,
        }))
    }

    /// The mode of ipvlan `index`; `None` if it is not an ipvlan (or its
    /// mode is one this crate does not name).
    pub async fn ipvlan_mode(&self, index: u32) -> Result<Option<IpvlanMode>> {
        let msg = self.link_message(index).await?;
        Ok(info_data(&msg).and_then(|d| match d {
            InfoData::IpVlan(v) => v.iter().find_map(|x| match x {
                InfoIpVlan::Mode(IpVlanMode::L2) => Some(IpvlanMode::L2),
                InfoIpVlan::Mode(IpVlanMode::L3) => Some(IpvlanMode::L3),
                InfoIpVlan::Mode(IpVlanMode::L3S) => Some(IpvlanMode::L3s),
                _ => None,
            }),
            _ => None,
        }))
    }
}
