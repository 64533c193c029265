//! The nftables backend, in upstream's layout (`portmap_nftables.go`,
//! v1.9.1), one table per IP family:
//!
//! ```text
//! table ip cni_hostport {
//!     comment "CNI portmap plugin"
//!     chain hostports { tcp dport 8080 dnat to 10.88.0.5:80 comment "<attachment>" }
//!     chain hostip_hostports { ip daddr 10.0.0.1 udp dport 53 dnat to 10.88.0.5:53 comment "<attachment>" }
//!     chain prerouting { type nat hook prerouting priority dstnat;
//!         jump hostip_hostports
//!         fib daddr type local jump hostports }
//!     chain output { type nat hook output priority -100;
//!         jump hostip_hostports
//!         fib daddr type local jump hostports }
//!     chain masquerading { type nat hook postrouting priority srcnat;
//!         ip saddr 10.88.0.0/24 ip daddr 10.88.0.5 ct status dnat masquerade comment "<attachment>"
//!         ip saddr 127.0.0.1 ip daddr 10.88.0.5 ct status dnat masquerade comment "<attachment>" }
//! }
//! ```
//!
//! Deliberate differences from upstream, each a fix:
//! * the comment names the attachment (network, ifname, container:
//!   [`rcni_netfilter::nft_comment`]) instead of the bare container ID, so a
//!   container on two networks keeps its other network's mappings when one
//!   is deleted, and GC can tell networks apart; rules with upstream's bare
//!   container-ID comment are still deleted by DEL;
//! * prerouting reaches `hostports` only for local destinations (as the
//!   iptables layout's `--dst-type LOCAL`), where upstream DNATs traffic to
//!   any address with a mapped port, including pods' outbound connections;
//! * hairpin masquerade covers the container's subnet, not just the
//!   container itself (as the iptables layout does): another pod on the
//!   same bridge reaching the host port gets its reply through the host;
//!   `ct status dnat` keeps it to port-mapped connections; `masqAll`
//!   masquerades every mapped connection, one rule from `0.0.0.0/0` (or
//!   `::/0`) and none from 127.0.0.1, as upstream since v1.10.0 (v1.9.1's
//!   nftables backend ignored the key).
//!
//! ADD writes both families in one nf_tables transaction over netlink
//! (through `nft -f -` only when conditions, which are nft rule text, are
//! configured); DEL, CHECK and GC find rules by comment over nfnetlink: no
//! process at all.

use crate::conf::{Conf, Mapping};
use ipnetwork::IpNetwork;
use rcni_cni::{CniError, subnet};
use rcni_netfilter::expr::{self, Expr};
use rcni_netfilter::nfnl::{Hook, Nfnl, NftFamily, NftOp, NftRule};
use rcni_netns::NetNs;
use std::fmt::Write;
use std::net::IpAddr;

pub const TABLE: &str = "cni_hostport";
pub const HOSTPORTS: &str = "hostports";
pub const HOSTIP_HOSTPORTS: &str = "hostip_hostports";
pub const MASQUERADING: &str = "masquerading";
const RULE_CHAINS: [&str; 3] = [HOSTPORTS, HOSTIP_HOSTPORTS, MASQUERADING];

/// Who an attachment's rules belong to.
#[derive(Debug, Clone)]
pub struct Owner<'a> {
    pub network: &'a str,
    pub ifname: &'a str,
    pub container_id: &'a str,
}

impl Owner<'_> {
    pub fn comment(&self) -> String {
        rcni_netfilter::nft_comment(self.network, self.ifname, self.container_id)
    }

    /// Whether `comment` marks a rule of this attachment: ours, or
    /// upstream's bare container ID.
    fn owns(&self, comment: &str) -> bool {
        comment.starts_with(&rcni_netfilter::nft_instance_hash(
            self.network,
            self.ifname,
            self.container_id,
        )) || comment == self.container_id
    }
}

fn fam_of(ip: &IpNetwork) -> NftFamily {
    NftFamily::of(&ip.ip())
}

fn dnat_target(ip: &IpNetwork, port: u16) -> String {
    if ip.is_ipv4() {
        format!("{}:{port}", ip.ip())
    } else {
        format!("[{}]:{port}", ip.ip())
    }
}

fn prefix(conds: &[String]) -> String {
    conds.iter().map(|c| format!("{c} ")).collect()
}

/// The sources the masquerade rule of container address `ip` matches: its
/// subnet (hairpin), or with `masqAll` every source, written as upstream
/// v1.10.0 writes it (`0.0.0.0/0`, `::/0`) so that the rule reads the same
/// in `nft list`.
fn masq_sources(conf: &Conf, ip: &IpNetwork) -> IpNetwork {
    if conf.masq_all {
        let any = if ip.is_ipv4() {
            IpAddr::from([0u8; 4])
        } else {
            IpAddr::from([0u16; 8])
        };
        IpNetwork::new(any, 0).expect("a /0 prefix is valid")
    } else {
        subnet(ip)
    }
}

/// The rules of one family, written into `s`.
fn family_script(s: &mut String, conf: &Conf, owner: &Owner, ip: &IpNetwork) {
    let fam = fam_of(ip);
    let v6 = ip.is_ipv6();
    let t = format!("{fam} {TABLE}");
    let cond = prefix(conf.conditions(v6));
    let comment = owner.comment();
    let _ = write!(
        s,
        "add table {t} {{ comment \"CNI portmap plugin\" ; }}\n\
         add chain {t} {HOSTPORTS}\n\
         add chain {t} {HOSTIP_HOSTPORTS}\n\
         add chain {t} prerouting {{ type nat hook prerouting priority dstnat ; }}\n\
         flush chain {t} prerouting\n\
         add rule {t} prerouting {cond}jump {HOSTIP_HOSTPORTS}\n\
         add rule {t} prerouting {cond}fib daddr type local jump {HOSTPORTS}\n\
         add chain {t} output {{ type nat hook output priority -100 ; }}\n\
         flush chain {t} output\n\
         add rule {t} output {cond}jump {HOSTIP_HOSTPORTS}\n\
         add rule {t} output {cond}fib daddr type local jump {HOSTPORTS}\n"
    );
    if conf.snat {
        let _ = writeln!(
            s,
            "add chain {t} {MASQUERADING} {{ type nat hook postrouting priority srcnat ; }}"
        );
    }
    for m in conf.mappings.iter().filter(|m| m.applies_to(v6)) {
        let Mapping {
            host_port,
            container_port,
            proto,
            host_ip,
            ..
        } = m;
        let target = dnat_target(ip, *container_port);
        let p = proto.as_str();
        match host_ip {
            Some(h) => {
                let _ = writeln!(
                    s,
                    "add rule {t} {HOSTIP_HOSTPORTS} {fam} daddr {h} meta l4proto {p} th dport {host_port} dnat to {target} comment \"{comment}\""
                );
            }
            None => {
                let _ = writeln!(
                    s,
                    "add rule {t} {HOSTPORTS} meta l4proto {p} th dport {host_port} dnat to {target} comment \"{comment}\""
                );
            }
        }
    }
    if conf.snat {
        let _ = writeln!(
            s,
            "add rule {t} {MASQUERADING} {fam} saddr {} {fam} daddr {} ct status dnat masquerade comment \"{comment}\"",
            masq_sources(conf, ip),
            ip.ip()
        );
        if !v6 && !conf.masq_all {
            let _ = writeln!(
                s,
                "add rule {t} {MASQUERADING} {fam} saddr 127.0.0.1 {fam} daddr {} ct status dnat masquerade comment \"{comment}\"",
                ip.ip()
            );
        }
    }
}

/// The whole ADD transaction: first the deletion of the attachment's
/// current rules (`stale`: `(family, chain, handle)`, so a repeated ADD
/// replaces instead of duplicating), then each family's rules.
pub fn setup_script(
    conf: &Conf,
    owner: &Owner,
    ips: &[IpNetwork],
    stale: &[(NftFamily, String, u64)],
) -> String {
    let mut s = String::new();
    for (fam, chain, handle) in stale {
        let _ = writeln!(s, "delete rule {fam} {TABLE} {chain} handle {handle}");
    }
    for ip in ips {
        family_script(&mut s, conf, owner, ip);
    }
    s
}

/// The attachment's rules in both families' tables: `(family, rule)`.
fn owned_rules(
    nl: &mut Nfnl,
    pick: &dyn Fn(&str) -> bool,
) -> Result<Vec<(NftFamily, NftRule)>, CniError> {
    let mut out = Vec::new();
    for fam in [NftFamily::Ip, NftFamily::Ip6] {
        let rules = nl.nft_rules(fam, TABLE)?.unwrap_or_default();
        out.extend(
            rules
                .into_iter()
                .filter(|r| RULE_CHAINS.contains(&r.chain.as_str()))
                .filter(|r| r.comment.as_deref().is_some_and(pick))
                .map(|r| (fam, r)),
        );
    }
    Ok(out)
}

fn run_nft(ns: &NetNs, script: &str) -> Result<(), CniError> {
    rcni_netfilter::exec::run_ok(ns, "nft", &["-f", "-"], Some(script))
        .map(|_| ())
        .map_err(|e| CniError::from(e).context("unable to set up nftables rules for port mappings"))
}

/// The ADD transaction as netlink operations: the same rules as
/// [`setup_script`], without an `nft` process. (Conditions are nft rule
/// text, which only nft can parse: with them [`setup_script`] is used.)
pub fn setup_ops(
    conf: &Conf,
    owner: &Owner,
    ips: &[IpNetwork],
    stale: &[(NftFamily, String, u64)],
) -> Vec<NftOp> {
    let mut ops: Vec<NftOp> = stale
        .iter()
        .map(|(family, chain, handle)| NftOp::DeleteRule {
            family: *family,
            table: TABLE.into(),
            chain: chain.clone(),
            handle: *handle,
        })
        .collect();
    let comment = owner.comment();
    for ip in ips {
        let family = fam_of(ip);
        let v6 = ip.is_ipv6();
        let chain = |name: &str, hook: Option<Hook>| NftOp::AddChain {
            family,
            table: TABLE.into(),
            chain: name.into(),
            hook,
            comment: None,
        };
        let rule = |chain: &str, expr: Vec<Expr>, comment: Option<&str>| NftOp::AddRule {
            family,
            table: TABLE.into(),
            chain: chain.into(),
            expr,
            comment: comment.map(String::from),
            insert: false,
        };
        let nat = |hook, priority| {
            Some(Hook {
                kind: "nat",
                hook,
                priority,
            })
        };
        ops.push(NftOp::AddTable {
            family,
            table: TABLE.into(),
            comment: Some("CNI portmap plugin".into()),
        });
        ops.push(chain(HOSTPORTS, None));
        ops.push(chain(HOSTIP_HOSTPORTS, None));
        for (base, hook) in [("prerouting", Hook::PREROUTING), ("output", Hook::OUTPUT)] {
            ops.push(chain(base, nat(hook, -100)));
            ops.push(NftOp::FlushChain {
                family,
                table: TABLE.into(),
                chain: base.into(),
            });
            ops.push(rule(base, expr::jump(HOSTIP_HOSTPORTS), None));
            let local = [expr::fib_daddr_local(), expr::jump(HOSTPORTS)].concat();
            ops.push(rule(base, local, None));
        }
        if conf.snat {
            ops.push(chain(MASQUERADING, nat(Hook::POSTROUTING, 100)));
        }
        for m in conf.mappings.iter().filter(|m| m.applies_to(v6)) {
            let mut e = Vec::new();
            if let Some(h) = m.host_ip {
                e.extend(expr::addr(false, IpNetwork::from(h)));
            }
            e.extend(expr::l4proto(m.proto.number()));
            e.extend(expr::th_dport(m.host_port));
            e.extend(expr::dnat(ip.ip(), m.container_port));
            let chain = if m.host_ip.is_some() {
                HOSTIP_HOSTPORTS
            } else {
                HOSTPORTS
            };
            ops.push(rule(chain, e, Some(&comment)));
        }
        if conf.snat {
            let dst = expr::addr(false, IpNetwork::from(ip.ip()));
            let tail = [expr::ct_status_dnat(), expr::masquerade()].concat();
            let hairpin = [
                expr::addr(true, masq_sources(conf, ip)),
                dst.clone(),
                tail.clone(),
            ]
            .concat();
            ops.push(rule(MASQUERADING, hairpin, Some(&comment)));
            if !v6 && !conf.masq_all {
                let lo = IpNetwork::from(std::net::IpAddr::from([127, 0, 0, 1]));
                let local = [expr::addr(true, lo), dst, tail].concat();
                ops.push(rule(MASQUERADING, local, Some(&comment)));
            }
        }
    }
    ops
}

/// Writes the attachment's rules (replacing any it had) in one
/// transaction: over netlink, or through `nft -f -` when the config has
/// conditions (nft syntax). A rule deleted by someone else between the
/// listing and the write fails the transaction atomically; listing again
/// and retrying once settles that.
pub fn setup(
    ns: &NetNs,
    nl: &mut Nfnl,
    conf: &Conf,
    owner: &Owner,
    ips: &[IpNetwork],
) -> Result<(), CniError> {
    let with_nft = !conf.conditions_v4.is_empty() || !conf.conditions_v6.is_empty();
    let mut last = None;
    for _ in 0..2 {
        let stale: Vec<(NftFamily, String, u64)> = owned_rules(nl, &|c| owner.owns(c))?
            .into_iter()
            .map(|(f, r)| (f, r.chain, r.handle))
            .collect();
        let r = if with_nft {
            run_nft(ns, &setup_script(conf, owner, ips, &stale))
        } else {
            nl.nft_apply(&setup_ops(conf, owner, ips, &stale))
                .map_err(|e| {
                    CniError::from(e).context("unable to set up nftables rules for port mappings")
                })
        };
        match r {
            Ok(()) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("one attempt at least"))
}

/// Deletes the rules `pick` selects (by comment) in both families.
fn remove(nl: &mut Nfnl, pick: &dyn Fn(&str) -> bool) -> Result<(), CniError> {
    let tables = [(NftFamily::Ip, TABLE), (NftFamily::Ip6, TABLE)];
    nl.nft_delete_rules_where(&tables, &|_, r| {
        RULE_CHAINS.contains(&r.chain.as_str()) && r.comment.as_deref().is_some_and(pick)
    })?;
    Ok(())
}

/// Removes the attachment's rules in both families.
pub fn teardown(nl: &mut Nfnl, owner: &Owner) -> Result<(), CniError> {
    remove(nl, &|c| owner.owns(c))
}

/// Removes the rules of `network` whose attachment is not in `valid`.
pub fn gc(nl: &mut Nfnl, network: &str, valid: &[(String, String)]) -> Result<(), CniError> {
    let prefix = format!("{}-", rcni_netfilter::nft_network_hash(network));
    let keep: std::collections::HashSet<String> = valid
        .iter()
        .map(|(cid, ifname)| rcni_netfilter::nft_comment(network, ifname, cid))
        .collect();
    remove(nl, &|c| c.starts_with(&prefix) && !keep.contains(c))
}

/// What CHECK finds missing for the attachment; empty when complete.
pub fn problems(
    nl: &mut Nfnl,
    conf: &Conf,
    owner: &Owner,
    ips: &[IpNetwork],
) -> Result<Vec<String>, CniError> {
    let comment = owner.comment();
    let mut out = Vec::new();
    for ip in ips {
        let fam = fam_of(ip);
        let v6 = ip.is_ipv6();
        let Some(chains) = nl.nft_chains(fam, TABLE)? else {
            out.push(format!("table {fam} {TABLE} does not exist"));
            continue;
        };
        for base in ["prerouting", "output"] {
            if !chains.iter().any(|c| c.name == base && c.base) {
                out.push(format!("chain {fam} {TABLE} {base} does not exist"));
            }
        }
        let rules = nl.nft_rules(fam, TABLE)?.unwrap_or_default();
        let count = |chain: &str| {
            rules
                .iter()
                .filter(|r| r.chain == chain && r.comment.as_deref() == Some(comment.as_str()))
                .count()
        };
        let applicable: Vec<&Mapping> = conf.mappings.iter().filter(|m| m.applies_to(v6)).collect();
        let want_host = applicable.iter().filter(|m| m.host_ip.is_none()).count();
        let want_hostip = applicable.len() - want_host;
        let want_masq = match (conf.snat, v6 || conf.masq_all) {
            (false, _) => 0,
            (true, true) => 1,
            (true, false) => 2,
        };
        for (chain, want) in [
            (HOSTPORTS, want_host),
            (HOSTIP_HOSTPORTS, want_hostip),
            (MASQUERADING, want_masq),
        ] {
            let have = count(chain);
            if have < want {
                out.push(format!(
                    "missing hostport rules in {fam} {TABLE} {chain}: {have} of {want}"
                ));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcni_cni::skel::CmdArgs;
    use serde_json::json;

    fn conf(extra: serde_json::Value) -> Conf {
        let mut v = json!({"cniVersion": "1.0.0", "name": "mynet", "type": "portmap",
            "runtimeConfig": {"portMappings": [
                {"hostPort": 8080, "containerPort": 80, "protocol": "tcp"},
                {"hostPort": 5353, "containerPort": 53, "protocol": "udp", "hostIP": "192.0.2.1"},
                {"hostPort": 9090, "containerPort": 90, "protocol": "sctp", "hostIP": "2001:db8::1"}]}});
        for (k, val) in extra.as_object().unwrap() {
            v[k] = val.clone();
        }
        Conf::load(&CmdArgs::for_conf(&v).unwrap()).unwrap()
    }

    fn owner() -> Owner<'static> {
        Owner {
            network: "mynet",
            ifname: "eth0",
            container_id: "ctr1",
        }
    }

    #[test]
    fn dual_stack_script() {
        let c = conf(json!({}));
        let ips: Vec<IpNetwork> = vec![
            "10.88.0.5/24".parse().unwrap(),
            "fd88::5/64".parse().unwrap(),
        ];
        let s = setup_script(
            &c,
            &owner(),
            &ips,
            &[(NftFamily::Ip, "hostports".into(), 7)],
        );
        let cm = owner().comment();
        assert!(s.starts_with("delete rule ip cni_hostport hostports handle 7\n"));
        assert!(s.contains(&format!(
            "add rule ip cni_hostport hostports meta l4proto tcp th dport 8080 dnat to 10.88.0.5:80 comment \"{cm}\"\n"
        )));
        assert!(s.contains(&format!(
            "add rule ip cni_hostport hostip_hostports ip daddr 192.0.2.1 meta l4proto udp th dport 5353 dnat to 10.88.0.5:53 comment \"{cm}\"\n"
        )));
        // The IPv6 host IP applies to the IPv6 address only.
        assert!(!s.contains("ip cni_hostport hostip_hostports ip daddr 2001"));
        assert!(s.contains(&format!(
            "add rule ip6 cni_hostport hostip_hostports ip6 daddr 2001:db8::1 meta l4proto sctp th dport 9090 dnat to [fd88::5]:90 comment \"{cm}\"\n"
        )));
        assert!(s.contains(&format!(
            "add rule ip cni_hostport masquerading ip saddr 10.88.0.0/24 ip daddr 10.88.0.5 ct status dnat masquerade comment \"{cm}\"\n"
        )));
        assert!(s.contains(
            "add rule ip cni_hostport masquerading ip saddr 127.0.0.1 ip daddr 10.88.0.5"
        ));
        assert!(!s.contains("ip6 saddr 127.0.0.1"));
        assert!(
            s.contains("add rule ip cni_hostport prerouting fib daddr type local jump hostports\n")
        );
    }

    #[test]
    fn snat_off_masq_all_and_conditions() {
        let ips: Vec<IpNetwork> = vec!["10.88.0.5/24".parse().unwrap()];
        let s = setup_script(&conf(json!({"snat": false})), &owner(), &ips, &[]);
        assert!(!s.contains("masquerad"));
        // masqAll: one rule per family, every source, none from localhost.
        let dual: Vec<IpNetwork> = vec![
            "10.88.0.5/24".parse().unwrap(),
            "fd88::5/64".parse().unwrap(),
        ];
        let s = setup_script(&conf(json!({"masqAll": true})), &owner(), &dual, &[]);
        let masq: Vec<&str> = s.lines().filter(|l| l.contains("masquerade")).collect();
        assert_eq!(masq.len(), 2, "{s}");
        assert!(masq[0].contains(
            "masquerading ip saddr 0.0.0.0/0 ip daddr 10.88.0.5 ct status dnat masquerade"
        ));
        assert!(
            masq[1].contains(
                "masquerading ip6 saddr ::/0 ip6 daddr fd88::5 ct status dnat masquerade"
            )
        );
        assert!(!s.contains("127.0.0.1"));
        let s = setup_script(
            &conf(json!({"conditionsV4": ["ip saddr != 10.0.0.0/8"]})),
            &owner(),
            &ips,
            &[],
        );
        assert!(s.contains(
            "add rule ip cni_hostport prerouting ip saddr != 10.0.0.0/8 jump hostip_hostports\n"
        ));
    }

    #[test]
    fn masq_all_over_netlink_matches_every_source() {
        let ips: Vec<IpNetwork> = vec![
            "10.88.0.5/24".parse().unwrap(),
            "fd88::5/64".parse().unwrap(),
        ];
        let ops = setup_ops(&conf(json!({"masqAll": true})), &owner(), &ips, &[]);
        let masq: Vec<&Vec<Expr>> = ops
            .iter()
            .filter_map(|o| match o {
                NftOp::AddRule { chain, expr, .. } if chain == MASQUERADING => Some(expr),
                _ => None,
            })
            .collect();
        assert_eq!(masq.len(), 2, "one per family, none from 127.0.0.1");
        assert!(masq[0].starts_with(&expr::addr(true, "0.0.0.0/0".parse().unwrap())));
        assert!(masq[1].starts_with(&expr::addr(true, "::/0".parse().unwrap())));
    }

    #[test]
    fn ownership() {
        let o = owner();
        assert!(o.owns(&o.comment()));
        assert!(o.owns("ctr1"));
        assert!(!o.owns("ctr2"));
        let other_if = Owner {
            ifname: "eth1",
            ..owner()
        };
        assert!(!o.owns(&other_if.comment()));
    }
}
