//! A namespace's forwarding switch (`net.ipv4.ip_forward`,
//! `net.ipv6.conf.all.forwarding`) read over RTM_GETNETCONF, which the
//! rtnetlink crate does not speak. The /proc/sys path costs a lookup of
//! "net" that walks one cached dentry per namespace on the machine (they
//! all hash alike), about a millisecond per read at a thousand pods; the
//! kernel answers this request without rtnl (6.9 and later).

use std::os::fd::AsRawFd;

use nix::sys::socket::{MsgFlags, recv, send};
use rcni_netns::NetNs;

use crate::{Error, Family, Result, detach};

const RTM_NEWNETCONF: u16 = 80;
const RTM_GETNETCONF: u16 = 82;
const NLMSG_ERROR: u16 = 2;
const NETCONFA_IFINDEX: u16 = 1;
const NETCONFA_FORWARDING: u16 = 2;
/// `NETCONFA_IFINDEX_ALL`: the namespace-wide ("all") values.
const IFINDEX_ALL: i32 = -1;

/// Whether forwarding of `family` (V4 or V6) is on in `ns`.
pub fn forwarding(ns: &NetNs, family: Family) -> Result<bool> {
    let op = "read the forwarding setting";
    let af = match family {
        Family::V6 => libc::AF_INET6,
        _ => libc::AF_INET,
    } as u8;
    let sock = detach::netlink_socket(ns, libc::NETLINK_ROUTE, op)?;
    let req = request(af);
    let sent =
        send(sock.as_raw_fd(), &req, MsgFlags::empty()).map_err(|e| Error::io(op, e.into()))?;
    if sent != req.len() {
        return Err(Error::other(op, "short send"));
    }
    let mut buf = [0u8; 1024];
    let n =
        recv(sock.as_raw_fd(), &mut buf, MsgFlags::empty()).map_err(|e| Error::io(op, e.into()))?;
    parse(&buf[..n]).map_err(|e| match e {
        Parsed::Errno(errno) => Error::io(op, std::io::Error::from_raw_os_error(errno)),
        Parsed::Malformed(what) => Error::other(op, what),
    })
}

/// nlmsghdr, netconfmsg (family, padded to 4), NETCONFA_IFINDEX = all.
fn request(af: u8) -> Vec<u8> {
    let mut m = Vec::with_capacity(28);
    m.extend_from_slice(&28u32.to_ne_bytes());
    m.extend_from_slice(&RTM_GETNETCONF.to_ne_bytes());
    m.extend_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    m.extend_from_slice(&1u32.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.extend_from_slice(&[af, 0, 0, 0]);
    m.extend_from_slice(&8u16.to_ne_bytes());
    m.extend_from_slice(&NETCONFA_IFINDEX.to_ne_bytes());
    m.extend_from_slice(&IFINDEX_ALL.to_ne_bytes());
    m
}

#[derive(Debug, PartialEq)]
enum Parsed {
    Errno(i32),
    Malformed(&'static str),
}

fn u16_at(b: &[u8], i: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(i..i + 2)?.try_into().ok()?))
}

fn i32_at(b: &[u8], i: usize) -> Option<i32> {
    Some(i32::from_ne_bytes(b.get(i..i + 4)?.try_into().ok()?))
}

/// The kernel's answer: RTM_NEWNETCONF with NETCONFA_FORWARDING, or an
/// error message.
fn parse(b: &[u8]) -> std::result::Result<bool, Parsed> {
    let short = Parsed::Malformed("short netconf answer");
    let len = i32_at(b, 0).ok_or(Parsed::Malformed("empty netconf answer"))? as usize;
    let b = b
        .get(..len)
        .ok_or(Parsed::Malformed("truncated netconf answer"))?;
    match u16_at(b, 4).ok_or(short)? {
        NLMSG_ERROR => Err(Parsed::Errno(
            -i32_at(b, 16).ok_or(Parsed::Malformed("short netlink error"))?,
        )),
        RTM_NEWNETCONF => {
            // Attributes follow the 16-byte header and the 4-byte netconfmsg.
            let mut i = 20;
            while let (Some(alen), Some(atype)) = (u16_at(b, i), u16_at(b, i + 2)) {
                let alen = alen as usize;
                if alen < 4 {
                    break;
                }
                if atype == NETCONFA_FORWARDING {
                    return i32_at(b, i + 4)
                        .map(|v| v != 0)
                        .ok_or(Parsed::Malformed("short forwarding attribute"));
                }
                i += (alen + 3) & !3;
            }
            Err(Parsed::Malformed("netconf answer without forwarding"))
        }
        _ => Err(Parsed::Malformed("unexpected netconf answer")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(attrs: &[(u16, i32)]) -> Vec<u8> {
        let mut m = Vec::new();
        let len = 20 + 8 * attrs.len();
        m.extend_from_slice(&(len as u32).to_ne_bytes());
        m.extend_from_slice(&RTM_NEWNETCONF.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(&[libc::AF_INET as u8, 0, 0, 0]);
        for (t, v) in attrs {
            m.extend_from_slice(&8u16.to_ne_bytes());
            m.extend_from_slice(&t.to_ne_bytes());
            m.extend_from_slice(&v.to_ne_bytes());
        }
        m
    }

    #[test]
    fn request_and_answers() {
        let r = request(libc::AF_INET6 as u8);
        assert_eq!(r.len(), 28);
        assert_eq!(u16_at(&r, 4), Some(RTM_GETNETCONF));
        assert_eq!(r[16], libc::AF_INET6 as u8);
        assert_eq!(i32_at(&r, 24), Some(-1));

        assert_eq!(parse(&answer(&[(1, -1), (2, 1), (3, 0)])), Ok(true));
        assert_eq!(parse(&answer(&[(2, 0)])), Ok(false));
        assert!(parse(&answer(&[(1, -1)])).is_err());
        let mut err = Vec::new();
        err.extend_from_slice(&36u32.to_ne_bytes());
        err.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        err.extend_from_slice(&[0; 10]);
        err.extend_from_slice(&(-libc::EOPNOTSUPP).to_ne_bytes());
        err.extend_from_slice(&[0; 16]);
        assert_eq!(parse(&err), Err(Parsed::Errno(libc::EOPNOTSUPP)));
        assert!(parse(&[]).is_err());
        assert!(parse(&answer(&[(2, 1)])[..22]).is_err());
    }
}
