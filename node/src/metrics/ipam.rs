//! host-local's address use, read as the plugin leaves it: the ranges from
//! the networks' configs in the CNI conf dir, the reservations from the
//! files named by address in `<dataDir>/<network>/` (each holding the
//! container id and interface).

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use ipnetwork::IpNetwork;
use serde_json::Value;

/// host-local's default dataDir.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/cni/networks";

/// One host-local range of a network, with its use.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RangeUse {
    pub network: String,
    /// The subnet, or `start-end` when the config narrows it.
    pub range: String,
    pub used: u64,
    /// Addresses left to hand out (the gateway is never handed out).
    pub free: f64,
}

/// A reserved address and who holds it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Reservation {
    pub network: String,
    pub ip: IpAddr,
    #[serde(rename = "containerId")]
    pub container_id: String,
    pub ifname: String,
}

/// A range as host-local canonicalizes it: start network+1, end the last
/// address (minus the IPv4 broadcast), gateway network+1, unless given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Range {
    pub subnet: IpNetwork,
    pub start: IpAddr,
    pub end: IpAddr,
    pub gateway: IpAddr,
    pub narrowed: bool,
}

fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u32::from(a).into(),
        IpAddr::V6(a) => a.into(),
    }
}

fn from_u128(n: u128, v4: bool) -> IpAddr {
    if v4 {
        IpAddr::V4((n as u32).into())
    } else {
        IpAddr::V6(n.into())
    }
}

impl Range {
    pub fn parse(r: &Value) -> Option<Range> {
        let subnet: IpNetwork = r.get("subnet")?.as_str()?.parse().ok()?;
        let v4 = subnet.is_ipv4();
        let net = to_u128(subnet.network());
        let ip = |k: &str| -> Option<IpAddr> {
            r.get(k)?.as_str().filter(|s| !s.is_empty())?.parse().ok()
        };
        let first = from_u128(net + 1, v4);
        let last = to_u128(subnet.broadcast());
        let start = ip("rangeStart");
        let end = ip("rangeEnd");
        Some(Range {
            subnet,
            start: start.unwrap_or(first),
            end: end.unwrap_or_else(|| from_u128(if v4 { last - 1 } else { last }, v4)),
            gateway: ip("gateway").unwrap_or(first),
            narrowed: start.is_some() || end.is_some(),
        })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        ip.is_ipv4() == self.subnet.is_ipv4()
            && (to_u128(self.start)..=to_u128(self.end)).contains(&to_u128(ip))
    }

    /// Addresses host-local can hand out from this range.
    pub fn size(&self) -> f64 {
        let (s, e) = (to_u128(self.start), to_u128(self.end));
        if e < s {
            return 0.0;
        }
        let n = (e - s) as f64 + 1.0;
        if self.contains(self.gateway) {
            n - 1.0
        } else {
            n
        }
    }

    pub fn label(&self) -> String {
        if self.narrowed {
            format!("{}-{}", self.start, self.end)
        } else {
            self.subnet.to_string()
        }
    }
}

/// The host-local networks of one config (a conflist or a single
/// config): (network name, dataDir, ranges).
pub fn host_local_of(conf: &Value) -> Option<(String, PathBuf, Vec<Range>)> {
    let name = conf.get("name")?.as_str()?.to_string();
    let plugins: Vec<&Value> = match conf.get("plugins").and_then(Value::as_array) {
        Some(list) => list.iter().collect(),
        None => vec![conf],
    };
    for p in plugins {
        let Some(ipam) = p.get("ipam") else { continue };
        if ipam.get("type").and_then(Value::as_str) != Some("host-local") {
            continue;
        }
        let data_dir = ipam
            .get("dataDir")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .unwrap_or(DEFAULT_DATA_DIR);
        let mut ranges = Vec::new();
        match ipam.get("ranges").and_then(Value::as_array) {
            Some(sets) => {
                for set in sets {
                    for r in set.as_array().into_iter().flatten() {
                        ranges.extend(Range::parse(r));
                    }
                }
            }
            // The old form: one range in the ipam section itself.
            None => ranges.extend(Range::parse(ipam)),
        }
        return Some((name, PathBuf::from(data_dir), ranges));
    }
    None
}

/// The reservations under `dir` (`<dataDir>/<network>`): files named by
/// address, holding the container id and the interface name.
pub fn reservations(network: &str, dir: &Path) -> Vec<Reservation> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<Reservation> = rd
        .flatten()
        .filter_map(|e| {
            let ip: IpAddr = e.file_name().to_str()?.parse().ok()?;
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            let mut lines = text.lines();
            Some(Reservation {
                network: network.to_string(),
                ip,
                container_id: lines.next().unwrap_or_default().trim().to_string(),
                ifname: lines.next().unwrap_or_default().trim().to_string(),
            })
        })
        .collect();
    v.sort_by_key(|r| (r.ip.is_ipv6(), to_u128(r.ip)));
    v
}

/// Every host-local network configured in `conf_dir` (`*.conflist`,
/// `*.conf`, `*.json`), each read once even when several files name it.
pub fn networks(conf_dir: &Path) -> Vec<(String, PathBuf, Vec<Range>)> {
    let Ok(rd) = std::fs::read_dir(conf_dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("conflist" | "conf" | "json")
            )
        })
        .collect();
    files.sort();
    let mut out: Vec<(String, PathBuf, Vec<Range>)> = Vec::new();
    for f in files {
        let Ok(text) = std::fs::read(&f) else {
            continue;
        };
        let Ok(v) = serde_json::from_slice::<Value>(&text) else {
            continue;
        };
        if let Some(n) = host_local_of(&v)
            && !out.iter().any(|o| o.0 == n.0)
        {
            out.push(n);
        }
    }
    out
}

/// Use of every range of the host-local networks in `conf_dir`, and who
/// holds the addresses.
pub fn usage(conf_dir: &Path) -> (Vec<RangeUse>, Vec<Reservation>) {
    let mut uses = Vec::new();
    let mut held = Vec::new();
    for (name, data_dir, ranges) in networks(conf_dir) {
        let res = reservations(&name, &data_dir.join(&name));
        for r in &ranges {
            let used = res
                .iter()
                .filter(|x| r.contains(x.ip) && x.ip != r.gateway)
                .count() as u64;
            uses.push(RangeUse {
                network: name.clone(),
                range: r.label(),
                used,
                free: (r.size() - used as f64).max(0.0),
            });
        }
        held.extend(res);
    }
    (uses, held)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ranges_default_as_host_local_does() {
        let r = Range::parse(&json!({"subnet": "10.244.1.0/24"})).unwrap();
        assert_eq!(r.start.to_string(), "10.244.1.1");
        assert_eq!(r.end.to_string(), "10.244.1.254");
        // .1 is the gateway: .2 to .254.
        assert_eq!(r.size(), 253.0);
        assert_eq!(r.label(), "10.244.1.0/24");
        let r = Range::parse(&json!({"subnet": "10.0.0.0/24", "rangeStart": "10.0.0.10",
                                     "rangeEnd": "10.0.0.19", "gateway": "10.0.0.1"}))
        .unwrap();
        assert_eq!(r.size(), 10.0);
        assert_eq!(r.label(), "10.0.0.10-10.0.0.19");
        let r = Range::parse(&json!({"subnet": "fd00:0:0:1::/64"})).unwrap();
        assert_eq!(r.size(), 2f64.powi(64) - 2.0);
        assert!(Range::parse(&json!({"subnet": "nope"})).is_none());
    }

    #[test]
    fn usage_counts_the_files_host_local_leaves() {
        let d = tempfile::tempdir().unwrap();
        let conf = d.path().join("net.d");
        let data = d.path().join("ipam");
        std::fs::create_dir_all(&conf).unwrap();
        let list = json!({"cniVersion": "1.0.0", "name": "rcni", "plugins": [
            {"type": "bridge", "ipam": {"type": "host-local", "dataDir": data,
                "ranges": [[{"subnet": "10.244.1.0/24"}], [{"subnet": "fd00:0:0:1::/64"}]]}},
            {"type": "portmap"}]});
        std::fs::write(conf.join("10-rcni.conflist"), list.to_string()).unwrap();
        std::fs::write(conf.join("junk.conf"), "not json").unwrap();
        let net = data.join("rcni");
        std::fs::create_dir_all(&net).unwrap();
        std::fs::write(net.join("10.244.1.2"), "c1\neth0").unwrap();
        std::fs::write(net.join("10.244.1.3"), "c2\r\neth0").unwrap();
        std::fs::write(net.join("fd00:0:0:1::2"), "c1\neth0").unwrap();
        std::fs::write(net.join("lock"), "").unwrap();
        std::fs::write(net.join("last_reserved_ip.0"), "10.244.1.3").unwrap();
        let (uses, held) = usage(&conf);
        assert_eq!(uses.len(), 2);
        assert_eq!(
            (uses[0].range.as_str(), uses[0].used, uses[0].free),
            ("10.244.1.0/24", 2, 251.0)
        );
        assert_eq!(uses[1].used, 1);
        assert_eq!(held.len(), 3);
        assert_eq!(held[1].container_id, "c2");
        assert_eq!(held[1].ifname, "eth0");
        // The legacy single-range form, and a config without host-local.
        let one = json!({"name": "old", "type": "bridge",
                         "ipam": {"type": "host-local", "subnet": "10.1.0.0/16"}});
        let (name, dir, ranges) = host_local_of(&one).unwrap();
        assert_eq!((name.as_str(), ranges.len()), ("old", 1));
        assert_eq!(dir, PathBuf::from(DEFAULT_DATA_DIR));
        assert!(
            host_local_of(&json!({"name": "x", "type": "ptp", "ipam": {"type": "dhcp"}})).is_none()
        );
        assert!(usage(&d.path().join("none")).0.is_empty());
    }
}
