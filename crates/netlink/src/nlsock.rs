//! Synchronous netlink sockets beside rtnetlink's.

use crate::{Error, Result};
use nix::sys::socket::{AddressFamily, SockFlag, SockProtocol, SockType};
use rcni_netns::NetNs;
use std::os::fd::OwnedFd;

/// A raw netlink socket of protocol `proto` (`NETLINK_ROUTE`,
/// `NETLINK_NETFILTER`) bound to `ns`: a socket talks to the namespace it was
/// created in.
///
/// From nix rather than netlink-sys: callers (also crates/netfilter) keep an
/// `OwnedFd`, which netlink-sys's `Socket` becomes only through an unsafe
/// `from_raw_fd`.
pub fn netlink_socket(ns: &NetNs, proto: i32, op: &str) -> Result<OwnedFd> {
    let proto = match proto {
        libc::NETLINK_ROUTE => SockProtocol::NetlinkRoute,
        libc::NETLINK_NETFILTER => SockProtocol::NetlinkNetFilter,
        _ => {
            return Err(Error::io(
                op,
                std::io::Error::from_raw_os_error(libc::EPROTONOSUPPORT),
            ));
        }
    };
    ns.run(|| {
        nix::sys::socket::socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            proto,
        )
    })
    .map_err(|e| Error::netns(op, e))?
    .map_err(|e| Error::io(op, e.into()))
}
