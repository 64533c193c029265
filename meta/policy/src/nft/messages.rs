//! The steps of a [`plan`](super::model::plan) as the nfnetlink messages of
//! one transaction (encoders in `rcni_netfilter::nftset`).

use super::model::{Fin, Op, Rule, VMAPS, set_decl};
use rcni_netfilter::expr as nftexpr;
use rcni_netfilter::nftset::{Batch, DynKey, Elem, Exprs, INET, Key, SetDecl, Stateful};
use std::net::IpAddr;

/// `NF_INET_FORWARD`, priority `filter`.
const FORWARD: (rcni_netfilter::nftset::InetHook, i32) =
    (rcni_netfilter::nftset::InetHook::Forward, 0);

/// ICMPv6 neighbour solicitation and advertisement.
const ND_TYPES: [u8; 2] = [135, 136];

fn addrs(s: &str) -> Option<(IpAddr, IpAddr)> {
    match s.split_once('-') {
        Some((lo, hi)) => Some((lo.parse().ok()?, hi.parse().ok()?)),
        None => {
            let a = s.parse().ok()?;
            Some((a, a))
        }
    }
}

fn ports(s: &str) -> Option<(u16, u16)> {
    match s.split_once('-') {
        Some((lo, hi)) => Some((lo.parse().ok()?, hi.parse().ok()?)),
        None => {
            let p = s.parse().ok()?;
            Some((p, p))
        }
    }
}

/// An element as the model writes it (nft's syntax) in a set declared
/// `d`; `None` for text the model never makes.
fn elem(d: SetDecl, s: &str) -> Option<Elem> {
    if d.verdict_map {
        let (k, chain) = s.split_once(" : jump ")?;
        return Some(Elem::Jump(k.parse().ok()?, chain.to_string()));
    }
    match d.key {
        Key::Addr { .. } => {
            let (lo, hi) = addrs(s)?;
            Some(Elem::Addrs(lo, hi))
        }
        Key::AddrProtoPort { .. } => {
            let mut f = s.split(" . ");
            let (lo, hi) = addrs(f.next()?)?;
            let proto = f.next()?.parse().ok()?;
            let ports = ports(f.next()?)?;
            f.next().is_none().then_some(Elem::AddrsProtoPorts {
                lo,
                hi,
                proto,
                ports,
            })
        }
        // Filled by the rules alone.
        Key::Flow { .. } => None,
    }
}

fn elems(set: &str, v: &[String]) -> Result<(SetDecl, Vec<Elem>), String> {
    let d = set_decl(set).ok_or_else(|| format!("unknown set {set}"))?;
    let e = v
        .iter()
        .map(|s| elem(d, s).ok_or_else(|| format!("bad element {s:?} of set {set}")))
        .collect::<Result<_, _>>()?;
    Ok((d, e))
}

fn forward(b: &mut Batch) {
    b.add_chain("forward", Some(FORWARD));
    // In FORWARD_RULES' order.
    let mut e = Exprs::new();
    e.nftexpr(&nftexpr::ct_established())
        .nftexpr(&nftexpr::accept());
    b.add_rule("forward", e, None);
    let mut e = b.icmpv6_types(&ND_TYPES);
    e.nftexpr(&nftexpr::accept());
    b.add_rule("forward", e, None);
    for (v6, src, map) in [
        (false, true, VMAPS[0]),
        (true, true, VMAPS[1]),
        (false, false, VMAPS[2]),
        (true, false, VMAPS[3]),
    ] {
        let mut e = Exprs::new();
        e.vmap(v6, src, map);
        b.add_rule("forward", e, None);
    }
}

fn rule(b: &mut Batch, chain: &str, r: &Rule) {
    let mut e = Exprs::new();
    match r {
        Rule::Allow {
            v6,
            src,
            ports,
            set,
            goto,
        } => {
            e.in_set(*v6, *src, *ports, set);
            match goto {
                Some(c) => e.goto(c),
                None => e.ret(),
            };
            b.add_rule(chain, e, None);
        }
        Rule::Seen { v6, set, fin } => {
            e.lookup(DynKey::Flow { v6: *v6 }, set);
            end(&mut e, *fin);
            b.add_rule(chain, e, None);
        }
        Rule::Report {
            v6,
            seen,
            prefix,
            group,
            fin,
        } => {
            e.add(DynKey::Flow { v6: *v6 }, seen).log(prefix, *group);
            end(&mut e, *fin);
            b.add_rule(chain, e, None);
        }
        Rule::Over {
            v6,
            src,
            rl,
            sup,
            rate,
            fin,
        } => {
            let k = DynKey::Addr { v6: *v6, src: *src };
            e.update(
                k,
                rl,
                Stateful::LimitOver {
                    rate: u64::from(*rate),
                    unit_secs: 1,
                    burst: *rate,
                },
            )
            .update(k, sup, Stateful::Counter);
            end(&mut e, *fin);
            b.add_rule(chain, e, None);
        }
        Rule::End { log, fin, comment } => {
            if let Some((prefix, group)) = log {
                e.log(prefix, *group);
            }
            end(&mut e, *fin);
            b.add_rule(chain, e, comment.as_deref());
        }
    }
}

fn end(e: &mut Exprs, fin: Fin) {
    match fin {
        Fin::Drop => e.drop(),
        Fin::Return => e.ret(),
    };
}

/// The transaction doing `ops` on `table`.
pub(super) fn batch(table: &str, ops: &[Op]) -> Result<Batch, String> {
    let mut b = Batch::new(INET, table);
    for op in ops {
        match op {
            Op::AddTable => b.add_table(),
            Op::DeleteTable => b.delete_table(),
            Op::AddSet(name) => {
                let d = set_decl(name).ok_or_else(|| format!("unknown set {name}"))?;
                b.add_set(name, d);
            }
            Op::AddChain(name) => b.add_chain(name, None),
            Op::AddForward => forward(&mut b),
            Op::AddElements(set, v) => {
                let (d, e) = elems(set, v)?;
                b.add_elements(set, d, &e);
            }
            Op::DeleteElements(set, v) => {
                let (_, e) = elems(set, v)?;
                b.delete_elements(set, &e);
            }
            Op::FlushSet(set) => b.flush_set(set),
            Op::DeleteSet(set) => b.delete_set(set),
            Op::AddRules(chain, rules) => {
                for r in rules {
                    rule(&mut b, chain, r);
                }
            }
            Op::FlushChain(chain) => b.flush_chain(chain),
            Op::DeleteChain(chain) => b.delete_chain(chain),
        }
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_elements_parse() {
        let d = |n| set_decl(n).unwrap();
        assert_eq!(
            elem(d("to_pod4"), "10.0.0.2 : jump in_3"),
            Some(Elem::Jump("10.0.0.2".parse().unwrap(), "in_3".into()))
        );
        assert_eq!(
            elem(d("in_3_net6"), "fd00::-fd00::ff"),
            Some(Elem::Addrs(
                "fd00::".parse().unwrap(),
                "fd00::ff".parse().unwrap()
            ))
        );
        assert_eq!(
            elem(d("in_3_net4p"), "192.168.0.0-192.168.0.255 . 6 . 8000-8080"),
            Some(Elem::AddrsProtoPorts {
                lo: "192.168.0.0".parse().unwrap(),
                hi: "192.168.0.255".parse().unwrap(),
                proto: 6,
                ports: (8000, 8080)
            })
        );
        assert_eq!(elem(d("in_3_pod4p"), "10.0.0.3 . 17"), None);
    }
}
