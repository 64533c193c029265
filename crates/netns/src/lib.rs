//! Network namespaces as file descriptors.
//!
//! `setns(2)` only switches the calling thread, and threads inherit the
//! namespace of the thread that spawned them. So namespace-bound work runs on
//! a throwaway thread ([`NetNs::run`]) that exits afterwards: nothing has to be
//! restored and no other code can observe the switch. (Tests that switch
//! the current thread itself use `rcni_testkit::NsGuard`.)

use std::ffi::OsStr;
use std::fs::{self, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags};
use nix::sched::CloneFlags;
use nix::sys::statfs::{NSFS_MAGIC, PROC_SUPER_MAGIC};

/// Where `ip netns` keeps its named namespaces.
pub const NETNS_RUN_DIR: &str = "/run/netns";

/// The calling thread's network namespace. `/proc/self` would name the
/// thread-group leader, which may sit in another namespace than this thread.
const THREAD_SELF_NETNS: &str = "/proc/thread-self/ns/net";

/// `NS_GET_NSTYPE` from `<linux/nsfs.h>`: `_IO(0xb7, 0x3)`.
const NS_GET_NSTYPE: libc::c_ulong = 0xb703;

/// Errors of this crate.
///
/// `Display` is a complete sentence for operators, including the OS error,
/// which is also the `source()` of the variants that carry one (for callers
/// that inspect it; a printer that walks the chain sees its text twice).
#[derive(thiserror::Error, Debug)]
pub enum Error {
    #[error("network namespace {} does not exist", .0.display())]
    NotFound(PathBuf),
    #[error("{} is not a network namespace", .0.display())]
    NotNetns(PathBuf),
    #[error("network namespace {} already exists", .0.display())]
    Exists(PathBuf),
    #[error("invalid network namespace name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },
    #[error("cannot enter network namespace {target}: {error}")]
    Setns {
        target: String,
        #[source]
        error: io::Error,
    },
    #[error("{op}{}: {error}", fmt_path(path))]
    Io {
        op: &'static str,
        path: Option<PathBuf>,
        #[source]
        error: io::Error,
    },
}

fn fmt_path(path: &Option<PathBuf>) -> String {
    match path {
        Some(p) => format!(" {}", p.display()),
        None => String::new(),
    }
}

impl Error {
    /// The namespace (or its file) does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::NotFound(_))
    }

    /// CNI error code: 104 when the namespace itself is the problem (missing,
    /// not a netns, cannot enter it), 100 for other internal failures.
    pub fn cni_code(&self) -> u32 {
        match self {
            Error::NotFound(_) | Error::NotNetns(_) | Error::Setns { .. } => {
                rcni_cni::ErrorCode::Netns.code()
            }
            // A path the kernel refuses to resolve (over PATH_MAX, a file
            // where a directory should be, a symlink loop) is a bad
            // CNI_NETNS from the runtime, not a failure of ours.
            Error::Io {
                op: "open", error, ..
            } if matches!(
                error.raw_os_error(),
                Some(libc::ENAMETOOLONG | libc::ENOTDIR | libc::ELOOP | libc::EINVAL)
            ) =>
            {
                rcni_cni::ErrorCode::Netns.code()
            }
            _ => rcni_cni::ErrorCode::Internal.code(),
        }
    }

    fn io(op: &'static str, path: Option<&Path>, error: impl Into<io::Error>) -> Error {
        Error::Io {
            op,
            path: path.map(Path::to_path_buf),
            error: error.into(),
        }
    }
}

/// An open network namespace, checked to be one.
///
/// The fd keeps the namespace alive even when nothing else references it.
#[derive(Debug)]
pub struct NetNs {
    fd: OwnedFd,
    path: Option<PathBuf>,
}

impl NetNs {
    /// Open a namespace file such as `/run/netns/x` or `/proc/<pid>/ns/net`.
    pub fn open(path: impl AsRef<Path>) -> Result<NetNs, Error> {
        let path = path.as_ref();
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => Error::NotFound(path.to_path_buf()),
                _ => Error::io("open", Some(path), e),
            })?;
        let fd = OwnedFd::from(file);
        check_netns(fd.as_fd(), path)?;
        Ok(NetNs {
            fd,
            path: Some(path.to_path_buf()),
        })
    }

    /// The calling thread's network namespace.
    pub fn current() -> Result<NetNs, Error> {
        NetNs::open(THREAD_SELF_NETNS)
    }

    /// A fresh network namespace referenced only by the returned fd: the
    /// kernel frees it (and every link in it) once the fd is closed.
    pub fn new_anonymous() -> Result<NetNs, Error> {
        let fd = on_fresh_netns_thread(|| {
            OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(THREAD_SELF_NETNS)
                .map(OwnedFd::from)
                .map_err(|e| Error::io("open", Some(Path::new(THREAD_SELF_NETNS)), e))
        })?;
        Ok(NetNs { fd, path: None })
    }

    /// A second handle on the same namespace (`dup(2)`).
    pub fn try_clone(&self) -> Result<NetNs, Error> {
        let fd = self
            .fd
            .try_clone()
            .map_err(|e| Error::io("dup namespace fd", self.path.as_deref(), e))?;
        Ok(NetNs {
            fd,
            path: self.path.clone(),
        })
    }

    /// Run `f` on a new thread inside this namespace and return its result
    /// (on the calling thread if that is in this namespace already).
    ///
    /// The thread exits afterwards, so the caller's thread never changes
    /// namespace. A panic in `f` is resumed on the caller.
    pub fn run<F, R>(&self, f: F) -> Result<R, Error>
    where
        F: FnOnce() -> R + Send,
        R: Send,
    {
        // Already there (a plugin's own, host, namespace): a thread spawn
        // and join cost more than the work they would wrap.
        if self.is_current_thread_ns() {
            return Ok(f());
        }
        let joined = std::thread::scope(|s| {
            let handle = std::thread::Builder::new()
                .name("rcni-netns".into())
                .spawn_scoped(s, || -> Result<R, Error> {
                    nix::sched::setns(self.fd.as_fd(), CloneFlags::CLONE_NEWNET)
                        .map_err(|e| self.setns_error(e))?;
                    Ok(f())
                })
                .map_err(|e| Error::io("spawn namespace thread", None, e))?;
            Ok(handle.join())
        })?;
        match joined {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    /// The path this namespace was opened from, if any.
    /// `program` set up to run inside this network namespace: the child
    /// setns(2)es between fork and exec. Only the network namespace changes;
    /// the mount namespace (and /sys, /sys/fs/bpf) stays the caller's, as for
    /// a container runtime. The NetNs must outlive the spawn.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> std::process::Command {
        use std::os::unix::process::CommandExt;
        let mut cmd = std::process::Command::new(program);
        let fd = self.fd.as_raw_fd();
        // SAFETY: between fork and exec only async-signal-safe calls are
        // allowed; setns(2) is a plain syscall on an fd the child inherited
        // (CLOEXEC closes it only at exec). `pre_exec` is unsafe by nature;
        // no crate offers a safe hook between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// `/proc/<pid>/fd/<fd>`: a path other processes (plugins) can open for
    /// as long as this `NetNs` lives.
    pub fn proc_path(&self) -> PathBuf {
        PathBuf::from(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            self.fd.as_raw_fd()
        ))
    }

    fn is_current_thread_ns(&self) -> bool {
        match (
            nix::sys::stat::fstat(self.fd.as_fd()),
            nix::sys::stat::stat(THREAD_SELF_NETNS),
        ) {
            (Ok(a), Ok(b)) => a.st_dev == b.st_dev && a.st_ino == b.st_ino,
            _ => false,
        }
    }

    /// Whether both handles name the same namespace (same nsfs inode).
    pub fn same_as(&self, other: &NetNs) -> bool {
        match (
            nix::sys::stat::fstat(self.fd.as_fd()),
            nix::sys::stat::fstat(other.fd.as_fd()),
        ) {
            (Ok(a), Ok(b)) => a.st_dev == b.st_dev && a.st_ino == b.st_ino,
            _ => false,
        }
    }

    /// The namespace's inode number (as in `ip netns identify`, `lsns`).
    pub fn inode(&self) -> u64 {
        nix::sys::stat::fstat(self.fd.as_fd())
            .map(|s| s.st_ino)
            .unwrap_or(0)
    }

    fn describe(&self) -> String {
        match &self.path {
            Some(p) => p.display().to_string(),
            None => format!("anonymous:[{}]", self.inode()),
        }
    }

    fn setns_error(&self, e: Errno) -> Error {
        Error::Setns {
            target: self.describe(),
            error: e.into(),
        }
    }
}

impl AsFd for NetNs {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Reject anything but a network namespace. Since Linux 3.19 namespace files
/// live on nsfs; `NS_GET_NSTYPE` (4.11) tells a netns from a mount or user
/// namespace, which setns would otherwise reject only later.
fn check_netns(fd: BorrowedFd<'_>, path: &Path) -> Result<(), Error> {
    let fs = nix::sys::statfs::fstatfs(fd).map_err(|e| Error::io("statfs", Some(path), e))?;
    let fs_type = fs.filesystem_type();
    if fs_type != NSFS_MAGIC && fs_type != PROC_SUPER_MAGIC {
        return Err(Error::NotNetns(path.to_path_buf()));
    }
    // SAFETY: NS_GET_NSTYPE takes no argument and only reads the fd. No
    // crate wraps this ioctl (the functions nix's ioctl macros generate are
    // unsafe to call as well), and the fd's /proc link names a bind-mounted
    // namespace by its path, not its type.
    let ty = unsafe { libc::ioctl(fd.as_raw_fd(), NS_GET_NSTYPE as _) };
    if ty == libc::CLONE_NEWNET {
        return Ok(());
    }
    if ty < 0 && fs_type == NSFS_MAGIC && Errno::last() == Errno::ENOTTY {
        // nsfs before 4.11 has no NS_GET_NSTYPE; setns will check.
        return Ok(());
    }
    Err(Error::NotNetns(path.to_path_buf()))
}

/// Run `f` on a throwaway thread that first unshares into a new netns.
fn on_fresh_netns_thread<R: Send>(f: impl FnOnce() -> Result<R, Error> + Send) -> Result<R, Error> {
    let joined = std::thread::scope(|s| {
        let handle = std::thread::Builder::new()
            .name("rcni-netns-new".into())
            .spawn_scoped(s, || -> Result<R, Error> {
                nix::sched::unshare(CloneFlags::CLONE_NEWNET)
                    .map_err(|e| Error::io("unshare(CLONE_NEWNET)", None, e))?;
                f()
            })
            .map_err(|e| Error::io("spawn namespace thread", None, e))?;
        Ok(handle.join())
    })?;
    match joined {
        Ok(r) => r,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// `/run/netns/<name>`.
pub fn named_path(name: &str) -> PathBuf {
    Path::new(NETNS_RUN_DIR).join(name)
}

fn validate_name(name: &str) -> Result<(), Error> {
    let reason = if name.is_empty() {
        "empty"
    } else if name.contains('/') {
        "contains '/'"
    } else if name == "." || name == ".." {
        "reserved"
    } else if name.contains('\0') {
        "contains NUL"
    } else {
        return Ok(());
    };
    Err(Error::InvalidName {
        name: name.to_string(),
        reason,
    })
}

/// Create a named namespace like `ip netns add`: a bind mount of a fresh
/// netns on `/run/netns/<name>`.
pub fn create_named(name: &str) -> Result<NetNs, Error> {
    validate_name(name)?;
    let dir = Path::new(NETNS_RUN_DIR);
    fs::create_dir_all(dir).map_err(|e| Error::io("create directory", Some(dir), e))?;
    make_shared(dir)?;
    create_at(&named_path(name))
}

/// Like iproute2: `/run/netns` must be a shared mount point so that the
/// namespace mounts propagate into mount namespaces created later (and a
/// later unmount propagates too). Making a non-mount-point shared fails with
/// EINVAL, so bind-mount the directory on itself first.
fn make_shared(dir: &Path) -> Result<(), Error> {
    let shared = || {
        nix::mount::mount::<str, Path, str, str>(
            Some(""),
            dir,
            Some("none"),
            MsFlags::MS_SHARED | MsFlags::MS_REC,
            None,
        )
    };
    match shared() {
        Ok(()) => return Ok(()),
        Err(Errno::EINVAL) => {}
        Err(e) => return Err(Error::io("make shared mount", Some(dir), e)),
    }
    nix::mount::mount::<Path, Path, str, str>(
        Some(dir),
        dir,
        Some("none"),
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None,
    )
    .map_err(|e| Error::io("bind mount", Some(dir), e))?;
    shared().map_err(|e| Error::io("make shared mount", Some(dir), e))
}

/// Create a persistent namespace bind-mounted on `path` (the parent
/// directory must exist).
pub fn create_at(path: &Path) -> Result<NetNs, Error> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o000)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.kind() {
            io::ErrorKind::AlreadyExists => Error::Exists(path.to_path_buf()),
            _ => Error::io("create", Some(path), e),
        })?;

    let mounted = on_fresh_netns_thread(|| {
        nix::mount::mount::<str, Path, str, str>(
            Some(THREAD_SELF_NETNS),
            path,
            Some("none"),
            MsFlags::MS_BIND,
            None,
        )
        .map_err(|e| Error::io("bind mount netns on", Some(path), e))
    });
    let opened = mounted.and_then(|()| NetNs::open(path));
    if opened.is_err() {
        let _ = nix::mount::umount2(path, MntFlags::MNT_DETACH);
        let _ = fs::remove_file(path);
    }
    opened
}

/// Delete a named namespace like `ip netns delete`. A missing one is success.
pub fn delete_named(name: &str) -> Result<(), Error> {
    validate_name(name)?;
    delete_at(&named_path(name))
}

/// Unmount and remove a namespace file. A missing one is success.
pub fn delete_at(path: &Path) -> Result<(), Error> {
    // Lazy unmount: a process still inside keeps the namespace alive, but
    // the name goes away now. EINVAL means "not a mount point" (a stale
    // file), which we still remove.
    match nix::mount::umount2(path, MntFlags::MNT_DETACH) {
        Ok(()) | Err(Errno::EINVAL) | Err(Errno::ENOENT) => {}
        Err(e) => return Err(Error::io("unmount", Some(path), e)),
    }
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("remove", Some(path), e)),
    }
}

/// Names under `/run/netns`, sorted; empty if the directory does not exist.
pub fn list_named() -> Result<Vec<String>, Error> {
    let dir = Path::new(NETNS_RUN_DIR);
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("read directory", Some(dir), e)),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("read directory", Some(dir), e))?;
        let name = entry.file_name();
        if let Some(name) = OsStr::to_str(&name) {
            names.push(name.to_string());
        }
    }
    names.sort();
    Ok(names)
}

impl From<Error> for rcni_cni::CniError {
    fn from(e: Error) -> Self {
        rcni_cni::CniError::with_code(e.cni_code(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_validation() {
        assert!(validate_name("a-b_1").is_ok());
        for bad in ["", ".", "..", "a/b", "/x", "a\0b"] {
            let err = validate_name(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidName { .. }), "{bad:?}");
            assert_eq!(err.cni_code(), 100);
        }
    }

    #[test]
    fn named_path_is_under_run_netns() {
        assert_eq!(named_path("x"), PathBuf::from("/run/netns/x"));
    }

    #[test]
    fn error_codes_and_display() {
        let e = Error::NotFound("/run/netns/x".into());
        assert!(e.is_not_found());
        assert_eq!(e.cni_code(), 104);
        assert_eq!(
            e.to_string(),
            "network namespace /run/netns/x does not exist"
        );
        let e = Error::io("open", Some(Path::new("/x")), Errno::EACCES);
        assert_eq!(e.cni_code(), 100);
        assert_eq!(e.to_string(), "open /x: Permission denied (os error 13)");
        // Found by fuzzing: a 64 KB CNI_NETNS was reported as code 100.
        let long = "é".repeat(32 * 1024);
        let e = NetNs::open(&long).map(|_| ()).unwrap_err();
        assert_eq!(e.cni_code(), 104, "{e}");
        assert_eq!(NetNs::open("/etc/hostname/x").unwrap_err().cni_code(), 104);
    }
}
