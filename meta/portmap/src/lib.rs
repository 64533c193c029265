//! `portmap`: host ports forwarded to a container, as a chained plugin.
//!
//! The mappings come from the `portMappings` capability; the container's
//! first IPv4 and first IPv6 address from prevResult. Two backends:
//! nftables (the default where `nft` is installed; every call is one
//! nfnetlink transaction without a process, `nft -f -` only when
//! conditions, nft rule text, must be parsed), and
//! iptables in the reference's exact layout (one `iptables-restore` per
//! family). Stale UDP conntrack entries of the mapped ports are flushed
//! over netlink on ADD and DEL.
//!
//! Better than the reference: DEL removes the attachment's rules of both
//! backends even when it carries no portMappings (the reference returns
//! early and leaks them), and also flushes UDP conntrack; GC exists; CHECK
//! fails with a code of its own.

pub mod backend;
pub mod conf;
pub mod ipt;
pub mod nft;

use backend::Ctx;
use conf::{Conf, Proto, container_ips};
use ipnetwork::IpNetwork;
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult};
use rcni_netfilter::nfnl::{IPPROTO_UDP, Nfnl};
use rcni_netlink::{Netlink, TABLE_MAIN};
use rcni_netns::NetNs;
use std::collections::BTreeSet;
use std::net::IpAddr;

pub struct Portmap;

fn owner(args: &CmdArgs) -> nft::Owner<'_> {
    nft::Owner {
        network: &args.conf.name,
        ifname: &args.ifname,
        container_id: &args.container_id,
    }
}

/// Lets 127.0.0.0/8 sources cross into the container's link
/// (`route_localnet`), so `127.0.0.1:<hostPort>` works: set on the host
/// interface that routes to the container, as the reference does.
fn enable_localnet_routing(ns: &NetNs, container: IpAddr) -> Result<(), CniError> {
    let rt = rcni_netlink::runtime()?;
    let ifname = rt.block_on(async {
        let nl = Netlink::connect(ns).await?;
        let routes = nl.routes(rcni_netlink::Family::V4).await?;
        let best = routes
            .iter()
            .filter(|r| r.table == TABLE_MAIN && r.oif.is_some() && r.dst.contains(container))
            .max_by_key(|r| r.dst.prefix());
        match best.and_then(|r| r.oif) {
            Some(index) => Ok::<_, CniError>(Some(nl.link_by_index(index).await?.name)),
            None => Ok(None),
        }
    })?;
    if let Some(name) = ifname {
        rcni_netlink::sysctl::set(ns, &format!("net/ipv4/conf/{name}/route_localnet"), "1")
            .map_err(|e| CniError::from(e).context("unable to enable route_localnet"))?;
    }
    Ok(())
}

/// Deletes UDP conntrack entries that would keep sending a mapped port's
/// datagrams to where they went before the rules changed (plugins #123):
/// entries to one of the mapped UDP `ports` (on DEL only those answered by
/// one of `container_ips`, the deleted container's). Nothing to do without UDP mappings: a dump
/// walks the node's whole conntrack table (all namespaces share it), which
/// costs milliseconds on a busy node.
fn flush_udp_conntrack(ns: &NetNs, ports: &BTreeSet<u16>, container_ips: &[IpAddr]) {
    if ports.is_empty() {
        return;
    }
    let r = Nfnl::open(ns).and_then(|mut nl| {
        nl.conntrack_delete_where(|f| {
            f.proto == IPPROTO_UDP
                && ports.contains(&f.dport)
                && (container_ips.is_empty()
                    || f.reply_src.is_some_and(|s| container_ips.contains(&s)))
        })
    });
    // Informative only, as in the reference: the rules are in place.
    if let Err(e) = r {
        eprintln!("portmap: failed to delete stale UDP conntrack entries: {e}");
    }
}

fn udp_ports(conf: &Conf) -> BTreeSet<u16> {
    conf.mappings
        .iter()
        .filter(|m| m.proto == Proto::Udp)
        .map(|m| m.host_port)
        .collect()
}

impl Plugin for Portmap {
    fn about(&self) -> About {
        About::all_versions("portmap", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let conf = Conf::load(args)?;
        let prev = args
            .conf
            .required_prev_result("must be called as chained plugin")?;
        if conf.mappings.is_empty() {
            return Ok(prev);
        }
        let (v4, v6) = container_ips(&prev, &args.ifname);
        let ips: Vec<IpNetwork> = [v4, v6].into_iter().flatten().collect();
        if ips.is_empty() {
            return Ok(prev);
        }
        let ns = NetNs::current()?;
        if conf.snat
            && let Some(v4) = v4
        {
            enable_localnet_routing(&ns, v4.ip())?;
        }
        let ctx = Ctx::new(&ns, owner(args));
        backend::select(&ns, &conf).add(&ctx, &conf, &ips)?;
        // After the rules, so new datagrams take the new path.
        flush_udp_conntrack(&ns, &udp_ports(&conf), &[]);
        Ok(prev)
    }

    /// Removes the attachment's rules from both backends, whatever the
    /// config says now and even without portMappings; each step runs even
    /// if an earlier one failed.
    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let ns = NetNs::current()?;
        let ctx = Ctx::new(&ns, owner(args));
        let removed = rcni_cni::first_error(backend::ALL.map(|b| b.del(&ctx)));
        let container: Vec<IpAddr> = args
            .conf
            .prev_result()
            .ok()
            .flatten()
            .map(|p| {
                let (a, b) = container_ips(&p, &args.ifname);
                [a, b].into_iter().flatten().map(|n| n.ip()).collect()
            })
            .unwrap_or_default();
        flush_udp_conntrack(&ns, &udp_ports(&conf), &container);
        removed
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let prev = args
            .conf
            .required_prev_result("Required prevResult missing")?;
        if conf.mappings.is_empty() {
            return Ok(());
        }
        let (v4, v6) = container_ips(&prev, &args.ifname);
        let ips: Vec<IpNetwork> = [v4, v6].into_iter().flatten().collect();
        let ns = NetNs::current()?;
        let ctx = Ctx::new(&ns, owner(args));
        let problems = backend::select(&ns, &conf).check(&ctx, &conf, &ips)?;
        CniError::check_problems("portmap rules", &problems)
    }

    /// Removes the rules of this network's attachments that are not in the
    /// valid set, in both backends.
    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        let valid = args.conf.gc_valid_pairs();
        let ns = NetNs::current()?;
        let ctx = Ctx::new(&ns, owner(args));
        rcni_cni::first_error(backend::ALL.map(|b| b.gc(&ctx, &valid)))
    }
}
