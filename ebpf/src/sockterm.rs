//! Connected UDP sockets whose Service backend went. kube-proxy flushes a
//! removed UDP backend's conntrack entries so that the next datagram is
//! translated again; the Services' connect hook leaves no such entry (the
//! socket itself is connected to the backend), so the socket is closed
//! instead, as Cilium's socket termination does: its owner's next `recv()`
//! fails with ECONNABORTED, and connecting it again gets a live backend.
//!
//! Which sockets: those of a namespace that sock_diag lists as connected
//! UDP (`rcni_netlink::sockdiag`) whose cookie and peer the hooks'
//! reverse map holds, through a frontend the peer left. A socket its owner
//! connected to the backend's own address has no reverse entry; one
//! connected through another Service that keeps the backend names that
//! Service. Closed with `SOCK_DESTROY` (`CONFIG_INET_DIAG_DESTROY`, in the
//! distributions' kernels), which needs no eBPF of its own.

use crate::services::{Frontend, ServiceLb};
use crate::{Error, Result};
use rcni_netlink::sockdiag::SockDiag;
use rcni_netns::NetNs;
use std::collections::BTreeSet;
use std::net::SocketAddr;

const IPPROTO_UDP: u8 = 17;

/// Closes the connected UDP sockets of `ns` that `lb`'s hooks connected to
/// a backend that left that frontend (`gone`, as
/// [`ServiceLb::take_udp_gone`] gives it). Returns how many it closed.
pub fn close_gone_udp(
    lb: &ServiceLb,
    ns: &NetNs,
    gone: &BTreeSet<(Frontend, SocketAddr)>,
) -> Result<usize> {
    if gone.is_empty() {
        return Ok(0);
    }
    let nl = |e| Error::netlink(None, e);
    let mut diag = SockDiag::open(ns).map_err(nl)?;
    let mut closed = 0;
    for s in diag.connected_udp().map_err(nl)? {
        let Some(fe) = lb.frontend_of_socket(s.cookie, s.peer)? else {
            continue;
        };
        let f = Frontend {
            addr: fe.ip(),
            proto: IPPROTO_UDP,
            port: fe.port(),
        };
        if gone.contains(&(f, s.peer)) {
            diag.destroy(&s).map_err(nl)?;
            closed += 1;
        }
    }
    Ok(closed)
}
