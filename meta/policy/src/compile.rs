//! From policies and pods to what a backend enforces: identities, rule
//! sets, and each pod's identity and rule sets.
//!
//! - An *identity* names a label set (namespace and labels): pods with the
//!   same labels share one, so a selector is evaluated once per label set,
//!   and a new pod with known labels needs no rule change anywhere.
//! - A *rule set* is the union of the rules of the policies selecting a pod
//!   in one direction. Pods selected by the same policies share one. It
//!   holds peers by identity (this node's pods matching a
//!   podSelector/namespaceSelector), other nodes' pods matching them by
//!   address (they have no identity here: their packets arrive with only
//!   an address), and CIDRs (ipBlock, and `0.0.0.0/0` + `::/0` for rules
//!   without peers), each with the ports they may use.
//!
//! CIDRs are flattened for longest-prefix match: every `cidr` and `except`
//! becomes one prefix whose value is the union of the ports of the rules
//! that cover it and do not except it; one LPM lookup (or one interval
//! lookup) then gives the answer of all rules at once.
//!
//! Numbers (identities, rule sets) are allocated in [`Ids`], which the
//! caller persists, so they stay stable while their label set or policy
//! selection lives, and are freed when it goes.

use crate::model::{
    Dir, Frontend, IpBlock, Labels, MAX_PORT_RANGES, NamedPorts, Peer, Policy, PolicySet,
    PortRange, RemotePod, Rule, frontends, proto_number,
};
use ipnetwork::IpNetwork;
use rcni_cni::CniError;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

/// What traffic a peer may send (ingress) or receive (egress).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Ports {
    /// Every protocol and port.
    All,
    /// These ranges, sorted and merged; empty allows nothing.
    Ranges(Vec<PortRange>),
}

impl Ports {
    pub fn none() -> Ports {
        Ports::Ranges(vec![])
    }

    pub fn is_none(&self) -> bool {
        matches!(self, Ports::Ranges(r) if r.is_empty())
    }

    /// A rule's ports, its named ones resolved from `named` (the policed
    /// pod's container ports for ingress, the peer's for egress); a name
    /// the pod does not have, or any name without `named`, allows
    /// nothing, as a named port no pod has does in Kubernetes.
    fn of_rule(r: &Rule, named: Option<&NamedPorts>) -> Ports {
        match &r.ports {
            None => Ports::All,
            Some(p) => {
                let mut v = p.clone();
                for (proto, name) in &r.named {
                    if let Some((pp, port)) = named.and_then(|m| m.get(name))
                        && proto_number(pp) == Some(*proto)
                    {
                        v.push(PortRange {
                            proto: *proto,
                            lo: *port,
                            hi: *port,
                        });
                    }
                }
                Ports::Ranges(merge(v))
            }
        }
    }

    pub fn union(&mut self, o: &Ports) {
        match (&mut *self, o) {
            (Ports::All, _) => {}
            (_, Ports::All) => *self = Ports::All,
            (Ports::Ranges(a), Ports::Ranges(b)) => {
                a.extend_from_slice(b);
                *a = merge(std::mem::take(a));
            }
        }
    }

    pub fn allows(&self, proto: u8, port: u16) -> bool {
        match self {
            Ports::All => true,
            Ports::Ranges(r) => r
                .iter()
                .any(|p| p.proto == proto && p.lo <= port && port <= p.hi),
        }
    }
}

/// Sorted by protocol and start, overlapping and adjacent ranges merged.
fn merge(mut v: Vec<PortRange>) -> Vec<PortRange> {
    v.sort();
    let mut out: Vec<PortRange> = Vec::with_capacity(v.len());
    for r in v {
        match out.last_mut() {
            Some(l) if l.proto == r.proto && (r.lo as u32) <= l.hi as u32 + 1 => {
                l.hi = l.hi.max(r.hi);
            }
            _ => out.push(r),
        }
    }
    out
}

/// A pod as policies see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    pub namespace: String,
    pub labels: Labels,
    /// Named container ports (not part of the identity: they only
    /// resolve the named ports of the rules that police this pod).
    pub ports: NamedPorts,
    /// Its addresses (not part of the identity either): another node's
    /// pod said to have one of them is stale and left out.
    pub addrs: Vec<IpAddr>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleSet {
    pub dir: Dir,
    /// The selecting policies (`namespace/name`), sorted.
    pub policies: Vec<String>,
    pub peers: BTreeMap<u32, Ports>,
    /// Other nodes' pods the rules select, by address.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub remote: BTreeMap<IpAddr, Ports>,
    /// Flattened for longest-prefix match, sorted; a prefix with no ports
    /// punches a hole (an `except`) into a shorter one.
    pub cidrs: Vec<(IpNetwork, Ports)>,
    /// Egress only, for the eBPF backend, which decides before kube-proxy's
    /// DNAT: a Service address with the ports whose every endpoint the
    /// rules allow (empty: none). The nftables backend sees the endpoint
    /// itself and ignores these.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub services: BTreeMap<IpAddr, Ports>,
    /// Made of audit-only policies (`rcni.io/audit`, or the network's
    /// `"audit": true`): what it denies is reported and let through.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub audit: bool,
}

impl RuleSet {
    /// Whether a peer (by identity, 0 for none, and address) may use
    /// `proto`/`port`: the semantics every backend implements.
    pub fn allows(&self, identity: u32, addr: IpAddr, proto: u8, port: u16) -> bool {
        // A Service's address, as the eBPF backend sees it before the DNAT.
        if let Some(p) = self.services.get(&addr) {
            return p.allows(proto, port);
        }
        if identity != 0
            && self
                .peers
                .get(&identity)
                .is_some_and(|p| p.allows(proto, port))
        {
            return true;
        }
        if self
            .remote
            .get(&addr)
            .is_some_and(|p| p.allows(proto, port))
        {
            return true;
        }
        self.lpm(addr).is_some_and(|p| p.allows(proto, port))
    }

    /// The ports of the longest prefix of `cidrs` holding `addr`.
    fn lpm(&self, addr: IpAddr) -> Option<&Ports> {
        self.cidrs
            .iter()
            .filter(|(n, _)| n.contains(addr))
            .max_by_key(|(n, _)| n.prefix())
            .map(|(_, p)| p)
    }

    /// `cidrs` with the remote pods' addresses as host prefixes, each
    /// allowing what its pod is allowed and what the prefix it falls in
    /// allows: for a longest-prefix-match table, where a host entry hides
    /// the shorter prefixes holding it; then `services`' addresses.
    pub fn lpm_entries(&self) -> Vec<(IpNetwork, Ports)> {
        if self.remote.is_empty() && self.services.is_empty() {
            return self.cidrs.clone();
        }
        let mut m: BTreeMap<IpNetwork, Ports> = self.cidrs.iter().cloned().collect();
        for (a, p) in &self.remote {
            let host =
                IpNetwork::new(*a, if a.is_ipv4() { 32 } else { 128 }).expect("host prefix length");
            let mut v = self.lpm(*a).cloned().unwrap_or_else(Ports::none);
            v.union(p);
            m.insert(host, v);
        }
        // A Service's address is judged by its endpoints alone, whatever
        // prefix holds it.
        for (a, p) in &self.services {
            let host =
                IpNetwork::new(*a, if a.is_ipv4() { 32 } else { 128 }).expect("host prefix length");
            m.insert(host, p.clone());
        }
        m.into_iter().collect()
    }

    /// The address space as disjoint intervals `[start, end]` of one family
    /// with what they allow (nothing-allowed stretches left out): the
    /// flattened prefixes resolved the way a longest-prefix lookup would,
    /// for interval sets that cannot hold overlapping elements.
    pub fn intervals(&self, v6: bool) -> Vec<(u128, u128, Ports)> {
        let nets: Vec<(u128, u128, u8, &Ports)> = self
            .cidrs
            .iter()
            .filter(|(n, _)| n.is_ipv6() == v6)
            .map(|(n, p)| {
                let (s, e) = bounds(n);
                (s, e, n.prefix(), p)
            })
            .collect();
        // Boundaries where the longest match may change.
        let mut cuts: BTreeSet<u128> = BTreeSet::new();
        for (s, e, _, _) in &nets {
            cuts.insert(*s);
            if *e != u128::MAX {
                cuts.insert(e + 1);
            }
        }
        let max = if v6 { u128::MAX } else { u32::MAX as u128 };
        let cuts: Vec<u128> = cuts.into_iter().collect();
        let mut out: Vec<(u128, u128, Ports)> = Vec::new();
        for (i, s) in cuts.iter().enumerate() {
            let e = cuts.get(i + 1).map(|n| n - 1).unwrap_or(max);
            let best = nets
                .iter()
                .filter(|(ns, ne, _, _)| ns <= s && *s <= *ne)
                .max_by_key(|(_, _, len, _)| *len);
            let Some((_, _, _, p)) = best else { continue };
            if p.is_none() {
                continue;
            }
            match out.last_mut() {
                Some((_, le, lp)) if *le + 1 == *s && lp == *p => *le = e,
                _ => out.push((*s, e, (*p).clone())),
            }
        }
        out
    }
}

/// First and last address of a network, as integers.
pub fn bounds(n: &IpNetwork) -> (u128, u128) {
    match n {
        IpNetwork::V4(n) => {
            let s = u32::from(n.network()) as u128;
            let size = 1u128 << (32 - n.prefix());
            (s, s + size - 1)
        }
        IpNetwork::V6(n) => {
            let s = u128::from(n.network());
            let host = 128 - n.prefix() as u32;
            let e = if host == 128 {
                u128::MAX
            } else {
                s | ((1u128 << host) - 1)
            };
            (s, e)
        }
    }
}

/// A pod's identity and the rule sets deciding its traffic (0: none, all
/// allowed that way).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodPolicy {
    pub identity: u32,
    pub ingress: u32,
    pub egress: u32,
}

impl PodPolicy {
    pub fn rule_set(&self, dir: Dir) -> u32 {
        match dir {
            Dir::Ingress => self.ingress,
            Dir::Egress => self.egress,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Desired {
    pub pods: BTreeMap<String, PodPolicy>,
    pub rulesets: BTreeMap<u32, RuleSet>,
    /// Identity -> the label set it names, for display.
    pub identities: BTreeMap<u32, String>,
    /// The network has a policy, whichever pods it selects and on whichever
    /// node: a pod's packets can then meet rules that read their addresses
    /// (another node's among them), so the backend checks them. Without
    /// one it may pass them unread.
    #[serde(default)]
    pub enforce: bool,
}

/// Persisted number allocations: label set -> identity, selection -> rule
/// set.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ids {
    #[serde(default)]
    pub identities: BTreeMap<String, u32>,
    #[serde(default)]
    pub rulesets: BTreeMap<String, u32>,
}

/// The lowest number from 1 not yet used in `map`.
fn alloc(map: &mut BTreeMap<String, u32>, key: &str) -> u32 {
    if let Some(v) = map.get(key) {
        return *v;
    }
    let used: BTreeSet<u32> = map.values().copied().collect();
    let n = (1..).find(|n| !used.contains(n)).expect("u32 space");
    map.insert(key.to_string(), n);
    n
}

/// `namespace` and labels, one per line: the identity's key.
pub fn identity_key(p: &PodView) -> String {
    let mut k = p.namespace.clone();
    for (l, v) in &p.labels {
        k.push('\n');
        k.push_str(l);
        k.push('=');
        k.push_str(v);
    }
    k
}

fn ruleset_key(dir: Dir, policies: &[String]) -> String {
    format!("{}:{}", dir.as_str(), policies.join(","))
}

fn split_identity_key(k: &str) -> PodView {
    let mut it = k.split('\n');
    let namespace = it.next().unwrap_or_default().to_string();
    let labels = it
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    PodView {
        namespace,
        labels,
        ports: NamedPorts::new(),
        addrs: Vec::new(),
    }
}

/// Whether any of `policies`' rules in `dir` names a port.
fn uses_named(set: &PolicySet, dir: Dir, policies: &[String]) -> bool {
    set.policies
        .iter()
        .filter(|p| policies.contains(&p.id()))
        .flat_map(|p| p.rules(dir).unwrap_or_default())
        .any(|r| !r.named.is_empty())
}

/// The pod's named ports as part of a rule set's key: pods whose
/// policies name ports share a rule set only when their ports agree.
fn ports_key(ports: &NamedPorts) -> String {
    ports
        .iter()
        .map(|(n, (p, port))| format!("{n}={p}/{port}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Computes what to enforce for `pods` (by attachment key); `ids` keeps
/// its numbers for what still exists and drops the rest.
pub fn compile(
    set: &PolicySet,
    pods: &BTreeMap<String, PodView>,
    ids: &mut Ids,
) -> Result<Desired, CniError> {
    let mut d = Desired {
        enforce: !set.policies.is_empty(),
        ..Desired::default()
    };
    // Identities of the pods there are, and only those.
    let live: BTreeSet<String> = pods.values().map(identity_key).collect();
    ids.identities.retain(|k, _| live.contains(k));
    let mut identities: BTreeMap<u32, PodView> = BTreeMap::new();
    for k in &live {
        let n = alloc(&mut ids.identities, k);
        identities.insert(n, split_identity_key(k));
        d.identities.insert(n, k.replace('\n', " "));
    }
    // Other nodes' pods; an address a pod here has is this node's to
    // judge (by identity), whatever a stale entry says.
    let local: BTreeSet<IpAddr> = pods.values().flat_map(|p| p.addrs.clone()).collect();
    let remote: Vec<RemotePod> = set
        .remote_pods
        .iter()
        .map(|r| RemotePod {
            addrs: r
                .addrs
                .iter()
                .filter(|a| !local.contains(a))
                .copied()
                .collect(),
            ..r.clone()
        })
        .filter(|r| !r.addrs.is_empty())
        .collect();
    let ns_labels: HashMap<&str, Labels> = identities
        .values()
        .map(|p| p.namespace.as_str())
        .chain(remote.iter().map(|r| r.namespace.as_str()))
        .map(|ns| (ns, set.namespace_labels(ns)))
        .collect();

    let mut wanted_rs: BTreeSet<String> = BTreeSet::new();
    type Selection = (Dir, Vec<String>, Option<NamedPorts>, bool);
    let mut rs_by_key: BTreeMap<String, Selection> = BTreeMap::new();
    let mut pod_sel: BTreeMap<&str, [Option<String>; 2]> = BTreeMap::new();
    for (key, pod) in pods {
        let mut sel: [Option<String>; 2] = [None, None];
        for (i, dir) in [Dir::Ingress, Dir::Egress].into_iter().enumerate() {
            let selecting: Vec<&Policy> = set
                .policies
                .iter()
                .filter(|p| {
                    p.rules(dir).is_some()
                        && p.namespace == pod.namespace
                        && p.pod_selector.matches(&pod.labels)
                })
                .collect();
            // Audit policies never change what is enforced: a pod that an
            // enforced policy selects is decided by the enforced ones
            // alone (an audit policy could only add allows, which it must
            // not); one that only audit policies select is decided by
            // them, in audit mode: what they deny is reported and passes.
            let enforced = selecting.iter().any(|p| !p.audit);
            let mut ps: Vec<String> = selecting
                .iter()
                .filter(|p| p.audit != enforced)
                .map(|p| p.id())
                .collect();
            if ps.is_empty() {
                continue;
            }
            ps.sort();
            let audit = !enforced;
            let mut k = ruleset_key(dir, &ps);
            if audit {
                k.insert_str(0, "audit:");
            }
            // Ingress rules' named ports are the policed pod's own.
            let named = (dir == Dir::Ingress && uses_named(set, dir, &ps)).then(|| {
                k.push('#');
                k.push_str(&ports_key(&pod.ports));
                pod.ports.clone()
            });
            wanted_rs.insert(k.clone());
            rs_by_key.insert(k.clone(), (dir, ps, named, audit));
            sel[i] = Some(k);
        }
        pod_sel.insert(key.as_str(), sel);
    }
    ids.rulesets.retain(|k, _| wanted_rs.contains(k));
    // This node's pods' named ports by identity (egress rules naming a
    // port allow it toward the pods that have it) and their identities
    // by address (a Service's endpoints are judged as the pods they are).
    let mut local_named: BTreeMap<u32, Vec<NamedPorts>> = BTreeMap::new();
    let mut local_ids: BTreeMap<IpAddr, u32> = BTreeMap::new();
    for pod in pods.values() {
        let id = ids.identities[&identity_key(pod)];
        if !pod.ports.is_empty() {
            local_named.entry(id).or_default().push(pod.ports.clone());
        }
        for a in &pod.addrs {
            local_ids.insert(*a, id);
        }
    }
    let fronts = frontends(&set.services, &set.slices);
    for (k, (dir, ps, named, audit)) in &rs_by_key {
        let n = alloc(&mut ids.rulesets, k);
        let mut rs = build_ruleset(
            set,
            *dir,
            ps,
            named.as_ref(),
            &Peers {
                identities: &identities,
                local_named: &local_named,
                remote: &remote,
            },
            &ns_labels,
        )?;
        if *dir == Dir::Egress {
            rs.services = service_entries(&rs, &fronts, &local_ids);
        }
        rs.audit = *audit;
        d.rulesets.insert(n, rs);
    }
    for (key, pod) in pods {
        let sel = &pod_sel[key.as_str()];
        let rs = |s: &Option<String>| s.as_ref().map(|k| ids.rulesets[k]).unwrap_or(0);
        d.pods.insert(
            key.clone(),
            PodPolicy {
                identity: ids.identities[&identity_key(pod)],
                ingress: rs(&sel[0]),
                egress: rs(&sel[1]),
            },
        );
    }
    Ok(d)
}

/// The pods a rule set's peers are chosen from.
struct Peers<'a> {
    /// This node's, by identity.
    identities: &'a BTreeMap<u32, PodView>,
    /// Named ports of this node's pods, by identity.
    local_named: &'a BTreeMap<u32, Vec<NamedPorts>>,
    /// Other nodes'.
    remote: &'a [RemotePod],
}

/// What a rule set allows toward each Service address: a port where the
/// rules allow every endpoint behind it (kube-proxy picks one, and the
/// decision is taken before it does: allowing when only some are allowed
/// would let connections reach the others). A Service without endpoints
/// is allowed: kube-proxy rejects its connections itself. Addresses
/// where nothing is allowed and nothing covers them are left out (the
/// table denies them anyway); one with more ranges than a port set holds
/// too, and is judged by its address as before.
fn service_entries(
    rs: &RuleSet,
    fronts: &[Frontend],
    local_ids: &BTreeMap<IpAddr, u32>,
) -> BTreeMap<IpAddr, Ports> {
    let mut out: BTreeMap<IpAddr, Ports> = BTreeMap::new();
    for f in fronts {
        let ok = f.backends.iter().all(|(a, port)| {
            let id = local_ids.get(a).copied().unwrap_or(0);
            rs.allows(id, *a, f.proto, *port)
        });
        let e = out.entry(f.addr).or_insert_with(Ports::none);
        if ok {
            e.union(&Ports::Ranges(vec![PortRange {
                proto: f.proto,
                lo: f.port,
                hi: f.port,
            }]));
        }
    }
    out.retain(|a, p| {
        let fits = !matches!(p, Ports::Ranges(r) if r.len() > MAX_PORT_RANGES);
        fits && !(p.is_none() && rs.lpm(*a).is_none_or(Ports::is_none))
    });
    out
}

fn build_ruleset(
    set: &PolicySet,
    dir: Dir,
    policies: &[String],
    named: Option<&NamedPorts>,
    from: &Peers,
    ns_labels: &HashMap<&str, Labels>,
) -> Result<RuleSet, CniError> {
    let (identities, remote_pods) = (from.identities, from.remote);
    let mut peers: BTreeMap<u32, Ports> = BTreeMap::new();
    let mut remote: BTreeMap<IpAddr, Ports> = BTreeMap::new();
    let mut blocks: Vec<(IpBlock, Ports)> = Vec::new();
    for p in set.policies.iter().filter(|p| policies.contains(&p.id())) {
        for r in p.rules(dir).unwrap_or_default() {
            let ports = Ports::of_rule(r, named);
            // Egress rules' named ports are the peer's own, resolved per
            // peer: another node's pod by its ports, this node's by the
            // ports of the pods sharing its identity (a Deployment's pods
            // share their template's).
            let per_peer = dir == Dir::Egress && !r.named.is_empty();
            let of_remote = |rp: &RemotePod| {
                if per_peer {
                    Ports::of_rule(r, Some(&rp.ports))
                } else {
                    ports.clone()
                }
            };
            let of_identity = |id: u32| {
                let mut v = ports.clone();
                if per_peer {
                    for np in from.local_named.get(&id).into_iter().flatten() {
                        v.union(&Ports::of_rule(r, Some(np)));
                    }
                }
                v
            };
            let Some(list) = &r.peers else {
                if per_peer {
                    for id in identities.keys() {
                        peers
                            .entry(*id)
                            .or_insert_with(Ports::none)
                            .union(&of_identity(*id));
                    }
                    for rp in remote_pods {
                        for a in &rp.addrs {
                            remote
                                .entry(*a)
                                .or_insert_with(Ports::none)
                                .union(&of_remote(rp));
                        }
                    }
                }
                // No peers: everyone, pods and the world.
                for any in ["0.0.0.0/0", "::/0"] {
                    blocks.push((
                        IpBlock {
                            cidr: any.parse().expect("valid"),
                            except: vec![],
                        },
                        ports.clone(),
                    ));
                }
                continue;
            };
            for peer in list {
                match peer {
                    Peer::Block(b) => blocks.push((b.clone(), ports.clone())),
                    Peer::Pods { pods, namespaces } => {
                        let selects = |ns: &str, labels: &Labels| {
                            let ns_ok = match namespaces {
                                None => ns == p.namespace,
                                Some(s) => s.matches(&ns_labels[ns]),
                            };
                            ns_ok && pods.matches(labels)
                        };
                        for (id, v) in identities {
                            if selects(&v.namespace, &v.labels) {
                                peers
                                    .entry(*id)
                                    .or_insert_with(Ports::none)
                                    .union(&of_identity(*id));
                            }
                        }
                        for rp in remote_pods {
                            if selects(&rp.namespace, &rp.labels) {
                                let p = of_remote(rp);
                                for a in &rp.addrs {
                                    remote.entry(*a).or_insert_with(Ports::none).union(&p);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    let cidrs = flatten(&blocks);
    let too_many = |p: &Ports| matches!(p, Ports::Ranges(r) if r.len() > MAX_PORT_RANGES);
    if peers.values().any(too_many)
        || remote.values().any(too_many)
        || cidrs.iter().any(|(_, p)| too_many(p))
    {
        return Err(CniError::config(format!(
            "policies {}: together they allow one peer more than {MAX_PORT_RANGES} port ranges",
            policies.join(", ")
        )));
    }
    Ok(RuleSet {
        dir,
        policies: policies.to_vec(),
        peers,
        remote,
        cidrs,
        services: BTreeMap::new(),
        audit: false,
    })
}

fn net_of(addr: IpAddr, len: u8) -> IpNetwork {
    let n = IpNetwork::new(addr, len).expect("length within the family");
    IpNetwork::new(n.network(), len).expect("length within the family")
}

fn contains_net(outer: &IpNetwork, inner: &IpNetwork) -> bool {
    outer.is_ipv4() == inner.is_ipv4()
        && outer.prefix() <= inner.prefix()
        && outer.contains(inner.network())
}

/// ipBlocks to longest-prefix-match entries (see the module doc).
fn flatten(blocks: &[(IpBlock, Ports)]) -> Vec<(IpNetwork, Ports)> {
    let mut by_cidr: HashMap<IpNetwork, Vec<usize>> = HashMap::new();
    let mut prefixes: BTreeSet<(bool, IpNetwork)> = BTreeSet::new();
    for (i, (b, _)) in blocks.iter().enumerate() {
        by_cidr.entry(b.cidr).or_default().push(i);
        prefixes.insert((b.cidr.is_ipv6(), b.cidr));
        for e in &b.except {
            prefixes.insert((e.is_ipv6(), *e));
        }
    }
    let mut out = Vec::with_capacity(prefixes.len());
    for (_, p) in prefixes {
        let mut val = Ports::none();
        // Only rules whose cidr is p or contains it cover the addresses
        // whose longest match is p.
        for len in 0..=p.prefix() {
            let Some(rules) = by_cidr.get(&net_of(p.network(), len)) else {
                continue;
            };
            for i in rules {
                let (b, ports) = &blocks[*i];
                if !b.except.iter().any(|e| contains_net(e, &p)) {
                    val.union(ports);
                }
            }
        }
        out.push((p, val));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{SCTP, TCP, UDP};
    use serde_json::json;

    fn set(v: serde_json::Value) -> PolicySet {
        let mut s = PolicySet::default();
        s.add_document(&v, "t").unwrap();
        s.sort();
        s
    }

    fn pod(ns: &str, labels: &[(&str, &str)]) -> PodView {
        PodView {
            ports: NamedPorts::new(),
            addrs: Vec::new(),
            namespace: ns.into(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn selected_pods_get_rule_sets_and_peers_get_identities() {
        let s = set(json!([
            {"name":"web","podSelector":{"matchLabels":{"app":"web"}},
             "ingress":[{"from":[{"podSelector":{"matchLabels":{"app":"client"}}}],"ports":[{"port":80},{"port":81}]}]},
            {"name":"deny-egress","podSelector":{"matchLabels":{"app":"web"}},"policyTypes":["Egress"]}
        ]));
        let mut pods = BTreeMap::new();
        pods.insert("a".to_string(), pod("default", &[("app", "web")]));
        pods.insert("b".to_string(), pod("default", &[("app", "client")]));
        pods.insert("c".to_string(), pod("default", &[("app", "client")]));
        pods.insert("d".to_string(), pod("other", &[("app", "client")]));
        let mut ids = Ids::default();
        let d = compile(&s, &pods, &mut ids).unwrap();
        // Same labels, same identity; namespaces keep them apart.
        assert_eq!(d.pods["b"].identity, d.pods["c"].identity);
        assert_ne!(d.pods["b"].identity, d.pods["d"].identity);
        assert_eq!(d.identities.len(), 3);
        let a = d.pods["a"];
        assert!(a.ingress != 0 && a.egress != 0 && a.ingress != a.egress);
        assert_eq!((d.pods["b"].ingress, d.pods["b"].egress), (0, 0));
        let rs = &d.rulesets[&a.ingress];
        let client = d.pods["b"].identity;
        assert_eq!(
            rs.peers[&client],
            Ports::Ranges(vec![PortRange {
                proto: TCP,
                lo: 80,
                hi: 81
            }])
        );
        assert!(!rs.peers.contains_key(&d.pods["d"].identity));
        assert!(rs.allows(client, ip("10.0.0.2"), TCP, 81));
        assert!(!rs.allows(client, ip("10.0.0.2"), TCP, 82));
        assert!(!rs.allows(client, ip("10.0.0.2"), UDP, 80));
        let eg = &d.rulesets[&a.egress];
        assert!(eg.peers.is_empty() && eg.cidrs.is_empty());
        // Numbers are stable across compilations, and freed with their pods.
        let again = compile(&s, &pods, &mut ids).unwrap();
        assert_eq!(again, d);
        pods.remove("a");
        let d2 = compile(&s, &pods, &mut ids).unwrap();
        assert!(d2.rulesets.is_empty() && ids.rulesets.is_empty());
        assert_eq!(d2.pods["b"].identity, client);
        // Its policies select no pod here, but this node's pods' addresses
        // still meet them on other nodes.
        assert!(d.enforce && d2.enforce);
        let none = compile(&PolicySet::default(), &pods, &mut ids).unwrap();
        assert!(!none.enforce);
        pods.clear();
        compile(&s, &pods, &mut ids).unwrap();
        assert_eq!(ids, Ids::default());
    }

    #[test]
    fn namespace_selectors_use_namespace_labels() {
        let s = set(json!([
            {"kind":"Namespace","metadata":{"name":"prod","labels":{"team":"a"}}},
            {"name":"p","podSelector":{},"ingress":[{"from":[
                {"namespaceSelector":{"matchLabels":{"team":"a"}}},
                {"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"dev"}},"podSelector":{"matchLabels":{"x":"y"}}}]}]}
        ]));
        let mut pods = BTreeMap::new();
        pods.insert("self".to_string(), pod("default", &[]));
        pods.insert("prod".to_string(), pod("prod", &[("any", "thing")]));
        pods.insert("dev-x".to_string(), pod("dev", &[("x", "y")]));
        pods.insert("dev".to_string(), pod("dev", &[]));
        let d = compile(&s, &pods, &mut Ids::default()).unwrap();
        let rs = &d.rulesets[&d.pods["self"].ingress];
        let has = |k: &str| rs.peers.contains_key(&d.pods[k].identity);
        assert!(has("prod") && has("dev-x"));
        assert!(!has("dev") && !has("self"));
    }

    #[test]
    fn cidrs_flatten_to_the_union_of_covering_rules() {
        let s = set(json!({"name":"p","podSelector":{},"egress":[
            {"to":[{"ipBlock":{"cidr":"10.0.0.0/8","except":["10.1.0.0/16","10.2.0.0/16"]}}],"ports":[{"port":80}]},
            {"to":[{"ipBlock":{"cidr":"10.1.0.0/16"}}],"ports":[{"protocol":"UDP","port":53}]},
            {"to":[{"ipBlock":{"cidr":"10.1.2.0/24"}}]},
            {"to":[{"ipBlock":{"cidr":"fd00::/8","except":["fd00:1::/32"]}}],"ports":[{"protocol":"SCTP"}]}
        ]}));
        let mut pods = BTreeMap::new();
        pods.insert("a".to_string(), pod("default", &[]));
        let d = compile(&s, &pods, &mut Ids::default()).unwrap();
        let rs = &d.rulesets[&d.pods["a"].egress];
        let cases = [
            ("10.9.9.9", TCP, 80, true),
            ("10.9.9.9", TCP, 81, false),
            ("10.1.9.9", TCP, 80, false), // excepted from rule 1
            ("10.1.9.9", UDP, 53, true),  // rule 2
            ("10.2.0.1", TCP, 80, false), // excepted, nothing else
            ("10.2.0.1", UDP, 53, false),
            ("10.1.2.3", TCP, 9, true), // rule 3: all
            ("11.0.0.1", TCP, 80, false),
            ("fd00::1", SCTP, 9, true),
            ("fd00:1::1", SCTP, 9, false),
            ("fd00::1", TCP, 9, false),
        ];
        for (a, proto, port, want) in cases {
            assert_eq!(rs.allows(0, ip(a), proto, port), want, "{a} {proto}/{port}");
        }
        // The intervals say the same, for every case.
        for (a, proto, port, want) in cases {
            let v6 = ip(a).is_ipv6();
            let x = match ip(a) {
                IpAddr::V4(v) => u32::from(v) as u128,
                IpAddr::V6(v) => u128::from(v),
            };
            let got = rs
                .intervals(v6)
                .iter()
                .any(|(s, e, p)| *s <= x && x <= *e && p.allows(proto, port));
            assert_eq!(got, want, "interval {a} {proto}/{port}");
        }
        let iv = rs.intervals(false);
        for w in iv.windows(2) {
            assert!(w[0].1 < w[1].0, "disjoint and sorted: {iv:?}");
        }
    }

    #[test]
    fn rules_without_peers_or_ports_allow_everyone() {
        let s = set(
            json!({"name":"p","podSelector":{},"policyTypes":["Ingress","Egress"],
            "ingress":[{}], "egress":[{"ports":[{"protocol":"UDP","port":53}]}]}),
        );
        let mut pods = BTreeMap::new();
        pods.insert("a".to_string(), pod("default", &[]));
        let d = compile(&s, &pods, &mut Ids::default()).unwrap();
        let inr = &d.rulesets[&d.pods["a"].ingress];
        assert!(inr.allows(0, ip("1.2.3.4"), TCP, 1) && inr.allows(0, ip("::1"), 58, 0));
        let eg = &d.rulesets[&d.pods["a"].egress];
        assert!(eg.allows(0, ip("8.8.8.8"), UDP, 53) && !eg.allows(0, ip("8.8.8.8"), TCP, 53));
        assert_eq!(
            eg.intervals(false),
            vec![(0, u32::MAX as u128, eg.cidrs[0].1.clone())]
        );
    }

    #[test]
    fn port_unions_merge() {
        let mut p = Ports::Ranges(vec![PortRange {
            proto: TCP,
            lo: 10,
            hi: 20,
        }]);
        p.union(&Ports::Ranges(vec![
            PortRange {
                proto: TCP,
                lo: 21,
                hi: 30,
            },
            PortRange {
                proto: UDP,
                lo: 5,
                hi: 5,
            },
            PortRange {
                proto: TCP,
                lo: 15,
                hi: 16,
            },
        ]));
        assert_eq!(
            p,
            Ports::Ranges(vec![
                PortRange {
                    proto: TCP,
                    lo: 10,
                    hi: 30
                },
                PortRange {
                    proto: UDP,
                    lo: 5,
                    hi: 5
                }
            ])
        );
        p.union(&Ports::All);
        assert_eq!(p, Ports::All);
    }

    #[test]
    fn named_ports_resolve_from_the_policed_pods_own_ports() {
        let s = set(json!([
            {"name":"web","podSelector":{"matchLabels":{"app":"web"}},
             "ingress":[{"ports":[{"port":"http"},{"protocol":"UDP","port":"dns"},{"port":22}]}],
             "egress":[{"ports":[{"port":"http"}]}]}
        ]));
        let mut a = pod("default", &[("app", "web")]);
        a.ports = [
            ("http".to_string(), ("TCP".to_string(), 8080)),
            // The protocol must agree: the rule asks UDP.
            ("dns".to_string(), ("TCP".to_string(), 53)),
        ]
        .into();
        let mut b = pod("default", &[("app", "web")]);
        b.ports = [("http".to_string(), ("TCP".to_string(), 9090))].into();
        let c = pod("default", &[("app", "web")]);
        let pods: BTreeMap<String, PodView> = [
            ("a/eth0".to_string(), a),
            ("b/eth0".to_string(), b),
            ("c/eth0".to_string(), c),
        ]
        .into();
        let mut ids = Ids::default();
        let d = compile(&s, &pods, &mut ids).unwrap();
        let ingress = |k: &str| &d.rulesets[&d.pods[k].ingress];
        let any: IpAddr = ip("10.9.9.9");
        // Same labels, one identity, but each its own ports.
        assert_eq!(d.pods["a/eth0"].identity, d.pods["b/eth0"].identity);
        assert!(ingress("a/eth0").allows(0, any, TCP, 8080));
        assert!(!ingress("a/eth0").allows(0, any, TCP, 9090));
        assert!(!ingress("a/eth0").allows(0, any, UDP, 53));
        assert!(!ingress("a/eth0").allows(0, any, TCP, 53));
        assert!(ingress("b/eth0").allows(0, any, TCP, 9090));
        assert!(!ingress("b/eth0").allows(0, any, TCP, 8080));
        // No such port: only the numbered one.
        assert!(ingress("c/eth0").allows(0, any, TCP, 22));
        assert!(!ingress("c/eth0").allows(0, any, TCP, 8080));
        // Egress names refer to the peers' ports: toward an address no pod
        // has, nothing; toward this node's pods of the identity, the
        // ports its pods have by that name.
        let eg = &d.rulesets[&d.pods["a/eth0"].egress];
        assert!(!eg.allows(0, any, TCP, 8080));
        let web = d.pods["a/eth0"].identity;
        assert!(eg.allows(web, any, TCP, 8080));
        assert!(eg.allows(web, any, TCP, 9090));
        assert!(!eg.allows(web, any, TCP, 22));
        // Pods with the same policies and ports share the rule set.
        assert_eq!(d.pods["c/eth0"].egress, d.pods["a/eth0"].egress);
    }

    #[test]
    fn egress_named_ports_resolve_from_each_peers_own_ports() {
        let mut s = set(json!([
            {"name":"client","podSelector":{"matchLabels":{"app":"client"}},
             "policyTypes":["Egress"],
             "egress":[{"ports":[{"protocol":"UDP","port":"dns"}]},
                       {"to":[{"podSelector":{"matchLabels":{"app":"db"}}}],
                        "ports":[{"port":"pg"}]}]}
        ]));
        s.add_document(
            &json!({"kind":"PodList","items":[
                {"kind":"Pod","metadata":{"namespace":"default","name":"db","labels":{"app":"db"}},
                 "spec":{"containers":[{"name":"c","ports":[{"name":"pg","containerPort":5432}]}]},
                 "status":{"podIP":"10.244.2.5"}},
                {"kind":"Pod","metadata":{"namespace":"default","name":"dns","labels":{"app":"dns"}},
                 "spec":{"containers":[{"ports":[{"name":"dns","containerPort":1053,"protocol":"UDP"},
                                                  {"name":"pg","containerPort":6543}]}]},
                 "status":{"podIP":"10.244.2.6"}}]}),
            "f",
        )
        .unwrap();
        let pods: BTreeMap<String, PodView> =
            [("c/eth0".to_string(), pod("default", &[("app", "client")]))].into();
        let d = compile(&s, &pods, &mut Ids::default()).unwrap();
        let eg = &d.rulesets[&d.pods["c/eth0"].egress];
        let (db, dns) = (ip("10.244.2.5"), ip("10.244.2.6"));
        // A rule without peers: every pod, on the port it names so.
        assert!(eg.allows(0, dns, UDP, 1053));
        assert!(!eg.allows(0, db, UDP, 1053));
        // With a selector: only the selected pod's port of that name.
        assert!(eg.allows(0, db, TCP, 5432));
        assert!(!eg.allows(0, dns, TCP, 6543));
        assert!(!eg.allows(0, ip("10.9.9.9"), TCP, 5432));
        // What the eBPF table holds agrees.
        let lpm = eg.lpm_entries();
        let at = |a: IpAddr| lpm.iter().find(|(n, _)| n.ip() == a && n.prefix() == 32);
        assert!(at(db).unwrap().1.allows(TCP, 5432));
        assert!(at(dns).unwrap().1.allows(UDP, 1053));
    }

    #[test]
    fn a_service_address_is_judged_by_its_endpoints() {
        let mut s = set(json!([
            // Everything but the server's own address, as upstream's
            // "except clause" spec.
            {"name":"client","podSelector":{"matchLabels":{"app":"client"}},
             "policyTypes":["Egress"],
             "egress":[{"to":[{"ipBlock":{"cidr":"0.0.0.0/0","except":["10.244.2.5/32"]}}]}]}
        ]));
        s.add_document(
            &json!([
                {"kind":"Service","metadata":{"namespace":"default","name":"srv"},
                 "spec":{"clusterIP":"10.96.0.20","ports":[{"port":80,"targetPort":8080}]}},
                {"kind":"EndpointSlice","addressType":"IPv4",
                 "metadata":{"namespace":"default","name":"srv-1",
                             "labels":{"kubernetes.io/service-name":"srv"}},
                 "endpoints":[{"addresses":["10.244.2.5"]}],"ports":[{"port":8080}]},
                {"kind":"Service","metadata":{"namespace":"default","name":"other"},
                 "spec":{"clusterIP":"10.96.0.21","ports":[{"port":80,"targetPort":8080}]}},
                {"kind":"EndpointSlice","addressType":"IPv4",
                 "metadata":{"namespace":"default","name":"other-1",
                             "labels":{"kubernetes.io/service-name":"other"}},
                 "endpoints":[{"addresses":["10.244.1.9"]}],"ports":[{"port":8080}]},
                {"kind":"Service","metadata":{"namespace":"default","name":"empty"},
                 "spec":{"clusterIP":"10.96.0.22","ports":[{"port":80}]}}
            ]),
            "f",
        )
        .unwrap();
        let mut client = pod("default", &[("app", "client")]);
        client.addrs = vec![ip("10.244.1.8")];
        let mut local = pod("default", &[("app", "other")]);
        local.addrs = vec![ip("10.244.1.9")];
        let pods: BTreeMap<String, PodView> = [
            ("c/eth0".to_string(), client),
            ("o/eth0".to_string(), local),
        ]
        .into();
        let d = compile(&s, &pods, &mut Ids::default()).unwrap();
        let eg = &d.rulesets[&d.pods["c/eth0"].egress];
        // The ClusterIP is inside 0.0.0.0/0, its endpoint is excepted.
        assert!(!eg.allows(0, ip("10.96.0.20"), TCP, 80));
        // An endpoint the rules allow (a pod of this node, by address).
        assert!(eg.allows(0, ip("10.96.0.21"), TCP, 80));
        // Only the Service's own ports pass to its address.
        assert!(!eg.allows(0, ip("10.96.0.21"), TCP, 8080));
        // No endpoints: kube-proxy answers the connection itself.
        assert!(eg.allows(0, ip("10.96.0.22"), TCP, 80));
        let lpm = eg.lpm_entries();
        let at = |a: &str| {
            lpm.iter()
                .find(|(n, _)| n.ip() == ip(a) && n.prefix() == 32)
        };
        assert!(at("10.96.0.20").unwrap().1.is_none());
        assert_eq!(
            at("10.96.0.21").unwrap().1,
            Ports::Ranges(vec![PortRange {
                proto: TCP,
                lo: 80,
                hi: 80
            }])
        );
        // Ingress rule sets never carry them: the receiver sees the endpoint.
        assert!(
            d.rulesets
                .values()
                .all(|r| r.dir == Dir::Egress || r.services.is_empty())
        );
    }

    /// A Pod object of another node, as the agent writes it.
    fn remote(ns: &str, name: &str, app: &str, ips: &[&str]) -> serde_json::Value {
        let ips: Vec<_> = ips.iter().map(|i| json!({"ip": i})).collect();
        json!({"kind":"Pod","metadata":{"namespace":ns,"name":name,"labels":{"app":app}},
               "spec":{"nodeName":"n2"},"status":{"podIPs":ips}})
    }

    #[test]
    fn pod_and_namespace_selectors_match_other_nodes_pods_by_address() {
        let mut s = set(json!([
            {"kind":"Namespace","metadata":{"name":"prod","labels":{"team":"a"}}},
            {"kind":"Namespace","metadata":{"name":"dev","labels":{"team":"b"}}},
            {"name":"web","podSelector":{"matchLabels":{"app":"web"}},
             "policyTypes":["Ingress","Egress"],
             "ingress":[
                {"from":[{"podSelector":{"matchLabels":{"app":"client"}}}],"ports":[{"port":80}]},
                {"from":[{"namespaceSelector":{"matchLabels":{"team":"a"}},
                          "podSelector":{"matchLabels":{"app":"client"}}}],"ports":[{"port":443}]},
                {"from":[{"namespaceSelector":{"matchLabels":{"team":"b"}}}],
                 "ports":[{"protocol":"UDP","port":53}]}],
             "egress":[{"to":[{"podSelector":{"matchLabels":{"app":"db"}}}],"ports":[{"port":5432}]}]}
        ]));
        s.add_document(
            &json!({"kind":"PodList","items":[
                remote("default", "client", "client", &["10.244.2.5", "fd00:2::5"]),
                remote("default", "db", "db", &["10.244.3.7"]),
                remote("default", "other", "other", &["10.244.3.8"]),
                remote("prod", "client", "client", &["10.244.2.6"]),
                remote("prod", "other", "other", &["10.244.2.9"]),
                remote("dev", "any", "x", &["10.244.3.10"]),
                // Host network, finished, or without an address: no peers.
                {"kind":"Pod","metadata":{"namespace":"default","name":"h","labels":{"app":"client"}},
                 "spec":{"hostNetwork":true},"status":{"podIP":"192.168.50.22"}},
                {"kind":"Pod","metadata":{"namespace":"default","name":"f","labels":{"app":"client"}},
                 "status":{"phase":"Succeeded","podIP":"10.244.2.99"}},
                {"kind":"Pod","metadata":{"namespace":"default","name":"p","labels":{"app":"client"}},
                 "status":{"phase":"Pending"}}
            ]}),
            "k8s-pods.json",
        )
        .unwrap();
        s.sort();
        assert_eq!(s.remote_pods.len(), 6);
        let mut pods = BTreeMap::new();
        pods.insert("w".to_string(), pod("default", &[("app", "web")]));
        let mut ids = Ids::default();
        let d = compile(&s, &pods, &mut ids).unwrap();
        let w = d.pods["w"];
        let (inr, eg) = (&d.rulesets[&w.ingress], &d.rulesets[&w.egress]);
        // No identity: by address alone.
        let cases = [
            ("10.244.2.5", TCP, 80, true),
            ("fd00:2::5", TCP, 80, true),
            ("10.244.2.5", TCP, 443, false),
            ("10.244.2.6", TCP, 443, true), // prod's client: ns and pod selector
            ("10.244.2.6", TCP, 80, false), // podSelector alone: own namespace only
            ("10.244.2.9", TCP, 443, false),
            ("10.244.3.10", UDP, 53, true), // dev: namespace selector alone
            ("10.244.3.10", TCP, 80, false),
            ("10.244.3.7", TCP, 80, false),
            ("10.244.3.8", TCP, 80, false),
            ("192.168.50.22", TCP, 80, false),
            ("10.244.2.99", TCP, 80, false),
        ];
        for (a, proto, port, want) in cases {
            assert_eq!(
                inr.allows(0, ip(a), proto, port),
                want,
                "{a} {proto}/{port}"
            );
        }
        assert!(eg.allows(0, ip("10.244.3.7"), TCP, 5432));
        assert!(!eg.allows(0, ip("10.244.2.5"), TCP, 5432));
        assert_eq!(inr.remote.len(), 4, "{:?}", inr.remote);
        assert!(inr.cidrs.is_empty());

        // Relabeled (the agent rewrites the file): the same rule set
        // number, other addresses.
        let before = w.ingress;
        for r in &mut s.remote_pods {
            if r.name == "client" && r.namespace == "default" {
                r.labels.insert("app".into(), "gone".into());
            }
            if r.name == "other" && r.namespace == "default" {
                r.labels.insert("app".into(), "client".into());
            }
        }
        let d = compile(&s, &pods, &mut ids).unwrap();
        assert_eq!(d.pods["w"].ingress, before);
        let inr = &d.rulesets[&before];
        assert!(!inr.allows(0, ip("10.244.2.5"), TCP, 80));
        assert!(!inr.allows(0, ip("fd00:2::5"), TCP, 80));
        assert!(inr.allows(0, ip("10.244.3.8"), TCP, 80));
    }

    #[test]
    fn a_local_pods_address_is_never_a_remote_peer() {
        let mut s = set(
            json!({"name":"web","podSelector":{"matchLabels":{"app":"web"}},
            "ingress":[{"from":[{"podSelector":{"matchLabels":{"app":"client"}}}]}]}),
        );
        // A stale entry: the address is a local pod's now, labelled otherwise.
        s.add_document(&remote("default", "old", "client", &["10.244.1.7"]), "f")
            .unwrap();
        let mut local = pod("default", &[("app", "db")]);
        local.addrs = vec![ip("10.244.1.7")];
        let mut pods = BTreeMap::new();
        pods.insert("w".to_string(), pod("default", &[("app", "web")]));
        pods.insert("l".to_string(), local);
        let d = compile(&s, &pods, &mut Ids::default()).unwrap();
        let inr = &d.rulesets[&d.pods["w"].ingress];
        assert!(inr.remote.is_empty());
        assert!(!inr.allows(d.pods["l"].identity, ip("10.244.1.7"), TCP, 80));
    }

    #[test]
    fn remote_addresses_join_the_prefixes_for_longest_prefix_match() {
        let mut s = set(json!({"name":"web","podSelector":{},"ingress":[
            {"from":[{"ipBlock":{"cidr":"10.244.0.0/16","except":["10.244.2.0/24"]}}],"ports":[{"port":22}]},
            {"from":[{"podSelector":{"matchLabels":{"app":"client"}}}],"ports":[{"port":80}]}]}));
        s.add_document(
            &json!([
                remote("default", "a", "client", &["10.244.2.5", "fd00::5"]),
                remote("default", "b", "client", &["10.244.3.5"]),
                remote("default", "c", "other", &["10.244.3.6"])
            ]),
            "f",
        )
        .unwrap();
        let mut pods = BTreeMap::new();
        pods.insert("w".to_string(), pod("default", &[]));
        let d = compile(&s, &pods, &mut Ids::default()).unwrap();
        let rs = &d.rulesets[&d.pods["w"].ingress];
        let lpm = rs.lpm_entries();
        let at = |n: &str| lpm.iter().find(|(p, _)| p.to_string() == n).map(|(_, p)| p);
        let tcp = |ports: &[u16]| {
            Ports::Ranges(
                ports
                    .iter()
                    .map(|p| PortRange {
                        proto: TCP,
                        lo: *p,
                        hi: *p,
                    })
                    .collect(),
            )
        };
        // In the except hole: its own port only; in the block: both.
        assert_eq!(at("10.244.2.5/32"), Some(&tcp(&[80])));
        assert_eq!(at("10.244.3.5/32"), Some(&tcp(&[22, 80])));
        assert_eq!(at("fd00::5/128"), Some(&tcp(&[80])));
        assert_eq!(at("10.244.3.6/32"), None);
        assert_eq!(lpm.len(), rs.cidrs.len() + 3);
        // The table says what `allows` says.
        for (a, port) in [("10.244.2.5", 80), ("10.244.2.5", 22), ("10.244.3.5", 22)] {
            let best = lpm
                .iter()
                .filter(|(n, _)| n.contains(ip(a)))
                .max_by_key(|(n, _)| n.prefix())
                .is_some_and(|(_, p)| p.allows(TCP, port));
            assert_eq!(best, rs.allows(0, ip(a), TCP, port), "{a} {port}");
        }
        // The rule set survives the state file.
        let back: RuleSet = serde_json::from_str(&serde_json::to_string(rs).unwrap()).unwrap();
        assert_eq!(&back, rs);
    }
}
