//! The pods' assignments on disk, so an agent restart neither loses a pod's
//! address nor hands it to a second pod:
//! `{"version": 1, "allocations": [{"containerID", "ifName", "ip",
//! "interface", "mismatch"?}], "cooling": [{"ip", "releasedAt"}]}`
//! (`releasedAt` in unix milliseconds; `mismatch` only on an assignment
//! kept although the cloud's view lacks its address). A missing file is an empty checkpoint; a corrupt one is
//! an error naming the file, and the agent refuses to start rather than
//! guess (guessing could double-assign).

use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

pub const VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub version: u32,
    #[serde(default)]
    pub allocations: Vec<Entry>,
    #[serde(default)]
    pub cooling: Vec<Cooling>,
}

impl Default for Checkpoint {
    fn default() -> Self {
        Checkpoint {
            version: VERSION,
            allocations: Vec::new(),
            cooling: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    #[serde(rename = "containerID")]
    pub container_id: String,
    #[serde(rename = "ifName")]
    pub if_name: String,
    pub ip: Ipv4Addr,
    /// The cloud interface that carried `ip` when it was written (the
    /// cloud's view wins on restore).
    pub interface: String,
    /// Set when the cloud's view did not show `ip` on any of the node's
    /// interfaces at the agent's start and it could not be assigned back:
    /// why. The pod keeps its address all the same (it still runs with
    /// it); the field goes once the cloud shows the address again or the
    /// pod is released.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mismatch: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cooling {
    pub ip: Ipv4Addr,
    #[serde(rename = "releasedAt")]
    pub released_at: u64,
}

/// A checkpoint that cannot be read or written; the message names the
/// file.
#[derive(Debug, thiserror::Error)]
#[error("checkpoint {path}: {reason}")]
pub struct CheckpointError {
    pub path: PathBuf,
    pub reason: String,
}

fn err(path: &Path, reason: impl ToString) -> CheckpointError {
    CheckpointError {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub fn from_unix_ms(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
}

/// The checkpoint at `path`: empty if there is none.
pub fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
    let data = match std::fs::read(path) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Checkpoint::default()),
        Err(e) => return Err(err(path, e)),
    };
    let cp: Checkpoint =
        serde_json::from_slice(&data).map_err(|e| err(path, format!("corrupt: {e}")))?;
    if cp.version != VERSION {
        return Err(err(
            path,
            format!(
                "version {} is not one this agent reads ({VERSION})",
                cp.version
            ),
        ));
    }
    Ok(cp)
}

/// Writes `cp` to `path` atomically: a temporary file in the same
/// directory, renamed over the old one, so a crash leaves the old or the
/// new checkpoint, never half of one. Not fsynced: it has to survive the
/// agent, not the node (a rebooted node has no pods left to protect).
pub fn save(path: &Path, cp: &Checkpoint) -> Result<(), CheckpointError> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| err(path, e))?;
    let name = path
        .file_name()
        .ok_or_else(|| err(path, "not a file name"))?
        .to_string_lossy();
    let tmp = dir.join(format!(".{name}.tmp"));
    let data = serde_json::to_vec(cp).map_err(|e| err(path, e))?;
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&data)?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        err(path, e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_is_empty_round_trip_and_corrupt_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/pool.json");
        assert_eq!(load(&path).unwrap(), Checkpoint::default());
        let cp = Checkpoint {
            version: 1,
            allocations: vec![Entry {
                container_id: "c1".into(),
                if_name: "eth0".into(),
                ip: Ipv4Addr::new(10, 0, 0, 5),
                interface: "eni-1".into(),
                mismatch: None,
            }],
            cooling: vec![Cooling {
                ip: Ipv4Addr::new(10, 0, 0, 6),
                released_at: 1_700_000_000_000,
            }],
        };
        save(&path, &cp).unwrap();
        assert_eq!(load(&path).unwrap(), cp);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(r#""containerID":"c1""#), "{text}");
        assert!(text.contains(r#""releasedAt":1700000000000"#), "{text}");
        // No "mismatch" unless there is one, so older agents read it as
        // they wrote it.
        assert!(!text.contains("mismatch"), "{text}");
        // No temporary file left beside it.
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        std::fs::write(&path, b"{\"version\": 1, \"allocations\": [").unwrap();
        let e = load(&path).unwrap_err().to_string();
        assert!(e.contains("pool.json") && e.contains("corrupt"), "{e}");
        std::fs::write(&path, b"{\"version\": 2}").unwrap();
        assert!(load(&path).unwrap_err().to_string().contains("version 2"));
    }
}
