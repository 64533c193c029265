//! The backends' halves of the plugin's steps: choosing one, and the eBPF
//! datapath's programs and leftovers.

use crate::conf::{Backend, Conf};
use crate::state::{Locked, PodRecord, State};
use crate::{ebpf, nft};
use rcni_cni::{CniError, ErrorCode};
use rcni_ebpf::{AttachmentId, Datapath, EndpointKey, bpffs};
use std::collections::BTreeSet;

/// The eBPF backend's datapath, loaded and pinned on first use.
pub(crate) fn datapath(conf: &Conf) -> Result<Datapath, CniError> {
    bpffs::ensure_root(&conf.pin_root).map_err(ebpf::err)?;
    Datapath::open_or_load(&conf.pin_dir).map_err(ebpf::err)
}

/// The backend a network uses: the one its pods already use, else the
/// config's, else (auto) eBPF where it loads and nftables otherwise. The
/// datapath auto loaded comes along, so ADD does not open it twice.
pub(crate) fn choose_backend(
    conf: &Conf,
    st: &State,
    network: &str,
) -> Result<(Backend, Option<Datapath>), CniError> {
    let current = st
        .backend
        .as_deref()
        .and_then(Backend::parse)
        .filter(|_| !st.pods.is_empty());
    match (current, conf.backend) {
        (Some(cur), Some(want)) if cur != want => Err(CniError::config(format!(
            "policy: network {network} enforces with backend {} for its {} pods; \
             backend {} applies once they are gone",
            cur.as_str(),
            st.pods.len(),
            want.as_str()
        ))),
        (Some(cur), _) => Ok((cur, None)),
        (None, Some(want)) => Ok((want, None)),
        (None, None) => match datapath(conf) {
            Ok(dp) => Ok((Backend::Ebpf, Some(dp))),
            Err(ebpf_err) => match nft::available() {
                Ok(()) => {
                    eprintln!("policy: eBPF unavailable ({ebpf_err}); using nftables");
                    Ok((Backend::Nftables, None))
                }
                Err(nft_err) => Err(CniError::new(
                    ErrorCode::Ebpf,
                    format!(
                        "policy: no backend works here: {}; {}",
                        ebpf_err.msg, nft_err.msg
                    ),
                )),
            },
        },
    }
}

/// The node's own addresses (the namespace the plugin runs in): traffic
/// between a pod and its node always passes. IPv6 link-local ones are left
/// out: the programs never check link-local traffic, and there is one per
/// host veth.
pub(crate) fn node_addrs() -> Result<Vec<std::net::IpAddr>, CniError> {
    let addrs = rcni_attach::rt()?.block_on(async {
        rcni_netlink::Netlink::connect_current()
            .await?
            .addresses(None)
            .await
    })?;
    let mut v: Vec<std::net::IpAddr> = addrs
        .iter()
        .map(|a| a.addr.ip())
        .filter(|ip| !matches!(ip, std::net::IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80))
        .collect();
    v.sort();
    v.dedup();
    Ok(v)
}

pub(crate) fn attachment(p: &PodRecord) -> AttachmentId {
    AttachmentId::new(&p.container_id, &p.ifname)
}

pub(crate) fn attach_programs(
    dp: &mut Datapath,
    conf: &Conf,
    p: &PodRecord,
) -> Result<(), CniError> {
    let id = attachment(p);
    if !dp
        .policy_attached(&conf.pin_dir, &p.host_ifname, id, conf.hook())
        .map_err(ebpf::err)?
    {
        dp.attach_policy(&p.host_ifname, id, conf.hook())
            .map_err(ebpf::err)?;
    }
    Ok(())
}

/// Takes the programs off a pod's veth; a gone veth or link is fine.
pub(crate) fn detach_programs(conf: &Conf, p: &PodRecord) -> Result<(), CniError> {
    rcni_ebpf::detach_policy(&conf.pin_dir, attachment(p), &p.host_ifname).map_err(ebpf::err)
}

/// nftables cannot see what fastpath redirects: refuse to pretend.
pub(crate) fn refuse_fastpath(conf: &Conf, addrs: &[std::net::IpAddr]) -> Result<(), CniError> {
    let Ok(Some(dp)) = Datapath::open(&conf.pin_dir) else {
        return Ok(());
    };
    for a in addrs {
        if let Ok(Some(ep)) = dp.endpoint(&EndpointKey::new(*a))
            && ep.flags & rcni_ebpf::EP_FASTPATH != 0
        {
            return Err(CniError::config(format!(
                "policy: backend nftables cannot see traffic that fastpath redirects past \
                 netfilter ({a} is a fastpath endpoint); use backend ebpf"
            )));
        }
    }
    Ok(())
}

/// Clears policy entries of endpoints whose owner `doomed` selects, left by
/// an attachment the state no longer knows (a crash between writes).
pub(crate) fn sweep_where(conf: &Conf, doomed: impl Fn(u64) -> bool) -> Result<usize, CniError> {
    let Some(mut dp) = Datapath::open(&conf.pin_dir).map_err(ebpf::err)? else {
        return Ok(0);
    };
    let mut by_owner: std::collections::BTreeMap<u64, Vec<EndpointKey>> = Default::default();
    for (k, ep) in dp.endpoints().map_err(ebpf::err)? {
        if ep.flags & rcni_ebpf::EP_POLICY != 0 && doomed(ep.owner) {
            by_owner.entry(ep.owner).or_default().push(k);
        }
    }
    let mut n = 0;
    for (owner, keys) in by_owner {
        n += keys.len();
        dp.clear_policy_endpoint(&keys, owner).map_err(ebpf::err)?;
        let addrs: BTreeSet<EndpointKey> = keys.into_iter().collect();
        dp.flush_ct(|k| addrs.contains(&k.src()) || addrs.contains(&k.dst()))
            .map_err(ebpf::err)?;
    }
    Ok(n)
}

/// An attachment the state does not know (its ADD killed before the state
/// was saved): its endpoint entries cleared and its tcx links (pinned by
/// attachment id) taken off, so nothing of it keeps the network's
/// datapath in use.
pub(crate) fn sweep_owner(conf: &Conf, id: AttachmentId) {
    let owner = id.owner();
    if let Err(e) = sweep_where(conf, |o| o == owner) {
        eprintln!("policy: {}", e.msg);
    }
    if let Err(e) = rcni_ebpf::detach_policy_links_except(&conf.pin_dir, |l| l != id) {
        eprintln!("policy: {}", ebpf::err(e).msg);
    }
}

/// [`ebpf::sweep_rules`] for a network whose state directory exists (an
/// ADD got as far as locking it), under its lock; a network never added
/// to gets nothing made for it.
pub(crate) fn sweep_rules(
    conf: &Conf,
    network: &str,
    locked: Option<&Locked>,
) -> Result<(), CniError> {
    let owned;
    let locked = match locked {
        Some(l) => l,
        None if conf.data_dir.join(network).is_dir() => {
            owned = Locked::open(&conf.data_dir, network)?;
            &owned
        }
        None => return Ok(()),
    };
    if locked.state.backend() != Backend::Ebpf {
        return Ok(());
    }
    let Some(mut dp) = Datapath::open(&conf.pin_dir).map_err(ebpf::err)? else {
        return Ok(());
    };
    let no_pods = locked.state.pods.is_empty();
    ebpf::sweep_rules(&mut dp, &locked.state.applied, no_pods).map(|_| ())
}
