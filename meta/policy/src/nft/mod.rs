//! The nftables backend: one table per network in the node namespace,
//! written over nfnetlink (one atomic transaction per change, no `nft`
//! process).
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
//! With flow events on (`flowEvents`, default `deny`), each rule set chain
//! reports before its `drop` (audit rule sets: `return`) to the network's
//! NFLOG group, once per flow and within the policed pod's `flowRate`, and
//! `flowEvents: all` sends allowed new flows through an `_ok` chain that
//! reports them: see [`Flows`]; `crate::flows::nft` reads them.
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

//!
//! The parts: [`model`] (what the table should hold, what the last apply
//! left, the steps between them), [`messages`] (those steps as one
//! nfnetlink transaction), [`runner`] (the socket: writing, and reading
//! back for CHECK), [`br_netfilter`] (bridged pods). A test-only `script`
//! renders the same steps as the `nft` text this backend used to write.

mod br_netfilter;
#[cfg(test)]
mod golden;
mod messages;
mod model;
mod runner;
#[cfg(test)]
mod script;

use crate::compile::{Desired, PodPolicy};
use crate::model::Dir;
use crate::state::PodRecord;
use model::{Applied, Model, VMAPS, chain_name};
pub use model::{Flows, log_prefix};
use rcni_cni::{CniError, ErrorCode};
use rcni_netns::NetNs;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::IpAddr;

const TABLE_PREFIX: &str = "rcni_policy_";
/// Longest network name used verbatim in the table name; longer ones are
/// cut and made unique by a hash (nft names are at most 255 bytes).
const MAX_VERBATIM: usize = 200;
/// `NF_INET_FORWARD`.
const HOOK_FORWARD: u32 = 2;

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

/// NFLOG groups of the networks' flow events: the upper half of the
/// 16-bit range, where other users (ulogd's examples, CNIs' and
/// firewalls' defaults) are rare.
const NFLOG_BASE: u16 = 0x8000;

/// The NFLOG group of `network`'s flow events: from a hash of its name,
/// so the table's writer and the source agree without shared state. Two
/// networks of one node share a group with probability 1/32768; then the
/// second collector's bind fails (`EBUSY`: one listener per group) and
/// `policy flows` says so.
pub fn nflog_group(network: &str) -> u16 {
    let h = Sha256::digest(network.as_bytes());
    NFLOG_BASE | (u16::from_be_bytes([h[0], h[1]]) & 0x7fff)
}

/// The flow settings of `conf` for the table of `network`.
pub fn flows(conf: &crate::conf::Conf, network: &str) -> Flows {
    Flows {
        events: conf.flow_events,
        rate: conf.flow_rate,
        group: nflog_group(network),
    }
}

fn netfilter(msg: impl Into<String>) -> CniError {
    CniError::new(ErrorCode::Netfilter, msg)
}

fn current_ns() -> Result<NetNs, CniError> {
    NetNs::current()
        .map_err(|e| CniError::new(ErrorCode::Netns, format!("policy: open current netns: {e}")))
}

/// Makes the network's table enforce `desired` for `pods` (by attachment
/// key), in the current network namespace, reporting to NFLOG as `flows`
/// says. `applied` is what the last call left there (null or unreadable:
/// the table is rewritten in full); it is updated on success only.
pub fn apply(
    network: &str,
    pods: &BTreeMap<String, PodRecord>,
    desired: &Desired,
    flows: &Flows,
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
            bridged.extend(br_netfilter::bridged_ports(&unknown)?);
        }
        if bridged.values().any(|b| *b) {
            br_netfilter::ensure_bridge_netfilter()?;
        }
    }
    let model = Model::build(pods, desired, flows);
    let (ops, full) = model::plan(prev.as_ref(), &model);
    if !ops.is_empty() {
        let mut nl = runner::open_current()?;
        if let Err(e) = runner::run(&mut nl, batch(&table, &ops)?) {
            if full {
                return Err(e);
            }
            // The kernel is not what `applied` says (the table was removed,
            // the node rebooted, someone edited it): start over.
            runner::run(&mut nl, batch(&table, &model::full(&model))?)?;
        }
    }
    let new = Applied::of(table, model, bridged);
    *applied = serde_json::to_value(new).map_err(|e| CniError::internal(e.to_string()))?;
    Ok(())
}

fn batch(table: &str, ops: &[model::Op]) -> Result<rcni_netfilter::nftset::Batch, CniError> {
    messages::batch(table, ops).map_err(|e| CniError::internal(format!("policy: {e}")))
}

/// Deletes the network's table; a missing one is fine (DEL and GC repeat).
pub fn remove_network(network: &str) -> Result<(), CniError> {
    let table = table_name(network);
    // `add` first makes the `delete` valid when there is no table, in one
    // transaction.
    let mut nl = runner::open_current()?;
    runner::run(
        &mut nl,
        batch(&table, &[model::Op::AddTable, model::Op::DeleteTable])?,
    )
}

/// What the kernel holds of the parts CHECK looks at.
#[derive(Debug, Default)]
struct Listing {
    /// vmap -> address -> target chain.
    vmaps: BTreeMap<String, BTreeMap<IpAddr, String>>,
    /// chain -> its hook (`NF_INET_*`) if a base chain.
    chains: BTreeMap<String, Option<u32>>,
}

/// What differs between the table and what `pod` with `policy` needs.
fn problems(l: &Listing, table: &str, pod: &PodRecord, policy: &PodPolicy) -> Vec<String> {
    let mut out = Vec::new();
    if l.chains.get("forward") != Some(&Some(HOOK_FORWARD)) {
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
    let mut nl = runner::open_current()?;
    let Some(l) = runner::listing(&mut nl, &table, &VMAPS)? else {
        return Err(CniError::check_failed(format!(
            "policy: nftables table inet {table} does not exist"
        )));
    };
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

/// The suppressed-event counters of rule set `rs`'s chain for `dir` (its
/// `sup` sets, see [`Flows`]) in the network's table, in the current
/// namespace: policed pod -> events over its rate so far. Empty when the
/// table or sets are gone.
pub fn suppressed_counts(
    nl: &mut rcni_netfilter::nfnl::Nfnl,
    network: &str,
    rs: u32,
    dir: Dir,
) -> Result<BTreeMap<IpAddr, u64>, CniError> {
    let table = table_name(network);
    let chain = chain_name(rs, dir);
    let mut out = BTreeMap::new();
    for fam in [4, 6] {
        let set = format!("{chain}_sup{fam}");
        let (kind, req) = rcni_netfilter::nftset::elements_request(&table, &set);
        let msgs = nl
            .nft_dump_raw(kind, rcni_netfilter::nftset::INET, &req)
            .map_err(|e| netfilter(format!("policy: read set {set} of table inet {table}: {e}")))?;
        for a in msgs.iter().flatten() {
            out.extend(rcni_netfilter::nftset::parse_counters(a));
        }
    }
    Ok(out)
}

/// A netfilter socket in the current namespace (for
/// [`suppressed_counts`]).
pub fn open_nfnl() -> Result<rcni_netfilter::nfnl::Nfnl, CniError> {
    runner::open_current()
}

/// Whether nf_tables answers here and lets us read the ruleset (STATUS,
/// backend "auto").
pub fn available() -> Result<(), CniError> {
    runner::open_current()?
        .nft_tables()
        .map(|_| ())
        .map_err(|e| netfilter(format!("policy: nftables: {e}")))
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
                name: None,
                ports: Default::default(),
            },
        )
    }

    /// A pod of namespace "default" labelled app=`app`.
    pub(super) fn app_pod(key: &str, app: &str, addrs: &[&str], host: &str) -> (String, PodRecord) {
        record(key, "default", &[("app", app)], addrs, host)
    }

    pub(super) fn policies() -> PolicySet {
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

    /// The nft text of the steps from `prev` to `m`, and whether they are a
    /// full rewrite.
    fn plan(table: &str, prev: Option<&Applied>, m: &Model) -> (String, bool) {
        let (ops, full) = model::plan(prev, m);
        (script::render(table, &ops), full)
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
        let m = Model::build(&pods, &d, &Flows::off());
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
    fn flow_events_report_before_the_drop_and_in_allow_chains() {
        let pods: BTreeMap<_, _> = [
            app_pod("web/eth0", "web", &["10.0.0.2"], "vweb"),
            app_pod("cli/eth0", "client", &["10.0.0.3"], "vcli"),
        ]
        .into();
        let d = compiled(&pods, &mut Ids::default());
        let rs = d.pods["web/eth0"].ingress;
        let c = format!("in_{rs}");
        let mut flows = Flows {
            events: crate::conf::FlowEvents::Deny,
            rate: 7,
            group: nflog_group("net"),
        };
        let (s, _) = plan("T", None, &Model::build(&pods, &d, &flows));
        let g = flows.group;
        for want in [
            format!(
                "add set inet T {c}_seen4 {{ type ipv4_addr . ipv4_addr . inet_proto . inet_service . inet_service; size 65535; flags dynamic,timeout; timeout 10s; }}"
            ),
            format!(
                "add set inet T {c}_sup6 {{ type ipv6_addr; size 65535; flags dynamic,timeout; timeout 3600s; }}"
            ),
            format!(
                "add rule inet T {c} ip saddr . ip daddr . meta l4proto . th sport . th dport @{c}_seen4 drop"
            ),
            format!(
                "add rule inet T {c} add @{c}_seen6 {{ ip6 saddr . ip6 daddr . meta l4proto . th sport . th dport }} log prefix \"rcni deny ingress {rs}\" group {g} drop"
            ),
            // The receiver is the policed pod of an ingress rule set.
            format!(
                "add rule inet T {c} update @{c}_rl4 {{ ip daddr limit rate over 7/second burst 7 packets }} update @{c}_sup4 {{ ip daddr counter }} drop"
            ),
            format!(
                "add rule inet T {c} log prefix \"rcni deny ingress {rs}\" group {g} drop comment \"ingress: default/web\""
            ),
        ] {
            assert!(s.contains(&want), "missing {want:?} in\n{s}");
        }
        assert!(!s.contains("_ok"), "{s}");
        // Allow events: allow rules go to the chain that reports them.
        flows.events = crate::conf::FlowEvents::All;
        let (s, _) = plan("T", None, &Model::build(&pods, &d, &flows));
        for want in [
            format!("add chain inet T {c}_ok\n"),
            format!(
                "add rule inet T {c} ip saddr . meta l4proto . th dport @{c}_pod4p goto {c}_ok"
            ),
            format!(
                "add rule inet T {c}_ok ip saddr . ip daddr . meta l4proto . th sport . th dport @{c}_seen4 return"
            ),
            format!(
                "add rule inet T {c}_ok log prefix \"rcni allow ingress {rs}\" group {g} return\n"
            ),
        ] {
            assert!(s.contains(&want), "missing {want:?} in\n{s}");
        }
        assert_ne!(nflog_group("net"), nflog_group("net2"));
        assert!(nflog_group("net") >= 0x8000);
    }

    #[test]
    fn other_nodes_pods_are_elements_of_the_address_sets() {
        let pods: BTreeMap<_, _> = [app_pod("web/eth0", "web", &["10.0.0.2"], "vweb")].into();
        let mut set = policies();
        set.add_document(
            &json!([
                {"kind":"Pod","metadata":{"name":"c","labels":{"app":"client"}},
                 "status":{"podIPs":[{"ip":"10.244.2.5"},{"ip":"fd00:2::5"}]}},
                {"kind":"Pod","metadata":{"name":"a","labels":{"app":"admin"}},
                 "status":{"podIP":"10.244.3.5"}},
                {"kind":"Pod","metadata":{"name":"x","labels":{"app":"x"}},
                 "status":{"podIP":"10.244.3.6"}}
            ]),
            "t",
        )
        .unwrap();
        let views = pods.iter().map(|(k, p)| (k.clone(), p.view())).collect();
        let d = compile(&set, &views, &mut Ids::default()).unwrap();
        let c = format!("in_{}", d.pods["web/eth0"].ingress);
        let m = Model::build(&pods, &d, &Flows::off());
        let (s, _) = plan("T", None, &m);
        for want in [
            format!(
                "add element inet T {c}_pod4p {{ 10.244.2.5 . 17 . 53, 10.244.2.5 . 6 . 80, 10.244.2.5 . 6 . 8000-8080 }}"
            ),
            format!(
                "add element inet T {c}_pod6p {{ fd00:2::5 . 17 . 53, fd00:2::5 . 6 . 80, fd00:2::5 . 6 . 8000-8080 }}"
            ),
            format!("add element inet T {c}_pod4 {{ 10.244.3.5 }}"),
            format!("add rule inet T {c} ip saddr @{c}_pod4 return"),
        ] {
            assert!(s.contains(&want), "missing {want:?} in\n{s}");
        }
        assert!(!s.contains("10.244.3.6"), "{s}");
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
        let m1 = Model::build(&pods, &d1, &Flows::off());
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
        let (s, full) = plan("T", Some(&prev), &Model::build(&pods, &d2, &Flows::off()));
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
        let m2 = Model::build(&pods, &d2, &Flows::off());
        let prev2 = applied(&m2);
        pods.remove("cli2/eth0");
        pods.remove("web2/eth0");
        let d3 = compiled(&pods, &mut ids);
        let (s, _) = plan("T", Some(&prev2), &Model::build(&pods, &d3, &Flows::off()));
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
        let (s, _) = plan("T", Some(&prev), &Model::build(&pods, &d4, &Flows::off()));
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
        let m = Model::build(&pods, &d, &Flows::off());
        let prev = applied(&m);
        let empty = compile(
            &PolicySet::default(),
            &pods.iter().map(|(k, p)| (k.clone(), p.view())).collect(),
            &mut ids,
        )
        .unwrap();
        let (s, _) = plan(
            "T",
            Some(&prev),
            &Model::build(&pods, &empty, &Flows::off()),
        );
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
    fn check_compares_vmaps_and_chains() {
        let l = Listing {
            vmaps: [
                (
                    "to_pod4".to_string(),
                    [("10.0.0.2".parse().unwrap(), "in_1".to_string())].into(),
                ),
                ("from_pod4".to_string(), BTreeMap::new()),
            ]
            .into(),
            chains: [("forward".to_string(), Some(2)), ("in_1".to_string(), None)].into(),
        };
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
        // A forward chain on another hook is no forward chain.
        let mut l2 = Listing::default();
        l2.chains.insert("forward".into(), Some(1));
        let p = problems(&l2, "T", &pod, &PodPolicy::default());
        assert!(p[0].contains("no forward chain"), "{p:?}");
    }
}
