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
fn comments(pod_cidr: IpNetwork, network: IpNetwork) -> [String; 2] {
    [
        format!("rcni-node: {pod_cidr} to {network} keeps its source"),
        format!("rcni-node: {pod_cidr} leaving {network} masqueraded"),
    ]
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
            IpNetwork::V4(network),
        ),
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
            IpNetwork::V6(network),
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
    net: IpNetwork,
) -> rcni_netlink::Result<bool> {
    let mut nl = Nfnl::open(ns)?;
    let want = comments(pods, net);
    let have = nl.nft_rules(family, TABLE)?;
    if let Some(rules) = &have {
        let got: Vec<Option<&str>> = rules.iter().map(|r| r.comment.as_deref()).collect();
        if got == [Some(want[0].as_str()), Some(want[1].as_str())] {
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
    let keep = [
        expr::addr(true, pods),
        expr::addr(false, net),
        expr::accept(),
    ]
    .concat();
    let masq = [expr::addr(true, pods), expr::masquerade()].concat();
    let ops = vec![
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
        rule(keep, &want[0]),
        rule(masq, &want[1]),
    ];
    nl.nft_apply(&ops)?;
    Ok(true)
}
