//! The iptables layout of the reference (`pkg/ip/ipmasq_iptables_linux.go`):
//!
//! ```text
//! *nat
//! :CNI-<hash(net+cid)> - [0:0]
//! -A POSTROUTING -s <ip>/32 -m comment --comment "name: \"<net>\" id: \"<cid>\"" -j CNI-<hash>
//! -A CNI-<hash> -d <subnet> -m comment --comment "..." -j ACCEPT
//! -A CNI-<hash> ! -d 224.0.0.0/4 -m comment --comment "..." -j MASQUERADE
//! ```
//!
//! One `iptables-save` read and at most one `iptables-restore --noflush`
//! write per family and call (see [`crate::iptables`]).

use crate::iptables::{Family, Rule, SaveTable, apply, read, removal_script};
use crate::{Error, names};
use ipnetwork::IpNetwork;
use rcni_cni::subnet;
use rcni_netns::NetNs;
use std::collections::{BTreeSet, HashSet};

fn host_net(ip: &IpNetwork) -> IpNetwork {
    let len = if ip.is_ipv4() { 32 } else { 128 };
    IpNetwork::new(ip.ip(), len).expect("full-length prefix is valid")
}

fn accept_line(chain: &str, subnet: &IpNetwork, comment: &str) -> String {
    format!(
        "-A {chain} -d {subnet} -m comment --comment {} -j ACCEPT",
        crate::names::go_quote(comment)
    )
}

fn masquerade_line(chain: &str, fam: Family, comment: &str) -> String {
    format!(
        "-A {chain} ! -d {} -m comment --comment {} -j MASQUERADE",
        fam.multicast(),
        crate::names::go_quote(comment)
    )
}

fn postrouting_line(chain: &str, ip: &IpNetwork, comment: &str) -> String {
    format!(
        "-A POSTROUTING -s {} -m comment --comment {} -j {chain}",
        host_net(ip),
        crate::names::go_quote(comment)
    )
}

/// What is missing for `ips` (all of family `fam`) in `t`; empty when the
/// attachment's masquerade is complete.
pub(crate) fn problems(t: &SaveTable, fam: Family, chain: &str, ips: &[IpNetwork]) -> Vec<String> {
    let mut out = Vec::new();
    if !t.has_chain(chain) {
        out.push(format!(
            "{} chain nat/{chain} does not exist",
            fam.iptables_tool()
        ));
        return out;
    }
    let body: Vec<&Rule> = t.rules_in(chain).collect();
    let multicast: IpNetwork = fam.multicast().parse().expect("constant");
    let masq_at = body.iter().position(|r| {
        r.target.as_deref() == Some("MASQUERADE")
            && r.dst_net(true) == Some(multicast)
            && r.src.is_none()
            && !r.other
    });
    if masq_at.is_none() {
        out.push(format!(
            "{chain} has no \"! -d {} -j MASQUERADE\" rule",
            fam.multicast()
        ));
    }
    for ip in ips {
        let net = subnet(ip);
        // ACCEPT must come before MASQUERADE, or traffic inside the subnet
        // would be masqueraded.
        let accept_at = body.iter().position(|r| {
            r.target.as_deref() == Some("ACCEPT")
                && r.dst_net(false) == Some(net)
                && r.src.is_none()
                && !r.other
        });
        match (accept_at, masq_at) {
            (None, _) => out.push(format!("{chain} has no \"-d {net} -j ACCEPT\" rule")),
            (Some(a), Some(m)) if a > m => {
                out.push(format!("{chain} masquerades before accepting {net}"))
            }
            _ => {}
        }
        let host = host_net(ip);
        if !t.references(chain).any(|r| {
            r.chain == "POSTROUTING" && r.src_net() == Some(host) && r.dst.is_none() && !r.other
        }) {
            out.push(format!("no POSTROUTING rule sends {} to {chain}", host));
        }
    }
    out
}

/// The `iptables-restore --noflush` input that makes `ips` masqueraded, or
/// `None` when nothing is missing.
///
/// Declaring the chain in `--noflush` mode creates it or empties it, so its
/// whole body is written again: ACCEPT for every subnet (those already there,
/// which another interface of the same container may need since the chain
/// is per container, then the new ones), then the one MASQUERADE. The
/// reference appends ACCEPTs after MASQUERADE when a container has two
/// subnets of one family, which masquerades the second subnet; we keep all
/// ACCEPTs first. POSTROUTING rules are only added where missing.
pub(crate) fn setup_script(
    t: &SaveTable,
    fam: Family,
    chain: &str,
    comment: &str,
    ips: &[IpNetwork],
) -> Option<String> {
    if problems(t, fam, chain, ips).is_empty() {
        return None;
    }
    let mut subnets: Vec<IpNetwork> = Vec::new();
    for r in t.rules_in(chain) {
        if r.target.as_deref() == Some("ACCEPT")
            && let Some(n) = r.dst_net(false)
            && !subnets.contains(&n)
        {
            subnets.push(n);
        }
    }
    for ip in ips {
        let n = subnet(ip);
        if !subnets.contains(&n) {
            subnets.push(n);
        }
    }
    let mut s = format!("*nat\n:{chain} - [0:0]\n");
    for n in &subnets {
        s.push_str(&accept_line(chain, n, comment));
        s.push('\n');
    }
    s.push_str(&masquerade_line(chain, fam, comment));
    s.push('\n');
    let mut seen = BTreeSet::new();
    for ip in ips {
        let host = host_net(ip);
        let present = t.references(chain).any(|r| {
            r.chain == "POSTROUTING" && r.src_net() == Some(host) && r.dst.is_none() && !r.other
        });
        if !present && seen.insert(host) {
            s.push_str(&postrouting_line(chain, ip, comment));
            s.push('\n');
        }
    }
    s.push_str("COMMIT\n");
    Some(s)
}

/// Chains of `network` whose container is not in `valid`, found by the
/// comment on their rules (the chain name alone does not say which network
/// it belongs to). The reference has no iptables GC at all.
pub(crate) fn stale_chains(
    t: &SaveTable,
    network: &str,
    valid: &HashSet<&str>,
) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for r in &t.rules {
        let Some((net, cid)) = r.comment.as_deref().and_then(names::parse_iptables_comment) else {
            continue;
        };
        if net != network || valid.contains(cid) {
            continue;
        }
        let chain = names::chain_name(net, cid);
        // Only a rule in the chain, or jumping to it, ties the comment to
        // the chain; anything else is not our layout.
        if r.chain == chain || r.target.as_deref() == Some(chain.as_str()) {
            out.insert(chain);
        }
    }
    out
}

/// Makes `ips` (all of family `fam`) masqueraded with the reference's chain.
pub(crate) fn setup(
    ns: &NetNs,
    fam: Family,
    network: &str,
    container_id: &str,
    ips: &[IpNetwork],
) -> Result<(), Error> {
    let chain = names::chain_name(network, container_id);
    let comment = names::iptables_comment(network, container_id);
    // A new container's chain is in no table yet, and no rule can jump to
    // a chain that does not exist: where nfnetlink shows that (the chain
    // is not in iptables-nft's `nat` table, and legacy iptables has no
    // `nat` table in this namespace), the rules are written without an
    // `iptables-save` process first.
    let absent = crate::nfnl::Nfnl::open(ns)
        .is_ok_and(|mut nl| !nl.iptables_may_hold(ns, fam == Family::V6, "nat", &[&chain]));
    let t = if absent {
        SaveTable::default()
    } else {
        read(ns, fam)?
    };
    match setup_script(&t, fam, &chain, &comment, ips) {
        Some(script) => apply(ns, fam, &script),
        None => Ok(()),
    }
}

pub(crate) fn check(
    ns: &NetNs,
    fam: Family,
    network: &str,
    container_id: &str,
    ips: &[IpNetwork],
) -> Result<Vec<String>, Error> {
    let chain = names::chain_name(network, container_id);
    Ok(problems(&read(ns, fam)?, fam, &chain, ips))
}

/// Removes the container's chain and everything jumping to it.
pub(crate) fn teardown(
    ns: &NetNs,
    fam: Family,
    network: &str,
    container_id: &str,
) -> Result<(), Error> {
    let t = read(ns, fam)?;
    let chains = BTreeSet::from([names::chain_name(network, container_id)]);
    match removal_script(&t, &chains) {
        Some(script) => apply(ns, fam, &script),
        None => Ok(()),
    }
}

pub(crate) fn gc(
    ns: &NetNs,
    fam: Family,
    network: &str,
    valid: &HashSet<&str>,
) -> Result<(), Error> {
    let t = read(ns, fam)?;
    let chains = stale_chains(&t, network, valid);
    match removal_script(&t, &chains) {
        Some(script) => apply(ns, fam, &script),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iptables::parse_save;

    /// `iptables-save -t nat` after the reference bridge (v1.1.1) ran with
    /// ipMasq for network "mynet", container "ctr1".
    const REFERENCE: &str = r#"# Generated by iptables-save v1.8.9 (nf_tables) on Sat Nov 21 18:27:06 2026
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:CNI-5145007e2a8415ce07579739 - [0:0]
-A POSTROUTING -s 10.22.0.2/32 -m comment --comment "name: \"mynet\" id: \"ctr1\"" -j CNI-5145007e2a8415ce07579739
-A CNI-5145007e2a8415ce07579739 -d 10.22.0.0/16 -m comment --comment "name: \"mynet\" id: \"ctr1\"" -j ACCEPT
-A CNI-5145007e2a8415ce07579739 ! -d 224.0.0.0/4 -m comment --comment "name: \"mynet\" id: \"ctr1\"" -j MASQUERADE
COMMIT
"#;

    fn ip(s: &str) -> IpNetwork {
        s.parse().unwrap()
    }

    #[test]
    fn parses_the_reference_layout() {
        let t = parse_save(REFERENCE).unwrap();
        let chain = names::chain_name("mynet", "ctr1");
        assert!(t.has_chain(&chain));
        assert_eq!(t.rules.len(), 3);
        let pr = &t.rules[0];
        assert_eq!(pr.chain, "POSTROUTING");
        assert_eq!(pr.src, Some((false, "10.22.0.2/32".into())));
        assert_eq!(pr.comment.as_deref(), Some(r#"name: "mynet" id: "ctr1""#));
        assert_eq!(pr.target.as_deref(), Some(chain.as_str()));
        assert!(!pr.other);
        assert_eq!(t.rules[2].dst, Some((true, "224.0.0.0/4".into())));
        assert!(problems(&t, Family::V4, &chain, &[ip("10.22.0.2/16")]).is_empty());
        let p = problems(&t, Family::V4, &chain, &[ip("10.23.0.2/16")]);
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(
            setup_script(&t, Family::V4, &chain, "x", &[ip("10.22.0.2/16")]).is_none(),
            "complete: nothing to write"
        );
    }

    #[test]
    fn setup_script_writes_what_save_prints() {
        let chain = names::chain_name("mynet", "ctr1");
        let comment = names::iptables_comment("mynet", "ctr1");
        let empty = parse_save("*nat\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n").unwrap();
        let s = setup_script(&empty, Family::V4, &chain, &comment, &[ip("10.22.0.2/16")]).unwrap();
        // The rule lines are exactly the reference's as iptables-save prints them.
        let ours: BTreeSet<&str> = s.lines().filter(|l| l.starts_with("-A")).collect();
        let theirs: BTreeSet<&str> = REFERENCE.lines().filter(|l| l.starts_with("-A")).collect();
        assert_eq!(ours, theirs);
        assert!(s.starts_with(&format!("*nat\n:{chain} - [0:0]\n")));
        assert!(s.ends_with("COMMIT\n"));
    }

    #[test]
    fn second_subnet_keeps_accepts_first() {
        let chain = names::chain_name("n", "c");
        let t = parse_save(
            REFERENCE
                .replace("CNI-5145007e2a8415ce07579739", &chain)
                .as_str(),
        )
        .unwrap();
        let s = setup_script(&t, Family::V4, &chain, "c", &[ip("10.30.0.9/24")]).unwrap();
        let lines: Vec<&str> = s.lines().collect();
        let pos = |needle: &str| lines.iter().position(|l| l.contains(needle)).unwrap();
        assert!(pos("-d 10.22.0.0/16") < pos("MASQUERADE"));
        assert!(pos("-d 10.30.0.0/24") < pos("MASQUERADE"));
        assert!(s.contains("-A POSTROUTING -s 10.30.0.9/32"));
        assert!(
            !s.contains("-A POSTROUTING -s 10.22.0.2/32"),
            "present already"
        );
    }

    #[test]
    fn removal_covers_old_style_references() {
        let chain = names::chain_name("mynet", "ctr1");
        let old = REFERENCE.replace(
            "-A POSTROUTING -s 10.22.0.2/32",
            "-A POSTROUTING -s 10.22.0.0/16",
        );
        let t = parse_save(&old).unwrap();
        let s = removal_script(&t, &BTreeSet::from([chain.clone()])).unwrap();
        assert_eq!(
            s,
            format!(
                "*nat\n-D POSTROUTING -s 10.22.0.0/16 -m comment --comment \"name: \\\"mynet\\\" id: \\\"ctr1\\\"\" -j {chain}\n-F {chain}\n-X {chain}\nCOMMIT\n"
            )
        );
        let none = parse_save("*nat\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n").unwrap();
        assert!(removal_script(&none, &BTreeSet::from([chain])).is_none());
    }

    #[test]
    fn gc_finds_chains_by_comment() {
        let t = parse_save(REFERENCE).unwrap();
        let stale = stale_chains(&t, "mynet", &HashSet::new());
        assert_eq!(stale, BTreeSet::from([names::chain_name("mynet", "ctr1")]));
        assert!(stale_chains(&t, "mynet", &HashSet::from(["ctr1"])).is_empty());
        assert!(stale_chains(&t, "othernet", &HashSet::new()).is_empty());
    }
}
