//! Connected UDP sockets of a namespace, and closing one (sock_diag's
//! `SOCK_DIAG_BY_FAMILY` dump and `SOCK_DESTROY`, the kernel's
//! `CONFIG_INET_DIAG_DESTROY`, as `ss -K` uses it). The node agent closes a
//! UDP socket its Service hook connected to a backend that went, as
//! kube-proxy flushes such a backend's conntrack entries: the owner's next
//! `recv()` fails with ECONNABORTED and the socket is no longer connected.

use crate::nlsock::{NlSocket, Protocol};
use crate::{Error, Result};
use netlink_packet_core::{Emitable, Parseable};
use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_UDP};
use netlink_packet_sock_diag::inet::{
    ExtensionFlags, InetRequest, InetResponseHeader, SocketId, StateFlags,
};
use netlink_packet_sock_diag::{SOCK_DESTROY, SOCK_DIAG_BY_FAMILY};
use rcni_netns::NetNs;
use std::net::{IpAddr, SocketAddr};

/// One connected UDP socket: its cookie, its own address and its peer's
/// (an IPv6 socket's v4-mapped peer as IPv4, as a connect hook saw it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdpSocket {
    pub cookie: u64,
    pub local: SocketAddr,
    pub peer: SocketAddr,
    /// The kernel's own name for it, echoed by [`SockDiag::destroy`].
    id: SocketId,
    family: u8,
}

/// A sock_diag socket in one namespace.
pub struct SockDiag(NlSocket);

impl SockDiag {
    pub fn open(ns: &NetNs) -> Result<SockDiag> {
        NlSocket::open(ns, Protocol::SockDiag, "open a sock_diag socket").map(SockDiag)
    }

    /// Every connected UDP socket of the namespace, both families.
    pub fn connected_udp(&mut self) -> Result<Vec<UdpSocket>> {
        let mut out = Vec::new();
        for family in [AF_INET, AF_INET6] {
            let any = if family == AF_INET {
                SocketId::new_v4()
            } else {
                SocketId::new_v6()
            };
            let req = request(family, any);
            let op = "list the UDP sockets";
            for m in self.0.dump(op, SOCK_DIAG_BY_FAMILY, &emit(&req))? {
                if m.ty != SOCK_DIAG_BY_FAMILY {
                    continue;
                }
                let h = InetResponseHeader::parse(&m.payload[..])
                    .map_err(|e| Error::io(op, std::io::Error::other(e.to_string())))?;
                let id = h.socket_id;
                let peer = SocketAddr::new(unmapped(id.destination_address), id.destination_port);
                if id.destination_port == 0 {
                    continue;
                }
                out.push(UdpSocket {
                    cookie: cookie(id.cookie),
                    local: SocketAddr::new(id.source_address, id.source_port),
                    peer,
                    family: h.family,
                    id,
                });
            }
        }
        Ok(out)
    }

    /// Closes `s` (found by [`SockDiag::connected_udp`]): ECONNABORTED to
    /// its owner. A socket closed meanwhile is no error.
    pub fn destroy(&mut self, s: &UdpSocket) -> Result<()> {
        let req = request(s.family, s.id.clone());
        match self.0.request(
            "close a UDP socket",
            SOCK_DESTROY,
            crate::nlsock::NLM_F_ACK,
            &emit(&req),
        ) {
            Ok(_) => Ok(()),
            Err(e) if e.errno() == Some(libc::ENOENT) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

fn request(family: u8, socket_id: SocketId) -> InetRequest {
    InetRequest {
        family,
        protocol: IPPROTO_UDP,
        extensions: ExtensionFlags::empty(),
        // A connected UDP socket is TCP_ESTABLISHED to the kernel.
        states: StateFlags::ESTABLISHED,
        socket_id,
    }
}

fn emit(req: &InetRequest) -> Vec<u8> {
    let mut buf = vec![0u8; req.buffer_len()];
    req.emit(&mut buf);
    buf
}

/// `idiag_cookie` is two native-order u32s, the low half first.
fn cookie(b: [u8; 8]) -> u64 {
    let lo = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
    let hi = u32::from_ne_bytes([b[4], b[5], b[6], b[7]]);
    u64::from(lo) | (u64::from(hi) << 32)
}

fn unmapped(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cookie_is_the_low_half_first_and_mapped_peers_are_ipv4() {
        let c: u64 = 0x0000_0001_0000_2345;
        let mut b = [0u8; 8];
        b[..4].copy_from_slice(&(c as u32).to_ne_bytes());
        b[4..].copy_from_slice(&((c >> 32) as u32).to_ne_bytes());
        assert_eq!(cookie(b), c);
        let mapped: IpAddr = "::ffff:10.96.0.10".parse().unwrap();
        assert_eq!(unmapped(mapped), "10.96.0.10".parse::<IpAddr>().unwrap());
        let v6: IpAddr = "fd96::10".parse().unwrap();
        assert_eq!(unmapped(v6), v6);
    }
}
