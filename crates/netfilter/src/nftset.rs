//! nf_tables sets, verdict maps and their elements, and the rule
//! expressions that look them up, as the [`NftOp`]s of one nfnetlink
//! transaction ([`crate::nfnl::Nfnl::nft_batch`]).
//!
//! The encoding is what nft 1.0.6 sends for the same text (as `nft
//! --debug=netlink` shows it, and as the kernel lists it back: the policy
//! plugin's golden test writes one table both ways and compares `nft list`).
//! Where nft's userspace does the work, so does this module:
//!
//! * an interval set holds a start element and an end element
//!   (`NFT_SET_ELEM_INTERVAL_END`, key one past the range) per range, no
//!   end element when the range ends at the top of the address space, and
//!   an end element at 0 before a first range that does not start there;
//! * a concatenated key (`ipv4_addr . inet_proto . inet_service`) pads each
//!   field to a 4-byte register; its ranges are one element with
//!   `NFTA_SET_ELEM_KEY_END`, and the set says its field lengths
//!   (`NFTA_SET_DESC_CONCAT`);
//! * sets carry nft's userdata (key byte order, the concatenation's
//!   fields), which `nft list` uses to print them as it would its own.
//!
//! The messages themselves are [`NftOp`]s (encoded with
//! netlink-packet-netfilter's types); hand-encoded here (that crate has no
//! type for them) are the byteorder expression, the field lengths inside
//! `NFTA_SET_DESC_CONCAT` and nft's userdata TLVs.

use crate::expr::Expr;
use crate::nfnl::{Hook, NftFamily, NftOp, SetElem, SetSpec};
use netlink_packet_core::{DefaultNla, Emitable, NLA_F_NESTED};
use netlink_packet_netfilter::nftables::{
    DataAttribute, ExpressionAttribute, Expressions, ListAttribute, Lookup, Meta, MetaKey, Payload,
    Register, SetAttribute, SetDescription, SetElementAttribute, SetElementFlags, SetElementList,
    SetFlags, Verdict, VerdictAttribute,
};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// A base chain's hook in an `ip`, `ip6` or `inet` table.
pub use netlink_packet_netfilter::nftables::InetHookNumber as InetHook;

use crate::nfnl::nft::c_string;

// <linux/netfilter/nf_tables.h>
const NFT_MSG_GETSET: u8 = 10;
const NFTA_SET_HANDLE: u16 = 16;
const NFT_MSG_GETSETELEM: u8 = 13;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_SET_FIELD_LEN: u16 = 1;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_SET_ELEM_FLAGS: u16 = 3;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;
const NFT_DATA_VERDICT: u32 = 0xffff_ff00;
/// `sizeof(struct nft_verdict)`: what nft gives as a verdict map's data length.
const VERDICT_LEN: u32 = 16;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
const NFT_BYTEORDER_HTON: u32 = 1;
const NFT_JUMP: i32 = -3;
const NFT_SET_ELEM_INTERVAL_END: u32 = 1;
const NFTA_SET_ELEM_EXPR: u16 = 7;
const NFTA_SET_ELEM_EXPRESSIONS: u16 = 11;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_COUNTER_PACKETS: u16 = 2;
const NFTA_DYNSET_SET_NAME: u16 = 1;
const NFTA_DYNSET_OP: u16 = 3;
const NFTA_DYNSET_SREG_KEY: u16 = 4;
const NFTA_DYNSET_EXPR: u16 = 7;
const NFT_DYNSET_OP_ADD: u32 = 0;
const NFT_DYNSET_OP_UPDATE: u32 = 1;
const NFTA_LIMIT_RATE: u16 = 1;
const NFTA_LIMIT_UNIT: u16 = 2;
const NFTA_LIMIT_BURST: u16 = 3;
const NFTA_LIMIT_TYPE: u16 = 4;
const NFTA_LIMIT_FLAGS: u16 = 5;
const NFT_LIMIT_PKTS: u32 = 0;
const NFT_LIMIT_F_INV: u32 = 1;
const NFTA_LOG_GROUP: u16 = 1;
const NFTA_LOG_PREFIX: u16 = 2;

/// `NFPROTO_INET`, the family of an `inet` table.
pub const INET: u8 = 1;

// nft's datatype numbers (`enum datatypes` in nftables' datatype.h); a
// concatenation's type is its fields' types, 6 bits each.
const TYPE_IPADDR: u32 = 7;
const TYPE_IP6ADDR: u32 = 8;
const TYPE_INET_PROTOCOL: u32 = 12;
const TYPE_INET_SERVICE: u32 = 13;
const TYPE_ICMP6_TYPE: u32 = 29;
const TYPE_BITS: u32 = 6;

// libnftnl's set userdata TLVs (`NFTNL_UDATA_SET_*`) and nft's byte orders.
const UDATA_SET_KEYBYTEORDER: u8 = 0;
const UDATA_SET_DATABYTEORDER: u8 = 1;
const UDATA_SET_KEY_TYPEOF: u8 = 3;
const UDATA_SET_DATA_INTERVAL: u8 = 6;
/// libnftnl's `NFTNL_UDATA_SET_ELEM_FLAGS` and nft's
/// `NFTNL_SET_ELEM_F_INTERVAL_OPEN`.
const UDATA_SET_ELEM_FLAGS: u8 = 1;
const SET_ELEM_F_INTERVAL_OPEN: u32 = 1;
const BYTEORDER_INVALID: u32 = 0;
const BYTEORDER_BIG_ENDIAN: u32 = 2;

/// The most attribute bytes in one message: a set's elements are split
/// over several `NFT_MSG_NEWSETELEM` messages of the same transaction.
/// Netlink attribute lengths are 16 bits, and a failing message comes back
/// whole inside its error, which must fit one read of the socket
/// (`rcni_netlink::nlsock::NlSocket`'s 64 KiB).
const MAX_MSG_ATTRS: usize = 8 * 1024;

/// One message of an nf_tables transaction, ready for
/// [`crate::nfnl::Nfnl::nft_batch`] (its attribute bytes:
/// [`NftOp::attrs`]).
pub type Msg = NftOp;

fn emit<T: netlink_packet_core::Nla>(attrs: &[T]) -> Vec<u8> {
    let mut b = vec![0u8; attrs.buffer_len()];
    attrs.emit(&mut b);
    b
}

use crate::expr::ip_bytes;

/// The address after `ip`, `None` past the top of its family.
fn next_ip(ip: IpAddr) -> Option<IpAddr> {
    match ip {
        IpAddr::V4(a) => u32::from(a)
            .checked_add(1)
            .map(|v| IpAddr::V4(Ipv4Addr::from(v))),
        IpAddr::V6(a) => u128::from(a)
            .checked_add(1)
            .map(|v| IpAddr::V6(Ipv6Addr::from(v))),
    }
}

fn zero_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

/// libnftnl's userdata TLV holding a native-endian u32.
fn udata_u32(buf: &mut Vec<u8>, ty: u8, v: u32) {
    buf.extend_from_slice(&[ty, 4]);
    buf.extend_from_slice(&v.to_ne_bytes());
}

/// What a set's keys are: nft's `type` of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    /// `ipv4_addr` (or `ipv6_addr`).
    Addr { v6: bool },
    /// `ipv4_addr . inet_proto . inet_service` (or `ipv6_addr . ...`).
    AddrProtoPort { v6: bool },
    /// A flow: `ipv4_addr . ipv4_addr . inet_proto . inet_service .
    /// inet_service` (source, destination, protocol, ports; or IPv6).
    Flow { v6: bool },
}

impl Key {
    fn addr_len(v6: bool) -> u32 {
        if v6 { 16 } else { 4 }
    }

    fn addr_type(v6: bool) -> u32 {
        if v6 { TYPE_IP6ADDR } else { TYPE_IPADDR }
    }

    fn type_id(self) -> u32 {
        match self {
            Key::Addr { v6 } => Key::addr_type(v6),
            Key::AddrProtoPort { v6 } => {
                (Key::addr_type(v6) << (2 * TYPE_BITS))
                    | (TYPE_INET_PROTOCOL << TYPE_BITS)
                    | TYPE_INET_SERVICE
            }
            Key::Flow { v6 } => {
                (Key::addr_type(v6) << (4 * TYPE_BITS))
                    | (Key::addr_type(v6) << (3 * TYPE_BITS))
                    | (TYPE_INET_PROTOCOL << (2 * TYPE_BITS))
                    | (TYPE_INET_SERVICE << TYPE_BITS)
                    | TYPE_INET_SERVICE
            }
        }
    }

    /// Key length with each field in its own 4-byte registers.
    fn len(self) -> u32 {
        match self {
            Key::Addr { v6 } => Key::addr_len(v6),
            Key::AddrProtoPort { v6 } => Key::addr_len(v6) + 4 + 4,
            Key::Flow { v6 } => 2 * Key::addr_len(v6) + 4 + 4 + 4,
        }
    }

    /// The userdata nft 1.0.6 stores with such a set (as dumped back from
    /// the kernel after `nft -f`): the key's byte order, and for the
    /// concatenation nft's description of its fields, copied verbatim.
    fn udata(self, verdict_map: bool) -> Vec<u8> {
        let mut u = Vec::new();
        match self {
            Key::Addr { .. } => udata_u32(&mut u, UDATA_SET_KEYBYTEORDER, BYTEORDER_BIG_ENDIAN),
            Key::AddrProtoPort { .. } | Key::Flow { .. } => {
                udata_u32(&mut u, UDATA_SET_KEYBYTEORDER, BYTEORDER_INVALID);
                u.extend_from_slice(&[UDATA_SET_KEY_TYPEOF, 8, 0, 4, 13, 0, 0, 0, 1, 0]);
            }
        }
        if verdict_map {
            udata_u32(&mut u, UDATA_SET_DATABYTEORDER, BYTEORDER_INVALID);
            // The data are no intervals.
            udata_u32(&mut u, UDATA_SET_DATA_INTERVAL, 0);
        }
        u
    }
}

/// One element of a set or map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Elem {
    /// The addresses `lo..=hi`: one address (`lo == hi`) in a plain set,
    /// a range in an interval set.
    Addrs(IpAddr, IpAddr),
    /// `lo-hi . proto . plo-phi` in a [`Key::AddrProtoPort`] set.
    AddrsProtoPorts {
        lo: IpAddr,
        hi: IpAddr,
        proto: u8,
        ports: (u16, u16),
    },
    /// `addr : jump chain` in a verdict map.
    Jump(IpAddr, String),
}

fn key_attr(bytes: Vec<u8>) -> SetElementAttribute {
    SetElementAttribute::Key(DataAttribute::Value(bytes))
}

fn concat_key(ip: IpAddr, proto: u8, port: u16) -> Vec<u8> {
    let mut k = ip_bytes(ip);
    k.extend_from_slice(&[proto, 0, 0, 0]);
    k.extend_from_slice(&port.to_be_bytes());
    k.extend_from_slice(&[0, 0]);
    k
}

fn interval_end(ip: IpAddr) -> ListAttribute<SetElementAttribute> {
    ListAttribute::Element(vec![
        key_attr(ip_bytes(ip)),
        SetElementAttribute::Flags(SetElementFlags::IntervalEnd),
    ])
}

impl Elem {
    /// The kernel elements of this one, in a set with `interval` ranges.
    fn encode(&self, interval: bool, out: &mut Vec<ListAttribute<SetElementAttribute>>) {
        match self {
            Elem::Addrs(lo, hi) => {
                let start = key_attr(ip_bytes(*lo));
                if !interval {
                    out.push(ListAttribute::Element(vec![start]));
                } else if let Some(end) = next_ip(*hi) {
                    out.push(ListAttribute::Element(vec![start]));
                    out.push(interval_end(end));
                } else {
                    // Nothing ends a range at the top; nft marks it open
                    // in the element's userdata (which its listing reads).
                    let mut u = Vec::new();
                    udata_u32(&mut u, UDATA_SET_ELEM_FLAGS, SET_ELEM_F_INTERVAL_OPEN);
                    out.push(ListAttribute::Element(vec![
                        start,
                        SetElementAttribute::UserData(u),
                    ]));
                }
            }
            Elem::AddrsProtoPorts {
                lo,
                hi,
                proto,
                ports,
            } => {
                let mut e = vec![key_attr(concat_key(*lo, *proto, ports.0))];
                if interval {
                    e.push(SetElementAttribute::KeyEnd(vec![DefaultNla::new(
                        NFTA_DATA_VALUE,
                        concat_key(*hi, *proto, ports.1),
                    )]));
                }
                out.push(ListAttribute::Element(e));
            }
            Elem::Jump(ip, chain) => out.push(ListAttribute::Element(vec![
                key_attr(ip_bytes(*ip)),
                SetElementAttribute::Data(DataAttribute::Verdict(vec![
                    VerdictAttribute::Code(Verdict::Jump),
                    VerdictAttribute::Chain(chain.clone()),
                ])),
            ])),
        }
    }

    /// The element's key alone, as a deletion names it.
    fn key_only(&self) -> ListAttribute<SetElementAttribute> {
        let k = match self {
            Elem::Addrs(lo, _) | Elem::Jump(lo, _) => ip_bytes(*lo),
            Elem::AddrsProtoPorts {
                lo, proto, ports, ..
            } => concat_key(*lo, *proto, ports.0),
        };
        ListAttribute::Element(vec![key_attr(k)])
    }
}

/// A set or map declaration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetDecl {
    pub key: Key,
    /// `flags interval`.
    pub interval: bool,
    /// A map to verdicts (`type <key> : verdict`).
    pub verdict_map: bool,
    /// A set the rules fill (`update @set { ... }`): `size 65535; flags
    /// dynamic,timeout; timeout <ms>`. 0: the set holds what is written.
    pub timeout_ms: u64,
}

/// How many elements a dynamic set holds: nft's default `size` for one.
const DYNAMIC_SIZE: u32 = 65535;

/// The messages of one transaction on one table.
#[derive(Debug)]
pub struct Batch {
    family: NftFamily,
    table: String,
    msgs: Vec<Msg>,
    /// `NFTA_SET_ID`s: unique within the transaction.
    next_set_id: u32,
}

impl Batch {
    /// A batch on `table` of the nfgen family `family` (`NFPROTO_*`, one
    /// of [`NftFamily`]'s; the policy plugin's is [`INET`]).
    pub fn new(family: u8, table: &str) -> Batch {
        debug_assert!(NftFamily::from_code(family).is_some(), "{family}");
        Batch {
            family: NftFamily::from_code(family).unwrap_or(NftFamily::Inet),
            table: table.to_string(),
            msgs: Vec::new(),
            next_set_id: 0,
        }
    }

    pub fn messages(&self) -> &[Msg] {
        &self.msgs
    }

    pub fn into_messages(self) -> Vec<Msg> {
        self.msgs
    }

    fn push(&mut self, op: NftOp) {
        self.msgs.push(op);
    }

    /// `add table` (no error when it exists).
    pub fn add_table(&mut self) {
        self.push(NftOp::AddTable {
            family: self.family,
            table: self.table.clone(),
            comment: None,
        });
    }

    pub fn delete_table(&mut self) {
        self.push(NftOp::DeleteTable {
            family: self.family,
            table: self.table.clone(),
        });
    }

    /// `add chain`; with `hook` (`NF_INET_*`, priority) a base chain of
    /// type filter, policy accept.
    pub fn add_chain(&mut self, name: &str, hook: Option<(InetHook, i32)>) {
        let (family, table, chain) = (self.family, self.table.clone(), name.to_string());
        self.push(match hook {
            Some((n, priority)) => NftOp::AddBaseChain {
                family,
                table,
                chain,
                hook: Hook {
                    kind: "filter",
                    hook: n.into(),
                    priority,
                },
                // NF_ACCEPT
                policy: 1,
            },
            None => NftOp::AddChain {
                family,
                table,
                chain,
                hook: None,
                comment: None,
            },
        });
    }

    /// `flush chain`: every rule of it goes.
    pub fn flush_chain(&mut self, name: &str) {
        self.push(NftOp::FlushChain {
            family: self.family,
            table: self.table.clone(),
            chain: name.to_string(),
        });
    }

    /// Refused while the chain holds rules (the caller flushes it first),
    /// never taking rules along (see [`NftOp::DeleteChain`]).
    pub fn delete_chain(&mut self, name: &str) {
        self.push(NftOp::DeleteChain {
            family: self.family,
            table: self.table.clone(),
            chain: name.to_string(),
        });
    }

    fn set_id(&mut self) -> u32 {
        self.next_set_id += 1;
        self.next_set_id
    }

    /// `add set` / `add map` (no error when it exists).
    pub fn add_set(&mut self, name: &str, d: SetDecl) {
        let mut flags = SetFlags::empty();
        if d.interval {
            flags |= SetFlags::Interval;
        }
        if d.verdict_map {
            flags |= SetFlags::Map;
        }
        if matches!(d.key, Key::AddrProtoPort { .. }) {
            flags |= SetFlags::Concat;
        }
        if d.timeout_ms > 0 {
            flags |= SetFlags::Timeout | SetFlags::Eval;
        }
        let id = self.set_id();
        let mut desc = None;
        if let Key::AddrProtoPort { v6 } = d.key {
            // One NFTA_LIST_ELEM { NFTA_SET_FIELD_LEN } per field, unpadded.
            let fields = [Key::addr_len(v6), 1, 2]
                .iter()
                .map(|len| {
                    let inner = emit(&[DefaultNla::new(
                        NFTA_SET_FIELD_LEN,
                        len.to_be_bytes().to_vec(),
                    )]);
                    DefaultNla::new(NFTA_LIST_ELEM | NLA_F_NESTED, inner)
                })
                .collect();
            desc = Some(SetDescription::Concat(fields));
        }
        if d.timeout_ms > 0 {
            desc = Some(SetDescription::Size(DYNAMIC_SIZE));
        }
        self.push(NftOp::AddSet {
            family: self.family,
            table: self.table.clone(),
            set: name.to_string(),
            spec: SetSpec {
                flags,
                key_type: d.key.type_id(),
                key_len: d.key.len(),
                data: d.verdict_map.then_some((NFT_DATA_VERDICT, VERDICT_LEN)),
                id,
                desc,
                timeout_ms: (d.timeout_ms > 0).then_some(d.timeout_ms),
                userdata: d.key.udata(d.verdict_map),
            },
        });
    }

    /// `flush set`: every element goes.
    pub fn flush_set(&mut self, name: &str) {
        self.push(NftOp::FlushSet {
            family: self.family,
            table: self.table.clone(),
            set: name.to_string(),
        });
    }

    pub fn delete_set(&mut self, name: &str) {
        self.push(NftOp::DeleteSet {
            family: self.family,
            table: self.table.clone(),
            set: name.to_string(),
        });
    }

    /// The elements in messages of at most [`MAX_MSG_ATTRS`] bytes each:
    /// added (`add`), or else deleted.
    fn elements(
        &mut self,
        add: bool,
        set: &str,
        set_id: Option<u32>,
        elems: Vec<ListAttribute<SetElementAttribute>>,
    ) {
        let mut head = vec![
            SetElementList::Table(self.table.clone()),
            SetElementList::Set(set.to_string()),
        ];
        if let Some(id) = set_id {
            head.push(SetElementList::SetId(id));
        }
        let room = MAX_MSG_ATTRS - head.as_slice().buffer_len() - 4;
        let mut chunk = Vec::new();
        let mut size = 0;
        let flush = |chunk: &mut Vec<SetElem>, b: &mut Batch| {
            let (family, table, set) = (b.family, b.table.clone(), set.to_string());
            let elements = std::mem::take(chunk);
            b.push(if add {
                NftOp::AddElements {
                    family,
                    table,
                    set,
                    set_id,
                    elements,
                }
            } else {
                NftOp::DeleteElements {
                    family,
                    table,
                    set,
                    elements,
                }
            });
        };
        for e in elems {
            let n = e.buffer_len();
            if size + n > room && !chunk.is_empty() {
                flush(&mut chunk, self);
                size = 0;
            }
            size += n;
            chunk.push(SetElem(e));
        }
        if !chunk.is_empty() {
            flush(&mut chunk, self);
        }
    }

    /// `add element`: `elems` into `set`, declared as `d`. For an interval
    /// set of addresses, the elements must be disjoint ranges.
    pub fn add_elements(&mut self, set: &str, d: SetDecl, elems: &[Elem]) {
        if elems.is_empty() {
            return;
        }
        let mut out = Vec::with_capacity(elems.len() * 2 + 1);
        if d.interval && matches!(d.key, Key::Addr { .. }) {
            // As nft: what lies below the first range is an interval that
            // does not match.
            let first = elems
                .iter()
                .filter_map(|e| match e {
                    Elem::Addrs(lo, _) => Some(*lo),
                    _ => None,
                })
                .min();
            if let Some(lo) = first
                && lo != zero_of(lo)
            {
                out.push(interval_end(zero_of(lo)));
            }
        }
        for e in elems {
            e.encode(d.interval, &mut out);
        }
        self.elements(true, set, None, out);
    }

    /// `delete element` by key, in a set without intervals.
    pub fn delete_elements(&mut self, set: &str, elems: &[Elem]) {
        if elems.is_empty() {
            return;
        }
        let out = elems.iter().map(Elem::key_only).collect();
        self.elements(false, set, None, out);
    }

    /// `add rule` (appended) with the expressions `exprs` (see [`Exprs`])
    /// and an optional comment.
    pub fn add_rule(&mut self, chain: &str, exprs: Exprs, comment: Option<&str>) {
        self.push(NftOp::AddRule {
            family: self.family,
            table: self.table.clone(),
            chain: chain.to_string(),
            expr: exprs.0,
            comment: comment.map(str::to_string),
            insert: false,
        });
    }

    /// An anonymous constant set of ICMPv6 types (`icmpv6 type { ... }`),
    /// declared and filled in this transaction; the match on it.
    pub fn icmpv6_types(&mut self, types: &[u8]) -> Exprs {
        let id = self.set_id();
        let name = "__set%d";
        // nft's userdata for a set made from `icmpv6 type`, verbatim: the
        // key's byte order and the expression it came from.
        let mut u = Vec::new();
        udata_u32(&mut u, UDATA_SET_KEYBYTEORDER, BYTEORDER_BIG_ENDIAN);
        u.extend_from_slice(&[
            UDATA_SET_KEY_TYPEOF,
            20,
            0,
            4,
            7,
            0,
            0,
            0,
            1,
            12,
            0,
            4,
            14,
            0,
            0,
            0,
            1,
            4,
            1,
            0,
            0,
            0,
        ]);
        self.push(NftOp::AddSet {
            family: self.family,
            table: self.table.clone(),
            set: name.to_string(),
            spec: SetSpec {
                flags: SetFlags::Anonymous | SetFlags::Constant,
                key_type: TYPE_ICMP6_TYPE,
                key_len: 1,
                data: None,
                id,
                desc: Some(SetDescription::Size(types.len() as u32)),
                timeout_ms: None,
                userdata: u,
            },
        });
        let elems = types
            .iter()
            .map(|t| ListAttribute::Element(vec![key_attr(vec![*t])]))
            .collect();
        self.elements(true, name, Some(id), elems);
        let mut e = Exprs::new();
        e.nftexpr(&crate::expr::nfproto(true));
        e.nftexpr(&crate::expr::l4proto(58));
        e.payload(NFT_PAYLOAD_TRANSPORT_HEADER, 0, 1, Register::Reg1);
        e.push(Expressions::Lookup(vec![
            Lookup::Set(name.to_string()),
            Lookup::SourceRegister(Register::Reg1),
            Lookup::SetId(id),
        ]));
        e
    }
}

/// The key of a dynamic set's element, from the packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DynKey {
    /// `ip|ip6 saddr|daddr` ([`Key::Addr`]).
    Addr { v6: bool, src: bool },
    /// `ip saddr . ip daddr . meta l4proto . th sport . th dport` (or
    /// `ip6`; [`Key::Flow`]). For ICMP the "ports" are type, code and
    /// checksum.
    Flow { v6: bool },
}

/// What each element of a dynamic set keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stateful {
    /// `limit rate over <rate>/<unit> burst <burst> packets`: matches once
    /// the element's tokens are spent.
    LimitOver {
        rate: u64,
        unit_secs: u64,
        burst: u32,
    },
    /// `counter`: packets and bytes (read back with [`parse_counters`]).
    Counter,
}

impl Stateful {
    fn attrs(self) -> (&'static str, Vec<DefaultNla>) {
        match self {
            Stateful::LimitOver {
                rate,
                unit_secs,
                burst,
            } => (
                "limit",
                vec![
                    DefaultNla::new(NFTA_LIMIT_RATE, rate.to_be_bytes().to_vec()),
                    DefaultNla::new(NFTA_LIMIT_UNIT, unit_secs.to_be_bytes().to_vec()),
                    DefaultNla::new(NFTA_LIMIT_BURST, be32(burst)),
                    DefaultNla::new(NFTA_LIMIT_TYPE, be32(NFT_LIMIT_PKTS)),
                    DefaultNla::new(NFTA_LIMIT_FLAGS, be32(NFT_LIMIT_F_INV)),
                ],
            ),
            Stateful::Counter => ("counter", Vec::new()),
        }
    }
}

fn be32(v: u32) -> Vec<u8> {
    v.to_be_bytes().to_vec()
}

fn c_str(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

/// A rule's expressions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exprs(Vec<Expr>);

impl Exprs {
    pub fn new() -> Exprs {
        Exprs::default()
    }

    fn push(&mut self, e: Expressions) {
        self.0.push(Expr::from(e));
    }

    /// Appends expressions of [`crate::expr`].
    pub fn nftexpr(&mut self, e: &[Expr]) -> &mut Exprs {
        self.0.extend_from_slice(e);
        self
    }

    fn payload(&mut self, base: u32, offset: u32, len: u32, reg: Register) {
        self.push(Expressions::Payload(vec![
            Payload::DestinationRegister(reg),
            Payload::Base(base),
            Payload::Offset(offset),
            Payload::Len(len),
        ]));
    }

    /// Loads the source (or destination) address into register 1, after
    /// `meta nfproto` (an `inet` table sees both families).
    fn addr(&mut self, v6: bool, src: bool) {
        self.nftexpr(&crate::expr::nfproto(v6));
        let (s, d, len) = if v6 { (8, 24, 16) } else { (12, 16, 4) };
        self.payload(
            NFT_PAYLOAD_NETWORK_HEADER,
            if src { s } else { d },
            len,
            Register::Reg1,
        );
    }

    /// `ip|ip6 saddr|daddr . meta l4proto . th dport` into registers, as
    /// nft lays the concatenation out: each field in the 4-byte registers
    /// after the previous one.
    fn addr_proto_port(&mut self, v6: bool, src: bool) {
        self.addr(v6, src);
        // nft names a 16-byte register when the field starts on one.
        let (proto, port) = if v6 {
            (Register::Reg2, Register::Reg32_05)
        } else {
            (Register::Reg32_01, Register::Reg32_02)
        };
        self.push(Expressions::Meta(vec![
            Meta::Key(MetaKey::L4Proto),
            Meta::DestinationRegister(proto),
        ]));
        // nft 1.0.6 converts the 1-byte protocol as a 2-byte field (a
        // no-op the kernel accepts); kept so the rule reads back the same.
        let r: u32 = proto.into();
        self.push(Expressions::Other {
            expression_type: "byteorder".into(),
            attributes: [(1u16, r), (2, r), (3, NFT_BYTEORDER_HTON), (4, 1), (5, 2)]
                .iter()
                .map(|(t, v)| DefaultNla::new(*t, v.to_be_bytes().to_vec()))
                .collect(),
        });
        self.payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2, port);
    }

    /// `ip|ip6 saddr|daddr @set` (`ports`: `... . meta l4proto . th dport
    /// @set`).
    pub fn in_set(&mut self, v6: bool, src: bool, ports: bool, set: &str) -> &mut Exprs {
        if ports {
            self.addr_proto_port(v6, src);
        } else {
            self.addr(v6, src);
        }
        self.push(Expressions::Lookup(vec![
            Lookup::Set(set.to_string()),
            Lookup::SourceRegister(Register::Reg1),
        ]));
        self
    }

    /// `ip|ip6 saddr|daddr vmap @map`.
    pub fn vmap(&mut self, v6: bool, src: bool, map: &str) -> &mut Exprs {
        self.addr(v6, src);
        self.push(Expressions::Lookup(vec![
            Lookup::Set(map.to_string()),
            Lookup::SourceRegister(Register::Reg1),
            Lookup::DestinationRegister(Register::Verdict),
        ]));
        self
    }

    /// Loads `k` into the registers from 1 as nft lays it out; `meta
    /// nfproto` first only at the start of a rule (nft checks the family
    /// once per rule).
    fn load(&mut self, k: DynKey) {
        let dep = self.0.is_empty();
        let (v6, src) = match k {
            DynKey::Addr { v6, src } => (v6, src),
            DynKey::Flow { v6 } => (v6, true),
        };
        if dep {
            self.nftexpr(&crate::expr::nfproto(v6));
        }
        let (s, d, len) = if v6 { (8, 24, 16) } else { (12, 16, 4) };
        if let DynKey::Addr { .. } = k {
            let off = if src { s } else { d };
            self.payload(NFT_PAYLOAD_NETWORK_HEADER, off, len, Register::Reg1);
            return;
        }
        // Each field in the 4-byte registers after the previous one.
        let (daddr, proto, sport, dport) = if v6 {
            (
                Register::Reg2,
                Register::Reg3,
                Register::Reg32_09,
                Register::Reg32_10,
            )
        } else {
            (
                Register::Reg32_01,
                Register::Reg32_02,
                Register::Reg32_03,
                Register::Reg2,
            )
        };
        self.payload(NFT_PAYLOAD_NETWORK_HEADER, s, len, Register::Reg1);
        self.payload(NFT_PAYLOAD_NETWORK_HEADER, d, len, daddr);
        self.push(Expressions::Meta(vec![
            Meta::Key(MetaKey::L4Proto),
            Meta::DestinationRegister(proto),
        ]));
        self.payload(NFT_PAYLOAD_TRANSPORT_HEADER, 0, 2, sport);
        self.payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2, dport);
    }

    /// `update @set { <key> <stateful> }`: the element of the packet's
    /// key (added when missing, with the set's timeout, which each update
    /// renews) runs its own copy of `stateful`; the rule goes on only when
    /// that matches.
    pub fn update(&mut self, key: DynKey, set: &str, stateful: Stateful) -> &mut Exprs {
        self.load(key);
        let (name, data) = stateful.attrs();
        let inner = emit(&[
            ExpressionAttribute::Name(name.to_string()),
            ExpressionAttribute::Data(Expressions::Other {
                expression_type: name.to_string(),
                attributes: data,
            }),
        ]);
        self.dynset(NFT_DYNSET_OP_UPDATE, set, Some(inner));
        self
    }

    /// `add @set { <key> }`: the packet's key into the set (with the set's
    /// timeout, not renewed if it is there).
    pub fn add(&mut self, key: DynKey, set: &str) -> &mut Exprs {
        self.load(key);
        self.dynset(NFT_DYNSET_OP_ADD, set, None);
        self
    }

    /// `<key> @set`: the packet's key is in the set.
    pub fn lookup(&mut self, key: DynKey, set: &str) -> &mut Exprs {
        self.load(key);
        self.push(Expressions::Lookup(vec![
            Lookup::Set(set.to_string()),
            Lookup::SourceRegister(Register::Reg1),
        ]));
        self
    }

    fn dynset(&mut self, op: u32, set: &str, expr: Option<Vec<u8>>) {
        let mut a = vec![
            DefaultNla::new(NFTA_DYNSET_SREG_KEY, be32(Register::Reg1.into())),
            DefaultNla::new(NFTA_DYNSET_OP, be32(op)),
            DefaultNla::new(NFTA_DYNSET_SET_NAME, c_str(set)),
        ];
        if let Some(e) = expr {
            a.push(DefaultNla::new(NFTA_DYNSET_EXPR | NLA_F_NESTED, e));
        }
        self.push(Expressions::Other {
            expression_type: "dynset".into(),
            attributes: a,
        });
    }

    /// `log prefix "<prefix>" group <group>`: the packet to NFLOG group
    /// `group` (nfnetlink_log), tagged `prefix`.
    pub fn log(&mut self, prefix: &str, group: u16) -> &mut Exprs {
        self.push(Expressions::Other {
            expression_type: "log".into(),
            attributes: vec![
                DefaultNla::new(NFTA_LOG_PREFIX, c_str(prefix)),
                DefaultNla::new(NFTA_LOG_GROUP, group.to_be_bytes().to_vec()),
            ],
        });
        self
    }

    /// The `drop` verdict.
    pub fn drop(&mut self) -> &mut Exprs {
        self.nftexpr(&crate::expr::drop())
    }

    /// `goto <chain>`.
    pub fn goto(&mut self, chain: &str) -> &mut Exprs {
        self.nftexpr(&crate::expr::goto(chain))
    }

    /// The `return` verdict.
    pub fn ret(&mut self) -> &mut Exprs {
        self.nftexpr(&crate::expr::ret())
    }

    pub fn take(&mut self) -> Exprs {
        std::mem::take(self)
    }
}

impl crate::nfnl::Nfnl {
    /// Sends messages built by a [`Batch`] (sets, elements and the rules
    /// using them, for the policy plugin) as one nf_tables transaction,
    /// through the same writer as [`crate::nfnl::Nfnl::nft_apply`].
    pub fn nft_batch(&mut self, msgs: &[Msg]) -> rcni_netlink::Result<()> {
        let what = format!("nftables transaction of {} messages", msgs.len());
        self.transaction(&what, msgs.iter().map(NftOp::encode))
    }
}

// ---- reading back ------------------------------------------------------

use crate::nfnl::{attr as nla, attrs as nlas};

/// The `NFT_MSG_GETSET` dump request for the sets of `table`.
pub fn sets_request(table: &str) -> (u8, Vec<u8>) {
    (
        NFT_MSG_GETSET,
        emit(&[SetAttribute::Table(table.to_string())]),
    )
}

/// The attributes of a dumped set but its handle (which differs between
/// two tables written alike): to compare how two writers declared a set.
pub fn set_attrs_but_handle(attrs: &[u8]) -> Vec<(u16, Vec<u8>)> {
    nlas(attrs)
        .filter(|(t, _)| *t != NFTA_SET_HANDLE)
        .map(|(t, v)| (t, v.to_vec()))
        .collect()
}

/// The `NFT_MSG_GETSETELEM` dump request for the elements of `set`.
pub fn elements_request(table: &str, set: &str) -> (u8, Vec<u8>) {
    (
        NFT_MSG_GETSETELEM,
        emit(&[
            SetElementList::Table(table.to_string()),
            SetElementList::Set(set.to_string()),
        ]),
    )
}

/// The `address -> jump chain` elements of one dumped message of a
/// verdict map (others are skipped).
pub fn parse_jumps(attrs: &[u8]) -> Vec<(IpAddr, String)> {
    let mut out = Vec::new();
    if nla(attrs, NFTA_SET_ELEM_LIST_TABLE).is_none()
        || nla(attrs, NFTA_SET_ELEM_LIST_SET).is_none()
    {
        return out;
    }
    let Some(list) = nla(attrs, NFTA_SET_ELEM_LIST_ELEMENTS) else {
        return out;
    };
    for (_, e) in nlas(list).filter(|(t, _)| *t == NFTA_LIST_ELEM) {
        let flags = nla(e, NFTA_SET_ELEM_FLAGS)
            .and_then(|v| Some(u32::from_be_bytes(v.try_into().ok()?)))
            .unwrap_or(0);
        if flags & NFT_SET_ELEM_INTERVAL_END != 0 {
            continue;
        }
        let key = nla(e, NFTA_SET_ELEM_KEY).and_then(|k| nla(k, NFTA_DATA_VALUE));
        let ip = match key.map(<[u8]>::len) {
            Some(4) => <[u8; 4]>::try_from(key.unwrap_or_default())
                .ok()
                .map(IpAddr::from),
            Some(16) => <[u8; 16]>::try_from(key.unwrap_or_default())
                .ok()
                .map(IpAddr::from),
            _ => None,
        };
        let verdict = nla(e, NFTA_SET_ELEM_DATA).and_then(|d| nla(d, NFTA_DATA_VERDICT));
        let code = verdict
            .and_then(|v| nla(v, NFTA_VERDICT_CODE))
            .and_then(|c| Some(i32::from_be_bytes(c.try_into().ok()?)));
        let chain = verdict
            .and_then(|v| nla(v, NFTA_VERDICT_CHAIN))
            .map(c_string);
        if let (Some(ip), Some(NFT_JUMP), Some(chain)) = (ip, code, chain) {
            out.push((ip, chain));
        }
    }
    out
}

fn ip_of(key: &[u8]) -> Option<IpAddr> {
    match key.len() {
        4 => <[u8; 4]>::try_from(key).ok().map(IpAddr::from),
        16 => <[u8; 16]>::try_from(key).ok().map(IpAddr::from),
        _ => None,
    }
}

/// The packets counted by the `counter` of each element of one dumped
/// message of an address set filled by `update @set { ... counter }`.
pub fn parse_counters(attrs: &[u8]) -> Vec<(IpAddr, u64)> {
    let mut out = Vec::new();
    let Some(list) = nla(attrs, NFTA_SET_ELEM_LIST_ELEMENTS) else {
        return out;
    };
    let packets = |expr: &[u8]| -> Option<u64> {
        if nla(expr, NFTA_EXPR_NAME).map(c_string).as_deref() != Some("counter") {
            return None;
        }
        let v = nla(nla(expr, NFTA_EXPR_DATA)?, NFTA_COUNTER_PACKETS)?;
        Some(u64::from_be_bytes(v.try_into().ok()?))
    };
    for (_, e) in nlas(list).filter(|(t, _)| *t == NFTA_LIST_ELEM) {
        let Some(ip) = nla(e, NFTA_SET_ELEM_KEY)
            .and_then(|k| nla(k, NFTA_DATA_VALUE))
            .and_then(ip_of)
        else {
            continue;
        };
        // One expression is dumped alone, several as a list.
        let n = nla(e, NFTA_SET_ELEM_EXPR).and_then(packets).or_else(|| {
            nlas(nla(e, NFTA_SET_ELEM_EXPRESSIONS)?)
                .filter(|(t, _)| *t == NFTA_LIST_ELEM)
                .find_map(|(_, x)| packets(x))
        });
        if let Some(n) = n {
            out.push((ip, n));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concatenated_keys_pad_each_field_to_four_bytes() {
        let k = concat_key("10.0.0.3".parse().unwrap(), 6, 8080);
        assert_eq!(k, [10, 0, 0, 3, 6, 0, 0, 0, 0x1f, 0x90, 0, 0]);
        assert_eq!(Key::AddrProtoPort { v6: false }.len(), 12);
        assert_eq!(Key::AddrProtoPort { v6: true }.len(), 24);
        // As `nft --debug=netlink` names them.
        assert_eq!(Key::AddrProtoPort { v6: false }.type_id(), 0x730d);
        assert_eq!(Key::AddrProtoPort { v6: true }.type_id(), 0x830d);
        assert_eq!(Key::Flow { v6: false }.type_id(), 0x071c_c34d);
        assert_eq!(Key::Flow { v6: true }.type_id(), 0x0820_c34d);
        assert_eq!(Key::Flow { v6: false }.len(), 20);
        assert_eq!(Key::Flow { v6: true }.len(), 44);
    }

    #[test]
    fn interval_elements_start_end_and_the_zero_end() {
        let d = SetDecl {
            key: Key::Addr { v6: false },
            interval: true,
            verdict_map: false,
            timeout_ms: 0,
        };
        let mut b = Batch::new(INET, "T");
        b.add_elements(
            "s",
            d,
            &[Elem::Addrs(
                "192.168.2.0".parse().unwrap(),
                "255.255.255.255".parse().unwrap(),
            )],
        );
        let m = &b.messages()[0];
        let attrs = m.attrs();
        let list = nla(&attrs, NFTA_SET_ELEM_LIST_ELEMENTS).unwrap();
        let elems: Vec<(Vec<u8>, u32)> = nlas(list)
            .map(|(_, e)| {
                let k = nla(nla(e, NFTA_SET_ELEM_KEY).unwrap(), NFTA_DATA_VALUE).unwrap();
                let f = nla(e, NFTA_SET_ELEM_FLAGS)
                    .map(|v| u32::from_be_bytes(v.try_into().unwrap()))
                    .unwrap_or(0);
                (k.to_vec(), f)
            })
            .collect();
        // 0.0.0.0 ends a non-matching interval; the range reaches the top,
        // so it has no end element.
        assert_eq!(
            elems,
            vec![(vec![0, 0, 0, 0], 1), (vec![192, 168, 2, 0], 0)]
        );
    }

    #[test]
    fn big_sets_are_split_into_messages_that_fit() {
        let d = SetDecl {
            key: Key::Addr { v6: true },
            interval: true,
            verdict_map: false,
            timeout_ms: 0,
        };
        let elems: Vec<Elem> = (0..5000u128)
            .map(|i| {
                let a = IpAddr::V6(Ipv6Addr::from((0xfd00u128 << 112) + (i << 16)));
                let z = IpAddr::V6(Ipv6Addr::from((0xfd00u128 << 112) + (i << 16) + 0xff));
                Elem::Addrs(a, z)
            })
            .collect();
        let mut b = Batch::new(INET, "T");
        b.add_elements("s", d, &elems);
        assert!(b.messages().len() > 10);
        let mut n = 0;
        for m in b.messages() {
            assert!(m.attrs().len() <= MAX_MSG_ATTRS);
            n += nlas(nla(&m.attrs(), NFTA_SET_ELEM_LIST_ELEMENTS).unwrap()).count();
        }
        assert_eq!(n, 1 + 2 * 5000);
    }

    #[test]
    fn jumps_read_back() {
        let mut b = Batch::new(INET, "T");
        let d = SetDecl {
            key: Key::Addr { v6: false },
            interval: false,
            verdict_map: true,
            timeout_ms: 0,
        };
        b.add_elements(
            "m",
            d,
            &[Elem::Jump("10.0.0.2".parse().unwrap(), "in_3".into())],
        );
        assert_eq!(
            parse_jumps(&b.messages()[0].attrs()),
            vec![("10.0.0.2".parse().unwrap(), "in_3".to_string())]
        );
    }
}

#[cfg(test)]
mod wire {
    //! The bytes on the wire, compared with what the two builders (this
    //! module's `Batch` and `NftOp`) sent before they became one: the
    //! fixture was captured from that code (commit 39575aa).
    use super::*;
    use crate::nfnl::{Hook as H, NftFamily, NftOp};

    fn representative() -> Batch {
        let v4 = |s: &str| -> IpAddr { s.parse().unwrap() };
        let mut b = Batch::new(INET, "rcni_policy");
        b.add_table();
        b.add_chain("forward", Some((InetHook::Forward, 0)));
        b.add_chain("in_3", None);
        let iv = SetDecl {
            key: Key::Addr { v6: false },
            interval: true,
            verdict_map: false,
            timeout_ms: 0,
        };
        let iv6 = SetDecl {
            key: Key::Addr { v6: true },
            interval: true,
            verdict_map: false,
            timeout_ms: 0,
        };
        let plain = SetDecl {
            key: Key::Addr { v6: false },
            interval: false,
            verdict_map: false,
            timeout_ms: 0,
        };
        let cc = SetDecl {
            key: Key::AddrProtoPort { v6: false },
            interval: true,
            verdict_map: false,
            timeout_ms: 0,
        };
        let cc6 = SetDecl {
            key: Key::AddrProtoPort { v6: true },
            interval: true,
            verdict_map: false,
            timeout_ms: 0,
        };
        let vm = SetDecl {
            key: Key::Addr { v6: false },
            interval: false,
            verdict_map: true,
            timeout_ms: 0,
        };
        let vm6 = SetDecl {
            key: Key::Addr { v6: true },
            interval: false,
            verdict_map: true,
            timeout_ms: 0,
        };
        b.add_set("ranges", iv);
        b.add_set("ranges6", iv6);
        b.add_set("plain", plain);
        b.add_set("ports", cc);
        b.add_set("ports6", cc6);
        b.add_set("vm", vm);
        b.add_set("vm6", vm6);
        b.add_elements(
            "ranges",
            iv,
            &[
                Elem::Addrs(v4("10.0.0.0"), v4("10.0.0.255")),
                Elem::Addrs(v4("10.1.2.3"), v4("10.1.2.3")),
                Elem::Addrs(v4("192.168.0.0"), v4("255.255.255.255")),
            ],
        );
        b.add_elements(
            "ranges6",
            iv6,
            &[
                Elem::Addrs(v4("::"), v4("fd00::ffff")),
                Elem::Addrs(v4("fe80::"), v4("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff")),
            ],
        );
        b.add_elements(
            "plain",
            plain,
            &[Elem::Addrs(v4("10.0.0.2"), v4("10.0.0.2"))],
        );
        b.add_elements(
            "ports",
            cc,
            &[
                Elem::AddrsProtoPorts {
                    lo: v4("10.0.0.0"),
                    hi: v4("10.0.0.255"),
                    proto: 6,
                    ports: (80, 80),
                },
                Elem::AddrsProtoPorts {
                    lo: v4("0.0.0.0"),
                    hi: v4("255.255.255.255"),
                    proto: 17,
                    ports: (1000, 2000),
                },
            ],
        );
        b.add_elements(
            "ports6",
            cc6,
            &[Elem::AddrsProtoPorts {
                lo: v4("fd00::1"),
                hi: v4("fd00::ff"),
                proto: 132,
                ports: (0, 65535),
            }],
        );
        b.add_elements(
            "vm",
            vm,
            &[
                Elem::Jump(v4("10.0.0.2"), "in_3".into()),
                Elem::Jump(v4("10.0.0.3"), "in_4".into()),
            ],
        );
        b.add_elements("vm6", vm6, &[Elem::Jump(v4("fd00::2"), "in_3".into())]);
        b.delete_elements("vm", &[Elem::Jump(v4("10.0.0.3"), "in_4".into())]);
        b.delete_elements("plain", &[Elem::Addrs(v4("10.0.0.2"), v4("10.0.0.2"))]);
        let mut e = Exprs::new();
        e.in_set(false, true, false, "ranges").ret();
        b.add_rule("in_3", e.take(), Some("a comment"));
        e.in_set(true, false, true, "ports6");
        b.add_rule("in_3", e.take(), None);
        e.vmap(false, false, "vm");
        b.add_rule("forward", e.take(), None);
        e.vmap(true, true, "vm6");
        b.add_rule("forward", e.take(), Some("v6"));
        let icmp = b.icmpv6_types(&[1, 2, 3, 4, 128, 129, 133, 134, 135, 136]);
        let mut x = icmp;
        x.ret();
        b.add_rule("in_3", x, None);
        e.nftexpr(&crate::expr::accept());
        b.add_rule("in_3", e.take(), None);
        b.flush_set("plain");
        b.delete_set("plain");
        b.flush_chain("in_3");
        b.delete_chain("in_3");
        b.delete_table();
        b
    }

    fn ops() -> Vec<NftOp> {
        let t = || "t".to_string();
        vec![
            NftOp::AddTable {
                family: NftFamily::Inet,
                table: t(),
                comment: Some("c".into()),
            },
            NftOp::AddTable {
                family: NftFamily::Ip,
                table: t(),
                comment: None,
            },
            NftOp::AddChain {
                family: NftFamily::Ip6,
                table: t(),
                chain: "pre".into(),
                hook: Some(H {
                    kind: "nat",
                    hook: H::PREROUTING,
                    priority: -100,
                }),
                comment: Some("cc".into()),
            },
            NftOp::AddChain {
                family: NftFamily::Bridge,
                table: t(),
                chain: "x".into(),
                hook: None,
                comment: None,
            },
            NftOp::AddRule {
                family: NftFamily::Inet,
                table: t(),
                chain: "x".into(),
                expr: [crate::expr::nfproto(false), crate::expr::masquerade()].concat(),
                comment: Some("r".into()),
                insert: false,
            },
            NftOp::AddRule {
                family: NftFamily::Ip,
                table: t(),
                chain: "x".into(),
                expr: crate::expr::drop(),
                comment: None,
                insert: true,
            },
            NftOp::FlushChain {
                family: NftFamily::Ip,
                table: t(),
                chain: "x".into(),
            },
            NftOp::DeleteRule {
                family: NftFamily::Ip,
                table: t(),
                chain: "x".into(),
                handle: 42,
            },
            NftOp::DeleteChain {
                family: NftFamily::Ip,
                table: t(),
                chain: "x".into(),
            },
            NftOp::DeleteTable {
                family: NftFamily::Ip,
                table: t(),
            },
        ]
    }

    /// `type flags family attributes`, one message a line.
    fn line(op: &NftOp) -> String {
        let (ty, flags, family, attrs) = op.encode();
        let hex: String = attrs.iter().map(|b| format!("{b:02x}")).collect();
        format!("{ty:04x} {flags:04x} {family} {hex}")
    }

    #[test]
    fn messages_are_byte_identical_to_the_fixture() {
        let want: Vec<&str> = include_str!("nfnl/testdata/nft-messages.hex")
            .lines()
            .collect();
        let got: Vec<String> = representative()
            .messages()
            .iter()
            .chain(&ops())
            .map(line)
            .collect();
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "message {i}");
        }
    }
}
