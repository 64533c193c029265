//! The agent socket (`agentSocket`, default `/run/rcni/agent.sock`): the
//! plugin writes one [`PodQuery`] line, the agent answers one
//! [`PodAnswer`] line. Kubernetes runtimes pass only K8S_POD_NAMESPACE and
//! K8S_POD_NAME; the agent, which watches this node's Pods, holds their
//! labels and named container ports.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Named container ports: name -> (protocol, port), as the Pod spec has
/// them (`containerPort` is an int32 in the API).
pub type NamedPorts = BTreeMap<String, (String, i32)>;

/// `{"namespace": ..., "name": ...}`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodQuery {
    pub namespace: String,
    pub name: String,
}

/// One of `{"synced": false}`, `{"synced": true, "found": false}`,
/// `{"synced": true, "found": true, "labels": {...}, "ports": {...}}` or
/// `{"error": "..."}`. Absent fields read as false or empty.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodAnswer {
    /// The agent has listed this node's Pods: before that "not found"
    /// would be a guess.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub synced: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub found: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<NamedPorts>,
    /// A request the agent could not read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl PodAnswer {
    pub fn not_synced() -> PodAnswer {
        PodAnswer {
            synced: Some(false),
            ..PodAnswer::default()
        }
    }
    pub fn not_found() -> PodAnswer {
        PodAnswer {
            synced: Some(true),
            found: Some(false),
            ..PodAnswer::default()
        }
    }
    pub fn found(labels: BTreeMap<String, String>, ports: NamedPorts) -> PodAnswer {
        PodAnswer {
            synced: Some(true),
            found: Some(true),
            labels: Some(labels),
            ports: Some(ports),
            error: None,
        }
    }
    pub fn error(message: impl Into<String>) -> PodAnswer {
        PodAnswer {
            error: Some(message.into()),
            ..PodAnswer::default()
        }
    }
    pub fn is_synced(&self) -> bool {
        self.synced.unwrap_or(false)
    }
    pub fn is_found(&self) -> bool {
        self.found.unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line<T: Serialize>(v: &T) -> String {
        serde_json::to_string(v).unwrap()
    }

    #[test]
    fn answers_are_the_agents_lines() {
        assert_eq!(line(&PodAnswer::not_synced()), r#"{"synced":false}"#);
        assert_eq!(
            line(&PodAnswer::not_found()),
            r#"{"synced":true,"found":false}"#
        );
        let labels = BTreeMap::from([("app".to_string(), "web".to_string())]);
        let ports = NamedPorts::from([("http".to_string(), ("TCP".to_string(), 8080))]);
        assert_eq!(
            line(&PodAnswer::found(labels, ports)),
            r#"{"synced":true,"found":true,"labels":{"app":"web"},"ports":{"http":["TCP",8080]}}"#
        );
        assert_eq!(line(&PodAnswer::error("bad")), r#"{"error":"bad"}"#);
    }

    #[test]
    fn absent_fields_read_as_false_or_empty() {
        let a: PodAnswer = serde_json::from_str("{}").unwrap();
        assert!(!a.is_synced() && !a.is_found());
        assert_eq!(a.labels, None);
        let a: PodAnswer = serde_json::from_str(
            r#"{"synced":true,"found":true,"labels":{"a":"b"},"ports":{"p":["UDP",53]}}"#,
        )
        .unwrap();
        assert!(a.is_synced() && a.is_found());
        assert_eq!(a.ports.unwrap()["p"], ("UDP".to_string(), 53));
    }

    #[test]
    fn query_line() {
        let q = PodQuery {
            namespace: "default".into(),
            name: "web-0".into(),
        };
        assert_eq!(line(&q), r#"{"namespace":"default","name":"web-0"}"#);
        assert_eq!(serde_json::from_str::<PodQuery>(&line(&q)).unwrap(), q);
    }
}
