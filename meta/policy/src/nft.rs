//! The nftables backend: one table per network in the node namespace,
//! written with `nft -f -` (one atomic transaction per change).
//!
//! ```text
//! table inet rcni_policy_<network> {
//!     map from_pod4 { type ipv4_addr : verdict; }   # pod address -> jump eg_<rs>
//!     map from_pod6 { type ipv6_addr : verdict; }
//!     map to_pod4   { type ipv4_addr : verdict; }   # pod address -> jump in_<rs>
//!     map to_pod6   { type ipv6_addr : verdict; }
//!     chain forward {
//!         type filter hook forward priority filter; policy accept;
//!         ct state established,related accept
//!         icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert } accept
//!         ip saddr vmap @from_pod4
//!         ip6 saddr vmap @from_pod6
//!         ip daddr vmap @to_pod4
//!         ip6 daddr vmap @to_pod6
//!     }
//!     set in_3_pod4  { type ipv4_addr; }                                    # identity peers, any port
//!     set in_3_pod4p { type ipv4_addr . inet_proto . inet_service; flags interval; }
//!     set in_3_net4  { type ipv4_addr; flags interval; }                    # RuleSet::intervals
//!     set in_3_net4p { type ipv4_addr . inet_proto . inet_service; flags interval; }
//!     ... the same four for IPv6 ...
//!     chain in_3 {
//!         ip saddr @in_3_pod4 return
//!         ip saddr . meta l4proto . th dport @in_3_pod4p return
//!         ...                                  # a rule only for each non-empty set
//!         drop comment "ingress: default/web"
//!     }
//!     chain eg_4 { ... the same on daddr ... }
//! }
//! ```
//!
//! Pods are found by address, not by interface name: with the bridge
//! plugin, pod-to-pod traffic reaches the inet forward hook through
//! br_netfilter, which presents the bridge (`cni0`) as both `iifname` and
//! `oifname`, never the pod's veth; addresses name the pod on bridged and
//! routed (ptp) attachments alike. A pod-to-pod packet runs through the
//! sender's egress chain and then the receiver's ingress chain; each
//! `return`s when allowed and drops otherwise. Replies pass on the
//! conntrack rule; traffic between a pod and its node is INPUT/OUTPUT and
//! never meets this table. Neighbour solicitations and advertisements are
//! let through because bridged IPv6 needs them the way IPv4 needs ARP
//! (which no inet hook sees).
//!
//! Peers never become one rule each: a rule set has a fixed number of
//! rules, and its peers are elements of its sets. What was applied is kept
//! in the caller's `applied` value (every set's elements, every chain's
//! hash), so a change writes only the difference: a pod with known labels
//! adds its vmap elements and its addresses to the sets of the rule sets
//! that allow its identity, nothing else.

use crate::compile::{Desired, PodPolicy, Ports};
use crate::model::Dir;
use crate::state::PodRecord;
use rcni_cni::{CniError, ErrorCode};
use rcni_netns::NetNs;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

const TABLE_PREFIX: &str = "rcni_policy_";
/// Longest network name used verbatim in the table name; longer ones are
/// cut and made unique by a hash (nft names are at most 255 bytes).
const MAX_VERBATIM: usize = 200;
/// Elements per `add element` command: keeps lines (and nft's error
/// excerpts) short on big sets.
const ELEMENTS_PER_LINE: usize = 256;
/// Bumped when the layout changes, so an old `applied` forces a rewrite.
const FORMAT: u32 = 1;

/// The vmaps of the forward chain; they live as long as the table.
const VMAPS: [&str; 4] = ["from_pod4", "from_pod6", "to_pod4", "to_pod6"];

const FORWARD_RULES: &[&str] = &[
    "ct state established,related accept",
    "icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert } accept",
    "ip saddr vmap @from_pod4",
    "ip6 saddr vmap @from_pod6",
    "ip daddr vmap @to_pod4",
    "ip6 daddr vmap @to_pod6",
];
const FORWARD_HOOK: &str = "type filter hook forward priority filter; policy accept;";

/// The table of `network`. CNI names match `[a-zA-Z0-9][a-zA-Z0-9_.-]*`,
/// all of which nft takes in an identifier after our prefix; anything else
/// (or a very long name) is replaced and disambiguated by a hash, so two
/// networks never share a table.
pub fn table_name(network: &str) -> String {
    let plain = network
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if plain && !network.is_empty() && network.len() <= MAX_VERBATIM {
        return format!("{TABLE_PREFIX}{network}");
    }
    let clean: String = network
        .chars()
        .take(MAX_VERBATIM)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{TABLE_PREFIX}{clean}_{}", short_hash(network.as_bytes()))
}

fn short_hash(b: &[u8]) -> String {
    Sha256::digest(b)[..8]
        .iter()
        .fold(String::new(), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

fn netfilter(msg: impl Into<String>) -> CniError {
    CniError::new(ErrorCode::Netfilter, msg)
}

// ---- what the table should hold --------------------------------------

/// The four sets of one family of a rule set, in rule order.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SetKind {
    /// Identity peers allowed everything: their addresses.
    Pod,
    /// Identity peers with port ranges: address . protocol . ports.
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

/// A set's declaration, from its name (which encodes kind and family), and
/// whether it is an interval set.
fn set_decl(name: &str) -> Option<(&'static str, String, bool)> {
    if VMAPS.contains(&name) {
        let t = if name.ends_with('4') {
            "ipv4_addr"
        } else {
            "ipv6_addr"
        };
        return Some(("map", format!("type {t} : verdict;"), false));
    }
    let (_, suffix) = name.rsplit_once('_')?;
    let (kind, fam) = match suffix {
        "pod4" | "pod6" => (SetKind::Pod, &suffix[3..]),
        "pod4p" | "pod6p" => (SetKind::PodPorts, &suffix[3..4]),
        "net4" | "net6" => (SetKind::Net, &suffix[3..]),
        "net4p" | "net6p" => (SetKind::NetPorts, &suffix[3..4]),
        _ => return None,
    };
    let addr = if fam == "4" { "ipv4_addr" } else { "ipv6_addr" };
    Some(match kind {
        SetKind::Pod => ("set", format!("type {addr};"), false),
        SetKind::Net => ("set", format!("type {addr}; flags interval;"), true),
        SetKind::PodPorts | SetKind::NetPorts => (
            "set",
            format!("type {addr} . inet_proto . inet_service; flags interval;"),
            true,
        ),
    })
}

/// `in_3` + `podp` + 4 -> `in_3_pod4p`.
fn set_name(chain: &str, kind: &str, fam: u8) -> String {
    format!("{chain}_{}{fam}{}", &kind[..3], &kind[3..])
}

fn chain_name(rs: u32, dir: Dir) -> String {
    match dir {
        Dir::Ingress => format!("in_{rs}"),
        Dir::Egress => format!("eg_{rs}"),
    }
}

/// The table's contents: every set (and vmap) with its elements, every
/// rule set chain with its rules. The forward chain and the vmap
/// declarations are fixed (see [`base_hash`]).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Model {
    sets: BTreeMap<String, BTreeSet<String>>,
    chains: BTreeMap<String, Vec<String>>,
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

impl Model {
    fn build(pods: &BTreeMap<String, PodRecord>, desired: &Desired) -> Model {
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
            for (id, ports) in &rs.peers {
                for a in by_identity.get(id).unwrap_or(&empty) {
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
            let field = match rs.dir {
                Dir::Ingress => "saddr",
                Dir::Egress => "daddr",
            };
            let mut rules = Vec::new();
            for v6 in [false, true] {
                let (ip, fam) = if v6 { ("ip6", 6u8) } else { ("ip", 4u8) };
                for (kind, k) in KINDS {
                    if sets[&(v6, k)].is_empty() {
                        continue;
                    }
                    let set = set_name(&chain, k, fam);
                    rules.push(match kind {
                        SetKind::Pod | SetKind::Net => format!("{ip} {field} @{set} return"),
                        SetKind::PodPorts | SetKind::NetPorts => {
                            format!("{ip} {field} . meta l4proto . th dport @{set} return")
                        }
                    });
                }
            }
            rules.push(format!(
                "drop comment \"{}\"",
                comment(&format!("{}: {}", rs.dir.as_str(), rs.policies.join(", ")))
            ));
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

fn chain_hash(rules: &[String]) -> String {
    short_hash(rules.join("\n").as_bytes())
}

/// The shape of `applied` (ours alone).
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Applied {
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
    bridged: BTreeMap<String, bool>,
}

impl Applied {
    /// What applying `m` to `table` leaves behind.
    fn of(table: String, m: Model, bridged: BTreeMap<String, bool>) -> Applied {
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
    fn usable(v: &Value, table: &str) -> Option<Applied> {
        let a: Applied = serde_json::from_value(v.clone()).ok()?;
        (a.format == FORMAT && a.table == table && a.base == base_hash()).then_some(a)
    }
}

// ---- scripts ----------------------------------------------------------

fn add_elements(s: &mut String, table: &str, set: &str, elems: &BTreeSet<String>) {
    let v: Vec<&String> = elems.iter().collect();
    for chunk in v.chunks(ELEMENTS_PER_LINE) {
        let list: Vec<&str> = chunk.iter().map(|e| e.as_str()).collect();
        let _ = writeln!(
            s,
            "add element inet {table} {set} {{ {} }}",
            list.join(", ")
        );
    }
}

/// Element keys (a map element is deleted by its key alone).
fn delete_elements(s: &mut String, table: &str, set: &str, elems: &BTreeSet<&String>) {
    let v: Vec<&str> = elems
        .iter()
        .map(|e| e.split_once(" : ").map_or(e.as_str(), |(k, _)| k))
        .collect();
    for chunk in v.chunks(ELEMENTS_PER_LINE) {
        let _ = writeln!(
            s,
            "delete element inet {table} {set} {{ {} }}",
            chunk.join(", ")
        );
    }
}

fn add_set(s: &mut String, table: &str, name: &str) {
    let (kw, decl, _) = set_decl(name).expect("names come from Model::build");
    let _ = writeln!(s, "add {kw} inet {table} {name} {{ {decl} }}");
}

fn add_rules(s: &mut String, table: &str, chain: &str, rules: &[String]) {
    for r in rules {
        let _ = writeln!(s, "add rule inet {table} {chain} {r}");
    }
}

/// The whole table, replacing whatever is there under its name (the
/// `add` first makes the `delete` valid when there is none).
fn full_script(table: &str, m: &Model) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "add table inet {table}");
    let _ = writeln!(s, "delete table inet {table}");
    let _ = writeln!(s, "add table inet {table}");
    for name in m.sets.keys() {
        add_set(&mut s, table, name);
    }
    for name in m.chains.keys() {
        let _ = writeln!(s, "add chain inet {table} {name}");
    }
    let _ = writeln!(s, "add chain inet {table} forward {{ {FORWARD_HOOK} }}");
    add_rules(
        &mut s,
        table,
        "forward",
        &FORWARD_RULES
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>(),
    );
    // Rule set sets before their chains' rules, chains before the vmap
    // elements jumping to them.
    for (name, elems) in m.sets.iter().filter(|(n, _)| !VMAPS.contains(&n.as_str())) {
        add_elements(&mut s, table, name, elems);
    }
    for (name, rules) in &m.chains {
        add_rules(&mut s, table, name, rules);
    }
    for v in VMAPS {
        add_elements(&mut s, table, v, &m.sets[v]);
    }
    s
}

/// Only what changed from `prev`, ordered so that every command finds
/// what it refers to: new sets and chains, set contents, chain rules, vmap
/// elements (which jump to chains), then removed chains and sets (whose
/// references are gone by then). Empty when nothing changed.
fn incremental_script(table: &str, prev: &Applied, m: &Model) -> String {
    let mut s = String::new();
    let is_vmap = |n: &str| VMAPS.contains(&n);
    for (name, elems) in &m.sets {
        if !prev.sets.contains_key(name) {
            add_set(&mut s, table, name);
            add_elements(&mut s, table, name, elems);
        }
    }
    for name in m.chains.keys() {
        if !prev.chains.contains_key(name) {
            let _ = writeln!(s, "add chain inet {table} {name}");
        }
    }
    let diff = |s: &mut String, name: &str, elems: &BTreeSet<String>| {
        let Some(old) = prev.sets.get(name) else {
            return;
        };
        let gone: BTreeSet<&String> = old.difference(elems).collect();
        let new: BTreeSet<String> = elems.difference(old).cloned().collect();
        let interval = set_decl(name).is_some_and(|(_, _, i)| i);
        if interval && !gone.is_empty() {
            // Interval sets reject overlaps, and a removal next to an
            // addition in one transaction has had kernel bugs: rewrite.
            let _ = writeln!(s, "flush set inet {table} {name}");
            add_elements(s, table, name, elems);
        } else {
            if !gone.is_empty() {
                delete_elements(s, table, name, &gone);
            }
            add_elements(s, table, name, &new);
        }
    };
    for (name, elems) in m.sets.iter().filter(|(n, _)| !is_vmap(n)) {
        diff(&mut s, name, elems);
    }
    for (name, rules) in &m.chains {
        match prev.chains.get(name) {
            Some(h) if *h == chain_hash(rules) => {}
            Some(_) => {
                let _ = writeln!(s, "flush chain inet {table} {name}");
                add_rules(&mut s, table, name, rules);
            }
            None => add_rules(&mut s, table, name, rules),
        }
    }
    for v in VMAPS {
        diff(&mut s, v, &m.sets[v]);
    }
    for name in prev.chains.keys().filter(|c| !m.chains.contains_key(*c)) {
        let _ = writeln!(s, "flush chain inet {table} {name}");
        let _ = writeln!(s, "delete chain inet {table} {name}");
    }
    for name in prev.sets.keys().filter(|n| !m.sets.contains_key(*n)) {
        let kw = set_decl(name).map_or("set", |(kw, _, _)| kw);
        let _ = writeln!(s, "delete {kw} inet {table} {name}");
    }
    s
}

/// The script taking the table from `prev` (or from anything, when `None`)
/// to `m`, and whether it is a full rewrite.
fn plan(table: &str, prev: Option<&Applied>, m: &Model) -> (String, bool) {
    match prev {
        Some(p) => (incremental_script(table, p, m), false),
        None => (full_script(table, m), true),
    }
}

// ---- running nft ------------------------------------------------------

fn current_ns() -> Result<NetNs, CniError> {
    NetNs::current()
        .map_err(|e| CniError::new(ErrorCode::Netns, format!("policy: open current netns: {e}")))
}

/// Runs nft with `args` (and `stdin`) in the current namespace: the output
/// on success, or (stderr, the error) on failure.
fn nft(args: &[&str], stdin: Option<&str>) -> Result<Result<String, (String, CniError)>, CniError> {
    let ns = current_ns()?;
    let out = rcni_netfilter::exec::run(&ns, "nft", args, stdin)
        .map_err(|e| netfilter(format!("policy: {e}")))?;
    if out.success {
        return Ok(Ok(out.stdout));
    }
    let mut err = out.stderr.trim().to_string();
    // nft quotes the offending line itself; a whole rewrite script would
    // drown it.
    if err.len() > 4000 {
        let mut cut = 4000;
        while !err.is_char_boundary(cut) {
            cut -= 1;
        }
        err.truncate(cut);
        err.push_str("...");
    }
    let e = netfilter(format!(
        "policy: nft {} failed ({}): {err}",
        args.join(" "),
        out.status
    ));
    Ok(Err((out.stderr, e)))
}

fn run_script(script: &str) -> Result<(), CniError> {
    nft(&["-f", "-"], Some(script))?
        .map(|_| ())
        .map_err(|(_, e)| e)
}

// ---- br_netfilter -----------------------------------------------------

/// Whether each attachment's host veth is a bridge port. A veth that is
/// gone is not (its pod is on its way out).
fn bridged_ports(ports: &[(String, String)]) -> Result<Vec<(String, bool)>, CniError> {
    // A thread of our own for the runtime, in case the caller runs in one
    // already; it inherits this thread's network namespace.
    std::thread::scope(|sc| {
        sc.spawn(|| -> Result<Vec<(String, bool)>, CniError> {
            let rt = rcni_netlink::runtime()?;
            rt.block_on(async {
                let nl = rcni_netlink::Netlink::connect_current().await?;
                let mut out = Vec::with_capacity(ports.len());
                for (key, ifname) in ports {
                    let link = match nl.link_by_name(ifname).await {
                        Ok(l) => l,
                        Err(e) if e.is_not_found() => {
                            out.push((key.clone(), false));
                            continue;
                        }
                        Err(e) => return Err(e.into()),
                    };
                    let bridged = match link.master {
                        None => false,
                        Some(m) => match nl.link_by_index(m).await {
                            Ok(master) => master.kind.as_deref() == Some("bridge"),
                            Err(e) if e.is_not_found() => false,
                            Err(e) => return Err(e.into()),
                        },
                    };
                    out.push((key.clone(), bridged));
                }
                Ok(out)
            })
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

const BRIDGE_SYSCTLS: [&str; 2] = [
    "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
];

/// Bridged pod-to-pod traffic meets the inet forward hook only through
/// br_netfilter, with these (per-namespace) sysctls on; without them the
/// policy would silently not apply to pods on the same bridge.
fn ensure_bridge_netfilter() -> Result<(), CniError> {
    let ns = current_ns()?;
    // /proc/sys/net resolves against the calling thread's namespace.
    let present = || std::path::Path::new("/proc/sys/net/bridge").is_dir();
    if !present() {
        if let Some(modprobe) = rcni_netfilter::exec::find_tool("modprobe") {
            let _ = std::process::Command::new(modprobe)
                .arg("br_netfilter")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status();
        }
        if !present() {
            return Err(netfilter(
                "policy: pods are attached to a bridge but br_netfilter is not available \
                 (/proc/sys/net/bridge is missing and `modprobe br_netfilter` did not help): \
                 traffic between them would bypass the nftables policy",
            ));
        }
    }
    for key in BRIDGE_SYSCTLS {
        let cur = rcni_netlink::sysctl::get(&ns, key).map_err(CniError::from)?;
        if cur != "1" {
            rcni_netlink::sysctl::set(&ns, key, "1")
                .map_err(|e| netfilter(format!("policy: bridged pods need {key}=1: {e}")))?;
        }
    }
    Ok(())
}

// ---- API --------------------------------------------------------------

/// Makes the network's table enforce `desired` for `pods` (by attachment
/// key), in the current network namespace. `applied` is what the last call
/// left there (null or unreadable: the table is rewritten in full); it is
/// updated on success only.
pub fn apply(
    network: &str,
    pods: &BTreeMap<String, PodRecord>,
    desired: &Desired,
    applied: &mut Value,
) -> Result<(), CniError> {
    let table = table_name(network);
    if desired.pods.is_empty() {
        remove_network(network)?;
        *applied = Value::Null;
        return Ok(());
    }
    let prev = Applied::usable(applied, &table);
    let mut bridged: BTreeMap<String, bool> =
        prev.as_ref().map(|p| p.bridged.clone()).unwrap_or_default();
    bridged.retain(|k, _| desired.pods.contains_key(k));
    // Without a selected pod, nothing is dropped and bridging is moot; the
    // lookups wait for the first policy.
    if !desired.rulesets.is_empty() {
        let unknown: Vec<(String, String)> = desired
            .pods
            .keys()
            .filter(|k| !bridged.contains_key(*k))
            .filter_map(|k| pods.get(k).map(|r| (k.clone(), r.host_ifname.clone())))
            .collect();
        if !unknown.is_empty() {
            bridged.extend(bridged_ports(&unknown)?);
        }
        if bridged.values().any(|b| *b) {
            ensure_bridge_netfilter()?;
        }
    }
    let model = Model::build(pods, desired);
    let (script, full) = plan(&table, prev.as_ref(), &model);
    if !script.is_empty()
        && let Err(e) = run_script(&script)
    {
        if full {
            return Err(e);
        }
        // The kernel is not what `applied` says (the table was removed,
        // the node rebooted, someone edited it): start over.
        run_script(&full_script(&table, &model))?;
    }
    let new = Applied::of(table, model, bridged);
    *applied = serde_json::to_value(new).map_err(|e| CniError::internal(e.to_string()))?;
    Ok(())
}

/// Deletes the network's table; a missing one is fine (DEL and GC repeat).
pub fn remove_network(network: &str) -> Result<(), CniError> {
    let table = table_name(network);
    // `add` first makes the `delete` valid when there is no table (nft
    // 1.0.6 has no `destroy`), in one transaction.
    run_script(&format!(
        "add table inet {table}\ndelete table inet {table}\n"
    ))
}

/// What `nft -j list table` says about the parts CHECK looks at.
#[derive(Debug, Default)]
struct Listing {
    /// vmap -> address -> target chain.
    vmaps: BTreeMap<String, BTreeMap<IpAddr, String>>,
    chains: BTreeMap<String, Option<String>>,
}

fn parse_listing(json: &str) -> Result<Listing, String> {
    let mut l = Listing::default();
    for item in &rcni_netfilter::nft_listing_items(json)? {
        if let Some(c) = item.get("chain") {
            l.chains.insert(
                c["name"].as_str().unwrap_or_default().to_string(),
                c["hook"].as_str().map(String::from),
            );
        } else if let Some(m) = item.get("map") {
            let name = m["name"].as_str().unwrap_or_default().to_string();
            let mut elems = BTreeMap::new();
            for e in m["elem"].as_array().map(Vec::as_slice).unwrap_or_default() {
                let (Some(k), Some(t)) = (
                    e[0].as_str().and_then(|s| s.parse::<IpAddr>().ok()),
                    e[1]["jump"]["target"].as_str(),
                ) else {
                    continue;
                };
                elems.insert(k, t.to_string());
            }
            l.vmaps.insert(name, elems);
        }
    }
    Ok(l)
}

/// What differs between the table and what `pod` with `policy` needs.
fn problems(l: &Listing, table: &str, pod: &PodRecord, policy: &PodPolicy) -> Vec<String> {
    let mut out = Vec::new();
    if l.chains.get("forward").map(|h| h.as_deref()) != Some(Some("forward")) {
        out.push(format!(
            "table inet {table} has no forward chain on the forward hook"
        ));
    }
    for (vmap, rs, dir) in [
        ("from_pod", policy.egress, Dir::Egress),
        ("to_pod", policy.ingress, Dir::Ingress),
    ] {
        let want = (rs != 0).then(|| chain_name(rs, dir));
        if let Some(c) = &want
            && !l.chains.contains_key(c)
        {
            out.push(format!(
                "chain {c} ({} rule set {rs}) is missing",
                dir.as_str()
            ));
        }
        for a in &pod.addrs {
            let map = format!("{vmap}{}", if a.is_ipv6() { 6 } else { 4 });
            let got = l.vmaps.get(&map).and_then(|m| m.get(a));
            if got != want.as_ref() {
                out.push(format!(
                    "{map}[{a}] is {}, expected {}",
                    got.map_or("absent".to_string(), |c| format!("jump {c}")),
                    want.as_ref()
                        .map_or("absent".to_string(), |c| format!("jump {c}"))
                ));
            }
        }
    }
    out
}

/// Whether the table holds what `pod` needs: its vmap elements jump to the
/// chains of its rule sets (and only those), and the chains exist.
pub fn check(network: &str, pod: &PodRecord, policy: &PodPolicy) -> Result<(), CniError> {
    let table = table_name(network);
    let json = match nft(&["-j", "list", "table", "inet", &table], None)? {
        Ok(out) => out,
        Err((stderr, _)) if stderr.contains("No such file or directory") => {
            return Err(CniError::check_failed(format!(
                "policy: nftables table inet {table} does not exist"
            )));
        }
        Err((_, e)) => return Err(e),
    };
    let l = parse_listing(&json)
        .map_err(|e| netfilter(format!("policy: cannot read nft -j output: {e}")))?;
    let p = problems(&l, &table, pod, policy);
    if p.is_empty() {
        Ok(())
    } else {
        Err(CniError::check_failed(format!(
            "policy: {} (table inet {table}): {}",
            pod.host_ifname,
            p.join("; ")
        )))
    }
}

/// Whether nft runs here and may read the ruleset (STATUS, backend "auto").
pub fn available() -> Result<(), CniError> {
    nft(&["list", "tables"], None)?
        .map(|_| ())
        .map_err(|(_, e)| e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::{Ids, compile};
    use crate::model::PolicySet;
    use serde_json::json;

    fn record(
        key: &str,
        ns: &str,
        labels: &[(&str, &str)],
        addrs: &[&str],
        host: &str,
    ) -> (String, PodRecord) {
        let (cid, ifname) = key.split_once('/').unwrap();
        (
            key.to_string(),
            PodRecord {
                container_id: cid.into(),
                ifname: ifname.into(),
                namespace: ns.into(),
                labels: labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                addrs: addrs.iter().map(|a| a.parse().unwrap()).collect(),
                host_ifname: host.into(),
                host_ifindex: 0,
            },
        )
    }

    /// A pod of namespace "default" labelled app=`app`.
    fn app_pod(key: &str, app: &str, addrs: &[&str], host: &str) -> (String, PodRecord) {
        record(key, "default", &[("app", app)], addrs, host)
    }

    fn policies() -> PolicySet {
        let mut s = PolicySet::default();
        s.add_document(
            &json!({"name":"web","podSelector":{"matchLabels":{"app":"web"}},
            "ingress":[
                {"from":[{"podSelector":{"matchLabels":{"app":"client"}}}],
                 "ports":[{"port":80},{"port":8000,"endPort":8080},{"protocol":"UDP","port":53}]},
                {"from":[{"podSelector":{"matchLabels":{"app":"admin"}}}]},
                {"from":[{"ipBlock":{"cidr":"192.168.0.0/16","except":["192.168.1.0/24"]}}]}
            ]}),
            "t",
        )
        .unwrap();
        s.sort();
        s
    }

    /// What applying `m` to table T leaves behind, no bridge ports.
    fn applied(m: &Model) -> Applied {
        Applied::of("T".into(), m.clone(), BTreeMap::new())
    }

    fn compiled(pods: &BTreeMap<String, PodRecord>, ids: &mut Ids) -> Desired {
        let views = pods.iter().map(|(k, p)| (k.clone(), p.view())).collect();
        compile(&policies(), &views, ids).unwrap()
    }

    #[test]
    fn table_names_are_nft_identifiers_and_unique() {
        assert_eq!(table_name("my-net.v1_x"), "rcni_policy_my-net.v1_x");
        let odd = table_name("a b");
        assert!(odd.starts_with("rcni_policy_a_b_") && odd != table_name("a_b"));
        let long = "n".repeat(300);
        assert!(table_name(&long).len() < 230 && table_name(&long) != table_name(&long[..299]));
    }

    #[test]
    fn the_first_apply_writes_sets_chains_and_vmaps() {
        let pods: BTreeMap<_, _> = [
            app_pod("web/eth0", "web", &["10.0.0.2", "fd00::2"], "vweb"),
            app_pod("cli/eth0", "client", &["10.0.0.3", "fd00::3"], "vcli"),
        ]
        .into();
        let d = compiled(&pods, &mut Ids::default());
        let rs = d.pods["web/eth0"].ingress;
        assert_ne!(rs, 0);
        let m = Model::build(&pods, &d);
        let (s, full) = plan("T", None, &m);
        assert!(full);
        let c = format!("in_{rs}");
        for want in [
            "add table inet T\ndelete table inet T\nadd table inet T\n".to_string(),
            "add chain inet T forward { type filter hook forward priority filter; policy accept; }"
                .into(),
            "add rule inet T forward ct state established,related accept".into(),
            "add rule inet T forward ip daddr vmap @to_pod4".into(),
            format!(
                "add set inet T {c}_pod4p {{ type ipv4_addr . inet_proto . inet_service; flags interval; }}"
            ),
            format!("add set inet T {c}_net4 {{ type ipv4_addr; flags interval; }}"),
            // The client may use TCP 80 and 8000-8080 and UDP 53.
            format!(
                "add element inet T {c}_pod4p {{ 10.0.0.3 . 17 . 53, 10.0.0.3 . 6 . 80, 10.0.0.3 . 6 . 8000-8080 }}"
            ),
            format!(
                "add element inet T {c}_pod6p {{ fd00::3 . 17 . 53, fd00::3 . 6 . 80, fd00::3 . 6 . 8000-8080 }}"
            ),
            // 192.168.0.0/16 except 192.168.1.0/24, as two intervals.
            format!(
                "add element inet T {c}_net4 {{ 192.168.0.0-192.168.0.255, 192.168.2.0-192.168.255.255 }}"
            ),
            format!("add rule inet T {c} ip saddr . meta l4proto . th dport @{c}_pod4p return"),
            format!("add rule inet T {c} ip saddr @{c}_net4 return"),
            format!("add rule inet T {c} ip6 saddr . meta l4proto . th dport @{c}_pod6p return"),
            format!("add rule inet T {c} drop comment \"ingress: default/web\""),
            format!("add element inet T to_pod4 {{ 10.0.0.2 : jump {c} }}"),
            format!("add element inet T to_pod6 {{ fd00::2 : jump {c} }}"),
        ] {
            assert!(s.contains(&want), "missing {want:?} in\n{s}");
        }
        // Empty sets exist but get no rule; nobody is selected for egress.
        assert!(s.contains(&format!("add set inet T {c}_pod4 {{ type ipv4_addr; }}")));
        assert!(!s.contains(&format!("@{c}_pod4 ")) && !s.contains(&format!("@{c}_net6 ")));
        assert!(!s.contains("add element inet T from_pod"));
        // The client is not selected: no element sends it anywhere.
        assert!(!s.contains("10.0.0.3 : jump"));
        // Chains exist before the rules and vmap elements naming them.
        let pos = |x: &str| s.find(x).unwrap_or_else(|| panic!("{x} in\n{s}"));
        assert!(pos(&format!("add chain inet T {c}\n")) < pos(&format!("add rule inet T {c} ")));
        assert!(pos(&format!("add rule inet T {c} ")) < pos("add element inet T to_pod4"));
    }

    #[test]
    fn a_pod_with_known_labels_adds_elements_only() {
        let mut pods: BTreeMap<_, _> = [
            app_pod("web/eth0", "web", &["10.0.0.2"], "vweb"),
            app_pod("cli/eth0", "client", &["10.0.0.3", "fd00::3"], "vcli"),
            app_pod("adm/eth0", "admin", &["10.0.0.9"], "vadm"),
        ]
        .into();
        let mut ids = Ids::default();
        let d1 = compiled(&pods, &mut ids);
        let m1 = Model::build(&pods, &d1);
        let prev = applied(&m1);
        assert_eq!(
            plan("T", Some(&prev), &m1).0,
            "",
            "nothing changed, nothing to run"
        );
        // A second web pod and a second client: known identities.
        pods.extend([
            app_pod("web2/eth0", "web", &["10.0.0.4"], "vweb2"),
            app_pod("cli2/eth0", "client", &["10.0.0.5"], "vcli2"),
        ]);
        let d2 = compiled(&pods, &mut ids);
        assert_eq!(d2.rulesets, {
            // Peers are identities, so the rule sets do not change.
            d1.rulesets.clone()
        });
        let (s, full) = plan("T", Some(&prev), &Model::build(&pods, &d2));
        assert!(!full);
        let rs = d2.pods["web/eth0"].ingress;
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(
            lines,
            vec![
                format!(
                    "add element inet T in_{rs}_pod4p {{ 10.0.0.5 . 17 . 53, 10.0.0.5 . 6 . 80, 10.0.0.5 . 6 . 8000-8080 }}"
                ),
                format!("add element inet T to_pod4 {{ 10.0.0.4 : jump in_{rs} }}"),
            ],
            "{s}"
        );
        // A removed client takes its elements; an interval set is rewritten
        // rather than edited, a plain map loses the key.
        let m2 = Model::build(&pods, &d2);
        let prev2 = applied(&m2);
        pods.remove("cli2/eth0");
        pods.remove("web2/eth0");
        let d3 = compiled(&pods, &mut ids);
        let (s, _) = plan("T", Some(&prev2), &Model::build(&pods, &d3));
        assert!(
            s.contains(&format!("flush set inet T in_{rs}_pod4p\n")),
            "{s}"
        );
        assert!(
            s.contains("delete element inet T to_pod4 { 10.0.0.4 }"),
            "{s}"
        );
        assert!(!s.contains("chain"), "{s}");
        // The last admin pod goes: its identity leaves the rule set, whose
        // chain loses the rule for the now empty set.
        pods.remove("adm/eth0");
        let d4 = compiled(&pods, &mut ids);
        let (s, _) = plan("T", Some(&prev), &Model::build(&pods, &d4));
        assert!(s.contains(&format!("flush chain inet T in_{rs}\n")), "{s}");
        assert!(!s.contains(&format!("@in_{rs}_pod4 ")), "{s}");
        assert!(
            s.contains(&format!(
                "delete element inet T in_{rs}_pod4 {{ 10.0.0.9 }}"
            )),
            "{s}"
        );
    }

    #[test]
    fn a_rule_set_that_goes_takes_its_chain_and_sets_after_the_jumps() {
        let pods: BTreeMap<_, _> = [app_pod("web/eth0", "web", &["10.0.0.2"], "v")].into();
        let mut ids = Ids::default();
        let d = compiled(&pods, &mut ids);
        let m = Model::build(&pods, &d);
        let prev = applied(&m);
        let empty = compile(
            &PolicySet::default(),
            &pods.iter().map(|(k, p)| (k.clone(), p.view())).collect(),
            &mut ids,
        )
        .unwrap();
        let (s, _) = plan("T", Some(&prev), &Model::build(&pods, &empty));
        let rs = d.pods["web/eth0"].ingress;
        let pos = |x: &str| s.find(x).unwrap_or_else(|| panic!("{x} in\n{s}"));
        assert!(
            pos("delete element inet T to_pod4 { 10.0.0.2 }")
                < pos(&format!("delete chain inet T in_{rs}"))
        );
        assert!(
            pos(&format!("delete chain inet T in_{rs}"))
                < pos(&format!("delete set inet T in_{rs}_net4\n"))
        );
        // Stale or foreign `applied` values are not trusted.
        let v = serde_json::to_value(&prev).unwrap();
        assert!(Applied::usable(&v, "T").is_some());
        assert!(Applied::usable(&v, "U").is_none());
        assert!(Applied::usable(&json!({"sets": 1}), "T").is_none());
    }

    #[test]
    fn check_reads_vmaps_and_chains_from_the_json_listing() {
        let json = r#"{"nftables":[{"metainfo":{"version":"1.0.6"}},
            {"table":{"family":"inet","name":"T","handle":2}},
            {"map":{"family":"inet","name":"to_pod4","table":"T","type":"ipv4_addr","map":"verdict",
                    "elem":[["10.0.0.2",{"jump":{"target":"in_1"}}]]}},
            {"map":{"family":"inet","name":"from_pod4","table":"T","type":"ipv4_addr","map":"verdict"}},
            {"chain":{"family":"inet","table":"T","name":"forward","type":"filter","hook":"forward","prio":0,"policy":"accept"}},
            {"chain":{"family":"inet","table":"T","name":"in_1"}}]}"#;
        let l = parse_listing(json).unwrap();
        let (_, pod) = record("web/eth0", "default", &[], &["10.0.0.2"], "v");
        // Identity 1 with these rule sets.
        let problems_with = |ingress, egress| {
            let want = PodPolicy {
                identity: 1,
                ingress,
                egress,
            };
            problems(&l, "T", &pod, &want)
        };
        assert!(problems_with(1, 0).is_empty());
        let p = problems_with(1, 2);
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(
            p[0].contains("eg_2") && p[1].contains("from_pod4[10.0.0.2] is absent"),
            "{p:?}"
        );
        let p = problems_with(0, 0);
        assert!(
            p[0].contains("to_pod4[10.0.0.2] is jump in_1, expected absent"),
            "{p:?}"
        );
    }
}
