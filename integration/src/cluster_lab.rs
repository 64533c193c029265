//! The simulated cluster of the cross-node tests: node namespaces joined
//! by an underlay (one L2, a bridge in a router namespace; or several
//! subnets the router routes between), `rcni-node` run in each node, pods
//! attached from the conflist the agent wrote. integration/tests/cluster.rs
//! and vm_wireguard.rs build on it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{addr_of, addrs_of, ip, nl};
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
