//! nf_tables rule expressions in their netlink encoding, for the handful
//! of matches and statements the meta plugins write (what `nft
//! --debug=netlink` shows nft 1.0.6 generating for the same rule text), so
//! a plugin can add its rules in one netlink transaction instead of
//! starting an `nft` process (about 10 ms each, most of it nft loading the
//! ruleset into its cache).

use std::net::IpAddr;

use ipnetwork::IpNetwork;

// <linux/netfilter/nf_tables.h>
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;
const NLA_F_NESTED: u16 = 0x8000;

const NFT_REG_VERDICT: u32 = 0;
const NFT_REG_1: u32 = 1;
const NFT_REG_2: u32 = 2;

const NF_DROP: i32 = 0;
const NF_ACCEPT: i32 = 1;
const NFT_JUMP: i32 = -3;

const NFT_META_NFPROTO: u32 = 15;
const NFT_META_L4PROTO: u32 = 16;
const NFT_META_IIFNAME: u32 = 6;
const NFT_META_OIFNAME: u32 = 7;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
const NFT_CT_STATE: u32 = 0;
const NFT_CT_STATUS: u32 = 2;
const NFT_CMP_EQ: u32 = 0;
const NFT_CMP_NEQ: u32 = 1;
const NFT_NAT_DNAT: u32 = 1;
const NFT_FIB_RESULT_ADDRTYPE: u32 = 3;
const NFTA_FIB_F_DADDR: u32 = 2;
const RTN_LOCAL: u32 = 2;
const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 2;
/// `IPS_DST_NAT`: the connection was DNATed.
const IPS_DST_NAT: u32 = 0x20;
/// `NF_CT_STATE_BIT(ESTABLISHED) | NF_CT_STATE_BIT(RELATED)`.
const CT_ESTABLISHED_RELATED: u32 = 0x6;
const IFNAMSIZ: usize = 16;

/// One expression, encoded as an `NFTA_LIST_ELEM`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expr(Vec<u8>);

impl Expr {
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }
}

pub(crate) fn push_attr(buf: &mut Vec<u8>, ty: u16, value: &[u8]) {
    let len = 4 + value.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&ty.to_ne_bytes());
    buf.extend_from_slice(value);
    while !buf.len().is_multiple_of(4) {
        buf.push(0);
    }
}

fn nested(ty: u16, inner: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    push_attr(&mut b, ty | NLA_F_NESTED, inner);
    b
}

fn be32(v: u32) -> [u8; 4] {
    v.to_be_bytes()
}

/// An expression `name` with data attributes `(type, value)`.
fn expr(name: &str, attrs: &[(u16, Vec<u8>)]) -> Expr {
    let mut data = Vec::new();
    for (t, v) in attrs {
        push_attr(&mut data, *t, v);
    }
    let mut inner = Vec::new();
    let mut n = name.as_bytes().to_vec();
    n.push(0);
    push_attr(&mut inner, NFTA_EXPR_NAME, &n);
    if !attrs.is_empty() {
        push_attr(&mut inner, NFTA_EXPR_DATA | NLA_F_NESTED, &data);
    }
    Expr(nested(NFTA_LIST_ELEM, &inner))
}

fn data_value(v: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    push_attr(&mut b, NFTA_DATA_VALUE, v);
    b
}

fn meta(key: u32) -> Expr {
    expr(
        "meta",
        &[(2, be32(key).to_vec()), (1, be32(NFT_REG_1).to_vec())],
    )
}

fn payload(base: u32, offset: u32, len: u32) -> Expr {
    expr(
        "payload",
        &[
            (1, be32(NFT_REG_1).to_vec()),
            (2, be32(base).to_vec()),
            (3, be32(offset).to_vec()),
            (4, be32(len).to_vec()),
        ],
    )
}

fn cmp(op: u32, data: &[u8]) -> Expr {
    expr(
        "cmp",
        &[
            (1, be32(NFT_REG_1).to_vec()),
            (2, be32(op).to_vec()),
            (3 | NLA_F_NESTED, data_value(data)),
        ],
    )
}

fn bitwise(mask: &[u8]) -> Expr {
    expr(
        "bitwise",
        &[
            (1, be32(NFT_REG_1).to_vec()),
            (2, be32(NFT_REG_1).to_vec()),
            (3, be32(mask.len() as u32).to_vec()),
            (4 | NLA_F_NESTED, data_value(mask)),
            (5 | NLA_F_NESTED, data_value(&vec![0u8; mask.len()])),
        ],
    )
}

fn immediate(reg: u32, data: &[u8]) -> Expr {
    expr(
        "immediate",
        &[
            (1, be32(reg).to_vec()),
            (2 | NLA_F_NESTED, data_value(data)),
        ],
    )
}

fn verdict(code: i32, chain: Option<&str>) -> Expr {
    let mut v = Vec::new();
    push_attr(&mut v, NFTA_VERDICT_CODE, &code.to_be_bytes());
    if let Some(c) = chain {
        let mut n = c.as_bytes().to_vec();
        n.push(0);
        push_attr(&mut v, NFTA_VERDICT_CHAIN, &n);
    }
    let mut d = Vec::new();
    push_attr(&mut d, NFTA_DATA_VERDICT | NLA_F_NESTED, &v);
    expr(
        "immediate",
        &[(1, be32(NFT_REG_VERDICT).to_vec()), (2 | NLA_F_NESTED, d)],
    )
}

fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// Where the source and destination addresses sit in the network header.
fn addr_offsets(v6: bool) -> (u32, u32, u32) {
    if v6 { (8, 24, 16) } else { (12, 16, 4) }
}

/// A transport protocol for `meta l4proto`.
pub fn l4proto(proto: u8) -> Vec<Expr> {
    vec![meta(NFT_META_L4PROTO), cmp(NFT_CMP_EQ, &[proto])]
}

/// `meta nfproto ipv4|ipv6`: needed before address matches in an `inet`
/// table.
pub fn nfproto(v6: bool) -> Vec<Expr> {
    vec![
        meta(NFT_META_NFPROTO),
        cmp(NFT_CMP_EQ, &[if v6 { 10 } else { 2 }]),
    ]
}

/// `th dport <port>`.
pub fn th_dport(port: u16) -> Vec<Expr> {
    vec![
        payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2),
        cmp(NFT_CMP_EQ, &port.to_be_bytes()),
    ]
}

/// `ip|ip6 saddr|daddr <net>` (a full-length prefix matches one address).
pub fn addr(src: bool, net: IpNetwork) -> Vec<Expr> {
    let v6 = net.is_ipv6();
    let (s, d, len) = addr_offsets(v6);
    let mut out = vec![payload(
        NFT_PAYLOAD_NETWORK_HEADER,
        if src { s } else { d },
        len,
    )];
    if u32::from(net.prefix()) != len * 8 {
        out.push(bitwise(&ip_bytes(net.mask())));
    }
    out.push(cmp(NFT_CMP_EQ, &ip_bytes(net.network())));
    out
}

/// `iifname|oifname [!=] "<name>"`.
pub fn ifname(input: bool, name: &str, equal: bool) -> Vec<Expr> {
    let mut n = [0u8; IFNAMSIZ];
    let b = name.as_bytes();
    n[..b.len().min(IFNAMSIZ - 1)].copy_from_slice(&b[..b.len().min(IFNAMSIZ - 1)]);
    vec![
        meta(if input {
            NFT_META_IIFNAME
        } else {
            NFT_META_OIFNAME
        }),
        cmp(if equal { NFT_CMP_EQ } else { NFT_CMP_NEQ }, &n),
    ]
}

/// `fib daddr type local`.
pub fn fib_daddr_local() -> Vec<Expr> {
    vec![
        expr(
            "fib",
            &[
                (1, be32(NFT_REG_1).to_vec()),
                (2, be32(NFT_FIB_RESULT_ADDRTYPE).to_vec()),
                (3, be32(NFTA_FIB_F_DADDR).to_vec()),
            ],
        ),
        cmp(NFT_CMP_EQ, &RTN_LOCAL.to_ne_bytes()),
    ]
}

fn ct_bits(key: u32, mask: u32) -> Vec<Expr> {
    vec![
        expr(
            "ct",
            &[(1, be32(NFT_REG_1).to_vec()), (2, be32(key).to_vec())],
        ),
        bitwise(&mask.to_ne_bytes()),
        cmp(NFT_CMP_NEQ, &[0, 0, 0, 0]),
    ]
}

/// `ct status dnat`.
pub fn ct_status_dnat() -> Vec<Expr> {
    ct_bits(NFT_CT_STATUS, IPS_DST_NAT)
}

/// `ct state related,established`.
pub fn ct_established() -> Vec<Expr> {
    ct_bits(NFT_CT_STATE, CT_ESTABLISHED_RELATED)
}

/// `dnat to <ip>:<port>` (in an `ip` or `ip6` table).
pub fn dnat(ip: IpAddr, port: u16) -> Vec<Expr> {
    let family: u32 = if ip.is_ipv6() { 10 } else { 2 };
    vec![
        immediate(NFT_REG_1, &ip_bytes(ip)),
        immediate(NFT_REG_2, &port.to_be_bytes()),
        expr(
            "nat",
            &[
                (1, be32(NFT_NAT_DNAT).to_vec()),
                (2, be32(family).to_vec()),
                (3, be32(NFT_REG_1).to_vec()),
                (5, be32(NFT_REG_2).to_vec()),
                (7, be32(NF_NAT_RANGE_PROTO_SPECIFIED).to_vec()),
            ],
        ),
    ]
}

pub fn masquerade() -> Vec<Expr> {
    vec![expr("masq", &[])]
}

pub fn accept() -> Vec<Expr> {
    vec![verdict(NF_ACCEPT, None)]
}

pub fn drop() -> Vec<Expr> {
    vec![verdict(NF_DROP, None)]
}

pub fn jump(chain: &str) -> Vec<Expr> {
    vec![verdict(NFT_JUMP, Some(chain))]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings() {
        // A subnet needs a mask, a host address does not.
        assert_eq!(addr(true, "10.88.0.0/24".parse().unwrap()).len(), 3);
        assert_eq!(addr(false, "10.88.0.5/32".parse().unwrap()).len(), 2);
        assert_eq!(addr(false, "fd88::5/128".parse().unwrap()).len(), 2);
        // Each expression is one NFTA_LIST_ELEM, length-prefixed.
        for e in dnat("10.88.0.5".parse().unwrap(), 80)
            .iter()
            .chain(&jump("hostports"))
            .chain(&ifname(true, "cni0", false))
        {
            let b = e.bytes();
            assert_eq!(u16::from_ne_bytes([b[0], b[1]]) as usize, b.len());
            assert_eq!(
                u16::from_ne_bytes([b[2], b[3]]),
                NFTA_LIST_ELEM | NLA_F_NESTED
            );
        }
    }
}
