//! `k8s-pods.json`: the agent writes other nodes' pods (namespace, name,
//! labels, node, addresses) into the policy plugin's `policyDir` as a
//! `PodList`, so pod and namespace selectors match pods of other nodes by
//! address. The plugin reads `kind: Pod` objects from any file of that
//! directory, so [`Pod`] also carries the fields a hand-written Pod may have
//! (`status.podIP`, `status.phase`, `spec.hostNetwork`); the agent writes
//! only the ones it fills.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The file's name in the policy directory.
pub const REMOTE_PODS_FILE: &str = "k8s-pods.json";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodList {
    pub api_version: String,
    pub kind: String,
    pub items: Vec<Pod>,
}

impl PodList {
    pub fn new(items: Vec<Pod>) -> PodList {
        PodList {
            api_version: "v1".into(),
            kind: "PodList".into(),
            items,
        }
    }

    /// The file's bytes: one JSON document and a newline.
    pub fn to_file(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self).unwrap_or_default();
        v.push(b'\n');
        v
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pod {
    pub kind: String,
    pub metadata: PodMeta,
    #[serde(default)]
    pub spec: PodSpec,
    #[serde(default)]
    pub status: PodStatus,
}

impl Pod {
    /// Another node's pod as the agent writes it.
    pub fn remote(
        namespace: &str,
        name: &str,
        labels: BTreeMap<String, String>,
        node: &str,
        ips: &[String],
        ports: Vec<ContainerPort>,
    ) -> Pod {
        Pod {
            kind: "Pod".into(),
            metadata: PodMeta {
                namespace: Some(namespace.into()),
                name: Some(name.into()),
                labels,
            },
            spec: PodSpec {
                node_name: Some(node.into()),
                host_network: None,
                // One container holds them all: egress rules' named ports
                // need the names, not which container has them.
                containers: if ports.is_empty() {
                    vec![]
                } else {
                    vec![Container { ports }]
                },
            },
            status: PodStatus {
                pod_ips: ips.iter().map(|ip| PodIp { ip: ip.clone() }).collect(),
                ..PodStatus::default()
            },
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodMeta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
    /// Only the named ports matter here (egress rules naming a peer's
    /// port); other container fields are ignored.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub containers: Vec<Container>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Container {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<ContainerPort>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerPort {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An int32 in the API; a value no port can have is left to the
    /// reader to refuse.
    pub container_port: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodStatus {
    #[serde(rename = "podIP", default, skip_serializing_if = "Option::is_none")]
    pub pod_ip: Option<String>,
    #[serde(rename = "podIPs", default)]
    pub pod_ips: Vec<PodIp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodIp {
    pub ip: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agents_file_byte_for_byte() {
        let labels = BTreeMap::from([("app".to_string(), "db".to_string())]);
        let list = PodList::new(vec![Pod::remote(
            "prod",
            "db-0",
            labels,
            "node-b",
            &["10.244.1.5".into(), "fd00::5".into()],
            vec![ContainerPort {
                name: Some("pg".into()),
                container_port: 5432,
                protocol: None,
            }],
        )]);
        assert_eq!(
            String::from_utf8(list.to_file()).unwrap(),
            concat!(
                r#"{"apiVersion":"v1","kind":"PodList","items":[{"kind":"Pod","#,
                r#""metadata":{"namespace":"prod","name":"db-0","labels":{"app":"db"}},"#,
                r#""spec":{"nodeName":"node-b","containers":[{"ports":[{"name":"pg","containerPort":5432}]}]},"#,
                r#""status":{"podIPs":[{"ip":"10.244.1.5"},{"ip":"fd00::5"}]}}]}"#,
                "\n"
            )
        );
        let back: PodList = serde_json::from_slice(&list.to_file()).unwrap();
        assert_eq!(back, list);
    }

    #[test]
    fn hand_written_pods_read() {
        let p: Pod = serde_json::from_str(
            r#"{"kind":"Pod","metadata":{"name":"d"},"spec":{"hostNetwork":true},
                "status":{"podIP":"10.0.0.8","phase":"Running"}}"#,
        )
        .unwrap();
        assert_eq!(p.spec.host_network, Some(true));
        assert_eq!(p.status.pod_ip.as_deref(), Some("10.0.0.8"));
        assert!(p.metadata.labels.is_empty() && p.metadata.namespace.is_none());
    }
}
