//! `bandwidth`: rate limits on a veth attachment, as a chained plugin.
//!
//! Ingress (towards the container): a token bucket (TBF) as the root qdisc
//! of the host-side veth. Egress (from the container): the host veth's
//! ingress qdisc redirects everything (u32 match-all, mirred) to an IFB
//! device `bwp<hash(network+containerID)>`, whose root qdisc is a TBF; the
//! IFB is added to the result's interfaces. All of it over netlink, with
//! the reference's names and TBF parameters (latency 25 ms), so either
//! implementation checks and removes what the other made.
//!
//! Better than the reference: DEL also removes the qdiscs from a host veth
//! that outlives the attachment; GC removes IFBs of stale attachments
//! (found by the alias ours carry); a failed ADD removes what it made;
//! CHECK fails with a code of its own.
//!
//! With rcni's `fastpath` earlier in the chain, its eBPF program would skip
//! both TBFs (it redirects the pod's packets on the host veth's ingress
//! hook, ahead of the ingress qdisc, and delivers into pods past their host
//! veth's root qdisc). So there ADD shapes by earliest departure time
//! instead, as Cilium's bandwidth manager does, and the pod keeps the fast
//! path ([`rcni_ebpf::shape`]): egress by an fq root qdisc on the pod's own
//! interface and `rcni_edt` on its egress hook, which stamps each packet
//! with the time it may leave; ingress the same on the host veth, with the
//! pod's endpoints marked `EP_SHAPED`, so that the fast path delivers to
//! them through that hook and qdisc. No IFB then (the result lists none; a
//! conflist with fastpath does not run on the reference anyway); on netkit
//! pairs the same, on the pod's netkit device and the node's primary. Where
//! the kernel has no `sch_fq`, ADD shapes with the
//! TBFs and takes the pod off the fast path in the network's pinned
//! endpoint map (found from the program on the host veth). A fastpath later
//! in the chain sees the TBFs and keeps the pod off the fast path itself.

use rcni_cni::rollback::Rollback;
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::types::BandwidthEntry;
use rcni_cni::{CniError, CniResult, ErrorCode, Interface};
use rcni_netlink::tc::{INGRESS_HANDLE, TBF_HANDLE, Tbf};
use rcni_netlink::{Link, Netlink};
use rcni_netns::NetNs;
use serde::Deserialize;

pub struct Bandwidth;

/// The reference supports 0.3.0 and later.
const VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
/// IFB names: `bwp` and the hash, 15 characters (IFNAMSIZ - 1).
const IFB_NAME_LEN: usize = 15;
/// Bursts are handed to the kernel in bytes as a u32.
const MAX_BURST_BITS: u64 = (u32::MAX as u64) * 8;

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    #[serde(default)]
    ingress_rate: Option<u64>,
    #[serde(default)]
    ingress_burst: Option<u64>,
    #[serde(default)]
    egress_rate: Option<u64>,
    #[serde(default)]
    egress_burst: Option<u64>,
}

/// The limits of one call: the config's own entry if it has any of the
/// four keys (as Go allocates the embedded entry then), else the
/// `bandwidth` capability.
pub fn limits(args: &CmdArgs) -> Result<Option<BandwidthEntry>, CniError> {
    let raw: Raw = args.conf.plugin_conf()?;
    let any = raw.ingress_rate.is_some()
        || raw.ingress_burst.is_some()
        || raw.egress_rate.is_some()
        || raw.egress_burst.is_some();
    let bw = if any {
        Some(BandwidthEntry {
            ingress_rate: raw.ingress_rate.unwrap_or(0),
            ingress_burst: raw.ingress_burst.unwrap_or(0),
            egress_rate: raw.egress_rate.unwrap_or(0),
            egress_burst: raw.egress_burst.unwrap_or(0),
        })
    } else {
        args.conf.runtime_value::<BandwidthEntry>("bandwidth")?
    };
    if let Some(b) = &bw {
        validate(b.ingress_rate, b.ingress_burst)?;
        validate(b.egress_rate, b.egress_burst)?;
    }
    Ok(bw)
}

/// Rate and burst come together, and the burst fits the kernel's u32 of
/// bytes (the reference's `validateRateAndBurst`).
pub fn validate(rate: u64, burst: u64) -> Result<(), CniError> {
    match (rate, burst) {
        (0, b) if b != 0 => Err(CniError::config("if burst is set, rate must also be set")),
        (r, 0) if r != 0 => Err(CniError::config("if rate is set, burst must also be set")),
        (_, b) if b >= MAX_BURST_BITS => Err(CniError::config("burst cannot be more than 4GB")),
        (r, _) if r != 0 && r < 8 => Err(CniError::config("rate must be at least 8 bit/s")),
        _ => Ok(()),
    }
}

/// The reference's IFB name.
pub fn ifb_name(network: &str, container_id: &str) -> String {
    rcni_netfilter::hash_with_prefix(IFB_NAME_LEN, "bwp", &format!("{network}{container_id}"))
}

/// The alias our IFBs carry: what GC needs to tell whose it is.
fn ifb_alias(network: &str, container_id: &str, ifname: &str) -> String {
    format!("rcni-bandwidth {network} {container_id} {ifname}")
}

fn parse_alias(alias: &str) -> Option<(&str, &str, &str)> {
    let mut w = alias.strip_prefix("rcni-bandwidth ")?.split(' ');
    Some((w.next()?, w.next()?, w.next()?))
}

/// The host end of the container's veth, which the result must list as a
/// host interface (the reference's `getHostInterface`).
async fn host_veth(
    host: &Netlink,
    container: &Netlink,
    prev: &CniResult,
    ifname: &str,
) -> Result<Link, CniError> {
    let link = veth_peer(host, container, ifname).await?;
    if !prev
        .interfaces
        .iter()
        .any(|i| i.sandbox.is_empty() && i.name == link.name)
    {
        return Err(CniError::config(
            "no veth peer of container interface found in host ns",
        ));
    }
    Ok(link)
}

/// The host end of the container's veth `ifname`.
async fn veth_peer(host: &Netlink, container: &Netlink, ifname: &str) -> Result<Link, CniError> {
    let ct = container.link_by_name(ifname).await?;
    let peer = match (ct.kind.as_deref(), ct.link) {
        // netkit: a pod born with linkType netkit (bridge, ptp).
        (Some("veth" | "netkit"), Some(p)) => p,
        _ => {
            return Err(CniError::config(format!(
                "container interface {ifname} has no veth peer"
            )));
        }
    };
    let link = host
        .link_by_index(peer)
        .await
        .map_err(|_| CniError::config(format!("veth peer with index {peer} is not in host ns")))?;
    Ok(link)
}

fn open_container(args: &CmdArgs) -> Result<NetNs, CniError> {
    let p = args.netns.as_ref().ok_or_else(|| {
        CniError::new(ErrorCode::InvalidEnvironmentVariables, "CNI_NETNS is empty")
    })?;
    Ok(NetNs::open(p)?)
}

/// Keeps the pod behind `veth` off rcni's fast path, if the fast path's
/// program sits on the veth: its redirects would skip the TBFs. Nothing to
/// undo on DEL: the endpoints go with fastpath's DEL.
fn off_the_fast_path(veth: &Link, fast: Option<rcni_ebpf::Datapath>) -> Result<(), CniError> {
    if let Some(mut dp) = fast {
        dp.keep_on_normal_path(veth.index)
            .map_err(ebpf_err(format!(
                "cannot take {} off the fast path, which would skip the limits",
                veth.name
            )))?;
    }
    Ok(())
}

fn ebpf_err(what: String) -> impl Fn(rcni_ebpf::Error) -> CniError {
    move |e| CniError::new(ErrorCode::Ebpf, format!("bandwidth: {what}: {e}"))
}

/// The network's datapath, if its fast path program sits on `veth`.
fn fast_path_of(veth: &Link, network: &str) -> Result<Option<rcni_ebpf::Datapath>, CniError> {
    rcni_ebpf::open_attached(&veth.name, network).map_err(ebpf_err(format!(
        "cannot find the fast path on {}, whose redirects would skip the limits \
         (the pod can be neither shaped on it nor taken off it)",
        veth.name
    )))
}

/// Shapes a fast path pod by departure time (see the module's doc): its
/// egress on `ifname` in the pod, its ingress on `veth`. False, with
/// nothing left, where the kernel has no fq qdisc; a failure undoes what
/// was done.
fn shape_edt(
    bw: &BandwidthEntry,
    ct_ns: &NetNs,
    ifname: &str,
    veth: &Link,
    network: &str,
    dp: &mut rcni_ebpf::Datapath,
) -> Result<bool, CniError> {
    use rcni_ebpf::shape::{EdtCfg, shape, unshape};
    let mut undo = Rollback::new();
    if bw.egress_rate > 0 {
        let cfg = EdtCfg::from_bits(bw.egress_rate, bw.egress_burst);
        let err = ebpf_err(format!("shape {ifname} in the container"));
        if !ct_ns.run(|| shape(ifname, cfg))?.map_err(&err)? {
            return Ok(false);
        }
        undo.push(format!("shaping of {ifname}"), move || {
            ct_ns.run(|| unshape(ifname))?.map_err(&err)
        });
        // The pod's shaping is the pod's to remove (with CAP_NET_ADMIN in
        // its namespace): its host-side port polices the same limit, past
        // what that shaping ever lets through (the reference's IFB keeps
        // the limit on the node side too).
        dp.police_port(veth.index, rcni_ebpf::Police::behind(&cfg))
            .map_err(ebpf_err(format!("police {}'s egress", veth.name)))?;
        let index = veth.index;
        let network = network.to_string();
        let name = veth.name.clone();
        undo.push(format!("policer on {name}"), move || {
            let Some(mut dp) = rcni_ebpf::open_attached(&name, &network)
                .map_err(ebpf_err(format!("find the fast path on {name}")))?
            else {
                return Ok(());
            };
            dp.unpolice_port(index)
                .map_err(ebpf_err(format!("take the policer off {name}")))
        });
    }
    if bw.ingress_rate > 0 {
        let cfg = EdtCfg::from_bits(bw.ingress_rate, bw.ingress_burst);
        let err = ebpf_err(format!("shape {}", veth.name));
        if !shape(&veth.name, cfg).map_err(&err)? {
            return Ok(false);
        }
        undo.push(format!("shaping of {}", veth.name), move || {
            unshape(&veth.name).map_err(&err)
        });
        dp.set_shaped(veth.index, true)
            .map_err(ebpf_err(format!("mark {}'s endpoints shaped", veth.name)))?;
    }
    undo.commit();
    Ok(true)
}

/// Takes the departure-time shaping off the pod's host veth (`ingress`)
/// and its mark off the pod's endpoints (fastpath's DEL may have taken them
/// already), and the egress policer off its port; failures are logged, DEL
/// goes on.
fn unshape_host(veth: &Link, network: &str, ingress: bool) {
    if ingress && let Err(e) = rcni_ebpf::shape::unshape(&veth.name) {
        eprintln!("bandwidth: unshape {}: {e}", veth.name);
    }
    match fast_path_of(veth, network) {
        Ok(Some(mut dp)) => {
            if ingress && let Err(e) = dp.set_shaped(veth.index, false) {
                eprintln!("bandwidth: unmark {}'s endpoints: {e}", veth.name);
            }
            if let Err(e) = dp.unpolice_port(veth.index) {
                eprintln!("bandwidth: take the policer off {}: {e}", veth.name);
            }
        }
        Ok(None) => {}
        Err(e) => eprintln!("{}", e.msg),
    }
}

/// Whether link `index` has the root fq of departure-time shaping.
async fn has_edt_fq(nl: &Netlink, index: u32) -> Result<bool, CniError> {
    Ok(nl
        .qdiscs(index)
        .await?
        .iter()
        .any(rcni_ebpf::shape::is_edt_fq))
}

async fn has_clsact(host: &Netlink, index: u32) -> Result<bool, CniError> {
    Ok(host.qdiscs(index).await?.iter().any(|q| q.kind == "clsact"))
}

fn tbf_of(qdiscs: &[rcni_netlink::tc::Qdisc]) -> Option<Tbf> {
    qdiscs
        .iter()
        .find(|q| q.kind == "tbf" && q.parent == 0xffff_ffff)
        .and_then(|q| q.tbf)
}

impl Plugin for Bandwidth {
    fn about(&self) -> About {
        About {
            name: "bandwidth",
            version: env!("CARGO_PKG_VERSION"),
            supported_versions: VERSIONS,
        }
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let bw = limits(args)?;
        let mut prev = args
            .conf
            .prev_result()?
            .ok_or_else(|| CniError::config("must be called as chained plugin"))?;
        let Some(bw) = bw.filter(|b| b.ingress_rate > 0 || b.egress_rate > 0) else {
            return Ok(prev);
        };
        let ct_ns = open_container(args)?;
        let host_ns = NetNs::current()?;
        let rt = rcni_netlink::runtime()?;
        let (host, ct) = rt.block_on(async {
            Ok::<_, CniError>((
                Netlink::connect(&host_ns).await?,
                Netlink::connect(&ct_ns).await?,
            ))
        })?;
        let veth = rt.block_on(host_veth(&host, &ct, &prev, &args.ifname))?;
        let mut fast = fast_path_of(&veth, &args.conf.name)?;
        if let Some(dp) = &mut fast {
            if shape_edt(&bw, &ct_ns, &args.ifname, &veth, &args.conf.name, dp)? {
                return Ok(prev);
            }
            eprintln!(
                "bandwidth: this kernel has no fq qdisc (sch_fq) for shaping by departure \
                 time: {} is shaped with TBFs, off the fast path",
                veth.name
            );
        }
        let mut undo = Rollback::new();
        if bw.ingress_rate > 0 {
            let tbf = Tbf::from_bits(bw.ingress_rate, bw.ingress_burst);
            rt.block_on(host.add_tbf(veth.index, tbf))?;
            let (rt, host, index) = (&rt, &host, veth.index);
            undo.push("ingress TBF", move || {
                Ok(rt.block_on(host.del_qdisc(index, 0xffff_ffff, TBF_HANDLE))?)
            });
        }
        if bw.egress_rate > 0 {
            let name = ifb_name(&args.conf.name, &args.container_id);
            let alias = ifb_alias(&args.conf.name, &args.container_id, &args.ifname);
            let ifb = rt.block_on(host.create_ifb(&name, veth.mtu, &alias))?;
            {
                let (rt, host, index) = (&rt, &host, ifb.index);
                undo.push(format!("ifb {name}"), move || {
                    Ok(rt.block_on(host.delete_link(index))?)
                });
            }
            let tbf = Tbf::from_bits(bw.egress_rate, bw.egress_burst);
            // rcni's fastpath or policy in tc mode (kernels without tcx)
            // put a clsact qdisc there first, and an ingress qdisc cannot
            // sit next to one: the redirect goes on clsact's ingress hook.
            let clsact = rt.block_on(async {
                host.add_tbf(ifb.index, tbf).await?;
                let clsact = has_clsact(&host, veth.index).await?;
                if !clsact {
                    host.add_ingress_qdisc(veth.index).await?;
                }
                Ok::<_, CniError>(clsact)
            })?;
            if !clsact {
                let (rt, host, index) = (&rt, &host, veth.index);
                undo.push("ingress qdisc", move || {
                    Ok(rt.block_on(host.del_qdisc(index, 0xffff_fff1, INGRESS_HANDLE))?)
                });
            }
            rt.block_on(host.add_redirect_filter(veth.index, ifb.index, clsact))?;
            if clsact {
                let (rt, host, index) = (&rt, &host, veth.index);
                undo.push("redirect filter", move || {
                    Ok(rt.block_on(host.del_redirect_filter(index))?)
                });
            }
            prev.interfaces.push(Interface {
                name,
                mac: ifb.mac.map(|m| m.to_string()).unwrap_or_default(),
                ..Interface::default()
            });
        }
        off_the_fast_path(&veth, fast)?;
        undo.commit();
        Ok(prev)
    }

    /// Deletes the qdiscs of the host veth when it is still there, then the
    /// IFB; missing ones are success.
    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        let bw = limits(args)?;
        let host_ns = NetNs::current()?;
        let rt = rcni_netlink::runtime()?;
        let host = rt.block_on(Netlink::connect(&host_ns))?;
        let name = ifb_name(&args.conf.name, &args.container_id);
        // The redirect goes before the IFB: while it points at a deleted
        // IFB, the kernel's mirred action drops whatever the pod sends, so
        // a dhcp IPAM's DHCPRELEASE later in this DEL would never reach its
        // server. A runtime whose ADD was killed has no cached result to
        // give: the attachment's veth is then the peer of the container's
        // interface, cleaned when this plugin shaped it (the IFB is there)
        // or is configured to.
        let prev = args.conf.prev_result().ok().flatten();
        let ifb = matches!(rt.block_on(host.find_link(&name)), Ok(Some(_)));
        let ours = prev.is_some()
            || bw
                .as_ref()
                .is_some_and(|b| b.ingress_rate > 0 || b.egress_rate > 0)
            || ifb;
        if ours && let Ok(ct_ns) = open_container(args) {
            // Which sides carry our fq, i.e. were shaped by departure time:
            // only those are unshaped (a thread into the pod's namespace and
            // the datapath's endpoints otherwise for every pod's DEL).
            let found = rt.block_on(async {
                let ct = Netlink::connect(&ct_ns).await?;
                let veth = match &prev {
                    Some(prev) => host_veth(&host, &ct, prev, &args.ifname).await?,
                    None => veth_peer(&host, &ct, &args.ifname).await?,
                };
                let pod = ct.link_by_name(&args.ifname).await?;
                let pod_edt = has_edt_fq(&ct, pod.index).await?;
                let host_edt = has_edt_fq(&host, veth.index).await?;
                Ok::<_, CniError>((veth, pod_edt, host_edt))
            });
            if let Ok((veth, pod_edt, host_edt)) = &found {
                // The pod's side goes with its namespace, but a DEL may
                // come while that lives on.
                if *pod_edt && let Err(e) = ct_ns.run(|| rcni_ebpf::shape::unshape(&args.ifname)) {
                    eprintln!("bandwidth: unshape {} in the container: {e}", args.ifname);
                }
                // The policer goes with the pod's shaping, also where the
                // pod took that off itself (the limit is still asked for);
                // an egress shaped by the IFB's TBF (no fq, or no fast
                // path) never had one, and needs no look at the datapath.
                let egress = *pod_edt || (!ifb && bw.as_ref().is_some_and(|b| b.egress_rate > 0));
                if *host_edt || egress {
                    unshape_host(veth, &args.conf.name, *host_edt);
                }
            }
            let _ = rt.block_on(async {
                let (veth, ..) = found?;
                host.del_qdisc(veth.index, 0xffff_ffff, TBF_HANDLE).await?;
                // A clsact qdisc holds other plugins' filters: only ours goes.
                if has_clsact(&host, veth.index).await? {
                    host.del_redirect_filter(veth.index).await?;
                } else {
                    host.del_qdisc(veth.index, 0xffff_fff1, INGRESS_HANDLE)
                        .await?;
                }
                Ok::<_, CniError>(())
            });
        }
        rt.block_on(host.ensure_link_deleted(&name))?;
        Ok(())
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let bw = limits(args)?;
        let prev = args
            .conf
            .prev_result()?
            .ok_or_else(|| CniError::config("must be called as chained plugin"))?;
        let Some(bw) = bw.filter(|b| b.ingress_rate > 0 || b.egress_rate > 0) else {
            return Ok(());
        };
        let ct_ns = open_container(args)?;
        let host_ns = NetNs::current()?;
        let rt = rcni_netlink::runtime()?;
        let (host, veth) = rt.block_on(async {
            let host = Netlink::connect(&host_ns).await?;
            let ct = Netlink::connect(&ct_ns).await?;
            let veth = host_veth(&host, &ct, &prev, &args.ifname).await?;
            Ok::<_, CniError>((host, veth))
        })?;
        // Shaped by departure time (a fast path pod): the same limits
        // on the pod's interface and its host veth.
        let edt_in = rcni_ebpf::shape::shaping(&veth.name)
            .map_err(ebpf_err(format!("read the shaping of {}", veth.name)))?;
        let edt_out = ct_ns
            .run(|| rcni_ebpf::shape::shaping(&args.ifname))?
            .map_err(ebpf_err(format!("read the shaping of {}", args.ifname)))?;
        if edt_in.is_some() || edt_out.is_some() {
            use rcni_ebpf::shape::EdtCfg;
            for (what, rate, burst, have) in [
                ("ingress", bw.ingress_rate, bw.ingress_burst, edt_in),
                ("egress", bw.egress_rate, bw.egress_burst, edt_out),
            ] {
                let want = (rate > 0).then(|| EdtCfg::from_bits(rate, burst));
                let same = match (&want, &have) {
                    (Some(w), Some(h)) => w.same_limits(h),
                    (None, None) => true,
                    _ => false,
                };
                if !same {
                    return Err(CniError::check_failed(format!(
                        "{what} shaping of {} is {have:?}, want {want:?}",
                        args.ifname
                    )));
                }
            }
            // One look for the policer and the endpoints' mark.
            let dp = fast_path_of(&veth, &args.conf.name)?;
            if let Some(out) = &edt_out {
                let want = rcni_ebpf::Police::behind(out);
                let have = dp
                    .as_ref()
                    .map(|dp| dp.policer(veth.index))
                    .transpose()
                    .map_err(ebpf_err(format!("read the policer of {}", veth.name)))?
                    .flatten();
                if !have.is_some_and(|h| h.same_limits(&want)) {
                    return Err(CniError::check_failed(format!(
                        "the egress policer of {} is {have:?}, want {want:?}",
                        veth.name
                    )));
                }
            }
            if edt_in.is_some() {
                let shaped = dp
                    .as_ref()
                    .map(|dp| {
                        dp.endpoints().map(|eps| {
                            eps.iter().any(|(_, e)| {
                                e.ifindex == veth.index && e.flags & rcni_ebpf::EP_SHAPED != 0
                            })
                        })
                    })
                    .transpose()
                    .map_err(ebpf_err("read the endpoints".into()))?;
                if shaped != Some(true) {
                    return Err(CniError::check_failed(format!(
                        "{}'s endpoints are not marked shaped: the fast path delivers \
                         past the ingress shaping",
                        veth.name
                    )));
                }
            }
            return Ok(());
        }
        rt.block_on(async {
            let qdiscs = host.qdiscs(veth.index).await?;
            if bw.ingress_rate > 0 {
                let want = Tbf::from_bits(bw.ingress_rate, bw.ingress_burst);
                if tbf_of(&qdiscs) != Some(want) {
                    return Err(CniError::check_failed(format!(
                        "ingress TBF of {} is {:?}, want {want:?}",
                        veth.name,
                        tbf_of(&qdiscs)
                    )));
                }
            }
            if bw.egress_rate > 0 {
                let redirect = qdiscs.iter().any(|q| q.kind == "ingress")
                    || (qdiscs.iter().any(|q| q.kind == "clsact")
                        && host
                            .ingress_filter_kinds(veth.index)
                            .await?
                            .iter()
                            .any(|k| k == "u32"));
                if !redirect {
                    return Err(CniError::check_failed(format!(
                        "no ingress qdisc on {}",
                        veth.name
                    )));
                }
                let name = ifb_name(&args.conf.name, &args.container_id);
                let ifb = host
                    .find_link(&name)
                    .await?
                    .ok_or_else(|| CniError::check_failed(format!("ifb {name} does not exist")))?;
                let want = Tbf::from_bits(bw.egress_rate, bw.egress_burst);
                let have = tbf_of(&host.qdiscs(ifb.index).await?);
                if have != Some(want) {
                    return Err(CniError::check_failed(format!(
                        "egress TBF of {name} is {have:?}, want {want:?}"
                    )));
                }
            }
            Ok(())
        })
    }

    /// Deletes this network's IFBs whose attachment is not valid (ours
    /// carry an alias naming it; the reference's carry none and are left).
    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        let valid = args.conf.gc_valid_pairs();
        let host_ns = NetNs::current()?;
        let rt = rcni_netlink::runtime()?;
        rt.block_on(async {
            let host = Netlink::connect(&host_ns).await?;
            for l in host.links().await? {
                let Some((net, cid, ifname)) = l.alias.as_deref().and_then(parse_alias) else {
                    continue;
                };
                let stale = l.kind.as_deref() == Some("ifb")
                    && net == args.conf.name
                    && !valid.iter().any(|(c, i)| c == cid && i == ifname);
                if stale {
                    match host.delete_link(l.index).await {
                        Err(e) if !e.is_not_found() => return Err(e.into()),
                        _ => {}
                    }
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn load(v: serde_json::Value) -> Result<Option<BandwidthEntry>, CniError> {
        limits(&CmdArgs::for_conf(&v)?)
    }

    #[test]
    fn static_entry_wins_over_the_capability() {
        let mut v = json!({"cniVersion": "1.0.0", "name": "n", "type": "bandwidth",
            "runtimeConfig": {"bandwidth": {"ingressRate": 1000, "ingressBurst": 800}}});
        assert_eq!(load(v.clone()).unwrap().unwrap().ingress_rate, 1000);
        v["egressRate"] = json!(2000);
        v["egressBurst"] = json!(1600);
        let b = load(v).unwrap().unwrap();
        assert_eq!((b.ingress_rate, b.egress_rate), (0, 2000));
        let none = json!({"cniVersion": "1.0.0", "name": "n", "type": "bandwidth"});
        assert_eq!(load(none).unwrap(), None);
    }

    #[test]
    fn rate_and_burst_go_together() {
        assert!(validate(0, 0).is_ok());
        assert!(validate(1000, 800).is_ok());
        assert_eq!(validate(1000, 0).unwrap_err().code, 7);
        assert_eq!(validate(0, 800).unwrap_err().code, 7);
        assert_eq!(validate(1000, MAX_BURST_BITS).unwrap_err().code, 7);
    }

    #[test]
    fn names() {
        let n = ifb_name("mynet", "ctr1");
        assert_eq!(n.len(), 15);
        assert!(n.starts_with("bwp"));
        let a = ifb_alias("mynet", "ctr1", "eth0");
        assert_eq!(parse_alias(&a), Some(("mynet", "ctr1", "eth0")));
        assert_eq!(parse_alias("something"), None);
    }
}
