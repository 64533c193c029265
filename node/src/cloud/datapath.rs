//! The node's side of cloud mode, as the AWS VPC CNI lays it out:
//! - each secondary interface (ENI) found by its MAC, up, with its own
//!   address, and a route table of its own (`device index + 1`) whose
//!   default route leaves through it; its connected route is taken out of
//!   the main table, so the node's own traffic keeps leaving by the primary
//!   interface;
//! - per pod address, `512: to <pod> lookup main` (traffic for the pod
//!   reaches its veth whatever interface it came in on) and, for an address
//!   of a secondary interface, `1536: from <pod> [to <VPC CIDR>] lookup
//!   <its table>`: the VPC only delivers an address's packets from the
//!   interface it is assigned to (source/destination check);
//! - traffic leaving the VPC masqueraded to the primary address (the VPC's
//!   internet gateway only translates an instance's primary address), unless
//!   SNAT is external (`AWS_VPC_K8S_CNI_EXTERNALSNAT`): then every packet of
//!   a secondary interface's pod leaves by that interface.
//!
//! The pod's veth and its /32 route are ptp's, run by the runtime.

use std::net::{IpAddr, Ipv4Addr};

use ipnetwork::{IpNetwork, Ipv4Network};
use rcni_cloud::Interface;
use rcni_netlink::{Family, Netlink, Route, Rule};

use crate::sync::masq;

/// `to <pod> lookup main`, as the AWS VPC CNI's.
pub const PRIO_TO_POD: u32 = 512;
/// `from <pod> lookup <interface table>`, as the AWS VPC CNI's.
pub const PRIO_FROM_POD: u32 = 1536;
const MAIN: u32 = 254;
/// RT_SCOPE_LINK.
const SCOPE_LINK: u8 = 253;

/// How pods' traffic leaves the VPC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snat {
    /// Nothing is translated here (a NAT gateway does it).
    pub external: bool,
    /// Destinations that keep the pod's address besides the VPC's own.
    pub exclude: Vec<Ipv4Network>,
}

/// One pod address and the interface it is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodAddr {
    pub ip: Ipv4Addr,
    pub device_index: u32,
}

pub fn table_of(device_index: u32) -> u32 {
    device_index + 1
}

fn host(ip: Ipv4Addr) -> IpNetwork {
    IpNetwork::V4(Ipv4Network::new(ip, 32).expect("/32"))
}

/// The rules one pod address needs.
pub fn pod_rules(p: PodAddr, vpc: &[Ipv4Network], snat: &Snat) -> Vec<Rule> {
    let mut v = vec![Rule::to_dst(host(p.ip), MAIN).priority(PRIO_TO_POD)];
    if p.device_index > 0 {
        let t = table_of(p.device_index);
        if snat.external {
            v.push(Rule::from_src(host(p.ip), t).priority(PRIO_FROM_POD));
        } else {
            for c in vpc.iter().chain(&snat.exclude) {
                let mut r = Rule::from_src(host(p.ip), t).priority(PRIO_FROM_POD);
                r.dst = Some(IpNetwork::V4(*c));
                v.push(r);
            }
        }
    }
    v
}

/// Adds the pod's rules (those already there are kept).
pub async fn add_pod(
    nl: &Netlink,
    p: PodAddr,
    vpc: &[Ipv4Network],
    snat: &Snat,
) -> rcni_netlink::Result<()> {
    for r in pod_rules(p, vpc, snat) {
        match nl.add_rule(&r).await {
            Err(e) if e.is_exists() => {}
            other => other?,
        }
    }
    Ok(())
}

/// Removes the pod's rules (those already gone are fine): the ones
/// [`pod_rules`] makes, deleted by what they are, with no dump of the
/// table on a pod's DEL. A rule left by another SNAT setting is the next
/// [`reconcile_pods`]'s.
pub async fn del_pod(
    nl: &Netlink,
    p: PodAddr,
    vpc: &[Ipv4Network],
    snat: &Snat,
) -> rcni_netlink::Result<()> {
    for r in pod_rules(p, vpc, snat) {
        match nl.del_rule(&r).await {
            Err(e) if e.is_not_found() => {}
            other => other?,
        }
    }
    Ok(())
}

fn is_pod_rule(r: &Rule) -> bool {
    !r.v6
        && !r.other_matches
        && match r.priority {
            Some(PRIO_TO_POD) => r.src.is_none() && r.dst.is_some_and(|d| d.prefix() == 32),
            Some(PRIO_FROM_POD) => r.src.is_some_and(|s| s.prefix() == 32),
            _ => false,
        }
}

/// Rules of pods that hold no address any more removed, those of pods that
/// do made: what the kernel has matches the pool after a restart. Returns
/// how many rules changed.
pub async fn reconcile_pods(
    nl: &Netlink,
    pods: &[PodAddr],
    vpc: &[Ipv4Network],
    snat: &Snat,
) -> rcni_netlink::Result<usize> {
    let want: Vec<Rule> = pods.iter().flat_map(|p| pod_rules(*p, vpc, snat)).collect();
    let have: Vec<Rule> = nl
        .rules(Family::V4)
        .await?
        .into_iter()
        .filter(is_pod_rule)
        .collect();
    let mut n = 0;
    for r in &have {
        if !want.iter().any(|w| same(w, r)) {
            match nl.del_rule(r).await {
                Err(e) if e.is_not_found() => {}
                other => other?,
            }
            n += 1;
        }
    }
    for w in &want {
        if !have.iter().any(|r| same(w, r)) {
            match nl.add_rule(w).await {
                Err(e) if e.is_exists() => {}
                other => other?,
            }
            n += 1;
        }
    }
    Ok(n)
}

fn same(a: &Rule, b: &Rule) -> bool {
    a.src == b.src && a.dst == b.dst && a.table == b.table && a.priority == b.priority
}

/// Each secondary interface's link set up (address, table, no connected
/// route in main). Returns the MACs not found on the node yet: the
/// hypervisor plugs an attached interface in a moment later.
pub async fn ensure_interfaces(
    nl: &Netlink,
    ifaces: &[Interface],
) -> rcni_netlink::Result<Vec<String>> {
    let links = nl.links().await?;
    let mut missing = Vec::new();
    for i in ifaces.iter().filter(|i| i.device_index > 0) {
        let Some(link) = links
            .iter()
            .find(|l| l.mac.is_some_and(|m| m.to_string() == i.mac))
        else {
            missing.push(i.mac.clone());
            continue;
        };
        let idx = link.index;
        nl.set_up(idx).await?;
        let addr =
            IpNetwork::V4(Ipv4Network::new(i.primary_ip, i.subnet.prefix()).expect("prefix"));
        nl.ensure_address(idx, addr).await?;
        let t = table_of(i.device_index);
        let gw = i.gateway();
        nl.ensure_route(&Route::new(host(gw)).oif(idx).scope(SCOPE_LINK).table(t))
            .await?;
        nl.ensure_route(
            &Route::new(IpNetwork::V4(
                Ipv4Network::new(Ipv4Addr::UNSPECIFIED, 0).expect("/0"),
            ))
            .gateway(IpAddr::V4(gw))
            .oif(idx)
            .table(t),
        )
        .await?;
        // The kernel's connected route: the node's own traffic to the
        // subnet would otherwise leave by whichever interface came last.
        for r in nl.routes_in_table(Family::V4, Some(MAIN)).await? {
            if r.oif == Some(idx) && r.dst == IpNetwork::V4(i.subnet) && r.gateway.is_none() {
                match nl.del_route(&r).await {
                    Err(e) if e.is_not_found() => {}
                    other => other?,
                }
            }
        }
    }
    Ok(missing)
}

/// Masquerade of traffic leaving the VPC (and the excluded CIDRs) to the
/// primary address, or none with external SNAT. Whatever the source, as
/// the AWS VPC CNI's `! -d <VPC CIDR> -j SNAT` rule: the node's own
/// traffic already has that address.
pub fn ensure_snat(
    ns: &rcni_netns::NetNs,
    vpc: &[Ipv4Network],
    snat: &Snat,
) -> rcni_netlink::Result<bool> {
    if snat.external || vpc.is_empty() {
        return masq::ensure_keep(ns, None);
    }
    let keep: Vec<Ipv4Network> = vpc.iter().chain(&snat.exclude).copied().collect();
    let any = Ipv4Network::new(Ipv4Addr::UNSPECIFIED, 0).expect("/0");
    masq::ensure_keep(ns, Some((any, &keep)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_as_the_aws_vpc_cni_makes_them() {
        let vpc: Vec<Ipv4Network> = vec!["10.0.0.0/16".parse().unwrap()];
        let snat = Snat {
            external: false,
            exclude: vec![],
        };
        let p0 = PodAddr {
            ip: "10.0.16.5".parse().unwrap(),
            device_index: 0,
        };
        let r = pod_rules(p0, &vpc, &snat);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].to_string(), "512: from all to 10.0.16.5/32 lookup 254");
        let p1 = PodAddr {
            ip: "10.0.16.6".parse().unwrap(),
            device_index: 1,
        };
        let r: Vec<String> = pod_rules(p1, &vpc, &snat)
            .iter()
            .map(|r| r.to_string())
            .collect();
        assert_eq!(
            r,
            [
                "512: from all to 10.0.16.6/32 lookup 254",
                "1536: from 10.0.16.6/32 to 10.0.0.0/16 lookup 2"
            ]
        );
        let ext = Snat {
            external: true,
            exclude: vec![],
        };
        let r: Vec<String> = pod_rules(p1, &vpc, &ext)
            .iter()
            .map(|r| r.to_string())
            .collect();
        assert_eq!(r[1], "1536: from 10.0.16.6/32 lookup 2");
        assert!(pod_rules(p1, &vpc, &snat).iter().all(is_pod_rule));
    }
}
