//! The warm pool: which addresses the node's cloud interfaces carry, which
//! pod holds which, and what to ask the cloud for next. No I/O and no
//! clock of its own (every decision takes `now`), so each rule is tested
//! against the AWS VPC CNI's documented examples.
//!
//! The rules are ipamd's (amazon-vpc-cni-k8s `pkg/ipamd/ipamd.go` and
//! `datastore/data_store.go`):
//! - "available" is every address no pod holds, cooling ones included;
//! - with `WARM_IP_TARGET` or `MINIMUM_IP_TARGET` set (non-zero), they
//!   replace `WARM_ENI_TARGET`/`WARM_PREFIX_TARGET`: short =
//!   max(WARM_IP - available, MINIMUM_IP - total, 0), over likewise;
//! - otherwise the pool is too low while available < target x the
//!   interface's address slots (`WARM_ENI_TARGET` in secondary-IP mode,
//!   `WARM_PREFIX_TARGET` x 16 in prefix mode), a new interface is filled
//!   to capacity, and a whole unused interface is freed once
//!   available >= (target + 1) x per-interface addresses;
//! - the primary interface is never freed, nor an interface younger than a
//!   minute (ipamd's `minENILifeTime`), nor an address or prefix a pod
//!   holds.
//!
//! Where we are stricter than ipamd: an address still cooling down is
//! never returned to the cloud (ipamd may unassign it, and the cloud may
//! hand it to another node while the old pod's peers still send to it).

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::time::{Duration, SystemTime};

use ipnetwork::Ipv4Network;
use rcni_agent_proto::ipam::Attachment;
use serde::Serialize;

use crate::{Interface, Limits};

/// Addresses in one delegated prefix (an AWS /28).
pub const PREFIX_ADDRS: u32 = 16;

/// The pool's settings, named and defaulted as the AWS VPC CNI's `aws-node`
/// environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// `WARM_ENI_TARGET`: whole interfaces' worth of free addresses.
    pub warm_eni_target: u32,
    /// `WARM_IP_TARGET`: free addresses to keep. `Some(0)` counts as unset,
    /// as in ipamd.
    pub warm_ip_target: Option<u32>,
    /// `MINIMUM_IP_TARGET`: addresses to hold at least, pods or not.
    pub minimum_ip_target: Option<u32>,
    /// `WARM_PREFIX_TARGET`: free /28 prefixes to keep in prefix mode
    /// (unset: 1, the value of the AWS manifest).
    pub warm_prefix_target: Option<u32>,
    /// `ENABLE_PREFIX_DELEGATION`: /28 prefixes instead of single
    /// secondary addresses.
    pub prefix_delegation: bool,
    /// `IP_COOLDOWN_PERIOD`: how long a released address rests before it
    /// is handed out again.
    pub cooldown: Duration,
    /// `MAX_ENI`: at most this many interfaces, below the instance type's
    /// limit.
    pub max_enis: Option<u32>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            warm_eni_target: 1,
            warm_ip_target: None,
            minimum_ip_target: None,
            warm_prefix_target: None,
            prefix_delegation: false,
            cooldown: Duration::from_secs(30),
            max_enis: None,
        }
    }
}

/// Keys the net-conf's `"cloud"` section may carry that the pool does not
/// read (the agent's datapath reads them).
const JSON_OTHER_KEYS: &[&str] = &["provider", "externalSNAT", "excludeSNATCIDRs"];

impl PoolConfig {
    /// The defaults, then the `aws-node` environment over them.
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<PoolConfig, String> {
        let mut cfg = PoolConfig::default();
        cfg.apply_env(get)?;
        Ok(cfg)
    }

    /// The environment over this config: a variable that is set (and not
    /// empty) wins over the net-conf's `"cloud"` section, so a DaemonSet's
    /// env keeps working as it does for `aws-node`. Unlike ipamd, which
    /// ignores a value it cannot parse, a bad value is an error naming the
    /// variable.
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<(), String> {
        let var = |name: &str| {
            get(name)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let count = |name: &str, v: &str| -> Result<u32, String> {
            v.parse::<u32>()
                .map_err(|_| format!("{name}: {v:?} is not a whole number >= 0"))
        };
        if let Some(v) = var("WARM_ENI_TARGET") {
            self.warm_eni_target = count("WARM_ENI_TARGET", &v)?;
        }
        if let Some(v) = var("WARM_IP_TARGET") {
            self.warm_ip_target = Some(count("WARM_IP_TARGET", &v)?);
        }
        if let Some(v) = var("MINIMUM_IP_TARGET") {
            self.minimum_ip_target = Some(count("MINIMUM_IP_TARGET", &v)?);
        }
        if let Some(v) = var("WARM_PREFIX_TARGET") {
            self.warm_prefix_target = Some(count("WARM_PREFIX_TARGET", &v)?);
        }
        if let Some(v) = var("ENABLE_PREFIX_DELEGATION") {
            // Go's strconv.ParseBool, which aws-node uses.
            self.prefix_delegation = match v.as_str() {
                "1" | "t" | "T" | "true" | "TRUE" | "True" => true,
                "0" | "f" | "F" | "false" | "FALSE" | "False" => false,
                _ => {
                    return Err(format!(
                        "ENABLE_PREFIX_DELEGATION: {v:?} is not true or false"
                    ));
                }
            };
        }
        if let Some(v) = var("IP_COOLDOWN_PERIOD") {
            self.cooldown = Duration::from_secs(count("IP_COOLDOWN_PERIOD", &v)?.into());
        }
        if let Some(v) = var("MAX_ENI") {
            // ipamd's default is -1 and any value below 1 means "the
            // instance type's limit".
            let n: i64 = v
                .parse()
                .map_err(|_| format!("MAX_ENI: {v:?} is not a whole number"))?;
            self.max_enis = u32::try_from(n).ok().filter(|n| *n >= 1);
        }
        Ok(())
    }

    /// The net-conf's `"cloud"` section: `warmENITarget`, `warmIPTarget`,
    /// `minimumIPTarget`, `warmPrefixTarget`, `enablePrefixDelegation`,
    /// `ipCooldownPeriod` (seconds), `maxENI`. `null` is unset. Other keys
    /// than these and `provider`, `externalSNAT`, `excludeSNATCIDRs` are an
    /// error naming the key.
    pub fn from_json(v: &serde_json::Value) -> Result<PoolConfig, String> {
        let obj = v
            .as_object()
            .ok_or_else(|| format!("cloud: expected an object, got {v}"))?;
        let mut cfg = PoolConfig::default();
        for (key, value) in obj {
            if value.is_null() || JSON_OTHER_KEYS.contains(&key.as_str()) {
                continue;
            }
            let count = || -> Result<u32, String> {
                value
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| {
                        format!("cloud.{key}: expected a whole number >= 0, got {value}")
                    })
            };
            match key.as_str() {
                "warmENITarget" => cfg.warm_eni_target = count()?,
                "warmIPTarget" => cfg.warm_ip_target = Some(count()?),
                "minimumIPTarget" => cfg.minimum_ip_target = Some(count()?),
                "warmPrefixTarget" => cfg.warm_prefix_target = Some(count()?),
                "ipCooldownPeriod" => cfg.cooldown = Duration::from_secs(count()?.into()),
                "maxENI" => {
                    let n = count()?;
                    if n == 0 {
                        return Err("cloud.maxENI: must be at least 1".into());
                    }
                    cfg.max_enis = Some(n);
                }
                "enablePrefixDelegation" => {
                    cfg.prefix_delegation = value.as_bool().ok_or_else(|| {
                        format!("cloud.enablePrefixDelegation: expected true or false, got {value}")
                    })?
                }
                _ => return Err(format!("cloud: unknown key {key:?}")),
            }
        }
        Ok(cfg)
    }

    /// WARM_IP_TARGET or MINIMUM_IP_TARGET is in force (ipamd's
    /// `warmIPTargetsDefined`: 0 means unset).
    pub fn warm_ip_defined(&self) -> bool {
        self.warm_ip_target.unwrap_or(0) != 0 || self.minimum_ip_target.unwrap_or(0) != 0
    }

    /// WARM_PREFIX_TARGET as used: the AWS manifest's 1 when unset.
    pub fn warm_prefix(&self) -> u32 {
        self.warm_prefix_target.unwrap_or(1)
    }

    /// The instance type's limits with MAX_ENI applied.
    pub fn effective_limits(&self, limits: Limits) -> Limits {
        Limits {
            max_interfaces: match self.max_enis {
                Some(m) if m >= 1 => limits.max_interfaces.min(m),
                _ => limits.max_interfaces,
            },
            ..limits
        }
    }

    /// [`max_pods`] for these limits with MAX_ENI and the mode applied.
    pub fn max_pods(&self, limits: Limits) -> u32 {
        max_pods(self.effective_limits(limits), self.prefix_delegation)
    }

    fn unit(&self) -> u32 {
        if self.prefix_delegation {
            PREFIX_ADDRS
        } else {
            1
        }
    }
}

/// The pods a node can run: interfaces x (addresses per interface - 1) +
/// 2, the AWS VPC CNI's formula (the interface's own address is not a
/// pod's; the 2 are host-network pods, aws-node and kube-proxy). In prefix
/// mode each slot is a /28: interfaces x (addresses - 1) x 16 + 2.
///
/// AWS's max-pods calculator further caps prefix mode at 110 (instances
/// with fewer than 30 vCPUs) or 250; [`Limits`] carries no vCPU count, so
/// that cap is left to the kubelet's `--max-pods`. Pass limits with MAX_ENI
/// applied ([`PoolConfig::effective_limits`], or [`PoolConfig::max_pods`]).
pub fn max_pods(limits: Limits, prefix: bool) -> u32 {
    pod_addresses(limits, prefix).saturating_add(2)
}

/// Addresses the node's interfaces can carry for pods.
fn pod_addresses(limits: Limits, prefix: bool) -> u32 {
    let slots = limits.addrs_per_interface.saturating_sub(1);
    let unit = if prefix { PREFIX_ADDRS } else { 1 };
    limits
        .max_interfaces
        .saturating_mul(slots)
        .saturating_mul(unit)
}

/// The pool's counts in addresses (ipamd's `DataStoreStats`), over the
/// current mode's cidrs only (secondary addresses, or prefixes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    pub total: u32,
    pub assigned: u32,
    /// Released less than the cooldown ago, no pod holds them.
    pub cooling: u32,
    pub prefixes: u32,
    /// Prefixes none of whose addresses a pod holds.
    pub free_prefixes: u32,
}

impl Stats {
    /// ipamd's `AvailableAddresses`: not held by a pod (cooling included).
    pub fn available(&self) -> u32 {
        self.total.saturating_sub(self.assigned)
    }
    /// Can be handed out now.
    pub fn free(&self) -> u32 {
        self.available().saturating_sub(self.cooling)
    }
}

fn div_ceil(x: i64, y: i64) -> i64 {
    (x + y - 1).div_euclid(y)
}

/// ipamd's `datastoreTargetState`: with WARM_IP_TARGET/MINIMUM_IP_TARGET in
/// force, how many addresses (prefixes in prefix mode) the pool is short of
/// and over its targets; `None` when they are not set.
pub fn target_state(cfg: &PoolConfig, s: &Stats) -> Option<(u32, u32)> {
    if !cfg.warm_ip_defined() {
        return None;
    }
    let warm = i64::from(cfg.warm_ip_target.unwrap_or(0));
    let minimum = i64::from(cfg.minimum_ip_target.unwrap_or(0));
    let available = i64::from(s.available());
    let total = i64::from(s.total);
    let short = (warm - available).max(0).max(minimum - total);
    let over = (available - warm).max(0).min(total - minimum).max(0);
    if cfg.prefix_delegation {
        let per = i64::from(PREFIX_ADDRS);
        let short = div_ceil(short, per);
        // Prefixes come whole: `over` addresses may be spread over
        // prefixes that still hold pods, so count whole free prefixes
        // beyond what the targets need.
        let prefixes = i64::from(s.prefixes);
        let for_warm = div_ceil(i64::from(s.assigned) + warm, per);
        let for_min = div_ceil(minimum, per);
        let over = i64::from(s.free_prefixes)
            .min(prefixes - for_warm)
            .max(0)
            .min(prefixes - for_min)
            .max(0);
        return Some((short as u32, over as u32));
    }
    Some((short as u32, over as u32))
}

/// ipamd's `isDatastorePoolTooLow`: should the pool ask for more now?
pub fn too_low(cfg: &PoolConfig, limits: Limits, s: &Stats) -> bool {
    let limits = cfg.effective_limits(limits);
    if s.total >= pod_addresses(limits, cfg.prefix_delegation) {
        return false;
    }
    if let Some((short, _)) = target_state(cfg, s) {
        return short > 0;
    }
    let (target, per) = if cfg.prefix_delegation {
        (cfg.warm_prefix(), PREFIX_ADDRS)
    } else {
        (
            cfg.warm_eni_target,
            limits.addrs_per_interface.saturating_sub(1),
        )
    };
    let available = s.available();
    available < per.saturating_mul(target) || (target == 0 && available == 0)
}

/// ipamd's `isDatastorePoolTooHigh`, as a count: how many addresses
/// (prefixes in prefix mode) could go back to the cloud. Never in plain
/// WARM_ENI_TARGET mode, where only whole interfaces are freed.
pub fn excess(cfg: &PoolConfig, s: &Stats) -> u32 {
    if let Some((_, over)) = target_state(cfg, s) {
        return over;
    }
    if cfg.prefix_delegation {
        return s.free_prefixes.saturating_sub(cfg.warm_prefix());
    }
    0
}

/// ipamd's `shouldRemoveExtraENIs`: is it worth looking for an interface to
/// free? (`unused_interface`: some secondary interface holds no pod.)
pub fn should_remove_extra(
    cfg: &PoolConfig,
    limits: Limits,
    s: &Stats,
    unused_interface: bool,
) -> bool {
    if cfg.warm_ip_defined() {
        return true;
    }
    let target = if cfg.prefix_delegation {
        cfg.warm_prefix()
    } else {
        cfg.warm_eni_target
    };
    let per_interface = limits.addrs_per_interface.saturating_sub(1) * cfg.unit();
    if s.available() >= (target + 1).saturating_mul(per_interface) {
        return true;
    }
    cfg.prefix_delegation && unused_interface
}

/// What to ask the cloud for next. Unassign and delete steps have already
/// taken their addresses out of the pool (so no pod gets one on its way
/// out); [`Pool::restore`] puts them back if the call fails.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    AssignIps {
        interface: String,
        count: u32,
    },
    AssignPrefixes {
        interface: String,
        count: u32,
    },
    /// A new interface at `device_index`, then `count` addresses (prefixes
    /// in prefix mode) on it.
    CreateInterface {
        device_index: u32,
        count: u32,
    },
    UnassignIps {
        interface: String,
        ips: Vec<Ipv4Addr>,
    },
    UnassignPrefixes {
        interface: String,
        prefixes: Vec<Ipv4Network>,
    },
    DeleteInterface {
        interface: Interface,
    },
}

/// A checkpointed assignment whose address is on none of the node's
/// interfaces in the cloud's view ([`Pool::restore_assignments`]): the
/// pool keeps it (the pod still runs with the address) and the agent tries
/// to assign the address back to `interface`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Missing {
    pub attachment: Attachment,
    pub ip: Ipv4Addr,
    /// The interface the checkpoint had it on.
    pub interface: String,
}

/// What [`Pool::restore_assignments`] could not take over as it was.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Restored {
    /// Kept, but not on any interface in the cloud's view.
    pub missing: Vec<Missing>,
    /// Left out, why: entries that contradict other entries (an address
    /// two attachments claim, a second address for one attachment).
    pub dropped: Vec<String>,
}

/// Why an address a describe or an assignment's answer showed was not
/// taken into the pool ([`Pool::pick_described`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Refused {
    /// An interface's own address: never a pod's.
    Primary,
    /// Another of the node's interfaces has it in the pool.
    OtherInterface,
    /// The pool gave it back a moment ago; a describe may lag the cloud's
    /// writes, so only the assignment's answer naming it brings it back.
    Recent,
    /// The answer named it, the describe does not show it as one of the
    /// interface's secondary addresses (prefixes).
    NotDescribed,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Refused::Primary => "an interface's primary address",
            Refused::OtherInterface => "on another of the node's interfaces",
            Refused::Recent => "given back a moment ago",
            Refused::NotDescribed => "not a secondary address of the interface in its describe",
        })
    }
}

/// What a describe of an interface after an assignment adds to the pool
/// ([`Pool::pick_described`]), and what it leaves out of what the describe
/// or the answer showed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Picked {
    pub ips: Vec<Ipv4Addr>,
    pub prefixes: Vec<Ipv4Network>,
    pub refused_ips: Vec<(Ipv4Addr, Refused)>,
    pub refused_prefixes: Vec<(Ipv4Network, Refused)>,
}

/// Where a pod's address lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Allocation {
    pub ip: Ipv4Addr,
    /// The cloud interface (`eni-...`) that carries `ip`.
    pub interface: String,
    /// Its device index: the node's route table for it is `device_index + 1`.
    pub device_index: u32,
}

#[derive(Debug, Clone)]
struct Slot {
    iface: Interface,
    /// When the pool first saw it: ipamd frees no interface younger than a
    /// minute (its metadata may still be settling).
    seen: SystemTime,
}

/// The pool's whole state: interfaces with their addresses, the pods'
/// assignments and the cooling addresses.
#[derive(Debug, Clone)]
pub struct Pool {
    pub cfg: PoolConfig,
    /// The instance type's, MAX_ENI applied.
    pub limits: Limits,
    slots: BTreeMap<u32, Slot>,
    assigned: BTreeMap<Attachment, Allocation>,
    owner: HashMap<Ipv4Addr, Attachment>,
    cooling: HashMap<Ipv4Addr, SystemTime>,
    last_decrease: Option<SystemTime>,
    /// When the pool last changed an address, prefix or interface in the
    /// cloud (`ip:`, `prefix:`, `iface:` keys): [`Pool::reconcile`] leaves
    /// those alone for a while, the cloud's reads being eventually
    /// consistent (ipamd's `reconcileCooldownCache`).
    touched: HashMap<String, SystemTime>,
    /// Assignments kept although their address is on none of the node's
    /// interfaces in the cloud's view, with why (the checkpoint's
    /// `mismatch`): the pod still runs with it, so the address stays its
    /// own until it is released.
    mismatched: BTreeMap<Attachment, String>,
}

impl Pool {
    /// The pool over these interfaces (the cloud's view), no pod holding
    /// anything yet.
    pub fn new(
        cfg: PoolConfig,
        limits: Limits,
        interfaces: Vec<Interface>,
        now: SystemTime,
    ) -> Pool {
        let limits = cfg.effective_limits(limits);
        let slots = interfaces
            .into_iter()
            .map(|iface| (iface.device_index, Slot { iface, seen: now }))
            .collect();
        Pool {
            cfg,
            limits,
            slots,
            assigned: BTreeMap::new(),
            owner: HashMap::new(),
            cooling: HashMap::new(),
            last_decrease: None,
            touched: HashMap::new(),
            mismatched: BTreeMap::new(),
        }
    }

    /// Addresses pods can hold at most (max pods without the 2
    /// host-network pods).
    pub fn capacity(&self) -> u32 {
        pod_addresses(self.limits, self.cfg.prefix_delegation)
    }

    pub fn max_pods(&self) -> u32 {
        max_pods(self.limits, self.cfg.prefix_delegation)
    }

    pub fn interfaces(&self) -> impl Iterator<Item = &Interface> {
        self.slots.values().map(|s| &s.iface)
    }

    pub fn allocations(&self) -> impl Iterator<Item = (&Attachment, &Allocation)> {
        self.assigned.iter()
    }

    pub fn lookup(&self, a: &Attachment) -> Option<&Allocation> {
        self.assigned.get(a)
    }

    /// Released addresses still cooling at `now`, with when they were
    /// released.
    pub fn cooling(&self, now: SystemTime) -> Vec<(Ipv4Addr, SystemTime)> {
        let mut v: Vec<_> = self
            .cooling
            .iter()
            .filter(|(_, at)| self.is_cooling(**at, now))
            .map(|(ip, at)| (*ip, *at))
            .collect();
        v.sort();
        v
    }

    fn is_cooling(&self, released: SystemTime, now: SystemTime) -> bool {
        now.duration_since(released).unwrap_or_default() < self.cfg.cooldown
    }

    fn cooling_at(&self, ip: Ipv4Addr, now: SystemTime) -> bool {
        self.cooling
            .get(&ip)
            .is_some_and(|at| self.is_cooling(*at, now))
    }

    /// The interface whose secondary addresses or prefixes hold `ip`.
    fn carrier(&self, ip: Ipv4Addr) -> Option<&Interface> {
        self.interfaces()
            .find(|i| i.secondary_ips.contains(&ip) || i.prefixes.iter().any(|p| p.contains(ip)))
    }

    /// The current mode's addresses of an interface, in order.
    fn pod_addrs(&self, iface: &Interface) -> Vec<Ipv4Addr> {
        if self.cfg.prefix_delegation {
            iface.prefixes.iter().flat_map(|p| p.iter()).collect()
        } else {
            iface.secondary_ips.clone()
        }
    }

    pub fn stats(&self, now: SystemTime) -> Stats {
        let mut s = Stats::default();
        for iface in self.interfaces() {
            if self.cfg.prefix_delegation {
                for p in &iface.prefixes {
                    s.prefixes += 1;
                    let mut held = 0;
                    for ip in p.iter() {
                        s.total += 1;
                        if self.owner.contains_key(&ip) {
                            held += 1;
                        } else if self.cooling_at(ip, now) {
                            s.cooling += 1;
                        }
                    }
                    s.assigned += held;
                    if held == 0 {
                        s.free_prefixes += 1;
                    }
                }
            } else {
                for ip in &iface.secondary_ips {
                    s.total += 1;
                    if self.owner.contains_key(ip) {
                        s.assigned += 1;
                    } else if self.cooling_at(*ip, now) {
                        s.cooling += 1;
                    }
                }
            }
        }
        s
    }

    /// An address for `a`: the one it holds, or the first free one
    /// (interfaces by device index, so pods pack onto the first interfaces
    /// and the last ones empty out). `None` when none is free.
    pub fn assign(&mut self, a: &Attachment, now: SystemTime) -> Option<Allocation> {
        if let Some(al) = self.assigned.get(a) {
            return Some(al.clone());
        }
        // Whatever a provider's describe or answer said, an interface's own
        // address is never a pod's.
        let primaries: Vec<Ipv4Addr> = self.interfaces().map(|i| i.primary_ip).collect();
        let mut found = None;
        'outer: for slot in self.slots.values() {
            let iface = &slot.iface;
            let candidates: Box<dyn Iterator<Item = Ipv4Addr>> = if self.cfg.prefix_delegation {
                Box::new(iface.prefixes.iter().flat_map(|p| p.iter()))
            } else {
                Box::new(iface.secondary_ips.iter().copied())
            };
            for ip in candidates {
                if !self.owner.contains_key(&ip)
                    && !self.cooling_at(ip, now)
                    && !primaries.contains(&ip)
                {
                    found = Some(Allocation {
                        ip,
                        interface: iface.id.clone(),
                        device_index: iface.device_index,
                    });
                    break 'outer;
                }
            }
        }
        let al = found?;
        self.cooling.remove(&al.ip);
        self.owner.insert(al.ip, a.clone());
        self.assigned.insert(a.clone(), al.clone());
        Some(al)
    }

    /// `a`'s address back to the pool, cooling from `now`.
    pub fn unassign(&mut self, a: &Attachment, now: SystemTime) -> Option<Allocation> {
        let al = self.assigned.remove(a)?;
        self.owner.remove(&al.ip);
        self.mismatched.remove(a);
        // An address on none of the interfaces is not the pool's to hand
        // out again, cooled or not.
        if self.carrier(al.ip).is_some() {
            self.cooling.insert(al.ip, now);
        }
        Some(al)
    }

    /// Why `a`'s assignment is kept though the cloud's view lacks its
    /// address, if it is.
    pub fn mismatch(&self, a: &Attachment) -> Option<&str> {
        self.mismatched.get(a).map(String::as_str)
    }

    /// Flags `a`'s assignment as one the cloud's view does not bear out.
    pub fn flag(&mut self, a: &Attachment, why: String) {
        if self.assigned.contains_key(a) {
            self.mismatched.insert(a.clone(), why);
        }
    }

    /// Takes a checkpoint's assignments (attachment, address, the
    /// interface it was on) and cooling addresses over. An assignment whose
    /// address no interface carries in the cloud's view is kept all the
    /// same (its pod still runs with it: dropping it would lose track of a
    /// live pod and hand the address to another) and returned as
    /// [`Missing`], flagged until [`Pool::confirm`] or a reconcile finds
    /// the address again. Only entries that contradict earlier ones (an
    /// address already held, a second address for one attachment) are
    /// left out, and returned with why.
    pub fn restore_assignments(
        &mut self,
        entries: impl IntoIterator<Item = (Attachment, Ipv4Addr, String)>,
        cooling: impl IntoIterator<Item = (Ipv4Addr, SystemTime)>,
        now: SystemTime,
    ) -> Restored {
        let mut out = Restored::default();
        for (a, ip, interface) in entries {
            if let Some(other) = self.owner.get(&ip) {
                out.dropped.push(format!(
                    "{}/{}: {ip} is already held by {}/{}",
                    a.container_id, a.if_name, other.container_id, other.if_name
                ));
                continue;
            }
            if self.assigned.contains_key(&a) {
                out.dropped.push(format!(
                    "{}/{}: a second address {ip} for the same attachment",
                    a.container_id, a.if_name
                ));
                continue;
            }
            let al = match self.carrier(ip) {
                Some(iface) => Allocation {
                    ip,
                    interface: iface.id.clone(),
                    device_index: iface.device_index,
                },
                None => {
                    let device_index = self
                        .interfaces()
                        .find(|i| i.id == interface)
                        .map_or(0, |i| i.device_index);
                    self.mismatched.insert(
                        a.clone(),
                        format!("{ip} is not on {interface} in the cloud's view"),
                    );
                    out.missing.push(Missing {
                        attachment: a.clone(),
                        ip,
                        interface: interface.clone(),
                    });
                    Allocation {
                        ip,
                        // An interface gone too: its route table went with
                        // it, the main table is all there is.
                        device_index,
                        interface,
                    }
                }
            };
            self.owner.insert(ip, a.clone());
            self.assigned.insert(a, al);
        }
        for (ip, at) in cooling {
            if self.is_cooling(at, now)
                && !self.owner.contains_key(&ip)
                && self.carrier(ip).is_some()
            {
                self.cooling.insert(ip, at);
            }
        }
        out
    }

    /// `a`'s address as `described` (a describe of the interface after the
    /// address was assigned back to it) shows it: if it is one of the
    /// interface's secondary addresses, the assignment is the cloud's
    /// again (no longer flagged) and true.
    pub fn confirm(&mut self, a: &Attachment, described: &Interface, now: SystemTime) -> bool {
        let Some(ip) = self.assigned.get(a).map(|al| al.ip) else {
            return false;
        };
        if !described.secondary_ips.contains(&ip) || described.primary_ip == ip {
            return false;
        }
        // On its interface again: what a reconcile finding it would do.
        if !self.add_ips(&described.id, &[ip], now) {
            return false;
        }
        self.found_again();
        !self.mismatched.contains_key(a)
    }

    fn used_slots(iface: &Interface) -> u32 {
        (iface.secondary_ips.len() + iface.prefixes.len()) as u32
    }

    fn holds_pods(&self, iface: &Interface) -> bool {
        self.assigned.values().any(|al| al.interface == iface.id)
    }

    fn has_cooling(&self, iface: &Interface, now: SystemTime) -> bool {
        iface
            .secondary_ips
            .iter()
            .any(|ip| self.cooling_at(*ip, now))
            || iface
                .prefixes
                .iter()
                .any(|p| p.iter().any(|ip| self.cooling_at(ip, now)))
    }

    /// ipamd's `getDeletableENI`: an interface that could go, targets kept.
    fn deletable(&self, now: SystemTime, min_age: Duration) -> Option<u32> {
        let per = i64::from(PREFIX_ADDRS);
        let round = |n: i64| {
            if self.cfg.prefix_delegation {
                div_ceil(n, per) * per
            } else {
                n
            }
        };
        let warm = i64::from(self.cfg.warm_ip_target.unwrap_or(0));
        let minimum = i64::from(self.cfg.minimum_ip_target.unwrap_or(0));
        // The last interfaces first: pods pack onto the first ones.
        self.slots.iter().rev().find_map(|(idx, slot)| {
            let iface = &slot.iface;
            if iface.device_index == 0
                || now.duration_since(slot.seen).unwrap_or_default() < min_age
                || self.has_cooling(iface, now)
                || self.holds_pods(iface)
            {
                return None;
            }
            let (mut other_avail, mut other_total, mut other_free_prefixes) = (0i64, 0i64, 0i64);
            for other in self.interfaces().filter(|o| o.id != iface.id) {
                let addrs = self.pod_addrs(other);
                let held = addrs
                    .iter()
                    .filter(|ip| self.owner.contains_key(ip))
                    .count() as i64;
                other_total += addrs.len() as i64;
                other_avail += addrs.len() as i64 - held;
                other_free_prefixes += other
                    .prefixes
                    .iter()
                    .filter(|p| !p.iter().any(|ip| self.owner.contains_key(&ip)))
                    .count() as i64;
            }
            if warm != 0 && other_avail < round(warm) {
                return None;
            }
            if minimum != 0 && other_total < round(minimum) {
                return None;
            }
            let wp = i64::from(self.cfg.warm_prefix());
            if self.cfg.prefix_delegation && wp != 0 && other_free_prefixes < wp {
                return None;
            }
            Some(*idx)
        })
    }

    /// The next thing to ask the cloud for, if any (ipamd's
    /// `updateIPPoolIfRequired`: grow when too low; otherwise give back
    /// what is over the targets, at most once per `decrease_interval`; and
    /// free an interface nobody needs). Unassign and delete steps take
    /// their addresses out of the pool now.
    pub fn next_step(
        &mut self,
        now: SystemTime,
        min_interface_age: Duration,
        decrease_interval: Duration,
    ) -> Option<Step> {
        let s = self.stats(now);
        let slots_per = self.limits.addrs_per_interface.saturating_sub(1);
        if too_low(&self.cfg, self.limits, &s) {
            let short = target_state(&self.cfg, &s).map(|(short, _)| short);
            let wanted = if self.cfg.prefix_delegation {
                match short {
                    Some(short) => short.max(1),
                    None => self
                        .cfg
                        .warm_prefix()
                        .saturating_sub(s.free_prefixes)
                        .max(1),
                }
            } else {
                short.unwrap_or(slots_per)
            };
            if let Some(iface) = self.interfaces().find(|i| Self::used_slots(i) < slots_per) {
                let count = (slots_per - Self::used_slots(iface)).min(wanted);
                let interface = iface.id.clone();
                return Some(if self.cfg.prefix_delegation {
                    Step::AssignPrefixes { interface, count }
                } else {
                    Step::AssignIps { interface, count }
                });
            }
            if (self.slots.len() as u32) < self.limits.max_interfaces {
                let device_index = (1..).find(|i| !self.slots.contains_key(i)).unwrap_or(1);
                return Some(Step::CreateInterface {
                    device_index,
                    count: wanted.min(slots_per),
                });
            }
            return None;
        }
        let over = excess(&self.cfg, &s);
        let may_decrease = self
            .last_decrease
            .is_none_or(|at| now.duration_since(at).unwrap_or_default() >= decrease_interval);
        if over > 0
            && may_decrease
            && let Some(step) = self.take_excess(over, now)
        {
            self.last_decrease = Some(now);
            return Some(step);
        }
        let unused = self
            .interfaces()
            .any(|i| i.device_index != 0 && !self.holds_pods(i));
        if should_remove_extra(&self.cfg, self.limits, &s, unused)
            && let Some(idx) = self.deletable(now, min_interface_age)
        {
            let slot = self.slots.remove(&idx)?;
            self.touched.insert(format!("iface:{}", slot.iface.id), now);
            return Some(Step::DeleteInterface {
                interface: slot.iface,
            });
        }
        None
    }

    /// Up to `over` addresses (prefixes) no pod holds and none cooling, from
    /// the last interface that has spare ones; taken out of the pool.
    fn take_excess(&mut self, over: u32, now: SystemTime) -> Option<Step> {
        let prefix = self.cfg.prefix_delegation;
        let over = over as usize;
        let mut found = None;
        for (idx, slot) in self.slots.iter().rev() {
            let iface = &slot.iface;
            let unheld = |ip: &Ipv4Addr| !self.owner.contains_key(ip);
            let cooling = |ip: &Ipv4Addr| self.cooling_at(*ip, now);
            let waiting = if prefix {
                let unheld: Vec<Ipv4Network> = iface
                    .prefixes
                    .iter()
                    .filter(|p| p.iter().all(|ip| unheld(&ip)))
                    .copied()
                    .collect();
                let v: Vec<Ipv4Network> = unheld
                    .iter()
                    .filter(|p| !p.iter().any(|ip| cooling(&ip)))
                    .take(over)
                    .copied()
                    .collect();
                if !v.is_empty() {
                    found = Some((*idx, Vec::new(), v));
                    break;
                }
                !unheld.is_empty()
            } else {
                let unheld: Vec<Ipv4Addr> =
                    iface.secondary_ips.iter().copied().filter(unheld).collect();
                let v: Vec<Ipv4Addr> = unheld
                    .iter()
                    .filter(|ip| !cooling(ip))
                    .take(over)
                    .copied()
                    .collect();
                if !v.is_empty() {
                    found = Some((*idx, v, Vec::new()));
                    break;
                }
                !unheld.is_empty()
            };
            // The last interface's spare addresses still cool: wait for
            // them rather than give back an earlier interface's, so the
            // last one empties and can go.
            if waiting {
                return None;
            }
        }
        let (idx, picked_ips, picked_prefixes) = found?;
        let interface = self.slots.get(&idx)?.iface.id.clone();
        for p in &picked_prefixes {
            self.touched.insert(format!("prefix:{p}"), now);
        }
        for ip in &picked_ips {
            self.touched.insert(format!("ip:{ip}"), now);
        }
        let iface = &mut self.slots.get_mut(&idx)?.iface;
        if prefix {
            iface.prefixes.retain(|p| !picked_prefixes.contains(p));
            Some(Step::UnassignPrefixes {
                interface,
                prefixes: picked_prefixes,
            })
        } else {
            iface.secondary_ips.retain(|ip| !picked_ips.contains(ip));
            Some(Step::UnassignIps {
                interface,
                ips: picked_ips,
            })
        }
    }

    /// A step's addresses back, its call having failed (they are still the
    /// node's in the cloud).
    pub fn restore(&mut self, step: Step) {
        match step {
            Step::UnassignIps { interface, ips } => {
                if let Some(i) = self.iface_mut(&interface) {
                    i.secondary_ips.extend(ips);
                }
            }
            Step::UnassignPrefixes {
                interface,
                prefixes,
            } => {
                if let Some(i) = self.iface_mut(&interface) {
                    i.prefixes.extend(prefixes);
                }
            }
            Step::DeleteInterface { interface } => {
                let seen = SystemTime::UNIX_EPOCH;
                self.slots.entry(interface.device_index).or_insert(Slot {
                    iface: interface,
                    seen,
                });
            }
            _ => {}
        }
    }

    fn iface_mut(&mut self, id: &str) -> Option<&mut Interface> {
        self.slots
            .values_mut()
            .map(|s| &mut s.iface)
            .find(|i| i.id == id)
    }

    /// A new interface from the cloud.
    pub fn add_interface(&mut self, iface: Interface, now: SystemTime) {
        self.touched.insert(format!("iface:{}", iface.id), now);
        self.slots
            .insert(iface.device_index, Slot { iface, seen: now });
    }

    /// New secondary addresses on `interface`; false if the pool no longer
    /// knows it.
    pub fn add_ips(&mut self, interface: &str, ips: &[Ipv4Addr], now: SystemTime) -> bool {
        for ip in ips {
            self.touched.insert(format!("ip:{ip}"), now);
        }
        let Some(i) = self.iface_mut(interface) else {
            return false;
        };
        for ip in ips {
            if !i.secondary_ips.contains(ip) {
                i.secondary_ips.push(*ip);
            }
        }
        true
    }

    pub fn add_prefixes(
        &mut self,
        interface: &str,
        prefixes: &[Ipv4Network],
        now: SystemTime,
    ) -> bool {
        for p in prefixes {
            self.touched.insert(format!("prefix:{p}"), now);
        }
        let Some(i) = self.iface_mut(interface) else {
            return false;
        };
        for p in prefixes {
            if !i.prefixes.contains(p) {
                i.prefixes.push(*p);
            }
        }
        true
    }

    /// What `described`, a describe of one of the node's interfaces right
    /// after an assignment on it answered `answered_ips` or
    /// `answered_prefixes`, adds to the pool: the secondary addresses
    /// (prefixes) it shows that the pool does not have on it yet. Never an
    /// interface's primary address, never one the pool has on another
    /// interface, never one it gave back less than `quiet` ago unless the
    /// answer names it (a describe may still show what is gone). What the
    /// answer names and the describe does not show as a secondary address
    /// is refused: the answer alone never puts an address in the pool (as
    /// ipamd once did, `GetIPv4sFromEC2` after each assignment "to verify
    /// which IPs got attached").
    pub fn pick_described(
        &self,
        described: &Interface,
        answered_ips: &[Ipv4Addr],
        answered_prefixes: &[Ipv4Network],
        now: SystemTime,
        quiet: Duration,
    ) -> Picked {
        let recent = |key: String| {
            self.touched
                .get(&key)
                .is_some_and(|at| now.duration_since(*at).unwrap_or_default() < quiet)
        };
        let known = self.interfaces().find(|i| i.id == described.id);
        let others: Vec<&Interface> = self.interfaces().filter(|i| i.id != described.id).collect();
        let is_primary = |ip: &Ipv4Addr| {
            *ip == described.primary_ip || self.interfaces().any(|i| i.primary_ip == *ip)
        };
        let mut out = Picked::default();
        for ip in &described.secondary_ips {
            if known.is_some_and(|k| k.secondary_ips.contains(ip)) || out.ips.contains(ip) {
                continue;
            }
            let why = if is_primary(ip) {
                Some(Refused::Primary)
            } else if others.iter().any(|o| o.secondary_ips.contains(ip)) {
                Some(Refused::OtherInterface)
            } else if recent(format!("ip:{ip}")) && !answered_ips.contains(ip) {
                Some(Refused::Recent)
            } else {
                None
            };
            match why {
                Some(r) => out.refused_ips.push((*ip, r)),
                None => out.ips.push(*ip),
            }
        }
        for ip in answered_ips {
            if described.secondary_ips.contains(ip) || out.refused_ips.iter().any(|(x, _)| x == ip)
            {
                continue;
            }
            let why = if is_primary(ip) {
                Refused::Primary
            } else {
                Refused::NotDescribed
            };
            out.refused_ips.push((*ip, why));
        }
        for p in &described.prefixes {
            if known.is_some_and(|k| k.prefixes.contains(p)) || out.prefixes.contains(p) {
                continue;
            }
            let why = if others.iter().any(|o| o.prefixes.contains(p)) {
                Some(Refused::OtherInterface)
            } else if recent(format!("prefix:{p}")) && !answered_prefixes.contains(p) {
                Some(Refused::Recent)
            } else {
                None
            };
            match why {
                Some(r) => out.refused_prefixes.push((*p, r)),
                None => out.prefixes.push(*p),
            }
        }
        for p in answered_prefixes {
            if !described.prefixes.contains(p) {
                out.refused_prefixes.push((*p, Refused::NotDescribed));
            }
        }
        out
    }

    /// [`Pool::pick_described`], then what it picked into the pool (false
    /// in [`Picked`]'s place when the pool no longer knows the interface).
    pub fn add_described(
        &mut self,
        described: &Interface,
        answered_ips: &[Ipv4Addr],
        answered_prefixes: &[Ipv4Network],
        now: SystemTime,
        quiet: Duration,
    ) -> Option<Picked> {
        let picked = self.pick_described(described, answered_ips, answered_prefixes, now, quiet);
        if !self.add_ips(&described.id, &picked.ips, now)
            || !self.add_prefixes(&described.id, &picked.prefixes, now)
        {
            return None;
        }
        self.found_again();
        Some(picked)
    }

    /// Takes the cloud's view over again (ipamd's `nodeIPPoolReconcile`):
    /// interfaces and addresses the cloud has and the pool does not become
    /// free; those the pool has and the cloud no longer does go, with any
    /// assignment on them (dropped: the pod's address is gone). Whatever the
    /// pool itself changed less than `quiet` ago is left alone, the cloud's
    /// answer may not show it yet. Returns what changed, to log.
    pub fn reconcile(
        &mut self,
        cloud: Vec<Interface>,
        now: SystemTime,
        quiet: Duration,
    ) -> Vec<String> {
        self.touched
            .retain(|_, at| now.duration_since(*at).unwrap_or_default() < quiet);
        let recent = |key: String| self.touched.contains_key(&key);
        let mut notes = Vec::new();
        let mut gone_ips: Vec<Ipv4Addr> = Vec::new();
        let mut gone_prefixes: Vec<Ipv4Network> = Vec::new();
        let known: Vec<String> = self.interfaces().map(|i| i.id.clone()).collect();
        for theirs in cloud.iter().filter(|c| !known.contains(&c.id)) {
            if !recent(format!("iface:{}", theirs.id))
                && !self.slots.contains_key(&theirs.device_index)
            {
                notes.push(format!(
                    "found interface {} at device index {}",
                    theirs.id, theirs.device_index
                ));
                let slot = Slot {
                    iface: theirs.clone(),
                    seen: now,
                };
                self.slots.insert(theirs.device_index, slot);
            }
        }
        let vanished: Vec<u32> = self
            .slots
            .iter()
            .filter(|(_, s)| {
                !cloud.iter().any(|c| c.id == s.iface.id)
                    && !recent(format!("iface:{}", s.iface.id))
            })
            .map(|(idx, _)| *idx)
            .collect();
        for idx in vanished {
            if let Some(slot) = self.slots.remove(&idx) {
                notes.push(format!("interface {} is gone", slot.iface.id));
                gone_ips.extend(&slot.iface.secondary_ips);
                gone_prefixes.extend(&slot.iface.prefixes);
            }
        }
        let touched = self.touched.clone();
        let recent = |key: String| touched.contains_key(&key);
        for slot in self.slots.values_mut() {
            let ours = &mut slot.iface;
            let Some(theirs) = cloud.iter().find(|c| c.id == ours.id) else {
                continue;
            };
            for ip in &theirs.secondary_ips {
                if !ours.secondary_ips.contains(ip) && !recent(format!("ip:{ip}")) {
                    notes.push(format!("{}: found {ip}", ours.id));
                    ours.secondary_ips.push(*ip);
                }
            }
            for p in &theirs.prefixes {
                if !ours.prefixes.contains(p) && !recent(format!("prefix:{p}")) {
                    notes.push(format!("{}: found {p}", ours.id));
                    ours.prefixes.push(*p);
                }
            }
            let id = ours.id.clone();
            ours.secondary_ips.retain(|ip| {
                let keep = theirs.secondary_ips.contains(ip) || recent(format!("ip:{ip}"));
                if !keep {
                    notes.push(format!("{id}: {ip} is gone"));
                    gone_ips.push(*ip);
                }
                keep
            });
            ours.prefixes.retain(|p| {
                let keep = theirs.prefixes.contains(p) || recent(format!("prefix:{p}"));
                if !keep {
                    notes.push(format!("{id}: {p} is gone"));
                    gone_prefixes.push(*p);
                }
                keep
            });
        }
        let gone =
            |ip: &Ipv4Addr| gone_ips.contains(ip) || gone_prefixes.iter().any(|p| p.contains(*ip));
        let dropped: Vec<Attachment> = self
            .assigned
            .iter()
            .filter(|(_, al)| gone(&al.ip))
            .map(|(a, _)| a.clone())
            .collect();
        for a in dropped {
            if let Some(al) = self.assigned.remove(&a) {
                self.owner.remove(&al.ip);
                notes.push(format!(
                    "{}/{}: dropped {}, no longer the node's",
                    a.container_id, a.if_name, al.ip
                ));
            }
        }
        self.cooling.retain(|ip, _| !gone(ip));
        notes.extend(self.found_again());
        notes
    }

    /// Kept assignments whose address is on one of the interfaces again:
    /// the cloud's again, no longer flagged. Returns what changed, to log.
    fn found_again(&mut self) -> Vec<String> {
        let found: Vec<(Attachment, Interface)> = self
            .mismatched
            .keys()
            .filter_map(|a| {
                let ip = self.assigned.get(a)?.ip;
                Some((a.clone(), self.carrier(ip)?.clone()))
            })
            .collect();
        let mut notes = Vec::new();
        for (a, iface) in found {
            self.mismatched.remove(&a);
            if let Some(al) = self.assigned.get_mut(&a) {
                al.interface = iface.id.clone();
                al.device_index = iface.device_index;
                notes.push(format!(
                    "{}/{}: {} is on {} again",
                    a.container_id, a.if_name, al.ip, iface.id
                ));
            }
        }
        notes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn limits(ifaces: u32, addrs: u32) -> Limits {
        Limits {
            max_interfaces: ifaces,
            addrs_per_interface: addrs,
        }
    }

    #[test]
    fn max_pods_matches_aws_eni_max_pods() {
        // eni-max-pods.txt: m5.large 29, t3.medium 17, t3.small 11,
        // m5.4xlarge 234, p3dn.24xlarge 737.
        assert_eq!(max_pods(limits(3, 10), false), 29);
        assert_eq!(max_pods(limits(3, 6), false), 17);
        assert_eq!(max_pods(limits(3, 4), false), 11);
        assert_eq!(max_pods(limits(8, 30), false), 234);
        assert_eq!(max_pods(limits(15, 50), false), 737);
        // Prefix mode: m5.large 3 x 9 x 16 + 2 (before AWS's 110 cap).
        assert_eq!(max_pods(limits(3, 10), true), 434);
        let cfg = PoolConfig {
            max_enis: Some(2),
            ..Default::default()
        };
        assert_eq!(cfg.max_pods(limits(3, 10)), 20);
    }

    #[test]
    fn env_names_and_defaults() {
        let cfg = PoolConfig::from_env(|_| None).unwrap();
        assert_eq!(cfg, PoolConfig::default());
        assert_eq!(cfg.warm_eni_target, 1);
        assert_eq!(cfg.cooldown, Duration::from_secs(30));
        let env: HashMap<&str, &str> = [
            ("WARM_ENI_TARGET", "2"),
            ("WARM_IP_TARGET", "5"),
            ("MINIMUM_IP_TARGET", "10"),
            ("WARM_PREFIX_TARGET", "3"),
            ("ENABLE_PREFIX_DELEGATION", "true"),
            ("IP_COOLDOWN_PERIOD", "7"),
            ("MAX_ENI", "4"),
        ]
        .into();
        let cfg = PoolConfig::from_env(|k| env.get(k).map(|v| v.to_string())).unwrap();
        assert_eq!(
            cfg,
            PoolConfig {
                warm_eni_target: 2,
                warm_ip_target: Some(5),
                minimum_ip_target: Some(10),
                warm_prefix_target: Some(3),
                prefix_delegation: true,
                cooldown: Duration::from_secs(7),
                max_enis: Some(4),
            }
        );
        let bad = PoolConfig::from_env(|k| (k == "WARM_IP_TARGET").then(|| "x".to_string()));
        assert!(bad.unwrap_err().contains("WARM_IP_TARGET"));
        let neg = PoolConfig::from_env(|k| (k == "MAX_ENI").then(|| "-1".to_string())).unwrap();
        assert_eq!(neg.max_enis, None);
        let empty = PoolConfig::from_env(|k| (k == "WARM_ENI_TARGET").then(String::new)).unwrap();
        assert_eq!(empty.warm_eni_target, 1);
    }

    #[test]
    fn json_section_and_env_over_it() {
        let v = serde_json::json!({
            "provider": "aws", "externalSNAT": false, "excludeSNATCIDRs": [],
            "warmENITarget": 0, "warmIPTarget": 2, "minimumIPTarget": 12,
            "enablePrefixDelegation": false, "ipCooldownPeriod": 1, "maxENI": 2,
            "warmPrefixTarget": null
        });
        let mut cfg = PoolConfig::from_json(&v).unwrap();
        assert_eq!(cfg.warm_eni_target, 0);
        assert_eq!(cfg.warm_ip_target, Some(2));
        assert_eq!(cfg.minimum_ip_target, Some(12));
        assert_eq!(cfg.cooldown, Duration::from_secs(1));
        assert_eq!(cfg.max_enis, Some(2));
        assert_eq!(cfg.warm_prefix_target, None);
        cfg.apply_env(|k| (k == "WARM_IP_TARGET").then(|| "3".into()))
            .unwrap();
        assert_eq!(cfg.warm_ip_target, Some(3));
        let e = PoolConfig::from_json(&serde_json::json!({"warmIpTargett": 1})).unwrap_err();
        assert!(e.contains("warmIpTargett"), "{e}");
        let e = PoolConfig::from_json(&serde_json::json!({"warmIPTarget": "1"})).unwrap_err();
        assert!(e.contains("warmIPTarget"), "{e}");
        let e = PoolConfig::from_json(&serde_json::json!({"warmIPTarget": -1})).unwrap_err();
        assert!(e.contains("warmIPTarget"), "{e}");
        let e = PoolConfig::from_json(&serde_json::json!({"enablePrefixDelegation": "yes"}))
            .unwrap_err();
        assert!(e.contains("enablePrefixDelegation"), "{e}");
        assert!(PoolConfig::from_json(&serde_json::json!([])).is_err());
        assert!(PoolConfig::from_json(&serde_json::json!({"maxENI": 0})).is_err());
    }

    fn stats(total: u32, assigned: u32) -> Stats {
        Stats {
            total,
            assigned,
            ..Default::default()
        }
    }

    #[test]
    fn warm_ip_short_and_over() {
        let cfg = PoolConfig {
            warm_ip_target: Some(5),
            minimum_ip_target: Some(10),
            ..Default::default()
        };
        // p3dn.24xlarge rows of eni-and-ip-target.md.
        assert_eq!(target_state(&cfg, &stats(0, 0)), Some((10, 0)));
        assert_eq!(target_state(&cfg, &stats(10, 0)), Some((0, 0)));
        assert_eq!(target_state(&cfg, &stats(10, 7)), Some((2, 0)));
        assert_eq!(target_state(&cfg, &stats(12, 7)), Some((0, 0)));
        assert_eq!(target_state(&cfg, &stats(20, 7)), Some((0, 8)));
        // Over never takes total below MINIMUM_IP_TARGET.
        assert_eq!(target_state(&cfg, &stats(12, 0)), Some((0, 2)));
        // 0 is unset, as in ipamd.
        let unset = PoolConfig {
            warm_ip_target: Some(0),
            ..Default::default()
        };
        assert_eq!(target_state(&unset, &stats(3, 0)), None);
    }

    #[test]
    fn warm_eni_low_and_extra() {
        let cfg = PoolConfig::default();
        let t3small = limits(3, 4);
        assert!(too_low(&cfg, t3small, &stats(0, 0)));
        assert!(!too_low(&cfg, t3small, &stats(3, 0)));
        assert!(too_low(&cfg, t3small, &stats(3, 1)));
        // At capacity nothing more can come.
        assert!(!too_low(&cfg, t3small, &stats(9, 9)));
        assert!(!should_remove_extra(&cfg, t3small, &stats(6, 1), true));
        assert!(should_remove_extra(&cfg, t3small, &stats(9, 3), true));
        assert_eq!(excess(&cfg, &stats(9, 0)), 0);
    }

    #[test]
    fn prefix_targets() {
        let cfg = PoolConfig {
            prefix_delegation: true,
            ..Default::default()
        };
        let l = limits(3, 4);
        assert!(too_low(&cfg, l, &stats(0, 0)));
        assert!(!too_low(&cfg, l, &stats(16, 0)));
        assert!(too_low(&cfg, l, &stats(16, 1)));
        let s = Stats {
            total: 48,
            assigned: 5,
            prefixes: 3,
            free_prefixes: 2,
            ..Default::default()
        };
        assert_eq!(excess(&cfg, &s), 1);
        let wip = PoolConfig {
            prefix_delegation: true,
            warm_ip_target: Some(5),
            minimum_ip_target: Some(10),
            ..Default::default()
        };
        // 15 pods on one prefix: short 5 addresses is one prefix.
        let s = Stats {
            total: 16,
            assigned: 15,
            prefixes: 1,
            free_prefixes: 0,
            ..Default::default()
        };
        assert_eq!(target_state(&wip, &s), Some((1, 0)));
    }

    /// Runs the pool's steps against an in-memory cloud until it is quiet.
    struct Sim {
        pool: Pool,
        next: u32,
        calls: u32,
    }

    impl Sim {
        fn new(cfg: PoolConfig, l: Limits) -> Sim {
            let primary = Interface {
                id: "eni-0".into(),
                mac: "02:00:00:00:00:00".into(),
                device_index: 0,
                subnet: "10.0.0.0/16".parse().unwrap(),
                primary_ip: Ipv4Addr::new(10, 0, 0, 10),
                secondary_ips: vec![],
                prefixes: vec![],
            };
            Sim {
                pool: Pool::new(cfg, l, vec![primary], SystemTime::UNIX_EPOCH),
                next: 1 << 8,
                calls: 0,
            }
        }
        fn ips(&mut self, n: u32) -> Vec<Ipv4Addr> {
            (0..n)
                .map(|_| {
                    self.next += 1;
                    Ipv4Addr::from(0x0a00_0000 + self.next)
                })
                .collect()
        }
        fn prefixes(&mut self, n: u32) -> Vec<Ipv4Network> {
            (0..n)
                .map(|_| {
                    self.next = (self.next + 16) & !15;
                    Ipv4Network::new(Ipv4Addr::from(0x0a00_0000 + self.next), 28).unwrap()
                })
                .collect()
        }
        fn settle(&mut self, now: SystemTime) {
            for _ in 0..100 {
                let Some(step) = self.pool.next_step(now, Duration::ZERO, Duration::ZERO) else {
                    return;
                };
                self.calls += 1;
                match step {
                    Step::AssignIps { interface, count } => {
                        let ips = self.ips(count);
                        self.pool.add_ips(&interface, &ips, now);
                    }
                    Step::AssignPrefixes { interface, count } => {
                        let p = self.prefixes(count);
                        self.pool.add_prefixes(&interface, &p, now);
                    }
                    Step::CreateInterface {
                        device_index,
                        count,
                    } => {
                        let mut iface = self.pool.interfaces().next().unwrap().clone();
                        iface.id = format!("eni-{device_index}");
                        iface.device_index = device_index;
                        iface.secondary_ips.clear();
                        iface.prefixes.clear();
                        let id = iface.id.clone();
                        self.pool.add_interface(iface, now);
                        if self.pool.cfg.prefix_delegation {
                            let p = self.prefixes(count);
                            self.pool.add_prefixes(&id, &p, now);
                        } else {
                            let ips = self.ips(count);
                            self.pool.add_ips(&id, &ips, now);
                        }
                    }
                    Step::UnassignIps { .. }
                    | Step::UnassignPrefixes { .. }
                    | Step::DeleteInterface { .. } => {}
                }
            }
            panic!("the pool never settled");
        }
        /// Pods, interfaces, addresses (prefixes in prefix mode) per
        /// interface, unused addresses.
        fn shape(&self) -> (u32, Vec<usize>, u32) {
            let s = self.pool.stats(SystemTime::UNIX_EPOCH);
            let per: Vec<usize> = self
                .pool
                .interfaces()
                .map(|i| {
                    if self.pool.cfg.prefix_delegation {
                        i.prefixes.len()
                    } else {
                        i.secondary_ips.len()
                    }
                })
                .collect();
            (s.assigned, per, s.available())
        }
        fn pods(&mut self, n: u32) {
            let now = SystemTime::UNIX_EPOCH;
            self.settle(now);
            let have = self.pool.allocations().count() as u32;
            for k in have..n {
                let a = Attachment {
                    container_id: format!("c{k}"),
                    if_name: "eth0".into(),
                };
                if self.pool.assign(&a, now).is_none() {
                    self.settle(now);
                    self.pool
                        .assign(&a, now)
                        .expect("an address after a refill");
                }
                self.settle(now);
            }
        }
    }

    /// Pods, addresses (prefixes) per interface, unused addresses.
    type Row = (u32, Vec<usize>, u32);

    fn sorted(mut v: Vec<usize>) -> Vec<usize> {
        v.sort();
        v
    }

    /// docs/eni-and-ip-target.md's table (t3.small: 3 ENIs x 4 addresses;
    /// p3dn.24xlarge: 15 x 50), row by row: pods, attached ENIs, secondary
    /// addresses per ENI, unused addresses.
    #[test]
    fn aws_doc_eni_and_ip_target_table() {
        let t3small = limits(3, 4);
        let p3dn = limits(15, 50);
        let warm_ip = |w, m| PoolConfig {
            warm_ip_target: Some(w),
            minimum_ip_target: Some(m),
            ..Default::default()
        };
        let rows: Vec<(PoolConfig, Limits, Vec<Row>)> = vec![
            (
                PoolConfig::default(),
                t3small,
                vec![
                    (0, vec![3], 3),
                    (5, vec![3, 3, 3], 4),
                    (9, vec![3, 3, 3], 0),
                ],
            ),
            (
                warm_ip(1, 1),
                t3small,
                vec![(0, vec![1], 1), (5, vec![3, 3], 1), (9, vec![3, 3, 3], 0)],
            ),
            (
                warm_ip(2, 5),
                t3small,
                vec![
                    (0, vec![2, 3], 5),
                    (5, vec![1, 3, 3], 2),
                    (9, vec![3, 3, 3], 0),
                ],
            ),
            (
                PoolConfig::default(),
                p3dn,
                vec![
                    (0, vec![49], 49),
                    (3, vec![49, 49], 95),
                    (95, vec![49, 49, 49], 52),
                ],
            ),
            (
                warm_ip(5, 10),
                p3dn,
                vec![
                    (0, vec![10], 10),
                    (7, vec![12], 5),
                    (15, vec![20], 5),
                    (45, vec![1, 49], 5),
                ],
            ),
        ];
        for (cfg, l, expect) in rows {
            let mut sim = Sim::new(cfg.clone(), l);
            for (pods, per, unused) in expect {
                sim.pods(pods);
                let (p, got, u) = sim.shape();
                assert_eq!(
                    (p, sorted(got), u),
                    (pods, per, unused),
                    "{cfg:?} at {pods} pods"
                );
            }
        }
    }

    /// docs/prefix-and-ip-target.md's table: pods, prefixes per ENI, unused
    /// addresses. (Its t3.small row with WARM_IP 7 / MIN 20 at 0 pods says
    /// both 1 and 2 prefixes; ipamd's code attaches 2, MINIMUM_IP_TARGET 20
    /// rounding up to 32 addresses, and so do we.)
    #[test]
    fn aws_doc_prefix_table() {
        let t3small = limits(3, 4);
        let p3dn = limits(15, 50);
        let pd = |wp: Option<u32>, w: Option<u32>, m: Option<u32>| PoolConfig {
            prefix_delegation: true,
            warm_prefix_target: wp,
            warm_ip_target: w,
            minimum_ip_target: m,
            ..Default::default()
        };
        let rows: Vec<(PoolConfig, Limits, Vec<Row>)> = vec![
            (
                pd(Some(1), None, None),
                t3small,
                vec![
                    (0, vec![1], 16),
                    (5, vec![2], 27),
                    (16, vec![2], 16),
                    (17, vec![3], 31),
                    (58, vec![2, 3], 22),
                ],
            ),
            (
                pd(None, Some(1), Some(1)),
                t3small,
                vec![
                    (0, vec![1], 16),
                    (5, vec![1], 11),
                    (17, vec![2], 15),
                    (58, vec![1, 3], 6),
                ],
            ),
            (
                pd(None, Some(7), Some(20)),
                t3small,
                vec![
                    (0, vec![2], 32),
                    (5, vec![2], 27),
                    (17, vec![2], 15),
                    (58, vec![2, 3], 22),
                ],
            ),
            (
                pd(Some(1), None, None),
                p3dn,
                vec![(0, vec![1], 16), (3, vec![2], 29), (95, vec![7], 17)],
            ),
            (
                pd(None, Some(5), Some(10)),
                p3dn,
                vec![
                    (0, vec![1], 16),
                    (7, vec![1], 9),
                    (15, vec![2], 17),
                    (45, vec![4], 19),
                ],
            ),
        ];
        for (cfg, l, expect) in rows {
            let mut sim = Sim::new(cfg.clone(), l);
            for (pods, per, unused) in expect {
                sim.pods(pods);
                let (p, got, u) = sim.shape();
                assert_eq!(
                    (p, sorted(got), u),
                    (pods, per, unused),
                    "{cfg:?} at {pods} pods"
                );
            }
        }
    }

    #[test]
    fn release_gives_back_over_target_and_frees_interfaces() {
        let cfg = PoolConfig {
            warm_ip_target: Some(2),
            minimum_ip_target: Some(5),
            cooldown: Duration::ZERO,
            ..Default::default()
        };
        let mut sim = Sim::new(cfg, limits(3, 4));
        sim.pods(9);
        let now = SystemTime::UNIX_EPOCH;
        let all: Vec<Attachment> = sim.pool.allocations().map(|(a, _)| a.clone()).collect();
        for a in &all {
            sim.pool.unassign(a, now);
        }
        sim.settle(now);
        let s = sim.pool.stats(now);
        assert_eq!(
            (s.total, s.assigned),
            (5, 0),
            "MINIMUM_IP_TARGET is the floor"
        );
        assert!(sim.pool.interfaces().count() <= 2);
        // The primary interface stays.
        assert!(sim.pool.interfaces().any(|i| i.device_index == 0));
    }

    #[test]
    fn warm_eni_frees_a_whole_unused_interface() {
        let cfg = PoolConfig {
            cooldown: Duration::ZERO,
            ..Default::default()
        };
        let mut sim = Sim::new(cfg, limits(3, 4));
        sim.pods(7);
        assert_eq!(sim.pool.interfaces().count(), 3);
        let now = SystemTime::UNIX_EPOCH;
        let all: Vec<Attachment> = sim.pool.allocations().map(|(a, _)| a.clone()).collect();
        for a in &all {
            sim.pool.unassign(a, now);
        }
        sim.settle(now);
        // available 6 >= 2 x 3 still frees one; 3 left is the target.
        let (_, per, unused) = sim.shape();
        assert_eq!((per.len(), unused), (1, 3));
    }

    #[test]
    fn cooling_addresses_are_neither_handed_out_nor_freed() {
        let cfg = PoolConfig {
            warm_ip_target: Some(1),
            minimum_ip_target: Some(1),
            cooldown: Duration::from_secs(30),
            ..Default::default()
        };
        let mut sim = Sim::new(cfg, limits(3, 4));
        let t0 = SystemTime::UNIX_EPOCH;
        sim.pods(1);
        let a = Attachment {
            container_id: "c0".into(),
            if_name: "eth0".into(),
        };
        let ip = sim.pool.lookup(&a).unwrap().ip;
        sim.pool.unassign(&a, t0);
        // Over the target: what goes back is never the cooling address.
        while let Some(step) = sim.pool.next_step(t0, Duration::ZERO, Duration::ZERO) {
            if let Step::UnassignIps { ips, .. } = &step {
                assert!(!ips.contains(&ip), "{step:?}");
            }
        }
        assert!(sim.pool.interfaces().any(|i| i.secondary_ips.contains(&ip)));
        let b = Attachment {
            container_id: "c1".into(),
            if_name: "eth0".into(),
        };
        let t1 = t0 + Duration::from_secs(10);
        assert_ne!(sim.pool.assign(&b, t1).map(|al| al.ip), Some(ip));
        sim.settle(t1);
        let t2 = t0 + Duration::from_secs(31);
        // Past the cooldown it may come back.
        let mut seen = vec![];
        for k in 2..20 {
            let c = Attachment {
                container_id: format!("c{k}"),
                if_name: "eth0".into(),
            };
            match sim.pool.assign(&c, t2) {
                Some(al) => seen.push(al.ip),
                None => break,
            }
        }
        assert!(seen.contains(&ip), "{seen:?}");
    }

    #[test]
    fn reconcile_leaves_what_the_pool_just_changed_alone() {
        let cfg = PoolConfig::default();
        let mut sim = Sim::new(cfg, limits(3, 4));
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        sim.pool.next_step(t0, Duration::ZERO, Duration::ZERO);
        let ips = sim.ips(3);
        sim.pool.add_ips("eni-0", &ips, t0);
        let a = Attachment {
            container_id: "c".into(),
            if_name: "eth0".into(),
        };
        let al = sim.pool.assign(&a, t0).unwrap();
        let quiet = Duration::from_secs(60);
        // The cloud's read still lags: it shows none of the three.
        let mut stale: Vec<Interface> = sim.pool.interfaces().cloned().collect();
        stale[0].secondary_ips.clear();
        let notes = sim
            .pool
            .reconcile(stale.clone(), t0 + Duration::from_secs(5), quiet);
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(sim.pool.lookup(&a), Some(&al));
        // Past the quiet window the cloud is believed: the pod's address
        // is gone and so is its assignment.
        let notes = sim
            .pool
            .reconcile(stale, t0 + Duration::from_secs(61), quiet);
        assert_eq!(notes.len(), 4, "{notes:?}");
        assert_eq!(sim.pool.lookup(&a), None);
        assert_eq!(sim.pool.stats(t0).total, 0);
    }

    fn ip(last: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 0, 0, last)
    }

    fn iface(id: &str, device_index: u32, primary: u8, secondary: &[u8]) -> Interface {
        Interface {
            id: id.into(),
            mac: format!("02:00:00:00:00:0{device_index}"),
            device_index,
            subnet: "10.0.0.0/24".parse().unwrap(),
            primary_ip: ip(primary),
            secondary_ips: secondary.iter().map(|b| ip(*b)).collect(),
            prefixes: vec![],
        }
    }

    fn att(cid: &str) -> Attachment {
        Attachment {
            container_id: cid.into(),
            if_name: "eth0".into(),
        }
    }

    /// moto's AssignPrivateIpAddresses answer lists the interface's primary
    /// address with the new ones: only what the describe shows as a
    /// secondary address goes into the pool, never an interface's primary,
    /// one of another interface, or one the pool just gave back that the
    /// answer does not name.
    #[test]
    fn what_is_handed_out_after_an_assignment_comes_from_the_describe() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let quiet = Duration::from_secs(60);
        let mut pool = Pool::new(
            PoolConfig::default(),
            limits(3, 10),
            vec![iface("eni-0", 0, 10, &[20]), iface("eni-1", 1, 30, &[40])],
            t0,
        );
        // Given back a moment ago; a lagging describe still shows it.
        pool.touched.insert(format!("ip:{}", ip(22)), t0);
        let described = iface("eni-0", 0, 10, &[20, 21, 22, 30, 40, 24]);
        let answered = [ip(10), ip(20), ip(21), ip(23), ip(24)];
        let picked = pool.pick_described(&described, &answered, &[], t0, quiet);
        assert_eq!(picked.ips, [ip(21), ip(24)]);
        let mut refused = picked.refused_ips.clone();
        refused.sort();
        assert_eq!(
            refused,
            [
                (ip(10), Refused::Primary),
                (ip(22), Refused::Recent),
                (ip(23), Refused::NotDescribed),
                (ip(30), Refused::Primary),
                (ip(40), Refused::OtherInterface),
            ]
        );
        // Past the quiet window the describe is believed again; named by
        // the answer, it is taken at once.
        let later = pool.pick_described(&described, &[], &[], t0 + quiet, quiet);
        assert!(later.ips.contains(&ip(22)), "{later:?}");
        let named = pool.pick_described(&described, &[ip(22)], &[], t0, quiet);
        assert!(named.ips.contains(&ip(22)), "{named:?}");
        // The answer alone adds nothing.
        let bare = iface("eni-0", 0, 10, &[20]);
        let none = pool.pick_described(&bare, &answered, &[], t0, quiet);
        assert!(none.ips.is_empty(), "{none:?}");

        assert!(
            pool.add_described(&described, &answered, &[], t0, quiet)
                .is_some()
        );
        let mut got = BTreeSet::new();
        for k in 0..10 {
            if let Some(al) = pool.assign(&att(&format!("c{k}")), t0) {
                got.insert(al.ip);
            }
        }
        assert_eq!(got, BTreeSet::from([ip(20), ip(21), ip(24), ip(40)]));
        let gone = iface("eni-9", 2, 50, &[51]);
        assert_eq!(pool.add_described(&gone, &[], &[], t0, quiet), None);
    }

    #[test]
    fn prefixes_after_an_assignment_come_from_the_describe_too() {
        let t0 = SystemTime::UNIX_EPOCH;
        let cfg = PoolConfig {
            prefix_delegation: true,
            ..Default::default()
        };
        let mut primary = iface("eni-0", 0, 10, &[]);
        primary.prefixes = vec!["10.0.0.32/28".parse().unwrap()];
        let pool = Pool::new(cfg, limits(3, 10), vec![primary.clone()], t0);
        let (p1, p2): (Ipv4Network, Ipv4Network) = (
            "10.0.0.48/28".parse().unwrap(),
            "10.0.0.64/28".parse().unwrap(),
        );
        let mut described = primary;
        described.prefixes.push(p1);
        let picked = pool.pick_described(&described, &[], &[p1, p2], t0, Duration::ZERO);
        assert_eq!(picked.prefixes, [p1]);
        assert_eq!(picked.refused_prefixes, [(p2, Refused::NotDescribed)]);
    }

    /// Whatever a provider put in an interface's secondary addresses, the
    /// pool hands out no interface's primary address.
    #[test]
    fn no_primary_address_is_ever_handed_out() {
        let t0 = SystemTime::UNIX_EPOCH;
        let mut pool = Pool::new(
            PoolConfig::default(),
            limits(3, 10),
            vec![
                iface("eni-0", 0, 10, &[10, 30, 11]),
                iface("eni-1", 1, 30, &[]),
            ],
            t0,
        );
        let got: Vec<Ipv4Addr> = (0..4)
            .filter_map(|k| pool.assign(&att(&format!("c{k}")), t0).map(|al| al.ip))
            .collect();
        assert_eq!(got, [ip(11)]);
    }

    /// A restart never drops a live pod because the cloud's view lacks its
    /// address: the assignment is kept (its address handed to nobody
    /// else), flagged, and confirmed once a describe shows the address
    /// again. Only entries contradicting earlier ones are left out.
    #[test]
    fn restore_keeps_what_the_cloud_lost_and_confirm_takes_it_back() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let mut pool = Pool::new(
            PoolConfig::default(),
            limits(3, 10),
            vec![iface("eni-0", 0, 10, &[20, 21]), iface("eni-1", 1, 30, &[])],
            t0,
        );
        let restored = pool.restore_assignments(
            [
                (att("held"), ip(20), "eni-0".into()),
                (att("lost"), ip(25), "eni-0".into()),
                (att("orphan"), ip(26), "eni-7".into()),
                (att("twice"), ip(20), "eni-0".into()),
                (att("held"), ip(21), "eni-0".into()),
            ],
            [(ip(25), t0)],
            t0,
        );
        assert_eq!(
            restored.missing,
            [
                Missing {
                    attachment: att("lost"),
                    ip: ip(25),
                    interface: "eni-0".into(),
                },
                Missing {
                    attachment: att("orphan"),
                    ip: ip(26),
                    interface: "eni-7".into(),
                },
            ]
        );
        assert_eq!(restored.dropped.len(), 2, "{:?}", restored.dropped);
        assert!(restored.dropped[0].contains("already held by held/eth0"));
        assert!(restored.dropped[1].contains("second address"));
        for (cid, device_index) in [("lost", 0), ("orphan", 0)] {
            let al = pool.lookup(&att(cid)).expect("kept");
            assert_eq!(al.device_index, device_index);
            assert!(pool.mismatch(&att(cid)).is_some());
        }
        assert_eq!(pool.mismatch(&att("held")), None);
        // Nobody else gets them; the one free address goes.
        assert_eq!(pool.assign(&att("new"), t0).map(|al| al.ip), Some(ip(21)));
        assert_eq!(pool.assign(&att("newer"), t0), None);

        // Assigned back: the describe shows it as a secondary address.
        assert!(!pool.confirm(&att("lost"), &iface("eni-0", 0, 10, &[20, 21]), t0));
        assert!(pool.confirm(&att("lost"), &iface("eni-0", 0, 10, &[20, 21, 25]), t0));
        assert_eq!(pool.mismatch(&att("lost")), None);
        assert!(
            pool.interfaces()
                .next()
                .unwrap()
                .secondary_ips
                .contains(&ip(25))
        );
        // Released without its address: nothing to cool, nothing to reuse.
        let al = pool.unassign(&att("orphan"), t0).unwrap();
        assert_eq!(al.ip, ip(26));
        assert_eq!(pool.mismatch(&att("orphan")), None);
        assert!(pool.cooling(t0).is_empty());
    }

    #[test]
    fn a_reconcile_that_finds_a_kept_address_clears_its_flag() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let mut pool = Pool::new(
            PoolConfig::default(),
            limits(3, 10),
            vec![iface("eni-0", 0, 10, &[20]), iface("eni-1", 1, 30, &[])],
            t0,
        );
        pool.restore_assignments([(att("lost"), ip(25), "eni-0".into())], [], t0);
        assert!(pool.mismatch(&att("lost")).is_some());
        let notes = pool.reconcile(
            vec![iface("eni-0", 0, 10, &[20]), iface("eni-1", 1, 30, &[25])],
            t0,
            Duration::ZERO,
        );
        assert!(notes.iter().any(|n| n.contains("again")), "{notes:?}");
        assert_eq!(pool.mismatch(&att("lost")), None);
        let al = pool.lookup(&att("lost")).unwrap();
        assert_eq!((al.interface.as_str(), al.device_index), ("eni-1", 1));
    }
}
