//! Writing and reading the table over nfnetlink, in the current network
//! namespace: one `NETLINK_NETFILTER` socket per call, no `nft` process.

use super::Listing;
use super::{current_ns, netfilter};
use rcni_cni::CniError;
use rcni_netfilter::nfnl::{Nfnl, NftFamily};
use rcni_netfilter::nftset::{self, Batch, INET};
use rcni_netns::NetNs;

pub(super) fn open(ns: &NetNs) -> Result<Nfnl, CniError> {
    Nfnl::open(ns).map_err(|e| netfilter(format!("policy: {e}")))
}

pub(super) fn open_current() -> Result<Nfnl, CniError> {
    open(&current_ns()?)
}

/// Commits `b` as one transaction (nothing when it is empty).
pub(super) fn run(nl: &mut Nfnl, b: Batch) -> Result<(), CniError> {
    nl.nft_batch(&b.into_messages())
        .map_err(|e| netfilter(format!("policy: {e}")))
}

/// The chains (name, hook) and vmap elements of `table`; `None` when there
/// is no such table.
pub(super) fn listing(
    nl: &mut Nfnl,
    table: &str,
    vmaps: &[&str],
) -> Result<Option<Listing>, CniError> {
    let err = |e: rcni_netlink::Error| netfilter(format!("policy: read table inet {table}: {e}"));
    let Some(chains) = nl.nft_chains(NftFamily::Inet, table).map_err(err)? else {
        return Ok(None);
    };
    let mut l = Listing::default();
    for c in chains {
        l.chains.insert(c.name, c.hook.map(|(_, h)| h));
    }
    for m in vmaps {
        let (kind, req) = nftset::elements_request(table, m);
        let Some(msgs) = nl.nft_dump_raw(kind, INET, &req).map_err(err)? else {
            continue;
        };
        let e = l.vmaps.entry(m.to_string()).or_default();
        for a in &msgs {
            e.extend(nftset::parse_jumps(a));
        }
    }
    Ok(Some(l))
}
