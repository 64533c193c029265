//! `useInterfaceNetwork` (upstream v1.10.0): the device's L3 setup on the
//! node, read before the move (which drops it), set up again on the device
//! in the container, and reported in the result. Where a cloud or a VM
//! provisions the address on the device itself, the pod keeps it.
//!
//! What is taken, as upstream: universe-scope addresses (IPv6 only
//! permanent ones: SLAAC's and DHCPv6's come back by themselves), the
//! device's routes of every table but `local` that a configuration made
//! (not `proto kernel` nor router advertisements, nor IPv6 routes to
//! link-local destinations), and the rules from one of those addresses to
//! one of those routes' tables. Unlike upstream, a rule with matches besides
//! source and destination (fwmark, iif, ...) is left out: copied without
//! them it would take more traffic than on the node.

use std::cmp::Reverse;
use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnetwork::IpNetwork;
use rcni_cni::{CniError, CniResult, IpConfig};
use rcni_netlink::{Address, Family, Link, Netlink, Route, Rule, SCOPE_UNIVERSE};

const TABLE_LOCAL: u32 = 255;
const RTPROT_KERNEL: u8 = 2;
const RTPROT_RA: u8 = 9;

/// The device's L3 setup, for one ADD.
#[derive(Debug, Default, Clone)]
pub struct HostState {
    pub addrs: Vec<IpNetwork>,
    pub routes: Vec<Route>,
    pub rules: Vec<Rule>,
}

/// IPv4 addresses are taken even when leased: nothing renews them in the
/// container, and without them the routes via their gateways cannot be set.
fn keep_address(a: &Address, permanent: bool) -> bool {
    a.scope == SCOPE_UNIVERSE && (a.addr.is_ipv4() || permanent)
}

fn keep_route(r: &Route) -> bool {
    if r.table == TABLE_LOCAL || matches!(r.protocol, Some(RTPROT_KERNEL | RTPROT_RA)) {
        return false;
    }
    // fe80::/64 comes back with the link; a default route via a link-local
    // router is kept.
    !(r.dst.prefix() > 0 && matches!(r.dst.ip(), IpAddr::V6(v6) if v6.is_unicast_link_local()))
}

fn keep_rule(rule: &Rule, addrs: &[IpNetwork], tables: &BTreeSet<u32>) -> bool {
    let Some(src) = rule.src else { return false };
    rule.table != 0
        && rule.table != TABLE_LOCAL
        && !rule.other_matches
        && addrs.iter().any(|a| src.contains(a.ip()))
        && tables.contains(&rule.table)
}

/// Reads `dev`'s setup in the node (`nl`), before the move.
pub async fn capture(nl: &Netlink, dev: &Link) -> Result<HostState, CniError> {
    let name = &dev.name;
    let addrs: Vec<IpNetwork> = nl
        .addresses_with_permanence(dev.index)
        .await
        .map_err(|e| {
            CniError::from(e).context(format!("failed to list addresses for host device {name}"))
        })?
        .into_iter()
        .filter(|(a, permanent)| keep_address(a, *permanent))
        .map(|(a, _)| a.addr)
        .collect();
    let routes: Vec<Route> = nl
        .routes_in_table(Family::All, None)
        .await
        .map_err(|e| {
            CniError::from(e).context(format!("failed to list routes for host device {name}"))
        })?
        .into_iter()
        .filter(|r| r.oif == Some(dev.index) && keep_route(r))
        .collect();
    let tables: BTreeSet<u32> = routes.iter().map(|r| r.table).collect();
    let rules = nl
        .rules(Family::All)
        .await
        .map_err(|e| CniError::from(e).context("failed to list rules"))?
        .into_iter()
        .filter(|r| keep_rule(r, &addrs, &tables))
        .collect();
    Ok(HostState {
        addrs,
        routes,
        rules,
    })
}

/// Sets `st` up on link `index` (`name` in errors): the addresses, then
/// the routes, link scope first (the others go via those), then, with
/// `rules`, the rules (not on the node: they stay there when the device
/// leaves). What is there already is no error.
pub async fn apply(
    nl: &Netlink,
    index: u32,
    name: &str,
    st: &HostState,
    rules: bool,
) -> Result<(), CniError> {
    for a in &st.addrs {
        // The node's own address, done with duplicate address detection
        // there: tentative again, it could not be a copied route's source.
        nl.ensure_address_nodad(index, *a).await.map_err(|e| {
            CniError::from(e).context(format!("failed to add copied address {a} on {name}"))
        })?;
    }
    let mut routes = st.routes.clone();
    routes.sort_by_key(|r| Reverse(r.scope));
    for r in routes {
        let r = Route {
            oif: Some(index),
            ..r
        };
        match nl.add_route(&r).await {
            Err(e) if !e.is_exists() => {
                return Err(
                    CniError::from(e).context(format!("failed to add copied route {r} on {name}"))
                );
            }
            _ => {}
        }
    }
    if rules {
        for rule in &st.rules {
            match nl.add_rule(rule).await {
                Err(e) if !e.is_exists() => {
                    let src = rule.src.map(|s| s.to_string()).unwrap_or_default();
                    return Err(CniError::from(e).context(format!(
                        "failed to add copied rule (src={src} table={})",
                        rule.table
                    )));
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// The result's part: the addresses on interface `index`, without
/// gateway; the routes with their metric, table and (when not universe)
/// scope, as upstream's `routeToCNIRoute`.
pub fn merge_into(result: &mut CniResult, st: &HostState, index: usize) {
    result.ips.extend(st.addrs.iter().map(|a| IpConfig {
        interface: Some(index),
        address: *a,
        gateway: None,
    }));
    result.routes.extend(st.routes.iter().map(|r| {
        let mut c = rcni_cni::Route::new(r.dst, r.gateway);
        c.priority = r.metric.filter(|m| *m != 0);
        c.table = (r.table != 0).then_some(r.table);
        c.scope = (r.scope != SCOPE_UNIVERSE).then_some(u32::from(r.scope));
        c
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcni_netlink::{SCOPE_HOST, SCOPE_LINK};
    use serde_json::json;

    fn addr(a: &str, scope: u8) -> Address {
        Address {
            index: 2,
            addr: a.parse().unwrap(),
            scope,
        }
    }

    fn route(dst: &str, proto: u8, table: u32) -> Route {
        let mut r = Route::new(dst.parse().unwrap()).table(table).oif(2);
        r.protocol = Some(proto);
        r
    }

    #[test]
    fn what_is_taken() {
        assert!(keep_address(&addr("10.0.0.5/24", SCOPE_UNIVERSE), false));
        assert!(keep_address(&addr("fd00::5/64", SCOPE_UNIVERSE), true));
        assert!(!keep_address(&addr("fd00::6/64", SCOPE_UNIVERSE), false));
        assert!(!keep_address(&addr("fe80::1/64", SCOPE_LINK), true));
        assert!(!keep_address(&addr("127.0.0.9/8", SCOPE_HOST), true));

        assert!(keep_route(&route("0.0.0.0/0", 3, 254)));
        assert!(keep_route(&route("::/0", 4, 100)));
        assert!(!keep_route(&route("10.0.0.0/24", RTPROT_KERNEL, 254)));
        assert!(!keep_route(&route("2001:db8::/64", RTPROT_RA, 254)));
        assert!(!keep_route(&route("10.0.0.5/32", 3, TABLE_LOCAL)));
        assert!(!keep_route(&route("fe80::/64", 3, 254)));
        let via_ll = route("::/0", 3, 254).gateway("fe80::1".parse().unwrap());
        assert!(keep_route(&via_ll));

        let addrs: Vec<IpNetwork> = vec!["10.0.0.5/24".parse().unwrap()];
        let tables: BTreeSet<u32> = [254, 100].into();
        let from = |src: &str, table: u32| Rule::from_src(src.parse().unwrap(), table);
        assert!(keep_rule(&from("10.0.0.5/32", 100), &addrs, &tables));
        assert!(keep_rule(&from("10.0.0.0/24", 254), &addrs, &tables));
        assert!(
            !keep_rule(&from("10.0.0.5/32", 200), &addrs, &tables),
            "no route of it"
        );
        assert!(
            !keep_rule(&from("10.9.0.5/32", 100), &addrs, &tables),
            "not its address"
        );
        let mut marked = from("10.0.0.5/32", 100);
        marked.other_matches = true;
        assert!(!keep_rule(&marked, &addrs, &tables));
        let all = Rule {
            src: None,
            ..from("10.0.0.5/32", 100)
        };
        assert!(!keep_rule(&all, &addrs, &tables));
    }

    #[test]
    fn result_as_upstream() {
        let mut gw = route("0.0.0.0/0", 3, 254).gateway("10.0.0.1".parse().unwrap());
        gw.metric = Some(100);
        let mut link = route("10.9.0.0/16", 3, 100).scope(SCOPE_LINK);
        link.metric = Some(0);
        let st = HostState {
            addrs: vec!["10.0.0.5/24".parse().unwrap()],
            routes: vec![gw, link],
            rules: vec![],
        };
        let mut r = CniResult::new("1.1.0");
        r.ips.push(IpConfig {
            interface: Some(0),
            address: "10.1.0.2/24".parse().unwrap(),
            gateway: None,
        });
        merge_into(&mut r, &st, 0);
        let v: serde_json::Value = serde_json::from_str(&r.to_json("1.1.0").unwrap()).unwrap();
        assert_eq!(
            v["ips"],
            json!([{"interface": 0, "address": "10.1.0.2/24"},
                   {"interface": 0, "address": "10.0.0.5/24"}])
        );
        assert_eq!(
            v["routes"],
            json!([{"dst": "0.0.0.0/0", "gw": "10.0.0.1", "priority": 100, "table": 254},
                   {"dst": "10.9.0.0/16", "table": 100, "scope": 253}])
        );
    }
}
