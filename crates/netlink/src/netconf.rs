//! A namespace's forwarding switch (`net.ipv4.ip_forward`,
//! `net.ipv6.conf.all.forwarding`) read over RTM_GETNETCONF, which the
//! rtnetlink crate does not speak. The /proc/sys path costs a lookup of
//! "net" that walks one cached dentry per namespace on the machine (they
//! all hash alike), about a millisecond per read at a thousand pods; the
//! kernel answers this request without rtnl (6.9 and later).

use rcni_netns::NetNs;

use crate::nlsock::{NlSocket, Protocol};
use crate::{Error, Family, Result};

const RTM_NEWNETCONF: u16 = 80;
const RTM_GETNETCONF: u16 = 82;
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
    let mut sock = NlSocket::open(ns, Protocol::Route, op)?;
    let answer = sock.request_one(op, RTM_GETNETCONF, 0, &request(af))?;
    parse(answer.ty, &answer.payload).map_err(|what| Error::other(op, what))
}

/// netconfmsg (family, padded to 4), NETCONFA_IFINDEX = all.
fn request(af: u8) -> Vec<u8> {
    let mut m = Vec::with_capacity(12);
    m.extend_from_slice(&[af, 0, 0, 0]);
    m.extend_from_slice(&8u16.to_ne_bytes());
    m.extend_from_slice(&NETCONFA_IFINDEX.to_ne_bytes());
    m.extend_from_slice(&IFINDEX_ALL.to_ne_bytes());
    m
}

fn u16_at(b: &[u8], i: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(i..i + 2)?.try_into().ok()?))
}

fn i32_at(b: &[u8], i: usize) -> Option<i32> {
    Some(i32::from_ne_bytes(b.get(i..i + 4)?.try_into().ok()?))
}

/// The kernel's answer (the socket turned an error message into an
/// error): RTM_NEWNETCONF with NETCONFA_FORWARDING.
fn parse(ty: u16, b: &[u8]) -> std::result::Result<bool, &'static str> {
    if ty != RTM_NEWNETCONF {
        return Err("unexpected netconf answer");
    }
    // Attributes follow the 4-byte netconfmsg.
    let mut i = 4;
    while let (Some(alen), Some(atype)) = (u16_at(b, i), u16_at(b, i + 2)) {
        let alen = alen as usize;
        if alen < 4 {
            break;
        }
        if atype == NETCONFA_FORWARDING {
            return i32_at(b, i + 4)
                .map(|v| v != 0)
                .ok_or("short forwarding attribute");
        }
        i += (alen + 3) & !3;
    }
    Err("netconf answer without forwarding")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// netconfmsg and the attributes.
    fn answer(attrs: &[(u16, i32)]) -> Vec<u8> {
        let mut m = vec![libc::AF_INET as u8, 0, 0, 0];
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
        assert_eq!(r.len(), 12);
        assert_eq!(r[0], libc::AF_INET6 as u8);
        assert_eq!(u16_at(&r, 6), Some(NETCONFA_IFINDEX));
        assert_eq!(i32_at(&r, 8), Some(-1));

        let p = |a: &[u8]| parse(RTM_NEWNETCONF, a);
        assert_eq!(p(&answer(&[(1, -1), (2, 1), (3, 0)])), Ok(true));
        assert_eq!(p(&answer(&[(2, 0)])), Ok(false));
        assert!(p(&answer(&[(1, -1)])).is_err());
        assert!(p(&[]).is_err());
        assert!(p(&answer(&[(2, 1)])[..10]).is_err());
        assert!(parse(RTM_GETNETCONF, &answer(&[(2, 1)])).is_err());
    }
}
