//! What multinet keeps between commands: the record of an attachment's
//! networks (DEL, CHECK and GC work from it, not from the conflists as they
//! are now) and the network-status document a pod's tooling reads.
//! Both are written whole (temporary file + rename): a kill never leaves a
//! torn record that DEL could not read.

use cnitool::conf::{ConfList, conf_list_from_bytes};
use cnitool::runtime::RuntimeConf;
use rcni_cni::skel::CmdArgs;
use rcni_cni::{CniError, CniResult, ErrorCode};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

/// One network of an attachment, as ADD ran it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Attachment {
    pub network: String,
    pub ifname: String,
    pub default: bool,
    /// The conflist as it was loaded.
    pub conflist: Value,
    pub args: Vec<[String; 2]>,
    pub capability_args: Map<String, Value>,
    #[serde(default)]
    pub default_route: Vec<IpAddr>,
}

impl Attachment {
    pub fn conf_list(&self) -> Result<ConfList, CniError> {
        let bytes =
            serde_json::to_vec(&self.conflist).map_err(|e| CniError::internal(e.to_string()))?;
        conf_list_from_bytes(&bytes, &format!("recorded network {:?}", self.network))
            .map_err(|e| CniError::config(e.to_string()))
    }

    pub fn runtime_conf(&self, args: &CmdArgs) -> RuntimeConf {
        RuntimeConf {
            container_id: args.container_id.clone(),
            netns: rcni_attach::sandbox(args),
            ifname: self.ifname.clone(),
            args: self.args.clone(),
            capability_args: self.capability_args.clone(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
    pub netns: String,
    pub attachments: Vec<Attachment>,
}

fn io_err(what: &str, path: &Path, e: io::Error) -> CniError {
    CniError::new(
        ErrorCode::IoFailure,
        format!("multinet: {what} {}: {e}", path.display()),
    )
}

fn file_of(dir: &Path, container_id: &str, ifname: &str) -> PathBuf {
    // Container IDs and interface names are validated by the skel: no '/'.
    dir.join(format!("{container_id}-{ifname}.json"))
}

impl Record {
    pub fn write(&self, dir: &Path) -> Result<(), CniError> {
        std::fs::create_dir_all(dir).map_err(|e| io_err("mkdir", dir, e))?;
        let path = file_of(dir, &self.container_id, &self.ifname);
        let data = serde_json::to_vec(self).map_err(|e| CniError::internal(e.to_string()))?;
        rcni_statefile::write_replace(&path, &data, 0o600).map_err(|e| io_err("write", &path, e))
    }

    pub fn read(dir: &Path, container_id: &str, ifname: &str) -> Result<Option<Record>, CniError> {
        let path = file_of(dir, container_id, ifname);
        match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).map(Some).map_err(|e| {
                CniError::new(
                    ErrorCode::DecodingFailure,
                    format!("multinet: record {}: {e}", path.display()),
                )
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err("read", &path, e)),
        }
    }

    /// Removes the record (or the status file: both are named by `file_of`); absent is fine.
    /// So do the temporaries of a writer of this attachment killed before
    /// its rename (no other command of the attachment runs meanwhile:
    /// spec, "Concurrency"; GC's sweep of the directory waits for an age).
    pub fn remove(dir: &Path, container_id: &str, ifname: &str) -> Result<(), CniError> {
        let path = file_of(dir, container_id, ifname);
        rcni_statefile::sweep_of(&path).map_err(|e| io_err("sweep", &path, e))?;
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err("remove", &path, e)),
            _ => Ok(()),
        }
    }

    /// Every readable record; temporaries a killed writer left go first
    /// (GC is the command that lists the directory).
    pub fn list(dir: &Path) -> Vec<Record> {
        let _ = rcni_statefile::sweep(dir, Some(std::time::Duration::from_secs(60)));
        let Ok(rd) = std::fs::read_dir(dir) else {
            return Vec::new();
        };
        rd.flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
            .filter_map(|e| std::fs::read(e.path()).ok())
            .filter_map(|b| serde_json::from_slice(&b).ok())
            .collect()
    }
}

/// One entry of the network-status document, in the shape of Multus'
/// `k8s.v1.cni.cncf.io/network-status` annotation.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NetworkStatus {
    pub name: String,
    pub interface: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ips: Vec<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
    pub default: bool,
    #[serde(default)]
    pub dns: Value,
}

impl NetworkStatus {
    pub fn of(att: &crate::state::Attachment, r: &CniResult) -> NetworkStatus {
        let iface = r
            .interfaces
            .iter()
            .position(|i| i.name == att.ifname && !i.sandbox.is_empty());
        let ips = r
            .ips
            .iter()
            .filter(|ip| iface.is_none() || ip.interface.is_none() || ip.interface == iface)
            .map(|ip| ip.address.ip().to_string())
            .collect();
        let dns = serde_json::to_value(&r.dns).unwrap_or(Value::Null);
        NetworkStatus {
            name: att.network.clone(),
            interface: att.ifname.clone(),
            ips,
            mac: iface
                .map(|i| r.interfaces[i].mac.clone())
                .unwrap_or_default(),
            default: att.default,
            dns: if r.dns.is_empty() {
                Value::Object(Map::new())
            } else {
                dns
            },
        }
    }
}

pub fn write_status(
    dir: &Path,
    container_id: &str,
    ifname: &str,
    status: &[NetworkStatus],
) -> Result<(), CniError> {
    std::fs::create_dir_all(dir).map_err(|e| io_err("mkdir", dir, e))?;
    let path = file_of(dir, container_id, ifname);
    let data = serde_json::to_vec_pretty(status).map_err(|e| CniError::internal(e.to_string()))?;
    rcni_statefile::write_replace(&path, &data, 0o644).map_err(|e| io_err("write", &path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DEL's removal of an attachment's record also removes what a writer
    /// of that record killed before its rename left, and nothing of
    /// another attachment's.
    #[test]
    fn remove_takes_a_killed_writers_temporary() {
        let d = tempfile::tempdir().unwrap();
        let killed = rcni_statefile::tmp_path(&file_of(d.path(), "c1", "eth0"));
        let other = rcni_statefile::tmp_path(&file_of(d.path(), "c2", "eth0"));
        std::fs::write(&killed, b"{").unwrap();
        std::fs::write(&other, b"{").unwrap();
        Record::remove(d.path(), "c1", "eth0").unwrap();
        assert!(!killed.exists());
        assert!(other.exists());
        Record::remove(d.path(), "c1", "eth0").unwrap();
    }
}
