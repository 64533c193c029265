//! NFLOG (nfnetlink_log): reading the packets that `log group N` rules
//! send to userspace, in the namespace whose rules log them (NFLOG groups
//! are per network namespace).
//!
//! [`Nflog::bind`] binds one group (a group has one listener per
//! namespace: a second bind fails with `EBUSY`) and asks for the first
//! bytes of each packet only: the headers are all a flow needs.
//! [`parse_packet`] and [`parse_headers`] are pure, for tests without
//! root.

use crate::nfnl::{attr as nla, attrs as nlas};
use netlink_packet_core::{Emitable, NLM_F_ACK};
use netlink_packet_netfilter::nflog::{ConfigCmd, ConfigMode, ConfigNla};
use rcni_netlink::nlsock::{NlSocket, Protocol, split};
use rcni_netlink::{Error, Result};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::AsFd;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

// <linux/netfilter/nfnetlink.h>, <linux/netfilter/nfnetlink_log.h>
const NFNL_SUBSYS_ULOG: u16 = 4;
const NFULNL_MSG_PACKET: u16 = 0;
const NFULNL_MSG_CONFIG: u16 = 1;
const NFULA_PACKET_HDR: u16 = 1;
const NFULA_TIMESTAMP: u16 = 4;
const NFULA_PAYLOAD: u16 = 9;
const NFULA_PREFIX: u16 = 10;
const NFNETLINK_V0: u8 = 0;
const AF_UNSPEC: u8 = 0;
/// `sizeof(struct nfgenmsg)`.
const NFGENMSG_LEN: usize = 4;

/// Headers only: IPv6 (40) and TCP (20) with room to spare.
pub const COPY_RANGE: u32 = 128;

/// One logged packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Logged {
    /// The rule's `prefix`.
    pub prefix: String,
    /// When the kernel logged it (when it says so).
    pub time: Option<SystemTime>,
    /// `NFULA_PACKET_HDR`'s ethertype (0x0800, 0x86dd), 0 when absent.
    pub hw_protocol: u16,
    /// The packet from its network header, cut at [`COPY_RANGE`].
    pub payload: Vec<u8>,
}

/// A listener of one NFLOG group.
pub struct Nflog {
    sock: NlSocket,
    group: u16,
    buf: Vec<u8>,
}

fn config(sock: &mut NlSocket, group: u16, nla: ConfigNla, what: &str) -> Result<()> {
    let mut p = vec![AF_UNSPEC, NFNETLINK_V0];
    p.extend_from_slice(&group.to_be_bytes());
    let mut a = vec![0u8; [nla.clone()].as_slice().buffer_len()];
    [nla].as_slice().emit(&mut a);
    p.extend_from_slice(&a);
    sock.request(
        what,
        (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG,
        NLM_F_ACK,
        &p,
    )
    .map(|_| ())
}

impl Nflog {
    /// Binds `group` in the calling thread's namespace, copying
    /// [`COPY_RANGE`] bytes of each packet.
    pub fn bind(group: u16) -> Result<Nflog> {
        let what = format!("bind NFLOG group {group}");
        let mut sock = NlSocket::open_here(Protocol::Netfilter, &what)?;
        config(&mut sock, group, ConfigNla::Cmd(ConfigCmd::Bind), &what)?;
        config(
            &mut sock,
            group,
            ConfigNla::Mode(ConfigMode::new_packet(COPY_RANGE)),
            &what,
        )?;
        // Each packet at once: the instance's default batches 100 packets
        // or 1 s, the rule's `queue-threshold` being 0.
        config(&mut sock, group, ConfigNla::QThresh(1), &what)?;
        // A burst of denials must not overflow the queue before we read.
        let _ = sock.force_buffers(1 << 20, 4 << 20, &what);
        Ok(Nflog {
            sock,
            group,
            buf: vec![0u8; 1 << 16],
        })
    }

    pub fn group(&self) -> u16 {
        self.group
    }

    /// Waits up to `timeout` for packets; what arrived (maybe nothing).
    /// Packets the socket dropped on overflow (`ENOBUFS`) are lost, not
    /// an error.
    pub fn recv(&mut self, timeout: Duration) -> Result<Vec<Logged>> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use nix::sys::socket::{MsgFlags, recv};
        use std::os::fd::AsRawFd;
        let mut out = Vec::new();
        let ms = timeout.as_millis().min(u128::from(u16::MAX)) as u16;
        let mut fds = [PollFd::new(self.sock.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(Error::io("poll NFLOG", e.into())),
        }
        let fd = self.sock.as_fd().as_raw_fd();
        loop {
            match recv(fd, &mut self.buf, MsgFlags::MSG_DONTWAIT) {
                Ok(n) => {
                    for (ty, _, _, p) in split(&self.buf[..n]) {
                        if ty == (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET
                            && let Some(l) = parse_packet(p)
                        {
                            out.push(l);
                        }
                    }
                }
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(nix::errno::Errno::EINTR | nix::errno::Errno::ENOBUFS) => continue,
                Err(e) => return Err(Error::io("read NFLOG", e.into())),
            }
        }
        Ok(out)
    }
}

/// An `NFULNL_MSG_PACKET` message's payload (`nfgenmsg`, then the
/// attributes).
pub fn parse_packet(msg: &[u8]) -> Option<Logged> {
    let attrs = msg.get(NFGENMSG_LEN..)?;
    let prefix = nla(attrs, NFULA_PREFIX)
        .map(|p| {
            let end = p.iter().position(|b| *b == 0).unwrap_or(p.len());
            String::from_utf8_lossy(&p[..end]).into_owned()
        })
        .unwrap_or_default();
    let time = nla(attrs, NFULA_TIMESTAMP).and_then(|t| {
        let sec = u64::from_be_bytes(t.get(..8)?.try_into().ok()?);
        let usec = u64::from_be_bytes(t.get(8..16)?.try_into().ok()?);
        Some(UNIX_EPOCH + Duration::from_secs(sec) + Duration::from_micros(usec))
    });
    let hw_protocol = nla(attrs, NFULA_PACKET_HDR)
        .and_then(|h| Some(u16::from_be_bytes(h.get(..2)?.try_into().ok()?)))
        .unwrap_or(0);
    let payload = nla(attrs, NFULA_PAYLOAD)?.to_vec();
    // Attributes we do not read are skipped; the iterator proves the
    // buffer well formed enough.
    let _ = nlas(attrs).count();
    Some(Logged {
        prefix,
        time,
        hw_protocol,
        payload,
    })
}

/// What a flow needs of an IP packet's headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Headers {
    pub proto: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    /// TCP, UDP and SCTP ports; ICMP echo's identifier as both; else 0.
    pub sport: u16,
    pub dport: u16,
    /// ICMP and ICMPv6.
    pub icmp_type: Option<u8>,
}

/// The headers of an IPv4 or IPv6 packet (from its network header). A
/// transport header cut short, or behind IPv6 extension headers or in a
/// later fragment, leaves the ports 0.
pub fn parse_headers(p: &[u8]) -> Option<Headers> {
    let (proto, src, dst, l4) = match p.first()? >> 4 {
        4 => {
            let ihl = usize::from(p[0] & 0x0f) * 4;
            if ihl < 20 || p.len() < 20 {
                return None;
            }
            let frag = u16::from_be_bytes([p[6], p[7]]) & 0x1fff;
            let src = Ipv4Addr::from(<[u8; 4]>::try_from(&p[12..16]).ok()?);
            let dst = Ipv4Addr::from(<[u8; 4]>::try_from(&p[16..20]).ok()?);
            let l4 = if frag == 0 { p.get(ihl..) } else { None };
            (p[9], IpAddr::V4(src), IpAddr::V4(dst), l4)
        }
        6 => {
            if p.len() < 40 {
                return None;
            }
            let src = Ipv6Addr::from(<[u8; 16]>::try_from(&p[8..24]).ok()?);
            let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&p[24..40]).ok()?);
            (p[6], IpAddr::V6(src), IpAddr::V6(dst), p.get(40..))
        }
        _ => return None,
    };
    let mut h = Headers {
        proto,
        src,
        dst,
        sport: 0,
        dport: 0,
        icmp_type: None,
    };
    let l4 = l4.unwrap_or_default();
    let be16 = |i: usize| l4.get(i..i + 2).map(|b| u16::from_be_bytes([b[0], b[1]]));
    match proto {
        6 | 17 | 132 => {
            h.sport = be16(0).unwrap_or(0);
            h.dport = be16(2).unwrap_or(0);
        }
        1 | 58 => {
            h.icmp_type = l4.first().copied();
            let echo = matches!(
                (proto, h.icmp_type),
                (1, Some(0 | 8)) | (58, Some(128 | 129))
            );
            if echo {
                h.sport = be16(4).unwrap_or(0);
                h.dport = h.sport;
            }
        }
        _ => {}
    }
    Some(h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nfnl::push_attr;

    fn v4_udp() -> Vec<u8> {
        let mut p = vec![0x45, 0, 0, 28, 0, 0, 0x40, 0, 64, 17, 0, 0];
        p.extend_from_slice(&[10, 0, 0, 2, 10, 0, 0, 3]);
        p.extend_from_slice(&[0x9c, 0x40, 0x00, 0x35, 0, 8, 0, 0]);
        p
    }

    #[test]
    fn ipv4_udp_and_icmp_echo() {
        let h = parse_headers(&v4_udp()).unwrap();
        assert_eq!(
            (h.proto, h.src, h.dst, h.sport, h.dport, h.icmp_type),
            (
                17,
                "10.0.0.2".parse().unwrap(),
                "10.0.0.3".parse().unwrap(),
                40000,
                53,
                None
            )
        );
        let mut p = v4_udp();
        p[9] = 1;
        p[20..28].copy_from_slice(&[8, 0, 0, 0, 0x12, 0x34, 0, 1]);
        let h = parse_headers(&p).unwrap();
        assert_eq!((h.icmp_type, h.sport, h.dport), (Some(8), 0x1234, 0x1234));
        // A later fragment has no ports.
        let mut p = v4_udp();
        p[7] = 1;
        assert_eq!(parse_headers(&p).unwrap().sport, 0);
        // Cut short: no transport header, no panic.
        assert_eq!(parse_headers(&v4_udp()[..21]).unwrap().dport, 0);
        assert!(parse_headers(&v4_udp()[..19]).is_none());
        assert!(parse_headers(&[]).is_none());
        assert!(parse_headers(&[0x46]).is_none());
    }

    #[test]
    fn ipv6_tcp() {
        let mut p = vec![0x60, 0, 0, 0, 0, 20, 6, 64];
        p.extend_from_slice(&"fd00::2".parse::<Ipv6Addr>().unwrap().octets());
        p.extend_from_slice(&"fd00::3".parse::<Ipv6Addr>().unwrap().octets());
        p.extend_from_slice(&[0xc3, 0x50, 0x1f, 0x90]);
        p.resize(60, 0);
        let h = parse_headers(&p).unwrap();
        assert_eq!(h.src, "fd00::2".parse::<IpAddr>().unwrap());
        assert_eq!((h.proto, h.sport, h.dport), (6, 50000, 8080));
    }

    #[test]
    fn packet_messages() {
        let mut m = vec![2, 0, 0x80, 0x01];
        push_attr(&mut m, NFULA_PACKET_HDR, &[0x08, 0x00, 3, 0]);
        let mut ts = 1_700_000_000u64.to_be_bytes().to_vec();
        ts.extend_from_slice(&250_000u64.to_be_bytes());
        push_attr(&mut m, NFULA_TIMESTAMP, &ts);
        push_attr(&mut m, NFULA_PREFIX, b"rcni deny ingress 3\0");
        push_attr(&mut m, NFULA_PAYLOAD, &v4_udp());
        let l = parse_packet(&m).unwrap();
        assert_eq!(l.prefix, "rcni deny ingress 3");
        assert_eq!(l.hw_protocol, 0x0800);
        assert_eq!(
            l.time,
            Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000) + Duration::from_millis(250))
        );
        assert_eq!(l.payload, v4_udp());
        // No payload: nothing to report.
        assert!(parse_packet(&m[..4]).is_none());
        assert!(parse_packet(&[1]).is_none());
    }
}
