//! Network sysctls of a namespace.
//!
//! Files under `/proc/sys/net` resolve against the network namespace of the
//! thread that opens them, so both functions open the file on a thread inside
//! `ns` ([`NetNs::run`]); the caller's thread never switches.

use std::io::Write;
use std::path::PathBuf;

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
        .run(|| std::fs::read_to_string(&path))
        .map_err(|e| Error::netns(op(), e))?
        .map_err(|e| Error::io(op(), e))?;
    Ok(value.trim_end_matches('\n').to_string())
}

/// Write a sysctl in `ns`.
pub fn set(ns: &NetNs, key: &str, value: &str) -> Result<()> {
    let path = key_path(key)?;
    let op = || format!("set sysctl {key} to {value:?}");
    ns.run(|| {
        // One write(2): a sysctl parses each write as a whole value.
        let mut f = std::fs::OpenOptions::new().write(true).open(&path)?;
        f.write_all(value.as_bytes())
    })
    .map_err(|e| Error::netns(op(), e))?
    .map_err(|e| Error::io(op(), e))
}

/// Write several sysctls in `ns` from one thread (one namespace switch for
/// the lot: plugins set a handful per attachment). Every key is attempted;
/// the results are in the order of `pairs`.
///
/// The files are opened relative to one `/proc/sys/net` descriptor: the
/// lookup of `net` itself walks a dentry chain with an entry per network
/// namespace on the node (each has its own), which at a thousand pods costs
/// more than the rest of the write.
pub fn set_each(ns: &NetNs, pairs: &[(&str, &str)]) -> Vec<Result<()>> {
    if pairs.is_empty() {
        return Vec::new();
    }
    let write_all = || {
        let net = std::fs::File::open("/proc/sys/net");
        pairs
            .iter()
            .map(|(key, value)| {
                let op = || format!("set sysctl {key} to {value:?}");
                let path = key_path(key)?;
                // The one open's error, for every key (an io::Error is not Clone).
                let net = net.as_ref().map_err(|e| {
                    let e = e.raw_os_error().map_or_else(
                        || std::io::Error::new(e.kind(), e.to_string()),
                        std::io::Error::from_raw_os_error,
                    );
                    Error::io(op(), e)
                })?;
                let rel = path.strip_prefix("/proc/sys/net").unwrap_or(&path);
                let mut f = open_write_at(net, rel).map_err(|e| Error::io(op(), e))?;
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

fn open_write_at(dir: &std::fs::File, rel: &std::path::Path) -> std::io::Result<std::fs::File> {
    use nix::fcntl::{OFlag, openat};
    openat(
        dir,
        rel,
        OFlag::O_WRONLY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map(std::fs::File::from)
    .map_err(std::io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

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
