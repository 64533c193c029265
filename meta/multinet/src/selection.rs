//! Which extra networks a pod asks for: the Multus annotation
//! `k8s.v1.cni.cncf.io/networks`, in its two forms (Multus'
//! `parsePodNetworkAnnotation`):
//!
//! - a comma-separated list, `net-a, ns/net-b@eth2`;
//! - a JSON list of objects with `name`, `namespace`, `interface`, `ips`,
//!   `mac` and `default-route`.

use rcni_cni::{CniError, ErrorCode};
use serde::Deserialize;
use std::net::IpAddr;

/// The annotation's key, in containerd's pod-annotations capability.
pub const NETWORKS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/networks";

/// One requested attachment.
/// Unknown keys are ignored, as Go's decoder (and so Multus) ignores them.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
pub struct Selection {
    pub name: String,
    /// Multus resolves NetworkAttachmentDefinitions per namespace; here a
    /// network is a conflist of `confDir`, so the namespace only must be
    /// valid (see `conflist_name`).
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default, alias = "interfaceRequest")]
    pub interface: Option<String>,
    /// Addresses for delegates that declare the `ips` capability.
    #[serde(default)]
    pub ips: Vec<String>,
    /// A MAC for delegates that declare the `mac` capability.
    #[serde(default)]
    pub mac: Option<String>,
    /// Gateways: the pod's default route of each one's family goes through
    /// this attachment.
    #[serde(default, rename = "default-route")]
    pub default_route: Vec<IpAddr>,
    /// Given to every plugin of the network as `args.cni`.
    #[serde(default, rename = "cni-args")]
    pub cni_args: Option<serde_json::Map<String, serde_json::Value>>,
    /// For delegates declaring the `portMappings` capability.
    #[serde(default, rename = "portMappings")]
    pub port_mappings: Option<serde_json::Value>,
    /// For delegates declaring the `bandwidth` capability.
    #[serde(default)]
    pub bandwidth: Option<serde_json::Value>,
    /// For delegates declaring the `infinibandGUID` capability.
    #[serde(default, rename = "infiniband-guid")]
    pub infiniband_guid: Option<String>,
}

fn invalid(msg: String) -> CniError {
    CniError::new(ErrorCode::InvalidNetworkConfig, msg)
}

/// Parses either form. An empty or blank annotation asks for nothing.
pub fn parse(annotation: &str) -> Result<Vec<Selection>, CniError> {
    let s = annotation.trim();
    if s.is_empty() {
        return Ok(Vec::new());
    }
    let sels = if s.starts_with('[') {
        serde_json::from_str::<Vec<Selection>>(s).map_err(|e| {
            invalid(format!(
                "networks annotation {NETWORKS_ANNOTATION:?}: invalid JSON list: {e}"
            ))
        })?
    } else {
        s.split(',')
            .map(|item| parse_item(item.trim()))
            .collect::<Result<_, _>>()?
    };
    for sel in &sels {
        check_name(&sel.name, "name")?;
        if let Some(ns) = &sel.namespace {
            check_name(ns, "namespace")?;
        }
    }
    Ok(sels)
}

/// `[namespace/]name[@interface]`.
fn parse_item(item: &str) -> Result<Selection, CniError> {
    if item.is_empty() {
        return Err(invalid(format!(
            "networks annotation {NETWORKS_ANNOTATION:?}: empty network name in the list"
        )));
    }
    let (rest, interface) = match item.split_once('@') {
        Some((r, i)) if !i.is_empty() && !i.contains('@') => (r, Some(i.to_string())),
        Some(_) => {
            return Err(invalid(format!(
                "networks annotation: {item:?}: expected name@interface"
            )));
        }
        None => (item, None),
    };
    let (namespace, name) = match rest.split_once('/') {
        Some((ns, n)) if !n.contains('/') => (Some(ns.to_string()), n.to_string()),
        Some(_) => {
            return Err(invalid(format!(
                "networks annotation: {item:?}: expected namespace/name"
            )));
        }
        None => (None, rest.to_string()),
    };
    Ok(Selection {
        name,
        namespace,
        interface,
        ..Selection::default()
    })
}

/// A DNS-1123 label or subdomain, as Kubernetes names are; it also keeps a
/// name from reaching outside `confDir`.
fn check_name(s: &str, what: &str) -> Result<(), CniError> {
    let ok = !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !s.starts_with(['-', '.'])
        && !s.ends_with(['-', '.']);
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "networks annotation: {what} {s:?} is not a valid Kubernetes name (lower-case letters, digits, '-' and '.')"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comma_form() {
        let v = parse("net-a, kube-system/net-b@eth2 ,net-c").unwrap();
        assert_eq!(v.len(), 3);
        assert_eq!(v[0].name, "net-a");
        assert_eq!(v[0].interface, None);
        assert_eq!(v[1].namespace.as_deref(), Some("kube-system"));
        assert_eq!(v[1].name, "net-b");
        assert_eq!(v[1].interface.as_deref(), Some("eth2"));
        assert_eq!(v[2].name, "net-c");
        assert!(parse("").unwrap().is_empty());
        assert!(parse("  ").unwrap().is_empty());
    }

    #[test]
    fn json_form() {
        let v = parse(
            r#"[{"name": "macnet", "interface": "data0", "ips": ["10.1.1.5/24"],
                 "mac": "c2:b0:57:49:47:f1", "default-route": ["10.1.1.1"]},
                {"name": "other", "namespace": "ns1"}]"#,
        )
        .unwrap();
        assert_eq!(v[0].ips, ["10.1.1.5/24"]);
        assert_eq!(v[0].mac.as_deref(), Some("c2:b0:57:49:47:f1"));
        assert_eq!(v[0].default_route, ["10.1.1.1".parse::<IpAddr>().unwrap()]);
        assert_eq!(v[1].namespace.as_deref(), Some("ns1"));
        // Keys Multus knows and we do not are ignored, as Go ignores them.
        let v = parse(r#"[{"name": "x", "interfaceRequest": "n9", "ipam-claim-reference": "c"}]"#)
            .unwrap();
        assert_eq!(v[0].interface.as_deref(), Some("n9"));
    }

    #[test]
    fn bad_annotations_are_config_errors() {
        for bad in [
            "net-a,,net-b",
            "net-a@",
            "a/b/c",
            "net@a@b",
            "../etc",
            "Net-A",
            "[{\"interface\": \"x\"}]",
            "[{\"name\": \"x\", \"default-route\": [\"nope\"]}]",
            "[",
        ] {
            let e = parse(bad).unwrap_err();
            assert_eq!(e.code, 7, "{bad}: {}", e.msg);
        }
    }
}
