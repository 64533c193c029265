//! Ingress and egress rules: peers and ports for one direction.

use super::peers::{Peer, parse_peer};
use super::ports::{MAX_PORT_RANGES, PortRange, PortSpec, parse_port};
use super::{invalid, object_of};
use rcni_cni::CniError;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One ingress or egress rule: traffic with any of `peers` (all when
/// `None`) on any of `ports` (all when `None`), and on the ports `named`
/// resolves to (protocol, container port name) for the destination pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub peers: Option<Vec<Peer>>,
    pub ports: Option<Vec<PortRange>>,
    pub named: Vec<(u8, String)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Dir {
    Ingress,
    Egress,
}

impl Dir {
    pub fn as_str(self) -> &'static str {
        match self {
            Dir::Ingress => "ingress",
            Dir::Egress => "egress",
        }
    }
}

pub(super) fn parse_rules(v: &Value, who: &str, dir: Dir) -> Result<Vec<Rule>, CniError> {
    let d = dir.as_str();
    let list = v
        .as_array()
        .ok_or_else(|| invalid(who, d, "must be an array of rules"))?;
    let peers_key = match dir {
        Dir::Ingress => "from",
        Dir::Egress => "to",
    };
    let mut rules = Vec::new();
    for (i, r) in list.iter().enumerate() {
        let f = format!("{d}[{i}]");
        let m = object_of(r, who, &f, &[peers_key, "ports"])?;
        let peers = match m.get(peers_key) {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) if a.is_empty() => None,
            Some(Value::Array(a)) => Some(
                a.iter()
                    .enumerate()
                    .map(|(j, p)| parse_peer(p, who, &format!("{f}.{peers_key}[{j}]")))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            Some(_) => {
                return Err(invalid(
                    who,
                    &format!("{f}.{peers_key}"),
                    "must be an array",
                ));
            }
        };
        let mut named = Vec::new();
        let ports = match m.get("ports") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) if a.is_empty() => None,
            Some(Value::Array(a)) => {
                let v = a
                    .iter()
                    .enumerate()
                    .map(|(j, p)| parse_port(p, who, &format!("{f}.ports[{j}]")))
                    .collect::<Result<Vec<_>, _>>()?;
                if v.len() > MAX_PORT_RANGES {
                    return Err(invalid(
                        who,
                        &format!("{f}.ports"),
                        &format!(
                            "{} entries, more than the {MAX_PORT_RANGES} supported",
                            v.len()
                        ),
                    ));
                }
                let mut ranges = Vec::new();
                for p in v {
                    match p {
                        PortSpec::Range(r) => ranges.push(r),
                        PortSpec::Named(proto, n) => named.push((proto, n)),
                    }
                }
                Some(ranges)
            }
            Some(_) => return Err(invalid(who, &format!("{f}.ports"), "must be an array")),
        };
        rules.push(Rule {
            peers,
            ports,
            named,
        });
    }
    Ok(rules)
}
