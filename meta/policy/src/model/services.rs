//! Services and their EndpointSlices (`kind: Service`, `kind:
//! EndpointSlice` objects in `policyDir`, as the agent mirrors them): which
//! endpoints a ClusterIP or external IP and port stand for.
//!
//! The eBPF backend decides a pod's egress where the pod's packets enter
//! the node, before kube-proxy's DNAT: there a connection to a Service
//! still names the Service's address, and NetworkPolicy is about the
//! endpoint behind it. The compiler uses these frontends to judge such a
//! connection by its endpoints (see `RuleSet::services`).

use super::invalid;
use super::ports::proto_number;
use super::remote_pods::{meta_str, part};
use rcni_cni::CniError;
use serde::Deserialize;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::net::IpAddr;

/// One address, protocol and port of a Service, and the endpoints
/// (address, target port) kube-proxy may send its connections to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frontend {
    pub addr: IpAddr,
    pub proto: u8,
    pub port: u16,
    pub backends: Vec<(IpAddr, u16)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub namespace: String,
    pub name: String,
    /// ClusterIPs (none for a headless Service) and external IPs.
    pub addrs: Vec<IpAddr>,
    /// (name, protocol, port): a slice's port of the same name gives the
    /// endpoints' port.
    pub ports: Vec<(String, u8, u16)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slice {
    pub namespace: String,
    /// The owning Service (label `kubernetes.io/service-name`).
    pub service: String,
    /// Endpoints kube-proxy uses: ready ones, or where none is ready, the
    /// serving (terminating) ones.
    pub addrs: Vec<IpAddr>,
    /// name -> (protocol, port).
    pub ports: BTreeMap<String, (u8, u16)>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct SvcSpec {
    #[serde(default, rename = "clusterIP")]
    cluster_ip: Option<String>,
    #[serde(default, rename = "clusterIPs")]
    cluster_ips: Vec<String>,
    #[serde(default, rename = "externalIPs")]
    external_ips: Vec<String>,
    #[serde(default)]
    ports: Vec<SvcPort>,
}

#[derive(Deserialize)]
struct SvcPort {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    protocol: Option<String>,
    port: i64,
}

#[derive(Deserialize)]
struct SliceEndpoint {
    #[serde(default)]
    addresses: Vec<String>,
    #[serde(default)]
    conditions: Conditions,
}

#[derive(Deserialize, Default)]
struct Conditions {
    #[serde(default)]
    ready: Option<bool>,
    #[serde(default)]
    serving: Option<bool>,
}

#[derive(Deserialize)]
struct SlicePort {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    protocol: Option<String>,
    #[serde(default)]
    port: Option<i64>,
}

fn proto_of(p: &Option<String>, who: &str, f: &str) -> Result<u8, CniError> {
    let s = p.as_deref().unwrap_or("TCP");
    proto_number(s)
        .ok_or_else(|| invalid(who, f, &format!("protocol {s:?} is not TCP, UDP or SCTP")))
}

fn port_of(p: i64, who: &str, f: &str) -> Result<u16, CniError> {
    u16::try_from(p)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| invalid(who, f, "port must be 1-65535"))
}

pub(super) fn parse_service(m: &Map<String, Value>, origin: &str) -> Result<Service, CniError> {
    let meta = m.get("metadata").and_then(Value::as_object);
    let name = meta_str(meta, "name").ok_or_else(|| invalid(origin, "metadata.name", "missing"))?;
    let namespace = meta_str(meta, "namespace").unwrap_or("default");
    let who = format!("service {namespace}/{name} ({origin})");
    let spec: SvcSpec = part(m, "spec", |f, w| invalid(&who, f, w))?;
    let mut addrs = Vec::new();
    let ips = spec
        .cluster_ips
        .iter()
        .chain(spec.cluster_ip.iter())
        .filter(|s| !s.is_empty() && s.as_str() != "None");
    for s in ips.chain(spec.external_ips.iter()) {
        let a: IpAddr = s
            .parse()
            .map_err(|_| invalid(&who, "spec", &format!("{s:?} is not an address")))?;
        if !addrs.contains(&a) {
            addrs.push(a);
        }
    }
    let mut ports = Vec::new();
    for (i, p) in spec.ports.iter().enumerate() {
        let f = format!("spec.ports[{i}]");
        ports.push((
            p.name.clone().unwrap_or_default(),
            proto_of(&p.protocol, &who, &f)?,
            port_of(p.port, &who, &f)?,
        ));
    }
    Ok(Service {
        namespace: namespace.to_string(),
        name: name.to_string(),
        addrs,
        ports,
    })
}

/// `None` for a slice no Service owns, or of FQDN endpoints.
pub(super) fn parse_slice(m: &Map<String, Value>, origin: &str) -> Result<Option<Slice>, CniError> {
    let meta = m.get("metadata").and_then(Value::as_object);
    let name = meta_str(meta, "name").ok_or_else(|| invalid(origin, "metadata.name", "missing"))?;
    let namespace = meta_str(meta, "namespace").unwrap_or("default");
    let who = format!("endpointslice {namespace}/{name} ({origin})");
    let service = meta
        .and_then(|m| m.get("labels"))
        .and_then(|l| l.get("kubernetes.io/service-name"))
        .and_then(Value::as_str);
    let Some(service) = service else {
        return Ok(None);
    };
    if m.get("addressType").and_then(Value::as_str) == Some("FQDN") {
        return Ok(None);
    }
    let endpoints: Vec<SliceEndpoint> = part(m, "endpoints", |f, w| invalid(&who, f, w))?;
    let used = |e: &&SliceEndpoint| e.conditions.ready != Some(false);
    let mut chosen: Vec<&SliceEndpoint> = endpoints.iter().filter(used).collect();
    if chosen.is_empty() {
        chosen = endpoints
            .iter()
            .filter(|e| e.conditions.serving == Some(true))
            .collect();
    }
    let mut addrs = Vec::new();
    for e in chosen {
        for s in &e.addresses {
            let a: IpAddr = s
                .parse()
                .map_err(|_| invalid(&who, "endpoints", &format!("{s:?} is not an address")))?;
            addrs.push(a);
        }
    }
    let slice_ports: Vec<SlicePort> = part(m, "ports", |f, w| invalid(&who, f, w))?;
    let mut ports = BTreeMap::new();
    for (i, p) in slice_ports.iter().enumerate() {
        let f = format!("ports[{i}]");
        // A slice port without a number: every port (the Service has no
        // ports), nothing to translate to.
        let Some(n) = p.port else { continue };
        ports.insert(
            p.name.clone().unwrap_or_default(),
            (proto_of(&p.protocol, &who, &f)?, port_of(n, &who, &f)?),
        );
    }
    Ok(Some(Slice {
        namespace: namespace.to_string(),
        service: service.to_string(),
        addrs,
        ports,
    }))
}

/// Every Service address and port with the endpoints it stands for. An
/// endpoint's port comes from its slice's port of the same name and
/// protocol, as kube-proxy pairs them.
pub fn frontends(services: &[Service], slices: &[Slice]) -> Vec<Frontend> {
    let mut out = Vec::new();
    for s in services {
        let own: Vec<&Slice> = slices
            .iter()
            .filter(|l| l.namespace == s.namespace && l.service == s.name)
            .collect();
        for (pname, proto, port) in &s.ports {
            let mut backends: Vec<(IpAddr, u16)> = Vec::new();
            for l in &own {
                let Some((p, target)) = l.ports.get(pname) else {
                    continue;
                };
                if p != proto {
                    continue;
                }
                backends.extend(l.addrs.iter().map(|a| (*a, *target)));
            }
            backends.sort();
            backends.dedup();
            for a in &s.addrs {
                out.push(Frontend {
                    addr: *a,
                    proto: *proto,
                    port: *port,
                    backends: backends
                        .iter()
                        .filter(|(b, _)| b.is_ipv4() == a.is_ipv4())
                        .copied()
                        .collect(),
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn a_service_and_its_slices_pair_by_port_name_and_family() {
        let svc = parse_service(
            &obj(
                json!({"kind": "Service", "metadata": {"namespace": "x", "name": "s"},
                "spec": {"clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00:96::a"],
                         "externalIPs": ["192.0.2.7"],
                         "ports": [{"name": "http", "port": 80, "targetPort": 8080},
                                   {"name": "dns", "protocol": "UDP", "port": 53}]}}),
            ),
            "t",
        )
        .unwrap();
        assert_eq!(svc.addrs.len(), 3);
        let slice = |addrs: Value, ty: &str| {
            parse_slice(
                &obj(json!({"kind": "EndpointSlice", "addressType": ty,
                    "metadata": {"namespace": "x", "name": "s-1",
                                 "labels": {"kubernetes.io/service-name": "s"}},
                    "endpoints": addrs,
                    "ports": [{"name": "http", "port": 8080, "protocol": "TCP"},
                              {"name": "dns", "port": 5353, "protocol": "UDP"}]})),
                "t",
            )
            .unwrap()
            .unwrap()
        };
        let v4 = slice(
            json!([{"addresses": ["10.244.1.5"], "conditions": {"ready": true}},
                   {"addresses": ["10.244.2.6"], "conditions": {"ready": false, "serving": true}}]),
            "IPv4",
        );
        // Only the ready one: the terminating endpoint is kube-proxy's
        // last resort.
        assert_eq!(v4.addrs, vec!["10.244.1.5".parse::<IpAddr>().unwrap()]);
        let v6 = slice(json!([{"addresses": ["fd00:1::5"]}]), "IPv6");
        let f = frontends(&[svc], &[v4, v6]);
        let http4 = f
            .iter()
            .find(|f| f.addr.to_string() == "10.96.0.10" && f.port == 80)
            .unwrap();
        assert_eq!(http4.backends, vec![("10.244.1.5".parse().unwrap(), 8080)]);
        let dns6 = f
            .iter()
            .find(|f| f.addr.to_string() == "fd00:96::a" && f.port == 53)
            .unwrap();
        assert_eq!(dns6.proto, 17);
        assert_eq!(dns6.backends, vec![("fd00:1::5".parse().unwrap(), 5353)]);
        let ext = f
            .iter()
            .find(|f| f.addr.to_string() == "192.0.2.7" && f.port == 80)
            .unwrap();
        assert_eq!(ext.backends, http4.backends);
    }

    #[test]
    fn only_terminating_endpoints_are_used_when_none_is_ready() {
        let s = parse_slice(
            &obj(json!({"kind": "EndpointSlice", "addressType": "IPv4",
                "metadata": {"name": "s-1", "labels": {"kubernetes.io/service-name": "s"}},
                "endpoints": [{"addresses": ["10.244.2.6"],
                               "conditions": {"ready": false, "serving": true, "terminating": true}}],
                "ports": [{"port": 80}]})),
            "t",
        )
        .unwrap()
        .unwrap();
        assert_eq!(s.addrs.len(), 1);
        assert_eq!(s.ports[""], (6, 80));
    }

    #[test]
    fn headless_unowned_and_bad_objects() {
        let headless = parse_service(
            &obj(
                json!({"metadata": {"name": "h"}, "spec": {"clusterIP": "None",
                "ports": [{"port": 80}]}}),
            ),
            "t",
        )
        .unwrap();
        assert!(headless.addrs.is_empty());
        assert!(
            parse_slice(&obj(json!({"metadata": {"name": "e"}})), "t")
                .unwrap()
                .is_none()
        );
        let e = parse_service(
            &obj(json!({"metadata": {"name": "b"}, "spec": {"ports": [{"port": 70000}]}})),
            "f.json",
        )
        .unwrap_err();
        assert!(e.msg.contains("spec.ports[0]"), "{}", e.msg);
    }
}
