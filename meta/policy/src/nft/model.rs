//! What the table should hold ([`Model`]), what the last apply left
//! ([`Applied`]), and the changes from one to the other ([`plan`]), as
//! [`Op`]s that `messages` turns into one nfnetlink transaction.

use super::short_hash;
use crate::compile::{Desired, Ports};
use crate::conf::FlowEvents;
use crate::model::Dir;
use crate::state::PodRecord;
use rcni_netfilter::nftset::{Key, SetDecl};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Bumped when the layout changes, so an old `applied` forces a rewrite.
const FORMAT: u32 = 1;

/// The vmaps of the forward chain; they live as long as the table.
pub(super) const VMAPS: [&str; 4] = ["from_pod4", "from_pod6", "to_pod4", "to_pod6"];

/// The fixed rules of the forward chain, as `nft list` shows them (their
/// encoding is in `messages`).
pub(super) const FORWARD_RULES: &[&str] = &[
    "ct state established,related accept",
    "icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert } accept",
    "ip saddr vmap @from_pod4",
    "ip6 saddr vmap @from_pod6",
    "ip daddr vmap @to_pod4",
    "ip6 daddr vmap @to_pod6",
];
pub(super) const FORWARD_HOOK: &str = "type filter hook forward priority filter; policy accept;";

/// The four sets of one family of a rule set, in rule order.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SetKind {
    /// Identity peers and other nodes' pods allowed everything: their
    /// addresses.
    Pod,
    /// Identity peers and other nodes' pods with port ranges: address .
    /// protocol . ports.
    PodPorts,
    /// CIDR intervals allowed everything.
    Net,
    /// CIDR intervals with port ranges.
    NetPorts,
}

const KINDS: [(SetKind, &str); 4] = [
    (SetKind::Pod, "pod"),
    (SetKind::PodPorts, "podp"),
    (SetKind::Net, "net"),
    (SetKind::NetPorts, "netp"),
];

/// A set's declaration, from its name (which encodes kind and family).
pub(super) fn set_decl(name: &str) -> Option<SetDecl> {
    if VMAPS.contains(&name) {
        return Some(SetDecl {
            key: Key::Addr {
                v6: name.ends_with('6'),
            },
            interval: false,
            verdict_map: true,
            timeout_ms: 0,
        });
    }
    let (_, suffix) = name.rsplit_once('_')?;
    for (k, flow, timeout_ms) in FLOW_SETS {
        if let Some(fam) = suffix.strip_prefix(k)
            && (fam == "4" || fam == "6")
        {
            let v6 = fam == "6";
            return Some(SetDecl {
                key: if flow {
                    Key::Flow { v6 }
                } else {
                    Key::Addr { v6 }
                },
                interval: false,
                verdict_map: false,
                timeout_ms,
            });
        }
    }
    let (kind, v6) = match suffix {
        "pod4" | "pod6" => (SetKind::Pod, &suffix[3..] == "6"),
        "pod4p" | "pod6p" => (SetKind::PodPorts, &suffix[3..4] == "6"),
        "net4" | "net6" => (SetKind::Net, &suffix[3..] == "6"),
        "net4p" | "net6p" => (SetKind::NetPorts, &suffix[3..4] == "6"),
        _ => return None,
    };
    let (key, interval) = match kind {
        SetKind::Pod => (Key::Addr { v6 }, false),
        SetKind::Net => (Key::Addr { v6 }, true),
        SetKind::PodPorts | SetKind::NetPorts => (Key::AddrProtoPort { v6 }, true),
    };
    Some(SetDecl {
        key,
        interval,
        verdict_map: false,
        timeout_ms: 0,
    })
}

/// The flow event sets of a rule set (see [`Flows`]): by suffix, the key
/// (flow or policed pod) and the elements' lifetime.
const FLOW_SETS: [(&str, bool, u64); 3] = [
    // A flow reported in the last 10 s: one event per connection attempt,
    // not one per retransmitted SYN.
    ("seen", true, 10_000),
    // A policed pod's tokens.
    ("rl", false, 60_000),
    // A policed pod's suppressed events: the counter the source reads.
    // Updated on each suppression; an hour idle and it goes.
    ("sup", false, 3_600_000),
];

/// What the rule set chains report to NFLOG (the nftables side of
/// `flowEvents`, `flowRate` and audit mode; read by `flows::nft`).
///
/// A chain's default-deny tail, with events on, is:
///
/// ```text
/// ip saddr . ip daddr . meta l4proto . th sport . th dport @in_3_seen4 drop
/// ip6 saddr . ip6 daddr . meta l4proto . th sport . th dport @in_3_seen6 drop
/// update @in_3_rl4 { ip daddr limit rate over 10/second burst 10 packets } update @in_3_sup4 { ip daddr counter } drop
/// update @in_3_rl6 { ... } drop
/// add @in_3_seen4 { ip saddr . ip daddr . meta l4proto . th sport . th dport } log prefix "rcni deny ingress 3" group 33000 drop
/// add @in_3_seen6 { ... } log prefix "rcni deny ingress 3" group 33000 drop
/// log prefix "rcni deny ingress 3" group 33000 drop comment "ingress: default/web"
/// ```
///
/// (the last rule for what the others cannot key: a later fragment, a
/// full `seen` set).
///
/// - One event per connection attempt: a flow reported in the last 10 s
///   (an element of `seen`, which expires 10 s after it was added) is
///   dropped silently, as retransmitted SYNs are. The flow is the packet's addresses, protocol
///   and first four transport bytes: for ICMP those are type, code and
///   checksum, so each echo request of a denied ping is its own flow
///   (within the pod's rate), where the eBPF datapath keys echo by its
///   identifier. (`ct original proto-src` would give the identifier, but
///   only in a set declared by `typeof`, whose userdata this writer does
///   not encode.)
/// - Per policed pod (the chain's pod: the receiver for ingress, the
///   sender for egress), `flowRate` events a second with a burst of as
///   many; over that the pod's `sup` element counts the suppressed event
///   in the kernel and nothing goes to userspace: a flood of denials
///   costs three set lookups a packet, no insertion (a suppressed flow is
///   not marked seen, as in the eBPF datapath) and no copy. The source
///   reads the counters and reports the increase in the pod's next
///   event.
/// - Audit rule sets end the same way with `return` (the flow passes;
///   once answered, the forward chain's conntrack rule takes its later
///   packets).
/// - With `"flowEvents": "all"`, allow rules `goto` the chain's `_ok`
///   chain (`in_3_ok`): the same tail, tag `allow`, ending in `return`.
///   Only new flows reach the rule set chains.
///
/// The tag (`rcni <verdict> <direction> <rule set>`) tells the source the
/// verdict and whose policy decided; the packet tells the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flows {
    pub events: FlowEvents,
    /// Events per second per pod, and the burst.
    pub rate: u32,
    /// The network's NFLOG group ([`super::nflog_group`]).
    pub group: u16,
}

impl Flows {
    /// No events: the chains drop (or, audit, return) silently.
    pub fn off() -> Flows {
        Flows {
            events: FlowEvents::None,
            rate: 0,
            group: 0,
        }
    }
}

/// `drop` or `return` at the end of a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fin {
    Drop,
    Return,
}

impl std::fmt::Display for Fin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Fin::Drop => "drop",
            Fin::Return => "return",
        })
    }
}

/// The NFLOG tag of a rule set's reports.
pub fn log_prefix(verdict: &str, dir: Dir, rs: u32) -> String {
    format!("rcni {verdict} {} {rs}", dir.as_str())
}

/// `in_3` + `podp` + 4 -> `in_3_pod4p`.
fn set_name(chain: &str, kind: &str, fam: u8) -> String {
    format!("{chain}_{}{fam}{}", &kind[..3], &kind[3..])
}

pub(super) fn chain_name(rs: u32, dir: Dir) -> String {
    match dir {
        Dir::Ingress => format!("in_{rs}"),
        Dir::Egress => format!("eg_{rs}"),
    }
}

/// A rule of a rule set chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Rule {
    /// `ip|ip6 saddr|daddr [. meta l4proto . th dport] @set return` (or
    /// `goto <chain>`: the allow events' chain).
    Allow {
        v6: bool,
        src: bool,
        ports: bool,
        set: String,
        goto: Option<String>,
    },
    /// `<flow> @set <fin>`: a flow reported lately ends here, unreported.
    Seen { v6: bool, set: String, fin: Fin },
    /// `add @seen { <flow> } log prefix "<prefix>" group <group> <fin>`:
    /// reported, and marked so for 10 s.
    Report {
        v6: bool,
        seen: String,
        prefix: String,
        group: u16,
        fin: Fin,
    },
    /// `update @rl { <pod> limit rate over N/second burst N packets }
    /// update @sup { <pod> counter } <fin>`: the pod's events over the
    /// rate are counted and end here.
    Over {
        v6: bool,
        /// The policed pod is the source (egress).
        src: bool,
        rl: String,
        sup: String,
        rate: u32,
        fin: Fin,
    },
    /// `[log prefix "<prefix>" group <group>] drop|return [comment "..."]`.
    End {
        log: Option<(String, u16)>,
        fin: Fin,
        comment: Option<String>,
    },
}

fn ip_of(v6: bool) -> &'static str {
    if v6 { "ip6" } else { "ip" }
}

/// The flow key of the `seen` sets, as nft writes it.
fn flow_key(v6: bool) -> String {
    let ip = ip_of(v6);
    format!("{ip} saddr . {ip} daddr . meta l4proto . th sport . th dport")
}

impl std::fmt::Display for Rule {
    /// nft's text of the rule: what `nft list` shows, and what a chain's
    /// hash in `applied` is made of.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rule::Allow {
                v6,
                src,
                ports,
                set,
                goto,
            } => {
                let ip = ip_of(*v6);
                let field = if *src { "saddr" } else { "daddr" };
                let ports = if *ports {
                    " . meta l4proto . th dport"
                } else {
                    ""
                };
                match goto {
                    Some(c) => write!(f, "{ip} {field}{ports} @{set} goto {c}"),
                    None => write!(f, "{ip} {field}{ports} @{set} return"),
                }
            }
            Rule::Seen { v6, set, fin } => write!(f, "{} @{set} {fin}", flow_key(*v6)),
            Rule::Report {
                v6,
                seen,
                prefix,
                group,
                fin,
            } => write!(
                f,
                "add @{seen} {{ {} }} log prefix \"{prefix}\" group {group} {fin}",
                flow_key(*v6)
            ),
            Rule::Over {
                v6,
                src,
                rl,
                sup,
                rate,
                fin,
            } => {
                let ip = ip_of(*v6);
                let field = if *src { "saddr" } else { "daddr" };
                write!(
                    f,
                    "update @{rl} {{ {ip} {field} limit rate over {rate}/second burst {rate} packets }} update @{sup} {{ {ip} {field} counter }} {fin}"
                )
            }
            Rule::End { log, fin, comment } => {
                if let Some((prefix, group)) = log {
                    write!(f, "log prefix \"{prefix}\" group {group} ")?;
                }
                write!(f, "{fin}")?;
                match comment {
                    Some(c) => write!(f, " comment \"{c}\""),
                    None => Ok(()),
                }
            }
        }
    }
}

/// The table's contents: every set (and vmap) with its elements in nft's
/// syntax, every rule set chain with its rules. The forward chain and the
/// vmap declarations are fixed (see [`base_hash`]).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Model {
    pub(super) sets: BTreeMap<String, BTreeSet<String>>,
    pub(super) chains: BTreeMap<String, Vec<Rule>>,
}

fn addr_str(v: u128, v6: bool) -> String {
    if v6 {
        Ipv6Addr::from(v).to_string()
    } else {
        Ipv4Addr::from(v as u32).to_string()
    }
}

fn ports_str(lo: u16, hi: u16) -> String {
    if lo == hi {
        lo.to_string()
    } else {
        format!("{lo}-{hi}")
    }
}

/// A comment nft takes inside double quotes, within its 128-byte limit.
fn comment(s: &str) -> String {
    let mut c: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || " ._/,:-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if c.len() > 120 {
        c.truncate(117);
        c.push_str("...");
    }
    c
}

/// The rules that report what reaches them (see [`Flows`]) and end with
/// `fin`, the flow sets of `chain` first declared in `m`.
fn report(
    m: &mut Model,
    sets_of: &str,
    flows: &Flows,
    tag: String,
    pod_src: bool,
    fin: Fin,
    comment: Option<String>,
) -> Vec<Rule> {
    for (k, _, _) in FLOW_SETS {
        for fam in [4, 6] {
            m.sets.entry(format!("{sets_of}_{k}{fam}")).or_default();
        }
    }
    let mut rules = Vec::new();
    for v6 in [false, true] {
        let fam = if v6 { 6 } else { 4 };
        rules.push(Rule::Seen {
            v6,
            set: format!("{sets_of}_seen{fam}"),
            fin,
        });
    }
    for v6 in [false, true] {
        let fam = if v6 { 6 } else { 4 };
        rules.push(Rule::Over {
            v6,
            src: pod_src,
            rl: format!("{sets_of}_rl{fam}"),
            sup: format!("{sets_of}_sup{fam}"),
            rate: flows.rate.max(1),
            fin,
        });
    }
    for v6 in [false, true] {
        let fam = if v6 { 6 } else { 4 };
        rules.push(Rule::Report {
            v6,
            seen: format!("{sets_of}_seen{fam}"),
            prefix: tag.clone(),
            group: flows.group,
            fin,
        });
    }
    rules.push(Rule::End {
        log: Some((tag, flows.group)),
        fin,
        comment,
    });
    rules
}

/// The chain of a rule set's allow events.
pub(super) fn allow_chain(chain: &str) -> String {
    format!("{chain}_ok")
}

impl Model {
    pub(super) fn build(
        pods: &BTreeMap<String, PodRecord>,
        desired: &Desired,
        flows: &Flows,
    ) -> Model {
        let mut m = Model::default();
        for v in VMAPS {
            m.sets.insert(v.to_string(), BTreeSet::new());
        }
        // Addresses per identity: the peers of every rule set naming it.
        let mut by_identity: BTreeMap<u32, BTreeSet<IpAddr>> = BTreeMap::new();
        for (key, pp) in &desired.pods {
            if let Some(rec) = pods.get(key) {
                by_identity
                    .entry(pp.identity)
                    .or_default()
                    .extend(&rec.addrs);
            }
        }
        // Two attachments claiming one address (a misconfiguration) would
        // make conflicting vmap elements; the first keeps it.
        let mut seen: BTreeSet<(&str, IpAddr)> = BTreeSet::new();
        for (key, pp) in &desired.pods {
            let Some(rec) = pods.get(key) else { continue };
            for (vmap, rs) in [("from_pod", pp.egress), ("to_pod", pp.ingress)] {
                let Some(set) = desired.rulesets.get(&rs) else {
                    continue;
                };
                let chain = chain_name(rs, set.dir);
                for a in &rec.addrs {
                    if !seen.insert((vmap, *a)) {
                        continue;
                    }
                    let fam = if a.is_ipv6() { 6 } else { 4 };
                    m.sets
                        .get_mut(&format!("{vmap}{fam}"))
                        .expect("vmaps inserted above")
                        .insert(format!("{a} : jump {chain}"));
                }
            }
        }
        for (n, rs) in &desired.rulesets {
            let chain = chain_name(*n, rs.dir);
            let mut sets: BTreeMap<(bool, &str), BTreeSet<String>> = BTreeMap::new();
            for v6 in [false, true] {
                for (_, k) in KINDS {
                    sets.insert((v6, k), BTreeSet::new());
                }
            }
            let empty = BTreeSet::new();
            // Addresses of this node's pods (by identity) and of other
            // nodes' pods; compile keeps the two apart, and ports per
            // address are merged, so no two elements overlap.
            let by_addr = rs
                .peers
                .iter()
                .flat_map(|(id, ports)| {
                    by_identity
                        .get(id)
                        .unwrap_or(&empty)
                        .iter()
                        .map(move |a| (a, ports))
                })
                .chain(rs.remote.iter());
            for (a, ports) in by_addr {
                let v6 = a.is_ipv6();
                match ports {
                    Ports::All => {
                        sets.get_mut(&(v6, "pod"))
                            .expect("all kinds")
                            .insert(a.to_string());
                    }
                    Ports::Ranges(r) => {
                        let s = sets.get_mut(&(v6, "podp")).expect("all kinds");
                        for p in r {
                            s.insert(format!("{a} . {} . {}", p.proto, ports_str(p.lo, p.hi)));
                        }
                    }
                }
            }
            for v6 in [false, true] {
                for (lo, hi, ports) in rs.intervals(v6) {
                    let range = if lo == hi {
                        addr_str(lo, v6)
                    } else {
                        format!("{}-{}", addr_str(lo, v6), addr_str(hi, v6))
                    };
                    match ports {
                        Ports::All => {
                            sets.get_mut(&(v6, "net")).expect("all kinds").insert(range);
                        }
                        Ports::Ranges(r) => {
                            let s = sets.get_mut(&(v6, "netp")).expect("all kinds");
                            for p in r {
                                s.insert(format!(
                                    "{range} . {} . {}",
                                    p.proto,
                                    ports_str(p.lo, p.hi)
                                ));
                            }
                        }
                    }
                }
            }
            let src = rs.dir == Dir::Ingress;
            let allow_events = flows.events == FlowEvents::All;
            let goto = allow_events.then(|| allow_chain(&chain));
            let mut rules = Vec::new();
            for v6 in [false, true] {
                let fam = if v6 { 6u8 } else { 4u8 };
                for (kind, k) in KINDS {
                    if sets[&(v6, k)].is_empty() {
                        continue;
                    }
                    rules.push(Rule::Allow {
                        v6,
                        src,
                        ports: matches!(kind, SetKind::PodPorts | SetKind::NetPorts),
                        set: set_name(&chain, k, fam),
                        goto: goto.clone(),
                    });
                }
            }
            let note = comment(&format!("{}: {}", rs.dir.as_str(), rs.policies.join(", ")));
            // The policed pod: the receiver's policy decides ingress.
            let pod_src = rs.dir == Dir::Egress;
            let (verdict, fin) = if rs.audit {
                ("audit", Fin::Return)
            } else {
                ("deny", Fin::Drop)
            };
            if flows.events == FlowEvents::None {
                rules.push(Rule::End {
                    log: None,
                    fin,
                    comment: Some(note),
                });
            } else {
                let tag = log_prefix(verdict, rs.dir, *n);
                rules.extend(report(&mut m, &chain, flows, tag, pod_src, fin, Some(note)));
            }
            if let Some(ok) = goto {
                let tag = log_prefix("allow", rs.dir, *n);
                let r = report(&mut m, &chain, flows, tag, pod_src, Fin::Return, None);
                m.chains.insert(ok, r);
            }
            for ((v6, k), elems) in sets {
                let fam = if v6 { 6u8 } else { 4u8 };
                m.sets.insert(set_name(&chain, k, fam), elems);
            }
            m.chains.insert(chain, rules);
        }
        m
    }
}

/// What the fixed part of the table looks like; an `applied` made with a
/// different one is rewritten in full.
fn base_hash() -> String {
    let mut s = format!("{FORMAT}\n{FORWARD_HOOK}\n");
    for r in FORWARD_RULES {
        s.push_str(r);
        s.push('\n');
    }
    short_hash(s.as_bytes())
}

fn chain_hash(rules: &[Rule]) -> String {
    let text: Vec<String> = rules.iter().map(Rule::to_string).collect();
    short_hash(text.join("\n").as_bytes())
}

/// The shape of `applied` (ours alone). The same with either writer (nft
/// text before, nfnetlink now): both leave the same table.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Applied {
    format: u32,
    table: String,
    base: String,
    /// Every set and vmap with its elements as written.
    sets: BTreeMap<String, BTreeSet<String>>,
    /// Every rule set chain with the hash of its rules.
    chains: BTreeMap<String, String>,
    /// Attachment key -> whether its host veth is a bridge port (looked up
    /// once per attachment).
    #[serde(default)]
    pub(super) bridged: BTreeMap<String, bool>,
}

impl Applied {
    /// What applying `m` to `table` leaves behind.
    pub(super) fn of(table: String, m: Model, bridged: BTreeMap<String, bool>) -> Applied {
        Applied {
            format: FORMAT,
            table,
            base: base_hash(),
            chains: m
                .chains
                .iter()
                .map(|(n, r)| (n.clone(), chain_hash(r)))
                .collect(),
            sets: m.sets,
            bridged,
        }
    }

    /// The previous state, if it describes this table in this layout.
    pub(super) fn usable(v: &Value, table: &str) -> Option<Applied> {
        let a: Applied = serde_json::from_value(v.clone()).ok()?;
        (a.format == FORMAT && a.table == table && a.base == base_hash()).then_some(a)
    }
}

/// One step of a transaction on the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Op {
    AddTable,
    DeleteTable,
    /// Declares the set or map of that name (see [`set_decl`]).
    AddSet(String),
    AddChain(String),
    /// The forward base chain with its fixed rules.
    AddForward,
    AddElements(String, Vec<String>),
    DeleteElements(String, Vec<String>),
    FlushSet(String),
    DeleteSet(String),
    AddRules(String, Vec<Rule>),
    FlushChain(String),
    DeleteChain(String),
}

/// The whole table, replacing whatever is there under its name (the
/// `add` first makes the `delete` valid when there is none).
pub(super) fn full(m: &Model) -> Vec<Op> {
    let mut ops = vec![Op::AddTable, Op::DeleteTable, Op::AddTable];
    ops.extend(m.sets.keys().map(|n| Op::AddSet(n.clone())));
    ops.extend(m.chains.keys().map(|n| Op::AddChain(n.clone())));
    ops.push(Op::AddForward);
    // Rule set sets before their chains' rules, chains before the vmap
    // elements jumping to them.
    for (name, elems) in m.sets.iter().filter(|(n, _)| !VMAPS.contains(&n.as_str())) {
        add_elements(&mut ops, name, elems.iter());
    }
    for (name, rules) in &m.chains {
        ops.push(Op::AddRules(name.clone(), rules.clone()));
    }
    for v in VMAPS {
        add_elements(&mut ops, v, m.sets[v].iter());
    }
    ops
}

fn add_elements<'a>(ops: &mut Vec<Op>, set: &str, elems: impl Iterator<Item = &'a String>) {
    let v: Vec<String> = elems.cloned().collect();
    if !v.is_empty() {
        ops.push(Op::AddElements(set.to_string(), v));
    }
}

/// Only what changed from `prev`, ordered so that every step finds what it
/// refers to: new sets and chains, set contents, chain rules, vmap
/// elements (which jump to chains), then removed chains and sets (whose
/// references are gone by then). Empty when nothing changed.
fn incremental(prev: &Applied, m: &Model) -> Vec<Op> {
    let mut ops = Vec::new();
    let is_vmap = |n: &str| VMAPS.contains(&n);
    for (name, elems) in &m.sets {
        if !prev.sets.contains_key(name) {
            ops.push(Op::AddSet(name.clone()));
            add_elements(&mut ops, name, elems.iter());
        }
    }
    for name in m.chains.keys() {
        if !prev.chains.contains_key(name) {
            ops.push(Op::AddChain(name.clone()));
        }
    }
    let diff = |ops: &mut Vec<Op>, name: &str, elems: &BTreeSet<String>| {
        let Some(old) = prev.sets.get(name) else {
            return;
        };
        let gone: Vec<String> = old.difference(elems).cloned().collect();
        let interval = set_decl(name).is_some_and(|d| d.interval);
        if interval && !gone.is_empty() {
            // Interval sets reject overlaps, and a removal next to an
            // addition in one transaction has had kernel bugs: rewrite.
            ops.push(Op::FlushSet(name.to_string()));
            add_elements(ops, name, elems.iter());
        } else {
            if !gone.is_empty() {
                ops.push(Op::DeleteElements(name.to_string(), gone));
            }
            add_elements(ops, name, elems.difference(old));
        }
    };
    for (name, elems) in m.sets.iter().filter(|(n, _)| !is_vmap(n)) {
        diff(&mut ops, name, elems);
    }
    for (name, rules) in &m.chains {
        match prev.chains.get(name) {
            Some(h) if *h == chain_hash(rules) => {}
            Some(_) => {
                ops.push(Op::FlushChain(name.clone()));
                ops.push(Op::AddRules(name.clone(), rules.clone()));
            }
            None => ops.push(Op::AddRules(name.clone(), rules.clone())),
        }
    }
    for v in VMAPS {
        diff(&mut ops, v, &m.sets[v]);
    }
    for name in prev.chains.keys().filter(|c| !m.chains.contains_key(*c)) {
        ops.push(Op::FlushChain(name.clone()));
        ops.push(Op::DeleteChain(name.clone()));
    }
    for name in prev.sets.keys().filter(|n| !m.sets.contains_key(*n)) {
        ops.push(Op::DeleteSet(name.clone()));
    }
    ops
}

/// The steps taking the table from `prev` (or from anything, when `None`)
/// to `m`, and whether they are a full rewrite.
pub(super) fn plan(prev: Option<&Applied>, m: &Model) -> (Vec<Op>, bool) {
    match prev {
        Some(p) => (incremental(p, m), false),
        None => (full(m), true),
    }
}
