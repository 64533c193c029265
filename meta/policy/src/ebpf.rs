//! The eBPF backend: the compiled policy written into the network's maps
//! (rcni-ebpf), shared with fastpath.
//!
//! - endpoints (`rcni_endpoints`, fastpath's map): each pod address gets
//!   its identity and its ingress and egress rule set;
//! - `rcni_pol_peer`: (rule set, identity) -> port set;
//! - `rcni_pol_cidr`: LPM trie (rule set, prefix) -> port set; other
//!   nodes' pods a rule set selects are host prefixes here (identities
//!   are this node's endpoints only);
//! - `rcni_pol_ports`: port set -> ranges (0 and 1 reserved: none, all).
//!
//! Only differences are written: what was applied is kept in the state
//! file. Rule sets are written before endpoints point at them and removed
//! after nothing does. Whenever an allowed set shrinks, connection tracking
//! of the network is flushed, so a connection the new policy denies cannot
//! live on as a "reply".

use crate::compile::{Desired, PodPolicy, Ports, RuleSet};
use crate::conf::{Conf, FlowEvents};
use crate::state::PodRecord;
use ipnetwork::IpNetwork;
use rcni_cni::{CniError, ErrorCode};
use rcni_ebpf::{AttachmentId, Datapath, EndpointKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

pub fn err(e: rcni_ebpf::Error) -> CniError {
    CniError::new(ErrorCode::Ebpf, format!("policy: {e}"))
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct AppliedRs {
    cidr_hash: String,
    peers: BTreeMap<u32, u32>,
}

/// The datapath's flow event switches for `conf`.
pub fn flow_events(conf: &Conf) -> u32 {
    match conf.flow_events {
        FlowEvents::None => 0,
        FlowEvents::Deny => rcni_ebpf::EVENTS_DENY,
        FlowEvents::All => rcni_ebpf::EVENTS_DENY | rcni_ebpf::EVENTS_ALLOW,
    }
}

/// The endpoint's audit flags: the directions whose rule set is audit-only.
fn audit_flags(desired: &Desired, p: &PodPolicy) -> u32 {
    let audit = |rs: u32| desired.rulesets.get(&rs).is_some_and(|r| r.audit);
    let mut f = 0;
    if audit(p.ingress) {
        f |= rcni_ebpf::POL_AUDIT_IN;
    }
    if audit(p.egress) {
        f |= rcni_ebpf::POL_AUDIT_OUT;
    }
    f
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct AppliedPod {
    policy: PodPolicy,
    #[serde(default)]
    audit: u32,
    addrs: Vec<IpAddr>,
    ifindex: u32,
    owner: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Applied {
    /// The program the entries were written for: a network loaded afresh
    /// (its pins removed) has empty maps, whatever this file says.
    prog: u32,
    portsets: BTreeMap<String, u32>,
    rulesets: BTreeMap<u32, AppliedRs>,
    pods: BTreeMap<String, AppliedPod>,
}

/// What [`apply`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Changes {
    pub endpoints: usize,
    pub cidrs: usize,
    pub peers: usize,
    pub ct_flushed: usize,
}

fn ranges_key(r: &Ports) -> String {
    serde_json::to_string(r).expect("serializable")
}

fn cidr_hash(entries: &[(IpNetwork, Ports)]) -> String {
    let mut h = Sha256::new();
    for (n, p) in entries {
        h.update(n.to_string().as_bytes());
        h.update(ranges_key(p).as_bytes());
        h.update(b";");
    }
    h.finalize()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn to_ebpf_ranges(p: &Ports) -> Vec<rcni_ebpf::PortRange> {
    match p {
        Ports::All => vec![],
        Ports::Ranges(r) => r
            .iter()
            .map(|r| rcni_ebpf::PortRange::new(r.proto, r.lo, r.hi))
            .collect(),
    }
}

fn keys(addrs: &[IpAddr]) -> Vec<EndpointKey> {
    addrs.iter().map(|a| EndpointKey::new(*a)).collect()
}

pub fn owner(p: &PodRecord) -> u64 {
    AttachmentId::new(&p.container_id, &p.ifname).owner()
}

/// Makes the maps say what `desired` says for `pods`; pods that were
/// applied before and are not in `pods` lose their entries.
pub fn apply(
    dp: &mut Datapath,
    pods: &BTreeMap<String, PodRecord>,
    desired: &Desired,
    applied_json: &mut serde_json::Value,
) -> Result<Changes, CniError> {
    let applied = load_applied(dp, applied_json)?;
    let mut w = Writer {
        dp,
        applied,
        ch: Changes::default(),
        narrowed: false,
    };
    let lpm: BTreeMap<u32, Vec<(IpNetwork, Ports)>> = desired
        .rulesets
        .iter()
        .map(|(id, rs)| (*id, rs.lpm_entries()))
        .collect();
    let wanted_ps = wanted_portsets(desired, &lpm);
    w.put_portsets(&wanted_ps)?;
    for (id, rs) in &desired.rulesets {
        w.put_ruleset(*id, rs, &lpm[id])?;
    }
    w.put_endpoints(pods, desired)?;
    w.clear_gone_pods(pods, desired)?;
    w.remove_dead_rulesets(desired)?;
    w.remove_dead_portsets(&wanted_ps)?;
    if w.narrowed {
        w.ch.ct_flushed += w.dp.flush_ct(|_| true).map_err(err)?;
    }
    *applied_json =
        serde_json::to_value(&w.applied).map_err(|e| CniError::internal(e.to_string()))?;
    Ok(w.ch)
}

/// What the state says was applied, or nothing when the datapath's program
/// changed since: a network loaded afresh (its pins removed) has empty
/// maps, whatever the state file says.
fn load_applied(dp: &mut Datapath, applied_json: &serde_json::Value) -> Result<Applied, CniError> {
    let prog = dp.program_id().map_err(err)?;
    let mut applied: Applied = serde_json::from_value(applied_json.clone()).unwrap_or_default();
    if applied.prog != prog {
        applied = Applied {
            prog,
            ..Default::default()
        };
    }
    Ok(applied)
}

/// The port sets the rule sets use, by their key: only real ranges need an
/// entry (0 and 1 are none and all).
fn wanted_portsets<'a>(
    desired: &'a Desired,
    lpm: &'a BTreeMap<u32, Vec<(IpNetwork, Ports)>>,
) -> BTreeMap<String, &'a Ports> {
    let mut wanted_ps: BTreeMap<String, &Ports> = BTreeMap::new();
    for (id, rs) in &desired.rulesets {
        for p in rs.peers.values().chain(lpm[id].iter().map(|(_, p)| p)) {
            if matches!(p, Ports::Ranges(r) if !r.is_empty()) {
                wanted_ps.insert(ranges_key(p), p);
            }
        }
    }
    wanted_ps
}

impl Applied {
    /// The port set id entries point at for `p`; a range list must have
    /// been interned first ([`Writer::put_portsets`]).
    fn portset_id(&self, p: &Ports) -> u32 {
        match p {
            Ports::All => rcni_ebpf::PORTSET_ALL,
            Ports::Ranges(r) if r.is_empty() => rcni_ebpf::PORTSET_NONE,
            _ => self.portsets[&ranges_key(p)],
        }
    }
}

/// One [`apply`] under way: the datapath, what is applied so far, what
/// changed, and whether anything allowed before may now be denied.
struct Writer<'a> {
    dp: &'a mut Datapath,
    applied: Applied,
    ch: Changes,
    /// An allowed set shrank: connection tracking is flushed at the end,
    /// so a connection the new policy denies cannot live on as a "reply".
    narrowed: bool,
}

impl Writer<'_> {
    /// Port sets first, interned with ids from 2 (0: none, 1: all): rule
    /// set entries point at them.
    fn put_portsets(&mut self, wanted_ps: &BTreeMap<String, &Ports>) -> Result<(), CniError> {
        for (k, p) in wanted_ps {
            if !self.applied.portsets.contains_key(k) {
                let used: BTreeSet<u32> = self.applied.portsets.values().copied().collect();
                let id = (2..).find(|n| !used.contains(n)).expect("u32 space");
                self.dp.put_portset(id, &to_ebpf_ranges(p)).map_err(err)?;
                self.applied.portsets.insert(k.clone(), id);
            }
        }
        Ok(())
    }

    /// A rule set's peers and prefixes, before any endpoint points at it.
    fn put_ruleset(
        &mut self,
        id: u32,
        rs: &RuleSet,
        lpm: &[(IpNetwork, Ports)],
    ) -> Result<(), CniError> {
        let old = self.applied.rulesets.get(&id).cloned().unwrap_or_default();
        let peers = self.put_peers(id, rs, &old)?;
        let hash = cidr_hash(lpm);
        if hash != old.cidr_hash {
            self.put_cidrs(id, lpm)?;
        }
        self.applied.rulesets.insert(
            id,
            AppliedRs {
                cidr_hash: hash,
                peers,
            },
        );
        Ok(())
    }

    /// The (rule set, identity) entries that differ from `old`, and those
    /// gone removed; returns the peers now applied.
    fn put_peers(
        &mut self,
        id: u32,
        rs: &RuleSet,
        old: &AppliedRs,
    ) -> Result<BTreeMap<u32, u32>, CniError> {
        let peers: BTreeMap<u32, u32> = rs
            .peers
            .iter()
            .map(|(i, p)| (*i, self.applied.portset_id(p)))
            .collect();
        for (ident, ps) in &peers {
            if old.peers.get(ident) != Some(ps) {
                if old.peers.contains_key(ident) {
                    self.narrowed = true;
                }
                self.dp.put_peer(id, *ident, *ps).map_err(err)?;
                self.ch.peers += 1;
            }
        }
        for ident in old.peers.keys().filter(|i| !peers.contains_key(i)) {
            self.dp.remove_peer(id, *ident).map_err(err)?;
            self.narrowed = true;
            self.ch.peers += 1;
        }
        Ok(peers)
    }

    /// A rule set's prefixes, when their list changed (its hash differs):
    /// the state keeps only the hash, so the difference is taken against
    /// what the trie holds.
    fn put_cidrs(&mut self, id: u32, lpm: &[(IpNetwork, Ports)]) -> Result<(), CniError> {
        let want: BTreeMap<(IpAddr, u8), u32> = lpm
            .iter()
            .map(|(n, p)| ((n.network(), n.prefix()), self.applied.portset_id(p)))
            .collect();
        let have = self.dp.cidrs(Some(id)).map_err(err)?;
        let mut have_map = BTreeMap::new();
        for (_, addr, len, ps) in have {
            have_map.insert((addr, len), ps);
        }
        let puts: Vec<(IpAddr, u8, u32)> = want
            .iter()
            .filter(|(k, v)| have_map.get(k) != Some(v))
            .map(|((a, l), v)| (*a, *l, *v))
            .collect();
        if puts
            .iter()
            .any(|(a, l, _)| have_map.contains_key(&(*a, *l)))
        {
            self.narrowed = true;
        }
        self.dp.put_cidrs(id, &puts).map_err(err)?;
        self.ch.cidrs += puts.len();
        let gone: Vec<(IpAddr, u8)> = have_map
            .keys()
            .filter(|k| !want.contains_key(k))
            .copied()
            .collect();
        if !gone.is_empty() {
            self.narrowed = true;
            self.dp.remove_cidrs(id, &gone).map_err(err)?;
            self.ch.cidrs += gone.len();
        }
        Ok(())
    }

    /// Each pod's addresses point at its identity and rule sets; addresses
    /// it no longer has lose theirs.
    fn put_endpoints(
        &mut self,
        pods: &BTreeMap<String, PodRecord>,
        desired: &Desired,
    ) -> Result<(), CniError> {
        for (key, pod) in pods {
            let Some(policy) = desired.pods.get(key) else {
                continue;
            };
            let want = AppliedPod {
                policy: *policy,
                audit: audit_flags(desired, policy),
                addrs: pod.addrs.clone(),
                ifindex: pod.host_ifindex,
                owner: owner(pod),
            };
            let old = self.applied.pods.get(key);
            if old == Some(&want) {
                continue;
            }
            if let Some(old) = old {
                let stale: Vec<IpAddr> = old
                    .addrs
                    .iter()
                    .filter(|a| !want.addrs.contains(a))
                    .copied()
                    .collect();
                if !stale.is_empty() {
                    self.dp
                        .clear_policy_endpoint(&keys(&stale), old.owner)
                        .map_err(err)?;
                }
                // A pod whose policy got stricter must not keep connections
                // through its old one.
                if old.policy != want.policy {
                    self.narrowed = true;
                }
            }
            self.dp
                .set_policy_endpoint_audited(
                    &keys(&want.addrs),
                    want.ifindex,
                    want.owner,
                    policy.identity,
                    policy.ingress,
                    policy.egress,
                    want.audit,
                )
                .map_err(err)?;
            self.ch.endpoints += want.addrs.len();
            self.applied.pods.insert(key.clone(), want);
        }
        Ok(())
    }

    /// Pods gone (or no longer given a policy) lose their entries and
    /// their connections.
    fn clear_gone_pods(
        &mut self,
        pods: &BTreeMap<String, PodRecord>,
        desired: &Desired,
    ) -> Result<(), CniError> {
        let gone: Vec<String> = self
            .applied
            .pods
            .keys()
            .filter(|k| !pods.contains_key(*k) || !desired.pods.contains_key(*k))
            .cloned()
            .collect();
        for k in gone {
            let old = self.applied.pods.remove(&k).expect("listed");
            self.dp
                .clear_policy_endpoint(&keys(&old.addrs), old.owner)
                .map_err(err)?;
            self.ch.endpoints += old.addrs.len();
            let addrs: BTreeSet<EndpointKey> = keys(&old.addrs).into_iter().collect();
            self.ch.ct_flushed += self
                .dp
                .flush_ct(|k| addrs.contains(&k.src()) || addrs.contains(&k.dst()))
                .map_err(err)?;
        }
        Ok(())
    }

    /// Rule sets nothing uses any more, once no endpoint points at them.
    fn remove_dead_rulesets(&mut self, desired: &Desired) -> Result<(), CniError> {
        let dead: Vec<u32> = self
            .applied
            .rulesets
            .keys()
            .filter(|id| !desired.rulesets.contains_key(id))
            .copied()
            .collect();
        for id in dead {
            let old = self.applied.rulesets.remove(&id).expect("listed");
            for ident in old.peers.keys() {
                self.dp.remove_peer(id, *ident).map_err(err)?;
                self.ch.peers += 1;
            }
            let have: Vec<(IpAddr, u8)> = self
                .dp
                .cidrs(Some(id))
                .map_err(err)?
                .into_iter()
                .map(|(_, a, l, _)| (a, l))
                .collect();
            self.ch.cidrs += have.len();
            self.dp.remove_cidrs(id, &have).map_err(err)?;
        }
        Ok(())
    }

    /// Port sets nothing uses any more, once no rule set points at them.
    fn remove_dead_portsets(
        &mut self,
        wanted_ps: &BTreeMap<String, &Ports>,
    ) -> Result<(), CniError> {
        let dead_ps: Vec<(String, u32)> = self
            .applied
            .portsets
            .iter()
            .filter(|(k, _)| !wanted_ps.contains_key(*k))
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        for (k, id) in dead_ps {
            self.dp.remove_portset(id).map_err(err)?;
            self.applied.portsets.remove(&k);
        }
        Ok(())
    }
}

/// Removes the rule entries (peers, CIDRs, port sets) the maps hold beyond
/// what `applied_json` records (nothing, for a network without pods): an
/// ADD killed between its map writes and its state's save leaves entries
/// no later apply knows of, and with them the network's datapath pinned.
/// Run under the network's lock, so no ADD is half way. Returns how many
/// went.
pub fn sweep_rules(
    dp: &mut Datapath,
    applied_json: &serde_json::Value,
    no_pods: bool,
) -> Result<usize, CniError> {
    let mut applied: Applied = serde_json::from_value(applied_json.clone()).unwrap_or_default();
    if no_pods || applied.prog != dp.program_id().map_err(err)? {
        applied = Applied::default();
    }
    let mut n = 0;
    for (k, _) in dp.peers().map_err(err)? {
        let kept = applied
            .rulesets
            .get(&k.rs)
            .is_some_and(|rs| rs.peers.contains_key(&k.identity));
        if !kept {
            dp.remove_peer(k.rs, k.identity).map_err(err)?;
            n += 1;
        }
    }
    let cidrs: Vec<(u32, IpAddr, u8)> = dp
        .cidrs(None)
        .map_err(err)?
        .into_iter()
        .filter(|(rs, ..)| !applied.rulesets.contains_key(rs))
        .map(|(rs, a, l, _)| (rs, a, l))
        .collect();
    for (rs, a, l) in &cidrs {
        dp.remove_cidr(*rs, *a, *l).map_err(err)?;
    }
    n += cidrs.len();
    let kept_ps: BTreeSet<u32> = applied.portsets.values().copied().collect();
    for (id, _) in dp.portsets().map_err(err)? {
        if !kept_ps.contains(&id) {
            dp.remove_portset(id).map_err(err)?;
            n += 1;
        }
    }
    Ok(n)
}

/// Whether the maps hold what `desired` says for one pod (CHECK).
pub fn check_pod(dp: &Datapath, pod: &PodRecord, want: &PodPolicy) -> Result<(), CniError> {
    for a in &pod.addrs {
        let ep = dp
            .endpoint(&EndpointKey::new(*a))
            .map_err(err)?
            .ok_or_else(|| CniError::check_failed(format!("policy: no endpoint entry for {a}")))?;
        let got = (ep.identity, ep.ingress_rs, ep.egress_rs, ep.ifindex);
        let exp = (want.identity, want.ingress, want.egress, pod.host_ifindex);
        if got != exp || ep.flags & rcni_ebpf::EP_POLICY == 0 {
            return Err(CniError::check_failed(format!(
                "policy: endpoint {a} has identity/ingress/egress/ifindex {got:?}, expected {exp:?}"
            )));
        }
    }
    Ok(())
}
