//! nf_tables over [`Nfnl`]: listing tables, chains and rules, and writing
//! them in all-or-nothing transactions ([`Nfnl::nft_apply`]).
//!
//! Messages are encoded and decoded with netlink-packet-netfilter's types
//! (tables, chains, rules, sets and the common expressions); only the
//! expressions it lacks are hand-encoded (see [`crate::expr`]).

use super::{Dumped, NLM_F_ACK, NLM_F_REQUEST, Nfnl, io_err};
use crate::expr::{Expr, Term, terms};
use netlink_packet_core::{DefaultNla, Emitable, Nla, Parseable};
use netlink_packet_netfilter::nftables::{
    ChainAttribute, ChainMessage, ExpressionAttribute, Expressions, Hook as NlHook, HookNumber,
    Immediate, ListAttribute, NfTablesMessage, RuleAttribute, RuleMessage, SetAttribute,
    SetDescription, SetElementAttribute, SetElementList, SetElementMessage, SetFlags, SetMessage,
    TableAttribute, TableMessage, Verdict, VerdictAttribute,
};
use rcni_netlink::Result;
use rcni_netns::NetNs;
use std::net::IpAddr;

// <linux/netlink.h>
pub(crate) const NLM_F_CREATE: u16 = 0x400;
pub(crate) const NLM_F_APPEND: u16 = 0x800;
/// "Do not delete recursively": without it the kernel (since 5.x) deletes
/// a chain together with its rules, including rules another process
/// committed after the listing a deletion was planned from.
pub(crate) const NLM_F_NONREC: u16 = 0x100;
// <linux/netfilter/nfnetlink.h>
pub(crate) const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
// <linux/netfilter.h>
const NF_DROP: u32 = 0;
/// libnftnl's `NFTNL_UDATA_{TABLE,CHAIN,RULE}_COMMENT`: the comment TLV in
/// an object's userdata.
const UDATA_COMMENT: u8 = 0;
/// xt's `target` expression: its name attribute (iptables-nft's `-j X`).
const NFTA_TARGET_NAME: u16 = 1;

/// An nf_tables family (`nfgenmsg.nfgen_family`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NftFamily {
    Inet,
    Ip,
    Ip6,
    Bridge,
}

impl NftFamily {
    pub(super) fn code(self) -> u8 {
        match self {
            NftFamily::Inet => 1,
            NftFamily::Ip => 2,
            NftFamily::Bridge => 7,
            NftFamily::Ip6 => 10,
        }
    }

    pub(crate) fn from_code(c: u8) -> Option<NftFamily> {
        Some(match c {
            1 => NftFamily::Inet,
            2 => NftFamily::Ip,
            7 => NftFamily::Bridge,
            10 => NftFamily::Ip6,
            _ => return None,
        })
    }

    /// The name nft uses (`ip`, `ip6`, `inet`, `bridge`).
    pub fn as_str(self) -> &'static str {
        match self {
            NftFamily::Inet => "inet",
            NftFamily::Ip => "ip",
            NftFamily::Ip6 => "ip6",
            NftFamily::Bridge => "bridge",
        }
    }

    /// The IP family of an address: `ip` or `ip6`.
    pub fn of(ip: &IpAddr) -> NftFamily {
        if ip.is_ipv4() {
            NftFamily::Ip
        } else {
            NftFamily::Ip6
        }
    }
}

impl std::fmt::Display for NftFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A listed rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftRule {
    pub chain: String,
    pub handle: u64,
    /// The rule's `comment "..."`, if any.
    pub comment: Option<String>,
    /// What the rule does, comparable with [`crate::expr::terms_of`].
    pub terms: Vec<Term>,
}

/// A listed chain; `base` is true for chains attached to a hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftChain {
    pub name: String,
    pub base: bool,
    /// A base chain's type (`filter`, `nat`) and hook number (`NF_INET_*`).
    pub hook: Option<(String, u32)>,
    pub comment: Option<String>,
}

/// Linux's default socket buffer size (`net.core.[rw]mem_default`).
const DEFAULT_SOCK_BUF: usize = 212_992;

/// One change in an nf_tables transaction built by [`Nfnl::nft_apply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NftOp {
    DeleteRule {
        family: NftFamily,
        table: String,
        chain: String,
        handle: u64,
    },
    DeleteChain {
        family: NftFamily,
        table: String,
        chain: String,
    },
    DeleteTable {
        family: NftFamily,
        table: String,
    },
    /// `add table` (no error if it exists).
    AddTable {
        family: NftFamily,
        table: String,
        comment: Option<String>,
    },
    /// `add chain`, a base chain when `hook` is given; an existing chain
    /// keeps its policy.
    AddChain {
        family: NftFamily,
        table: String,
        chain: String,
        hook: Option<Hook>,
        comment: Option<String>,
    },
    /// `flush chain`: every rule of the chain goes.
    FlushChain {
        family: NftFamily,
        table: String,
        chain: String,
    },
    /// `add rule` (appended), or `insert rule` (first) when `insert`.
    AddRule {
        family: NftFamily,
        table: String,
        chain: String,
        expr: Vec<Expr>,
        comment: Option<String>,
        insert: bool,
    },
    /// `add chain` of a base chain with an explicit `policy` (`NF_DROP` 0,
    /// `NF_ACCEPT` 1), as nft sends `policy accept;`; an existing chain
    /// takes the policy.
    AddBaseChain {
        family: NftFamily,
        table: String,
        chain: String,
        hook: Hook,
        policy: u32,
    },
    /// `add set` / `add map` (no error if it exists).
    AddSet {
        family: NftFamily,
        table: String,
        set: String,
        spec: SetSpec,
    },
    DeleteSet {
        family: NftFamily,
        table: String,
        set: String,
    },
    /// `flush set`: every element goes.
    FlushSet {
        family: NftFamily,
        table: String,
        set: String,
    },
    /// `add element`, one message of them; `set_id` names a set declared
    /// earlier in the same transaction (an anonymous one).
    AddElements {
        family: NftFamily,
        table: String,
        set: String,
        set_id: Option<u32>,
        elements: Vec<SetElem>,
    },
    /// `delete element`, by key.
    DeleteElements {
        family: NftFamily,
        table: String,
        set: String,
        elements: Vec<SetElem>,
    },
}

/// How a set is declared (see [`crate::nftset::SetDecl`], which fills it
/// as nft would).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetSpec {
    pub(crate) flags: SetFlags,
    /// nft's datatype of the key (a concatenation's: its fields' types).
    pub(crate) key_type: u32,
    pub(crate) key_len: u32,
    /// A map's data type and length.
    pub(crate) data: Option<(u32, u32)>,
    /// `NFTA_SET_ID`, unique within the transaction.
    pub(crate) id: u32,
    pub(crate) desc: Option<SetDescription>,
    /// `timeout`: the elements' default lifetime in ms (dynamic sets).
    pub(crate) timeout_ms: Option<u64>,
    /// nft's userdata (byte orders, the key's expression), which `nft
    /// list` reads to print the set as nft would.
    pub(crate) userdata: Vec<u8>,
}

/// One element of a set or map (an `NFTA_LIST_ELEM`), as
/// [`crate::nftset`] encodes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetElem(pub(crate) ListAttribute<SetElementAttribute>);

/// A base chain's hook: `type <kind> hook <hook> priority <priority>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hook {
    /// "filter" or "nat".
    pub kind: &'static str,
    /// `NF_INET_*`: 0 prerouting, 2 forward, 3 output, 4 postrouting.
    pub hook: u32,
    pub priority: i32,
}

impl Hook {
    pub const PREROUTING: u32 = 0;
    pub const FORWARD: u32 = 2;
    pub const OUTPUT: u32 = 3;
    pub const POSTROUTING: u32 = 4;
}

/// libnftnl's userdata TLV holding a comment (type 0, length with NUL;
/// nft cuts comments at 128 bytes).
pub(crate) fn udata(comment: &str) -> Vec<u8> {
    let b = comment.as_bytes();
    let b = &b[..b.len().min(127)];
    let mut v = vec![UDATA_COMMENT, (b.len() + 1) as u8];
    v.extend_from_slice(b);
    v.push(0);
    v
}

pub(crate) fn c_string(v: &[u8]) -> String {
    let end = v.iter().position(|b| *b == 0).unwrap_or(v.len());
    String::from_utf8_lossy(&v[..end]).into_owned()
}

/// The comment TLV in userdata (`type u8, len u8, value`).
fn udata_comment(mut v: &[u8]) -> Option<String> {
    while v.len() >= 2 {
        let (ty, len) = (v[0], v[1] as usize);
        let value = v.get(2..2 + len)?;
        if ty == UDATA_COMMENT {
            return Some(c_string(value));
        }
        v = &v[2 + len..];
    }
    None
}

/// The expressions of a listed rule by name, with their data.
fn elements(exprs: &[ListAttribute<ExpressionAttribute>]) -> Vec<(String, Option<&Expressions>)> {
    exprs
        .iter()
        .filter_map(|e| match e {
            ListAttribute::Element(attrs) => Some(attrs),
            _ => None,
        })
        .map(|attrs| {
            let name = attrs.iter().find_map(|a| match a {
                ExpressionAttribute::Name(n) => Some(n.clone()),
                _ => None,
            });
            let data = attrs.iter().find_map(|a| match a {
                ExpressionAttribute::Data(d) => Some(d),
                _ => None,
            });
            (name.unwrap_or_default(), data)
        })
        .collect()
}

/// Whether a rule's expressions are counters and then a drop or reject:
/// nothing the rule matches on.
fn unconditional_drop(exprs: &[ListAttribute<ExpressionAttribute>]) -> bool {
    let list = elements(exprs);
    let Some(((name, data), rest)) = list.split_last() else {
        return false;
    };
    if rest.iter().any(|(n, _)| n != "counter") {
        return false;
    }
    match (name.as_str(), data) {
        ("reject", _) => true,
        ("target", Some(Expressions::Other { attributes, .. })) => attributes
            .iter()
            .any(|a| a.kind() == NFTA_TARGET_NAME && c_string(&nla_value(a)) == "REJECT"),
        ("immediate", Some(Expressions::Immediate(i))) => i.iter().any(|a| {
            matches!(a, Immediate::Data(netlink_packet_netfilter::nftables::DataAttribute::Verdict(v))
                if v.contains(&VerdictAttribute::Code(Verdict::Other(NF_DROP))))
        }),
        _ => false,
    }
}

fn nla_value(a: &DefaultNla) -> Vec<u8> {
    let mut v = vec![0u8; a.value_len()];
    a.emit_value(&mut v);
    v
}

fn emit(msg: &NfTablesMessage) -> Vec<u8> {
    let mut v = vec![0u8; msg.buffer_len()];
    msg.emit(&mut v);
    v
}

fn nft_type(msg: &NfTablesMessage) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | u16::from(u8::from(msg.message_type()))
}

impl NftOp {
    /// The message, its family and the flags besides request and ack.
    fn message(&self) -> (NftFamily, NfTablesMessage, u16) {
        let s = |v: &str| v.to_string();
        match self {
            NftOp::DeleteRule {
                family,
                table,
                chain,
                handle,
            } => (
                *family,
                NfTablesMessage::DeleteRule(RuleMessage {
                    attributes: vec![
                        RuleAttribute::Table(s(table)),
                        RuleAttribute::Chain(s(chain)),
                        RuleAttribute::Handle(*handle),
                    ],
                }),
                0,
            ),
            NftOp::DeleteChain {
                family,
                table,
                chain,
            } => (
                *family,
                NfTablesMessage::DeleteChain(ChainMessage {
                    attributes: vec![
                        ChainAttribute::Table(s(table)),
                        ChainAttribute::Name(s(chain)),
                    ],
                }),
                NLM_F_NONREC,
            ),
            NftOp::DeleteTable { family, table } => (
                *family,
                NfTablesMessage::DeleteTable(TableMessage {
                    attributes: vec![TableAttribute::Name(s(table))],
                }),
                0,
            ),
            NftOp::AddTable {
                family,
                table,
                comment,
            } => {
                let mut a = vec![TableAttribute::Name(s(table))];
                if let Some(c) = comment {
                    a.push(TableAttribute::UserData(udata(c)));
                }
                (
                    *family,
                    NfTablesMessage::NewTable(TableMessage { attributes: a }),
                    NLM_F_CREATE,
                )
            }
            NftOp::AddChain {
                family,
                table,
                chain,
                hook,
                comment,
            } => {
                let mut a = vec![
                    ChainAttribute::Table(s(table)),
                    ChainAttribute::Name(s(chain)),
                ];
                if let Some(h) = hook {
                    a.push(ChainAttribute::Hook(vec![
                        NlHook::Number(HookNumber::Other(h.hook)),
                        // The kernel reads the priority as a signed number.
                        NlHook::Priority(h.priority as u32),
                    ]));
                    a.push(ChainAttribute::Type(s(h.kind)));
                }
                if let Some(c) = comment {
                    a.push(ChainAttribute::UserData(udata(c)));
                }
                (
                    *family,
                    NfTablesMessage::NewChain(ChainMessage { attributes: a }),
                    NLM_F_CREATE,
                )
            }
            NftOp::FlushChain {
                family,
                table,
                chain,
            } => (
                *family,
                NfTablesMessage::DeleteRule(RuleMessage {
                    attributes: vec![
                        RuleAttribute::Table(s(table)),
                        RuleAttribute::Chain(s(chain)),
                    ],
                }),
                0,
            ),
            NftOp::AddRule {
                family,
                table,
                chain,
                expr,
                comment,
                insert,
            } => {
                let mut a = vec![
                    RuleAttribute::Table(s(table)),
                    RuleAttribute::Chain(s(chain)),
                    RuleAttribute::Expressions(expr.iter().map(|e| e.0.clone()).collect()),
                ];
                if let Some(c) = comment {
                    a.push(RuleAttribute::UserData(udata(c)));
                }
                let flags = if *insert {
                    NLM_F_CREATE
                } else {
                    NLM_F_CREATE | NLM_F_APPEND
                };
                (
                    *family,
                    NfTablesMessage::NewRule(RuleMessage { attributes: a }),
                    flags,
                )
            }
            NftOp::AddBaseChain {
                family,
                table,
                chain,
                hook,
                policy,
            } => {
                let a = vec![
                    ChainAttribute::Table(s(table)),
                    ChainAttribute::Name(s(chain)),
                    ChainAttribute::Hook(vec![
                        NlHook::Number(HookNumber::Other(hook.hook)),
                        NlHook::Priority(hook.priority as u32),
                    ]),
                    ChainAttribute::Policy(*policy),
                    ChainAttribute::Type(s(hook.kind)),
                ];
                (
                    *family,
                    NfTablesMessage::NewChain(ChainMessage { attributes: a }),
                    NLM_F_CREATE,
                )
            }
            NftOp::AddSet {
                family,
                table,
                set,
                spec,
            } => {
                let mut a = vec![
                    SetAttribute::Table(s(table)),
                    SetAttribute::Name(s(set)),
                    SetAttribute::Flags(spec.flags),
                    SetAttribute::KeyType(spec.key_type),
                    SetAttribute::KeyLen(spec.key_len),
                ];
                if let Some((ty, len)) = spec.data {
                    a.push(SetAttribute::DataType(ty));
                    a.push(SetAttribute::DataLen(len));
                }
                a.push(SetAttribute::Id(spec.id));
                if let Some(d) = &spec.desc {
                    a.push(SetAttribute::Description(vec![d.clone()]));
                }
                if let Some(t) = spec.timeout_ms {
                    a.push(SetAttribute::Timeout(t));
                }
                if !spec.userdata.is_empty() {
                    a.push(SetAttribute::UserData(spec.userdata.clone()));
                }
                (
                    *family,
                    NfTablesMessage::NewSet(SetMessage { attributes: a }),
                    NLM_F_CREATE,
                )
            }
            NftOp::DeleteSet { family, table, set } => (
                *family,
                NfTablesMessage::DeleteSet(SetMessage {
                    attributes: vec![SetAttribute::Table(s(table)), SetAttribute::Name(s(set))],
                }),
                0,
            ),
            NftOp::FlushSet { family, table, set } => (
                *family,
                NfTablesMessage::DeleteSetElement(SetElementMessage {
                    attributes: vec![SetElementList::Table(s(table)), SetElementList::Set(s(set))],
                }),
                0,
            ),
            NftOp::AddElements {
                family,
                table,
                set,
                set_id,
                elements,
            } => (
                *family,
                NfTablesMessage::NewSetElement(SetElementMessage {
                    attributes: element_list(table, set, *set_id, elements),
                }),
                NLM_F_CREATE,
            ),
            NftOp::DeleteElements {
                family,
                table,
                set,
                elements,
            } => (
                *family,
                NfTablesMessage::DeleteSetElement(SetElementMessage {
                    attributes: element_list(table, set, None, elements),
                }),
                0,
            ),
        }
    }

    /// The message as the transaction sends it: (type, flags besides
    /// request and ack, family, attributes after nfgenmsg).
    pub(crate) fn encode(&self) -> (u16, u16, u8, Vec<u8>) {
        let (family, msg, flags) = self.message();
        (nft_type(&msg), flags, family.code(), emit(&msg))
    }

    /// The message's attribute bytes (for tests comparing encodings).
    pub fn attrs(&self) -> Vec<u8> {
        self.encode().3
    }
}

/// The attributes of an element message: the set, then its elements.
pub(crate) fn element_list(
    table: &str,
    set: &str,
    set_id: Option<u32>,
    elements: &[SetElem],
) -> Vec<SetElementList> {
    let mut a = vec![
        SetElementList::Table(table.to_string()),
        SetElementList::Set(set.to_string()),
    ];
    if let Some(id) = set_id {
        a.push(SetElementList::SetId(id));
    }
    a.push(SetElementList::Elements(
        elements.iter().map(|e| e.0.clone()).collect(),
    ));
    a
}

fn parse<T: for<'a> Parseable<[u8]>>(what: &str, a: &[u8]) -> Result<T> {
    T::parse(a).map_err(|e| {
        io_err(
            format!("decode {what}"),
            std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()),
        )
    })
}

/// The attributes of a listed rule that say which it is.
#[derive(Default)]
struct RuleParts<'a> {
    table: Option<&'a str>,
    chain: Option<&'a str>,
    handle: Option<u64>,
    udata: Option<&'a [u8]>,
}

fn rule_parts(m: &RuleMessage) -> RuleParts<'_> {
    let mut p = RuleParts::default();
    for a in &m.attributes {
        match a {
            RuleAttribute::Table(t) => p.table = Some(t.as_str()),
            RuleAttribute::Chain(c) => p.chain = Some(c.as_str()),
            RuleAttribute::Handle(h) => p.handle = Some(*h),
            RuleAttribute::UserData(u) => p.udata = Some(u.as_slice()),
            _ => {}
        }
    }
    p
}

fn rule_exprs(m: &RuleMessage) -> &[ListAttribute<ExpressionAttribute>] {
    m.attributes
        .iter()
        .find_map(|a| match a {
            RuleAttribute::Expressions(e) => Some(e.as_slice()),
            _ => None,
        })
        .unwrap_or_default()
}

impl Nfnl {
    fn nft_dump(
        &mut self,
        op: &str,
        family: NftFamily,
        request: NfTablesMessage,
    ) -> Result<Option<Dumped>> {
        let t = nft_type(&request);
        match self.dump(op, t, family.code(), 0, &emit(&request)) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The tables of every family: `(family, name)`.
    pub fn nft_tables(&mut self) -> Result<Vec<(NftFamily, String)>> {
        let get = NfTablesMessage::GetTable(TableMessage { attributes: vec![] });
        // Family 0 (NFPROTO_UNSPEC) dumps every family.
        let msgs = self.dump("list nftables tables", nft_type(&get), 0, 0, &[])?;
        let mut out = Vec::new();
        for (fam, a) in msgs {
            let t: TableMessage = parse("table", &a)?;
            let name = t.attributes.iter().find_map(|a| match a {
                TableAttribute::Name(n) => Some(n.clone()),
                _ => None,
            });
            if let (Some(f), Some(n)) = (NftFamily::from_code(fam), name) {
                out.push((f, n));
            }
        }
        Ok(out)
    }

    fn nft_table_exists(&mut self, family: NftFamily, table: &str) -> Result<bool> {
        Ok(self
            .nft_tables()?
            .iter()
            .any(|(f, t)| *f == family && t == table))
    }

    /// The chains of a table; `None` when the table does not exist.
    pub fn nft_chains(&mut self, family: NftFamily, table: &str) -> Result<Option<Vec<NftChain>>> {
        let get = NfTablesMessage::GetChain(ChainMessage {
            attributes: vec![ChainAttribute::Table(table.into())],
        });
        let op = format!("list chains of table {family} {table}");
        let Some(msgs) = self.nft_dump(&op, family, get)? else {
            return Ok(None);
        };
        let mut chains = Vec::new();
        for (_, a) in msgs {
            let m: ChainMessage = parse("chain", &a)?;
            let (mut t, mut name, mut hooknum, mut kind, mut comment) =
                (None, None, None, None, None);
            for a in &m.attributes {
                match a {
                    ChainAttribute::Table(v) => t = Some(v.as_str()),
                    ChainAttribute::Name(v) => name = Some(v.clone()),
                    ChainAttribute::Type(v) => kind = Some(v.clone()),
                    ChainAttribute::UserData(u) => comment = udata_comment(u),
                    ChainAttribute::Hook(h) => {
                        hooknum = h.iter().find_map(|x| match x {
                            NlHook::Number(n) => Some(u32::from(*n)),
                            _ => None,
                        })
                    }
                    _ => {}
                }
            }
            // Older kernels ignore the table filter of a chain dump.
            if t != Some(table) {
                continue;
            }
            if let Some(name) = name {
                chains.push(NftChain {
                    name,
                    base: hooknum.is_some(),
                    hook: kind.zip(hooknum),
                    comment,
                });
            }
        }
        // An empty answer from a kernel that ignored the filter means "no
        // such table".
        if chains.is_empty() && !self.nft_table_exists(family, table)? {
            return Ok(None);
        }
        Ok(Some(chains))
    }

    /// Whether the base chain `chain` of `table` drops what its earlier
    /// rules did not decide: its policy is drop, or its last rule drops or
    /// rejects unconditionally (`-j DROP` / `-j REJECT` as iptables-nft
    /// writes them: a counter and the verdict). A chain or table that does
    /// not exist drops nothing. One request, and a dump of the chain's
    /// rules only when the policy accepts.
    pub fn nft_chain_drops(&mut self, family: NftFamily, table: &str, chain: &str) -> Result<bool> {
        let get = NfTablesMessage::GetChain(ChainMessage {
            attributes: vec![
                ChainAttribute::Table(table.into()),
                ChainAttribute::Name(chain.into()),
            ],
        });
        let op = format!("get chain {family} {table} {chain}");
        let a = match self.get(&op, nft_type(&get), family.code(), &emit(&get)) {
            Ok(Some(a)) => a,
            Ok(None) => return Ok(false),
            Err(e) if e.is_not_found() => return Ok(false),
            Err(e) => return Err(e),
        };
        let m: ChainMessage = parse("chain", &a)?;
        if m.attributes.contains(&ChainAttribute::Policy(NF_DROP)) {
            return Ok(true);
        }
        let get = NfTablesMessage::GetRule(RuleMessage {
            attributes: vec![
                RuleAttribute::Table(table.into()),
                RuleAttribute::Chain(chain.into()),
            ],
        });
        let op = format!("list rules of chain {family} {table} {chain}");
        let Some(msgs) = self.nft_dump(&op, family, get)? else {
            return Ok(false);
        };
        // Kernels that ignore the dump's filter answer with every rule.
        let mut last = None;
        for (_, a) in msgs {
            let r: RuleMessage = parse("rule", &a)?;
            let p = rule_parts(&r);
            if p.table == Some(table) && p.chain == Some(chain) {
                last = Some(r);
            }
        }
        Ok(last.is_some_and(|r| unconditional_drop(rule_exprs(&r))))
    }

    /// The rules of a table in listing order; `None` when the table does
    /// not exist.
    pub fn nft_rules(&mut self, family: NftFamily, table: &str) -> Result<Option<Vec<NftRule>>> {
        let get = NfTablesMessage::GetRule(RuleMessage {
            attributes: vec![RuleAttribute::Table(table.into())],
        });
        let op = format!("list rules of table {family} {table}");
        let Some(msgs) = self.nft_dump(&op, family, get)? else {
            return Ok(None);
        };
        let mut rules = Vec::new();
        for (_, a) in msgs {
            let r: RuleMessage = parse("rule", &a)?;
            let p = rule_parts(&r);
            if p.table != Some(table) {
                continue;
            }
            if let (Some(chain), Some(handle)) = (p.chain, p.handle) {
                rules.push(NftRule {
                    chain: chain.to_string(),
                    handle,
                    comment: p.udata.and_then(udata_comment),
                    terms: terms(rule_exprs(&r)),
                });
            }
        }
        if rules.is_empty() && !self.nft_table_exists(family, table)? {
            return Ok(None);
        }
        Ok(Some(rules))
    }

    /// Applies `ops` as one nf_tables transaction: all or nothing.
    pub fn nft_apply(&mut self, ops: &[NftOp]) -> Result<()> {
        let what = format!("nftables transaction of {} changes", ops.len());
        self.transaction(&what, ops.iter().map(NftOp::encode))
    }

    /// The one nf_tables writer: `msgs` as (type, flags besides request and
    /// ack, family, payload) between batch markers, every message
    /// acknowledged, all or nothing.
    pub(crate) fn transaction(
        &mut self,
        what: &str,
        msgs: impl Iterator<Item = (u16, u16, u8, Vec<u8>)>,
    ) -> Result<()> {
        // The batch markers carry the subsystem in nfgenmsg's res_id.
        let mut buf = self.message(
            NFNL_MSG_BATCH_BEGIN,
            NLM_F_REQUEST,
            0,
            NFNL_SUBSYS_NFTABLES,
            &[],
        );
        let mut acked = Vec::new();
        for (ty, flags, family, payload) in msgs {
            let m = self.message(ty, NLM_F_REQUEST | NLM_F_ACK | flags, family, 0, &payload);
            acked.push(self.seq);
            buf.extend_from_slice(&m);
        }
        if acked.is_empty() {
            return Ok(());
        }
        let end = self.message(
            NFNL_MSG_BATCH_END,
            NLM_F_REQUEST,
            0,
            NFNL_SUBSYS_NFTABLES,
            &[],
        );
        buf.extend_from_slice(&end);
        // Netlink takes a batch in one datagram, and the kernel queues every
        // message's ack (an error ack echoes its message) before the first
        // is read: each costs about 800 bytes of receive buffer, so ~260
        // fill the default 212992 and the read fails with ENOBUFS although
        // the transaction committed. Big batches (a policy table of many
        // rule sets or thousands of set elements) get buffers to fit; root
        // may exceed net.core.[rw]mem_max.
        let snd = buf.len() + 64 * 1024;
        let rcv = acked.len() * 1024 + buf.len() + 64 * 1024;
        if snd > DEFAULT_SOCK_BUF || rcv > DEFAULT_SOCK_BUF {
            self.sock.force_buffers(
                snd.max(DEFAULT_SOCK_BUF),
                rcv,
                "size the nfnetlink socket buffers",
            )?;
        }
        self.spawn_releaser_once();
        self.send_acked(what, &buf, &acked)
    }

    /// A dump of nf_tables objects (`NFT_MSG_GET*` type `kind` with the
    /// request's attributes, as [`crate::nftset`] builds them): each
    /// message's attributes; `None` when the table does not exist.
    pub fn nft_dump_raw(
        &mut self,
        kind: u8,
        family: u8,
        attrs: &[u8],
    ) -> Result<Option<Vec<Vec<u8>>>> {
        let op = format!("nftables dump of type {kind}");
        let t = (NFNL_SUBSYS_NFTABLES << 8) | u16::from(kind);
        match self.dump(&op, t, family, 0, attrs) {
            Ok(v) => Ok(Some(v.into_iter().map(|(_, a)| a).collect())),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Deletes the rules of `tables` that `pick` selects, in one
    /// transaction; returns the deleted rules. A rule that vanished between
    /// the listing and the deletion fails the transaction atomically, so
    /// the listing is read again and the deletion retried once. Nothing to
    /// delete is success.
    pub fn nft_delete_rules_where(
        &mut self,
        tables: &[(NftFamily, &str)],
        pick: &dyn Fn(NftFamily, &NftRule) -> bool,
    ) -> Result<Vec<(NftFamily, NftRule)>> {
        let mut last = None;
        for _ in 0..2 {
            let mut doomed = Vec::new();
            for (family, table) in tables {
                for r in self.nft_rules(*family, table)?.unwrap_or_default() {
                    if pick(*family, &r) {
                        doomed.push((*family, table.to_string(), r));
                    }
                }
            }
            let ops: Vec<NftOp> = doomed
                .iter()
                .map(|(family, table, r)| NftOp::DeleteRule {
                    family: *family,
                    table: table.clone(),
                    chain: r.chain.clone(),
                    handle: r.handle,
                })
                .collect();
            match self.nft_apply(&ops) {
                Ok(()) => return Ok(doomed.into_iter().map(|(f, _, r)| (f, r)).collect()),
                Err(e) if e.is_not_found() => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            io_err("delete nftables rules", std::io::ErrorKind::NotFound.into())
        }))
    }

    /// Whether iptables (family `v6` or not) may hold one of `chains` in
    /// `table` of `ns` (the namespace this socket was opened in): legacy
    /// iptables has that table there, or the iptables-nft table of that
    /// name has one of the chains. When it cannot tell, it says yes.
    ///
    /// Lets DEL skip `iptables-save` (a process each) on a node whose rules
    /// of that kind were never written with iptables.
    pub fn iptables_may_hold(
        &mut self,
        ns: &NetNs,
        v6: bool,
        table: &str,
        chains: &[&str],
    ) -> bool {
        let names = if v6 {
            "ip6_tables_names"
        } else {
            "ip_tables_names"
        };
        let legacy = ns
            .run(|| std::fs::read_to_string(format!("/proc/thread-self/net/{names}")))
            .ok()
            .and_then(std::result::Result::ok)
            .is_some_and(|s| s.lines().any(|l| l == table));
        if legacy {
            return true;
        }
        let family = if v6 { NftFamily::Ip6 } else { NftFamily::Ip };
        match self.nft_chains(family, table) {
            Ok(Some(cs)) => cs.iter().any(|c| chains.contains(&c.name.as_str())),
            Ok(None) => false,
            Err(_) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::expr;

    fn listed(e: Vec<Expr>) -> Vec<ListAttribute<ExpressionAttribute>> {
        e.into_iter().map(|x| x.0).collect()
    }

    #[test]
    fn comment_from_userdata() {
        // As libnftnl writes it: type 0, length with NUL, the text.
        assert_eq!(udata_comment(&udata("ctr1")).as_deref(), Some("ctr1"));
        assert_eq!(udata_comment(&[1, 1, 9]), None);
        assert_eq!(udata("x".repeat(300).as_str()).len(), 2 + 128);
    }

    #[test]
    fn unconditional_drop_rules() {
        assert!(unconditional_drop(&listed(expr::drop())));
        assert!(!unconditional_drop(&listed(expr::accept())));
        let mut cond = expr::ifname(true, "x", true);
        cond.extend(expr::drop());
        assert!(!unconditional_drop(&listed(cond)));
        assert!(!unconditional_drop(&[]));
        // `counter` + `target REJECT`, as iptables-nft writes `-j REJECT`.
        let xt = |name: &str, attrs: Vec<DefaultNla>| {
            Expr::from(Expressions::Other {
                expression_type: name.into(),
                attributes: attrs,
            })
        };
        let target = |t: &str| {
            let mut v = t.as_bytes().to_vec();
            v.push(0);
            xt("target", vec![DefaultNla::new(NFTA_TARGET_NAME, v)])
        };
        assert!(unconditional_drop(&listed(vec![
            xt("counter", vec![]),
            target("REJECT")
        ])));
        assert!(!unconditional_drop(&listed(vec![target("MASQUERADE")])));
    }

    #[test]
    fn ops_round_trip_through_the_crate() {
        let op = NftOp::AddRule {
            family: NftFamily::Inet,
            table: "t".into(),
            chain: "c".into(),
            expr: [expr::nfproto(false), expr::masquerade()].concat(),
            comment: Some("hello".into()),
            insert: false,
        };
        let (_, msg, flags) = op.message();
        assert_eq!(flags, NLM_F_CREATE | NLM_F_APPEND);
        let back: RuleMessage = parse("rule", &emit(&msg)).unwrap();
        let p = rule_parts(&back);
        assert_eq!((p.table, p.chain), (Some("t"), Some("c")));
        assert_eq!(p.udata.and_then(udata_comment).as_deref(), Some("hello"));
        assert_eq!(
            terms(rule_exprs(&back)),
            expr::terms_of(&[expr::nfproto(false), expr::masquerade()].concat())
        );
    }
}
