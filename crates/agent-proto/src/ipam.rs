//! The cloud IPAM socket (`socket` in the `vpc-ipam` plugin's config,
//! default [`DEFAULT_SOCKET`]): the plugin writes one [`IpamRequest`] line,
//! `rcni-node --cloud` answers one [`IpamAnswer`] line. The agent owns the
//! pool of the node's cloud addresses; the plugin holds no state.

use serde::{Deserialize, Serialize};
use std::net::Ipv4Addr;

pub const DEFAULT_SOCKET: &str = "/run/rcni/cloud.sock";

/// The pod end's gateway the plugin returns: a link-local address the
/// host end of the pod's veth answers for (ptp puts it there), as the AWS
/// VPC CNI's 169.254.1.1.
pub const POD_GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);

/// One attachment: what CNI names it by (container ID and interface).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Attachment {
    #[serde(rename = "containerID")]
    pub container_id: String,
    #[serde(rename = "ifName")]
    pub if_name: String,
}

/// `{"op": "add"|"del"|"check", "containerID", "ifName"}`,
/// `{"op": "gc", "valid": [{"containerID", "ifName"}...]}` or
/// `{"op": "status"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum IpamRequest {
    /// An address for the attachment; the same one again if it has one.
    Add {
        #[serde(flatten)]
        attachment: Attachment,
    },
    /// The attachment's address back to the pool (none held: success).
    Del {
        #[serde(flatten)]
        attachment: Attachment,
    },
    /// The attachment's address, if it holds one.
    Check {
        #[serde(flatten)]
        attachment: Attachment,
    },
    /// Every address held by an attachment not in `valid` back to the
    /// pool (CNI GC's `cni.dev/valid-attachments`).
    Gc { valid: Vec<Attachment> },
    /// Can ADD be served (CNI STATUS)? `{}`, or code 50 with why not.
    Status,
}

/// An address (`ip` with the interface that carries it), `{}` for a DEL or
/// GC done (`released` counts GC's), or `{"error", "code"}` with the CNI
/// error code to return: 11 (try again) while the pool is empty and
/// refilling.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpamAnswer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<Ipv4Addr>,
    /// The cloud interface (`eni-...`) that carries `ip`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
    /// Its device index (0: the primary interface).
    #[serde(
        rename = "deviceIndex",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub device_index: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<u32>,
}

impl IpamAnswer {
    pub fn error(code: u32, msg: impl Into<String>) -> IpamAnswer {
        IpamAnswer {
            error: Some(msg.into()),
            code: Some(code),
            ..IpamAnswer::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format() {
        let a = Attachment {
            container_id: "c1".into(),
            if_name: "eth0".into(),
        };
        let r = IpamRequest::Add {
            attachment: a.clone(),
        };
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"op":"add","containerID":"c1","ifName":"eth0"}"#
        );
        let back: IpamRequest =
            serde_json::from_str(r#"{"op":"gc","valid":[{"containerID":"c1","ifName":"eth0"}]}"#)
                .unwrap();
        assert_eq!(back, IpamRequest::Gc { valid: vec![a] });
        assert!(serde_json::from_str::<IpamRequest>(r#"{"op":"zap"}"#).is_err());
        let ans = IpamAnswer {
            ip: Some(Ipv4Addr::new(10, 0, 16, 9)),
            interface: Some("eni-1".into()),
            device_index: Some(1),
            ..IpamAnswer::default()
        };
        assert_eq!(
            serde_json::to_string(&ans).unwrap(),
            r#"{"ip":"10.0.16.9","interface":"eni-1","deviceIndex":1}"#
        );
        assert_eq!(
            serde_json::to_string(&IpamAnswer::error(11, "empty")).unwrap(),
            r#"{"error":"empty","code":11}"#
        );
    }
}
