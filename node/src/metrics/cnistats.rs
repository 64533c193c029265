//! The CNI commands the plugins ran: each plugin's skel appends one line
//! `plugin command code micros` to [`FILE`] in the stats directory, which
//! exists only when the agent made it (rcni_cni::skel::record); the agent
//! reads the new lines, keeps an offset, and rotates the file when it is
//! big.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::text::Histogram;

/// The plugins' default (`RCNI_CNI_STATS_DIR` overrides it for them).
pub const DEFAULT_DIR: &str = "/run/rcni/cni-stats";

/// The file the plugins append to.
pub const FILE: &str = "commands";
/// The file renamed away, read to its end one pass later: a plugin that
/// opened it before the rename still writes into it.
const ROTATED: &str = "commands.1";
/// The file is rotated past this size.
const ROTATE_AT: u64 = 1 << 20;

/// Buckets for a plugin's command: a loopback ADD takes a millisecond, a
/// bridge ADD tens, a delegated dhcp lease seconds.
pub static BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// One parsed line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    pub plugin: String,
    pub command: String,
    pub code: u32,
    pub micros: u64,
}

pub fn parse_line(l: &str) -> Option<Line> {
    let mut it = l.split_ascii_whitespace();
    let plugin = it.next()?;
    let command = it.next()?;
    let code = it.next()?.parse().ok()?;
    let micros = it.next()?.parse().ok()?;
    if it.next().is_some()
        || !matches!(
            command,
            "ADD" | "DEL" | "CHECK" | "STATUS" | "GC" | "VERSION"
        )
        || plugin.len() > 64
        || !plugin
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return None;
    }
    Some(Line {
        plugin: plugin.into(),
        command: command.into(),
        code,
        micros,
    })
}

/// The counts so far.
#[derive(Debug, Default)]
pub struct CniStats {
    dir: PathBuf,
    offset: u64,
    /// The rotated file's offset, while it is waiting to be finished.
    rotated: Option<u64>,
    pub commands: BTreeMap<(String, String, u32), u64>,
    pub durations: BTreeMap<(String, String), Histogram>,
}

impl CniStats {
    pub fn new(dir: &Path) -> CniStats {
        CniStats {
            dir: dir.to_path_buf(),
            ..Default::default()
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads what the plugins appended since the last call.
    pub fn collect(&mut self) {
        if let Some(off) = self.rotated.take() {
            let old = self.dir.join(ROTATED);
            self.read_from(&old, off);
            let _ = std::fs::remove_file(&old);
        }
        let path = self.dir.join(FILE);
        self.offset = self.read_from(&path, self.offset);
        if self.offset >= ROTATE_AT && std::fs::rename(&path, self.dir.join(ROTATED)).is_ok() {
            self.rotated = Some(self.offset);
            self.offset = 0;
        }
    }

    /// Counts the whole lines of `path` past `offset`; returns the offset
    /// after the last whole line (a line being written is read next time).
    fn read_from(&mut self, path: &Path, offset: u64) -> u64 {
        let Ok(mut f) = std::fs::File::open(path) else {
            return 0;
        };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        // Shorter than we read: someone else truncated or replaced it.
        let offset = if len < offset { 0 } else { offset };
        let mut buf = Vec::new();
        if f.seek(SeekFrom::Start(offset)).is_err() || f.read_to_end(&mut buf).is_err() {
            return offset;
        }
        let whole = buf.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        for l in String::from_utf8_lossy(&buf[..whole]).lines() {
            if let Some(l) = parse_line(l) {
                self.add(l);
            }
        }
        offset + whole as u64
    }

    pub fn add(&mut self, l: Line) {
        *self
            .commands
            .entry((l.plugin.clone(), l.command.clone(), l.code))
            .or_default() += 1;
        self.durations
            .entry((l.plugin, l.command))
            .or_insert_with(|| Histogram::new(&BUCKETS))
            .observe(l.micros as f64 / 1e6);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn lines_parse_and_junk_does_not() {
        assert_eq!(
            parse_line("bridge ADD 0 12345"),
            Some(Line {
                plugin: "bridge".into(),
                command: "ADD".into(),
                code: 0,
                micros: 12345
            })
        );
        for bad in [
            "",
            "bridge",
            "bridge ADD x 1",
            "bridge ADD 0",
            "bridge FOO 0 1",
            "bridge ADD 0 1 more",
            "br\"idge ADD 0 1",
        ] {
            assert_eq!(parse_line(bad), None, "{bad}");
        }
    }

    #[test]
    fn only_new_whole_lines_count_and_the_file_rotates() {
        let d = tempfile::tempdir().unwrap();
        let mut s = CniStats::new(d.path());
        s.collect();
        assert!(s.commands.is_empty());
        let path = d.path().join(FILE);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&path)
            .unwrap();
        f.write_all(b"bridge ADD 0 1000\nbridge ADD 7 2000\nptp DE")
            .unwrap();
        s.collect();
        assert_eq!(s.commands[&("bridge".into(), "ADD".into(), 0)], 1);
        assert_eq!(s.commands[&("bridge".into(), "ADD".into(), 7)], 1);
        assert_eq!(s.commands.len(), 2);
        f.write_all(b"L 0 5\n").unwrap();
        s.collect();
        s.collect();
        assert_eq!(s.commands[&("ptp".into(), "DEL".into(), 0)], 1);
        assert_eq!(s.durations[&("bridge".into(), "ADD".into())].count(), 2);

        // Past the limit: renamed, a writer that still holds it is read
        // once more, then it is gone and the plugins make a new one.
        let big = "loopback ADD 0 10\n".repeat((ROTATE_AT as usize / 18) + 1);
        f.write_all(big.as_bytes()).unwrap();
        s.collect();
        let n = s.commands[&("loopback".into(), "ADD".into(), 0)];
        assert!(!path.exists());
        f.write_all(b"loopback DEL 0 10\n").unwrap();
        drop(f);
        std::fs::write(&path, "loopback CHECK 0 10\n").unwrap();
        s.collect();
        assert_eq!(s.commands[&("loopback".into(), "ADD".into(), 0)], n);
        assert_eq!(s.commands[&("loopback".into(), "DEL".into(), 0)], 1);
        assert_eq!(s.commands[&("loopback".into(), "CHECK".into(), 0)], 1);
        assert!(!d.path().join(ROTATED).exists());
    }
}
