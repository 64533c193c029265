//! Policy routing rules (`ip rule`): the ones sbr makes, a source prefix
//! looked up in a table.

use futures::TryStreamExt;
use ipnetwork::IpNetwork;
use rtnetlink::IpVersion;
use rtnetlink::packet_core::{NLM_F_CREATE, NLM_F_EXCL};
use rtnetlink::packet_route::route::RouteHeader;
use rtnetlink::packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};

use crate::{Error, Family, Netlink, Result};

/// A rule sending what matches to a table. Fields the kernel reports but
/// this type does not name (marks, interfaces, ...) are left out of
/// listings' matching and deletions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// IPv6 when true.
    pub v6: bool,
    /// `from PREFIX`; `None` is `from all`.
    pub src: Option<IpNetwork>,
    /// `to PREFIX`; `None` is `to all`.
    pub dst: Option<IpNetwork>,
    pub table: u32,
    /// `None` on creation lets the kernel pick (just above the first rule
    /// after `local`, as `ip rule add` without `pref`).
    pub priority: Option<u32>,
    /// Any match besides the source (fwmark, iif, ...): such a rule is
    /// listed but is never one [`Rule`] describes fully.
    pub other_matches: bool,
}

impl Rule {
    /// `from src lookup table`, priority left to the kernel.
    pub fn from_src(src: IpNetwork, table: u32) -> Rule {
        Rule {
            v6: src.is_ipv6(),
            src: Some(src),
            dst: None,
            table,
            priority: None,
            other_matches: false,
        }
    }

    /// `to dst lookup table`, priority left to the kernel.
    pub fn to_dst(dst: IpNetwork, table: u32) -> Rule {
        Rule {
            v6: dst.is_ipv6(),
            src: None,
            dst: Some(dst),
            table,
            priority: None,
            other_matches: false,
        }
    }

    pub fn priority(mut self, p: u32) -> Rule {
        self.priority = Some(p);
        self
    }
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(p) = self.priority {
            write!(f, "{p}: ")?;
        }
        match self.src {
            Some(s) => write!(f, "from {s}")?,
            None => write!(f, "from all")?,
        }
        if let Some(d) = self.dst {
            write!(f, " to {d}")?;
        }
        write!(f, " lookup {}", self.table)
    }
}

fn message(rule: &Rule) -> RuleMessage {
    let mut msg = RuleMessage::default();
    msg.header.family = if rule.v6 {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    };
    msg.header.action = RuleAction::ToTable;
    if rule.table < 256 {
        msg.header.table = rule.table as u8;
    } else {
        msg.header.table = RouteHeader::RT_TABLE_UNSPEC;
        msg.attributes.push(RuleAttribute::Table(rule.table));
    }
    if let Some(src) = rule.src {
        msg.header.src_len = src.prefix();
        msg.attributes.push(RuleAttribute::Source(src.ip()));
    }
    if let Some(dst) = rule.dst {
        msg.header.dst_len = dst.prefix();
        msg.attributes.push(RuleAttribute::Destination(dst.ip()));
    }
    if let Some(p) = rule.priority {
        msg.attributes.push(RuleAttribute::Priority(p));
    }
    msg
}

fn parse(m: &RuleMessage) -> Option<Rule> {
    let v6 = match m.header.family {
        AddressFamily::Inet => false,
        AddressFamily::Inet6 => true,
        _ => return None,
    };
    let mut rule = Rule {
        v6,
        src: None,
        dst: None,
        table: u32::from(m.header.table),
        priority: Some(0),
        other_matches: m.header.tos > 0,
    };
    for a in &m.attributes {
        match a {
            RuleAttribute::Source(ip) => {
                rule.src = IpNetwork::new(*ip, m.header.src_len).ok();
            }
            RuleAttribute::Destination(ip) => {
                rule.dst = IpNetwork::new(*ip, m.header.dst_len).ok();
            }
            RuleAttribute::Table(t) => rule.table = *t,
            RuleAttribute::Priority(p) => rule.priority = Some(*p),
            RuleAttribute::Iifname(_)
            | RuleAttribute::Oifname(_)
            | RuleAttribute::FwMark(_)
            | RuleAttribute::UidRange(_)
            | RuleAttribute::IpProtocol(_)
            | RuleAttribute::SourcePortRange(_)
            | RuleAttribute::DestinationPortRange(_)
            | RuleAttribute::L3MDev(_) => rule.other_matches = true,
            _ => {}
        }
    }
    // Only rules that look a table up are ours to describe.
    (m.header.action == RuleAction::ToTable).then_some(rule)
}

impl Netlink {
    /// The rules of `family` that look a table up, in the kernel's order.
    pub async fn rules(&self, family: Family) -> Result<Vec<Rule>> {
        let mut out = Vec::new();
        for (f, v) in [(Family::V4, IpVersion::V4), (Family::V6, IpVersion::V6)] {
            if family != Family::All && family != f {
                continue;
            }
            let msgs: Vec<RuleMessage> = self
                .handle
                .rule()
                .get(v)
                .execute()
                .try_collect()
                .await
                .map_err(|e| Error::netlink("list rules", e))?;
            out.extend(msgs.iter().filter_map(parse));
        }
        Ok(out)
    }

    /// Adds `rule`; an identical one is an error with `is_exists()`.
    pub async fn add_rule(&self, rule: &Rule) -> Result<()> {
        self.acked_request(
            &format!("add rule {rule}"),
            RouteNetlinkMessage::NewRule(message(rule)),
            NLM_F_CREATE | NLM_F_EXCL,
        )
        .await
    }

    /// Deletes the rule matching `rule`'s source, destination, table and
    /// (when set) priority; a missing one is an error with `is_not_found()`.
    pub async fn del_rule(&self, rule: &Rule) -> Result<()> {
        self.acked_request(
            &format!("delete rule {rule}"),
            RouteNetlinkMessage::DelRule(message(rule)),
            0,
        )
        .await
    }
}
