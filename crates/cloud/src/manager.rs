//! The pool manager the agent runs: pods take and return addresses under a
//! mutex with no cloud call and no await on their path ([`Manager::allocate`],
//! [`Manager::release`]); one loop ([`Manager::run`]) asks the cloud for
//! more or gives back what is over the targets, as ipamd's pool manager
//! does. Assignments are checkpointed before an address is handed out, so
//! a restarted agent hands no address to two pods.

use std::future::Future;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use rcni_agent_proto::ipam::Attachment;
use serde::Serialize;
use tokio::sync::{Notify, watch};

use crate::checkpoint::{self, Checkpoint};
use crate::pool::{Pool, PoolConfig, Step};
use crate::{CloudError, Instance, Interface, Limits, Provider, Result};

pub use crate::pool::Allocation;

macro_rules! log {
    ($($arg:tt)*) => { eprintln!("rcni-node: cloud: {}", format_args!($($arg)*)) };
}

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

impl<P: Provider + 'static> Manager<P> {
    /// Describe the node, delete leaked (unattached, ours) interfaces, load
    /// the checkpoint and reconcile it with the cloud's view (an assignment
    /// whose address the cloud no longer has is dropped and logged; cloud
    /// addresses no assignment holds are free); never leaks, never
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
        let dropped = pool.restore_assignments(
            cp.allocations.into_iter().map(|e| {
                (
                    Attachment {
                        container_id: e.container_id,
                        if_name: e.if_name,
                    },
                    e.ip,
                )
            }),
            cp.cooling
                .into_iter()
                .map(|c| (c.ip, checkpoint::from_unix_ms(c.released_at))),
            now,
        );
        for d in &dropped {
            log!("checkpoint: dropped {d}");
        }
        let s = pool.stats(now);
        log!(
            "{} ({}): {} interfaces, {} addresses, {} held by pods, max pods {}",
            view.instance.id,
            view.instance.instance_type,
            pool.interfaces().count(),
            s.total,
            s.assigned,
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
                let ips = p.assign_ips(&interface, count).await?;
                log!("{interface}: +{} addresses", ips.len());
                self.lock()
                    .pool
                    .add_ips(&interface, &ips, SystemTime::now());
            }
            Step::AssignPrefixes { interface, count } => {
                let prefixes = p.assign_prefixes(&interface, count).await?;
                log!("{interface}: +{} prefixes", prefixes.len());
                self.lock()
                    .pool
                    .add_prefixes(&interface, &prefixes, SystemTime::now());
            }
            Step::CreateInterface {
                device_index,
                count,
            } => {
                let iface = p.create_interface(device_index).await?;
                let id = iface.id.clone();
                log!(
                    "attached {id} ({}) at device index {device_index}",
                    iface.mac
                );
                self.lock().pool.add_interface(iface, SystemTime::now());
                self.changed();
                if count > 0 {
                    let prefix = self.lock().pool.cfg.prefix_delegation;
                    if prefix {
                        let v = p.assign_prefixes(&id, count).await?;
                        log!("{id}: +{} prefixes", v.len());
                        self.lock().pool.add_prefixes(&id, &v, SystemTime::now());
                    } else {
                        let v = p.assign_ips(&id, count).await?;
                        log!("{id}: +{} addresses", v.len());
                        self.lock().pool.add_ips(&id, &v, SystemTime::now());
                    }
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
