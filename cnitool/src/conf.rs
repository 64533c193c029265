//! Loading network configurations the way libcni does (`libcni/conf.go`).

use rcni_cni::version;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// A network configuration list, as loaded.
#[derive(Debug, Clone)]
pub struct ConfList {
    pub name: String,
    /// The version the runtime uses: the highest of `cniVersion` and
    /// `cniVersions` this implementation knows.
    pub cni_version: String,
    pub disable_check: bool,
    pub disable_gc: bool,
    pub plugins: Vec<Value>,
    /// The list's bytes, kept in the result cache as libcni does.
    pub bytes: Vec<u8>,
    pub source: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfError {
    #[error("no net configuration with name \"{name}\" in {dir}")]
    NotFound { dir: String, name: String },
    #[error("no net configurations found in {0}")]
    NoConfigs(String),
    #[error("error reading {path}: {err}")]
    Read { path: String, err: std::io::Error },
    #[error("{path}: error parsing configuration list: {msg}")]
    List { path: String, msg: String },
    #[error("{path}: error parsing configuration: {msg}")]
    Conf { path: String, msg: String },
}

fn get_bool(m: &Map<String, Value>, key: &str, path: &str) -> Result<bool, ConfError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        // Go's libcni also takes the strings "true"/"false" here.
        Some(Value::String(s)) if s.eq_ignore_ascii_case("true") => Ok(true),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("false") => Ok(false),
        Some(v) => Err(ConfError::List {
            path: path.into(),
            msg: format!("invalid {key} value {v}"),
        }),
    }
}

/// `bytes` as a JSON object; what else they are is `err`'s to say.
fn json_object(
    bytes: &[u8],
    err: impl Fn(String) -> ConfError,
) -> Result<Map<String, Value>, ConfError> {
    match serde_json::from_slice(bytes).map_err(|e| err(e.to_string()))? {
        Value::Object(m) => Ok(m),
        _ => Err(err("not a JSON object".into())),
    }
}

/// Parses a `.conflist`.
pub fn conf_list_from_bytes(bytes: &[u8], path: &str) -> Result<ConfList, ConfError> {
    let err = |msg: String| ConfError::List {
        path: path.into(),
        msg,
    };
    let m = &json_object(bytes, err)?;
    let name = match m.get("name") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::String(_)) | None => return Err(err("no name".into())),
        Some(other) => return Err(err(format!("invalid name {other}"))),
    };
    let declared = match m.get("cniVersion") {
        None => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => return Err(err(format!("invalid cniVersion {other}"))),
    };
    let versions: Vec<String> = match m.get("cniVersions") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(String::from)
                    .ok_or_else(|| err(format!("invalid cniVersions entry {x}")))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(err(format!("invalid cniVersions {other}"))),
    };
    let cni_version = if declared.is_empty() && versions.is_empty() {
        version::DEFAULT_CONFIG_VERSION.to_string()
    } else {
        version::negotiate_list_version(&declared, &versions).ok_or_else(|| {
            err(format!(
                "no supported version in cniVersion {declared:?} / cniVersions {versions:?}"
            ))
        })?
    };
    let plugins = match m.get("plugins") {
        None => return Err(err("no 'plugins' key".into())),
        Some(Value::Array(a)) => a.clone(),
        Some(other) => return Err(err(format!("invalid 'plugins' type {other}"))),
    };
    if plugins.is_empty() {
        return Err(err("no plugins in list".into()));
    }
    for (i, p) in plugins.iter().enumerate() {
        match p.get("type") {
            // Checked for every plugin before any runs (libcni checks each
            // only as it runs it, after the ones before it made their
            // links).
            Some(Value::String(t)) if !t.is_empty() => {
                rcni_cni::invoke::validate_plugin_name(t).map_err(|e| err(e.msg))?
            }
            _ => return Err(err(format!("plugin {i} has no 'type'"))),
        }
    }
    Ok(ConfList {
        name,
        cni_version,
        disable_check: get_bool(m, "disableCheck", path)?,
        disable_gc: get_bool(m, "disableGC", path)?,
        plugins,
        bytes: bytes.to_vec(),
        source: Some(PathBuf::from(path)),
    })
}

/// Wraps a single plugin `.conf` into a list, as libcni's ConfListFromConf.
pub fn conf_list_from_conf(bytes: &[u8], path: &str) -> Result<ConfList, ConfError> {
    let err = |msg: String| ConfError::Conf {
        path: path.into(),
        msg,
    };
    let m = json_object(bytes, err)?;
    match m.get("type") {
        Some(Value::String(t)) if !t.is_empty() => {}
        _ => return Err(err("missing 'type'".into())),
    }
    let name = m
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let ver = m
        .get("cniVersion")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let list = serde_json::json!({"cniVersion": ver, "name": name, "plugins": [m]});
    let bytes = serde_json::to_vec(&list).expect("a Value serializes");
    let mut out = conf_list_from_bytes(&bytes, path)?;
    out.source = Some(PathBuf::from(path));
    Ok(out)
}

fn files_with(dir: &Path, exts: &[&str]) -> Result<Vec<PathBuf>, ConfError> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => {
            return Err(ConfError::Read {
                path: dir.display().to_string(),
                err: e,
            });
        }
    };
    let mut out: Vec<PathBuf> = rd
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .filter(|p| {
            p.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| exts.contains(&e))
        })
        .collect();
    out.sort();
    Ok(out)
}

fn read(p: &Path) -> Result<Vec<u8>, ConfError> {
    std::fs::read(p).map_err(|e| ConfError::Read {
        path: p.display().to_string(),
        err: e,
    })
}

/// Finds network `name` in `dir`: `.conflist` files first (sorted), then
/// `.conf`/`.json` files wrapped into a list.
pub fn load_conf_list(dir: &Path, name: &str) -> Result<ConfList, ConfError> {
    let lists = files_with(dir, &["conflist"])?;
    for f in &lists {
        let l = conf_list_from_bytes(&read(f)?, &f.display().to_string())?;
        if l.name == name {
            return Ok(l);
        }
    }
    let singles = files_with(dir, &["conf", "json"])?;
    if singles.is_empty() && lists.is_empty() {
        return Err(ConfError::NoConfigs(dir.display().to_string()));
    }
    for f in &singles {
        let bytes = read(f)?;
        let v: Value = serde_json::from_slice(&bytes).map_err(|e| ConfError::Conf {
            path: f.display().to_string(),
            msg: e.to_string(),
        })?;
        if v.get("name").and_then(Value::as_str) == Some(name) {
            return conf_list_from_conf(&bytes, &f.display().to_string());
        }
    }
    Err(ConfError::NotFound {
        dir: dir.display().to_string(),
        name: name.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every plugin's type is checked at load, so a bad second plugin
    /// stops the list before the first one runs.
    #[test]
    fn plugin_types_naming_paths_are_refused_at_load() {
        for bad in ["../bridge", "/bin/sh", "..", "."] {
            let l = serde_json::json!({"cniVersion": "1.0.0", "name": "n",
                "plugins": [{"type": "bridge"}, {"type": bad}]});
            let e = conf_list_from_bytes(&serde_json::to_vec(&l).unwrap(), "x").unwrap_err();
            assert!(e.to_string().contains("invalid plugin name"), "{e}");
        }
    }

    fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for (n, c) in files {
            std::fs::write(d.path().join(n), c).unwrap();
        }
        d
    }

    #[test]
    fn conflist_before_conf_and_sorted() {
        let d = dir_with(&[
            (
                "10-a.conf",
                r#"{"cniVersion":"0.3.1","name":"net","type":"from-conf"}"#,
            ),
            (
                "20-b.conflist",
                r#"{"cniVersion":"1.0.0","name":"net","plugins":[{"type":"second-list"}]}"#,
            ),
            (
                "15-c.conflist",
                r#"{"cniVersion":"1.0.0","name":"net","plugins":[{"type":"first-list"}]}"#,
            ),
            ("ignored.txt", "garbage"),
        ]);
        let l = load_conf_list(d.path(), "net").unwrap();
        assert_eq!(l.plugins[0]["type"], "first-list");
    }

    #[test]
    fn single_conf_is_wrapped() {
        let d = dir_with(&[
            (
                "a.json",
                r#"{"cniVersion":"0.3.1","name":"other","type":"x"}"#,
            ),
            (
                "b.conf",
                r#"{"cniVersion":"0.3.1","name":"lo","type":"loopback"}"#,
            ),
        ]);
        let l = load_conf_list(d.path(), "lo").unwrap();
        assert_eq!((l.name.as_str(), l.cni_version.as_str()), ("lo", "0.3.1"));
        assert_eq!(l.plugins.len(), 1);
        assert_eq!(l.plugins[0]["type"], "loopback");
        let e = load_conf_list(d.path(), "missing").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("no net configuration with name \"missing\""),
            "{e}"
        );
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(
            load_conf_list(empty.path(), "x"),
            Err(ConfError::NoConfigs(_))
        ));
        assert!(matches!(
            load_conf_list(&empty.path().join("nope"), "x"),
            Err(ConfError::NoConfigs(_))
        ));
    }

    #[test]
    fn list_validation_and_versions() {
        let p = |s: &str| conf_list_from_bytes(s.as_bytes(), "t");
        assert!(
            p(r#"{"plugins":[{"type":"a"}]}"#)
                .unwrap_err()
                .to_string()
                .contains("no name")
        );
        assert!(
            p(r#"{"name":"n"}"#)
                .unwrap_err()
                .to_string()
                .contains("no 'plugins' key")
        );
        assert!(
            p(r#"{"name":"n","plugins":[]}"#)
                .unwrap_err()
                .to_string()
                .contains("no plugins in list")
        );
        assert!(
            p(r#"{"name":"n","plugins":[{}]}"#)
                .unwrap_err()
                .to_string()
                .contains("no 'type'")
        );
        assert!(p("{").is_err());
        let l = p(r#"{"name":"n","cniVersion":"1.0.0","cniVersions":["1.1.0","9.0.0"],"disableCheck":true,"disableGC":"true","plugins":[{"type":"a"}]}"#).unwrap();
        assert_eq!(l.cni_version, "1.1.0");
        assert!(l.disable_check && l.disable_gc);
        assert_eq!(
            p(r#"{"name":"n","plugins":[{"type":"a"}]}"#)
                .unwrap()
                .cni_version,
            "0.1.0"
        );
    }
}
