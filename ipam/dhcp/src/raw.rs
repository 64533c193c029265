//! The two sockets a DHCP client needs inside the container's namespace.
//!
//! Before it has an address a client can neither receive a reply unicast to
//! the address being offered (the kernel drops IP packets for addresses it
//! does not have) nor rely on the kernel to send from 0.0.0.0. So DISCOVER,
//! REQUEST and their replies go through an `AF_PACKET` socket bound to the
//! interface, with the IPv4 and UDP headers built here and a classic BPF
//! filter letting only UDP to port 68 through. Once bound, RFC 2131 has the
//! client renew by unicast from its address: a plain UDP socket bound to the
//! device and port 68 does that, and receives the unicast answer.
//!
//! Both sockets are created on a thread inside the namespace (a socket
//! belongs to the namespace it was created in) and then driven from tokio.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use tokio::io::unix::AsyncFd;

pub const SERVER_PORT: u16 = 67;
pub const CLIENT_PORT: u16 = 68;
const ETH_P_IP: u16 = 0x0800;
const IPPROTO_UDP: u8 = 17;

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// The cBPF program: accept unfragmented IPv4 UDP to port 68, drop the
/// rest. On an `AF_PACKET`/`SOCK_DGRAM` socket offsets start at the IP header.
fn bpf_program() -> [libc::sock_filter; 9] {
    let s = |code: u16, jt: u8, jf: u8, k: u32| libc::sock_filter { code, jt, jf, k };
    [
        s(0x30, 0, 0, 9),                      // ldb [9]            (protocol)
        s(0x15, 0, 6, u32::from(IPPROTO_UDP)), // jeq #17 ? next : drop
        s(0x28, 0, 0, 6),                      // ldh [6]            (flags, fragment offset)
        s(0x45, 4, 0, 0x1fff),                 // jset #0x1fff ? drop : next
        s(0xb1, 0, 0, 0),                      // ldxb 4*([0]&0xf)   (header length)
        s(0x48, 0, 0, 2),                      // ldh [x+2]          (UDP destination port)
        s(0x15, 0, 1, u32::from(CLIENT_PORT)), // jeq #68 ? accept : drop
        s(0x06, 0, 0, 0x0004_0000),            // ret #262144        (accept)
        s(0x06, 0, 0, 0),                      // ret #0             (drop)
    ]
}

/// Creates the packet socket; call on a thread inside the target namespace.
///
/// The socket starts with protocol 0 (it receives nothing) so that no
/// unfiltered packet is queued before the filter is attached; `bind` then
/// sets the protocol and the interface.
pub fn packet_socket(ifindex: u32) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe {
        OwnedFd::from_raw_fd(cvt(libc::socket(
            libc::AF_PACKET,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        ))?)
    };
    let prog = bpf_program();
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: fprog points at `prog`, alive for the call; the kernel copies it.
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            (&raw const fprog).cast(),
            size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    })?;
    let sll = sockaddr_ll(ifindex, [0; 6]);
    // SAFETY: sll is a valid sockaddr_ll of the given length.
    cvt(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const sll).cast(),
            size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    })?;
    Ok(fd)
}

fn sockaddr_ll(ifindex: u32, dst: [u8; 6]) -> libc::sockaddr_ll {
    // SAFETY: sockaddr_ll is plain data; all-zero is a valid value.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = ETH_P_IP.to_be();
    sll.sll_ifindex = ifindex as i32;
    sll.sll_halen = 6;
    sll.sll_addr[..6].copy_from_slice(&dst);
    sll
}

fn setsockopt_int(
    fd: &OwnedFd,
    level: libc::c_int,
    opt: libc::c_int,
    v: libc::c_int,
) -> io::Result<()> {
    // SAFETY: a c_int option value of the right size.
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            (&raw const v).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// Creates the UDP socket for renewing and releasing: bound to the device
/// and to port 68, broadcast allowed (rebinding broadcasts). Call on a
/// thread inside the target namespace.
pub fn udp_socket(ifname: &str) -> io::Result<std::net::UdpSocket> {
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe {
        OwnedFd::from_raw_fd(cvt(libc::socket(
            libc::AF_INET,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        ))?)
    };
    // Another client on another interface of the namespace may hold port 68.
    setsockopt_int(&fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    setsockopt_int(&fd, libc::SOL_SOCKET, libc::SO_BROADCAST, 1)?;
    // SAFETY: the name bytes and their length.
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_BINDTODEVICE,
            ifname.as_ptr().cast(),
            ifname.len() as libc::socklen_t,
        )
    })?;
    // SAFETY: sockaddr_in is plain data; all-zero is INADDR_ANY.
    let mut sin: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    sin.sin_family = libc::AF_INET as libc::sa_family_t;
    sin.sin_port = CLIENT_PORT.to_be();
    // SAFETY: sin is a valid sockaddr_in of the given length.
    cvt(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const sin).cast(),
            size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    })?;
    Ok(std::net::UdpSocket::from(fd))
}

/// The packet socket, driven by tokio.
pub struct PacketSocket {
    fd: AsyncFd<OwnedFd>,
    ifindex: u32,
}

impl PacketSocket {
    /// Registers `fd` (from [`packet_socket`]) with the current runtime.
    pub fn new(fd: OwnedFd, ifindex: u32) -> io::Result<PacketSocket> {
        // SAFETY: an OwnedFd keeps its descriptor open and unchanged for as
        // long as the AsyncFd owns it.
        let fd = unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)?;
        Ok(PacketSocket { fd, ifindex })
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
        let sll = sockaddr_ll(self.ifindex, dst_mac);
        loop {
            let mut guard = self.fd.writable().await?;
            // SAFETY: pkt and sll are valid for the call.
            let r = guard.try_io(|fd| {
                cvt(unsafe {
                    libc::sendto(
                        fd.as_raw_fd(),
                        pkt.as_ptr().cast(),
                        pkt.len(),
                        0,
                        (&raw const sll).cast(),
                        size_of::<libc::sockaddr_ll>() as libc::socklen_t,
                    ) as libc::c_int
                })
            });
            match r {
                Ok(res) => return res.map(drop),
                Err(_would_block) => continue,
            }
        }
    }

    /// The next UDP payload to port 68, with the sender's IP and MAC
    /// addresses.
    pub async fn recv(&self) -> io::Result<(Vec<u8>, Ipv4Addr, [u8; 6])> {
        let mut buf = vec![0u8; 4096];
        // SAFETY: sockaddr_ll is plain data; all-zero is a valid value.
        let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        loop {
            let mut guard = self.fd.readable().await?;
            let r = guard.try_io(|fd| {
                let mut len = size_of::<libc::sockaddr_ll>() as libc::socklen_t;
                // SAFETY: buf and from are writable for their lengths.
                let n = unsafe {
                    libc::recvfrom(
                        fd.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        0,
                        (&raw mut from).cast(),
                        &mut len,
                    )
                };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            let n = match r {
                Ok(res) => res?,
                Err(_would_block) => continue,
            };
            if let Some((src, payload)) = parse_ipv4_udp(&buf[..n], CLIENT_PORT) {
                let mut mac = [0u8; 6];
                mac.copy_from_slice(&from.sll_addr[..6]);
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
        let prog = bpf_program();
        for (i, ins) in prog.iter().enumerate() {
            if ins.code & 0x07 == 0x05 {
                for off in [ins.jt, ins.jf] {
                    let target = i + 1 + usize::from(off);
                    assert!(target < prog.len(), "jump out of program at {i}");
                }
            }
        }
        assert_eq!(prog[8].code, 0x06);
        assert_eq!(prog[8].k, 0);
    }
}
