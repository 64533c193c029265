//! Where the node list comes from. One interface: the cluster file here,
//! the Kubernetes API (Node objects and their annotations) in `k8s`.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

pub mod cluster;
pub mod k8s;

use self::cluster::{Cluster, ClusterError};

pub trait Registry {
    /// The cluster as the source has it now.
    fn load(&mut self) -> Result<Cluster, ClusterError>;

    /// Cheap: whether the source may have changed since the last `load`.
    /// A false positive costs one reconcile that changes nothing.
    fn maybe_changed(&mut self) -> bool;

    /// Where the description comes from, for messages.
    fn describe(&self) -> String;
}

/// A JSON cluster file, re-read when its identity, size or mtime changes
/// (an editor's rename-over and an in-place write both show).
pub struct FileRegistry {
    path: PathBuf,
    seen: Option<Stamp>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    ino: u64,
    len: u64,
    mtime: Option<SystemTime>,
}

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        ino: m.ino(),
        len: m.len(),
        mtime: m.modified().ok(),
    })
}

impl FileRegistry {
    pub fn new(path: impl Into<PathBuf>) -> FileRegistry {
        FileRegistry {
            path: path.into(),
            seen: None,
        }
    }
}

impl Registry for FileRegistry {
    fn load(&mut self) -> Result<Cluster, ClusterError> {
        self.seen = stamp(&self.path);
        let text = std::fs::read_to_string(&self.path).map_err(|e| {
            ClusterError::Invalid(format!("cannot read {}: {e}", self.path.display()))
        })?;
        let at = |m| format!("{}: {m}", self.path.display());
        cluster::parse(&text).map_err(|e| match e {
            ClusterError::Invalid(m) => ClusterError::Invalid(at(m)),
            ClusterError::NotImplemented(m) => ClusterError::NotImplemented(at(m)),
            ClusterError::ThisNode(m) => ClusterError::ThisNode(at(m)),
        })
    }

    fn maybe_changed(&mut self) -> bool {
        stamp(&self.path) != self.seen
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}
