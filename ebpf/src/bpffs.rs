//! The BPF filesystem: finding it, mounting it where it is missing, and
//! locking a pin directory.
//!
//! Pins live only on a bpffs. Runtimes run plugins in the host's mount
//! namespace, where /sys/fs/bpf is usually mounted, but not always (this
//! machine has none): the first ADD mounts it. `ip netns exec` remounts /sys
//! privately, which hides the host's bpffs (and a bpffs mounted there is a
//! separate instance whose pins vanish with that mount namespace).

use crate::{Error, Result};
use nix::fcntl::{Flock, FlockArg};
use std::fs::File;
use std::path::{Path, PathBuf};

/// statfs(2) f_type of a bpffs.
const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// The canonical mount point, the one place above a pin root we mount on.
pub const DEFAULT_MOUNT: &str = "/sys/fs/bpf";

/// Whether `path` (which must exist) lies on a bpffs.
pub fn is_bpffs(path: &Path) -> Result<bool> {
    let st = nix::sys::statfs::statfs(path)
        .map_err(|e| Error::errno(format!("statfs {}", path.display()), e))?;
    Ok(st.filesystem_type().0 as i64 == BPF_FS_MAGIC)
}

/// The nearest existing directory at or above `path`.
fn existing_ancestor(path: &Path) -> Option<&Path> {
    path.ancestors().find(|p| p.exists())
}

/// Makes `root` a directory on a bpffs, mounting one if needed: on `root`
/// itself when it exists (an empty directory given as the pin root, as
/// tests do), or on /sys/fs/bpf when `root` is below it. Anywhere else a
/// mount would hide an unrelated directory, so that is an error.
pub fn ensure_root(root: &Path) -> Result<()> {
    if let Some(at) = mount_point_for(root)? {
        mount(&at)?;
    }
    std::fs::create_dir_all(root)
        .map_err(|e| Error::io(format!("create pin directory {}", root.display()), e))
}

/// Whether [`ensure_root`] can work for `root`, changing nothing.
pub fn check_root(root: &Path) -> Result<()> {
    mount_point_for(root).map(|_| ())
}

/// Where a bpffs must be mounted for `root`; `None` if it is on one.
fn mount_point_for(root: &Path) -> Result<Option<PathBuf>> {
    let Some(at) = existing_ancestor(root) else {
        return Err(Error::msg(format!("{}: no such directory", root.display())));
    };
    if is_bpffs(at)? {
        return Ok(None);
    }
    if at == root || at == Path::new(DEFAULT_MOUNT) {
        return Ok(Some(at.to_path_buf()));
    }
    Err(Error::msg(format!(
        "pin directory {} is not on a bpffs, and its nearest existing directory {} is not one \
         either: mount a bpffs there or choose a directory under {DEFAULT_MOUNT}",
        root.display(),
        at.display()
    )))
}

fn mount(at: &Path) -> Result<()> {
    // The mount is serialized so that two first ADDs racing on one node do
    // not stack two bpffs instances (the second would hide the first's
    // pins). The lock is the mount point directory itself, so nothing is
    // left behind: whoever opened it before the mount locks the directory
    // underneath and then finds the bpffs; whoever opens it after gets the
    // bpffs root and finds it at once.
    let dir = File::open(at).map_err(|e| Error::io(format!("open {}", at.display()), e))?;
    let _lock = Flock::lock(dir, FlockArg::LockExclusive)
        .map_err(|(_, e)| Error::errno(format!("lock {}", at.display()), e))?;
    if is_bpffs(at)? {
        return Ok(());
    }
    nix::mount::mount(
        Some("bpf"),
        at,
        Some("bpf"),
        nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
        Some("mode=0700"),
    )
    .map_err(|e| Error::errno(format!("mount bpffs on {}", at.display()), e))
}

/// How deep below a bpffs mount [`network_dirs`] looks for a directory
/// named after the network (`<mount>/a/b/<network>`: 3).
pub const SEARCH_DEPTH: usize = 3;

/// The mount points of every bpffs in this mount namespace.
pub fn mounts() -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| Error::io("read /proc/self/mountinfo", e))?;
    Ok(parse_mountinfo(&text))
}

fn parse_mountinfo(text: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = text
        .lines()
        .filter_map(|l| {
            let (fields, rest) = l.split_once(" - ")?;
            let fstype = rest.split(' ').next()?;
            let at = fields.split(' ').nth(4)?;
            (fstype == "bpf").then(|| PathBuf::from(unescape(at)))
        })
        .collect();
    v.sort();
    v.dedup();
    v
}

/// mountinfo's octal escapes (`\040` for a space).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let d = |j: usize| u32::from(b[i + j] - b'0');
            // Above \377 is no byte: kept as written.
            match u8::try_from(d(1) * 64 + d(2) * 8 + d(3)) {
                Ok(n) => out.push(n),
                Err(_) => out.extend_from_slice(&b[i..i + 4]),
            }
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Where a network's pins may be, for a caller that does not know the pin
/// root: `<mount>/rcni/<network>` and `<mount>/<network>` first, then every
/// directory named `network` at most [`SEARCH_DEPTH`] levels below a bpffs
/// mount; only those holding a `prog` pin.
pub fn network_dirs(network: &str) -> Result<Vec<PathBuf>> {
    let mut v = Vec::new();
    let mounts = mounts()?;
    for m in &mounts {
        v.push(m.join("rcni").join(network));
        v.push(m.join(network));
    }
    for m in &mounts {
        let mut level = vec![m.clone()];
        for _ in 0..SEARCH_DEPTH {
            let mut next = Vec::new();
            for d in &level {
                let Ok(rd) = std::fs::read_dir(d) else {
                    continue;
                };
                for e in rd.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        let p = e.path();
                        if e.file_name() == network && !v.contains(&p) {
                            v.push(p.clone());
                        }
                        next.push(p);
                    }
                }
            }
            level = next;
        }
    }
    v.retain(|d| d.join("prog").exists());
    Ok(v)
}

/// An exclusive lock on a pin directory, held while the network's program
/// is loaded and pinned (flock works on a bpffs directory like on any other).
pub struct DirLock {
    _lock: Flock<File>,
}

impl DirLock {
    pub fn acquire(dir: &Path) -> Result<DirLock> {
        let f = File::open(dir).map_err(|e| Error::io(format!("open {}", dir.display()), e))?;
        let lock = Flock::lock(f, FlockArg::LockExclusive)
            .map_err(|(_, e)| Error::errno(format!("lock {}", dir.display()), e))?;
        Ok(DirLock { _lock: lock })
    }
}

/// Removes a pin (a program, map or link: the kernel drops the pin's
/// reference); gone already is fine.
pub(crate) fn remove_pin(p: &Path) -> Result<()> {
    match std::fs::remove_file(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(format!("remove {}", p.display()), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bpffs_mount_points_from_mountinfo() {
        let text = "\
22 1 0:21 / /sys rw,nosuid shared:7 - sysfs sysfs rw
40 22 0:33 / /sys/fs/bpf rw,nosuid,nodev shared:16 - bpf bpf rw,mode=700
90 1 0:50 / /tmp/with\\040space rw - bpf none rw
91 1 0:51 / /tmp/x rw - tmpfs tmpfs rw
";
        assert_eq!(
            parse_mountinfo(text),
            [
                PathBuf::from("/sys/fs/bpf"),
                PathBuf::from("/tmp/with space")
            ]
        );
        assert_eq!(unescape("a\\134b"), "a\\b");
        assert_eq!(unescape("end\\04"), "end\\04");
    }

    #[test]
    fn nearest_existing_ancestor() {
        let d = tempfile::tempdir().unwrap();
        let deep = d.path().join("a/b/c");
        assert_eq!(existing_ancestor(&deep), Some(d.path()));
        assert_eq!(existing_ancestor(d.path()), Some(d.path()));
    }

    #[test]
    fn refuses_to_mount_over_an_unrelated_directory() {
        let d = tempfile::tempdir().unwrap();
        // Its nearest existing directory is the tempdir, not the root
        // itself and not /sys/fs/bpf: mounting there would hide it.
        let e = ensure_root(&d.path().join("missing/rcni")).unwrap_err();
        assert!(e.to_string().contains("not on a bpffs"), "{e}");
        assert!(check_root(&d.path().join("missing/rcni")).is_err());
        // The directory itself, or a path below /sys/fs/bpf: mountable.
        assert!(check_root(d.path()).is_ok());
        assert!(!is_bpffs(d.path()).unwrap());
    }
}
