//! The `ipam` section (plus `runtimeConfig` and `args`) as the reference's
//! `LoadIPAMConfig` reads it: same keys, same defaults, same checks in the
//! same order, same messages.

use crate::range::{RangeSet, RangeSpec, Subnet, parse_ip};
use rcni_cni::types::cidr;
use rcni_cni::{CniArgs, CniError, ErrorCode, NetConf, Route};
use serde::Deserialize;
use std::net::IpAddr;
use std::path::PathBuf;

pub const DEFAULT_DATA_DIR: &str = "/var/lib/cni/networks";

// Wire shapes: every leaf is an optional string so that an empty string
// means "unset", as it does for Go's net.IP, and so that bad addresses get
// Go's messages rather than serde's.

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct NetWire {
    #[serde(default)]
    ipam: Option<IpamWire>,
    #[serde(default)]
    runtime_config: Option<RuntimeWire>,
    #[serde(default)]
    args: Option<ArgsWire>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct IpamWire {
    // The legacy single range, embedded in Go's IPAMConfig.
    #[serde(default)]
    subnet: Option<String>,
    #[serde(default)]
    range_start: Option<String>,
    #[serde(default)]
    range_end: Option<String>,
    #[serde(default)]
    gateway: Option<String>,
    #[serde(default)]
    routes: Option<Vec<RouteWire>>,
    #[serde(default)]
    data_dir: Option<String>,
    #[serde(default)]
    resolv_conf: Option<String>,
    #[serde(default)]
    ranges: Option<Vec<Vec<RangeWire>>>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct RangeWire {
    #[serde(default)]
    subnet: Option<String>,
    #[serde(default)]
    range_start: Option<String>,
    #[serde(default)]
    range_end: Option<String>,
    #[serde(default)]
    gateway: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct RouteWire {
    #[serde(default)]
    dst: Option<String>,
    #[serde(default)]
    gw: Option<String>,
    #[serde(default)]
    mtu: Option<u32>,
    #[serde(default)]
    advmss: Option<u32>,
    #[serde(default)]
    priority: Option<u32>,
    #[serde(default)]
    table: Option<u32>,
    #[serde(default)]
    scope: Option<u32>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct RuntimeWire {
    #[serde(default)]
    ip_ranges: Option<Vec<Vec<RangeWire>>>,
    #[serde(default)]
    ips: Option<Vec<String>>,
}

#[derive(Deserialize, Default)]
struct ArgsWire {
    #[serde(default)]
    cni: Option<CniArgsWire>,
}

#[derive(Deserialize, Default)]
struct CniArgsWire {
    #[serde(default)]
    ips: Option<Vec<String>>,
}

/// For DEL and GC, which need only the state location.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct LocationWire {
    #[serde(default)]
    ipam: Option<LocationIpam>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct LocationIpam {
    #[serde(default)]
    data_dir: Option<String>,
}

/// What the commands need, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpamConfig {
    pub name: String,
    pub cni_version: String,
    pub data_dir: PathBuf,
    pub resolv_conf: Option<PathBuf>,
    pub routes: Vec<Route>,
    /// Index = the range set's id in `last_reserved_ip.<id>`.
    pub ranges: Vec<RangeSet>,
    /// Requested addresses, from the highest-precedence source that gave
    /// any: `runtimeConfig.ips`, then `args.cni.ips`, then CNI_ARGS `IP`.
    pub requested: Vec<IpAddr>,
}

/// Which command the config is loaded for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// ADD and CHECK: everything, CNI_ARGS included.
    Allocate,
    /// STATUS gets no runtimeConfig, so ranges that only a runtime supplies
    /// (`ipRanges`) are absent: no ranges is then nothing to report, not an
    /// invalid config.
    Status,
}

fn config_err(msg: impl Into<String>) -> CniError {
    CniError::config(msg)
}

/// Go's net.IP text decoding: empty is unset.
fn opt_ip(s: &Option<String>) -> Result<Option<IpAddr>, String> {
    match s.as_deref() {
        None | Some("") => Ok(None),
        Some(t) => parse_ip(t)
            .map(Some)
            .ok_or_else(|| format!("invalid IP address: {t}")),
    }
}

fn range_spec(w: &RangeWire) -> Result<RangeSpec, String> {
    Ok(RangeSpec {
        // A missing subnet is kept as None: validation reports it.
        subnet: w.subnet.as_deref().map(Subnet::parse).transpose()?,
        range_start: opt_ip(&w.range_start)?,
        range_end: opt_ip(&w.range_end)?,
        gateway: opt_ip(&w.gateway)?,
    })
}

fn range_specs(sets: &[Vec<RangeWire>]) -> Result<Vec<Vec<RangeSpec>>, String> {
    sets.iter()
        .map(|set| set.iter().map(range_spec).collect())
        .collect()
}

/// `ip.IP` text: an address with an optional (ignored) prefix.
pub fn parse_requested(s: &str) -> Option<IpAddr> {
    match s.split_once('/') {
        Some(_) => Subnet::parse(s).ok().map(|n| n.ip),
        None => parse_ip(s),
    }
}

fn requested_list(ips: &Option<Vec<String>>) -> Result<Vec<IpAddr>, CniError> {
    let mut out = Vec::new();
    for s in ips.iter().flatten() {
        if s.is_empty() {
            // Go decodes "" to an empty ip.IP, which canonicalizeIP rejects.
            return Err(config_err("cannot understand ip: IP <nil> not v4 nor v6"));
        }
        let ip = parse_requested(s).ok_or_else(|| config_err(format!("invalid IP address {s}")))?;
        out.push(ip);
    }
    Ok(out)
}

/// CNI_ARGS `IP=`: one address (reference) or several, comma-separated.
fn env_requested(env: &CniArgs) -> Result<Vec<IpAddr>, CniError> {
    env.check_known(&["IP"])?;
    let Some(v) = env.get("IP") else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for item in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let ip = parse_requested(item).ok_or_else(|| {
            CniError::new(
                ErrorCode::InvalidEnvironmentVariables,
                format!("ARGS: error parsing value of pair \"IP={v}\": invalid IP address {item}"),
            )
        })?;
        out.push(ip);
    }
    Ok(out)
}

fn route(w: &RouteWire) -> Result<Route, String> {
    let dst = w.dst.as_deref().ok_or("route without \"dst\"")?;
    let mut r = Route::new(cidr::parse(dst)?, opt_ip(&w.gw)?);
    r.mtu = w.mtu;
    r.advmss = w.advmss;
    r.priority = w.priority;
    r.table = w.table;
    r.scope = w.scope;
    Ok(r)
}

fn dedup(ips: Vec<IpAddr>) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = Vec::with_capacity(ips.len());
    for ip in ips {
        if !out.contains(&ip) {
            out.push(ip);
        }
    }
    out
}

fn version_at_least(v: &str, min: &str) -> bool {
    rcni_cni::version::at_least(v, min).unwrap_or(false)
}

impl IpamConfig {
    /// `env` is CNI_ARGS for ADD and CHECK (None: not consulted).
    pub fn load(
        conf: &NetConf,
        env: Option<&CniArgs>,
        purpose: Purpose,
    ) -> Result<IpamConfig, CniError> {
        let wire: NetWire = conf.plugin_conf()?;
        let ipam = wire
            .ipam
            .ok_or_else(|| config_err("IPAM config missing 'ipam' key"))?;

        // Every source is parsed, so a malformed one is an error as in the
        // reference; only the highest-precedence non-empty one is used (the
        // reference requests the union, which turns a runtime and a kubelet
        // asking for different addresses into a failure).
        let from_env = match env {
            Some(e) => env_requested(e)?,
            None => Vec::new(),
        };
        let from_args = requested_list(
            &wire
                .args
                .as_ref()
                .and_then(|a| a.cni.as_ref())
                .and_then(|c| c.ips.clone()),
        )?;
        let runtime = wire.runtime_config.unwrap_or_default();
        let from_runtime = requested_list(&runtime.ips)?;
        let requested = dedup(
            [from_runtime, from_args, from_env]
                .into_iter()
                .find(|l| !l.is_empty())
                .unwrap_or_default(),
        );

        // Decode every address before validating any, as Go's decoder fails
        // on a bad address before LoadIPAMConfig looks at ranges.
        let legacy = range_spec(&RangeWire {
            subnet: ipam.subnet.clone(),
            range_start: ipam.range_start.clone(),
            range_end: ipam.range_end.clone(),
            gateway: ipam.gateway.clone(),
        })
        .map_err(config_err)?;
        let configured =
            range_specs(ipam.ranges.as_deref().unwrap_or_default()).map_err(config_err)?;
        let from_runtime_ranges =
            range_specs(runtime.ip_ranges.as_deref().unwrap_or_default()).map_err(config_err)?;
        let routes = ipam
            .routes
            .iter()
            .flatten()
            .map(route)
            .collect::<Result<Vec<_>, _>>()
            .map_err(config_err)?;

        // Order as in the reference: runtime ipRanges, the legacy range,
        // then `ranges` (both the legacy range and ipRanges are prepended).
        let mut specs: Vec<Vec<RangeSpec>> = Vec::new();
        specs.extend(from_runtime_ranges);
        if legacy.subnet.is_some() {
            specs.push(vec![legacy]);
        }
        specs.extend(configured);

        let mut ranges = Vec::with_capacity(specs.len());
        if specs.is_empty() && purpose == Purpose::Allocate {
            return Err(config_err("no IP ranges specified"));
        }
        for (i, set) in specs.iter().enumerate() {
            ranges.push(
                RangeSet::canonicalize(set)
                    .map_err(|e| config_err(format!("invalid range set {i}: {e}")))?,
            );
        }
        let v4 = ranges.iter().filter(|s| s.is_ipv4()).count();
        if (v4 > 1 || ranges.len() - v4 > 1) && !version_at_least(&conf.cni_version, "0.3.0") {
            return Err(config_err(format!(
                "CNI version {} does not support more than 1 address per family",
                conf.cni_version
            )));
        }
        for (i, a) in ranges.iter().enumerate() {
            for (j, b) in ranges.iter().enumerate().skip(i + 1) {
                if a.overlaps(b) {
                    return Err(config_err(format!("range set {i} overlaps with {j}")));
                }
            }
        }

        Ok(IpamConfig {
            name: conf.name.clone(),
            cni_version: conf.cni_version.clone(),
            data_dir: data_dir(ipam.data_dir.as_deref()),
            resolv_conf: ipam
                .resolv_conf
                .filter(|s| !s.is_empty())
                .map(PathBuf::from),
            routes,
            ranges,
            requested,
        })
    }
}

fn data_dir(s: Option<&str>) -> PathBuf {
    PathBuf::from(s.filter(|s| !s.is_empty()).unwrap_or(DEFAULT_DATA_DIR))
}

/// The state root for DEL and GC. Only `ipam` and its `dataDir` must be
/// valid: releasing must not depend on ranges or CNI_ARGS that may have
/// changed (or broken) since ADD.
pub fn locate(conf: &NetConf) -> Result<PathBuf, CniError> {
    let wire: LocationWire = conf.plugin_conf()?;
    let ipam = wire
        .ipam
        .ok_or_else(|| config_err("IPAM config missing 'ipam' key"))?;
    Ok(data_dir(ipam.data_dir.as_deref()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn conf(v: Value) -> NetConf {
        NetConf::parse(v.to_string().as_bytes()).unwrap()
    }

    fn load(v: Value) -> Result<IpamConfig, CniError> {
        IpamConfig::load(&conf(v), Some(&CniArgs::default()), Purpose::Allocate)
    }

    fn load_env(v: Value, env: &str) -> Result<IpamConfig, CniError> {
        IpamConfig::load(&conf(v), Some(&CniArgs::parse(env)), Purpose::Allocate)
    }

    fn err(v: Value) -> (u32, String) {
        let e = load(v).unwrap_err();
        (e.code, e.msg)
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn net(ipam: Value) -> Value {
        json!({"cniVersion": "1.0.0", "name": "mynet", "type": "bridge", "ipam": ipam})
    }

    #[test]
    fn legacy_single_range_and_defaults() {
        let c = load(net(json!({"type": "host-local", "subnet": "10.1.2.0/24"}))).unwrap();
        assert_eq!(c.name, "mynet");
        assert_eq!(c.data_dir, PathBuf::from("/var/lib/cni/networks"));
        assert_eq!(c.ranges.len(), 1);
        assert_eq!(c.ranges[0].to_string(), "10.1.2.1-10.1.2.254");
        assert!(c.resolv_conf.is_none());
        assert!(c.routes.is_empty());
        assert!(c.requested.is_empty());
    }

    #[test]
    fn keys_match_case_insensitively_like_go() {
        let c = load(net(json!({
            "Type": "host-local",
            "DATADIR": "/tmp/x",
            "Ranges": [[{"Subnet": "10.0.0.0/24", "RANGESTART": "10.0.0.10", "rangeend": "10.0.0.20", "GateWay": "10.0.0.254"}]],
            "ROUTES": [{"DST": "0.0.0.0/0", "GW": "10.0.0.254"}],
            "resolvconf": "/etc/resolv.conf"
        })))
        .unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/tmp/x"));
        let r = &c.ranges[0].0[0];
        assert_eq!(
            (r.range_start, r.range_end, r.gateway),
            (ip("10.0.0.10"), ip("10.0.0.20"), ip("10.0.0.254"))
        );
        assert_eq!(c.routes[0].gw, Some(ip("10.0.0.254")));
        assert_eq!(c.resolv_conf, Some(PathBuf::from("/etc/resolv.conf")));
    }

    #[test]
    fn range_set_order_runtime_legacy_configured() {
        let mut v = net(json!({
            "subnet": "10.0.0.0/24",
            "ranges": [[{"subnet": "10.1.0.0/24"}], [{"subnet": "2001:db8::/64"}]]
        }));
        v["runtimeConfig"] = json!({"ipRanges": [[{"subnet": "10.2.0.0/24"}]]});
        let c = load(v).unwrap();
        let firsts: Vec<String> = c.ranges.iter().map(|s| s.0[0].subnet.to_string()).collect();
        assert_eq!(
            firsts,
            ["10.2.0.0/24", "10.0.0.0/24", "10.1.0.0/24", "2001:db8::/64"]
        );
        // A legacy block without a subnet is ignored, as in Go.
        let c = load(net(
            json!({"rangeStart": "10.0.0.5", "ranges": [[{"subnet": "10.1.0.0/24"}]]}),
        ))
        .unwrap();
        assert_eq!(c.ranges.len(), 1);
    }

    #[test]
    fn validation_errors_have_reference_messages() {
        let cases = [
            (
                json!({"subnet": "10.0.0.0/31"}),
                "invalid range set 0: Network 10.0.0.0/31 too small to allocate from",
            ),
            (
                json!({"subnet": "10.0.0.1/32"}),
                "invalid range set 0: Network 10.0.0.1/32 too small to allocate from",
            ),
            (json!({}), "no IP ranges specified"),
            (json!({"ranges": []}), "no IP ranges specified"),
            (
                json!({"ranges": [[]]}),
                "invalid range set 0: empty range set",
            ),
            (
                json!({"ranges": [[{"rangeStart": "10.0.0.1"}]]}),
                "invalid range set 0: IP <nil> not v4 nor v6",
            ),
            (
                json!({"subnet": "10.0.0.0/24", "rangeStart": "10.0.1.1"}),
                "invalid range set 0: RangeStart 10.0.1.1 not in network 10.0.0.0/24",
            ),
            (
                json!({"subnet": "10.0.0.0/24", "rangeEnd": "10.0.1.1"}),
                "invalid range set 0: RangeEnd 10.0.1.1 not in network 10.0.0.0/24",
            ),
            (
                json!({"subnet": "10.0.0.1/24"}),
                "invalid range set 0: Network has host bits set. For a subnet mask of length 24 the network address is 10.0.0.0",
            ),
            (
                json!({"ranges": [[{"subnet": "10.0.0.0/24"}, {"subnet": "2001:db8::/64"}]]}),
                "invalid range set 0: mixed address families",
            ),
            (
                json!({"ranges": [[{"subnet": "10.0.0.0/24"}, {"subnet": "10.0.0.0/25"}]]}),
                "invalid range set 0: subnets 10.0.0.1-10.0.0.254 and 10.0.0.1-10.0.0.126 overlap",
            ),
            (
                json!({"ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "10.0.0.0/16"}]]}),
                "range set 0 overlaps with 1",
            ),
            (
                json!({"ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "2001:db8::/64"}], [{"subnet": "10.0.0.0/16"}]]}),
                "range set 0 overlaps with 2",
            ),
            (
                json!({"subnet": "10.0.0.0/24", "gateway": "nope"}),
                "invalid IP address: nope",
            ),
            // v1.10.0's checks, with its texts.
            (
                json!({"subnet": "10.0.0.0/24", "gateway": "169.254.1.1"}),
                "invalid range set 0: gateway 169.254.1.1 not in network 10.0.0.0/24",
            ),
            (
                json!({"ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "2001:db8::/64", "gateway": "10.0.0.1"}]]}),
                "invalid range set 1: gateway 10.0.0.1 not in network 2001:db8::/64",
            ),
            (
                json!({"subnet": "255.255.255.252/30", "rangeStart": "255.255.255.255"}),
                "invalid range set 0: RangeStart 255.255.255.255 is after RangeEnd 255.255.255.254 in network 255.255.255.252/30",
            ),
            (json!({"subnet": ""}), "invalid CIDR address: "),
            (
                json!({"subnet": "10.0.0.0"}),
                "invalid CIDR address: 10.0.0.0",
            ),
        ];
        for (ipam, want) in cases {
            assert_eq!(err(net(ipam.clone())), (7, want.to_string()), "{ipam}");
        }
        let mut v = net(json!({"subnet": "10.0.0.0/24"}));
        v.as_object_mut().unwrap().remove("ipam");
        assert_eq!(err(v), (7, "IPAM config missing 'ipam' key".into()));
        // Type errors are config errors too.
        assert_eq!(err(net(json!({"subnet": 5}))).0, 7);
        assert_eq!(
            err(net(json!({"ranges": [{"subnet": "10.0.0.0/24"}]}))).0,
            7
        );
    }

    #[test]
    fn empty_strings_are_unset() {
        let c = load(net(json!({"subnet": "10.0.0.0/24", "gateway": "", "rangeStart": "", "dataDir": "", "resolvConf": ""}))).unwrap();
        assert_eq!(c.ranges[0].0[0].gateway, ip("10.0.0.1"));
        assert_eq!(c.data_dir, PathBuf::from(DEFAULT_DATA_DIR));
        assert!(c.resolv_conf.is_none());
    }

    #[test]
    fn one_address_per_family_before_0_3_0() {
        let two_v4 = json!({"ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "10.1.0.0/24"}]]});
        let mut v = net(two_v4.clone());
        v["cniVersion"] = json!("0.2.0");
        assert_eq!(
            err(v),
            (
                7,
                "CNI version 0.2.0 does not support more than 1 address per family".into()
            )
        );
        let mut v =
            net(json!({"ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "2001:db8::/64"}]]}));
        v["cniVersion"] = json!("0.2.0");
        assert!(load(v).is_ok(), "one v4 and one v6 are fine");
        let mut v = net(two_v4);
        v["cniVersion"] = json!("0.3.0");
        assert!(load(v).is_ok());
    }

    #[test]
    fn requested_ip_sources_and_precedence() {
        let base =
            net(json!({"ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "2001:db8::/64"}]]}));
        let c = load_env(base.clone(), "IP=10.0.0.5").unwrap();
        assert_eq!(c.requested, [ip("10.0.0.5")]);
        let c = load_env(
            base.clone(),
            "IgnoreUnknown=1;K8S_POD_NAME=x;IP=10.0.0.5, 2001:db8::5/64",
        )
        .unwrap();
        assert_eq!(c.requested, [ip("10.0.0.5"), ip("2001:db8::5")]);
        let e = load_env(base.clone(), "IP=10.0.0.5;FOO=bar").unwrap_err();
        assert_eq!(e.code, 4);
        // A pair without `=` fails ADD and CHECK as the reference's
        // LoadArgs, IgnoreUnknown or not (DEL never reads CNI_ARGS).
        for bad in ["none", "IgnoreUnknown=1;IP=10.0.0.5;none"] {
            let e = load_env(base.clone(), bad).unwrap_err();
            assert_eq!(
                (e.code, e.msg.as_str()),
                (4, r#"ARGS: invalid pair "none""#)
            );
        }
        let e = load_env(base.clone(), "IP=10.0.0.500").unwrap_err();
        assert_eq!(e.code, 4);
        assert!(e.msg.contains("invalid IP address 10.0.0.500"), "{}", e.msg);

        let mut v = base.clone();
        v["args"] = json!({"cni": {"ips": ["10.0.0.6", "::ffff:10.0.0.6"]}});
        let c = load_env(v.clone(), "IP=10.0.0.5").unwrap();
        assert_eq!(
            c.requested,
            [ip("10.0.0.6")],
            "args beat CNI_ARGS; duplicates fold"
        );
        v["runtimeConfig"] = json!({"ips": ["10.0.0.7/24"]});
        let c = load_env(v.clone(), "IP=10.0.0.5").unwrap();
        assert_eq!(c.requested, [ip("10.0.0.7")], "runtimeConfig beats args");

        let mut v = base.clone();
        v["runtimeConfig"] = json!({"ips": ["bogus"]});
        assert_eq!(err(v), (7, "invalid IP address bogus".into()));
        let mut v = base;
        v["args"] = json!({"cni": {"ips": [""]}});
        assert_eq!(
            err(v),
            (7, "cannot understand ip: IP <nil> not v4 nor v6".into())
        );
    }

    #[test]
    fn routes() {
        let c = load(net(json!({
            "subnet": "10.0.0.0/24",
            "routes": [{"dst": "0.0.0.0/0"}, {"dst": "192.168.0.0/16", "gw": "10.0.0.254", "mtu": 1400}, {"dst": "::/0", "gw": ""}]
        })))
        .unwrap();
        assert_eq!(c.routes.len(), 3);
        assert_eq!(c.routes[0].gw, None);
        assert_eq!(c.routes[1].mtu, Some(1400));
        assert_eq!(c.routes[2].gw, None);
        assert_eq!(
            err(net(
                json!({"subnet": "10.0.0.0/24", "routes": [{"gw": "10.0.0.1"}]})
            ))
            .0,
            7
        );
        assert_eq!(
            err(net(
                json!({"subnet": "10.0.0.0/24", "routes": [{"dst": "10.0.0.0"}]})
            ))
            .0,
            7
        );
    }

    #[test]
    fn status_tolerates_missing_ranges_and_locate_is_lenient() {
        let v = net(json!({"dataDir": "/tmp/d"}));
        let c = IpamConfig::load(&conf(v.clone()), None, Purpose::Status).unwrap();
        assert!(c.ranges.is_empty());
        assert_eq!(locate(&conf(v)).unwrap(), PathBuf::from("/tmp/d"));
        let broken = net(json!({"subnet": "10.0.0.0/31", "ranges": "nonsense"}));
        assert_eq!(
            locate(&conf(broken)).unwrap(),
            PathBuf::from(DEFAULT_DATA_DIR)
        );
        let mut v = net(json!({}));
        v.as_object_mut().unwrap().remove("ipam");
        assert_eq!(locate(&conf(v)).unwrap_err().code, 7);
    }
}
