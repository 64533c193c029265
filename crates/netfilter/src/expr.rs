//! nf_tables rule expressions: the builders for the matches and statements
//! the plugins write, encoded exactly as nft 1.0.6 encodes the same rule
//! text (`nft --debug=netlink`), and [`Term`], the form a listed rule is
//! compared in.
//!
//! Encoding the same bytes as nft matters: `nft list` prints a rule we
//! wrote exactly like the one nft wrote from the reference's text (upstream
//! writes with knftables, i.e. nft), and CHECK accepts either.
//!
//! The expressions netlink-packet-netfilter models (meta, payload, cmp,
//! bitwise, immediate) are built with its types. It has nothing for `ct`,
//! `nat`, `fib` and `masq`: those are hand-encoded as
//! [`Expressions::Other`] with their attributes from
//! `<linux/netfilter/nf_tables.h>`.

use ipnetwork::IpNetwork;
use netlink_packet_core::DefaultNla;
use netlink_packet_netfilter::nftables::{
    Bitwise, Cmp, DataAttribute, ExpressionAttribute, Expressions, Immediate, ListAttribute, Meta,
    MetaKey, Operator, Payload, Register, Verdict, VerdictAttribute,
};
use std::net::IpAddr;

// <linux/netfilter.h>: verdict codes the crate's `Verdict` has no name for.
const NF_DROP: u32 = 0;
const NF_ACCEPT: u32 = 1;

const NFT_PAYLOAD_LL_HEADER: u32 = 0;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;
const IFNAMSIZ: usize = 16;

// Hand-encoded expressions (see the module docs).
const NFTA_CT_DREG: u16 = 1;
const NFTA_CT_KEY: u16 = 2;
const NFT_CT_STATE: u32 = 0;
const NFT_CT_STATUS: u32 = 2;
const NFTA_NAT_TYPE: u16 = 1;
const NFTA_NAT_FAMILY: u16 = 2;
const NFTA_NAT_REG_ADDR_MIN: u16 = 3;
const NFTA_NAT_REG_PROTO_MIN: u16 = 5;
const NFTA_NAT_FLAGS: u16 = 7;
const NFT_NAT_SNAT: u32 = 0;
const NFT_NAT_DNAT: u32 = 1;
const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 2;
const NFTA_FIB_DREG: u16 = 1;
const NFTA_FIB_RESULT: u16 = 2;
const NFTA_FIB_FLAGS: u16 = 3;
const NFT_FIB_RESULT_ADDRTYPE: u32 = 3;
const NFTA_FIB_F_DADDR: u32 = 2;
const RTN_LOCAL: u32 = 2;
/// `IPS_DST_NAT`: the connection was DNATed.
const IPS_DST_NAT: u32 = 0x20;
/// `NF_CT_STATE_BIT(ESTABLISHED) | NF_CT_STATE_BIT(RELATED)`.
const CT_ESTABLISHED_RELATED: u32 = 0x6;

/// One expression of a rule (an `NFTA_LIST_ELEM`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expr(pub(crate) ListAttribute<ExpressionAttribute>);

impl From<Expressions> for Expr {
    fn from(e: Expressions) -> Expr {
        Expr(e.into())
    }
}

fn be32(v: u32) -> Vec<u8> {
    v.to_be_bytes().to_vec()
}

/// An expression the crate does not model, from its attributes.
fn other(name: &str, attrs: &[(u16, Vec<u8>)]) -> Expr {
    Expressions::Other {
        expression_type: name.into(),
        attributes: attrs
            .iter()
            .map(|(t, v)| DefaultNla::new(*t, v.clone()))
            .collect(),
    }
    .into()
}

fn meta(key: MetaKey) -> Expr {
    Expressions::Meta(vec![
        Meta::Key(key),
        Meta::DestinationRegister(Register::Reg1),
    ])
    .into()
}

fn payload(base: u32, offset: u32, len: u32) -> Expr {
    Expressions::Payload(vec![
        Payload::DestinationRegister(Register::Reg1),
        Payload::Base(base),
        Payload::Offset(offset),
        Payload::Len(len),
    ])
    .into()
}

fn cmp(equal: bool, data: &[u8]) -> Expr {
    let op = if equal {
        Operator::Equal
    } else {
        Operator::NotEqual
    };
    Expressions::Cmp(vec![
        Cmp::SourceRegister(Register::Reg1),
        Cmp::Op(op),
        Cmp::Data(DataAttribute::Value(data.to_vec())),
    ])
    .into()
}

fn bitwise(mask: &[u8]) -> Expr {
    Expressions::Bitwise(vec![
        Bitwise::SourceRegister(Register::Reg1),
        Bitwise::DestinationRegister(Register::Reg1),
        Bitwise::Length(mask.len() as u32),
        Bitwise::Mask(DataAttribute::Value(mask.to_vec())),
        Bitwise::Xor(DataAttribute::Value(vec![0u8; mask.len()])),
    ])
    .into()
}

fn immediate(reg: Register, data: DataAttribute) -> Expr {
    Expressions::Immediate(vec![
        Immediate::DestinationRegister(reg),
        Immediate::Data(data),
    ])
    .into()
}

fn verdict(code: Verdict, chain: Option<&str>) -> Expr {
    let mut v = vec![VerdictAttribute::Code(code)];
    if let Some(c) = chain {
        v.push(VerdictAttribute::Chain(c.into()));
    }
    immediate(Register::Verdict, DataAttribute::Verdict(v))
}

pub(crate) fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// A transport protocol for `meta l4proto`.
pub fn l4proto(proto: u8) -> Vec<Expr> {
    vec![meta(MetaKey::L4Proto), cmp(true, &[proto])]
}

/// `meta nfproto ipv4|ipv6`: what nft puts before address matches in an
/// `inet` table.
pub fn nfproto(v6: bool) -> Vec<Expr> {
    let p = if v6 { NFPROTO_IPV6 } else { NFPROTO_IPV4 };
    vec![meta(MetaKey::Nfproto), cmp(true, &[p])]
}

/// `th dport <port>`.
pub fn th_dport(port: u16) -> Vec<Expr> {
    vec![
        payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2),
        cmp(true, &port.to_be_bytes()),
    ]
}

/// `ip|ip6 saddr|daddr <net>` (a full-length prefix matches one address).
pub fn addr(src: bool, net: IpNetwork) -> Vec<Expr> {
    addr_cmp(src, net, true)
}

/// `ip|ip6 saddr|daddr [!=] <net>`, as nft encodes it: a whole address is
/// compared as loaded; a prefix on a byte boundary loads only its bytes; any
/// other prefix is masked.
pub fn addr_cmp(src: bool, net: IpNetwork, equal: bool) -> Vec<Expr> {
    let (s, d, len) = if net.is_ipv6() {
        (8, 24, 16)
    } else {
        (12, 16, 4)
    };
    let offset = if src { s } else { d };
    let prefix = u32::from(net.prefix());
    let bytes = ip_bytes(net.network());
    if prefix == len * 8 {
        vec![
            payload(NFT_PAYLOAD_NETWORK_HEADER, offset, len),
            cmp(equal, &bytes),
        ]
    } else if prefix > 0 && prefix % 8 == 0 {
        let n = prefix / 8;
        vec![
            payload(NFT_PAYLOAD_NETWORK_HEADER, offset, n),
            cmp(equal, &bytes[..n as usize]),
        ]
    } else {
        vec![
            payload(NFT_PAYLOAD_NETWORK_HEADER, offset, len),
            bitwise(&ip_bytes(net.mask())),
            cmp(equal, &bytes),
        ]
    }
}

/// `iifname|oifname [!=] "<name>"`.
pub fn ifname(input: bool, name: &str, equal: bool) -> Vec<Expr> {
    let mut n = [0u8; IFNAMSIZ];
    let b = name.as_bytes();
    n[..b.len().min(IFNAMSIZ - 1)].copy_from_slice(&b[..b.len().min(IFNAMSIZ - 1)]);
    let key = if input {
        MetaKey::Iifname
    } else {
        MetaKey::Oifname
    };
    vec![meta(key), cmp(equal, &n)]
}

/// `ether saddr <mac>` (in a `bridge` table, where nft adds no protocol
/// dependency before it).
pub fn ether_saddr(mac: [u8; 6]) -> Vec<Expr> {
    vec![payload(NFT_PAYLOAD_LL_HEADER, 6, 6), cmp(true, &mac)]
}

/// `fib daddr type local`.
pub fn fib_daddr_local() -> Vec<Expr> {
    vec![
        other(
            "fib",
            &[
                (NFTA_FIB_DREG, be32(1)),
                (NFTA_FIB_RESULT, be32(NFT_FIB_RESULT_ADDRTYPE)),
                (NFTA_FIB_FLAGS, be32(NFTA_FIB_F_DADDR)),
            ],
        ),
        cmp(true, &RTN_LOCAL.to_ne_bytes()),
    ]
}

fn ct_bits(key: u32, mask: u32) -> Vec<Expr> {
    vec![
        other("ct", &[(NFTA_CT_DREG, be32(1)), (NFTA_CT_KEY, be32(key))]),
        bitwise(&mask.to_ne_bytes()),
        cmp(false, &[0, 0, 0, 0]),
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
        immediate(Register::Reg1, DataAttribute::Value(ip_bytes(ip))),
        immediate(
            Register::Reg2,
            DataAttribute::Value(port.to_be_bytes().to_vec()),
        ),
        other(
            "nat",
            &[
                (NFTA_NAT_TYPE, be32(NFT_NAT_DNAT)),
                (NFTA_NAT_FAMILY, be32(family)),
                (NFTA_NAT_REG_ADDR_MIN, be32(1)),
                (NFTA_NAT_REG_PROTO_MIN, be32(2)),
                (NFTA_NAT_FLAGS, be32(NF_NAT_RANGE_PROTO_SPECIFIED)),
            ],
        ),
    ]
}

/// `snat to <ip>` (in an `ip` or `ip6` table), the port kept where it is
/// free.
pub fn snat(ip: IpAddr) -> Vec<Expr> {
    let family: u32 = if ip.is_ipv6() { 10 } else { 2 };
    vec![
        immediate(Register::Reg1, DataAttribute::Value(ip_bytes(ip))),
        other(
            "nat",
            &[
                (NFTA_NAT_TYPE, be32(NFT_NAT_SNAT)),
                (NFTA_NAT_FAMILY, be32(family)),
                (NFTA_NAT_REG_ADDR_MIN, be32(1)),
            ],
        ),
    ]
}

pub fn masquerade() -> Vec<Expr> {
    vec![other("masq", &[])]
}

pub fn accept() -> Vec<Expr> {
    vec![verdict(Verdict::Other(NF_ACCEPT), None)]
}

pub fn drop() -> Vec<Expr> {
    vec![verdict(Verdict::Other(NF_DROP), None)]
}

/// `return`.
pub fn ret() -> Vec<Expr> {
    vec![verdict(Verdict::Return, None)]
}

pub fn jump(chain: &str) -> Vec<Expr> {
    vec![verdict(Verdict::Jump, Some(chain))]
}

pub fn goto(chain: &str) -> Vec<Expr> {
    vec![verdict(Verdict::Goto, Some(chain))]
}

/// A rule's expressions in a form that compares by meaning: a load and
/// the comparison of its register become one term, so a rule reads the
/// same whoever encoded it (nft, an older nft that masks whole addresses,
/// or us), and attributes a kernel adds on listing do not count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Term {
    /// `meta <key> == / != <value>`.
    Meta {
        key: MetaKey,
        equal: bool,
        value: Vec<u8>,
    },
    /// A header field compared under a mask. The mask's trailing zero
    /// bytes are cut, so a /16 loaded as 2 bytes equals a /16 loaded as 4
    /// bytes and masked.
    Payload {
        base: u32,
        offset: u32,
        equal: bool,
        value: Vec<u8>,
        mask: Vec<u8>,
    },
    Verdict {
        code: Verdict,
        chain: Option<String>,
    },
    /// Any other expression, by name.
    Other(String),
}

/// What the register holds before a `cmp`.
enum Load {
    Meta(MetaKey),
    Payload {
        base: u32,
        offset: u32,
        mask: Vec<u8>,
    },
}

fn data_value(d: &DataAttribute) -> Option<&[u8]> {
    match d {
        DataAttribute::Value(v) => Some(v),
        _ => None,
    }
}

/// The [`Term`]s of a rule's expressions (as listed, or as built here).
pub fn terms<'a>(
    exprs: impl IntoIterator<Item = &'a ListAttribute<ExpressionAttribute>>,
) -> Vec<Term> {
    let mut out = Vec::new();
    let mut load: Option<Load> = None;
    for elem in exprs {
        let ListAttribute::Element(attrs) = elem else {
            continue;
        };
        let data = attrs.iter().find_map(|a| match a {
            ExpressionAttribute::Data(d) => Some(d),
            _ => None,
        });
        match data {
            Some(Expressions::Meta(m)) => {
                load = m.iter().find_map(|a| match a {
                    Meta::Key(k) => Some(Load::Meta(*k)),
                    _ => None,
                });
            }
            Some(Expressions::Payload(p)) => {
                let (mut base, mut offset, mut len) = (0, 0, 0);
                for a in p {
                    match a {
                        Payload::Base(v) => base = *v,
                        Payload::Offset(v) => offset = *v,
                        Payload::Len(v) => len = *v,
                        _ => {}
                    }
                }
                load = Some(Load::Payload {
                    base,
                    offset,
                    mask: vec![0xff; len as usize],
                });
            }
            Some(Expressions::Bitwise(b)) => {
                let m = b.iter().find_map(|a| match a {
                    Bitwise::Mask(d) => data_value(d),
                    _ => None,
                });
                match (&mut load, m) {
                    (Some(Load::Payload { mask, .. }), Some(m)) if m.len() == mask.len() => {
                        *mask = m.to_vec();
                    }
                    _ => {
                        out.push(Term::Other("bitwise".into()));
                        load = None;
                    }
                }
            }
            Some(Expressions::Cmp(c)) => {
                let equal = c.iter().any(|a| matches!(a, Cmp::Op(Operator::Equal)));
                let value = c
                    .iter()
                    .find_map(|a| match a {
                        Cmp::Data(d) => data_value(d),
                        _ => None,
                    })
                    .unwrap_or_default()
                    .to_vec();
                match load.take() {
                    Some(Load::Meta(key)) => out.push(Term::Meta { key, equal, value }),
                    Some(Load::Payload {
                        base,
                        offset,
                        mut mask,
                    }) => {
                        while mask.last() == Some(&0) {
                            mask.pop();
                        }
                        let value = value.iter().zip(&mask).map(|(v, m)| v & m).collect();
                        out.push(Term::Payload {
                            base,
                            offset,
                            equal,
                            value,
                            mask,
                        });
                    }
                    None => out.push(Term::Other("cmp".into())),
                }
            }
            Some(Expressions::Immediate(i)) => {
                let v = i.iter().find_map(|a| match a {
                    Immediate::Data(DataAttribute::Verdict(v)) => Some(v),
                    _ => None,
                });
                match v {
                    Some(v) => out.push(Term::Verdict {
                        code: v
                            .iter()
                            .find_map(|a| match a {
                                VerdictAttribute::Code(c) => Some(*c),
                                _ => None,
                            })
                            .unwrap_or(Verdict::Other(u32::MAX)),
                        chain: v.iter().find_map(|a| match a {
                            VerdictAttribute::Chain(c) => Some(c.clone()),
                            _ => None,
                        }),
                    }),
                    None => out.push(Term::Other("immediate".into())),
                }
                load = None;
            }
            Some(Expressions::Other {
                expression_type, ..
            }) => {
                out.push(Term::Other(expression_type.clone()));
                load = None;
            }
            _ => {
                let name = attrs.iter().find_map(|a| match a {
                    ExpressionAttribute::Name(n) => Some(n.clone()),
                    _ => None,
                });
                out.push(Term::Other(name.unwrap_or_default()));
                load = None;
            }
        }
    }
    out
}

/// The [`Term`]s of expressions built here.
pub fn terms_of(exprs: &[Expr]) -> Vec<Term> {
    terms(exprs.iter().map(|e| &e.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_core::{Emitable, Nla};

    #[test]
    fn addresses_as_nft_encodes_them() {
        // A whole address, a prefix on a byte boundary (only its bytes are
        // loaded), any other prefix (masked), as `nft --debug=netlink`.
        assert_eq!(addr(false, "10.88.0.5/32".parse().unwrap()).len(), 2);
        assert_eq!(addr(false, "fd88::5/128".parse().unwrap()).len(), 2);
        assert_eq!(addr(true, "10.88.0.0/24".parse().unwrap()).len(), 2);
        assert_eq!(addr(true, "10.88.0.0/20".parse().unwrap()).len(), 3);
        assert_eq!(addr(true, "224.0.0.0/4".parse().unwrap()).len(), 3);
        assert_eq!(addr(true, "0.0.0.0/0".parse().unwrap()).len(), 3);
        // Either encoding of a /16 reads the same.
        let nft = terms_of(&addr_cmp(false, "10.22.0.0/16".parse().unwrap(), false));
        let masked = terms_of(&[
            payload(NFT_PAYLOAD_NETWORK_HEADER, 16, 4),
            bitwise(&[255, 255, 0, 0]),
            cmp(false, &[10, 22, 0, 0]),
        ]);
        assert_eq!(nft, masked);
        assert_eq!(
            nft,
            [Term::Payload {
                base: 1,
                offset: 16,
                equal: false,
                value: vec![10, 22],
                mask: vec![255, 255]
            }]
        );
    }

    #[test]
    fn terms_of_a_rule() {
        let rule = [
            nfproto(false),
            addr(true, "10.22.0.2/32".parse().unwrap()),
            masquerade(),
            goto("masq_checks"),
        ]
        .concat();
        let t = terms_of(&rule);
        assert_eq!(t.len(), 4);
        assert!(
            matches!(&t[0], Term::Meta { key: MetaKey::Nfproto, equal: true, value } if value == &[2])
        );
        assert_eq!(t[2], Term::Other("masq".into()));
        assert_eq!(
            t[3],
            Term::Verdict {
                code: Verdict::Goto,
                chain: Some("masq_checks".into())
            }
        );
        // ct loads are not modelled: the cmp after them stays opaque.
        assert_eq!(
            terms_of(&ct_status_dnat()),
            [
                Term::Other("ct".into()),
                Term::Other("bitwise".into()),
                Term::Other("cmp".into())
            ]
        );
    }

    #[test]
    fn each_expression_is_one_list_element() {
        for e in dnat("10.88.0.5".parse().unwrap(), 80)
            .iter()
            .chain(&jump("hostports"))
            .chain(&ifname(true, "cni0", false))
            .chain(&masquerade())
            .chain(&ether_saddr([2, 0, 0, 0, 0, 1]))
        {
            let mut b = vec![0u8; e.0.buffer_len()];
            e.0.emit(&mut b);
            assert_eq!(u16::from_ne_bytes([b[0], b[1]]) as usize, b.len());
            assert_eq!(e.0.kind(), 1 | 0x8000);
        }
    }
}
