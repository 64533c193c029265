//! The portmap config: the reference's keys (`snat`, `masqAll`,
//! `markMasqBit`, `externalSetMarkChain`, `conditionsV4`/`V6`, `backend`)
//! and the `portMappings` capability, validated before anything is written.

use ipnetwork::IpNetwork;
use rcni_cni::skel::CmdArgs;
use rcni_cni::types::PortMapping;
use rcni_cni::{CniError, CniResult};
use rcni_netns::NetNs;
use serde::Deserialize;
use std::net::IpAddr;

/// The reference's default mark bit (Kubernetes uses 14 and 15, Calico
/// 20-31).
pub const DEFAULT_MARK_BIT: u32 = 13;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    #[serde(default)]
    snat: Option<bool>,
    #[serde(default)]
    masq_all: bool,
    #[serde(default)]
    mark_masq_bit: Option<i64>,
    #[serde(default)]
    external_set_mark_chain: Option<String>,
    #[serde(default, rename = "conditionsV4")]
    conditions_v4: Option<Vec<String>>,
    #[serde(default, rename = "conditionsV6")]
    conditions_v6: Option<Vec<String>>,
    #[serde(default)]
    backend: Option<String>,
}

/// Which netfilter interface holds the rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Nftables,
    Iptables,
}

/// Transport protocol of a mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proto {
    Sctp,
    Tcp,
    Udp,
}

impl Proto {
    /// The IP protocol number.
    pub fn number(self) -> u8 {
        match self {
            Proto::Tcp => 6,
            Proto::Udp => 17,
            Proto::Sctp => 132,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Sctp => "sctp",
        }
    }
}

/// One validated port mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub host_port: u16,
    pub container_port: u16,
    pub proto: Proto,
    /// `None` for every host address (also for `0.0.0.0` and `::`, which
    /// the reference treats as "no host IP" for the destination match).
    pub host_ip: Option<IpAddr>,
    /// The host IP was given (even unspecified): the mapping then applies
    /// to that family only.
    pub host_ip_family: Option<bool>,
}

impl Mapping {
    /// Whether the mapping applies to a container address of this family
    /// (a host IP of the other family skips it, as in the reference).
    pub fn applies_to(&self, v6: bool) -> bool {
        self.host_ip_family.is_none_or(|f| f == v6)
    }
}

/// The validated settings of one call.
#[derive(Debug, Clone)]
pub struct Conf {
    pub network: String,
    pub snat: bool,
    pub masq_all: bool,
    pub mark_bit: u32,
    pub external_set_mark_chain: Option<String>,
    pub conditions_v4: Vec<String>,
    pub conditions_v6: Vec<String>,
    /// The configured backend; `None` picks one by [`Conf::backend`].
    pub backend: Option<Backend>,
    pub mappings: Vec<Mapping>,
}

fn parse_mapping(m: &PortMapping) -> Result<Mapping, CniError> {
    if m.container_port == 0 {
        return Err(CniError::config(format!(
            "Invalid container port number: {}",
            m.container_port
        )));
    }
    if m.host_port == 0 {
        return Err(CniError::config(format!(
            "Invalid host port number: {}",
            m.host_port
        )));
    }
    let proto = match m.protocol.to_ascii_lowercase().as_str() {
        "tcp" => Proto::Tcp,
        "udp" => Proto::Udp,
        "sctp" => Proto::Sctp,
        other => {
            return Err(CniError::unsupported(
                "portMappings.protocol",
                format!("{other:?}"),
            ));
        }
    };
    let (host_ip, host_ip_family) = if m.host_ip.is_empty() {
        (None, None)
    } else {
        let ip: IpAddr = m.host_ip.parse().map_err(|_| {
            CniError::config(format!("invalid hostIP {:?} in portMappings", m.host_ip))
        })?;
        ((!ip.is_unspecified()).then_some(ip), Some(ip.is_ipv6()))
    };
    Ok(Mapping {
        host_port: m.host_port,
        container_port: m.container_port,
        proto,
        host_ip,
        host_ip_family,
    })
}

impl Conf {
    pub fn load(args: &CmdArgs) -> Result<Conf, CniError> {
        let raw: Raw = args.conf.plugin_conf()?;
        if raw.mark_masq_bit.is_some() && raw.external_set_mark_chain.is_some() {
            return Err(CniError::config(
                "Cannot specify externalSetMarkChain and markMasqBit",
            ));
        }
        let mark_bit = match raw.mark_masq_bit {
            None => DEFAULT_MARK_BIT,
            Some(b @ 0..=31) => b as u32,
            Some(_) => return Err(CniError::config("MasqMarkBit must be between 0 and 31")),
        };
        let backend = match raw.backend.as_deref() {
            None | Some("") => None,
            Some("nftables") => Some(Backend::Nftables),
            Some("iptables") => Some(Backend::Iptables),
            Some(other) => return Err(CniError::unsupported("backend", format!("{other:?}"))),
        };
        let mappings = args
            .conf
            .runtime_value::<Vec<PortMapping>>("portMappings")?
            .unwrap_or_default()
            .iter()
            .map(parse_mapping)
            .collect::<Result<Vec<_>, _>>()?;
        let conf = Conf {
            network: args.conf.name.clone(),
            snat: raw.snat.unwrap_or(true),
            masq_all: raw.masq_all,
            mark_bit,
            external_set_mark_chain: raw.external_set_mark_chain.filter(|s| !s.is_empty()),
            conditions_v4: raw.conditions_v4.unwrap_or_default(),
            conditions_v6: raw.conditions_v6.unwrap_or_default(),
            backend,
            mappings,
        };
        if conf.backend == Some(Backend::Nftables) && conf.external_set_mark_chain.is_some() {
            return Err(CniError::config(
                "externalSetMarkChain is an iptables chain: it cannot be used with the nftables backend",
            ));
        }
        Ok(conf)
    }

    /// The backend the config asks for: the configured one; else the one
    /// the conditions are written for (upstream's `detectBackendOfConditions`:
    /// `-` or `!` first is iptables syntax, anything else nft syntax) or that
    /// `externalSetMarkChain` needs. Upstream defaults to iptables there and
    /// then refuses conditions in nft syntax; following them accepts more.
    pub fn implied_backend(&self) -> Option<Backend> {
        if self.backend.is_some() {
            return self.backend;
        }
        if self.external_set_mark_chain.is_some() {
            return Some(Backend::Iptables);
        }
        let first = self
            .conditions_v4
            .iter()
            .chain(&self.conditions_v6)
            .find(|c| !c.trim().is_empty())?;
        Some(if first.trim_start().starts_with(['-', '!']) {
            Backend::Iptables
        } else {
            Backend::Nftables
        })
    }

    /// The backend to write with: [`Conf::implied_backend`], else upstream's
    /// default (`ensureBackend`, v1.9.1): iptables unless iptables does not
    /// work in `ns` and nftables does. The default keeps the rules where
    /// the node's other tools, and the reference plugins sharing the node,
    /// look for them (upstream's suite checks the `CNI-DN-` chain).
    pub fn backend(&self, ns: &NetNs) -> Backend {
        if let Some(b) = self.implied_backend() {
            return b;
        }
        match rcni_netfilter::Backend::detect(ns) {
            rcni_netfilter::Backend::Iptables => Backend::Iptables,
            rcni_netfilter::Backend::Nftables => Backend::Nftables,
        }
    }

    pub fn conditions(&self, v6: bool) -> &[String] {
        if v6 {
            &self.conditions_v6
        } else {
            &self.conditions_v4
        }
    }

    /// The mark value (`1 << markMasqBit`).
    pub fn mark(&self) -> u32 {
        1u32 << self.mark_bit
    }
}

/// The container's first IPv4 and first IPv6 address (with prefix), as the
/// reference picks them: addresses of interfaces other than `ifname`, or of
/// host-side interfaces (no sandbox), are skipped.
pub fn container_ips(prev: &CniResult, ifname: &str) -> (Option<IpNetwork>, Option<IpNetwork>) {
    let mut v4 = None;
    let mut v6 = None;
    for ip in &prev.ips {
        if let Some(i) = ip.interface
            && let Some(iface) = prev.interfaces.get(i)
            && (iface.name != ifname || iface.sandbox.is_empty())
        {
            continue;
        }
        let slot = if ip.address.is_ipv4() {
            &mut v4
        } else {
            &mut v6
        };
        if slot.is_none() {
            *slot = Some(ip.address);
        }
    }
    (v4, v6)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn load(v: serde_json::Value) -> Result<Conf, CniError> {
        Conf::load(&CmdArgs::for_conf(&v)?)
    }

    fn base() -> serde_json::Value {
        json!({"cniVersion": "1.0.0", "name": "n", "type": "portmap"})
    }

    #[test]
    fn defaults() {
        let c = load(base()).unwrap();
        assert!(c.snat && !c.masq_all);
        assert_eq!(c.mark(), 0x2000);
        assert!(c.mappings.is_empty());
        assert_eq!(c.backend, None);
    }

    #[test]
    fn mappings_with_any_key_case() {
        let mut v = base();
        v["runtimeConfig"] = json!({"portMappings": [
            {"HostPort": 8080, "ContainerPort": 80, "Protocol": "TCP"},
            {"hostport": 53, "containerport": 53, "protocol": "udp", "hostip": "10.0.0.1"},
            {"hostPort": 99, "containerPort": 9, "protocol": "sctp", "hostIP": "::"}
        ]});
        let c = load(v).unwrap();
        assert_eq!(c.mappings.len(), 3);
        assert_eq!(c.mappings[0].proto, Proto::Tcp);
        assert_eq!(c.mappings[1].host_ip, Some("10.0.0.1".parse().unwrap()));
        assert!(c.mappings[1].applies_to(false) && !c.mappings[1].applies_to(true));
        assert_eq!(c.mappings[2].host_ip, None);
        assert!(c.mappings[2].applies_to(true) && !c.mappings[2].applies_to(false));
        assert!(c.mappings[0].applies_to(true) && c.mappings[0].applies_to(false));
    }

    #[test]
    fn validation() {
        let mut v = base();
        v["markMasqBit"] = json!(5);
        v["externalSetMarkChain"] = json!("KUBE-MARK-MASQ");
        assert_eq!(load(v).unwrap_err().code, 7);
        let mut v = base();
        v["markMasqBit"] = json!(32);
        assert_eq!(load(v).unwrap_err().code, 7);
        let mut v = base();
        v["backend"] = json!("ebpf");
        let e = load(v).unwrap_err();
        assert_eq!(e.code, 2);
        assert!(e.msg.contains("backend") && e.msg.contains("ebpf"));
        let mut v = base();
        v["runtimeConfig"] =
            json!({"portMappings": [{"hostPort": 0, "containerPort": 80, "protocol": "tcp"}]});
        assert_eq!(load(v).unwrap_err().code, 7);
        let mut v = base();
        v["runtimeConfig"] =
            json!({"portMappings": [{"hostPort": 1, "containerPort": 80, "protocol": "icmp"}]});
        assert_eq!(load(v).unwrap_err().code, 2);
    }

    #[test]
    fn backend_choice() {
        // No backend key and nothing backend-specific: upstream's default,
        // decided by probing the node (Conf::backend).
        assert_eq!(load(base()).unwrap().implied_backend(), None);
        let mut v = base();
        v["conditionsV4"] = json!([""]);
        assert_eq!(load(v).unwrap().implied_backend(), None);
        let mut v = base();
        v["conditionsV4"] = json!(["-s", "1.2.3.4"]);
        assert_eq!(load(v).unwrap().implied_backend(), Some(Backend::Iptables));
        let mut v = base();
        v["conditionsV6"] = json!(["!", "-s", "::1"]);
        assert_eq!(load(v).unwrap().implied_backend(), Some(Backend::Iptables));
        let mut v = base();
        v["conditionsV4"] = json!(["ip saddr 1.2.3.4"]);
        assert_eq!(load(v).unwrap().implied_backend(), Some(Backend::Nftables));
        let mut v = base();
        v["externalSetMarkChain"] = json!("KUBE-MARK-MASQ");
        assert_eq!(load(v).unwrap().implied_backend(), Some(Backend::Iptables));
        let mut v = base();
        v["backend"] = json!("iptables");
        assert_eq!(load(v).unwrap().implied_backend(), Some(Backend::Iptables));
        let mut v = base();
        v["backend"] = json!("nftables");
        v["conditionsV4"] = json!(["ip saddr 1.2.3.4"]);
        assert_eq!(load(v).unwrap().implied_backend(), Some(Backend::Nftables));
    }

    #[test]
    fn picks_the_sandbox_interface_addresses() {
        let prev = CniResult::from_value(
            &json!({"cniVersion": "1.0.0",
                "interfaces": [{"name": "cni0"}, {"name": "veth1"}, {"name": "eth0", "sandbox": "/x"}],
                "ips": [{"address": "10.0.0.1/24", "interface": 0},
                        {"address": "10.0.0.5/24", "interface": 2},
                        {"address": "fd00::5/64", "interface": 2},
                        {"address": "10.0.0.6/24", "interface": 2}]}),
            "1.0.0",
        )
        .unwrap();
        let (v4, v6) = container_ips(&prev, "eth0");
        assert_eq!(v4.unwrap().to_string(), "10.0.0.5/24");
        assert_eq!(v6.unwrap().to_string(), "fd00::5/64");
        assert_eq!(container_ips(&prev, "eth1"), (None, None));
    }
}
