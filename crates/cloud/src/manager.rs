//! The pool manager the agent runs: pods take and return addresses under a
//! mutex with no cloud call and no await on their path ([`Manager::allocate`],
//! [`Manager::release`]); one loop ([`Manager::run`]) asks the cloud for
//! more or gives back what is over the targets, as ipamd's pool manager
//! does. Assignments are checkpointed before an address is handed out, so
//! a restarted agent hands no address to two pods.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use rcni_agent_proto::ipam::Attachment;
use serde::Serialize;
use tokio::sync::{Notify, watch};

use crate::checkpoint::{self, Checkpoint};
use crate::pool::{Missing, Pool, PoolConfig, Refused, Step};
use crate::{CloudError, Instance, Interface, Limits, Provider, Result};

pub use crate::pool::Allocation;

macro_rules! log {
    ($($arg:tt)*) => { eprintln!("rcni-node: cloud: {}", format_args!($($arg)*)) };
}

/// What an operator has to look at: a pod whose address the cloud's view
/// does not bear out, an answer of the cloud the pool did not believe.
macro_rules! warn {
    ($($arg:tt)*) => { eprintln!("rcni-node: cloud: warning: {}", format_args!($($arg)*)) };
}

/// What was done with a checkpointed assignment the cloud's view did not
/// bear out at start: the label of the agent's
/// `rcni_cloud_checkpoint_mismatches_total`.
pub const MISMATCH_ACTIONS: [&str; 3] = ["reacquired", "kept", "dropped"];

/// Why no address was handed out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// Nothing free right now; the pool is refilling (CNI code 11, try
    /// again).
    #[error(
        "no free address in the node's cloud address pool yet; it is being refilled, try again"
    )]
    Empty,
    /// Every address the node's interfaces can carry is a pod's: the
    /// instance type's limit (the number is those addresses; max pods is 2
    /// more).
    #[error(
        "this node's cloud interfaces carry at most {0} pod addresses and all are in use (the instance type's limit; set the kubelet's max pods accordingly)"
    )]
    Full(u32),
}

/// The loop's timings. [`Default`] is ipamd's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// How often the loop checks the pool without being woken (ipamd's
    /// `ipPoolMonitorInterval`, 5 s).
    pub resync: Duration,
    /// No interface younger than this is freed (ipamd's `minENILifeTime`,
    /// 1 min).
    pub min_interface_age: Duration,
    /// At most one give-back of addresses per this long (ipamd's
    /// `decreaseIPPoolInterval`, 30 s), so churn does not turn into API
    /// calls.
    pub decrease_interval: Duration,
    /// First wait after a throttled call, doubled up to `backoff_max`.
    pub backoff_start: Duration,
    pub backoff_max: Duration,
    /// How often the pool takes the cloud's view over again (ipamd's
    /// `nodeIPPoolReconcileInterval`, 1 min): addresses or interfaces
    /// added or removed behind its back.
    pub reconcile: Duration,
    /// What the pool itself changed less than this ago is left out of a
    /// reconcile, the cloud's reads lagging its writes (ipamd's
    /// `ipReconcileCooldown`, 1 min).
    pub reconcile_quiet: Duration,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            resync: Duration::from_secs(5),
            min_interface_age: Duration::from_secs(60),
            decrease_interval: Duration::from_secs(30),
            backoff_start: Duration::from_millis(500),
            backoff_max: Duration::from_secs(30),
            reconcile: Duration::from_secs(60),
            reconcile_quiet: Duration::from_secs(60),
        }
    }
}

/// The pool as the agent reports it.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    pub instance: Instance,
    /// The instance type's limits with MAX_ENI applied.
    pub limits: Limits,
    pub interfaces: Vec<Interface>,
    pub allocations: Vec<(Attachment, Allocation)>,
    /// Can be handed out now.
    pub free: u32,
    /// Released within the cooldown.
    pub cooling: u32,
    /// All pod addresses the interfaces carry (current mode).
    pub total: u32,
    pub max_pods: u32,
    /// Cloud API calls so far.
    pub provider_calls: u64,
    /// Checkpointed assignments the cloud's view did not bear out at start,
    /// by what was done ([`MISMATCH_ACTIONS`]): the address assigned back
    /// ("reacquired"), the assignment kept and flagged without it ("kept"),
    /// an entry contradicting another left out ("dropped").
    pub checkpoint_mismatches: BTreeMap<&'static str, u64>,
}

struct State {
    pool: Pool,
    instance: Instance,
    last_reconcile: Instant,
}

pub struct Manager<P: Provider> {
    provider: P,
    state: Mutex<State>,
    wake: Notify,
    changes: watch::Sender<u64>,
    checkpoint: PathBuf,
    tuning: Tuning,
    mismatches: BTreeMap<&'static str, u64>,
}

/// Retries a call while the cloud throttles it, backing off as the loop
/// does, a few times (for the start, which has no loop yet).
async fn patiently<T, F: Future<Output = Result<T>>>(
    tuning: &Tuning,
    mut f: impl FnMut() -> F,
) -> Result<T> {
    let mut wait = tuning.backoff_start;
    for _ in 0..6 {
        match f().await {
            Err(CloudError::Throttled(m)) => {
                log!("throttled ({m}); retrying in {wait:?}");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(tuning.backoff_max);
            }
            r => return r,
        }
    }
    f().await
}

/// Assigns a checkpointed pod's address back to the interface the checkpoint
/// had it on, and confirms with a describe that it is there; why not
/// otherwise.
async fn reacquire<P: Provider>(
    provider: &P,
    tuning: &Tuning,
    pool: &mut Pool,
    m: &Missing,
) -> std::result::Result<(), String> {
    let (ip, interface) = (m.ip, m.interface.as_str());
    if let Some(i) = pool.interfaces().find(|i| i.primary_ip == ip) {
        return Err(format!("it is {}'s own address, never a pod's", i.id));
    }
    if pool.cfg.prefix_delegation {
        return Err("prefix mode: only whole prefixes are assigned".into());
    }
    if !pool.interfaces().any(|i| i.id == interface) {
        return Err(format!("{interface} is no longer attached"));
    }
    let ips = [ip];
    patiently(tuning, || provider.assign_these_ips(interface, &ips))
        .await
        .map_err(|e| e.to_string())?;
    let described = patiently(tuning, || provider.describe_interface(interface))
        .await
        .map_err(|e| format!("assigned, then {e}"))?;
    if pool.confirm(&m.attachment, &described, SystemTime::now()) {
        Ok(())
    } else {
        Err(format!(
            "assigned, but a describe of {interface} does not show it as a secondary address"
        ))
    }
}

impl<P: Provider + 'static> Manager<P> {
    /// Describe the node, delete leaked (unattached, ours) interfaces, load
    /// the checkpoint and reconcile it with the cloud's view: cloud
    /// addresses no assignment holds are free; an assignment whose address
    /// the cloud no longer shows is never dropped (its pod still runs): the
    /// address is assigned back to its interface where the cloud lets us,
    /// else the assignment is kept and flagged in the checkpoint; either
    /// way a warning and `checkpoint_mismatches`. Never leaks, never
    /// double-assigns.
    pub async fn start(provider: P, cfg: PoolConfig, checkpoint: PathBuf) -> Result<Arc<Self>> {
        Self::start_tuned(provider, cfg, checkpoint, Tuning::default()).await
    }

    /// [`Manager::start`] with other timings (tests; ipamd's are the
    /// default).
    pub async fn start_tuned(
        provider: P,
        cfg: PoolConfig,
        checkpoint: PathBuf,
        tuning: Tuning,
    ) -> Result<Arc<Self>> {
        // A corrupt checkpoint stops the start before any cloud call.
        let cp = checkpoint::load(&checkpoint).map_err(|e| CloudError::Other(e.to_string()))?;
        let view = patiently(&tuning, || provider.describe()).await?;
        match patiently(&tuning, || provider.leaked_interfaces()).await {
            Ok(leaked) => {
                for id in leaked {
                    match patiently(&tuning, || provider.delete_interface(&id)).await {
                        Ok(()) | Err(CloudError::NotFound(_)) => {
                            log!("deleted leaked interface {id} (created, never attached)")
                        }
                        Err(e) => log!("leaked interface {id}: delete failed: {e}"),
                    }
                }
            }
            Err(e) => log!("listing leaked interfaces failed: {e}"),
        }
        let now = SystemTime::now();
        let mut pool = Pool::new(cfg, view.limits, view.interfaces, now);
        let restored = pool.restore_assignments(
            cp.allocations.into_iter().map(|e| {
                (
                    Attachment {
                        container_id: e.container_id,
                        if_name: e.if_name,
                    },
                    e.ip,
                    e.interface,
                )
            }),
            cp.cooling
                .into_iter()
                .map(|c| (c.ip, checkpoint::from_unix_ms(c.released_at))),
            now,
        );
        let mut mismatches: BTreeMap<&'static str, u64> =
            MISMATCH_ACTIONS.iter().map(|a| (*a, 0)).collect();
        for d in &restored.dropped {
            warn!("checkpoint: dropped {d}");
            *mismatches.entry("dropped").or_default() += 1;
        }
        for m in restored.missing {
            let Missing {
                attachment: a,
                ip,
                interface,
            } = &m;
            let pod = format!("{}/{}", a.container_id, a.if_name);
            match reacquire(&provider, &tuning, &mut pool, &m).await {
                Ok(()) => {
                    warn!(
                        "checkpoint: {pod}: {ip} was not on {interface} in the cloud's view; assigned it back, the pod keeps it"
                    );
                    *mismatches.entry("reacquired").or_default() += 1;
                }
                Err(why) => {
                    warn!(
                        "checkpoint: {pod}: {ip} is not on {interface} in the cloud's view and was not assigned back ({why}); kept for the pod and flagged in the checkpoint: the pod may be unreachable until it is deleted"
                    );
                    pool.flag(
                        a,
                        format!("{ip} is not on {interface} in the cloud's view: {why}"),
                    );
                    *mismatches.entry("kept").or_default() += 1;
                }
            }
        }
        let s = pool.stats(now);
        log!(
            "{} ({}): {} interfaces, {} addresses, {} pods, max pods {}",
            view.instance.id,
            view.instance.instance_type,
            pool.interfaces().count(),
            s.total,
            pool.allocations().count(),
            pool.max_pods()
        );
        let mgr = Arc::new(Manager {
            provider,
            state: Mutex::new(State {
                pool,
                instance: view.instance,
                last_reconcile: Instant::now(),
            }),
            wake: Notify::new(),
            changes: watch::channel(0).0,
            checkpoint,
            tuning,
            mismatches,
        });
        {
            let st = mgr.lock();
            mgr.save(&st).map_err(CloudError::Other)?;
        }
        Ok(mgr)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere must not take every later ADD down with it; the
        // state is consistent between statements.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn save(&self, st: &State) -> std::result::Result<(), String> {
        let now = SystemTime::now();
        let cp = Checkpoint {
            version: checkpoint::VERSION,
            allocations: st
                .pool
                .allocations()
                .map(|(a, al)| checkpoint::Entry {
                    container_id: a.container_id.clone(),
                    if_name: a.if_name.clone(),
                    ip: al.ip,
                    interface: al.interface.clone(),
                    mismatch: st.pool.mismatch(a).map(str::to_string),
                })
                .collect(),
            cooling: st
                .pool
                .cooling(now)
                .into_iter()
                .map(|(ip, at)| checkpoint::Cooling {
                    ip,
                    released_at: checkpoint::unix_ms(at),
                })
                .collect(),
        };
        checkpoint::save(&self.checkpoint, &cp).map_err(|e| e.to_string())
    }

    /// Idempotent per attachment (same attachment: same address).
    /// `Err(AllocError::Empty)` while nothing is free (the agent answers
    /// CNI code 11 and the refill is already woken); `Err(AllocError::Full)`
    /// at max pods.
    pub fn allocate(&self, a: &Attachment) -> std::result::Result<Allocation, AllocError> {
        let now = SystemTime::now();
        let mut st = self.lock();
        if let Some(al) = st.pool.lookup(a) {
            return Ok(al.clone());
        }
        let Some(al) = st.pool.assign(a, now) else {
            let held = st.pool.allocations().count() as u32;
            let cap = st.pool.capacity();
            drop(st);
            if held >= cap {
                return Err(AllocError::Full(cap));
            }
            self.wake.notify_one();
            return Err(AllocError::Empty);
        };
        // On disk before the pod has it: a restart must see it held.
        if let Err(e) = self.save(&st) {
            log!("{e}; {} not handed out", al.ip);
            st.pool.unassign(a, SystemTime::UNIX_EPOCH);
            return Err(AllocError::Empty);
        }
        drop(st);
        self.wake.notify_one();
        Ok(al)
    }

    /// Idempotent; starts the address's cooldown and wakes the loop.
    pub fn release(&self, a: &Attachment) -> Option<Allocation> {
        let mut st = self.lock();
        let al = st.pool.unassign(a, SystemTime::now())?;
        if let Err(e) = self.save(&st) {
            // The old checkpoint still names the attachment: after a
            // restart its address stays held until GC, never doubled.
            log!("{e} (releasing {})", al.ip);
        }
        drop(st);
        self.wake.notify_one();
        Some(al)
    }

    pub fn lookup(&self, a: &Attachment) -> Option<Allocation> {
        self.lock().pool.lookup(a).cloned()
    }

    /// Releases every assignment whose attachment is not in `valid`;
    /// returns the released ones.
    pub fn gc(&self, valid: &[Attachment]) -> Vec<(Attachment, Allocation)> {
        let now = SystemTime::now();
        let mut st = self.lock();
        let stale: Vec<Attachment> = st
            .pool
            .allocations()
            .filter(|(a, _)| !valid.contains(a))
            .map(|(a, _)| a.clone())
            .collect();
        let released: Vec<(Attachment, Allocation)> = stale
            .into_iter()
            .filter_map(|a| st.pool.unassign(&a, now).map(|al| (a, al)))
            .collect();
        if !released.is_empty() {
            if let Err(e) = self.save(&st) {
                log!("{e} (gc)");
            }
            drop(st);
            for (a, al) in &released {
                log!("gc: {} from {}/{}", al.ip, a.container_id, a.if_name);
            }
            self.wake.notify_one();
        }
        released
    }

    pub fn snapshot(&self) -> Snapshot {
        let now = SystemTime::now();
        let st = self.lock();
        let s = st.pool.stats(now);
        Snapshot {
            instance: st.instance.clone(),
            limits: st.pool.limits,
            interfaces: st.pool.interfaces().cloned().collect(),
            allocations: st
                .pool
                .allocations()
                .map(|(a, al)| (a.clone(), al.clone()))
                .collect(),
            free: s.free(),
            cooling: s.cooling,
            total: s.total,
            max_pods: st.pool.max_pods(),
            provider_calls: self.provider.calls(),
            checkpoint_mismatches: self.mismatches.clone(),
        }
    }

    /// Bumped whenever the set of interfaces or their addresses changes:
    /// the agent sets up a new interface's link, rules and routes.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    /// The refill/free loop: runs until `stop` resolves; wakes on
    /// allocate/release and every resync; on a throttled call backs off
    /// exponentially (start 500 ms, cap 30 s, reset on success), deaf to
    /// wake-ups meanwhile so pods' retries do not hammer the API; other
    /// errors are logged and retried at the next resync.
    pub async fn run(self: Arc<Self>, stop: impl Future<Output = ()>) {
        let mut stop = std::pin::pin!(stop);
        let mut backoff: Option<Duration> = None;
        let mut delay = Duration::ZERO;
        loop {
            if backoff.is_some() {
                tokio::select! {
                    _ = &mut stop => return,
                    _ = tokio::time::sleep(delay) => {}
                }
            } else {
                tokio::select! {
                    _ = &mut stop => return,
                    _ = self.wake.notified() => {}
                    _ = tokio::time::sleep(delay) => {}
                }
            }
            let result = tokio::select! {
                _ = &mut stop => return,
                r = self.pass() => r,
            };
            match result {
                Ok(()) => {
                    backoff = None;
                    delay = self.tuning.resync;
                }
                Err(CloudError::Throttled(m)) => {
                    let wait = backoff.map_or(self.tuning.backoff_start, |b| {
                        (b * 2).min(self.tuning.backoff_max)
                    });
                    log!("throttled ({m}); next try in {wait:?}");
                    backoff = Some(wait);
                    delay = wait;
                }
                Err(e) => {
                    log!("{e}; next try in {:?}", self.tuning.resync);
                    backoff = None;
                    delay = self.tuning.resync;
                }
            }
        }
    }

    /// Steps until the pool needs nothing (or a call fails). Bounded, so a
    /// cloud that answers with fewer addresses than asked cannot spin us.
    async fn pass(&self) -> Result<()> {
        let due = self.lock().last_reconcile.elapsed() >= self.tuning.reconcile;
        if due {
            let view = self.provider.describe().await?;
            let mut st = self.lock();
            st.last_reconcile = Instant::now();
            let notes = st.pool.reconcile(
                view.interfaces,
                SystemTime::now(),
                self.tuning.reconcile_quiet,
            );
            if !notes.is_empty() {
                if let Err(e) = self.save(&st) {
                    log!("{e} (reconcile)");
                }
                drop(st);
                for n in notes {
                    log!("reconcile: {n}");
                }
                self.changed();
            }
        }
        for _ in 0..64 {
            let step = {
                let mut st = self.lock();
                let t = &self.tuning;
                st.pool
                    .next_step(SystemTime::now(), t.min_interface_age, t.decrease_interval)
            };
            let Some(step) = step else { return Ok(()) };
            self.execute(step).await?;
        }
        Ok(())
    }

    async fn execute(&self, step: Step) -> Result<()> {
        let p = &self.provider;
        match step {
            Step::AssignIps { interface, count } => {
                let answered = p.assign_ips(&interface, count).await?;
                let described = p.describe_interface(&interface).await?;
                self.take_described(&described, &answered, &[]);
            }
            Step::AssignPrefixes { interface, count } => {
                let answered = p.assign_prefixes(&interface, count).await?;
                let described = p.describe_interface(&interface).await?;
                self.take_described(&described, &[], &answered);
            }
            Step::CreateInterface {
                device_index,
                count,
            } => {
                let mut iface = p.create_interface(device_index).await?;
                // What an interface carries for pods is what a describe
                // after the assignment below shows, never the create's
                // answer.
                iface.secondary_ips.clear();
                iface.prefixes.clear();
                let id = iface.id.clone();
                log!(
                    "attached {id} ({}) at device index {device_index}",
                    iface.mac
                );
                self.lock().pool.add_interface(iface, SystemTime::now());
                self.changed();
                if count > 0 {
                    let prefix = self.lock().pool.cfg.prefix_delegation;
                    let (ips, prefixes) = if prefix {
                        (Vec::new(), p.assign_prefixes(&id, count).await?)
                    } else {
                        (p.assign_ips(&id, count).await?, Vec::new())
                    };
                    let described = p.describe_interface(&id).await?;
                    self.take_described(&described, &ips, &prefixes);
                }
            }
            Step::UnassignIps { interface, ips } => {
                // Out of the pool already; back in if the cloud keeps them.
                match p.unassign_ips(&interface, &ips).await {
                    Ok(()) | Err(CloudError::NotFound(_)) => {
                        log!("{interface}: -{} addresses", ips.len())
                    }
                    Err(e) => {
                        self.lock()
                            .pool
                            .restore(Step::UnassignIps { interface, ips });
                        return Err(e);
                    }
                }
            }
            Step::UnassignPrefixes {
                interface,
                prefixes,
            } => match p.unassign_prefixes(&interface, &prefixes).await {
                Ok(()) | Err(CloudError::NotFound(_)) => {
                    log!("{interface}: -{} prefixes", prefixes.len())
                }
                Err(e) => {
                    self.lock().pool.restore(Step::UnassignPrefixes {
                        interface,
                        prefixes,
                    });
                    return Err(e);
                }
            },
            Step::DeleteInterface { interface } => match p.delete_interface(&interface.id).await {
                Ok(()) | Err(CloudError::NotFound(_)) => {
                    log!(
                        "deleted {} (device index {})",
                        interface.id,
                        interface.device_index
                    )
                }
                Err(e) => {
                    self.lock()
                        .pool
                        .restore(Step::DeleteInterface { interface });
                    return Err(e);
                }
            },
        }
        self.changed();
        Ok(())
    }
}

impl<P: Provider> Manager<P> {
    /// What a describe after an assignment adds to the pool (see
    /// [`Pool::pick_described`]); warns of what the answer named that the
    /// pool did not take (an interface's primary address in moto's answer,
    /// say).
    fn take_described(
        &self,
        described: &Interface,
        ips: &[Ipv4Addr],
        prefixes: &[ipnetwork::Ipv4Network],
    ) {
        let id = &described.id;
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let picked = st.pool.add_described(
            described,
            ips,
            prefixes,
            SystemTime::now(),
            self.tuning.reconcile_quiet,
        );
        drop(st);
        let Some(picked) = picked else {
            log!("{id}: no longer the pool's; its addresses wait for the next reconcile");
            return;
        };
        if !picked.ips.is_empty() {
            log!("{id}: +{} addresses", picked.ips.len());
        }
        if !picked.prefixes.is_empty() {
            log!("{id}: +{} prefixes", picked.prefixes.len());
        }
        for (ip, why) in &picked.refused_ips {
            if ips.contains(ip) {
                warn!("{id}: the assignment answered {ip}, {why}: not handed out");
            } else if *why == Refused::Recent {
                // A describe lagging the pool's own give-back is expected.
                log!("{id}: the describe still shows {ip}, {why}: not taken");
            } else {
                warn!("{id}: its describe after the assignment shows {ip}, {why}: not handed out");
            }
        }
        for (p, why) in &picked.refused_prefixes {
            let how = if prefixes.contains(p) {
                "the assignment answered"
            } else {
                "its describe after the assignment shows"
            };
            warn!("{id}: {how} {p}, {why}: not handed out");
        }
    }

    /// Addresses that can be handed out right now.
    pub fn free(&self) -> u32 {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.pool.stats(SystemTime::now()).free()
    }

    /// The address `ip` is some attachment's.
    pub fn holder(&self, ip: Ipv4Addr) -> Option<Attachment> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.pool
            .allocations()
            .find(|(_, al)| al.ip == ip)
            .map(|(a, _)| a.clone())
    }
}
