//! Forwarding of the cluster network through an iptables `filter FORWARD`
//! that drops (Docker sets its policy DROP on every host it runs on). Pod
//! traffic between nodes, and between pods of one node where br_netfilter
//! hands bridged traffic to iptables, is forwarded by the node, and a packet
//! dropped by any base chain at the forward hook is dropped: nothing in our
//! nftables tables can let it through. flannel (the anchor) adds
//! `FLANNEL-FWD` with `-s <network> -j ACCEPT` and `-d <network> -j ACCEPT`
//! jumped from FORWARD; the agent does the same in `RCNI-FWD`, but only where
//! FORWARD drops (elsewhere it writes no iptables rule and runs no iptables
//! process), reading that over nfnetlink on every reconcile so a Docker
//! started after the agent is noticed at the next resync.
//!
//! The accepts stay when FORWARD stops dropping: they accept what would be
//! accepted anyway.

use ipnetwork::IpNetwork;
use rcni_netfilter::iptables::{self, Family, Rule, SaveTable};
use rcni_netfilter::nfnl::Nfnl;
use rcni_netns::NetNs;

pub const CHAIN: &str = "RCNI-FWD";
const COMMENT: &str = "rcni-node: cluster network forwarded";

/// Makes FORWARD accept `networks` (one per family at most) where iptables'
/// FORWARD drops. Returns what it changed, for the agent's log.
pub fn ensure(ns: &NetNs, networks: &[IpNetwork]) -> Result<Vec<String>, rcni_netfilter::Error> {
    let mut nl = Nfnl::open(ns)?;
    let mut log = Vec::new();
    for net in networks {
        let fam = match net {
            IpNetwork::V4(_) => Family::V4,
            IpNetwork::V6(_) => Family::V6,
        };
        if !iptables::forward_drops(ns, &mut nl, fam)? {
            continue;
        }
        let mut changed = false;
        iptables::edit(ns, fam, "filter", |t| {
            let s = script(t, *net);
            changed = s.is_some();
            s
        })?;
        if changed {
            log.push(format!(
                "forward: {} accepts {net} (its FORWARD drops)",
                fam.iptables_tool()
            ));
        }
    }
    Ok(log)
}

fn ours(r: &Rule, net: IpNetwork, src: bool) -> bool {
    let side = Some((false, net.to_string()));
    let (s, d) = if src { (side, None) } else { (None, side) };
    r.src == s
        && r.dst == d
        && r.comment.as_deref() == Some(COMMENT)
        && r.target.as_deref() == Some("ACCEPT")
        && !r.other
}

/// Unconditional DROP or REJECT.
fn final_drop(r: &Rule) -> bool {
    r.src.is_none()
        && r.dst.is_none()
        && match r.target.as_deref() {
            Some("DROP") => !r.other,
            // REJECT carries `--reject-with`, which the parser counts as
            // another option.
            Some("REJECT") => true,
            _ => false,
        }
}

/// The `iptables-restore --noflush` input that makes the filter table hold
/// the chain with exactly the two accepts and one jump to it from FORWARD
/// before any final drop; `None` when it does already.
fn script(t: &SaveTable, net: IpNetwork) -> Option<String> {
    let chain: Vec<&Rule> = t.rules_in(CHAIN).collect();
    let chain_ok = chain.len() == 2 && ours(chain[0], net, true) && ours(chain[1], net, false);
    let forward: Vec<&Rule> = t.rules_in("FORWARD").collect();
    let jumps: Vec<usize> = forward
        .iter()
        .enumerate()
        .filter(|(_, r)| r.target.as_deref() == Some(CHAIN))
        .map(|(i, _)| i)
        .collect();
    let last_drop = forward.iter().rposition(|r| final_drop(r));
    let jump_ok = matches!(jumps.as_slice(), [j] if last_drop.is_none_or(|d| *j < d));
    if chain_ok && jump_ok {
        return None;
    }
    let mut s = String::from("*filter\n");
    // With --noflush, declaring a chain that exists flushes it: the chain is
    // rewritten in the same commit, never seen half-filled.
    s.push_str(&format!(":{CHAIN} - [0:0]\n"));
    s.push_str(&format!(
        "-A {CHAIN} -s {net} -m comment --comment \"{COMMENT}\" -j ACCEPT\n"
    ));
    s.push_str(&format!(
        "-A {CHAIN} -d {net} -m comment --comment \"{COMMENT}\" -j ACCEPT\n"
    ));
    if !jump_ok {
        for j in &jumps {
            s.push_str(&forward[*j].delete_line());
            s.push('\n');
        }
        let jump = format!("-m comment --comment \"{COMMENT}\" -j {CHAIN}");
        // Before a final drop (its position once our jumps are gone), else
        // last, as flannel appends: the admin's and Docker's own rules
        // (DOCKER-USER first) still decide before ours.
        match last_drop {
            Some(d) => {
                let pos = d + 1 - jumps.iter().filter(|j| **j < d).count();
                s.push_str(&format!("-I FORWARD {pos} {jump}\n"));
            }
            None => s.push_str(&format!("-A FORWARD {jump}\n")),
        }
    }
    s.push_str("COMMIT\n");
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> SaveTable {
        iptables::parse_save_table(&format!("*filter\n{text}COMMIT\n"), "filter").unwrap()
    }

    const NET: &str = "10.244.0.0/16";

    fn applied(before: &str) -> String {
        let net: IpNetwork = NET.parse().unwrap();
        script(&table(before), net).unwrap()
    }

    #[test]
    fn a_dropping_forward_gets_the_chain_and_one_jump() {
        let s = applied(":FORWARD DROP [0:0]\n-A FORWARD -j DOCKER-USER\n");
        assert!(s.contains(&format!("-A RCNI-FWD -s {NET} ")), "{s}");
        assert!(s.contains(&format!("-A RCNI-FWD -d {NET} ")), "{s}");
        assert!(s.contains("-A FORWARD -m comment"), "{s}");
        // A final DROP: the jump goes before it.
        let s = applied(
            ":FORWARD ACCEPT [0:0]\n-A FORWARD -i x -j ACCEPT\n-A FORWARD -j REJECT --reject-with icmp-port-unreachable\n",
        );
        assert!(s.contains("-I FORWARD 2 -m comment"), "{s}");
    }

    #[test]
    fn what_is_in_place_is_left_and_a_jump_behind_a_drop_moves() {
        let good = format!(
            ":FORWARD DROP [0:0]\n:RCNI-FWD - [0:0]\n-A FORWARD -j DOCKER-USER\n\
             -A FORWARD -m comment --comment \"{COMMENT}\" -j RCNI-FWD\n\
             -A RCNI-FWD -s {NET} -m comment --comment \"{COMMENT}\" -j ACCEPT\n\
             -A RCNI-FWD -d {NET} -m comment --comment \"{COMMENT}\" -j ACCEPT\n"
        );
        assert!(script(&table(&good), NET.parse().unwrap()).is_none());
        // Another network: the chain is rewritten, the jump kept.
        let s = script(&table(&good), "10.245.0.0/16".parse().unwrap()).unwrap();
        assert!(s.contains("-A RCNI-FWD -s 10.245.0.0/16"), "{s}");
        assert!(!s.contains("FORWARD -m"), "{s}");
        // A DROP appended after our jump is fine; our jump after a DROP is
        // moved before it.
        let behind = format!(
            ":FORWARD ACCEPT [0:0]\n:RCNI-FWD - [0:0]\n-A FORWARD -j DROP\n\
             -A FORWARD -m comment --comment \"{COMMENT}\" -j RCNI-FWD\n\
             -A RCNI-FWD -s {NET} -m comment --comment \"{COMMENT}\" -j ACCEPT\n\
             -A RCNI-FWD -d {NET} -m comment --comment \"{COMMENT}\" -j ACCEPT\n"
        );
        let s = script(&table(&behind), NET.parse().unwrap()).unwrap();
        assert!(s.contains("-D FORWARD -m comment"), "{s}");
        assert!(s.contains("-I FORWARD 1 -m comment"), "{s}");
    }
}
