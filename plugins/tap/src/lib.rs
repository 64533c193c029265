//! `tap`: a persistent TAP device named CNI_IFNAME made directly in the
//! container's namespace (for a VM's network card), optionally a port of a
//! bridge there, addressed by IPAM or, without IPAM, an L2-only link; the
//! reference plugin's keys (v1.4.0+), flags and result shape.
//!
//! The reference makes the device with `ip tuntap add` (exec'd under the
//! config's SELinux label when it has one), or with its netlink library when
//! the config sets both `owner` and `group`; the two give different flags,
//! which [`Conf::tap_spec`] reproduces. Both are the same ioctls on
//! `/dev/net/tun`, done here in-process, or, under an SELinux label, by this
//! binary exec'd under that label (the kernel labels the device with its
//! creator's context).
//!
//! Unlike the reference: MTU and MAC are applied on both of its paths (its
//! netlink path drops them), the bridge is looked up before anything is
//! made, a failed ADD removes the device (the reference leaks it when the
//! rename or the MAC fails), CHECK also compares the device with the config,
//! and DEL releases IPAM's addresses alongside the device's removal.

mod conf;

pub use conf::Conf;
use rcni_attach::check::{self, PREV_RESULT_MISSING};
use rcni_attach::{
    Attach, Attachment, Dad, configure_iface, delegate_ipam, delete_container_link,
    ensure_ifname_free, in_container_for_del, interface, ipam_config, open_container, rt, sandbox,
    start_ipam_add, start_ipam_del, undo_link, wait_ipam,
};
use rcni_cni::rollback::Rollback;
use rcni_cni::skel::{About, CmdArgs};
use rcni_cni::{CniError, CniResult, first_error};
use rcni_netlink::tuntap::{TapSpec, create_tap, create_tap_here};
use rcni_netlink::{IPV4_DEVCONF_ARP_NOTIFY, Netlink};
use rcni_netns::NetNs;
use std::io::Write;

/// The tap is the result's only interface.
const IDX_CONTAINER: usize = 0;

/// Set in the environment of this binary exec'd to create a device under
/// an SELinux label: `name flags owner group` (`-` for none).
const HELPER_ENV: &str = "RCNI_TAP_CREATE";

pub struct Tap;

/// The binary's entry: the plugin, or the SELinux-labelled helper.
pub fn main() -> ! {
    if let Some(spec) = std::env::var_os(HELPER_ENV) {
        std::process::exit(helper(&spec.to_string_lossy()));
    }
    rcni_cni::skel::run(&Attach(Tap))
}

impl Attachment for Tap {
    type Conf = Conf;

    fn about(&self) -> About {
        About::all_versions("tap", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs, conf: &Conf) -> Result<CniResult, CniError> {
        if conf.ipam.is_none() {
            // A result without addresses has no 0.1.0/0.2.0 form: refused
            // before the device is made (the reference fails after, and
            // leaves the device behind).
            CniResult::new(args.version()).to_value(args.version())?;
        }
        let rt = rt()?;
        let ct_ns = open_container(args)?;
        let ct = rt.block_on(Netlink::connect(&ct_ns))?;
        rt.block_on(ensure_ifname_free(&ct, &args.ifname))?;
        let bridge = match &conf.bridge {
            Some(name) => Some(rt.block_on(ct.find_link(name))?.ok_or_else(|| {
                CniError::config(format!("failed to get bridge {name}: Link not found"))
            })?),
            None => None,
        };
        // IPAM runs beside the device's creation. Declared before the
        // rollback: dropped after it, a failed ADD releases the addresses
        // after removing the device that held them.
        let mut ipam = start_ipam_add(conf.ipam.as_deref(), args);
        let mut undo = Rollback::new();

        // Made under its final name, free in the container (checked above,
        // and IFF_TUN_EXCL refuses a device that took it since): nothing of
        // it shows anywhere else.
        make_tap(&ct_ns, &conf.tap_spec(&args.ifname), conf)?;
        let link = rt.block_on(ct.link_by_name(&args.ifname))?;
        undo_link(
            &mut undo,
            format!("tap {}", args.ifname),
            &rt,
            &ct,
            link.index,
        );
        rt.block_on(async {
            if let Some(mtu) = conf.mtu {
                ct.set_mtu(link.index, mtu).await?;
            }
            if let Some(mac) = conf.mac {
                ct.set_mac(link.index, mac).await?;
            }
            if let Some(br) = &bridge {
                ct.set_master(link.index, br.index).await.map_err(|e| {
                    CniError::from(e).context(format!(
                        "failed to set tap {} as a port of bridge {}",
                        args.ifname, br.name
                    ))
                })?;
            }
            Ok::<(), CniError>(())
        })?;

        let mut result = match &mut ipam {
            Some(p) => {
                let result = ipam_config(args.version(), p.wait_into(&mut undo)?, IDX_CONTAINER)?;
                // Best effort, as the reference's: neighbours learn the
                // device's MAC for its addresses once it is up.
                let _ =
                    rt.block_on(ct.set_ipv4_devconf(link.index, &[(IPV4_DEVCONF_ARP_NOTIFY, 1)]));
                // Without a reader attached the device has no carrier, so
                // the kernel holds IPv6 duplicate address detection until a
                // VM attaches; waiting for it here would wait for nothing
                // (the reference, given an IPv6 gateway, waits out its 10 seconds,
                // then succeeds).
                rt.block_on(configure_iface(&ct, &ct_ns, &link, &result, Dad::NoWait))?;
                result
            }
            None => {
                rt.block_on(ct.set_up(link.index))?;
                CniResult::new(args.version())
            }
        };
        let link = rt.block_on(ct.link_by_index(link.index))?;
        result.interfaces = vec![interface(&link, &sandbox(args))];
        // The reference's result has the config's DNS, whatever IPAM said.
        result.dns = args.conf.dns.clone().unwrap_or_default();
        undo.commit();
        if let Some(p) = ipam {
            p.commit();
        }
        Ok(result)
    }

    /// IPAM's release alongside the device's removal if the netns is still
    /// there; a missing netns or device is success.
    fn del(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        let pending = start_ipam_del(conf.ipam.as_deref(), args);
        let link = in_container_for_del(args, async |_, ct| {
            delete_container_link(ct, &args.ifname).await.map(|_| ())
        });
        first_error([wait_ipam(pending), link])
    }

    /// The reference's CHECK (IPAM's, then `prevResult`'s addresses and
    /// routes in the container), and the device as ADD made it: a TAP
    /// device with the recorded MAC, the configured flags, owner, group,
    /// MTU and bridge.
    fn check(&self, args: &CmdArgs, conf: &Conf) -> Result<(), CniError> {
        let ct_ns = open_container(args)?;
        delegate_ipam(conf.ipam.as_deref(), "CHECK", args)?;
        let prev = args.conf.required_prev_result(PREV_RESULT_MISSING)?;
        let iface = check::container_interface(&prev, &args.ifname, &sandbox(args))?;
        rt()?.block_on(async {
            let ct = Netlink::connect(&ct_ns).await?;
            let link = check::validate_link(&ct, iface, Some("tun")).await?;
            let info = ct.tun_info(link.index).await?.unwrap_or_default();
            conf.tap_matches(&info)
                .map_err(|e| CniError::check_failed(format!("tap {}: {e}", link.name)))?;
            if let Some(mtu) = conf.mtu
                && mtu != link.mtu
            {
                return Err(CniError::check_failed(format!(
                    "tap {}: MTU is {}, configured {mtu}",
                    link.name, link.mtu
                )));
            }
            if let Some(name) = &conf.bridge {
                let br = ct.find_link(name).await?;
                if br.is_none() || link.master != br.map(|b| b.index) {
                    return Err(CniError::check_failed(format!(
                        "tap {} is not a port of bridge {name}",
                        link.name
                    )));
                }
            }
            check::validate_ips(&ct, &link, &prev.ips, IDX_CONTAINER).await?;
            check::validate_routes(&ct, &prev.routes).await
        })
    }
}

/// Creates the device in the container: in-process, or, with an SELinux
/// label, by this binary exec'd under it.
fn make_tap(ct_ns: &NetNs, spec: &TapSpec, conf: &Conf) -> Result<(), CniError> {
    let Some(label) = &conf.selinux_context else {
        return create_tap(ct_ns, spec)
            .map_err(|e| CniError::from(e).context("failed to create tap"));
    };
    // The label is set for the next exec of the writing thread only, so
    // that thread is a throwaway one (inside the container's namespace,
    // which the helper inherits).
    std::thread::scope(|s| {
        s.spawn(|| ct_ns.run(|| exec_labelled(label, spec)))
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })?
}

/// On the calling thread: sets the SELinux exec label (as the reference's
/// `selinux.SetExecLabel`, which fails where no LSM takes it) and runs the
/// helper under it.
fn exec_labelled(label: &str, spec: &TapSpec) -> Result<(), CniError> {
    const ATTR: &str = "/proc/thread-self/attr/exec";
    std::fs::OpenOptions::new()
        .write(true)
        .open(ATTR)
        .and_then(|mut f| f.write_all(label.as_bytes()))
        .map_err(|e| CniError::config(format!("failed set socket label: write {ATTR}: {e}")))?;
    let exe = std::env::current_exe().map_err(|e| CniError::internal(e.to_string()))?;
    let out = std::process::Command::new(exe)
        .env_clear()
        .env(HELPER_ENV, encode(spec))
        .output()
        .map_err(|e| CniError::internal(format!("failed to create tap: {e}")))?;
    if !out.status.success() {
        return Err(CniError::internal(format!(
            "failed to create tap: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

fn encode(spec: &TapSpec) -> String {
    let id = |v: Option<u32>| v.map_or("-".to_string(), |v| v.to_string());
    format!(
        "{} {} {} {}",
        spec.name,
        spec.flags,
        id(spec.owner),
        id(spec.group)
    )
}

fn decode(s: &str) -> Option<TapSpec> {
    let mut it = s.split(' ');
    let name = it.next()?.to_string();
    let flags = it.next()?.parse().ok()?;
    let id = |v: &str| match v {
        "-" => Some(None),
        v => v.parse().ok().map(Some),
    };
    let owner = id(it.next()?)?;
    let group = id(it.next()?)?;
    Some(TapSpec {
        name,
        flags,
        owner,
        group,
    })
}

/// The helper: creates the device `spec` describes in its own namespace.
fn helper(spec: &str) -> i32 {
    let Some(spec) = decode(spec) else {
        eprintln!("{HELPER_ENV}: malformed {spec:?}");
        return 2;
    };
    match create_tap_here(&spec) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("create tap {}: {e}", spec.name);
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helper_spec_round_trips() {
        for spec in [
            TapSpec {
                name: "eth0".into(),
                flags: 0x1002,
                owner: Some(0),
                group: None,
            },
            TapSpec {
                name: "net1".into(),
                flags: 0x4102,
                owner: None,
                group: Some(4294967295),
            },
        ] {
            assert_eq!(decode(&encode(&spec)), Some(spec));
        }
        assert_eq!(decode("eth0 2 x -"), None);
        assert_eq!(decode("eth0"), None);
    }
}
