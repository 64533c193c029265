//! What the plugins of a link on a lower device share (macvlan, ipvlan,
//! vlan): their common keys; the master named by the config, or the
//! interface of the default route when it names none, in the node's
//! namespace or, with `linkInContainer`, the container's; ADD's first steps,
//! the pod's link, and the end of ADD once it exists; DEL.

use crate::{
    Dad, Namespaces, check, configure_iface, delete_container_link, ensure_ifname_free, finish_add,
    in_container_for_del, interface, ipam_config, sandbox, start_ipam_del, sysctl_best_effort,
    temp_name, undo_link, wait_ipam,
};
use rcni_cni::first_error;
use rcni_cni::invoke::PendingAdd;
use rcni_cni::rollback::Rollback;
use rcni_cni::skel::CmdArgs;
use rcni_cni::{CniError, CniResult};
use rcni_netlink::{Family, IPV4_DEVCONF_ARP_NOTIFY, Link, Netlink};
use rcni_netns::NetNs;
use serde::Deserialize;

/// The pod's link is the result's only interface.
pub const IDX_CONTAINER: usize = 0;

/// The keys every link on a lower device takes (macvlan, ipvlan, vlan):
/// where its master is, and IPAM. Each plugin reads its own keys (mode,
/// MTU, ...) beside these.
#[derive(Debug)]
pub struct LowerConf {
    /// As configured; empty: the interface of the default route (macvlan,
    /// ipvlan; vlan requires a master).
    pub master: String,
    /// The master lives in the container's namespace, not the node's.
    pub link_in_container: bool,
    /// IPAM plugin type; `None` is an L2-only attachment (ipvlan, chained:
    /// `prevResult`'s addresses).
    pub ipam: Option<String>,
}

impl LowerConf {
    pub fn load(args: &CmdArgs) -> Result<LowerConf, CniError> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Keys {
            #[serde(default)]
            master: String,
            #[serde(default)]
            link_in_container: bool,
        }
        let keys: Keys = args.conf.plugin_conf()?;
        Ok(LowerConf {
            master: keys.master,
            link_in_container: keys.link_in_container,
            ipam: crate::ipam_type(args),
        })
    }

    /// The master `name` (the default route's interface when empty), looked
    /// up in the namespace the config says it lives in.
    pub async fn find_master(&self, ns: &Namespaces, name: &str) -> Result<Link, CniError> {
        let nl = if self.link_in_container {
            &ns.ct
        } else {
            &ns.host
        };
        find_master(nl, name).await
    }
}

/// The `mode` key: `modes` names each mode, the first also the default (an
/// empty or absent key); any other name is unsupported (code 2).
pub fn mode<M: Copy>(name: &str, modes: &[(&str, M)]) -> Result<M, CniError> {
    match modes.iter().find(|(n, _)| *n == name) {
        Some((_, m)) => Ok(*m),
        None if name.is_empty() => Ok(modes[0].1),
        None => Err(CniError::unsupported("mode", format!("{name:?}"))),
    }
}

/// The interface of the first default route of the main table (IPv4
/// before IPv6), as the reference's `getDefaultRouteInterfaceName`.
pub async fn default_route_link(nl: &Netlink) -> Result<Link, CniError> {
    let routes = nl.routes(Family::All).await?;
    for r in routes.iter().filter(|r| r.dst.prefix() == 0) {
        if let Some(oif) = r.oif {
            return Ok(nl.link_by_index(oif).await?);
        }
    }
    Err(CniError::config("no default route interface found"))
}

/// The master: `name`, or the default route's interface when it is empty,
/// looked up in `nl`'s namespace.
pub async fn find_master(nl: &Netlink, name: &str) -> Result<Link, CniError> {
    if name.is_empty() {
        return default_route_link(nl).await;
    }
    nl.find_link(name).await?.ok_or_else(|| {
        CniError::config(format!("failed to lookup master {name:?}: link not found"))
    })
}

/// The `mtu` key of a link on a master: 0 (or absent) is the master's,
/// negative or above the master's is a config error, with the reference's
/// wording.
pub fn check_mtu(mtu: i64, master: &Link) -> Result<Option<u32>, CniError> {
    if mtu < 0 || mtu > i64::from(master.mtu) {
        return Err(CniError::config(format!(
            "invalid MTU {mtu}, must be [0, master MTU({})]",
            master.mtu
        )));
    }
    Ok((mtu > 0).then_some(mtu as u32))
}

/// ADD's first steps, in the reference's order: the namespaces, the master
/// `name` (see [`LowerConf::find_master`]) passed to `validate` (the
/// plugin's MTU bound), and CNI_IFNAME free in the container. Returns the
/// namespaces, the master and what `validate` made of it.
pub fn open_master<T>(
    args: &CmdArgs,
    lower: &LowerConf,
    name: &str,
    validate: impl FnOnce(&Link) -> Result<T, CniError>,
) -> Result<(Namespaces, Link, T), CniError> {
    let ns = Namespaces::open(args)?;
    let master = ns.rt.block_on(lower.find_master(&ns, name))?;
    let valid = validate(&master)?;
    ns.rt.block_on(ensure_ifname_free(&ns.ct, &args.ifname))?;
    Ok((ns, master, valid))
}

/// Makes the pod's link on a lower device and gives it the pod's name:
/// `create(nl, name, target)` makes it under a temporary name (the final
/// name may be taken where the master lives) with `nl`, in the node's
/// namespace and moved to `target` (the container's), or, with
/// `linkInContainer`, directly in the container (`target` none). Its
/// removal is registered on `undo` before the rename.
pub fn create_lower_link<'a>(
    ns: &'a Namespaces,
    args: &CmdArgs,
    kind: &str,
    in_container: bool,
    undo: &mut Rollback<'a>,
    create: impl AsyncFn(&'a Netlink, &str, Option<&'a NetNs>) -> rcni_netlink::Result<()>,
) -> Result<Link, CniError> {
    let tmp = temp_name(&args.container_id, &args.ifname);
    let link = ns.rt.block_on(async {
        let (nl, target) = if in_container {
            (&ns.ct, None)
        } else {
            (&ns.host, Some(&ns.ct_ns))
        };
        let made = match create(nl, &tmp, target).await {
            // An earlier ADD of this attachment killed before its rename,
            // and no DEL since, left the link under this name: removed and
            // made again (only then, not a lookup on every ADD).
            Err(e) if e.is_exists() && ns.ct.ensure_link_deleted(&tmp).await? => {
                create(nl, &tmp, target).await
            }
            r => r,
        };
        made.map_err(|e| CniError::from(e).context(format!("failed to create {kind}")))?;
        ns.ct.link_by_name(&tmp).await.map_err(CniError::from)
    })?;
    undo_link(
        undo,
        format!("{kind} {}", args.ifname),
        &ns.rt,
        &ns.ct,
        link.index,
    );
    ns.rt.block_on(ns.ct.set_name(link.index, &args.ifname))?;
    Ok(ns.rt.block_on(ns.ct.link_by_index(link.index))?)
}

/// The end of ADD once the pod's link exists under its name: configured
/// from IPAM's result, or `without_ipam`'s when there is no IPAM (ipvlan's
/// `prevResult`), with addresses and routes (other hosts share the segment,
/// so IPv6 addresses go through duplicate address detection, waited for as
/// the reference does), or only brought up for an L2-only attachment; its
/// interface in the result; the result's DNS the config's `dns`, never
/// IPAM's or prevResult's (upstream's `result.DNS = n.DNS`); the undo stack
/// committed. With `notify`, neighbours learn the link's MAC for its
/// addresses at once: `arp_notify` and `ndisc_notify` (best effort, as the
/// reference's macvlan and ipvlan; ndisc_notify since v1.4.0).
pub fn finish_lower_add(
    ns: &Namespaces,
    args: &CmdArgs,
    link: &Link,
    without_ipam: Option<CniResult>,
    notify: bool,
    // Before `undo`: parameters drop in reverse order, so a failure here
    // removes the link before host-local or static release its addresses
    // (any other IPAM releases first: `wait_into`).
    mut ipam: Option<PendingAdd>,
    mut undo: Rollback<'_>,
) -> Result<CniResult, CniError> {
    let result = match &mut ipam {
        Some(ipam) => Some(ipam_config(
            args.version(),
            ipam.wait_into(&mut undo)?,
            IDX_CONTAINER,
        )?),
        None => without_ipam,
    };
    let mut result = match result {
        Some(result) => {
            if notify {
                let _ = ns.rt.block_on(
                    ns.ct
                        .set_ipv4_devconf(link.index, &[(IPV4_DEVCONF_ARP_NOTIFY, 1)]),
                );
                // IPv6's devconf is read-only over netlink.
                let key = format!("net/ipv6/conf/{}/ndisc_notify", link.name);
                sysctl_best_effort(&ns.ct_ns, &[(key, "1")]);
            }
            ns.rt
                .block_on(configure_iface(&ns.ct, &ns.ct_ns, link, &result, Dad::Wait))?;
            result
        }
        None => {
            ns.rt.block_on(ns.ct.set_up(link.index))?;
            CniResult::new(args.version())
        }
    };
    let link = ns.rt.block_on(ns.ct.link_by_index(link.index))?;
    result.interfaces = vec![interface(&link, &sandbox(args))];
    result.dns = args.conf.dns.clone().unwrap_or_default();
    Ok(finish_add(result, args, undo, ipam))
}

/// CHECK of the pod's link of `kind` against `prevResult` and the config:
/// IPAM's CHECK; the master as ADD found it (the default route's interface
/// when the config names none, or, with `unnamed_unchecked`, no master:
/// ipvlan's chained ADD took it from a `prevResult` that is gone now); the
/// link as recorded, on that master; `kind_checks` (mode, VLAN ID, MTU);
/// the link's addresses and routes.
pub fn check_lower(
    args: &CmdArgs,
    lower: &LowerConf,
    kind: &str,
    unnamed_unchecked: bool,
    kind_checks: impl AsyncFnOnce(&Netlink, &Link) -> Result<(), CniError>,
) -> Result<(), CniError> {
    crate::delegate_ipam(lower.ipam.as_deref(), "CHECK", args)?;
    let prev = args.conf.required_prev_result(check::PREV_RESULT_MISSING)?;
    let ns = Namespaces::open(args)?;
    let ct_if = check::container_interface(&prev, &args.ifname, &sandbox(args))?;
    ns.rt.block_on(async {
        let master = match lower.master.is_empty() && unnamed_unchecked {
            true => None,
            false => Some(
                lower
                    .find_master(&ns, &lower.master)
                    .await
                    .map_err(|e| CniError::check_failed(e.msg))?,
            ),
        };
        let link = check::validate_link(&ns.ct, ct_if, Some(kind)).await?;
        if let Some(master) = &master
            && link.link != Some(master.index)
        {
            return Err(CniError::check_failed(format!(
                "{kind}: {} is not on master {}",
                link.name, master.name
            )));
        }
        kind_checks(&ns.ct, &link).await?;
        check::validate_ips(&ns.ct, &link, &prev.ips, IDX_CONTAINER).await?;
        check::validate_routes(&ns.ct, &prev.routes).await
    })
}

/// CHECK of the link's mode (`got`, `None` when the kernel named none)
/// against the config's; `what` names the kind as the reference's message
/// does ("macvlan", "IPVlan").
pub fn check_mode<M: PartialEq + std::fmt::Display>(
    what: &str,
    got: Option<M>,
    want: M,
) -> Result<(), CniError> {
    if got.as_ref() == Some(&want) {
        return Ok(());
    }
    Err(CniError::check_failed(format!(
        "Container {what} mode {} does not match expected value: {want}",
        got.map_or("unknown".into(), |m| m.to_string()),
    )))
}

/// DEL: IPAM's release alongside the link's removal if the netns is still
/// there; a missing master, netns or link is success.
pub fn del_lower(args: &CmdArgs, ipam: Option<&str>) -> Result<(), CniError> {
    let pending = start_ipam_del(ipam, args);
    let link = in_container_for_del(args, async |_, ct| {
        // An ADD killed between the link's creation and its rename left it
        // under its temporary name.
        ct.ensure_link_deleted(&temp_name(&args.container_id, &args.ifname))
            .await?;
        delete_container_link(ct, &args.ifname).await.map(|_| ())
    });
    first_error([wait_ipam(pending), link])
}
