//! The iptables backend, in the reference's filter-table layout (as
//! `/usr/lib/cni/firewall` v1.1.1 writes it), so either implementation
//! checks and removes what the other made:
//!
//! ```text
//! -A FORWARD -m comment --comment "CNI firewall plugin rules (ingressPolicy: same-bridge)" -j CNI-ISOLATION-STAGE-1
//! -A FORWARD -m comment --comment "CNI firewall plugin rules" -j CNI-FORWARD
//! -A CNI-FORWARD -m comment --comment "CNI firewall plugin admin overrides" -j CNI-ADMIN
//! -A CNI-FORWARD -d 10.88.0.5/32 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
//! -A CNI-FORWARD -s 10.88.0.5/32 -j ACCEPT
//! -A CNI-ISOLATION-STAGE-1 -i cni0 ! -o cni0 -m comment --comment "..." -j CNI-ISOLATION-STAGE-2
//! -A CNI-ISOLATION-STAGE-1 -m comment --comment "..." -j RETURN
//! -A CNI-ISOLATION-STAGE-2 -o cni0 -m comment --comment "..." -j DROP
//! -A CNI-ISOLATION-STAGE-2 -m comment --comment "..." -j RETURN
//! ```
//!
//! `isolated` adds upstream's `-i cni0 -o cni0 -j DROP` to stage 1 (which
//! sees bridged pod-to-pod traffic only with `br_netfilter`). The per-IP
//! rules carry no comment in the reference's layout, so they are found by
//! the addresses of prevResult, and GC cannot tell whose they are; the
//! isolation rules are shared by every pod of the bridge and are kept, as
//! the reference keeps them. One `iptables-save` and one
//! `iptables-restore --noflush` per family and call.

use crate::conf::{Conf, IngressPolicy};
use ipnetwork::IpNetwork;
use rcni_cni::CniError;
use rcni_netfilter::go_quote;
use rcni_netfilter::iptables::{Family, SaveTable};
use rcni_netns::NetNs;
use std::fmt::Write;

pub const FORWARD_CHAIN: &str = "CNI-FORWARD";
const STAGE1: &str = "CNI-ISOLATION-STAGE-1";
const STAGE2: &str = "CNI-ISOLATION-STAGE-2";
const RULES_COMMENT: &str = "CNI firewall plugin rules";
const ADMIN_COMMENT: &str = "CNI firewall plugin admin overrides";
const POLICY_COMMENT: &str = "CNI firewall plugin rules (ingressPolicy: same-bridge)";

fn host(ip: &IpNetwork) -> String {
    format!("{}/{}", ip.ip(), if ip.is_ipv4() { 32 } else { 128 })
}

pub fn family(ip: &IpNetwork) -> Family {
    if ip.is_ipv4() { Family::V4 } else { Family::V6 }
}

/// The per-address rules, as iptables-save prints them.
pub fn ip_rules(ip: &IpNetwork) -> [String; 2] {
    let h = host(ip);
    [
        format!("-A {FORWARD_CHAIN} -d {h} -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"),
        format!("-A {FORWARD_CHAIN} -s {h} -j ACCEPT"),
    ]
}

fn forward_jump() -> String {
    format!(
        "-A FORWARD -m comment --comment {} -j {FORWARD_CHAIN}",
        go_quote(RULES_COMMENT)
    )
}

fn admin_jump(admin: &str) -> String {
    format!(
        "-A {FORWARD_CHAIN} -m comment --comment {} -j {admin}",
        go_quote(ADMIN_COMMENT)
    )
}

/// The isolation rules of `bridge`: (rule, prepend?) in the order to write.
fn isolation_rules(bridge: &str, policy: IngressPolicy) -> Vec<(String, bool)> {
    let c = go_quote(POLICY_COMMENT);
    let mut v = vec![
        (
            format!("-A FORWARD -m comment --comment {c} -j {STAGE1}"),
            true,
        ),
        (
            format!("-A {STAGE1} -i {bridge} ! -o {bridge} -m comment --comment {c} -j {STAGE2}"),
            true,
        ),
        (
            format!("-A {STAGE1} -m comment --comment {c} -j RETURN"),
            false,
        ),
        (
            format!("-A {STAGE2} -o {bridge} -m comment --comment {c} -j DROP"),
            true,
        ),
        (
            format!("-A {STAGE2} -m comment --comment {c} -j RETURN"),
            false,
        ),
    ];
    if policy == IngressPolicy::Isolated {
        v.push((
            format!("-A {STAGE1} -i {bridge} -o {bridge} -m comment --comment {c} -j DROP"),
            true,
        ));
    }
    v
}

/// `-A CHAIN rest` as `-I CHAIN 1 rest`.
fn prepended(rule: &str) -> String {
    let rest = rule.strip_prefix("-A ").unwrap_or(rule);
    let (chain, tail) = rest.split_once(' ').unwrap_or((rest, ""));
    format!("-I {chain} 1 {tail}")
}

/// The rules the plugin wants in table filter: with `forward`, the
/// CNI-FORWARD layout and the per-address rules of `ips` (the iptables
/// backend); the isolation rules of `bridge` (any backend: the reference
/// writes them to iptables whatever its backend). `(rule, prepend?)`.
fn wanted(
    conf: &Conf,
    forward: bool,
    ips: &[IpNetwork],
    bridge: Option<&str>,
) -> Vec<(String, bool)> {
    let mut want = Vec::new();
    if forward {
        want.push((forward_jump(), true));
        want.push((admin_jump(&conf.admin_chain), true));
        for ip in ips {
            want.extend(ip_rules(ip).into_iter().map(|r| (r, false)));
        }
    }
    if let Some(b) = bridge {
        want.extend(isolation_rules(b, conf.policy));
    }
    want
}

/// The restore input that adds what is missing of [`wanted`] in table `t`.
fn script(
    t: &SaveTable,
    conf: &Conf,
    forward: bool,
    ips: &[IpNetwork],
    bridge: Option<&str>,
) -> String {
    let has = |raw: &str| t.rules.iter().any(|r| r.raw == raw);
    let mut decl = String::new();
    let mut body = String::new();
    let mut chains = Vec::new();
    if forward {
        chains.extend([FORWARD_CHAIN, conf.admin_chain.as_str()]);
    }
    if bridge.is_some() {
        chains.extend([STAGE1, STAGE2]);
    }
    for c in chains {
        if !t.has_chain(c) {
            let _ = writeln!(decl, ":{c} - [0:0]");
        }
    }
    for (rule, prepend) in wanted(conf, forward, ips, bridge) {
        if !has(&rule) {
            let line = if prepend { prepended(&rule) } else { rule };
            let _ = writeln!(body, "{line}");
        }
    }
    if body.is_empty() && decl.is_empty() {
        return String::new();
    }
    format!("*filter\n{decl}{body}COMMIT\n")
}

/// The restore input that adds what is missing for `ips` (all of one
/// family) in table `t`.
pub fn setup_script(t: &SaveTable, conf: &Conf, ips: &[IpNetwork], bridge: Option<&str>) -> String {
    script(t, conf, true, ips, bridge)
}

/// Only the isolation rules of `bridge` (the firewalld backend's ingress
/// policy, as the reference's).
pub fn setup_isolation(ns: &NetNs, conf: &Conf, fam: Family, bridge: &str) -> Result<(), CniError> {
    rcni_netfilter::iptables::edit(ns, fam, "filter", |t| {
        Some(script(t, conf, false, &[], Some(bridge)))
    })
    .map_err(|e| CniError::from(e).context("unable to set up iptables ingress policy rules"))
}

/// What CHECK finds missing of the isolation rules of `bridge`.
pub fn check_isolation(
    ns: &NetNs,
    conf: &Conf,
    fam: Family,
    bridge: &str,
) -> Result<Vec<String>, CniError> {
    let t = rcni_netfilter::iptables::read_table(ns, fam, "filter")?;
    Ok(missing(&t, wanted(conf, false, &[], Some(bridge))))
}

fn missing(t: &SaveTable, want: Vec<(String, bool)>) -> Vec<String> {
    want.into_iter()
        .map(|(w, _)| w)
        .filter(|w| !t.rules.iter().any(|r| &r.raw == w))
        .map(|w| format!("missing rule: {w}"))
        .collect()
}

pub fn setup(
    ns: &NetNs,
    conf: &Conf,
    fam: Family,
    ips: &[IpNetwork],
    bridge: Option<&str>,
) -> Result<(), CniError> {
    rcni_netfilter::iptables::edit(ns, fam, "filter", |t| {
        Some(setup_script(t, conf, ips, bridge))
    })
    .map_err(|e| CniError::from(e).context("unable to set up iptables firewall rules"))
}

/// What CHECK finds missing.
pub fn problems(
    t: &SaveTable,
    conf: &Conf,
    ips: &[IpNetwork],
    bridge: Option<&str>,
) -> Vec<String> {
    missing(t, wanted(conf, true, ips, bridge))
}

pub fn check(
    ns: &NetNs,
    conf: &Conf,
    fam: Family,
    ips: &[IpNetwork],
    bridge: Option<&str>,
) -> Result<Vec<String>, CniError> {
    let t = rcni_netfilter::iptables::read_table(ns, fam, "filter")?;
    Ok(problems(&t, conf, ips, bridge))
}

/// The restore input removing the per-address rules of `ips`.
pub fn teardown_script(t: &SaveTable, ips: &[IpNetwork]) -> Option<String> {
    let mut body = String::new();
    for ip in ips {
        for rule in ip_rules(ip) {
            for r in t.rules.iter().filter(|r| r.raw == rule) {
                let _ = writeln!(body, "{}", r.delete_line());
            }
        }
    }
    (!body.is_empty()).then(|| format!("*filter\n{body}COMMIT\n"))
}

pub fn teardown(ns: &NetNs, fam: Family, ips: &[IpNetwork]) -> Result<(), CniError> {
    Ok(rcni_netfilter::iptables::edit(ns, fam, "filter", |t| {
        teardown_script(t, ips)
    })?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcni_cni::skel::CmdArgs;
    use serde_json::json;

    /// iptables-save after `/usr/lib/cni/firewall` (v1.1.1) ADD of
    /// 10.88.0.5/24 with ingressPolicy same-bridge on cni0.
    const REFERENCE: &str = r#"*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:CNI-ADMIN - [0:0]
:CNI-FORWARD - [0:0]
:CNI-ISOLATION-STAGE-1 - [0:0]
:CNI-ISOLATION-STAGE-2 - [0:0]
-A FORWARD -m comment --comment "CNI firewall plugin rules (ingressPolicy: same-bridge)" -j CNI-ISOLATION-STAGE-1
-A FORWARD -m comment --comment "CNI firewall plugin rules" -j CNI-FORWARD
-A CNI-FORWARD -m comment --comment "CNI firewall plugin admin overrides" -j CNI-ADMIN
-A CNI-FORWARD -d 10.88.0.5/32 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A CNI-FORWARD -s 10.88.0.5/32 -j ACCEPT
-A CNI-ISOLATION-STAGE-1 -i cni0 ! -o cni0 -m comment --comment "CNI firewall plugin rules (ingressPolicy: same-bridge)" -j CNI-ISOLATION-STAGE-2
-A CNI-ISOLATION-STAGE-1 -m comment --comment "CNI firewall plugin rules (ingressPolicy: same-bridge)" -j RETURN
-A CNI-ISOLATION-STAGE-2 -o cni0 -m comment --comment "CNI firewall plugin rules (ingressPolicy: same-bridge)" -j DROP
-A CNI-ISOLATION-STAGE-2 -m comment --comment "CNI firewall plugin rules (ingressPolicy: same-bridge)" -j RETURN
COMMIT
"#;

    fn conf(policy: &str) -> Conf {
        let v = json!({"cniVersion": "1.0.0", "name": "n", "type": "firewall", "ingressPolicy": policy});
        Conf::load(&CmdArgs::for_conf(&v).unwrap()).unwrap()
    }

    #[test]
    fn the_references_rules_are_complete_for_us() {
        let t = rcni_netfilter::iptables::parse_save_table(REFERENCE, "filter").unwrap();
        let ips = vec!["10.88.0.5/24".parse().unwrap()];
        assert!(problems(&t, &conf("same-bridge"), &ips, Some("cni0")).is_empty());
        assert_eq!(
            setup_script(&t, &conf("same-bridge"), &ips, Some("cni0")),
            ""
        );
        let iso = setup_script(&t, &conf("isolated"), &ips, Some("cni0"));
        assert_eq!(
            iso,
            "*filter\n-I CNI-ISOLATION-STAGE-1 1 -i cni0 -o cni0 -m comment --comment \"CNI firewall plugin rules (ingressPolicy: same-bridge)\" -j DROP\nCOMMIT\n"
        );
        let other: Vec<IpNetwork> = vec!["10.88.0.6/24".parse().unwrap()];
        assert_eq!(problems(&t, &conf("open"), &other, None).len(), 2);
        let td = teardown_script(&t, &ips).unwrap();
        assert!(td.contains("-D CNI-FORWARD -s 10.88.0.5/32 -j ACCEPT\n"));
        assert!(teardown_script(&t, &other).is_none());
    }

    #[test]
    fn fresh_table() {
        let t = rcni_netfilter::iptables::parse_save_table(
            "*filter\n:FORWARD ACCEPT [0:0]\nCOMMIT\n",
            "filter",
        )
        .unwrap();
        let ips = vec!["fd88::5/64".parse().unwrap()];
        let s = setup_script(&t, &conf("open"), &ips, None);
        assert!(s.starts_with("*filter\n:CNI-FORWARD - [0:0]\n:CNI-ADMIN - [0:0]\n"));
        assert!(s.contains(
            "-I FORWARD 1 -m comment --comment \"CNI firewall plugin rules\" -j CNI-FORWARD\n"
        ));
        assert!(s.contains(
            "-A CNI-FORWARD -d fd88::5/128 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n"
        ));
    }
}
