//! Other nodes' pods, read from Pod objects (`kubectl get pods -o json`,
//! the agent's `k8s-pods.json`).

use super::invalid;
use super::labels::{Labels, string_map, validate_labels};
use rcni_cni::CniError;
use serde_json::{Map, Value};
use std::net::IpAddr;

/// A pod this node has no attachment of (another node's, as the agent
/// writes them): selectors match it by its labels, and its addresses are
/// what a rule allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemotePod {
    pub namespace: String,
    pub name: String,
    pub labels: Labels,
    pub addrs: Vec<IpAddr>,
}

/// A non-empty string field of an object's `metadata`.
pub(super) fn meta_str<'a>(meta: Option<&'a Map<String, Value>>, key: &str) -> Option<&'a str> {
    meta.and_then(|m| m.get(key))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

/// A Pod object as a peer: `None` for one that has no address to match or
/// should not match by address (`kubectl get pods -o json` output holds
/// them too): host-network pods, whose address is their node's (traffic
/// from nodes passes anyway, and matching by it would admit every process
/// of that node), and finished pods (Succeeded, Failed), whose addresses
/// are free for new pods.
pub(super) fn parse_pod(
    m: &Map<String, Value>,
    origin: &str,
) -> Result<Option<RemotePod>, CniError> {
    let meta = m.get("metadata").and_then(Value::as_object);
    let name = meta_str(meta, "name").ok_or_else(|| invalid(origin, "metadata.name", "missing"))?;
    let namespace = meta_str(meta, "namespace").unwrap_or("default");
    let bad = |field: &str, what: &str| {
        CniError::config(format!(
            "pod {namespace}/{name} ({origin}): {field}: {what}"
        ))
    };
    let labels = match meta.and_then(|m| m.get("labels")) {
        None | Some(Value::Null) => Labels::new(),
        Some(l) => string_map(l)
            .filter(|l| validate_labels(l).is_ok())
            .ok_or_else(|| bad("metadata.labels", "must be valid labels"))?,
    };
    let spec = m.get("spec");
    let status = m.get("status");
    if spec
        .and_then(|s| s.get("hostNetwork"))
        .and_then(Value::as_bool)
        == Some(true)
    {
        return Ok(None);
    }
    if matches!(
        status.and_then(|s| s.get("phase")).and_then(Value::as_str),
        Some("Succeeded" | "Failed")
    ) {
        return Ok(None);
    }
    let mut addrs: Vec<IpAddr> = Vec::new();
    let mut add = |v: Option<&Value>, field: &str| -> Result<(), CniError> {
        let Some(s) = v.and_then(Value::as_str).filter(|s| !s.is_empty()) else {
            return Ok(());
        };
        let a: IpAddr = s
            .parse()
            .map_err(|_| bad(field, &format!("{s:?} is not an address")))?;
        if !addrs.contains(&a) {
            addrs.push(a);
        }
        Ok(())
    };
    if let Some(ips) = status
        .and_then(|s| s.get("podIPs"))
        .and_then(Value::as_array)
    {
        for (i, ip) in ips.iter().enumerate() {
            add(ip.get("ip"), &format!("status.podIPs[{i}].ip"))?;
        }
    }
    add(status.and_then(|s| s.get("podIP")), "status.podIP")?;
    if addrs.is_empty() {
        return Ok(None);
    }
    addrs.sort();
    Ok(Some(RemotePod {
        namespace: namespace.to_string(),
        name: name.to_string(),
        labels,
        addrs,
    }))
}
