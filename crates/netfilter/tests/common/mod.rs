//! Helpers shared by the kernel tests. Every command runs inside a
//! throwaway namespace: nothing here may touch the root namespace.

#![allow(dead_code)]

use ipnetwork::IpNetwork;
use rcni_testkit::TestNs;
use serde_json::Value;

pub fn ips(list: &[&str]) -> Vec<IpNetwork> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

/// Runs `program args` in `ns` and returns stdout; panics on failure.
pub fn sh(ns: &TestNs, program: &str, args: &[&str]) -> String {
    let out = ns.command(program).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The rule and user-chain lines of `iptables-save -t nat` (or ip6tables),
/// in the order printed.
pub fn nat_lines(ns: &TestNs, save: &str) -> Vec<String> {
    sh(ns, save, &["-t", "nat"])
        .lines()
        .filter(|l| l.starts_with("-A") || l.starts_with(":CNI-"))
        .map(String::from)
        .collect()
}

/// Every nft table in the namespace as `(family, name)`.
pub fn nft_tables(ns: &TestNs) -> Vec<(String, String)> {
    let v: Value = serde_json::from_str(&sh(ns, "nft", &["-j", "list", "tables"])).unwrap();
    v["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i.get("table"))
        .map(|t| {
            (
                t["family"].as_str().unwrap().to_string(),
                t["name"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Comments of the rules in our nft table's masq_checks chain.
pub fn nft_masq_comments(ns: &TestNs) -> Vec<String> {
    if !nft_tables(ns)
        .iter()
        .any(|(f, n)| f == "inet" && n == rcni_netfilter::NFT_TABLE)
    {
        return Vec::new();
    }
    let v: Value = serde_json::from_str(&sh(
        ns,
        "nft",
        &[
            "-j",
            "list",
            "chain",
            "inet",
            rcni_netfilter::NFT_TABLE,
            "masq_checks",
        ],
    ))
    .unwrap();
    v["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i.get("rule"))
        .map(|r| r["comment"].as_str().unwrap_or_default().to_string())
        .collect()
}
