//! ipMasq through the shared masquerade crate, keyed like the reference
//! (network, container ID) so either suite cleans up after the other.

use crate::conf::Conf;
use ipnetwork::IpNetwork;
use rcni_cni::CniError;
use rcni_netns::NetNs;

fn backend(host: &NetNs, conf: &Conf) -> Result<rcni_ipmasq::Backend, CniError> {
    Ok(rcni_ipmasq::Backend::from_config(
        host,
        conf.ip_masq_backend.as_deref(),
    )?)
}

fn masq<'a>(
    conf: &'a Conf,
    container_id: &'a str,
    ifname: &'a str,
    ips: &'a [IpNetwork],
) -> rcni_ipmasq::Masq<'a> {
    rcni_ipmasq::Masq {
        network: &conf.network,
        container_id,
        ifname,
        ips,
    }
}

pub fn setup(
    host: &NetNs,
    conf: &Conf,
    cid: &str,
    ifname: &str,
    ips: &[IpNetwork],
) -> Result<(), CniError> {
    Ok(rcni_ipmasq::setup(
        host,
        backend(host, conf)?,
        &masq(conf, cid, ifname, ips),
    )?)
}

pub fn teardown(
    host: &NetNs,
    conf: &Conf,
    cid: &str,
    ifname: &str,
    ips: &[IpNetwork],
) -> Result<(), CniError> {
    Ok(rcni_ipmasq::teardown(host, &masq(conf, cid, ifname, ips))?)
}

pub fn check(
    host: &NetNs,
    conf: &Conf,
    cid: &str,
    ifname: &str,
    ips: &[IpNetwork],
) -> Result<(), CniError> {
    rcni_ipmasq::check(host, backend(host, conf)?, &masq(conf, cid, ifname, ips)).map_err(|e| {
        CniError::new(
            rcni_cni::ErrorCode::CheckFailed,
            format!("masquerade rules: {e}"),
        )
    })
}

pub fn gc(host: &NetNs, conf: &Conf, valid: &[(String, String)]) -> Result<(), CniError> {
    Ok(rcni_ipmasq::gc(host, &conf.network, valid)?)
}
