//! ipMasq (bridge, ptp) through the shared masquerade crate, keyed like the
//! reference (network, container ID, interface) so that either suite checks
//! and cleans up after the other.

use ipnetwork::IpNetwork;
use rcni_cni::skel::CmdArgs;
use rcni_cni::{CniError, ErrorCode};
use rcni_netns::NetNs;

/// One attachment's masquerade, on the node namespace `host`.
pub struct Masq<'a> {
    pub host: &'a NetNs,
    /// The network name (`name` of the config).
    pub network: &'a str,
    /// `ipMasqBackend`; `None` picks the reference's default.
    pub backend: Option<&'a str>,
    pub container_id: &'a str,
    pub ifname: &'a str,
}

impl<'a> Masq<'a> {
    /// The attachment of this plugin call.
    pub fn of(host: &'a NetNs, args: &'a CmdArgs, backend: Option<&'a str>) -> Masq<'a> {
        Masq {
            host,
            network: &args.conf.name,
            backend,
            container_id: &args.container_id,
            ifname: &args.ifname,
        }
    }

    fn rules<'b>(&'b self, ips: &'b [IpNetwork]) -> rcni_netfilter::Masq<'b> {
        rcni_netfilter::Masq {
            network: self.network,
            container_id: self.container_id,
            ifname: self.ifname,
            ips,
        }
    }

    fn backend(&self) -> Result<rcni_netfilter::Backend, CniError> {
        Ok(rcni_netfilter::Backend::from_config(
            self.host,
            self.backend,
        )?)
    }

    pub fn setup(&self, ips: &[IpNetwork]) -> Result<(), CniError> {
        Ok(rcni_netfilter::setup(
            self.host,
            self.backend()?,
            &self.rules(ips),
        )?)
    }

    /// Removes the rules of both backends. The rules are found by network,
    /// container and interface, so DEL needs no addresses: it works when
    /// the netns and prevResult are gone.
    pub fn teardown(&self) -> Result<(), CniError> {
        Ok(rcni_netfilter::teardown(self.host, &self.rules(&[]))?)
    }

    pub fn check(&self, ips: &[IpNetwork]) -> Result<(), CniError> {
        rcni_netfilter::check(self.host, self.backend()?, &self.rules(ips))
            .map_err(|e| CniError::new(ErrorCode::CheckFailed, format!("masquerade rules: {e}")))
    }
}

/// `ipMasqBackend`, checked before the kernel is touched; `None` picks the
/// reference's default.
pub fn backend_key(backend: Option<String>) -> Result<Option<String>, CniError> {
    match backend.as_deref() {
        None | Some("iptables" | "nftables") => Ok(backend),
        Some(b) => Err(CniError::unsupported("ipMasqBackend", format!("{b:?}"))),
    }
}

/// GC: removes the masquerade rules of the network whose attachment is not
/// in the valid set (a missing set counts as empty).
pub fn gc(host: &NetNs, args: &CmdArgs) -> Result<(), CniError> {
    let valid = args.conf.gc_valid_pairs();
    Ok(rcni_netfilter::gc(host, &args.conf.name, &valid)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_key_names_the_bad_value() {
        assert_eq!(backend_key(None).unwrap(), None);
        assert_eq!(
            backend_key(Some("nftables".into())).unwrap().as_deref(),
            Some("nftables")
        );
        let e = backend_key(Some("ebpf".into())).unwrap_err();
        assert_eq!(e.code, 2);
        assert!(e.msg.contains("ipMasqBackend") && e.msg.contains("\"ebpf\""));
    }
}
