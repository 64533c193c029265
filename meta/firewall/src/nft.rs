//! The native nftables backend (the reference has none; upstream's PR #462
//! was closed). Layout:
//!
//! ```text
//! table inet cni_firewall {
//!     chain forward { type filter hook forward priority filter;
//!         jump isolation_stage1
//!         jump CNI-ADMIN            # iptablesAdminChainName: the operator's rules
//!         jump containers }
//!     chain CNI-ADMIN { }
//!     chain containers {
//!         ip daddr 10.88.0.5 ct state established,related accept comment "<attachment>"
//!         ip saddr 10.88.0.5 accept comment "<attachment>" }
//!     chain isolation_stage1 { iifname "cni0" oifname != "cni0" jump isolation_stage2 comment "bridge cni0 same-bridge" }
//!     chain isolation_stage2 { oifname "cni0" drop comment "bridge cni0 same-bridge" }
//! }
//! table bridge cni_firewall {            # ingressPolicy isolated
//!     chain forward { type filter hook forward priority filter;
//!         iifname "veth1" drop comment "<attachment>"
//!         oifname "veth1" drop comment "<attachment>" }
//! }
//! ```
//!
//! The accept rules mirror the iptables backend; they only decide anything
//! once an operator sets `policy drop` on the forward chain (ADD never
//! resets a policy). A drop in `CNI-ADMIN` is final for the whole node.
//!
//! Each attachment's comment starts with its instance hash (network,
//! ifname, container) and names its bridge and policy, so DEL and GC find
//! its rules without prevResult, and the shared same-bridge rules of a
//! bridge go with the last attachment that needed them (the reference's
//! iptables isolation rules are never removed). `isolated` drops bridged
//! frames to and from the pod's host-side port in a `bridge` table, which
//! works without `br_netfilter`.
//!
//! Every call is nfnetlink only, without a process: ADD one transaction,
//! DEL, CHECK and GC read and delete by comment.

use crate::conf::{Conf, IngressPolicy};
use ipnetwork::IpNetwork;
use rcni_cni::CniError;
use rcni_netfilter::expr::{self, Expr};
use rcni_netfilter::nfnl::{Hook, Nfnl, NftFamily, NftOp, NftRule};
use std::collections::BTreeSet;

pub const TABLE: &str = "cni_firewall";
pub const CONTAINERS: &str = "containers";
pub const STAGE1: &str = "isolation_stage1";
pub const STAGE2: &str = "isolation_stage2";
const COMMENT_MAX: usize = 128;

/// One attachment.
#[derive(Debug, Clone)]
pub struct Attachment<'a> {
    pub network: &'a str,
    pub ifname: &'a str,
    pub container_id: &'a str,
    /// The bridge of an ingress policy ("-" for open).
    pub bridge: Option<String>,
    pub policy: IngressPolicy,
    /// The pod's port on the bridge, for `isolated`.
    pub host_port: Option<&'a str>,
}

impl Attachment<'_> {
    fn instance(&self) -> String {
        rcni_netfilter::nft_instance_hash(self.network, self.ifname, self.container_id)
    }

    /// `<instance> <bridge> <policy>, net: <net>, if: <if>, id: <cid>`,
    /// cut to nft's 128 bytes (the first three fields always fit).
    pub fn comment(&self) -> String {
        let mut c = format!(
            "{} {} {}, net: {}, if: {}, id: {}",
            self.instance(),
            self.bridge.as_deref().unwrap_or("-"),
            self.policy.as_str(),
            self.network,
            self.ifname,
            self.container_id
        );
        c.truncate(COMMENT_MAX);
        c
    }
}

/// `(instance, bridge, policy)` of an attachment comment.
pub fn parse_comment(c: &str) -> Option<(&str, &str, IngressPolicy)> {
    let head = c.split(',').next()?;
    let mut words = head.split(' ');
    let (inst, bridge, policy) = (words.next()?, words.next()?, words.next()?);
    // `<16 hex>-<16 hex>`, as nft_instance_hash makes it.
    let hex = |h: &str| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit());
    let (a, b) = inst.split_once('-')?;
    if !(hex(a) && hex(b)) {
        return None;
    }
    Some((inst, bridge, IngressPolicy::parse(policy)?))
}

fn bridge_comment(bridge: &str) -> String {
    format!("bridge {bridge} same-bridge")
}

/// The ADD transaction. `stale` are `(family, chain, handle)` of rules to
/// replace: the attachment's own, and the bridge's same-bridge rules
/// (re-added, so a concurrent DEL that removes them makes this
/// transaction fail and retry instead of losing them).
pub fn setup_ops(
    conf: &Conf,
    a: &Attachment,
    ips: &[IpNetwork],
    stale: &[(NftFamily, String, u64)],
) -> Vec<NftOp> {
    let inet = NftFamily::Inet;
    let admin = conf.admin_chain.as_str();
    let chain = |family, name: &str, hook: Option<Hook>| NftOp::AddChain {
        family,
        table: TABLE.into(),
        chain: name.into(),
        hook,
        comment: None,
    };
    let rule = |family, chain: &str, expr: Vec<Expr>, comment: Option<&str>| NftOp::AddRule {
        family,
        table: TABLE.into(),
        chain: chain.into(),
        expr,
        comment: comment.map(String::from),
        insert: false,
    };
    let forward = |priority| {
        Some(Hook {
            kind: "filter",
            hook: Hook::FORWARD,
            priority,
        })
    };
    let mut ops = vec![
        NftOp::AddTable {
            family: inet,
            table: TABLE.into(),
            comment: Some("CNI firewall plugin rules".into()),
        },
        chain(inet, "forward", forward(0)),
        chain(inet, admin, None),
        chain(inet, CONTAINERS, None),
        chain(inet, STAGE1, None),
        chain(inet, STAGE2, None),
        NftOp::FlushChain {
            family: inet,
            table: TABLE.into(),
            chain: "forward".into(),
        },
        rule(inet, "forward", expr::jump(STAGE1), None),
        rule(inet, "forward", expr::jump(admin), None),
        rule(inet, "forward", expr::jump(CONTAINERS), None),
    ];
    if a.policy == IngressPolicy::Isolated {
        let bridge = NftFamily::Bridge;
        ops.push(NftOp::AddTable {
            family: bridge,
            table: TABLE.into(),
            comment: None,
        });
        ops.push(chain(bridge, "forward", forward(-200)));
    }
    ops.extend(
        stale
            .iter()
            .map(|(family, chain, handle)| NftOp::DeleteRule {
                family: *family,
                table: TABLE.into(),
                chain: chain.clone(),
                handle: *handle,
            }),
    );
    let c = a.comment();
    for ip in ips {
        let v6 = ip.is_ipv6();
        let host = IpNetwork::from(ip.ip());
        let inbound = [
            expr::nfproto(v6),
            expr::addr(false, host),
            expr::ct_established(),
            expr::accept(),
        ]
        .concat();
        ops.push(rule(inet, CONTAINERS, inbound, Some(&c)));
        let outbound = [expr::nfproto(v6), expr::addr(true, host), expr::accept()].concat();
        ops.push(rule(inet, CONTAINERS, outbound, Some(&c)));
    }
    if let Some(b) = a.bridge.as_deref()
        && a.policy != IngressPolicy::Open
    {
        let bc = bridge_comment(b);
        let stage1 = [
            expr::ifname(true, b, true),
            expr::ifname(false, b, false),
            expr::jump(STAGE2),
        ]
        .concat();
        ops.push(rule(inet, STAGE1, stage1, Some(&bc)));
        let stage2 = [expr::ifname(false, b, true), expr::drop()].concat();
        ops.push(rule(inet, STAGE2, stage2, Some(&bc)));
    }
    if a.policy == IngressPolicy::Isolated
        && let Some(port) = a.host_port
    {
        for input in [true, false] {
            let e = [expr::ifname(input, port, true), expr::drop()].concat();
            ops.push(rule(NftFamily::Bridge, "forward", e, Some(&c)));
        }
    }
    ops
}

fn tables() -> [(NftFamily, &'static str); 2] {
    [(NftFamily::Inet, TABLE), (NftFamily::Bridge, TABLE)]
}

/// Every rule of both tables.
fn all_rules(nl: &mut Nfnl) -> Result<Vec<(NftFamily, NftRule)>, CniError> {
    let mut out = Vec::new();
    for (f, t) in tables() {
        out.extend(
            nl.nft_rules(f, t)?
                .unwrap_or_default()
                .into_iter()
                .map(|r| (f, r)),
        );
    }
    Ok(out)
}

fn owned_by(r: &NftRule, instance: &str) -> bool {
    r.comment
        .as_deref()
        .is_some_and(|c| c.starts_with(instance))
}

pub fn setup(
    nl: &mut Nfnl,
    conf: &Conf,
    a: &Attachment,
    ips: &[IpNetwork],
) -> Result<(), CniError> {
    let inst = a.instance();
    let bc = a.bridge.as_deref().map(bridge_comment);
    let mut last = None;
    for _ in 0..2 {
        let stale: Vec<(NftFamily, String, u64)> = all_rules(nl)?
            .into_iter()
            .filter(|(_, r)| {
                owned_by(r, &inst)
                    || (a.policy != IngressPolicy::Open && bc.is_some() && r.comment == bc)
            })
            .map(|(f, r)| (f, r.chain, r.handle))
            .collect();
        match nl.nft_apply(&setup_ops(conf, a, ips, &stale)) {
            Ok(()) => return Ok(()),
            Err(e) => {
                last = Some(CniError::from(e).context("unable to set up nftables firewall rules"))
            }
        }
    }
    Err(last.expect("one attempt at least"))
}

/// Deletes the rules of the attachments `doomed` selects (by comment), and
/// the same-bridge rules of bridges no remaining attachment needs.
fn remove(nl: &mut Nfnl, doomed: &dyn Fn(&str) -> bool) -> Result<(), CniError> {
    let rules = all_rules(nl)?;
    let attachments = |want_doomed: bool| -> BTreeSet<(String, IngressPolicy)> {
        rules
            .iter()
            .filter(|(_, r)| r.chain == CONTAINERS)
            .filter_map(|(_, r)| r.comment.as_deref())
            .filter(|c| doomed(c) == want_doomed)
            .filter_map(parse_comment)
            .map(|(_, b, p)| (b.to_string(), p))
            .collect()
    };
    let leaving = attachments(true);
    let staying = attachments(false);
    let unneeded: BTreeSet<String> = leaving
        .iter()
        .filter(|(_, p)| *p != IngressPolicy::Open)
        .map(|(b, _)| b.clone())
        .filter(|b| {
            !staying
                .iter()
                .any(|(sb, p)| sb == b && *p != IngressPolicy::Open)
        })
        .map(|b| bridge_comment(&b))
        .collect();
    nl.nft_delete_rules_where(&tables(), &|_, r| match r.comment.as_deref() {
        Some(c) => doomed(c) || unneeded.contains(c),
        None => false,
    })?;
    Ok(())
}

pub fn teardown(nl: &mut Nfnl, a: &Attachment) -> Result<(), CniError> {
    let inst = a.instance();
    remove(nl, &|c| c.starts_with(&inst))
}

/// Removes the attachments of `network` not in `valid`.
pub fn gc(nl: &mut Nfnl, network: &str, valid: &[(String, String)]) -> Result<(), CniError> {
    let prefix = format!("{}-", rcni_netfilter::nft_network_hash(network));
    let keep: BTreeSet<String> = valid
        .iter()
        .map(|(cid, ifname)| rcni_netfilter::nft_instance_hash(network, ifname, cid))
        .collect();
    remove(nl, &|c| {
        c.starts_with(&prefix) && parse_comment(c).is_some_and(|(inst, _, _)| !keep.contains(inst))
    })
}

/// What CHECK finds missing.
pub fn problems(
    nl: &mut Nfnl,
    conf: &Conf,
    a: &Attachment,
    ips: &[IpNetwork],
) -> Result<Vec<String>, CniError> {
    let mut out = Vec::new();
    let Some(chains) = nl.nft_chains(NftFamily::Inet, TABLE)? else {
        return Ok(vec![format!("table inet {TABLE} does not exist")]);
    };
    for c in ["forward", conf.admin_chain.as_str(), CONTAINERS] {
        if !chains.iter().any(|ch| ch.name == c) {
            out.push(format!("chain inet {TABLE} {c} does not exist"));
        }
    }
    let rules = all_rules(nl)?;
    let comment = a.comment();
    let count = |fam: NftFamily, chain: &str, comment: &str| {
        rules
            .iter()
            .filter(|(f, r)| *f == fam && r.chain == chain && r.comment.as_deref() == Some(comment))
            .count()
    };
    let have = count(NftFamily::Inet, CONTAINERS, &comment);
    if have < 2 * ips.len() {
        out.push(format!(
            "missing rules in inet {TABLE} {CONTAINERS}: {have} of {}",
            2 * ips.len()
        ));
    }
    if let Some(b) = a.bridge.as_deref()
        && a.policy != IngressPolicy::Open
    {
        let bc = bridge_comment(b);
        if count(NftFamily::Inet, STAGE1, &bc) == 0 || count(NftFamily::Inet, STAGE2, &bc) == 0 {
            out.push(format!("missing ingress policy rules for bridge {b}"));
        }
    }
    if a.policy == IngressPolicy::Isolated && count(NftFamily::Bridge, "forward", &comment) < 2 {
        out.push(format!("missing isolation rules in bridge {TABLE} forward"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcni_cni::skel::CmdArgs;
    use serde_json::json;

    fn att(policy: IngressPolicy) -> Attachment<'static> {
        Attachment {
            network: "mynet",
            ifname: "eth0",
            container_id: "ctr1",
            bridge: Some("cni0".into()),
            policy,
            host_port: Some("veth1"),
        }
    }

    #[test]
    fn comments_round_trip() {
        let a = att(IngressPolicy::SameBridge);
        let c = a.comment();
        let (inst, b, p) = parse_comment(&c).unwrap();
        assert_eq!(
            (inst, b, p),
            (a.instance().as_str(), "cni0", IngressPolicy::SameBridge)
        );
        let long = Attachment {
            container_id: "c".repeat(300).leak(),
            ..att(IngressPolicy::Open)
        };
        assert_eq!(long.comment().len(), 128);
        assert!(parse_comment(&long.comment()).is_some());
        assert_eq!(parse_comment("bridge cni0 same-bridge"), None);
    }

    #[test]
    fn add_transaction() {
        let v = json!({"cniVersion": "1.0.0", "name": "mynet", "type": "firewall", "ingressPolicy": "isolated"});
        let conf = Conf::load(&CmdArgs::for_conf(&v).unwrap()).unwrap();
        let ips: Vec<IpNetwork> = vec![
            "10.88.0.5/24".parse().unwrap(),
            "fd88::5/64".parse().unwrap(),
        ];
        let a = att(IngressPolicy::Isolated);
        let ops = setup_ops(
            &conf,
            &a,
            &ips,
            &[(NftFamily::Inet, "containers".into(), 9)],
        );
        let rules = |chain: &str, family: NftFamily| {
            ops.iter()
                .filter(|o| matches!(o, NftOp::AddRule { chain: c, family: f, .. } if c == chain && *f == family))
                .count()
        };
        assert_eq!(rules(CONTAINERS, NftFamily::Inet), 4);
        assert_eq!(rules("forward", NftFamily::Inet), 3);
        assert_eq!(
            (
                rules(STAGE1, NftFamily::Inet),
                rules(STAGE2, NftFamily::Inet)
            ),
            (1, 1)
        );
        assert_eq!(rules("forward", NftFamily::Bridge), 2);
        assert!(ops.contains(&NftOp::DeleteRule {
            family: NftFamily::Inet,
            table: TABLE.into(),
            chain: "containers".into(),
            handle: 9
        }));
        let open = setup_ops(&conf, &att(IngressPolicy::Open), &ips, &[]);
        assert!(!open.iter().any(|o| matches!(
            o,
            NftOp::AddTable {
                family: NftFamily::Bridge,
                ..
            }
        )));
    }
}
