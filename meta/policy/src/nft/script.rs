//! The same steps as `nft` text: what this backend wrote with `nft -f -`
//! before it wrote over nfnetlink. Kept for the tests: the planning tests
//! read it, and the golden test writes one model both ways and compares
//! what the kernel lists.

use super::model::{FORWARD_HOOK, FORWARD_RULES, Op, set_decl};
use rcni_netfilter::nftset::Key;
use std::fmt::Write as _;

/// Elements per `add element` command: keeps lines (and nft's error
/// excerpts) short on big sets.
const ELEMENTS_PER_LINE: usize = 256;

fn decl(name: &str) -> String {
    let d = set_decl(name).expect("names come from Model::build");
    let (v6, concat) = match d.key {
        Key::Addr { v6 } => (v6, false),
        Key::AddrProtoPort { v6 } => (v6, true),
        Key::Flow { v6 } => {
            let a = if v6 { "ipv6_addr" } else { "ipv4_addr" };
            return format!(
                "set inet {{}} {name} {{ type {a} . {a} . inet_proto . inet_service . inet_service; size 65535; flags dynamic,timeout; timeout {}s; }}",
                d.timeout_ms / 1000
            );
        }
    };
    let addr = if v6 { "ipv6_addr" } else { "ipv4_addr" };
    if d.verdict_map {
        return format!("map inet {{}} {name} {{ type {addr} : verdict; }}");
    }
    let ty = if concat {
        format!("{addr} . inet_proto . inet_service")
    } else {
        addr.to_string()
    };
    if d.timeout_ms > 0 {
        return format!(
            "set inet {{}} {name} {{ type {addr}; size 65535; flags dynamic,timeout; timeout {}s; }}",
            d.timeout_ms / 1000
        );
    }
    let flags = if d.interval { " flags interval;" } else { "" };
    format!("set inet {{}} {name} {{ type {ty};{flags} }}")
}

fn elements(s: &mut String, verb: &str, table: &str, set: &str, elems: &[String]) {
    for chunk in elems.chunks(ELEMENTS_PER_LINE) {
        let _ = writeln!(
            s,
            "{verb} element inet {table} {set} {{ {} }}",
            chunk.join(", ")
        );
    }
}

/// The nft script doing `ops` on `table`.
pub(super) fn render(table: &str, ops: &[Op]) -> String {
    let mut s = String::new();
    for op in ops {
        match op {
            Op::AddTable => {
                let _ = writeln!(s, "add table inet {table}");
            }
            Op::DeleteTable => {
                let _ = writeln!(s, "delete table inet {table}");
            }
            Op::AddSet(name) => {
                let _ = writeln!(s, "add {}", decl(name).replacen("{}", table, 1));
            }
            Op::AddChain(name) => {
                let _ = writeln!(s, "add chain inet {table} {name}");
            }
            Op::AddForward => {
                let _ = writeln!(s, "add chain inet {table} forward {{ {FORWARD_HOOK} }}");
                for r in FORWARD_RULES {
                    let _ = writeln!(s, "add rule inet {table} forward {r}");
                }
            }
            Op::AddElements(set, elems) => elements(&mut s, "add", table, set, elems),
            Op::DeleteElements(set, elems) => {
                // A map element is deleted by its key alone.
                let keys: Vec<String> = elems
                    .iter()
                    .map(|e| {
                        e.split_once(" : ")
                            .map_or(e.as_str(), |(k, _)| k)
                            .to_string()
                    })
                    .collect();
                elements(&mut s, "delete", table, set, &keys);
            }
            Op::FlushSet(set) => {
                let _ = writeln!(s, "flush set inet {table} {set}");
            }
            Op::DeleteSet(set) => {
                let kw = if set_decl(set).is_some_and(|d| d.verdict_map) {
                    "map"
                } else {
                    "set"
                };
                let _ = writeln!(s, "delete {kw} inet {table} {set}");
            }
            Op::AddRules(chain, rules) => {
                for r in rules {
                    let _ = writeln!(s, "add rule inet {table} {chain} {r}");
                }
            }
            Op::FlushChain(chain) => {
                let _ = writeln!(s, "flush chain inet {table} {chain}");
            }
            Op::DeleteChain(chain) => {
                let _ = writeln!(s, "delete chain inet {table} {chain}");
            }
        }
    }
    s
}
