//! Other nodes' pods, read from Pod objects (`kubectl get pods -o json`,
//! the agent's `k8s-pods.json`) with the agent protocol's types
//! (`rcni_agent_proto::pods`).

use super::invalid;
use super::labels::{Labels, validate_labels};
use super::ports::{NamedPorts, proto_number};
use rcni_agent_proto::pods::{PodMeta, PodSpec, PodStatus};
use rcni_cni::CniError;
use serde::Deserialize;
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
    /// Its named container ports: what an egress rule naming a port
    /// allows toward this pod.
    pub ports: NamedPorts,
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
    let metadata: PodMeta = part(m, "metadata", bad)?;
    let labels = metadata.labels;
    validate_labels(&labels).map_err(|_| bad("metadata.labels", "must be valid labels"))?;
    let spec: PodSpec = part(m, "spec", bad)?;
    if spec.host_network == Some(true) {
        return Ok(None);
    }
    let status: PodStatus = part(m, "status", bad)?;
    if matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
        return Ok(None);
    }
    let mut addrs: Vec<IpAddr> = Vec::new();
    let mut add = |s: &str, field: &str| -> Result<(), CniError> {
        if s.is_empty() {
            return Ok(());
        }
        let a: IpAddr = s
            .parse()
            .map_err(|_| bad(field, &format!("{s:?} is not an address")))?;
        if !addrs.contains(&a) {
            addrs.push(a);
        }
        Ok(())
    };
    for (i, ip) in status.pod_ips.iter().enumerate() {
        add(&ip.ip, &format!("status.podIPs[{i}].ip"))?;
    }
    if let Some(ip) = &status.pod_ip {
        add(ip, "status.podIP")?;
    }
    if addrs.is_empty() {
        return Ok(None);
    }
    addrs.sort();
    let mut ports = NamedPorts::new();
    for (i, c) in spec.containers.iter().enumerate() {
        for (j, p) in c.ports.iter().enumerate() {
            let Some(n) = &p.name else { continue };
            let field = format!("spec.containers[{i}].ports[{j}]");
            let proto = p.protocol.clone().unwrap_or_else(|| "TCP".into());
            if proto_number(&proto).is_none() {
                return Err(bad(
                    &field,
                    &format!("protocol {proto:?} is not TCP, UDP or SCTP"),
                ));
            }
            let port = u16::try_from(p.container_port)
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| bad(&field, "containerPort must be 1-65535"))?;
            ports.insert(n.clone(), (proto, port));
        }
    }
    Ok(Some(RemotePod {
        namespace: namespace.to_string(),
        name: name.to_string(),
        labels,
        addrs,
        ports,
    }))
}

/// One part of a Pod object (`metadata`, `spec`, `status`) in the agent
/// protocol's terms; absent or null is the empty one, a field of the wrong
/// JSON type refuses the pod naming the part.
pub(super) fn part<T: for<'de> Deserialize<'de> + Default>(
    m: &Map<String, Value>,
    key: &str,
    bad: impl Fn(&str, &str) -> CniError,
) -> Result<T, CniError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(T::default()),
        Some(v) => T::deserialize(v).map_err(|e| bad(key, &e.to_string())),
    }
}
