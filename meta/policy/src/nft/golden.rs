//! The nfnetlink writer against the `nft -f` text it replaced: one model
//! written both ways into two throwaway namespaces, step by step (full
//! rewrite, then incremental changes), must list the same from the kernel
//! (`nft list`, the raw elements and rule expressions of `nft
//! --debug=netlink list`, and the sets' attributes).

use super::model::{Applied, Flows, Model, Op, plan};
use super::{messages, runner, script};
use crate::compile::{Ids, compile};
use crate::conf::FlowEvents;
use crate::model::PolicySet;
use crate::state::PodRecord;
use rcni_netfilter::nftset::{self, INET};
use rcni_testkit::{TestNs, stdout_of};
use serde_json::json;
use std::collections::BTreeMap;
use std::io::Write;
use std::process::Stdio;

const T: &str = "rcni_policy_golden";

/// A pod of namespace "default" labelled app=`app`.
fn pod(key: &str, app: &str, addrs: &[&str]) -> (String, PodRecord) {
    super::tests::app_pod(key, app, addrs, "v")
}

/// The nft tests' policies, and more ranges: from 0 and to the top of
/// both families, with ports.
fn policies(with_egress: bool) -> PolicySet {
    let mut s = super::tests::policies();
    s.add_document(
        &json!({"name":"web-more","podSelector":{"matchLabels":{"app":"web"}},
        "ingress":[
            {"from":[{"ipBlock":{"cidr":"fd00::/64","except":["fd00::/120"]}}]},
            {"from":[{"ipBlock":{"cidr":"0.0.0.0/0","except":["10.0.0.0/8"]}},
                     {"ipBlock":{"cidr":"::/0","except":["fd00::/8"]}}],
             "ports":[{"port":443},{"protocol":"SCTP","port":9000,"endPort":9100}]}
        ]}),
        "t",
    )
    .unwrap();
    if with_egress {
        s.add_document(
            &json!({"name":"cli","podSelector":{"matchLabels":{"app":"client"}},
            "policyTypes":["Egress"],
            "egress":[
                {"to":[{"podSelector":{"matchLabels":{"app":"web"}}}],"ports":[{"port":80}]},
                {"to":[{"ipBlock":{"cidr":"203.0.113.0/24"}}]},
                {"to":[{"ipBlock":{"cidr":"255.255.255.0/24"}}]}
            ]}),
            "t",
        )
        .unwrap();
    }
    s.sort();
    s
}

fn nft(ns: &TestNs, args: &[&str]) -> String {
    stdout_of(ns.command("nft").args(args))
}

fn nft_script(ns: &TestNs, script: &str) {
    let mut c = ns
        .command("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    let out = c.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "nft -f: {}\n{script}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The sets as the kernel describes them, by name.
fn sets(ns: &TestNs) -> BTreeMap<String, Vec<(u16, Vec<u8>)>> {
    let mut nl = runner::open(&ns.ns).unwrap();
    let (kind, req) = nftset::sets_request(T);
    nl.nft_dump_raw(kind, INET, &req)
        .unwrap()
        .unwrap_or_default()
        .iter()
        .map(|a| {
            let v = nftset::set_attrs_but_handle(a);
            let name = v.iter().find(|(t, _)| *t == 2).unwrap().1.clone();
            (String::from_utf8_lossy(&name).into_owned(), v)
        })
        .collect()
}

/// `nft --debug=netlink list` without the rule handles, and with each
/// set's elements sorted (a hash set lists them in the order of its
/// random seed).
fn raw_listing(ns: &TestNs) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut elems: Vec<String> = Vec::new();
    let text = sorted_elements(&nft(ns, &["--debug=netlink", "list", "table", "inet", T]));
    for l in text.lines() {
        if l.starts_with("\telement ") {
            elems.push(l.to_string());
            continue;
        }
        elems.sort();
        out.append(&mut elems);
        if l.starts_with("inet ") && !l.contains('@') {
            out.push(l.rsplit_once(' ').map_or(l, |(h, _)| h).to_string());
        } else {
            out.push(l.to_string());
        }
    }
    elems.sort();
    out.append(&mut elems);
    out
}

/// `nft list` text with each set's elements sorted: a concatenated
/// interval set lists them in insertion order, which depends on how
/// elements were split over messages.
fn sorted_elements(listing: &str) -> String {
    let mut out = String::new();
    let mut rest = listing;
    while let Some(i) = rest.find("elements = { ") {
        let (head, tail) = rest.split_at(i + "elements = { ".len());
        out.push_str(head);
        let end = tail.find(" }").expect("elements end");
        let mut e: Vec<&str> = tail[..end].split(',').map(str::trim).collect();
        e.sort_unstable();
        out.push_str(&e.join(", "));
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

struct Both {
    text: TestNs,
    netlink: TestNs,
}

impl Both {
    fn step(&self, what: &str, ops: &[Op]) {
        nft_script(&self.text, &script::render(T, ops));
        let mut nl = runner::open(&self.netlink.ns).unwrap();
        runner::run(&mut nl, messages::batch(T, ops).unwrap()).unwrap();
        let tables = |ns: &TestNs| nft(ns, &["list", "tables"]);
        assert_eq!(tables(&self.text), tables(&self.netlink), "{what}");
        if !tables(&self.text).contains(T) {
            return;
        }
        let list = |ns: &TestNs| sorted_elements(&nft(ns, &["list", "table", "inet", T]));
        let (a, b) = (list(&self.text), list(&self.netlink));
        if a != b {
            std::fs::write("/tmp/golden-nft.txt", &a).ok();
            std::fs::write("/tmp/golden-netlink.txt", &b).ok();
            panic!("{what}: nft list differs (/tmp/golden-nft.txt, /tmp/golden-netlink.txt)");
        }
        let (a, b) = (raw_listing(&self.text), raw_listing(&self.netlink));
        if let Some(i) = (0..a.len().max(b.len())).find(|i| a.get(*i) != b.get(*i)) {
            let around = |v: &[String]| v[i.saturating_sub(3)..(i + 3).min(v.len())].join("\n");
            panic!(
                "{what}: netlink listing differs at line {i}:\nnft:\n{}\nnetlink:\n{}",
                around(&a),
                around(&b)
            );
        }
        let (a, b) = (sets(&self.text), sets(&self.netlink));
        assert_eq!(
            a.keys().collect::<Vec<_>>(),
            b.keys().collect::<Vec<_>>(),
            "{what}"
        );
        for (name, attrs) in &a {
            let other = &b[name];
            let only: Vec<_> = attrs.iter().filter(|x| !other.contains(x)).collect();
            let theirs: Vec<_> = other.iter().filter(|x| !attrs.contains(x)).collect();
            assert!(
                only.is_empty() && theirs.is_empty(),
                "{what}: set {name} differs: nft {only:?}, netlink {theirs:?}"
            );
        }
    }
}

#[test]
fn netlink_writes_what_nft_wrote() {
    let both = Both {
        text: TestNs::new(),
        netlink: TestNs::new(),
    };
    let mut pods: BTreeMap<_, _> = [
        pod("web/eth0", "web", &["10.0.0.2", "fd00::2"]),
        pod("cli/eth0", "client", &["10.0.0.3", "fd00::3"]),
        pod("adm/eth0", "admin", &["10.0.0.9"]),
    ]
    .into();
    let mut ids = Ids::default();
    let desired = |pods: &BTreeMap<String, PodRecord>, ids: &mut Ids, egress| {
        let views = pods.iter().map(|(k, p)| (k.clone(), p.view())).collect();
        compile(&policies(egress), &views, ids).unwrap()
    };
    let d = desired(&pods, &mut ids, true);
    let m1 = Model::build(&pods, &d, &Flows::off());
    let (ops, full) = plan(None, &m1);
    assert!(full);
    both.step("full", &ops);
    // The same again, over an existing table.
    both.step("full again", &ops);
    let listing = nft(&both.netlink, &["list", "table", "inet", T]);
    for want in [
        "icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert } accept",
        "ip saddr . meta l4proto . th dport @in_",
        "10.0.0.3 . tcp . 8000-8080",
        "255.255.255.0/24",
    ] {
        assert!(listing.contains(want), "{want} in\n{listing}");
    }

    // Flow events (see `Flows`): the deny tails, the allow chains and
    // their dynamic sets added to the table as it is...
    let flows = Flows {
        events: FlowEvents::All,
        rate: 10,
        group: 33000,
    };
    let prev = Applied::of(T.into(), m1.clone(), BTreeMap::new());
    let mf = Model::build(&pods, &d, &flows);
    let (ops, full) = plan(Some(&prev), &mf);
    assert!(!full);
    both.step("flow events on", &ops);
    let listing = nft(&both.netlink, &["list", "table", "inet", T]);
    for want in [
        "flags dynamic,timeout",
        "type ipv6_addr . ipv6_addr . inet_proto . inet_service . inet_service",
        "update @in_",
        "limit rate over 10/second burst 10 packets } update @",
        "group 33000 drop comment",
        "_ok\n",
    ] {
        assert!(listing.contains(want), "{want} in\n{listing}");
    }
    // ... audit rule sets, which report and return ...
    let mut audit = policies(true);
    for p in &mut audit.policies {
        p.audit = true;
    }
    let views = pods.iter().map(|(k, p)| (k.clone(), p.view())).collect();
    let da = compile(&audit, &views, &mut ids).unwrap();
    let deny = Flows {
        events: FlowEvents::Deny,
        ..flows
    };
    both.step(
        "audit",
        &super::model::full(&Model::build(&pods, &da, &deny)),
    );
    let listing = nft(&both.netlink, &["list", "table", "inet", T]);
    assert!(
        listing.contains("log prefix \"rcni audit ingress "),
        "{listing}"
    );
    assert!(!listing.contains(" drop"), "{listing}");
    // ... and taken away again.
    let prev = Applied::of(T.into(), mf, BTreeMap::new());
    both.step(
        "flow events again",
        &super::model::full(&Model::build(&pods, &d, &flows)),
    );
    let (ops, _) = plan(Some(&prev), &m1);
    both.step("flow events off", &ops);

    // Elements only: new pods of known identities.
    let prev = Applied::of(T.into(), m1.clone(), BTreeMap::new());
    pods.extend([
        pod("web2/eth0", "web", &["10.0.0.4", "fd00::4"]),
        pod("cli2/eth0", "client", &["10.0.0.5"]),
    ]);
    let m2 = Model::build(&pods, &desired(&pods, &mut ids, true), &Flows::off());
    let (ops, _) = plan(Some(&prev), &m2);
    both.step("pods added", &ops);

    // Removals: interval sets rewritten, map elements deleted.
    let prev = Applied::of(T.into(), m2, BTreeMap::new());
    pods.remove("cli2/eth0");
    pods.remove("web2/eth0");
    pods.remove("adm/eth0");
    let m3 = Model::build(&pods, &desired(&pods, &mut ids, true), &Flows::off());
    let (ops, _) = plan(Some(&prev), &m3);
    both.step("pods removed", &ops);

    // A rule set goes: its jumps, chain and sets.
    let prev = Applied::of(T.into(), m3, BTreeMap::new());
    let m4 = Model::build(&pods, &desired(&pods, &mut ids, false), &Flows::off());
    let (ops, _) = plan(Some(&prev), &m4);
    assert!(ops.iter().any(|o| matches!(o, Op::DeleteChain(_))));
    both.step("rule set removed", &ops);

    // And the table.
    both.step("table removed", &[Op::AddTable, Op::DeleteTable]);
}

/// Ten thousand ranges in a plain and a concatenated interval set: more
/// than a netlink message (64 KiB) and the default socket buffers hold,
/// still one transaction, still what nft writes.
#[test]
fn ten_thousand_ranges_in_one_transaction() {
    use super::model::{Rule, VMAPS, full};
    let both = Both {
        text: TestNs::new(),
        netlink: TestNs::new(),
    };
    let mut m = Model::default();
    for v in VMAPS {
        m.sets.insert(v.to_string(), Default::default());
    }
    let range = |i: u32| {
        format!(
            "10.{}.{}.0-10.{}.{}.127",
            i / 256,
            i % 256,
            i / 256,
            i % 256
        )
    };
    m.sets
        .insert("in_1_net4".into(), (0..10_000).map(range).collect());
    m.sets.insert(
        "in_1_net4p".into(),
        (0..10_000)
            .map(|i| format!("{} . 6 . 80-90", range(i)))
            .collect(),
    );
    m.sets.insert(
        "in_1_net6".into(),
        (0..2_000u32)
            .map(|i| format!("fd00:{i:x}::-fd00:{i:x}::ffff"))
            .collect(),
    );
    m.chains.insert(
        "in_1".into(),
        vec![
            Rule::Allow {
                v6: false,
                src: true,
                ports: false,
                set: "in_1_net4".into(),
                goto: None,
            },
            Rule::Allow {
                v6: false,
                src: true,
                ports: true,
                set: "in_1_net4p".into(),
                goto: None,
            },
            Rule::Allow {
                v6: true,
                src: true,
                ports: false,
                set: "in_1_net6".into(),
                goto: None,
            },
            Rule::End {
                log: None,
                fin: super::model::Fin::Drop,
                comment: Some("ingress: big".into()),
            },
        ],
    );
    m.sets
        .get_mut("to_pod4")
        .unwrap()
        .insert("10.255.0.2 : jump in_1".into());
    let ops = full(&m);
    let b = messages::batch(T, &ops).unwrap();
    let bytes: usize = b.messages().iter().map(|m| m.attrs().len()).sum();
    assert!(bytes > 256 * 1024, "{bytes} bytes");
    both.step("10k ranges", &ops);
}
