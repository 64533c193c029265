//! rcni's eBPF datapath: the fast path's tc program (`c/fastpath.bpf.c`,
//! compiled by clang in `build.rs` and embedded here) and its loader.
//!
//! One copy of the program and its maps serves a whole network: the first
//! ADD loads it and pins program and maps under the network's pin directory
//! (`/sys/fs/bpf/rcni/<network>/`); every later call opens the pins, so a
//! pod's ADD is an attach and a few map updates. Each pod's attachment is a
//! tcx link pinned as `link-<attachment id>` (the plugin process exits after
//! every call, and an unpinned tcx link dies with its last fd), or on kernels
//! without tcx a cls_bpf filter on a clsact qdisc, which lives on its own.

pub mod bpffs;
mod types;

pub use types::{
    AttachmentId, Endpoint, EndpointKey, EndpointStats, MAX_ENDPOINTS, TC_ACT_REDIRECT,
    TC_ACT_UNSPEC, Verdict, fmt_mac,
};

use aya::maps::{Array, HashMap, Map, MapData, PerCpuArray, PerCpuValues};
use aya::programs::links::FdLink;
use aya::programs::tc::{NlOptions, TcAttachOptions};
use aya::programs::{LinkOrder, SchedClassifier, TcAttachType};
use aya::util::KernelVersion;
use aya::{Ebpf, EbpfLoader};
use std::fmt;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// The program's name in the object (and in the kernel: under 16 bytes).
pub const PROGRAM: &str = "rcni_fastpath";
const MAP_ENDPOINTS: &str = "rcni_endpoints";
const MAP_STATS: &str = "rcni_ep_stats";
const MAP_VERDICTS: &str = "rcni_verdicts";
const MAP_SLOTS: &str = "rcni_slots";
const MAPS: [&str; 4] = [MAP_ENDPOINTS, MAP_STATS, MAP_VERDICTS, MAP_SLOTS];
/// The program's pin; pinned last, so its presence means the maps are too.
const PROG_PIN: &str = "prog";

#[repr(C, align(8))]
struct Aligned<T: ?Sized>(T);

// ELF parsing wants the object aligned; include_bytes! gives no guarantee.
static OBJECT: &Aligned<[u8]> =
    &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/fastpath.bpf.o")));

/// The compiled object (ELF, BPF target), as embedded.
pub fn object() -> &'static [u8] {
    &OBJECT.0
}

/// A failure with the errno behind it, when there is one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    msg: String,
    errno: Option<i32>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn msg(msg: impl Into<String>) -> Error {
        Error {
            msg: msg.into(),
            errno: None,
        }
    }

    pub fn errno(op: impl fmt::Display, e: nix::errno::Errno) -> Error {
        Error {
            msg: format!("{op}: {}", e.desc()),
            errno: Some(e as i32),
        }
    }

    pub fn io(op: impl fmt::Display, e: std::io::Error) -> Error {
        Error {
            msg: format!("{op}: {e}"),
            errno: e.raw_os_error(),
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
        Error { msg, errno }
    }

    pub fn raw_errno(&self) -> Option<i32> {
        self.errno
    }

    pub fn is_not_found(&self) -> bool {
        self.errno == Some(libc::ENOENT)
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

    pub fn name(self) -> &'static str {
        match self {
            Hook::Tcx => "tcx",
            Hook::Tc => "tc",
        }
    }
}

/// Who holds the program: a fresh load keeps the whole object.
enum Prog {
    Object(Box<Ebpf>),
    Pinned(Box<SchedClassifier>),
}

/// One network's program and maps.
pub struct Datapath {
    dir: Option<PathBuf>,
    prog: Prog,
    endpoints: HashMap<MapData, EndpointKey, Endpoint>,
    stats: PerCpuArray<MapData, EndpointStats>,
    verdicts: PerCpuArray<MapData, u64>,
    slots: Array<MapData, types::SlotBitmap>,
}

impl Datapath {
    /// Loads a private, unpinned copy: for tests and for STATUS's probe.
    pub fn load() -> Result<Datapath> {
        Self::load_object(None)
    }

    /// The datapath pinned in `dir`, if there is one. Reads only.
    pub fn open(dir: &Path) -> Result<Option<Datapath>> {
        let prog_pin = dir.join(PROG_PIN);
        if !prog_pin.exists() {
            return Ok(None);
        }
        let prog = SchedClassifier::from_pin(&prog_pin)
            .map_err(|e| Error::aya(format!("open {}", prog_pin.display()), e))?;
        let map = |name: &str| -> Result<Map> {
            let p = dir.join(name);
            let data = MapData::from_pin(&p)
                .map_err(|e| Error::aya(format!("open {}", p.display()), e))?;
            Map::from_map_data(data).map_err(|e| Error::aya(format!("map {}", p.display()), e))
        };
        Ok(Some(Datapath {
            dir: Some(dir.to_path_buf()),
            prog: Prog::Pinned(Box::new(prog)),
            endpoints: typed(map(MAP_ENDPOINTS)?, MAP_ENDPOINTS)?,
            stats: typed(map(MAP_STATS)?, MAP_STATS)?,
            verdicts: typed(map(MAP_VERDICTS)?, MAP_VERDICTS)?,
            slots: typed(map(MAP_SLOTS)?, MAP_SLOTS)?,
        }))
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
            // pinning the program), so endpoints survive it.
            for m in MAPS {
                loader.map_pin_path(m, dir.join(m));
            }
        }
        let mut ebpf = loader
            .load(object())
            .map_err(|e| Error::aya("load the eBPF object", e))?;
        let prog: &mut SchedClassifier = ebpf
            .program_mut(PROGRAM)
            .ok_or_else(|| Error::msg(format!("program {PROGRAM} missing from the object")))?
            .try_into()
            .map_err(|e| Error::aya(format!("program {PROGRAM}"), e))?;
        prog.load()
            .map_err(|e| Error::aya(format!("load program {PROGRAM}"), e))?;
        if let Some(dir) = dir {
            let p = dir.join(PROG_PIN);
            prog.pin(&p)
                .map_err(|e| Error::aya(format!("pin {}", p.display()), e))?;
        }
        let mut take = |name: &str| {
            ebpf.take_map(name)
                .ok_or_else(|| Error::msg(format!("map {name} missing from the object")))
        };
        let endpoints = typed(take(MAP_ENDPOINTS)?, MAP_ENDPOINTS)?;
        let stats = typed(take(MAP_STATS)?, MAP_STATS)?;
        let verdicts = typed(take(MAP_VERDICTS)?, MAP_VERDICTS)?;
        let slots = typed(take(MAP_SLOTS)?, MAP_SLOTS)?;
        Ok(Datapath {
            dir: dir.map(Path::to_path_buf),
            prog: Prog::Object(Box::new(ebpf)),
            endpoints,
            stats,
            verdicts,
            slots,
        })
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The program, for attaching and for `BPF_PROG_TEST_RUN`.
    pub fn program(&mut self) -> &mut SchedClassifier {
        match &mut self.prog {
            Prog::Pinned(p) => p,
            Prog::Object(e) => e
                .program_mut(PROGRAM)
                .expect("checked at load")
                .try_into()
                .expect("checked at load"),
        }
    }

    /// The kernel's id of the program.
    pub fn program_id(&mut self) -> Result<u32> {
        self.program()
            .info()
            .map(|i| i.id())
            .map_err(|e| Error::aya("program info", e))
    }

    // ---- endpoints ----

    /// Serializes slot allocation between plugin processes (pinned maps
    /// are shared); an unpinned datapath has no other users.
    fn lock(&self) -> Result<Option<bpffs::DirLock>> {
        self.dir.as_deref().map(bpffs::DirLock::acquire).transpose()
    }

    fn slot_bits(&self) -> Result<types::SlotBitmap> {
        self.slots
            .get(&0, 0)
            .map_err(|e| Error::aya("read counter slots", e))
    }

    /// Adds or replaces endpoints; each gets zeroed counters in a slot of
    /// its own (a replaced one keeps its slot).
    pub fn insert_endpoints(&mut self, eps: &[(EndpointKey, Endpoint)]) -> Result<()> {
        let _lock = self.lock()?;
        let mut bits = self.slot_bits()?;
        let ncpus = aya::util::nr_cpus().map_err(|(_, e)| Error::io("count possible CPUs", e))?;
        for (key, ep) in eps {
            let slot = match self.endpoint(key)? {
                Some(old) => old.slot,
                None => types::take_slot(&mut bits).ok_or_else(|| {
                    Error::msg(format!(
                        "the network has {MAX_ENDPOINTS} endpoints on this node, the most it can"
                    ))
                })?,
            };
            // The bitmap first: a slot in use is never handed out twice,
            // even if what follows fails.
            self.slots
                .set(0, bits, 0)
                .map_err(|e| Error::aya("write counter slots", e))?;
            // Counters before the endpoint: once the endpoint is visible its
            // counters start from zero.
            let zero = PerCpuValues::try_from(vec![EndpointStats::default(); ncpus])
                .map_err(|e| Error::io("per-CPU values", e))?;
            self.stats
                .set(slot, zero, 0)
                .map_err(|e| Error::aya("reset endpoint counters", e))?;
            let ep = Endpoint {
                slot,
                reserved: 0,
                ..*ep
            };
            self.endpoints
                .insert(key, ep, 0)
                .map_err(|e| Error::aya("insert endpoint", e))?;
        }
        Ok(())
    }

    pub fn insert_endpoint(&mut self, key: EndpointKey, ep: Endpoint) -> Result<()> {
        self.insert_endpoints(&[(key, ep)])
    }

    /// Removes endpoints and frees their counter slots; missing ones are
    /// no error.
    pub fn remove_endpoints(&mut self, keys: &[EndpointKey]) -> Result<()> {
        let _lock = self.lock()?;
        let mut bits = self.slot_bits()?;
        for key in keys {
            let Some(ep) = self.endpoint(key)? else {
                continue;
            };
            if let Err(e) = self.endpoints.remove(key) {
                let e = Error::aya("remove endpoint", e);
                if !e.is_not_found() {
                    return Err(e);
                }
            }
            types::free_slot(&mut bits, ep.slot);
        }
        self.slots
            .set(0, bits, 0)
            .map_err(|e| Error::aya("write counter slots", e))
    }

    pub fn remove_endpoint(&mut self, key: &EndpointKey) -> Result<()> {
        self.remove_endpoints(std::slice::from_ref(key))
    }

    pub fn endpoint(&self, key: &EndpointKey) -> Result<Option<Endpoint>> {
        match self.endpoints.get(key, 0) {
            Ok(v) => Ok(Some(v)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(Error::aya("look up endpoint", e)),
        }
    }

    /// Every endpoint, sorted by address.
    pub fn endpoints(&self) -> Result<Vec<(EndpointKey, Endpoint)>> {
        let mut v = Vec::new();
        for kv in self.endpoints.iter() {
            match kv {
                Ok(kv) => v.push(kv),
                // Removed while we walked the map.
                Err(aya::maps::MapError::KeyNotFound) => {}
                Err(e) => return Err(Error::aya("list endpoints", e)),
            }
        }
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

    // ---- attachments ----

    /// Hooks the program to `ifname`'s ingress (a name in the calling
    /// thread's network namespace). With a pin directory a tcx link is
    /// pinned as the attachment's; without one (tests) it lives as long as
    /// this value. The caller checks first that it is not attached yet: the
    /// kernel refuses the same program twice on one tcx hook (EEXIST).
    pub fn attach(&mut self, ifname: &str, id: AttachmentId, hook: Hook) -> Result<()> {
        let pin = self.dir.as_ref().map(|d| d.join(id.link_pin()));
        let prog = self.program();
        match hook {
            Hook::Tcx => {
                if let Some(pin) = &pin {
                    // A link left pinned by an earlier attachment of this
                    // id (its veth gone): unpinning releases it.
                    remove_pin(pin)?;
                }
                // Appended last: a program that must run before the
                // redirect (the policy plugin's) attaches in front.
                let link = prog
                    .attach_with_options(
                        ifname,
                        TcAttachType::Ingress,
                        TcAttachOptions::TcxOrder(LinkOrder::default()),
                    )
                    .map_err(|e| Error::aya(format!("attach tcx to {ifname}"), e))?;
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
                let link = prog
                    .attach_with_options(
                        ifname,
                        TcAttachType::Ingress,
                        TcAttachOptions::Netlink(NlOptions::default()),
                    )
                    .map_err(|e| Error::aya(format!("attach tc filter to {ifname}"), e))?;
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

    /// Whether this program sits on `ifname`'s tcx ingress hook.
    pub fn tcx_attached(&mut self, ifname: &str) -> Result<bool> {
        let id = self.program_id()?;
        tcx_programs(ifname).map(|ids| ids.contains(&id))
    }
}

/// The ids of the programs on `ifname`'s tcx ingress hook.
pub fn tcx_programs(ifname: &str) -> Result<Vec<u32>> {
    match SchedClassifier::query_tcx(ifname, TcAttachType::Ingress) {
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

/// Detaches and unpins the tcx link pinned for `id` in `dir`; gone already
/// is fine. BPF_LINK_DETACH takes it off the hook now, not when the kernel
/// gets round to freeing the unpinned link.
pub fn detach_tcx(dir: &Path, id: AttachmentId) -> Result<bool> {
    let pin = dir.join(id.link_pin());
    match obj_get(&pin) {
        Ok(fd) => link_detach(&fd)?,
        Err(e) if e.is_not_found() => return Ok(false),
        // Unreadable: still remove the pin, which releases the link.
        Err(_) => {}
    }
    remove_pin(&pin)?;
    Ok(true)
}

/// Removes the cls_bpf filters running this program from `ifname`'s ingress;
/// none there is fine.
pub fn detach_tc(ifname: &str) -> Result<bool> {
    match aya::programs::tc::qdisc_detach_program(ifname, TcAttachType::Ingress, PROGRAM) {
        Ok(()) => Ok(true),
        Err(e) => {
            let e = Error::aya(format!("detach tc filter from {ifname}"), e);
            match e.raw_errno() {
                Some(libc::ENOENT) | Some(libc::ENODEV) | Some(libc::EINVAL) => Ok(false),
                _ if e.msg.contains(PROGRAM) && e.raw_errno().is_none() => Ok(false),
                _ => Err(e),
            }
        }
    }
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

/// The attachment ids of the links pinned in `dir`.
pub fn pinned_links(dir: &Path) -> Result<Vec<AttachmentId>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(Error::io(format!("read {}", dir.display()), e)),
    };
    let mut v: Vec<AttachmentId> = rd
        .flatten()
        .filter_map(|e| AttachmentId::from_link_pin(&e.file_name().to_string_lossy()))
        .collect();
    v.sort();
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
