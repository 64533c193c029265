//! The policy set: every document of the config and the policy directory.

use super::invalid;
use super::labels::{Labels, NS_NAME_LABEL, string_map};
use super::policy::{Policy, parse_policy};
use super::remote_pods::{RemotePod, meta_str, parse_pod};
use super::services::{Service, Slice, parse_service, parse_slice};
use rcni_cni::CniError;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// Policies, namespace labels and other nodes' pods, as read from the
/// config and the policy directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicySet {
    pub policies: Vec<Policy>,
    pub namespaces: BTreeMap<String, Labels>,
    pub remote_pods: Vec<RemotePod>,
    pub services: Vec<Service>,
    pub slices: Vec<Slice>,
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
                | Some("PodList")
                | Some("ServiceList")
                | Some("EndpointSliceList") => {
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
                Some("Service") => {
                    self.services.push(parse_service(m, origin)?);
                    Ok(())
                }
                Some("EndpointSlice") => {
                    self.slices.extend(parse_slice(m, origin)?);
                    Ok(())
                }
                Some("NetworkPolicy") | None => {
                    let p = parse_policy(m, origin)?;
                    self.push(p)
                }
                Some(other) => Err(invalid(
                    origin,
                    "kind",
                    &format!(
                        "{other:?} is not NetworkPolicy, Namespace, Pod, Service, \
                         EndpointSlice or List"
                    ),
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
