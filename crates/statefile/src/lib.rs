//! State files that a later command reads become visible only complete.
//!
//! A plugin can be SIGKILLed at any instruction (the kubelet's timeout, a
//! runtime killing its process group). A file created under its final name
//! and then written is, for the moment in between, an empty or torn record
//! that the next command misreads: host-local's empty reservation file was
//! an address lost for good. So every writer here puts the content in a
//! temporary file of the same directory first and then gives it its name
//! with one rename, which the kernel performs whole or not at all.
//!
//! Temporary names end in [`TMP_SUFFIX`] and start with a dot, so no reader
//! of the reference's layouts (an address, `last_reserved_ip.N`, a container
//! ID) takes them for state. A kill can leave one behind; [`sweep`] removes
//! them.

use nix::errno::Errno;
use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};

/// What every temporary file's name ends with.
pub const TMP_SUFFIX: &str = ".rcni-tmp";

/// A fresh temporary name beside `path`: `.<name>.<pid>.<n>.rcni-tmp`. The
/// pid and a per-process counter keep writers that hold no common lock
/// apart.
pub fn tmp_path(path: &Path) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let n = N.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.{}.{n}{TMP_SUFFIX}", std::process::id()))
}

/// Writes `data` into a new temporary file beside `path` (mode `mode`
/// exactly: the creation mode alone is masked by the umask, which a
/// container may set to 077) and returns its path, its data on disk when
/// `durable`; on failure nothing is left.
fn write_tmp(path: &Path, data: &[u8], mode: u32, durable: bool) -> io::Result<PathBuf> {
    let tmp = tmp_path(path);
    let written = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(data)?;
            f.set_permissions(std::fs::Permissions::from_mode(mode))?;
            if durable { f.sync_all() } else { Ok(()) }
        });
    match written {
        Ok(()) => Ok(tmp),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Replaces `path`'s content with `data` atomically: readers see the old
/// file or the new one, never a torn one.
pub fn write_replace(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    let tmp = write_tmp(path, data, mode, false)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// [`write_replace`] that also survives a power loss: the data reaches the
/// disk before the rename, and the directory after it (without the first
/// sync, ext4 and xfs may commit the rename before the data, which a crash
/// shows as an empty file under the new name).
pub fn write_replace_durable(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    let tmp = write_tmp(path, data, mode, true)?;
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir_of(path);
    Ok(())
}

fn sync_dir_of(path: &Path) {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && let Ok(d) = File::open(dir)
    {
        let _ = d.sync_all();
    }
}

/// Creates `path` with `data` unless it exists: `Ok(false)` then, and the
/// existing file is untouched. The name appears with its whole content
/// (`O_EXCL` followed by a write would show an empty file in between).
pub fn create_new(path: &Path, data: &[u8], mode: u32) -> io::Result<bool> {
    create_new_with(path, data, mode, false)
}

/// [`create_new`] that also survives a power loss (as
/// [`write_replace_durable`]): for what cannot be made again, such as a key.
pub fn create_new_durable(path: &Path, data: &[u8], mode: u32) -> io::Result<bool> {
    create_new_with(path, data, mode, true)
}

fn create_new_with(path: &Path, data: &[u8], mode: u32, durable: bool) -> io::Result<bool> {
    let tmp = write_tmp(path, data, mode, durable)?;
    let published = publish_noreplace(&tmp, path);
    if !matches!(published, Ok(true)) {
        let _ = std::fs::remove_file(&tmp);
    } else if durable {
        sync_dir_of(path);
    }
    published
}

/// Gives `tmp` the name `path` unless `path` exists. renameat2 with
/// RENAME_NOREPLACE does both in one step; filesystems without it (EINVAL)
/// get link(2), which also refuses an existing name, and then the temporary
/// name is dropped (a kill in between leaves a complete file plus a
/// temporary one for [`sweep`]).
fn publish_noreplace(tmp: &Path, path: &Path) -> io::Result<bool> {
    match renameat2(AT_FDCWD, tmp, AT_FDCWD, path, RenameFlags::RENAME_NOREPLACE) {
        Ok(()) => Ok(true),
        Err(Errno::EEXIST) => Ok(false),
        Err(Errno::EINVAL | Errno::ENOSYS) => match std::fs::hard_link(tmp, path) {
            Ok(()) => {
                let _ = std::fs::remove_file(tmp);
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(e),
        },
        Err(e) => Err(e.into()),
    }
}

/// Replaces the small file `path` with `data` through a spare file that is
/// kept beside it (`spare`, which no reader looks at): the spare is written
/// over in place, then the two names are swapped with RENAME_EXCHANGE.
/// Unlike [`write_replace`] no inode is freed, so no block is: on an ext4
/// mounted with `discard` and without a journal, freeing a block is a
/// synchronous device discard, a round trip per write on a hot path. A
/// kill while the spare is written leaves `path` as it was.
pub fn write_exchange(path: &Path, spare: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(mode)
        .open(spare)?;
    overwrite(f, data)?;
    match renameat2(
        AT_FDCWD,
        spare,
        AT_FDCWD,
        path,
        RenameFlags::RENAME_EXCHANGE,
    ) {
        Ok(()) => Ok(()),
        // No file to swap with yet, or a filesystem without exchange: the
        // spare takes the name (and a new spare is made next time).
        Err(Errno::ENOENT | Errno::EINVAL | Errno::ENOSYS) => std::fs::rename(spare, path),
        Err(e) => Err(e.into()),
    }
}

/// Replaces a file's content by writing over it and then cutting it to
/// length, where O_TRUNC would first free its blocks (see
/// [`write_exchange`]). Not atomic: for files whose readers check
/// integrity themselves, or that nobody reads under this name.
pub fn overwrite(mut f: File, data: &[u8]) -> io::Result<()> {
    f.write_all(data)?;
    f.set_len(data.len() as u64)
}

/// Removes the temporary files in `dir` that a killed writer left. With
/// `older_than`, only those not modified for that long (for directories
/// whose writers share no lock, where a young one may be in use); callers
/// holding the lock every writer takes pass `None`. Returns how many went;
/// a missing directory is none.
pub fn sweep(dir: &Path, older_than: Option<Duration>) -> io::Result<usize> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut removed = 0;
    for entry in entries {
        let entry = entry?;
        if is_tmp_name(&entry.file_name().to_string_lossy()) && old_enough(&entry, older_than) {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(removed)
}

/// Removes the temporary files a killed writer of `path` left, and only
/// those: for a caller no other writer of that one name runs beside, such
/// as a command of the attachment the file belongs to (the runtime never
/// runs two commands of one attachment at once, spec: "Concurrency"),
/// where [`sweep`] of the whole directory would need a lock or an age.
/// Returns how many went.
pub fn sweep_of(path: &Path) -> io::Result<usize> {
    let Some(name) = path.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return Ok(0);
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut removed = 0;
    for entry in entries {
        let entry = entry?;
        if tmp_target(&entry.file_name().to_string_lossy()) == Some(name.as_str()) {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(removed)
}

/// How old a temporary must be before [`sweep`] of a directory whose
/// writers share no lock may take it for a killed writer's: a live one
/// holds its temporary for the time of one write and one rename.
pub const ORPHAN_AGE: Duration = Duration::from_secs(600);

/// A name [`tmp_path`] makes.
pub fn is_tmp_name(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(TMP_SUFFIX)
}

/// The final name a temporary name of [`tmp_path`] stands for.
pub fn tmp_target(name: &str) -> Option<&str> {
    let inner = name.strip_prefix('.')?.strip_suffix(TMP_SUFFIX)?;
    let mut parts = inner.rsplitn(3, '.');
    let (n, pid, target) = (parts.next()?, parts.next()?, parts.next()?);
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(n) && digits(pid) && !target.is_empty()).then_some(target)
}

fn old_enough(entry: &std::fs::DirEntry, older_than: Option<Duration>) -> bool {
    let Some(min) = older_than else { return true };
    entry.metadata().and_then(|m| m.modified()).is_ok_and(|t| {
        SystemTime::now()
            .duration_since(t)
            .is_ok_and(|age| age >= min)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn create_new_never_replaces_and_leaves_no_temp() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("10.0.0.2");
        assert!(create_new(&p, b"a\r\neth0", 0o644).unwrap());
        assert!(!create_new(&p, b"b\r\neth0", 0o644).unwrap());
        assert_eq!(std::fs::read(&p).unwrap(), b"a\r\neth0");
        assert_eq!(names(d.path()), ["10.0.0.2"]);
    }

    #[test]
    fn link_fallback_refuses_existing() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x");
        std::fs::write(&p, "old").unwrap();
        let tmp = write_tmp(&p, b"new", 0o644, false).unwrap();
        // The EINVAL branch as a filesystem without RENAME_NOREPLACE takes it.
        assert!(matches!(
            std::fs::hard_link(&tmp, &p),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists
        ));
        std::fs::remove_file(&tmp).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
    }

    #[test]
    fn replace_and_exchange() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        write_replace(&p, b"one", 0o644).unwrap();
        write_replace(&p, b"2", 0o644).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"2");
        let last = d.path().join("last_reserved_ip.0");
        let spare = d.path().join(".last_reserved_ip.0.spare");
        write_exchange(&last, &spare, b"10.0.0.100", 0o644).unwrap();
        assert!(!spare.exists(), "the first write has nothing to swap with");
        write_exchange(&last, &spare, b"10.0.0.9", 0o644).unwrap();
        assert_eq!(std::fs::read(&last).unwrap(), b"10.0.0.9");
        assert_eq!(std::fs::read(&spare).unwrap(), b"10.0.0.100");
        write_exchange(&last, &spare, b"10.0.0.10", 0o644).unwrap();
        assert_eq!(std::fs::read(&last).unwrap(), b"10.0.0.10");
        assert_eq!(
            names(d.path()),
            [".last_reserved_ip.0.spare", "f", "last_reserved_ip.0"]
        );
    }

    #[test]
    fn durable_replace_and_sweep_of_one_name() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("net-c.1-eth0.json");
        write_replace_durable(&p, b"{}", 0o600).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"{}");
        // What killed writers of this name and of others left.
        let mine = [tmp_path(&p), tmp_path(&p)];
        let other = tmp_path(&d.path().join("net-c.1-eth0.json.x"));
        let prefix = tmp_path(&d.path().join("net-c"));
        for t in mine.iter().chain([&other, &prefix]) {
            std::fs::write(t, b"{").unwrap();
        }
        assert_eq!(
            tmp_target(&mine[0].file_name().unwrap().to_string_lossy()),
            Some("net-c.1-eth0.json")
        );
        assert_eq!(tmp_target(".x.rcni-tmp"), None);
        assert_eq!(tmp_target(".x.1.rcni-tmp"), None);
        assert_eq!(tmp_target("..1.2.rcni-tmp"), None);
        assert_eq!(sweep_of(&p).unwrap(), 2);
        let mut want = vec![
            "net-c.1-eth0.json".to_string(),
            other.file_name().unwrap().to_string_lossy().into_owned(),
            prefix.file_name().unwrap().to_string_lossy().into_owned(),
        ];
        want.sort();
        assert_eq!(names(d.path()), want);
        assert_eq!(sweep_of(&d.path().join("missing/x")).unwrap(), 0);
    }

    #[test]
    fn sweep_removes_only_temporaries() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("keep"), "").unwrap();
        std::fs::write(d.path().join("keep.rcni-tmp"), "").unwrap();
        std::fs::write(tmp_path(&d.path().join("a")), "").unwrap();
        std::fs::write(tmp_path(&d.path().join("b")), "").unwrap();
        assert_eq!(sweep(d.path(), Some(Duration::from_secs(3600))).unwrap(), 0);
        assert_eq!(sweep(d.path(), None).unwrap(), 2);
        assert_eq!(names(d.path()), ["keep", "keep.rcni-tmp"]);
        assert_eq!(sweep(&d.path().join("missing"), None).unwrap(), 0);
    }
}
