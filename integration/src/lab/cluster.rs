//! The simulated cluster of the cross-node tests: node namespaces joined
//! by an underlay (one L2, a bridge in a router namespace; or several
//! subnets the router routes between), `rcni-node` run in each node, pods
//! attached from the conflist the agent wrote. integration/tests/cluster_*.rs
//! and vm_wireguard.rs build on it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{addr_of, addrs_of, ip, link_names, nl};
use rcni_netlink::NUD_PERMANENT;
use rcni_testkit::{Bpffs, Call, TestNs, bin, tied_command_in};
use serde_json::{Value, json};

pub struct ClusterNode {
    pub name: String,
    pub ns: TestNs,
    pub dir: tempfile::TempDir,
    /// The node's pin root (`--bpf-pin-root`): a bpffs of its own.
    pub bpffs: Bpffs,
}

impl ClusterNode {
    pub fn conf_dir(&self) -> PathBuf {
        self.dir.path().join("net.d")
    }

    pub fn agent(&self, file: &Path) -> Command {
        let mut c = tied_command_in(&self.ns.ns, bin("rcni-node"));
        c.arg("run")
            .arg("--cluster")
            .arg(file)
            .args(["--node", &self.name])
            .arg("--cni-conf-dir")
            .arg(self.conf_dir())
            .arg("--state-dir")
            .arg(self.dir.path().join("state"))
            .arg("--ipam-data-dir")
            .arg(self.dir.path().join("ipam"))
            .arg("--bpf-pin-root")
            .arg(self.bpffs.path());
        c
    }

    /// `rcni-node run --once`: (exit code, stderr).
    pub fn run_once(&self, file: &Path) -> (i32, String) {
        let out = self.agent(file).arg("--once").output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    pub fn reconcile(&self, file: &Path) -> String {
        let (code, err) = self.run_once(file);
        assert_eq!(code, 0, "{}: {err}", self.name);
        err
    }

    /// The bridge plugin's config from the conflist the agent wrote.
    pub fn plugin_conf(&self) -> Value {
        let text = std::fs::read(self.conf_dir().join("10-rcni.conflist")).unwrap();
        let list: Value = serde_json::from_slice(&text).unwrap();
        let mut c = list["plugins"][0].clone();
        c["cniVersion"] = list["cniVersion"].clone();
        c["name"] = list["name"].clone();
        c
    }

    /// A pod on this node: its namespace and ADD's result. The bridge,
    /// and the fastpath plugin after it when the conflist has it.
    pub fn add_pod(&self, cid: &str) -> (TestNs, Value) {
        let pod = TestNs::new();
        let r = Call::new(bin("bridge"), "ADD")
            .env("CNI_CONTAINERID", cid)
            .netns(&pod.path())
            .stdin(&self.plugin_conf())
            .run_in(&self.ns.ns)
            .ok();
        let text = std::fs::read(self.conf_dir().join("10-rcni.conflist")).unwrap();
        let list: Value = serde_json::from_slice(&text).unwrap();
        if list["plugins"][1]["type"] == "fastpath" {
            let mut c = list["plugins"][1].clone();
            c["cniVersion"] = list["cniVersion"].clone();
            c["name"] = list["name"].clone();
            c["prevResult"] = r.clone();
            let r2 = Call::new(bin("fastpath"), "ADD")
                .env("CNI_CONTAINERID", cid)
                .netns(&pod.path())
                .stdin(&c)
                .run_in(&self.ns.ns)
                .ok();
            return (pod, r2);
        }
        (pod, r)
    }

    /// A pod on this node: its namespace and IPv4 address.
    pub fn pod(&self, cid: &str) -> (TestNs, String) {
        let (pod, r) = self.add_pod(cid);
        (pod, addr_of(&r, true))
    }

    /// A pod of an IPv6-only node: its namespace and IPv6 address (it has
    /// no IPv4 one).
    pub fn pod6(&self, cid: &str) -> (TestNs, String) {
        let (pod, r) = self.add_pod(cid);
        let ips = rcni_testkit::result_ips(&r);
        assert!(ips.iter().all(|a| a.contains(':')), "{r}");
        (pod, addr_of(&r, false))
    }

    /// A dual-stack pod: its namespace, IPv4 and IPv6 addresses.
    pub fn pod_dual(&self, cid: &str) -> (TestNs, String, String) {
        let (pod, r) = self.add_pod(cid);
        (pod, addr_of(&r, true), addr_of(&r, false))
    }
}

/// Underlay namespaces: bridges (one per subnet) in a router namespace
/// that also routes between them when there are two.
pub struct Cluster {
    pub router: TestNs,
    pub nodes: Vec<ClusterNode>,
    pub file: PathBuf,
    pub dir: tempfile::TempDir,
}

/// Underlay subnets: `192.168.50.0/24` on bridge `ul0`, `192.168.60.0/24`
/// on `ul1`; the router namespace holds `.254` on each.
pub fn subnet(i: usize) -> String {
    format!("192.168.{}", 50 + 10 * i)
}

impl Cluster {
    /// Nodes `n1..` placed on underlay subnets `placement[i]`; node i's
    /// address is `<subnet>.<i+1>`, its pod subnet `10.244.<i+1>.0/24`.
    pub fn new(placement: &[usize]) -> Cluster {
        let router = TestNs::new();
        ip(&router.ns, "link set lo up");
        let subnets: BTreeSet<usize> = placement.iter().copied().collect();
        for s in &subnets {
            ip(&router.ns, &format!("link add ul{s} type bridge"));
            ip(
                &router.ns,
                &format!("addr add {}.254/24 dev ul{s}", subnet(*s)),
            );
            // See the nodes' eth0 below.
            let _ = rcni_netlink::sysctl::set(
                &router.ns,
                &format!("net.ipv6.conf.ul{s}.accept_dad"),
                "0",
            );
            ip(&router.ns, &format!("link set ul{s} up"));
        }
        rcni_netlink::sysctl::set(&router.ns, "net.ipv4.ip_forward", "1").unwrap();
        let mut nodes = Vec::new();
        for (i, s) in placement.iter().enumerate() {
            let ns = TestNs::new();
            let port = format!("u{i}");
            nl(&router.ns, async |n| {
                n.create_veth(&port, "eth0", Some(&ns.ns), None)
                    .await
                    .unwrap()
            });
            ip(&router.ns, &format!("link set {port} master ul{s} up"));
            ip(&ns.ns, "link set lo up");
            // A real node's uplink finished DAD long before its pods came;
            // in a fresh namespace it would keep the node's link-local
            // address tentative for a second or two, and the kernel sends
            // no neighbour solicitation for a forwarded packet from a
            // tentative link-local.
            let _ = rcni_netlink::sysctl::set(&ns.ns, "net.ipv6.conf.eth0.accept_dad", "0");
            ip(&ns.ns, "link set eth0 up");
            ip(
                &ns.ns,
                &format!("addr add {}.{}/24 dev eth0", subnet(*s), i + 1),
            );
            ip(&ns.ns, &format!("route add default via {}.254", subnet(*s)));
            nodes.push(ClusterNode {
                name: format!("n{}", i + 1),
                ns,
                dir: tempfile::tempdir().unwrap(),
                bpffs: Bpffs::mount(),
            });
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cluster.json");
        Cluster {
            router,
            nodes,
            file,
            dir,
        }
    }

    /// The cluster file for `backend` with the nodes `which` (indexes),
    /// each at the address its eth0 holds now.
    pub fn write(&self, backend: &str, which: &[usize]) {
        self.write_with(backend, which, json!({}));
    }

    /// [`Cluster::write`] with more top-level keys (`"ebpf"`).
    pub fn write_with(&self, backend: &str, which: &[usize], extra: Value) {
        let nodes: Vec<Value> = which
            .iter()
            .map(|&i| {
                let n = &self.nodes[i];
                json!({"name": n.name, "address": self.address(i),
                       "podCIDR": format!("10.244.{}.0/24", i + 1)})
            })
            .collect();
        let mut c = json!({"network": "10.244.0.0/16", "backend": backend, "nodes": nodes});
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        std::fs::write(&self.file, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
    }

    /// Dual-stack: every node gets `fd50::<i+1>/64` on its eth0 (the one
    /// L2 carries both families) and the router `fd50::fe`.
    pub fn add_ipv6(&self) {
        ip(&self.router.ns, "addr add fd50::fe/64 dev ul0 nodad");
        for (i, n) in self.nodes.iter().enumerate() {
            ip(
                &n.ns.ns,
                &format!("addr add fd50::{}/64 dev eth0 nodad", i + 1),
            );
        }
    }

    /// A dual-stack cluster file: node i also has `address6` `fd50::<i+1>`
    /// and IPv6 pod subnet `fd00:0:0:<i+1>::/64` in `fd00::/48`.
    pub fn write_dual(&self, backend: &str, which: &[usize]) {
        self.write_dual_with(backend, which, json!({}));
    }

    pub fn write_dual_with(&self, backend: &str, which: &[usize], extra: Value) {
        let nodes: Vec<Value> = which
            .iter()
            .map(|&i| {
                json!({"name": self.nodes[i].name, "address": self.address(i),
                       "address6": format!("fd50::{}", i + 1),
                       "podCIDRs": [format!("10.244.{}.0/24", i + 1),
                                    format!("fd00:0:0:{}::/64", i + 1)]})
            })
            .collect();
        let mut c = json!({"network": "10.244.0.0/16", "network6": "fd00::/48",
                       "backend": backend, "nodes": nodes});
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        std::fs::write(&self.file, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
    }

    /// An IPv6-only underlay: every node's eth0 keeps only
    /// `fd5<s>::<i+1>/64` (its IPv4 address and routes go, so nothing can
    /// fall back to IPv4), the router holds `fd5<s>::fe` on each subnet's
    /// bridge and routes IPv6 between them, and is each node's default
    /// route. Node i on subnet 0 has `add_ipv6`'s `fd50::<i+1>`.
    pub fn make_v6only(&self) {
        let mut subnets = BTreeSet::new();
        for (i, n) in self.nodes.iter().enumerate() {
            // The subnet index from the IPv4 address `Cluster::new` gave.
            let v4 = self.address(i);
            let s = (v4.split('.').nth(2).unwrap().parse::<usize>().unwrap() - 50) / 10;
            subnets.insert(s);
            ip(&n.ns.ns, "-4 addr flush dev eth0");
            ip(
                &n.ns.ns,
                &format!("addr add fd5{s}::{}/64 dev eth0 nodad", i + 1),
            );
            ip(&n.ns.ns, &format!("-6 route add default via fd5{s}::fe"));
        }
        for s in subnets {
            ip(
                &self.router.ns,
                &format!("addr add fd5{s}::fe/64 dev ul{s} nodad"),
            );
        }
        rcni_netlink::sysctl::set(&self.router.ns, "net.ipv6.conf.all.forwarding", "1").unwrap();
    }

    /// An IPv6-only cluster file (after [`Cluster::make_v6only`]): an IPv6
    /// `"network"` `fd00::/48` alone, node i at its IPv6 `"address"` with
    /// `"podCIDR"` `fd00:0:0:<i+1>::/64`, no IPv4 anywhere.
    pub fn write_v6only(&self, backend: &str, which: &[usize]) {
        self.write_v6only_with(backend, which, json!({}));
    }

    pub fn write_v6only_with(&self, backend: &str, which: &[usize], extra: Value) {
        let nodes: Vec<Value> = which
            .iter()
            .map(|&i| {
                json!({"name": self.nodes[i].name, "address": self.address(i),
                       "podCIDR": format!("fd00:0:0:{}::/64", i + 1)})
            })
            .collect();
        let mut c = json!({"network": "fd00::/48", "backend": backend, "nodes": nodes});
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        std::fs::write(&self.file, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
    }

    /// Node i's first global address on eth0 (IPv4, or its IPv6 one on an
    /// IPv6-only underlay).
    pub fn address(&self, i: usize) -> String {
        addrs_of(&self.nodes[i].ns.ns, "eth0")[0]
            .split('/')
            .next()
            .unwrap()
            .to_string()
    }

    pub fn reconcile_all(&self) {
        for n in &self.nodes {
            n.reconcile(&self.file);
        }
    }
}

/// The agent's route protocol (agent::RTPROT_RCNI).
const RTPROT_RCNI: u8 = 0x52;
/// The VXLAN device of a node (flannel's flannel.<VNI>).
pub const VTEP: &str = "rcni.1";
/// The IPv6 VXLAN device of a dual-stack node.
pub const VTEP6: &str = "rcni6.1";
/// How long a test waits for running agents to act on a change (they poll
/// every 20 ms; the bound is for a loaded machine).
pub const SETTLE: std::time::Duration = std::time::Duration::from_secs(10);

/// What the tests read of a node's kernel state and datapath.
impl ClusterNode {
    /// `fastpath <sub> --json` on this node's pin root.
    pub fn fastpath_json(&self, sub: &str) -> Vec<Value> {
        crate::fastpath_json(&self.ns.ns, self.bpffs.path(), sub)
    }

    /// A verdict counter of the node's datapath (by its name).
    pub fn verdict(&self, name: &str) -> u64 {
        self.fastpath_json("stats")
            .iter()
            .map(|n| n["verdicts"][name].as_u64().unwrap_or(0))
            .sum()
    }

    /// A per-address counter (`rxPackets`, `txPackets`).
    pub fn counter(&self, addr: &str, key: &str) -> u64 {
        self.fastpath_json("list")
            .iter()
            .find(|r| r["address"] == addr)
            .map_or(0, |r| r[key].as_u64().unwrap())
    }

    /// The datapath's other-node map: "subnet via next-hop dev mtu".
    pub fn remote_map(&self) -> BTreeSet<String> {
        let dir = self.bpffs.path().join("rcni");
        self.ns
            .ns
            .run(move || {
                let Some(dp) = rcni_ebpf::Datapath::open(&dir).unwrap() else {
                    return BTreeSet::new();
                };
                dp.remote_routes()
                    .unwrap()
                    .into_iter()
                    .map(|(net, h)| {
                        let dev = nix::net::if_::if_indextoname(h.ifindex)
                            .map(|n| n.to_string_lossy().into_owned())
                            .unwrap_or_default();
                        format!(
                            "{net} via {} dev {dev} mtu {}",
                            h.next_hop().unwrap(),
                            h.mtu
                        )
                    })
                    .collect()
            })
            .unwrap()
    }

    /// The devices with the agent's program on their tcx ingress, by the
    /// program's name (what the kernel says, not the pins).
    pub fn net_program_on(&self) -> BTreeSet<String> {
        self.ns
            .ns
            .run(|| {
                let progs: Vec<(u32, String)> = aya::programs::loaded_programs()
                    .filter_map(|p| p.ok())
                    .map(|p| (p.id(), p.name_as_str().unwrap_or("").to_string()))
                    .collect();
                let mut on = BTreeSet::new();
                for l in nix::net::if_::if_nameindex().unwrap().iter() {
                    let name = l.name().to_string_lossy().into_owned();
                    let ids = rcni_ebpf::tcx_programs(&name).unwrap();
                    if progs
                        .iter()
                        .any(|(id, n)| ids.contains(id) && n == "rcni_from_net")
                    {
                        on.insert(name);
                    }
                }
                on
            })
            .unwrap()
    }

    /// (permanent neighbours, FDB entries) on the VTEP and the agent's
    /// routes, as text.
    pub fn entries(&self) -> (BTreeSet<String>, BTreeSet<String>, BTreeSet<String>) {
        self.entries_of(VTEP, false)
    }

    /// The same for IPv6: the IPv6 VTEP and the agent's IPv6 routes.
    pub fn entries6(&self) -> (BTreeSet<String>, BTreeSet<String>, BTreeSet<String>) {
        self.entries_of(VTEP6, true)
    }

    /// host-gw for one family: no VTEP and no entries of one, only the
    /// agent's `routes`.
    pub fn assert_host_gw(&self, v6: bool, routes: &[&str]) {
        let vtep = if v6 { VTEP6 } else { VTEP };
        let (neigh, fdb, got) = self.entries_of(vtep, v6);
        assert!(neigh.is_empty() && fdb.is_empty());
        assert_eq!(got, routes.iter().map(|r| r.to_string()).collect());
        assert!(link_names(&self.ns.ns).iter().all(|l| l != vtep));
    }

    fn entries_of(
        &self,
        vtep: &str,
        v6: bool,
    ) -> (BTreeSet<String>, BTreeSet<String>, BTreeSet<String>) {
        nl(&self.ns.ns, async |n| {
            let routes = n
                .owned_routes(v6, RTPROT_RCNI)
                .await
                .unwrap()
                .iter()
                .map(|r| {
                    format!(
                        "{} via {}{}",
                        r.dst,
                        r.gateway.unwrap(),
                        if r.onlink { " onlink" } else { "" }
                    )
                })
                .collect();
            let Some(v) = n.find_link(vtep).await.unwrap() else {
                return (BTreeSet::new(), BTreeSet::new(), routes);
            };
            let neigh = n
                .neighbours(Some(v.index))
                .await
                .unwrap()
                .into_iter()
                .filter(|x| x.state & NUD_PERMANENT != 0 && x.ip.is_ipv6() == v6)
                .map(|x| format!("{} {}", x.ip, x.mac.unwrap()))
                .collect();
            let fdb = n
                .fdb_entries(v.index)
                .await
                .unwrap()
                .into_iter()
                .map(|f| format!("{} {}", f.mac, f.dst.unwrap()))
                .collect();
            (neigh, fdb, routes)
        })
    }
}
