//! Masquerade of pod traffic that leaves the cluster network, in an
//! nftables table of the agent's own (`ip rcni_node`), written over
//! nfnetlink with the expression builders the meta plugins use. The
//! per-attachment rules of `ipMasq` (crates/netfilter) do not fit: this is one
//! rule per node, and it must not depend on pods coming and going.

use ipnetwork::{IpNetwork, Ipv4Network, Ipv6Network};
use rcni_netfilter::expr;
use rcni_netfilter::nfnl::{Hook, Nfnl, NftFamily, NftOp};
use rcni_netns::NetNs;

pub const TABLE: &str = "rcni_node";
const CHAIN: &str = "postrouting";

/// The rules' comments: they name what the rules do, so an unchanged table
/// is recognised and left alone (no flush on restart).
fn comments(pod_cidr: IpNetwork, keep: &[IpNetwork]) -> Vec<String> {
    let mut v: Vec<String> = keep
        .iter()
        .map(|n| format!("rcni-node: {pod_cidr} to {n} keeps its source"))
        .collect();
    let all: Vec<String> = keep.iter().map(|n| n.to_string()).collect();
    v.push(format!(
        "rcni-node: {pod_cidr} leaving {} masqueraded",
        all.join(", ")
    ));
    v
}

/// Makes the table hold exactly
/// `ip saddr <pod_cidr> ip daddr <network> accept` and
/// `ip saddr <pod_cidr> masquerade` in a postrouting nat chain, or, with
/// `None` (an IPv6-only node), that table removed. Returns whether it
/// changed anything. One transaction: the rules are replaced atomically,
/// never absent.
pub fn ensure(ns: &NetNs, pods: Option<(Ipv4Network, Ipv4Network)>) -> rcni_netlink::Result<bool> {
    match pods {
        Some((pod_cidr, network)) => ensure_family(
            ns,
            NftFamily::Ip,
            IpNetwork::V4(pod_cidr),
            &[IpNetwork::V4(network)],
        ),
        None => drop_table(ns, NftFamily::Ip),
    }
}

/// The same with several destinations keeping the source (cloud mode: the
/// VPC's CIDR blocks and the excluded ones), or the table removed.
pub fn ensure_keep(
    ns: &NetNs,
    pods: Option<(Ipv4Network, &[Ipv4Network])>,
) -> rcni_netlink::Result<bool> {
    match pods {
        Some((pod_cidr, keep)) => {
            let keep: Vec<IpNetwork> = keep.iter().map(|n| IpNetwork::V4(*n)).collect();
            ensure_family(ns, NftFamily::Ip, IpNetwork::V4(pod_cidr), &keep)
        }
        None => drop_table(ns, NftFamily::Ip),
    }
}

/// The same for IPv6 in table `ip6 rcni_node` (`ip6 saddr`, `ip6 daddr`),
/// or, with `None` (a single-stack node), that table removed.
pub fn ensure6(ns: &NetNs, pods: Option<(Ipv6Network, Ipv6Network)>) -> rcni_netlink::Result<bool> {
    match pods {
        Some((pod_cidr, network)) => ensure_family(
            ns,
            NftFamily::Ip6,
            IpNetwork::V6(pod_cidr),
            &[IpNetwork::V6(network)],
        ),
        None => drop_table(ns, NftFamily::Ip6),
    }
}

/// The family's table gone (whether it was there).
fn drop_table(ns: &NetNs, family: NftFamily) -> rcni_netlink::Result<bool> {
    let mut nl = Nfnl::open(ns)?;
    if nl.nft_rules(family, TABLE)?.is_none() {
        return Ok(false);
    }
    nl.nft_apply(&[NftOp::DeleteTable {
        family,
        table: TABLE.into(),
    }])?;
    Ok(true)
}

fn ensure_family(
    ns: &NetNs,
    family: NftFamily,
    pods: IpNetwork,
    keep: &[IpNetwork],
) -> rcni_netlink::Result<bool> {
    let mut nl = Nfnl::open(ns)?;
    let want = comments(pods, keep);
    let have = nl.nft_rules(family, TABLE)?;
    if let Some(rules) = &have {
        let got: Vec<Option<&str>> = rules.iter().map(|r| r.comment.as_deref()).collect();
        let want: Vec<Option<&str>> = want.iter().map(|c| Some(c.as_str())).collect();
        if got == want {
            return Ok(false);
        }
    }
    let rule = |expr: Vec<expr::Expr>, comment: &str| NftOp::AddRule {
        family,
        table: TABLE.into(),
        chain: CHAIN.into(),
        expr,
        comment: Some(comment.into()),
        insert: false,
    };
    let masq = [expr::addr(true, pods), expr::masquerade()].concat();
    let mut ops = vec![
        NftOp::AddTable {
            family,
            table: TABLE.into(),
            comment: None,
        },
        NftOp::AddChain {
            family,
            table: TABLE.into(),
            chain: CHAIN.into(),
            hook: Some(Hook {
                kind: "nat",
                hook: Hook::POSTROUTING,
                // srcnat
                priority: 100,
            }),
            comment: None,
        },
        NftOp::FlushChain {
            family,
            table: TABLE.into(),
            chain: CHAIN.into(),
        },
    ];
    for (net, comment) in keep.iter().zip(&want) {
        let e = [
            expr::addr(true, pods),
            expr::addr(false, *net),
            expr::accept(),
        ]
        .concat();
        ops.push(rule(e, comment));
    }
    ops.push(rule(
        masq,
        want.last().expect("the masquerade rule's comment"),
    ));
    nl.nft_apply(&ops)?;
    Ok(true)
}
