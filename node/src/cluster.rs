//! The cluster description: which nodes exist, where they are on the
//! underlay, which pod subnet each owns, and how pod traffic crosses nodes.
//! Parsed from the cluster file here; the Kubernetes source (issue 18) will
//! fill the same type from Node objects.

use std::collections::BTreeSet;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr};

use ipnetwork::Ipv4Network;
use serde_json::{Map, Value};

/// How pod traffic reaches another node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Every peer through the VXLAN device (flannel's kernel layout).
    Vxlan,
    /// A plain route via the peer's underlay address; peers must share the
    /// node's L2.
    HostGw,
    /// host-gw where the peer is on-link, VXLAN elsewhere (flannel's
    /// DirectRouting).
    Auto,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Vxlan => "vxlan",
            Backend::HostGw => "host-gw",
            Backend::Auto => "auto",
        }
    }

    /// Whether the node needs its VXLAN device.
    pub fn uses_vxlan(self) -> bool {
        self != Backend::HostGw
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub name: String,
    /// The node's underlay address: the agent's uplink holds it, peers send
    /// to it.
    pub address: Ipv4Addr,
    pub pod_cidr: Ipv4Network,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster {
    /// The whole pod network: pod traffic to it is not masqueraded.
    pub network: Ipv4Network,
    pub backend: Backend,
    pub vni: u32,
    pub port: u16,
    pub nodes: Vec<Node>,
}

impl Cluster {
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.name == name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterError {
    /// The description is wrong: the message says where.
    Invalid(String),
    /// The description asks for something this agent does not do yet.
    NotImplemented(String),
}

impl fmt::Display for ClusterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClusterError::Invalid(m) => f.write_str(m),
            ClusterError::NotImplemented(m) => write!(f, "{m}: not implemented yet"),
        }
    }
}

impl std::error::Error for ClusterError {}

fn invalid(m: impl Into<String>) -> ClusterError {
    ClusterError::Invalid(m.into())
}

pub const DEFAULT_VNI: u32 = 1;
/// flannel's port (the Linux kernel's historical VXLAN port), not IANA's 4789.
pub const DEFAULT_PORT: u16 = 8472;
/// VNIs are 24 bits.
const MAX_VNI: u32 = (1 << 24) - 1;

/// Parses and checks a cluster file's text.
pub fn parse(text: &str) -> Result<Cluster, ClusterError> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
    let Value::Object(top) = v else {
        return Err(invalid("the cluster file must be a JSON object"));
    };
    const KEYS: &[&str] = &[
        "network",
        "backend",
        "ebpf",
        "encryption",
        "vni",
        "port",
        "nodes",
    ];
    if let Some(k) = top.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(invalid(format!(
            "unknown key {k:?} (known: {})",
            KEYS.join(", ")
        )));
    }
    let network = match top.get("network") {
        None => return Err(invalid("\"network\" is missing (e.g. \"10.244.0.0/16\")")),
        Some(v) => cidr(v, "\"network\"")?,
    };
    let backend = match top.get("backend") {
        None => Backend::Vxlan,
        Some(Value::String(s)) => match s.as_str() {
            "vxlan" => Backend::Vxlan,
            "host-gw" => Backend::HostGw,
            "auto" => Backend::Auto,
            other => {
                return Err(invalid(format!(
                    "\"backend\": {other:?} is not one of \"vxlan\", \"host-gw\", \"auto\""
                )));
            }
        },
        Some(v) => return Err(invalid(format!("\"backend\": expected a string, got {v}"))),
    };
    match top.get("ebpf") {
        None | Some(Value::Bool(false)) => {}
        Some(Value::Bool(true)) => {
            return Err(ClusterError::NotImplemented(
                "\"ebpf\": true (eBPF cross-node forwarding)".into(),
            ));
        }
        Some(v) => {
            return Err(invalid(format!(
                "\"ebpf\": expected true or false, got {v}"
            )));
        }
    }
    match top.get("encryption") {
        None => {}
        Some(Value::String(s)) if s == "none" => {}
        Some(Value::String(s)) if s == "wireguard" => {
            return Err(ClusterError::NotImplemented(
                "\"encryption\": \"wireguard\"".into(),
            ));
        }
        Some(v) => {
            return Err(invalid(format!(
                "\"encryption\": {v} is not one of \"none\", \"wireguard\""
            )));
        }
    }
    let vni = match top.get("vni") {
        None => DEFAULT_VNI,
        Some(v) => match v.as_u64() {
            Some(n) if (1..=u64::from(MAX_VNI)).contains(&n) => n as u32,
            _ => return Err(invalid(format!("\"vni\": {v} is not in 1..={MAX_VNI}"))),
        },
    };
    let port = match top.get("port") {
        None => DEFAULT_PORT,
        Some(v) => match v.as_u64() {
            Some(n) if (1..=65535).contains(&n) => n as u16,
            _ => return Err(invalid(format!("\"port\": {v} is not in 1..=65535"))),
        },
    };
    let nodes = match top.get("nodes") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(invalid("\"nodes\" is empty")),
        None => return Err(invalid("\"nodes\" is missing")),
        Some(v) => return Err(invalid(format!("\"nodes\": expected an array, got {v}"))),
    };
    let mut out = Vec::with_capacity(nodes.len());
    for (i, n) in nodes.iter().enumerate() {
        out.push(parse_node(i, n, network)?);
    }
    let cluster = Cluster {
        network,
        backend,
        vni,
        port,
        nodes: out,
    };
    check_unique(&cluster)?;
    Ok(cluster)
}

fn cidr(v: &Value, what: &str) -> Result<Ipv4Network, ClusterError> {
    let Value::String(s) = v else {
        return Err(invalid(format!("{what}: expected a CIDR string, got {v}")));
    };
    let net: ipnetwork::IpNetwork = s
        .parse()
        .map_err(|e| invalid(format!("{what}: {s:?} is not a CIDR ({e})")))?;
    let ipnetwork::IpNetwork::V4(net) = net else {
        return Err(ClusterError::NotImplemented(format!(
            "{what}: {s:?}: IPv6 pod networks"
        )));
    };
    if net.ip() != net.network() {
        return Err(invalid(format!(
            "{what}: {s:?} has host bits set (the network is {}/{})",
            net.network(),
            net.prefix()
        )));
    }
    Ok(net)
}

fn parse_node(i: usize, v: &Value, network: Ipv4Network) -> Result<Node, ClusterError> {
    let Value::Object(o) = v else {
        return Err(invalid(format!("nodes[{i}]: expected an object, got {v}")));
    };
    let name = match o.get("name") {
        Some(Value::String(s)) if valid_name(s) => s.clone(),
        Some(v) => {
            return Err(invalid(format!(
                "nodes[{i}]: \"name\": {v} is not a node name (1-253 characters, no whitespace or '/')"
            )));
        }
        None => return Err(invalid(format!("nodes[{i}]: \"name\" is missing"))),
    };
    let at = format!("node {name:?} (nodes[{i}])");
    node_keys(o, &at)?;
    let address = match o.get("address") {
        None => return Err(invalid(format!("{at}: \"address\" is missing"))),
        Some(Value::String(s)) => match s.parse::<IpAddr>() {
            Ok(IpAddr::V4(a)) if !a.is_unspecified() && !a.is_multicast() && !a.is_broadcast() => a,
            Ok(IpAddr::V4(_)) => {
                return Err(invalid(format!(
                    "{at}: \"address\": {s:?} is not a unicast address"
                )));
            }
            Ok(IpAddr::V6(_)) => {
                return Err(ClusterError::NotImplemented(format!(
                    "{at}: \"address\": {s:?}: IPv6 underlays"
                )));
            }
            Err(_) => {
                return Err(invalid(format!(
                    "{at}: \"address\": {s:?} is not an IP address"
                )));
            }
        },
        Some(v) => {
            return Err(invalid(format!(
                "{at}: \"address\": expected a string, got {v}"
            )));
        }
    };
    if o.contains_key("address6") {
        return Err(ClusterError::NotImplemented(format!(
            "{at}: \"address6\" (dual-stack clusters)"
        )));
    }
    let mut pod_cidr = match o.get("podCIDR") {
        Some(v) => Some(cidr(v, &format!("{at}: \"podCIDR\""))?),
        None => None,
    };
    if let Some(list) = o.get("podCIDRs") {
        let Value::Array(list) = list else {
            return Err(invalid(format!(
                "{at}: \"podCIDRs\": expected an array, got {list}"
            )));
        };
        for (j, c) in list.iter().enumerate() {
            let what = format!("{at}: \"podCIDRs\"[{j}]");
            let net = cidr(c, &what).map_err(|e| match e {
                ClusterError::NotImplemented(_) => {
                    ClusterError::NotImplemented(format!("{what}: IPv6 pod subnets (dual-stack)"))
                }
                e => e,
            })?;
            match pod_cidr {
                Some(p) if p != net => {
                    return Err(invalid(format!(
                        "{what}: {net} differs from \"podCIDR\" {p}"
                    )));
                }
                _ => pod_cidr = Some(net),
            }
        }
    }
    let Some(pod_cidr) = pod_cidr else {
        return Err(invalid(format!("{at}: \"podCIDR\" is missing")));
    };
    if !(pod_cidr.prefix() >= network.prefix() && network.contains(pod_cidr.network())) {
        return Err(invalid(format!(
            "{at}: \"podCIDR\" {pod_cidr} is outside \"network\" {network}"
        )));
    }
    if pod_cidr.prefix() > 30 {
        return Err(invalid(format!(
            "{at}: \"podCIDR\" {pod_cidr} is too small (at most /30: .0 is the tunnel address, .1 the gateway)"
        )));
    }
    Ok(Node {
        name,
        address,
        pod_cidr,
    })
}

fn node_keys(o: &Map<String, Value>, at: &str) -> Result<(), ClusterError> {
    const KEYS: &[&str] = &["name", "address", "podCIDR", "podCIDRs", "address6"];
    match o.keys().find(|k| !KEYS.contains(&k.as_str())) {
        Some(k) => Err(invalid(format!(
            "{at}: unknown key {k:?} (known: {})",
            KEYS.join(", ")
        ))),
        None => Ok(()),
    }
}

fn valid_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && !s.chars().any(|c| c.is_whitespace() || c == '/')
}

/// Names and addresses unique, pod subnets disjoint.
fn check_unique(c: &Cluster) -> Result<(), ClusterError> {
    let mut names = BTreeSet::new();
    let mut addrs = std::collections::BTreeMap::new();
    for n in &c.nodes {
        if !names.insert(n.name.as_str()) {
            return Err(invalid(format!(
                "node {:?} is listed more than once",
                n.name
            )));
        }
        if let Some(other) = addrs.insert(n.address, n.name.as_str()) {
            return Err(invalid(format!(
                "nodes {other:?} and {:?} have the same \"address\" {}",
                n.name, n.address
            )));
        }
    }
    // Sorted by first address, two CIDRs overlap only if one contains the
    // next: a neighbour check finds every overlap in O(n log n).
    let mut by_start: Vec<&Node> = c.nodes.iter().collect();
    by_start.sort_by_key(|n| (u32::from(n.pod_cidr.network()), n.pod_cidr.prefix()));
    for w in by_start.windows(2) {
        let (a, b) = (w[0], w[1]);
        if u32::from(a.pod_cidr.broadcast()) >= u32::from(b.pod_cidr.network()) {
            return Err(invalid(format!(
                "nodes {:?} and {:?} have overlapping \"podCIDR\"s {} and {}",
                a.name, b.name, a.pod_cidr, b.pod_cidr
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(extra: &str, nodes: &str) -> String {
        format!(r#"{{"network": "10.244.0.0/16" {extra}, "nodes": [{nodes}]}}"#)
    }

    const TWO: &str = r#"{"name": "n1", "address": "192.168.50.1", "podCIDR": "10.244.1.0/24"},
                         {"name": "n2", "address": "192.168.50.2", "podCIDR": "10.244.2.0/24"}"#;

    fn err(text: &str) -> String {
        match parse(text) {
            Err(ClusterError::Invalid(m)) => m,
            other => panic!("expected an invalid-file error, got {other:?}"),
        }
    }

    #[test]
    fn defaults_and_fields() {
        let c = parse(&file("", TWO)).unwrap();
        assert_eq!(c.backend, Backend::Vxlan);
        assert_eq!((c.vni, c.port), (1, 8472));
        assert_eq!(c.nodes.len(), 2);
        assert_eq!(
            c.node("n2").unwrap().address,
            Ipv4Addr::new(192, 168, 50, 2)
        );
        let c = parse(&file(
            r#", "backend": "auto", "vni": 7, "port": 4789, "ebpf": false, "encryption": "none""#,
            TWO,
        ))
        .unwrap();
        assert_eq!((c.backend, c.vni, c.port), (Backend::Auto, 7, 4789));
        // podCIDRs with the same IPv4 subnet is the same node.
        let c = parse(&file(
            "",
            r#"{"name": "n1", "address": "192.168.50.1", "podCIDRs": ["10.244.1.0/24"]}"#,
        ))
        .unwrap();
        assert_eq!(c.nodes[0].pod_cidr.to_string(), "10.244.1.0/24");
    }

    #[test]
    fn errors_name_node_and_field() {
        let m = err(&file(
            "",
            r#"{"name": "n1", "address": "192.168.50.1", "podCIDR": "10.244.1.0/24"},
               {"name": "n2", "address": "192.168.50.x", "podCIDR": "10.244.2.0/24"}"#,
        ));
        assert!(
            m.contains("node \"n2\" (nodes[1])") && m.contains("\"address\""),
            "{m}"
        );
        let m = err(&file(
            "",
            r#"{"name": "n1", "address": "192.168.50.1", "podCIDR": "10.245.1.0/24"}"#,
        ));
        assert!(
            m.contains("\"n1\"") && m.contains("outside \"network\" 10.244.0.0/16"),
            "{m}"
        );
        let m = err(&file(
            "",
            r#"{"name": "n1", "address": "192.168.50.1", "podCIDR": "10.244.1.0/24"},
               {"name": "n2", "address": "192.168.50.2", "podCIDR": "10.244.0.0/23"}"#,
        ));
        assert!(
            m.contains("overlapping") && m.contains("\"n1\"") && m.contains("\"n2\""),
            "{m}"
        );
        let m = err(&file(
            "",
            r#"{"name": "n1", "address": "192.168.50.1", "podCIDR": "10.244.1.0/24"},
               {"name": "n1", "address": "192.168.50.2", "podCIDR": "10.244.2.0/24"}"#,
        ));
        assert!(m.contains("more than once"), "{m}");
        let m = err(&file(
            "",
            r#"{"name": "n1", "address": "192.168.50.1", "podCIDR": "10.244.1.0/24"},
               {"name": "n2", "address": "192.168.50.1", "podCIDR": "10.244.2.0/24"}"#,
        ));
        assert!(m.contains("same \"address\""), "{m}");
        let m = err(&file(
            "",
            r#"{"name": "n1", "address": "192.168.50.1", "podCIDR": "10.244.1.5/24"}"#,
        ));
        assert!(m.contains("host bits"), "{m}");
        let m = err(&file("", r#"{"name": "n1", "address": "192.168.50.1"}"#));
        assert!(
            m.contains("\"n1\"") && m.contains("\"podCIDR\" is missing"),
            "{m}"
        );
        let m = err(&file(
            "",
            r#"{"name": "n1", "adress": "192.168.50.1", "podCIDR": "10.244.1.0/24"}"#,
        ));
        assert!(m.contains("unknown key \"adress\""), "{m}");
        assert!(err(&file(r#", "backend": "udp""#, TWO)).contains("\"backend\""));
        assert!(err(&file(r#", "vni": 0"#, TWO)).contains("\"vni\""));
        assert!(err(&file(r#", "vni": 16777216"#, TWO)).contains("\"vni\""));
        assert!(err(&file(r#", "port": 70000"#, TWO)).contains("\"port\""));
        assert!(err(r#"{"nodes": []}"#).contains("\"network\" is missing"));
        assert!(err(r#"{"network": "10.244.0.0/16", "nodes": []}"#).contains("empty"));
        assert!(err("{").contains("not valid JSON"));
    }

    #[test]
    fn unimplemented_features_say_so() {
        for extra in [r#", "ebpf": true"#, r#", "encryption": "wireguard""#] {
            match parse(&file(extra, TWO)) {
                Err(e @ ClusterError::NotImplemented(_)) => {
                    assert!(e.to_string().ends_with("not implemented yet"), "{e}")
                }
                other => panic!("{extra}: {other:?}"),
            }
        }
        let v6 = r#"{"name": "n1", "address": "192.168.50.1", "podCIDRs": ["10.244.1.0/24", "fd00:1::/64"]}"#;
        assert!(matches!(
            parse(&file("", v6)),
            Err(ClusterError::NotImplemented(_))
        ));
    }
}
