//! rcni's eBPF datapath: the tc programs of `c/datapath.bpf.c` (the fast
//! path, and network policy from `c/policy.h`), compiled by clang in
//! `build.rs` and embedded here, and their loader.
//!
//! One copy of the programs and their maps serves a whole network, for the
//! fastpath and policy plugins alike: whichever comes first loads it and
//! pins programs and maps under the network's pin directory
//! (`/sys/fs/bpf/rcni/<network>/`); every later call opens the pins, so a
//! pod's ADD is an attach and a few map updates. Both plugins write their
//! part of the same endpoint entry per pod address. Each pod's attachment is
//! a tcx link pinned per attachment id (the plugin process exits after every
//! call, and an unpinned tcx link dies with its last fd), or on kernels
//! without tcx a cls_bpf filter on a clsact qdisc, which lives on its own.

pub mod bpffs;
mod types;

pub use types::{
    AttachmentId, CT_EGRESS, CT_INGRESS, CtKey, EP_FASTPATH, EP_NORMAL_PATH, EP_POLICY, Endpoint,
    EndpointKey, EndpointStats, MAX_ENDPOINTS, MAX_PORT_RANGES, PORTSET_ALL, PORTSET_NONE, PeerKey,
    PortRange, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC, Verdict, fmt_mac,
};

use aya::maps::lpm_trie::{Key as LpmKey, LpmTrie};
use aya::maps::{Array, HashMap, Map, MapData, MapError, MapType, PerCpuArray, PerCpuValues};
use aya::programs::links::FdLink;
use aya::programs::tc::{NlOptions, TcAttachOptions};
use aya::programs::{LinkOrder, SchedClassifier, TcAttachType};
use aya::util::KernelVersion;
use aya::{Ebpf, EbpfLoader};
use std::fmt;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use types::{CidrData, PortSet};

/// The fast path program's name in the object (and in the kernel: under 16
/// bytes).
pub const PROGRAM: &str = "rcni_fastpath";
/// The pod's ingress policy, on the egress hook of its host veth.
pub const POLICY_IN_PROGRAM: &str = "rcni_pol_in";
/// The pod's egress policy, on the ingress hook, in front of the fast path.
pub const POLICY_OUT_PROGRAM: &str = "rcni_pol_out";

/// The object's programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Program {
    Fastpath = 0,
    PolicyIn = 1,
    PolicyOut = 2,
}

impl Program {
    pub const ALL: [Program; 3] = [Program::Fastpath, Program::PolicyIn, Program::PolicyOut];

    pub fn name(self) -> &'static str {
        match self {
            Program::Fastpath => PROGRAM,
            Program::PolicyIn => POLICY_IN_PROGRAM,
            Program::PolicyOut => POLICY_OUT_PROGRAM,
        }
    }

    /// Its pin in the network's directory. The fast path's, `prog`, is
    /// pinned last: its presence means everything else is there too.
    fn pin(self) -> &'static str {
        match self {
            Program::Fastpath => PROG_PIN,
            Program::PolicyIn => "prog-pol-in",
            Program::PolicyOut => "prog-pol-out",
        }
    }
}

/// The layout of the pinned maps and what they mean, written into
/// `rcni_version` at load. Pins of another version are refused (1 was the
/// fast path alone, before the map held a version). Bump it with any change
/// of a key, a value or their meaning (3: `EP_NORMAL_PATH`, which a version
/// 2 program would ignore).
pub const DATAPATH_VERSION: u32 = 3;

const MAP_ENDPOINTS: &str = "rcni_endpoints";
const MAP_STATS: &str = "rcni_ep_stats";
const MAP_VERDICTS: &str = "rcni_verdicts";
const MAP_SLOTS: &str = "rcni_slots";
const MAP_VERSION: &str = "rcni_version";
const MAP_CIDR: &str = "rcni_pol_cidr";
const MAP_PEER: &str = "rcni_pol_peer";
const MAP_PORTS: &str = "rcni_pol_ports";
const MAP_CT: &str = "rcni_pol_ct";
const MAP_NODE_ADDRS: &str = "rcni_node_addrs";
const PROG_PIN: &str = "prog";

/// tc mode: filter priorities on the ingress hook (lower runs first), so
/// that policy decides before the fast path redirects.
const POLICY_TC_PRIORITY: u16 = 10;
const FASTPATH_TC_PRIORITY: u16 = 20;

/// What each map must look like: (name, type, key size, value size).
fn map_specs() -> [(&'static str, MapType, usize, usize); 10] {
    use std::mem::size_of;
    [
        (
            MAP_ENDPOINTS,
            MapType::Hash,
            size_of::<EndpointKey>(),
            size_of::<Endpoint>(),
        ),
        (
            MAP_STATS,
            MapType::PerCpuArray,
            4,
            size_of::<EndpointStats>(),
        ),
        (MAP_VERDICTS, MapType::PerCpuArray, 4, 8),
        (MAP_SLOTS, MapType::Array, 4, size_of::<types::SlotBitmap>()),
        (MAP_VERSION, MapType::Array, 4, 4),
        (MAP_CIDR, MapType::LpmTrie, size_of::<LpmKey<CidrData>>(), 4),
        (MAP_PEER, MapType::Hash, size_of::<PeerKey>(), 4),
        (MAP_PORTS, MapType::Hash, 4, size_of::<PortSet>()),
        (MAP_CT, MapType::LruHash, size_of::<CtKey>(), 8),
        (MAP_NODE_ADDRS, MapType::Hash, size_of::<EndpointKey>(), 4),
    ]
}

#[repr(C, align(8))]
struct Aligned<T: ?Sized>(T);

// ELF parsing wants the object aligned; include_bytes! gives no guarantee.
static OBJECT: &Aligned<[u8]> =
    &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/datapath.bpf.o")));

/// The compiled object (ELF, BPF target), as embedded.
pub fn object() -> &'static [u8] {
    &OBJECT.0
}

/// A failure with the errno behind it, when there is one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    msg: String,
    errno: Option<i32>,
    /// Pins of another layout version (see [`Error::is_incompatible`]).
    incompatible: bool,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn msg(msg: impl Into<String>) -> Error {
        Error {
            msg: msg.into(),
            errno: None,
            incompatible: false,
        }
    }

    pub fn errno(op: impl fmt::Display, e: nix::errno::Errno) -> Error {
        Error {
            msg: format!("{op}: {}", e.desc()),
            errno: Some(e as i32),
            incompatible: false,
        }
    }

    pub fn io(op: impl fmt::Display, e: std::io::Error) -> Error {
        Error {
            msg: format!("{op}: {e}"),
            errno: e.raw_os_error(),
            incompatible: false,
        }
    }

    /// An aya error: the message of every layer, and the errno of the
    /// innermost I/O error (aya wraps syscalls' errors a few levels deep).
    fn aya(op: impl fmt::Display, e: impl std::error::Error + 'static) -> Error {
        let mut msg = format!("{op}: {e}");
        let mut errno = None;
        let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        while let Some(c) = cur {
            if let Some(io) = c.downcast_ref::<std::io::Error>() {
                errno = errno.or(io.raw_os_error());
            }
            if !std::ptr::eq(c, &e as &dyn std::error::Error) {
                let s = c.to_string();
                if !msg.contains(&s) {
                    msg.push_str(": ");
                    msg.push_str(&s);
                }
            }
            cur = c.source();
        }
        Error {
            msg,
            errno,
            incompatible: false,
        }
    }

    pub fn raw_errno(&self) -> Option<i32> {
        self.errno
    }

    pub fn is_not_found(&self) -> bool {
        self.errno == Some(libc::ENOENT)
    }

    /// The network's pins are of another layout version: nothing in them
    /// can be read or written by this build. A DEL has nothing it can undo
    /// there; the message says what the operator can do.
    pub fn is_incompatible(&self) -> bool {
        self.incompatible
    }

    /// The kernel refused for lack of privileges (CAP_BPF, CAP_NET_ADMIN,
    /// CAP_SYS_ADMIN for bpffs).
    pub fn is_permission(&self) -> bool {
        matches!(self.errno, Some(libc::EPERM) | Some(libc::EACCES))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Error {}

/// How a program is hooked to a veth's ingress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// A tcx link (kernel 6.6+), pinned per attachment.
    Tcx,
    /// A cls_bpf filter in direct-action mode on a clsact qdisc.
    Tc,
}

impl Hook {
    /// tcx where the kernel has it, else clsact.
    pub fn preferred() -> Hook {
        match KernelVersion::current() {
            Ok(v) if v >= KernelVersion::new(6, 6, 0) => Hook::Tcx,
            _ => Hook::Tc,
        }
    }

    /// A config's `attachMode`: `None` for auto (absent, empty or "auto");
    /// the error describes a bad value.
    pub fn from_config(mode: Option<&str>) -> Result<Option<Hook>, String> {
        match mode {
            None | Some("auto") | Some("") => Ok(None),
            Some("tcx") => Ok(Some(Hook::Tcx)),
            Some("tc") => Ok(Some(Hook::Tc)),
            Some(other) => Err(format!("{other:?} (auto, tcx or tc)")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Hook::Tcx => "tcx",
            Hook::Tc => "tc",
        }
    }
}

/// Who holds the programs: a fresh load keeps the whole object.
enum Prog {
    Object(Box<Ebpf>),
    /// By [`Program`] index.
    Pinned(Box<[SchedClassifier; 3]>),
}

/// One network's programs and maps.
pub struct Datapath {
    dir: Option<PathBuf>,
    prog: Prog,
    endpoints: HashMap<MapData, EndpointKey, Endpoint>,
    stats: PerCpuArray<MapData, EndpointStats>,
    verdicts: PerCpuArray<MapData, u64>,
    slots: Array<MapData, types::SlotBitmap>,
    cidrs: LpmTrie<MapData, CidrData, u32>,
    peers: HashMap<MapData, PeerKey, u32>,
    portsets: HashMap<MapData, u32, PortSet>,
    ct: HashMap<MapData, CtKey, u64>,
    node_addrs: HashMap<MapData, EndpointKey, u32>,
}

/// Why pins in `dir` cannot be used, and what to do about it.
fn incompatible(dir: &Path, what: impl fmt::Display) -> Error {
    let mut e = Error::msg(format!(
        "{}: pinned by another version of rcni ({what}): delete the network's pods, or remove \
         the directory (its pods keep the normal path, without fast path and policy, until \
         re-added), so that the next ADD loads this version",
        dir.display()
    ));
    e.incompatible = true;
    e
}

/// Opens the map pinned as `name` in `dir`, checked against what this
/// build's programs and types expect.
fn open_pinned_map(dir: &Path, name: &str) -> Result<Map> {
    let (_, kind, key, value) = map_specs()
        .into_iter()
        .find(|s| s.0 == name)
        .expect("a known map");
    let p = dir.join(name);
    let data = match MapData::from_pin(&p) {
        Ok(d) => d,
        Err(e) => {
            let e = Error::aya(format!("open {}", p.display()), e);
            return Err(if e.is_not_found() {
                incompatible(dir, format_args!("no map {name}"))
            } else {
                e
            });
        }
    };
    let info = data
        .info()
        .map_err(|e| Error::aya(format!("map {}", p.display()), e))?;
    let got_kind = info.map_type().ok();
    if got_kind != Some(kind)
        || info.key_size() as usize != key
        || info.value_size() as usize != value
    {
        return Err(incompatible(
            dir,
            format_args!(
                "map {name} is {got_kind:?} with {}-byte keys and {}-byte values, this build's \
                 is {kind:?} with {key} and {value}",
                info.key_size(),
                info.value_size()
            ),
        ));
    }
    Map::from_map_data(data).map_err(|e| Error::aya(format!("map {}", p.display()), e))
}

fn not_found_ok(r: Result<(), MapError>, op: &str) -> Result<()> {
    match r {
        Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
        Err(e) => {
            let e = Error::aya(op, e);
            if e.is_not_found() { Ok(()) } else { Err(e) }
        }
    }
}

/// Every entry of an iterable map; entries removed while it is walked are
/// skipped.
fn collect<K, V>(
    it: impl Iterator<Item = Result<(K, V), MapError>>,
    op: &str,
) -> Result<Vec<(K, V)>> {
    let mut v = Vec::new();
    for kv in it {
        match kv {
            Ok(kv) => v.push(kv),
            Err(MapError::KeyNotFound) => {}
            Err(e) => return Err(Error::aya(op, e)),
        }
    }
    Ok(v)
}

impl Datapath {
    /// Loads a private, unpinned copy: for tests and for STATUS's probe.
    pub fn load() -> Result<Datapath> {
        Self::load_object(None)
    }

    /// The datapath pinned in `dir`, if there is one. Reads only. Pins of
    /// another layout version are an error that says what to do.
    pub fn open(dir: &Path) -> Result<Option<Datapath>> {
        if !dir.join(PROG_PIN).exists() {
            return Ok(None);
        }
        // The maps first: their layout is what another version changes.
        let version: Array<MapData, u32> = typed(open_pinned_map(dir, MAP_VERSION)?, MAP_VERSION)?;
        check_version(dir, &version, false)?;
        let prog = |p: Program| {
            let pin = dir.join(p.pin());
            SchedClassifier::from_pin(&pin).map_err(|e| {
                let e = Error::aya(format!("open {}", pin.display()), e);
                if e.is_not_found() {
                    incompatible(dir, format_args!("no program {}", p.pin()))
                } else {
                    e
                }
            })
        };
        // By Program index.
        let progs = [
            prog(Program::Fastpath)?,
            prog(Program::PolicyIn)?,
            prog(Program::PolicyOut)?,
        ];
        Self::assemble(Some(dir), Prog::Pinned(Box::new(progs)), |name| {
            open_pinned_map(dir, name)
        })
        .map(Some)
    }

    /// A datapath of `prog` and the maps `map` gives by name.
    fn assemble(
        dir: Option<&Path>,
        prog: Prog,
        mut map: impl FnMut(&str) -> Result<Map>,
    ) -> Result<Datapath> {
        Ok(Datapath {
            dir: dir.map(Path::to_path_buf),
            prog,
            endpoints: typed(map(MAP_ENDPOINTS)?, MAP_ENDPOINTS)?,
            stats: typed(map(MAP_STATS)?, MAP_STATS)?,
            verdicts: typed(map(MAP_VERDICTS)?, MAP_VERDICTS)?,
            slots: typed(map(MAP_SLOTS)?, MAP_SLOTS)?,
            cidrs: typed(map(MAP_CIDR)?, MAP_CIDR)?,
            peers: typed(map(MAP_PEER)?, MAP_PEER)?,
            portsets: typed(map(MAP_PORTS)?, MAP_PORTS)?,
            ct: typed(map(MAP_CT)?, MAP_CT)?,
            node_addrs: typed(map(MAP_NODE_ADDRS)?, MAP_NODE_ADDRS)?,
        })
    }

    /// The datapath pinned in `dir` (which must be on a bpffs, see
    /// [`bpffs::ensure_root`]), loaded and pinned there first if needed.
    /// Concurrent first calls for one network load it once.
    pub fn open_or_load(dir: &Path) -> Result<Datapath> {
        if let Some(d) = Self::open(dir)? {
            return Ok(d);
        }
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        let _lock = bpffs::DirLock::acquire(dir)?;
        if let Some(d) = Self::open(dir)? {
            return Ok(d);
        }
        Self::load_object(Some(dir))
    }

    fn load_object(dir: Option<&Path>) -> Result<Datapath> {
        let mut loader = EbpfLoader::new();
        if let Some(dir) = dir {
            // Reuses maps already pinned there (a load that died before
            // pinning the programs), so endpoints survive it; aya would
            // take them whatever their layout, so check that first.
            for (name, ..) in map_specs() {
                if dir.join(name).exists() {
                    let m = open_pinned_map(dir, name)?;
                    if name == MAP_VERSION {
                        check_version(dir, &typed(m, name)?, true)?;
                    }
                }
                loader.map_pin_path(name, dir.join(name));
            }
        }
        let mut ebpf = loader
            .load(object())
            .map_err(|e| Error::aya("load the eBPF object", e))?;
        for p in Program::ALL {
            let prog: &mut SchedClassifier = ebpf
                .program_mut(p.name())
                .ok_or_else(|| Error::msg(format!("program {} missing from the object", p.name())))?
                .try_into()
                .map_err(|e| Error::aya(format!("program {}", p.name()), e))?;
            prog.load()
                .map_err(|e| Error::aya(format!("load program {}", p.name()), e))?;
        }
        // The maps out of the object first: the object itself goes into
        // the datapath.
        let mut maps = std::collections::BTreeMap::new();
        for (name, ..) in map_specs() {
            let m = ebpf
                .take_map(name)
                .ok_or_else(|| Error::msg(format!("map {name} missing from the object")))?;
            maps.insert(name, m);
        }
        let mut take = |name: &str| Ok(maps.remove(name).expect("one of map_specs"));
        let mut version: Array<MapData, u32> = typed(take(MAP_VERSION)?, MAP_VERSION)?;
        version
            .set(0, DATAPATH_VERSION, 0)
            .map_err(|e| Error::aya("write the layout version", e))?;
        let mut dp = Self::assemble(dir, Prog::Object(Box::new(ebpf)), take)?;
        if let Some(dir) = dir {
            // The fast path's program last: its pin says all is there.
            for p in [Program::PolicyIn, Program::PolicyOut, Program::Fastpath] {
                let pin = dir.join(p.pin());
                // Left by a load that died before pinning `prog`.
                remove_pin(&pin)?;
                dp.program_of(p)
                    .pin(&pin)
                    .map_err(|e| Error::aya(format!("pin {}", pin.display()), e))?;
            }
        }
        Ok(dp)
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The fast path program, for attaching and for `BPF_PROG_TEST_RUN`.
    pub fn program(&mut self) -> &mut SchedClassifier {
        self.program_of(Program::Fastpath)
    }

    /// One of the programs, for `BPF_PROG_TEST_RUN` and ids.
    pub fn program_of(&mut self, p: Program) -> &mut SchedClassifier {
        match &mut self.prog {
            Prog::Pinned(progs) => &mut progs[p as usize],
            Prog::Object(e) => e
                .program_mut(p.name())
                .expect("checked at load")
                .try_into()
                .expect("checked at load"),
        }
    }

    /// The kernel's id of the fast path program.
    pub fn program_id(&mut self) -> Result<u32> {
        self.program_id_of(Program::Fastpath)
    }

    pub fn program_id_of(&mut self, p: Program) -> Result<u32> {
        self.program_of(p)
            .info()
            .map(|i| i.id())
            .map_err(|e| Error::aya(format!("program {} info", p.name()), e))
    }

    // ---- endpoints ----

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
        let _lock = self.lock()?;
        let mut n = 0;
        for (key, ep) in self.endpoints()? {
            if ep.ifindex != ifindex || ep.flags & EP_FASTPATH == 0 {
                continue;
            }
            n += 1;
            if !ep.keeps_normal_path() {
                self.endpoints
                    .insert(key, ep.normal_path(true), 0)
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
        let ep = Endpoint::policy(ifindex, owner, identity, ingress_rs, egress_rs);
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

    // ---- policy rules ----
    //
    // Rule maps are written by the policy plugin alone (under its own
    // lock): no read-modify-write here. Write a rule set's entries before
    // an endpoint names it, and remove them after none does.

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

    // ---- attachments ----

    /// Hooks `p` to `ifname` (a name in the calling thread's network
    /// namespace). With `pin`, a tcx link is pinned there; without (tests)
    /// it lives as long as this value.
    fn attach_program(
        &mut self,
        p: Program,
        ifname: &str,
        attach_type: TcAttachType,
        pin: Option<PathBuf>,
        hook: Hook,
    ) -> Result<()> {
        let (order, priority) = match p {
            // Policy first: it must decide before the fast path redirects.
            Program::PolicyIn | Program::PolicyOut => (LinkOrder::first(), POLICY_TC_PRIORITY),
            // Appended last: a program that must run before the redirect
            // (the policy plugin's) attaches in front.
            Program::Fastpath => (LinkOrder::default(), FASTPATH_TC_PRIORITY),
        };
        let prog = self.program_of(p);
        match hook {
            Hook::Tcx => {
                if let Some(pin) = &pin {
                    // A link left pinned by an earlier attachment of this
                    // id (its veth gone): unpinning releases it.
                    remove_pin(pin)?;
                }
                let link = prog
                    .attach_with_options(ifname, attach_type, TcAttachOptions::TcxOrder(order))
                    .map_err(|e| Error::aya(format!("attach {} (tcx) to {ifname}", p.name()), e))?;
                if let Some(pin) = pin {
                    let link = prog
                        .take_link(link)
                        .map_err(|e| Error::aya("take link", e))?;
                    let fd: FdLink = link.try_into().map_err(|e| Error::aya("tcx link fd", e))?;
                    fd.pin(&pin)
                        .map_err(|e| Error::aya(format!("pin {}", pin.display()), e))?;
                }
                Ok(())
            }
            Hook::Tc => {
                match aya::programs::tc::qdisc_add_clsact(ifname) {
                    Ok(()) => {}
                    Err(e) => {
                        let e = Error::aya(format!("add clsact qdisc to {ifname}"), e);
                        if e.raw_errno() != Some(libc::EEXIST) {
                            return Err(e);
                        }
                    }
                }
                let opts = NlOptions {
                    priority,
                    ..Default::default()
                };
                let link = prog
                    .attach_with_options(ifname, attach_type, TcAttachOptions::Netlink(opts))
                    .map_err(|e| {
                        Error::aya(format!("attach {} (tc filter) to {ifname}", p.name()), e)
                    })?;
                if pin.is_some() {
                    // A cls_bpf filter stays on the qdisc by itself; the
                    // link object would remove it when dropped.
                    let link = prog
                        .take_link(link)
                        .map_err(|e| Error::aya("take link", e))?;
                    std::mem::forget(link);
                }
                Ok(())
            }
        }
    }

    /// Hooks the fast path to `ifname`'s ingress (a name in the calling
    /// thread's network namespace). With a pin directory a tcx link is
    /// pinned as the attachment's; without one (tests) it lives as long as
    /// this value. The caller checks first that it is not attached yet: the
    /// kernel refuses the same program twice on one tcx hook (EEXIST).
    pub fn attach(&mut self, ifname: &str, id: AttachmentId, hook: Hook) -> Result<()> {
        let pin = self.dir.as_ref().map(|d| d.join(id.link_pin()));
        self.attach_program(Program::Fastpath, ifname, TcAttachType::Ingress, pin, hook)
    }

    /// Hooks the policy programs to `ifname`: `rcni_pol_out` to its ingress
    /// in front of everything (the fast path included: tcx first, tc
    /// priority 10 against the fast path's 20), `rcni_pol_in` to its
    /// egress. Pinned links and checks as for [`Datapath::attach`]; if the
    /// second fails the first is taken off again.
    pub fn attach_policy(&mut self, ifname: &str, id: AttachmentId, hook: Hook) -> Result<()> {
        let [pin_in, pin_out] = match &self.dir {
            Some(d) => id.policy_link_pins().map(|n| Some(d.join(n))),
            None => [None, None],
        };
        self.attach_program(
            Program::PolicyOut,
            ifname,
            TcAttachType::Ingress,
            pin_out,
            hook,
        )?;
        let r = self.attach_program(
            Program::PolicyIn,
            ifname,
            TcAttachType::Egress,
            pin_in,
            hook,
        );
        if r.is_err() {
            let undo = match (hook, &self.dir) {
                (Hook::Tcx, Some(d)) => detach_policy_tcx(d, id).map(|_| ()),
                (Hook::Tc, _) => detach_policy_tc(ifname).map(|_| ()),
                // Unpinned: the link lives in this value.
                (Hook::Tcx, None) => Ok(()),
            };
            if let Err(u) = undo {
                eprintln!("rcni: undo policy attachment: {u}");
            }
        }
        r
    }

    /// Whether the fast path sits on `ifname`'s tcx ingress hook.
    pub fn tcx_attached(&mut self, ifname: &str) -> Result<bool> {
        let id = self.program_id()?;
        tcx_programs(ifname).map(|ids| ids.contains(&id))
    }

    /// Whether both policy programs are attached to `ifname` (a name in
    /// the calling thread's network namespace) for `id`: with tcx, both
    /// links pinned in `dir` and both programs on their hooks; with tc, this
    /// copy's programs (by id) in filters on both hooks.
    pub fn policy_attached(
        &mut self,
        dir: &Path,
        ifname: &str,
        id: AttachmentId,
        hook: Hook,
    ) -> Result<bool> {
        match hook {
            Hook::Tcx => {
                let pinned = id.policy_link_pins().iter().all(|p| dir.join(p).exists());
                Ok(pinned && self.policy_tcx_attached(ifname)?)
            }
            Hook::Tc => {
                let pin = self.program_id_of(Program::PolicyIn)?;
                let pout = self.program_id_of(Program::PolicyOut)?;
                let Some((ingress, egress)) = tc_filter_programs(ifname)? else {
                    return Ok(false);
                };
                Ok(ingress.contains(&pout) && egress.contains(&pin))
            }
        }
    }

    /// Whether both policy programs sit on `ifname`'s tcx hooks.
    pub fn policy_tcx_attached(&mut self, ifname: &str) -> Result<bool> {
        let out = self.program_id_of(Program::PolicyOut)?;
        let pin = self.program_id_of(Program::PolicyIn)?;
        Ok(tcx_programs(ifname)?.contains(&out) && tcx_egress_programs(ifname)?.contains(&pin))
    }
}

/// The network's datapath whose fast path program sits on `ifname`'s
/// ingress hook (a name in the calling thread's network namespace), for a
/// plugin that does not know the fast path's `pinRoot` (bandwidth): the pin
/// directory is found among `<bpffs mount>/rcni/<network>`,
/// `<bpffs mount>/<network>` and directories named `network` a few levels
/// below a bpffs mount, by the id of the program pinned there. `None` when
/// no fast path program is attached; an error when one is but its pins are
/// nowhere to be found (or of another version).
pub fn open_attached(ifname: &str, network: &str) -> Result<Option<Datapath>> {
    let mut ids = tcx_programs(ifname)?;
    if let Some((ingress, _)) = tc_filter_programs(ifname)? {
        ids.extend(ingress);
    }
    if ids.is_empty() {
        return Ok(None);
    }
    let fast: Vec<u32> = aya::programs::loaded_programs()
        .filter_map(|p| p.ok())
        .filter(|p| ids.contains(&p.id()) && p.name_as_str() == Some(PROGRAM))
        .map(|p| p.id())
        .collect();
    if fast.is_empty() {
        return Ok(None);
    }
    let dirs = bpffs::network_dirs(network)?;
    for dir in &dirs {
        if let Some(mut dp) = Datapath::open(dir)?
            && fast.contains(&dp.program_id()?)
        {
            return Ok(Some(dp));
        }
    }
    Err(Error::msg(format!(
        "the fast path program on {ifname} (id {fast:?}) is not pinned for network {network} \
         where it can be found (a bpffs mount's rcni/{network} or {network} directory, or one \
         named {network} at most {} levels below; looked in {dirs:?})",
        bpffs::SEARCH_DEPTH
    )))
}

/// Checks the layout version a pinned `rcni_version` holds; `unwritten_ok`
/// for maps left by a load that died before writing it.
fn check_version(dir: &Path, m: &Array<MapData, u32>, unwritten_ok: bool) -> Result<()> {
    let v = m
        .get(&0, 0)
        .map_err(|e| Error::aya("read the layout version", e))?;
    if v == DATAPATH_VERSION || (unwritten_ok && v == 0) {
        return Ok(());
    }
    Err(incompatible(
        dir,
        format_args!("layout version {v}, this build's is {DATAPATH_VERSION}"),
    ))
}

/// A CIDR key, or an error for a prefix too long for the address.
fn cidr_key(rs: u32, ip: IpAddr, len: u8) -> Result<LpmKey<CidrData>> {
    types::cidr_key(rs, ip, len)
        .ok_or_else(|| Error::msg(format!("{ip}/{len}: prefix longer than the address")))
}

/// The ids of the programs on `ifname`'s tcx ingress hook.
pub fn tcx_programs(ifname: &str) -> Result<Vec<u32>> {
    tcx_query(ifname, TcAttachType::Ingress)
}

/// The ids of the programs on `ifname`'s tcx egress hook.
pub fn tcx_egress_programs(ifname: &str) -> Result<Vec<u32>> {
    tcx_query(ifname, TcAttachType::Egress)
}

fn tcx_query(ifname: &str, at: TcAttachType) -> Result<Vec<u32>> {
    match SchedClassifier::query_tcx(ifname, at) {
        Ok((_, progs)) => Ok(progs.iter().map(|p| p.id()).collect()),
        Err(e) => {
            let e = Error::aya(format!("query tcx programs of {ifname}"), e);
            // No tcx entry on the device yet (or no tcx at all): nothing.
            if matches!(
                e.raw_errno(),
                Some(libc::ENOENT) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP)
            ) {
                Ok(vec![])
            } else {
                Err(e)
            }
        }
    }
}

/// The program ids in cls_bpf filters on `ifname`'s ingress and egress
/// hooks; `None` when there is no such link.
fn tc_filter_programs(ifname: &str) -> Result<Option<(Vec<u32>, Vec<u32>)>> {
    let nl_err = |e: rcni_netlink::Error| Error {
        msg: e.to_string(),
        errno: e.errno(),
        incompatible: false,
    };
    let rt = rcni_netlink::runtime().map_err(nl_err)?;
    rt.block_on(async {
        let nl = rcni_netlink::Netlink::connect_current().await?;
        let link = match nl.link_by_name(ifname).await {
            Ok(l) => l,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(e),
        };
        let ids =
            |fs: Vec<rcni_netlink::tc::BpfFilter>| fs.iter().filter_map(|f| f.prog_id).collect();
        let ingress = ids(nl.ingress_bpf_filters(link.index).await?);
        let egress = ids(nl.egress_bpf_filters(link.index).await?);
        Ok(Some((ingress, egress)))
    })
    .map_err(nl_err)
}

/// Detaches and unpins the tcx link pinned at `pin`; gone already is fine.
/// BPF_LINK_DETACH takes it off the hook now, not when the kernel gets
/// round to freeing the unpinned link.
fn detach_pinned_link(pin: &Path) -> Result<bool> {
    match obj_get(pin) {
        Ok(fd) => link_detach(&fd)?,
        Err(e) if e.is_not_found() => return Ok(false),
        // Unreadable: still remove the pin, which releases the link.
        Err(_) => {}
    }
    remove_pin(pin)?;
    Ok(true)
}

/// Detaches and unpins the fast path's tcx link pinned for `id` in `dir`;
/// gone already is fine.
pub fn detach_tcx(dir: &Path, id: AttachmentId) -> Result<bool> {
    detach_pinned_link(&dir.join(id.link_pin()))
}

/// Detaches and unpins both policy links pinned for `id` in `dir`; gone
/// already is fine. True if there was any.
pub fn detach_policy_tcx(dir: &Path, id: AttachmentId) -> Result<bool> {
    let [a, b] = id.policy_link_pins();
    let a = detach_pinned_link(&dir.join(a))?;
    let b = detach_pinned_link(&dir.join(b))?;
    Ok(a || b)
}

/// Takes the policy programs off `ifname` for `id`, whichever way they were
/// attached: the links pinned in `dir`, the filters on the device. Gone
/// already (links, filters, the device) is fine.
pub fn detach_policy(dir: &Path, id: AttachmentId, ifname: &str) -> Result<()> {
    detach_policy_tcx(dir, id)?;
    detach_policy_tc(ifname)?;
    Ok(())
}

/// Detaches the policy links pinned in `dir` of every attachment `keep`
/// does not keep (GC); returns how many attachments lost theirs.
pub fn detach_policy_links_except(
    dir: &Path,
    keep: impl Fn(AttachmentId) -> bool,
) -> Result<usize> {
    let mut n = 0;
    for id in pinned_policy_links(dir)? {
        if !keep(id) && detach_policy_tcx(dir, id)? {
            n += 1;
        }
    }
    Ok(n)
}

/// Removes the cls_bpf filters named `name` from `ifname`'s hook; none
/// there is fine. Over rcni-netlink, not aya: aya's walk of the hook fails
/// on filters of other kinds (bandwidth's u32 redirect on the same hook).
fn detach_tc_named(ifname: &str, at: TcAttachType, name: &str) -> Result<bool> {
    let nl_err = |e: rcni_netlink::Error| Error {
        msg: format!("detach tc filter {name} from {ifname}: {e}"),
        errno: e.errno(),
        incompatible: false,
    };
    let rt = rcni_netlink::runtime().map_err(nl_err)?;
    rt.block_on(async {
        let nl = rcni_netlink::Netlink::connect_current().await?;
        let link = match nl.link_by_name(ifname).await {
            Ok(l) => l,
            Err(e) if e.is_not_found() => return Ok(false),
            Err(e) => return Err(e),
        };
        let egress = matches!(at, TcAttachType::Egress);
        Ok(nl.del_bpf_filters(link.index, egress, name).await? > 0)
    })
    .map_err(nl_err)
}

/// Removes the cls_bpf filters running the fast path from `ifname`'s
/// ingress; none there is fine.
pub fn detach_tc(ifname: &str) -> Result<bool> {
    detach_tc_named(ifname, TcAttachType::Ingress, PROGRAM)
}

/// Removes the policy programs' cls_bpf filters from `ifname` (ingress and
/// egress); none there is fine. True if there was any.
pub fn detach_policy_tc(ifname: &str) -> Result<bool> {
    let out = detach_tc_named(ifname, TcAttachType::Ingress, POLICY_OUT_PROGRAM)?;
    let r#in = detach_tc_named(ifname, TcAttachType::Egress, POLICY_IN_PROGRAM)?;
    Ok(out || r#in)
}

/// bpf(BPF_OBJ_GET): an fd for a pinned object.
fn obj_get(path: &Path) -> Result<OwnedFd> {
    use std::os::unix::ffi::OsStrExt;
    #[repr(C)]
    struct ObjGetAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    const BPF_OBJ_GET: libc::c_long = 7;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::msg(format!("{}: NUL in path", path.display())))?;
    let attr = ObjGetAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    // SAFETY: bpf(2) reads the attr struct and the NUL-terminated path,
    // both alive for the call; a non-negative result is a new fd we own.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET,
            &attr as *const ObjGetAttr,
            std::mem::size_of::<ObjGetAttr>(),
        )
    };
    if r < 0 {
        return Err(Error::io(
            format!("open {}", path.display()),
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: the kernel just returned this fd to us.
    Ok(unsafe { OwnedFd::from_raw_fd(r as i32) })
}

/// bpf(BPF_LINK_DETACH) on a link fd.
fn link_detach(fd: &OwnedFd) -> Result<()> {
    #[repr(C)]
    struct LinkDetachAttr {
        link_fd: u32,
    }
    const BPF_LINK_DETACH: libc::c_long = 34;
    let attr = LinkDetachAttr {
        link_fd: fd.as_raw_fd() as u32,
    };
    // SAFETY: bpf(2) reads the attr struct, alive for the call; the fd is
    // borrowed from `fd`.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_DETACH,
            &attr as *const LinkDetachAttr,
            std::mem::size_of::<LinkDetachAttr>(),
        )
    };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        // ENOLINK: defunct already (its device is gone).
        if e.raw_os_error() != Some(libc::ENOLINK) {
            return Err(Error::io("detach tcx link", e));
        }
    }
    Ok(())
}

fn remove_pin(p: &Path) -> Result<()> {
    match std::fs::remove_file(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(format!("remove {}", p.display()), e)),
    }
}

/// The attachment ids `of_pin` reads from the names of the pins in `dir`,
/// sorted; none when there is no such directory.
fn pinned_ids(dir: &Path, of_pin: fn(&str) -> Option<AttachmentId>) -> Result<Vec<AttachmentId>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(Error::io(format!("read {}", dir.display()), e)),
    };
    let mut v: Vec<AttachmentId> = rd
        .flatten()
        .filter_map(|e| of_pin(&e.file_name().to_string_lossy()))
        .collect();
    v.sort();
    Ok(v)
}

/// The attachment ids of the fast path's links pinned in `dir`.
pub fn pinned_links(dir: &Path) -> Result<Vec<AttachmentId>> {
    pinned_ids(dir, AttachmentId::from_link_pin)
}

/// The attachment ids with policy links pinned in `dir`.
pub fn pinned_policy_links(dir: &Path) -> Result<Vec<AttachmentId>> {
    // Two pins per attachment.
    let mut v = pinned_ids(dir, AttachmentId::from_policy_link_pin)?;
    v.dedup();
    Ok(v)
}

/// Removes a network's pin directory with everything in it (program, maps,
/// links). Programs still attached through a cls_bpf filter stay loaded
/// until that filter goes.
pub fn remove_network(dir: &Path) -> Result<()> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(format!("read {}", dir.display()), e)),
    };
    for e in rd.flatten() {
        remove_pin(&e.path())?;
    }
    match std::fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(format!("remove {}", dir.display()), e)),
    }
}

fn typed<T>(m: Map, name: &str) -> Result<T>
where
    T: TryFrom<Map, Error = aya::maps::MapError>,
{
    T::try_from(m).map_err(|e| Error::aya(format!("map {name}"), e))
}
