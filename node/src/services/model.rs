//! Which backends each Service address, protocol and port stands for, from
//! Service and EndpointSlice objects, as kube-proxy reads them:
//!
//! - frontends: every ClusterIP, external IP and load balancer status IP
//!   (not one whose `ipMode` is `Proxy`: the load balancer itself proxies
//!   it) of each TCP or UDP port; none for headless and ExternalName
//!   Services, nor for those another proxy serves (label
//!   `service.kubernetes.io/service-proxy-name`) or labelled
//!   `service.kubernetes.io/headless`; EndpointSlices with either label are
//!   left out too, as kube-proxy's own watch leaves out both kinds;
//! - endpoints: those of the slices labelled with the Service's name, of
//!   the frontend's address family, on the port of the same name and
//!   protocol; the ready ones, or where none is ready the serving
//!   (terminating) ones; an address listed by two slices once;
//! - `internalTrafficPolicy: Local`: a ClusterIP's endpoints only this
//!   node's;
//! - NodePort (and LoadBalancer) Services: every node's InternalIP and
//!   ExternalIP on the node port too. This node's with every endpoint (a
//!   connection made on a node to its own node port is the cluster's,
//!   kube-proxy's short-circuit); another node's, with
//!   `externalTrafficPolicy: Local`, with that node's endpoints only, as
//!   its proxy would answer (none: refused);
//! - topology (`trafficDistribution`, which the EndpointSlice controller
//!   turns into hints): where every ready endpoint has a node hint and one
//!   names the node, the endpoints hinted for it; else where every one has
//!   a zone hint and one names the node's zone, those; else all. The node
//!   is the one whose proxy would answer: this one, or for another node's
//!   node port that node (kube-proxy's `topologyModeFromHints`);
//! - `sessionAffinity: ClientIP`: its timeout (default 3 hours) on every
//!   frontend of the Service;
//! - no endpoint: the frontend stays, with none, and connections to it are
//!   refused (kube-proxy's REJECT).

use crate::registry::cluster::NodePortAddresses;
use k8s_openapi::api::core::v1::{Service, ServicePort};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use rcni_ebpf::services::{Backends, Frontend};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
const PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// kube-proxy leaves Services and EndpointSlices with this label alone too.
const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";
const TCP: u8 = 6;
const UDP: u8 = 17;

pub type Frontends = BTreeMap<Frontend, Backends>;

/// What the model needs of the Nodes: every node's InternalIP and
/// ExternalIP addresses with whose they are (node ports), and each node's
/// zone (topology hints).
#[derive(Debug, Clone, Default)]
pub struct Nodes {
    pub addrs: BTreeMap<IpAddr, String>,
    pub zones: BTreeMap<String, String>,
}

/// kube-proxy's default `sessionAffinityConfig.clientIP.timeoutSeconds`.
const DEFAULT_AFFINITY_S: u32 = 10800;

fn proto(p: Option<&str>) -> Option<u8> {
    match p.unwrap_or("TCP") {
        "TCP" => Some(TCP),
        "UDP" => Some(UDP),
        // SCTP: no socket hook of ours translates it.
        _ => None,
    }
}

/// The addresses a port of `svc` is reached on, each with whether it is a
/// ClusterIP (`internalTrafficPolicy` applies only to those).
fn addresses(svc: &Service) -> Vec<(IpAddr, bool)> {
    let Some(spec) = &svc.spec else {
        return Vec::new();
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut cluster: Vec<&String> = spec.cluster_ips.iter().flatten().collect();
    if cluster.is_empty() {
        cluster.extend(spec.cluster_ip.as_ref());
    }
    // "None": headless, left to DNS.
    for a in cluster.into_iter().filter_map(|s| s.parse().ok()) {
        out.push((a, true));
    }
    if out.is_empty() {
        return out;
    }
    for a in spec.external_ips.iter().flatten() {
        if let Ok(a) = a.parse() {
            out.push((a, false));
        }
    }
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    for i in ingress.into_iter().flatten() {
        if i.ip_mode.as_deref() == Some("Proxy") {
            continue;
        }
        if let Some(a) = i.ip.as_deref().and_then(|s| s.parse().ok()) {
            out.push((a, false));
        }
    }
    out
}

/// kube-proxy's one watch of Services and EndpointSlices leaves out both
/// kinds with either label.
fn ignored(labels: Option<&BTreeMap<String, String>>) -> bool {
    labels.is_some_and(|l| l.contains_key(PROXY_NAME_LABEL) || l.contains_key(HEADLESS_LABEL))
}

fn ready(e: &Endpoint) -> bool {
    e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true)
}

fn serving(e: &Endpoint) -> bool {
    e.conditions
        .as_ref()
        .and_then(|c| c.serving.or(c.ready))
        .unwrap_or(true)
}

/// One port's endpoints of one family: (address, port, node).
fn endpoints<'a>(
    slices: &[&'a EndpointSlice],
    port: &ServicePort,
    v4: bool,
) -> Vec<(SocketAddr, &'a Endpoint)> {
    let family = if v4 { "IPv4" } else { "IPv6" };
    let name = port.name.as_deref().unwrap_or("");
    let want = proto(port.protocol.as_deref());
    let mut out = Vec::new();
    for s in slices.iter().filter(|s| s.address_type == family) {
        let Some(p) = s.ports.iter().flatten().find(|p| {
            p.name.as_deref().unwrap_or("") == name && proto(p.protocol.as_deref()) == want
        }) else {
            continue;
        };
        let Some(n) = p.port.and_then(|n| u16::try_from(n).ok()) else {
            continue;
        };
        for e in &s.endpoints {
            for a in &e.addresses {
                if let Ok(ip) = a.parse::<IpAddr>()
                    && ip.is_ipv4() == v4
                {
                    out.push((SocketAddr::new(ip, n), e));
                }
            }
        }
    }
    out
}

/// Which of a node's addresses (`(type, address)` in the Node's order)
/// answer node ports: its InternalIP and ExternalIP addresses, narrowed by
/// `nodePortAddresses` as kube-proxy narrows them. "primary" is the
/// node's first InternalIP of each family, else its first ExternalIP
/// (kube-proxy's node IPs).
pub fn node_port_addrs(addrs: &[(&str, IpAddr)], which: &NodePortAddresses) -> Vec<IpAddr> {
    let usable = addrs
        .iter()
        .filter(|(t, _)| *t == "InternalIP" || *t == "ExternalIP");
    match which {
        NodePortAddresses::All => usable.map(|(_, a)| *a).collect(),
        NodePortAddresses::Cidrs(nets) => usable
            .map(|(_, a)| *a)
            .filter(|a| nets.iter().any(|n| n.contains(*a)))
            .collect(),
        NodePortAddresses::Primary => [true, false]
            .into_iter()
            .filter_map(|v4| {
                let of = |ty: &str| {
                    addrs
                        .iter()
                        .find(|(t, a)| *t == ty && a.is_ipv4() == v4)
                        .map(|(_, a)| *a)
                };
                of("InternalIP").or_else(|| of("ExternalIP"))
            })
            .collect(),
    }
}

/// How kube-proxy on `node` (in `zone`) narrows a Service port's ready
/// endpoints by their hints: only to those hinted for the node, or for
/// its zone, or not at all (`topologyModeFromHints`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Topology<'a> {
    All,
    Node(&'a str),
    Zone(&'a str),
}

fn hinted_nodes(e: &Endpoint) -> impl Iterator<Item = &str> {
    e.hints
        .as_ref()
        .and_then(|h| h.for_nodes.as_ref())
        .into_iter()
        .flatten()
        .map(|n| n.name.as_str())
}

fn hinted_zones(e: &Endpoint) -> impl Iterator<Item = &str> {
    e.hints
        .as_ref()
        .and_then(|h| h.for_zones.as_ref())
        .into_iter()
        .flatten()
        .map(|z| z.name.as_str())
}

fn topology<'a>(eps: &[(SocketAddr, &Endpoint)], node: &'a str, zone: &'a str) -> Topology<'a> {
    let ready: Vec<&Endpoint> = eps.iter().map(|(_, e)| *e).filter(|e| ready(e)).collect();
    if ready.is_empty() {
        return Topology::All;
    }
    let every = |f: fn(&Endpoint) -> bool| ready.iter().all(|e| f(e));
    if every(|e| hinted_nodes(e).next().is_some())
        && ready.iter().any(|e| hinted_nodes(e).any(|n| n == node))
    {
        return Topology::Node(node);
    }
    if every(|e| hinted_zones(e).next().is_some())
        && ready.iter().any(|e| hinted_zones(e).any(|z| z == zone))
    {
        return Topology::Zone(zone);
    }
    Topology::All
}

impl Topology<'_> {
    fn admits(self, e: &Endpoint) -> bool {
        match self {
            Topology::All => true,
            Topology::Node(n) => hinted_nodes(e).any(|h| h == n),
            Topology::Zone(z) => hinted_zones(e).any(|h| h == z),
        }
    }
}

/// Every Service's frontends and their backends, for this node (`node`,
/// for `internalTrafficPolicy: Local` and topology); `nodes` every node's
/// addresses and zone, for node ports and topology.
pub fn frontends<'a>(
    services: impl IntoIterator<Item = &'a Service>,
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    node: &str,
    nodes: &Nodes,
) -> Frontends {
    let mut by_svc: BTreeMap<(&str, &str), Vec<&EndpointSlice>> = BTreeMap::new();
    for s in slices
        .into_iter()
        .filter(|s| !ignored(s.metadata.labels.as_ref()))
    {
        let ns = s.metadata.namespace.as_deref().unwrap_or("");
        if let Some(svc) = s
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_NAME_LABEL))
        {
            by_svc.entry((ns, svc.as_str())).or_default().push(s);
        }
    }
    let mut out = Frontends::new();
    for svc in services {
        if ignored(svc.metadata.labels.as_ref()) {
            continue;
        }
        let ns = svc.metadata.namespace.as_deref().unwrap_or("");
        let name = svc.metadata.name.as_deref().unwrap_or("");
        let slices = by_svc.get(&(ns, name)).map(Vec::as_slice).unwrap_or(&[]);
        let spec = svc.spec.as_ref();
        let local_only = spec.and_then(|s| s.internal_traffic_policy.as_deref()) == Some("Local");
        let external_local =
            spec.and_then(|s| s.external_traffic_policy.as_deref()) == Some("Local");
        let affinity_s = match spec.and_then(|s| s.session_affinity.as_deref()) {
            Some("ClientIP") => spec
                .and_then(|s| s.session_affinity_config.as_ref())
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds)
                .and_then(|t| u32::try_from(t).ok())
                .filter(|t| *t > 0)
                .unwrap_or(DEFAULT_AFFINITY_S),
            _ => 0,
        };
        let addrs = addresses(svc);
        for port in spec.and_then(|s| s.ports.as_ref()).into_iter().flatten() {
            let Some(proto) = proto(port.protocol.as_deref()) else {
                continue;
            };
            let Ok(pnum) = u16::try_from(port.port) else {
                continue;
            };
            for v4 in [true, false] {
                let eps = endpoints(slices, port, v4);
                // `on`: only the endpoints of that node (a Local traffic
                // policy, where hints play no part); else the cluster's as
                // `view`'s proxy narrows them by topology.
                let pick = |on: Option<&str>, view: &str| -> Backends {
                    let topo = match on {
                        Some(_) => Topology::All,
                        None => {
                            topology(&eps, view, nodes.zones.get(view).map_or("", String::as_str))
                        }
                    };
                    let mine = |e: &Endpoint| on.is_none() || e.node_name.as_deref() == on;
                    let mut ready: BTreeSet<SocketAddr> = eps
                        .iter()
                        .filter(|(_, e)| ready(e) && mine(e) && topo.admits(e))
                        .map(|(a, _)| *a)
                        .collect();
                    if ready.is_empty() {
                        ready = eps
                            .iter()
                            .filter(|(_, e)| serving(e) && mine(e))
                            .map(|(a, _)| *a)
                            .collect();
                    }
                    Backends {
                        addrs: ready.into_iter().collect(),
                        affinity_s,
                    }
                };
                for &(addr, is_cluster) in addrs.iter().filter(|(a, _)| a.is_ipv4() == v4) {
                    let f = Frontend {
                        addr,
                        proto,
                        port: pnum,
                    };
                    out.insert(f, pick((is_cluster && local_only).then_some(node), node));
                }
                let node_port = port
                    .node_port
                    .and_then(|n| u16::try_from(n).ok())
                    // Of the families the Service has.
                    .filter(|n| *n != 0 && addrs.iter().any(|(a, _)| a.is_ipv4() == v4));
                if let Some(np) = node_port {
                    for (&addr, owner) in nodes.addrs.iter().filter(|(a, _)| a.is_ipv4() == v4) {
                        let f = Frontend {
                            addr,
                            proto,
                            port: np,
                        };
                        // Another node's port with externalTrafficPolicy
                        // Local: what that node's proxy would answer, its
                        // own endpoints. This node's: every endpoint
                        // (kube-proxy's short-circuit for the node's own
                        // traffic).
                        let on = (external_local && owner != node).then_some(owner.as_str());
                        out.insert(f, pick(on, owner));
                    }
                }
            }
        }
    }
    out
}

/// Every `healthCheckNodePort` and its Service's ready endpoints on this
/// node (kube-proxy's answer to a load balancer's probe).
pub fn health_ports<'a>(
    services: impl IntoIterator<Item = &'a Service>,
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    node: &str,
) -> BTreeMap<u16, super::health::HealthPort> {
    let mut local: BTreeMap<(&str, &str), BTreeSet<&str>> = BTreeMap::new();
    for s in slices
        .into_iter()
        .filter(|s| !ignored(s.metadata.labels.as_ref()))
    {
        let ns = s.metadata.namespace.as_deref().unwrap_or("");
        let Some(svc) = s
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_NAME_LABEL))
        else {
            continue;
        };
        let set = local.entry((ns, svc.as_str())).or_default();
        for e in s
            .endpoints
            .iter()
            .filter(|e| ready(e) && e.node_name.as_deref() == Some(node))
        {
            set.extend(e.addresses.iter().map(String::as_str));
        }
    }
    let mut out = BTreeMap::new();
    for svc in services {
        let Some(port) = svc
            .spec
            .as_ref()
            .and_then(|s| s.health_check_node_port)
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0)
        else {
            continue;
        };
        let ns = svc.metadata.namespace.as_deref().unwrap_or("");
        let name = svc.metadata.name.as_deref().unwrap_or("");
        let n = local.get(&(ns, name)).map_or(0, BTreeSet::len);
        out.insert(
            port,
            super::health::HealthPort {
                namespace: ns.to_string(),
                name: name.to_string(),
                local_endpoints: n,
            },
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn svc(v: serde_json::Value) -> Service {
        serde_json::from_value(v).unwrap()
    }

    fn slice(v: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(v).unwrap()
    }

    fn fe(a: &str, proto: u8, port: u16) -> Frontend {
        Frontend {
            addr: a.parse().unwrap(),
            proto,
            port,
        }
    }

    fn sa(v: &[&str]) -> Vec<SocketAddr> {
        v.iter().map(|s| s.parse().unwrap()).collect()
    }

    fn none() -> Nodes {
        Nodes::default()
    }

    fn web_slice(name: &str, ty: &str, eps: serde_json::Value) -> EndpointSlice {
        slice(json!({
            "metadata": {"name": name, "namespace": "ns",
                          "labels": {SERVICE_NAME_LABEL: "web"}},
            "addressType": ty,
            "ports": [{"name": "http", "protocol": "TCP", "port": 8080},
                      {"name": "dns", "protocol": "UDP", "port": 5353}],
            "endpoints": eps,
        }))
    }

    #[test]
    fn cluster_external_and_balancer_addresses_each_port_ready_endpoints() {
        let s = svc(json!({
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {"clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd96::10"],
                     "externalIPs": ["192.0.2.7"],
                     "ports": [{"name": "http", "port": 80},
                               {"name": "dns", "protocol": "UDP", "port": 53},
                               {"name": "x", "protocol": "SCTP", "port": 9}]},
            "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"},
                                                     {"ip": "198.51.100.2", "ipMode": "Proxy"},
                                                     {"hostname": "lb.example"}]}},
        }));
        let v4 = web_slice(
            "web-a",
            "IPv4",
            json!([
                {"addresses": ["10.1.0.5"], "conditions": {"ready": true}},
                {"addresses": ["10.1.1.5"]},
                {"addresses": ["10.1.2.5"], "conditions": {"ready": false, "serving": true,
                                                            "terminating": true}},
            ]),
        );
        // The same endpoint in a second slice (a slice split underway).
        let v4b = web_slice("web-b", "IPv4", json!([{"addresses": ["10.1.0.5"]}]));
        let v6 = web_slice("web-c", "IPv6", json!([{"addresses": ["fd01::5"]}]));
        let other = slice(json!({
            "metadata": {"name": "x", "namespace": "other",
                          "labels": {SERVICE_NAME_LABEL: "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 1}],
            "endpoints": [{"addresses": ["10.9.9.9"]}],
        }));
        let got = frontends([&s], [&v4, &v4b, &v6, &other], "n1", &none());
        let http4: Backends = sa(&["10.1.0.5:8080", "10.1.1.5:8080"]).into();
        let dns4: Backends = sa(&["10.1.0.5:5353", "10.1.1.5:5353"]).into();
        let want = Frontends::from([
            (fe("10.96.0.10", TCP, 80), http4.clone()),
            (fe("10.96.0.10", UDP, 53), dns4.clone()),
            (fe("192.0.2.7", TCP, 80), http4.clone()),
            (fe("192.0.2.7", UDP, 53), dns4.clone()),
            (fe("198.51.100.1", TCP, 80), http4),
            (fe("198.51.100.1", UDP, 53), dns4),
            (fe("fd96::10", TCP, 80), sa(&["[fd01::5]:8080"]).into()),
            (fe("fd96::10", UDP, 53), sa(&["[fd01::5]:5353"]).into()),
        ]);
        assert_eq!(got, want);
    }

    #[test]
    fn terminating_endpoints_serve_only_when_none_is_ready() {
        let s = svc(json!({
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80}]},
        }));
        let sl = web_slice(
            "web-a",
            "IPv4",
            json!([
                {"addresses": ["10.1.2.5"], "conditions": {"ready": false, "serving": true}},
                {"addresses": ["10.1.2.6"], "conditions": {"ready": false, "serving": false}},
            ]),
        );
        let got = frontends([&s], [&sl], "n1", &none());
        assert_eq!(
            got[&fe("10.96.0.10", TCP, 80)].addrs,
            sa(&["10.1.2.5:8080"])
        );
        // Without a slice: kept, refusing.
        let got = frontends([&s], [], "n1", &none());
        assert_eq!(got[&fe("10.96.0.10", TCP, 80)].addrs, sa(&[]));
        // A slice labelled headless is no one's (kube-proxy's watch).
        let mut hidden = sl.clone();
        hidden
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert(HEADLESS_LABEL.into(), String::new());
        let got = frontends([&s], [&hidden], "n1", &none());
        assert_eq!(got[&fe("10.96.0.10", TCP, 80)].addrs, sa(&[]));
    }

    #[test]
    fn internal_traffic_policy_local_keeps_this_nodes_endpoints_for_the_cluster_ip() {
        let s = svc(json!({
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {"clusterIP": "10.96.0.10", "externalIPs": ["192.0.2.7"],
                     "internalTrafficPolicy": "Local",
                     "ports": [{"name": "http", "port": 80}]},
        }));
        let sl = web_slice(
            "web-a",
            "IPv4",
            json!([
                {"addresses": ["10.1.0.5"], "nodeName": "n1"},
                {"addresses": ["10.1.1.5"], "nodeName": "n2"},
            ]),
        );
        let got = frontends([&s], [&sl], "n1", &none());
        assert_eq!(
            got[&fe("10.96.0.10", TCP, 80)].addrs,
            sa(&["10.1.0.5:8080"])
        );
        assert_eq!(
            got[&fe("192.0.2.7", TCP, 80)].addrs,
            sa(&["10.1.0.5:8080", "10.1.1.5:8080"])
        );
        let got = frontends([&s], [&sl], "n3", &none());
        assert_eq!(got[&fe("10.96.0.10", TCP, 80)].addrs, sa(&[]));
    }

    #[test]
    fn headless_external_name_and_other_proxies_services_are_left_alone() {
        let headless = svc(json!({
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {"clusterIP": "None", "externalIPs": ["192.0.2.7"],
                     "ports": [{"name": "http", "port": 80}]},
        }));
        let ext = svc(json!({
            "metadata": {"name": "ext", "namespace": "ns"},
            "spec": {"type": "ExternalName", "externalName": "example.com",
                     "ports": [{"port": 80}]},
        }));
        let other = svc(json!({
            "metadata": {"name": "o", "namespace": "ns",
                          "labels": {PROXY_NAME_LABEL: "someone-else"}},
            "spec": {"clusterIP": "10.96.0.12", "ports": [{"port": 80}]},
        }));
        let labelled = svc(json!({
            "metadata": {"name": "h", "namespace": "ns", "labels": {HEADLESS_LABEL: ""}},
            "spec": {"clusterIP": "10.96.0.13", "ports": [{"port": 80}]},
        }));
        assert!(frontends([&headless, &ext, &other, &labelled], [], "n1", &none()).is_empty());
    }

    #[test]
    fn an_unnamed_port_matches_the_slices_unnamed_one_by_protocol() {
        let s = svc(json!({
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {"clusterIP": "10.96.0.10",
                     "ports": [{"port": 53, "protocol": "UDP"}]},
        }));
        let sl = slice(json!({
            "metadata": {"name": "w", "namespace": "ns", "labels": {SERVICE_NAME_LABEL: "web"}},
            "addressType": "IPv4",
            "ports": [{"port": 9999, "protocol": "TCP"}, {"port": 5353, "protocol": "UDP"}],
            "endpoints": [{"addresses": ["10.1.0.5"]}],
        }));
        let got = frontends([&s], [&sl], "n1", &none());
        assert_eq!(
            got[&fe("10.96.0.10", UDP, 53)].addrs,
            sa(&["10.1.0.5:5353"])
        );
    }

    #[test]
    fn node_ports_on_every_nodes_address_with_every_endpoint() {
        let s = svc(json!({
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {"type": "NodePort", "clusterIP": "10.96.0.10",
                     "externalTrafficPolicy": "Local", "internalTrafficPolicy": "Local",
                     "ports": [{"name": "http", "port": 80, "nodePort": 30080}]},
        }));
        let sl = web_slice(
            "web-a",
            "IPv4",
            json!([
                {"addresses": ["10.1.0.5"], "nodeName": "n1"},
                {"addresses": ["10.1.1.5"], "nodeName": "n2"},
            ]),
        );
        let nodes = Nodes {
            addrs: [
                ("172.30.0.11", "n1"),
                ("172.30.0.12", "n2"),
                ("172.30.0.13", "n3"),
                ("fd30::11", "n1"),
            ]
            .iter()
            .map(|(a, n)| (a.parse().unwrap(), n.to_string()))
            .collect(),
            zones: BTreeMap::new(),
        };
        let got = frontends([&s], [&sl], "n1", &nodes);
        let all = sa(&["10.1.0.5:8080", "10.1.1.5:8080"]);
        // This node's port: every endpoint; n2's: n2's only; n3 has none.
        assert_eq!(
            got,
            Frontends::from([
                (fe("10.96.0.10", TCP, 80), sa(&["10.1.0.5:8080"]).into()),
                (fe("172.30.0.11", TCP, 30080), all.clone().into()),
                (fe("172.30.0.12", TCP, 30080), sa(&["10.1.1.5:8080"]).into()),
                (fe("172.30.0.13", TCP, 30080), sa(&[]).into()),
            ])
        );
        // With externalTrafficPolicy Cluster every node's port has all.
        let mut c = s.clone();
        c.spec.as_mut().unwrap().external_traffic_policy = Some("Cluster".into());
        let got = frontends([&c], [&sl], "n1", &nodes);
        assert_eq!(got[&fe("172.30.0.13", TCP, 30080)].addrs, all);
        // A ClusterIP Service has no node port.
        let c = svc(json!({
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80}]},
        }));
        assert_eq!(frontends([&c], [&sl], "n1", &nodes).len(), 1);
    }

    #[test]
    fn node_port_addresses_narrow_a_nodes_addresses_as_kube_proxy_does() {
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let addrs = [
            ("Hostname", ip("10.9.9.9")),
            ("ExternalIP", ip("192.0.2.11")),
            ("InternalIP", ip("172.30.0.11")),
            ("InternalIP", ip("10.0.0.11")),
            ("ExternalIP", ip("2001:db8::11")),
        ];
        assert_eq!(
            node_port_addrs(&addrs, &NodePortAddresses::All),
            [
                ip("192.0.2.11"),
                ip("172.30.0.11"),
                ip("10.0.0.11"),
                ip("2001:db8::11")
            ]
        );
        assert_eq!(
            node_port_addrs(&addrs, &NodePortAddresses::Primary),
            [ip("172.30.0.11"), ip("2001:db8::11")]
        );
        let cidrs = NodePortAddresses::Cidrs(vec![
            "10.0.0.0/8".parse().unwrap(),
            "2001:db8::/32".parse().unwrap(),
        ]);
        assert_eq!(
            node_port_addrs(&addrs, &cidrs),
            [ip("10.0.0.11"), ip("2001:db8::11")]
        );
    }

    #[test]
    fn hints_narrow_the_cluster_endpoints_as_kube_proxy_reads_them() {
        let s = svc(json!({
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {"type": "NodePort", "clusterIP": "10.96.0.10",
                     "ports": [{"name": "http", "port": 80, "nodePort": 30080}]},
        }));
        let hinted = |zones: [&str; 3], nodes: [&str; 3]| {
            let ep = |i: usize, ip: &str| {
                let mut hints = serde_json::Map::new();
                if !zones[i].is_empty() {
                    hints.insert("forZones".into(), json!([{"name": zones[i]}]));
                }
                if !nodes[i].is_empty() {
                    hints.insert("forNodes".into(), json!([{"name": nodes[i]}]));
                }
                json!({"addresses": [ip], "hints": hints})
            };
            web_slice(
                "web-a",
                "IPv4",
                json!([ep(0, "10.1.0.5"), ep(1, "10.1.1.5"), ep(2, "10.1.2.5"),
                       {"addresses": ["10.1.3.5"], "conditions": {"ready": false}}]),
            )
        };
        let nodes = Nodes {
            addrs: [("172.30.0.11", "n1"), ("172.30.0.12", "n2")]
                .iter()
                .map(|(a, n)| (a.parse().unwrap(), n.to_string()))
                .collect(),
            zones: [("n1", "za"), ("n2", "zb")]
                .iter()
                .map(|(n, z)| (n.to_string(), z.to_string()))
                .collect(),
        };
        let cluster = |sl: &EndpointSlice| frontends([&s], [sl], "n1", &nodes);
        let ip = fe("10.96.0.10", TCP, 80);
        // Zone hints on every ready endpoint (the not-ready one needs
        // none): this zone's.
        let got = cluster(&hinted(["za", "zb", "za"], ["", "", ""]));
        assert_eq!(got[&ip].addrs, sa(&["10.1.0.5:8080", "10.1.2.5:8080"]));
        // n2's node port: as n2's proxy narrows them, to zb.
        assert_eq!(
            got[&fe("172.30.0.12", TCP, 30080)].addrs,
            sa(&["10.1.1.5:8080"])
        );
        // Node hints first, where every ready endpoint has one.
        let got = cluster(&hinted(["za", "zb", "za"], ["n2", "n1", "n2"]));
        assert_eq!(got[&ip].addrs, sa(&["10.1.1.5:8080"]));
        // One ready endpoint without a node hint: zones decide.
        let got = cluster(&hinted(["za", "zb", "za"], ["n2", "", "n2"]));
        assert_eq!(got[&ip].addrs, sa(&["10.1.0.5:8080", "10.1.2.5:8080"]));
        // One without a zone hint, or none for this zone: every endpoint.
        let all = sa(&["10.1.0.5:8080", "10.1.1.5:8080", "10.1.2.5:8080"]);
        assert_eq!(
            cluster(&hinted(["za", "", "za"], ["", "", ""]))[&ip].addrs,
            all
        );
        assert_eq!(
            cluster(&hinted(["zb", "zb", "zc"], ["", "", ""]))[&ip].addrs,
            all
        );
        // A node without a zone label: no zone matches.
        let bare = Nodes {
            addrs: nodes.addrs.clone(),
            zones: BTreeMap::new(),
        };
        let got = frontends(
            [&s],
            [&hinted(["za", "zb", "za"], ["", "", ""])],
            "n1",
            &bare,
        );
        assert_eq!(got[&ip].addrs, all);
    }

    #[test]
    fn client_ip_affinity_with_its_timeout_or_kube_proxys_default() {
        let with = |aff: serde_json::Value| {
            let mut spec = json!({"clusterIP": "10.96.0.10", "sessionAffinity": "ClientIP",
                                  "ports": [{"name": "http", "port": 80}]});
            if !aff.is_null() {
                spec["sessionAffinityConfig"] = aff;
            }
            let s = svc(json!({"metadata": {"name": "web", "namespace": "ns"}, "spec": spec}));
            frontends([&s], [], "n1", &none())[&fe("10.96.0.10", TCP, 80)].affinity_s
        };
        assert_eq!(with(serde_json::Value::Null), 10800);
        assert_eq!(with(json!({"clientIP": {"timeoutSeconds": 60}})), 60);
        let none_set = svc(json!({
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {"clusterIP": "10.96.0.10", "sessionAffinity": "None",
                     "ports": [{"name": "http", "port": 80}]},
        }));
        assert_eq!(
            frontends([&none_set], [], "n1", &none())[&fe("10.96.0.10", TCP, 80)].affinity_s,
            0
        );
    }

    #[test]
    fn health_check_node_ports_count_this_nodes_ready_endpoints() {
        let s = svc(json!({
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.10",
                     "externalTrafficPolicy": "Local", "healthCheckNodePort": 31000,
                     "ports": [{"name": "http", "port": 80, "nodePort": 30080}]},
        }));
        let sl = web_slice(
            "web-a",
            "IPv4",
            json!([
                {"addresses": ["10.1.0.5"], "nodeName": "n1"},
                {"addresses": ["10.1.0.6"], "nodeName": "n1",
                 "conditions": {"ready": false, "serving": true, "terminating": true}},
                {"addresses": ["10.1.1.5"], "nodeName": "n2"},
            ]),
        );
        let got = health_ports([&s], [&sl], "n1");
        assert_eq!(got[&31000].local_endpoints, 1);
        assert_eq!(
            (got[&31000].namespace.as_str(), got[&31000].name.as_str()),
            ("ns", "web")
        );
        // Only terminating ones: none.
        let sl = web_slice(
            "web-a",
            "IPv4",
            json!([{"addresses": ["10.1.0.6"], "nodeName": "n1",
                    "conditions": {"ready": false, "serving": true, "terminating": true}}]),
        );
        assert_eq!(health_ports([&s], [&sl], "n1")[&31000].local_endpoints, 0);
        assert_eq!(health_ports([&s], [&sl], "n3")[&31000].local_endpoints, 0);
    }
}
