//! macspoofchk: frames entering the bridge from a pod's port must carry the
//! pod's MAC. Same nftables layout as upstream (bridge table `nat`, base
//! chain PREROUTING at priority -300, per-attachment chains
//! `cni-br-iface-<cid>-<ifname>[-mac]`, rules commented
//! `macspoofchk-<cid>-<ifname>`), so either suite removes the other's rules.
//! Each change is one nf_tables transaction over nfnetlink.

use rcni_cni::{CniError, ErrorCode};
use rcni_netfilter::expr::{self, Expr, Term};
use rcni_netfilter::nfnl::{Hook, Nfnl, NftFamily, NftOp, NftRule};
use rcni_netlink::MacAddr;
use rcni_netns::NetNs;

const TABLE: &str = "nat";
const PREROUTING: &str = "PREROUTING";
const FAMILY: NftFamily = NftFamily::Bridge;

fn nft_err(e: impl std::fmt::Display) -> CniError {
    CniError::new(ErrorCode::Netfilter, format!("macspoofchk: {e}"))
}

fn open(ns: &NetNs) -> Result<Nfnl, CniError> {
    Nfnl::open(ns).map_err(nft_err)
}

/// One attachment's macspoofchk rules, by its names: its two chains and
/// the rules' comment.
pub struct Spoofchk {
    chain: String,
    mac_chain: String,
    comment: String,
}

impl Spoofchk {
    pub fn of(container_id: &str, ifname: &str) -> Spoofchk {
        let id = format!("{container_id}-{ifname}");
        Spoofchk {
            chain: format!("cni-br-iface-{id}"),
            mac_chain: format!("cni-br-iface-{id}-mac"),
            comment: format!("macspoofchk-{id}"),
        }
    }

    fn commented(&self, r: &NftRule) -> bool {
        r.comment.as_deref() == Some(self.comment.as_str())
    }

    /// The attachment's rules as upstream writes them: `(chain, expressions)`.
    fn rules(&self, host_veth: &str, mac: MacAddr) -> [(&str, Vec<Expr>); 4] {
        [
            (
                PREROUTING,
                [expr::ifname(true, host_veth, true), expr::jump(&self.chain)].concat(),
            ),
            (&self.chain, expr::jump(&self.mac_chain)),
            (
                &self.mac_chain,
                [expr::ether_saddr(mac.0), expr::ret()].concat(),
            ),
            (&self.mac_chain, expr::drop()),
        ]
    }

    /// Writes the rules for frames from `host_veth`, which must carry `mac`.
    pub fn setup(&self, ns: &NetNs, host_veth: &str, mac: MacAddr) -> Result<(), CniError> {
        let chain = |name: &str, hook| NftOp::AddChain {
            family: FAMILY,
            table: TABLE.into(),
            chain: name.into(),
            hook,
            comment: None,
        };
        let flush = |name: &str| NftOp::FlushChain {
            family: FAMILY,
            table: TABLE.into(),
            chain: name.into(),
        };
        let mut ops = vec![
            NftOp::AddTable {
                family: FAMILY,
                table: TABLE.into(),
                comment: None,
            },
            // A base chain's policy is accept unless set otherwise, as
            // upstream's `policy accept` asks.
            chain(
                PREROUTING,
                Some(Hook {
                    kind: "filter",
                    hook: Hook::PREROUTING,
                    priority: -300,
                }),
            ),
            chain(&self.chain, None),
            chain(&self.mac_chain, None),
            flush(&self.chain),
            flush(&self.mac_chain),
        ];
        for (chain, e) in self.rules(host_veth, mac) {
            ops.push(NftOp::AddRule {
                family: FAMILY,
                table: TABLE.into(),
                chain: chain.into(),
                expr: e,
                comment: Some(self.comment.clone()),
                insert: false,
            });
        }
        open(ns)?.nft_apply(&ops).map_err(nft_err)
    }

    /// Removes the attachment's rules and chains; missing pieces are fine. A
    /// piece removed by someone else between the listing and the write fails
    /// the transaction atomically: listing again and retrying once settles it.
    pub fn teardown(&self, ns: &NetNs) -> Result<(), CniError> {
        let mut nl = open(ns)?;
        let mut last = None;
        for _ in 0..2 {
            let Some(chains) = nl.nft_chains(FAMILY, TABLE).map_err(nft_err)? else {
                return Ok(());
            };
            let rules = nl
                .nft_rules(FAMILY, TABLE)
                .map_err(nft_err)?
                .unwrap_or_default();
            let mut ops: Vec<NftOp> = rules
                .iter()
                .filter(|r| r.chain == PREROUTING && self.commented(r))
                .map(|r| NftOp::DeleteRule {
                    family: FAMILY,
                    table: TABLE.into(),
                    chain: PREROUTING.into(),
                    handle: r.handle,
                })
                .collect();
            // The chain first: its jump is what keeps the -mac chain in use.
            for chain in [&self.chain, &self.mac_chain] {
                if chains.iter().any(|c| &c.name == chain) {
                    ops.extend([
                        NftOp::FlushChain {
                            family: FAMILY,
                            table: TABLE.into(),
                            chain: chain.clone(),
                        },
                        NftOp::DeleteChain {
                            family: FAMILY,
                            table: TABLE.into(),
                            chain: chain.clone(),
                        },
                    ]);
                }
            }
            match nl.nft_apply(&ops) {
                Ok(()) => return Ok(()),
                Err(e) if e.is_not_found() => last = Some(e),
                Err(e) => return Err(nft_err(e)),
            }
        }
        Err(nft_err(last.expect("one attempt at least")))
    }

    /// Whether the attachment's rules are in place, as [`setup`] writes them
    /// for `host_veth` and `mac` (the PREROUTING rule among others).
    pub fn check(&self, ns: &NetNs, host_veth: &str, mac: MacAddr) -> Result<(), CniError> {
        let listed = open(ns)?
            .nft_rules(FAMILY, TABLE)
            .map_err(nft_err)?
            .unwrap_or_default();
        let ours = |chain: &str| -> Vec<&[Term]> {
            listed
                .iter()
                .filter(|r| r.chain == chain && self.commented(r))
                .map(|r| r.terms.as_slice())
                .collect()
        };
        let want = self.rules(host_veth, mac);
        let entry = ours(PREROUTING).contains(&expr::terms_of(&want[0].1).as_slice());
        let chain: Vec<Vec<Term>> = vec![expr::terms_of(&want[1].1)];
        let mac_chain: Vec<Vec<Term>> = want[2..].iter().map(|(_, e)| expr::terms_of(e)).collect();
        if entry && ours(&self.chain) == chain && ours(&self.mac_chain) == mac_chain {
            Ok(())
        } else {
            Err(CniError::new(
                ErrorCode::CheckFailed,
                format!(
                    "macspoofchk rules \"{}\" are missing or differ",
                    self.comment
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcni_testkit::TestNs;

    const MAC: MacAddr = MacAddr([0x0a, 0x58, 0x0a, 0x16, 0x00, 0x02]);

    /// What upstream v1.1.1 (`pkg/link/spoofcheck.go`) hands `nft -f -`.
    fn upstream_script(host_veth: &str, mac: &str, id: &str) -> String {
        let (c, m) = (
            format!("cni-br-iface-{id}"),
            format!("cni-br-iface-{id}-mac"),
        );
        let comment = format!("macspoofchk-{id}");
        format!(
            "add table bridge nat\n\
             add chain bridge nat PREROUTING {{ type filter hook prerouting priority -300; policy accept; }}\n\
             add chain bridge nat {c}\n\
             add chain bridge nat {m}\n\
             flush chain bridge nat {c}\n\
             flush chain bridge nat {m}\n\
             add rule bridge nat PREROUTING iifname \"{host_veth}\" jump {c} comment \"{comment}\"\n\
             add rule bridge nat {c} jump {m} comment \"{comment}\"\n\
             add rule bridge nat {m} ether saddr {mac} return comment \"{comment}\"\n\
             add rule bridge nat {m} drop comment \"{comment}\"\n"
        )
    }

    fn nft(ns: &TestNs, args: &[&str], stdin: &str) -> String {
        rcni_netfilter::exec::run_ok(&ns.ns, "nft", args, Some(stdin)).unwrap()
    }

    fn list(ns: &TestNs, debug: bool) -> String {
        let mut args = vec!["list", "table", "bridge", "nat"];
        if debug {
            args.insert(0, "--debug=netlink");
        }
        nft(ns, &args, "")
    }

    /// Our messages are what nft makes of upstream's text: `nft list` and
    /// its netlink debug view print the same table for both; our CHECK
    /// accepts upstream's rules, and each side's teardown leaves the same.
    #[test]
    fn nft_lists_our_rules_as_upstreams() {
        let (ours, theirs) = (TestNs::new(), TestNs::new());
        Spoofchk::of("ctr1", "eth0")
            .setup(&ours.ns, "veth1234abcd", MAC)
            .unwrap();
        let script = upstream_script("veth1234abcd", "0a:58:0a:16:00:02", "ctr1-eth0");
        nft(&theirs, &["-f", "-"], &script);
        for debug in [false, true] {
            assert_eq!(list(&ours, debug), list(&theirs, debug));
        }
        for ns in [&ours, &theirs] {
            Spoofchk::of("ctr1", "eth0")
                .check(&ns.ns, "veth1234abcd", MAC)
                .unwrap();
            let other_mac = MacAddr([2, 0, 0, 0, 0, 1]);
            assert!(
                Spoofchk::of("ctr1", "eth0")
                    .check(&ns.ns, "veth1234abcd", other_mac)
                    .is_err()
            );
            assert!(
                Spoofchk::of("ctr1", "eth0")
                    .check(&ns.ns, "vethother", MAC)
                    .is_err()
            );
            assert!(
                Spoofchk::of("ctr2", "eth0")
                    .check(&ns.ns, "veth1234abcd", MAC)
                    .is_err()
            );
        }
        Spoofchk::of("ctr1", "eth0").teardown(&theirs.ns).unwrap();
        Spoofchk::of("ctr1", "eth0").teardown(&ours.ns).unwrap();
        assert_eq!(list(&ours, false), list(&theirs, false));
        assert!(!list(&ours, false).contains("cni-br-iface"));
        assert!(
            Spoofchk::of("ctr1", "eth0")
                .check(&ours.ns, "veth1234abcd", MAC)
                .is_err()
        );
    }

    /// Teardown with nothing there, twice, and with only part of it left.
    #[test]
    fn teardown_takes_missing_pieces() {
        let ns = TestNs::new();
        Spoofchk::of("ctr1", "eth0").teardown(&ns.ns).unwrap();
        Spoofchk::of("ctr1", "eth0")
            .setup(&ns.ns, "veth1", MAC)
            .unwrap();
        Spoofchk::of("ctr2", "eth0")
            .setup(&ns.ns, "veth2", MAC)
            .unwrap();
        // The -mac chain gone, its parent chain empty.
        let partial = "flush chain bridge nat cni-br-iface-ctr1-eth0\n\
                       delete chain bridge nat cni-br-iface-ctr1-eth0-mac\n";
        nft(&ns, &["-f", "-"], partial);
        assert!(
            Spoofchk::of("ctr1", "eth0")
                .check(&ns.ns, "veth1", MAC)
                .is_err()
        );
        Spoofchk::of("ctr1", "eth0").teardown(&ns.ns).unwrap();
        Spoofchk::of("ctr1", "eth0").teardown(&ns.ns).unwrap();
        let text = list(&ns, false);
        assert!(!text.contains("ctr1"), "{text}");
        Spoofchk::of("ctr2", "eth0")
            .check(&ns.ns, "veth2", MAC)
            .unwrap();
    }
}
