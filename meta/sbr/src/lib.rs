//! `sbr`: source-based routing for a pod interface, chained after the
//! plugin that made it. For each address of CNI_IFNAME in `prevResult` a
//! routing table of its own (the first free from 100), a rule sending
//! traffic from that address to it, a default route via the address's
//! gateway there, and the interface's routes moved from the main table into
//! it; so replies leave by the interface that owns their source address.
//! The reference's 1.1.1 behaviour, kernel state included (rules without
//! priority, which the kernel numbers down from 32765).
//!
//! Added: `table` (upstream's later key): rules to that table only, the
//! routes left where they are. Upstream v1.10.0's `gateways` (a static
//! default gateway per family, over prevResult's) and `addSourceHints`
//! (the subnet routes stay in the main table with the address as source);
//! both ignored with `table`, as upstream. Unlike the reference, a failed ADD undoes
//! what it did; DEL succeeds without the netns or the interface (the rules
//! of `prevResult`'s addresses go) and also removes the routes it left in
//! the interface's tables; a table that still holds routes is not reused;
//! CHECK verifies the rules.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnetwork::IpNetwork;
use rcni_attach::open_container_for_del;
use rcni_cni::skel::{About, CmdArgs, Plugin};
use rcni_cni::{CniError, CniResult, IpConfig, subnet};
use rcni_netlink::{Family, Netlink, Route, Rule, SCOPE_LINK, TABLE_MAIN};
use rcni_netns::NetNs;
use serde::Deserialize;

pub struct Sbr;

/// The reference's first table.
const FIRST_TABLE: u32 = 100;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    #[serde(default)]
    table: Option<i64>,
    // Options: Go's decoder takes `null` for either as unset.
    #[serde(default)]
    gateways: Option<Vec<String>>,
    #[serde(default)]
    add_source_hints: Option<bool>,
}

/// The validated config.
#[derive(Debug)]
pub struct Conf {
    /// `table`: every rule to this table, routes untouched.
    pub table: Option<u32>,
    /// `gateways` as given: checked by ADD only, and only without `table`
    /// (upstream checks them there, so DEL and CHECK of a bad list work).
    pub gateways: Vec<String>,
    /// `addSourceHints`.
    pub add_source_hints: bool,
}

impl Conf {
    pub fn load(args: &CmdArgs) -> Result<Conf, CniError> {
        let raw: Raw = args.conf.plugin_conf()?;
        let table = match raw.table {
            None => None,
            Some(t @ 1..=0xffff_ffff) => Some(t as u32),
            Some(t) => return Err(CniError::unsupported("table", t)),
        };
        Ok(Conf {
            table,
            gateways: raw.gateways.unwrap_or_default(),
            add_source_hints: raw.add_source_hints.unwrap_or_default(),
        })
    }
}

/// The `gateways` key, at most one address per family.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StaticGateways {
    pub v4: Option<Ipv4Addr>,
    pub v6: Option<Ipv6Addr>,
}

impl StaticGateways {
    /// Upstream's checks and texts, in its order. An IPv4-mapped IPv6
    /// address counts as IPv4, as Go's `To4` has it.
    pub fn parse(list: &[String]) -> Result<StaticGateways, CniError> {
        if list.len() > 2 {
            return Err(CniError::config(
                "gateways list cannot contain more than 2 entries (one IPv4, one IPv6)",
            ));
        }
        let mut g = StaticGateways::default();
        for s in list {
            let ip: IpAddr = s
                .parse()
                .map_err(|_| CniError::config(format!("invalid static gateway IP address: {s}")))?;
            match ip.to_canonical() {
                IpAddr::V4(v4) => match g.v4 {
                    Some(first) => {
                        return Err(CniError::config(format!(
                            "gateways list contains multiple IPv4 addresses: {first} and {s}"
                        )));
                    }
                    None => g.v4 = Some(v4),
                },
                IpAddr::V6(v6) => match g.v6 {
                    Some(first) => {
                        return Err(CniError::config(format!(
                            "gateways list contains multiple IPv6 addresses: {first} and {s}"
                        )));
                    }
                    None => g.v6 = Some(v6),
                },
            }
        }
        Ok(g)
    }

    /// The default gateway of `ip`'s table: the static one of its family,
    /// else prevResult's.
    pub fn for_ip(&self, ip: &IpConfig) -> Option<IpAddr> {
        let fixed = match ip.address {
            IpNetwork::V4(_) => self.v4.map(IpAddr::V4),
            IpNetwork::V6(_) => self.v6.map(IpAddr::V6),
        };
        fixed.or(ip.gateway)
    }
}

/// The addresses of `prev` that are `ifname`'s: those naming it, and those
/// naming no interface (or one out of range), as the reference.
pub fn ips_of(ifname: &str, prev: &CniResult) -> Result<Vec<IpConfig>, CniError> {
    if prev.ips.is_empty() {
        return Err(CniError::config(format!(
            "No IP addresses supplied on interface: {ifname}"
        )));
    }
    Ok(prev
        .ips
        .iter()
        .filter(|ip| match ip.interface {
            Some(i) => prev
                .interfaces
                .get(i)
                .is_none_or(|iface| iface.name == ifname),
            None => true,
        })
        .cloned()
        .collect())
}

/// The address as a single-host prefix: a rule's source.
fn host(ip: IpAddr) -> IpNetwork {
    let prefix = if ip.is_ipv4() { 32 } else { 128 };
    IpNetwork::new(ip, prefix).expect("host prefix is valid")
}

/// The first table from `from` on that no rule looks up and no route is in.
fn next_free(used: &BTreeSet<u32>, mut from: u32) -> u32 {
    while used.contains(&from) {
        from += 1;
    }
    from
}

/// What ADD changed, undone in reverse when a later step fails.
enum Done {
    Rule(Rule),
    Route(Route),
    Removed(Route),
}

async fn undo(nl: &Netlink, done: Vec<Done>) {
    for d in done.into_iter().rev() {
        let _ = match d {
            Done::Rule(r) => nl.del_rule(&r).await,
            Done::Route(r) => nl.del_route(&r).await,
            Done::Removed(r) => nl.add_route(&r).await,
        };
    }
}

/// The reference's `doRoutes`: tables, rules and default routes for `ips`,
/// and the interface's main-table routes moved into them.
async fn setup_tables(
    nl: &Netlink,
    ips: &[IpConfig],
    ifname: &str,
    conf: &Conf,
    done: &mut Vec<Done>,
) -> Result<(), CniError> {
    let mut used: BTreeSet<u32> = nl
        .rules(Family::All)
        .await?
        .iter()
        .map(|r| r.table)
        .collect();
    used.extend(
        nl.routes_in_table(Family::All, None)
            .await?
            .iter()
            .map(|r| r.table),
    );
    let link = nl
        .find_link(ifname)
        .await?
        .ok_or_else(|| CniError::config(format!("Cannot find network interface {ifname}")))?;
    let routes: Vec<Route> = nl
        .routes(Family::All)
        .await?
        .into_iter()
        .filter(|r| r.oif == Some(link.index))
        .collect();
    let gateways = StaticGateways::parse(&conf.gateways)?;

    let mut table = next_free(&used, FIRST_TABLE);
    for ip in ips {
        let rule = Rule::from_src(host(ip.address.ip()), table);
        nl.add_rule(&rule)
            .await
            .map_err(|e| CniError::from(e).context("Failed to add rule"))?;
        done.push(Done::Rule(rule));
        // The previous plugin may have left no default route: one via the
        // address's gateway, in its table.
        if let Some(gw) = gateways.for_ip(ip) {
            let any = IpNetwork::new(
                if gw.is_ipv4() {
                    [0u8; 4].into()
                } else {
                    [0u16; 8].into()
                },
                0,
            )
            .expect("default route prefix");
            let r = Route::new(any).gateway(gw).oif(link.index).table(table);
            nl.add_route(&r).await.map_err(|e| {
                CniError::from(e).context(format!("Failed to add default route to {gw}"))
            })?;
            done.push(Done::Route(r));
        }
        // The interface's routes of this address (its subnet, via gateways
        // in it) and the generic ones (neither source nor gateway), into
        // the table; replaced, as the default route may be among them.
        for r in &routes {
            let mine = r.src.is_some_and(|s| ip.address.contains(s))
                || r.gateway.is_some_and(|g| ip.address.contains(g))
                || (r.src.is_none() && r.gateway.is_none());
            if mine {
                let copy = Route { table, ..r.clone() };
                nl.ensure_route(&copy)
                    .await
                    .map_err(|e| CniError::from(e).context("Failed to readd route"))?;
                done.push(Done::Route(copy));
            }
        }
        table = next_free(&used, table + 1);
    }
    if conf.add_source_hints {
        source_hints(nl, ips, link.index, &routes).await;
        return Ok(());
    }
    // Only now out of the main table: addresses of one subnet share routes.
    for r in routes {
        match nl.del_route(&r).await {
            Err(e) if !e.is_not_found() => {
                return Err(CniError::from(e).context("Failed to delete route"));
            }
            _ => done.push(Done::Removed(r)),
        }
    }
    Ok(())
}

/// `addSourceHints`: each address's subnet stays routed in the main table,
/// with the address as source, so traffic that picks its source by
/// destination leaves by this interface too; then only the interface's
/// routes that are not link scope (via gateways, and IPv6's, which the
/// kernel always reports as universe) leave the main table. As upstream,
/// failures are warnings: the rules and tables, the point of sbr, are in
/// place, and nothing is undone after this.
async fn source_hints(nl: &Netlink, ips: &[IpConfig], oif: u32, routes: &[Route]) {
    for ip in ips {
        let hint = Route::new(subnet(&ip.address))
            .oif(oif)
            .src(ip.address.ip())
            .scope(SCOPE_LINK)
            .table(TABLE_MAIN);
        if let Err(e) = nl.ensure_route(&hint).await {
            eprintln!("sbr: Warning: Failed to add subnet route to main table: {e}");
        }
    }
    for r in routes.iter().filter(|r| r.scope != SCOPE_LINK) {
        if let Err(e) = nl.del_route(r).await {
            eprintln!("sbr: Warning: Failed to delete route: {e}");
        }
    }
}

impl Plugin for Sbr {
    fn about(&self) -> About {
        About::all_versions("sbr", env!("CARGO_PKG_VERSION"))
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        let conf = Conf::load(args)?;
        let prev = args
            .conf
            .required_prev_result("This plugin must be called as chained plugin")?;
        let ips = ips_of(&args.ifname, &prev)?;
        let path = args
            .netns
            .as_deref()
            .ok_or_else(|| CniError::config("CNI_NETNS is required"))?;
        let ns = NetNs::open(path)?;
        let _lock = rcni_attach::lock_netns(path)?;
        let rt = rcni_netlink::runtime()?;
        rt.block_on(async {
            let nl = Netlink::connect(&ns).await?;
            let mut done = Vec::new();
            let r = match conf.table {
                Some(table) => add_rules(&nl, &ips, table, &mut done).await,
                None => setup_tables(&nl, &ips, &args.ifname, &conf, &mut done).await,
            };
            if r.is_err() {
                undo(&nl, done).await;
            }
            r
        })?;
        Ok(prev)
    }

    /// Removes the rules whose source is an address of CNI_IFNAME (as it is
    /// now, and as `prevResult` says), and the routes of the interface left
    /// in the tables only those rules looked up. A missing netns or
    /// interface is no error.
    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let prev = args.conf.prev_result().ok().flatten();
        let (Some(ns), Some(path)) = (open_container_for_del(args)?, args.netns.as_deref()) else {
            return Ok(());
        };
        let _lock = rcni_attach::lock_netns(path)?;
        let rt = rcni_netlink::runtime()?;
        rt.block_on(async {
            let nl = Netlink::connect(&ns).await?;
            let link = nl.find_link(&args.ifname).await?;
            let mut addrs: BTreeSet<IpAddr> = BTreeSet::new();
            if let Some(l) = &link {
                addrs.extend(
                    nl.addresses(Some(l.index))
                        .await?
                        .iter()
                        .map(|a| a.addr.ip()),
                );
            }
            if let Some(p) = &prev {
                addrs.extend(
                    ips_of(&args.ifname, p)
                        .unwrap_or_default()
                        .iter()
                        .map(|i| i.address.ip()),
                );
            }
            let rules = nl.rules(Family::All).await?;
            let mut first_err = None;
            let mut tables = BTreeSet::new();
            let (gone, kept): (Vec<&Rule>, Vec<&Rule>) = rules.iter().partition(|r| {
                r.src.is_some_and(|s| addrs.contains(&s.ip()))
                    && conf.table.is_none_or(|t| r.table == t)
            });
            for r in gone {
                match nl.del_rule(r).await {
                    Err(e) if !e.is_not_found() => {
                        first_err.get_or_insert(CniError::from(e).context("Failed to delete rule"));
                    }
                    _ => {
                        tables.insert(r.table);
                    }
                }
            }
            // The interface's routes in its own tables, now looked up by no
            // rule (the reference leaves them until the link goes).
            if let (Some(l), None) = (&link, conf.table) {
                for t in tables {
                    if t == TABLE_MAIN || t >= 253 || kept.iter().any(|r| r.table == t) {
                        continue;
                    }
                    for r in nl.routes_in_table(Family::All, Some(t)).await? {
                        if r.oif == Some(l.index)
                            && let Err(e) = nl.del_route(&r).await
                            && !e.is_not_found()
                        {
                            first_err.get_or_insert(CniError::from(e));
                        }
                    }
                }
            }
            first_err.map_or(Ok(()), Err)
        })
    }

    /// Every address of the interface in `prevResult` has its rule. Without
    /// `prevResult` there is nothing to compare (the reference's CHECK
    /// checks nothing at all).
    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        let conf = Conf::load(args)?;
        let Some(prev) = args.conf.prev_result()? else {
            return Ok(());
        };
        let ips = ips_of(&args.ifname, &prev)?;
        let path = args
            .netns
            .as_deref()
            .ok_or_else(|| CniError::config("CNI_NETNS is required"))?;
        let ns = NetNs::open(path)?;
        let rt = rcni_netlink::runtime()?;
        rt.block_on(async {
            let nl = Netlink::connect(&ns).await?;
            let rules = nl.rules(Family::All).await?;
            for ip in &ips {
                let src = host(ip.address.ip());
                if !rules.iter().any(|r| {
                    r.src == Some(src)
                        && !r.other_matches
                        && r.dst.is_none()
                        && conf.table.is_none_or(|t| r.table == t)
                }) {
                    return Err(CniError::check_failed(format!(
                        "sbr: no rule for source {}",
                        src.ip()
                    )));
                }
            }
            Ok(())
        })
    }
}

/// With `table`: only the rules, the routes being the config's business
/// (IPAM routes with `table`).
async fn add_rules(
    nl: &Netlink,
    ips: &[IpConfig],
    table: u32,
    done: &mut Vec<Done>,
) -> Result<(), CniError> {
    for ip in ips {
        let rule = Rule::from_src(host(ip.address.ip()), table);
        nl.add_rule(&rule)
            .await
            .map_err(|e| CniError::from(e).context("failed to add rule"))?;
        done.push(Done::Rule(rule));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ips_of_the_interface() {
        let prev = CniResult::from_value(
            &json!({"cniVersion": "1.0.0",
                "interfaces": [{"name": "eth0"}, {"name": "net1", "sandbox": "/x"}],
                "ips": [{"address": "10.0.0.2/24", "interface": 0},
                        {"address": "10.1.0.2/24", "interface": 1},
                        {"address": "10.2.0.2/24"}]}),
            "1.0.0",
        )
        .unwrap();
        let got: Vec<String> = ips_of("net1", &prev)
            .unwrap()
            .iter()
            .map(|i| i.address.to_string())
            .collect();
        assert_eq!(got, ["10.1.0.2/24", "10.2.0.2/24"]);
        let empty = CniResult::new("1.0.0");
        assert_eq!(ips_of("net1", &empty).unwrap_err().code, 7);
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn static_gateways_with_upstream_texts() {
        let ok = StaticGateways::parse(&strings(&["fd00::1", "10.0.0.254"])).unwrap();
        assert_eq!(ok.v4, Some("10.0.0.254".parse().unwrap()));
        assert_eq!(ok.v6, Some("fd00::1".parse().unwrap()));
        assert_eq!(
            StaticGateways::parse(&[]).unwrap(),
            StaticGateways::default()
        );
        let err = |v: &[&str]| {
            let e = StaticGateways::parse(&strings(v)).unwrap_err();
            assert_eq!(e.code, 7);
            e.msg
        };
        assert_eq!(
            err(&["10.0.0.1", "fd00::1", "10.0.0.2"]),
            "gateways list cannot contain more than 2 entries (one IPv4, one IPv6)"
        );
        assert_eq!(
            err(&["gw.example"]),
            "invalid static gateway IP address: gw.example"
        );
        assert_eq!(
            err(&["10.0.0.1", "::ffff:10.0.0.2"]),
            "gateways list contains multiple IPv4 addresses: 10.0.0.1 and ::ffff:10.0.0.2"
        );
        assert_eq!(
            err(&["fd00::1", "fd00:0::2"]),
            "gateways list contains multiple IPv6 addresses: fd00::1 and fd00:0::2"
        );
    }

    #[test]
    fn static_gateway_wins_per_family() {
        let ip = |a: &str, gw: Option<&str>| IpConfig {
            interface: None,
            address: a.parse().unwrap(),
            gateway: gw.map(|g| g.parse().unwrap()),
        };
        let only_v6 = StaticGateways::parse(&strings(&["fd00::fe"])).unwrap();
        let v4 = ip("10.0.0.2/24", Some("10.0.0.1"));
        let v6 = ip("fd00::2/64", Some("fd00::1"));
        assert_eq!(only_v6.for_ip(&v4), Some("10.0.0.1".parse().unwrap()));
        assert_eq!(only_v6.for_ip(&v6), Some("fd00::fe".parse().unwrap()));
        // A default route even where prevResult gave no gateway.
        let bare6 = ip("fd00::3/64", None);
        assert_eq!(only_v6.for_ip(&bare6), Some("fd00::fe".parse().unwrap()));
        assert_eq!(StaticGateways::default().for_ip(&bare6), None);
    }

    #[test]
    fn new_keys_parse() {
        let args = CmdArgs::for_conf(&json!({"cniVersion": "1.0.0", "name": "n", "type": "sbr",
            "gateways": ["10.0.0.1"], "addSourceHints": true}))
        .unwrap();
        let c = Conf::load(&args).unwrap();
        assert_eq!(c.gateways, ["10.0.0.1"]);
        assert!(c.add_source_hints);
        // Checked by ADD, not by loading: DEL of a bad list still works.
        let args = CmdArgs::for_conf(&json!({"cniVersion": "1.0.0", "name": "n", "type": "sbr",
            "gateways": ["x", "y", "z"]}))
        .unwrap();
        assert!(Conf::load(&args).is_ok());
        let args = CmdArgs::for_conf(&json!({"cniVersion": "1.0.0", "name": "n", "type": "sbr",
            "gateways": null, "addSourceHints": null}))
        .unwrap();
        let c = Conf::load(&args).unwrap();
        assert!(c.gateways.is_empty() && !c.add_source_hints);
    }

    #[test]
    fn tables_skip_used_ones() {
        let used: BTreeSet<u32> = [100, 101, 103].into();
        assert_eq!(next_free(&used, FIRST_TABLE), 102);
        assert_eq!(next_free(&used, 103), 104);
        assert_eq!(host("10.0.0.5".parse().unwrap()).to_string(), "10.0.0.5/32");
        assert_eq!(host("fd00::5".parse().unwrap()).to_string(), "fd00::5/128");
    }
}
