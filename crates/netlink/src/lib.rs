//! rtnetlink in domain types, one socket per network namespace.
//!
//! A netlink socket talks to the namespace it was created in, whichever
//! thread later uses it. [`Netlink::connect`] therefore creates the socket on
//! a throwaway thread inside the target namespace and drives it from the
//! caller's tokio runtime; no async code ever calls `setns`.
//!
//! One file per kind of object, each an `impl Netlink` block: `links.rs`,
//! `bridge.rs`, `lower.rs` (macvlan, ipvlan), `vlan.rs`, `addresses.rs`
//! (and `dad.rs`), `routes.rs`, `rule.rs`, `neighbours.rs` (ARP/NDP and
//! FDB entries), `tc.rs`, `tuntap.rs` (TUN/TAP devices, dummy links),
//! `overlay.rs` (VXLAN devices and routes a node
//! agent owns). Requests rtnetlink has no call for go through
//! `Netlink::acked_request`; raw sockets and forked helpers for the
//! kernel's slow paths are in `detach.rs`, `unlink.rs` and `netconf.rs`.
//! `nlsock.rs` is the one synchronous socket (sequence numbers, acks,
//! dumps retried when interrupted) of netconf, nfnetlink and generic
//! netlink.

mod addresses;
mod bridge;
mod dad;
pub mod detach;
mod error;
mod links;
mod lower;
mod neighbours;
pub mod netconf;
pub mod nlsock;
pub mod overlay;
pub mod packet;
pub mod route_watch;
mod routes;
mod rule;
pub mod sockdiag;
pub mod sysctl;
pub mod tc;
pub mod tuntap;
mod types;
mod unlink;
mod vlan;
mod vrf;

use std::net::IpAddr;

use futures::StreamExt;
use rcni_netns::NetNs;
use rtnetlink::Handle;
use rtnetlink::packet_core::{NLM_F_ACK, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};

pub use error::{Error, ErrorKind, Result};
pub use lower::LowerOpts;
pub use rule::Rule;
pub use types::{
    Address, Family, IpvlanMode, Link, MacAddr, MacvlanMode, NUD_DELAY, NUD_FAILED, NUD_INCOMPLETE,
    NUD_NOARP, NUD_PERMANENT, NUD_PROBE, NUD_REACHABLE, NUD_STALE, Neighbour, ParseMacError, Route,
    SCOPE_HOST, SCOPE_LINK, SCOPE_UNIVERSE, TABLE_MAIN,
};

/// `IPV4_DEVCONF_ARP_NOTIFY`: `net/ipv4/conf/<link>/arp_notify`.
pub const IPV4_DEVCONF_ARP_NOTIFY: u16 = 22;

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

    /// Sends a request with `NLM_F_ACK` (and `flags`) and waits for the
    /// kernel's answer, for messages rtnetlink has no request type for (or
    /// none that takes these flags).
    pub(crate) async fn acked_request(
        &self,
        op: &str,
        msg: RouteNetlinkMessage,
        flags: u16,
    ) -> Result<()> {
        let mut req = NetlinkMessage::from(msg);
        req.header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
        let mut handle = self.handle.clone();
        let mut resp = handle.request(req).map_err(|e| Error::netlink(op, e))?;
        while let Some(m) = resp.next().await {
            // An ACK is an error message with code 0.
            if let NetlinkPayload::Error(e) = m.payload
                && e.code.is_some()
            {
                return Err(Error::netlink(op, rtnetlink::Error::NetlinkError(e)));
            }
        }
        Ok(())
    }
}

pub(crate) fn describe_ns(ns: &NetNs) -> String {
    match ns.path() {
        Some(p) => p.display().to_string(),
        None => format!("netns:[{}]", ns.inode()),
    }
}

pub(crate) fn family_of(ip: IpAddr) -> AddressFamily {
    match ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    }
}
