//! The policy model: Kubernetes NetworkPolicy semantics, read from the
//! plugin's `policies` and from the JSON files of `policyDir`.
//!
//! A policy is accepted in two spellings: the flat one of the config
//! (`{"name", "namespace", "podSelector", "policyTypes", "ingress",
//! "egress"}`) and the Kubernetes object (`{"kind": "NetworkPolicy",
//! "metadata": {"name", "namespace"}, "spec": {...}}`), so `kubectl get
//! netpol -o json` output can be dropped into the policy directory. A file
//! holds one object, an array of them, or a `List` with `items`; objects of
//! kind `Namespace` give namespaces their labels, objects of kind `Pod`
//! (namespace, labels, `status.podIPs`) are pods of other nodes, which
//! podSelector and namespaceSelector peers match by address.
//!
//! Everything is validated before it is used: a bad policy is code 7 with
//! a message naming the policy and the field.

use ipnetwork::IpNetwork;
use rcni_cni::CniError;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;

pub type Labels = BTreeMap<String, String>;

/// The label every Kubernetes namespace carries with its own name (1.21+).
pub const NS_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// Port ranges one peer may be allowed (the eBPF map's bound).
pub const MAX_PORT_RANGES: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    In(Vec<String>),
    NotIn(Vec<String>),
    Exists,
    DoesNotExist,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requirement {
    pub key: String,
    pub op: Op,
}

/// A label selector; the empty one selects everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    pub match_labels: Labels,
    pub match_expressions: Vec<Requirement>,
}

impl Selector {
    pub fn matches(&self, labels: &Labels) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| match &r.op {
                Op::In(vs) => labels.get(&r.key).is_some_and(|v| vs.contains(v)),
                Op::NotIn(vs) => labels.get(&r.key).is_none_or(|v| !vs.contains(v)),
                Op::Exists => labels.contains_key(&r.key),
                Op::DoesNotExist => !labels.contains_key(&r.key),
            })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpBlock {
    pub cidr: IpNetwork,
    pub except: Vec<IpNetwork>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// Pods matching `pods` in namespaces matching `namespaces`; `None`
    /// for `namespaces` means the policy's own namespace.
    Pods {
        pods: Selector,
        namespaces: Option<Selector>,
    },
    Block(IpBlock),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PortRange {
    pub proto: u8,
    pub lo: u16,
    pub hi: u16,
}

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const SCTP: u8 = 132;

/// One ingress or egress rule: traffic with any of `peers` (all when
/// `None`) on any of `ports` (all when `None`), and on the ports `named`
/// resolves to (protocol, container port name) for the destination pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub peers: Option<Vec<Peer>>,
    pub ports: Option<Vec<PortRange>>,
    pub named: Vec<(u8, String)>,
}

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
enum PortSpec {
    Range(PortRange),
    Named(u8, String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Dir {
    Ingress,
    Egress,
}

impl Dir {
    pub fn as_str(self) -> &'static str {
        match self {
            Dir::Ingress => "ingress",
            Dir::Egress => "egress",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub name: String,
    pub namespace: String,
    pub pod_selector: Selector,
    pub ingress: Option<Vec<Rule>>,
    pub egress: Option<Vec<Rule>>,
    /// The JSON it was read from, normalized: two policies are the same
    /// when this is.
    pub source: String,
}

impl Policy {
    /// `namespace/name`, unique in a policy set.
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Whether the policy applies to a direction (its policyTypes).
    pub fn rules(&self, dir: Dir) -> Option<&[Rule]> {
        match dir {
            Dir::Ingress => self.ingress.as_deref(),
            Dir::Egress => self.egress.as_deref(),
        }
    }
}

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

/// Policies, namespace labels and other nodes' pods, as read from the
/// config and the policy directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicySet {
    pub policies: Vec<Policy>,
    pub namespaces: BTreeMap<String, Labels>,
    pub remote_pods: Vec<RemotePod>,
}

impl PolicySet {
    /// A namespace's labels: those given, plus its name label.
    pub fn namespace_labels(&self, ns: &str) -> Labels {
        let mut l = self.namespaces.get(ns).cloned().unwrap_or_default();
        l.insert(NS_NAME_LABEL.into(), ns.into());
        l
    }

    /// Adds the objects of one JSON document (`origin` names it in errors).
    pub fn add_document(&mut self, v: &Value, origin: &str) -> Result<(), CniError> {
        match v {
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    self.add_document(item, &format!("{origin}[{i}]"))?;
                }
                Ok(())
            }
            Value::Object(m) => match m.get("kind").and_then(Value::as_str) {
                Some("List")
                | Some("NetworkPolicyList")
                | Some("NamespaceList")
                | Some("PodList") => {
                    let items = m.get("items").cloned().unwrap_or(Value::Array(vec![]));
                    if !items.is_array() {
                        return Err(invalid(origin, "items", "must be an array"));
                    }
                    self.add_document(&items, origin)
                }
                Some("Namespace") => {
                    let meta = m.get("metadata").and_then(Value::as_object);
                    let name = meta_str(meta, "name")
                        .ok_or_else(|| invalid(origin, "metadata.name", "missing"))?;
                    let labels = match meta.and_then(|m| m.get("labels")) {
                        None | Some(Value::Null) => Labels::new(),
                        Some(l) => string_map(l).ok_or_else(|| {
                            invalid(name, "metadata.labels", "must map strings to strings")
                        })?,
                    };
                    self.namespaces.insert(name.to_string(), labels);
                    Ok(())
                }
                Some("Pod") => {
                    if let Some(p) = parse_pod(m, origin)? {
                        self.remote_pods.push(p);
                    }
                    Ok(())
                }
                Some("NetworkPolicy") | None => {
                    let p = parse_policy(m, origin)?;
                    self.push(p)
                }
                Some(other) => Err(invalid(
                    origin,
                    "kind",
                    &format!("{other:?} is not NetworkPolicy, Namespace, Pod or List"),
                )),
            },
            _ => Err(invalid(origin, "", "a policy must be a JSON object")),
        }
    }

    fn push(&mut self, p: Policy) -> Result<(), CniError> {
        if let Some(old) = self.policies.iter().find(|o| o.id() == p.id()) {
            if old.source != p.source {
                return Err(CniError::config(format!(
                    "policy {}: defined twice, differently",
                    p.id()
                )));
            }
            return Ok(());
        }
        self.policies.push(p);
        Ok(())
    }

    /// Reads every `*.json` file of `dir` in name order; a missing
    /// directory holds no policies.
    pub fn add_dir(&mut self, dir: &Path) -> Result<(), CniError> {
        let rd = match std::fs::read_dir(dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => {
                return Err(CniError::config(format!(
                    "policyDir {}: {e}",
                    dir.display()
                )));
            }
        };
        let mut files: Vec<_> = rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        for f in files {
            let origin = f.display().to_string();
            let bytes = match std::fs::read(&f) {
                Ok(b) => b,
                // Removed between the listing and the read.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(CniError::config(format!("{origin}: {e}"))),
            };
            let v: Value = serde_json::from_slice(&bytes)
                .map_err(|e| CniError::config(format!("{origin}: not valid JSON: {e}")))?;
            self.add_document(&v, &origin)?;
        }
        Ok(())
    }

    pub fn sort(&mut self) {
        self.policies.sort_by_key(|p| p.id());
        self.remote_pods
            .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    }
}

/// A non-empty string field of an object's `metadata`.
fn meta_str<'a>(meta: Option<&'a Map<String, Value>>, key: &str) -> Option<&'a str> {
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
fn parse_pod(m: &Map<String, Value>, origin: &str) -> Result<Option<RemotePod>, CniError> {
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

fn invalid(policy: &str, field: &str, what: &str) -> CniError {
    if field.is_empty() {
        CniError::config(format!("policy {policy}: {what}"))
    } else {
        CniError::config(format!("policy {policy}: {field}: {what}"))
    }
}

fn string_map(v: &Value) -> Option<Labels> {
    let m = v.as_object()?;
    m.iter()
        .map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
        .collect()
}

/// Kubernetes' label key and value syntax (qualified names), so a typo is
/// reported here rather than silently never matching.
fn valid_label_key(k: &str) -> bool {
    let (prefix, name) = match k.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    if let Some(p) = prefix
        && (p.is_empty()
            || p.len() > 253
            || !p.split('.').all(|l| {
                !l.is_empty()
                    && l.bytes()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
            }))
    {
        return false;
    }
    !name.is_empty() && name.len() <= 63 && valid_label_value(name)
}

fn valid_label_value(v: &str) -> bool {
    if v.is_empty() {
        return true;
    }
    let b = v.as_bytes();
    v.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// Checks a pod's or namespace's labels (from CNI args) the same way.
pub fn validate_labels(labels: &Labels) -> Result<(), String> {
    for (k, v) in labels {
        if !valid_label_key(k) {
            return Err(format!("invalid label key {k:?}"));
        }
        if !valid_label_value(v) {
            return Err(format!("invalid value {v:?} of label {k:?}"));
        }
    }
    Ok(())
}

const POLICY_KEYS: &[&str] = &[
    "name",
    "namespace",
    "podSelector",
    "policyTypes",
    "ingress",
    "egress",
    "kind",
    "apiVersion",
    "metadata",
    "spec",
    "status",
];

fn parse_policy(m: &Map<String, Value>, origin: &str) -> Result<Policy, CniError> {
    // The Kubernetes object keeps its name in metadata and its rules in spec.
    let (name, namespace, spec) = if let Some(spec) = m.get("spec") {
        let meta = m.get("metadata").and_then(Value::as_object);
        let name = meta.and_then(|m| m.get("name")).and_then(Value::as_str);
        let ns = meta
            .and_then(|m| m.get("namespace"))
            .and_then(Value::as_str);
        let spec = spec
            .as_object()
            .ok_or_else(|| invalid(name.unwrap_or(origin), "spec", "must be an object"))?;
        (name, ns, spec)
    } else {
        let name = m.get("name").and_then(Value::as_str);
        let ns = m.get("namespace").and_then(Value::as_str);
        (name, ns, m)
    };
    let name = name
        .filter(|n| !n.is_empty())
        .ok_or_else(|| invalid(origin, "name", "missing (every policy needs a name)"))?;
    let namespace = namespace.filter(|n| !n.is_empty()).unwrap_or("default");
    let id = format!("{namespace}/{name}");
    let who = id.as_str();
    if !valid_label_value(name) && !name.split('.').all(valid_label_value) {
        return Err(invalid(who, "name", "must be a DNS name"));
    }
    for k in spec.keys() {
        if !POLICY_KEYS.contains(&k.as_str()) {
            return Err(invalid(who, k, "unknown field"));
        }
    }
    let pod_selector = match spec.get("podSelector") {
        None | Some(Value::Null) => {
            return Err(invalid(
                who,
                "podSelector",
                "missing ({} selects every pod of the namespace)",
            ));
        }
        Some(v) => parse_selector(v, who, "podSelector")?,
    };
    let ingress = match spec.get("ingress") {
        None | Some(Value::Null) => None,
        Some(v) => Some(parse_rules(v, who, Dir::Ingress)?),
    };
    let egress = match spec.get("egress") {
        None | Some(Value::Null) => None,
        Some(v) => Some(parse_rules(v, who, Dir::Egress)?),
    };
    // Kubernetes' default: Ingress always, Egress when there are egress
    // rules. A listed type without rules denies everything that way.
    let (mut has_in, mut has_eg) = (true, egress.is_some());
    if let Some(t) = spec.get("policyTypes").filter(|v| !v.is_null()) {
        let list = t
            .as_array()
            .ok_or_else(|| invalid(who, "policyTypes", "must be an array"))?;
        has_in = false;
        has_eg = false;
        for v in list {
            match v.as_str() {
                Some("Ingress") => has_in = true,
                Some("Egress") => has_eg = true,
                _ => {
                    return Err(invalid(
                        who,
                        "policyTypes",
                        &format!("{v} is not \"Ingress\" or \"Egress\""),
                    ));
                }
            }
        }
        if list.is_empty() {
            return Err(invalid(who, "policyTypes", "empty"));
        }
    }
    if !has_in && ingress.as_ref().is_some_and(|r| !r.is_empty()) {
        return Err(invalid(
            who,
            "ingress",
            "rules given but policyTypes lacks \"Ingress\"",
        ));
    }
    if !has_eg && egress.as_ref().is_some_and(|r| !r.is_empty()) {
        return Err(invalid(
            who,
            "egress",
            "rules given but policyTypes lacks \"Egress\"",
        ));
    }
    let mut norm = spec.clone();
    norm.remove("name");
    norm.remove("namespace");
    norm.remove("metadata");
    norm.remove("kind");
    norm.remove("apiVersion");
    norm.remove("status");
    Ok(Policy {
        name: name.to_string(),
        namespace: namespace.to_string(),
        pod_selector,
        ingress: has_in.then(|| ingress.unwrap_or_default()),
        egress: has_eg.then(|| egress.unwrap_or_default()),
        source: format!("{id}:{}", canonical(&Value::Object(norm))),
    })
}

/// JSON text with object keys sorted at every level: the same policy
/// written with keys in another order is the same policy.
fn canonical(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let sorted: BTreeMap<&String, String> =
                m.iter().map(|(k, v)| (k, canonical(v))).collect();
            let items: Vec<String> = sorted
                .iter()
                .map(|(k, v)| format!("{}:{v}", Value::String((*k).clone())))
                .collect();
            format!("{{{}}}", items.join(","))
        }
        Value::Array(a) => format!(
            "[{}]",
            a.iter().map(canonical).collect::<Vec<_>>().join(",")
        ),
        other => other.to_string(),
    }
}

fn parse_selector(v: &Value, who: &str, field: &str) -> Result<Selector, CniError> {
    let m = v
        .as_object()
        .ok_or_else(|| invalid(who, field, "must be an object"))?;
    let mut s = Selector::default();
    for (k, v) in m {
        match k.as_str() {
            "matchLabels" => {
                if v.is_null() {
                    continue;
                }
                s.match_labels = string_map(v).ok_or_else(|| {
                    invalid(
                        who,
                        &format!("{field}.matchLabels"),
                        "must map strings to strings",
                    )
                })?;
                validate_labels(&s.match_labels)
                    .map_err(|e| invalid(who, &format!("{field}.matchLabels"), &e))?;
            }
            "matchExpressions" => {
                if v.is_null() {
                    continue;
                }
                let list = v.as_array().ok_or_else(|| {
                    invalid(
                        who,
                        &format!("{field}.matchExpressions"),
                        "must be an array",
                    )
                })?;
                for (i, e) in list.iter().enumerate() {
                    let f = format!("{field}.matchExpressions[{i}]");
                    s.match_expressions.push(parse_requirement(e, who, &f)?);
                }
            }
            _ => return Err(invalid(who, &format!("{field}.{k}"), "unknown field")),
        }
    }
    Ok(s)
}

fn parse_requirement(v: &Value, who: &str, field: &str) -> Result<Requirement, CniError> {
    let m = v
        .as_object()
        .ok_or_else(|| invalid(who, field, "must be an object"))?;
    let key = m
        .get("key")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(who, &format!("{field}.key"), "missing"))?;
    if !valid_label_key(key) {
        return Err(invalid(
            who,
            &format!("{field}.key"),
            &format!("invalid label key {key:?}"),
        ));
    }
    let values: Vec<String> = match m.get("values") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| invalid(who, &format!("{field}.values"), "must be strings"))?,
        Some(_) => return Err(invalid(who, &format!("{field}.values"), "must be an array")),
    };
    let op = m
        .get("operator")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(who, &format!("{field}.operator"), "missing"))?;
    let op = match op {
        "In" | "NotIn" if values.is_empty() => {
            return Err(invalid(
                who,
                &format!("{field}.values"),
                &format!("{op} needs values"),
            ));
        }
        "Exists" | "DoesNotExist" if !values.is_empty() => {
            return Err(invalid(
                who,
                &format!("{field}.values"),
                &format!("{op} takes no values"),
            ));
        }
        "In" => Op::In(values),
        "NotIn" => Op::NotIn(values),
        "Exists" => Op::Exists,
        "DoesNotExist" => Op::DoesNotExist,
        other => {
            return Err(invalid(
                who,
                &format!("{field}.operator"),
                &format!("{other:?} is not In, NotIn, Exists or DoesNotExist"),
            ));
        }
    };
    Ok(Requirement {
        key: key.to_string(),
        op,
    })
}

fn parse_rules(v: &Value, who: &str, dir: Dir) -> Result<Vec<Rule>, CniError> {
    let d = dir.as_str();
    let list = v
        .as_array()
        .ok_or_else(|| invalid(who, d, "must be an array of rules"))?;
    let peers_key = match dir {
        Dir::Ingress => "from",
        Dir::Egress => "to",
    };
    let mut rules = Vec::new();
    for (i, r) in list.iter().enumerate() {
        let f = format!("{d}[{i}]");
        let m = object_of(r, who, &f, &[peers_key, "ports"])?;
        let peers = match m.get(peers_key) {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) if a.is_empty() => None,
            Some(Value::Array(a)) => Some(
                a.iter()
                    .enumerate()
                    .map(|(j, p)| parse_peer(p, who, &format!("{f}.{peers_key}[{j}]")))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            Some(_) => {
                return Err(invalid(
                    who,
                    &format!("{f}.{peers_key}"),
                    "must be an array",
                ));
            }
        };
        let mut named = Vec::new();
        let ports = match m.get("ports") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) if a.is_empty() => None,
            Some(Value::Array(a)) => {
                let v = a
                    .iter()
                    .enumerate()
                    .map(|(j, p)| parse_port(p, who, &format!("{f}.ports[{j}]")))
                    .collect::<Result<Vec<_>, _>>()?;
                if v.len() > MAX_PORT_RANGES {
                    return Err(invalid(
                        who,
                        &format!("{f}.ports"),
                        &format!(
                            "{} entries, more than the {MAX_PORT_RANGES} supported",
                            v.len()
                        ),
                    ));
                }
                let mut ranges = Vec::new();
                for p in v {
                    match p {
                        PortSpec::Range(r) => ranges.push(r),
                        PortSpec::Named(proto, n) => named.push((proto, n)),
                    }
                }
                Some(ranges)
            }
            Some(_) => return Err(invalid(who, &format!("{f}.ports"), "must be an array")),
        };
        rules.push(Rule {
            peers,
            ports,
            named,
        });
    }
    Ok(rules)
}

/// `v` as an object whose keys are all in `allowed`.
fn object_of<'a>(
    v: &'a Value,
    who: &str,
    field: &str,
    allowed: &[&str],
) -> Result<&'a Map<String, Value>, CniError> {
    let m = v
        .as_object()
        .ok_or_else(|| invalid(who, field, "must be an object"))?;
    if let Some(k) = m.keys().find(|k| !allowed.contains(&k.as_str())) {
        let f = if field.is_empty() {
            k.clone()
        } else {
            format!("{field}.{k}")
        };
        return Err(invalid(who, &f, "unknown field"));
    }
    Ok(m)
}

fn parse_peer(v: &Value, who: &str, field: &str) -> Result<Peer, CniError> {
    let m = object_of(
        v,
        who,
        field,
        &["podSelector", "namespaceSelector", "ipBlock"],
    )?;
    let get = |k: &str| m.get(k).filter(|v| !v.is_null());
    match (get("podSelector"), get("namespaceSelector"), get("ipBlock")) {
        (None, None, Some(b)) => Ok(Peer::Block(parse_ip_block(
            b,
            who,
            &format!("{field}.ipBlock"),
        )?)),
        (_, _, Some(_)) => Err(invalid(
            who,
            &format!("{field}.ipBlock"),
            "cannot be combined with podSelector or namespaceSelector in one peer",
        )),
        (None, None, None) => Err(invalid(
            who,
            field,
            "a peer needs podSelector, namespaceSelector or ipBlock",
        )),
        (p, n, None) => Ok(Peer::Pods {
            pods: match p {
                Some(p) => parse_selector(p, who, &format!("{field}.podSelector"))?,
                None => Selector::default(),
            },
            namespaces: match n {
                Some(n) => Some(parse_selector(
                    n,
                    who,
                    &format!("{field}.namespaceSelector"),
                )?),
                None => None,
            },
        }),
    }
}

fn parse_cidr(s: &str, who: &str, field: &str) -> Result<IpNetwork, CniError> {
    let n: IpNetwork = s
        .parse()
        .map_err(|_| invalid(who, field, &format!("{s:?} is not a CIDR")))?;
    if !s.contains('/') {
        return Err(invalid(who, field, &format!("{s:?} has no prefix length")));
    }
    // The network address: Go's ParseCIDR masks the host bits as well.
    IpNetwork::new(n.network(), n.prefix())
        .map_err(|_| invalid(who, field, &format!("{s:?} is not a CIDR")))
}

fn contains_net(outer: &IpNetwork, inner: &IpNetwork) -> bool {
    outer.is_ipv4() == inner.is_ipv4()
        && outer.prefix() <= inner.prefix()
        && outer.contains(inner.network())
}

fn parse_ip_block(v: &Value, who: &str, field: &str) -> Result<IpBlock, CniError> {
    let m = object_of(v, who, field, &["cidr", "except"])?;
    let cidr = m
        .get("cidr")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(who, &format!("{field}.cidr"), "missing"))?;
    let cidr = parse_cidr(cidr, who, &format!("{field}.cidr"))?;
    let mut except = Vec::new();
    match m.get("except") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) => {
            for (i, e) in a.iter().enumerate() {
                let f = format!("{field}.except[{i}]");
                let s = e
                    .as_str()
                    .ok_or_else(|| invalid(who, &f, "must be a CIDR string"))?;
                let n = parse_cidr(s, who, &f)?;
                // Kubernetes: each except must lie strictly inside cidr.
                if !contains_net(&cidr, &n) || n.prefix() == cidr.prefix() {
                    return Err(invalid(who, &f, &format!("{s} is not inside {cidr}")));
                }
                except.push(n);
            }
        }
        Some(_) => return Err(invalid(who, &format!("{field}.except"), "must be an array")),
    }
    Ok(IpBlock { cidr, except })
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

fn parse_port(v: &Value, who: &str, field: &str) -> Result<PortSpec, CniError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn one(v: Value) -> Result<Policy, CniError> {
        let mut s = PolicySet::default();
        s.add_document(&v, "test")?;
        Ok(s.policies.remove(0))
    }

    fn labels(v: &[(&str, &str)]) -> Labels {
        v.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn flat_and_kubernetes_spellings_are_the_same_policy() {
        let flat = one(
            json!({"name":"web","namespace":"prod","podSelector":{"matchLabels":{"app":"web"}},
            "ingress":[{"from":[{"podSelector":{}}],"ports":[{"port":80}]}]}),
        )
        .unwrap();
        let k8s = one(
            json!({"apiVersion":"networking.k8s.io/v1","kind":"NetworkPolicy",
            "metadata":{"name":"web","namespace":"prod"},
            "spec":{"podSelector":{"matchLabels":{"app":"web"}},
            "ingress":[{"from":[{"podSelector":{}}],"ports":[{"port":80}]}]}}),
        )
        .unwrap();
        assert_eq!(flat, k8s);
        assert_eq!(flat.id(), "prod/web");
        // Default policyTypes: Ingress only, as there are no egress rules.
        assert!(flat.ingress.is_some() && flat.egress.is_none());
        let r = &flat.ingress.as_ref().unwrap()[0];
        assert_eq!(
            r.ports.as_deref(),
            Some(
                &[PortRange {
                    proto: TCP,
                    lo: 80,
                    hi: 80
                }][..]
            )
        );
    }

    #[test]
    fn policy_types_decide_the_directions() {
        let p = one(json!({"name":"deny","podSelector":{},"policyTypes":["Ingress","Egress"]}))
            .unwrap();
        assert_eq!(p.namespace, "default");
        assert_eq!(p.ingress, Some(vec![]));
        assert_eq!(p.egress, Some(vec![]));
        let p = one(json!({"name":"eg","podSelector":{},"egress":[{}]})).unwrap();
        assert!(p.ingress.is_some() && p.egress.is_some());
        let p = one(json!({"name":"eg","podSelector":{},"policyTypes":["Egress"]})).unwrap();
        assert!(p.ingress.is_none() && p.egress == Some(vec![]));
    }

    #[test]
    fn selectors_match_like_kubernetes() {
        let mut s = PolicySet::default();
        s.add_document(
            &json!({"name":"x","podSelector":{"matchLabels":{"app":"web"},"matchExpressions":[
                {"key":"tier","operator":"In","values":["a","b"]},
                {"key":"canary","operator":"DoesNotExist"},
                {"key":"env","operator":"NotIn","values":["dev"]}]}}),
            "t",
        )
        .unwrap();
        let sel = &s.policies[0].pod_selector;
        assert!(sel.matches(&labels(&[("app", "web"), ("tier", "a")])));
        assert!(sel.matches(&labels(&[("app", "web"), ("tier", "b"), ("env", "prod")])));
        assert!(!sel.matches(&labels(&[("app", "web"), ("tier", "c")])));
        assert!(!sel.matches(&labels(&[("app", "web"), ("tier", "a"), ("canary", "")])));
        assert!(!sel.matches(&labels(&[("app", "web"), ("tier", "a"), ("env", "dev")])));
        assert!(!sel.matches(&labels(&[("tier", "a")])));
        assert!(Selector::default().matches(&Labels::new()));
    }

    #[test]
    fn invalid_policies_name_the_policy_and_the_field() {
        let cases = [
            (json!({"podSelector":{}}), "name"),
            (json!({"name":"p"}), "podSelector"),
            (
                json!({"name":"p","podSelector":{},"ingress":[{"from":[{"ipBlock":{"cidr":"10.0.0.0/8","except":["11.0.0.0/16"]}}]}]}),
                "ingress[0].from[0].ipBlock.except[0]",
            ),
            (
                json!({"name":"p","podSelector":{},"ingress":[{"from":[{"ipBlock":{"cidr":"10.0.0.300/8"}}]}]}),
                "ipBlock.cidr",
            ),
            (
                json!({"name":"p","podSelector":{},"ingress":[{"ports":[{"port":"Http_1"}]}]}),
                "ports[0].port",
            ),
            (
                json!({"name":"p","podSelector":{},"ingress":[{"ports":[{"port":"http","endPort":90}]}]}),
                "ports[0].endPort",
            ),
            (
                json!({"name":"p","podSelector":{},"ingress":[{"ports":[{"port":90,"endPort":80}]}]}),
                "endPort",
            ),
            (
                json!({"name":"p","podSelector":{},"ingress":[{"ports":[{"protocol":"ICMP"}]}]}),
                "protocol",
            ),
            (
                json!({"name":"p","podSelector":{},"policyTypes":["Ingres"]}),
                "policyTypes",
            ),
            (
                json!({"name":"p","podSelector":{"matchExpressions":[{"key":"a","operator":"In"}]}}),
                "matchExpressions[0].values",
            ),
            (
                json!({"name":"p","podSelector":{"matchLabels":{"a b":"c"}}}),
                "matchLabels",
            ),
            (json!({"name":"p","podSelector":{},"ingres":[]}), "ingres"),
            (
                json!({"name":"p","podSelector":{},"egress":[{"to":[{"ipBlock":{"cidr":"10.0.0.0/8"},"podSelector":{}}]}]}),
                "egress[0].to[0].ipBlock",
            ),
            (
                json!({"name":"p","podSelector":{},"policyTypes":["Ingress"],"egress":[{}]}),
                "egress",
            ),
        ];
        for (v, field) in cases {
            let e = one(v.clone()).unwrap_err();
            assert_eq!(e.code, 7, "{v}: {}", e.msg);
            assert!(e.msg.contains(field), "{v}: {} lacks {field}", e.msg);
            if v.get("name").is_some() {
                assert!(e.msg.contains("default/p"), "{}", e.msg);
            }
        }
    }

    #[test]
    fn ip_blocks_are_masked_and_ports_default_to_all_of_tcp() {
        let p = one(json!({"name":"p","podSelector":{},"egress":[{"to":[{"ipBlock":{"cidr":"10.1.2.3/8","except":["10.1.0.0/16"]}}],
            "ports":[{},{"protocol":"UDP","port":53},{"protocol":"SCTP","port":100,"endPort":200}]}]}))
        .unwrap();
        let r = &p.egress.as_ref().unwrap()[0];
        match &r.peers.as_ref().unwrap()[0] {
            Peer::Block(b) => {
                assert_eq!(b.cidr.to_string(), "10.0.0.0/8");
                assert_eq!(b.except[0].to_string(), "10.1.0.0/16");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            r.ports.as_deref().unwrap(),
            &[
                PortRange {
                    proto: TCP,
                    lo: 0,
                    hi: 65535
                },
                PortRange {
                    proto: UDP,
                    lo: 53,
                    hi: 53
                },
                PortRange {
                    proto: SCTP,
                    lo: 100,
                    hi: 200
                }
            ]
        );
    }

    #[test]
    fn documents_lists_namespaces_and_duplicates() {
        let mut s = PolicySet::default();
        s.add_document(
            &json!({"kind":"List","items":[
                {"kind":"Namespace","metadata":{"name":"prod","labels":{"team":"a"}}},
                {"name":"p","podSelector":{}}]}),
            "f",
        )
        .unwrap();
        // The same policy twice is one; a different one of that name is an error.
        s.add_document(&json!([{"name":"p","podSelector":{}}]), "g")
            .unwrap();
        assert_eq!(s.policies.len(), 1);
        let e = s
            .add_document(
                &json!({"name":"p","podSelector":{"matchLabels":{"a":"b"}}}),
                "h",
            )
            .unwrap_err();
        assert!(
            e.msg.contains("default/p") && e.msg.contains("twice"),
            "{}",
            e.msg
        );
        let l = s.namespace_labels("prod");
        assert_eq!(l.get("team").map(String::as_str), Some("a"));
        assert_eq!(l.get(NS_NAME_LABEL).map(String::as_str), Some("prod"));
        assert_eq!(s.namespace_labels("other").len(), 1);
    }

    #[test]
    fn pods_are_read_with_their_addresses_and_bad_ones_refused() {
        let mut s = PolicySet::default();
        s.add_document(
            &json!({"kind":"PodList","items":[
                {"kind":"Pod","metadata":{"namespace":"prod","name":"a","labels":{"app":"x"}},
                 "status":{"podIP":"10.0.0.5","podIPs":[{"ip":"10.0.0.5"},{"ip":"fd00::5"}]}},
                {"kind":"Pod","metadata":{"name":"b"},"status":{"podIP":"10.0.0.6","phase":"Running"}},
                {"kind":"Pod","metadata":{"name":"c"},"status":{"podIP":"10.0.0.7","phase":"Failed"}},
                {"kind":"Pod","metadata":{"name":"d"},"spec":{"hostNetwork":true},"status":{"podIP":"10.0.0.8"}},
                {"kind":"Pod","metadata":{"name":"e"}}]}),
            "f",
        )
        .unwrap();
        s.sort();
        let got: Vec<(&str, &str, usize)> = s
            .remote_pods
            .iter()
            .map(|p| (p.namespace.as_str(), p.name.as_str(), p.addrs.len()))
            .collect();
        assert_eq!(got, [("default", "b", 1), ("prod", "a", 2)]);
        assert_eq!(s.remote_pods[1].labels, labels(&[("app", "x")]));
        for (bad, field) in [
            (
                json!({"kind":"Pod","metadata":{"name":"p"},"status":{"podIP":"10.0.0.300"}}),
                "status.podIP",
            ),
            (
                json!({"kind":"Pod","metadata":{"name":"p","labels":{"a b":"c"}},"status":{"podIP":"10.0.0.3"}}),
                "metadata.labels",
            ),
            (json!({"kind":"Pod","metadata":{}}), "metadata.name"),
        ] {
            let e = PolicySet::default().add_document(&bad, "f").unwrap_err();
            assert_eq!(e.code, 7);
            assert!(e.msg.contains(field), "{}", e.msg);
        }
    }
}
