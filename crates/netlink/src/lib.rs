//! rtnetlink in domain types, one socket per network namespace.
//!
//! A netlink socket talks to the namespace it was created in, whichever
//! thread later uses it. [`Netlink::connect`] therefore creates the socket on
//! a throwaway thread inside the target namespace and drives it from the
//! caller's tokio runtime; no async code ever calls `setns`.

mod dad;
pub mod detach;
mod error;
mod lower;
pub mod netconf;
pub mod overlay;
mod rule;
pub mod sysctl;
pub mod tc;
mod types;
mod unlink;
mod vlan;

use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd};

use futures::TryStreamExt;
use ipnetwork::IpNetwork;
use rcni_netns::NetNs;
use rtnetlink::packet_core::{
    DefaultNla, NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST, NetlinkMessage,
    NetlinkPayload,
};
use rtnetlink::packet_route::address::{AddressAttribute, AddressMessage};
use rtnetlink::packet_route::link::{
    AfSpecInet, AfSpecInet6, AfSpecUnspec, In6AddrGenMode, InfoData, InfoKind, InfoMacVlan,
    InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage, MacVlanMode, State,
};
use rtnetlink::packet_route::neighbour::{NeighbourAddress, NeighbourAttribute};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteMetric, RouteProtocol,
    RouteScope, RouteType, RouteVia,
};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::{Handle, LinkMessageBuilder, LinkUnspec};

pub use error::{Error, ErrorKind, Result};
pub use lower::LowerOpts;
pub use rule::Rule;
pub use types::{
    Address, Family, IpvlanMode, Link, MacAddr, MacvlanMode, NUD_DELAY, NUD_FAILED, NUD_INCOMPLETE,
    NUD_NOARP, NUD_PERMANENT, NUD_PROBE, NUD_REACHABLE, NUD_STALE, Neighbour, ParseMacError, Route,
    SCOPE_HOST, SCOPE_LINK, SCOPE_UNIVERSE, TABLE_MAIN,
};

/// `IFLA_INET_CONF` inside `IFLA_AF_SPEC`/`AF_INET`.
const IFLA_INET_CONF: u16 = 1;
/// `IPV4_DEVCONF_ARP_NOTIFY`: `net/ipv4/conf/<link>/arp_notify`.
pub const IPV4_DEVCONF_ARP_NOTIFY: u16 = 22;

/// Longest interface name the kernel accepts (`IFNAMSIZ - 1`).
const IFNAMSIZ_MAX: usize = 15;

/// A current-thread runtime with I/O and timers, for synchronous callers
/// (plugins): `runtime()?.block_on(async { ... })`.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|e| Error::io("build tokio runtime", e))
}

/// A netlink connection to one network namespace.
#[derive(Debug, Clone)]
pub struct Netlink {
    handle: Handle,
    ns: std::sync::Arc<NetNs>,
}

impl Netlink {
    /// Open a netlink socket inside `ns`. Must be called within a tokio
    /// runtime with I/O enabled; the connection task is spawned on it and
    /// ends when the last clone of this `Netlink` is dropped.
    pub async fn connect(ns: &NetNs) -> Result<Netlink> {
        let op = || format!("connect netlink in {}", describe_ns(ns));
        let rt = tokio::runtime::Handle::try_current()
            .map_err(|e| Error::other(op(), format!("no tokio runtime: {e}")))?;
        // The socket is bound to the namespace it is created in; the runtime
        // is entered on that thread so the AsyncFd registers with the
        // caller's reactor.
        let (conn, handle, _) = ns
            .run(move || {
                let _rt = rt.enter();
                // Strict checking makes the kernel honour a dump's header
                // filters (an address dump of one link): without it every
                // dump walks every link, which grows with the pods on a node.
                rtnetlink::new_connection_with_strict_check()
            })
            .map_err(|e| Error::netns(op(), e))?
            .map_err(|e| Error::io(op(), e))?;
        tokio::spawn(conn);
        let ns = ns.try_clone().map_err(|e| Error::netns(op(), e))?;
        Ok(Netlink {
            handle,
            ns: std::sync::Arc::new(ns),
        })
    }

    /// Connect to the calling thread's namespace.
    pub async fn connect_current() -> Result<Netlink> {
        let ns = NetNs::current().map_err(|e| Error::netns("open current netns", e))?;
        Netlink::connect(&ns).await
    }

    /// The namespace this connection talks to.
    pub fn netns(&self) -> &NetNs {
        &self.ns
    }

    // ---- links ---------------------------------------------------------

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
        let op = || format!("get link {index}");
        if index == 0 {
            return Err(Error::not_found(op()));
        }
        let mut stream = self.handle.link().get().match_index(index).execute();
        match stream.try_next().await {
            Ok(Some(m)) => Ok(parse_link(&m)),
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

    async fn set_link(&self, op: String, msg: LinkMessage) -> Result<()> {
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

    async fn add_link(&self, op: &str, msg: LinkMessage) -> Result<()> {
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

    /// Create a bridge (down; see [`Netlink::ensure_bridge`]).
    pub async fn create_bridge(&self, name: &str, mtu: Option<u32>) -> Result<Link> {
        self.create_bridge_with(name, mtu, false).await
    }

    /// Create a bridge (down), with VLAN filtering on when asked: the kernel
    /// only honours per-port VLANs on a filtering bridge.
    pub async fn create_bridge_with(
        &self,
        name: &str,
        mtu: Option<u32>,
        vlan_filtering: bool,
    ) -> Result<Link> {
        let mut builder = LinkMessageBuilder::<rtnetlink::LinkBridge>::new(name);
        if let Some(mtu) = mtu {
            builder = builder.mtu(mtu);
        }
        if vlan_filtering {
            builder = builder.vlan_filtering(true);
        }
        self.add_link(&format!("create bridge {name}"), builder.build())
            .await?;
        self.link_by_name(name).await
    }

    /// Make sure a bridge of that name exists and is up. An existing bridge
    /// is reused as is (its MTU is not changed: other ports depend on it);
    /// an existing link of another kind is an error.
    pub async fn ensure_bridge(&self, name: &str, mtu: Option<u32>) -> Result<Link> {
        self.ensure_bridge_with(name, mtu, false).await
    }

    /// [`Netlink::ensure_bridge`], creating the bridge with VLAN filtering
    /// when asked (an existing bridge keeps its setting, as the reference).
    pub async fn ensure_bridge_with(
        &self,
        name: &str,
        mtu: Option<u32>,
        vlan_filtering: bool,
    ) -> Result<Link> {
        let op = || format!("ensure bridge {name}");
        let link = match self.find_link(name).await? {
            Some(l) => l,
            None => match self.create_bridge_with(name, mtu, vlan_filtering).await {
                Ok(l) => l,
                // Someone else created it in between.
                Err(e) if e.is_exists() => self.link_by_name(name).await?,
                Err(e) => return Err(e),
            },
        };
        if link.kind.as_deref() != Some("bridge") {
            return Err(Error::other(
                op(),
                format!(
                    "link {name} exists but is a {}, not a bridge",
                    link.kind.as_deref().unwrap_or("device without kind")
                ),
            ));
        }
        if !link.admin_up {
            self.set_up(link.index).await?;
        }
        self.link_by_index(link.index).await
    }

    /// Whether link `index` is an isolated bridge port (`IFLA_BRPORT_ISOLATED`
    /// in its port data); false for a link that is no bridge port.
    pub async fn bridge_port_isolated(&self, index: u32) -> Result<bool> {
        use rtnetlink::packet_route::link::{InfoBridgePort, InfoPortData};
        let op = || format!("get link {index}");
        let mut stream = self.handle.link().get().match_index(index).execute();
        let m = match stream.try_next().await {
            Ok(Some(m)) => m,
            Ok(None) => return Err(Error::not_found(op())),
            Err(e) => return Err(Error::netlink(op(), e)),
        };
        Ok(m.attributes.iter().any(|a| match a {
            LinkAttribute::LinkInfo(infos) => infos.iter().any(|i| match i {
                LinkInfo::PortData(InfoPortData::BridgePort(p)) => {
                    p.contains(&InfoBridgePort::Isolated(true))
                }
                _ => false,
            }),
            _ => false,
        }))
    }

    /// Bridge port flags of an enslaved link (IFLA_BRPORT_*); `None` leaves
    /// a flag as it is.
    pub async fn set_bridge_port(
        &self,
        index: u32,
        hairpin: Option<bool>,
        isolated: Option<bool>,
    ) -> Result<()> {
        let mut b = rtnetlink::LinkBridgePort::new(index);
        if let Some(h) = hairpin {
            b = b.hairpin(h);
        }
        if let Some(i) = isolated {
            b = b.isolated(i);
        }
        self.handle
            .link()
            .set_port(b.build())
            .execute()
            .await
            .map_err(|e| Error::netlink(format!("set bridge port flags of link {index}"), e))
    }

    /// Add VLAN `vid` to bridge port `index`; `pvid_untagged` makes it the
    /// port's access VLAN (ingress untagged, egress untagged).
    pub async fn bridge_vlan_add(&self, index: u32, vid: u16, pvid_untagged: bool) -> Result<()> {
        use rtnetlink::packet_route::link::BridgeVlanInfoFlags as F;
        let flags = if pvid_untagged {
            F::Pvid | F::Untagged
        } else {
            F::empty()
        };
        let msg = rtnetlink::LinkBridgeVlan::new(index)
            .vlan(vid, flags)
            .build();
        self.handle
            .link()
            .set(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink(format!("add vlan {vid} to bridge port {index}"), e))
    }

    pub async fn bridge_vlan_del(&self, index: u32, vid: u16) -> Result<()> {
        use rtnetlink::packet_route::link::BridgeVlanInfoFlags as F;
        let msg = rtnetlink::LinkBridgeVlan::new(index)
            .vlan(vid, F::empty())
            .build();
        self.handle
            .link()
            .del_with_message(msg)
            .execute()
            .await
            .map_err(|e| Error::netlink(format!("delete vlan {vid} from bridge port {index}"), e))
    }

    /// VLANs of bridge port `index`: (vid, is the untagged PVID).
    pub async fn bridge_vlans(&self, index: u32) -> Result<Vec<(u16, bool)>> {
        use rtnetlink::packet_route::link::{
            AfSpecBridge, BridgeVlanInfoFlags as F, LinkExtentMask,
        };
        let msgs: Vec<LinkMessage> = self
            .handle
            .link()
            .get()
            .set_filter_mask(AddressFamily::Bridge, vec![LinkExtentMask::Brvlan])
            .execute()
            .try_collect()
            .await
            .map_err(|e| Error::netlink(format!("list vlans of bridge port {index}"), e))?;
        let mut out = Vec::new();
        for m in msgs.iter().filter(|m| m.header.index == index) {
            for a in &m.attributes {
                if let LinkAttribute::AfSpecBridge(specs) = a {
                    for s in specs {
                        if let AfSpecBridge::VlanInfo(v) = s {
                            out.push((
                                v.vid,
                                v.flags.contains(F::Pvid) && v.flags.contains(F::Untagged),
                            ));
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// Create a macvlan on top of `master` (down).
    pub async fn create_macvlan(&self, name: &str, master: u32, mode: MacvlanMode) -> Result<Link> {
        let mode = match mode {
            MacvlanMode::Private => MacVlanMode::Private,
            MacvlanMode::Vepa => MacVlanMode::Vepa,
            MacvlanMode::Bridge => MacVlanMode::Bridge,
            MacvlanMode::Passthru => MacVlanMode::Passthrough,
            MacvlanMode::Source => MacVlanMode::Source,
        };
        let msg = LinkMessageBuilder::<LinkUnspec>::new()
            .name(name)
            .link(master)
            .append_extra_attribute(LinkAttribute::LinkInfo(vec![
                LinkInfo::Kind(InfoKind::MacVlan),
                LinkInfo::Data(InfoData::MacVlan(vec![InfoMacVlan::Mode(mode)])),
            ]))
            .build();
        self.add_link(&format!("create macvlan {name} on link {master}"), msg)
            .await?;
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

    // ---- addresses -----------------------------------------------------

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

    // ---- routes --------------------------------------------------------

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
            .iter()
            .filter(|m| m.header.address_family == family && m.header.kind == RouteType::Unicast)
            .filter_map(parse_route)
            .filter(|r| table.is_none_or(|t| r.table == t))
            .collect())
    }

    async fn route_request(&self, op: String, msg: RouteNetlinkMessage, flags: u16) -> Result<()> {
        let mut req = NetlinkMessage::from(msg);
        req.header.flags = flags;
        let mut handle = self.handle.clone();
        let mut resp = handle.request(req).map_err(|e| Error::netlink(&op, e))?;
        while let Some(m) = futures::StreamExt::next(&mut resp).await {
            if let NetlinkPayload::Error(err) = m.payload {
                return Err(Error::netlink(op, rtnetlink::Error::NetlinkError(err)));
            }
        }
        Ok(())
    }

    /// Add a route; an identical one is an error with `is_exists()`.
    pub async fn add_route(&self, route: &Route) -> Result<()> {
        let msg = route_message(route, false)
            .map_err(|m| Error::other(format!("add route {route}"), m))?;
        self.route_request(
            format!("add route {route}"),
            RouteNetlinkMessage::NewRoute(msg),
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
        )
        .await
    }

    /// Create the route or replace the one with the same destination, table
    /// and metric (`ip route replace`).
    pub async fn ensure_route(&self, route: &Route) -> Result<()> {
        let msg = route_message(route, false)
            .map_err(|m| Error::other(format!("replace route {route}"), m))?;
        self.route_request(
            format!("replace route {route}"),
            RouteNetlinkMessage::NewRoute(msg),
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        )
        .await
    }

    /// Delete a route matching destination, table and whichever of gateway,
    /// oif and metric are set (scope is ignored, as in `ip route del`). A
    /// missing one is an error with `is_not_found()` (ESRCH).
    pub async fn del_route(&self, route: &Route) -> Result<()> {
        let msg = route_message(route, true)
            .map_err(|m| Error::other(format!("delete route {route}"), m))?;
        self.route_request(
            format!("delete route {route}"),
            RouteNetlinkMessage::DelRoute(msg),
            NLM_F_REQUEST | NLM_F_ACK,
        )
        .await
    }

    // ---- neighbours ----------------------------------------------------

    /// IPv4 and IPv6 neighbour entries of one link, or of all links.
    pub async fn neighbours(&self, index: Option<u32>) -> Result<Vec<Neighbour>> {
        let msgs: Vec<_> = self
            .handle
            .neighbours()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(|e| Error::netlink("list neighbours", e))?;
        Ok(msgs
            .iter()
            .filter(|m| index.is_none_or(|i| m.header.ifindex == i))
            .filter_map(|m| {
                let ip = m.attributes.iter().find_map(|a| match a {
                    NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)) => {
                        Some(IpAddr::V4(*ip))
                    }
                    NeighbourAttribute::Destination(NeighbourAddress::Inet6(ip)) => {
                        Some(IpAddr::V6(*ip))
                    }
                    _ => None,
                })?;
                let mac = m.attributes.iter().find_map(|a| match a {
                    NeighbourAttribute::LinkLayerAddress(b) => MacAddr::from_slice(b),
                    _ => None,
                });
                Some(Neighbour {
                    index: m.header.ifindex,
                    ip,
                    mac,
                    state: m.header.state.into(),
                })
            })
            .collect())
    }
}

fn describe_ns(ns: &NetNs) -> String {
    match ns.path() {
        Some(p) => p.display().to_string(),
        None => format!("netns:[{}]", ns.inode()),
    }
}

fn family_of(ip: IpAddr) -> AddressFamily {
    match ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
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

fn route_addr(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(ip) => Some(IpAddr::V4(*ip)),
        RouteAddress::Inet6(ip) => Some(IpAddr::V6(*ip)),
        _ => None,
    }
}

fn parse_route(m: &RouteMessage) -> Option<Route> {
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
fn route_message(route: &Route, delete: bool) -> std::result::Result<RouteMessage, String> {
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
