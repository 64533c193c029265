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

use crate::compile::{Desired, PodPolicy, Ports};
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

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct AppliedPod {
    policy: PodPolicy,
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
    let prog = dp.program_id().map_err(err)?;
    let mut applied: Applied = serde_json::from_value(applied_json.clone()).unwrap_or_default();
    if applied.prog != prog {
        applied = Applied {
            prog,
            ..Default::default()
        };
    }
    let mut ch = Changes::default();
    let mut narrowed = false;

    let lpm: BTreeMap<u32, Vec<(IpNetwork, Ports)>> = desired
        .rulesets
        .iter()
        .map(|(id, rs)| (*id, rs.lpm_entries()))
        .collect();
    // Port sets in use, interned: ids from 2 (0: none, 1: all).
    let mut wanted_ps: BTreeMap<String, &Ports> = BTreeMap::new();
    for (id, rs) in &desired.rulesets {
        for p in rs.peers.values().chain(lpm[id].iter().map(|(_, p)| p)) {
            if matches!(p, Ports::Ranges(r) if !r.is_empty()) {
                wanted_ps.insert(ranges_key(p), p);
            }
        }
    }
    for (k, p) in &wanted_ps {
        if !applied.portsets.contains_key(k) {
            let used: BTreeSet<u32> = applied.portsets.values().copied().collect();
            let id = (2..).find(|n| !used.contains(n)).expect("u32 space");
            dp.put_portset(id, &to_ebpf_ranges(p)).map_err(err)?;
            applied.portsets.insert(k.clone(), id);
        }
    }
    let ps_id = |applied: &Applied, p: &Ports| -> u32 {
        match p {
            Ports::All => rcni_ebpf::PORTSET_ALL,
            Ports::Ranges(r) if r.is_empty() => rcni_ebpf::PORTSET_NONE,
            _ => applied.portsets[&ranges_key(p)],
        }
    };

    // Rule sets, before any endpoint points at them.
    for (id, rs) in &desired.rulesets {
        let old = applied.rulesets.get(id).cloned().unwrap_or_default();
        let peers: BTreeMap<u32, u32> = rs
            .peers
            .iter()
            .map(|(i, p)| (*i, ps_id(&applied, p)))
            .collect();
        for (ident, ps) in &peers {
            if old.peers.get(ident) != Some(ps) {
                if old.peers.contains_key(ident) {
                    narrowed = true;
                }
                dp.put_peer(*id, *ident, *ps).map_err(err)?;
                ch.peers += 1;
            }
        }
        for ident in old.peers.keys().filter(|i| !peers.contains_key(i)) {
            dp.remove_peer(*id, *ident).map_err(err)?;
            narrowed = true;
            ch.peers += 1;
        }
        let hash = cidr_hash(&lpm[id]);
        if hash != old.cidr_hash {
            let want: BTreeMap<(IpAddr, u8), u32> = lpm[id]
                .iter()
                .map(|(n, p)| ((n.network(), n.prefix()), ps_id(&applied, p)))
                .collect();
            let have = dp.cidrs(Some(*id)).map_err(err)?;
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
                narrowed = true;
            }
            dp.put_cidrs(*id, &puts).map_err(err)?;
            ch.cidrs += puts.len();
            let gone: Vec<(IpAddr, u8)> = have_map
                .keys()
                .filter(|k| !want.contains_key(k))
                .copied()
                .collect();
            if !gone.is_empty() {
                narrowed = true;
                dp.remove_cidrs(*id, &gone).map_err(err)?;
                ch.cidrs += gone.len();
            }
        }
        applied.rulesets.insert(
            *id,
            AppliedRs {
                cidr_hash: hash,
                peers,
            },
        );
    }

    // Endpoints.
    for (key, pod) in pods {
        let Some(policy) = desired.pods.get(key) else {
            continue;
        };
        let want = AppliedPod {
            policy: *policy,
            addrs: pod.addrs.clone(),
            ifindex: pod.host_ifindex,
            owner: owner(pod),
        };
        let old = applied.pods.get(key);
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
                dp.clear_policy_endpoint(&keys(&stale), old.owner)
                    .map_err(err)?;
            }
            // A pod whose policy got stricter must not keep connections
            // through its old one.
            if old.policy != want.policy {
                narrowed = true;
            }
        }
        dp.set_policy_endpoint(
            &keys(&want.addrs),
            want.ifindex,
            want.owner,
            policy.identity,
            policy.ingress,
            policy.egress,
        )
        .map_err(err)?;
        ch.endpoints += want.addrs.len();
        applied.pods.insert(key.clone(), want);
    }
    let gone: Vec<String> = applied
        .pods
        .keys()
        .filter(|k| !pods.contains_key(*k) || !desired.pods.contains_key(*k))
        .cloned()
        .collect();
    for k in gone {
        let old = applied.pods.remove(&k).expect("listed");
        dp.clear_policy_endpoint(&keys(&old.addrs), old.owner)
            .map_err(err)?;
        ch.endpoints += old.addrs.len();
        let addrs: BTreeSet<EndpointKey> = keys(&old.addrs).into_iter().collect();
        ch.ct_flushed += dp
            .flush_ct(|k| addrs.contains(&k.src()) || addrs.contains(&k.dst()))
            .map_err(err)?;
    }

    // Rule sets and port sets nothing uses any more.
    let dead: Vec<u32> = applied
        .rulesets
        .keys()
        .filter(|id| !desired.rulesets.contains_key(id))
        .copied()
        .collect();
    for id in dead {
        let old = applied.rulesets.remove(&id).expect("listed");
        for ident in old.peers.keys() {
            dp.remove_peer(id, *ident).map_err(err)?;
            ch.peers += 1;
        }
        let have: Vec<(IpAddr, u8)> = dp
            .cidrs(Some(id))
            .map_err(err)?
            .into_iter()
            .map(|(_, a, l, _)| (a, l))
            .collect();
        ch.cidrs += have.len();
        dp.remove_cidrs(id, &have).map_err(err)?;
    }
    let dead_ps: Vec<(String, u32)> = applied
        .portsets
        .iter()
        .filter(|(k, _)| !wanted_ps.contains_key(*k))
        .map(|(k, v)| (k.clone(), *v))
        .collect();
    for (k, id) in dead_ps {
        dp.remove_portset(id).map_err(err)?;
        applied.portsets.remove(&k);
    }
    if narrowed {
        ch.ct_flushed += dp.flush_ct(|_| true).map_err(err)?;
    }
    *applied_json =
        serde_json::to_value(&applied).map_err(|e| CniError::internal(e.to_string()))?;
    Ok(ch)
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
