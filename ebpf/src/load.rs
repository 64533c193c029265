//! Loading the object, or opening what an earlier call pinned, and the
//! pinned maps' layout checks.

use crate::bpffs::{self, remove_pin};
use crate::types::{self, CidrData, PortSet, RemoteData};
use crate::{CtKey, Endpoint, EndpointKey, EndpointStats, PeerKey, PolicyConfig, RemoteHop};
use crate::{DATAPATH_VERSION, Error, PROG_PIN, Program, Result, object};
use aya::maps::lpm_trie::{Key as LpmKey, LpmTrie};
use aya::maps::{Array, HashMap, Map, MapData, MapError, MapType, PerCpuArray};
use aya::programs::SchedClassifier;
use aya::{Ebpf, EbpfLoader};
use std::path::{Path, PathBuf};

// The maps' names in the object, and their pins' in the network's directory.
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
const MAP_REMOTE: &str = "rcni_remote";
const MAP_NAT_SOCKS: &str = "rcni_nat_socks";
const MAP_POL_EVENTS: &str = "rcni_pol_events";
const MAP_REMOTE_STATS: &str = "rcni_remote_stats";
const MAP_POL_CFG: &str = "rcni_pol_cfg";
const MAP_POL_RL: &str = "rcni_pol_rl";
const MAP_POL_SEEN: &str = "rcni_pol_seen";
const MAP_POD_PORTS: &str = "rcni_ports";
const MAP_POD_PORTS_DIRECT: &str = "rcni_ports_direct";
const MAP_POLICE: &str = "rcni_police";

/// What each map must look like: (name, type, key size, value size).
fn map_specs() -> [(&'static str, MapType, usize, usize); 20] {
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
        (
            MAP_REMOTE,
            MapType::LpmTrie,
            size_of::<LpmKey<RemoteData>>(),
            size_of::<RemoteHop>(),
        ),
        (MAP_NAT_SOCKS, MapType::LruHash, types::NAT_SOCK_SIZE, 8),
        // A ring buffer has neither keys nor values.
        (MAP_POL_EVENTS, MapType::RingBuf, 0, 0),
        (MAP_POL_CFG, MapType::Array, 4, size_of::<PolicyConfig>()),
        (MAP_POL_RL, MapType::LruHash, size_of::<EndpointKey>(), 16),
        (MAP_POL_SEEN, MapType::LruHash, size_of::<CtKey>(), 8),
        (
            MAP_REMOTE_STATS,
            MapType::PerCpuArray,
            4,
            size_of::<types::RemoteStats>(),
        ),
        (MAP_POD_PORTS, MapType::Hash, 4, 4),
        (MAP_POD_PORTS_DIRECT, MapType::Array, 4, 4),
        (MAP_POLICE, MapType::Hash, 4, size_of::<types::Police>()),
    ]
}

/// Who holds the programs: a fresh load keeps the whole object.
enum Prog {
    Object(Box<Ebpf>),
    /// By [`Program`] index.
    Pinned(Box<[SchedClassifier; 5]>),
}

/// One network's programs and maps.
pub struct Datapath {
    pub(crate) dir: Option<PathBuf>,
    prog: Prog,
    pub(crate) endpoints: HashMap<MapData, EndpointKey, Endpoint>,
    pub(crate) stats: PerCpuArray<MapData, EndpointStats>,
    pub(crate) verdicts: PerCpuArray<MapData, u64>,
    pub(crate) slots: Array<MapData, types::SlotBitmap>,
    pub(crate) cidrs: LpmTrie<MapData, CidrData, u32>,
    pub(crate) peers: HashMap<MapData, PeerKey, u32>,
    pub(crate) portsets: HashMap<MapData, u32, PortSet>,
    pub(crate) ct: HashMap<MapData, CtKey, u64>,
    pub(crate) node_addrs: HashMap<MapData, EndpointKey, u32>,
    pub(crate) remote: LpmTrie<MapData, RemoteData, RemoteHop>,
    pub(crate) remote_stats: PerCpuArray<MapData, types::RemoteStats>,
    pub(crate) pol_cfg: Array<MapData, PolicyConfig>,
    /// `rcni_pod`'s ports: ifindex to PORT_* parts, indexes below
    /// [`PORTS_DIRECT`](crate::PORTS_DIRECT) in `ports_direct`.
    pub(crate) ports: HashMap<MapData, u32, u32>,
    pub(crate) ports_direct: Array<MapData, u32>,
    /// bandwidth's egress policers, by port ifindex (`PORT_POLICE`).
    pub(crate) police: HashMap<MapData, u32, types::Police>,
    /// The flow events' ring, until [`Datapath::take_flow_events`].
    pub(crate) pol_events: Option<Map>,
    _nat_socks: Map,
    _pol_rl: Map,
    _pol_seen: Map,
    /// Unpinned netkit links (tests): attached while this value lives.
    pub(crate) held: Vec<std::os::fd::OwnedFd>,
    /// Other unpinned tcx links (tests): attached while this value lives.
    pub(crate) held_links: Vec<aya::programs::links::FdLink>,
    /// Unpinned `rcni_pod` tcx links (tests), by device index.
    pub(crate) held_ports: std::collections::BTreeMap<u32, aya::programs::links::FdLink>,
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
                Error::incompatible(dir, format_args!("no map {name}"))
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
        return Err(Error::incompatible(
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

/// A removal: the entry gone already is no error.
pub(crate) fn not_found_ok(r: Result<(), MapError>, op: &str) -> Result<()> {
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
pub(crate) fn collect<K, V>(
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
                    Error::incompatible(dir, format_args!("no program {}", p.pin()))
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
            prog(Program::FromNet)?,
            prog(Program::Pod)?,
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
            remote: typed(map(MAP_REMOTE)?, MAP_REMOTE)?,
            remote_stats: typed(map(MAP_REMOTE_STATS)?, MAP_REMOTE_STATS)?,
            pol_cfg: typed(map(MAP_POL_CFG)?, MAP_POL_CFG)?,
            ports: typed(map(MAP_POD_PORTS)?, MAP_POD_PORTS)?,
            ports_direct: typed(map(MAP_POD_PORTS_DIRECT)?, MAP_POD_PORTS_DIRECT)?,
            police: typed(map(MAP_POLICE)?, MAP_POLICE)?,
            pol_events: Some(map(MAP_POL_EVENTS)?),
            // Only the programs use these; opening checks their layout.
            _nat_socks: map(MAP_NAT_SOCKS)?,
            _pol_rl: map(MAP_POL_RL)?,
            _pol_seen: map(MAP_POL_SEEN)?,
            held: Vec::new(),
            held_links: Vec::new(),
            held_ports: Default::default(),
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
            for p in [
                Program::PolicyIn,
                Program::PolicyOut,
                Program::FromNet,
                Program::Pod,
                Program::Fastpath,
            ] {
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
    Err(Error::incompatible(
        dir,
        format_args!("layout version {v}, this build's is {DATAPATH_VERSION}"),
    ))
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

/// The keys of every map entry of the datapaths pinned in the directories
/// under `pins` (one per network), as "<network> <map> <key>" lines: what
/// leak checks compare before and after. Runs in the caller's namespace.
pub fn entry_keys_under(pins: &Path) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let rd = match std::fs::read_dir(pins) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(Error::io(format!("read {}", pins.display()), e)),
    };
    for e in rd.flatten() {
        let dir = e.path();
        if !dir.is_dir() {
            continue;
        }
        let Some(dp) = Datapath::open(&dir)? else {
            continue;
        };
        let net = e.file_name().to_string_lossy().into_owned();
        let mut add = |map: &str, key: String| out.push(format!("{net} {map} {key}"));
        for (k, _) in dp.endpoints()? {
            add("endpoint", format!("{k:?}"));
        }
        for c in dp.cidrs(None)? {
            add("cidr", format!("{c:?}"));
        }
        for (k, _) in dp.peers()? {
            add("peer", format!("{k:?}"));
        }
        for (k, _) in dp.portsets()? {
            add("portset", k.to_string());
        }
        for (k, _) in dp.ct_entries()? {
            add("ct", format!("{k:?}"));
        }
    }
    Ok(out)
}
