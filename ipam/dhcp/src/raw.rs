//! The two sockets a DHCP client needs inside the container's namespace.
//!
//! Before it has an address a client can neither receive a reply unicast to
//! the address being offered (the kernel drops IP packets for addresses it
//! does not have) nor rely on the kernel to send from 0.0.0.0. So DISCOVER,
//! REQUEST and their replies go through an `AF_PACKET` socket bound to the
//! interface, with the IPv4 and UDP headers built here and a classic BPF
//! filter letting only UDP to port 68 through. Once bound, RFC 2131 has the
//! client renew by unicast from its address: a plain UDP socket bound to the
//! device and port 68 does that, and receives the unicast answer. RELEASE
//! goes the same way, from a socket bound to the leased address.
//!
//! Both sockets are created on a thread inside the namespace (a socket
//! belongs to the namespace it was created in) and then driven from tokio.

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, OwnedFd};

use nix::sys::socket::{LinkAddr, MsgFlags};
use socket2::{Domain, SockFilter, Socket, Type};
use tokio::io::Interest;
use tokio::net::UdpSocket;

pub const SERVER_PORT: u16 = 67;
pub const CLIENT_PORT: u16 = 68;
const ETH_P_IP: u16 = 0x0800;
const IPPROTO_UDP: u8 = 17;

/// The cBPF program, as (code, jt, jf, k): accept unfragmented IPv4 UDP to
/// port 68, drop the rest. On an `AF_PACKET`/`SOCK_DGRAM` socket offsets
/// start at the IP header.
const FILTER: [(u16, u8, u8, u32); 9] = [
    (0x30, 0, 0, 9),                  // ldb [9]            (protocol)
    (0x15, 0, 6, IPPROTO_UDP as u32), // jeq #17 ? next : drop
    (0x28, 0, 0, 6),                  // ldh [6]            (flags, fragment offset)
    (0x45, 4, 0, 0x1fff),             // jset #0x1fff ? drop : next
    (0xb1, 0, 0, 0),                  // ldxb 4*([0]&0xf)   (header length)
    (0x48, 0, 0, 2),                  // ldh [x+2]          (UDP destination port)
    (0x15, 0, 1, CLIENT_PORT as u32), // jeq #68 ? accept : drop
    (0x06, 0, 0, 0x0004_0000),        // ret #262144        (accept)
    (0x06, 0, 0, 0),                  // ret #0             (drop)
];

/// The link-layer address of `dst` on interface `ifindex`, for IPv4.
fn link_addr(ifindex: u32, dst: [u8; 6]) -> io::Result<LinkAddr> {
    rcni_netlink::packet::link_addr(ifindex, ETH_P_IP, dst)
}

/// Creates the packet socket; call on a thread inside the target namespace.
///
/// The socket starts with protocol 0 (it receives nothing) so that no
/// unfiltered packet is queued before the filter is attached; `bind` then
/// sets the protocol and the interface.
pub fn packet_socket(ifindex: u32) -> io::Result<OwnedFd> {
    let s = Socket::new(Domain::PACKET, Type::DGRAM.nonblocking(), None)?;
    s.attach_filter(&FILTER.map(|(code, jt, jf, k)| SockFilter::new(code, jt, jf, k)))?;
    nix::sys::socket::bind(s.as_raw_fd(), &link_addr(ifindex, [0; 6])?)?;
    Ok(s.into())
}

/// Creates the UDP socket for renewing and releasing: bound to the device
/// and to port 68, broadcast allowed (rebinding broadcasts). Call on a
/// thread inside the target namespace.
pub fn udp_socket(ifname: &str) -> io::Result<std::net::UdpSocket> {
    let s = Socket::new(Domain::IPV4, Type::DGRAM.nonblocking(), None)?;
    // Another client on another interface of the namespace may hold port 68.
    s.set_reuse_address(true)?;
    s.set_broadcast(true)?;
    s.bind_device(Some(ifname.as_bytes()))?;
    s.bind(&SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, CLIENT_PORT).into())?;
    Ok(s.into())
}

/// Creates the UDP socket DHCPRELEASE goes out on: bound to the leased
/// address and port 68, not to a device, so the kernel routes it as any
/// datagram from that address (upstream's `nclient4.WithUnicast`). Fails
/// when the address is on no interface of the namespace. Call on a thread
/// inside the target namespace.
pub fn udp_socket_from(addr: Ipv4Addr) -> io::Result<std::net::UdpSocket> {
    let s = Socket::new(Domain::IPV4, Type::DGRAM.nonblocking(), None)?;
    // The renewal sockets of other leases in the namespace hold port 68.
    s.set_reuse_address(true)?;
    s.bind(&SocketAddrV4::new(addr, CLIENT_PORT).into())?;
    Ok(s.into())
}

/// The packet socket, driven by tokio.
pub struct PacketSocket {
    /// The packet socket, registered with the runtime as a tokio UdpSocket:
    /// tokio registers an arbitrary descriptor only through the unsafe
    /// `AsyncFd::register`, while its UdpSocket is any datagram socket it
    /// polls. Only its readiness (`async_io`) is used, never its IP calls.
    sock: UdpSocket,
    ifindex: u32,
}

impl PacketSocket {
    /// Registers `fd` (from [`packet_socket`]) with the current runtime.
    pub fn new(fd: OwnedFd, ifindex: u32) -> io::Result<PacketSocket> {
        let sock = UdpSocket::from_std(std::net::UdpSocket::from(fd))?;
        Ok(PacketSocket { sock, ifindex })
    }

    /// Sends a DHCP payload from `src`:68 to `dst`:67 in an Ethernet frame
    /// to `dst_mac`.
    pub async fn send(
        &self,
        payload: &[u8],
        src: Ipv4Addr,
        dst: Ipv4Addr,
        dst_mac: [u8; 6],
    ) -> io::Result<()> {
        let pkt = ipv4_udp(src, dst, CLIENT_PORT, SERVER_PORT, payload);
        let to = link_addr(self.ifindex, dst_mac)?;
        let fd = self.sock.as_raw_fd();
        self.sock
            .async_io(Interest::WRITABLE, || {
                Ok(nix::sys::socket::sendto(fd, &pkt, &to, MsgFlags::empty()).map(drop)?)
            })
            .await
    }

    /// The next UDP payload to port 68, with the sender's IP and MAC
    /// addresses.
    pub async fn recv(&self) -> io::Result<(Vec<u8>, Ipv4Addr, [u8; 6])> {
        let mut buf = vec![0u8; 4096];
        let fd = self.sock.as_raw_fd();
        loop {
            let (n, from) = self
                .sock
                .async_io(Interest::READABLE, || {
                    Ok(nix::sys::socket::recvfrom::<LinkAddr>(fd, &mut buf)?)
                })
                .await?;
            if let Some((src, payload)) = parse_ipv4_udp(&buf[..n], CLIENT_PORT) {
                let mac = from.and_then(|a| a.addr()).unwrap_or_default();
                return Ok((payload.to_vec(), src, mac));
            }
        }
    }
}

/// The Internet checksum (RFC 1071) over `data`, starting from `sum`.
fn checksum(mut sum: u32, data: &[u8]) -> u16 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IPv4 packet (no options, TTL 64, DF clear) carrying a UDP datagram
/// with its checksum.
pub fn ipv4_udp(src: Ipv4Addr, dst: Ipv4Addr, sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let udp_len = 8 + payload.len();
    let total = 20 + udp_len;
    let mut p = Vec::with_capacity(total);
    p.extend_from_slice(&[0x45, 0]);
    p.extend_from_slice(&(total as u16).to_be_bytes());
    p.extend_from_slice(&[0, 0, 0, 0, 64, IPPROTO_UDP, 0, 0]);
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    let ip_sum = checksum(0, &p[..20]);
    p[10..12].copy_from_slice(&ip_sum.to_be_bytes());
    p.extend_from_slice(&sport.to_be_bytes());
    p.extend_from_slice(&dport.to_be_bytes());
    p.extend_from_slice(&(udp_len as u16).to_be_bytes());
    p.extend_from_slice(&[0, 0]);
    p.extend_from_slice(payload);
    // The pseudo header: addresses, protocol, UDP length.
    let mut pseudo = 0u32;
    for w in [src.octets(), dst.octets()] {
        pseudo += u32::from(u16::from_be_bytes([w[0], w[1]]));
        pseudo += u32::from(u16::from_be_bytes([w[2], w[3]]));
    }
    pseudo += u32::from(IPPROTO_UDP) + udp_len as u32;
    let mut udp_sum = checksum(pseudo, &p[20..]);
    if udp_sum == 0 {
        // 0 means "no checksum" in IPv4 UDP (RFC 768).
        udp_sum = 0xffff;
    }
    p[26..28].copy_from_slice(&udp_sum.to_be_bytes());
    p
}

/// The source address and UDP payload of an IPv4 packet to `dport`; `None`
/// for anything else or a truncated packet. The UDP checksum is not
/// verified: the kernel handed the frame up from a device that already
/// checked it, or from a veth that never computes it.
pub fn parse_ipv4_udp(p: &[u8], dport: u16) -> Option<(Ipv4Addr, &[u8])> {
    if p.len() < 20 || p[0] >> 4 != 4 || p[9] != IPPROTO_UDP {
        return None;
    }
    let ihl = usize::from(p[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([p[2], p[3]]));
    if ihl < 20 || total < ihl + 8 || total > p.len() {
        return None;
    }
    if u16::from_be_bytes([p[6], p[7]]) & 0x1fff != 0 || p[6] & 0x20 != 0 {
        return None; // a fragment
    }
    let udp = &p[ihl..total];
    if u16::from_be_bytes([udp[2], udp[3]]) != dport {
        return None;
    }
    let ulen = usize::from(u16::from_be_bytes([udp[4], udp[5]]));
    if ulen < 8 || ulen > udp.len() {
        return None;
    }
    let src = Ipv4Addr::new(p[12], p[13], p[14], p[15]);
    Some((src, &udp[8..ulen]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_valid_headers_and_parses_them_back() {
        let src = Ipv4Addr::UNSPECIFIED;
        let dst = Ipv4Addr::BROADCAST;
        let p = ipv4_udp(src, dst, 67, 68, b"hello dhcp");
        assert_eq!(p.len(), 20 + 8 + 10);
        // A correct header sums to zero.
        assert_eq!(checksum(0, &p[..20]), 0);
        let mut pseudo = 0u32;
        for w in [src.octets(), dst.octets()] {
            pseudo += u32::from(u16::from_be_bytes([w[0], w[1]]));
            pseudo += u32::from(u16::from_be_bytes([w[2], w[3]]));
        }
        pseudo += 17 + 18;
        assert_eq!(checksum(pseudo, &p[20..]), 0);
        let (from, payload) = parse_ipv4_udp(&p, 68).unwrap();
        assert_eq!((from, payload), (src, &b"hello dhcp"[..]));
        assert!(parse_ipv4_udp(&p, 67).is_none(), "other port");
        assert!(parse_ipv4_udp(&p[..25], 68).is_none(), "truncated");
        let mut frag = p.clone();
        frag[6] = 0x20; // more fragments
        assert!(parse_ipv4_udp(&frag, 68).is_none());
    }

    #[test]
    fn checksum_known_value() {
        // RFC 1071's example words.
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(checksum(0, &data), !0xddf2);
        assert_eq!(checksum(0, &[0xff]), !0xff00);
    }

    #[test]
    fn filter_jumps_land_on_returns() {
        for (i, &(code, jt, jf, _)) in FILTER.iter().enumerate() {
            if code & 0x07 == 0x05 {
                for off in [jt, jf] {
                    let target = i + 1 + usize::from(off);
                    assert!(target < FILTER.len(), "jump out of program at {i}");
                }
            }
        }
        assert_eq!(FILTER[8], (0x06, 0, 0, 0));
    }
}
