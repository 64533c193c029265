//! One NetworkPolicy in either spelling, validated, with its normalized
//! source.

use super::invalid;
use super::labels::{Selector, parse_selector, valid_label_value};
use super::rules::{Dir, Rule, parse_rules};
use rcni_cni::CniError;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub name: String,
    pub namespace: String,
    pub pod_selector: Selector,
    pub ingress: Option<Vec<Rule>>,
    pub egress: Option<Vec<Rule>>,
    /// Annotated `rcni.io/audit: "true"`: evaluated and reported, never
    /// enforced (see `compile`).
    pub audit: bool,
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

/// The annotation that makes a policy audit-only.
pub const AUDIT_ANNOTATION: &str = "rcni.io/audit";

/// `metadata.annotations["rcni.io/audit"]`: "true" or "false" (any case);
/// anything else is an error, so a typo cannot enforce a policy meant to
/// be audited.
fn audit_annotation(m: &Map<String, Value>, who: &str) -> Result<bool, CniError> {
    let v = m
        .get("metadata")
        .and_then(|m| m.get("annotations"))
        .and_then(|a| a.get(AUDIT_ANNOTATION));
    match v {
        None | Some(Value::Null) => Ok(false),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("true") => Ok(true),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("false") => Ok(false),
        Some(v) => Err(invalid(
            who,
            &format!("metadata.annotations.{AUDIT_ANNOTATION}"),
            &format!("{v} is not \"true\" or \"false\""),
        )),
    }
}

pub(super) fn parse_policy(m: &Map<String, Value>, origin: &str) -> Result<Policy, CniError> {
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
    let audit = audit_annotation(m, who)?;
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
        audit,
        // Auditing is part of what the policy is: turning it off is a
        // change to apply.
        source: format!(
            "{id}:{}{}",
            if audit { "audit:" } else { "" },
            canonical(&Value::Object(norm))
        ),
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
