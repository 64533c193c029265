//! `static` IPAM: hands out the addresses, routes and DNS written in the
//! config, or given per attachment. No state: DEL and GC have nothing to do.
//!
//! Where the addresses come from, as in the reference
//! (`plugins/ipam/static/main.go`, v1.1.1 to v1.9.1), later sources
//! replacing earlier ones:
//! 1. `ipam.addresses` `[{address, gateway?}]`, plus CNI_ARGS
//!    `IP=<cidr>[,<cidr>...]` appended to them; CNI_ARGS
//!    `GATEWAY=<ip>[,<ip>...]` sets the gateway of each CNI_ARGS address whose
//!    subnet contains it (never of a configured one);
//! 2. `args.cni.ips` (CONVENTIONS.md) replaces all of the above;
//! 3. `runtimeConfig.ips` (capability `ips`) replaces everything.
//!
//! Deliberate differences from the reference, both rejecting configs that
//! only fail later and more obscurely in the interface plugin: no address at
//! all is an error (every reference interface plugin fails on an empty IPAM
//! result), and so is a gateway of the other IP family than its address.
//! CHECK also fails when a configured address is missing from prevResult
//! (the reference checks only the gateway of addresses it finds).

use ipnetwork::IpNetwork;
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::types::cidr;
use rcni_cni::{CniArgs, CniError, CniResult, Dns, ErrorCode, IpConfig, NetConf, Route, version};
use serde::{Deserialize, Deserializer};
use std::net::IpAddr;

pub struct Static;

/// The keys of the network config this plugin reads (Go's `Net`).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Net {
    #[serde(default)]
    ipam: Option<IpamConf>,
    #[serde(default)]
    runtime_config: Option<RuntimeConfig>,
    #[serde(default)]
    args: Option<Args>,
}

#[derive(Debug, Default, Deserialize)]
struct RuntimeConfig {
    #[serde(default)]
    ips: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
struct Args {
    #[serde(default)]
    cni: Option<CniIps>,
}

#[derive(Debug, Default, Deserialize)]
struct CniIps {
    #[serde(default)]
    ips: Option<Vec<String>>,
}

/// The `ipam` section.
#[derive(Debug, Default, Deserialize)]
struct IpamConf {
    #[serde(default)]
    routes: Option<Vec<Route>>,
    #[serde(default)]
    addresses: Option<Vec<AddressConf>>,
    #[serde(default)]
    dns: Option<Dns>,
}

#[derive(Debug, Default, Deserialize)]
struct AddressConf {
    /// Kept as text: it is parsed (and its error reported) only if no
    /// override replaced it, as the reference does.
    #[serde(default)]
    address: String,
    #[serde(default, deserialize_with = "go_ip")]
    gateway: Option<IpAddr>,
}

/// Go's `net.IP` from JSON: null or "" is no address, anything else must
/// parse (`invalid IP address: <text>`).
fn go_ip<'de, D: Deserializer<'de>>(d: D) -> Result<Option<IpAddr>, D::Error> {
    match Option::<String>::deserialize(d)? {
        None => Ok(None),
        Some(s) if s.is_empty() => Ok(None),
        Some(s) => s
            .parse()
            .map(Some)
            .map_err(|_| serde::de::Error::custom(format!("invalid IP address: {s}"))),
    }
}

/// The CNI_ARGS keys this plugin knows (Go's `IPAMEnvArgs`).
const ENV_KEYS: &[&str] = &["IP", "GATEWAY"];

/// What ADD returns, once every source is applied and validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticConf {
    pub addresses: Vec<IpConfig>,
    pub routes: Vec<Route>,
    pub dns: Dns,
}

/// An address whose text has not been parsed yet (from `ipam.addresses`) or
/// one already parsed (from an override).
enum Entry {
    Text(String, Option<IpAddr>),
    Parsed(IpNetwork, Option<IpAddr>),
}

fn env_err(msg: String) -> CniError {
    CniError::new(ErrorCode::InvalidEnvironmentVariables, msg)
}

fn parse_ips_field(list: &[String]) -> Result<Vec<Entry>, CniError> {
    list.iter()
        .map(|s| {
            cidr::parse(s).map(|n| Entry::Parsed(n, None)).map_err(|_| {
                CniError::config(format!(
                    "an entry in the 'ips' field is NOT in CIDR notation, got: '{s}'"
                ))
            })
        })
        .collect()
}

/// Reads the config and the per-attachment sources into the result's
/// contents, with the reference's precedence and messages. Config problems
/// are code 7, CNI_ARGS problems code 4.
pub fn load(conf: &NetConf, env: &CniArgs) -> Result<StaticConf, CniError> {
    let net: Net = conf.plugin_conf()?;
    let ipam = net
        .ipam
        .ok_or_else(|| CniError::config("IPAM config missing 'ipam' key"))?;
    let mut entries: Vec<Entry> = ipam
        .addresses
        .unwrap_or_default()
        .into_iter()
        .map(|a| Entry::Text(a.address, a.gateway))
        .collect();

    // Go's LoadArgs runs only for a non-empty CNI_ARGS.
    if !env.is_empty() {
        env.check_known(ENV_KEYS)?;
        if let Some(list) = env.get("IP").filter(|s| !s.is_empty()) {
            for item in list.split(',') {
                let s = item.trim();
                let n = cidr::parse(s).map_err(|_| {
                    env_err(format!(
                        "the 'ip' field is expected to be in CIDR notation, got: '{s}'"
                    ))
                })?;
                entries.push(Entry::Parsed(n, None));
            }
        }
        if let Some(list) = env.get("GATEWAY").filter(|s| !s.is_empty()) {
            for item in list.split(',') {
                let gw: IpAddr = item
                    .trim()
                    .parse()
                    .map_err(|_| env_err(format!("invalid gateway address: {item}")))?;
                // Configured addresses are still unparsed text here, so in
                // the reference they never match: only CNI_ARGS addresses
                // get a CNI_ARGS gateway.
                for e in &mut entries {
                    if let Entry::Parsed(n, g) = e
                        && n.contains(gw)
                    {
                        *g = Some(gw);
                    }
                }
            }
        }
    }
    if let Some(list) = net
        .args
        .and_then(|a| a.cni)
        .and_then(|c| c.ips)
        .filter(|l| !l.is_empty())
    {
        entries = parse_ips_field(&list)?;
    }
    if let Some(list) = net
        .runtime_config
        .and_then(|r| r.ips)
        .filter(|l| !l.is_empty())
    {
        entries = parse_ips_field(&list)?;
    }

    let mut addresses = Vec::with_capacity(entries.len());
    for e in entries {
        let (address, gateway) = match e {
            Entry::Parsed(n, g) => (n, g),
            Entry::Text(s, g) => (
                cidr::parse(&s).map_err(|_| {
                    CniError::config(format!(
                        "the 'address' field is expected to be in CIDR notation, got: '{s}'"
                    ))
                })?,
                g,
            ),
        };
        if let Some(gw) = gateway
            && gw.is_ipv4() != address.is_ipv4()
        {
            return Err(CniError::config(format!(
                "gateway {gw} is not of the same IP family as address {address}"
            )));
        }
        addresses.push(IpConfig {
            interface: None,
            address,
            gateway,
        });
    }
    if addresses.is_empty() {
        return Err(CniError::config(
            "no IP address configured: set ipam.addresses, runtimeConfig.ips, args.cni.ips or CNI_ARGS IP",
        ));
    }
    let v4 = addresses.iter().filter(|a| a.address.is_ipv4()).count();
    let v6 = addresses.len() - v4;
    if (v4 > 1 || v6 > 1) && !version::at_least(conf.cni_version.as_str(), "0.3.0")? {
        return Err(CniError::new(
            ErrorCode::IncompatibleCniVersion,
            format!(
                "CNI version {} does not support more than 1 address per family",
                conf.cni_version
            ),
        ));
    }
    Ok(StaticConf {
        addresses,
        routes: ipam.routes.unwrap_or_default(),
        dns: ipam.dns.unwrap_or_default(),
    })
}

impl StaticConf {
    /// The abbreviated IPAM result: no interfaces, no `ips[].interface`.
    pub fn to_result(&self, cni_version: &str) -> CniResult {
        CniResult {
            cni_version: cni_version.to_string(),
            interfaces: Vec::new(),
            ips: self.addresses.clone(),
            routes: self.routes.clone(),
            dns: self.dns.clone(),
        }
    }
}

impl Plugin for Static {
    fn about(&self) -> About {
        About::all_versions("static", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        Ok(load(&args.conf, &args.args)?.to_result(args.version()))
    }

    /// Nothing was allocated, so nothing to release; the config is not even
    /// read (a DEL must not fail on a config that ADD rejected).
    fn del(&self, _args: &CmdArgs) -> Result<(), CniError> {
        Ok(())
    }

    /// The config must still load, and prevResult must carry every address
    /// with the configured gateway.
    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = load(&args.conf, &args.args)?;
        let prev = args
            .conf
            .prev_result()?
            .ok_or_else(|| CniError::config("Required prevResult missing"))?;
        for want in &conf.addresses {
            let Some(got) = prev
                .ips
                .iter()
                .find(|ip| ip.address.ip() == want.address.ip())
            else {
                return Err(CniError::new(
                    ErrorCode::CheckFailed,
                    format!(
                        "static: addr {} not found in prevResult for interface {}",
                        want.address.ip(),
                        args.ifname
                    ),
                ));
            };
            if want.gateway.is_some() && want.gateway != got.gateway {
                return Err(CniError::new(
                    ErrorCode::CheckFailed,
                    format!(
                        "static: Failed to match addr {} on interface {}",
                        got.address.ip(),
                        args.ifname
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn conf(v: Value) -> NetConf {
        NetConf::parse(&serde_json::to_vec(&v).unwrap()).unwrap()
    }

    fn base(ipam: Value) -> Value {
        json!({"cniVersion": "1.0.0", "name": "mynet", "type": "bridge", "ipam": ipam})
    }

    fn load_str(v: Value, env: &str) -> Result<StaticConf, CniError> {
        load(&conf(v), &CniArgs::parse(env))
    }

    fn addrs(c: &StaticConf) -> Vec<(String, Option<String>)> {
        c.addresses
            .iter()
            .map(|a| (a.address.to_string(), a.gateway.map(|g| g.to_string())))
            .collect()
    }

    fn pair(a: &str, g: Option<&str>) -> (String, Option<String>) {
        (a.to_string(), g.map(String::from))
    }

    #[test]
    fn config_addresses_routes_dns() {
        let c = load_str(
            base(json!({
                "type": "static",
                "addresses": [
                    {"address": "10.10.0.1/24", "gateway": "10.10.0.254"},
                    {"address": "3ffe:ffff:0:01ff::1/64", "gateway": "3ffe:ffff:0::1"}
                ],
                "routes": [{"dst": "0.0.0.0/0"}, {"dst": "192.168.0.0/16", "gw": "10.10.5.1"}],
                "dns": {"nameservers": ["8.8.8.8"], "domain": "example.com", "search": ["example.com"]}
            })),
            "",
        )
        .unwrap();
        assert_eq!(
            addrs(&c),
            [
                pair("10.10.0.1/24", Some("10.10.0.254")),
                pair("3ffe:ffff:0:1ff::1/64", Some("3ffe:ffff::1"))
            ]
        );
        assert_eq!(c.routes.len(), 2);
        assert_eq!(c.dns.domain, "example.com");
        let r = c.to_result("0.4.0");
        assert!(r.interfaces.is_empty() && r.ips.iter().all(|i| i.interface.is_none()));
    }

    #[test]
    fn keys_match_case_insensitively_like_go() {
        let c = load_str(
            json!({"cniVersion": "1.0.0", "name": "n", "IPAM": {"Type": "static",
                "Addresses": [{"ADDRESS": "10.0.0.2/24", "Gateway": "10.0.0.1"}]},
                "RuntimeConfig": {"IPS": []}}),
            "",
        )
        .unwrap();
        assert_eq!(addrs(&c), [pair("10.0.0.2/24", Some("10.0.0.1"))]);
    }

    #[test]
    fn cni_args_append_and_gateways_pair_by_subnet() {
        let ipam = json!({"type": "static", "addresses": [{"address": "10.1.0.2/24"}]});
        let c = load_str(
            base(ipam.clone()),
            "IP=10.0.0.5/24, fd00::5/64,11.0.0.5/24;GATEWAY=10.0.0.1, fd00::1,10.1.0.1",
        )
        .unwrap();
        assert_eq!(
            addrs(&c),
            [
                // A CNI_ARGS gateway never applies to a configured address.
                pair("10.1.0.2/24", None),
                pair("10.0.0.5/24", Some("10.0.0.1")),
                pair("fd00::5/64", Some("fd00::1")),
                pair("11.0.0.5/24", None),
            ]
        );
        let e = load_str(base(ipam.clone()), "IP=10.0.0.5").unwrap_err();
        assert_eq!(
            (e.code, e.msg.as_str()),
            (
                4,
                "the 'ip' field is expected to be in CIDR notation, got: '10.0.0.5'"
            )
        );
        let e = load_str(base(ipam.clone()), "GATEWAY=bogus").unwrap_err();
        assert_eq!(
            (e.code, e.msg.as_str()),
            (4, "invalid gateway address: bogus")
        );
        let e = load_str(base(ipam.clone()), "IP=10.0.0.5/24;FOO=1").unwrap_err();
        assert_eq!(e.code, 4);
        assert!(e.msg.contains("FOO"), "{}", e.msg);
        // A pair without `=` is LoadArgs' error (ADD and CHECK; DEL reads
        // nothing), even alone.
        let e = load_str(base(ipam.clone()), "none").unwrap_err();
        assert_eq!(
            (e.code, e.msg.as_str()),
            (4, r#"ARGS: invalid pair "none""#)
        );
        let c = load_str(base(ipam), "IgnoreUnknown=1;K8S_POD_NAME=x;IP=").unwrap();
        assert_eq!(addrs(&c), [pair("10.1.0.2/24", None)]);
    }

    #[test]
    fn precedence_runtime_config_then_args_then_cni_args() {
        let mut v = base(json!({"type": "static", "addresses": [{"address": "bogus"}]}));
        v["args"] = json!({"cni": {"ips": ["10.10.0.2/24", "3ffe:ffff:0:01ff::2/64"]}});
        let c = load_str(v.clone(), "IP=10.10.0.3/24;GATEWAY=10.10.0.254").unwrap();
        // args.cni.ips replaced both the (invalid, never parsed) config
        // address and the CNI_ARGS one, gateway included.
        assert_eq!(
            addrs(&c),
            [
                pair("10.10.0.2/24", None),
                pair("3ffe:ffff:0:1ff::2/64", None)
            ]
        );
        v["runtimeConfig"] = json!({"ips": ["10.10.0.1/24"]});
        let c = load_str(v.clone(), "IP=10.10.0.3/24").unwrap();
        assert_eq!(addrs(&c), [pair("10.10.0.1/24", None)]);
        // An empty list is no override.
        v["runtimeConfig"] = json!({"ips": []});
        let c = load_str(v.clone(), "").unwrap();
        assert_eq!(c.addresses.len(), 2);
        v["runtimeConfig"] = json!({"ips": ["10.10.0.1"]});
        let e = load_str(v, "").unwrap_err();
        assert_eq!(
            (e.code, e.msg.as_str()),
            (
                7,
                "an entry in the 'ips' field is NOT in CIDR notation, got: '10.10.0.1'"
            )
        );
    }

    #[test]
    fn config_errors() {
        let e = load_str(
            json!({"cniVersion": "1.0.0", "name": "n"}),
            "IP=10.0.0.1/24",
        )
        .unwrap_err();
        assert_eq!(
            (e.code, e.msg.as_str()),
            (7, "IPAM config missing 'ipam' key")
        );
        let e = load_str(base(json!({"addresses": [{"address": "10.10.0.1"}]})), "").unwrap_err();
        assert_eq!(
            (e.code, e.msg.as_str()),
            (
                7,
                "the 'address' field is expected to be in CIDR notation, got: '10.10.0.1'"
            )
        );
        let e = load_str(
            base(json!({"addresses": [{"address": "10.10.0.1/24", "gateway": "nope"}]})),
            "",
        )
        .unwrap_err();
        assert_eq!(e.code, 7);
        assert!(e.msg.contains("invalid IP address: nope"), "{}", e.msg);
        let e = load_str(
            base(json!({"addresses": [{"address": "10.10.0.1/24", "gateway": "fd00::1"}]})),
            "",
        )
        .unwrap_err();
        assert_eq!(e.code, 7);
        assert!(e.msg.contains("same IP family"), "{}", e.msg);
        let e = load_str(base(json!({"type": "static"})), "").unwrap_err();
        assert_eq!(e.code, 7);
        assert!(e.msg.starts_with("no IP address configured"), "{}", e.msg);
        let e = load_str(
            base(
                json!({"routes": [{"dst": "nonsense"}], "addresses": [{"address": "10.0.0.1/8"}]}),
            ),
            "",
        )
        .unwrap_err();
        assert_eq!(e.code, 7);
        // Empty and null gateways are no gateway, as Go's net.IP.
        let c = load_str(
            base(json!({"addresses": [{"address": "10.0.0.1/8", "gateway": ""}, {"address": "fd00::1/64", "gateway": null}]})),
            "",
        )
        .unwrap();
        assert!(c.addresses.iter().all(|a| a.gateway.is_none()));
    }

    #[test]
    fn one_address_per_family_before_0_3_0() {
        for (v, ok) in [
            ("0.1.0", false),
            ("0.2.0", false),
            ("0.3.0", true),
            ("1.1.0", true),
        ] {
            let mut c =
                base(json!({"addresses": [{"address": "10.0.0.1/24"}, {"address": "fd00::1/64"}]}));
            c["cniVersion"] = json!(v);
            assert!(load_str(c.clone(), "").is_ok(), "{v}: one of each family");
            let r = load_str(c, "IP=11.0.0.1/24");
            if ok {
                r.unwrap();
            } else {
                let e = r.unwrap_err();
                assert_eq!(
                    e.msg,
                    format!("CNI version {v} does not support more than 1 address per family")
                );
            }
        }
    }
}
