//! The nftables layout of upstream v1.9.1 (`pkg/ip/ipmasq_nftables_linux.go`,
//! written there through knftables, i.e. nft):
//!
//! ```text
//! table inet cni_plugins_masquerade {
//!     comment "Masquerading for plugins from github.com/containernetworking/plugins"
//!     chain masq_checks {
//!         comment "Masquerade traffic from certain IPs to any (non-multicast) IP outside their subnet"
//!         ip saddr 10.22.0.2 ip daddr != 10.22.0.0/16 masquerade comment "<net hash>-<if:cid hash>, net: mynet, if: eth0, id: ctr1"
//!     }
//!     chain postrouting {
//!         type nat hook postrouting priority srcnat; policy accept;
//!         ip daddr 224.0.0.0/4 return
//!         ip6 daddr ff00::/8 return
//!         goto masq_checks
//!     }
//! }
//! ```
//!
//! One rule per address, found again by the hash at the start of its
//! comment. Everything goes over nfnetlink ([`Nfnl`]): a read is two dumps
//! (chains, rules), a change one transaction, with the expressions encoded
//! as nft encodes upstream's rule text ([`crate::expr`]), so `nft list`
//! shows the same table whichever implementation wrote it.

use crate::expr::{self, Expr, Term};
use crate::nfnl::{Hook, Nfnl, NftChain, NftFamily, NftOp, NftRule};
use crate::{Error, names};
use ipnetwork::IpNetwork;
use rcni_cni::subnet;
use rcni_netns::NetNs;
use std::collections::HashSet;

/// Our nftables table (family inet).
pub const TABLE: &str = "cni_plugins_masquerade";
pub(crate) const MASQ_CHAIN: &str = "masq_checks";
pub(crate) const POSTROUTING: &str = "postrouting";
const TABLE_COMMENT: &str = "Masquerading for plugins from github.com/containernetworking/plugins";
const MASQ_CHAIN_COMMENT: &str =
    "Masquerade traffic from certain IPs to any (non-multicast) IP outside their subnet";
const FAMILY: NftFamily = NftFamily::Inet;
/// `priority srcnat`.
const SRCNAT: i32 = 100;

/// Our table's contents.
#[derive(Debug, Clone, Default)]
pub(crate) struct Listing {
    pub chains: Vec<NftChain>,
    pub rules: Vec<NftRule>,
}

impl Listing {
    fn chain(&self, name: &str) -> Option<&NftChain> {
        self.chains.iter().find(|c| c.name == name)
    }

    fn rules_in<'a>(&'a self, chain: &'a str) -> impl Iterator<Item = &'a NftRule> + 'a {
        self.rules.iter().filter(move |r| r.chain == chain)
    }
}

/// `<ip|ip6> daddr <net> return`.
fn multicast_return(net: &str) -> Vec<Expr> {
    let net: IpNetwork = net.parse().expect("a constant network");
    [
        expr::nfproto(net.is_ipv6()),
        expr::addr(false, net),
        expr::ret(),
    ]
    .concat()
}

/// The postrouting chain's rules, in order.
fn postrouting_rules() -> [Vec<Expr>; 3] {
    [
        multicast_return("224.0.0.0/4"),
        multicast_return("ff00::/8"),
        expr::goto(MASQ_CHAIN),
    ]
}

/// `<ip|ip6> saddr <ip> <ip|ip6> daddr != <subnet> masquerade`.
fn masq_rule(ip: &IpNetwork) -> Vec<Expr> {
    [
        expr::nfproto(ip.is_ipv6()),
        expr::addr(true, IpNetwork::from(ip.ip())),
        expr::addr_cmp(false, subnet(ip), false),
        expr::masquerade(),
    ]
    .concat()
}

/// What is missing for the attachment; empty when complete.
pub(crate) fn problems(
    l: Option<&Listing>,
    network: &str,
    ifname: &str,
    container_id: &str,
    ips: &[IpNetwork],
) -> Vec<String> {
    let Some(l) = l else {
        return vec![format!("nftables table inet {TABLE} does not exist")];
    };
    let mut out = Vec::new();
    match l.chain(POSTROUTING) {
        Some(c)
            if c.hook
                .as_ref()
                .is_some_and(|(t, h)| t == "nat" && *h == Hook::POSTROUTING) =>
        {
            let have: Vec<&[Term]> = l
                .rules_in(POSTROUTING)
                .map(|r| r.terms.as_slice())
                .collect();
            let want: Vec<Vec<Term>> = postrouting_rules()
                .iter()
                .map(|e| expr::terms_of(e))
                .collect();
            if have != want.iter().map(Vec::as_slice).collect::<Vec<_>>() {
                out.push(format!(
                    "chain inet {TABLE} {POSTROUTING} is not: multicast returns, then goto {MASQ_CHAIN}"
                ));
            }
        }
        _ => out.push(format!(
            "nat postrouting chain inet {TABLE} {POSTROUTING} does not exist"
        )),
    }
    if l.chain(MASQ_CHAIN).is_none() {
        out.push(format!("chain inet {TABLE} {MASQ_CHAIN} does not exist"));
        return out;
    }
    let comment = names::nft_comment(network, ifname, container_id);
    for ip in ips {
        let want = expr::terms_of(&masq_rule(ip));
        let found = l
            .rules_in(MASQ_CHAIN)
            .any(|r| r.comment.as_deref() == Some(comment.as_str()) && r.terms == want);
        if !found {
            out.push(format!(
                "no rule in {MASQ_CHAIN} masquerades {} leaving {} for {comment:?}",
                ip.ip(),
                subnet(ip)
            ));
        }
    }
    out
}

/// The transaction that (re)creates the table and chains and replaces the
/// attachment's rules with one per address, as upstream's
/// `setupIPMasqNFTablesWithInterface` does.
pub(crate) fn setup_ops(
    l: Option<&Listing>,
    network: &str,
    ifname: &str,
    container_id: &str,
    ips: &[IpNetwork],
) -> Vec<NftOp> {
    let table = || TABLE.to_string();
    let rule = |chain: &str, expr: Vec<Expr>, comment: Option<String>| NftOp::AddRule {
        family: FAMILY,
        table: table(),
        chain: chain.into(),
        expr,
        comment,
        insert: false,
    };
    let mut ops = vec![
        NftOp::AddTable {
            family: FAMILY,
            table: table(),
            comment: Some(TABLE_COMMENT.into()),
        },
        NftOp::AddChain {
            family: FAMILY,
            table: table(),
            chain: MASQ_CHAIN.into(),
            hook: None,
            comment: Some(MASQ_CHAIN_COMMENT.into()),
        },
        NftOp::AddChain {
            family: FAMILY,
            table: table(),
            chain: POSTROUTING.into(),
            hook: Some(Hook {
                kind: "nat",
                hook: Hook::POSTROUTING,
                priority: SRCNAT,
            }),
            comment: None,
        },
        NftOp::FlushChain {
            family: FAMILY,
            table: table(),
            chain: POSTROUTING.into(),
        },
    ];
    ops.extend(postrouting_rules().map(|e| rule(POSTROUTING, e, None)));
    if let Some(l) = l {
        let prefix = names::nft_instance_hash(network, ifname, container_id);
        let stale = l
            .rules_in(MASQ_CHAIN)
            .filter(|r| r.comment.as_deref().is_some_and(|c| c.starts_with(&prefix)));
        ops.extend(stale.map(|r| NftOp::DeleteRule {
            family: FAMILY,
            table: table(),
            chain: MASQ_CHAIN.into(),
            handle: r.handle,
        }));
    }
    let comment = names::nft_comment(network, ifname, container_id);
    ops.extend(
        ips.iter()
            .map(|ip| rule(MASQ_CHAIN, masq_rule(ip), Some(comment.clone()))),
    );
    ops
}

/// Deletes `doomed` rules (handles in masq_checks). When they are all the
/// chain holds, the first attempt also removes the chains and the table so
/// that nothing is left behind; if another attachment added a rule
/// meanwhile, deleting the non-empty chain fails the whole transaction
/// atomically and the plain deletion is applied instead.
fn removal_attempts(l: &Listing, doomed: &[u64]) -> Vec<Vec<NftOp>> {
    if doomed.is_empty() {
        return Vec::new();
    }
    let plain: Vec<NftOp> = doomed
        .iter()
        .map(|h| NftOp::DeleteRule {
            family: FAMILY,
            table: TABLE.into(),
            chain: MASQ_CHAIN.into(),
            handle: *h,
        })
        .collect();
    let all_ours = l.rules_in(MASQ_CHAIN).all(|r| doomed.contains(&r.handle));
    let only_our_chains = l
        .chains
        .iter()
        .all(|c| c.name == MASQ_CHAIN || c.name == POSTROUTING);
    if !(all_ours && only_our_chains) {
        return vec![plain];
    }
    let mut full = plain.clone();
    full.extend(drop_table_ops());
    vec![full, plain]
}

/// The chains and the table. postrouting holds only the fixed rules and is
/// flushed; masq_checks is deleted without recursion (`NftOp::DeleteChain`),
/// so a rule another attachment added since the listing makes the kernel
/// refuse the whole transaction instead of deleting that rule with it.
fn drop_table_ops() -> Vec<NftOp> {
    let mut ops = vec![NftOp::FlushChain {
        family: FAMILY,
        table: TABLE.into(),
        chain: POSTROUTING.into(),
    }];
    ops.extend(
        [POSTROUTING, MASQ_CHAIN]
            .into_iter()
            .map(|chain| NftOp::DeleteChain {
                family: FAMILY,
                table: TABLE.into(),
                chain: chain.into(),
            }),
    );
    ops.push(NftOp::DeleteTable {
        family: FAMILY,
        table: TABLE.into(),
    });
    ops
}

/// After a plain deletion. Two DELs at once each see the other's rule and
/// both keep the table; the later of the two to commit sees it empty here.
/// If an ADD put a rule in meanwhile, the chain is not empty and the kernel
/// refuses the whole transaction, which is what we want.
fn drop_table_if_empty(nl: &mut Nfnl) {
    let Ok(Some(l)) = list(nl) else { return };
    let only_our_chains = l
        .chains
        .iter()
        .all(|c| c.name == MASQ_CHAIN || c.name == POSTROUTING);
    if l.rules_in(MASQ_CHAIN).next().is_none() && only_our_chains {
        let _ = nl.nft_apply(&drop_table_ops());
    }
}

/// The error of the last of [`ATTEMPTS`] (always one: the loops run).
fn exhausted(last: Option<rcni_netlink::Error>) -> Error {
    last.map_or_else(|| Error::Several(Vec::new()), Error::from)
}

/// Reads our table; `None` when it does not exist.
pub(crate) fn list(nl: &mut Nfnl) -> Result<Option<Listing>, Error> {
    let Some(chains) = nl.nft_chains(FAMILY, TABLE)? else {
        return Ok(None);
    };
    let rules = nl.nft_rules(FAMILY, TABLE)?.unwrap_or_default();
    Ok(Some(Listing { chains, rules }))
}

/// Whether nf_tables works in `ns` (the reference's `SupportsNFTables`,
/// asked of the kernel rather than of the `nft` tool, which we do not need).
pub(crate) fn supported(ns: &NetNs) -> bool {
    Nfnl::open(ns).and_then(|mut nl| nl.nft_tables()).is_ok()
}

/// A list-then-write step may race with another plugin process changing the
/// table between the two (a handle we meant to delete is gone): reading again
/// and retrying once resolves that.
const ATTEMPTS: usize = 2;

pub(crate) fn setup(
    ns: &NetNs,
    network: &str,
    ifname: &str,
    container_id: &str,
    ips: &[IpNetwork],
) -> Result<(), Error> {
    let mut nl = Nfnl::open(ns)?;
    let mut last = None;
    for _ in 0..ATTEMPTS {
        let l = list(&mut nl)?;
        if problems(l.as_ref(), network, ifname, container_id, ips).is_empty() {
            return Ok(());
        }
        match nl.nft_apply(&setup_ops(l.as_ref(), network, ifname, container_id, ips)) {
            Ok(()) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(exhausted(last))
}

pub(crate) fn check(
    ns: &NetNs,
    network: &str,
    ifname: &str,
    container_id: &str,
    ips: &[IpNetwork],
) -> Result<Vec<String>, Error> {
    let mut nl = Nfnl::open(ns)?;
    Ok(problems(
        list(&mut nl)?.as_ref(),
        network,
        ifname,
        container_id,
        ips,
    ))
}

/// Deletes the rules of masq_checks whose comment `select` picks, and with
/// the last of them the chains and the table, in one transaction; listing
/// again and retrying once if another plugin process changed the table
/// meanwhile.
fn remove_where(nl: &mut Nfnl, select: &dyn Fn(&str) -> bool) -> Result<(), Error> {
    let mut last = None;
    for _ in 0..ATTEMPTS {
        let Some(l) = list(nl)? else {
            return Ok(());
        };
        let doomed: Vec<u64> = l
            .rules_in(MASQ_CHAIN)
            .filter(|r| r.comment.as_deref().is_some_and(select))
            .map(|r| r.handle)
            .collect();
        let attempts = removal_attempts(&l, &doomed);
        if attempts.is_empty() {
            return Ok(());
        }
        for ops in &attempts {
            match nl.nft_apply(ops) {
                Ok(()) => {
                    if ops.len() == doomed.len() {
                        drop_table_if_empty(nl);
                    }
                    return Ok(());
                }
                Err(e) => last = Some(e),
            }
        }
    }
    Err(exhausted(last))
}

/// Removes the attachment's rules (by the hash of network, ifname and
/// container ID, so no address is needed).
pub(crate) fn teardown(
    nl: &mut Nfnl,
    network: &str,
    ifname: &str,
    container_id: &str,
) -> Result<(), Error> {
    let prefix = names::nft_instance_hash(network, ifname, container_id);
    remove_where(nl, &|c| c.starts_with(&prefix))
}

/// Removes rules of `network` whose attachment is not in `valid`
/// (`(containerID, ifname)` pairs), as upstream's `gcIPMasqNFTables`.
pub(crate) fn gc(nl: &mut Nfnl, network: &str, valid: &[(String, String)]) -> Result<(), Error> {
    let prefix = format!("{}-", names::nft_network_hash(network));
    let keep: HashSet<String> = valid
        .iter()
        .map(|(cid, ifname)| names::nft_comment(network, ifname, cid))
        .collect();
    remove_where(nl, &|c| c.starts_with(&prefix) && !keep.contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A namespace of its own with nfnetlink, or None when not root.
    fn kernel() -> (rcni_testkit::TestNs, Nfnl) {
        let ns = rcni_testkit::TestNs::new();
        let nl = Nfnl::open(&ns.ns).unwrap();
        (ns, nl)
    }

    fn doomed(l: &Listing, cid: &str) -> Vec<u64> {
        let prefix = names::nft_instance_hash("mynet", "eth0", cid);
        l.rules_in(MASQ_CHAIN)
            .filter(|r| r.comment.as_deref().is_some_and(|c| c.starts_with(&prefix)))
            .map(|r| r.handle)
            .collect()
    }

    /// The last attachment's DEL planned its removal (rule, chains, table)
    /// from a listing; another pod's ADD committed its rule before the DEL
    /// applied it. The kernel must refuse the removal of the table instead
    /// of deleting the new rule with it (a lost rule under concurrency).
    #[test]
    fn last_teardown_racing_an_add_keeps_the_new_rule() {
        let (_ns, mut nl) = kernel();
        let (a, b) = (ips(), vec!["10.22.0.3/16".parse().unwrap()]);
        nl.nft_apply(&setup_ops(None, "mynet", "eth0", "a", &a))
            .unwrap();
        let stale = list(&mut nl).unwrap().unwrap();
        nl.nft_apply(&setup_ops(Some(&stale), "mynet", "eth0", "b", &b))
            .unwrap();
        let attempts = removal_attempts(&stale, &doomed(&stale, "a"));
        assert_eq!(attempts.len(), 2);
        // EBUSY: the chain still holds b's rule (NLM_F_NONREC).
        let e = nl.nft_apply(&attempts[0]).expect_err("took b's rule along");
        assert_eq!(e.errno(), Some(libc::EBUSY), "{e}");
        nl.nft_apply(&attempts[1]).unwrap();
        let l = list(&mut nl).unwrap().expect("the table stays for b");
        assert!(problems(Some(&l), "mynet", "eth0", "b", &b).is_empty());
        teardown(&mut nl, "mynet", "eth0", "b").unwrap();
        assert!(list(&mut nl).unwrap().is_none());
    }

    /// The last two attachments' DELs at once: each lists the other's rule
    /// and deletes only its own; the later one still drops the table.
    #[test]
    fn last_two_teardowns_at_once_leave_no_table() {
        let (_ns, mut nl) = kernel();
        let (a, b) = (ips(), vec!["10.22.0.3/16".parse().unwrap()]);
        nl.nft_apply(&setup_ops(None, "mynet", "eth0", "a", &a))
            .unwrap();
        let l = list(&mut nl).unwrap().unwrap();
        nl.nft_apply(&setup_ops(Some(&l), "mynet", "eth0", "b", &b))
            .unwrap();
        let both = list(&mut nl).unwrap().unwrap();
        for cid in ["a", "b"] {
            let attempts = removal_attempts(&both, &doomed(&both, cid));
            assert_eq!(attempts.len(), 1, "{cid}: only the plain deletion");
            nl.nft_apply(&attempts[0]).unwrap();
        }
        assert!(list(&mut nl).unwrap().is_some());
        drop_table_if_empty(&mut nl);
        assert!(list(&mut nl).unwrap().is_none());
    }

    fn ips() -> Vec<IpNetwork> {
        vec![
            "10.22.0.2/16".parse().unwrap(),
            "fd00:22::2/64".parse().unwrap(),
        ]
    }

    /// The table after a dual-stack setup for "mynet", eth0, "ctr1", as a
    /// listing would read it back.
    fn listing() -> Listing {
        let c = names::nft_comment("mynet", "eth0", "ctr1");
        let rule = |chain: &str, handle, comment: Option<&str>, e: &[Expr]| NftRule {
            chain: chain.into(),
            handle,
            comment: comment.map(String::from),
            terms: expr::terms_of(e),
        };
        let [r4, r6, goto] = postrouting_rules();
        let ips = ips();
        Listing {
            chains: vec![
                NftChain {
                    name: MASQ_CHAIN.into(),
                    base: false,
                    hook: None,
                    comment: Some(MASQ_CHAIN_COMMENT.into()),
                },
                NftChain {
                    name: POSTROUTING.into(),
                    base: true,
                    hook: Some(("nat".into(), Hook::POSTROUTING)),
                    comment: None,
                },
            ],
            rules: vec![
                rule(MASQ_CHAIN, 6, Some(&c), &masq_rule(&ips[0])),
                rule(MASQ_CHAIN, 7, Some(&c), &masq_rule(&ips[1])),
                rule(POSTROUTING, 3, None, &r4),
                rule(POSTROUTING, 4, None, &r6),
                rule(POSTROUTING, 5, None, &goto),
            ],
        }
    }

    #[test]
    fn checks_a_listing() {
        let l = listing();
        assert!(problems(Some(&l), "mynet", "eth0", "ctr1", &ips()).is_empty());
        // Another interface of the same container has no rules here.
        assert_eq!(problems(Some(&l), "mynet", "eth1", "ctr1", &ips()).len(), 2);
        assert_eq!(problems(None, "mynet", "eth0", "ctr1", &ips()).len(), 1);
        let mut broken = l.clone();
        broken.rules.retain(|r| r.handle != 5);
        assert_eq!(
            problems(Some(&broken), "mynet", "eth0", "ctr1", &ips()).len(),
            1
        );
        // Same address, other subnet: not the rule CHECK wants.
        let other: Vec<IpNetwork> = vec!["10.22.0.2/24".parse().unwrap()];
        assert_eq!(problems(Some(&l), "mynet", "eth0", "ctr1", &other).len(), 1);
    }

    #[test]
    fn setup_replaces_the_instance_rules() {
        let l = listing();
        let ops = setup_ops(Some(&l), "mynet", "eth0", "ctr1", &ips()[..1]);
        let deleted: Vec<u64> = ops
            .iter()
            .filter_map(|o| match o {
                NftOp::DeleteRule { handle, .. } => Some(*handle),
                _ => None,
            })
            .collect();
        assert_eq!(deleted, [6, 7]);
        let c = names::nft_comment("mynet", "eth0", "ctr1");
        assert!(
            matches!(ops.last(), Some(NftOp::AddRule { chain, comment: Some(cm), .. })
            if chain == MASQ_CHAIN && cm == &c)
        );
        let other = setup_ops(Some(&l), "mynet", "eth1", "ctr1", &ips());
        assert!(!other.iter().any(|o| matches!(o, NftOp::DeleteRule { .. })));
    }

    #[test]
    fn removal_drops_the_table_with_the_last_rule() {
        let l = listing();
        let all = removal_attempts(&l, &[6, 7]);
        assert_eq!(all.len(), 2);
        assert!(matches!(all[0].last(), Some(NftOp::DeleteTable { .. })));
        assert!(
            !all[1]
                .iter()
                .any(|o| matches!(o, NftOp::DeleteTable { .. }))
        );
        assert_eq!(removal_attempts(&l, &[6]).len(), 1);
        assert!(removal_attempts(&l, &[]).is_empty());
    }
}
