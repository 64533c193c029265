//! The network's policy state on disk: `<dataDir>/<network>/state.json`,
//! read and written under an exclusive lock on `<dataDir>/<network>/lock`.
//!
//! It is what lets one pod's ADD or DEL, and `policy sync`, recompute the
//! whole network: the pods (labels, addresses, host interface), the
//! numbers allocated to identities and rule sets, the config last used (so
//! `sync` needs no config of its own) and what the backend last applied
//! (so a change writes only the difference).

use crate::compile::{Desired, Ids, PodView};
use crate::conf::Backend;
use crate::model::{Labels, NamedPorts};
use nix::fcntl::{Flock, FlockArg};
use rcni_cni::{CniError, ErrorCode};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

/// Where state lives unless `dataDir` says otherwise.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/cni/rcni-policy";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodRecord {
    pub container_id: String,
    pub ifname: String,
    pub namespace: String,
    /// The Kubernetes pod's name (K8S_POD_NAME), when its labels come from
    /// the agent: `policy sync` asks again by namespace and name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default)]
    pub labels: Labels,
    /// Named container ports, from the agent.
    #[serde(default, skip_serializing_if = "NamedPorts::is_empty")]
    pub ports: NamedPorts,
    #[serde(default)]
    pub addrs: Vec<IpAddr>,
    /// The pod's veth end in the node namespace.
    pub host_ifname: String,
    pub host_ifindex: u32,
}

impl PodRecord {
    /// The attachment's key in [`State::pods`].
    pub fn key(container_id: &str, ifname: &str) -> String {
        format!("{container_id}/{ifname}")
    }

    pub fn view(&self) -> PodView {
        PodView {
            namespace: self.namespace.clone(),
            labels: self.labels.clone(),
            ports: self.ports.clone(),
            addrs: self.addrs.clone(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct State {
    /// "ebpf" or "nftables": chosen by the first ADD of the network, kept
    /// while it has pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// The plugin config of the last ADD (without prevResult and runtime
    /// data), for `policy sync`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conf: Option<serde_json::Value>,
    #[serde(default)]
    pub pods: BTreeMap<String, PodRecord>,
    #[serde(default)]
    pub ids: Ids,
    /// What the last successful change enforced: DEL and GC fall back to
    /// it (less the pods they remove) when the policies cannot be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired: Option<Desired>,
    /// What the backend applied, in its own terms.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub applied: serde_json::Value,
}

impl State {
    /// The backend the network's pods use (eBPF when none is recorded).
    pub fn backend(&self) -> Backend {
        self.backend
            .as_deref()
            .and_then(Backend::parse)
            .unwrap_or(Backend::Ebpf)
    }

    pub fn views(&self) -> BTreeMap<String, PodView> {
        self.pods
            .iter()
            .map(|(k, p)| (k.clone(), p.view()))
            .collect()
    }
}

/// The locked state of one network; written back by [`Locked::save`].
pub struct Locked {
    dir: PathBuf,
    _lock: Flock<File>,
    pub state: State,
}

fn io_err(what: impl std::fmt::Display, e: impl std::fmt::Display) -> CniError {
    CniError::new(ErrorCode::IoFailure, format!("policy: {what}: {e}"))
}

impl Locked {
    /// Locks `<data_dir>/<network>` (created if missing) and reads its state.
    pub fn open(data_dir: &Path, network: &str) -> Result<Locked, CniError> {
        let dir = data_dir.join(network);
        std::fs::create_dir_all(&dir).map_err(|e| io_err(dir.display(), e))?;
        let lock_path = dir.join("lock");
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| io_err(lock_path.display(), e))?;
        let lock = Flock::lock(f, FlockArg::LockExclusive)
            .map_err(|(_, e)| io_err(format!("lock {}", lock_path.display()), e))?;
        // A writer killed before its rename left a temporary; every writer
        // holds this lock, so none is in use. Swept here, not only at the
        // next save: a DEL or GC with nothing to change saves nothing.
        rcni_statefile::sweep(&dir, None).map_err(|e| io_err(dir.display(), e))?;
        let path = dir.join("state.json");
        let state = match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| {
                CniError::new(
                    ErrorCode::DecodingFailure,
                    format!("policy: {}: {e}", path.display()),
                )
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => State::default(),
            Err(e) => return Err(io_err(path.display(), e)),
        };
        Ok(Locked {
            dir,
            _lock: lock,
            state,
        })
    }

    /// Only reads, if there is state: for CHECK and the CLI.
    pub fn existing(data_dir: &Path, network: &str) -> Result<Option<Locked>, CniError> {
        if !data_dir.join(network).join("state.json").exists() {
            return Ok(None);
        }
        Locked::open(data_dir, network).map(Some)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes the state (atomically: a kill leaves the old or the new);
    /// a network left without pods loses its state file.
    pub fn save(&mut self) -> Result<(), CniError> {
        let path = self.dir.join("state.json");
        if self.state.pods.is_empty() {
            // `state.json.tmp`: the temporary of earlier versions.
            for f in [path, self.dir.join("state.json.tmp")] {
                match std::fs::remove_file(&f) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io_err(f.display(), e)),
                }
            }
            // The lock file stays while we hold it; a later ADD reuses the
            // directory. Removing it here would let a waiter lock a file
            // that a third process no longer sees.
            return Ok(());
        }
        let bytes =
            serde_json::to_vec(&self.state).map_err(|e| CniError::internal(e.to_string()))?;
        rcni_statefile::write_replace(&path, &bytes, 0o644).map_err(|e| io_err(path.display(), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_round_trips_and_an_empty_network_leaves_no_state_file() {
        let d = tempfile::tempdir().unwrap();
        {
            let mut l = Locked::open(d.path(), "net").unwrap();
            assert_eq!(l.state, State::default());
            l.state.backend = Some("ebpf".into());
            l.state.pods.insert(
                PodRecord::key("c1", "eth0"),
                PodRecord {
                    container_id: "c1".into(),
                    ifname: "eth0".into(),
                    namespace: "default".into(),
                    name: None,
                    ports: Default::default(),
                    labels: [("app".to_string(), "web".to_string())].into(),
                    addrs: vec!["10.0.0.2".parse().unwrap()],
                    host_ifname: "veth1".into(),
                    host_ifindex: 7,
                },
            );
            l.save().unwrap();
        }
        // A writer killed before its rename left a temporary: never read,
        // swept by the next command to take the lock (every writer holds
        // it), even one that saves nothing.
        let killed = rcni_statefile::tmp_path(&d.path().join("net/state.json"));
        std::fs::write(&killed, b"{\"pods\":").unwrap();
        let mut l = Locked::existing(d.path(), "net").unwrap().unwrap();
        assert_eq!(l.state.pods.len(), 1);
        assert!(!killed.exists());
        l.save().unwrap();
        assert_eq!(l.state.backend.as_deref(), Some("ebpf"));
        l.state.pods.clear();
        l.save().unwrap();
        drop(l);
        assert!(Locked::existing(d.path(), "net").unwrap().is_none());
    }
}
