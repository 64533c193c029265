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
//! podSelector and namespaceSelector peers match by address, and objects
//! of kind `Service` and `EndpointSlice` say which endpoints a Service's
//! address stands for (the eBPF backend's egress judges those).
//!
//! Everything is validated before it is used: a bad policy is code 7 with
//! a message naming the policy and the field.

mod labels;
mod peers;
mod policy;
mod ports;
mod remote_pods;
mod rules;
mod services;
mod set;

pub use labels::{Labels, NS_NAME_LABEL, Op, Requirement, Selector, validate_labels};
pub use peers::{IpBlock, Peer};
pub use policy::Policy;
pub use ports::{MAX_PORT_RANGES, NamedPorts, PortRange, SCTP, TCP, UDP, proto_number};
pub use remote_pods::RemotePod;
pub use rules::{Dir, Rule};
pub use services::{Frontend, Service, Slice, frontends};
pub use set::PolicySet;

use rcni_cni::CniError;
use serde_json::{Map, Value};

fn invalid(policy: &str, field: &str, what: &str) -> CniError {
    if field.is_empty() {
        CniError::config(format!("policy {policy}: {what}"))
    } else {
        CniError::config(format!("policy {policy}: {field}: {what}"))
    }
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
            // A part with a field of the wrong type names the part.
            (
                json!({"kind":"Pod","metadata":{"name":"p"},"status":{"podIPs":5}}),
                "status",
            ),
        ] {
            let e = PolicySet::default().add_document(&bad, "f").unwrap_err();
            assert_eq!(e.code, 7);
            assert!(e.msg.contains(field), "{}", e.msg);
        }
    }
}
