//! `host-device`: moves an existing device of the node into the container
//! under CNI_IFNAME, keeping its original name in the interface alias, and
//! moves it back under that name on DEL; the reference plugin's keys and
//! result shape.
//!
//! Moves go straight between the node and the container, renamed in the
//! container, so that a plugin killed on the way (a runtime's timeout)
//! leaves the device where DEL finds it: in the node as it was, or in the
//! container under CNI_IFNAME or under its own name, with its name in the
//! alias once that is set. Only when a name would clash (the original name
//! taken in the container, or CNI_IFNAME's in the node after the rename)
//! does a move go through a throwaway namespace; a device in it when the
//! plugin is killed dies with it (a virtual one) or lands in the root
//! namespace (a physical one). Any failure on the way puts the device back
//! where it was.
//!
//! Unlike the reference, DEL releases the IPAM reservation also when the
//! netns is gone or not given (cni #1167), and a repeated DEL succeeds.
//! A PCI device bound to a userspace driver (DPDK) is not moved: the IPAM
//! result is returned for the application to use, as the reference does.
//!
//! `useInterfaceNetwork` (upstream v1.10.0, see [`network`]) takes the
//! device's addresses, routes and rules along; unlike upstream, a failed ADD
//! puts them back on the node with the device. DEL, as upstream's, moves the
//! device back bare.

mod conf;
mod network;
mod sysfs;

use conf::{Conf, Selector};
use rcni_attach::check;
use rcni_attach::{
    Attachment, Dad, Namespaces, configure_iface, ensure_ifname_free, finish_add,
    in_container_for_del, interface, ipam_config, open_container, rt, sandbox, start_ipam_add,
};
use rcni_cni::first_error;
use rcni_cni::rollback::Rollback;
use rcni_cni::skel::{About, CmdArgs};
use rcni_cni::{CniError, CniResult, Interface};
use rcni_netlink::{Link, Netlink};
use rcni_netns::NetNs;
use sysfs::Sysfs;

pub struct HostDevice;

/// The device is the result's only interface.
const IDX_CONTAINER: usize = 0;

/// The PCI address of a device bound to a userspace driver, if the config
/// names one: such a device is not moved.
fn dpdk_device(sys: &Sysfs, sel: &Selector) -> Result<Option<String>, CniError> {
    match sel {
        Selector::DeviceId(id) if !sys.is_auxiliary(id) => match sys.pci_is_dpdk(id) {
            Ok(true) => Ok(Some(id.clone())),
            Ok(false) => Ok(None),
            Err(e) => Err(CniError::config(format!(
                "error with host device: {id}: {e}"
            ))),
        },
        _ => Ok(None),
    }
}

/// [`dpdk_device`] for ADD: with `useInterfaceNetwork` a DPDK device is an
/// error, as upstream's (there is no kernel device whose setup to take).
fn dpdk_for_add(sys: &Sysfs, conf: &Conf) -> Result<Option<String>, CniError> {
    let dpdk = dpdk_device(sys, &conf.selector)?;
    if conf.use_interface_network && dpdk.is_some() {
        return Err(CniError::config(
            "useInterfaceNetwork is not supported for dpdk-bound devices",
        ));
    }
    Ok(dpdk)
}

/// The node's link the config names.
async fn find_device(host: &Netlink, sys: &Sysfs, sel: &Selector) -> Result<Link, CniError> {
    let not_found = |what: String| CniError::config(format!("failed to find host device: {what}"));
    let names = match sel {
        Selector::Device(name) => vec![name.clone()],
        Selector::HwAddr(mac) => {
            return host
                .links()
                .await?
                .into_iter()
                .find(|l| l.mac == Some(*mac))
                .ok_or_else(|| not_found(format!("no link with MAC address {mac}")));
        }
        Selector::KernelPath(p) => sys.kernelpath_netdevs(p).map_err(not_found)?,
        Selector::DeviceId(id) if sys.is_auxiliary(id) => sys.aux_netdevs(id).map_err(not_found)?,
        Selector::DeviceId(id) => sys.pci_netdevs(id).map_err(not_found)?,
    };
    for n in &names {
        if let Some(l) = host.find_link(n).await? {
            return Ok(l);
        }
    }
    Err(not_found(format!("no link named {}", names.join(" or "))))
}

/// Moves `dev` from the node into the container as `ifname` with its name
/// in the alias. On failure the device is back in the node as it was.
async fn move_in(
    host: &Netlink,
    host_ns: &NetNs,
    dev: &Link,
    ct: &Netlink,
    ct_ns: &NetNs,
    ifname: &str,
) -> Result<Link, CniError> {
    if ct.find_link(&dev.name).await?.is_some() {
        return move_in_via_tmp(host, host_ns, dev, ct, ct_ns, ifname).await;
    }
    host.move_to_netns(dev.index, ct_ns).await?;
    // From here DEL finds it in the container: by its name (the
    // selector's) until the alias is set, by the alias or CNI_IFNAME after.
    let r: Result<(), CniError> = async {
        let l = ct.link_by_name(&dev.name).await?;
        ct.set_alias(l.index, &dev.name).await?;
        ct.set_name(l.index, ifname).await?;
        Ok(())
    }
    .await;
    if let Err(e) = r {
        restore(
            ct,
            &[&dev.name, ifname],
            &dev.name,
            dev.alias.as_deref(),
            host_ns,
        )
        .await;
        return Err(e);
    }
    Ok(ct.link_by_name(ifname).await?)
}

/// [`move_in`] through a throwaway namespace, when the device's name is
/// taken in the container.
async fn move_in_via_tmp(
    host: &Netlink,
    host_ns: &NetNs,
    dev: &Link,
    ct: &Netlink,
    ct_ns: &NetNs,
    ifname: &str,
) -> Result<Link, CniError> {
    let tmp_ns = NetNs::new_anonymous()?;
    let tmp = Netlink::connect(&tmp_ns).await?;
    host.move_to_netns(dev.index, &tmp_ns).await?;
    let r: Result<(), CniError> = async {
        let l = tmp.link_by_name(&dev.name).await?;
        tmp.set_alias(l.index, &dev.name).await?;
        tmp.set_name(l.index, ifname).await?;
        tmp.move_to_netns(l.index, ct_ns).await?;
        Ok(())
    }
    .await;
    if let Err(e) = r {
        restore(
            &tmp,
            &[&dev.name, ifname],
            &dev.name,
            dev.alias.as_deref(),
            host_ns,
        )
        .await;
        return Err(e);
    }
    Ok(ct.link_by_name(ifname).await?)
}

/// Best effort, on a failure path: the device named one of `names` in the
/// throwaway namespace goes to `to` as `name` with `alias`.
async fn restore(tmp: &Netlink, names: &[&str], name: &str, alias: Option<&str>, to: &NetNs) {
    for n in names {
        if let Ok(Some(l)) = tmp.find_link(n).await {
            let _ = tmp.set_name(l.index, name).await;
            let _ = tmp.set_alias(l.index, alias.unwrap_or("")).await;
            if let Err(e) = tmp.move_to_netns(l.index, to).await {
                eprintln!("host-device: could not put {name} back: {e}");
            }
            return;
        }
    }
}

/// The container's link that is the node's device: CNI_IFNAME, or, after
/// a move killed half-way, the device under its own name (the selector's
/// name or MAC, or a name equal to its alias, which only a move of ours
/// sets).
async fn device_in_container(
    ct: &Netlink,
    ifname: &str,
    sel: Option<&Selector>,
) -> Result<Option<Link>, CniError> {
    if let Some(l) = ct.find_link(ifname).await? {
        return Ok(Some(l));
    }
    let Some(sel) = sel else { return Ok(None) };
    Ok(ct.links().await?.into_iter().find(|l| match sel {
        Selector::Device(name) => &l.name == name,
        Selector::HwAddr(mac) => l.mac == Some(*mac),
        Selector::KernelPath(_) | Selector::DeviceId(_) => {
            l.alias.as_deref() == Some(l.name.as_str())
        }
    }))
}

/// Moves CNI_IFNAME (or the device a killed move left under its own name,
/// found through `sel`) out of the container back into the node under the
/// name in its alias, alias cleared. `Ok(false)` if there is no such link.
/// On failure the device stays in the container, so DEL can be retried.
async fn move_out(
    ct: &Netlink,
    ct_ns: &NetNs,
    host_ns: &NetNs,
    ifname: &str,
    sel: Option<&Selector>,
) -> Result<bool, CniError> {
    let Some(l) = device_in_container(ct, ifname, sel).await? else {
        return Ok(false);
    };
    // Without an alias (not ours, or cleared by someone) the name it has is
    // the best there is.
    let name = l.alias.clone().unwrap_or_else(|| l.name.clone());
    let host = Netlink::connect(host_ns).await?;
    if (l.name != name && ct.find_link(&name).await?.is_some())
        || host.find_link(&name).await?.is_some()
    {
        return move_out_via_tmp(ct, ct_ns, host_ns, &l, &name).await;
    }
    // Addresses go with the move; the device comes back down, as it came.
    ct.set_down(l.index).await?;
    // Renamed in the container first: killed after it, DEL finds it by
    // its alias.
    if l.name != name {
        ct.set_name(l.index, &name).await?;
    }
    if let Err(e) = ct.move_to_netns(l.index, host_ns).await {
        let _ = ct.set_name(l.index, &l.name).await;
        return Err(CniError::from(e).context(format!(
            "failed to move {} back to the node as {name}",
            l.name
        )));
    }
    // Cleared in the node, after the move: until here the alias is what
    // names the device for a retry.
    if let Some(h) = host.find_link(&name).await? {
        host.set_alias(h.index, "").await?;
    }
    Ok(true)
}

/// [`move_out`] of `l` through a throwaway namespace, when `name` is taken
/// in the container or the node.
async fn move_out_via_tmp(
    ct: &Netlink,
    ct_ns: &NetNs,
    host_ns: &NetNs,
    l: &Link,
    name: &str,
) -> Result<bool, CniError> {
    let ifname = l.name.as_str();
    let tmp_ns = NetNs::new_anonymous()?;
    let tmp = Netlink::connect(&tmp_ns).await?;
    // Addresses go with the move; the device comes back down, as it came.
    ct.set_down(l.index).await?;
    ct.move_to_netns(l.index, &tmp_ns).await?;
    let r: Result<(), CniError> = async {
        let t = tmp.link_by_name(ifname).await?;
        tmp.set_name(t.index, name).await?;
        tmp.move_to_netns(t.index, host_ns).await?;
        Ok(())
    }
    .await;
    if let Err(e) = r {
        restore(&tmp, &[ifname, name], ifname, Some(name), ct_ns).await;
        return Err(e.context(format!(
            "failed to move {ifname} back to the node as {name}"
        )));
    }
    // Cleared in the node, after the move: until here the alias is what
    // names the device for a retry.
    let host = Netlink::connect(host_ns).await?;
    if let Some(h) = host.find_link(name).await? {
        host.set_alias(h.index, "").await?;
    }
    Ok(true)
}

/// The interface of a DPDK-mode result: the device has no kernel link to
/// report a MAC of; the PCI address is in `pciID` (1.1.0).
fn dpdk_interface(ifname: &str, sandbox: &str, pci: &str) -> Interface {
    Interface {
        name: ifname.to_string(),
        sandbox: sandbox.to_string(),
        pci_id: pci.to_string(),
        ..Default::default()
    }
}

impl Attachment for HostDevice {
    type Conf = Conf;

    fn about(&self) -> About {
        About::all_versions("host-device", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs, conf: &Conf) -> Result<CniResult, CniError> {
        let sys = Sysfs::default();
        // Before the netns, as upstream (its config loading finds DPDK).
        let dpdk = dpdk_for_add(&sys, conf)?;
        let ns = Namespaces::open(args)?;
        let sandbox = sandbox(args);
        let dev = match &dpdk {
            Some(_) => None,
            None => {
                let dev = ns
                    .rt
                    .block_on(find_device(&ns.host, &sys, &conf.selector))?;
                ns.rt.block_on(ensure_ifname_free(&ns.ct, &args.ifname))?;
                Some(dev)
            }
        };
        let host_state = match &dev {
            Some(dev) if conf.use_interface_network => {
                Some(ns.rt.block_on(network::capture(&ns.host, dev))?)
            }
            _ => None,
        };
        // Once the device is known, IPAM runs alongside the move. Declared
        // before the rollback: dropped after it, so a failed ADD releases
        // its addresses after the device is back in the node.
        let mut ipam = start_ipam_add(conf.ipam.as_deref(), args);
        let mut undo = Rollback::new();
        if let (Some(dev), Some(st)) = (&dev, &host_state) {
            // Undone after the move back: the move took them off the device,
            // which comes back down (routes via a gateway need it up).
            undo.push(
                format!("restore {}'s addresses and routes", dev.name),
                || {
                    ns.rt.block_on(async {
                        let l = ns.host.link_by_name(&dev.name).await?;
                        if dev.admin_up {
                            ns.host.set_up(l.index).await?;
                        }
                        network::apply(&ns.host, l.index, &dev.name, st, false).await
                    })
                },
            );
        }

        let link = match &dev {
            Some(dev) => {
                let link = ns.rt.block_on(move_in(
                    &ns.host,
                    &ns.host_ns,
                    dev,
                    &ns.ct,
                    &ns.ct_ns,
                    &args.ifname,
                ))?;
                undo.push(format!("move {} back", dev.name), || {
                    let back = move_out(&ns.ct, &ns.ct_ns, &ns.host_ns, &args.ifname, None);
                    ns.rt.block_on(back).map(|_| ())
                });
                ns.rt.block_on(ns.ct.set_up(link.index))?;
                if let Some(st) = &host_state {
                    ns.rt
                        .block_on(network::apply(&ns.ct, link.index, &args.ifname, st, true))?;
                }
                Some(link)
            }
            None => None,
        };

        let mut result = CniResult::new(args.version());
        if let Some(ipam) = &mut ipam {
            let got = ipam.wait_into(&mut undo)?;
            result = if host_state.is_some() && got.ips.is_empty() {
                // The device's own addresses are the config (upstream
                // allows it too).
                let mut r = CniResult::new(args.version());
                r.routes = got.routes;
                r.dns = got.dns;
                r
            } else {
                ipam_config(args.version(), got, IDX_CONTAINER)?
            };
            if let Some(link) = &link {
                // A device on a real segment: IPv6 addresses go through
                // duplicate address detection, waited for as the reference.
                ns.rt
                    .block_on(configure_iface(&ns.ct, &ns.ct_ns, link, &result, Dad::Wait))?;
            }
        }
        // After IPAM's, as upstream.
        if let Some(st) = &host_state {
            network::merge_into(&mut result, st, IDX_CONTAINER);
        }
        result.interfaces = vec![match &link {
            Some(link) => interface(&ns.rt.block_on(ns.ct.link_by_index(link.index))?, &sandbox),
            None => dpdk_interface(&args.ifname, &sandbox, dpdk.as_deref().unwrap_or_default()),
        }];
        // As v1.9.1: with IPAM the config's `dns` (never IPAM's); without,
        // none at all (its result is the device alone).
        let with_ipam = ipam.is_some();
        result.dns = args.conf.dns.clone().unwrap_or_default();
        let mut result = finish_add(result, args, undo, ipam);
        if !with_ipam {
            result.dns = Default::default();
        }
        Ok(result)
    }

    /// IPAM's release, whether or not the netns is there (the reference
    /// skips it without a netns and leaks the address), alongside the
    /// device's move back to the node; a device already gone from the
    /// container is success.
    fn del(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        let ipam = rcni_attach::start_ipam_del(conf.ipam.as_deref(), args);
        // A DPDK device never moved; sysfs trouble here must not stop DEL.
        let dpdk = dpdk_device(&Sysfs::default(), &conf.selector)
            .ok()
            .flatten();
        let device = match dpdk {
            Some(_) => Ok(()),
            None => in_container_for_del(args, async |ct_ns, ct| {
                let host_ns = NetNs::current()?;
                move_out(ct, ct_ns, &host_ns, &args.ifname, Some(&conf.selector))
                    .await
                    .map(|_| ())
            }),
        };
        first_error([rcni_attach::wait_ipam(ipam), device])
    }

    fn check(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        rcni_attach::delegate_ipam(conf.ipam.as_deref(), "CHECK", args)?;
        let prev = args.conf.required_prev_result(check::PREV_RESULT_MISSING)?;
        if dpdk_device(&Sysfs::default(), &conf.selector)?.is_some() {
            return Ok(());
        }
        let ct_ns = open_container(args)?;
        let ct_if = check::container_interface(&prev, &args.ifname, &sandbox(args))?;
        rt()?.block_on(async {
            let ct = Netlink::connect(&ct_ns).await?;
            let link = check::validate_link(&ct, ct_if, None).await?;
            if link.alias.is_none() {
                return Err(CniError::check_failed(format!(
                    "host-device: {} has lost the alias naming its node device",
                    link.name
                )));
            }
            check::validate_ips(&ct, &link, &prev.ips, IDX_CONTAINER).await?;
            check::validate_routes(&ct, &prev.routes).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_interface_network_refuses_dpdk() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        std::fs::create_dir_all(r.join("bus/pci/drivers/vfio-pci")).unwrap();
        std::fs::create_dir_all(r.join("bus/pci/devices/0000:06:00.0")).unwrap();
        std::os::unix::fs::symlink(
            r.join("bus/pci/drivers/vfio-pci"),
            r.join("bus/pci/devices/0000:06:00.0/driver"),
        )
        .unwrap();
        let sys = Sysfs::at(r);
        let conf = |extra: serde_json::Value| {
            let mut c = serde_json::json!({"cniVersion": "1.0.0", "name": "n",
                "type": "host-device", "pciBusID": "0000:06:00.0"});
            c.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            <Conf as rcni_attach::AttachConf>::from_json(&c).unwrap()
        };
        let plain = dpdk_for_add(&sys, &conf(serde_json::json!({}))).unwrap();
        assert_eq!(plain.as_deref(), Some("0000:06:00.0"));
        let e = dpdk_for_add(
            &sys,
            &conf(serde_json::json!({"useInterfaceNetwork": true})),
        )
        .unwrap_err();
        assert_eq!(
            (e.code, e.msg.as_str()),
            (
                7,
                "useInterfaceNetwork is not supported for dpdk-bound devices"
            )
        );
    }

    #[test]
    fn dpdk_result_interface_has_no_mac() {
        let i = dpdk_interface("net1", "/run/netns/p", "0000:06:00.0");
        let mut r = CniResult::new("1.1.0");
        r.interfaces.push(i);
        let v: serde_json::Value = serde_json::from_str(&r.to_json("1.1.0").unwrap()).unwrap();
        assert_eq!(
            v["interfaces"],
            serde_json::json!([{"name": "net1", "sandbox": "/run/netns/p", "pciID": "0000:06:00.0"}])
        );
        // 0.4.0 has no such field.
        let v: serde_json::Value = serde_json::from_str(&r.to_json("0.4.0").unwrap()).unwrap();
        assert!(v["interfaces"][0].get("pciID").is_none(), "{v}");
    }
}
