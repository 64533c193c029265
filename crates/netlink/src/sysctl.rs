//! Network sysctls of a namespace.
//!
//! Files under `/proc/sys/net` resolve against the network namespace of the
//! thread that opens them, so these functions open the file on a thread inside
//! `ns` ([`NetNs::run`]); the caller's thread never switches.

use rustix::fs::OFlags;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use rcni_netns::NetNs;

use crate::{Error, Result};

/// Map `net.ipv4.ip_forward` or `net/ipv4/conf/eth0/arp_notify` to its file
/// under `/proc/sys`. Dotted keys cannot name an interface with a dot in
/// its name (`eth0.100`); use the slash form for those, as with sysctl(8).
pub fn key_path(key: &str) -> Result<PathBuf> {
    let invalid =
        |why: &str| Error::other(format!("sysctl {key:?}"), format!("invalid key: {why}"));
    let parts: Vec<&str> = if key.contains('/') {
        key.split('/').collect()
    } else {
        key.split('.').collect()
    };
    if key.contains('\0') {
        return Err(invalid("contains NUL"));
    }
    if parts.first() != Some(&"net") {
        return Err(invalid("only net.* keys are namespaced"));
    }
    if parts.len() < 2 {
        return Err(invalid("too short"));
    }
    if parts
        .iter()
        .any(|p| p.is_empty() || *p == "." || *p == "..")
    {
        return Err(invalid("empty, '.' or '..' component"));
    }
    let mut path = PathBuf::from("/proc/sys");
    path.extend(parts);
    Ok(path)
}

/// Read a sysctl in `ns`, without the trailing newline.
pub fn get(ns: &NetNs, key: &str) -> Result<String> {
    let path = key_path(key)?;
    let op = || format!("read sysctl {key}");
    let value = ns
        .run(|| read_here(&path))
        .map_err(|e| Error::netns(op(), e))?
        .map_err(|e| Error::io(op(), e))?;
    Ok(value.trim_end_matches('\n').to_string())
}

/// Write a sysctl in `ns`.
pub fn set(ns: &NetNs, key: &str, value: &str) -> Result<()> {
    let path = key_path(key)?;
    let op = || format!("set sysctl {key} to {value:?}");
    ns.run(|| write_here(&path, value))
        .map_err(|e| Error::netns(op(), e))?
        .map_err(|e| Error::io(op(), e))
}

/// Write several sysctls in `ns` from one thread (one namespace switch for
/// the lot: plugins set a handful per attachment). Every key is attempted;
/// the results are in the order of `pairs`.
pub fn set_each(ns: &NetNs, pairs: &[(&str, &str)]) -> Vec<Result<()>> {
    if pairs.is_empty() {
        return Vec::new();
    }
    let write_all = || {
        let net = net_dir();
        pairs
            .iter()
            .map(|(key, value)| {
                let op = || format!("set sysctl {key} to {value:?}");
                let path = key_path(key)?;
                // The one open's error, for every key (an io::Error is not Clone).
                let net = net
                    .as_ref()
                    .map_err(|e| Error::io(op(), copy_io_error(e)))?;
                let mut f = open_at(net, &path, true).map_err(|e| Error::io(op(), e))?;
                f.write_all(value.as_bytes())
                    .map_err(|e| Error::io(op(), e))
            })
            .collect::<Vec<_>>()
    };
    match ns.run(write_all) {
        Ok(v) => v,
        Err(e) => {
            let msg = e.to_string();
            pairs
                .iter()
                .map(|(k, _)| Err(Error::other(format!("set sysctl {k}"), msg.clone())))
                .collect()
        }
    }
}

/// Read the sysctl at `path` (from [`key_path`]) in the calling thread's
/// network namespace, trailing newline included.
pub fn read_here(path: &Path) -> std::io::Result<String> {
    std::io::read_to_string(open_at(&net_dir()?, path, false)?)
}

/// Write the sysctl at `path` (from [`key_path`]) in the calling thread's
/// network namespace, in one write(2): a sysctl parses each write as a whole
/// value.
pub fn write_here(path: &Path, value: &str) -> std::io::Result<()> {
    open_at(&net_dir()?, path, true)?.write_all(value.as_bytes())
}

/// `/proc/sys/net` of the calling thread's network namespace (a sysctl file
/// resolves against the namespace of the thread that looks it up).
///
/// Looked up in a procfs instance of this process's own where the kernel
/// gives one, else in `/proc`. In the node's `/proc` each network namespace
/// that has used its sysctls has its own `net` entry under `sys`, all with
/// the same name and parent, so the lookup compares against every one: an
/// entry per pod, about 0.1 ms from the node's namespace and 0.3 ms from a
/// new pod's at a thousand pods, on every ADD. A new instance (fsopen(2),
/// Linux 5.2; its own superblock and dentries since 5.8) holds only the
/// entries of the namespaces this process looked in. It is mounted nowhere
/// (fsmount(2) gives a detached mount, gone with the process) and costs
/// about 25 us; anything that refuses it (an older kernel, a seccomp filter,
/// an LSM, no CAP_SYS_ADMIN over the process's PID namespace) leaves `/proc`.
fn net_dir() -> std::io::Result<File> {
    static PRIVATE: OnceLock<Option<OwnedFd>> = OnceLock::new();
    let private = PRIVATE.get_or_init(|| {
        use rustix::mount::{
            FsMountFlags, FsOpenFlags, MountAttrFlags, fsconfig_create, fsmount, fsopen,
        };
        let fs = fsopen("proc", FsOpenFlags::FSOPEN_CLOEXEC).ok()?;
        fsconfig_create(&fs).ok()?;
        let attrs = MountAttrFlags::MOUNT_ATTR_NOSUID
            | MountAttrFlags::MOUNT_ATTR_NODEV
            | MountAttrFlags::MOUNT_ATTR_NOEXEC;
        fsmount(&fs, FsMountFlags::FSMOUNT_CLOEXEC, attrs).ok()
    });
    if let Some(Ok(net)) = private
        .as_ref()
        .map(|m| open_in(m, "sys/net", OFlags::RDONLY | OFlags::DIRECTORY))
    {
        return Ok(net);
    }
    File::open("/proc/sys/net")
}

/// Open `path` (from [`key_path`]) below the `net` directory `net`.
fn open_at(net: &File, path: &Path, write: bool) -> std::io::Result<File> {
    let rel = path.strip_prefix("/proc/sys/net").unwrap_or(path);
    let access = if write {
        OFlags::WRONLY
    } else {
        OFlags::RDONLY
    };
    open_in(net, rel, access)
}

fn open_in(dir: impl AsFd, path: impl rustix::path::Arg, flags: OFlags) -> std::io::Result<File> {
    rustix::fs::openat(
        dir,
        path,
        flags | OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map(File::from)
    .map_err(std::io::Error::from)
}

fn copy_io_error(e: &std::io::Error) -> std::io::Error {
    e.raw_os_error().map_or_else(
        || std::io::Error::new(e.kind(), e.to_string()),
        std::io::Error::from_raw_os_error,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lookup goes through a procfs instance of the process's own (a
    /// device of its own) where the kernel allows one; as root it does.
    #[test]
    fn sysctls_resolve_in_a_private_procfs() {
        use std::os::unix::fs::MetadataExt;
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let private = net_dir().unwrap().metadata().unwrap().dev();
        let node = std::fs::metadata("/proc/sys/net").unwrap().dev();
        assert_ne!(private, node, "looked up in the node's /proc");
        let path = key_path("net.ipv4.ip_forward").unwrap();
        assert_eq!(
            read_here(&path).unwrap(),
            std::fs::read_to_string(&path).unwrap()
        );
    }

    #[test]
    fn dotted_and_slashed_keys() {
        assert_eq!(
            key_path("net.ipv4.ip_forward").unwrap(),
            PathBuf::from("/proc/sys/net/ipv4/ip_forward")
        );
        assert_eq!(
            key_path("net/ipv4/conf/eth0.100/arp_notify").unwrap(),
            PathBuf::from("/proc/sys/net/ipv4/conf/eth0.100/arp_notify")
        );
    }

    #[test]
    fn rejects_bad_keys() {
        for bad in [
            "",
            "net",
            "kernel.hostname",
            "vm/swappiness",
            "net/../kernel/hostname",
            "net.ipv4..ip_forward",
            "net/ipv4/./ip_forward",
            "/net/ipv4/ip_forward",
            "net/ipv4/ip_forward/",
            "netx.ipv4.ip_forward",
            "net.ipv4.ip_forward\0",
        ] {
            let err = key_path(bad).unwrap_err();
            assert!(err.to_string().contains("invalid key"), "{bad:?}: {err}");
            assert_eq!(err.cni_code(), 100);
        }
    }
}
