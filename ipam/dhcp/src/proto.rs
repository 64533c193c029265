//! The plugin <-> daemon protocol on the unix socket.
//!
//! One connection per call: the plugin writes one JSON object and a
//! newline, the daemon answers with one JSON object and a newline and
//! closes. (The reference speaks Go `net/rpc` over HTTP; only our plugin
//! talks to our daemon, so the wire format is ours.)
//!
//! Requests (`op` selects):
//! - `{"op":"allocate","attachment":A,"netns":"/abs/path","options":{"request":[1,3],"provide":[[12,"web-0"]]}}`
//! - `{"op":"check","attachment":A}` and `{"op":"release","attachment":A}`
//! - `{"op":"status"}`
//! - `{"op":"gc","netName":"net","valid":[{"containerID":"c","ifname":"eth0"}]}`
//!
//! with `A = {"containerId":"c","netName":"net","ifName":"eth0"}`.
//!
//! Replies: `{"ok":true,"lease":L}` (`lease` for allocate and check) or
//! `{"ok":false,"error":{"code":N,"msg":"..."}}` with a CNI error code.
//! `L = {"address":"10.0.0.5/24","gateway":"10.0.0.1","routes":[...],
//! "dns":{...},"expires":<unix seconds>}`.

use rcni_cni::{CniError, Dns, GcAttachment, Route};
use serde::{Deserialize, Serialize};

use crate::options::ClientOptions;

/// Which container attachment a lease belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Attachment {
    pub container_id: String,
    pub net_name: String,
    pub if_name: String,
}

impl Attachment {
    /// The DHCP client identifier, as the reference builds it.
    pub fn client_id(&self) -> String {
        crate::options::client_id(&self.container_id, &self.net_name, &self.if_name)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Request {
    Allocate {
        attachment: Attachment,
        netns: String,
        options: ClientOptions,
    },
    Check {
        attachment: Attachment,
    },
    Release {
        attachment: Attachment,
    },
    Status,
    Gc {
        #[serde(rename = "netName")]
        net_name: String,
        valid: Vec<GcAttachment>,
    },
}

/// What the plugin needs of a lease to build its result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseReply {
    pub address: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    #[serde(default)]
    pub routes: Vec<Route>,
    #[serde(default)]
    pub dns: Dns,
    pub expires: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseReply>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<CniError>,
}

impl Reply {
    pub fn ok(lease: Option<LeaseReply>) -> Reply {
        Reply {
            ok: true,
            lease,
            error: None,
        }
    }

    pub fn err(e: CniError) -> Reply {
        Reply {
            ok: false,
            lease: None,
            error: Some(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_shapes() {
        let r: Request = serde_json::from_str(
            r#"{"op":"allocate","attachment":{"containerId":"c","netName":"n","ifName":"eth0"},
                "netns":"/run/netns/x","options":{"request":[1,3],"provide":[[12,"web-0"]]}}"#,
        )
        .unwrap();
        match r {
            Request::Allocate {
                attachment,
                options,
                ..
            } => {
                assert_eq!(attachment.client_id(), "c/n/eth0");
                assert_eq!(options.provide, vec![(12, "web-0".to_string())]);
            }
            other => panic!("{other:?}"),
        }
        let r: Request = serde_json::from_str(
            r#"{"op":"gc","netName":"n","valid":[{"containerID":"c","ifname":"eth0"}]}"#,
        )
        .unwrap();
        assert!(matches!(r, Request::Gc { valid, .. } if valid.len() == 1));
        let s = serde_json::to_string(&Request::Status).unwrap();
        assert_eq!(s, r#"{"op":"status"}"#);
        let e = serde_json::to_value(Reply::err(CniError::with_code(111, "x"))).unwrap();
        assert_eq!(
            e,
            serde_json::json!({"ok": false, "error": {"code": 111, "msg": "x"}})
        );
    }
}
