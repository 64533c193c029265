//! The backends behind one trait (the reference's `PortMapper`), and the
//! choice among them: [`Conf::backend`] for ADD and CHECK, both for DEL
//! and GC (the config's backend may have changed since ADD).

use crate::conf::{Backend, Conf};
use crate::{ipt, nft};
use ipnetwork::IpNetwork;
use rcni_cni::CniError;
use rcni_cni::rollback::Rollback;
use rcni_netfilter::iptables::Family;
use rcni_netfilter::nfnl::{LazyNfnl, Nfnl};
use rcni_netns::NetNs;
use std::collections::BTreeSet;

/// One attachment, as every backend sees it.
pub struct Ctx<'a> {
    pub ns: &'a NetNs,
    pub owner: nft::Owner<'a>,
    nl: LazyNfnl,
}

impl<'a> Ctx<'a> {
    pub fn new(ns: &'a NetNs, owner: nft::Owner<'a>) -> Ctx<'a> {
        Ctx {
            ns,
            owner,
            nl: LazyNfnl::default(),
        }
    }

    /// The namespace's nfnetlink socket, opened once for every backend.
    fn with_nfnl<T>(
        &self,
        f: impl FnOnce(&mut Nfnl) -> Result<T, CniError>,
    ) -> Result<T, CniError> {
        self.nl.with(self.ns, f)
    }

    /// Whether iptables of `fam` may hold one of `chains` in its nat table
    /// (see [`Nfnl::iptables_may_hold`]); yes when the socket cannot tell.
    fn iptables_may_hold(&self, fam: Family, chains: &BTreeSet<String>) -> bool {
        let chains: Vec<&str> = chains.iter().map(String::as_str).collect();
        self.with_nfnl(|nl| Ok(nl.iptables_may_hold(self.ns, fam == Family::V6, "nat", &chains)))
            .unwrap_or(true)
    }
}

/// What a portmap backend does for one attachment.
pub trait PortMapper {
    /// Writes the mappings of `conf` to the container's `ips` (its first
    /// IPv4 and first IPv6 address); a failure leaves nothing of this call.
    fn add(&self, c: &Ctx, conf: &Conf, ips: &[IpNetwork]) -> Result<(), CniError>;
    /// Removes the attachment's rules; nothing there is success.
    fn del(&self, c: &Ctx) -> Result<(), CniError>;
    /// What is missing of what `add` made (empty: all there).
    fn check(&self, c: &Ctx, conf: &Conf, ips: &[IpNetwork]) -> Result<Vec<String>, CniError>;
    /// Removes the rules of the network's attachments not in `valid`.
    fn gc(&self, c: &Ctx, valid: &[(String, String)]) -> Result<(), CniError>;
}

/// nftables over nfnetlink (see [`nft`]).
pub struct Nftables;

/// iptables in the reference's layout (see [`ipt`]).
pub struct Iptables;

impl PortMapper for Nftables {
    fn add(&self, c: &Ctx, conf: &Conf, ips: &[IpNetwork]) -> Result<(), CniError> {
        c.with_nfnl(|nl| nft::setup(c.ns, nl, conf, &c.owner, ips))
    }

    fn del(&self, c: &Ctx) -> Result<(), CniError> {
        c.with_nfnl(|nl| nft::teardown(nl, &c.owner))
    }

    fn check(&self, c: &Ctx, conf: &Conf, ips: &[IpNetwork]) -> Result<Vec<String>, CniError> {
        c.with_nfnl(|nl| nft::problems(nl, conf, &c.owner, ips))
    }

    fn gc(&self, c: &Ctx, valid: &[(String, String)]) -> Result<(), CniError> {
        c.with_nfnl(|nl| nft::gc(nl, c.owner.network, valid))
    }
}

/// Runs an iptables step of teardown or GC; failures of a family whose
/// iptables does not work at all are not errors (the reference's
/// `maybeGetIptables`).
fn best_effort(ns: &NetNs, fam: Family, r: Result<(), CniError>) -> Result<(), CniError> {
    match r {
        Err(e) if rcni_netfilter::iptables::supported(ns, fam) => Err(e),
        _ => Ok(()),
    }
}

impl PortMapper for Iptables {
    fn add(&self, c: &Ctx, conf: &Conf, ips: &[IpNetwork]) -> Result<(), CniError> {
        let (network, cid) = (c.owner.network, c.owner.container_id);
        let mut undo = Rollback::new();
        for ip in ips {
            ipt::setup(c.ns, conf, network, cid, ip)?;
            let fam = if ip.is_ipv4() { Family::V4 } else { Family::V6 };
            let ns = c.ns;
            undo.push("iptables port mappings", move || {
                ipt::teardown(ns, fam, network, cid)
            });
        }
        undo.commit();
        Ok(())
    }

    /// Skips a family whose iptables cannot hold the chains: no
    /// `iptables-save` on a node that never had them.
    fn del(&self, c: &Ctx) -> Result<(), CniError> {
        let (network, cid) = (c.owner.network, c.owner.container_id);
        let chains = ipt::attachment_chains(network, cid);
        rcni_cni::first_error(Family::BOTH.map(|fam| {
            if !c.iptables_may_hold(fam, &chains) {
                return Ok(());
            }
            best_effort(c.ns, fam, ipt::teardown(c.ns, fam, network, cid))
        }))
    }

    fn check(&self, c: &Ctx, conf: &Conf, ips: &[IpNetwork]) -> Result<Vec<String>, CniError> {
        let mut out = Vec::new();
        for ip in ips {
            out.extend(ipt::check(
                c.ns,
                conf,
                c.owner.network,
                c.owner.container_id,
                ip,
            )?);
        }
        Ok(out)
    }

    fn gc(&self, c: &Ctx, valid: &[(String, String)]) -> Result<(), CniError> {
        let valid_ids: BTreeSet<&str> = valid.iter().map(|(cid, _)| cid.as_str()).collect();
        let top = BTreeSet::from([ipt::DNAT_CHAIN.to_string()]);
        rcni_cni::first_error(Family::BOTH.map(|fam| {
            if !c.iptables_may_hold(fam, &top) {
                return Ok(());
            }
            best_effort(c.ns, fam, ipt::gc(c.ns, fam, c.owner.network, &valid_ids))
        }))
    }
}

/// The backend of ADD and CHECK.
pub fn select(ns: &NetNs, conf: &Conf) -> &'static dyn PortMapper {
    match conf.backend(ns) {
        Backend::Nftables => &Nftables,
        Backend::Iptables => &Iptables,
    }
}

/// The backends DEL and GC run: both, nftables first.
pub const ALL: [&dyn PortMapper; 2] = [&Nftables, &Iptables];
