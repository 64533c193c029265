//! The firewall config: `backend`, `iptablesAdminChainName`,
//! `firewalldZone`, `ingressPolicy`, and the attachment's addresses and bridge from
//! prevResult.

use ipnetwork::IpNetwork;
use rcni_cni::skel::CmdArgs;
use rcni_cni::{CniError, CniResult};
use serde::Deserialize;

pub const DEFAULT_ADMIN_CHAIN: &str = "CNI-ADMIN";
pub const DEFAULT_FIREWALLD_ZONE: &str = "trusted";

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    #[serde(default)]
    backend: String,
    #[serde(default)]
    iptables_admin_chain_name: String,
    #[serde(default)]
    firewalld_zone: String,
    #[serde(default)]
    ingress_policy: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Nftables,
    Iptables,
    Firewalld,
}

/// Who may reach the attachment's bridge from other bridges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum IngressPolicy {
    /// No restriction (the default).
    Open,
    /// Traffic from other isolated bridges is dropped (Docker-like).
    SameBridge,
    /// As same-bridge, and pods on the bridge cannot reach each other
    /// either; the gateway and the outside stay reachable.
    Isolated,
}

impl IngressPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            IngressPolicy::Open => "open",
            IngressPolicy::SameBridge => "same-bridge",
            IngressPolicy::Isolated => "isolated",
        }
    }

    pub fn parse(s: &str) -> Option<IngressPolicy> {
        Some(match s {
            "" | "open" => IngressPolicy::Open,
            "same-bridge" => IngressPolicy::SameBridge,
            "isolated" => IngressPolicy::Isolated,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone)]
pub struct Conf {
    pub network: String,
    /// `None`: firewalld if it runs, else iptables (`backend::select`).
    pub backend: Option<Backend>,
    pub admin_chain: String,
    pub firewalld_zone: String,
    pub policy: IngressPolicy,
}

impl Conf {
    pub fn load(args: &CmdArgs) -> Result<Conf, CniError> {
        let raw: Raw = args.conf.plugin_conf()?;
        // Any other value means the default, as in the reference (which
        // knows only "iptables" and "firewalld"): a config the reference
        // runs must not fail here.
        let backend = match raw.backend.as_str() {
            "iptables" => Some(Backend::Iptables),
            "nftables" => Some(Backend::Nftables),
            "firewalld" => Some(Backend::Firewalld),
            _ => None,
        };
        let policy = IngressPolicy::parse(&raw.ingress_policy).ok_or_else(|| {
            CniError::unsupported("ingressPolicy", format!("{:?}", raw.ingress_policy))
        })?;
        let admin_chain = if raw.iptables_admin_chain_name.is_empty() {
            DEFAULT_ADMIN_CHAIN.to_string()
        } else {
            raw.iptables_admin_chain_name
        };
        // The chain name goes into iptables-restore input and nft scripts
        // unquoted: refuse anything that is not a plain name.
        if admin_chain.len() > 28
            || !admin_chain
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(CniError::unsupported(
                "iptablesAdminChainName",
                format!("{admin_chain:?}"),
            ));
        }
        let firewalld_zone = if raw.firewalld_zone.is_empty() {
            DEFAULT_FIREWALLD_ZONE.to_string()
        } else {
            raw.firewalld_zone
        };
        Ok(Conf {
            network: args.conf.name.clone(),
            backend,
            admin_chain,
            firewalld_zone,
            policy,
        })
    }
}

/// Every address of the result, as the reference (all interfaces).
pub fn addresses(prev: &CniResult) -> Vec<IpNetwork> {
    prev.ips.iter().map(|i| i.address).collect()
}

/// The bridge an ingress policy applies to: the result's first interface
/// (the bridge plugin lists its bridge first).
pub fn bridge(prev: &CniResult, policy: IngressPolicy) -> Result<Option<String>, CniError> {
    if policy == IngressPolicy::Open {
        return Ok(None);
    }
    match prev.interfaces.first() {
        Some(i) if !i.name.is_empty() => Ok(Some(i.name.clone())),
        _ => Err(CniError::config(format!(
            "interface needs to be set for ingress policy {:?}, make sure to chain \"firewall\" plugin with \"bridge\"",
            policy.as_str()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn load(v: serde_json::Value) -> Result<Conf, CniError> {
        Conf::load(&CmdArgs::for_conf(&v)?)
    }

    #[test]
    fn keys() {
        let base = json!({"cniVersion": "1.0.0", "name": "n", "type": "firewall"});
        let c = load(base.clone()).unwrap();
        assert_eq!(
            (
                c.admin_chain.as_str(),
                c.policy,
                c.backend,
                c.firewalld_zone.as_str()
            ),
            ("CNI-ADMIN", IngressPolicy::Open, None, "trusted")
        );
        let mut v = base.clone();
        v["ingressPolicy"] = json!("isolated");
        v["backend"] = json!("iptables");
        v["iptablesAdminChainName"] = json!("MY-ADMIN");
        v["firewalldZone"] = json!("pods");
        let c = load(v).unwrap();
        assert_eq!(
            (
                c.admin_chain.as_str(),
                c.policy,
                c.backend,
                c.firewalld_zone.as_str()
            ),
            (
                "MY-ADMIN",
                IngressPolicy::Isolated,
                Some(Backend::Iptables),
                "pods"
            )
        );
        // podman writes "backend": ""; the reference takes any value it
        // does not know for the default.
        for (val, want) in [
            ("", None),
            ("firewalld", Some(Backend::Firewalld)),
            ("nftables", Some(Backend::Nftables)),
            ("bpf", None),
        ] {
            let mut v = base.clone();
            v["backend"] = json!(val);
            assert_eq!(load(v).unwrap().backend, want, "{val:?}");
        }
        for (k, val) in [
            ("ingressPolicy", "closed"),
            ("iptablesAdminChainName", "x y"),
        ] {
            let mut v = base.clone();
            v[k] = json!(val);
            let e = load(v).unwrap_err();
            assert_eq!(e.code, 2, "{k}");
            assert!(e.msg.contains(k), "{}", e.msg);
        }
    }

    #[test]
    fn bridge_from_the_result() {
        let r = CniResult::from_value(
            &json!({"cniVersion": "1.0.0", "interfaces": [{"name": "cni0"}, {"name": "eth0", "sandbox": "/x"}],
                    "ips": [{"address": "10.0.0.2/24", "interface": 1}]}),
            "1.0.0",
        )
        .unwrap();
        assert_eq!(bridge(&r, IngressPolicy::Open).unwrap(), None);
        assert_eq!(
            bridge(&r, IngressPolicy::SameBridge).unwrap().as_deref(),
            Some("cni0")
        );
        assert_eq!(addresses(&r).len(), 1);
        let empty = CniResult::new("1.0.0");
        assert_eq!(bridge(&empty, IngressPolicy::Isolated).unwrap_err().code, 7);
    }
}
