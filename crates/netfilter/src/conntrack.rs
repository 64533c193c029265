//! Conntrack entries over [`Nfnl`]: listing them and deleting those a
//! plugin made stale (portmap's UDP mappings, plugins #123).
//!
//! Hand-encoded: an entry is deleted by echoing back the `CTA_TUPLE_ORIG`
//! attribute exactly as the kernel listed it (with its zone), which needs
//! the raw bytes rather than a decoded model.

use crate::nfnl::{NLA_F_NESTED, NLM_F_ACK, NLM_F_REQUEST, Nfnl, attr, push_attr};
use rcni_netlink::Result;
use std::net::IpAddr;

// <linux/netfilter/nfnetlink.h>
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
// <linux/netfilter/nfnetlink_conntrack.h>
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_ZONE: u16 = 18;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;

/// IP protocol numbers used with conntrack filters.
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_SCTP: u8 = 132;

/// A conntrack entry: its original direction, and the reply source (which
/// differs from the original destination when the connection was DNATed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flow {
    pub proto: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub reply_src: Option<IpAddr>,
    zone: Option<Vec<u8>>,
    /// The `CTA_TUPLE_ORIG` attribute as the kernel sent it, echoed back to
    /// delete exactly this entry.
    orig_attr: Vec<u8>,
}

fn ip_of(v: &[u8]) -> Option<IpAddr> {
    match v.len() {
        4 => Some(IpAddr::from(<[u8; 4]>::try_from(v).ok()?)),
        16 => Some(IpAddr::from(<[u8; 16]>::try_from(v).ok()?)),
        _ => None,
    }
}

fn be16(v: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes(v.try_into().ok()?))
}

/// `(proto, src, dst, sport, dport)` of a `CTA_TUPLE_*` payload.
fn parse_tuple(t: &[u8]) -> Option<(u8, IpAddr, IpAddr, u16, u16)> {
    let ip = attr(t, CTA_TUPLE_IP)?;
    let src = attr(ip, CTA_IP_V4_SRC).or_else(|| attr(ip, CTA_IP_V6_SRC))?;
    let dst = attr(ip, CTA_IP_V4_DST).or_else(|| attr(ip, CTA_IP_V6_DST))?;
    let proto = attr(t, CTA_TUPLE_PROTO)?;
    let num = *attr(proto, CTA_PROTO_NUM)?.first()?;
    let sport = attr(proto, CTA_PROTO_SRC_PORT).and_then(be16).unwrap_or(0);
    let dport = attr(proto, CTA_PROTO_DST_PORT).and_then(be16).unwrap_or(0);
    Some((num, ip_of(src)?, ip_of(dst)?, sport, dport))
}

impl Nfnl {
    /// Every conntrack entry of one IP family (`v6` false: IPv4).
    pub fn conntrack_flows(&mut self, v6: bool) -> Result<Vec<Flow>> {
        let family = if v6 { libc::AF_INET6 } else { libc::AF_INET } as u8;
        let t = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET;
        let msgs = self.dump("dump conntrack table", t, family, 0, &[])?;
        Ok(msgs
            .into_iter()
            .filter_map(|(_, a)| {
                let orig = attr(&a, CTA_TUPLE_ORIG)?;
                let (proto, src, dst, sport, dport) = parse_tuple(orig)?;
                let reply_src = attr(&a, CTA_TUPLE_REPLY).and_then(parse_tuple).map(|t| t.1);
                let mut orig_attr = Vec::new();
                push_attr(&mut orig_attr, CTA_TUPLE_ORIG | NLA_F_NESTED, orig);
                Some(Flow {
                    proto,
                    src,
                    dst,
                    sport,
                    dport,
                    reply_src,
                    zone: attr(&a, CTA_ZONE).map(<[u8]>::to_vec),
                    orig_attr,
                })
            })
            .collect())
    }

    /// Deletes the entries for which `doomed` holds, in both IP families;
    /// returns how many went. An entry that expired meanwhile is no error.
    pub fn conntrack_delete_where(&mut self, doomed: impl Fn(&Flow) -> bool) -> Result<usize> {
        let mut n = 0;
        for v6 in [false, true] {
            let family = if v6 { libc::AF_INET6 } else { libc::AF_INET } as u8;
            for flow in self.conntrack_flows(v6)?.iter().filter(|f| doomed(f)) {
                let mut p = flow.orig_attr.clone();
                if let Some(z) = &flow.zone {
                    push_attr(&mut p, CTA_ZONE, z);
                }
                let t = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE;
                let m = self.message(t, NLM_F_REQUEST | NLM_F_ACK, family, 0, &p);
                let seq = self.seq;
                match self.send_acked("delete conntrack entry", &m, &[seq]) {
                    Ok(()) => n += 1,
                    Err(e) if e.is_not_found() => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuple_parsing() {
        let mut ip = Vec::new();
        push_attr(&mut ip, CTA_IP_V4_SRC, &[10, 0, 0, 1]);
        push_attr(&mut ip, CTA_IP_V4_DST, &[10, 0, 0, 2]);
        let mut proto = Vec::new();
        push_attr(&mut proto, CTA_PROTO_NUM, &[IPPROTO_UDP]);
        push_attr(&mut proto, CTA_PROTO_SRC_PORT, &1234u16.to_be_bytes());
        push_attr(&mut proto, CTA_PROTO_DST_PORT, &53u16.to_be_bytes());
        let mut t = Vec::new();
        push_attr(&mut t, CTA_TUPLE_IP | NLA_F_NESTED, &ip);
        push_attr(&mut t, CTA_TUPLE_PROTO | NLA_F_NESTED, &proto);
        let (p, s, d, sp, dp) = parse_tuple(&t).unwrap();
        assert_eq!(
            (p, s.to_string(), d.to_string(), sp, dp),
            (17, "10.0.0.1".into(), "10.0.0.2".into(), 1234, 53)
        );
    }
}
