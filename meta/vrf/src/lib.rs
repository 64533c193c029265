//! `vrf`: puts the pod interface made by the plugin before it into a VRF
//! (an L3 master device whose routing table is the interface's), chained.
//! Upstream v1.9.1's behaviour: the VRF `vrfname` is created in the pod's
//! namespace if missing (on `table`, or the lowest table no VRF there uses),
//! CNI_IFNAME is enslaved, the global IPv6 addresses the enslaving drops are
//! put back (and waited for), and the interface's main-table routes are
//! re-added in the VRF's table; `prevResult` is the result. DEL takes the
//! interface out and removes the VRF with its last member; CHECK verifies
//! membership.
//!
//! Better than the reference: a failed ADD undoes what it did (the VRF it
//! created is removed, the interface taken out again with its addresses
//! and routes put back; the reference leaves a VRF behind); runs in one
//! namespace are serialised (two never race to create the VRF, nor does a
//! DEL remove it under an ADD); the interface's static link-scope routes
//! move with the others, before them (ptp's route to its gateway, which the
//! reference drops, so its re-adding of the routes via that gateway fails);
//! DEL succeeds when CNI_IFNAME is gone or is no member (the reference
//! fails, or takes the interface out of another master), and leaves a link
//! of that name that is no VRF alone; the reserved tables 253-255 are never
//! picked.

use std::path::Path;
use std::time::Duration;

use ipnetwork::IpNetwork;
use rcni_attach::{open_container, open_container_for_del};
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, ErrorCode};
use rcni_netlink::{Address, Family, Link, Netlink, Route, SCOPE_UNIVERSE};
use serde::Deserialize;

pub struct Vrf;

/// `version.VersionsStartingFrom("0.3.1")`, as the reference.
const VERSIONS: &[&str] = &["0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// `RTPROT_KERNEL`: routes the kernel made for an address.
const RTPROT_KERNEL: u8 = 2;

/// The reference's wait for a restored IPv6 address to become usable (its
/// local route in the VRF's table, once DAD is done): 10 ms doubling, nine
/// looks, about 2.5 s.
const RESTORE_FIRST_WAIT: Duration = Duration::from_millis(10);
const RESTORE_LOOKS: u32 = 9;

#[derive(Debug, Deserialize)]
struct Raw {
    #[serde(default)]
    vrfname: Option<String>,
    #[serde(default)]
    table: Option<i64>,
}

/// The validated config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conf {
    /// `vrfname`.
    pub name: String,
    /// `table`; 0 lets ADD pick one.
    pub table: u32,
}

impl Conf {
    pub fn load(args: &CmdArgs) -> Result<Conf, CniError> {
        let raw: Raw = args.conf.plugin_conf()?;
        let name = raw.vrfname.unwrap_or_default();
        if name.is_empty() {
            return Err(CniError::config(
                "configuration is expected to have a valid vrf name",
            ));
        }
        // A link name: the kernel's rules (dev_valid_name).
        if name.len() > 15
            || name == "."
            || name == ".."
            || name
                .chars()
                .any(|c| c == '/' || c == ':' || c.is_whitespace())
        {
            return Err(CniError::unsupported("vrfname", format!("{name:?}")));
        }
        let table = match raw.table {
            None => 0,
            Some(t @ 0..=0xffff_ffff) => t as u32,
            Some(t) => return Err(CniError::unsupported("table", t)),
        };
        Ok(Conf { name, table })
    }
}

/// The lowest table from 1 that no VRF in `used` has, as the reference
/// picks, but never the kernel's default, main or local table.
pub fn free_table(used: &[u32]) -> Option<u32> {
    (1..=u32::MAX).find(|t| !(253..=255).contains(t) && !used.contains(t))
}

fn netns_path(args: &CmdArgs) -> Result<&Path, CniError> {
    args.netns.as_deref().ok_or_else(|| {
        CniError::new(
            ErrorCode::InvalidEnvironmentVariables,
            "required env variables [CNI_NETNS] missing",
        )
    })
}

/// The VRF named `name`: `None` if no link has that name, an error (code
/// 7) if the link is no VRF; else the link and its table.
async fn find_vrf(nl: &Netlink, name: &str) -> Result<Option<(Link, u32)>, CniError> {
    let Some(link) = nl.find_link(name).await? else {
        return Ok(None);
    };
    match nl.vrf_table(link.index).await? {
        Some(t) => Ok(Some((link, t))),
        None => Err(CniError::config(format!("Netlink {name} is not a VRF"))),
    }
}

/// The links whose master is `vrf`.
async fn members(nl: &Netlink, vrf: u32) -> Result<Vec<Link>, CniError> {
    Ok(nl
        .links()
        .await?
        .into_iter()
        .filter(|l| l.master == Some(vrf))
        .collect())
}

/// The main-table routes of link `index` that enslaving drops and the
/// kernel does not make again: all but those it made for an IPv4 address
/// (connected subnets, `proto kernel scope link`). Link-scope ones first:
/// gateways of the others may be reachable only through them.
fn routes_to_move(routes: Vec<Route>, index: u32) -> Vec<Route> {
    let mut v: Vec<Route> = routes
        .into_iter()
        .filter(|r| r.oif == Some(index))
        .filter(|r| r.scope == SCOPE_UNIVERSE || r.protocol != Some(RTPROT_KERNEL))
        .collect();
    v.sort_by_key(|r| std::cmp::Reverse(r.scope));
    v
}

/// What ADD saved of the interface before enslaving it.
struct Saved {
    index: u32,
    /// Its global IPv6 addresses with their flags.
    v6: Vec<(Address, u32)>,
    routes: Vec<Route>,
}

/// Adds those of `saved.v6` the link lacks now.
async fn restore_v6(nl: &Netlink, saved: &Saved) -> Result<Vec<IpNetwork>, CniError> {
    let now: Vec<IpNetwork> = nl
        .addresses(Some(saved.index))
        .await?
        .into_iter()
        .map(|a| a.addr)
        .collect();
    let mut added = Vec::new();
    for (a, flags) in &saved.v6 {
        if now.contains(&a.addr) {
            continue;
        }
        nl.add_address_with_flags(saved.index, a.addr, *flags)
            .await
            .map_err(|e| {
                CniError::from(e).context(format!("could not restore address {}", a.addr))
            })?;
        added.push(a.addr);
    }
    Ok(added)
}

/// Enslaving done: the addresses back and usable, the routes in `table`.
async fn settle(nl: &Netlink, saved: &Saved, table: u32, ifname: &str) -> Result<(), CniError> {
    for addr in restore_v6(nl, saved).await? {
        let mut wait = RESTORE_FIRST_WAIT;
        let mut look = 1;
        while !nl.has_host_route(addr.ip(), table, saved.index).await? {
            if look == RESTORE_LOOKS {
                return Err(CniError::new(
                    ErrorCode::Netlink,
                    format!(
                        "failed getting local/host addresses for {ifname} in table {table} \
                         with dst {addr}"
                    ),
                ));
            }
            tokio::time::sleep(wait).await;
            wait *= 2;
            look += 1;
        }
    }
    for r in &saved.routes {
        let moved = Route { table, ..r.clone() };
        nl.ensure_route(&moved)
            .await
            .map_err(|e| CniError::from(e).context(format!("could not add route '{moved}'")))?;
    }
    Ok(())
}

/// A failed ADD after enslaving: the interface out of the VRF again, with
/// what that drops once more put back in the main table.
async fn unslave(nl: &Netlink, saved: &Saved) {
    let _ = nl.set_nomaster(saved.index).await;
    let _ = restore_v6(nl, saved).await;
    for r in &saved.routes {
        let _ = nl.ensure_route(r).await;
    }
}

/// Enslaves `ifname` to VRF `vrf` (index `vrf_index`, table `table`).
async fn enslave(
    nl: &Netlink,
    vrf: &str,
    vrf_index: u32,
    table: u32,
    ifname: &str,
) -> Result<(), CniError> {
    let link = nl
        .find_link(ifname)
        .await?
        .ok_or_else(|| CniError::config(format!("could not get link by name {ifname}")))?;
    if let Some(m) = link.master {
        let master = match nl.link_by_index(m).await {
            Ok(l) => l.name,
            Err(e) => e.to_string(),
        };
        return Err(CniError::config(format!(
            "interface {ifname} has already a master set: {master}"
        )));
    }
    let v6 = nl
        .addresses_with_flags(link.index, Family::V6)
        .await?
        .into_iter()
        .filter(|(a, _)| a.scope == SCOPE_UNIVERSE)
        .collect();
    let routes = routes_to_move(nl.routes(Family::All).await?, link.index);
    let saved = Saved {
        index: link.index,
        v6,
        routes,
    };
    nl.set_master(link.index, vrf_index).await.map_err(|e| {
        CniError::from(e).context(format!("could not set vrf {vrf} as master of {ifname}"))
    })?;
    let r = settle(nl, &saved, table, ifname).await;
    if r.is_err() {
        unslave(nl, &saved).await;
    }
    r
}

async fn setup(nl: &Netlink, conf: &Conf, ifname: &str) -> Result<(), CniError> {
    let name = &conf.name;
    let (vrf, table, created) = match find_vrf(nl, name).await? {
        Some((_, t)) if conf.table != 0 && t != conf.table => {
            return Err(CniError::config(format!(
                "VRF {name} already exist with different routing table {t}"
            )));
        }
        Some((l, t)) => (l, t, false),
        None => {
            let table = match conf.table {
                0 => {
                    let used: Vec<u32> = nl.vrfs().await?.into_iter().map(|(_, t)| t).collect();
                    free_table(&used).ok_or_else(|| {
                        CniError::internal(
                            "findFreeRoutingTableID: Failed to find an available routing id",
                        )
                    })?
                }
                t => t,
            };
            let l = nl
                .create_vrf(name, table)
                .await
                .map_err(|e| CniError::from(e).context(format!("could not add VRF {name}")))?;
            if let Err(e) = nl.set_up(l.index).await {
                let _ = nl.delete_link(l.index).await;
                return Err(
                    CniError::from(e).context(format!("could not set link up for VRF {name}"))
                );
            }
            (l, table, true)
        }
    };
    let r = enslave(nl, name, vrf.index, table, ifname).await;
    if r.is_err() && created {
        let _ = nl.delete_link(vrf.index).await;
    }
    r
}

impl Plugin for Vrf {
    fn about(&self) -> About {
        About {
            name: "vrf",
            version: env!("CARGO_PKG_VERSION"),
            supported_versions: VERSIONS,
        }
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let conf = Conf::load(args)?;
        let prev = args
            .conf
            .required_prev_result("missing prevResult from earlier plugin")?;
        let ns = open_container(args)?;
        let _lock = rcni_attach::lock_netns(netns_path(args)?)?;
        let rt = rcni_netlink::runtime()?;
        rt.block_on(async {
            let nl = Netlink::connect(&ns).await?;
            setup(&nl, &conf, &args.ifname).await
        })
        .map_err(|e| e.context("cmdAdd failed"))?;
        Ok(prev)
    }

    /// Takes CNI_IFNAME out of the VRF and removes the VRF once no link is
    /// its member. A missing netns, VRF or interface is no error.
    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let Some(ns) = open_container_for_del(args)? else {
            return Ok(());
        };
        let _lock = rcni_attach::lock_netns(netns_path(args)?)?;
        let rt = rcni_netlink::runtime()?;
        rt.block_on(async {
            let nl = Netlink::connect(&ns).await?;
            let Some(vrf) = nl.find_link(&conf.name).await? else {
                return Ok(());
            };
            // A link of that name that is no VRF was not made by ADD.
            if nl.vrf_table(vrf.index).await?.is_none() {
                return Ok(());
            }
            let mut first_err = None;
            if let Some(l) = nl.find_link(&args.ifname).await?
                && l.master == Some(vrf.index)
                && let Err(e) = nl.set_nomaster(l.index).await
                && !e.is_not_found()
            {
                first_err = Some(CniError::from(e).context(format!(
                    "resetMaster: could reset master to {}",
                    args.ifname
                )));
            }
            if members(&nl, vrf.index).await?.is_empty()
                && let Err(e) = nl.delete_link(vrf.index).await
                && !e.is_not_found()
            {
                first_err.get_or_insert(CniError::from(e));
            }
            first_err.map_or(Ok(()), Err)
        })
    }

    /// The VRF exists and CNI_IFNAME is its member.
    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        args.conf
            .required_prev_result("missing prevResult from earlier plugin")?;
        let ns = open_container(args)?;
        let rt = rcni_netlink::runtime()?;
        rt.block_on(async {
            let nl = Netlink::connect(&ns).await?;
            let name = &conf.name;
            let (vrf, _) = find_vrf(&nl, name)
                .await
                .map_err(|e| CniError::check_failed(e.msg))?
                .ok_or_else(|| CniError::check_failed(format!("vrf {name}: Link not found")))?;
            if members(&nl, vrf.index)
                .await?
                .iter()
                .any(|l| l.name == args.ifname)
            {
                return Ok(());
            }
            Err(CniError::check_failed(format!(
                "failed to find {} associated to vrf {name}",
                args.ifname
            )))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn load(extra: serde_json::Value) -> Result<Conf, CniError> {
        let mut c = json!({"cniVersion": "1.0.0", "name": "n", "type": "vrf"});
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        Conf::load(&CmdArgs::for_conf(&c)?)
    }

    #[test]
    fn config_keys() {
        assert_eq!(
            load(json!({"vrfname": "blue"})).unwrap(),
            Conf {
                name: "blue".into(),
                table: 0
            }
        );
        // Go matches keys case-insensitively: upstream's own tests say vrfName.
        assert_eq!(
            load(json!({"vrfName": "blue", "table": 1001})).unwrap(),
            Conf {
                name: "blue".into(),
                table: 1001
            }
        );
        for missing in [json!({}), json!({"vrfname": ""}), json!({"vrfname": null})] {
            let e = load(missing).unwrap_err();
            assert_eq!(e.code, 7);
            assert_eq!(e.msg, "configuration is expected to have a valid vrf name");
        }
        for bad in ["a/b", "sixteen-chars-xx", "..", "a b"] {
            assert_eq!(load(json!({"vrfname": bad})).unwrap_err().code, 2, "{bad}");
        }
        for bad in [-1, 1i64 << 32] {
            assert_eq!(
                load(json!({"vrfname": "v", "table": bad}))
                    .unwrap_err()
                    .code,
                2
            );
        }
        assert_eq!(
            load(json!({"vrfname": "v", "table": "5"}))
                .unwrap_err()
                .code,
            7
        );
    }

    #[test]
    fn tables_are_picked_as_the_reference_does() {
        assert_eq!(free_table(&[]), Some(1));
        assert_eq!(free_table(&[1, 2, 4]), Some(3));
        assert_eq!(free_table(&[2]), Some(1));
        let many: Vec<u32> = (1..=252).collect();
        assert_eq!(free_table(&many), Some(256), "253-255 are the kernel's");
    }

    #[test]
    fn routes_that_move() {
        let r = |dst: &str, scope: u8, proto: u8, oif: u32| {
            let mut r = Route::new(dst.parse().unwrap()).oif(oif).scope(scope);
            r.protocol = Some(proto);
            r
        };
        let routes = vec![
            r("10.1.0.0/24", 0, 4, 2),   // via a gateway (static)
            r("10.0.0.0/24", 253, 2, 2), // connected: the kernel's
            r("10.0.0.1/32", 253, 3, 2), // ptp's route to its gateway
            r("fd00::/64", 0, 2, 2),     // IPv6 prefix route
            r("10.9.0.0/24", 0, 3, 3),   // another link's
        ];
        let got: Vec<String> = routes_to_move(routes, 2)
            .iter()
            .map(|r| r.dst.to_string())
            .collect();
        assert_eq!(got, ["10.0.0.1/32", "10.1.0.0/24", "fd00::/64"]);
    }
}
