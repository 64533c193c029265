//! The nftables backend against the kernel, with real traffic (root).
//!
//! Everything happens in namespaces these tests create: a node namespace
//! holding a bridge and the table, and one namespace per pod. They are
//! anonymous (testkit's `TestNs`), so the kernel frees them, links and
//! table included, however a test ends. Policies go through the real
//! compiler, as the plugin's would.

use policy::compile::{Desired, Ids, compile};
use policy::conf::FlowEvents;
use policy::flows::nft::NflogSource;
use policy::flows::{RawEvent, Source, Verdict};
use policy::model::{Dir, PolicySet};
use policy::nft;
use policy::state::PodRecord;
use rcni_netns::NetNs;
use rcni_testkit::{TestNs, ip, ping};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

const NET: &str = "kube-pods.v1";

/// Ports every pod listens on (TCP, both families).
const PORTS: [u16; 4] = [8005, 8011, 8105, 9000];

struct Pod {
    ns: TestNs,
    v4: IpAddr,
    v6: IpAddr,
}

/// A node namespace with bridge `br0` and pods on it.
struct Lab {
    node: TestNs,
    pods: BTreeMap<String, Pod>,
    records: BTreeMap<String, PodRecord>,
    ids: Ids,
    applied: Value,
    /// What the chains report (off unless a test turns it on).
    flows: nft::Flows,
    /// Every policy audit-only (the network's `"audit": true`).
    audit: bool,
}

impl Lab {
    fn new() -> Lab {
        let node = TestNs::new();
        ip(&node.ns, "link add br0 type bridge");
        ip(&node.ns, "addr add 10.77.0.1/24 dev br0");
        ip(&node.ns, "addr add fd77::1/64 dev br0 nodad");
        ip(&node.ns, "link set br0 up");
        // Off, so that the test sees apply turn them on for bridged pods
        // (a fresh namespace starts with them on).
        for key in [
            "net.bridge.bridge-nf-call-iptables",
            "net.bridge.bridge-nf-call-ip6tables",
        ] {
            rcni_netlink::sysctl::set(&node.ns, key, "0").unwrap();
        }
        Lab {
            node,
            pods: BTreeMap::new(),
            records: BTreeMap::new(),
            ids: Ids::default(),
            applied: Value::Null,
            flows: nft::Flows::off(),
            audit: false,
        }
    }

    /// A pod `name` with `labels` at 10.77.0.`n` and fd77::`n`, listening
    /// on [`PORTS`].
    fn add_pod(&mut self, name: &str, n: u8, labels: &[(&str, &str)]) {
        let ns = TestNs::new();
        let host = format!("v{name}");
        ip(
            &self.node.ns,
            &format!(
                "link add {host} type veth peer name eth0 netns {}",
                ns.path()
            ),
        );
        ip(&self.node.ns, &format!("link set {host} master br0 up"));
        let (v4, v6) = (format!("10.77.0.{n}"), format!("fd77::{n}"));
        ip(&ns.ns, "link set lo up");
        ip(&ns.ns, &format!("addr add {v4}/24 dev eth0"));
        ip(&ns.ns, &format!("addr add {v6}/64 dev eth0 nodad"));
        ip(&ns.ns, "link set eth0 up");
        // Carrier-on reaches the bridge port through the kernel's linkwatch,
        // which may defer it by up to a second after any other link event
        // on the machine (parallel tests make many): until then the port
        // drops frames, and a first connection attempt would be lost.
        wait_up(&self.node, &host);
        wait_up(&ns, "eth0");
        for port in PORTS {
            serve(&ns.ns, port);
        }
        let key = format!("{name}/eth0");
        self.records.insert(
            key,
            PodRecord {
                container_id: name.into(),
                ifname: "eth0".into(),
                namespace: "default".into(),
                labels: labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                addrs: vec![v4.parse().unwrap(), v6.parse().unwrap()],
                host_ifname: host,
                host_ifindex: 0,
                name: None,
                ports: Default::default(),
            },
        );
        self.pods.insert(
            name.into(),
            Pod {
                ns,
                v4: v4.parse().unwrap(),
                v6: v6.parse().unwrap(),
            },
        );
    }

    fn desired(&mut self, policies: &Value) -> Desired {
        let mut set = PolicySet::default();
        set.add_document(policies, "test").unwrap();
        for p in &mut set.policies {
            p.audit |= self.audit;
        }
        set.sort();
        let views = self
            .records
            .iter()
            .map(|(k, p)| (k.clone(), p.view()))
            .collect();
        compile(&set, &views, &mut self.ids).unwrap()
    }

    /// Compiles `policies` for the pods and applies them in the node
    /// namespace; returns the desired state.
    fn apply(&mut self, policies: &Value) -> Desired {
        let d = self.desired(policies);
        let (records, applied) = (&self.records, &mut self.applied);
        self.node
            .ns
            .run(|| nft::apply(NET, records, &d, &self.flows, applied))
            .unwrap()
            .unwrap_or_else(|e| panic!("apply: {} {}", e.code, e.msg));
        d
    }

    fn pod(&self, name: &str) -> &Pod {
        &self.pods[name]
    }

    /// Whether `from` gets a TCP answer from `to` on `port` over IPv4 (or
    /// IPv6): the connection and the reply byte both have to pass.
    fn tcp(&self, from: &str, to: &str, port: u16, v6: bool) -> bool {
        let dst = if v6 { self.pod(to).v6 } else { self.pod(to).v4 };
        let addr = SocketAddr::new(dst, port);
        self.pod(from)
            .ns
            .ns
            .run(move || -> std::io::Result<bool> {
                let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(800))?;
                s.set_read_timeout(Some(Duration::from_secs(2)))?;
                let mut b = [0u8; 2];
                s.read_exact(&mut b)?;
                Ok(&b == b"ok")
            })
            .unwrap()
            .unwrap_or(false)
    }

    fn ping(&self, from: &str, to: &str) -> bool {
        ping(&self.pod(from).ns.ns, &self.pod(to).v4.to_string())
    }

    fn nft(&self, args: &str) -> String {
        rcni_testkit::stdout_of(self.node.command("nft").args(args.split_whitespace()))
    }

    fn tables(&self) -> String {
        self.nft("list tables")
    }

    fn sysctl(&self, key: &str) -> String {
        rcni_netlink::sysctl::get(&self.node.ns, key).unwrap()
    }

    fn check(&self, name: &str, d: &Desired) -> Result<(), rcni_cni::CniError> {
        let key = format!("{name}/eth0");
        let (rec, want) = (&self.records[&key], d.pods[&key]);
        self.node.ns.run(|| nft::check(NET, rec, &want)).unwrap()
    }
}

/// Waits (up to 10 s) until `dev` in `ns` is operationally up.
fn wait_up(ns: &TestNs, dev: &str) {
    for _ in 0..200 {
        let out =
            rcni_testkit::stdout_of(ns.command("ip").args(["-o", "link", "show", "dev", dev]));
        if out.contains("state UP") {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{dev} did not come up");
}

/// A TCP server on `[::]:port` (IPv4 too) in `ns` answering "ok" to every
/// connection, for the rest of the process.
fn serve(ns: &NetNs, port: u16) {
    let l = ns
        .run(move || TcpListener::bind(("::", port)))
        .unwrap()
        .unwrap_or_else(|e| panic!("bind [::]:{port}: {e}"));
    std::thread::spawn(move || {
        for mut s in l.incoming().flatten() {
            let _ = s.write_all(b"ok");
        }
    });
}

/// `web` takes client pods on TCP 8000-8010, the /24 minus 10.77.0.4/30 on
/// TCP 9000; `other` takes anything from `web`; clients may talk to `web`
/// only.
fn policies(web_ports: (u16, u16)) -> Value {
    json!([
        {"name":"web","podSelector":{"matchLabels":{"app":"web"}},"ingress":[
            {"from":[{"podSelector":{"matchLabels":{"app":"client"}}}],
             "ports":[{"port":web_ports.0,"endPort":web_ports.1}]},
            {"from":[{"ipBlock":{"cidr":"10.77.0.0/24","except":["10.77.0.4/30"]}},
                     {"ipBlock":{"cidr":"fd77::/64","except":["fd77::4/126"]}}],
             "ports":[{"port":9000}]}]},
        {"name":"other","podSelector":{"matchLabels":{"app":"other"}},"ingress":[
            {"from":[{"podSelector":{"matchLabels":{"app":"web"}}}]}]},
        {"name":"clients","podSelector":{"matchLabels":{"app":"client"}},"policyTypes":["Egress"],"egress":[
            {"to":[{"podSelector":{"matchLabels":{"app":"web"}}}]}]}
    ])
}

#[test]
fn policies_decide_what_passes_between_bridged_pods() {
    let mut lab = Lab::new();
    lab.add_pod("web", 2, &[("app", "web")]);
    lab.add_pod("client", 3, &[("app", "client")]);
    lab.add_pod("other", 5, &[("app", "other")]);
    // Before any policy everything passes.
    assert!(lab.tcp("other", "web", 8005, false));
    assert!(lab.ping("client", "other"));

    let d = lab.apply(&policies((8000, 8010)));
    assert!(lab.tables().contains("rcni_policy_kube-pods.v1"));
    assert_eq!(lab.sysctl("net.bridge.bridge-nf-call-iptables"), "1");
    assert_eq!(lab.sysctl("net.bridge.bridge-nf-call-ip6tables"), "1");

    // Ingress by identity, within the port range, replies included.
    assert!(lab.tcp("client", "web", 8005, false));
    assert!(lab.tcp("client", "web", 8005, true));
    assert!(
        !lab.tcp("client", "web", 8011, false),
        "outside the port range"
    );
    // ipBlock: the client's address is in the block, other's is excepted.
    assert!(lab.tcp("client", "web", 9000, false));
    assert!(lab.tcp("client", "web", 9000, true));
    assert!(
        !lab.tcp("other", "web", 9000, false),
        "excepted from the ipBlock"
    );
    assert!(
        !lab.tcp("other", "web", 9000, true),
        "excepted from the ipBlock"
    );
    // A pod outside the peer selector.
    assert!(!lab.tcp("other", "web", 8005, false));
    assert!(!lab.tcp("other", "web", 8005, true));
    // All ports and protocols from web to other; pings come back.
    assert!(lab.ping("web", "other"));
    assert!(lab.tcp("web", "other", 8105, true));
    // Egress default deny for clients (other's ingress would refuse too;
    // web's does not, so this is the client's egress at work).
    assert!(!lab.ping("client", "other"));
    assert!(!lab.tcp("client", "web", 8105, false));
    // Unselected directions pass: nothing limits web's egress or the
    // client's ingress.
    assert!(lab.tcp("web", "client", 8105, false));
    assert!(lab.ping("web", "client"));
    for p in ["web", "client", "other"] {
        lab.check(p, &d)
            .unwrap_or_else(|e| panic!("check {p}: {}", e.msg));
    }

    // A pod with known labels is reachable (and limited) right away.
    lab.add_pod("client2", 9, &[("app", "client")]);
    let before = lab.applied.clone();
    let d = lab.apply(&policies((8000, 8010)));
    assert_eq!(
        before["chains"], lab.applied["chains"],
        "no chain rewritten"
    );
    assert!(lab.tcp("client2", "web", 8005, false));
    assert!(lab.tcp("client2", "web", 9000, true));
    assert!(!lab.tcp("client2", "web", 8011, false));
    assert!(!lab.ping("client2", "other"));
    lab.check("client2", &d).unwrap();

    // Editing the policy changes what passes.
    lab.apply(&policies((8100, 8110)));
    assert!(!lab.tcp("client", "web", 8005, false));
    assert!(lab.tcp("client", "web", 8105, false));
    assert!(lab.tcp("client2", "web", 8105, true));

    // No pods left: no table.
    lab.records.clear();
    lab.apply(&policies((8100, 8110)));
    assert!(lab.applied.is_null());
    assert!(!lab.tables().contains("rcni_policy"), "{}", lab.tables());
    assert!(lab.tcp("client", "other", 8005, false));
}

#[test]
fn drift_is_repaired_and_check_reports_it() {
    let mut lab = Lab::new();
    lab.add_pod("web", 2, &[("app", "web")]);
    lab.add_pod("client", 3, &[("app", "client")]);
    let d = lab.apply(&policies((8000, 8010)));
    let table = "rcni_policy_kube-pods.v1";
    let rs = d.pods["web/eth0"].ingress;

    // An element removed behind our back: CHECK says which.
    lab.nft(&format!(
        "delete element inet {table} to_pod4 {{ 10.77.0.2 }}"
    ));
    let e = lab.check("web", &d).unwrap_err();
    assert_eq!(e.code, 106);
    assert!(
        e.msg.contains("to_pod4[10.77.0.2] is absent") && e.msg.contains(&format!("in_{rs}")),
        "{}",
        e.msg
    );
    lab.check("client", &d).unwrap();

    // The whole table gone (a reboot, an admin): the next change finds the
    // kernel unlike `applied` and rewrites everything.
    lab.nft(&format!("delete table inet {table}"));
    assert_eq!(lab.check("web", &d).unwrap_err().code, 106);
    lab.add_pod("other", 5, &[("app", "other")]);
    let d = lab.apply(&policies((8000, 8010)));
    for p in ["web", "client", "other"] {
        lab.check(p, &d)
            .unwrap_or_else(|e| panic!("check {p}: {}", e.msg));
    }
    assert!(!lab.tcp("other", "web", 8005, false));
    assert!(lab.tcp("client", "web", 8005, false));

    // Unreadable `applied`: a full rewrite, same result.
    lab.applied = json!({"garbage": true});
    lab.apply(&policies((8000, 8010)));
    assert!(lab.tcp("client", "web", 8005, true));
    assert!(!lab.tcp("other", "web", 8005, true));

    assert!(lab.node.ns.run(nft::available).unwrap().is_ok());
    lab.node
        .ns
        .run(|| nft::remove_network(NET))
        .unwrap()
        .unwrap();
    assert!(!lab.tables().contains("rcni_policy"));
    // Absent is fine: DEL and GC repeat.
    lab.node
        .ns
        .run(|| nft::remove_network(NET))
        .unwrap()
        .unwrap();
    assert_eq!(lab.check("web", &d).unwrap_err().code, 106);
}

// ---- flow events ---------------------------------------------------------

/// Flow events on, as the network's config would say.
fn flows_on(events: FlowEvents, rate: u32) -> nft::Flows {
    nft::Flows {
        events,
        rate,
        group: nft::nflog_group(NET),
    }
}

impl Lab {
    /// The network's NFLOG source, bound in the node namespace.
    fn source(&self) -> NflogSource {
        self.node
            .ns
            .run(|| NflogSource::open(NET))
            .unwrap()
            .unwrap_or_else(|e| panic!("open source: {}", e.msg))
    }

    /// Tries a TCP connection for `wait` (the SYN retransmitted meanwhile).
    fn tcp_for(&self, from: &str, to: &str, port: u16, wait: Duration) -> bool {
        let addr = SocketAddr::new(self.pod(to).v4, port);
        self.pod(from)
            .ns
            .ns
            .run(move || TcpStream::connect_timeout(&addr, wait).is_ok())
            .unwrap()
    }

    /// Sends `n` UDP datagrams from `from` to `to`:`port`, each from a
    /// new socket (a new source port: a new flow).
    fn udp(&self, from: &str, to: &str, port: u16, n: usize) {
        let addr = SocketAddr::new(self.pod(to).v4, port);
        self.pod(from)
            .ns
            .ns
            .run(move || {
                for _ in 0..n {
                    let s = UdpSocket::bind("0.0.0.0:0").unwrap();
                    let _ = s.send_to(b"x", addr);
                }
            })
            .unwrap();
    }
}

/// Everything `src` reports for `d`.
fn drain(src: &mut NflogSource, d: Duration) -> Vec<RawEvent> {
    let end = Instant::now() + d;
    let mut out = Vec::new();
    while let Some(left) = end.checked_duration_since(Instant::now()) {
        out.extend(src.poll(left.min(Duration::from_millis(100))).unwrap());
    }
    out
}

fn one(events: &[RawEvent], what: &str) -> RawEvent {
    assert_eq!(events.len(), 1, "{what}: {events:#?}");
    events[0].clone()
}

#[test]
fn denials_allows_and_audit_findings_are_reported_once() {
    let mut lab = Lab::new();
    lab.add_pod("web", 2, &[("app", "web")]);
    lab.add_pod("client", 3, &[("app", "client")]);
    lab.add_pod("other", 5, &[("app", "other")]);
    lab.flows = flows_on(FlowEvents::Deny, 10);
    let d = lab.apply(&policies((8000, 8010)));
    let mut src = lab.source();
    let (web, client, other) = (lab.pod("web").v4, lab.pod("client").v4, lab.pod("other").v4);

    // A denied TCP connect, its SYN sent three times in 2.5 s: one event,
    // read within a second.
    let t0 = Instant::now();
    let (ev, first) = std::thread::scope(|s| {
        let conn = s.spawn(|| lab.tcp_for("other", "web", 8005, Duration::from_millis(2500)));
        let mut ev = Vec::new();
        let mut first = None;
        while t0.elapsed() < Duration::from_millis(2800) {
            ev.extend(src.poll(Duration::from_millis(50)).unwrap());
            if first.is_none() && !ev.is_empty() {
                first = Some(t0.elapsed());
            }
        }
        assert!(!conn.join().unwrap(), "denied");
        (ev, first)
    });
    let e = one(&ev, "denied TCP");
    assert!(first.unwrap() < Duration::from_secs(1), "{first:?}");
    assert_eq!(
        (e.verdict, e.dir, e.proto, e.src, e.dst, e.dport),
        (Verdict::Deny, Dir::Ingress, 6, other, web, 8005)
    );
    assert_ne!(e.sport, 0);
    assert_eq!(e.suppressed, 0);

    // A denied UDP datagram, by the sender's egress policy.
    let t0 = Instant::now();
    lab.udp("client", "other", 5353, 1);
    let ev = drain(&mut src, Duration::from_millis(1000));
    let e = one(&ev, "denied UDP");
    assert!(t0.elapsed() >= Duration::from_millis(1000));
    assert_eq!(
        (e.verdict, e.dir, e.proto, e.src, e.dst, e.dport),
        (Verdict::Deny, Dir::Egress, 17, client, other, 5353)
    );
    // A denied ping: ICMP with its type.
    assert!(!lab.ping("client", "other"));
    let ev = drain(&mut src, Duration::from_millis(300));
    assert!(
        ev.iter()
            .all(|e| e.proto == 1 && e.icmp_type == Some(8) && e.dir == Dir::Egress),
        "{ev:#?}"
    );
    assert!(!ev.is_empty());

    // Allowed: nothing with the default "deny".
    assert!(lab.tcp("client", "web", 8005, false));
    assert!(drain(&mut src, Duration::from_millis(500)).is_empty());

    // "all": the new connection, once at each policy that allowed it (the
    // client's egress, web's ingress); its later packets pass on conntrack.
    lab.flows = flows_on(FlowEvents::All, 10);
    lab.apply(&policies((8000, 8010)));
    assert!(lab.tcp("client", "web", 8005, false));
    let mut ev = drain(&mut src, Duration::from_millis(500));
    ev.sort_by_key(|e| e.dir);
    assert_eq!(ev.len(), 2, "{ev:#?}");
    let mut dirs = [Dir::Egress, Dir::Ingress];
    dirs.sort();
    for (e, dir) in ev.iter().zip(dirs) {
        assert_eq!(
            (e.verdict, e.dir, e.proto, e.src, e.dst, e.dport),
            (Verdict::Allow, dir, 6, client, web, 8005)
        );
    }
    // Denials are still reported.
    lab.udp("other", "web", 8005, 1);
    let e = one(&drain(&mut src, Duration::from_millis(300)), "denied");
    assert_eq!((e.verdict, e.proto), (Verdict::Deny, 17));
    for p in ["web", "client", "other"] {
        lab.check(p, &d)
            .unwrap_or_else(|e| panic!("check {p}: {}", e.msg));
    }

    // Audit: what the policies would deny passes and is reported, once
    // per connection.
    lab.audit = true;
    lab.flows = flows_on(FlowEvents::Deny, 10);
    lab.apply(&policies((8000, 8010)));
    assert!(lab.tcp("other", "web", 8005, false), "audit lets it pass");
    assert!(lab.tcp("other", "web", 8005, true));
    let ev = drain(&mut src, Duration::from_millis(500));
    assert_eq!(ev.len(), 2, "{ev:#?}");
    assert!(
        ev.iter().all(|e| e.verdict == Verdict::Audit
            && e.dir == Dir::Ingress
            && e.dport == 8005
            && e.proto == 6),
        "{ev:#?}"
    );
    assert!(ev.iter().any(|e| e.src == other && e.dst == web));
    assert!(ev.iter().any(|e| e.src.is_ipv6()));
    // The client's egress is audit-only too.
    assert!(lab.ping("client", "other"));
}

#[test]
fn a_flood_of_denials_stays_within_the_rate_limit() {
    let mut lab = Lab::new();
    lab.add_pod("web", 2, &[("app", "web")]);
    lab.add_pod("other", 5, &[("app", "other")]);
    let rate = 10;
    lab.flows = flows_on(FlowEvents::Deny, rate);
    lab.apply(&policies((8000, 8010)));
    let mut src = lab.source();
    // A group has one reader: a second source is an error, not a thief.
    let e = lab
        .node
        .ns
        .run(|| NflogSource::open(NET).err())
        .unwrap()
        .expect("a second reader of the group");
    assert!(e.msg.contains("NFLOG group"), "{}", e.msg);
    // The neighbours resolved, the first event out of the way.
    lab.udp("other", "web", 7000, 1);
    let first = drain(&mut src, Duration::from_millis(300));
    assert_eq!(first.len(), 1, "{first:?}\n{}", lab.nft("list ruleset"));
    std::thread::sleep(Duration::from_millis(1100));

    let t0 = Instant::now();
    let n = 2000;
    lab.udp("other", "web", 7000, n);
    let secs = t0.elapsed().as_secs_f64();
    let mut ev = drain(&mut src, Duration::from_millis(1200));
    // One more after the flood carries what was suppressed since the last.
    lab.udp("other", "web", 7001, 1);
    ev.extend(drain(&mut src, Duration::from_millis(500)));
    let suppressed: u64 = ev.iter().map(|e| e.suppressed).sum();
    let max = (f64::from(rate) * (secs + 2.8)).ceil() as usize + rate as usize;
    assert!(
        ev.len() <= max,
        "{} events in {secs:.2} s (+1.7 s): more than {max}",
        ev.len()
    );
    assert!(ev.len() >= rate as usize, "{} events", ev.len());
    assert!(
        ev.iter()
            .all(|e| e.verdict == Verdict::Deny && e.dir == Dir::Ingress && e.proto == 17)
    );
    // Every datagram is an event or counted (a source port reused in the
    // flood is one flow: not counted twice).
    let total = ev.len() as u64 + suppressed;
    assert!(
        suppressed > 0 && total <= n as u64 + 1 && total >= (n as u64) * 9 / 10,
        "{} events, {suppressed} suppressed, of {n} datagrams",
        ev.len()
    );
}
