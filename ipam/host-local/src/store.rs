//! Reservations, stored exactly as the reference's `backend/disk` stores
//! them, so that either implementation can take over a node's state:
//!
//! ```text
//! <dataDir>/<network>/lock                 flock(2)ed around every operation
//! <dataDir>/<network>/<ip>                 "<containerID>\r\n<ifname>" (older: "<containerID>")
//! <dataDir>/<network>/last_reserved_ip.<n> the last address reserved in range set n
//! ```
//!
//! Every file appears only complete (see `rcni_statefile`): a reservation is
//! written under a temporary name and published with
//! renameat2(RENAME_NOREPLACE), so an ADD killed at any moment leaves either
//! no reservation or one naming its owner, which DEL and GC can free. The
//! reference creates the file first and writes the owner after, so a kill
//! in between (ours before this layout, or the reference's) leaves an empty
//! file; such files are freed once [`ABANDONED_AFTER`] has passed.

use crate::range::parse_ip;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, OpenOptions};
use std::io;
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, SystemTime};

pub const LOCK_FILE: &str = "lock";
pub const LAST_RESERVED_PREFIX: &str = "last_reserved_ip.";
/// Between container ID and ifname in a reservation file (`disk.LineBreak`).
pub const LINE_BREAK: &str = "\r\n";
/// How old an empty or unreadable reservation file must be before ADD and GC
/// take it as free. Every writer (ours and the reference's) fills the file
/// under the lock we hold while looking, so an empty one is a killed
/// writer's; the wait only keeps a file whose writer somehow still runs
/// (a data directory shared without working flock) from being taken.
pub const ABANDONED_AFTER: Duration = Duration::from_secs(60);

/// One attachment: what a reservation belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Attachment {
    pub container_id: String,
    pub ifname: String,
}

impl Attachment {
    pub fn new(container_id: &str, ifname: &str) -> Attachment {
        Attachment {
            // The reference trims the ID when writing and when matching.
            container_id: container_id.trim().to_string(),
            ifname: ifname.to_string(),
        }
    }

    /// The file content the reference writes.
    pub fn content(&self) -> String {
        format!("{}{LINE_BREAK}{}", self.container_id, self.ifname)
    }
}

/// Who a reservation file names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    Attachment(Attachment),
    /// Files written before ifnames were recorded hold only the container ID;
    /// the reference still matches them by ID.
    Legacy(String),
    /// Anything else: never matched, never garbage-collected.
    Unknown(String),
    /// An empty or unreadable file older than [`ABANDONED_AFTER`]: a writer
    /// killed between creating and filling it. Matched by nobody, free for
    /// ADD, removed by GC.
    Abandoned,
}

impl Owner {
    /// Reads a file's content the way the reference compares it: trimmed,
    /// then `<id>\r\n<ifname>` or `<id>`.
    pub fn parse(content: &str) -> Owner {
        let t = content.trim();
        let clean = |s: &str| !s.is_empty() && !s.contains(['\r', '\n']);
        match t.split_once(LINE_BREAK) {
            Some((id, ifname)) if clean(id) && clean(ifname) => {
                Owner::Attachment(Attachment::new(id, ifname))
            }
            None if clean(t) => Owner::Legacy(t.to_string()),
            _ => Owner::Unknown(t.to_string()),
        }
    }

    pub fn container_id(&self) -> Option<&str> {
        match self {
            Owner::Attachment(a) => Some(&a.container_id),
            Owner::Legacy(id) => Some(id),
            Owner::Unknown(_) | Owner::Abandoned => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub ip: IpAddr,
    pub owner: Owner,
}

/// What the allocator needs from storage. Callers hold the lock (a
/// [`DiskStore`] is locked for its whole life).
pub trait Store {
    /// Every reservation file, in no particular order.
    fn reservations(&self) -> io::Result<Vec<Reservation>>;
    /// Creates the file for `ip` unless it exists (false then), and records
    /// `ip` as the last reserved of range set `range_id`.
    fn reserve(&mut self, who: &Attachment, ip: IpAddr, range_id: usize) -> io::Result<bool>;
    fn last_reserved(&self, range_id: usize) -> io::Result<Option<IpAddr>>;
    /// Removes the reservation of `ip`; a missing one is not an error.
    fn release(&mut self, ip: IpAddr) -> io::Result<()>;
}

/// `GetByID`: addresses `who` holds, including legacy files with its ID.
pub fn held_by(res: &[Reservation], who: &Attachment) -> Vec<IpAddr> {
    res.iter()
        .filter(|r| match &r.owner {
            Owner::Attachment(a) => a == who,
            Owner::Legacy(id) => *id == who.container_id,
            Owner::Unknown(_) | Owner::Abandoned => false,
        })
        .map(|r| r.ip)
        .collect()
}

/// `ReleaseByID`'s selection: the files of exactly (containerID, ifname);
/// only if there are none, the legacy files holding just the container ID
/// (so a second interface's DEL cannot take a first interface's legacy
/// file while that attachment has current-format files).
pub fn owned_by(res: &[Reservation], who: &Attachment) -> Vec<IpAddr> {
    let exact: Vec<IpAddr> = res
        .iter()
        .filter(|r| matches!(&r.owner, Owner::Attachment(a) if a == who))
        .map(|r| r.ip)
        .collect();
    if !exact.is_empty() {
        return exact;
    }
    res.iter()
        .filter(|r| matches!(&r.owner, Owner::Legacy(id) if *id == who.container_id))
        .map(|r| r.ip)
        .collect()
}

/// Releases everything `who` owns (see [`owned_by`]); returns what went.
/// One file failing does not keep the others: DEL releases what it can and
/// reports the first failure.
pub fn release_owned(store: &mut dyn Store, who: &Attachment) -> io::Result<Vec<IpAddr>> {
    let mut released = Vec::new();
    let mut first_err = None;
    for ip in owned_by(&store.reservations()?, who) {
        match store.release(ip) {
            Ok(()) => released.push(ip),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(released),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{what}: {err}")]
    Io { what: String, err: io::Error },
    #[error("timed out after {}s waiting for the lock on {}", .timeout.as_secs(), .path.display())]
    LockTimeout { path: PathBuf, timeout: Duration },
}

impl StoreError {
    pub fn io(what: impl Into<String>, err: io::Error) -> Self {
        StoreError::Io {
            what: what.into(),
            err,
        }
    }
}

/// Owner index: `<dir>/.rcni-owners`, a cache of every reservation file's
/// content, so an ADD or DEL on a node with many pods reads one file
/// instead of all of them. The reference never reads it as a reservation (its
/// name is no address) and never matches its content to an attachment.
pub const INDEX_FILE: &str = ".rcni-owners";

/// The first line of the index: `rcni-owners <body length> <crc32 of the
/// body>`. The index is written over in place (see [`DiskStore::write_index`]),
/// so a writer killed part way leaves a mix of old and new bytes that may
/// still parse; the length and checksum make such an index never believed.
const INDEX_MAGIC: &str = "rcni-owners";

fn index_encode(body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "{INDEX_MAGIC} {} {:08x}\n",
        body.len(),
        crc32fast::hash(body)
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// The body of an index file that is whole, else `None`.
fn index_decode(data: &[u8]) -> Option<&[u8]> {
    let nl = data.iter().position(|b| *b == b'\n')?;
    let header = std::str::from_utf8(&data[..nl]).ok()?;
    let mut words = header.split(' ');
    (words.next()? == INDEX_MAGIC).then_some(())?;
    let len: usize = words.next()?.parse().ok()?;
    let crc = u32::from_str_radix(words.next()?, 16).ok()?;
    let body = &data[nl + 1..];
    (words.next().is_none() && body.len() == len && crc32fast::hash(body) == crc).then_some(body)
}

/// The spare beside `last_reserved_ip.<n>` that [`rcni_statefile::write_exchange`]
/// swaps with it. A dot name that is no address: the reference's walks read
/// it and never match it to an attachment.
fn last_reserved_spare(range_id: usize) -> String {
    format!(".rcni-spare.{LAST_RESERVED_PREFIX}{range_id}")
}

/// The on-disk store of one network, locked from open to drop.
pub struct DiskStore {
    dir: PathBuf,
    /// Reservation file contents by address, loaded on first use.
    owners: RefCell<Option<BTreeMap<IpAddr, String>>>,
    /// The index file no longer matches `owners`.
    stale: Cell<bool>,
    _lock: Flock<File>,
}

/// What the index records besides the owners: the directory's mtime when it
/// was written. Every create or unlink of a reservation, by us or by the
/// reference (which does not know the index), moves it.
#[derive(serde::Serialize, serde::Deserialize)]
struct Index<'a> {
    dir_mtime: (i64, i64),
    /// `dir_mtime` is one we set, a second in the past, after the last
    /// change ([`DiskStore::stamp_dir`]): any later create or unlink sets
    /// the current time, which cannot equal it, so a matching mtime alone
    /// proves the index current and the directory need not be listed (on
    /// ext4 a listing of a thousand reservations costs about 0.3 ms; with
    /// it host-local's ADD at 1000 pods took 1.7 ms against 0.87 at none,
    /// without it 1.1 ms). Without it the mtime is the kernel's, whose
    /// clock ticks only every few milliseconds, so a change in the same
    /// tick would keep it: the listing must match as well.
    #[serde(default)]
    exact: bool,
    /// Borrowed when written: no copy of every owner per ADD.
    owners: Cow<'a, BTreeMap<IpAddr, String>>,
}

impl DiskStore {
    /// `<data_dir>/<network>`, locked. With `create` the directory and the
    /// lock file are made as the reference makes them (0755, 0750); without,
    /// a missing directory is `None`: DEL, GC and STATUS of a network that
    /// never had an address leave nothing behind.
    pub fn open(
        data_dir: &Path,
        network: &str,
        create: bool,
        timeout: Duration,
    ) -> Result<Option<DiskStore>, StoreError> {
        let dir = data_dir.join(network);
        if create {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(&dir)
                .map_err(|e| StoreError::io(format!("mkdir {}", dir.display()), e))?;
        } else if !dir.is_dir() {
            return Ok(None);
        }
        let path = dir.join(LOCK_FILE);
        // go-filemutex opens O_CREAT|O_RDONLY with mode 0750; flock needs no
        // write access. std refuses create(true) without write, hence the
        // raw flag.
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CREAT)
            .mode(0o750)
            .open(&path)
            .map_err(|e| StoreError::io(format!("open {}", path.display()), e))?;
        let lock = lock_exclusive(file, &path, timeout)?;
        Ok(Some(DiskStore {
            dir,
            owners: RefCell::new(None),
            stale: Cell::new(false),
            _lock: lock,
        }))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path_of(&self, ip: IpAddr) -> PathBuf {
        // Go's IP.String() and Rust's Display agree (RFC 5952 for IPv6),
        // which the differential tests check against the reference.
        self.dir.join(ip.to_string())
    }

    fn dir_mtime(&self) -> io::Result<(i64, i64)> {
        let m = std::fs::metadata(&self.dir)?;
        Ok((m.mtime(), m.mtime_nsec()))
    }

    /// Addresses with a reservation file: a directory listing, a few
    /// syscalls however many pods there are. Temporary files a killed
    /// writer left are removed on the way: we hold the lock every writer
    /// takes, so none is in use.
    fn reserved_names(&self) -> io::Result<BTreeSet<IpAddr>> {
        let mut out = BTreeSet::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if rcni_statefile::is_tmp_name(name) {
                let _ = std::fs::remove_file(entry.path());
                continue;
            }
            if name == LOCK_FILE || name.starts_with(LAST_RESERVED_PREFIX) {
                continue;
            }
            let Some(ip) = parse_ip(name) else { continue };
            if entry.file_type().is_ok_and(|t| t.is_file()) {
                out.insert(ip);
            }
        }
        Ok(out)
    }

    /// The index, if it still describes the directory: same mtime, and
    /// unless that mtime is one we set ([`Index::exact`]) the same set of
    /// address files. Anything else (no index, a torn write, a reference
    /// plugin having run since) is `Err` with the listing if one was made.
    fn load_index(&self) -> Result<BTreeMap<IpAddr, String>, Option<BTreeSet<IpAddr>>> {
        let data = std::fs::read(self.dir.join(INDEX_FILE)).map_err(|_| None)?;
        let body = index_decode(&data).ok_or(None)?;
        let index: Index = serde_json::from_slice(body).map_err(|_| None)?;
        if index.dir_mtime != self.dir_mtime().map_err(|_| None)? {
            return Err(None);
        }
        if index.exact {
            return Ok(index.owners.into_owned());
        }
        let names = self.reserved_names().map_err(|_| None)?;
        let same = index.owners.len() == names.len() && index.owners.keys().eq(names.iter());
        if same {
            Ok(index.owners.into_owned())
        } else {
            Err(Some(names))
        }
    }

    fn with_owners<T>(&self, f: impl FnOnce(&mut BTreeMap<IpAddr, String>) -> T) -> io::Result<T> {
        let mut owners = self.owners.borrow_mut();
        if owners.is_none() {
            *owners = Some(match self.load_index() {
                Ok(o) => o,
                Err(listed) => {
                    self.stale.set(true);
                    let names = match listed {
                        Some(n) => n,
                        None => self.reserved_names()?,
                    };
                    let mut o = BTreeMap::new();
                    for ip in names {
                        // An unreadable file counts as empty: it matches
                        // nobody (the reference skips it too) and is freed
                        // as abandoned once old enough.
                        let data = std::fs::read(self.path_of(ip)).unwrap_or_default();
                        o.insert(ip, String::from_utf8_lossy(&data).into_owned());
                    }
                    o
                }
            });
        }
        Ok(f(owners.as_mut().expect("loaded above")))
    }

    /// Sets the directory's mtime to a second ago, a time no later create
    /// or unlink can give it, and returns it as the filesystem keeps it.
    fn stamp_dir(&self) -> io::Result<(i64, i64)> {
        let past = SystemTime::now() - Duration::from_secs(1);
        File::open(&self.dir)?.set_times(std::fs::FileTimes::new().set_modified(past))?;
        self.dir_mtime()
    }

    /// Rewrites the index after the last change, under the lock. The index
    /// is created before the directory's mtime is read (creating it moves
    /// the mtime) and then rewritten in place (which does not).
    fn write_index(&self) -> io::Result<()> {
        let owners = self.owners.borrow();
        let Some(owners) = owners.as_ref() else {
            return Ok(());
        };
        let f = open_for_overwrite(&self.dir.join(INDEX_FILE))?;
        let (dir_mtime, exact) = match self.stamp_dir() {
            Ok(m) => (m, true),
            Err(_) => (self.dir_mtime()?, false),
        };
        let index = Index {
            dir_mtime,
            exact,
            owners: Cow::Borrowed(owners),
        };
        let body = serde_json::to_vec(&index).map_err(io::Error::other)?;
        rcni_statefile::overwrite(f, &index_encode(&body))
    }

    /// An empty (or unreadable) reservation file is abandoned once it has
    /// not changed for [`ABANDONED_AFTER`]; a young one is left alone.
    fn owner_of_empty(&self, ip: IpAddr) -> Owner {
        let old = std::fs::metadata(self.path_of(ip))
            .and_then(|m| m.modified())
            .is_ok_and(|t| {
                SystemTime::now()
                    .duration_since(t)
                    .is_ok_and(|age| age >= ABANDONED_AFTER)
            });
        if old {
            Owner::Abandoned
        } else {
            Owner::Unknown(String::new())
        }
    }
}

impl Drop for DiskStore {
    fn drop(&mut self) {
        // Still under the lock: fields drop after this. A failed write only
        // costs the next operation a full read.
        if self.stale.get() && self.write_index().is_err() {
            let _ = std::fs::remove_file(self.dir.join(INDEX_FILE));
        }
    }
}

/// flock(LOCK_EX), giving up after `timeout` (the reference waits forever;
/// a wedged holder should surface as "try again later", not a hung ADD).
/// The blocking call runs on a helper thread; if it wins after we gave up,
/// the lock is dropped (unlocked) at once because nobody receives it.
fn lock_exclusive(file: File, path: &Path, timeout: Duration) -> Result<Flock<File>, StoreError> {
    let io_err = |e: Errno| StoreError::io(format!("flock {}", path.display()), e.into());
    let file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(l) => return Ok(l),
        Err((f, e)) if e == Errno::EWOULDBLOCK => f,
        Err((_, e)) => return Err(io_err(e)),
    };
    let (tx, rx) = mpsc::sync_channel(1);
    std::thread::spawn(move || {
        let mut file = file;
        let r = loop {
            match Flock::lock(file, FlockArg::LockExclusive) {
                Err((f, Errno::EINTR)) => file = f,
                Ok(l) => break Ok(l),
                Err((_, e)) => break Err(e),
            }
        };
        // A failed send means the caller timed out: dropping the lock
        // returned inside the error unlocks it.
        let _ = tx.send(r);
    });
    match rx.recv_timeout(timeout) {
        Ok(Ok(l)) => Ok(l),
        Ok(Err(e)) => Err(io_err(e)),
        Err(_) => Err(StoreError::LockTimeout {
            path: path.to_path_buf(),
            timeout,
        }),
    }
}

impl Store for DiskStore {
    fn reservations(&self) -> io::Result<Vec<Reservation>> {
        self.with_owners(|o| {
            o.iter()
                .map(|(ip, c)| Reservation {
                    ip: *ip,
                    owner: if c.trim().is_empty() {
                        self.owner_of_empty(*ip)
                    } else {
                        Owner::parse(c)
                    },
                })
                .collect()
        })
    }

    fn reserve(&mut self, who: &Attachment, ip: IpAddr, range_id: usize) -> io::Result<bool> {
        // Loaded before the change, so the index still matches the listing.
        self.with_owners(|_| ())?;
        let path = self.path_of(ip);
        if !rcni_statefile::create_new(&path, who.content().as_bytes(), FILE_MODE)? {
            return Ok(false);
        }
        let written = rcni_statefile::write_exchange(
            &self.dir.join(format!("{LAST_RESERVED_PREFIX}{range_id}")),
            &self.dir.join(last_reserved_spare(range_id)),
            ip.to_string().as_bytes(),
            FILE_MODE,
        );
        if let Err(e) = written {
            // The reference keeps the address file when only the
            // last_reserved_ip write fails, leaking it; we undo both.
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        self.with_owners(|o| o.insert(ip, who.content()))?;
        self.stale.set(true);
        Ok(true)
    }

    fn last_reserved(&self, range_id: usize) -> io::Result<Option<IpAddr>> {
        match std::fs::read_to_string(self.dir.join(format!("{LAST_RESERVED_PREFIX}{range_id}"))) {
            Ok(s) => Ok(parse_ip(s.trim())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            // Round-robin is an optimisation: an unreadable marker only
            // restarts the walk, as in the reference.
            Err(_) => Ok(None),
        }
    }

    fn release(&mut self, ip: IpAddr) -> io::Result<()> {
        self.with_owners(|_| ())?;
        match std::fs::remove_file(self.path_of(ip)) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            r => r?,
        }
        self.with_owners(|o| o.remove(&ip))?;
        self.stale.set(true);
        Ok(())
    }
}

/// The mode of every file we write but the lock: upstream's since v1.4.0
/// (CIS Kubernetes 1.1.9; reservations name their containers).
const FILE_MODE: u32 = 0o600;

/// Opens (creating, [`FILE_MODE`]) a file whose content
/// [`rcni_statefile::overwrite`] replaces. One an earlier build left 0644
/// is narrowed: it is rewritten in place, so it would keep that mode
/// forever (the index lists every container ID).
fn open_for_overwrite(path: &Path) -> io::Result<File> {
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(FILE_MODE)
        .open(path)?;
    if f.metadata()?.mode() & 0o777 != FILE_MODE {
        f.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))?;
    }
    Ok(f)
}

/// An in-memory store with the disk store's semantics, for pure tests.
#[derive(Debug, Default, Clone)]
pub struct MemStore {
    pub files: BTreeMap<IpAddr, String>,
    pub last: BTreeMap<usize, IpAddr>,
    /// Empty files old enough to be [`Owner::Abandoned`].
    pub abandoned: BTreeSet<IpAddr>,
}

impl Store for MemStore {
    fn reservations(&self) -> io::Result<Vec<Reservation>> {
        Ok(self
            .files
            .iter()
            .map(|(ip, c)| Reservation {
                ip: *ip,
                owner: if self.abandoned.contains(ip) {
                    Owner::Abandoned
                } else {
                    Owner::parse(c)
                },
            })
            .collect())
    }

    fn reserve(&mut self, who: &Attachment, ip: IpAddr, range_id: usize) -> io::Result<bool> {
        if self.files.contains_key(&ip) {
            return Ok(false);
        }
        self.files.insert(ip, who.content());
        self.last.insert(range_id, ip);
        Ok(true)
    }

    fn last_reserved(&self, range_id: usize) -> io::Result<Option<IpAddr>> {
        Ok(self.last.get(&range_id).copied())
    }

    fn release(&mut self, ip: IpAddr) -> io::Result<()> {
        self.files.remove(&ip);
        self.abandoned.remove(&ip);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn owner_parsing() {
        assert_eq!(
            Owner::parse("abc\r\neth0"),
            Owner::Attachment(Attachment::new("abc", "eth0"))
        );
        assert_eq!(
            Owner::parse("  abc\r\neth0\n"),
            Owner::Attachment(Attachment::new("abc", "eth0"))
        );
        assert_eq!(Owner::parse("abc\n"), Owner::Legacy("abc".into()));
        assert_eq!(
            Owner::parse("abc\neth0"),
            Owner::Unknown("abc\neth0".into())
        );
        assert_eq!(Owner::parse(""), Owner::Unknown(String::new()));
        assert_eq!(Attachment::new(" abc ", "eth0").content(), "abc\r\neth0");
    }

    #[test]
    fn release_prefers_exact_matches_over_legacy_files() {
        let mut s = MemStore::default();
        s.files.insert(ip("10.0.0.2"), "c1\r\neth0".into());
        s.files.insert(ip("10.0.0.3"), "c1".into());
        s.files.insert(ip("10.0.0.4"), "c1\r\neth1".into());
        s.files.insert(ip("10.0.0.5"), "c2\r\neth0".into());
        let eth0 = Attachment::new("c1", "eth0");
        let res = s.reservations().unwrap();
        let mut held = held_by(&res, &eth0);
        held.sort();
        assert_eq!(held, [ip("10.0.0.2"), ip("10.0.0.3")]);
        assert_eq!(release_owned(&mut s, &eth0).unwrap(), [ip("10.0.0.2")]);
        // Now only the legacy file can match c1/eth0.
        assert_eq!(release_owned(&mut s, &eth0).unwrap(), [ip("10.0.0.3")]);
        assert!(release_owned(&mut s, &eth0).unwrap().is_empty());
        assert_eq!(s.files.len(), 2);
    }

    #[test]
    fn disk_layout() {
        let tmp = tempfile::tempdir().unwrap();
        let t = Duration::from_secs(5);
        assert!(
            DiskStore::open(tmp.path(), "net", false, t)
                .unwrap()
                .is_none()
        );
        assert!(
            !tmp.path().join("net").exists(),
            "open without create makes nothing"
        );
        let mut s = DiskStore::open(tmp.path(), "net", true, t)
            .unwrap()
            .unwrap();
        let who = Attachment::new("cid", "eth0");
        assert!(s.reserve(&who, ip("10.0.0.2"), 0).unwrap());
        assert!(!s.reserve(&who, ip("10.0.0.2"), 0).unwrap());
        assert!(s.reserve(&who, ip("2001:db8::2"), 1).unwrap());
        let dir = tmp.path().join("net");
        assert_eq!(
            std::fs::read_to_string(dir.join("10.0.0.2")).unwrap(),
            "cid\r\neth0"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("2001:db8::2")).unwrap(),
            "cid\r\neth0"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("last_reserved_ip.0")).unwrap(),
            "10.0.0.2"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("last_reserved_ip.1")).unwrap(),
            "2001:db8::2"
        );
        assert!(dir.join("lock").is_file());
        std::fs::write(dir.join("not-an-ip"), "cid\r\neth0").unwrap();
        let mut res = s.reservations().unwrap();
        res.sort_by_key(|r| r.ip);
        assert_eq!(res.len(), 2);
        assert_eq!(s.last_reserved(0).unwrap(), Some(ip("10.0.0.2")));
        assert_eq!(s.last_reserved(7).unwrap(), None);
        s.release(ip("10.0.0.2")).unwrap();
        s.release(ip("10.0.0.2")).unwrap();
        assert!(!dir.join("10.0.0.2").exists());

        // Files written over in place still end where their content does
        // when it gets shorter: the reference parses last_reserved_ip whole.
        assert!(s.reserve(&who, ip("10.0.0.100"), 0).unwrap());
        assert!(s.reserve(&who, ip("10.0.0.9"), 0).unwrap());
        assert_eq!(
            std::fs::read_to_string(dir.join("last_reserved_ip.0")).unwrap(),
            "10.0.0.9"
        );
        drop(s);
        let index_len = || std::fs::metadata(dir.join(INDEX_FILE)).unwrap().len();
        let before = index_len();
        let mut s = DiskStore::open(tmp.path(), "net", true, t)
            .unwrap()
            .unwrap();
        s.release(ip("10.0.0.100")).unwrap();
        drop(s);
        assert!(index_len() < before);
        let s = DiskStore::open(tmp.path(), "net", true, t)
            .unwrap()
            .unwrap();
        let data = std::fs::read(dir.join(INDEX_FILE)).unwrap();
        let index: Index = serde_json::from_slice(index_decode(&data).unwrap()).unwrap();
        assert_eq!(
            index.owners.keys().copied().collect::<Vec<_>>(),
            [ip("10.0.0.9"), ip("2001:db8::2")]
        );
        assert_eq!(s.reservations().unwrap().len(), 2);
    }

    /// Network "net" of data dir `data`, created if missing and locked.
    fn open_net(data: &Path) -> DiskStore {
        DiskStore::open(data, "net", true, Duration::from_secs(5))
            .unwrap()
            .unwrap()
    }

    fn set_mtime(path: &Path, t: SystemTime) {
        let times = std::fs::FileTimes::new().set_modified(t);
        File::open(path).unwrap().set_times(times).unwrap();
    }

    /// The owner index is a cache: whatever the reference (which does not
    /// know it) does to the directory in between, reads see the files.
    #[test]
    fn owner_index_follows_changes_made_without_it() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("net");
        let open = || open_net(tmp.path());
        let owners = |s: &DiskStore| {
            let mut r: Vec<(IpAddr, Option<String>)> = s
                .reservations()
                .unwrap()
                .into_iter()
                .map(|r| (r.ip, r.owner.container_id().map(str::to_string)))
                .collect();
            r.sort();
            r
        };
        {
            let mut s = open();
            assert!(
                s.reserve(&Attachment::new("a", "eth0"), ip("10.0.0.2"), 0)
                    .unwrap()
            );
            assert!(
                s.reserve(&Attachment::new("b", "eth0"), ip("10.0.0.3"), 0)
                    .unwrap()
            );
        }
        assert!(dir.join(INDEX_FILE).is_file(), "written on drop");
        // Served from the index: a file's content changed behind its back
        // without a create or unlink is not noticed (the reference never
        // rewrites a reservation in place)...
        std::fs::write(dir.join("10.0.0.2"), "z\r\neth0").unwrap();
        assert_eq!(owners(&open())[0].1.as_deref(), Some("a"));
        // ...but an address file created or removed by someone else is.
        std::fs::write(dir.join("10.0.0.9"), "c\r\neth0").unwrap();
        assert_eq!(
            owners(&open()),
            [
                (ip("10.0.0.2"), Some("z".into())),
                (ip("10.0.0.3"), Some("b".into())),
                (ip("10.0.0.9"), Some("c".into())),
            ]
        );
        std::fs::remove_file(dir.join("10.0.0.3")).unwrap();
        assert_eq!(owners(&open()).len(), 2);
        // A torn index is ignored and rewritten.
        std::fs::write(dir.join(INDEX_FILE), "{\"dir_mtime\":").unwrap();
        assert_eq!(owners(&open()).len(), 2);
        let data = std::fs::read(dir.join(INDEX_FILE)).unwrap();
        let index: Index = serde_json::from_slice(index_decode(&data).unwrap()).unwrap();
        assert_eq!(index.owners.len(), 2);
        // Releases through the store keep it exact.
        {
            let mut s = open();
            s.release(ip("10.0.0.9")).unwrap();
        }
        assert_eq!(owners(&open()), [(ip("10.0.0.2"), Some("z".into()))]);
    }

    #[test]
    fn exact_index_is_believed_without_a_listing() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("net");
        let open = || open_net(tmp.path());
        let ips = |s: &DiskStore| -> Vec<IpAddr> {
            s.reservations()
                .unwrap()
                .into_iter()
                .map(|r| r.ip)
                .collect()
        };
        {
            let mut s = open();
            assert!(
                s.reserve(&Attachment::new("a", "eth0"), ip("10.0.0.2"), 0)
                    .unwrap()
            );
        }
        let data = std::fs::read(dir.join(INDEX_FILE)).unwrap();
        let index: Index = serde_json::from_slice(index_decode(&data).unwrap()).unwrap();
        assert!(index.exact, "our own mtime recorded");
        let stamped = std::fs::metadata(&dir).unwrap().modified().unwrap();
        assert!(SystemTime::now().duration_since(stamped).unwrap() >= Duration::from_millis(900));
        // A file slipped in with the mtime put back, as no create can: not
        // seen, so the index alone was read.
        std::fs::write(dir.join("10.0.0.7"), "x\r\neth0").unwrap();
        set_mtime(&dir, stamped);
        assert_eq!(ips(&open()), [ip("10.0.0.2")]);
        // A create at once after the stamp moves the mtime to now, away
        // from it, within the same clock tick too.
        std::fs::remove_file(dir.join("10.0.0.7")).unwrap();
        std::fs::write(dir.join("10.0.0.8"), "y\r\neth0").unwrap();
        assert_eq!(ips(&open()), [ip("10.0.0.2"), ip("10.0.0.8")]);
        // An index from before `exact` (none recorded) is checked against
        // the listing as before.
        let old =
            serde_json::json!({"dir_mtime": index.dir_mtime, "owners": {"10.0.0.2": "a\r\neth0"}});
        let body = serde_json::to_vec(&old).unwrap();
        std::fs::write(dir.join(INDEX_FILE), index_encode(&body)).unwrap();
        set_mtime(&dir, stamped);
        assert_eq!(ips(&open()), [ip("10.0.0.2"), ip("10.0.0.8")]);
    }

    fn age(path: &Path, by: Duration) {
        set_mtime(path, SystemTime::now() - by);
    }

    /// What a writer killed at any point leaves: never an empty or partial
    /// file under an address's name, and its temporaries go with the next
    /// command that takes the lock.
    #[test]
    fn reservations_appear_whole_and_killed_writers_temporaries_go() {
        let tmp = tempfile::tempdir().unwrap();
        let t = Duration::from_secs(5);
        let dir = tmp.path().join("net");
        let who = Attachment::new("cid", "eth0");
        {
            let mut s = DiskStore::open(tmp.path(), "net", true, t)
                .unwrap()
                .unwrap();
            assert!(s.reserve(&who, ip("10.0.0.2"), 0).unwrap());
            assert!(s.reserve(&who, ip("10.0.0.3"), 0).unwrap());
        }
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        // The spare swapped with last_reserved_ip.0 holds the previous value.
        assert_eq!(
            names,
            [
                INDEX_FILE,
                ".rcni-spare.last_reserved_ip.0",
                "10.0.0.2",
                "10.0.0.3",
                "last_reserved_ip.0",
                "lock"
            ]
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("last_reserved_ip.0")).unwrap(),
            "10.0.0.3"
        );
        // A kill after the temporary was written and before it was published.
        let left = rcni_statefile::tmp_path(&dir.join("10.0.0.4"));
        std::fs::write(&left, who.content()).unwrap();
        let s = DiskStore::open(tmp.path(), "net", true, t)
            .unwrap()
            .unwrap();
        assert_eq!(
            s.reservations().unwrap().len(),
            2,
            "a temporary is no reservation"
        );
        assert!(!left.exists(), "swept under the lock");
    }

    #[test]
    fn empty_reservation_files_are_abandoned_after_the_grace_period() {
        let tmp = tempfile::tempdir().unwrap();
        let t = Duration::from_secs(5);
        let dir = tmp.path().join("net");
        drop(DiskStore::open(tmp.path(), "net", true, t).unwrap());
        // The reference's (and our older versions') crash leftover.
        std::fs::write(dir.join("10.0.0.5"), "").unwrap();
        std::fs::write(dir.join("10.0.0.6"), " \n").unwrap();
        let owners = || {
            let s = DiskStore::open(tmp.path(), "net", true, t)
                .unwrap()
                .unwrap();
            let mut r = s.reservations().unwrap();
            r.sort_by_key(|r| r.ip);
            r.into_iter().map(|r| r.owner).collect::<Vec<_>>()
        };
        assert_eq!(
            owners(),
            [Owner::Unknown(String::new()), Owner::Unknown(String::new())],
            "young: maybe still being written"
        );
        age(
            &dir.join("10.0.0.5"),
            ABANDONED_AFTER + Duration::from_secs(1),
        );
        age(
            &dir.join("10.0.0.6"),
            ABANDONED_AFTER + Duration::from_secs(1),
        );
        // Served from the index now: ages are read from the files each time.
        assert_eq!(owners(), [Owner::Abandoned, Owner::Abandoned]);
    }

    /// An index written over in place and cut short by a kill can hold old
    /// and new bytes that still parse; it must not be believed.
    #[test]
    fn torn_index_is_never_believed() {
        let body = br#"{"dir_mtime":[1,2],"owners":{}}"#;
        let whole = index_encode(body);
        assert_eq!(index_decode(&whole), Some(&body[..]));
        // Not cut to length after a shorter rewrite.
        let mut longer = whole.clone();
        longer.extend_from_slice(b"}}");
        assert_eq!(index_decode(&longer), None);
        // Same length, one byte of the old content left.
        let mut mixed = whole.clone();
        let n = mixed.len();
        mixed[n - 3] = b'1';
        assert_eq!(index_decode(&mixed), None);
        assert_eq!(index_decode(&whole[..n - 1]), None);
        assert_eq!(index_decode(body), None, "the old format has no header");
    }

    #[test]
    fn lock_excludes_and_times_out() {
        let tmp = tempfile::tempdir().unwrap();
        let held = DiskStore::open(tmp.path(), "net", true, Duration::from_secs(5))
            .unwrap()
            .unwrap();
        let e = DiskStore::open(tmp.path(), "net", true, Duration::from_millis(200))
            .err()
            .expect("second lock must wait and give up");
        assert!(matches!(e, StoreError::LockTimeout { .. }), "{e}");
        drop(held);
        // The helper thread of the timed-out open wins the lock now and
        // must drop it again at once.
        assert!(
            DiskStore::open(tmp.path(), "net", true, Duration::from_secs(5))
                .unwrap()
                .is_some()
        );
    }
}
