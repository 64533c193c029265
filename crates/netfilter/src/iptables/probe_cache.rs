//! The per-boot answer of the iptables probe ([`super::supported`]).
//!
//! One file per tool in [`DEFAULT_DIR`] (on tmpfs: gone at reboot), or in
//! `RCNI_PROBE_DIR` (empty: no cache). It holds a key and the answer; the
//! key is the tool's resolved file (symlinks followed, so switching
//! `update-alternatives` between iptables-nft and -legacy changes it) with
//! its inode, size and modification time, and the caller's user namespace
//! (a rootless runtime's probe is its own). A key that differs, or a file
//! that cannot be read or written, means the probe runs as before: the
//! cache never changes an answer, only saves asking again.

use std::io::Write;
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
pub fn key(tool: &Path) -> Option<String> {
    let real = std::fs::canonicalize(tool).ok()?;
    let m = std::fs::metadata(&real).ok()?;
    let userns = std::fs::metadata("/proc/self/ns/user")
        .map(|u| u.ino())
        .unwrap_or(0);
    Some(format!(
        "{} dev={} ino={} size={} mtime={}.{} userns={userns}",
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

    /// The answer kept for this key.
    pub fn get(&self) -> Option<bool> {
        let text = std::fs::read_to_string(&self.file).ok()?;
        parse(&text, &self.key)
    }

    /// Keeps `works` for this key; failures are ignored (the next call
    /// probes again). Written to a temporary file and renamed, so a reader
    /// racing a writer sees a whole file or none.
    pub fn put(&self, works: bool) {
        let Some(dir) = self.file.parent() else {
            return;
        };
        if std::fs::create_dir_all(dir).is_err() {
            return;
        }
        let Ok(mut tmp) = tempfile_in(dir) else {
            return;
        };
        let ok = tmp.1.write_all(render(&self.key, works).as_bytes()).is_ok();
        if !ok || std::fs::rename(&tmp.0, &self.file).is_err() {
            let _ = std::fs::remove_file(&tmp.0);
        }
    }
}

/// A new file in `dir` only this process writes (O_EXCL, named by pid and
/// a counter).
fn tempfile_in(dir: &Path) -> std::io::Result<(PathBuf, std::fs::File)> {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let p = dir.join(format!(".tmp.{}.{n}", std::process::id()));
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&p)?;
    Ok((p, f))
}

fn render(key: &str, works: bool) -> String {
    format!("{key}\n{}\n", if works { "works" } else { "fails" })
}

fn parse(text: &str, key: &str) -> Option<bool> {
    let mut lines = text.lines();
    if lines.next()? != key {
        return None;
    }
    match lines.next()? {
        "works" => Some(true),
        "fails" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answer_only_for_its_key() {
        let k = "/usr/sbin/xtables-nft-multi dev=1 ino=2 size=3 mtime=4.5 userns=6";
        assert_eq!(parse(&render(k, true), k), Some(true));
        assert_eq!(parse(&render(k, false), k), Some(false));
        assert_eq!(parse(&render(k, true), "other"), None);
        assert_eq!(parse("", k), None);
        assert_eq!(parse(&format!("{k}\nmaybe\n"), k), None);
    }

    #[test]
    fn kept_and_rekeyed_when_the_tool_changes() {
        let dir = tempfile::tempdir().unwrap();
        let tool = dir.path().join("iptables");
        std::fs::write(&tool, "#!/bin/sh\n").unwrap();
        let c = Cache {
            file: dir.path().join("cache/iptables"),
            key: key(&tool).unwrap(),
        };
        assert_eq!(c.get(), None);
        c.put(true);
        assert_eq!(c.get(), Some(true));
        // Another tool (a reinstall, an alternatives switch) is another key.
        std::fs::write(&tool, "#!/bin/sh\nexit 1\n").unwrap();
        let again = Cache {
            file: c.file.clone(),
            key: key(&tool).unwrap(),
        };
        assert_ne!(again.key, c.key);
        assert_eq!(again.get(), None);
        // Nothing but the cache file is left behind.
        let left: Vec<_> = std::fs::read_dir(dir.path().join("cache"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("iptables")]);
    }
}
