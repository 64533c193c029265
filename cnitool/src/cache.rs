//! libcni's result cache: `<dir>/results/<net>-<containerID>-<ifname>`,
//! `{"kind":"cniCacheV1", ...}`, so CHECK and DEL get prevResult and GC finds
//! stale attachments; files written by libcni runtimes are read as well.

use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

pub const KIND: &str = "cniCacheV1";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CachedInfo {
    pub kind: String,
    #[serde(rename = "containerId")]
    pub container_id: String,
    /// The list's bytes; Go's `[]byte` is base64 in JSON.
    #[serde(with = "b64")]
    pub config: Vec<u8>,
    #[serde(rename = "ifName")]
    pub ifname: String,
    #[serde(rename = "networkName")]
    pub network_name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub netns: String,
    #[serde(default, rename = "cniArgs", skip_serializing_if = "Vec::is_empty")]
    pub cni_args: Vec<[String; 2]>,
    #[serde(
        default,
        rename = "capabilityArgs",
        skip_serializing_if = "Map::is_empty"
    )]
    pub capability_args: Map<String, Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
}

mod b64 {
    use super::*;
    pub fn serialize<S: serde::Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(b))
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = Option::<String>::deserialize(d)?.unwrap_or_default();
        base64::engine::general_purpose::STANDARD
            .decode(s)
            .map_err(serde::de::Error::custom)
    }
}

pub fn results_dir(cache_dir: &Path) -> PathBuf {
    cache_dir.join("results")
}

pub fn path(cache_dir: &Path, net: &str, container_id: &str, ifname: &str) -> PathBuf {
    results_dir(cache_dir).join(format!("{net}-{container_id}-{ifname}"))
}

/// Writes the attachment's cache file as libcni does (0600 in a 0700
/// directory), visible under its name only once complete: a kill leaves
/// the old file or the new one, plus at most a temporary that DEL and GC
/// sweep. libcni reads every file in `results/` (GetCachedAttachments), so
/// a temporary must not outlive the next command of its attachment.
pub fn write(cache_dir: &Path, info: &CachedInfo) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let p = path(
        cache_dir,
        &info.network_name,
        &info.container_id,
        &info.ifname,
    );
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(results_dir(cache_dir))?;
    let data = serde_json::to_vec(info).map_err(std::io::Error::other)?;
    rcni_statefile::write_replace(&p, &data, 0o600)
}

/// The cached attachment, `None` if absent or unreadable (libcni ignores a
/// cache it cannot read).
pub fn read(cache_dir: &Path, net: &str, container_id: &str, ifname: &str) -> Option<CachedInfo> {
    let data = std::fs::read(path(cache_dir, net, container_id, ifname)).ok()?;
    serde_json::from_slice::<CachedInfo>(&data)
        .ok()
        .filter(|c| c.kind == KIND)
}

pub fn remove(
    cache_dir: &Path,
    net: &str,
    container_id: &str,
    ifname: &str,
) -> std::io::Result<()> {
    let p = path(cache_dir, net, container_id, ifname);
    match std::fs::remove_file(&p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    // What a killed ADD of this attachment left (the runtime runs no other
    // command of the attachment beside this one).
    rcni_statefile::sweep_of(&p).map(|_| ())
}

/// Removes the temporaries that killed writers left in `results/` long
/// enough ago that no live writer can own them (other attachments' ADDs may
/// be writing now).
pub fn sweep(cache_dir: &Path) -> std::io::Result<usize> {
    rcni_statefile::sweep(&results_dir(cache_dir), Some(rcni_statefile::ORPHAN_AGE))
}

/// Every cached attachment of network `net`.
pub fn list(cache_dir: &Path, net: &str) -> Vec<CachedInfo> {
    let Ok(rd) = std::fs::read_dir(results_dir(cache_dir)) else {
        return vec![];
    };
    let prefix = format!("{net}-");
    let mut out: Vec<CachedInfo> = rd
        .filter_map(Result::ok)
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with(&prefix) && !rcni_statefile::is_tmp_name(&name)
        })
        .filter_map(|e| std::fs::read(e.path()).ok())
        .filter_map(|d| serde_json::from_slice::<CachedInfo>(&d).ok())
        // "a-b" also starts with "a-": the recorded name decides.
        .filter(|c| c.kind == KIND && c.network_name == net)
        .collect();
    out.sort_by(|a, b| (&a.container_id, &a.ifname).cmp(&(&b.container_id, &b.ifname)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_go_format() {
        let d = tempfile::tempdir().unwrap();
        let info = CachedInfo {
            kind: KIND.into(),
            container_id: "c1".into(),
            config: br#"{"name":"n"}"#.to_vec(),
            ifname: "eth0".into(),
            network_name: "n".into(),
            netns: "/run/netns/x".into(),
            cni_args: vec![["K".into(), "V".into()]],
            capability_args: Map::new(),
            result: Some(serde_json::json!({"cniVersion":"1.0.0"})),
        };
        write(d.path(), &info).unwrap();
        let p = path(d.path(), "n", "c1", "eth0");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            std::fs::metadata(results_dir(d.path()))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o700
        );
        let raw: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert_eq!(raw["config"], "eyJuYW1lIjoibiJ9");
        assert_eq!(raw["containerId"], "c1");
        assert_eq!(read(d.path(), "n", "c1", "eth0").unwrap(), info);
        // Another network whose name shares the prefix is not listed.
        let other = CachedInfo {
            network_name: "n-x".into(),
            ..info.clone()
        };
        write(d.path(), &other).unwrap();
        assert_eq!(list(d.path(), "n").len(), 1);
        remove(d.path(), "n", "c1", "eth0").unwrap();
        remove(d.path(), "n", "c1", "eth0").unwrap();
        assert!(read(d.path(), "n", "c1", "eth0").is_none());
        std::fs::write(path(d.path(), "n", "bad", "eth0"), "{not json").unwrap();
        assert!(read(d.path(), "n", "bad", "eth0").is_none());
    }

    /// Sets `p`'s modification time `ago` in the past.
    fn age(p: &Path, ago: std::time::Duration) {
        let f = std::fs::File::options().write(true).open(p).unwrap();
        f.set_modified(std::time::SystemTime::now() - ago).unwrap();
    }

    #[test]
    fn a_killed_writers_temporary_is_no_attachment_and_goes() {
        let d = tempfile::tempdir().unwrap();
        let info = |cid: &str| CachedInfo {
            kind: KIND.into(),
            container_id: cid.into(),
            config: b"{}".to_vec(),
            ifname: "eth0".into(),
            network_name: "n".into(),
            netns: String::new(),
            cni_args: vec![],
            capability_args: Map::new(),
            result: None,
        };
        // A container ID with a dot: a temporary named by replacing the
        // "extension" would start with "n-" like a real entry.
        write(d.path(), &info("c.1")).unwrap();
        let complete = serde_json::to_vec(&info("c.2")).unwrap();
        // Killed between writing and renaming: complete, never published.
        let killed = rcni_statefile::tmp_path(&path(d.path(), "n", "c.2", "eth0"));
        std::fs::write(&killed, &complete).unwrap();
        let young = rcni_statefile::tmp_path(&path(d.path(), "n", "c.3", "eth0"));
        let old = rcni_statefile::tmp_path(&path(d.path(), "n", "c.4", "eth0"));
        for t in [&young, &old] {
            std::fs::write(t, &complete[..10]).unwrap();
        }
        age(&old, rcni_statefile::ORPHAN_AGE * 2);
        let ids: Vec<String> = list(d.path(), "n")
            .into_iter()
            .map(|c| c.container_id)
            .collect();
        assert_eq!(ids, ["c.1"]);
        assert!(read(d.path(), "n", "c.2", "eth0").is_none());
        // DEL of c.2 takes its temporary; GC's sweep only the old one.
        remove(d.path(), "n", "c.2", "eth0").unwrap();
        assert!(!killed.exists());
        assert_eq!(sweep(d.path()).unwrap(), 1);
        assert!(young.exists() && !old.exists());
        assert_eq!(list(d.path(), "n").len(), 1);
    }

    #[test]
    fn reads_a_libcni_written_file() {
        // As libcni 1.1 writes it (no netns key).
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(results_dir(d.path())).unwrap();
        std::fs::write(
            path(d.path(), "lo", "cid", "eth0"),
            r#"{"kind":"cniCacheV1","containerId":"cid","config":"e30=","ifName":"eth0","networkName":"lo","cniArgs":[["A","B"]],"result":{"cniVersion":"0.3.1"}}"#,
        )
        .unwrap();
        let c = read(d.path(), "lo", "cid", "eth0").unwrap();
        assert_eq!(c.config, b"{}");
        assert_eq!(c.cni_args, vec![["A".to_string(), "B".to_string()]]);
    }
}
