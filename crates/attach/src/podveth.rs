//! The pod's veth as chained plugins find it (fastpath, policy): the pod's
//! interface, its peer in the node namespace and that peer's master,
//! checked against what prevResult says.

use rcni_cni::skel::CmdArgs;
use rcni_cni::{CniError, CniResult, ErrorCode};
use rcni_netlink::{Link, Netlink};
use rcni_netns::NetNs;
use std::net::IpAddr;

#[derive(Debug)]
pub struct PodVeth {
    /// The pod's interface (in the pod's namespace).
    pub pod_link: Link,
    /// Its peer, in the node namespace (the caller's).
    pub host_veth: Link,
    /// The host veth's master (the bridge), if it has one.
    pub master: Option<Link>,
    /// The pod's addresses from prevResult.
    pub addrs: Vec<IpAddr>,
}

/// The index of the pod's interface in `prev` (named `ifname`, in a
/// sandbox), if the result lists interfaces.
pub fn container_iface(prev: &CniResult, ifname: &str) -> Option<usize> {
    prev.interfaces
        .iter()
        .position(|i| i.name == ifname && !i.sandbox.is_empty())
}

/// The pod's addresses in `prev`: those of its interface, or all when the
/// result does not say which interface an address belongs to.
pub fn pod_addrs(prev: &CniResult, ifname: &str) -> Vec<IpAddr> {
    let idx = container_iface(prev, ifname);
    let mut v: Vec<IpAddr> = prev
        .ips
        .iter()
        .filter(|ip| ip.interface.is_none() || ip.interface == idx)
        .map(|ip| ip.address.ip())
        .collect();
    v.sort();
    v.dedup();
    v
}

/// Names of the node-side interfaces in `prev` (no sandbox).
pub fn host_side_names(prev: &CniResult) -> Vec<&str> {
    prev.interfaces
        .iter()
        .filter(|i| i.sandbox.is_empty())
        .map(|i| i.name.as_str())
        .collect()
}

/// Finds the pod's host veth through its interface's veth peer, checked
/// against the node-side interfaces prevResult names. `plugin` prefixes
/// the messages.
pub fn find(args: &CmdArgs, prev: &CniResult, plugin: &str) -> Result<PodVeth, CniError> {
    let addrs = pod_addrs(prev, &args.ifname);
    let netns = args.netns.as_ref().ok_or_else(|| {
        CniError::new(ErrorCode::InvalidEnvironmentVariables, "CNI_NETNS missing")
    })?;
    let ct_ns = NetNs::open(netns)?;
    let host_ns = NetNs::current()?;
    let (pod_link, host_veth, master) = crate::rt()?.block_on(async {
        let ct = Netlink::connect(&ct_ns).await?;
        let host = Netlink::connect(&host_ns).await?;
        let ct_link = ct.link_by_name(&args.ifname).await?;
        let not_veth = |what: &str| {
            CniError::config(format!(
                "{plugin}: {what} is not a veth: chain {plugin} after bridge or ptp"
            ))
        };
        if !crate::is_pair_kind(ct_link.kind.as_deref()) {
            return Err(not_veth(&format!("pod interface {}", args.ifname)));
        }
        let peer = ct_link
            .link
            .ok_or_else(|| not_veth(&format!("pod interface {}", args.ifname)))?;
        let host_veth = host.link_by_index(peer).await.map_err(|_| {
            CniError::config(format!(
                "{plugin}: the peer of {} (index {peer}) is not in this (the node's) namespace",
                args.ifname
            ))
        })?;
        if !crate::is_pair_kind(host_veth.kind.as_deref()) || host_veth.link != Some(ct_link.index)
        {
            return Err(CniError::config(format!(
                "{plugin}: link {} of the node is not the peer of pod interface {}",
                host_veth.name, args.ifname
            )));
        }
        let master = match host_veth.master {
            Some(m) => Some(host.link_by_index(m).await?),
            None => None,
        };
        Ok::<_, CniError>((ct_link, host_veth, master))
    })?;
    let names = host_side_names(prev);
    if !names.is_empty() && !names.contains(&host_veth.name.as_str()) {
        return Err(CniError::config(format!(
            "{plugin}: the host veth of {} is {}, which prevResult does not list (it lists {})",
            args.ifname,
            host_veth.name,
            names.join(", ")
        )));
    }
    Ok(PodVeth {
        pod_link,
        host_veth,
        master,
        addrs,
    })
}
