//! `fastpath`: a chained plugin, placed after `bridge` or `ptp`, that lets
//! traffic between pods of one network on one node skip the bridge,
//! netfilter and the routing path. ADD hooks the eBPF program (rcni-ebpf) to
//! the pod's host-side veth and registers the pod's addresses as endpoints;
//! a packet from one endpoint to another is then handed by
//! `bpf_redirect_peer` straight into the destination pod. Everything else
//! keeps the normal path, so the plugin can be added to and removed from a
//! network at any time.
//!
//! The fast path skips every netfilter hook of the node namespace: policy
//! for pod-to-pod traffic of a network using it must be enforced in BPF
//! (tcx programs attached in front of this one run first).
//!
//! It would also skip the qdiscs of both pods' host veths and the bridge:
//! a pod whose host veth is shaped (bandwidth) or an isolated bridge port
//! (portIsolation) is registered as keeping the normal path
//! ([`rcni_ebpf::EP_NORMAL_PATH`]), and nothing is redirected to it or from
//! it. ADD sees what plugins before it set up; bandwidth, run after it,
//! marks the pod itself.
//!
//! Run with arguments, the binary is an operator's tool instead: `fastpath
//! list` and `fastpath stats` (see [`cli`]).

pub mod cli;
mod conf;

use conf::Conf;
use rcni_attach::podveth;
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, ErrorCode};
use rcni_ebpf::{
    AttachmentId, Datapath, EP_FASTPATH, Endpoint, EndpointKey, Hook, PORT_FASTPATH, Program, bpffs,
};
use rcni_netlink::tc::Qdisc;
use rcni_netlink::{Link, Netlink};
use std::collections::BTreeSet;
use std::net::IpAddr;

pub struct Fastpath;

/// The binary's entry: an operator's subcommand or the CNI plugin.
pub fn main() -> ! {
    rcni_cni::skel::run_or_cli(&Fastpath, cli::run)
}

fn ebpf_err(e: rcni_ebpf::Error) -> CniError {
    CniError::new(ErrorCode::Ebpf, format!("fastpath: {e}"))
}

fn rt() -> Result<tokio::runtime::Runtime, CniError> {
    Ok(rcni_netlink::runtime()?)
}

/// The pod as this plugin sees it: its interface's host end and what the
/// datapath needs to deliver to it.
#[derive(Debug)]
struct Target {
    host_veth: Link,
    pod_mac: [u8; 6],
    /// The pod's gateway MAC: the bridge's when the host veth is a bridge
    /// port, else (ptp) the host veth's own.
    node_mac: [u8; 6],
    addrs: Vec<IpAddr>,
}

fn mac_of(l: &Link) -> Result<[u8; 6], CniError> {
    l.mac
        .map(|m| m.0)
        .ok_or_else(|| CniError::internal(format!("link {} has no MAC address", l.name)))
}

/// The pod's host veth (see [`podveth::find`]) and the MACs delivery needs.
fn find_target(args: &CmdArgs, prev: &CniResult) -> Result<Target, CniError> {
    let v = podveth::find(args, prev, "fastpath")?;
    let node_mac = match &v.master {
        Some(bridge) => mac_of(bridge)?,
        None => mac_of(&v.host_veth)?,
    };
    Ok(Target {
        pod_mac: mac_of(&v.pod_link)?,
        node_mac,
        host_veth: v.host_veth,
        addrs: v.addrs,
    })
}

/// Why the pod's traffic must keep the normal path, if it must: traffic
/// control on its host veth that a redirect would skip (a root qdisc:
/// bandwidth's TBF into the pod; an `ingress` qdisc: bandwidth's redirect
/// to an IFB, which runs after tcx programs), or isolation only the bridge
/// enforces (an isolated bridge port: portIsolation; firewall's `isolated`
/// rules in its `bridge` table). Seen in the kernel, so what the reference's
/// bandwidth plugin made counts too.
///
/// Also returns the veth's qdiscs, which ADD's choice of hook needs too
/// ([`Hook::for_attach`]).
fn normal_path_reason(
    args: &CmdArgs,
    veth: &Link,
) -> Result<(Option<String>, Vec<Qdisc>), CniError> {
    let (reason, qdiscs) = rt()?.block_on(async {
        let host = Netlink::connect_current().await?;
        let qdiscs = host.qdiscs(veth.index).await?;
        let reason = shaped_or_isolated(&host, veth, &qdiscs).await?;
        Ok::<_, CniError>((reason, qdiscs))
    })?;
    if reason.is_some() || veth.master.is_none() {
        return Ok((reason, qdiscs));
    }
    Ok((firewall_isolated(args, veth)?, qdiscs))
}

/// The kernel-side part of [`normal_path_reason`].
async fn shaped_or_isolated(
    host: &Netlink,
    veth: &Link,
    qdiscs: &[Qdisc],
) -> Result<Option<String>, CniError> {
    for q in qdiscs {
        // rcni bandwidth's shaping by departure time: deliveries pass it
        // (EP_SHAPED), the fast path stays.
        let edt = rcni_ebpf::shape::is_edt_fq(q);
        if q.parent == 0xffff_ffff && q.kind != "noqueue" && !edt {
            return Ok(Some(format!(
                "{} has a {} root qdisc (shaped)",
                veth.name, q.kind
            )));
        }
        if q.kind == "ingress" {
            return Ok(Some(format!(
                "{} has an ingress qdisc (shaped through an IFB)",
                veth.name
            )));
        }
    }
    // With the fast path on clsact (attachMode auto, tc) that clsact holds
    // bandwidth's redirect to the IFB instead of an ingress qdisc.
    if let Some(k) = host
        .ingress_filter_kinds(veth.index)
        .await?
        .into_iter()
        .find(|k| k != "bpf")
    {
        return Ok(Some(format!(
            "{} has a {k} filter on its ingress hook (shaped through an IFB)",
            veth.name
        )));
    }
    if veth.master.is_some() && host.bridge_port_isolated(veth.index).await? {
        return Ok(Some(format!("{} is an isolated bridge port", veth.name)));
    }
    Ok(None)
}

/// Whether firewall (ingressPolicy `isolated`, nftables) drops the bridge's
/// frames to and from this pod's port: its rules in `bridge cni_firewall`
/// carry the attachment's instance hash first in their comment.
fn firewall_isolated(args: &CmdArgs, veth: &Link) -> Result<Option<String>, CniError> {
    use rcni_netfilter::nfnl::{Nfnl, NftFamily};
    let rules = Nfnl::open(&rcni_netns::NetNs::current()?)
        .and_then(|mut nl| nl.nft_rules(NftFamily::Bridge, "cni_firewall"));
    let rules = match rules {
        Ok(r) => r.unwrap_or_default(),
        // No nf_tables in this kernel: no such rules either.
        Err(e)
            if matches!(
                e.errno(),
                Some(libc::EPROTONOSUPPORT) | Some(libc::EOPNOTSUPP) | Some(libc::EAFNOSUPPORT)
            ) =>
        {
            vec![]
        }
        Err(e) => return Err(e.into()),
    };
    let inst = rcni_netfilter::nft_instance_hash(&args.conf.name, &args.ifname, &args.container_id);
    let ours = rules.iter().any(|r| {
        r.comment
            .as_deref()
            .and_then(|c| c.strip_prefix(&inst))
            .is_some_and(|rest| rest.starts_with(' '))
    });
    Ok(ours.then(|| format!("firewall isolates {} (ingressPolicy isolated)", veth.name)))
}

fn required_prev(args: &CmdArgs) -> Result<CniResult, CniError> {
    args.conf.prev_result()?.ok_or_else(|| {
        CniError::config(
            "fastpath must be chained after a plugin that creates the pod's veth \
             (bridge, ptp): no prevResult",
        )
    })
}

/// Whether the program already sits on the target's veth. With `clear`
/// (ADD, tc mode) cls_bpf filters of an earlier copy of the program (the
/// network unloaded by GC and loaded afresh since) are removed first: their
/// maps are no longer the network's, so they must not keep redirecting.
fn attached(
    dp: &mut Datapath,
    conf: &Conf,
    id: AttachmentId,
    veth: &Link,
    clear: bool,
) -> Result<bool, CniError> {
    for &hook in Hook::accepted_for_fastpath(conf.attach_mode, veth.kind.as_deref()) {
        if attached_on(dp, conf, id, veth, clear, hook)? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// [`attached`] on one hook.
fn attached_on(
    dp: &mut Datapath,
    conf: &Conf,
    id: AttachmentId,
    veth: &Link,
    clear: bool,
    hook: Hook,
) -> Result<bool, CniError> {
    match hook {
        Hook::Tcx => {
            // Before rcni_pod ran on tcx: rcni_fastpath's own link.
            let pinned = conf.dir.join(id.link_pin()).exists();
            if pinned && dp.tcx_attached(&veth.name).map_err(ebpf_err)? {
                return Ok(true);
            }
            dp.pod_attached(&veth.name, PORT_FASTPATH).map_err(ebpf_err)
        }
        Hook::Netkit => {
            let pinned = conf.dir.join(id.link_pin()).exists();
            Ok(pinned && dp.netkit_attached(&veth.name).map_err(ebpf_err)?)
        }
        Hook::Tc => {
            let pod = dp.program_id_of(Program::Pod).map_err(ebpf_err)?;
            let filters = rt()?.block_on(async {
                Netlink::connect_current()
                    .await?
                    .ingress_bpf_filters(veth.index)
                    .await
            })?;
            let stale = filters.iter().any(|f| {
                matches!(
                    f.name.as_deref(),
                    Some(rcni_ebpf::PROGRAM) | Some(rcni_ebpf::POD_PROGRAM)
                ) && f.prog_id != Some(pod)
            });
            if clear && stale {
                // By name: ours too, if it is there (the policy plugin's
                // part stays in the port's entry); ADD attaches afresh.
                rcni_ebpf::detach_tc(&veth.name).map_err(ebpf_err)?;
                return Ok(false);
            }
            let on = filters.iter().any(|f| f.prog_id == Some(pod));
            let parts = dp.port_parts(veth.index).map_err(ebpf_err)?;
            Ok(on && parts & PORT_FASTPATH != 0)
        }
    }
}

/// Takes the fast path off: the tcx or netkit link pinned for `id`
/// (whatever the mode: cheap when absent) and, on clsact or tcx, its part
/// of `rcni_pod` on the veths with these indexes (the program with it,
/// unless the policy plugin's part is still there). Gone veths are fine.
fn detach(
    conf: &Conf,
    dp: Option<&mut Datapath>,
    id: AttachmentId,
    veths: &BTreeSet<u32>,
) -> Result<(), CniError> {
    rcni_ebpf::detach_tcx(&conf.dir, id).map_err(ebpf_err)?;
    if let Some(dp) = dp
        && conf.hook() != Hook::Netkit
    {
        for &i in veths {
            dp.release_pod(i, PORT_FASTPATH).map_err(ebpf_err)?;
        }
    }
    Ok(())
}

/// Takes the fast path's part out of the endpoints `owned` selects (the
/// policy plugin's part, if any, stays); returns their host veth indexes.
fn remove_endpoints(
    dp: &mut Datapath,
    owned: impl Fn(u64) -> bool,
) -> Result<BTreeSet<u32>, CniError> {
    let mut veths = BTreeSet::new();
    let mut keys = Vec::new();
    for (key, ep) in dp.endpoints().map_err(ebpf_err)? {
        if ep.flags & EP_FASTPATH != 0 && owned(ep.owner) {
            keys.push(key);
            veths.insert(ep.ifindex);
        }
    }
    if !keys.is_empty() {
        dp.remove_endpoints(&keys).map_err(ebpf_err)?;
    }
    Ok(veths)
}

impl Fastpath {
    fn add_inner(&self, args: &CmdArgs, conf: &Conf, prev: &CniResult) -> Result<(), CniError> {
        let target = find_target(args, prev)?;
        if target.addrs.is_empty() {
            eprintln!(
                "fastpath: prevResult has no address for {}: nothing to fast-path",
                args.ifname
            );
            return Ok(());
        }
        bpffs::ensure_root(&conf.pin_root).map_err(ebpf_err)?;
        let mut dp = Datapath::open_or_load(&conf.dir).map_err(ebpf_err)?;
        let id = AttachmentId::new(&args.container_id, &args.ifname);
        let keys: Vec<EndpointKey> = target.addrs.iter().map(|a| EndpointKey::new(*a)).collect();
        let (normal, qdiscs) = normal_path_reason(args, &target.host_veth)?;
        let kind = target.host_veth.kind.as_deref();
        let hook = Hook::for_fastpath(conf.attach_mode, &qdiscs, kind);
        if hook == Hook::Netkit && kind != Some("netkit") {
            return Err(CniError::config(format!(
                "fastpath: attachMode netkit needs a netkit pod interface ({} is a {}): \
                 linkType netkit in bridge or ptp, on Linux 6.7+",
                target.host_veth.name,
                kind.unwrap_or("link")
            )));
        }
        let ep = Endpoint::new(
            target.host_veth.index,
            target.pod_mac,
            target.node_mac,
            id.owner(),
        )
        .normal_path(normal.is_some())
        .netkit(hook == Hook::Netkit);
        let eps: Vec<(EndpointKey, Endpoint)> = keys.iter().map(|k| (*k, ep)).collect();
        let r = (|| -> Result<(), CniError> {
            dp.insert_endpoints(&eps).map_err(ebpf_err)?;
            if !attached(&mut dp, conf, id, &target.host_veth, true)? {
                dp.attach(&target.host_veth.name, id, hook)
                    .map_err(ebpf_err)?;
            }
            Ok(())
        })();
        if let Err(e) = r {
            // Undo: the endpoints first, so nothing is redirected into a
            // pod whose setup failed, then the attachment.
            if let Err(u) = dp.remove_endpoints(&keys) {
                eprintln!("rcni: undo endpoints: {u}");
            }
            let veth = BTreeSet::from([target.host_veth.index]);
            if let Err(u) = detach(conf, Some(&mut dp), id, &veth) {
                eprintln!("rcni: undo attachment: {u}");
            }
            return Err(e);
        }
        Ok(())
    }

    fn check_inner(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        let prev = required_prev(args)?;
        let target = find_target(args, &prev)?;
        if target.addrs.is_empty() {
            return Ok(());
        }
        let mut dp = Datapath::open(&conf.dir)
            .map_err(ebpf_err)?
            .ok_or_else(|| {
                CniError::check_failed(format!(
                    "fastpath: no program pinned in {}",
                    conf.dir.display()
                ))
            })?;
        let id = AttachmentId::new(&args.container_id, &args.ifname);
        let (normal, qdiscs) = normal_path_reason(args, &target.host_veth)?;
        let kind = target.host_veth.kind.as_deref();
        let netkit = Hook::for_fastpath(conf.attach_mode, &qdiscs, kind) == Hook::Netkit;
        for a in &target.addrs {
            let Some(ep) = dp.endpoint(&EndpointKey::new(*a)).map_err(ebpf_err)? else {
                return Err(CniError::check_failed(format!(
                    "fastpath: endpoint {a} missing"
                )));
            };
            let want = Endpoint::new(
                target.host_veth.index,
                target.pod_mac,
                target.node_mac,
                id.owner(),
            )
            .normal_path(normal.is_some())
            .netkit(netkit);
            if let Some(why) = &normal
                && ep.same_as(&want.normal_path(false))
            {
                return Err(CniError::check_failed(format!(
                    "fastpath: endpoint {a} is redirected although {why}: the fast path skips that \
                     (chain that plugin before fastpath; rcni's bandwidth also takes the pod \
                     off the fast path when chained after it)"
                )));
            }
            if !ep.same_as(&want) {
                return Err(CniError::check_failed(format!(
                    "fastpath: endpoint {a} is {}, expected {}",
                    cli::describe(&ep),
                    cli::describe(&want)
                )));
            }
        }
        if !attached(&mut dp, conf, id, &target.host_veth, false)? {
            return Err(CniError::check_failed(format!(
                "fastpath: program not attached ({}) to {}",
                conf.hook().name(),
                target.host_veth.name
            )));
        }
        Ok(())
    }
}

impl Plugin for Fastpath {
    fn about(&self) -> About {
        About::all_versions("fastpath", env!("CARGO_PKG_VERSION"))
    }

    /// Attaches and registers the pod; passes prevResult through unchanged.
    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let conf = Conf::load(args)?;
        let prev = required_prev(args)?;
        match self.add_inner(args, &conf, &prev) {
            Ok(()) => Ok(prev),
            Err(e) if conf.best_effort && e.code == ErrorCode::Ebpf.code() => {
                eprintln!("{e}; bestEffort: the pod uses the normal path");
                Ok(prev)
            }
            Err(e) => Err(e),
        }
    }

    /// Removes the attachment's endpoints and its hook; anything already
    /// gone (netns, veth, pins, the whole bpffs) is success.
    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let id = AttachmentId::new(&args.container_id, &args.ifname);
        let mut errors = Vec::new();
        let mut veths = BTreeSet::new();
        let mut dp = match Datapath::open(&conf.dir) {
            Ok(Some(mut dp)) => {
                match remove_endpoints(&mut dp, |o| o == id.owner()) {
                    Ok(v) => veths = v,
                    Err(e) => errors.push(e),
                }
                Some(dp)
            }
            Ok(None) => None,
            // Another version's maps: nothing this build can take out of
            // them, and DEL must not fail for ever. The hook still goes.
            Err(e) if e.is_incompatible() => {
                eprintln!("fastpath: {e}");
                None
            }
            Err(e) => {
                errors.push(ebpf_err(e));
                None
            }
        };
        if let Err(e) = detach(&conf, dp.as_mut(), id, &veths) {
            errors.push(e);
        }
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        self.check_inner(args, &conf)
    }

    /// Ready when the network's program is pinned, or the kernel accepts a
    /// fresh copy (verifier, privileges) and the pin root is usable.
    fn status(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        if conf.best_effort {
            return Ok(());
        }
        let unavailable =
            |why: String| CniError::new(ErrorCode::PluginNotAvailable, format!("fastpath: {why}"));
        if let Ok(Some(_)) = Datapath::open(&conf.dir) {
            return Ok(());
        }
        if let Err(e) = bpffs::check_root(&conf.pin_root) {
            return Err(unavailable(e.to_string()));
        }
        match Datapath::load() {
            Ok(_) => Ok(()),
            Err(e) if e.is_permission() => Err(unavailable(format!(
                "not allowed to load eBPF programs (needs CAP_BPF and CAP_NET_ADMIN): {e}"
            ))),
            Err(e) => Err(unavailable(format!(
                "the kernel cannot load the fast path program: {e}"
            ))),
        }
    }

    /// Removes the endpoints and links of attachments not in the valid set;
    /// with none left, the network's program and maps too.
    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let valid: BTreeSet<u64> = args
            .conf
            .gc_required_valid_attachments("removes")?
            .iter()
            .map(|a| AttachmentId::new(&a.container_id, &a.ifname).owner())
            .collect();
        let mut errors = Vec::new();
        let mut veths = BTreeSet::new();
        let mut left = 0;
        match Datapath::open(&conf.dir) {
            Ok(Some(mut dp)) => {
                match remove_endpoints(&mut dp, |o| !valid.contains(&o)) {
                    Ok(v) => veths = v,
                    Err(e) => errors.push(e),
                }
                if conf.hook() != Hook::Netkit {
                    for &i in &veths {
                        if let Err(e) = dp.release_pod(i, PORT_FASTPATH) {
                            errors.push(ebpf_err(e));
                        }
                    }
                }
                // Veths gone without a DEL: their rcni_pod entries.
                if let Err(e) = dp.sweep_ports() {
                    errors.push(ebpf_err(e));
                }
                left = dp.endpoints().map(|v| v.len()).unwrap_or(1);
            }
            Ok(None) => {}
            Err(e) => errors.push(ebpf_err(e)),
        }
        let links = rcni_ebpf::pinned_links(&conf.dir).unwrap_or_else(|e| {
            errors.push(ebpf_err(e));
            vec![]
        });
        let mut links_left = 0;
        for id in links {
            if valid.contains(&id.owner()) {
                links_left += 1;
            } else if let Err(e) = rcni_ebpf::detach_tcx(&conf.dir, id) {
                errors.push(ebpf_err(e));
            }
        }
        // The policy plugin's links are its own to collect, but while there
        // are any the network's programs are in use; so are the ports'
        // rcni_pod links on tcx (the policy plugin's part may be there).
        links_left += rcni_ebpf::pinned_policy_links(&conf.dir)
            .map(|v| v.len())
            .unwrap_or(1);
        links_left += rcni_ebpf::pinned_port_links(&conf.dir)
            .map(|v| v.len())
            .unwrap_or(1);
        // So are rcni-node's (its program on the uplink and VXLAN devices,
        // with its other-node map): a node without pods still forwards.
        links_left += rcni_ebpf::net_links(&conf.dir)
            .map(|v| v.len())
            .unwrap_or(1);
        // GC runs alone (no ADD in flight): with nothing left (endpoints of
        // either plugin, links) the network's programs and maps go too, and
        // the next ADD loads them afresh.
        if errors.is_empty()
            && left == 0
            && links_left == 0
            && let Err(e) = rcni_ebpf::remove_network(&conf.dir)
        {
            errors.push(ebpf_err(e));
        }
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rcni_attach::podveth::{container_iface, host_side_names, pod_addrs};
    use rcni_cni::{CniArgs, Command, NetConf};
    use serde_json::json;

    pub(crate) fn args(v: &serde_json::Value) -> CmdArgs {
        let stdin = serde_json::to_vec(v).unwrap();
        CmdArgs {
            command: Command::Add,
            container_id: "c".into(),
            netns: None,
            ifname: "eth0".into(),
            args: CniArgs::default(),
            args_raw: String::new(),
            path: vec![],
            conf: NetConf::parse(&stdin).unwrap(),
            stdin,
        }
    }

    fn result(v: serde_json::Value) -> CniResult {
        CniResult::from_value(&v, "1.1.0").unwrap()
    }

    #[test]
    fn picks_the_pods_addresses_from_a_bridge_result() {
        let r = result(json!({"cniVersion":"1.1.0",
            "interfaces":[{"name":"cni0","mac":"aa:aa:aa:aa:aa:aa"},
                          {"name":"veth1","mac":"bb:bb:bb:bb:bb:bb"},
                          {"name":"eth0","mac":"cc:cc:cc:cc:cc:cc","sandbox":"/run/netns/p"},
                          {"name":"eth1","sandbox":"/run/netns/p"}],
            "ips":[{"address":"10.88.0.5/24","interface":2,"gateway":"10.88.0.1"},
                   {"address":"fd88::5/64","interface":2},
                   {"address":"10.99.0.5/24","interface":3}]}));
        assert_eq!(container_iface(&r, "eth0"), Some(2));
        assert_eq!(container_iface(&r, "veth1"), None, "not in a sandbox");
        let a: Vec<String> = pod_addrs(&r, "eth0")
            .iter()
            .map(|a| a.to_string())
            .collect();
        assert_eq!(a, ["10.88.0.5", "fd88::5"]);
        assert_eq!(host_side_names(&r), ["cni0", "veth1"]);
    }

    #[test]
    fn addresses_without_an_interface_belong_to_the_pod() {
        // A 0.2.0-era result: no interfaces, no indexes.
        let r = result(json!({"cniVersion":"1.1.0","ips":[{"address":"10.1.0.9/16"}]}));
        assert_eq!(
            pod_addrs(&r, "eth0"),
            vec!["10.1.0.9".parse::<IpAddr>().unwrap()]
        );
        assert!(host_side_names(&r).is_empty());
        let none = result(json!({"cniVersion":"1.1.0","ips":[]}));
        assert!(pod_addrs(&none, "eth0").is_empty());
    }

    #[test]
    fn add_without_prev_result_is_a_config_error() {
        let a = args(&json!({"cniVersion":"1.1.0","name":"n","type":"fastpath"}));
        let e = Fastpath.add(&a).unwrap_err();
        assert_eq!(e.code, 7);
        assert!(e.msg.contains("prevResult"), "{}", e.msg);
    }

    #[test]
    fn gc_without_the_valid_set_is_refused() {
        let mut a = args(&json!({"cniVersion":"1.1.0","name":"n","type":"fastpath",
            "pinRoot":"/nonexistent/rcni"}));
        a.command = Command::Gc;
        assert_eq!(Fastpath.gc(&a).unwrap_err().code, 7);
    }
}
