//! setup / check / teardown / gc against real netfilter, each test in its
//! own throwaway namespace (root needed).

mod common;

use common::{ips, nat_lines, nft_masq_comments, nft_tables, sh};
use rcni_netfilter::{Backend, Masq, chain_name, check, gc, setup, teardown};
use rcni_testkit::{TestNs, ping};

const BOTH: [Backend; 2] = [Backend::Iptables, Backend::Nftables];

fn masq<'a>(cid: &'a str, ifname: &'a str, ips: &'a [ipnetwork::IpNetwork]) -> Masq<'a> {
    Masq {
        network: "mynet",
        container_id: cid,
        ifname,
        ips,
    }
}

/// Whether `ns` holds any masquerade rule of ours or the reference's.
fn has_rules(ns: &TestNs) -> bool {
    let ipt = nat_lines(ns, "iptables-save").len() + nat_lines(ns, "ip6tables-save").len();
    // iptables-nft keeps its (empty) `ip nat` tables: only ours count.
    ipt > 0
        || nft_tables(ns)
            .iter()
            .any(|(f, n)| f == "inet" && n == rcni_netfilter::NFT_TABLE)
}

#[test]
fn setup_check_teardown_each_backend() {
    for backend in BOTH {
        let ns = TestNs::new();
        let addrs = ips(&["10.22.0.2/16"]);
        let m = masq("ctr1", "eth0", &addrs);
        setup(&ns.ns, backend, &m).unwrap();
        check(&ns.ns, backend, &m).unwrap();
        match backend {
            Backend::Iptables => {
                let chain = chain_name("mynet", "ctr1");
                let lines = nat_lines(&ns, "iptables-save");
                assert_eq!(lines.len(), 4, "{lines:?}");
                assert!(lines.contains(&format!(":{chain} - [0:0]")));
                assert!(
                    lines
                        .iter()
                        .any(|l| l.starts_with("-A POSTROUTING -s 10.22.0.2/32"))
                );
                assert!(nft_tables(&ns).iter().all(|(f, _)| f != "inet"));
            }
            Backend::Nftables => {
                let comments = nft_masq_comments(&ns);
                assert_eq!(
                    comments,
                    [rcni_netfilter::nft_comment("mynet", "eth0", "ctr1")]
                );
                assert!(nat_lines(&ns, "iptables-save").is_empty());
                let text = sh(
                    &ns,
                    "nft",
                    &["list", "table", "inet", rcni_netfilter::NFT_TABLE],
                );
                assert!(
                    text.contains("ip saddr 10.22.0.2 ip daddr != 10.22.0.0/16 masquerade"),
                    "{text}"
                );
                assert!(
                    text.contains("type nat hook postrouting priority srcnat"),
                    "{text}"
                );
            }
        }
        // Idempotent: a second setup changes nothing.
        let before = (nat_lines(&ns, "iptables-save"), nft_masq_comments(&ns));
        setup(&ns.ns, backend, &m).unwrap();
        assert_eq!(
            before,
            (nat_lines(&ns, "iptables-save"), nft_masq_comments(&ns))
        );

        // Another container's check fails, this one's passes.
        let e = check(&ns.ns, backend, &masq("ctr2", "eth0", &addrs)).unwrap_err();
        assert_eq!(e.cni_code(), 106, "{e}");

        teardown(&ns.ns, &m).unwrap();
        assert!(
            !has_rules(&ns),
            "{backend}: {:?}",
            nat_lines(&ns, "iptables-save")
        );
        teardown(&ns.ns, &m).unwrap();
        let e = check(&ns.ns, backend, &m).unwrap_err();
        assert_eq!(e.cni_code(), 106);
        assert!(e.to_string().contains(backend.as_str()), "{e}");
    }
}

#[test]
fn dual_stack() {
    for backend in BOTH {
        let ns = TestNs::new();
        let addrs = ips(&["10.22.0.2/16", "fd00:22::2/64"]);
        let m = masq("ctr1", "eth0", &addrs);
        setup(&ns.ns, backend, &m).unwrap();
        check(&ns.ns, backend, &m).unwrap();
        if backend == Backend::Iptables {
            let v6 = nat_lines(&ns, "ip6tables-save");
            assert!(
                v6.iter()
                    .any(|l| l.starts_with("-A POSTROUTING -s fd00:22::2/128")),
                "{v6:?}"
            );
            assert!(
                v6.iter()
                    .any(|l| l.contains("! -d ff00::/8") && l.ends_with("-j MASQUERADE"))
            );
            assert!(
                v6.iter()
                    .any(|l| l.contains("-d fd00:22::/64") && l.ends_with("-j ACCEPT"))
            );
        } else {
            assert_eq!(nft_masq_comments(&ns).len(), 2);
        }
        // Only the v4 address: check passes for it alone, not for a v6 one
        // that was never set up.
        check(&ns.ns, backend, &masq("ctr1", "eth0", &addrs[..1])).unwrap();
        let other = ips(&["fd00:23::2/64"]);
        assert!(check(&ns.ns, backend, &masq("ctr1", "eth0", &other)).is_err());
        teardown(&ns.ns, &m).unwrap();
        assert!(!has_rules(&ns));
    }
}

#[test]
fn teardown_needs_no_addresses_and_covers_both_backends() {
    let ns = TestNs::new();
    let addrs = ips(&["10.22.0.2/16", "fd00:22::2/64"]);
    let m = masq("ctr1", "eth0", &addrs);
    setup(&ns.ns, Backend::Iptables, &m).unwrap();
    setup(&ns.ns, Backend::Nftables, &m).unwrap();
    // A DEL without netns and without prevResult knows only these.
    teardown(&ns.ns, &masq("ctr1", "eth0", &[])).unwrap();
    assert!(!has_rules(&ns), "{:?}", nat_lines(&ns, "iptables-save"));
}

#[test]
fn teardown_keeps_other_attachments() {
    for backend in BOTH {
        let ns = TestNs::new();
        let a = ips(&["10.22.0.2/16"]);
        let b = ips(&["10.22.0.3/16"]);
        setup(&ns.ns, backend, &masq("ctr1", "eth0", &a)).unwrap();
        setup(&ns.ns, backend, &masq("ctr2", "eth0", &b)).unwrap();
        teardown(&ns.ns, &masq("ctr1", "eth0", &a)).unwrap();
        check(&ns.ns, backend, &masq("ctr2", "eth0", &b)).unwrap();
        assert!(check(&ns.ns, backend, &masq("ctr1", "eth0", &a)).is_err());
        teardown(&ns.ns, &masq("ctr2", "eth0", &b)).unwrap();
        assert!(!has_rules(&ns), "{backend}");
    }
}

#[test]
fn gc_keeps_valid_and_removes_stale() {
    let ns = TestNs::new();
    let (a, b, c) = (
        ips(&["10.22.0.2/16"]),
        ips(&["10.22.0.3/16", "fd00:22::3/64"]),
        ips(&["10.9.0.2/24"]),
    );
    for backend in BOTH {
        setup(&ns.ns, backend, &masq("ctr-a", "eth0", &a)).unwrap();
        setup(&ns.ns, backend, &masq("ctr-b", "eth0", &b)).unwrap();
        // Same container, other network: GC of "mynet" must not touch it.
        let other = Masq {
            network: "othernet",
            container_id: "ctr-b",
            ifname: "eth0",
            ips: &c,
        };
        setup(&ns.ns, backend, &other).unwrap();
    }
    gc(&ns.ns, "mynet", &[("ctr-a".into(), "eth0".into())]).unwrap();
    for backend in BOTH {
        check(&ns.ns, backend, &masq("ctr-a", "eth0", &a)).unwrap();
        assert!(
            check(&ns.ns, backend, &masq("ctr-b", "eth0", &b[..1])).is_err(),
            "{backend}"
        );
        assert!(
            check(&ns.ns, backend, &masq("ctr-b", "eth0", &b[1..])).is_err(),
            "{backend}"
        );
        let other = Masq {
            network: "othernet",
            container_id: "ctr-b",
            ifname: "eth0",
            ips: &c,
        };
        check(&ns.ns, backend, &other).unwrap();
    }
    assert!(
        nat_lines(&ns, "ip6tables-save").is_empty(),
        "ctr-b was the only v6 user"
    );
    // An empty valid set removes the rest of the network; GC again is a no-op.
    gc(&ns.ns, "mynet", &[]).unwrap();
    gc(&ns.ns, "mynet", &[]).unwrap();
    gc(&ns.ns, "othernet", &[]).unwrap();
    assert!(!has_rules(&ns), "{:?}", nat_lines(&ns, "iptables-save"));
}

#[test]
fn check_notices_a_deleted_rule() {
    let ns = TestNs::new();
    let addrs = ips(&["10.22.0.2/16"]);
    let m = masq("ctr1", "eth0", &addrs);
    setup(&ns.ns, Backend::Iptables, &m).unwrap();
    let chain = chain_name("mynet", "ctr1");
    sh(&ns, "iptables", &["-t", "nat", "-D", chain.as_str(), "2"]);
    let e = check(&ns.ns, Backend::Iptables, &m).unwrap_err();
    assert!(e.to_string().contains("MASQUERADE"), "{e}");
    // setup repairs it.
    setup(&ns.ns, Backend::Iptables, &m).unwrap();
    check(&ns.ns, Backend::Iptables, &m).unwrap();

    setup(&ns.ns, Backend::Nftables, &m).unwrap();
    sh(
        &ns,
        "nft",
        &[
            "flush",
            "chain",
            "inet",
            rcni_netfilter::NFT_TABLE,
            "postrouting",
        ],
    );
    assert!(check(&ns.ns, Backend::Nftables, &m).is_err());
    setup(&ns.ns, Backend::Nftables, &m).unwrap();
    check(&ns.ns, Backend::Nftables, &m).unwrap();
    teardown(&ns.ns, &m).unwrap();
    assert!(!has_rules(&ns));
}

/// What upstream v1.9.1 hands nft (through knftables) to set up its table,
/// with one masq_checks rule per `(address, subnet, comment)`.
fn upstream_script(rules: &[(&str, &str, &str)]) -> String {
    let t = "inet cni_plugins_masquerade";
    let mut s = format!(
        "add table {t} {{ comment \"Masquerading for plugins from github.com/containernetworking/plugins\" ; }}\n\
         add chain {t} masq_checks {{ comment \"Masquerade traffic from certain IPs to any (non-multicast) IP outside their subnet\" ; }}\n\
         add chain {t} postrouting {{ type nat hook postrouting priority srcnat ; }}\n\
         flush chain {t} postrouting\n\
         add rule {t} postrouting ip daddr == 224.0.0.0/4  return\n\
         add rule {t} postrouting ip6 daddr == ff00::/8  return\n\
         add rule {t} postrouting goto masq_checks\n"
    );
    for (ip, net, comment) in rules {
        let fam = if ip.contains(':') { "ip6" } else { "ip" };
        s.push_str(&format!(
            "add rule {t} masq_checks {fam} saddr == {ip} {fam} daddr != {net} masquerade comment \"{comment}\"\n"
        ));
    }
    s
}

/// Runs `nft -f -` with `script` in `ns`.
fn nft_f(ns: &TestNs, script: &str) {
    use std::io::Write;
    let mut child = ns
        .command("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success());
}

/// Rules as upstream v1.9.1 writes them through knftables (the hash is
/// computed independently from upstream's formula), next to a rule of
/// another network: our CHECK accepts them, GC and teardown remove exactly
/// the right ones.
#[test]
fn understands_rules_written_by_upstream_nft_backend() {
    let ns = TestNs::new();
    let ours = "d23676b4f2d9fe04-7883a6f9ce71eedb, net: mynet, if: eth0, id: ctr1";
    let other = "0000000000000000-1111111111111111, net: other, if: eth0, id: x";
    nft_f(
        &ns,
        &upstream_script(&[
            ("10.22.0.2", "10.22.0.0/16", ours),
            ("10.9.0.2", "10.9.0.0/24", other),
        ]),
    );
    let addrs = ips(&["10.22.0.2/16"]);
    let m = masq("ctr1", "eth0", &addrs);
    check(&ns.ns, Backend::Nftables, &m).unwrap();
    gc(&ns.ns, "mynet", &[("ctr1".into(), "eth0".into())]).unwrap();
    assert_eq!(
        nft_masq_comments(&ns).len(),
        2,
        "valid attachment and other network kept"
    );
    teardown(&ns.ns, &masq("ctr1", "eth0", &[])).unwrap();
    let left = nft_masq_comments(&ns);
    assert_eq!(left.len(), 1);
    assert!(left[0].contains("net: other"), "{left:?}");
}

/// Our rules, written over nfnetlink, are byte for byte what nft makes of
/// upstream's rule text: `nft list` prints the same table for both (dual
/// stack, a subnet on a byte boundary and one that is not).
#[test]
fn nft_lists_our_table_as_upstreams() {
    let (ours, theirs) = (TestNs::new(), TestNs::new());
    let addrs = ips(&["10.22.0.2/16", "10.30.0.9/20", "fd00:22::2/64"]);
    setup(&ours.ns, Backend::Nftables, &masq("ctr1", "eth0", &addrs)).unwrap();
    let c = rcni_netfilter::nft_comment("mynet", "eth0", "ctr1");
    nft_f(
        &theirs,
        &upstream_script(&[
            ("10.22.0.2", "10.22.0.0/16", &c),
            ("10.30.0.9", "10.30.0.0/20", &c),
            ("fd00:22::2", "fd00:22::/64", &c),
        ]),
    );
    // The listing, and the debug view: the same expressions, register by
    // register.
    for debug in [&[][..], &["--debug=netlink"][..]] {
        let list = |ns: &TestNs| {
            let table = ["list", "table", "inet", rcni_netfilter::NFT_TABLE];
            sh(ns, "nft", &[debug, &table[..]].concat())
        };
        assert_eq!(list(&ours), list(&theirs));
    }
}

/// A transaction of many small messages: every one is acknowledged, and
/// ~260 acks overflow a default receive buffer (ENOBUFS for a transaction
/// the kernel committed) although the batch is only ~20 KiB.
#[test]
fn a_transaction_of_many_messages_reports_its_commit() {
    use rcni_netfilter::expr;
    use rcni_netfilter::nfnl::{Nfnl, NftFamily, NftOp};
    let ns = TestNs::new();
    let family = NftFamily::Inet;
    let mut ops = vec![
        NftOp::AddTable {
            family,
            table: "t".into(),
            comment: None,
        },
        NftOp::AddChain {
            family,
            table: "t".into(),
            chain: "c".into(),
            hook: None,
            comment: None,
        },
    ];
    for _ in 0..600 {
        ops.push(NftOp::AddRule {
            family,
            table: "t".into(),
            chain: "c".into(),
            expr: expr::accept(),
            comment: None,
            insert: false,
        });
    }
    let mut nl = Nfnl::open(&ns.ns).unwrap();
    nl.nft_apply(&ops).unwrap();
    let rules = nl.nft_rules(family, "t").unwrap().unwrap();
    assert_eq!(rules.len(), 600);
}

#[test]
fn default_backend_is_iptables_where_it_works() {
    let ns = TestNs::new();
    assert_eq!(Backend::detect(&ns.ns), Backend::Iptables);
    assert_eq!(
        Backend::from_config(&ns.ns, Some("nftables")).unwrap(),
        Backend::Nftables
    );
    assert_eq!(
        Backend::from_config(&ns.ns, None).unwrap(),
        Backend::Iptables
    );
    assert_eq!(
        Backend::from_config(&ns.ns, Some("pf"))
            .unwrap_err()
            .cni_code(),
        2
    );
    assert!(!has_rules(&ns), "detection must not leave anything behind");
}

/// Real packets: pod -> node (forwarding) -> outside, where outside has no
/// route back to the pod subnet, so replies arrive only when the node
/// masquerades.
#[test]
fn masquerade_carries_real_traffic() {
    for backend in BOTH {
        let (node, pod, outside) = (TestNs::new(), TestNs::new(), TestNs::new());
        for (peer, host_if, host_addr) in [
            (&pod, "vpod", "10.99.0.1/24"),
            (&outside, "vout", "192.0.2.1/24"),
        ] {
            let peer_path = peer.path();
            sh(
                &node,
                "ip",
                &[
                    "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns",
                    &peer_path,
                ],
            );
            sh(&node, "ip", &["addr", "add", host_addr, "dev", host_if]);
            sh(&node, "ip", &["link", "set", host_if, "up"]);
            sh(peer, "ip", &["link", "set", "eth0", "up"]);
        }
        sh(&node, "sysctl", &["-qw", "net.ipv4.ip_forward=1"]);
        sh(&pod, "ip", &["addr", "add", "10.99.0.2/24", "dev", "eth0"]);
        sh(&pod, "ip", &["route", "add", "default", "via", "10.99.0.1"]);
        sh(
            &outside,
            "ip",
            &["addr", "add", "192.0.2.2/24", "dev", "eth0"],
        );

        assert!(
            !ping(&pod.ns, "192.0.2.2"),
            "{backend}: no way back without masquerade"
        );
        let addrs = ips(&["10.99.0.2/24"]);
        let m = masq("ctr1", "eth0", &addrs);
        setup(&node.ns, backend, &m).unwrap();
        assert!(
            ping(&pod.ns, "192.0.2.2"),
            "{backend}: masqueraded traffic is answered"
        );
        // Inside the subnet nothing is rewritten: the node sees the pod's own address.
        assert!(ping(&pod.ns, "10.99.0.1"));
        teardown(&node.ns, &m).unwrap();
        assert!(
            !ping(&pod.ns, "192.0.2.2"),
            "{backend}: teardown stops masquerading"
        );
    }
}
