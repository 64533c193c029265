//! Labels and label selectors: Kubernetes' syntax, checked when read, and
//! matching.

use super::invalid;
use rcni_cni::CniError;
use serde_json::Value;
use std::collections::BTreeMap;

pub type Labels = BTreeMap<String, String>;

/// The label every Kubernetes namespace carries with its own name (1.21+).
pub const NS_NAME_LABEL: &str = "kubernetes.io/metadata.name";

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

pub(super) fn string_map(v: &Value) -> Option<Labels> {
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

pub(super) fn valid_label_value(v: &str) -> bool {
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

pub(super) fn parse_selector(v: &Value, who: &str, field: &str) -> Result<Selector, CniError> {
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
