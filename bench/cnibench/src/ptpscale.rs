//! ptpscale: ptp's ADD and DEL latency on a node holding few pods against
//! one holding many (issue 20: with 1000 pods at most 1.5x the time with
//! 10). ptp gives each pod a veth and host routes, no bridge port: any
//! growth with the pod count is ptp's own (a dump of every link or route
//! per ADD, say), not the bridge's per-port kernel work. Ours and the
//! reference (if present) in the same run, each on two nodes of its own
//! (few pods, many pods) sampled in turn, so that drift of the machine over
//! the run does not land on one side of the ratio.
//! The "kernel" rows time the kernel work alone on each node, at both sizes
//! (see `floor`): what no ptp can avoid with the node's ends it makes.

use clap::Parser;
use rcni_bench::{call, pct};
use rcni_netns::NetNs;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

#[derive(Parser)]
#[command(about = "ptp ADD/DEL latency with few and with many pods on the node")]
struct Args {
    /// Directory with our plugins.
    #[arg(long, default_value = "target/release")]
    ours: PathBuf,
    /// Directory with the reference plugins (skipped if it has no ptp).
    #[arg(long, default_value = "/usr/lib/cni")]
    reference: PathBuf,
    /// Pods on the node for the small measurement.
    #[arg(long, default_value_t = 10)]
    few: usize,
    /// Pods on the node for the large one.
    #[arg(long, default_value_t = 1000)]
    many: usize,
    /// Timed ADD+DEL pairs at each size.
    #[arg(long, default_value_t = 40)]
    samples: usize,
}

struct Node {
    label: String,
    plugins: PathBuf,
    node: NetNs,
    _state: tempfile::TempDir,
    conf: Value,
    pods: Vec<(NetNs, String)>,
    n: usize,
}

impl Node {
    fn new(label: &str, plugins: &Path) -> Node {
        let state = tempfile::Builder::new()
            .prefix("rcni-ptpscale-")
            .tempdir()
            .unwrap();
        let conf = json!({"cniVersion": "1.0.0", "name": "ptpnet", "type": "ptp", "mtu": 1500,
            "ipam": {"type": "host-local", "dataDir": state.path().join("ipam"),
                     "ranges": [[{"subnet": "10.92.0.0/16"}]],
                     "routes": [{"dst": "0.0.0.0/0"}]}});
        Node {
            label: label.into(),
            plugins: plugins.to_path_buf(),
            node: NetNs::new_anonymous().expect("node namespace"),
            _state: state,
            conf,
            pods: Vec::new(),
            n: 0,
        }
    }

    /// One call: (success, µs).
    fn cmd(&self, op: &str, cid: &str, pod: &NetNs) -> (bool, f64) {
        let path = pod.proc_path().display().to_string();
        let (_, ok, us) = call(
            &self.node,
            &self.plugins.join("ptp"),
            &self.plugins,
            op,
            cid,
            &path,
            &self.conf,
        );
        (ok, us)
    }

    /// Adds pods (4 at a time) until the node holds `n`.
    fn fill(&mut self, n: usize) {
        while self.pods.len() < n {
            let k = (n - self.pods.len()).min(4);
            let batch: Vec<(NetNs, String)> = (0..k)
                .map(|_| {
                    self.n += 1;
                    (
                        NetNs::new_anonymous().expect("pod namespace"),
                        format!("fill{:05}", self.n),
                    )
                })
                .collect();
            let me = &*self;
            std::thread::scope(|s| {
                for (pod, cid) in &batch {
                    s.spawn(move || {
                        assert!(me.cmd("ADD", cid, pod).0, "{}: fill ADD failed", me.label)
                    });
                }
            });
            self.pods.extend(batch);
        }
    }

    /// An ADD of a new pod, then its DEL: µs of each.
    fn sample(&mut self) -> (f64, f64) {
        self.n += 1;
        let cid = format!("probe{:05}", self.n);
        let pod = NetNs::new_anonymous().expect("pod namespace");
        let (ok, add) = self.cmd("ADD", &cid, &pod);
        assert!(ok, "{}: ADD failed", self.label);
        let (ok, del) = self.cmd("DEL", &cid, &pod);
        assert!(ok, "{}: DEL failed", self.label);
        (add, del)
    }
}

/// The kernel's part alone, the floor of any ptp: what ptp asks of the
/// kernel for an IPv4 pod, without a plugin, a process or IPAM: a veth made
/// from a new pod's namespace with its peer in the node, the pod's end up
/// with its address (from `k`), the node's end up with the gateway address
/// and a host route to the pod; then the pod's end deleted: µs of each. With
/// `ipv6` the node's end keeps IPv6 (a link-local address and its routes, as
/// the reference leaves it), else it is turned off first (`disable_ipv6`,
/// as our ptp does for an IPv4-only pod).
fn floor(rt: &tokio::runtime::Runtime, node: &NetNs, k: usize, ipv6: bool) -> (f64, f64) {
    use rcni_netlink::{Netlink, Route};
    let gw: ipnetwork::IpNetwork = "10.93.255.254/32".parse().unwrap();
    let pod = NetNs::new_anonymous().expect("pod namespace");
    let addr: ipnetwork::IpNetwork = format!("10.93.{}.{}/32", k / 250, k % 250 + 1)
        .parse()
        .unwrap();
    let t = std::time::Instant::now();
    let eth0 = rt.block_on(async {
        let (p, n) = (
            Netlink::connect(&pod).await.unwrap(),
            Netlink::connect(node).await.unwrap(),
        );
        let peer = format!("vfloor{k}");
        let eth0 = p
            .create_veth("eth0", &peer, Some(node), Some(1500))
            .await
            .unwrap();
        p.set_up(eth0.index).await.unwrap();
        p.add_address(eth0.index, addr).await.unwrap();
        let host = n.link_by_name(&peer).await.unwrap();
        if !ipv6 {
            let key = format!("net/ipv6/conf/{peer}/disable_ipv6");
            rcni_netlink::sysctl::set(node, &key, "1").unwrap();
        }
        n.set_up(host.index).await.unwrap();
        n.add_address(host.index, gw).await.unwrap();
        n.add_route(&Route::new(addr).oif(host.index))
            .await
            .unwrap();
        eth0.index
    });
    let add = t.elapsed().as_secs_f64() * 1e6;
    let t = std::time::Instant::now();
    rt.block_on(async {
        let p = Netlink::connect(&pod).await.unwrap();
        p.delete_link(eth0).await.unwrap();
    });
    (add, t.elapsed().as_secs_f64() * 1e6)
}

/// µs per command on one node: ptp's ADD and DEL, the kernel floor's.
#[derive(Default)]
struct Samples {
    add: Vec<f64>,
    del: Vec<f64>,
    floor_add: Vec<f64>,
    floor_del: Vec<f64>,
}

fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
}

fn main() {
    let a = Args::parse();
    raise_fd_limit();
    let mut setups = vec![("rcni", a.ours.clone())];
    if a.reference.join("ptp").is_file() {
        setups.push(("reference", a.reference.clone()));
    }
    println!(
        "ptp + host-local, two nodes each; {} timed ADD+DEL pairs with {} and with {} pods on the node, in turn",
        a.samples, a.few, a.many
    );
    println!(
        "{:<10} {:>6} {:>10} {:>10} {:>10} {:>10}",
        "", "pods", "ADD p50", "ADD p90", "DEL p50", "DEL p90"
    );
    let mut worst: f64 = 0.0;
    for (label, dir) in setups {
        // Two nodes of the suite, one holding `few` pods and one `many`,
        // sampled in turn (which goes first alternating), so that whatever
        // the machine does meanwhile weighs on both sides of the ratio.
        let mut small = Node::new(label, &dir);
        small.fill(a.few);
        let mut big = Node::new(label, &dir);
        big.fill(a.many);
        // The kernel floor as each ptp leaves the node's ends: ours without
        // IPv6 for an IPv4 pod, the reference's with it.
        let ipv6 = label != "rcni";
        let rt = rcni_netlink::runtime().unwrap();
        let mut nodes = [(small, Samples::default()), (big, Samples::default())];
        for i in 0..a.samples {
            for j in [i % 2, 1 - i % 2] {
                let (node, s) = &mut nodes[j];
                let (add, del) = node.sample();
                s.add.push(add);
                s.del.push(del);
                let (add, del) = floor(&rt, &node.node, i, ipv6);
                s.floor_add.push(add);
                s.floor_del.push(del);
            }
        }
        let [(_, s1), (_, s2)] = &nodes;
        let ms = |v: &[f64], p| pct(v, p) / 1e3;
        let row = |label: &str, pods: usize, add: &[f64], del: &[f64]| {
            println!(
                "{label:<10} {pods:>6} {:>8.2}ms {:>8.2}ms {:>8.2}ms {:>8.2}ms",
                ms(add, 0.5),
                ms(add, 0.9),
                ms(del, 0.5),
                ms(del, 0.9)
            );
        };
        let ratio = |label: &str, a1: &[f64], d1: &[f64], a2: &[f64], d2: &[f64]| {
            let (ra, rd) = (pct(a2, 0.5) / pct(a1, 0.5), pct(d2, 0.5) / pct(d1, 0.5));
            println!(
                "{label:<10} ratio {} pods / {} pods, p50: ADD {ra:.2}x  DEL {rd:.2}x (target <= 1.5x); ADD +{:.2} ms",
                a.many,
                a.few,
                ms(a2, 0.5) - ms(a1, 0.5)
            );
            ra
        };
        row(label, a.few, &s1.add, &s1.del);
        row(label, a.many, &s2.add, &s2.del);
        let ra = ratio(label, &s1.add, &s1.del, &s2.add, &s2.del);
        let what = if ipv6 { " kernel+v6" } else { " kernel" };
        row(what, a.few, &s1.floor_add, &s1.floor_del);
        row(what, a.many, &s2.floor_add, &s2.floor_del);
        ratio(
            what,
            &s1.floor_add,
            &s1.floor_del,
            &s2.floor_add,
            &s2.floor_del,
        );
        if label == "rcni" {
            worst = ra;
        }
        // Dropping the pods' namespaces removes their veths; then the node.
        drop(nodes);
    }
    std::process::exit(if worst <= 1.5 { 0 } else { 1 });
}
