//! `firewall`: lets a container's traffic through the node's forward
//! filtering, with an admin chain for the operator's overrides and an
//! ingress policy between bridges, as a chained plugin.
//!
//! Backends ([`backend::FirewallBackend`]): firewalld over D-Bus and
//! iptables in the reference's exact layout, chosen as the reference
//! chooses (firewalld when it runs, else iptables), and a native nftables
//! one over nfnetlink without a process (the reference has none) when the
//! config says `"backend": "nftables"` (except where iptables' FORWARD
//! drops: see [`backend::select`]) or iptables does not work.
//!
//! Better than the reference: the nftables backend; DEL and GC remove the
//! nftables rules without prevResult; the shared same-bridge isolation
//! rules go with the bridge's last attachment that needed them in nftables
//! (the reference never removes them); `isolated` works without
//! `br_netfilter` in the nftables backend; CHECK fails with a code of its
//! own, and on firewalld it looks at the zone's answer (the reference's
//! passes whenever firewalld answers); one restore per family instead of
//! about 25 `iptables` processes.

pub mod backend;
pub mod conf;
pub mod firewalld;
pub mod ipt;
pub mod nft;

use backend::Ctx;
use conf::{Conf, IngressPolicy, addresses, bridge};
use ipnetwork::IpNetwork;
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult};
use rcni_netfilter::nfnl::Nfnl;
use rcni_netns::NetNs;

pub struct Firewall;

/// The reference supports 0.4.0 and later (CHECK exists from there).
const VERSIONS: &[&str] = &["0.4.0", "1.0.0", "1.1.0"];

/// The pod's port on the bridge: the result's host-side interface that is
/// not the bridge (bridge lists `[bridge, host veth, container]`).
fn host_port(prev: &CniResult) -> Option<&str> {
    let bridge = prev.interfaces.first()?;
    prev.interfaces[1..]
        .iter()
        .find(|i| i.sandbox.is_empty() && i.name != bridge.name)
        .map(|i| i.name.as_str())
}

fn attachment<'a>(
    args: &'a CmdArgs,
    conf: &Conf,
    prev: Option<&'a CniResult>,
) -> Result<nft::Attachment<'a>, CniError> {
    let (bridge, port) = match prev {
        Some(p) => (bridge(p, conf.policy)?, host_port(p)),
        None => (None, None),
    };
    if conf.policy == IngressPolicy::Isolated && port.is_none() {
        return Err(CniError::config(
            "ingressPolicy \"isolated\" needs the pod's host-side interface in prevResult: chain \"firewall\" after \"bridge\"",
        ));
    }
    Ok(nft::Attachment {
        network: &args.conf.name,
        ifname: &args.ifname,
        container_id: &args.container_id,
        bridge,
        policy: conf.policy,
        host_port: port,
    })
}

/// The global addresses of the pod's interface: what a DEL without
/// prevResult removes the iptables rules of. Those rules carry nothing but
/// the address, and a runtime has no cached result to pass after an ADD it
/// lost (killed between firewall's ADD and the end of the chain); the
/// interface is still there then, since DEL runs the chain in reverse and
/// the main plugin removes it only after firewall. None when the namespace
/// or the interface is gone.
fn pod_addresses(args: &CmdArgs) -> Vec<IpNetwork> {
    let Some(pod) = args.netns.as_deref().and_then(|p| NetNs::open(p).ok()) else {
        return Vec::new();
    };
    let Ok(rt) = rcni_netlink::runtime() else {
        return Vec::new();
    };
    rt.block_on(async {
        let nl = rcni_netlink::Netlink::connect(&pod).await.ok()?;
        let link = nl.find_link(&args.ifname).await.ok()??;
        let addrs = nl.addresses(Some(link.index)).await.ok()?;
        // Universe scope: not the IPv6 link-local address, which has no rules.
        Some(
            addrs
                .into_iter()
                .filter(|a| a.scope == 0)
                .map(|a| a.addr)
                .collect(),
        )
    })
    .unwrap_or_default()
}

impl Plugin for Firewall {
    fn about(&self) -> About {
        About {
            name: "firewall",
            version: env!("CARGO_PKG_VERSION"),
            supported_versions: VERSIONS,
        }
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let conf = Conf::load(args)?;
        let prev = args
            .conf
            .required_prev_result("missing prevResult from earlier plugin")?;
        let a = attachment(args, &conf, Some(&prev))?;
        let ns = NetNs::current()?;
        let ctx = Ctx::new(&ns, &conf, a, addresses(&prev));
        backend::select(&ctx)?.add(&ctx)?;
        Ok(prev)
    }

    /// Removes the attachment's nftables rules (found by comment, no
    /// prevResult needed) and its iptables rules (found by the addresses
    /// of prevResult, as the reference, or without one by the addresses
    /// the pod's interface still has), whatever backend the config names
    /// now, and those addresses from the firewalld zone where firewalld
    /// runs and the config lets it be chosen. Keeps going past a failure.
    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let prev = args.conf.prev_result().ok().flatten();
        let ns = NetNs::current()?;
        let a = nft::Attachment {
            network: &args.conf.name,
            ifname: &args.ifname,
            container_id: &args.container_id,
            bridge: None,
            policy: conf.policy,
            host_port: None,
        };
        let ips = match &prev {
            Some(prev) => addresses(prev),
            None => pod_addresses(args),
        };
        let ctx = Ctx::new(&ns, &conf, a, ips);
        let mut first = None;
        for b in backend::for_del(&conf)? {
            if let Err(e) = b.del(&ctx) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let prev = args
            .conf
            .required_prev_result("missing prevResult from earlier plugin")?;
        let a = attachment(args, &conf, Some(&prev))?;
        let ns = NetNs::current()?;
        let ctx = Ctx::new(&ns, &conf, a, addresses(&prev));
        let problems = backend::select(&ctx)?.check(&ctx)?;
        CniError::check_problems("firewall rules", &problems)
    }

    /// Removes the nftables rules of this network's attachments that are
    /// not valid any more. (The reference's iptables layout has nothing
    /// that ties a rule to an attachment.)
    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        let valid = args.conf.gc_valid_pairs();
        let ns = NetNs::current()?;
        nft::gc(&mut Nfnl::open(&ns)?, &args.conf.name, &valid)
    }
}
