//! The iptables backend, in the reference's exact layout (nat table, as
//! `/usr/lib/cni/portmap` v1.1.1 writes it), so either implementation
//! checks and removes what the other made:
//!
//! ```text
//! -A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
//! -A OUTPUT -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
//! -A POSTROUTING -m comment --comment "CNI portfwd requiring masquerade" -j CNI-HOSTPORT-MASQ
//! -A CNI-HOSTPORT-DNAT -p tcp -m comment --comment "dnat name: \"net\" id: \"cid\"" -m multiport --dports 8080 -j CNI-DN-<hash>
//! -A CNI-DN-<hash> -s 10.88.0.0/24 -p tcp -m tcp --dport 8080 -j CNI-HOSTPORT-SETMARK
//! -A CNI-DN-<hash> -s 127.0.0.1/32 -p tcp -m tcp --dport 8080 -j CNI-HOSTPORT-SETMARK
//! -A CNI-DN-<hash> -p tcp -m tcp --dport 8080 -j DNAT --to-destination 10.88.0.5:80
//! -A CNI-HOSTPORT-MASQ -m mark --mark 0x2000/0x2000 -j MASQUERADE
//! -A CNI-HOSTPORT-SETMARK -m comment --comment "CNI portfwd masquerade mark" -j MARK --set-xmark 0x2000/0x2000
//! ```
//!
//! One `iptables-save -t nat` to read and one `iptables-restore --noflush`
//! to write per family and call, where the reference runs about 35
//! `iptables` processes per family for one ADD. Rules are written in the
//! text `iptables-save` prints, so what we write and read compare as
//! strings.

use crate::conf::{Conf, Proto};
use ipnetwork::IpNetwork;
use rcni_cni::CniError;
use rcni_netfilter::iptables::{Family, SaveTable};
use rcni_netfilter::{chain_name_with_prefix, go_quote, parse_iptables_comment};
use rcni_netns::NetNs;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

pub const DNAT_CHAIN: &str = "CNI-HOSTPORT-DNAT";
pub const SETMARK_CHAIN: &str = "CNI-HOSTPORT-SETMARK";
pub const MASQ_CHAIN: &str = "CNI-HOSTPORT-MASQ";
/// multiport takes at most 15 ports per rule.
const MULTIPORT_MAX: usize = 15;

/// The per-attachment DNAT chain, `CNI-DN-<hash(network+containerID)>`.
pub fn dn_chain(network: &str, container_id: &str) -> String {
    chain_name_with_prefix("DN-", network, container_id)
}

/// The chain old reference versions made (`CNI-SN-...`), removed too.
fn old_sn_chain(network: &str, container_id: &str) -> String {
    chain_name_with_prefix("SN-", network, container_id)
}

/// The entry rules' comment (`trimComment` cuts at 256 bytes).
fn dnat_comment(network: &str, container_id: &str) -> String {
    let mut c = format!(
        "dnat name: {} id: {}",
        go_quote(network),
        go_quote(container_id)
    );
    c.truncate(256);
    c
}

fn family(ip: &IpNetwork) -> Family {
    if ip.is_ipv4() { Family::V4 } else { Family::V6 }
}

fn host_len(ip: &std::net::IpAddr) -> u8 {
    if ip.is_ipv4() { 32 } else { 128 }
}

/// An iptables word, quoted when it has blanks or quotes.
fn word(w: &str) -> String {
    if w.is_empty() || w.contains(|c: char| c.is_whitespace() || c == '"') {
        go_quote(w)
    } else {
        w.to_string()
    }
}

fn mark_def(conf: &Conf) -> String {
    format!("{:#x}/{:#x}", conf.mark(), conf.mark())
}

fn setmark_rule(conf: &Conf) -> String {
    format!(
        "-A {SETMARK_CHAIN} -m comment --comment \"CNI portfwd masquerade mark\" -j MARK --set-xmark {}",
        mark_def(conf)
    )
}

fn masq_rule(conf: &Conf) -> String {
    format!(
        "-A {MASQ_CHAIN} -m mark --mark {} -j MASQUERADE",
        mark_def(conf)
    )
}

const MASQ_ENTRY: &str =
    "-A POSTROUTING -m comment --comment \"CNI portfwd requiring masquerade\" -j CNI-HOSTPORT-MASQ";

fn dnat_entry(hook: &str) -> String {
    format!("-A {hook} -m addrtype --dst-type LOCAL -j {DNAT_CHAIN}")
}

/// The rules of the DN chain, as iptables-save prints them.
pub fn dn_rules(conf: &Conf, chain: &str, ip: &IpNetwork) -> Vec<String> {
    let v6 = ip.is_ipv6();
    let set_mark = conf
        .external_set_mark_chain
        .as_deref()
        .unwrap_or(SETMARK_CHAIN);
    let mut out = Vec::new();
    for m in conf.mappings.iter().filter(|m| m.applies_to(v6)) {
        let dst = m
            .host_ip
            .map(|h| format!("-d {h}/{} ", host_len(&h)))
            .unwrap_or_default();
        let p = m.proto.as_str();
        let base = format!("{dst}-p {p} -m {p} --dport {}", m.host_port);
        if conf.snat {
            let src = if conf.masq_all {
                String::new()
            } else {
                let subnet = IpNetwork::new(ip.network(), ip.prefix()).expect("valid prefix");
                format!("-s {subnet} ")
            };
            out.push(format!("-A {chain} {src}{base} -j {set_mark}"));
            if !v6 && !conf.masq_all {
                out.push(format!("-A {chain} -s 127.0.0.1/32 {base} -j {set_mark}"));
            }
        }
        let to = if v6 {
            format!("[{}]:{}", ip.ip(), m.container_port)
        } else {
            format!("{}:{}", ip.ip(), m.container_port)
        };
        out.push(format!("-A {chain} {base} -j DNAT --to-destination {to}"));
    }
    out
}

/// The entry rules in CNI-HOSTPORT-DNAT: every mapped port by protocol
/// (of either family, as the reference), at most 15 per rule.
fn entry_rules(
    conf: &Conf,
    network: &str,
    container_id: &str,
    chain: &str,
    v6: bool,
) -> Vec<String> {
    let mut by_proto: BTreeMap<Proto, Vec<u16>> = BTreeMap::new();
    for m in &conf.mappings {
        by_proto.entry(m.proto).or_default().push(m.host_port);
    }
    let comment = go_quote(&dnat_comment(network, container_id));
    let conds: String = conf
        .conditions(v6)
        .iter()
        .map(|c| format!(" {}", word(c)))
        .collect();
    let mut out = Vec::new();
    // Sorted by protocol name like the reference (sctp, tcp, udp).
    for (proto, ports) in by_proto {
        for chunk in ports.chunks(MULTIPORT_MAX) {
            let list: Vec<String> = chunk.iter().map(u16::to_string).collect();
            out.push(format!(
                "-A {DNAT_CHAIN} -p {p} -m comment --comment {comment} -m multiport --dports {}{conds} -j {chain}",
                list.join(","),
                p = proto.as_str()
            ));
        }
    }
    out
}

/// The restore input that (re)creates the attachment's rules in `t`.
pub fn setup_script(
    t: &SaveTable,
    conf: &Conf,
    network: &str,
    container_id: &str,
    ip: &IpNetwork,
) -> String {
    let chain = dn_chain(network, container_id);
    let has_rule = |raw: &str| t.rules.iter().any(|r| r.raw == raw);
    let mut decl = String::new();
    let mut body = String::new();
    let declare = |name: &str, decl: &mut String| {
        if !t.has_chain(name) {
            let _ = writeln!(decl, ":{name} - [0:0]");
        }
    };
    if conf.snat && conf.external_set_mark_chain.is_none() {
        declare(SETMARK_CHAIN, &mut decl);
        declare(MASQ_CHAIN, &mut decl);
        for rule in [setmark_rule(conf), masq_rule(conf)] {
            if !has_rule(&rule) {
                let _ = writeln!(body, "{rule}");
            }
        }
        if !has_rule(MASQ_ENTRY) {
            // Before the masquerade rules of bridge and ptp, as the reference.
            let _ = writeln!(
                body,
                "{}",
                MASQ_ENTRY.replacen("-A POSTROUTING", "-I POSTROUTING 1", 1)
            );
        }
    }
    declare(DNAT_CHAIN, &mut decl);
    for hook in ["PREROUTING", "OUTPUT"] {
        let rule = dnat_entry(hook);
        if !has_rule(&rule) {
            let _ = writeln!(body, "{rule}");
        }
    }
    // Replace the attachment's chain and entries whatever state they are in.
    if t.has_chain(&chain) {
        for r in t.references(&chain) {
            let _ = writeln!(body, "{}", r.delete_line());
        }
        let _ = writeln!(body, "-F {chain}");
    } else {
        let _ = writeln!(decl, ":{chain} - [0:0]");
    }
    for rule in dn_rules(conf, &chain, ip) {
        let _ = writeln!(body, "{rule}");
    }
    // Prepended, so the most recent container using a host port wins (as
    // upstream since v1.6); inserted last first to keep their order.
    for rule in entry_rules(conf, network, container_id, &chain, ip.is_ipv6())
        .iter()
        .rev()
    {
        let _ = writeln!(
            body,
            "{}",
            rule.replacen("-A CNI-HOSTPORT-DNAT", "-I CNI-HOSTPORT-DNAT 1", 1)
        );
    }
    format!("*nat\n{decl}{body}COMMIT\n")
}

pub fn setup(
    ns: &NetNs,
    conf: &Conf,
    network: &str,
    container_id: &str,
    ip: &IpNetwork,
) -> Result<(), CniError> {
    rcni_netfilter::iptables::edit(ns, family(ip), "nat", |t| {
        Some(setup_script(t, conf, network, container_id, ip))
    })
    .map_err(|e| CniError::from(e).context("unable to set up iptables rules for port mappings"))
}

/// What CHECK finds missing in `t` for the attachment.
pub fn problems(
    t: &SaveTable,
    conf: &Conf,
    network: &str,
    container_id: &str,
    ip: &IpNetwork,
) -> Vec<String> {
    let chain = dn_chain(network, container_id);
    if !t.has_chain(&chain) {
        return vec![format!("chain {chain} does not exist")];
    }
    let mut out = Vec::new();
    if t.references(&chain).next().is_none() {
        out.push(format!("no rule in {DNAT_CHAIN} jumps to {chain}"));
    }
    for hook in ["PREROUTING", "OUTPUT"] {
        let rule = dnat_entry(hook);
        if !t.rules.iter().any(|r| r.raw == rule) {
            out.push(format!("missing rule: {rule}"));
        }
    }
    for rule in dn_rules(conf, &chain, ip) {
        if !t.rules.iter().any(|r| r.raw == rule) {
            out.push(format!("missing rule: {rule}"));
        }
    }
    out
}

pub fn check(
    ns: &NetNs,
    conf: &Conf,
    network: &str,
    container_id: &str,
    ip: &IpNetwork,
) -> Result<Vec<String>, CniError> {
    let t = rcni_netfilter::iptables::read(ns, family(ip))?;
    Ok(problems(&t, conf, network, container_id, ip))
}

/// Removes `chains` and every rule jumping to them, in one restore run.
fn remove_chains(ns: &NetNs, fam: Family, chains: &BTreeSet<String>) -> Result<(), CniError> {
    Ok(rcni_netfilter::iptables::edit(ns, fam, "nat", |t| {
        rcni_netfilter::iptables::removal_script(t, chains)
    })?)
}

/// The attachment's chains (the current one and the old SNAT one).
pub fn attachment_chains(network: &str, container_id: &str) -> BTreeSet<String> {
    [
        dn_chain(network, container_id),
        old_sn_chain(network, container_id),
    ]
    .into_iter()
    .collect()
}

pub fn teardown(
    ns: &NetNs,
    fam: Family,
    network: &str,
    container_id: &str,
) -> Result<(), CniError> {
    remove_chains(ns, fam, &attachment_chains(network, container_id))
}

/// The DN chains of `network` whose container is not in `valid`, found by
/// the entry rules' comments (the chain name is a one-way hash).
pub fn stale_chains(t: &SaveTable, network: &str, valid: &BTreeSet<&str>) -> BTreeSet<String> {
    t.rules_in(DNAT_CHAIN)
        .filter_map(|r| {
            let c = r.comment.as_deref()?.strip_prefix("dnat ")?;
            let (net, cid) = parse_iptables_comment(c)?;
            (net == network && !valid.contains(cid)).then(|| dn_chain(net, cid))
        })
        .filter(|chain| {
            t.rules_in(DNAT_CHAIN)
                .any(|r| r.target.as_deref() == Some(chain.as_str()))
        })
        .collect()
}

pub fn gc(ns: &NetNs, fam: Family, network: &str, valid: &BTreeSet<&str>) -> Result<(), CniError> {
    Ok(rcni_netfilter::iptables::edit(ns, fam, "nat", |t| {
        rcni_netfilter::iptables::removal_script(t, &stale_chains(t, network, valid))
    })?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcni_cni::skel::CmdArgs;
    use serde_json::json;

    /// `iptables-save -t nat` after `/usr/lib/cni/portmap` (v1.1.1) ADD of
    /// network mynet, container ctr1, 10.88.0.5/24, mappings tcp 8080->80
    /// and udp 10.0.0.1:8081->81.
    const REFERENCE_V4: &str = r#"*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:CNI-DN-5145007e2a8415ce07579 - [0:0]
:CNI-HOSTPORT-DNAT - [0:0]
:CNI-HOSTPORT-MASQ - [0:0]
:CNI-HOSTPORT-SETMARK - [0:0]
-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
-A OUTPUT -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
-A POSTROUTING -m comment --comment "CNI portfwd requiring masquerade" -j CNI-HOSTPORT-MASQ
-A CNI-DN-5145007e2a8415ce07579 -s 10.88.0.0/24 -p tcp -m tcp --dport 8080 -j CNI-HOSTPORT-SETMARK
-A CNI-DN-5145007e2a8415ce07579 -s 127.0.0.1/32 -p tcp -m tcp --dport 8080 -j CNI-HOSTPORT-SETMARK
-A CNI-DN-5145007e2a8415ce07579 -p tcp -m tcp --dport 8080 -j DNAT --to-destination 10.88.0.5:80
-A CNI-DN-5145007e2a8415ce07579 -s 10.88.0.0/24 -d 10.0.0.1/32 -p udp -m udp --dport 8081 -j CNI-HOSTPORT-SETMARK
-A CNI-DN-5145007e2a8415ce07579 -s 127.0.0.1/32 -d 10.0.0.1/32 -p udp -m udp --dport 8081 -j CNI-HOSTPORT-SETMARK
-A CNI-DN-5145007e2a8415ce07579 -d 10.0.0.1/32 -p udp -m udp --dport 8081 -j DNAT --to-destination 10.88.0.5:81
-A CNI-HOSTPORT-DNAT -p tcp -m comment --comment "dnat name: \"mynet\" id: \"ctr1\"" -m multiport --dports 8080 -j CNI-DN-5145007e2a8415ce07579
-A CNI-HOSTPORT-DNAT -p udp -m comment --comment "dnat name: \"mynet\" id: \"ctr1\"" -m multiport --dports 8081 -j CNI-DN-5145007e2a8415ce07579
-A CNI-HOSTPORT-MASQ -m mark --mark 0x2000/0x2000 -j MASQUERADE
-A CNI-HOSTPORT-SETMARK -m comment --comment "CNI portfwd masquerade mark" -j MARK --set-xmark 0x2000/0x2000
COMMIT
"#;

    fn conf() -> Conf {
        let v = json!({"cniVersion": "1.0.0", "name": "mynet", "type": "portmap",
            "runtimeConfig": {"portMappings": [
                {"hostPort": 8080, "containerPort": 80, "protocol": "tcp"},
                {"hostPort": 8081, "containerPort": 81, "protocol": "udp", "hostIP": "10.0.0.1"}]}});
        Conf::load(&CmdArgs::for_conf(&v).unwrap()).unwrap()
    }

    #[test]
    fn the_references_rules_pass_our_check() {
        let t = rcni_netfilter::iptables::parse_save(REFERENCE_V4).unwrap();
        let ip: IpNetwork = "10.88.0.5/24".parse().unwrap();
        assert_eq!(
            problems(&t, &conf(), "mynet", "ctr1", &ip),
            Vec::<String>::new()
        );
        // Our entry rules are the reference's lines.
        for e in entry_rules(&conf(), "mynet", "ctr1", &dn_chain("mynet", "ctr1"), false) {
            assert!(REFERENCE_V4.contains(&e), "{e}");
        }
        // Nothing to add for the shared chains, the chain is refilled.
        let s = setup_script(&t, &conf(), "mynet", "ctr1", &ip);
        assert!(!s.contains(":CNI-HOSTPORT"), "{s}");
        assert!(s.contains("-D CNI-HOSTPORT-DNAT -p tcp"));
        assert!(s.contains("-F CNI-DN-5145007e2a8415ce07579\n"));
        let empty =
            rcni_netfilter::iptables::parse_save("*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n")
                .unwrap();
        let s = setup_script(&empty, &conf(), "mynet", "ctr1", &ip);
        assert!(s.contains(":CNI-HOSTPORT-SETMARK - [0:0]\n"));
        assert!(s.contains(":CNI-DN-5145007e2a8415ce07579 - [0:0]\n"));
        assert!(s.contains("-I POSTROUTING 1 -m comment"));
        assert!(s.ends_with("COMMIT\n"));
    }

    #[test]
    fn gc_finds_stale_chains_by_comment() {
        let t = rcni_netfilter::iptables::parse_save(REFERENCE_V4).unwrap();
        let stale = stale_chains(&t, "mynet", &BTreeSet::new());
        assert_eq!(
            stale.into_iter().collect::<Vec<_>>(),
            vec![dn_chain("mynet", "ctr1")]
        );
        assert!(stale_chains(&t, "mynet", &["ctr1"].into_iter().collect()).is_empty());
        assert!(stale_chains(&t, "other", &BTreeSet::new()).is_empty());
        let script =
            rcni_netfilter::iptables::removal_script(&t, &attachment_chains("mynet", "ctr1"))
                .unwrap();
        assert!(script.contains("-X CNI-DN-5145007e2a8415ce07579"));
    }

    #[test]
    fn v6_and_masq_all() {
        let ip: IpNetwork = "fd88::5/64".parse().unwrap();
        let rules = dn_rules(&conf(), "C", &ip);
        assert_eq!(
            rules,
            vec![
                "-A C -s fd88::/64 -p tcp -m tcp --dport 8080 -j CNI-HOSTPORT-SETMARK",
                "-A C -p tcp -m tcp --dport 8080 -j DNAT --to-destination [fd88::5]:80",
            ]
        );
        let mut c = conf();
        c.masq_all = true;
        let ip4: IpNetwork = "10.88.0.5/24".parse().unwrap();
        assert_eq!(
            dn_rules(&c, "C", &ip4)[0],
            "-A C -p tcp -m tcp --dport 8080 -j CNI-HOSTPORT-SETMARK"
        );
    }
}
