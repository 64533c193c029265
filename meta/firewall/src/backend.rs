//! The backends behind one trait, and the choice among them.
//!
//! The default is the reference's: firewalld when it runs, else iptables.
//! Either of those is what an operator's other tools look at: iptables'
//! `filter FORWARD` (where Docker sets policy DROP) is a hook of its own, and
//! an accept in any other table, nftables' included, cannot undo its drop;
//! firewalld's zones likewise reject forwarded traffic of sources it does
//! not trust. nftables is used when the config says so, unless iptables'
//! FORWARD drops (then the reference's iptables rules, see [`select`]), or
//! when iptables does not work on the node.

use crate::conf::{Backend, Conf, IngressPolicy};
use crate::{firewalld, ipt, nft};
use ipnetwork::IpNetwork;
use rcni_cni::CniError;
use rcni_cni::rollback::Rollback;
use rcni_netfilter::iptables::{self, Family};
use rcni_netfilter::nfnl::{LazyNfnl, Nfnl};
use rcni_netns::NetNs;

/// One attachment, as every backend sees it.
pub struct Ctx<'a> {
    pub ns: &'a NetNs,
    pub conf: &'a Conf,
    pub att: nft::Attachment<'a>,
    /// The addresses of prevResult (none on a DEL without it).
    pub ips: Vec<IpNetwork>,
    nl: LazyNfnl,
}

impl<'a> Ctx<'a> {
    pub fn new(
        ns: &'a NetNs,
        conf: &'a Conf,
        att: nft::Attachment<'a>,
        ips: Vec<IpNetwork>,
    ) -> Ctx<'a> {
        Ctx {
            ns,
            conf,
            att,
            ips,
            nl: LazyNfnl::default(),
        }
    }

    /// The namespace's nfnetlink socket, opened once for every backend.
    pub fn with_nfnl<T>(
        &self,
        f: impl FnOnce(&mut Nfnl) -> Result<T, CniError>,
    ) -> Result<T, CniError> {
        self.nl.with(self.ns, f)
    }

    /// The addresses by family, families without one left out.
    pub fn by_family(&self) -> Vec<(Family, Vec<IpNetwork>)> {
        Family::BOTH
            .into_iter()
            .map(|f| {
                let ips = self.ips.iter().filter(|ip| ipt::family(ip) == f);
                (f, ips.copied().collect::<Vec<_>>())
            })
            .filter(|(_, v)| !v.is_empty())
            .collect()
    }

    /// The bridge of a non-open ingress policy.
    fn isolated_bridge(&self) -> Option<&str> {
        match self.conf.policy {
            IngressPolicy::Open => None,
            _ => self.att.bridge.as_deref(),
        }
    }
}

/// What a firewall backend does for one attachment.
pub trait FirewallBackend {
    /// Lets the attachment's traffic through; a failure leaves nothing of
    /// this call behind.
    fn add(&self, c: &Ctx) -> Result<(), CniError>;
    /// Removes what `add` made; nothing there is success.
    fn del(&self, c: &Ctx) -> Result<(), CniError>;
    /// What is missing of what `add` made (empty: all there).
    fn check(&self, c: &Ctx) -> Result<Vec<String>, CniError>;
}

/// Native nftables over nfnetlink (see [`nft`]).
pub struct Nftables;

/// iptables in the reference's layout (see [`ipt`]).
pub struct Iptables;

/// Sources of a firewalld zone over D-Bus (see [`firewalld`]), and the
/// ingress policy's isolation rules in iptables, as the reference writes
/// them whatever its backend.
pub struct Firewalld(pub firewalld::Firewalld);

impl FirewallBackend for Nftables {
    fn add(&self, c: &Ctx) -> Result<(), CniError> {
        c.with_nfnl(|nl| nft::setup(nl, c.conf, &c.att, &c.ips))
    }

    /// Finds the rules by the attachment's comment: prevResult not needed.
    fn del(&self, c: &Ctx) -> Result<(), CniError> {
        c.with_nfnl(|nl| nft::teardown(nl, &c.att))
    }

    fn check(&self, c: &Ctx) -> Result<Vec<String>, CniError> {
        c.with_nfnl(|nl| nft::problems(nl, c.conf, &c.att, &c.ips))
    }
}

impl FirewallBackend for Iptables {
    fn add(&self, c: &Ctx) -> Result<(), CniError> {
        let mut undo = Rollback::new();
        for (fam, fips) in c.by_family() {
            ipt::setup(c.ns, c.conf, fam, &fips, c.att.bridge.as_deref())?;
            let ns = c.ns;
            undo.push("iptables firewall rules", move || {
                ipt::teardown(ns, fam, &fips)
            });
        }
        undo.commit();
        Ok(())
    }

    /// The per-address rules of prevResult's addresses, as the reference.
    fn del(&self, c: &Ctx) -> Result<(), CniError> {
        for (fam, fips) in c.by_family() {
            // No process on a node that never had iptables firewall rules.
            let v6 = fam == Family::V6;
            let may_hold = c.with_nfnl(|nl| {
                Ok(nl.iptables_may_hold(c.ns, v6, "filter", &[ipt::FORWARD_CHAIN]))
            })?;
            if !may_hold {
                continue;
            }
            if let Err(e) = ipt::teardown(c.ns, fam, &fips)
                && rcni_netfilter::iptables::supported(c.ns, fam)
            {
                return Err(e);
            }
        }
        Ok(())
    }

    fn check(&self, c: &Ctx) -> Result<Vec<String>, CniError> {
        let mut out = Vec::new();
        for (fam, fips) in c.by_family() {
            out.extend(ipt::check(
                c.ns,
                c.conf,
                fam,
                &fips,
                c.att.bridge.as_deref(),
            )?);
        }
        Ok(out)
    }
}

/// firewalld's name for an address: the host prefix, as the reference
/// passes it.
fn source(ip: &IpNetwork) -> String {
    format!("{}/{}", ip.ip(), if ip.is_ipv4() { 32 } else { 128 })
}

impl FirewallBackend for Firewalld {
    fn add(&self, c: &Ctx) -> Result<(), CniError> {
        let zone = c.conf.firewalld_zone.as_str();
        let mut undo = Rollback::new();
        for ip in &c.ips {
            let src = source(ip);
            self.0.add_source(zone, &src)?;
            undo.push("firewalld source", move || self.0.remove_source(zone, &src));
        }
        if let Some(b) = c.isolated_bridge() {
            for (fam, _) in c.by_family() {
                ipt::setup_isolation(c.ns, c.conf, fam, b)?;
            }
        }
        undo.commit();
        Ok(())
    }

    /// Removes prevResult's addresses from the zone; the isolation rules
    /// are shared by the bridge's pods and stay, as the reference's.
    fn del(&self, c: &Ctx) -> Result<(), CniError> {
        let zone = c.conf.firewalld_zone.as_str();
        let mut first = None;
        for ip in &c.ips {
            if let Err(e) = self.0.remove_source(zone, &source(ip)) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    fn check(&self, c: &Ctx) -> Result<Vec<String>, CniError> {
        let zone = c.conf.firewalld_zone.as_str();
        let mut out = Vec::new();
        for ip in &c.ips {
            let src = source(ip);
            if !self.0.has_source(zone, &src)? {
                out.push(format!("source {src} in firewalld zone {zone}"));
            }
        }
        if let Some(b) = c.isolated_bridge() {
            for (fam, _) in c.by_family() {
                out.extend(ipt::check_isolation(c.ns, c.conf, fam, b)?);
            }
        }
        Ok(out)
    }
}

/// Whether iptables works in `ns` (the same probe as ipMasq's default).
fn iptables_usable(ns: &NetNs) -> bool {
    rcni_netfilter::iptables::supported(ns, Family::V4)
}

/// The backend of ADD and CHECK: the configured one, else firewalld if it
/// runs, else iptables where it works, else nftables where the kernel has it.
///
/// `"backend": "nftables"` becomes iptables where iptables' `filter
/// FORWARD` drops what it does not accept (Docker sets its policy DROP):
/// that chain is a base chain of its own at the forward hook, and a packet
/// dropped by any base chain is dropped, so no accept in our nftables table
/// can let the pod's traffic through. The reference knows no nftables
/// backend and reads that value as its default, whose CNI-FORWARD accept
/// sits in iptables' own FORWARD chain: a config that works with it must
/// not lose traffic with ours.
pub fn select(c: &Ctx) -> Result<Box<dyn FirewallBackend>, CniError> {
    Ok(match c.conf.backend {
        Some(Backend::Nftables) if iptables_forward_drops(c)? => Box::new(Iptables),
        Some(Backend::Nftables) => Box::new(Nftables),
        Some(Backend::Iptables) => Box::new(Iptables),
        Some(Backend::Firewalld) => Box::new(Firewalld(firewalld::Firewalld::required()?)),
        None => match firewalld::Firewalld::running()? {
            Some(fw) => Box::new(Firewalld(fw)),
            None if iptables_usable(c.ns) => Box::new(Iptables),
            // Our nftables backend speaks nfnetlink itself: what it needs is
            // the kernel's nf_tables, not the nft tool.
            None if c
                .with_nfnl(|nl| Ok(nl.nft_tables().is_ok()))
                .unwrap_or(false) =>
            {
                Box::new(Nftables)
            }
            None => Box::new(Iptables),
        },
    })
}

/// Whether iptables' `filter FORWARD` of a family of the attachment's
/// addresses drops forwarded traffic, where iptables is there to write the
/// accept. iptables-nft keeps that chain in the nftables table `ip filter`
/// (`ip6 filter`), read over nfnetlink without a process (the nftables
/// ADD's cost is one request per family more); legacy iptables (x_tables)
/// only over `iptables-legacy -S`, a process run only where the legacy
/// `filter` table exists in the namespace.
fn iptables_forward_drops(c: &Ctx) -> Result<bool, CniError> {
    for (fam, _) in c.by_family() {
        if c.with_nfnl(|nl| Ok(iptables::forward_drops(c.ns, nl, fam)?))? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The backends DEL runs: every one whose state it can find without
/// guessing (nftables rules by comment, the iptables rules of prevResult's
/// addresses, which neither belong to anyone else), whatever the config
/// names now, and firewalld where it would be chosen and runs: a zone's
/// sources can be the operator's, so they are removed only where the
/// config gives them to this plugin. firewalld not running holds none
/// (its runtime state goes with it).
pub fn for_del(conf: &Conf) -> Result<Vec<Box<dyn FirewallBackend>>, CniError> {
    let mut v: Vec<Box<dyn FirewallBackend>> = vec![Box::new(Nftables), Box::new(Iptables)];
    if matches!(conf.backend, None | Some(Backend::Firewalld))
        && let Some(fw) = firewalld::Firewalld::running()?
    {
        v.push(Box::new(Firewalld(fw)));
    }
    Ok(v)
}
