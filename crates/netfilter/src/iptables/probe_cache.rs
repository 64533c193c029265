//! The per-boot answer of the iptables probe ([`super::supported`]).
//!
//! One file per tool in [`DEFAULT_DIR`] (on tmpfs: gone at reboot), or in
//! `RCNI_PROBE_DIR` (empty: no cache). Only a working iptables is kept, so
//! the file holds just a key, which says "works" while it matches; the key
//! is the tool's resolved file (symlinks followed, so switching
//! `update-alternatives` between iptables-nft and -legacy changes it) with
//! its inode, size and modification time, and the caller's user namespace
//! (a rootless runtime's probe is its own). A key that differs, or a file
//! that cannot be read or written, means the probe runs as before: the
//! cache never changes an answer, only saves asking again.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

pub const DEFAULT_DIR: &str = "/run/rcni/probe";
pub const DIR_ENV: &str = "RCNI_PROBE_DIR";

pub struct Cache {
    file: PathBuf,
    key: String,
}

/// What identifies the answer: the tool's resolved file and the user
/// namespace asking.
fn key(tool: &Path) -> Option<String> {
    let real = std::fs::canonicalize(tool).ok()?;
    let m = std::fs::metadata(&real).ok()?;
    let userns = std::fs::metadata("/proc/self/ns/user")
        .map(|u| u.ino())
        .unwrap_or(0);
    Some(format!(
        "{} dev={} ino={} size={} mtime={}.{} userns={userns}\n",
        real.display(),
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime(),
        m.mtime_nsec()
    ))
}

fn dir() -> Option<PathBuf> {
    match std::env::var_os(DIR_ENV) {
        Some(d) if d.is_empty() => None,
        Some(d) => Some(PathBuf::from(d)),
        None => Some(PathBuf::from(DEFAULT_DIR)),
    }
}

impl Cache {
    /// The cache of `name`'s probe with the tool found at `tool`; `None`
    /// where caching is off or the tool cannot be identified.
    pub fn new(name: &str, tool: &Path) -> Option<Cache> {
        Some(Cache {
            file: dir()?.join(name),
            key: key(tool)?,
        })
    }

    /// Whether this tool was found working earlier in the boot.
    pub fn works(&self) -> bool {
        std::fs::read_to_string(&self.file).is_ok_and(|k| k == self.key)
    }

    /// Keeps "works" for this key; failures are ignored (the next call
    /// probes again). Replaced whole (rcni_statefile), so a reader racing
    /// a writer sees one key or the other.
    pub fn put_works(&self) {
        if let Some(dir) = self.file.parent()
            && std::fs::create_dir_all(dir).is_ok()
        {
            let _ = rcni_statefile::write_replace(&self.file, self.key.as_bytes(), 0o644);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_and_rekeyed_when_the_tool_changes() {
        let dir = tempfile::tempdir().unwrap();
        let tool = dir.path().join("iptables");
        std::fs::write(&tool, "#!/bin/sh\n").unwrap();
        let c = Cache {
            file: dir.path().join("cache/iptables"),
            key: key(&tool).unwrap(),
        };
        assert!(!c.works());
        c.put_works();
        assert!(c.works());
        // Another tool (a reinstall, an alternatives switch) is another key.
        std::fs::write(&tool, "#!/bin/sh\nexit 1\n").unwrap();
        let again = Cache {
            file: c.file.clone(),
            key: key(&tool).unwrap(),
        };
        assert_ne!(again.key, c.key);
        assert!(!again.works());
        // Nothing but the cache file is left behind.
        let left: Vec<_> = std::fs::read_dir(dir.path().join("cache"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("iptables")]);
    }
}
