//! IP masquerade for `ipMasq` (bridge, ptp): traffic from a container's
//! address to anywhere outside its subnet leaves with the node's address.
//!
//! Two backends with the reference's exact layouts, so that either
//! implementation can check and remove what the other made (a drop-in
//! switch in both directions):
//!
//! * iptables (the reference's original backend, still its default): a nat
//!   chain `CNI-<hash(network+containerID)>` per container, see
//!   [`crate::chain_name`] and [`iptables`];
//! * nftables (`ipMasqBackend: "nftables"` in newer upstream releases, v1.9.1
//!   here): table `inet cni_plugins_masquerade`, one rule per address in
//!   chain `masq_checks`, see [`crate::nft_comment`] and [`nftables`],
//!   written and read over nfnetlink ([`crate::nfnl`]), no process.
//!
//! Every call makes at most one write per family: one
//! `iptables-restore --noflush` / `ip6tables-restore --noflush` run (inside
//! the namespace: the child setns' before exec), one nf_tables transaction.
//!
//! Better than the reference: teardown needs no addresses (it finds the
//! rules by network and container, so a DEL without netns or prevResult
//! still cleans up, plugins #810); GC exists for both backends (the
//! reference's iptables GC is a no-op); CHECK verifies the rules; the
//! nftables table is removed with its last rule.

pub mod iptables;
pub mod nftables;

use crate::Error;
use crate::iptables::Family;
use crate::names::chain_name;
use crate::nfnl::Nfnl;
use ipnetwork::IpNetwork;
use rcni_netns::NetNs;
use std::collections::HashSet;
use std::str::FromStr;

/// Which netfilter interface holds the rules (`ipMasqBackend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    Nftables,
    Iptables,
}

impl FromStr for Backend {
    type Err = Error;

    fn from_str(s: &str) -> Result<Backend, Error> {
        match s {
            "iptables" => Ok(Backend::Iptables),
            "nftables" => Ok(Backend::Nftables),
            other => Err(Error::UnknownBackend(other.to_string())),
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Iptables => "iptables",
            Backend::Nftables => "nftables",
        }
    }

    /// The backend when the config names none, by upstream's rule
    /// (`SetupIPMasqForNetworks` in v1.9.1): iptables, unless iptables does
    /// not work in `ns` and nftables does. Keeping iptables as the default
    /// keeps a host's rules where its other tools (and older plugins) look.
    /// nftables is asked of the kernel: the rules are written over
    /// nfnetlink, so no `nft` binary is needed (upstream's probe runs nft,
    /// plugins #1280).
    pub fn detect(ns: &NetNs) -> Backend {
        if crate::iptables::supported(ns, Family::V4) {
            Backend::Iptables
        } else if nftables::supported(ns) {
            Backend::Nftables
        } else {
            Backend::Iptables
        }
    }

    /// The configured backend, or [`Backend::detect`] when there is none.
    /// An unknown name is [`Error::UnknownBackend`] (CNI code 2).
    pub fn from_config(ns: &NetNs, configured: Option<&str>) -> Result<Backend, Error> {
        match configured {
            Some(s) => s.parse(),
            None => Ok(Backend::detect(ns)),
        }
    }
}

/// One attachment's masquerade.
#[derive(Debug, Clone, Copy)]
pub struct Masq<'a> {
    /// The network name (`name` of the config).
    pub network: &'a str,
    pub container_id: &'a str,
    /// The container interface (CNI_IFNAME): part of the nftables key only,
    /// the iptables chain is per container as in the reference.
    pub ifname: &'a str,
    /// The container's addresses with their subnet prefix (`10.1.0.5/16`):
    /// traffic from the address to outside the subnet is masqueraded.
    pub ips: &'a [IpNetwork],
}

/// The addresses of `m` in family `fam`.
fn of_family(m: &Masq, fam: Family) -> Vec<IpNetwork> {
    m.ips
        .iter()
        .filter(|ip| Family::of(&ip.ip()) == fam)
        .copied()
        .collect()
}

/// Makes the attachment's addresses masqueraded. Idempotent: when the rules
/// are already complete nothing is written.
pub fn setup(ns: &NetNs, backend: Backend, m: &Masq) -> Result<(), Error> {
    match backend {
        Backend::Iptables => {
            for fam in Family::BOTH {
                let ips = of_family(m, fam);
                if !ips.is_empty() {
                    iptables::setup(ns, fam, m.network, m.container_id, &ips)?;
                }
            }
            Ok(())
        }
        Backend::Nftables => {
            if m.ips.is_empty() {
                return Ok(());
            }
            nftables::setup(ns, m.network, m.ifname, m.container_id, m.ips)
        }
    }
}

/// Verifies that every address of the attachment is masqueraded by
/// `backend`; [`Error::Missing`] lists what is not.
pub fn check(ns: &NetNs, backend: Backend, m: &Masq) -> Result<(), Error> {
    let mut problems = Vec::new();
    match backend {
        Backend::Iptables => {
            for fam in Family::BOTH {
                let ips = of_family(m, fam);
                if !ips.is_empty() {
                    problems.extend(iptables::check(ns, fam, m.network, m.container_id, &ips)?);
                }
            }
        }
        Backend::Nftables => {
            if !m.ips.is_empty() {
                problems = nftables::check(ns, m.network, m.ifname, m.container_id, m.ips)?;
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::Missing { backend, problems })
    }
}

/// Runs one backend's part of teardown or GC. A missing tool means the
/// backend cannot hold rules here; a failure of a backend that does not work
/// in `ns` is ignored, as the reference does (`SupportsIPTables`,
/// `SupportsNFTables`), so DEL succeeds on hosts with only one of them.
fn best_effort(errors: &mut Vec<Error>, works: impl FnOnce() -> bool, r: Result<(), Error>) {
    match r {
        Ok(()) | Err(Error::ToolMissing { .. }) => {}
        Err(e) => {
            if works() {
                errors.push(e);
            }
        }
    }
}

/// Removes the attachment's rules of both backends (the config's backend
/// may have changed since ADD). Works without addresses: the iptables chain
/// and everything jumping to it are found by network and container ID, the
/// nftables rules by the hash of network, ifname and container ID. Nothing
/// to remove is success; errors of one backend do not stop the other.
///
/// Because the iptables chain is per container, tearing down one of two
/// interfaces a container has on the same network removes the iptables
/// masquerade of both (the reference empties the chain in that case too);
/// the nftables layout keeps them apart.
pub fn teardown(ns: &NetNs, m: &Masq) -> Result<(), Error> {
    let mut errors = Vec::new();
    // Which iptables families can hold the chain at all, read over
    // nfnetlink: on a node without such rules DEL starts no iptables-save.
    let mut nl = Nfnl::open(ns);
    let chain = chain_name(m.network, m.container_id);
    for fam in Family::BOTH {
        if let Ok(nl) = nl.as_mut()
            && !nl.iptables_may_hold(ns, fam == Family::V6, "nat", &[chain.as_str()])
        {
            continue;
        }
        let r = iptables::teardown(ns, fam, m.network, m.container_id);
        best_effort(&mut errors, || crate::iptables::supported(ns, fam), r);
    }
    let r = nl
        .map_err(Error::from)
        .and_then(|mut nl| nftables::teardown(&mut nl, m.network, m.ifname, m.container_id));
    best_effort(&mut errors, || nftables::supported(ns), r);
    Error::several(errors)
}

/// Removes the masquerade rules of `network` whose attachment is not in
/// `valid` (`(containerID, ifname)` pairs), in both backends. iptables
/// chains are per container, so one is kept when any of its container's
/// attachments is valid.
pub fn gc(ns: &NetNs, network: &str, valid: &[(String, String)]) -> Result<(), Error> {
    let mut errors = Vec::new();
    let valid_ids: HashSet<&str> = valid.iter().map(|(cid, _)| cid.as_str()).collect();
    for fam in Family::BOTH {
        let r = iptables::gc(ns, fam, network, &valid_ids);
        best_effort(&mut errors, || crate::iptables::supported(ns, fam), r);
    }
    let r = Nfnl::open(ns)
        .map_err(Error::from)
        .and_then(|mut nl| nftables::gc(&mut nl, network, valid));
    best_effort(&mut errors, || nftables::supported(ns), r);
    Error::several(errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_names() {
        assert_eq!("iptables".parse::<Backend>().unwrap(), Backend::Iptables);
        assert_eq!("nftables".parse::<Backend>().unwrap(), Backend::Nftables);
        let e = "ebpf".parse::<Backend>().unwrap_err();
        assert_eq!(e.cni_code(), 2);
        let c = rcni_cni::CniError::from(e);
        assert_eq!(c.code, 2);
        assert!(
            c.msg.contains("ipMasqBackend") && c.msg.contains("\"ebpf\""),
            "{}",
            c.msg
        );
        assert_eq!(Backend::Nftables.to_string(), "nftables");
    }
}
