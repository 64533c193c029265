//! The nftables layout of upstream v1.9.1 (`pkg/ip/ipmasq_nftables_linux.go`,
//! written there through knftables):
//!
//! ```text
//! table inet cni_plugins_masquerade {
//!     comment "Masquerading for plugins from github.com/containernetworking/plugins"
//!     chain masq_checks {
//!         comment "Masquerade traffic from certain IPs to any (non-multicast) IP outside their subnet"
//!         ip saddr 10.22.0.2 ip daddr != 10.22.0.0/16 masquerade comment "<net hash>-<if:cid hash>, net: mynet, if: eth0, id: ctr1"
//!     }
//!     chain postrouting {
//!         type nat hook postrouting priority srcnat; policy accept;
//!         ip daddr 224.0.0.0/4 return
//!         ip6 daddr ff00::/8 return
//!         goto masq_checks
//!     }
//! }
//! ```
//!
//! One rule per address, found again by the hash at the start of its
//! comment. Each change is one `nft -f -` transaction; reads are one
//! `nft -j list table`.

use crate::exec;
use crate::{Error, names};
use ipnetwork::IpNetwork;
use rcni_netns::NetNs;
use serde_json::Value;
use std::collections::HashSet;
use std::net::IpAddr;

/// Our nftables table (family inet).
pub const TABLE: &str = "cni_plugins_masquerade";
pub(crate) const MASQ_CHAIN: &str = "masq_checks";
pub(crate) const POSTROUTING: &str = "postrouting";
const TABLE_COMMENT: &str = "Masquerading for plugins from github.com/containernetworking/plugins";
const MASQ_CHAIN_COMMENT: &str =
    "Masquerade traffic from certain IPs to any (non-multicast) IP outside their subnet";

/// A chain of our table as `nft -j` lists it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Chain {
    pub name: String,
    pub chain_type: Option<String>,
    pub hook: Option<String>,
}

/// A rule of our table.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rule {
    pub chain: String,
    pub handle: u64,
    pub comment: Option<String>,
    pub expr: Vec<Value>,
}

/// Our table's contents.
#[derive(Debug, Clone, Default)]
pub(crate) struct Listing {
    pub chains: Vec<Chain>,
    pub rules: Vec<Rule>,
}

impl Listing {
    fn chain(&self, name: &str) -> Option<&Chain> {
        self.chains.iter().find(|c| c.name == name)
    }

    fn rules_in<'a>(&'a self, chain: &'a str) -> impl Iterator<Item = &'a Rule> + 'a {
        self.rules.iter().filter(move |r| r.chain == chain)
    }

    /// masq_checks rules whose comment starts with `prefix`.
    fn masq_rules_with_prefix<'a>(
        &'a self,
        prefix: &'a str,
    ) -> impl Iterator<Item = &'a Rule> + 'a {
        self.rules_in(MASQ_CHAIN)
            .filter(move |r| r.comment.as_deref().is_some_and(|c| c.starts_with(prefix)))
    }
}

/// The items of an `nft -j` listing: its "nftables" array.
pub fn listing_items(json: &str) -> Result<Vec<Value>, String> {
    let mut v: Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
    match v.get_mut("nftables").map(Value::take) {
        Some(Value::Array(items)) => Ok(items),
        _ => Err("no \"nftables\" array".to_string()),
    }
}

/// Parses `nft -j list table inet cni_plugins_masquerade`.
pub(crate) fn parse_listing(json: &str) -> Result<Listing, String> {
    let mut l = Listing::default();
    for item in &listing_items(json)? {
        if let Some(c) = item.get("chain") {
            l.chains.push(Chain {
                name: c["name"].as_str().unwrap_or_default().to_string(),
                chain_type: c["type"].as_str().map(String::from),
                hook: c["hook"].as_str().map(String::from),
            });
        } else if let Some(r) = item.get("rule") {
            l.rules.push(Rule {
                chain: r["chain"].as_str().unwrap_or_default().to_string(),
                handle: r["handle"]
                    .as_u64()
                    .ok_or_else(|| format!("rule without handle: {r}"))?,
                comment: r["comment"].as_str().map(String::from),
                expr: r["expr"].as_array().cloned().unwrap_or_default(),
            });
        }
    }
    Ok(l)
}

/// `{"payload": {"protocol": "ip", "field": "saddr"}}` -> ("ip", "saddr").
fn payload(v: &Value) -> Option<(&str, &str)> {
    let p = v.get("payload")?;
    Some((p["protocol"].as_str()?, p["field"].as_str()?))
}

/// A match's right-hand side as a network: a prefix object or a plain
/// address (nft prints a full-length prefix as an address).
fn network_value(v: &Value) -> Option<IpNetwork> {
    if let Some(s) = v.as_str() {
        let ip: IpAddr = s.parse().ok()?;
        return Some(IpNetwork::from(ip));
    }
    let p = v.get("prefix")?;
    let ip: IpAddr = p["addr"].as_str()?.parse().ok()?;
    IpNetwork::new(ip, u8::try_from(p["len"].as_u64()?).ok()?).ok()
}

/// `(op, protocol, field, value)` of a `match` expression.
fn match_parts(v: &Value) -> Option<(&str, &str, &str, &Value)> {
    let m = v.get("match")?;
    let (proto, field) = payload(&m["left"])?;
    Some((m["op"].as_str()?, proto, field, &m["right"]))
}

/// `(saddr, daddr network)` of a rule shaped
/// `ip saddr == A ip daddr != N masquerade`; `None` for anything else.
pub(crate) fn masq_rule(r: &Rule) -> Option<(IpAddr, IpNetwork)> {
    let [src, dst, masq] = r.expr.as_slice() else {
        return None;
    };
    let (op1, proto1, f1, v1) = match_parts(src)?;
    let (op2, proto2, f2, v2) = match_parts(dst)?;
    if (op1, f1, op2, f2) != ("==", "saddr", "!=", "daddr")
        || proto1 != proto2
        || !matches!(proto1, "ip" | "ip6")
        || masq.get("masquerade").is_none()
    {
        return None;
    }
    let saddr: IpAddr = v1.as_str()?.parse().ok()?;
    Some((saddr, network_value(v2)?))
}

/// Whether `r` is `<proto> daddr == <net> return`.
fn is_return_for(r: &Rule, proto: &str, net: &str) -> bool {
    let [m, ret] = r.expr.as_slice() else {
        return false;
    };
    let Some((op, p, f, v)) = match_parts(m) else {
        return false;
    };
    op == "=="
        && p == proto
        && f == "daddr"
        && network_value(v) == net.parse().ok()
        && ret.get("return").is_some()
}

fn is_goto_masq(r: &Rule) -> bool {
    matches!(r.expr.as_slice(), [g] if g["goto"]["target"] == MASQ_CHAIN)
}

fn subnet(ip: &IpNetwork) -> IpNetwork {
    IpNetwork::new(ip.network(), ip.prefix()).expect("prefix taken from a valid network")
}

/// What is missing for the attachment; empty when complete.
pub(crate) fn problems(
    l: Option<&Listing>,
    network: &str,
    ifname: &str,
    container_id: &str,
    ips: &[IpNetwork],
) -> Vec<String> {
    let Some(l) = l else {
        return vec![format!("nftables table inet {TABLE} does not exist")];
    };
    let mut out = Vec::new();
    match l.chain(POSTROUTING) {
        Some(c)
            if c.hook.as_deref() == Some("postrouting")
                && c.chain_type.as_deref() == Some("nat") =>
        {
            let rules: Vec<&Rule> = l.rules_in(POSTROUTING).collect();
            let good = matches!(rules.as_slice(), [a, b, c]
                if is_return_for(a, "ip", "224.0.0.0/4")
                    && is_return_for(b, "ip6", "ff00::/8")
                    && is_goto_masq(c));
            if !good {
                out.push(format!(
                    "chain inet {TABLE} {POSTROUTING} is not: multicast returns, then goto {MASQ_CHAIN}"
                ));
            }
        }
        _ => out.push(format!(
            "nat postrouting chain inet {TABLE} {POSTROUTING} does not exist"
        )),
    }
    if l.chain(MASQ_CHAIN).is_none() {
        out.push(format!("chain inet {TABLE} {MASQ_CHAIN} does not exist"));
        return out;
    }
    let comment = names::nft_comment(network, ifname, container_id);
    for ip in ips {
        let want = (ip.ip(), subnet(ip));
        let found = l
            .rules_in(MASQ_CHAIN)
            .any(|r| r.comment.as_deref() == Some(comment.as_str()) && masq_rule(r) == Some(want));
        if !found {
            out.push(format!(
                "no rule in {MASQ_CHAIN} masquerades {} leaving {} for {comment:?}",
                ip.ip(),
                subnet(ip)
            ));
        }
    }
    out
}

fn quote(s: &str) -> String {
    // Comments never contain quotes (the reference strips them from the
    // names, and the hash is hex), so plain quoting is exact.
    format!("\"{}\"", s.replace('"', ""))
}

/// The transaction that (re)creates the table and chains, replaces the
/// attachment's rules with one per address, as upstream's
/// `setupIPMasqNFTablesWithInterface` does.
pub(crate) fn setup_script(
    l: Option<&Listing>,
    network: &str,
    ifname: &str,
    container_id: &str,
    ips: &[IpNetwork],
) -> String {
    let t = format!("inet {TABLE}");
    let mut s = format!(
        "add table {t} {{ comment {} ; }}\n\
         add chain {t} {MASQ_CHAIN} {{ comment {} ; }}\n\
         add chain {t} {POSTROUTING} {{ type nat hook postrouting priority srcnat ; }}\n\
         flush chain {t} {POSTROUTING}\n\
         add rule {t} {POSTROUTING} ip daddr == 224.0.0.0/4  return\n\
         add rule {t} {POSTROUTING} ip6 daddr == ff00::/8  return\n\
         add rule {t} {POSTROUTING} goto {MASQ_CHAIN}\n",
        quote(TABLE_COMMENT),
        quote(MASQ_CHAIN_COMMENT),
    );
    if let Some(l) = l {
        let prefix = names::nft_instance_hash(network, ifname, container_id);
        for r in l.masq_rules_with_prefix(&prefix) {
            s.push_str(&format!(
                "delete rule {t} {MASQ_CHAIN} handle {}\n",
                r.handle
            ));
        }
    }
    let comment = quote(&names::nft_comment(network, ifname, container_id));
    for ip in ips {
        let fam = if ip.is_ipv4() { "ip" } else { "ip6" };
        s.push_str(&format!(
            "add rule {t} {MASQ_CHAIN} {fam} saddr == {} {fam} daddr != {} masquerade comment {comment}\n",
            ip.ip(),
            subnet(ip)
        ));
    }
    s
}

/// Deletes `doomed` rules (handles in masq_checks). When they are all the
/// chain holds, the first attempt also removes the chains and the table so
/// that nothing is left behind; if another attachment added a rule
/// meanwhile, deleting the non-empty chain fails the whole transaction
/// atomically and the plain deletion is applied instead.
fn removal_scripts(l: &Listing, doomed: &[u64]) -> Vec<String> {
    if doomed.is_empty() {
        return Vec::new();
    }
    let t = format!("inet {TABLE}");
    let mut plain = String::new();
    for h in doomed {
        plain.push_str(&format!("delete rule {t} {MASQ_CHAIN} handle {h}\n"));
    }
    let all_ours = l.rules_in(MASQ_CHAIN).all(|r| doomed.contains(&r.handle));
    let only_our_chains = l
        .chains
        .iter()
        .all(|c| c.name == MASQ_CHAIN || c.name == POSTROUTING);
    if all_ours && only_our_chains {
        let full = format!(
            "{plain}delete chain {t} {POSTROUTING}\ndelete chain {t} {MASQ_CHAIN}\ndelete table {t}\n"
        );
        vec![full, plain]
    } else {
        vec![plain]
    }
}

/// Reads our table; `None` when it does not exist.
pub(crate) fn list(ns: &NetNs) -> Result<Option<Listing>, Error> {
    let args = ["-j", "list", "table", "inet", TABLE];
    let out = exec::run(ns, "nft", &args, None)?;
    if !out.success {
        // nft says ENOENT for a missing table and exits 1 for every error;
        // the text is the only way to tell (LC_ALL=C keeps it stable).
        if out.stderr.contains("No such file or directory") {
            return Ok(None);
        }
        return Err(exec::failed("nft", &args, None, &out));
    }
    parse_listing(&out.stdout)
        .map(Some)
        .map_err(|msg| Error::Parse { tool: "nft", msg })
}

/// Runs a transaction with `nft -f -`.
fn apply(ns: &NetNs, script: &str) -> Result<(), Error> {
    exec::run_ok(ns, "nft", &["-f", "-"], Some(script)).map(|_| ())
}

/// Whether nftables works in `ns` (the reference's `SupportsNFTables`).
pub(crate) fn supported(ns: &NetNs) -> bool {
    exec::run(ns, "nft", &["list", "tables"], None).is_ok_and(|o| o.success)
}

/// A list-then-write step may race with another plugin process changing the
/// table between the two (a handle we meant to delete is gone): reading again
/// and retrying once resolves that.
const ATTEMPTS: usize = 2;

pub(crate) fn setup(
    ns: &NetNs,
    network: &str,
    ifname: &str,
    container_id: &str,
    ips: &[IpNetwork],
) -> Result<(), Error> {
    let mut last = None;
    for _ in 0..ATTEMPTS {
        let l = list(ns)?;
        if problems(l.as_ref(), network, ifname, container_id, ips).is_empty() {
            return Ok(());
        }
        match apply(
            ns,
            &setup_script(l.as_ref(), network, ifname, container_id, ips),
        ) {
            Ok(()) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("at least one attempt"))
}

pub(crate) fn check(
    ns: &NetNs,
    network: &str,
    ifname: &str,
    container_id: &str,
    ips: &[IpNetwork],
) -> Result<Vec<String>, Error> {
    Ok(problems(
        list(ns)?.as_ref(),
        network,
        ifname,
        container_id,
        ips,
    ))
}

/// Deletes the rules `select` picks from a fresh listing, retrying on races.
fn remove_where(ns: &NetNs, select: impl Fn(&Rule) -> bool) -> Result<(), Error> {
    let mut last = None;
    for _ in 0..ATTEMPTS {
        let Some(l) = list(ns)? else {
            return Ok(());
        };
        let doomed: Vec<u64> = l
            .rules_in(MASQ_CHAIN)
            .filter(|r| select(r))
            .map(|r| r.handle)
            .collect();
        let scripts = removal_scripts(&l, &doomed);
        if scripts.is_empty() {
            return Ok(());
        }
        for script in &scripts {
            match apply(ns, script) {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
        }
    }
    Err(last.expect("at least one attempt"))
}

/// Removes the attachment's rules (by the hash of network, ifname and
/// container ID, so no address is needed).
pub(crate) fn teardown(
    ns: &NetNs,
    network: &str,
    ifname: &str,
    container_id: &str,
) -> Result<(), Error> {
    let prefix = names::nft_instance_hash(network, ifname, container_id);
    remove_where_nl(ns, &|c: &str| c.starts_with(&prefix))
}

/// [`remove_where`] over nfnetlink, without `nft` processes (DEL runs on
/// every pod's teardown): the rules of masq_checks whose comment `select`
/// picks go, and with the last of them the chains and the table, in one
/// transaction; listing again and retrying once if another plugin
/// process changed the table meanwhile.
fn remove_where_nl(ns: &NetNs, select: &dyn Fn(&str) -> bool) -> Result<(), Error> {
    use crate::nfnl::{Nfnl, NftFamily, NftOp};
    let mut nl = Nfnl::open(ns)?;
    let fam = NftFamily::Inet;
    let mut last = None;
    for _ in 0..2 {
        let Some(rules) = nl.nft_rules(fam, TABLE)? else {
            return Ok(());
        };
        let masq: Vec<_> = rules.iter().filter(|r| r.chain == MASQ_CHAIN).collect();
        let doomed: Vec<u64> = masq
            .iter()
            .filter(|r| r.comment.as_deref().is_some_and(select))
            .map(|r| r.handle)
            .collect();
        if doomed.is_empty() {
            return Ok(());
        }
        let plain: Vec<NftOp> = doomed
            .iter()
            .map(|h| NftOp::DeleteRule {
                family: fam,
                table: TABLE.into(),
                chain: MASQ_CHAIN.into(),
                handle: *h,
            })
            .collect();
        let only_ours = nl
            .nft_chains(fam, TABLE)?
            .unwrap_or_default()
            .iter()
            .all(|c| c.name == MASQ_CHAIN || c.name == POSTROUTING);
        let mut attempts = Vec::new();
        if only_ours && masq.len() == doomed.len() {
            let mut full = plain.clone();
            for chain in [POSTROUTING, MASQ_CHAIN] {
                full.push(NftOp::DeleteChain {
                    family: fam,
                    table: TABLE.into(),
                    chain: chain.into(),
                });
            }
            full.push(NftOp::DeleteTable {
                family: fam,
                table: TABLE.into(),
            });
            attempts.push(full);
        }
        attempts.push(plain);
        for ops in &attempts {
            match nl.nft_apply(ops) {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
        }
    }
    Err(last.expect("one attempt at least").into())
}

/// Removes rules of `network` whose attachment is not in `valid`
/// (`(containerID, ifname)` pairs), as upstream's `gcIPMasqNFTables`.
pub(crate) fn gc(ns: &NetNs, network: &str, valid: &[(String, String)]) -> Result<(), Error> {
    let prefix = format!("{}-", names::nft_network_hash(network));
    let keep: HashSet<String> = valid
        .iter()
        .map(|(cid, ifname)| names::nft_comment(network, ifname, cid))
        .collect();
    remove_where(ns, |r| {
        r.comment
            .as_deref()
            .is_some_and(|c| c.starts_with(&prefix) && !keep.contains(c))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `nft -j list table inet cni_plugins_masquerade` (nft 1.0.6) after a
    /// dual-stack setup for network "mynet", eth0, container "ctr1".
    fn listing() -> String {
        let c = names::nft_comment("mynet", "eth0", "ctr1");
        format!(
            r#"{{"nftables": [{{"metainfo": {{"version": "1.0.6", "json_schema_version": 1}}}},
 {{"table": {{"family": "inet", "name": "cni_plugins_masquerade", "handle": 1}}}},
 {{"chain": {{"family": "inet", "table": "cni_plugins_masquerade", "name": "masq_checks", "handle": 1}}}},
 {{"chain": {{"family": "inet", "table": "cni_plugins_masquerade", "name": "postrouting", "handle": 2, "type": "nat", "hook": "postrouting", "prio": 100, "policy": "accept"}}}},
 {{"rule": {{"family": "inet", "table": "cni_plugins_masquerade", "chain": "masq_checks", "handle": 6, "comment": "{c}",
   "expr": [{{"match": {{"op": "==", "left": {{"payload": {{"protocol": "ip", "field": "saddr"}}}}, "right": "10.22.0.2"}}}},
            {{"match": {{"op": "!=", "left": {{"payload": {{"protocol": "ip", "field": "daddr"}}}}, "right": {{"prefix": {{"addr": "10.22.0.0", "len": 16}}}}}}}},
            {{"masquerade": null}}]}}}},
 {{"rule": {{"family": "inet", "table": "cni_plugins_masquerade", "chain": "masq_checks", "handle": 7, "comment": "{c}",
   "expr": [{{"match": {{"op": "==", "left": {{"payload": {{"protocol": "ip6", "field": "saddr"}}}}, "right": "fd00:22::2"}}}},
            {{"match": {{"op": "!=", "left": {{"payload": {{"protocol": "ip6", "field": "daddr"}}}}, "right": {{"prefix": {{"addr": "fd00:22::", "len": 64}}}}}}}},
            {{"masquerade": null}}]}}}},
 {{"rule": {{"family": "inet", "table": "cni_plugins_masquerade", "chain": "postrouting", "handle": 3,
   "expr": [{{"match": {{"op": "==", "left": {{"payload": {{"protocol": "ip", "field": "daddr"}}}}, "right": {{"prefix": {{"addr": "224.0.0.0", "len": 4}}}}}}}}, {{"return": null}}]}}}},
 {{"rule": {{"family": "inet", "table": "cni_plugins_masquerade", "chain": "postrouting", "handle": 4,
   "expr": [{{"match": {{"op": "==", "left": {{"payload": {{"protocol": "ip6", "field": "daddr"}}}}, "right": {{"prefix": {{"addr": "ff00::", "len": 8}}}}}}}}, {{"return": null}}]}}}},
 {{"rule": {{"family": "inet", "table": "cni_plugins_masquerade", "chain": "postrouting", "handle": 5,
   "expr": [{{"goto": {{"target": "masq_checks"}}}}]}}}}]}}"#
        )
    }

    fn ips() -> Vec<IpNetwork> {
        vec![
            "10.22.0.2/16".parse().unwrap(),
            "fd00:22::2/64".parse().unwrap(),
        ]
    }

    #[test]
    fn parses_and_checks_a_listing() {
        let l = parse_listing(&listing()).unwrap();
        assert_eq!(l.chains.len(), 2);
        assert_eq!(l.rules.len(), 5);
        assert_eq!(
            masq_rule(&l.rules[0]),
            Some((
                "10.22.0.2".parse().unwrap(),
                "10.22.0.0/16".parse().unwrap()
            ))
        );
        assert!(problems(Some(&l), "mynet", "eth0", "ctr1", &ips()).is_empty());
        // Another interface of the same container has no rules here.
        assert_eq!(problems(Some(&l), "mynet", "eth1", "ctr1", &ips()).len(), 2);
        assert_eq!(problems(None, "mynet", "eth0", "ctr1", &ips()).len(), 1);
        let mut broken = l.clone();
        broken.rules.retain(|r| r.handle != 5);
        assert_eq!(
            problems(Some(&broken), "mynet", "eth0", "ctr1", &ips()).len(),
            1
        );
    }

    #[test]
    fn setup_replaces_the_instance_rules() {
        let l = parse_listing(&listing()).unwrap();
        let s = setup_script(Some(&l), "mynet", "eth0", "ctr1", &ips()[..1]);
        assert!(s.contains("delete rule inet cni_plugins_masquerade masq_checks handle 6\n"));
        assert!(s.contains("delete rule inet cni_plugins_masquerade masq_checks handle 7\n"));
        let c = names::nft_comment("mynet", "eth0", "ctr1");
        assert!(s.ends_with(&format!(
            "add rule inet cni_plugins_masquerade masq_checks ip saddr == 10.22.0.2 ip daddr != 10.22.0.0/16 masquerade comment \"{c}\"\n"
        )));
        let other = setup_script(Some(&l), "mynet", "eth1", "ctr1", &ips());
        assert!(!other.contains("delete rule"));
    }

    #[test]
    fn removal_drops_the_table_with_the_last_rule() {
        let l = parse_listing(&listing()).unwrap();
        let all = removal_scripts(&l, &[6, 7]);
        assert_eq!(all.len(), 2);
        assert!(all[0].ends_with("delete table inet cni_plugins_masquerade\n"));
        assert!(!all[1].contains("delete table"));
        let some = removal_scripts(&l, &[6]);
        assert_eq!(some.len(), 1);
        assert!(removal_scripts(&l, &[]).is_empty());
    }
}
