//! Masquerade of pod traffic that leaves the cluster network, in an
//! nftables table of the agent's own (`ip rcni_node`), written over
//! nfnetlink with the expression builders the meta plugins use. The
//! per-attachment rules of `ipMasq` (crates/netfilter) do not fit: this is one
//! rule per node, and it must not depend on pods coming and going.
//!
//! The same chain gives a peer's traffic over the tunnel its node's address
//! back: a node's own traffic to another node's pods leaves by the VXLAN
//! device, so its source is that device's address (the pod subnet's `.0`,
//! as flannel's), and kube-proxy's masquerade of a node's connection to an
//! `externalTrafficPolicy: Local` NodePort picks that address too. A pod
//! would see `10.244.1.0` where, over host-gw or a routed underlay, it sees
//! the node (upstream's e2e "HealthCheckNodePort ... ExternalTrafficPolicy
//! changes" checks exactly that). The receiving node rewrites the peer's
//! `.0` to the peer's underlay address on the way into its pods; the
//! replies are translated back before routing, so they return by the
//! tunnel they came from (no asymmetric path for rp_filter to drop).

use std::net::IpAddr;

use ipnetwork::{IpNetwork, Ipv4Network, Ipv6Network};
use rcni_netfilter::expr;
use rcni_netfilter::nfnl::{Hook, Nfnl, NftFamily, NftOp};
use rcni_netns::NetNs;

pub const TABLE: &str = "rcni_node";
const CHAIN: &str = "postrouting";

/// A peer's tunnel address (its VTEP's, the source of its own traffic
/// into the tunnel) and the node address its traffic shows to our pods.
pub type Tunnel = (IpAddr, IpAddr);

/// The rules' comments: they name what the rules do, so an unchanged table
/// is recognised and left alone (no flush on restart).
fn comments(pod_cidr: IpNetwork, tunnels: &[Tunnel], keep: &[IpNetwork]) -> Vec<String> {
    let mut v: Vec<String> = tunnels
        .iter()
        .map(|(t, node)| format!("rcni-node: {t} into {pod_cidr} shows as its node {node}"))
        .collect();
    v.extend(
        keep.iter()
            .map(|n| format!("rcni-node: {pod_cidr} to {n} keeps its source")),
    );
    let all: Vec<String> = keep.iter().map(|n| n.to_string()).collect();
    v.push(format!(
        "rcni-node: {pod_cidr} leaving {} masqueraded",
        all.join(", ")
    ));
    v
}

/// Makes the table hold exactly, in a postrouting nat chain,
/// `ip saddr <tunnel> ip daddr <pod_cidr> snat to <node>` per tunnelled
/// peer, `ip saddr <pod_cidr> ip daddr <network> accept` and
/// `ip saddr <pod_cidr> masquerade`, or, with `None` (an IPv6-only node),
/// that table removed. Returns whether it changed anything. One
/// transaction: the rules are replaced atomically, never absent.
pub fn ensure(
    ns: &NetNs,
    pods: Option<(Ipv4Network, Ipv4Network)>,
    tunnels: &[Tunnel],
) -> rcni_netlink::Result<bool> {
    match pods {
        Some((pod_cidr, network)) => ensure_family(
            ns,
            NftFamily::Ip,
            IpNetwork::V4(pod_cidr),
            tunnels,
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
            ensure_family(ns, NftFamily::Ip, IpNetwork::V4(pod_cidr), &[], &keep)
        }
        None => drop_table(ns, NftFamily::Ip),
    }
}

/// The same for IPv6 in table `ip6 rcni_node` (`ip6 saddr`, `ip6 daddr`),
/// or, with `None` (a single-stack node), that table removed.
pub fn ensure6(
    ns: &NetNs,
    pods: Option<(Ipv6Network, Ipv6Network)>,
    tunnels: &[Tunnel],
) -> rcni_netlink::Result<bool> {
    match pods {
        Some((pod_cidr, network)) => ensure_family(
            ns,
            NftFamily::Ip6,
            IpNetwork::V6(pod_cidr),
            tunnels,
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
    tunnels: &[Tunnel],
    keep: &[IpNetwork],
) -> rcni_netlink::Result<bool> {
    let mut nl = Nfnl::open(ns)?;
    let want = comments(pods, tunnels, keep);
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
    for ((tunnel, node), comment) in tunnels.iter().zip(&want) {
        let host = IpNetwork::from(*tunnel);
        let e = [
            expr::addr(true, host),
            expr::addr(false, pods),
            expr::snat(*node),
        ]
        .concat();
        ops.push(rule(e, comment));
    }
    for (net, comment) in keep.iter().zip(&want[tunnels.len()..]) {
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
