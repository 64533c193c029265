//! The routed fabric of the BGP tests (`"backend": "bgp"`): racks of nodes,
//! each rack one underlay subnet on a bridge in its top-of-rack router's
//! namespace (ToR). The ToRs run BIRD 2 with a config the test writes, not
//! the agent's: they peer with each other over eBGP on a link of their own
//! and with their rack's nodes (an AS per node, Calico's "AS per compute
//! server"), graceful restart on. Routers here are real ones no one here
//! wrote, so the agent's BGP is checked against what a fabric does, not
//! against our idea of it. Also: extra BIRD peers on a rack (a peer that
//! announces what it should not), a rack that is only a switch (the
//! agents' full mesh on one L2), and the agents run as daemons with their
//! stderr kept.
//!
//! No route is written on a node by the lab: a node has the connected
//! subnet of its address only (and a default route via its ToR when a test
//! asks for one, as underlay config).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::lab::cluster::{ClusterNode, subnet};
use crate::{ip, nl};
use rcni_netlink::Family;
use rcni_netns::NetNs;
use rcni_testkit::{Bpffs, TestNs, command_in, tied_command_in, wait_while_running};
use serde_json::{Value, json};

/// The ToR of rack `r` is AS `65001 + r`.
pub fn tor_as(r: usize) -> u32 {
    65001 + r as u32
}

/// Node i (from 0) is AS `65101 + i` ("AS per compute server").
pub fn node_as(i: usize) -> u32 {
    65101 + i as u32
}

/// The IPv6 underlay of rack `r`: `fd50::/64`, `fd60::/64`.
pub fn subnet6(r: usize) -> String {
    format!("fd{}::", 50 + 10 * r)
}

/// The ToR's address on its rack: `.254` and `::fe`.
pub fn tor_address(r: usize, v6: bool) -> String {
    if v6 {
        format!("{}fe", subnet6(r))
    } else {
        format!("{}.254", subnet(r))
    }
}

/// Node i's IPv4 pod subnet, as [`Cluster`](crate::lab::cluster::Cluster).
pub fn pod_cidr(i: usize) -> String {
    format!("10.244.{}.0/24", i + 1)
}

/// Node i's IPv6 pod subnet (in `fd00::/48`).
pub fn pod_cidr6(i: usize) -> String {
    format!("fd00:0:0:{}::/64", i + 1)
}

/// The agents' route protocol in the main table (RTPROT_RCNI).
pub const RTPROT_RCNI: u8 = 0x52;
/// The kernel table BIRD's kernel protocol writes the learned routes to.
pub const BIRD_TABLE: u32 = 252;
/// How long BGP may take to converge or a change to cross the fabric: the
/// ToRs retry every second, and the bound is for a loaded machine.
pub const CONVERGE: Duration = Duration::from_secs(20);

/// A BIRD 2 daemon (Debian's bird2) in a namespace, in the foreground, tied
/// to the test ([`tied_command_in`]), its log (stderr) kept.
pub struct Bird {
    child: Child,
    log: Arc<Mutex<String>>,
    pub sock: PathBuf,
    dir: tempfile::TempDir,
}

impl Bird {
    /// Starts BIRD with `conf` in `ns`; returns once its control socket
    /// answers (panics with its log when it exits first: a config error).
    pub fn start(ns: &NetNs, conf: &str) -> Bird {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("bird.conf");
        std::fs::write(&file, conf).unwrap();
        let sock = dir.path().join("bird.ctl");
        let mut child = tied_command_in(ns, "bird")
            .arg("-f")
            .arg("-c")
            .arg(&file)
            .arg("-s")
            .arg(&sock)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("bird (apt-get install bird2)");
        let log = keep_log(child.stderr.take().unwrap());
        let ready = wait_while_running(&mut child, Duration::from_secs(10), || {
            birdc_run(ns, &sock, "show status")
                .is_some_and(|o| o.contains("Daemon is up"))
                .then_some(())
        });
        if let Err(e) = ready {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "bird {e}:\n{}\nconfig:\n{conf}",
                log.lock().unwrap().as_str()
            );
        }
        Bird {
            child,
            log,
            sock,
            dir,
        }
    }

    /// What BIRD logged so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Replaces the config and has BIRD apply it (`configure`: sessions
    /// whose settings did not change stay up).
    pub fn reconfigure(&self, ns: &NetNs, conf: &str) {
        std::fs::write(self.dir.path().join("bird.conf"), conf).unwrap();
        let out = birdc(ns, &self.sock, "configure");
        assert!(out.contains("Reconfigured"), "{out}");
    }
}

impl Drop for Bird {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A thread that appends what `r` says (a daemon's stderr) to a string.
fn keep_log(r: impl std::io::Read + Send + 'static) -> Arc<Mutex<String>> {
    let log = Arc::new(Mutex::new(String::new()));
    let l = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { return };
            let mut l = l.lock().unwrap();
            l.push_str(&line);
            l.push('\n');
        }
    });
    log
}

/// `birdc -s SOCK CMD` in `ns`: its output, or None when BIRD does not
/// answer.
fn birdc_run(ns: &NetNs, sock: &Path, cmd: &str) -> Option<String> {
    let out = command_in(ns, "birdc")
        .arg("-s")
        .arg(sock)
        .args(cmd.split_whitespace())
        .stdin(Stdio::null())
        .output()
        .expect("birdc (apt-get install bird2)");
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `birdc -s SOCK CMD` in `ns` (a ToR's, or a node's for the agent's BIRD).
pub fn birdc(ns: &NetNs, sock: &Path, cmd: &str) -> String {
    birdc_run(ns, sock, cmd).unwrap_or_else(|| panic!("birdc -s {} {cmd}", sock.display()))
}

/// The prefixes of a `show route` answer (every table it lists), in Rust's
/// spelling of addresses (`fd00:0:0:3::/64`).
pub fn parse_prefixes(out: &str) -> BTreeSet<String> {
    out.lines()
        .filter(|l| !l.starts_with(char::is_whitespace))
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(normalize_prefix)
        .collect()
}

fn normalize_prefix(s: &str) -> Option<String> {
    let (a, len) = s.split_once('/')?;
    let a: IpAddr = a.parse().ok()?;
    let len: u8 = len.parse().ok()?;
    Some(format!("{a}/{len}"))
}

/// A `show protocols` answer: protocol name -> (state, info), info being
/// what follows the time (for BGP: `Established`, `Active`, `Connect`...,
/// then the last error if any).
pub fn parse_protocols(out: &str) -> BTreeMap<String, (String, String)> {
    out.lines()
        .skip_while(|l| !l.starts_with("Name"))
        .skip(1)
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w.len() >= 5).then(|| (w[0].to_string(), (w[3].to_string(), w[5..].join(" "))))
        })
        .collect()
}

/// A router namespace with BIRD: a rack's ToR (also the bridge of its
/// rack's nodes), or another BGP speaker a test puts on a rack. A ToR of a
/// rack that is only a switch has no BIRD.
pub struct Router {
    pub bird: Option<Bird>,
    pub ns: TestNs,
    pub asn: u32,
}

impl Router {
    fn bird(&self) -> &Bird {
        self.bird.as_ref().expect("a router with BIRD")
    }

    pub fn birdc(&self, cmd: &str) -> String {
        birdc(&self.ns.ns, &self.bird().sock, cmd)
    }

    /// Every prefix in the router's BIRD tables (`show route`).
    pub fn prefixes(&self) -> BTreeSet<String> {
        parse_prefixes(&self.birdc("show route"))
    }

    /// The prefixes learned from protocol `proto` (`show route protocol`).
    pub fn prefixes_from(&self, proto: &str) -> BTreeSet<String> {
        parse_prefixes(&self.birdc(&format!("show route protocol {proto}")))
    }

    /// The router's pod prefixes (`10.244.`, `fd00:`).
    pub fn pod_prefixes(&self) -> BTreeSet<String> {
        self.prefixes()
            .into_iter()
            .filter(|p| p.starts_with("10.244.") || p.starts_with("fd00:"))
            .collect()
    }

    pub fn protocols(&self) -> BTreeMap<String, (String, String)> {
        parse_protocols(&self.birdc("show protocols"))
    }

    /// Whether BGP protocol `proto`'s session is established.
    pub fn established(&self, proto: &str) -> bool {
        self.protocols()
            .get(proto)
            .is_some_and(|(_, info)| info.starts_with("Established"))
    }

    /// Waits until every BGP session in `protos` is established.
    pub fn wait_established(&self, protos: &[&str]) {
        let ok = rcni_testkit::poll(CONVERGE, || protos.iter().all(|p| self.established(p)));
        assert!(
            ok,
            "sessions {protos:?} not established:\n{}\n{}",
            self.birdc("show protocols"),
            self.bird().log()
        );
    }

    pub fn log(&self) -> String {
        self.bird().log()
    }
}

/// Timers shorter than BIRD's defaults (connect delay 5 s, retry 120 s,
/// error wait 60 s): a ToR tries a node whose BIRD is not up yet again
/// within a second, not minutes later. Graceful restart (RFC 4724): a
/// node's restarting speaker keeps its routes on the ToR.
const TIMERS: &str = "template bgp fabric {
  graceful restart on;
  connect delay time 1;
  connect retry time 1;
  error wait time 1, 2;
}
";

/// The pod prefixes a ToR takes from nodes and gives them: `network` and
/// `network6` and their subnets, nothing else (a node announcing more is a
/// bad node; a ToR does not hand out the underlay).
const FILTERS: &str = "filter pods4 { if net ~ [ 10.244.0.0/16{16,32} ] then accept; reject; }
filter pods6 { if net ~ [ fd00::/48{48,128} ] then accept; reject; }
filter fabric4 { if net ~ [ 10.244.0.0/16{16,32}, 192.168.50.0/24, 192.168.60.0/24 ] then accept; reject; }
filter fabric6 { if net ~ [ fd00::/48{48,128}, fd50::/64, fd60::/64 ] then accept; reject; }
";

/// The address families of a fabric's nodes (underlay and pods).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stack {
    V4,
    Dual,
    /// No IPv4 on the nodes: IPv6 addresses, pod subnets and sessions only
    /// (the ToRs keep theirs: the routers' business).
    V6,
}

impl Stack {
    pub fn v4(self) -> bool {
        self != Stack::V6
    }

    pub fn v6(self) -> bool {
        self != Stack::V4
    }
}

/// A ToR's BIRD config: its rack subnet(s) from `direct`, learned routes
/// into its kernel (it forwards the pods' traffic), eBGP to the other ToR
/// (pods and rack subnets) and to each node of its rack (pods only), in
/// each family the nodes have.
fn tor_conf(r: usize, racks: usize, nodes: &[usize], stack: Stack) -> String {
    let asn = tor_as(r);
    let mut c = format!(
        "log stderr all;
router id 192.168.255.{};
protocol device {{ }}
protocol direct {{ ipv4; ipv6; interface \"rack\"; }}
protocol kernel {{ ipv4 {{ import none; export where source = RTS_BGP; }}; }}
protocol kernel {{ ipv6 {{ import none; export where source = RTS_BGP; }}; }}
{FILTERS}{TIMERS}",
        r + 1
    );
    if racks == 2 {
        let o = 1 - r;
        c += &format!(
            "protocol bgp tor{o1} from fabric {{
  local 192.168.255.{me} as {asn}; neighbor 192.168.255.{peer} as {oas};
  ipv4 {{ import filter fabric4; export filter fabric4; }};
}}
protocol bgp tor{o1}v6 from fabric {{
  local fdff::{me} as {asn}; neighbor fdff::{peer} as {oas};
  ipv6 {{ import filter fabric6; export filter fabric6; }};
}}
",
            o1 = o + 1,
            me = r + 1,
            peer = o + 1,
            oas = tor_as(o)
        );
    }
    for &i in nodes.iter().filter(|_| stack.v4()) {
        c += &format!(
            "protocol bgp n{n} from fabric {{
  local {me} as {asn}; neighbor {s}.{n} as {nas};
  ipv4 {{ import filter pods4; export filter pods4; }};
}}
",
            n = i + 1,
            me = tor_address(r, false),
            s = subnet(r),
            nas = node_as(i)
        );
    }
    for &i in nodes.iter().filter(|_| stack.v6()) {
        c += &format!(
            "protocol bgp n{n}v6 from fabric {{
  local {me} as {asn}; neighbor {s}{n} as {nas};
  ipv6 {{ import filter pods6; export filter pods6; }};
}}
",
            n = i + 1,
            me = tor_address(r, true),
            s = subnet6(r),
            nas = node_as(i)
        );
    }
    c
}

/// Racks of nodes behind ToRs (or one switch), as [`Fabric::routed`] and
/// [`Fabric::one_l2`] build them.
pub struct Fabric {
    pub tors: Vec<Router>,
    pub nodes: Vec<ClusterNode>,
    /// The rack of each node.
    pub rack_of: Vec<usize>,
    /// The nodes' families.
    pub stack: Stack,
    /// Whether the ToRs run BIRD (false: the racks are switches).
    pub routed: bool,
    pub file: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Fabric {
    /// Nodes `n1..` in racks `placement[i]` (0 or 1) behind ToRs running
    /// BIRD, the ToRs' sessions with each other established on return.
    /// Node i is `<subnet>.<i+1>` and/or `fdX0::<i+1>`, by `stack`.
    pub fn routed(placement: &[usize], stack: Stack) -> Fabric {
        Fabric::build(placement, stack, true)
    }

    /// `n` nodes on one L2, a switch and no router: what the agents' full
    /// mesh needs and all it has.
    pub fn one_l2(n: usize) -> Fabric {
        Fabric::build(&vec![0; n], Stack::V4, false)
    }

    fn build(placement: &[usize], stack: Stack, routed: bool) -> Fabric {
        let racks = placement.iter().max().map_or(1, |m| m + 1);
        assert!(racks <= 2, "one or two racks");
        let mut tors = Vec::new();
        for r in 0..racks {
            let ns = TestNs::new();
            ip(&ns.ns, "link set lo up");
            ip(&ns.ns, "link add rack type bridge");
            ip(&ns.ns, "link set rack up");
            if routed {
                ip(
                    &ns.ns,
                    &format!("addr add {}/24 dev rack", tor_address(r, false)),
                );
                ip(
                    &ns.ns,
                    &format!("addr add {}/64 dev rack nodad", tor_address(r, true)),
                );
                rcni_netlink::sysctl::set(&ns.ns, "net.ipv4.ip_forward", "1").unwrap();
                rcni_netlink::sysctl::set(&ns.ns, "net.ipv6.conf.all.forwarding", "1").unwrap();
            }
            tors.push(Router {
                bird: None,
                ns,
                asn: tor_as(r),
            });
        }
        if racks == 2 {
            nl(&tors[0].ns.ns, async |n| {
                n.create_veth("fab", "fab", Some(&tors[1].ns.ns), None)
                    .await
                    .unwrap()
            });
            for (r, t) in tors.iter().enumerate() {
                ip(
                    &t.ns.ns,
                    &format!("addr add 192.168.255.{}/30 dev fab", r + 1),
                );
                ip(
                    &t.ns.ns,
                    &format!("addr add fdff::{}/64 dev fab nodad", r + 1),
                );
                ip(&t.ns.ns, "link set fab up");
            }
        }
        let mut nodes = Vec::new();
        for (i, &r) in placement.iter().enumerate() {
            let ns = TestNs::new();
            let port = format!("n{}", i + 1);
            nl(&tors[r].ns.ns, async |n| {
                n.create_veth(&port, "eth0", Some(&ns.ns), None)
                    .await
                    .unwrap()
            });
            ip(&tors[r].ns.ns, &format!("link set {port} master rack up"));
            ip(&ns.ns, "link set lo up");
            ip(&ns.ns, "link set eth0 up");
            if stack.v4() {
                ip(
                    &ns.ns,
                    &format!("addr add {}.{}/24 dev eth0", subnet(r), i + 1),
                );
            }
            if stack.v6() {
                ip(
                    &ns.ns,
                    &format!("addr add {}{}/64 dev eth0 nodad", subnet6(r), i + 1),
                );
            }
            nodes.push(ClusterNode {
                name: format!("n{}", i + 1),
                ns,
                dir: tempfile::tempdir().unwrap(),
                bpffs: Bpffs::mount(),
            });
        }
        if routed {
            for (r, t) in tors.iter_mut().enumerate() {
                let mine: Vec<usize> = (0..placement.len())
                    .filter(|&i| placement[i] == r)
                    .collect();
                t.bird = Some(Bird::start(&t.ns.ns, &tor_conf(r, racks, &mine, stack)));
            }
            if racks == 2 {
                tors[0].wait_established(&["tor2", "tor2v6"]);
                tors[1].wait_established(&["tor1", "tor1v6"]);
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cluster.json");
        Fabric {
            tors,
            nodes,
            rack_of: placement.to_vec(),
            stack,
            routed,
            file,
            dir,
        }
    }

    /// Node i's underlay address.
    pub fn address(&self, i: usize) -> String {
        format!("{}.{}", subnet(self.rack_of[i]), i + 1)
    }

    pub fn address6(&self, i: usize) -> String {
        format!("{}{}", subnet6(self.rack_of[i]), i + 1)
    }

    /// The ToR of node i's rack.
    pub fn tor_of(&self, i: usize) -> &Router {
        &self.tors[self.rack_of[i]]
    }

    /// Node i's `peers`: its ToR, over each family the node has.
    pub fn tor_peers(&self, i: usize) -> Value {
        let r = self.rack_of[i];
        let mut v = Vec::new();
        if self.stack.v4() {
            v.push(json!({"peerIP": tor_address(r, false), "asNumber": tor_as(r)}));
        }
        if self.stack.v6() {
            v.push(json!({"peerIP": tor_address(r, true), "asNumber": tor_as(r)}));
        }
        Value::Array(v)
    }

    /// The cluster file with the nodes `which`, `"backend": "bgp"` and
    /// `bgp` as the `"bgp"` object; behind ToRs each node has its own AS and
    /// its ToR as peer.
    pub fn write(&self, which: &[usize], bgp: Value) {
        self.write_with(which, bgp, |_, _| {});
    }

    /// [`Fabric::write`], then `edit(i, node entry)` for each node.
    pub fn write_with(&self, which: &[usize], bgp: Value, edit: impl Fn(usize, &mut Value)) {
        let nodes: Vec<Value> = which
            .iter()
            .map(|&i| {
                let mut n = match self.stack {
                    Stack::V4 => json!({"name": self.nodes[i].name, "address": self.address(i),
                                        "podCIDR": pod_cidr(i)}),
                    Stack::Dual => json!({"name": self.nodes[i].name,
                                          "address": self.address(i),
                                          "address6": self.address6(i),
                                          "podCIDRs": [pod_cidr(i), pod_cidr6(i)]}),
                    // IPv6-only: the IPv6 address and subnet in the keys
                    // of an IPv4 cluster.
                    Stack::V6 => json!({"name": self.nodes[i].name,
                                        "address": self.address6(i),
                                        "podCIDR": pod_cidr6(i)}),
                };
                if self.routed {
                    n["asNumber"] = json!(node_as(i));
                    n["peers"] = self.tor_peers(i);
                }
                edit(i, &mut n);
                n
            })
            .collect();
        let mut c = json!({"network": "10.244.0.0/16", "backend": "bgp", "bgp": bgp,
                           "nodes": nodes});
        match self.stack {
            Stack::V4 => {}
            Stack::Dual => c["network6"] = json!("fd00::/48"),
            Stack::V6 => c["network"] = json!("fd00::/48"),
        }
        std::fs::write(&self.file, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
    }

    /// The pod prefixes of nodes `which`, of each family they have.
    pub fn pod_prefixes(&self, which: &[usize]) -> BTreeSet<String> {
        let mut s = BTreeSet::new();
        for &i in which {
            if self.stack.v4() {
                s.insert(pod_cidr(i));
            }
            if self.stack.v6() {
                s.insert(pod_cidr6(i));
            }
        }
        s
    }

    /// Waits until BGP has converged for the nodes `which`, whose agents
    /// are `agents` (same order): every ToR holds their pod prefixes and
    /// nothing more of the pods' networks, and each node's main table has
    /// exactly the others' as the agent's routes. Panics with what the ToRs
    /// and the agents said.
    pub fn wait_converged(&self, which: &[usize], agents: &[Agent]) {
        let all = self.pod_prefixes(which);
        let tors_ok = || !self.routed || self.tors.iter().all(|t| t.pod_prefixes() == all);
        let nodes_ok = || {
            which.iter().all(|&i| {
                let others: Vec<usize> = which.iter().copied().filter(|&j| j != i).collect();
                rcni_prefixes(&self.nodes[i].ns.ns) == self.pod_prefixes(&others)
            })
        };
        if rcni_testkit::poll(CONVERGE, || tors_ok() && nodes_ok()) {
            return;
        }
        let mut msg = format!("BGP did not converge for nodes {which:?} (want {all:?})\n");
        if self.routed {
            for (r, t) in self.tors.iter().enumerate() {
                msg += &format!(
                    "ToR {}: {:?}\n{}{}\n",
                    r + 1,
                    t.pod_prefixes(),
                    t.birdc("show protocols"),
                    t.log()
                );
            }
        }
        for (k, &i) in which.iter().enumerate() {
            msg += &format!(
                "{}: {:?}\n--- agent log:\n{}\n",
                self.nodes[i].name,
                rcni_routes(&self.nodes[i].ns.ns),
                agents.get(k).map(Agent::log).unwrap_or_default()
            );
        }
        panic!("{msg}");
    }

    /// A default route on every node via its ToR: underlay config a test
    /// adds when the nodes must reach the other rack's addresses (VXLAN
    /// across racks), not the pods' path.
    pub fn add_default_routes(&self) {
        for (i, n) in self.nodes.iter().enumerate() {
            let r = self.rack_of[i];
            if self.stack.v4() {
                ip(
                    &n.ns.ns,
                    &format!("route add default via {}", tor_address(r, false)),
                );
            }
            if self.stack.v6() {
                ip(
                    &n.ns.ns,
                    &format!("-6 route add default via {}", tor_address(r, true)),
                );
            }
        }
    }

    /// Another BGP speaker on rack `r` at `<subnet>.<host>`: AS `asn`,
    /// announcing `routes` (BIRD static routes: `172.16.0.0/24
    /// blackhole`) to each of `neighbours` (address, AS) and taking
    /// nothing. The test's stand-in for a misconfigured or hostile peer.
    pub fn add_speaker(
        &self,
        r: usize,
        host: u8,
        asn: u32,
        routes: &[&str],
        neighbours: &[(String, u32)],
    ) -> Router {
        let ns = TestNs::new();
        let port = format!("s{host}");
        nl(&self.tors[r].ns.ns, async |n| {
            n.create_veth(&port, "eth0", Some(&ns.ns), None)
                .await
                .unwrap()
        });
        ip(
            &self.tors[r].ns.ns,
            &format!("link set {port} master rack up"),
        );
        ip(&ns.ns, "link set lo up");
        ip(&ns.ns, "link set eth0 up");
        let me = format!("{}.{host}", subnet(r));
        ip(&ns.ns, &format!("addr add {me}/24 dev eth0"));
        let mut c = format!(
            "log stderr all;
router id {me};
protocol device {{ }}
protocol static {{ ipv4; {} }}
{TIMERS}",
            routes
                .iter()
                .map(|s| format!("route {s}; "))
                .collect::<String>()
        );
        for (k, (addr, nas)) in neighbours.iter().enumerate() {
            c += &format!(
                "protocol bgp peer{k} from fabric {{
  local {me} as {asn}; neighbor {addr} as {nas};
  ipv4 {{ import none; export all; }};
}}
"
            );
        }
        let bird = Bird::start(&ns.ns, &c);
        Router {
            bird: Some(bird),
            ns,
            asn,
        }
    }
}

/// `rcni-node run` on a node as a daemon (`--poll-ms 20`), its stderr (the
/// agent's and its BIRD's) kept; killed on drop.
pub struct Agent {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Agent {
    pub fn start(node: &ClusterNode, file: &Path) -> Agent {
        let mut child = node
            .agent(file)
            .args(["--poll-ms", "20"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = keep_log(child.stderr.take().unwrap());
        Agent { child, log }
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Whether the agent still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL: no chance to clean up anything.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The agent's BIRD control socket on a node (`<state-dir>/bird/bird.ctl`).
pub fn node_bird_sock(node: &ClusterNode) -> PathBuf {
    node.dir.path().join("state/bird/bird.ctl")
}

/// The routes of `table` (main: 254) in a node, both families, as
/// `dst via gw dev NAME proto N` (`via` and `dev` when set).
pub fn table_routes(ns: &NetNs, table: u32) -> BTreeSet<String> {
    nl(ns, async |n| {
        let names: BTreeMap<u32, String> = n
            .links()
            .await
            .unwrap()
            .into_iter()
            .map(|l| (l.index, l.name))
            .collect();
        n.routes_in_table(Family::All, Some(table))
            .await
            .unwrap()
            .iter()
            .filter(|r| !r.dst.ip().to_string().starts_with("fe80"))
            .map(|r| {
                let mut s = r.dst.to_string();
                if let Some(g) = r.gateway {
                    s += &format!(" via {g}");
                }
                if let Some(d) = r.oif.and_then(|o| names.get(&o)) {
                    s += &format!(" dev {d}");
                }
                s + &format!(" proto {}", r.protocol.unwrap_or(0))
            })
            .collect()
    })
}

/// The agent's routes in a node's main table (proto 0x52), as
/// `dst via gw dev NAME`.
pub fn rcni_routes(ns: &NetNs) -> BTreeSet<String> {
    let tail = format!(" proto {RTPROT_RCNI}");
    table_routes(ns, 254)
        .into_iter()
        .filter_map(|r| r.strip_suffix(&tail).map(str::to_string))
        .collect()
}

/// The destinations of [`rcni_routes`].
pub fn rcni_prefixes(ns: &NetNs) -> BTreeSet<String> {
    rcni_routes(ns)
        .iter()
        .map(|r| r.split(' ').next().unwrap().to_string())
        .collect()
}

/// Every route of every table in `ns` (`ip route show table all`, both
/// families), as text: for what must never be anywhere.
pub fn all_routes_text(ns: &NetNs) -> String {
    let mut s = String::new();
    for fam in ["-4", "-6"] {
        let out = command_in(ns, "ip")
            .args([fam, "route", "show", "table", "all"])
            .output()
            .unwrap();
        s.push_str(&String::from_utf8_lossy(&out.stdout));
    }
    s
}

/// The names of the tunnel devices (VXLAN, WireGuard) in `ns`.
pub fn tunnels(ns: &NetNs) -> Vec<String> {
    let out = command_in(ns, "ip")
        .args(["-d", "-j", "link", "show"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(json!([]));
    v.as_array()
        .into_iter()
        .flatten()
        .filter(|l| {
            matches!(
                l["linkinfo"]["info_kind"].as_str(),
                Some("vxlan" | "wireguard")
            )
        })
        .map(|l| l["ifname"].as_str().unwrap_or("").to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_birds_answers() {
        let routes = "BIRD 2.0.12 ready.
Table master4:
10.244.1.0/24        unicast [n1 00:31:02.123] * (100) [AS65101i]
\tvia 192.168.50.1 on rack
                     unicast [tor2 00:31:03.000] (100) [AS65002i]
\tvia 192.168.255.2 on fab
192.168.60.0/24      unicast [tor2 00:31:01] * (100) [AS65002i]

Table master6:
fd00:0:0:3::/64      unicast [tor2v6 00:31:05] * (100) [AS65002i]
";
        assert_eq!(
            parse_prefixes(routes),
            BTreeSet::from([
                "10.244.1.0/24".to_string(),
                "192.168.60.0/24".to_string(),
                "fd00:0:0:3::/64".to_string()
            ])
        );
        let protos = "BIRD 2.0.12 ready.
Name       Proto      Table      State  Since         Info
device1    Device     ---        up     00:31:00.000  
n1         BGP        ---        start  00:31:00.000  Active        Socket: Connection refused
tor2       BGP        ---        up     00:31:01.000  Established   
";
        let p = parse_protocols(protos);
        assert_eq!(p["tor2"], ("up".to_string(), "Established".to_string()));
        assert_eq!(p["n1"].1, "Active Socket: Connection refused");
        assert_eq!(p["device1"].1, "");
    }
}
