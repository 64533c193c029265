//! The endpoints both plugins write (one entry per pod address, each
//! plugin its part), their counter slots, and the counters.

use crate::load::{collect, not_found_ok};
use crate::types;
use crate::{
    Datapath, EP_FASTPATH, EP_NORMAL_PATH, EP_SHAPED, Endpoint, EndpointKey, EndpointStats, Error,
    MAX_ENDPOINTS, Result, Verdict, bpffs,
};
use aya::maps::{MapError, PerCpuValues};

impl Datapath {
    /// Serializes slot allocation and the read-modify-write of shared
    /// entries between plugin processes (pinned maps are shared); an
    /// unpinned datapath has no other users. Taken by every endpoint write:
    /// callers must not hold the directory's lock themselves.
    fn lock(&self) -> Result<Option<bpffs::DirLock>> {
        self.dir.as_deref().map(bpffs::DirLock::acquire).transpose()
    }

    fn slot_bits(&self) -> Result<types::SlotBitmap> {
        self.slots
            .get(&0, 0)
            .map_err(|e| Error::aya("read counter slots", e))
    }

    /// Writes `merge(old entry, new)` for each entry. A new entry gets a
    /// slot of its own; its counters, and those of an entry changing
    /// owner, start from zero.
    fn upsert(
        &mut self,
        eps: &[(EndpointKey, Endpoint)],
        merge: fn(Option<Endpoint>, &Endpoint) -> Endpoint,
    ) -> Result<()> {
        let _lock = self.lock()?;
        let mut bits = self.slot_bits()?;
        let mut ncpus = None;
        for (key, ep) in eps {
            let old = self.endpoint(key)?;
            let mut new = merge(old, ep);
            if old.is_none() {
                new.slot = types::take_slot(&mut bits).ok_or_else(|| {
                    Error::msg(format!(
                        "the network has {MAX_ENDPOINTS} endpoints on this node, the most it can"
                    ))
                })?;
                // The bitmap first: a slot in use is never handed out
                // twice, even if what follows fails.
                self.slots
                    .set(0, bits, 0)
                    .map_err(|e| Error::aya("write counter slots", e))?;
            }
            if old.is_none_or(|o| o.owner != new.owner) {
                // Counters before the endpoint: once the endpoint is
                // visible its counters start from zero.
                let n = match ncpus {
                    Some(n) => n,
                    None => {
                        let n = aya::util::nr_cpus()
                            .map_err(|(_, e)| Error::io("count possible CPUs", e))?;
                        *ncpus.insert(n)
                    }
                };
                let zero = PerCpuValues::try_from(vec![EndpointStats::default(); n])
                    .map_err(|e| Error::io("per-CPU values", e))?;
                self.stats
                    .set(new.slot, zero, 0)
                    .map_err(|e| Error::aya("reset endpoint counters", e))?;
            }
            self.endpoints
                .insert(key, new, 0)
                .map_err(|e| Error::aya("insert endpoint", e))?;
        }
        Ok(())
    }

    /// Takes one plugin's part out of entries (`strip`), only from those
    /// `owner` owns when given; an entry with nothing left goes, and its
    /// slot with it. Missing entries are no error.
    fn strip(
        &mut self,
        keys: &[EndpointKey],
        owner: Option<u64>,
        strip: fn(Endpoint) -> Option<Endpoint>,
    ) -> Result<()> {
        let _lock = self.lock()?;
        let mut bits = self.slot_bits()?;
        let mut freed = false;
        for key in keys {
            let Some(old) = self.endpoint(key)? else {
                continue;
            };
            if owner.is_some_and(|o| o != old.owner) {
                continue;
            }
            match strip(old) {
                Some(ep) => self
                    .endpoints
                    .insert(key, ep, 0)
                    .map_err(|e| Error::aya("update endpoint", e))?,
                None => {
                    not_found_ok(self.endpoints.remove(key), "remove endpoint")?;
                    types::free_slot(&mut bits, old.slot);
                    freed = true;
                }
            }
        }
        if freed {
            self.slots
                .set(0, bits, 0)
                .map_err(|e| Error::aya("write counter slots", e))?;
        }
        Ok(())
    }

    /// Adds or updates the fast path's endpoints (fields of [`Endpoint::new`]),
    /// keeping what the policy plugin wrote for the same owner.
    pub fn insert_endpoints(&mut self, eps: &[(EndpointKey, Endpoint)]) -> Result<()> {
        self.upsert(eps, Endpoint::merge_fastpath)
    }

    pub fn insert_endpoint(&mut self, key: EndpointKey, ep: Endpoint) -> Result<()> {
        self.insert_endpoints(&[(key, ep)])
    }

    /// Keeps the fast path endpoints behind host veth `ifindex` on the
    /// normal path ([`EP_NORMAL_PATH`]): nothing is redirected to them or
    /// from them any more. Returns how many there were.
    pub fn keep_on_normal_path(&mut self, ifindex: u32) -> Result<usize> {
        self.set_fastpath_flag(ifindex, EP_NORMAL_PATH, true)
    }

    /// Marks the fast path endpoints behind host veth `ifindex` as shaped
    /// on it ([`EP_SHAPED`]) or not: deliveries to them
    /// pass the host veth's egress hook and qdisc. Returns how many there
    /// were.
    pub fn set_shaped(&mut self, ifindex: u32, on: bool) -> Result<usize> {
        self.set_fastpath_flag(ifindex, EP_SHAPED, on)
    }

    /// Sets or clears `flag` on the fast path endpoints behind host veth
    /// `ifindex`, writing only those that change. Returns how many there
    /// were.
    fn set_fastpath_flag(&mut self, ifindex: u32, flag: u32, on: bool) -> Result<usize> {
        let _lock = self.lock()?;
        let mut n = 0;
        for (key, ep) in self.endpoints()? {
            if ep.ifindex != ifindex || ep.flags & EP_FASTPATH == 0 {
                continue;
            }
            n += 1;
            if (ep.flags & flag != 0) != on {
                self.endpoints
                    .insert(key, ep.with_flag(flag, on), 0)
                    .map_err(|e| Error::aya("update endpoint", e))?;
            }
        }
        Ok(n)
    }

    /// Takes the fast path's part out of these endpoints; those the policy
    /// plugin has no part in go, with their counter slots.
    pub fn remove_endpoints(&mut self, keys: &[EndpointKey]) -> Result<()> {
        self.strip(keys, None, Endpoint::without_fastpath)
    }

    pub fn remove_endpoint(&mut self, key: &EndpointKey) -> Result<()> {
        self.remove_endpoints(std::slice::from_ref(key))
    }

    /// Writes the policy plugin's part of a pod's endpoints: its host veth,
    /// identity and rule sets (0: not selected), keeping what the fast path
    /// wrote for the same owner.
    pub fn set_policy_endpoint(
        &mut self,
        keys: &[EndpointKey],
        ifindex: u32,
        owner: u64,
        identity: u32,
        ingress_rs: u32,
        egress_rs: u32,
    ) -> Result<()> {
        self.set_policy_endpoint_audited(keys, ifindex, owner, identity, ingress_rs, egress_rs, 0)
    }

    /// [`Datapath::set_policy_endpoint`] with audit flags
    /// ([`crate::POL_AUDIT_IN`], [`crate::POL_AUDIT_OUT`]).
    #[allow(clippy::too_many_arguments)]
    pub fn set_policy_endpoint_audited(
        &mut self,
        keys: &[EndpointKey],
        ifindex: u32,
        owner: u64,
        identity: u32,
        ingress_rs: u32,
        egress_rs: u32,
        pol_flags: u32,
    ) -> Result<()> {
        let ep = Endpoint::policy(ifindex, owner, identity, ingress_rs, egress_rs)
            .policy_audited(pol_flags);
        let eps: Vec<(EndpointKey, Endpoint)> = keys.iter().map(|k| (*k, ep)).collect();
        self.upsert(&eps, Endpoint::merge_policy)
    }

    /// Takes the policy plugin's part out of the endpoints `owner` owns
    /// (another owner's are left alone); those the fast path has no part in
    /// go.
    pub fn clear_policy_endpoint(&mut self, keys: &[EndpointKey], owner: u64) -> Result<()> {
        self.strip(keys, Some(owner), Endpoint::without_policy)
    }

    pub fn endpoint(&self, key: &EndpointKey) -> Result<Option<Endpoint>> {
        match self.endpoints.get(key, 0) {
            Ok(v) => Ok(Some(v)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(Error::aya("look up endpoint", e)),
        }
    }

    /// Every endpoint (either plugin's), sorted by address.
    pub fn endpoints(&self) -> Result<Vec<(EndpointKey, Endpoint)>> {
        let mut v = collect(self.endpoints.iter(), "list endpoints")?;
        v.sort_by_key(|(k, _)| *k);
        Ok(v)
    }

    /// An endpoint's counters, summed over CPUs (zero when there is no
    /// such endpoint).
    pub fn stats(&self, key: &EndpointKey) -> Result<EndpointStats> {
        match self.endpoint(key)? {
            Some(ep) => self.stats_of(&ep),
            None => Ok(EndpointStats::default()),
        }
    }

    /// The counters of an endpoint read from the map, summed over CPUs.
    pub fn stats_of(&self, ep: &Endpoint) -> Result<EndpointStats> {
        let per_cpu = self
            .stats
            .get(&ep.slot, 0)
            .map_err(|e| Error::aya("read endpoint counters", e))?;
        let mut sum = EndpointStats::default();
        for s in per_cpu.iter() {
            sum += *s;
        }
        Ok(sum)
    }

    /// Every verdict's count, summed over CPUs.
    pub fn verdicts(&self) -> Result<Vec<(Verdict, u64)>> {
        Verdict::ALL
            .iter()
            .map(|v| {
                let per_cpu = self
                    .verdicts
                    .get(&(*v as u32), 0)
                    .map_err(|e| Error::aya("read verdict counters", e))?;
                Ok((*v, per_cpu.iter().sum()))
            })
            .collect()
    }
}
