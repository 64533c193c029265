//! multinet's own configuration and what a pod asks for.

use crate::selection::{self, NETWORKS_ANNOTATION, Selection};
use rcni_cni::{CniError, NetConf};
use serde_json::{Map, Value};
use std::path::PathBuf;

pub const DEFAULT_CONF_DIR: &str = "/etc/cni/multinet.d";
pub const DEFAULT_DEFAULT_CONF_DIR: &str = "/etc/cni/net.d";
pub const DEFAULT_CACHE_DIR: &str = "/var/lib/cni/multinet";
pub const DEFAULT_STATUS_DIR: &str = "/run/rcni/multinet";
/// containerd's capability carrying the pod's annotations.
pub const POD_ANNOTATIONS: &str = "io.kubernetes.cri.pod-annotations";

/// The default network: a conflist by name, or given inline.
#[derive(Debug, Clone, PartialEq)]
pub enum DefaultNetwork {
    Named(String),
    Inline(Value),
}

#[derive(Debug, Clone)]
pub struct Conf {
    pub default_network: DefaultNetwork,
    /// Where the default network is looked up by name.
    pub default_conf_dir: PathBuf,
    /// Where additional networks are looked up by name.
    pub conf_dir: PathBuf,
    /// Per-attachment records (what DEL works from) and the delegates'
    /// result cache.
    pub cache_dir: PathBuf,
    /// The network-status documents.
    pub status_dir: PathBuf,
    /// The runtime's capability values, passed on to the default network.
    pub runtime_config: Map<String, Value>,
    /// What the pod asks for.
    pub selections: Vec<Selection>,
}

fn path_key(raw: &Value, key: &str, default: &str) -> Result<PathBuf, CniError> {
    match raw.get(key) {
        None | Some(Value::Null) => Ok(PathBuf::from(default)),
        Some(Value::String(s)) if !s.is_empty() => Ok(PathBuf::from(s)),
        Some(v) => Err(CniError::config(format!(
            "{key}: expected a non-empty path string, got {v}"
        ))),
    }
}

impl Conf {
    pub fn load(conf: &NetConf) -> Result<Conf, CniError> {
        let raw = &conf.raw;
        let default_network = match raw.get("defaultNetwork") {
            Some(Value::String(s)) if !s.is_empty() => DefaultNetwork::Named(s.clone()),
            Some(v @ Value::Object(_)) => DefaultNetwork::Inline(v.clone()),
            None | Some(Value::Null) => {
                return Err(CniError::config(
                    "defaultNetwork is required: the name of a conflist in defaultConfDir, or a conflist object",
                ));
            }
            Some(v) => {
                return Err(CniError::config(format!(
                    "defaultNetwork: expected a conflist name or object, got {v}"
                )));
            }
        };
        let mut runtime_config = match &conf.runtime_config {
            Some(Value::Object(m)) => m.clone(),
            _ => Map::new(),
        };
        let from_annotation = runtime_config
            .remove(POD_ANNOTATIONS)
            .and_then(|a| a.get(NETWORKS_ANNOTATION).cloned());
        let requested = match from_annotation {
            Some(v) => Some(v),
            None => conf
                .args
                .as_ref()
                .and_then(|a| a.get("cni"))
                .and_then(|c| c.get("networks"))
                .cloned(),
        };
        let selections = match requested {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => selection::parse(&s)?,
            // args.cni.networks may carry the JSON form unquoted.
            Some(v @ Value::Array(_)) => selection::parse(&v.to_string())?,
            Some(v) => {
                return Err(CniError::config(format!(
                    "networks: expected a string or a list, got {v}"
                )));
            }
        };
        Ok(Conf {
            default_network,
            default_conf_dir: path_key(raw, "defaultConfDir", DEFAULT_DEFAULT_CONF_DIR)?,
            conf_dir: path_key(raw, "confDir", DEFAULT_CONF_DIR)?,
            cache_dir: path_key(raw, "cacheDir", DEFAULT_CACHE_DIR)?,
            status_dir: path_key(raw, "statusDir", DEFAULT_STATUS_DIR)?,
            runtime_config,
            selections,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn load(v: Value) -> Result<Conf, CniError> {
        Conf::load(&NetConf::parse(&serde_json::to_vec(&v).unwrap()).unwrap())
    }

    #[test]
    fn requests_come_from_annotations_then_args() {
        let base = json!({"cniVersion": "1.0.0", "name": "m", "type": "multinet",
            "defaultNetwork": "cbr0"});
        let c = load(base.clone()).unwrap();
        assert_eq!(c.default_network, DefaultNetwork::Named("cbr0".into()));
        assert!(c.selections.is_empty());
        assert_eq!(c.conf_dir, PathBuf::from(DEFAULT_CONF_DIR));

        let mut v = base.clone();
        v["runtimeConfig"] = json!({
            POD_ANNOTATIONS: {NETWORKS_ANNOTATION: "a, b@eth5", "other": "x"},
            "portMappings": [{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}]});
        v["args"] = json!({"cni": {"networks": "ignored"}});
        let c = load(v).unwrap();
        assert_eq!(c.selections.len(), 2);
        assert_eq!(c.selections[1].interface.as_deref(), Some("eth5"));
        assert!(c.runtime_config.contains_key("portMappings"));
        assert!(!c.runtime_config.contains_key(POD_ANNOTATIONS));

        let mut v = base.clone();
        v["args"] = json!({"cni": {"networks": [{"name": "a", "interface": "x1"}]}});
        assert_eq!(load(v).unwrap().selections[0].name, "a");
    }

    #[test]
    fn errors() {
        let e = load(json!({"cniVersion": "1.0.0", "name": "m", "type": "multinet"})).unwrap_err();
        assert_eq!(e.code, 7);
        assert!(e.msg.contains("defaultNetwork"), "{}", e.msg);
        let e = load(
            json!({"cniVersion": "1.0.0", "name": "m", "type": "multinet",
            "defaultNetwork": 3}),
        )
        .unwrap_err();
        assert_eq!(e.code, 7);
        let e = load(
            json!({"cniVersion": "1.0.0", "name": "m", "type": "multinet",
            "defaultNetwork": "d", "confDir": ""}),
        )
        .unwrap_err();
        assert!(e.msg.contains("confDir"), "{}", e.msg);
    }
}
