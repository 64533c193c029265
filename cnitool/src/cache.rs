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

pub fn write(cache_dir: &Path, info: &CachedInfo) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
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
    let tmp = tmp_path(&p, std::process::id());
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&serde_json::to_vec(info).map_err(std::io::Error::other)?)?;
    }
    // rename: a reader never sees a half-written file.
    std::fs::rename(&tmp, &p)
}

/// The cached attachment, `None` if absent or unreadable (libcni ignores a
/// cache it cannot read).
pub fn read(cache_dir: &Path, net: &str, container_id: &str, ifname: &str) -> Option<CachedInfo> {
    let data = std::fs::read(path(cache_dir, net, container_id, ifname)).ok()?;
    serde_json::from_slice::<CachedInfo>(&data)
        .ok()
        .filter(|c| c.kind == KIND)
}

/// Where process `pid` writes `p` before renaming it into place (appended,
/// not an extension: container IDs may contain dots).
fn tmp_path(p: &Path, pid: u32) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(format!(".tmp{pid}"));
    PathBuf::from(s)
}

/// The writer's process ID if `name` is a temporary file of `base`.
fn tmp_writer(name: &str, base: &str) -> Option<u32> {
    name.strip_prefix(base)?.strip_prefix(".tmp")?.parse().ok()
}

fn remove_file(p: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Removes the cached attachment, and the temporary file of an ADD killed
/// while writing it (the DEL after a killed ADD is the one that can).
pub fn remove(
    cache_dir: &Path,
    net: &str,
    container_id: &str,
    ifname: &str,
) -> std::io::Result<()> {
    let p = path(cache_dir, net, container_id, ifname);
    remove_file(&p)?;
    let base = format!("{net}-{container_id}-{ifname}");
    for e in std::fs::read_dir(results_dir(cache_dir))
        .into_iter()
        .flatten()
    {
        let Ok(e) = e else { continue };
        if tmp_writer(&e.file_name().to_string_lossy(), &base).is_some() {
            remove_file(&e.path())?;
        }
    }
    Ok(())
}

/// Removes the temporary files of network `net` whose writer is gone (GC:
/// an ADD killed while writing, whose DEL never came).
pub fn sweep_tmp(cache_dir: &Path, net: &str) {
    let prefix = format!("{net}-");
    for e in std::fs::read_dir(results_dir(cache_dir))
        .into_iter()
        .flatten()
    {
        let Ok(e) = e else { continue };
        let name = e.file_name().to_string_lossy().into_owned();
        let Some((base, _)) = name.rsplit_once(".tmp") else {
            continue;
        };
        if base.starts_with(&prefix)
            && tmp_writer(&name, base)
                .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
        {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Every cached attachment of network `net`.
pub fn list(cache_dir: &Path, net: &str) -> Vec<CachedInfo> {
    let Ok(rd) = std::fs::read_dir(results_dir(cache_dir)) else {
        return vec![];
    };
    let prefix = format!("{net}-");
    let mut out: Vec<CachedInfo> = rd
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
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
        // The temporary file of a writer killed mid-write goes with the
        // entry; another key's stays.
        std::fs::write(tmp_path(&p, 4242), "{").unwrap();
        let other_tmp = tmp_path(&path(d.path(), "n", "c10", "eth0"), 7);
        std::fs::write(&other_tmp, "{").unwrap();
        remove(d.path(), "n", "c1", "eth0").unwrap();
        remove(d.path(), "n", "c1", "eth0").unwrap();
        assert!(!tmp_path(&p, 4242).exists());
        assert!(other_tmp.exists());
        // GC sweeps it once its writer is gone (no PID is above 2^22).
        let dead = tmp_path(&path(d.path(), "n", "c10", "eth0"), 99_999_999);
        std::fs::write(&dead, "{").unwrap();
        let alive = tmp_path(&path(d.path(), "n", "c11", "eth0"), std::process::id());
        std::fs::write(&alive, "{").unwrap();
        sweep_tmp(d.path(), "n");
        assert!(!dead.exists() && alive.exists());
        assert!(read(d.path(), "n", "c1", "eth0").is_none());
        std::fs::write(path(d.path(), "n", "bad", "eth0"), "{not json").unwrap();
        assert!(read(d.path(), "n", "bad", "eth0").is_none());
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
