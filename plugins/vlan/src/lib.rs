//! `vlan`: an 802.1Q link on a master interface of the node (or, with
//! `linkInContainer`, of the container), moved into the container under
//! CNI_IFNAME, with the reference plugin's result shape.
//!
//! Unlike the reference, DEL needs neither the master nor the netns (the
//! reference looks the master up to validate the MTU and fails once it is
//! gone), ADD undoes the link when IPAM or addressing fails, and a config
//! without IPAM is an L2-only attachment instead of an error.

mod conf;

use conf::Conf;
use rcni_attach::check::{self, check_failed};
use rcni_attach::{
    Dad, configure_iface, delete_container_link, delete_link, ensure_ifname_free, interface,
    open_container, open_container_for_del, random_temp_name, rt, sandbox,
};
use rcni_cni::invoke::{delegate_add, delegate_cmd};
use rcni_cni::rollback::Rollback;
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, version};
use rcni_netlink::{Link, Netlink};
use rcni_netns::NetNs;

pub struct Vlan;

/// The vlan link is the result's only interface.
const IDX_CONTAINER: usize = 0;

/// The master, looked up where the config says it lives.
async fn find_master(host: &Netlink, ct: &Netlink, conf: &Conf) -> Result<Link, CniError> {
    let nl = if conf.link_in_container { ct } else { host };
    nl.find_link(&conf.master).await?.ok_or_else(|| {
        CniError::config(format!(
            "failed to lookup master {:?}: link not found",
            conf.master
        ))
    })
}

impl Vlan {
    fn add_inner(&self, args: &CmdArgs, conf: &Conf) -> Result<CniResult, CniError> {
        let rt = rt()?;
        let host_ns = NetNs::current()?;
        let ct_ns = open_container(args)?;
        let host = rt.block_on(Netlink::connect(&host_ns))?;
        let ct = rt.block_on(Netlink::connect(&ct_ns))?;
        let master = rt.block_on(find_master(&host, &ct, conf))?;
        conf.check_mtu(master.mtu)?;
        rt.block_on(ensure_ifname_free(&ct, &args.ifname))?;
        let mut undo = Rollback::new();

        // Created under a temporary name, directly in the container (the
        // final name may be taken where the master lives), then renamed.
        let tmp = random_temp_name();
        let link = rt.block_on(async {
            let (nl, target) = if conf.link_in_container {
                (&ct, None)
            } else {
                (&host, Some(&ct_ns))
            };
            nl.create_vlan(&tmp, master.index, conf.vlan_id, conf.mtu, target)
                .await
                .map_err(|e| CniError::from(e).context("failed to create vlan"))?;
            ct.link_by_name(&tmp).await.map_err(CniError::from)
        })?;
        let (index, rt_ref, ct_ref) = (link.index, &rt, &ct);
        undo.push(format!("vlan {}", args.ifname), move || {
            rt_ref.block_on(delete_link(ct_ref, index))
        });
        rt.block_on(ct.set_name(link.index, &args.ifname))?;
        let link = rt.block_on(ct.link_by_index(link.index))?;

        let mut result = CniResult::new(args.version());
        if let Some(ipam) = &conf.ipam {
            let r = delegate_add(ipam, &args.stdin, &args.path, args.version())?;
            undo.push(format!("IPAM {ipam}"), || {
                delegate_cmd(ipam, "DEL", &args.stdin, &args.path)
            });
            if r.ips.is_empty() {
                return Err(CniError::internal("IPAM plugin returned missing IP config"));
            }
            result.ips = r.ips;
            result.routes = r.routes;
            result.dns = r.dns;
            for ip in &mut result.ips {
                ip.interface = Some(IDX_CONTAINER);
            }
            // Other hosts share the VLAN: IPv6 addresses go through
            // duplicate address detection, and ADD waits for it as the
            // reference does.
            rt.block_on(configure_iface(&ct, &ct_ns, &link, &result, Dad::Wait))?;
        } else {
            rt.block_on(ct.set_up(link.index))?;
        }
        let link = rt.block_on(ct.link_by_index(link.index))?;
        result.interfaces = vec![interface(&link, &sandbox(args))];
        if let Some(dns) = &conf.dns {
            result.dns = dns.clone();
        }
        undo.commit();
        Ok(result)
    }
}

impl Plugin for Vlan {
    fn about(&self) -> About {
        About {
            name: "vlan",
            version: env!("CARGO_PKG_VERSION"),
            supported_versions: version::ALL,
        }
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let conf = Conf::load(args)?;
        self.add_inner(args, &conf)
    }

    /// IPAM first, then the link if the netns is still there; a missing
    /// master, netns or link is success.
    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let mut errors = Vec::new();
        if let Err(e) = rcni_attach::delegate_ipam(conf.ipam.as_deref(), "DEL", args) {
            errors.push(e);
        }
        let r = open_container_for_del(args).and_then(|ct_ns| match ct_ns {
            None => Ok(()),
            Some(ct_ns) => rt()?.block_on(async {
                let ct = Netlink::connect(&ct_ns).await?;
                delete_container_link(&ct, &args.ifname).await.map(|_| ())
            }),
        });
        if let Err(e) = r {
            errors.push(e);
        }
        rcni_attach::first_error(errors)
    }

    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        rcni_attach::delegate_ipam(conf.ipam.as_deref(), "CHECK", args)?;
        let prev = check::prev_result(args)?;
        let ct_ns = open_container(args)?;
        let host_ns = NetNs::current()?;
        let ct_if = check::container_interface(&prev, &args.ifname, &sandbox(args))?;
        rt()?.block_on(async {
            let host = Netlink::connect(&host_ns).await?;
            let ct = Netlink::connect(&ct_ns).await?;
            let master = find_master(&host, &ct, &conf)
                .await
                .map_err(|e| check_failed(e.msg))?;
            let link = check::validate_link(&ct, ct_if, Some("vlan")).await?;
            if link.link != Some(master.index) {
                return Err(check_failed(format!(
                    "vlan: {} is not on master {}",
                    link.name, conf.master
                )));
            }
            let id = ct.vlan_id(link.index).await?;
            if id != Some(conf.vlan_id) {
                return Err(check_failed(format!(
                    "vlan: {} has VLAN ID {}, configured {}",
                    link.name,
                    id.map_or("none".into(), |i| i.to_string()),
                    conf.vlan_id
                )));
            }
            if let Some(mtu) = conf.mtu
                && mtu != link.mtu
            {
                return Err(check_failed(format!(
                    "vlan: configured MTU of {} is {mtu}, current value is {}",
                    link.name, link.mtu
                )));
            }
            check::validate_ips(&ct, &link, &prev.ips, IDX_CONTAINER).await?;
            check::validate_routes(&ct, &prev.routes).await
        })
    }

    fn status(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        rcni_attach::delegate_ipam(conf.ipam.as_deref(), "STATUS", args)
    }

    /// The only state outside the container is IPAM's.
    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        rcni_attach::delegate_ipam(conf.ipam.as_deref(), "GC", args)
    }
}
