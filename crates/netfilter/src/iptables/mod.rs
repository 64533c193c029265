//! iptables through its tools, for every plugin that keeps iptables rules
//! (ipMasq, portmap, firewall): `iptables-save` read into [`SaveTable`]
//! (the lines we look at, parsed), and changes written with one
//! `iptables-restore --noflush` per family and call (the reference runs one
//! `iptables` process per rule and check). Rules are written in the exact
//! text `iptables-save` prints, so what we write and what we read compare
//! as strings where that is simplest.

mod probe_cache;

use crate::Error;
use crate::exec;
use crate::nfnl::{Nfnl, NftFamily};
use ipnetwork::IpNetwork;
use rcni_netns::NetNs;
use std::collections::BTreeSet;
use std::net::IpAddr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub const BOTH: [Family; 2] = [Family::V4, Family::V6];

    pub fn of(ip: &IpAddr) -> Family {
        if ip.is_ipv4() { Family::V4 } else { Family::V6 }
    }

    fn save_tool(self) -> &'static str {
        match self {
            Family::V4 => "iptables-save",
            Family::V6 => "ip6tables-save",
        }
    }

    fn restore_tool(self) -> &'static str {
        match self {
            Family::V4 => "iptables-restore",
            Family::V6 => "ip6tables-restore",
        }
    }

    pub fn iptables_tool(self) -> &'static str {
        match self {
            Family::V4 => "iptables",
            Family::V6 => "ip6tables",
        }
    }

    /// Multicast is never masqueraded, so pods can use it on the local
    /// network.
    pub(crate) fn multicast(self) -> &'static str {
        match self {
            Family::V4 => "224.0.0.0/4",
            Family::V6 => "ff00::/8",
        }
    }
}

/// One `-A` line of `iptables-save`, with the parts we look at.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rule {
    pub chain: String,
    /// `(negated, value)` of `-s`.
    pub src: Option<(bool, String)>,
    /// `(negated, value)` of `-d`.
    pub dst: Option<(bool, String)>,
    pub comment: Option<String>,
    pub target: Option<String>,
    /// Any other match or option: such a rule is not one of ours.
    pub other: bool,
    /// The line as printed, for deleting it (`-A` becomes `-D`).
    pub raw: String,
}

impl Rule {
    pub(crate) fn src_net(&self) -> Option<IpNetwork> {
        match &self.src {
            Some((false, s)) => s.parse().ok(),
            _ => None,
        }
    }

    pub(crate) fn dst_net(&self, negated: bool) -> Option<IpNetwork> {
        match &self.dst {
            Some((n, s)) if *n == negated => s.parse().ok(),
            _ => None,
        }
    }

    /// The `iptables-restore` line that deletes this rule.
    pub fn delete_line(&self) -> String {
        match self.raw.strip_prefix("-A ") {
            Some(rest) => format!("-D {rest}"),
            None => self.raw.clone(),
        }
    }
}

/// The nat table as `iptables-save -t nat` prints it.
#[derive(Debug, Clone, Default)]
pub struct SaveTable {
    /// Every chain declared (`:NAME POLICY [p:b]`), built-in ones included.
    pub chains: Vec<String>,
    pub rules: Vec<Rule>,
}

impl SaveTable {
    pub fn has_chain(&self, chain: &str) -> bool {
        self.chains.iter().any(|c| c == chain)
    }

    pub fn rules_in<'a>(&'a self, chain: &'a str) -> impl Iterator<Item = &'a Rule> + 'a {
        self.rules.iter().filter(move |r| r.chain == chain)
    }

    /// Rules elsewhere that jump to `chain`.
    pub fn references<'a>(&'a self, chain: &'a str) -> impl Iterator<Item = &'a Rule> + 'a {
        self.rules
            .iter()
            .filter(move |r| r.chain != chain && r.target.as_deref() == Some(chain))
    }
}

/// Splits an `iptables-save` line into words: double quotes group, and a
/// backslash escapes the next character inside them (how comments are
/// printed).
pub fn tokenize(line: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\\') => match chars.next() {
                            Some(e) => cur.push(e),
                            None => return Err(format!("dangling escape in {line:?}")),
                        },
                        Some('"') => break,
                        Some(c) => cur.push(c),
                        None => return Err(format!("unterminated quote in {line:?}")),
                    }
                }
            }
            c if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        out.push(cur);
    }
    Ok(out)
}

/// Parses `iptables-save -t nat` output.
pub fn parse_save(text: &str) -> Result<SaveTable, String> {
    parse_save_table(text, "nat")
}

/// Parses the part of `iptables-save` output that lists `table`.
pub fn parse_save_table(text: &str, table: &str) -> Result<SaveTable, String> {
    let mut t = SaveTable::default();
    let mut in_nat = false;
    for line in text.lines() {
        let line = line.trim_end();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(name) = line.strip_prefix('*') {
            in_nat = name == table;
            continue;
        }
        if !in_nat || line == "COMMIT" {
            continue;
        }
        if let Some(decl) = line.strip_prefix(':') {
            if let Some(name) = decl.split_whitespace().next() {
                t.chains.push(name.to_string());
            }
            continue;
        }
        if !line.starts_with("-A ") {
            continue;
        }
        let words = tokenize(line)?;
        let mut rule = Rule {
            raw: line.to_string(),
            ..Rule::default()
        };
        let mut negate = false;
        let mut i = 0;
        let value = |i: &mut usize| -> Result<String, String> {
            *i += 1;
            words
                .get(*i)
                .cloned()
                .ok_or_else(|| format!("option without value in {line:?}"))
        };
        while i < words.len() {
            match words[i].as_str() {
                "-A" => rule.chain = value(&mut i)?,
                "!" => {
                    negate = true;
                    i += 1;
                    continue;
                }
                "-s" | "--source" => rule.src = Some((negate, value(&mut i)?)),
                "-d" | "--destination" => rule.dst = Some((negate, value(&mut i)?)),
                "-j" | "--jump" => rule.target = Some(value(&mut i)?),
                "-m" | "--match" => {
                    if value(&mut i)? != "comment" {
                        rule.other = true;
                    }
                }
                "--comment" => rule.comment = Some(value(&mut i)?),
                _ => rule.other = true,
            }
            negate = false;
            i += 1;
        }
        t.rules.push(rule);
    }
    Ok(t)
}

/// The input that removes `chains` entirely: every rule jumping to them
/// (whatever its source: older reference versions used `-s <ip>/<prefix>`),
/// then the chains. `None` when none of them exists.
pub fn removal_script(t: &SaveTable, chains: &BTreeSet<String>) -> Option<String> {
    let mut body = String::new();
    for chain in chains {
        for r in t.references(chain) {
            body.push_str(&r.delete_line());
            body.push('\n');
        }
    }
    for chain in chains {
        if t.has_chain(chain) {
            body.push_str(&format!("-F {chain}\n-X {chain}\n"));
        }
    }
    if body.is_empty() {
        None
    } else {
        Some(format!("*nat\n{body}COMMIT\n"))
    }
}

/// Reads the nat table of `fam` in `ns`.
pub fn read(ns: &NetNs, fam: Family) -> Result<SaveTable, Error> {
    read_table(ns, fam, "nat")
}

/// Reads `table` (nat, filter, ...) of `fam` in `ns`.
pub fn read_table(ns: &NetNs, fam: Family, table: &str) -> Result<SaveTable, Error> {
    let tool = fam.save_tool();
    let out = exec::run_ok(ns, tool, &["-t", table], None)?;
    parse_save_table(&out, table).map_err(|msg| Error::Parse { tool, msg })
}

/// Reads `table` of `fam`, lets `script` decide the restore input from
/// what is there (`None`: nothing to change) and applies it: one read and
/// at most one write.
pub fn edit(
    ns: &NetNs,
    fam: Family,
    table: &str,
    script: impl FnOnce(&SaveTable) -> Option<String>,
) -> Result<(), Error> {
    let t = read_table(ns, fam, table)?;
    match script(&t) {
        Some(s) if !s.is_empty() => apply(ns, fam, &s),
        _ => Ok(()),
    }
}

/// Applies a script with one `iptables-restore --noflush` (waiting for the
/// xtables lock like the reference's `iptables --wait`).
pub fn apply(ns: &NetNs, fam: Family, script: &str) -> Result<(), Error> {
    exec::run_ok(ns, fam.restore_tool(), &["-w", "--noflush"], Some(script)).map(|_| ())
}

/// Whether iptables of this family works in `ns` at all, with the
/// reference's probe (`SupportsIPTables`: can the filter INPUT chain be
/// listed). Teardown and GC ignore errors of a backend that cannot work.
///
/// The answer is kept for the boot in [`probe_cache`] (the probe is a
/// process that lists a table, a millisecond or more of every ADD that
/// takes the default backend): it depends on the tool and the kernel, not
/// on the namespace, and the key names the tool's resolved file, so
/// installing, removing or switching iptables (alternatives) asks again.
/// Only a working iptables is kept.
pub fn supported(ns: &NetNs, fam: Family) -> bool {
    let Some(tool) = exec::find_tool(fam.iptables_tool()) else {
        return false;
    };
    let cache = probe_cache::Cache::new(fam.iptables_tool(), &tool);
    if cache.as_ref().is_some_and(probe_cache::Cache::works) {
        return true;
    }
    let works = probe(ns, fam);
    // Only a working iptables is kept: a failure may be passing (a module
    // still loading), and one kept would move the default backend to
    // nftables for the whole boot.
    if works && let Some(c) = cache {
        c.put_works();
    }
    works
}

fn probe(ns: &NetNs, fam: Family) -> bool {
    match exec::run(
        ns,
        fam.iptables_tool(),
        &["-w", "-t", "filter", "-n", "-L", "INPUT"],
        None,
    ) {
        // go-iptables' ChainExists: exit 1 means "no such chain", still a
        // working iptables.
        Ok(out) => out.success || out.code == Some(1),
        Err(_) => false,
    }
}

/// Whether iptables' `filter FORWARD` of `fam` drops what it does not
/// accept (policy DROP, as Docker sets, or an unconditional DROP/REJECT
/// last), where the iptables tool is there to write an accept. Such a chain
/// is a base chain of its own at the forward hook, and a packet dropped by
/// any base chain is dropped: no nftables accept of ours can pass it.
/// iptables-nft keeps the chain in the nftables table `ip filter` (`ip6
/// filter`), read over `nl` without a process; legacy iptables (x_tables)
/// only with `iptables-legacy -S`, run only where the legacy `filter` table
/// exists in the namespace.
pub fn forward_drops(ns: &NetNs, nl: &mut Nfnl, fam: Family) -> Result<bool, Error> {
    let family = match fam {
        Family::V4 => NftFamily::Ip,
        Family::V6 => NftFamily::Ip6,
    };
    let drops = nl.nft_chain_drops(family, "filter", "FORWARD")? || legacy_forward_drops(ns, fam);
    Ok(drops && exec::find_tool(fam.iptables_tool()).is_some())
}

/// Legacy iptables' `filter FORWARD` drops (false when it cannot tell).
fn legacy_forward_drops(ns: &NetNs, fam: Family) -> bool {
    let (names, legacy) = match fam {
        Family::V4 => ("ip_tables_names", "iptables-legacy"),
        Family::V6 => ("ip6_tables_names", "ip6tables-legacy"),
    };
    // x_tables creates a namespace's tables on their first use: no
    // `filter` there, no legacy FORWARD chain.
    let in_use = ns
        .run(|| std::fs::read_to_string(format!("/proc/thread-self/net/{names}")))
        .ok()
        .and_then(Result::ok)
        .is_some_and(|s| s.lines().any(|l| l == "filter"));
    if !in_use {
        return false;
    }
    // Where `iptables` is iptables-nft, only the legacy tool sees x_tables.
    let tool = if exec::find_tool(legacy).is_some() {
        legacy
    } else {
        fam.iptables_tool()
    };
    exec::run(ns, tool, &["-w", "-S", "FORWARD"], None)
        .is_ok_and(|o| o.success && save_drops(&o.stdout))
}

/// Whether `iptables -S FORWARD` shows a chain that drops what it does not
/// accept: policy DROP, or an unconditional DROP or REJECT last.
fn save_drops(s: &str) -> bool {
    let mut last = None;
    for l in s.lines() {
        let w: Vec<&str> = l.split_whitespace().collect();
        match w.as_slice() {
            ["-P", "FORWARD", "DROP"] => return true,
            ["-A", "FORWARD", rest @ ..] => last = Some(rest.to_vec()),
            _ => {}
        }
    }
    matches!(
        last.as_deref(),
        Some(["-j", "DROP"]) | Some(["-j", "REJECT", ..])
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer() {
        assert_eq!(
            tokenize(r#"-A X -m comment --comment "a \"b\" c" -j Y"#).unwrap(),
            [
                "-A",
                "X",
                "-m",
                "comment",
                "--comment",
                r#"a "b" c"#,
                "-j",
                "Y"
            ]
        );
        assert_eq!(tokenize(r#"--comment """#).unwrap(), ["--comment", ""]);
        assert!(tokenize(r#"--comment "open"#).is_err());
        let t = parse_save("*nat\n-A POSTROUTING -o eth0 -j MASQUERADE\nCOMMIT\n").unwrap();
        assert!(t.rules[0].other);
    }

    #[test]
    fn forward_chain_that_drops() {
        assert!(save_drops("-P FORWARD DROP\n-A FORWARD -j DOCKER-USER\n"));
        assert!(!save_drops(
            "-P FORWARD ACCEPT\n-A FORWARD -j DOCKER-USER\n"
        ));
        assert!(save_drops(
            "-P FORWARD ACCEPT\n-A FORWARD -i x -j ACCEPT\n-A FORWARD -j DROP\n"
        ));
        assert!(save_drops(
            "-P FORWARD ACCEPT\n-A FORWARD -j REJECT --reject-with icmp-port-unreachable\n"
        ));
        assert!(!save_drops(
            "-P FORWARD ACCEPT\n-A FORWARD -j DROP\n-A FORWARD -i x -j ACCEPT\n"
        ));
        assert!(!save_drops(
            "-P FORWARD ACCEPT\n-A FORWARD -s 10.0.0.0/8 -j DROP\n"
        ));
        assert!(!save_drops(""));
    }
}
