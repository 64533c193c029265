//! Kubernetes Services at the socket (`c/services.bpf.c`): the cgroup
//! sock_addr programs that give a connection to a Service's address one of
//! its backends when the connection is made, and the maps they read.
//!
//! The maps are pinned in a directory of the caller's (the agent's
//! `<pin root>/services`), so a restarted agent finds the Services it
//! wrote and a connection's reverse entry outlives the agent. The
//! programs are attached to one cgroup v2 directory each call of
//! [`ServiceLb::attach`], their links pinned beside the maps under the
//! cgroup's id: the hooks stay while the agent is gone.

use crate::bpffs::remove_pin;
use crate::load::collect;
use crate::types::{SvcBackend, SvcBackendIdx, SvcBackendKey, SvcKey, SvcRevKey, SvcVal};
use crate::{Error, Result};
use aya::maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray};
use aya::programs::links::{CgroupAttachMode, FdLink};
use aya::programs::{CgroupSockAddr, Program};
use aya::{Ebpf, EbpfLoader};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

#[repr(C, align(8))]
struct Aligned<T: ?Sized>(T);

static OBJECT: &Aligned<[u8]> =
    &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/services.bpf.o")));

const MAP_SVC: &str = "rcni_svc";
const MAP_BACKENDS: &str = "rcni_svc_be";
const MAP_REVERSE: &str = "rcni_svc_rev";
const MAP_STATS: &str = "rcni_svc_stats";
const MAP_LAYOUT: &str = "rcni_svc_layout";
const MAP_AFFINITY: &str = "rcni_svc_aff";
const MAP_BACKEND_IDX: &str = "rcni_svc_be_idx";
const MAPS: [&str; 7] = [
    MAP_SVC,
    MAP_BACKENDS,
    MAP_REVERSE,
    MAP_STATS,
    MAP_LAYOUT,
    MAP_AFFINITY,
    MAP_BACKEND_IDX,
];
/// `SVC_LAYOUT` of the C: pins of another layout are refused.
const LAYOUT: u32 = 1;
/// Link pins: `link_<program>_<cgroup id>`.
const LINK_PREFIX: &str = "link_";
const IPPROTO_UDP: u8 = 17;
/// `MAX_BACKENDS` of the C.
pub const MAX_SERVICE_BACKENDS: usize = 262_144;

/// The programs, by name in the object (and in the kernel).
pub const SERVICE_PROGRAMS: [&str; 8] = [
    "rcni_svc_conn4",
    "rcni_svc_conn6",
    "rcni_svc_send4",
    "rcni_svc_send6",
    "rcni_svc_recv4",
    "rcni_svc_recv6",
    "rcni_svc_peer4",
    "rcni_svc_peer6",
];

/// One address, protocol and port of a Service (a frontend).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend {
    pub addr: IpAddr,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub proto: u8,
    pub port: u16,
}

/// A frontend's backends (any order) and its `sessionAffinity: ClientIP`
/// timeout in seconds (0: none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Backends {
    pub addrs: Vec<SocketAddr>,
    pub affinity_s: u32,
}

impl From<Vec<SocketAddr>> for Backends {
    fn from(addrs: Vec<SocketAddr>) -> Backends {
        Backends {
            addrs,
            affinity_s: 0,
        }
    }
}

/// What [`ServiceLb::sync`] changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncReport {
    pub added: usize,
    pub changed: usize,
    pub removed: usize,
}

/// The programs' counters, summed over CPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServiceStats {
    /// Connections and datagrams given a backend.
    pub translated: u64,
    /// Connections and datagrams refused: the Service had no endpoint.
    pub refused: u64,
    /// Replies' sources and peers' names turned back to the Service.
    pub reversed: u64,
}

/// The Services' maps, pinned in a directory, and the programs when this
/// value loaded them.
pub struct ServiceLb {
    dir: PathBuf,
    ebpf: Ebpf,
    svc: HashMap<MapData, SvcKey, SvcVal>,
    backends: HashMap<MapData, SvcBackendKey, SvcBackend>,
    backend_idx: HashMap<MapData, SvcBackendIdx, u32>,
    reverse: HashMap<MapData, SvcRevKey, SvcBackend>,
    stats: PerCpuArray<MapData, u64>,
    /// The last id given to a frontend's backends.
    next_id: u32,
    /// What the maps hold, as [`ServiceLb::current`] reads it: kept after
    /// a sync that wrote all it meant to, so the next one compares in
    /// memory rather than reading every entry back (tens of thousands at
    /// 10,000 Services); dropped by a failed one, which reads them again.
    mirror: Option<Frontends>,
    /// Backends that left a UDP frontend since [`ServiceLb::take_udp_gone`]
    /// last ran: the sockets connected to them through it are to be closed.
    udp_gone: BTreeSet<(Frontend, SocketAddr)>,
}

/// Every frontend, its value and its backends (sorted), by key.
type Frontends = BTreeMap<SvcKey, (SvcVal, Vec<SocketAddr>)>;

fn typed<T>(m: Map, name: &str) -> Result<T>
where
    T: TryFrom<Map, Error = MapError>,
{
    T::try_from(m).map_err(|e| Error::aya(format!("map {name}"), e))
}

/// A cgroup v2 directory's id, as the kernel names it (its inode number).
fn cgroup_id(cgroup: &Path) -> Result<u64> {
    let st = nix::sys::statfs::statfs(cgroup)
        .map_err(|e| Error::io(format!("statfs {}", cgroup.display()), e.into()))?;
    if st.filesystem_type() != nix::sys::statfs::CGROUP2_SUPER_MAGIC {
        return Err(Error::msg(format!(
            "{} is not a cgroup v2 directory: the Service hooks attach only there \
             (on a cgroup v1 host, the unified hierarchy, often /sys/fs/cgroup/unified)",
            cgroup.display()
        )));
    }
    std::fs::metadata(cgroup)
        .map(|m| m.ino())
        .map_err(|e| Error::io(format!("stat {}", cgroup.display()), e))
}

fn frontend_of(k: &SvcKey) -> Frontend {
    Frontend {
        addr: k.ip(),
        proto: k.proto,
        port: k.port(),
    }
}

fn link_pin(dir: &Path, program: &str, cgroup: u64) -> PathBuf {
    dir.join(format!("{LINK_PREFIX}{program}_{cgroup}"))
}

impl ServiceLb {
    /// Loads the programs, with the maps pinned in `dir` (a directory on a
    /// bpffs, made if missing) reused when they are there: the Services a
    /// run before wrote stay, and so do connections' reverse entries.
    pub fn open_or_load(dir: &Path) -> Result<ServiceLb> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        let _lock = crate::bpffs::DirLock::acquire(dir)?;
        if dir.join(MAP_LAYOUT).exists() {
            let m = Map::Array(
                MapData::from_pin(dir.join(MAP_LAYOUT))
                    .map_err(|e| Error::aya(format!("open {}/{MAP_LAYOUT}", dir.display()), e))?,
            );
            let layout: Array<MapData, u32> = typed(m, MAP_LAYOUT)?;
            let v = layout
                .get(&0, 0)
                .map_err(|e| Error::aya("read the Services' layout", e))?;
            if v != LAYOUT {
                return Err(Error::incompatible(
                    dir,
                    format_args!("Services' layout {v}, this build's is {LAYOUT}"),
                ));
            }
        }
        let mut loader = EbpfLoader::new();
        for name in MAPS {
            loader.map_pin_path(name, dir.join(name));
        }
        let mut ebpf = loader
            .load(&OBJECT.0)
            .map_err(|e| Error::aya("load the Services' object", e))?;
        for name in SERVICE_PROGRAMS {
            program(&mut ebpf, name)?
                .load()
                .map_err(|e| Error::aya(format!("load program {name}"), e))?;
        }
        let mut take = |name: &str| {
            ebpf.take_map(name)
                .ok_or_else(|| Error::msg(format!("map {name} missing from the object")))
        };
        let mut layout: Array<MapData, u32> = typed(take(MAP_LAYOUT)?, MAP_LAYOUT)?;
        layout
            .set(0, LAYOUT, 0)
            .map_err(|e| Error::aya("write the Services' layout", e))?;
        let svc: HashMap<MapData, SvcKey, SvcVal> = typed(take(MAP_SVC)?, MAP_SVC)?;
        let backends = typed(take(MAP_BACKENDS)?, MAP_BACKENDS)?;
        let backend_idx = typed(take(MAP_BACKEND_IDX)?, MAP_BACKEND_IDX)?;
        let reverse = typed(take(MAP_REVERSE)?, MAP_REVERSE)?;
        let stats = typed(take(MAP_STATS)?, MAP_STATS)?;
        let next_id = collect(svc.iter(), "read the Services")?
            .iter()
            .map(|(_, v)| v.id)
            .max()
            .unwrap_or(0);
        let mut lb = ServiceLb {
            dir: dir.to_path_buf(),
            ebpf,
            svc,
            backends,
            backend_idx,
            reverse,
            stats,
            next_id,
            mirror: None,
            udp_gone: BTreeSet::new(),
        };
        // Backends of a sync that died between writing them and swapping
        // the frontend, or removing them after.
        lb.sweep_backends()?;
        Ok(lb)
    }

    /// Hooks the programs to the cgroup v2 directory `cgroup` and the
    /// processes below it, links pinned in the directory; links of this
    /// directory pinned before (an earlier run's programs) are replaced,
    /// those of other directories removed. Other programs on the cgroup stay.
    pub fn attach(&mut self, cgroup: &Path) -> Result<()> {
        let id = cgroup_id(cgroup)?;
        let fd = std::fs::File::open(cgroup)
            .map_err(|e| Error::io(format!("open {}", cgroup.display()), e))?;
        for name in SERVICE_PROGRAMS {
            let prog = program(&mut self.ebpf, name)?;
            let link = prog
                // As a bpf_link (kernel 5.7+; getpeername's hook is 5.8)
                // it sits beside other programs on the cgroup: link_create
                // takes no mode flag (EINVAL with ALLOW_MULTI).
                .attach(&fd, CgroupAttachMode::Single)
                .map_err(|e| Error::aya(format!("attach {name} to {}", cgroup.display()), e))?;
            let link = prog
                .take_link(link)
                .map_err(|e| Error::aya("take link", e))?;
            let link: FdLink = link
                .try_into()
                .map_err(|e| Error::aya(format!("{name}'s link"), e))?;
            // The new link pinned first, then renamed over the old one,
            // whose program comes off only then: no connection made in
            // between misses the hook.
            let pin = link_pin(&self.dir, name, id);
            // (bpffs refuses names with a dot.)
            let tmp = self.dir.join(format!("new_{name}_{id}"));
            remove_pin(&tmp)?;
            link.pin(&tmp)
                .map_err(|e| Error::aya(format!("pin {}", tmp.display()), e))?;
            std::fs::rename(&tmp, &pin).map_err(|e| {
                Error::io(format!("rename {} to {}", tmp.display(), pin.display()), e)
            })?;
        }
        for (pin, cg) in link_pins(&self.dir)? {
            if cg != id {
                remove_pin(&pin)?;
            }
        }
        Ok(())
    }

    /// Makes the maps hold exactly `want`: each frontend and its backends
    /// (of its family; the order does not matter). An empty list of
    /// backends refuses connections, as kube-proxy does for a Service
    /// without endpoints. A changed frontend gets its new backends under a
    /// new id, then the frontend is swapped to it in one update: a
    /// connection meanwhile gets the old set or the new one.
    pub fn sync(&mut self, want: &BTreeMap<Frontend, Backends>) -> Result<SyncReport> {
        let mut cur = self.take_mirror()?;
        let gone: Vec<Frontend> = cur
            .keys()
            .map(frontend_of)
            .filter(|f| !want.contains_key(f))
            .collect();
        let changes = want
            .iter()
            .map(|(f, b)| (*f, Some(b)))
            .chain(gone.into_iter().map(|f| (f, None)));
        let report = self.write(changes, &mut cur)?;
        self.mirror = Some(cur);
        Ok(report)
    }

    /// Changes only the frontends named: each to its backends, or removed
    /// (`None`), as [`ServiceLb::sync`] would; the others stay. The agent's
    /// way after one Service changed among thousands.
    pub fn update(&mut self, changes: &BTreeMap<Frontend, Option<Backends>>) -> Result<SyncReport> {
        let mut cur = self.take_mirror()?;
        let report = self.write(changes.iter().map(|(f, b)| (*f, b.as_ref())), &mut cur)?;
        self.mirror = Some(cur);
        Ok(report)
    }

    /// The writes of a sync or update, `cur` (what the maps held) kept in
    /// step with them.
    fn write<'a>(
        &mut self,
        changes: impl IntoIterator<Item = (Frontend, Option<&'a Backends>)>,
        cur: &mut Frontends,
    ) -> Result<SyncReport> {
        let mut report = SyncReport::default();
        let mut used: BTreeSet<u32> = cur.values().map(|(v, _)| v.id).collect();
        for (f, b) in changes {
            let key = SvcKey::new(f.addr, f.proto, f.port);
            let Some(b) = b else {
                if let Some((v, bes)) = cur.remove(&key) {
                    removed(self.svc.remove(&key), &format!("remove {f:?}"))?;
                    if f.proto == IPPROTO_UDP {
                        self.udp_gone.extend(bes.iter().map(|b| (f, *b)));
                    }
                    self.remove_backends(&v, &bes)?;
                    used.remove(&v.id);
                    report.removed += 1;
                }
                continue;
            };
            let mut bes: Vec<SocketAddr> = b
                .addrs
                .iter()
                .filter(|b| b.is_ipv4() == f.addr.is_ipv4())
                .copied()
                .collect();
            bes.sort();
            bes.dedup();
            if cur
                .get(&key)
                .is_some_and(|(v, old)| *old == bes && v.affinity_s == b.affinity_s)
            {
                continue;
            }
            let id = self.new_id(&used)?;
            used.insert(id);
            for (slot, addr) in bes.iter().enumerate() {
                let slot = slot as u32;
                let be = SvcBackend::new(*addr);
                self.backends
                    .insert(SvcBackendKey { id, slot }, be, 0)
                    .map_err(|e| Error::aya(format!("write a backend of {f:?}"), e))?;
                if b.affinity_s > 0 {
                    self.backend_idx
                        .insert(SvcBackendIdx { id, be }, slot, 0)
                        .map_err(|e| Error::aya(format!("write a backend of {f:?}"), e))?;
                }
            }
            let val = SvcVal {
                id,
                count: bes.len() as u32,
                affinity_s: b.affinity_s,
                pad: 0,
            };
            self.svc
                .insert(key, val, 0)
                .map_err(|e| Error::aya(format!("write {f:?}"), e))?;
            if f.proto == IPPROTO_UDP
                && let Some((_, old)) = cur.get(&key)
            {
                let left = old.iter().filter(|a| bes.binary_search(a).is_err());
                self.udp_gone.extend(left.map(|b| (f, *b)));
            }
            match cur.insert(key, (val, bes)) {
                Some((v, b)) => {
                    self.remove_backends(&v, &b)?;
                    used.remove(&v.id);
                    report.changed += 1;
                }
                None => report.added += 1,
            }
        }
        Ok(report)
    }

    /// Each UDP frontend and backend that left it since the last call: what
    /// [`crate::sockterm::close_gone_udp`] closes sockets to.
    pub fn take_udp_gone(&mut self) -> BTreeSet<(Frontend, SocketAddr)> {
        std::mem::take(&mut self.udp_gone)
    }

    /// The frontend through which the hooks connected socket `cookie` to
    /// `backend`, if they did (the reverse entry a connect or sendmsg
    /// left).
    pub fn frontend_of_socket(
        &self,
        cookie: u64,
        backend: SocketAddr,
    ) -> Result<Option<SocketAddr>> {
        let key = SvcRevKey {
            cookie,
            be: SvcBackend::new(backend),
            pad: [0; 4],
        };
        match self.reverse.get(&key, 0) {
            Ok(v) => Ok(Some(v.socket_addr())),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(Error::aya("read a socket's Service", e)),
        }
    }

    /// The frontends and their backends as the maps hold them.
    pub fn frontends(&self) -> Result<BTreeMap<Frontend, Backends>> {
        Ok(self
            .current()?
            .into_iter()
            .map(|(k, (v, addrs))| {
                let b = Backends {
                    addrs,
                    affinity_s: v.affinity_s,
                };
                (frontend_of(&k), b)
            })
            .collect())
    }

    pub fn stats(&self) -> Result<ServiceStats> {
        let sum = |i: u32| -> Result<u64> {
            let v = self
                .stats
                .get(&i, 0)
                .map_err(|e| Error::aya("read the Services' counters", e))?;
            Ok(v.iter().sum())
        };
        Ok(ServiceStats {
            translated: sum(0)?,
            refused: sum(1)?,
            reversed: sum(2)?,
        })
    }

    /// What the maps hold: the copy the last write kept, else read back.
    /// A write that fails leaves it taken, so the next one reads again.
    fn take_mirror(&mut self) -> Result<Frontends> {
        match self.mirror.take() {
            Some(m) => Ok(m),
            None => self.current(),
        }
    }

    /// Every frontend, its value and its backends, sorted, read from the
    /// maps.
    fn current(&self) -> Result<Frontends> {
        let mut out = BTreeMap::new();
        for (k, v) in collect(self.svc.iter(), "read the Services")? {
            let mut bes = Vec::with_capacity(v.count as usize);
            for slot in 0..v.count {
                match self.backends.get(&SvcBackendKey { id: v.id, slot }, 0) {
                    Ok(b) => bes.push(b.socket_addr()),
                    // Half written (a sync that died): rewritten as changed.
                    Err(MapError::KeyNotFound) => {}
                    Err(e) => return Err(Error::aya("read a Service's backend", e)),
                }
            }
            bes.sort();
            out.insert(k, (v, bes));
        }
        Ok(out)
    }

    fn new_id(&mut self, used: &BTreeSet<u32>) -> Result<u32> {
        for _ in 0..=used.len() {
            self.next_id = self.next_id.wrapping_add(1).max(1);
            if !used.contains(&self.next_id) {
                return Ok(self.next_id);
            }
        }
        Err(Error::msg("no free Service id"))
    }

    /// Frontend `v`'s backends (`addrs`, as read) out of both maps.
    fn remove_backends(&mut self, v: &SvcVal, addrs: &[SocketAddr]) -> Result<()> {
        let gone = |r| removed(r, "remove a Service's backend");
        let id = v.id;
        for slot in 0..v.count {
            gone(self.backends.remove(&SvcBackendKey { id, slot }))?;
        }
        for addr in addrs {
            let be = SvcBackend::new(*addr);
            gone(self.backend_idx.remove(&SvcBackendIdx { id, be }))?;
        }
        Ok(())
    }

    fn sweep_backends(&mut self) -> Result<()> {
        let live: BTreeSet<u32> = collect(self.svc.iter(), "read the Services")?
            .into_iter()
            .map(|(_, v)| v.id)
            .collect();
        sweep(&mut self.backends, |k| k.id, &live)?;
        sweep(&mut self.backend_idx, |k| k.id, &live)
    }
}

/// Ids of the cgroups the programs pinned in `dir` are attached to.
pub fn attached_cgroups(dir: &Path) -> Result<BTreeSet<u64>> {
    Ok(link_pins(dir)?.into_iter().map(|(_, id)| id).collect())
}

/// Takes the programs off every cgroup (their link pins in `dir`); the
/// maps stay. True when there was a link.
pub fn detach_services(dir: &Path) -> Result<bool> {
    let pins = link_pins(dir)?;
    for (pin, _) in &pins {
        remove_pin(pin)?;
    }
    Ok(!pins.is_empty())
}

/// Removes `dir` and everything pinned in it: the hooks come off and the
/// Services and reverse entries go.
pub fn remove_services(dir: &Path) -> Result<()> {
    detach_services(dir)?;
    for name in MAPS {
        remove_pin(&dir.join(name))?;
    }
    match std::fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(format!("remove {}", dir.display()), e)),
    }
}

fn link_pins(dir: &Path) -> Result<Vec<(PathBuf, u64)>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(format!("read {}", dir.display()), e)),
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(LINK_PREFIX) else {
            continue;
        };
        if let Some(id) = rest.rsplit('_').next().and_then(|s| s.parse().ok()) {
            out.push((e.path(), id));
        }
    }
    Ok(out)
}

/// Removes the entries of `map` whose frontend id is not `live`.
fn sweep<K: aya::Pod, V: aya::Pod>(
    map: &mut HashMap<MapData, K, V>,
    id: impl Fn(&K) -> u32,
    live: &BTreeSet<u32>,
) -> Result<()> {
    let keys = collect(map.keys().map(|k| k.map(|k| (k, ()))), "read the backends")?;
    for (k, ()) in keys.into_iter().filter(|(k, ())| !live.contains(&id(k))) {
        removed(map.remove(&k), "remove a stale backend")?;
    }
    Ok(())
}

/// A map entry removed, or not there (aya says so as ENOENT).
fn removed(r: std::result::Result<(), MapError>, op: &str) -> Result<()> {
    match r {
        Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.kind() == std::io::ErrorKind::NotFound => {
            Ok(())
        }
        Err(e) => Err(Error::aya(op, e)),
    }
}

fn program<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut CgroupSockAddr> {
    let p: &mut Program = ebpf
        .program_mut(name)
        .ok_or_else(|| Error::msg(format!("program {name} missing from the object")))?;
    p.try_into()
        .map_err(|e| Error::aya(format!("program {name}"), e))
}
