//! Ports of a rule: numbers, ranges and container port names.

use super::{invalid, object_of};
use rcni_cni::CniError;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// Port ranges one peer may be allowed (the eBPF map's bound).
pub const MAX_PORT_RANGES: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PortRange {
    pub proto: u8,
    pub lo: u16,
    pub hi: u16,
}

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const SCTP: u8 = 132;

/// A pod's named container ports: name -> (protocol, port), as the agent
/// reports them from the Pod's spec.
pub type NamedPorts = BTreeMap<String, (String, u16)>;

/// The protocol number of a Kubernetes protocol name.
pub fn proto_number(s: &str) -> Option<u8> {
    match s {
        "TCP" => Some(TCP),
        "UDP" => Some(UDP),
        "SCTP" => Some(SCTP),
        _ => None,
    }
}

/// One `ports` entry: a number or range, or a container port's name.
pub(super) enum PortSpec {
    Range(PortRange),
    Named(u8, String),
}

fn port_number(p: &Value, who: &str, field: &str) -> Result<u16, CniError> {
    p.as_u64()
        .filter(|n| (1..=65535).contains(n))
        .map(|n| n as u16)
        .ok_or_else(|| invalid(who, field, &format!("{p} is not a port (1-65535)")))
}

/// Kubernetes' IANA_SVC_NAME: 1-15 of `a-z0-9-`, a letter among them, no
/// leading, trailing or double `-`.
fn valid_port_name(s: &str) -> bool {
    (1..=15).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && s.bytes().any(|b| b.is_ascii_lowercase())
        && !s.starts_with('-')
        && !s.ends_with('-')
        && !s.contains("--")
}

pub(super) fn parse_port(v: &Value, who: &str, field: &str) -> Result<PortSpec, CniError> {
    let m = object_of(v, who, field, &["protocol", "port", "endPort"])?;
    let proto = match m.get("protocol").filter(|v| !v.is_null()) {
        None => TCP,
        Some(p) => match p.as_str() {
            Some("TCP") => TCP,
            Some("UDP") => UDP,
            Some("SCTP") => SCTP,
            _ => {
                return Err(invalid(
                    who,
                    &format!("{field}.protocol"),
                    &format!("{p} is not TCP, UDP or SCTP"),
                ));
            }
        },
    };
    let port = match m.get("port").filter(|v| !v.is_null()) {
        None => None,
        Some(Value::String(s)) => {
            if !valid_port_name(s) {
                return Err(invalid(
                    who,
                    &format!("{field}.port"),
                    &format!("{s:?} is neither a number nor a port name"),
                ));
            }
            if m.get("endPort").is_some_and(|v| !v.is_null()) {
                return Err(invalid(
                    who,
                    &format!("{field}.endPort"),
                    "not allowed with a named port",
                ));
            }
            return Ok(PortSpec::Named(proto, s.clone()));
        }
        Some(p) => Some(port_number(p, who, &format!("{field}.port"))?),
    };
    let end = match m.get("endPort").filter(|v| !v.is_null()) {
        None => None,
        Some(p) => Some(port_number(p, who, &format!("{field}.endPort"))?),
    };
    let range = match (port, end) {
        (None, None) => Ok(PortRange {
            proto,
            lo: 0,
            hi: 65535,
        }),
        (Some(p), None) => Ok(PortRange {
            proto,
            lo: p,
            hi: p,
        }),
        (None, Some(_)) => Err(invalid(who, &format!("{field}.endPort"), "needs port")),
        (Some(p), Some(e)) if e < p => Err(invalid(
            who,
            &format!("{field}.endPort"),
            &format!("{e} is below port {p}"),
        )),
        (Some(p), Some(e)) => Ok(PortRange {
            proto,
            lo: p,
            hi: e,
        }),
    };
    range.map(PortSpec::Range)
}
