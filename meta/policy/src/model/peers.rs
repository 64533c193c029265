//! A rule's peers: pods by selector, or address blocks.

use super::labels::{Selector, parse_selector};
use super::{invalid, object_of};
use ipnetwork::IpNetwork;
use rcni_cni::CniError;
use serde_json::Value;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpBlock {
    pub cidr: IpNetwork,
    pub except: Vec<IpNetwork>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// Pods matching `pods` in namespaces matching `namespaces`; `None`
    /// for `namespaces` means the policy's own namespace.
    Pods {
        pods: Selector,
        namespaces: Option<Selector>,
    },
    Block(IpBlock),
}

pub(super) fn parse_peer(v: &Value, who: &str, field: &str) -> Result<Peer, CniError> {
    let m = object_of(
        v,
        who,
        field,
        &["podSelector", "namespaceSelector", "ipBlock"],
    )?;
    let get = |k: &str| m.get(k).filter(|v| !v.is_null());
    match (get("podSelector"), get("namespaceSelector"), get("ipBlock")) {
        (None, None, Some(b)) => Ok(Peer::Block(parse_ip_block(
            b,
            who,
            &format!("{field}.ipBlock"),
        )?)),
        (_, _, Some(_)) => Err(invalid(
            who,
            &format!("{field}.ipBlock"),
            "cannot be combined with podSelector or namespaceSelector in one peer",
        )),
        (None, None, None) => Err(invalid(
            who,
            field,
            "a peer needs podSelector, namespaceSelector or ipBlock",
        )),
        (p, n, None) => Ok(Peer::Pods {
            pods: match p {
                Some(p) => parse_selector(p, who, &format!("{field}.podSelector"))?,
                None => Selector::default(),
            },
            namespaces: match n {
                Some(n) => Some(parse_selector(
                    n,
                    who,
                    &format!("{field}.namespaceSelector"),
                )?),
                None => None,
            },
        }),
    }
}

fn parse_cidr(s: &str, who: &str, field: &str) -> Result<IpNetwork, CniError> {
    let n: IpNetwork = s
        .parse()
        .map_err(|_| invalid(who, field, &format!("{s:?} is not a CIDR")))?;
    if !s.contains('/') {
        return Err(invalid(who, field, &format!("{s:?} has no prefix length")));
    }
    // The network address: Go's ParseCIDR masks the host bits as well.
    IpNetwork::new(n.network(), n.prefix())
        .map_err(|_| invalid(who, field, &format!("{s:?} is not a CIDR")))
}

fn contains_net(outer: &IpNetwork, inner: &IpNetwork) -> bool {
    outer.is_ipv4() == inner.is_ipv4()
        && outer.prefix() <= inner.prefix()
        && outer.contains(inner.network())
}

fn parse_ip_block(v: &Value, who: &str, field: &str) -> Result<IpBlock, CniError> {
    let m = object_of(v, who, field, &["cidr", "except"])?;
    let cidr = m
        .get("cidr")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid(who, &format!("{field}.cidr"), "missing"))?;
    let cidr = parse_cidr(cidr, who, &format!("{field}.cidr"))?;
    let mut except = Vec::new();
    match m.get("except") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) => {
            for (i, e) in a.iter().enumerate() {
                let f = format!("{field}.except[{i}]");
                let s = e
                    .as_str()
                    .ok_or_else(|| invalid(who, &f, "must be a CIDR string"))?;
                let n = parse_cidr(s, who, &f)?;
                // Kubernetes: each except must lie strictly inside cidr.
                if !contains_net(&cidr, &n) || n.prefix() == cidr.prefix() {
                    return Err(invalid(who, &f, &format!("{s} is not inside {cidr}")));
                }
                except.push(n);
            }
        }
        Some(_) => return Err(invalid(who, &format!("{field}.except"), "must be an array")),
    }
    Ok(IpBlock { cidr, except })
}
