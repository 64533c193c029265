//! The policy plugin's rule maps: port sets, peers by identity, CIDRs,
//! connection tracking and the node's addresses.
//!
//! Rule maps are written by the policy plugin alone (under its own lock): no
//! read-modify-write here. Write a rule set's entries before an endpoint
//! names it, and remove them after none does.

use crate::load::{collect, not_found_ok};
use crate::types::{self, CidrData, PortSet};
use crate::{
    CtKey, Datapath, EndpointKey, Error, FlowEvent, MAX_PORT_RANGES, PORTSET_ALL, PORTSET_NONE,
    PeerKey, PolicyConfig, PortRange, Result,
};
use aya::maps::lpm_trie::Key as LpmKey;
use aya::maps::{MapData, RingBuf};
use std::net::IpAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;
use zerocopy::FromBytes;

impl Datapath {
    /// Stores port set `id` (2 and up: 0 and 1 are [`PORTSET_NONE`] and
    /// [`PORTSET_ALL`], which the program never looks up).
    pub fn put_portset(&mut self, id: u32, ranges: &[PortRange]) -> Result<()> {
        if id == PORTSET_NONE || id == PORTSET_ALL {
            return Err(Error::msg(format!(
                "port set {id} is reserved ({PORTSET_NONE}: none, {PORTSET_ALL}: all)"
            )));
        }
        if ranges.len() > MAX_PORT_RANGES {
            return Err(Error::msg(format!(
                "port set {id} has {} ranges, the most one holds is {MAX_PORT_RANGES}",
                ranges.len()
            )));
        }
        let mut set = PortSet {
            n: ranges.len() as u32,
            pad: 0,
            r: [PortRange::default(); MAX_PORT_RANGES],
        };
        set.r[..ranges.len()].copy_from_slice(ranges);
        self.portsets
            .insert(id, set, 0)
            .map_err(|e| Error::aya(format!("write port set {id}"), e))
    }

    /// Missing is no error.
    pub fn remove_portset(&mut self, id: u32) -> Result<()> {
        not_found_ok(self.portsets.remove(&id), "remove port set")
    }

    /// Every stored port set, by id.
    pub fn portsets(&self) -> Result<Vec<(u32, Vec<PortRange>)>> {
        let mut v: Vec<(u32, Vec<PortRange>)> = collect(self.portsets.iter(), "list port sets")?
            .into_iter()
            .map(|(id, s)| {
                let n = (s.n as usize).min(MAX_PORT_RANGES);
                (id, s.r[..n].to_vec())
            })
            .collect();
        v.sort();
        Ok(v)
    }

    /// Rule set `rs` allows peers of `identity` on `portset`'s ports.
    pub fn put_peer(&mut self, rs: u32, identity: u32, portset: u32) -> Result<()> {
        self.put_peers(&[(PeerKey { rs, identity }, portset)])
    }

    pub fn put_peers(&mut self, entries: &[(PeerKey, u32)]) -> Result<()> {
        for (k, ps) in entries {
            self.peers
                .insert(k, ps, 0)
                .map_err(|e| Error::aya(format!("write peer {}/{}", k.rs, k.identity), e))?;
        }
        Ok(())
    }

    /// Missing is no error.
    pub fn remove_peer(&mut self, rs: u32, identity: u32) -> Result<()> {
        not_found_ok(self.peers.remove(&PeerKey { rs, identity }), "remove peer")
    }

    /// Every peer entry, sorted.
    pub fn peers(&self) -> Result<Vec<(PeerKey, u32)>> {
        let mut v = collect(self.peers.iter(), "list peers")?;
        v.sort();
        Ok(v)
    }

    /// Rule set `rs` allows addresses in `ip/prefix_len` on `portset`'s
    /// ports (the longest prefix of the rule set decides).
    pub fn put_cidr(&mut self, rs: u32, ip: IpAddr, prefix_len: u8, portset: u32) -> Result<()> {
        self.put_cidrs(rs, &[(ip, prefix_len, portset)])
    }

    /// Many CIDRs of one rule set: `(address, prefix length, port set)`.
    /// Host bits of the address are ignored.
    pub fn put_cidrs(&mut self, rs: u32, entries: &[(IpAddr, u8, u32)]) -> Result<()> {
        for (ip, len, ps) in entries {
            let key = cidr_key(rs, *ip, *len)?;
            self.cidrs
                .insert(&key, ps, 0)
                .map_err(|e| Error::aya(format!("write CIDR {ip}/{len} of rule set {rs}"), e))?;
        }
        Ok(())
    }

    /// Missing is no error.
    pub fn remove_cidr(&mut self, rs: u32, ip: IpAddr, prefix_len: u8) -> Result<()> {
        self.remove_cidrs(rs, &[(ip, prefix_len)])
    }

    pub fn remove_cidrs(&mut self, rs: u32, entries: &[(IpAddr, u8)]) -> Result<()> {
        for (ip, len) in entries {
            let key = cidr_key(rs, *ip, *len)?;
            not_found_ok(self.cidrs.remove(&key), "remove CIDR")?;
        }
        Ok(())
    }

    /// CIDR entries as `(rule set, network address, prefix length, port
    /// set)`, of one rule set or all, sorted.
    pub fn cidrs(&self, rs: Option<u32>) -> Result<Vec<(u32, IpAddr, u8, u32)>> {
        let mut v: Vec<(u32, IpAddr, u8, u32)> = collect(self.cidrs.iter(), "list CIDRs")?
            .into_iter()
            .filter_map(|(k, ps)| {
                let (r, ip, len) = types::cidr_of(&k)?;
                Some((r, ip, len, ps))
            })
            .filter(|e| rs.is_none_or(|r| r == e.0))
            .collect();
        v.sort();
        Ok(v)
    }

    /// Every tracked flow with when it was recorded (CLOCK_MONOTONIC ns).
    pub fn ct_entries(&self) -> Result<Vec<(CtKey, u64)>> {
        let mut v = collect(self.ct.iter(), "list connection tracking")?;
        v.sort();
        Ok(v)
    }

    /// Forgets the tracked flows `pred` selects (their next packets are
    /// decided by the rules afresh); returns how many went.
    pub fn flush_ct(&mut self, pred: impl Fn(&CtKey) -> bool) -> Result<usize> {
        let keys: Vec<CtKey> = collect(
            self.ct.keys().map(|k| k.map(|k| (k, ()))),
            "list connection tracking",
        )?
        .into_iter()
        .map(|(k, ())| k)
        .filter(|k| pred(k))
        .collect();
        for k in &keys {
            not_found_ok(self.ct.remove(k), "forget a tracked flow")?;
        }
        Ok(keys.len())
    }

    /// Makes `rcni_node_addrs` hold exactly `addrs`: the node's own
    /// addresses, which pods may always reach whatever their egress policy
    /// (the program cannot ask the FIB: bpf_fib_lookup is for GPL programs
    /// only). Call it with the node's current addresses whenever policy is
    /// applied; an address the node gains in between is denied until then.
    pub fn set_node_addrs(&mut self, addrs: &[IpAddr]) -> Result<()> {
        let want: std::collections::BTreeSet<EndpointKey> =
            addrs.iter().map(|a| EndpointKey::new(*a)).collect();
        let have = collect(
            self.node_addrs.keys().map(|k| k.map(|k| (k, ()))),
            "list node addresses",
        )?;
        for (k, ()) in &have {
            if !want.contains(k) {
                not_found_ok(self.node_addrs.remove(k), "remove a node address")?;
            }
        }
        for k in &want {
            self.node_addrs
                .insert(k, 1, 0)
                .map_err(|e| Error::aya("write a node address", e))?;
        }
        Ok(())
    }

    /// The node addresses the program knows, sorted.
    pub fn node_addrs(&self) -> Result<Vec<IpAddr>> {
        let mut v: Vec<IpAddr> = collect(self.node_addrs.iter(), "list node addresses")?
            .into_iter()
            .filter_map(|(k, _)| k.ip())
            .collect();
        v.sort();
        Ok(v)
    }
}

/// A CIDR key, or an error for a prefix too long for the address.
fn cidr_key(rs: u32, ip: IpAddr, len: u8) -> Result<LpmKey<CidrData>> {
    types::cidr_key(rs, ip, len)
        .ok_or_else(|| Error::msg(format!("{ip}/{len}: prefix longer than the address")))
}

/// The reader of a network's policy flow events (`rcni_pol_events`). A
/// BPF ring buffer has one consumer position: one reader per network at a
/// time (the flow collector holds a lock for that).
pub struct FlowEvents {
    ring: RingBuf<MapData>,
}

impl FlowEvents {
    /// Reads what is in the ring now, oldest first, at most `max`.
    pub fn read(&mut self, max: usize) -> Vec<FlowEvent> {
        let mut out = Vec::new();
        while out.len() < max {
            let Some(item) = self.ring.next() else { break };
            if let Ok((e, _)) = FlowEvent::read_from_prefix(&item) {
                out.push(e);
            }
        }
        out
    }
}

impl AsFd for FlowEvents {
    /// Readable (poll) when records are waiting.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.ring.as_fd()
    }
}

impl Datapath {
    /// Which decisions become flow events ([`crate::EVENTS_DENY`],
    /// [`crate::EVENTS_ALLOW`]) and how many per second per pod.
    pub fn set_flow_config(&mut self, events: u32, rate: u32) -> Result<()> {
        self.edit_pol_cfg(|c| {
            c.events = events;
            c.rate = rate;
        })
    }

    /// Whether the network has a policy ([`crate::POL_ENFORCE`]). Set it
    /// after the rule sets are written: until then the programs let
    /// everything through, as they did before the policy existed.
    pub fn set_enforcing(&mut self, on: bool) -> Result<()> {
        self.edit_pol_cfg(|c| {
            c.flags = if on {
                c.flags | crate::POL_ENFORCE
            } else {
                c.flags & !crate::POL_ENFORCE
            }
        })
    }

    /// Whether [`Datapath::set_enforcing`] last set the flag.
    pub fn enforcing(&self) -> Result<bool> {
        Ok(self.flow_config()?.flags & crate::POL_ENFORCE != 0)
    }

    fn edit_pol_cfg(&mut self, f: impl FnOnce(&mut PolicyConfig)) -> Result<()> {
        let have = self
            .pol_cfg
            .get(&0, 0)
            .map_err(|e| Error::aya("read the policy config", e))?;
        let mut want = have;
        f(&mut want);
        if want == have {
            return Ok(());
        }
        self.pol_cfg
            .set(0, want, 0)
            .map_err(|e| Error::aya("write the policy config", e))
    }

    pub fn flow_config(&self) -> Result<PolicyConfig> {
        self.pol_cfg
            .get(&0, 0)
            .map_err(|e| Error::aya("read the flow event config", e))
    }

    /// The flow events' reader; a second call is an error.
    pub fn take_flow_events(&mut self) -> Result<FlowEvents> {
        let m = self
            .pol_events
            .take()
            .ok_or_else(|| Error::msg("the flow event ring is taken already"))?;
        let ring = RingBuf::try_from(m).map_err(|e| Error::aya("map rcni_pol_events", e))?;
        Ok(FlowEvents { ring })
    }
}

/// The kernel's id of the flow event ring pinned in `dir` (`None`: none
/// pinned): a collector holding an older ring (the network's datapath was
/// removed and loaded again) reads nothing any more.
pub fn flow_events_id(dir: &Path) -> Option<u32> {
    let m = MapData::from_pin(dir.join("rcni_pol_events")).ok()?;
    m.info().ok().map(|i| i.id())
}
