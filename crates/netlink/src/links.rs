//! Links: lookup, creation (veth), attributes, deletion. Bridges
//! are in `bridge.rs`, VLANs in `vlan.rs`, ipvlan and macvlan options in
//! `lower.rs`.

use std::os::fd::{AsFd, AsRawFd};

use futures::TryStreamExt;
use rcni_netns::NetNs;
use rtnetlink::packet_core::DefaultNla;
use rtnetlink::packet_route::link::{
    AfSpecInet, AfSpecInet6, AfSpecUnspec, In6AddrGenMode, InfoData, InfoKind, InfoNetkit,
    InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage, NetkitMode, NetkitPolicy, State,
};
use rtnetlink::{LinkMessageBuilder, LinkUnspec};

use crate::{Error, Link, MacAddr, Netlink, Result, describe_ns};

/// `IFLA_INET_CONF` inside `IFLA_AF_SPEC`/`AF_INET`.
const IFLA_INET_CONF: u16 = 1;

/// Longest interface name the kernel accepts (`IFNAMSIZ - 1`).
const IFNAMSIZ_MAX: usize = 15;

impl Netlink {
    pub async fn links(&self) -> Result<Vec<Link>> {
        self.handle
            .link()
            .get()
            .execute()
            .map_ok(|m| parse_link(&m))
            .try_collect()
            .await
            .map_err(|e| Error::netlink("list links", e))
    }

    /// Look a link up by name; a missing one is an error with
    /// [`Error::is_not_found`].
    pub async fn link_by_name(&self, name: &str) -> Result<Link> {
        let op = || format!("get link {name}");
        // Such a name cannot exist; the kernel would reject it with a policy
        // error rather than ENODEV.
        if name.is_empty() || name.len() > IFNAMSIZ_MAX {
            return Err(Error::not_found(op()));
        }
        let mut stream = self.handle.link().get().match_name(name).execute();
        match stream.try_next().await {
            Ok(Some(m)) => Ok(parse_link(&m)),
            Ok(None) => Err(Error::not_found(op())),
            Err(e) => Err(Error::netlink(op(), e)),
        }
    }

    pub async fn link_by_index(&self, index: u32) -> Result<Link> {
        Ok(parse_link(&self.link_message(index).await?))
    }

    /// The kernel's message for link `index`, for the attributes [`Link`]
    /// leaves out (bridge port data, VXLAN data).
    pub(crate) async fn link_message(&self, index: u32) -> Result<LinkMessage> {
        let op = || format!("get link {index}");
        if index == 0 {
            return Err(Error::not_found(op()));
        }
        let mut stream = self.handle.link().get().match_index(index).execute();
        match stream.try_next().await {
            Ok(Some(m)) => Ok(m),
            Ok(None) => Err(Error::not_found(op())),
            Err(e) => Err(Error::netlink(op(), e)),
        }
    }

    /// `Ok(None)` if there is no link of that name.
    pub async fn find_link(&self, name: &str) -> Result<Option<Link>> {
        match self.link_by_name(name).await {
            Ok(l) => Ok(Some(l)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub(crate) async fn set_link(&self, op: String, msg: LinkMessage) -> Result<()> {
        self.handle
            .link()
            .set(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink(op, e))
    }

    /// Sets per-link IPv4 sysctls (`net/ipv4/conf/<link>/...`, by their
    /// `IPV4_DEVCONF_*` ids) over netlink, as writing the files does: no
    /// /proc/sys path walk, whose cost grows with the node's namespaces.
    pub async fn set_ipv4_devconf(&self, index: u32, values: &[(u16, u32)]) -> Result<()> {
        // IFLA_INET_CONF nests one u32 attribute per value, typed by id.
        let mut nested = Vec::with_capacity(values.len() * 8);
        for (id, v) in values {
            nested.extend(8u16.to_ne_bytes());
            nested.extend(id.to_ne_bytes());
            nested.extend(v.to_ne_bytes());
        }
        let mut msg = LinkUnspec::new_with_index(index).build();
        msg.attributes
            .push(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet(vec![
                AfSpecInet::Other(DefaultNla::new(IFLA_INET_CONF, nested)),
            ])]));
        self.set_link(format!("set IPv4 devconf {values:?} of link {index}"), msg)
            .await
    }

    /// Sets the link's IPv6 address generation to none: once up it gets no
    /// link-local address, so no DAD, router solicitations or MLD reports
    /// of its own and no per-link fe80::/64 route. Before the link is up.
    pub async fn set_ipv6_addr_gen_none(&self, index: u32) -> Result<()> {
        let mut msg = LinkUnspec::new_with_index(index).build();
        msg.attributes
            .push(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(
                vec![AfSpecInet6::AddrGenMode(In6AddrGenMode::None)],
            )]));
        self.set_link(format!("set IPv6 addr_gen_mode none on link {index}"), msg)
            .await
    }

    pub async fn set_up(&self, index: u32) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index).up().build();
        self.set_link(format!("set link {index} up"), msg).await
    }

    pub async fn set_down(&self, index: u32) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index).down().build();
        self.set_link(format!("set link {index} down"), msg).await
    }

    /// Rename a link. Kernels before 6.2 refuse (EBUSY) while it is up, so
    /// portable callers rename before `set_up`.
    pub async fn set_name(&self, index: u32, name: &str) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index).name(name).build();
        self.set_link(format!("rename link {index} to {name}"), msg)
            .await
    }

    pub async fn set_mtu(&self, index: u32, mtu: u32) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index).mtu(mtu).build();
        self.set_link(format!("set mtu {mtu} on link {index}"), msg)
            .await
    }

    pub async fn set_mac(&self, index: u32, mac: MacAddr) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index)
            .address(mac.0.to_vec())
            .build();
        self.set_link(format!("set mac {mac} on link {index}"), msg)
            .await
    }

    /// Enslave a link, e.g. to a bridge.
    pub async fn set_master(&self, index: u32, master: u32) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index).controller(master).build();
        self.set_link(format!("set master of link {index} to {master}"), msg)
            .await
    }

    pub async fn set_nomaster(&self, index: u32) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index).nocontroller().build();
        self.set_link(format!("remove master of link {index}"), msg)
            .await
    }

    pub async fn set_alias(&self, index: u32, alias: &str) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index).alias(alias).build();
        self.set_link(format!("set alias {alias:?} on link {index}"), msg)
            .await
    }

    pub async fn set_promisc(&self, index: u32, on: bool) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index).promiscuous(on).build();
        let state = if on { "on" } else { "off" };
        self.set_link(format!("set promisc {state} on link {index}"), msg)
            .await
    }

    pub async fn set_allmulti(&self, index: u32, on: bool) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index).allmulticast(on).build();
        let state = if on { "on" } else { "off" };
        self.set_link(format!("set allmulticast {state} on link {index}"), msg)
            .await
    }

    pub async fn set_txqlen(&self, index: u32, len: u32) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index).txqueuelen(len).build();
        self.set_link(format!("set txqueuelen {len} on link {index}"), msg)
            .await
    }

    /// Move a link into another namespace. It arrives down there, and keeps
    /// its index only if that index is free in the target.
    pub async fn move_to_netns(&self, index: u32, ns: &NetNs) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index)
            .setns_by_fd(ns.as_fd().as_raw_fd())
            .build();
        self.set_link(
            format!("move link {index} to netns {}", describe_ns(ns)),
            msg,
        )
        .await
    }

    pub(crate) async fn add_link(&self, op: &str, msg: LinkMessage) -> Result<()> {
        self.handle
            .link()
            .add(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink(op, e))
    }

    /// Create a veth pair and return the local end. With `peer_ns` the peer
    /// is created directly in that namespace, so its name never clashes
    /// with, or shows up in, this one. `mtu` applies to both ends.
    pub async fn create_veth(
        &self,
        name: &str,
        peer: &str,
        peer_ns: Option<&NetNs>,
        mtu: Option<u32>,
    ) -> Result<Link> {
        let op = match peer_ns {
            Some(ns) => format!("create veth {name} with peer {peer} in {}", describe_ns(ns)),
            None => format!("create veth {name} with peer {peer}"),
        };
        let mut peer_msg = LinkUnspec::new_with_name(peer);
        if let Some(mtu) = mtu {
            peer_msg = peer_msg.mtu(mtu);
        }
        if let Some(ns) = peer_ns {
            peer_msg = peer_msg.setns_by_fd(ns.as_fd().as_raw_fd());
        }
        let mut builder = LinkMessageBuilder::<LinkUnspec>::new()
            .name(name)
            .append_extra_attribute(LinkAttribute::LinkInfo(vec![
                LinkInfo::Kind(InfoKind::Veth),
                LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer_msg.build()))),
            ]));
        if let Some(mtu) = mtu {
            builder = builder.mtu(mtu);
        }
        self.add_link(&op, builder.build()).await?;
        self.link_by_name(name).await
    }

    /// Create a netkit pair (Linux 6.7+) in L2 mode, this namespace's end
    /// `name` the primary: the end whose BPF hooks (primary and peer
    /// attach types) run the programs of both directions, so it must stay
    /// on the node, out of the pod's reach. The peer goes to `peer_ns` as
    /// `peer`. L2, not L3: the pod's end is an Ethernet device with a MAC
    /// and ARP, as a veth's, so routes, neighbours, the bridge and the
    /// datapath's programs (which parse Ethernet headers) see what they see
    /// on a veth. Both default policies pass: with no program attached the
    /// pair forwards as a veth pair does. A kernel without netkit answers
    /// EOPNOTSUPP ([`Error::is_not_supported`]).
    pub async fn create_netkit(
        &self,
        name: &str,
        peer: &str,
        peer_ns: &NetNs,
        mtu: Option<u32>,
    ) -> Result<Link> {
        let op = format!(
            "create netkit {name} with peer {peer} in {}",
            describe_ns(peer_ns)
        );
        let mut peer_msg = LinkUnspec::new_with_name(peer).setns_by_fd(peer_ns.as_fd().as_raw_fd());
        if let Some(mtu) = mtu {
            peer_msg = peer_msg.mtu(mtu);
        }
        let mut builder = LinkMessageBuilder::<LinkUnspec>::new()
            .name(name)
            .append_extra_attribute(LinkAttribute::LinkInfo(vec![
                LinkInfo::Kind(InfoKind::Netkit),
                LinkInfo::Data(InfoData::Netkit(vec![
                    InfoNetkit::Mode(NetkitMode::L2),
                    InfoNetkit::Policy(NetkitPolicy::Pass),
                    InfoNetkit::PeerPolicy(NetkitPolicy::Pass),
                    InfoNetkit::Peer(peer_msg.build()),
                ])),
            ]));
        if let Some(mtu) = mtu {
            builder = builder.mtu(mtu);
        }
        self.add_link(&op, builder.build()).await?;
        self.link_by_name(name).await
    }

    pub async fn delete_link(&self, index: u32) -> Result<()> {
        self.handle
            .link()
            .del(index)
            .execute()
            .await
            .map_err(|e| Error::netlink(format!("delete link {index}"), e))
    }

    /// Delete a link by name if it exists; `Ok(true)` if it did.
    pub async fn ensure_link_deleted(&self, name: &str) -> Result<bool> {
        let Some(link) = self.find_link(name).await? else {
            return Ok(false);
        };
        match self.delete_link(link.index).await {
            Ok(()) => Ok(true),
            // Gone in between (or with its veth peer).
            Err(e) if e.is_not_found() => Ok(false),
            Err(e) => Err(e),
        }
    }
}

fn parse_link(m: &LinkMessage) -> Link {
    let flags = m.header.flags;
    let mut link = Link {
        index: m.header.index,
        name: String::new(),
        kind: None,
        mac: None,
        mtu: 0,
        admin_up: flags.contains(LinkFlags::Up),
        oper_up: flags.contains(LinkFlags::Running),
        master: None,
        link: None,
        alias: None,
        promisc: flags.contains(LinkFlags::Promisc),
        allmulti: flags.contains(LinkFlags::Allmulti),
        txqlen: 0,
        is_loopback: flags.contains(LinkFlags::Loopback),
        ipv6_accept_ra: None,
        ipv6_accept_dad: None,
    };
    for attr in &m.attributes {
        match attr {
            LinkAttribute::IfName(n) => link.name = n.clone(),
            LinkAttribute::Address(a) => link.mac = MacAddr::from_slice(a),
            LinkAttribute::Mtu(mtu) => link.mtu = *mtu,
            LinkAttribute::TxQueueLen(q) => link.txqlen = *q,
            LinkAttribute::Controller(c) if *c != 0 => link.master = Some(*c),
            LinkAttribute::Link(l) if *l != 0 => link.link = Some(*l),
            LinkAttribute::IfAlias(a) if !a.is_empty() => link.alias = Some(a.clone()),
            LinkAttribute::OperState(State::Up) => link.oper_up = true,
            LinkAttribute::LinkInfo(infos) => {
                link.kind = infos.iter().find_map(|i| match i {
                    LinkInfo::Kind(k) => Some(k.to_string()),
                    _ => None,
                })
            }
            LinkAttribute::AfSpecUnspec(specs) => {
                let conf = specs.iter().find_map(|s| match s {
                    AfSpecUnspec::Inet6(v6) => v6.iter().find_map(|a| match a {
                        AfSpecInet6::DevConf(c) => Some(c),
                        _ => None,
                    }),
                    _ => None,
                });
                if let Some(c) = conf {
                    link.ipv6_accept_ra = Some(c.accept_ra);
                    link.ipv6_accept_dad = Some(c.accept_dad);
                }
            }
            _ => {}
        }
    }
    link
}

/// `IFLA_INFO_DATA`: the kind-specific attributes (VXLAN, macvlan, ...).
pub(crate) fn info_data(msg: &LinkMessage) -> Option<&InfoData> {
    msg.attributes.iter().find_map(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
            LinkInfo::Data(d) => Some(d),
            _ => None,
        }),
        _ => None,
    })
}
