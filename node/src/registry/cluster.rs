//! The cluster description: which nodes exist, where they are on the
//! underlay, which pod subnet each owns, and how pod traffic crosses nodes.
//! Parsed from the cluster file here; the Kubernetes source (`k8s`) fills
//! the same type from Node objects, with the network config of a cluster
//! file without "nodes" (`parse_net_conf`).

use std::collections::BTreeSet;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnetwork::{IpNetwork, Ipv4Network, Ipv6Network};
use rcni_netlink::MacAddr;
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
    /// Routes learned over BGP (BIRD, as Calico), with Calico's
    /// `vxlanMode` for the peers that are tunnelled anyway.
    Bgp(VxlanMode),
}

/// Calico's `vxlanMode` with BGP: which peers go through the VXLAN device
/// instead of the BGP-learned routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VxlanMode {
    Never,
    /// Peers off the node's subnet (on-link peers are routed by BGP).
    CrossSubnet,
    Always,
}

impl VxlanMode {
    pub fn as_str(self) -> &'static str {
        match self {
            VxlanMode::Never => "Never",
            VxlanMode::CrossSubnet => "CrossSubnet",
            VxlanMode::Always => "Always",
        }
    }
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Vxlan => "vxlan",
            Backend::HostGw => "host-gw",
            Backend::Auto => "auto",
            Backend::Bgp(_) => "bgp",
        }
    }

    /// Whether the node needs its VXLAN device.
    pub fn uses_vxlan(self) -> bool {
        !matches!(self, Backend::HostGw | Backend::Bgp(VxlanMode::Never))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub name: String,
    /// The node's IPv4 underlay address (the agent's uplink holds it, peers
    /// send to it) and its IPv4 pod subnet. Both `None` on the nodes of an
    /// IPv6-only cluster, whose IPv6 "address" and "podCIDR" are
    /// `address6` and `pod_cidr6`: one IPv6 code path then serves
    /// dual-stack and IPv6-only nodes, and the IPv4 one is skipped.
    pub address: Option<Ipv4Addr>,
    pub pod_cidr: Option<Ipv4Network>,
    /// Dual-stack: the node's IPv6 underlay address (peers' IPv6 pod
    /// traffic is sent to it) and its IPv6 pod subnet. Both or neither
    /// carry IPv6 pods.
    pub address6: Option<Ipv6Addr>,
    pub pod_cidr6: Option<Ipv6Network>,
    /// The VTEP MACs the node published (Kubernetes: its annotations);
    /// `None` for a cluster file, where every node derives them from the
    /// name (`desired::vtep_mac`).
    pub vtep_mac: Option<MacAddr>,
    pub vtep_mac6: Option<MacAddr>,
    /// The node's WireGuard public key (`"wireguardPublicKey"`, or its
    /// Node annotation); `None` until it is known.
    pub wireguard_key: Option<[u8; 32]>,
    /// BGP: this node's AS when it differs from the cluster's (Calico's
    /// per-node `asNumber`), and its own peers beside the cluster's.
    pub bgp_as: Option<u32>,
    pub bgp_peers: Vec<BgpPeer>,
}

impl Node {
    /// The node's underlay address: its IPv4 one, or an IPv6-only node's
    /// IPv6 one (WireGuard's endpoint, the one address peers know it by).
    pub fn underlay(&self) -> IpAddr {
        match (self.address, self.address6) {
            (Some(a), _) => IpAddr::V4(a),
            (None, Some(a6)) => IpAddr::V6(a6),
            // parse_node gives every node one or the other.
            (None, None) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        }
    }
}

/// A BGP neighbour (Calico's BGPPeer: `peerIP`, `asNumber`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct BgpPeer {
    pub ip: IpAddr,
    pub as_number: u32,
}

/// `"backend": "bgp"`'s settings, in Calico's BGPConfiguration spelling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BgpConf {
    pub as_number: u32,
    /// Every node peers with every other (iBGP full mesh); off, only the
    /// listed peers (route reflectors, top-of-rack routers).
    pub mesh: bool,
    pub peers: Vec<BgpPeer>,
}

/// Calico's default AS.
pub const DEFAULT_AS: u32 = 64512;

/// Calico's defaults: AS 64512, the full mesh, no listed peers.
impl Default for BgpConf {
    fn default() -> BgpConf {
        BgpConf {
            as_number: DEFAULT_AS,
            mesh: true,
            peers: Vec::new(),
        }
    }
}

/// How node-to-node pod traffic is protected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encryption {
    None,
    /// Every peer through the node's WireGuard device, whatever the
    /// backend says: WireGuard is the tunnel (VXLAN is not nested inside
    /// it, and host-gw's direct routes would bypass it).
    WireGuard,
}

/// WireGuard's customary port.
pub const DEFAULT_WIREGUARD_PORT: u16 = 51820;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster {
    /// The whole pod network: pod traffic to it is not masqueraded.
    /// `None`: an IPv6-only cluster (the file's IPv6 "network" is
    /// `network6`).
    pub network: Option<Ipv4Network>,
    /// Dual-stack: the cluster's IPv6 pod network; IPv6-only: its only one.
    pub network6: Option<Ipv6Network>,
    pub backend: Backend,
    /// eBPF cross-node forwarding: the conflist gets the fastpath plugin,
    /// the agent keeps the datapath's other-node map and its program on the
    /// uplink and VXLAN devices.
    pub ebpf: bool,
    pub vni: u32,
    pub port: u16,
    pub encryption: Encryption,
    pub wireguard_port: u16,
    /// Set with `Backend::Bgp` only.
    pub bgp: Option<BgpConf>,
    pub nodes: Vec<Node>,
}

impl Cluster {
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// No IPv4 anywhere: an IPv6 "network" alone.
    pub fn v6_only(&self) -> bool {
        self.network.is_none()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterError {
    /// The description is wrong: the message says where.
    Invalid(String),
    /// The description asks for something this agent does not do yet.
    NotImplemented(String),
    /// The source is fine but this node is not in it, or has no usable
    /// lease there (Kubernetes: no Node, no podCIDR).
    ThisNode(String),
}

impl fmt::Display for ClusterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClusterError::Invalid(m) | ClusterError::ThisNode(m) => f.write_str(m),
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

/// The cluster without its nodes: what a Kubernetes cluster's agents share
/// (flannel's net-conf.json), the node list coming from Node objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConf {
    /// `None`: IPv6-only (see `Cluster::network`).
    pub network: Option<Ipv4Network>,
    pub network6: Option<Ipv6Network>,
    pub backend: Backend,
    pub ebpf: bool,
    pub vni: u32,
    pub port: u16,
    pub encryption: Encryption,
    pub wireguard_port: u16,
    pub bgp: Option<BgpConf>,
    /// Services in the eBPF datapath instead of kube-proxy's rules
    /// (`"kubeProxyReplacement"`, a net-conf key only: Services come from
    /// the API).
    pub kube_proxy_replacement: bool,
    /// Which node addresses answer node ports with
    /// `kubeProxyReplacement` (`"nodePortAddresses"`, kube-proxy's
    /// setting of the same name and values).
    pub node_port_addresses: NodePortAddresses,
}

/// kube-proxy's `nodePortAddresses`: every address of a node (unset),
/// each node's primary addresses (`["primary"]`), or those in the CIDRs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum NodePortAddresses {
    #[default]
    All,
    Primary,
    Cidrs(Vec<IpNetwork>),
}

impl NetConf {
    pub fn with_nodes(&self, nodes: Vec<Node>) -> Result<Cluster, ClusterError> {
        let cluster = Cluster {
            network: self.network,
            network6: self.network6,
            backend: self.backend,
            ebpf: self.ebpf,
            vni: self.vni,
            port: self.port,
            encryption: self.encryption,
            wireguard_port: self.wireguard_port,
            bgp: self.bgp.clone(),
            nodes,
        };
        check_unique(&cluster)?;
        Ok(cluster)
    }
}

/// The keys of a cluster file but "nodes".
const NET_KEYS: &[&str] = &[
    "network",
    "network6",
    "backend",
    "ebpf",
    "encryption",
    "vni",
    "port",
    "wireguardPort",
    "bgp",
];

fn object(text: &str, what: &str) -> Result<Map<String, Value>, ClusterError> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
    match v {
        Value::Object(top) => Ok(top),
        _ => Err(invalid(format!("the {what} must be a JSON object"))),
    }
}

fn known_keys(top: &Map<String, Value>, keys: &[&str]) -> Result<(), ClusterError> {
    match top.keys().find(|k| !keys.contains(&k.as_str())) {
        Some(k) => Err(invalid(format!(
            "unknown key {k:?} (known: {})",
            keys.join(", ")
        ))),
        None => Ok(()),
    }
}

/// Parses and checks a network config (a cluster file without "nodes").
pub fn parse_net_conf(text: &str) -> Result<NetConf, ClusterError> {
    let top = object(text, "network config")?;
    if top.contains_key("nodes") {
        return Err(invalid(
            "\"nodes\" does not belong in the network config: with --kubernetes the nodes are the cluster's Node objects",
        ));
    }
    let mut keys = NET_KEYS.to_vec();
    keys.extend(NET_CONF_ONLY_KEYS);
    known_keys(&top, &keys)?;
    let mut net = net_conf(&top)?;
    net.kube_proxy_replacement = match top.get(KUBE_PROXY_REPLACEMENT) {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(invalid(format!(
                "\"{KUBE_PROXY_REPLACEMENT}\": expected true or false, got {v}"
            )));
        }
    };
    if let Some(v) = top.get(NODE_PORT_ADDRESSES) {
        net.node_port_addresses = node_port_addresses(v)?;
    }
    Ok(net)
}

/// `"nodePortAddresses"`: as kube-proxy validates it, a list of CIDRs, or
/// `["primary"]` alone.
fn node_port_addresses(v: &Value) -> Result<NodePortAddresses, ClusterError> {
    let bad = |why: String| invalid(format!("\"{NODE_PORT_ADDRESSES}\": {why}"));
    let Value::Array(items) = v else {
        return Err(bad(format!(
            "expected a list of CIDRs or [\"primary\"], got {v}"
        )));
    };
    let strs: Vec<&str> = items
        .iter()
        .map(|i| {
            i.as_str()
                .ok_or_else(|| bad(format!("{i} is not a string")))
        })
        .collect::<Result<_, _>>()?;
    if strs.contains(&"primary") {
        return match strs.len() {
            1 => Ok(NodePortAddresses::Primary),
            _ => Err(bad("\"primary\" goes alone, not beside CIDRs".into())),
        };
    }
    if strs.is_empty() {
        return Ok(NodePortAddresses::All);
    }
    strs.iter()
        .map(|s| {
            s.parse::<IpNetwork>()
                .map_err(|e| bad(format!("{s:?} is not a CIDR ({e})")))
        })
        .collect::<Result<_, _>>()
        .map(NodePortAddresses::Cidrs)
}

const KUBE_PROXY_REPLACEMENT: &str = "kubeProxyReplacement";
const NODE_PORT_ADDRESSES: &str = "nodePortAddresses";
/// Keys of the net-conf but not of a cluster file: Services come from the
/// API.
const NET_CONF_ONLY_KEYS: &[&str] = &["kubeProxyReplacement", "nodePortAddresses"];

/// Parses and checks a cluster file's text.
pub fn parse(text: &str) -> Result<Cluster, ClusterError> {
    let top = object(text, "cluster file")?;
    let mut keys = NET_KEYS.to_vec();
    keys.push("nodes");
    known_keys(&top, &keys)?;
    let net = net_conf(&top)?;
    let nodes = match top.get("nodes") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(invalid("\"nodes\" is empty")),
        None => return Err(invalid("\"nodes\" is missing")),
        Some(v) => return Err(invalid(format!("\"nodes\": expected an array, got {v}"))),
    };
    let mut out = Vec::with_capacity(nodes.len());
    for (i, n) in nodes.iter().enumerate() {
        out.push(parse_node(
            &format!("nodes[{i}]"),
            n,
            net.network,
            net.network6,
        )?);
    }
    net.with_nodes(out)
}

fn net_conf(top: &Map<String, Value>) -> Result<NetConf, ClusterError> {
    let network = match top.get("network") {
        None => return Err(invalid("\"network\" is missing (e.g. \"10.244.0.0/16\")")),
        Some(v) => cidr(v, "\"network\"")?,
    };
    let network6 = match top.get("network6") {
        None => None,
        Some(v) => match cidr(v, "\"network6\"")? {
            IpNetwork::V6(n) => Some(n),
            IpNetwork::V4(n) => {
                return Err(invalid(format!("\"network6\": {n} is not an IPv6 network")));
            }
        },
    };
    // An IPv6 "network" alone makes the cluster IPv6-only; dual-stack keeps
    // its IPv4 "network" and adds "network6".
    let (network, network6) = match (network, network6) {
        (IpNetwork::V4(n), n6) => (Some(n), n6),
        (IpNetwork::V6(n), None) => (None, Some(n)),
        (IpNetwork::V6(n), Some(n6)) => {
            return Err(invalid(format!(
                "\"network6\": {n6} beside an IPv6 \"network\" {n}: \"network6\" is for dual-stack clusters (with an IPv4 \"network\"); an IPv6 \"network\" alone makes the cluster IPv6-only"
            )));
        }
    };
    let backend = match top.get("backend") {
        None => Backend::Vxlan,
        Some(Value::String(s)) => match s.as_str() {
            "vxlan" => Backend::Vxlan,
            "host-gw" => Backend::HostGw,
            "auto" => Backend::Auto,
            "bgp" => Backend::Bgp(VxlanMode::Never),
            other => {
                return Err(invalid(format!(
                    "\"backend\": {other:?} is not one of \"vxlan\", \"host-gw\", \"auto\", \"bgp\""
                )));
            }
        },
        Some(v) => return Err(invalid(format!("\"backend\": expected a string, got {v}"))),
    };
    let ebpf = match top.get("ebpf") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(invalid(format!(
                "\"ebpf\": expected true or false, got {v}"
            )));
        }
    };
    let encryption = match top.get("encryption") {
        None => Encryption::None,
        Some(Value::String(s)) if s == "none" => Encryption::None,
        Some(Value::String(s)) if s == "wireguard" => Encryption::WireGuard,
        Some(v) => {
            return Err(invalid(format!(
                "\"encryption\": {v} is not one of \"none\", \"wireguard\""
            )));
        }
    };
    let wireguard_port = match top.get("wireguardPort") {
        None => DEFAULT_WIREGUARD_PORT,
        Some(v) => match v.as_u64() {
            Some(n) if (1..=65535).contains(&n) => n as u16,
            _ => {
                return Err(invalid(format!(
                    "\"wireguardPort\": {v} is not in 1..=65535"
                )));
            }
        },
    };
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
    let (backend, bgp) = match (backend, top.get("bgp")) {
        (Backend::Bgp(_), v) => {
            let (conf, mode) = bgp_conf(v.unwrap_or(&Value::Null))?;
            (Backend::Bgp(mode), Some(conf))
        }
        (_, None) => (backend, None),
        (b, Some(_)) => {
            return Err(invalid(format!(
                "\"bgp\" is for \"backend\": \"bgp\" (the backend is {:?})",
                b.as_str()
            )));
        }
    };
    if ebpf && encryption == Encryption::WireGuard {
        // The redirect would hand pod packets to the uplink or the VXLAN
        // device, around the WireGuard device: in the clear.
        return Err(invalid(
            "\"ebpf\": true with \"encryption\": \"wireguard\": eBPF forwarding does not go through the WireGuard device (it would send pod traffic unencrypted); use one or the other",
        ));
    }
    Ok(NetConf {
        network,
        network6,
        backend,
        ebpf,
        vni,
        port,
        encryption,
        wireguard_port,
        bgp,
        kube_proxy_replacement: false,
        node_port_addresses: NodePortAddresses::All,
    })
}

/// The `"bgp"` object (absent: every default).
fn bgp_conf(v: &Value) -> Result<(BgpConf, VxlanMode), ClusterError> {
    const KEYS: &[&str] = &["asNumber", "nodeToNodeMeshEnabled", "peers", "vxlanMode"];
    let empty = Map::new();
    let o = match v {
        Value::Null => &empty,
        Value::Object(o) => o,
        v => return Err(invalid(format!("\"bgp\": expected an object, got {v}"))),
    };
    if let Some(k) = o.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(invalid(format!(
            "\"bgp\": unknown key {k:?} (known: {})",
            KEYS.join(", ")
        )));
    }
    let as_number = match o.get("asNumber") {
        None => DEFAULT_AS,
        Some(v) => as_number(v, "\"bgp\": \"asNumber\"")?,
    };
    let mesh = match o.get("nodeToNodeMeshEnabled") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(invalid(format!(
                "\"bgp\": \"nodeToNodeMeshEnabled\": expected true or false, got {v}"
            )));
        }
    };
    let peers = match o.get("peers") {
        None => Vec::new(),
        Some(v) => bgp_peers(v, "\"bgp\": \"peers\"")?,
    };
    let mode = match o.get("vxlanMode") {
        None => VxlanMode::Never,
        Some(Value::String(s)) if s == "Never" => VxlanMode::Never,
        Some(Value::String(s)) if s == "CrossSubnet" => VxlanMode::CrossSubnet,
        Some(Value::String(s)) if s == "Always" => VxlanMode::Always,
        Some(v) => {
            return Err(invalid(format!(
                "\"bgp\": \"vxlanMode\": {v} is not one of \"Never\", \"CrossSubnet\", \"Always\""
            )));
        }
    };
    Ok((
        BgpConf {
            as_number,
            mesh,
            peers,
        },
        mode,
    ))
}

/// A 4-byte AS number (RFC 6793); 0 is reserved (RFC 7607).
fn as_number(v: &Value, what: &str) -> Result<u32, ClusterError> {
    // Calico's annotations and some tools write it as a string.
    let n = match v {
        Value::String(s) => s.parse::<u64>().ok(),
        v => v.as_u64(),
    };
    match n {
        Some(n) if (1..=u64::from(u32::MAX)).contains(&n) => Ok(n as u32),
        _ => Err(invalid(format!(
            "{what}: {v} is not an AS number (1..=4294967295)"
        ))),
    }
}

/// A list of `{"peerIP": ..., "asNumber": ...}`.
pub fn bgp_peers(v: &Value, what: &str) -> Result<Vec<BgpPeer>, ClusterError> {
    let Value::Array(a) = v else {
        return Err(invalid(format!("{what}: expected an array, got {v}")));
    };
    let mut out = Vec::with_capacity(a.len());
    for (i, p) in a.iter().enumerate() {
        let at = format!("{what}[{i}]");
        let Value::Object(o) = p else {
            return Err(invalid(format!("{at}: expected an object, got {p}")));
        };
        if let Some(k) = o.keys().find(|k| *k != "peerIP" && *k != "asNumber") {
            return Err(invalid(format!(
                "{at}: unknown key {k:?} (known: peerIP, asNumber)"
            )));
        }
        let ip = match o.get("peerIP") {
            Some(Value::String(s)) => match s.parse::<IpAddr>() {
                Ok(ip) if !ip.is_unspecified() && !ip.is_multicast() && !ip.is_loopback() => ip,
                _ => {
                    return Err(invalid(format!(
                        "{at}: \"peerIP\": {s:?} is not a unicast IP address"
                    )));
                }
            },
            Some(v) => {
                return Err(invalid(format!(
                    "{at}: \"peerIP\": expected a string, got {v}"
                )));
            }
            None => return Err(invalid(format!("{at}: \"peerIP\" is missing"))),
        };
        let as_number = match o.get("asNumber") {
            Some(v) => as_number(v, &format!("{at}: \"asNumber\""))?,
            None => return Err(invalid(format!("{at}: \"asNumber\" is missing"))),
        };
        if out.iter().any(|p: &BgpPeer| p.ip == ip) {
            return Err(invalid(format!("{at}: peer {ip} is listed twice")));
        }
        out.push(BgpPeer { ip, as_number });
    }
    Ok(out)
}

fn cidr(v: &Value, what: &str) -> Result<IpNetwork, ClusterError> {
    let Value::String(s) = v else {
        return Err(invalid(format!("{what}: expected a CIDR string, got {v}")));
    };
    let net: ipnetwork::IpNetwork = s
        .parse()
        .map_err(|e| invalid(format!("{what}: {s:?} is not a CIDR ({e})")))?;
    if net.ip() != net.network() {
        return Err(invalid(format!(
            "{what}: {s:?} has host bits set (the network is {}/{})",
            net.network(),
            net.prefix()
        )));
    }
    Ok(net)
}

/// One node in the cluster file's form; `origin` says where it came from
/// in messages (`nodes[3]`, or a Kubernetes Node).
pub fn parse_node(
    origin: &str,
    v: &Value,
    network: Option<Ipv4Network>,
    network6: Option<Ipv6Network>,
) -> Result<Node, ClusterError> {
    let Value::Object(o) = v else {
        return Err(invalid(format!("{origin}: expected an object, got {v}")));
    };
    let name = match o.get("name") {
        Some(Value::String(s)) if valid_name(s) => s.clone(),
        Some(v) => {
            return Err(invalid(format!(
                "{origin}: \"name\": {v} is not a node name (1-253 characters, no whitespace or '/')"
            )));
        }
        None => return Err(invalid(format!("{origin}: \"name\" is missing"))),
    };
    let at = format!("node {name:?} ({origin})");
    node_keys(o, &at)?;
    let address = match o.get("address") {
        None => return Err(invalid(format!("{at}: \"address\" is missing"))),
        Some(Value::String(s)) => match s.parse::<IpAddr>() {
            Ok(IpAddr::V4(_)) if network.is_none() => {
                return Err(invalid(format!(
                    "{at}: \"address\": {s:?} is IPv4 and the cluster is IPv6-only (an IPv6 \"network\"): the node's IPv6 address"
                )));
            }
            Ok(IpAddr::V4(a)) if !a.is_unspecified() && !a.is_multicast() && !a.is_broadcast() => {
                IpAddr::V4(a)
            }
            Ok(IpAddr::V4(_)) => {
                return Err(invalid(format!(
                    "{at}: \"address\": {s:?} is not a unicast address"
                )));
            }
            // IPv6-only: the node's underlay is IPv6.
            Ok(IpAddr::V6(a))
                if network.is_none()
                    && !a.is_unspecified()
                    && !a.is_multicast()
                    && !a.is_loopback() =>
            {
                IpAddr::V6(a)
            }
            Ok(IpAddr::V6(_)) if network.is_none() => {
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
    let address6 = match o.get("address6") {
        None => None,
        Some(_) if network.is_none() => {
            return Err(invalid(format!(
                "{at}: \"address6\" is for dual-stack clusters; in an IPv6-only cluster \"address\" is the node's IPv6 address"
            )));
        }
        Some(Value::String(s)) => match s.parse::<IpAddr>() {
            Ok(IpAddr::V6(a)) if !a.is_unspecified() && !a.is_multicast() && !a.is_loopback() => {
                Some(a)
            }
            Ok(IpAddr::V6(_)) => {
                return Err(invalid(format!(
                    "{at}: \"address6\": {s:?} is not a unicast address"
                )));
            }
            _ => {
                return Err(invalid(format!(
                    "{at}: \"address6\": {s:?} is not an IPv6 address"
                )));
            }
        },
        Some(v) => {
            return Err(invalid(format!(
                "{at}: \"address6\": expected a string, got {v}"
            )));
        }
    };
    // "podCIDR" and every "podCIDRs" entry: at most one subnet per family
    // (Kubernetes' podCIDRs rule), the single field agreeing with the list.
    let mut given: Vec<(String, IpNetwork)> = Vec::new();
    if let Some(v) = o.get("podCIDR") {
        let what = format!("{at}: \"podCIDR\"");
        given.push(("\"podCIDR\"".into(), cidr(v, &what)?));
    }
    if let Some(list) = o.get("podCIDRs") {
        let Value::Array(list) = list else {
            return Err(invalid(format!(
                "{at}: \"podCIDRs\": expected an array, got {list}"
            )));
        };
        for (j, c) in list.iter().enumerate() {
            let what = format!("\"podCIDRs\"[{j}]");
            given.push((what.clone(), cidr(c, &format!("{at}: {what}"))?));
        }
    }
    let mut pod_cidr: Option<(String, Ipv4Network)> = None;
    let mut pod_cidr6: Option<(String, Ipv6Network)> = None;
    for (what, net) in given {
        match net {
            IpNetwork::V4(n) => match &pod_cidr {
                Some((w, p)) if *p != n => {
                    return Err(invalid(format!(
                        "{at}: {what}: {n} differs from {w} {p} (at most one IPv4 pod subnet per node)"
                    )));
                }
                Some(_) => {}
                None => pod_cidr = Some((what, n)),
            },
            IpNetwork::V6(n) => match &pod_cidr6 {
                Some((w, p)) if *p != n => {
                    return Err(invalid(format!(
                        "{at}: {what}: {n} differs from {w} {p} (at most one IPv6 pod subnet per node)"
                    )));
                }
                Some(_) => {}
                None => pod_cidr6 = Some((what, n)),
            },
        }
    }
    // The node's two underlay fields: an IPv6-only node's one address is
    // its `address6`.
    let (address, address6) = match address {
        IpAddr::V4(a) => (Some(a), address6),
        IpAddr::V6(a) => (None, Some(a)),
    };
    if network.is_none()
        && let Some((what, n)) = &pod_cidr
    {
        return Err(invalid(format!(
            "{at}: {what}: {n} is IPv4 and the cluster is IPv6-only (an IPv6 \"network\" alone; dual-stack: an IPv4 \"network\" and \"network6\")"
        )));
    }
    // Where the IPv6 pod network came from, for messages.
    let net6_key = if network.is_none() {
        "\"network\""
    } else {
        "\"network6\""
    };
    let pod_cidr6 = match pod_cidr6 {
        None => None,
        Some((what, n)) => {
            let Some(network6) = network6 else {
                return Err(invalid(format!(
                    "{at}: {what}: {n} is IPv6 and the cluster has no \"network6\""
                )));
            };
            if !(n.prefix() >= network6.prefix() && network6.contains(n.network())) {
                return Err(invalid(format!(
                    "{at}: {what}: {n} is outside {net6_key} {network6}"
                )));
            }
            if n.prefix() > 126 {
                return Err(invalid(format!(
                    "{at}: {what}: {n} is too small (at most /126: ::0 is the tunnel address, ::1 the gateway)"
                )));
            }
            if address6.is_none() {
                return Err(invalid(format!(
                    "{at}: {what}: {n} is IPv6 and \"address6\" is missing (peers send the node's IPv6 pod traffic to it)"
                )));
            }
            Some(n)
        }
    };
    let wireguard_key = match o.get("wireguardPublicKey") {
        None => None,
        Some(Value::String(s)) => Some(crate::wgkey::decode(s).map_err(|e| {
            invalid(format!(
                "{at}: \"wireguardPublicKey\": {s:?} is not a WireGuard key: {e}"
            ))
        })?),
        Some(v) => {
            return Err(invalid(format!(
                "{at}: \"wireguardPublicKey\": expected a base64 string, got {v}"
            )));
        }
    };
    let bgp_as = o
        .get("asNumber")
        .map(|v| as_number(v, &format!("{at}: \"asNumber\"")))
        .transpose()?;
    let bgp_peers = match o.get("peers") {
        None => Vec::new(),
        Some(v) => bgp_peers(v, &format!("{at}: \"peers\""))?,
    };
    let pod_cidr = pod_cidr.map(|(_, n)| n);
    let Some(network) = network else {
        // IPv6-only: its IPv6 subnet is the node's one.
        if pod_cidr6.is_none() {
            return Err(invalid(format!("{at}: \"podCIDR\" is missing")));
        }
        return Ok(Node {
            name,
            address: None,
            pod_cidr: None,
            address6,
            pod_cidr6,
            vtep_mac: None,
            vtep_mac6: None,
            wireguard_key,
            bgp_as,
            bgp_peers,
        });
    };
    let Some(pod_cidr) = pod_cidr else {
        return Err(match pod_cidr6 {
            Some(_) => ClusterError::NotImplemented(format!(
                "{at}: IPv6-only nodes (\"podCIDRs\" without an IPv4 subnet)"
            )),
            None => invalid(format!("{at}: \"podCIDR\" is missing")),
        });
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
        pod_cidr: Some(pod_cidr),
        address6,
        pod_cidr6,
        vtep_mac: None,
        vtep_mac6: None,
        wireguard_key,
        bgp_as,
        bgp_peers,
    })
}

fn node_keys(o: &Map<String, Value>, at: &str) -> Result<(), ClusterError> {
    const KEYS: &[&str] = &[
        "name",
        "address",
        "podCIDR",
        "podCIDRs",
        "address6",
        "wireguardPublicKey",
        "asNumber",
        "peers",
    ];
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
/// Why peer `n` cannot join `nodes`: a name, address or pod subnet one of
/// them already has. The Kubernetes source skips such a peer (a replacement
/// VM reusing a stale Node's address) instead of refusing the cluster, which
/// would stop every node's reconcile; a cluster file is refused whole
/// ([`check_unique`]).
pub fn conflict(nodes: &[Node], n: &Node) -> Option<String> {
    nodes.iter().find_map(|o| {
        let why = if o.name == n.name {
            "the same name".to_string()
        } else if let Some(a) = n.address.filter(|a| o.address == Some(*a)) {
            format!("the same address {a}")
        } else if let Some(a6) = n.address6.filter(|a| o.address6 == Some(*a)) {
            // An IPv6-only node's "address" is its address6.
            let key = if n.address.is_some() {
                "address6"
            } else {
                "address"
            };
            format!("the same {key} {a6}")
        } else if let (Some(a), Some(b)) = (o.pod_cidr, n.pod_cidr)
            && a.overlaps(b)
        {
            format!("overlapping pod subnets {a} and {b}")
        } else if let (Some(a), Some(b)) = (o.pod_cidr6, n.pod_cidr6)
            && a.overlaps(b)
        {
            format!("overlapping IPv6 pod subnets {a} and {b}")
        } else {
            return None;
        };
        Some(format!("Node {:?} has {why} as {:?}", n.name, o.name))
    })
}

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
        if let Some(a) = n.address
            && let Some(other) = addrs.insert(IpAddr::V4(a), n.name.as_str())
        {
            return Err(invalid(format!(
                "nodes {other:?} and {:?} have the same \"address\" {a}",
                n.name
            )));
        }
        if let Some(a6) = n.address6
            && let Some(other) = addrs.insert(IpAddr::V6(a6), n.name.as_str())
        {
            let key = if n.address.is_some() {
                "address6"
            } else {
                "address"
            };
            return Err(invalid(format!(
                "nodes {other:?} and {:?} have the same \"{key}\" {a6}",
                n.name
            )));
        }
    }
    // Sorted by first address, two CIDRs overlap only if one contains the
    // next: a neighbour check finds every overlap in O(n log n).
    let mut by_start: Vec<(&Node, Ipv4Network)> = c
        .nodes
        .iter()
        .filter_map(|n| n.pod_cidr.map(|p| (n, p)))
        .collect();
    by_start.sort_by_key(|(_, p)| (u32::from(p.network()), p.prefix()));
    for w in by_start.windows(2) {
        let ((a, pa), (b, pb)) = (w[0], w[1]);
        if u32::from(pa.broadcast()) >= u32::from(pb.network()) {
            return Err(invalid(format!(
                "nodes {:?} and {:?} have overlapping \"podCIDR\"s {pa} and {pb}",
                a.name, b.name
            )));
        }
    }
    let mut by_start6: Vec<(&Node, Ipv6Network)> = c
        .nodes
        .iter()
        .filter_map(|n| n.pod_cidr6.map(|p| (n, p)))
        .collect();
    by_start6.sort_by_key(|(_, p)| (u128::from(p.network()), p.prefix()));
    for w in by_start6.windows(2) {
        let ((a, pa), (b, pb)) = (w[0], w[1]);
        if u128::from(pa.broadcast()) >= u128::from(pb.network()) {
            return Err(invalid(format!(
                "nodes {:?} and {:?} have overlapping IPv6 \"podCIDRs\" {pa} and {pb}",
                a.name, b.name
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
    fn bgp_keys_in_calicos_spelling_with_per_node_overrides() {
        let nodes = r#""nodes": [{"name": "a", "address": "192.168.1.1", "podCIDR": "10.244.1.0/24",
                       "asNumber": "65101", "peers": [{"peerIP": "192.168.1.254", "asNumber": 65001}]}]"#;
        let c = parse(&format!(
            r#"{{"network": "10.244.0.0/16", "backend": "bgp", {nodes}}}"#
        ))
        .unwrap();
        assert_eq!(c.backend, Backend::Bgp(VxlanMode::Never));
        assert!(!c.backend.uses_vxlan());
        assert_eq!(
            c.bgp,
            Some(BgpConf {
                as_number: DEFAULT_AS,
                mesh: true,
                peers: vec![]
            })
        );
        assert_eq!(c.nodes[0].bgp_as, Some(65101));
        assert_eq!(c.nodes[0].bgp_peers[0].as_number, 65001);
        let c = parse(&format!(
            r#"{{"network": "10.244.0.0/16", "backend": "bgp", "bgp": {{"asNumber": 4200000000,
                 "nodeToNodeMeshEnabled": false, "vxlanMode": "CrossSubnet",
                 "peers": [{{"peerIP": "fd00::fe", "asNumber": 65001}}]}}, {nodes}}}"#
        ))
        .unwrap();
        assert_eq!(c.backend, Backend::Bgp(VxlanMode::CrossSubnet));
        assert!(c.backend.uses_vxlan());
        let b = c.bgp.unwrap();
        assert_eq!((b.as_number, b.mesh), (4_200_000_000, false));
        assert_eq!(b.peers[0].ip.to_string(), "fd00::fe");
        for (bad, says) in [
            (r#""backend": "vxlan", "bgp": {}"#, "\"bgp\" is for"),
            (
                r#""backend": "bgp", "bgp": {"asNumber": 0}"#,
                "not an AS number",
            ),
            (
                r#""backend": "bgp", "bgp": {"asNumber": 4294967296}"#,
                "not an AS number",
            ),
            (
                r#""backend": "bgp", "bgp": {"vxlanMode": "always"}"#,
                "\"vxlanMode\"",
            ),
            (
                r#""backend": "bgp", "bgp": {"mesh": true}"#,
                "unknown key \"mesh\"",
            ),
            (
                r#""backend": "bgp", "bgp": {"peers": [{"peerIP": "224.0.0.1", "asNumber": 1}]}"#,
                "not a unicast",
            ),
            (
                r#""backend": "bgp", "bgp": {"peers": [{"peerIP": "192.0.2.1"}]}"#,
                "\"asNumber\" is missing",
            ),
            (
                r#""backend": "bgp", "bgp": {"peers": [{"peerIP": "192.0.2.1", "asNumber": 1}, {"peerIP": "192.0.2.1", "asNumber": 2}]}"#,
                "listed twice",
            ),
        ] {
            let m = err(&format!(
                r#"{{"network": "10.244.0.0/16", {bad}, {nodes}}}"#
            ));
            assert!(m.contains(says), "{bad}: {m}");
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
            Some(Ipv4Addr::new(192, 168, 50, 2))
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
        assert_eq!(c.nodes[0].pod_cidr.unwrap().to_string(), "10.244.1.0/24");
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
    fn node_port_addresses_as_kube_proxy_takes_them() {
        let net =
            |extra: &str| parse_net_conf(&format!(r#"{{"network": "10.244.0.0/16"{extra}}}"#));
        assert_eq!(net("").unwrap().node_port_addresses, NodePortAddresses::All);
        assert_eq!(
            net(r#", "nodePortAddresses": []"#)
                .unwrap()
                .node_port_addresses,
            NodePortAddresses::All
        );
        assert_eq!(
            net(r#", "nodePortAddresses": ["primary"]"#)
                .unwrap()
                .node_port_addresses,
            NodePortAddresses::Primary
        );
        assert_eq!(
            net(r#", "nodePortAddresses": ["172.30.0.0/24", "fd30::/64"]"#)
                .unwrap()
                .node_port_addresses,
            NodePortAddresses::Cidrs(vec![
                "172.30.0.0/24".parse().unwrap(),
                "fd30::/64".parse().unwrap()
            ])
        );
        for (bad, says) in [
            (r#""primary""#, "expected a list"),
            (r#"["primary", "10.0.0.0/8"]"#, "goes alone"),
            (r#"["10.0.0.0/33"]"#, "is not a CIDR"),
            (r#"[7]"#, "is not a string"),
        ] {
            let e = net(&format!(r#", "nodePortAddresses": {bad}"#))
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn kube_proxy_replacement_is_a_net_conf_switch() {
        let net =
            |extra: &str| parse_net_conf(&format!(r#"{{"network": "10.244.0.0/16"{extra}}}"#));
        assert!(!net("").unwrap().kube_proxy_replacement);
        assert!(
            net(r#", "kubeProxyReplacement": true"#)
                .unwrap()
                .kube_proxy_replacement
        );
        assert!(
            !net(r#", "kubeProxyReplacement": false"#)
                .unwrap()
                .kube_proxy_replacement
        );
        let e = net(r#", "kubeProxyReplacement": "strict""#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"kubeProxyReplacement\": expected true or false"),
            "{e}"
        );
        // A cluster file has no Services to replace.
        assert!(err(&file(r#", "kubeProxyReplacement": true"#, TWO)).contains("unknown key"));
    }

    #[test]
    fn ebpf_is_a_switch_refused_with_wireguard() {
        assert!(!parse(&file("", TWO)).unwrap().ebpf);
        assert!(parse(&file(r#", "ebpf": true"#, TWO)).unwrap().ebpf);
        assert!(!parse(&file(r#", "ebpf": false"#, TWO)).unwrap().ebpf);
        assert!(err(&file(r#", "ebpf": "yes""#, TWO)).contains("\"ebpf\""));
        let both = err(&file(r#", "ebpf": true, "encryption": "wireguard""#, TWO));
        assert!(
            both.contains("\"ebpf\"") && both.contains("\"encryption\": \"wireguard\""),
            "{both}"
        );
    }

    #[test]
    fn unimplemented_features_say_so() {
        // IPv6-only nodes are not done: every node needs an IPv4 subnet.
        let v6only = r#"{"name": "n1", "address": "192.168.50.1", "address6": "fd50::1", "podCIDRs": ["fd00:0:0:1::/64"]}"#;
        assert!(matches!(
            parse(&file(r#", "network6": "fd00::/48""#, v6only)),
            Err(ClusterError::NotImplemented(_))
        ));
    }

    #[test]
    fn wireguard_keys_and_port() {
        let key = "HIgo9xNzJMWLKASShiTqIybxZ0U3wGLiUeJ1PKf8ykw=";
        let nodes = format!(
            r#"{{"name": "n1", "address": "192.168.50.1", "podCIDR": "10.244.1.0/24", "wireguardPublicKey": "{key}"}},
               {{"name": "n2", "address": "192.168.50.2", "podCIDR": "10.244.2.0/24"}}"#
        );
        let c = parse(&file(r#", "encryption": "wireguard""#, &nodes)).unwrap();
        assert_eq!(c.encryption, Encryption::WireGuard);
        assert_eq!(c.wireguard_port, DEFAULT_WIREGUARD_PORT);
        assert_eq!(
            c.node("n1").unwrap().wireguard_key,
            Some(crate::wgkey::decode(key).unwrap())
        );
        assert_eq!(c.node("n2").unwrap().wireguard_key, None);
        let c = parse(&file(r#", "wireguardPort": 4500"#, TWO)).unwrap();
        assert_eq!((c.encryption, c.wireguard_port), (Encryption::None, 4500));
        assert!(err(&file(r#", "wireguardPort": 0"#, TWO)).contains("\"wireguardPort\""));
        assert!(err(&file(r#", "encryption": "ipsec""#, TWO)).contains("\"encryption\""));
        let bad = |k: &str| {
            err(&file(
                "",
                &format!(
                    r#"{{"name": "n1", "address": "192.168.50.1", "podCIDR": "10.244.1.0/24", "wireguardPublicKey": {k}}}"#
                ),
            ))
        };
        let m = bad(r#""c2hvcnQ=""#);
        assert!(
            m.contains("node \"n1\"") && m.contains("wireguardPublicKey") && m.contains("5 bytes"),
            "{m}"
        );
        assert!(bad(r#""not base64!""#).contains("not base64"));
        assert!(bad("42").contains("expected a base64 string"));
    }

    const DUAL: &str = r#", "network6": "fd00::/48""#;

    fn dual(i: u8, v6: &str) -> String {
        format!(
            r#"{{"name": "n{i}", "address": "192.168.50.{i}", "address6": "fd50::{i}", "podCIDRs": ["10.244.{i}.0/24", "{v6}"]}}"#
        )
    }

    #[test]
    fn dual_stack_nodes() {
        let nodes = [dual(1, "fd00:0:0:1::/64"), dual(2, "fd00:0:0:2::/64")].join(",");
        let c = parse(&file(DUAL, &nodes)).unwrap();
        assert_eq!(c.network6.unwrap().to_string(), "fd00::/48");
        let n2 = c.node("n2").unwrap();
        assert_eq!(n2.pod_cidr.unwrap().to_string(), "10.244.2.0/24");
        assert_eq!(n2.pod_cidr6.unwrap().to_string(), "fd00:0:0:2::/64");
        assert_eq!(n2.address6.unwrap().to_string(), "fd50::2");
        // "podCIDR" beside an IPv6-only list, either order in the list.
        let c = parse(&file(
            DUAL,
            r#"{"name": "n1", "address": "192.168.50.1", "address6": "fd50::1", "podCIDR": "10.244.1.0/24", "podCIDRs": ["fd00:0:0:1::/64", "10.244.1.0/24"]}"#,
        ))
        .unwrap();
        assert!(c.nodes[0].pod_cidr6.is_some());
        // A single-stack node beside dual-stack ones is fine.
        let nodes = [
            dual(1, "fd00:0:0:1::/64"),
            r#"{"name": "n3", "address": "192.168.50.3", "podCIDR": "10.244.3.0/24"}"#.into(),
        ]
        .join(",");
        let c = parse(&file(DUAL, &nodes)).unwrap();
        assert_eq!(c.node("n3").unwrap().pod_cidr6, None);
    }

    #[test]
    fn dual_stack_errors_name_node_and_field() {
        let m = err(&file("", &dual(1, "fd00:0:0:1::/64")));
        assert!(m.contains("\"n1\"") && m.contains("no \"network6\""), "{m}");
        let m = err(&file(DUAL, &dual(1, "fd01:0:0:1::/64")));
        assert!(
            m.contains("node \"n1\" (nodes[0])")
                && m.contains("\"podCIDRs\"[1]")
                && m.contains("outside \"network6\" fd00::/48"),
            "{m}"
        );
        let nodes = [dual(1, "fd00:0:0:1::/64"), dual(2, "fd00::/56")].join(",");
        let m = err(&file(DUAL, &nodes));
        assert!(
            m.contains("overlapping IPv6") && m.contains("\"n1\"") && m.contains("\"n2\""),
            "{m}"
        );
        let nodes = [
            dual(1, "fd00:0:0:1::/64"),
            dual(2, "fd00:0:0:2::/64").replace("fd50::2", "fd50::1"),
        ]
        .join(",");
        let m = err(&file(DUAL, &nodes));
        assert!(m.contains("same \"address6\" fd50::1"), "{m}");
        let m = err(&file(
            DUAL,
            &dual(1, "fd00:0:0:1::/64").replace(r#""address6": "fd50::1", "#, ""),
        ));
        assert!(
            m.contains("\"n1\"") && m.contains("\"address6\" is missing"),
            "{m}"
        );
        let m = err(&file(
            DUAL,
            &dual(1, "fd00:0:0:1::/64").replace("fd50::1", "10.0.0.1"),
        ));
        assert!(
            m.contains("\"address6\"") && m.contains("not an IPv6 address"),
            "{m}"
        );
        let m = err(&file(
            DUAL,
            r#"{"name": "n1", "address": "192.168.50.1", "address6": "fd50::1", "podCIDRs": ["10.244.1.0/24", "fd00:0:0:1::/64", "fd00:0:0:2::/64"]}"#,
        ));
        assert!(
            m.contains("\"podCIDRs\"[2]") && m.contains("at most one IPv6"),
            "{m}"
        );
        let m = err(&file(DUAL, &dual(1, "fd00:0:0:1::/127")));
        assert!(m.contains("too small"), "{m}");
        let m = err(&file(r#", "network6": "10.0.0.0/8""#, TWO));
        assert!(
            m.contains("\"network6\"") && m.contains("not an IPv6"),
            "{m}"
        );
    }

    fn v6only(nodes: &str) -> String {
        format!(r#"{{"network": "fd00::/48", "nodes": [{nodes}]}}"#)
    }

    const V6: &str = r#"{"name": "n1", "address": "fd50::1", "podCIDR": "fd00:0:0:1::/64"},
                        {"name": "n2", "address": "fd50::2", "podCIDRs": ["fd00:0:0:2::/64"]}"#;

    #[test]
    fn ipv6_only_clusters_have_no_ipv4_anywhere() {
        let c = parse(&v6only(V6)).unwrap();
        assert!(c.v6_only());
        assert_eq!(c.network, None);
        assert_eq!(c.network6.unwrap().to_string(), "fd00::/48");
        let n2 = c.node("n2").unwrap();
        assert_eq!((n2.address, n2.pod_cidr), (None, None));
        assert_eq!(n2.address6.unwrap().to_string(), "fd50::2");
        assert_eq!(n2.pod_cidr6.unwrap().to_string(), "fd00:0:0:2::/64");
        assert_eq!(n2.underlay().to_string(), "fd50::2");
        for extra in [
            r#""backend": "host-gw""#,
            r#""backend": "auto""#,
            r#""encryption": "wireguard", "wireguardPort": 4500"#,
            r#""ebpf": true"#,
        ] {
            let text = format!(r#"{{"network": "fd00::/48", {extra}, "nodes": [{V6}]}}"#);
            assert!(parse(&text).unwrap().v6_only(), "{extra}");
        }
        let n = parse_net_conf(r#"{"network": "fd00::/48", "backend": "host-gw"}"#).unwrap();
        assert_eq!(n.network, None);
        assert_eq!(n.network6.unwrap().to_string(), "fd00::/48");
        // Dual-stack and IPv4 clusters are not: their nodes' underlay is
        // their IPv4 address.
        let c = parse(&file(DUAL, &dual(1, "fd00:0:0:1::/64"))).unwrap();
        assert!(!c.v6_only());
        assert_eq!(c.nodes[0].underlay().to_string(), "192.168.50.1");
        assert!(!parse(&file("", TWO)).unwrap().v6_only());
    }

    #[test]
    fn ipv6_only_files_mixed_with_ipv4_are_refused_naming_node_and_field() {
        let m = err(&v6only(
            r#"{"name": "n1", "address": "192.168.50.1", "podCIDR": "fd00:0:0:1::/64"}"#,
        ));
        assert!(
            m.contains("node \"n1\" (nodes[0])")
                && m.contains("\"address\"")
                && m.contains("is IPv4 and the cluster is IPv6-only"),
            "{m}"
        );
        let m = err(&v6only(
            r#"{"name": "n1", "address": "fd50::1", "podCIDRs": ["fd00:0:0:1::/64", "10.244.1.0/24"]}"#,
        ));
        assert!(
            m.contains("\"podCIDRs\"[1]")
                && m.contains("10.244.1.0/24 is IPv4")
                && m.contains("IPv6-only"),
            "{m}"
        );
        let m = err(&v6only(
            r#"{"name": "n1", "address": "fd50::1", "address6": "fd50::1", "podCIDR": "fd00:0:0:1::/64"}"#,
        ));
        assert!(m.contains("\"address6\" is for dual-stack"), "{m}");
        let m = err(&v6only(
            r#"{"name": "n1", "address": "fd50::1", "podCIDR": "fd01:0:0:1::/64"}"#,
        ));
        assert!(m.contains("outside \"network\" fd00::/48"), "{m}");
        let m = err(&v6only(r#"{"name": "n1", "address": "fd50::1"}"#));
        assert!(m.contains("\"podCIDR\" is missing"), "{m}");
        let m = err(&v6only(
            r#"{"name": "n1", "address": "ff02::1", "podCIDR": "fd00:0:0:1::/64"}"#,
        ));
        assert!(m.contains("not a unicast address"), "{m}");
        let m = err(&v6only(
            r#"{"name": "n1", "address": "fd50::1", "podCIDR": "fd00:0:0:1::/64"},
               {"name": "n2", "address": "fd50::1", "podCIDR": "fd00:0:0:2::/64"}"#,
        ));
        assert!(m.contains("same \"address\" fd50::1"), "{m}");
        let m = err(&v6only(
            r#"{"name": "n1", "address": "fd50::1", "podCIDR": "fd00:0:0:1::/64"},
               {"name": "n2", "address": "fd50::2", "podCIDR": "fd00::/56"}"#,
        ));
        assert!(m.contains("overlapping IPv6"), "{m}");
        let m = err(&format!(
            r#"{{"network": "fd00::/48", "network6": "fd01::/48", "nodes": [{V6}]}}"#
        ));
        assert!(
            m.contains("\"network6\"") && m.contains("dual-stack") && m.contains("IPv6-only"),
            "{m}"
        );
        // An IPv4 cluster still takes no IPv6 "address" (IPv4 pods over an
        // IPv6 underlay), nor a dual-stack one a node without IPv4.
        assert!(matches!(
            parse(&file(
                "",
                r#"{"name": "n1", "address": "fd50::1", "podCIDR": "10.244.1.0/24"}"#
            )),
            Err(ClusterError::NotImplemented(_))
        ));
        // A conflict between IPv6-only nodes (the Kubernetes source's
        // check) names the field as the file spells it.
        let c = parse(&v6only(V6)).unwrap();
        let mut n = c.nodes[1].clone();
        n.name = "n3".into();
        n.pod_cidr6 = Some("fd00:0:0:3::/64".parse().unwrap());
        let m = conflict(&c.nodes, &n).unwrap();
        assert!(m.contains("the same address fd50::2"), "{m}");
    }
}
