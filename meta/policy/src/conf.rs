//! The plugin's config and the pod's identity, validated before the kernel
//! is touched.
//!
//! ```json
//! {"type": "policy", "backend": "auto", "policies": [...], "policyDir": "/etc/cni/policy.d",
//!  "namespaces": {"prod": {"team": "a"}}, "dataDir": "/var/lib/cni/rcni-policy",
//!  "pinRoot": "/sys/fs/bpf/rcni", "attachMode": "auto",
//!  "agentSocket": "/run/rcni/agent.sock",
//!  "audit": false, "flowEvents": "deny", "flowRate": 10}
//! ```
//!
//! `audit`: every policy of the network is audit-only (as if annotated
//! `rcni.io/audit: "true"`): reported, never enforced. `flowEvents`: which
//! decisions become flow events (`deny`, the default: denials and audit
//! findings; `all`: every new connection a policy allows too; `none`).
//! `flowRate`: events per second per pod (a burst of as many), the rest
//! counted as suppressed.
//!
//! The pod's labels come from `args.cni.labels` (the CNI convention: a
//! list of `{"key", "value"}`, or an object), its namespace from
//! `K8S_POD_NAMESPACE` in CNI_ARGS or `args.cni.namespace` (default
//! `default`). With `agentSocket`, labels and named container ports come
//! from the rcni-node agent instead, asked by `K8S_POD_NAMESPACE` and
//! `K8S_POD_NAME` (see [`crate::agent`]).

use crate::model::{Labels, NamedPorts, PolicySet, validate_labels};
use crate::state::DEFAULT_DATA_DIR;
use rcni_cni::skel::CmdArgs;
use rcni_cni::{CniError, ErrorCode};
use rcni_ebpf::Hook;
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Where networks' pin directories live (shared with fastpath).
pub const DEFAULT_PIN_ROOT: &str = "/sys/fs/bpf/rcni";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Ebpf,
    Nftables,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Ebpf => "ebpf",
            Backend::Nftables => "nftables",
        }
    }

    pub fn parse(s: &str) -> Option<Backend> {
        match s {
            "ebpf" => Some(Backend::Ebpf),
            "nftables" => Some(Backend::Nftables),
            _ => None,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    #[serde(default)]
    backend: Option<String>,
    #[serde(default)]
    policies: Option<Value>,
    #[serde(default)]
    policy_dir: Option<String>,
    #[serde(default)]
    namespaces: Option<BTreeMap<String, Labels>>,
    #[serde(default)]
    data_dir: Option<String>,
    #[serde(default)]
    pin_root: Option<String>,
    #[serde(default)]
    attach_mode: Option<String>,
    #[serde(default)]
    agent_socket: Option<String>,
    #[serde(default)]
    audit: Option<bool>,
    #[serde(default)]
    flow_events: Option<String>,
    #[serde(default)]
    flow_rate: Option<u32>,
}

/// Which decisions become flow events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FlowEvents {
    None,
    /// Denials and audit findings.
    #[default]
    Deny,
    /// And every new connection a policy allows.
    All,
}

/// Events per second per pod when `flowRate` is not given.
pub const DEFAULT_FLOW_RATE: u32 = 10;

#[derive(Debug, Clone)]
pub struct Conf {
    /// `None`: auto (eBPF where it loads, else nftables).
    pub backend: Option<Backend>,
    pub inline: Value,
    pub policy_dir: Option<PathBuf>,
    pub namespaces: BTreeMap<String, Labels>,
    pub data_dir: PathBuf,
    pub pin_root: PathBuf,
    /// `<pin_root>/<network>`, shared with fastpath.
    pub pin_dir: PathBuf,
    pub attach_mode: Option<Hook>,
    /// The rcni-node agent's pod socket: labels from the Kubernetes API.
    pub agent_socket: Option<PathBuf>,
    /// Every policy audit-only.
    pub audit: bool,
    pub flow_events: FlowEvents,
    /// Flow events per second per pod (and the burst).
    pub flow_rate: u32,
}

fn abs(key: &str, v: Option<&str>, default: &str) -> Result<PathBuf, CniError> {
    let p = PathBuf::from(v.filter(|s| !s.is_empty()).unwrap_or(default));
    if !p.is_absolute() {
        return Err(CniError::unsupported(
            key,
            format!("{:?} (must be an absolute path)", p.display()),
        ));
    }
    Ok(p)
}

impl Conf {
    pub fn load(args: &CmdArgs) -> Result<Conf, CniError> {
        Conf::from_value(&args.conf.raw, &args.conf.name)
    }

    /// From a config object (the plugin's stdin, or the copy `policy sync`
    /// keeps).
    pub fn from_value(v: &Value, network: &str) -> Result<Conf, CniError> {
        let raw: Raw = rcni_cni::ci::from_value(v.clone())
            .map_err(|e| CniError::config(format!("invalid network config: {e}")))?;
        let backend = match raw.backend.as_deref() {
            None | Some("") | Some("auto") => None,
            Some(b) => Some(Backend::parse(b).ok_or_else(|| {
                CniError::unsupported("backend", format!("{b:?} (auto, ebpf or nftables)"))
            })?),
        };
        let attach_mode = Hook::from_config(raw.attach_mode.as_deref())
            .map_err(|e| CniError::unsupported("attachMode", e))?;
        // netkit's primary hook runs with the packet already on the pod's
        // end (skb->dev), where rcni_pol_in cannot tell the pod's traffic;
        // on a netkit primary, clsact and tcx see what they see on a veth.
        if attach_mode == Some(Hook::Netkit) {
            return Err(CniError::unsupported(
                "attachMode",
                "\"netkit\" (the fast path's hook only; policy: auto, tcx or tc)",
            ));
        }
        let inline = raw.policies.unwrap_or(Value::Array(vec![]));
        if !inline.is_array() {
            return Err(CniError::config("policies: must be an array of policies"));
        }
        let policy_dir = match raw.policy_dir.as_deref() {
            None | Some("") => None,
            Some(d) => Some(abs("policyDir", Some(d), "")?),
        };
        let namespaces = raw.namespaces.unwrap_or_default();
        for (ns, l) in &namespaces {
            validate_labels(l).map_err(|e| CniError::config(format!("namespaces.{ns}: {e}")))?;
        }
        let pin_root = abs("pinRoot", raw.pin_root.as_deref(), DEFAULT_PIN_ROOT)?;
        let agent_socket = match raw.agent_socket.as_deref() {
            None | Some("") => None,
            Some(p) => Some(abs("agentSocket", Some(p), "")?),
        };
        let flow_events = match raw.flow_events.as_deref() {
            None | Some("") | Some("deny") => FlowEvents::Deny,
            Some("all") => FlowEvents::All,
            Some("none") => FlowEvents::None,
            Some(v) => {
                return Err(CniError::unsupported(
                    "flowEvents",
                    format!("{v:?} (deny, all or none)"),
                ));
            }
        };
        let flow_rate = match raw.flow_rate {
            None => DEFAULT_FLOW_RATE,
            Some(0) => {
                return Err(CniError::unsupported(
                    "flowRate",
                    "0 (events per second per pod: at least 1; \"flowEvents\": \"none\" turns them off)",
                ));
            }
            Some(n) => n,
        };
        Ok(Conf {
            audit: raw.audit.unwrap_or(false),
            flow_events,
            flow_rate,
            agent_socket,
            backend,
            inline,
            policy_dir,
            namespaces,
            data_dir: abs("dataDir", raw.data_dir.as_deref(), DEFAULT_DATA_DIR)?,
            // The network name is validated by the skel (no '/', no
            // leading dot), so it is a safe directory name.
            pin_dir: pin_root.join(network),
            pin_root,
            attach_mode,
        })
    }

    /// The policies in force: the config's, then the policy directory's
    /// (read now, so an edit shows at the next ADD, DEL or sync).
    pub fn policies(&self) -> Result<PolicySet, CniError> {
        let mut set = PolicySet {
            namespaces: self.namespaces.clone(),
            ..Default::default()
        };
        set.add_document(&self.inline, "policies")?;
        if let Some(d) = &self.policy_dir {
            set.add_dir(d)?;
        }
        if self.audit {
            for p in &mut set.policies {
                p.audit = true;
            }
        }
        set.sort();
        Ok(set)
    }

    pub fn hook(&self) -> Hook {
        self.attach_mode.unwrap_or_else(Hook::preferred)
    }
}

/// Who a pod is for its policies.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    pub namespace: String,
    /// K8S_POD_NAME, kept when the labels come from the agent.
    pub name: Option<String>,
    pub labels: Labels,
    pub ports: NamedPorts,
}

/// The pod's identity: from the agent when the config has `agentSocket`
/// (waiting up to `patience` for it to know the pod), else from CNI_ARGS
/// and `args`.
pub fn identity(
    args: &CmdArgs,
    conf: &Conf,
    patience: std::time::Duration,
) -> Result<Identity, CniError> {
    let (namespace, labels) = pod_identity(args)?;
    let Some(socket) = &conf.agent_socket else {
        return Ok(Identity {
            namespace,
            name: None,
            labels,
            ports: NamedPorts::new(),
        });
    };
    let name = args
        .env_args()?
        .get("K8S_POD_NAME")
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .ok_or_else(|| {
            CniError::new(
                ErrorCode::InvalidEnvironmentVariables,
                "policy: agentSocket is set but CNI_ARGS has no K8S_POD_NAME: the pod's labels \
                 come from the Kubernetes API by namespace and name (containerd and CRI-O pass \
                 them)",
            )
        })?;
    let info = crate::agent::ask(socket, &namespace, &name, patience)?;
    Ok(Identity {
        namespace,
        name: Some(name),
        labels: info.labels,
        ports: info.ports,
    })
}

/// The pod's namespace and labels from CNI_ARGS and `args`.
pub fn pod_identity(args: &CmdArgs) -> Result<(String, Labels), CniError> {
    let labels = match args.conf.cni_arg::<Value>("labels")? {
        None => Labels::new(),
        Some(Value::Array(list)) => {
            let mut l = Labels::new();
            for item in list {
                let k = item.get("key").and_then(Value::as_str);
                let v = item.get("value").and_then(Value::as_str);
                match (k, v) {
                    (Some(k), Some(v)) => {
                        l.insert(k.to_string(), v.to_string());
                    }
                    _ => {
                        return Err(CniError::config(format!(
                            "args.cni.labels: {item} is not {{\"key\": string, \"value\": string}}"
                        )));
                    }
                }
            }
            l
        }
        Some(v @ Value::Object(_)) => serde_json::from_value(v)
            .map_err(|e| CniError::config(format!("args.cni.labels: {e}")))?,
        Some(other) => {
            return Err(CniError::config(format!(
                "args.cni.labels: {other} is not a list of key/value pairs"
            )));
        }
    };
    validate_labels(&labels).map_err(|e| CniError::config(format!("args.cni.labels: {e}")))?;
    let ns = match args
        .env_args()?
        .get("K8S_POD_NAMESPACE")
        .filter(|s| !s.is_empty())
    {
        Some(ns) => ns.to_string(),
        None => args
            .conf
            .cni_arg::<String>("namespace")?
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "default".into()),
    };
    Ok((ns, labels))
}

/// The config as `policy sync` keeps it: without what belongs to one call.
pub fn stored(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(m) = v.as_object_mut() {
        for k in ["prevResult", "runtimeConfig", "args"] {
            m.remove(k);
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(v: Value, cni_args: &str) -> CmdArgs {
        let mut a = CmdArgs::for_conf(&v).unwrap();
        a.args = rcni_cni::CniArgs::parse(cni_args);
        a
    }

    #[test]
    fn defaults_and_checks() {
        let c = Conf::load(&args(
            json!({"cniVersion":"1.1.0","name":"n","type":"policy"}),
            "",
        ))
        .unwrap();
        assert_eq!(c.backend, None);
        assert_eq!(c.pin_dir, PathBuf::from("/sys/fs/bpf/rcni/n"));
        assert_eq!(c.data_dir, PathBuf::from(DEFAULT_DATA_DIR));
        assert!(c.policies().unwrap().policies.is_empty());
        let bad = [
            json!({"cniVersion":"1.1.0","name":"n","type":"policy","backend":"iptables"}),
            json!({"cniVersion":"1.1.0","name":"n","type":"policy","dataDir":"rel"}),
            json!({"cniVersion":"1.1.0","name":"n","type":"policy","attachMode":"xdp"}),
            // netkit's hooks are the fast path's only.
            json!({"cniVersion":"1.1.0","name":"n","type":"policy","attachMode":"netkit"}),
        ];
        for b in bad {
            assert_eq!(Conf::load(&args(b.clone(), "")).unwrap_err().code, 2, "{b}");
        }
        let e = Conf::load(&args(
            json!({"cniVersion":"1.1.0","name":"n","type":"policy","policies":{}}),
            "",
        ))
        .unwrap_err();
        assert_eq!(e.code, 7);
        // A bad policy is code 7 naming it.
        let c = Conf::load(&args(
            json!({"cniVersion":"1.1.0","name":"n","type":"policy","policies":[{"name":"x","podSelector":{},"ingress":[{"ports":[{"port":0}]}]}]}),
            "",
        ))
        .unwrap();
        let e = c.policies().unwrap_err();
        assert_eq!(e.code, 7);
        assert!(
            e.msg.contains("default/x") && e.msg.contains("ingress[0].ports[0].port"),
            "{}",
            e.msg
        );
    }

    #[test]
    fn pod_identity_from_args() {
        let a = args(
            json!({"cniVersion":"1.1.0","name":"n","type":"policy",
                "args":{"cni":{"labels":[{"key":"app","value":"web"},{"key":"tier","value":"fe"}]}}}),
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=prod;K8S_POD_NAME=p",
        );
        let (ns, l) = pod_identity(&a).unwrap();
        assert_eq!(ns, "prod");
        assert_eq!(l.len(), 2);
        let a = args(
            json!({"cniVersion":"1.1.0","name":"n","type":"policy",
                "args":{"cni":{"labels":{"app":"db"},"namespace":"data"}}}),
            "",
        );
        assert_eq!(
            pod_identity(&a).unwrap(),
            (
                "data".into(),
                [("app".to_string(), "db".to_string())].into()
            )
        );
        let a = args(json!({"cniVersion":"1.1.0","name":"n","type":"policy"}), "");
        assert_eq!(pod_identity(&a).unwrap(), ("default".into(), Labels::new()));
        let a = args(
            json!({"cniVersion":"1.1.0","name":"n","type":"policy","args":{"cni":{"labels":[{"key":"bad key","value":"x"}]}}}),
            "",
        );
        assert_eq!(pod_identity(&a).unwrap_err().code, 7);
        // A malformed CNI_ARGS is code 4 on ADD and CHECK, as in the
        // reference plugins that read CNI_ARGS.
        let a = args(
            json!({"cniVersion":"1.1.0","name":"n","type":"policy"}),
            "K8S_POD_NAMESPACE=prod;none",
        );
        assert_eq!(pod_identity(&a).unwrap_err().code, 4);
    }

    #[test]
    fn agent_socket_needs_an_absolute_path_and_the_pod_name() {
        let bad = json!({"cniVersion":"1.1.0","name":"n","type":"policy","agentSocket":"a.sock"});
        assert_eq!(Conf::load(&args(bad, "")).unwrap_err().code, 2);
        let d = tempfile::tempdir().unwrap();
        let v = json!({"cniVersion":"1.1.0","name":"n","type":"policy",
            "agentSocket": d.path().join("agent.sock")});
        let a = args(v.clone(), "K8S_POD_NAMESPACE=prod");
        let c = Conf::load(&a).unwrap();
        let e = identity(&a, &c, std::time::Duration::ZERO).unwrap_err();
        assert_eq!(e.code, 4, "{}", e.msg);
        // Labels in args do not stand in for the agent's.
        let a = args(v, "K8S_POD_NAMESPACE=prod;K8S_POD_NAME=web-1");
        let e = identity(&a, &c, std::time::Duration::ZERO).unwrap_err();
        assert_eq!(e.code, 11, "{}", e.msg);
    }
}
