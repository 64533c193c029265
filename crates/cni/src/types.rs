//! Config and result types. One canonical result (the 1.1.0 model) is read
//! from and written to every spec version's shape.

use crate::ci;
use crate::error::{CniError, ErrorCode};
use crate::version::{self, ResultFamily};
use ipnetwork::IpNetwork;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::net::IpAddr;

/// CIDR with the host bits kept (`10.1.0.5/16`), as Go's `types.IPNet`.
/// A bare address without a prefix is rejected, as `net.ParseCIDR` does.
pub mod cidr {
    use super::*;

    pub fn parse(s: &str) -> Result<IpNetwork, String> {
        if !s.contains('/') {
            return Err(format!("invalid CIDR address: {s}"));
        }
        s.parse::<IpNetwork>()
            .map_err(|_| format!("invalid CIDR address: {s}"))
    }

    pub fn serialize<S: Serializer>(n: &IpNetwork, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(n)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<IpNetwork, D::Error> {
        let s = String::deserialize(d)?;
        parse(&s).map_err(serde::de::Error::custom)
    }
}

/// DNS settings, in config and result.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dns {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nameservers: Vec<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub domain: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub search: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

impl Dns {
    pub fn is_empty(&self) -> bool {
        self.nameservers.is_empty()
            && self.domain.is_empty()
            && self.search.is_empty()
            && self.options.is_empty()
    }
}

/// A route, with the 1.1.0 attributes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Route {
    #[serde(with = "cidr")]
    pub dst: IpNetwork,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gw: Option<IpAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advmss: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<u32>,
}

impl Route {
    pub fn new(dst: IpNetwork, gw: Option<IpAddr>) -> Self {
        Route {
            dst,
            gw,
            mtu: None,
            advmss: None,
            priority: None,
            table: None,
            scope: None,
        }
    }
}

/// An interface in a result.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Interface {
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sandbox: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub socket_path: String,
    #[serde(default, rename = "pciID", skip_serializing_if = "String::is_empty")]
    pub pci_id: String,
}

/// An address in a result; `interface` indexes `CniResult::interfaces`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<usize>,
    #[serde(with = "cidr")]
    pub address: IpNetwork,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<IpAddr>,
}

/// A result in the 1.1.0 model. `cni_version` is the version it was read at
/// or made for; `to_json` writes it at any version.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniResult {
    pub cni_version: String,
    pub interfaces: Vec<Interface>,
    pub ips: Vec<IpConfig>,
    pub routes: Vec<Route>,
    pub dns: Dns,
}

// Wire shapes of each result family. Field order follows the Go structs, so
// that our output reads like the reference plugins'.
#[derive(Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Wire100 {
    #[serde(default)]
    cni_version: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    interfaces: Vec<Interface>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    ips: Vec<IpConfig>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    routes: Vec<Route>,
    #[serde(default, skip_serializing_if = "Dns::is_empty")]
    dns: Dns,
}

#[derive(Serialize, Deserialize, Default)]
struct Interface040 {
    name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    mac: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    sandbox: String,
}

#[derive(Serialize, Deserialize)]
struct IpConfig040 {
    #[serde(default)]
    version: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    interface: Option<usize>,
    #[serde(with = "cidr")]
    address: IpNetwork,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gateway: Option<IpAddr>,
}

#[derive(Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Wire040 {
    #[serde(default)]
    cni_version: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    interfaces: Vec<Interface040>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    ips: Vec<IpConfig040>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    routes: Vec<Route>,
    #[serde(default, skip_serializing_if = "Dns::is_empty")]
    dns: Dns,
}

/// 0.2.0 routes carry only dst and gw.
#[derive(Serialize, Deserialize, Clone)]
struct Route020 {
    #[serde(with = "cidr")]
    dst: IpNetwork,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gw: Option<IpAddr>,
}

#[derive(Serialize, Deserialize)]
struct IpConfig020 {
    #[serde(with = "cidr")]
    ip: IpNetwork,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gateway: Option<IpAddr>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    routes: Vec<Route020>,
}

#[derive(Serialize, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Wire020 {
    #[serde(default)]
    cni_version: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ip4: Option<IpConfig020>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ip6: Option<IpConfig020>,
    #[serde(default, skip_serializing_if = "Dns::is_empty")]
    dns: Dns,
}

fn decode_err(what: &str, e: impl std::fmt::Display) -> CniError {
    CniError::new(
        ErrorCode::DecodingFailure,
        format!("could not parse {what}: {e}"),
    )
}

impl CniResult {
    pub fn new(cni_version: impl Into<String>) -> Self {
        CniResult {
            cni_version: cni_version.into(),
            ..Default::default()
        }
    }

    /// The config's `dns`, when it sets anything, replaces what the IPAM
    /// plugin returned (the reference's `dnsConfSet`); an empty `dns` object
    /// keeps IPAM's.
    pub fn apply_config_dns(&mut self, conf: &NetConf) {
        if let Some(dns) = conf.dns.as_ref().filter(|d| !d.is_empty()) {
            self.dns = dns.clone();
        }
    }

    /// Reads a result of any version. Its own `cniVersion` decides the shape;
    /// `fallback_version` is used when it has none (results before 1.0.0 may
    /// omit it; libcni injects the config's version the same way).
    pub fn from_value(v: &Value, fallback_version: &str) -> Result<CniResult, CniError> {
        let ver = match v.get("cniVersion").or_else(|| v.get("CNIVersion")) {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            None | Some(Value::String(_)) | Some(Value::Null) => fallback_version.to_string(),
            Some(other) => {
                return Err(decode_err(
                    "result",
                    format!("cniVersion {other} is not a string"),
                ));
            }
        };
        let ver = if ver.is_empty() {
            version::DEFAULT_CONFIG_VERSION.to_string()
        } else {
            ver
        };
        let mut out = CniResult::new(ver.clone());
        match version::result_family(&ver)? {
            ResultFamily::V100 => {
                let w: Wire100 = ci::from_value(v.clone()).map_err(|e| decode_err("result", e))?;
                out.interfaces = w.interfaces;
                out.ips = w.ips;
                out.routes = w.routes;
                out.dns = w.dns;
            }
            ResultFamily::V040 => {
                let w: Wire040 = ci::from_value(v.clone()).map_err(|e| decode_err("result", e))?;
                out.interfaces = w
                    .interfaces
                    .into_iter()
                    .map(|i| Interface {
                        name: i.name,
                        mac: i.mac,
                        sandbox: i.sandbox,
                        ..Default::default()
                    })
                    .collect();
                out.ips = w
                    .ips
                    .into_iter()
                    .map(|i| IpConfig {
                        interface: i.interface,
                        address: i.address,
                        gateway: i.gateway,
                    })
                    .collect();
                out.routes = w.routes;
                out.dns = w.dns;
            }
            ResultFamily::V020 => {
                let w: Wire020 = ci::from_value(v.clone()).map_err(|e| decode_err("result", e))?;
                for ipc in [w.ip4, w.ip6].into_iter().flatten() {
                    out.ips.push(IpConfig {
                        interface: None,
                        address: ipc.ip,
                        gateway: ipc.gateway,
                    });
                    out.routes
                        .extend(ipc.routes.into_iter().map(|r| Route::new(r.dst, r.gw)));
                }
                out.dns = w.dns;
            }
        }
        for ip in &out.ips {
            if let Some(i) = ip.interface
                && i >= out.interfaces.len()
            {
                return Err(decode_err(
                    "result",
                    format!(
                        "ips entry {} names interface {i}, but there are {}",
                        ip.address,
                        out.interfaces.len()
                    ),
                ));
            }
        }
        Ok(out)
    }

    pub fn from_slice(b: &[u8], fallback_version: &str) -> Result<CniResult, CniError> {
        let v: Value = serde_json::from_slice(b).map_err(|e| decode_err("result", e))?;
        Self::from_value(&v, fallback_version)
    }

    /// The result in `version`'s shape, labelled with `version`.
    ///
    /// Towards 0.3.x/0.4.0 interface mtu/socketPath/pciID are dropped and each
    /// address gains `version`; routes keep every attribute (Go shares the
    /// Route type). Towards 0.1.0/0.2.0 only the first IPv4 and the first IPv6
    /// address survive, routes are split by family and keep only dst and gw,
    /// and a result without an address cannot be converted.
    pub fn to_value(&self, version: &str) -> Result<Value, CniError> {
        let enc = |r: Result<Value, serde_json::Error>| {
            r.map_err(|e| CniError::internal(format!("encode result: {e}")))
        };
        match version::result_family(version)? {
            ResultFamily::V100 => enc(serde_json::to_value(Wire100 {
                cni_version: version.into(),
                interfaces: self.interfaces.clone(),
                ips: self.ips.clone(),
                routes: self.routes.clone(),
                dns: self.dns.clone(),
            })),
            ResultFamily::V040 => enc(serde_json::to_value(Wire040 {
                cni_version: version.into(),
                interfaces: self
                    .interfaces
                    .iter()
                    .map(|i| Interface040 {
                        name: i.name.clone(),
                        mac: i.mac.clone(),
                        sandbox: i.sandbox.clone(),
                    })
                    .collect(),
                ips: self
                    .ips
                    .iter()
                    .map(|i| IpConfig040 {
                        version: if i.address.is_ipv4() { "4" } else { "6" }.into(),
                        interface: i.interface,
                        address: i.address,
                        gateway: i.gateway,
                    })
                    .collect(),
                routes: self.routes.clone(),
                dns: self.dns.clone(),
            })),
            ResultFamily::V020 => {
                let first = |v4: bool| {
                    self.ips
                        .iter()
                        .find(|i| i.address.is_ipv4() == v4)
                        .map(|i| IpConfig020 {
                            ip: i.address,
                            gateway: i.gateway,
                            routes: self
                                .routes
                                .iter()
                                .filter(|r| r.dst.is_ipv4() == v4)
                                .map(|r| Route020 {
                                    dst: r.dst,
                                    gw: r.gw,
                                })
                                .collect(),
                        })
                };
                let w = Wire020 {
                    cni_version: version.into(),
                    ip4: first(true),
                    ip6: first(false),
                    dns: self.dns.clone(),
                };
                if w.ip4.is_none() && w.ip6.is_none() {
                    // The reference's text (cni's types/040), whatever
                    // the version asked for.
                    return Err(CniError::new(
                        ErrorCode::IncompatibleCniVersion,
                        "cannot convert: no valid IP addresses",
                    ));
                }
                enc(serde_json::to_value(w))
            }
        }
    }

    /// Pretty JSON at `version`, as a plugin prints it.
    pub fn to_json(&self, version: &str) -> Result<String, CniError> {
        Ok(crate::to_pretty_json(&self.to_value(version)?))
    }
}

/// `ipam` section: only `type` is common; the rest is the IPAM plugin's.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct IpamConf {
    #[serde(rename = "type", default)]
    pub ipam_type: String,
}

/// One attachment of the GC valid set.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GcAttachment {
    #[serde(rename = "containerID")]
    pub container_id: String,
    #[serde(rename = "ifname")]
    pub ifname: String,
}

/// The keys every plugin config shares. Plugins deserialize their own
/// struct from `raw` for the rest.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetConf {
    #[serde(default)]
    pub cni_version: String,
    #[serde(default)]
    pub name: String,
    #[serde(rename = "type", default)]
    pub plugin_type: String,
    #[serde(default)]
    pub capabilities: BTreeMap<String, bool>,
    #[serde(default)]
    pub ipam: Option<IpamConf>,
    #[serde(default)]
    pub dns: Option<Dns>,
    #[serde(default)]
    pub ip_masq: bool,
    #[serde(default)]
    pub runtime_config: Option<Value>,
    #[serde(default)]
    pub prev_result: Option<Value>,
    #[serde(default)]
    pub args: Option<Value>,
    #[serde(default, rename = "cni.dev/valid-attachments")]
    pub valid_attachments: Option<Vec<GcAttachment>>,
    #[serde(default, rename = "cni.dev/attachments")]
    pub attachments: Option<Vec<GcAttachment>>,
    /// The whole config as received.
    #[serde(skip)]
    pub raw: Value,
}

impl NetConf {
    /// Parses a plugin's stdin: bad JSON is code 6, a wrong type code 7, a
    /// missing or malformed `name` code 7 (the skel's rules).
    pub fn parse(bytes: &[u8]) -> Result<NetConf, CniError> {
        let raw: Value = serde_json::from_slice(bytes).map_err(|e| {
            CniError::new(
                ErrorCode::DecodingFailure,
                format!("error unmarshall network config: {e}"),
            )
        })?;
        if !raw.is_object() {
            return Err(CniError::new(
                ErrorCode::DecodingFailure,
                "error unmarshall network config: not a JSON object",
            ));
        }
        let mut conf: NetConf = ci::from_value(raw.clone())
            .map_err(|e| CniError::config(format!("invalid network config: {e}")))?;
        conf.raw = raw;
        if conf.cni_version.is_empty() {
            conf.cni_version = version::DEFAULT_CONFIG_VERSION.into();
        }
        validate_name(&conf.name).map_err(|e| match conf.name.is_empty() {
            true => CniError::config("missing network name"),
            false => e,
        })?;
        // Refused here, before a plugin makes its links and only then
        // delegates to its IPAM.
        // An empty type means no IPAM to several plugins.
        if let Some(ipam) = conf.ipam.as_ref().filter(|i| !i.ipam_type.is_empty()) {
            crate::invoke::validate_plugin_name(&ipam.ipam_type)?;
        }
        Ok(conf)
    }

    /// The parsed `prevResult` of a plugin that cannot work without it
    /// (code 7 with `missing` as the message when absent).
    pub fn required_prev_result(&self, missing: &str) -> Result<CniResult, CniError> {
        self.prev_result()?
            .ok_or_else(|| CniError::config(missing.to_string()))
    }

    /// The parsed `prevResult`, if any.
    pub fn prev_result(&self) -> Result<Option<CniResult>, CniError> {
        match &self.prev_result {
            None | Some(Value::Null) => Ok(None),
            Some(v) => CniResult::from_value(v, &self.cni_version)
                .map(Some)
                .map_err(|e| e.context("could not parse prevResult")),
        }
    }

    /// GC's valid set. libcni sends both keys (the spec text once named the
    /// second); `None` means the runtime sent neither.
    pub fn gc_valid_attachments(&self) -> Option<Vec<GcAttachment>> {
        self.valid_attachments
            .clone()
            .or_else(|| self.attachments.clone())
    }

    /// GC's valid set for a plugin that removes what is not in it. An
    /// absent key is a malformed request (code 7), not "nothing is valid":
    /// guessing the latter would remove everything of the network. libcni
    /// sends `null` for an empty set, which is the key present. `verb` says
    /// in the error what an empty list does ("releases", "removes").
    pub fn gc_required_valid_attachments(&self, verb: &str) -> Result<Vec<GcAttachment>, CniError> {
        let has_key = self.raw.as_object().is_some_and(|m| {
            m.contains_key("cni.dev/valid-attachments") || m.contains_key("cni.dev/attachments")
        });
        if !has_key {
            return Err(CniError::config(format!(
                "GC needs cni.dev/valid-attachments (an empty list {verb} everything)"
            )));
        }
        Ok(self.gc_valid_attachments().unwrap_or_default())
    }

    /// GC's valid set as `(containerID, ifname)` pairs; empty when the
    /// runtime sent none.
    pub fn gc_valid_pairs(&self) -> Vec<(String, String)> {
        self.gc_valid_attachments()
            .unwrap_or_default()
            .into_iter()
            .map(|a| (a.container_id, a.ifname))
            .collect()
    }

    /// Deserializes the plugin's own config type from the raw stdin, with
    /// Go-like key matching.
    pub fn plugin_conf<T: serde::de::DeserializeOwned>(&self) -> Result<T, CniError> {
        ci::from_value(self.raw.clone())
            .map_err(|e| CniError::config(format!("invalid network config: {e}")))
    }

    /// A key of `runtimeConfig`, deserialized.
    pub fn runtime_value<T: serde::de::DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<T>, CniError> {
        let Some(rc) = self.runtime_config.as_ref().and_then(Value::as_object) else {
            return Ok(None);
        };
        match rc.iter().find(|(k, _)| k.eq_ignore_ascii_case(key)) {
            None | Some((_, Value::Null)) => Ok(None),
            Some((_, v)) => ci::from_value(v.clone())
                .map(Some)
                .map_err(|e| CniError::config(format!("invalid runtimeConfig.{key}: {e}"))),
        }
    }

    /// `args.cni.<key>`, deserialized (the CONVENTIONS.md place for
    /// per-attachment arguments).
    pub fn cni_arg<T: serde::de::DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<T>, CniError> {
        let v = self
            .args
            .as_ref()
            .and_then(|a| a.get("cni"))
            .and_then(|c| c.get(key));
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(v) => ci::from_value(v.clone())
                .map(Some)
                .map_err(|e| CniError::config(format!("invalid args.cni.{key}: {e}"))),
        }
    }
}

fn valid_name_chars(s: &str) -> bool {
    let mut b = s.bytes();
    matches!(b.next(), Some(c) if c.is_ascii_alphanumeric())
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'.' || c == b'-')
}

/// Network names: `^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$` (code 7).
pub fn validate_name(name: &str) -> Result<(), CniError> {
    if name.is_empty() {
        return Err(CniError::config("missing network name"));
    }
    if !valid_name_chars(name) {
        return Err(CniError::config("invalid characters found in network name").with_details(name));
    }
    Ok(())
}

/// Container IDs: empty is code 3, bad characters code 4.
pub fn validate_container_id(id: &str) -> Result<(), CniError> {
    if id.is_empty() {
        return Err(CniError::new(
            ErrorCode::UnknownContainer,
            "missing containerID",
        ));
    }
    if !valid_name_chars(id) {
        return Err(CniError::new(
            ErrorCode::InvalidEnvironmentVariables,
            "invalid characters in containerID",
        )
        .with_details(id));
    }
    Ok(())
}

/// Interface names as the kernel takes them: 1-15 bytes, not `.`/`..`, no
/// `/`, `:` or whitespace (code 4).
pub fn validate_ifname(name: &str) -> Result<(), CniError> {
    let e = |m: &str| CniError::new(ErrorCode::InvalidEnvironmentVariables, m);
    if name.is_empty() {
        return Err(e("interface name is empty"));
    }
    if name.len() > 15 {
        return Err(e("interface name is too long")
            .with_details("interface name should be less than 16 characters"));
    }
    if name == "." || name == ".." {
        return Err(e("interface name is . or .."));
    }
    if name
        .chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace())
    {
        return Err(e("interface name contains / or : or whitespace characters"));
    }
    Ok(())
}

/// Well-known capability: a port mapping, as containerd (`HostPort`, ...)
/// and podman (`hostPort`, ...) both send it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortMapping {
    pub host_port: u16,
    pub container_port: u16,
    #[serde(default)]
    pub protocol: String,
    #[serde(default, rename = "hostIP")]
    pub host_ip: String,
}

/// Well-known capability `bandwidth`: rates in bit/s, bursts in bits.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BandwidthEntry {
    #[serde(default)]
    pub ingress_rate: u64,
    #[serde(default)]
    pub ingress_burst: u64,
    #[serde(default)]
    pub egress_rate: u64,
    #[serde(default)]
    pub egress_burst: u64,
}

/// A JSON object with `key` set, for building stdin of chained calls.
pub fn with_key(mut conf: Value, key: &str, v: Value) -> Value {
    if let Some(m) = conf.as_object_mut() {
        m.insert(key.to_string(), v);
    }
    conf
}

/// An empty JSON object.
pub fn empty_object() -> Value {
    Value::Object(Map::new())
}

/// The subnet of an address: host bits cleared, same prefix.
pub fn subnet(ip: &IpNetwork) -> IpNetwork {
    IpNetwork::new(ip.network(), ip.prefix()).expect("prefix taken from a valid network")
}
