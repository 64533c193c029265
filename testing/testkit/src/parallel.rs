//! Many attachments of one network at once, as a node does when a
//! deployment scales up: N ADDs of the whole chain through `cnitool`
//! started together, then N DELs together. Checked afterwards: every ADD
//! and DEL succeeded (and none said EBUSY, EAGAIN, "resource busy" or an
//! nf_tables generation conflict: a plugin retries those itself), no
//! address was handed out twice, every pod has exactly the netfilter rules
//! a pod added alone has (none lost, none doubled), and after the DELs the
//! node holds what it held before (links, rules, reservations, tuning
//! backups, cached results, BPF pins). Per ADD and DEL the wall time is
//! kept for the benchmark's percentiles.
//!
//! Everything runs in a node namespace of its own, with pod namespaces
//! held here, state in a temporary directory and a bpffs of its own.

use crate::Bpffs;
use crate::chaos::{dir_names, ipt_rules, link_names, multiset_diff, nft_rules};
use rcni_netns::NetNs;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

pub const NETWORK: &str = "parnet";
pub const BRIDGE: &str = "parbr0";
const SUBNET: &str = "10.91.0.0/16";
const GATEWAY: &str = "10.91.0.1";

/// Which chain runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chain {
    /// bridge + host-local, portmap, firewall, tuning, bandwidth, fastpath,
    /// policy (eBPF backend).
    Full,
    /// The same without fastpath and policy, which the reference lacks.
    Common,
}

/// The conflist of `chain` with its state in `state` and BPF pins under
/// `pins`.
pub fn conflist(chain: Chain, state: &Path, pins: &Path) -> Value {
    let mut plugins = vec![
        json!({"type": "bridge", "bridge": BRIDGE, "isGateway": true, "ipMasq": true,
               "ipMasqBackend": "nftables", "hairpinMode": true,
               "ipam": {"type": "host-local", "dataDir": state.join("ipam"),
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "ranges": [[{"subnet": SUBNET, "gateway": GATEWAY}]]}}),
        json!({"type": "portmap", "backend": "nftables", "capabilities": {"portMappings": true}}),
        json!({"type": "firewall", "backend": "nftables"}),
        json!({"type": "tuning", "dataDir": state.join("tuning"), "mtu": 1400,
               "sysctl": {"net.ipv4.conf.eth0.arp_notify": "1"}}),
        json!({"type": "bandwidth", "ingressRate": 100_000_000u64, "ingressBurst": 1_000_000,
               "egressRate": 100_000_000u64, "egressBurst": 1_000_000}),
    ];
    if chain == Chain::Full {
        // With fastpath, nftables would not see the redirected traffic:
        // policy refuses that backend.
        let backend = "ebpf";
        plugins.push(json!({"type": "fastpath", "pinRoot": pins}));
        plugins.push(
            json!({"type": "policy", "backend": backend, "pinRoot": pins,
            "dataDir": state.join("policy"), "policyDir": state.join("policy.d"),
            "policies": [{"name": "prod-only", "namespace": "prod", "podSelector": {},
                "ingress": [{"from": [{"namespaceSelector": {"matchLabels":
                    {"kubernetes.io/metadata.name": "prod"}}}]}]}],
            "args": {"cni": {"labels": {"app": "par"}, "namespace": "prod"}}}),
        );
    }
    // The reference (v1.1.1) knows versions up to 1.0.0.
    let version = if chain == Chain::Full {
        "1.1.0"
    } else {
        "1.0.0"
    };
    json!({"cniVersion": version, "name": NETWORK, "plugins": plugins})
}

/// What the node holds in the parts an attachment touches.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct State {
    pub reservations: BTreeSet<String>,
    pub links: BTreeSet<String>,
    /// Netfilter rule lines as a sorted multiset.
    pub rules: Vec<String>,
    pub backups: BTreeSet<String>,
    pub cache: BTreeSet<String>,
    pub pins: BTreeSet<String>,
}

/// One command's outcome: success, wall time, CNI error or output.
#[derive(Clone, Debug)]
pub struct Run {
    pub cid: String,
    pub ok: bool,
    pub took: Duration,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// Whether the failure is one the plugin should have retried: a busy
    /// resource or a netfilter generation conflict.
    pub fn busy(&self) -> bool {
        let t = format!("{} {}", self.stdout, self.stderr).to_lowercase();
        [
            "ebusy",
            "eagain",
            "resource busy",
            "device or resource busy",
            "try again",
            "generation",
        ]
        .iter()
        .any(|w| t.contains(w))
    }
}

/// N concurrent ADDs and N concurrent DELs, and what the checks found.
pub struct Round {
    pub label: String,
    pub add: Vec<Run>,
    pub del: Vec<Run>,
    /// Each a description of one broken expectation.
    pub problems: Vec<String>,
}

impl Round {
    pub fn add_times(&self) -> Vec<f64> {
        self.add
            .iter()
            .map(|r| r.took.as_secs_f64() * 1e6)
            .collect()
    }

    pub fn del_times(&self) -> Vec<f64> {
        self.del
            .iter()
            .map(|r| r.took.as_secs_f64() * 1e6)
            .collect()
    }
}

/// A node namespace with one network: `cnitool` from `tools`, plugins from
/// `plugins`.
pub struct Node {
    pub label: String,
    cnitool: PathBuf,
    plugins: PathBuf,
    pub node: NetNs,
    state: tempfile::TempDir,
    pub bpffs: Bpffs,
    /// Rule lines naming the pod's address that one pod added alone has.
    pub rules_per_pod: usize,
    n: usize,
}

/// The addresses of a result (cnitool's stdout).
fn ips_of(stdout: &str) -> Vec<String> {
    crate::result_ips(&serde_json::from_str(stdout).unwrap_or(Value::Null))
}

/// Rule lines that name `ip` as a whole token (10.91.0.2 is not in
/// 10.91.0.20).
fn lines_naming(rules: &[String], ip: &str) -> usize {
    rules
        .iter()
        .filter(|l| {
            l.split(|c: char| !(c.is_ascii_digit() || c == '.'))
                .any(|t| t == ip)
        })
        .count()
}

impl Node {
    pub fn new(label: &str, chain: Chain, cnitool: &Path, plugins: &Path) -> Node {
        crate::require_root();
        let state = tempfile::Builder::new()
            .prefix("rcni-par-")
            .tempdir()
            .unwrap();
        let bpffs = Bpffs::mount();
        std::fs::create_dir_all(state.path().join("conf")).unwrap();
        std::fs::create_dir_all(state.path().join("policy.d")).unwrap();
        std::fs::write(
            state.path().join("conf/par.conflist"),
            serde_json::to_vec_pretty(&conflist(chain, state.path(), bpffs.path())).unwrap(),
        )
        .unwrap();
        let node = NetNs::new_anonymous().expect("node namespace");
        let _ = rcni_netlink::sysctl::set(&node, "net/ipv4/ip_forward", "1");
        let mut n = Node {
            label: label.to_string(),
            cnitool: cnitool.to_path_buf(),
            plugins: plugins.to_path_buf(),
            node,
            state,
            bpffs,
            rules_per_pod: 0,
            n: 0,
        };
        // One pod alone: the shared state (bridge, tables, maps) exists
        // from then on, and its rules are what every pod should have.
        let pod = NetNs::new_anonymous().expect("pod namespace");
        let path = pod.proc_path().display().to_string();
        let add = n.cmd("add", &path, "calibrate");
        assert!(
            add.ok,
            "{label}: calibration ADD failed: {} {}",
            add.stdout, add.stderr
        );
        let ip = ips_of(&add.stdout).pop().expect("calibration address");
        n.rules_per_pod = lines_naming(&n.rules(), &ip);
        let del = n.cmd("del", &path, "calibrate");
        assert!(
            del.ok,
            "{label}: calibration DEL failed: {} {}",
            del.stdout, del.stderr
        );
        n
    }

    /// ADD of one pod (a namespace path) as the runtime runs it.
    pub fn add(&self, pod: &str, cid: &str) -> Run {
        self.cmd("add", pod, cid)
    }

    /// DEL of one pod, with the cached result.
    pub fn del(&self, pod: &str, cid: &str) -> Run {
        self.cmd("del", pod, cid)
    }

    fn cmd(&self, op: &str, pod: &str, cid: &str) -> Run {
        let caps = json!({"portMappings": [
            {"hostPort": 8080, "containerPort": 80, "protocol": "tcp"},
            {"hostPort": 8053, "containerPort": 53, "protocol": "udp"}]});
        let t = Instant::now();
        let mut cmd = self.node.command(&self.cnitool);
        crate::keep_probe_dir(cmd.env_clear());
        let out = cmd
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("NETCONFPATH", self.state.path().join("conf"))
            .env("CNI_PATH", &self.plugins)
            .env("CNI_CACHE_DIR", self.state.path().join("cache"))
            .env("CAP_ARGS", caps.to_string())
            .env("CNI_IFNAME", "eth0")
            .args([op, NETWORK, pod, "--container-id", cid])
            .stdin(Stdio::null())
            .output()
            .expect("run cnitool");
        Run {
            cid: cid.to_string(),
            ok: out.status.success(),
            took: t.elapsed(),
            stdout: String::from_utf8_lossy(&out.stdout).trim().to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        }
    }

    fn rules(&self) -> Vec<String> {
        let mut r = ipt_rules(&self.node);
        r.extend(nft_rules(&self.node));
        r.sort();
        r
    }

    pub fn state(&self) -> State {
        let names = |d: PathBuf| -> BTreeSet<String> {
            dir_names(&d).into_iter().map(|(n, _)| n).collect()
        };
        State {
            reservations: crate::reservations(&self.state.path().join("ipam").join(NETWORK))
                .into_iter()
                .collect(),
            links: link_names(&self.node),
            rules: self.rules(),
            backups: names(self.state.path().join("tuning")),
            cache: names(self.state.path().join("cache/results")),
            pins: self.bpffs.files(),
        }
    }

    /// Each (op, pod path, container ID) at once, after a common start.
    fn all_at_once(&self, tasks: &[(&str, &str, &str)]) -> Vec<Run> {
        let start = std::sync::Barrier::new(tasks.len());
        std::thread::scope(|s| {
            let hs: Vec<_> = tasks
                .iter()
                .map(|&(op, path, cid)| {
                    let start = &start;
                    s.spawn(move || {
                        start.wait();
                        self.cmd(op, path, cid)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Failed runs as problems.
    fn failures(runs: &[Run], problems: &mut Vec<String>) {
        for r in runs.iter().filter(|r| !r.ok) {
            let kind = if r.busy() { "busy/conflict " } else { "" };
            problems.push(format!(
                "{} failed ({kind}error reached the runtime): {} | {}",
                r.cid, r.stdout, r.stderr
            ));
        }
    }

    /// No address twice among `adds`, and each pod with exactly the rules
    /// of a pod alone.
    fn check_pods(&self, adds: &[&Run], problems: &mut Vec<String>) {
        let mut owner: BTreeMap<String, &str> = BTreeMap::new();
        for r in adds.iter().filter(|r| r.ok) {
            for ip in ips_of(&r.stdout) {
                if let Some(o) = owner.insert(ip.clone(), &r.cid) {
                    problems.push(format!("address {ip} given to {o} and {}", r.cid));
                }
            }
        }
        let rules = self.rules();
        for (ip, cid) in &owner {
            let k = lines_naming(&rules, ip);
            if k != self.rules_per_pod {
                problems.push(format!(
                    "{cid} ({ip}): {k} rule lines name it, a pod alone has {}",
                    self.rules_per_pod
                ));
            }
        }
    }

    /// `n` ADDs at once (timed); then half of those pods' DELs at the same
    /// time as `n/2` new pods' ADDs (the last DELs racing new ADDs on the
    /// shared tables); then the DELs of all `n` left at once (timed); what
    /// went wrong.
    pub fn round(&mut self, n: usize) -> Round {
        let before = self.state();
        let mut pod = || {
            self.n += 1;
            let p = NetNs::new_anonymous().expect("pod namespace");
            let path = p.proc_path().display().to_string();
            (p, path, format!("par{:05}", self.n))
        };
        let pods: Vec<(NetNs, String, String)> = (0..n).map(|_| pod()).collect();
        let fresh: Vec<(NetNs, String, String)> = (0..n / 2).map(|_| pod()).collect();
        let mut problems = Vec::new();
        let tasks = |op, ps: &[(NetNs, String, String)]| -> Vec<(&str, String, String)> {
            ps.iter()
                .map(|(_, path, cid)| (op, path.clone(), cid.clone()))
                .collect()
        };
        let run = |me: &Node, t: Vec<(&str, String, String)>| -> Vec<Run> {
            let v: Vec<(&str, &str, &str)> = t
                .iter()
                .map(|(o, p, c)| (*o, p.as_str(), c.as_str()))
                .collect();
            me.all_at_once(&v)
        };
        let add = run(self, tasks("add", &pods));
        Self::failures(&add, &mut problems);
        self.check_pods(&add.iter().collect::<Vec<_>>(), &mut problems);

        let half = n / 2;
        let mut churn_tasks = tasks("del", &pods[..half]);
        churn_tasks.extend(tasks("add", &fresh));
        let churn = run(self, churn_tasks);
        Self::failures(&churn, &mut problems);
        let survivors: Vec<&Run> = add[half..].iter().chain(churn[half..].iter()).collect();
        self.check_pods(&survivors, &mut problems);

        let mut left = tasks("del", &pods[half..]);
        left.extend(tasks("del", &fresh));
        let del = run(self, left);
        Self::failures(&del, &mut problems);
        drop(pods);
        drop(fresh);
        let after = self.state();
        let diff = |what: &str, a: &BTreeSet<String>, b: &BTreeSet<String>| {
            let extra: Vec<_> = a.difference(b).collect();
            let gone: Vec<_> = b.difference(a).collect();
            (!extra.is_empty() || !gone.is_empty())
                .then(|| format!("{what}: left {extra:?}, gone {gone:?}"))
        };
        problems.extend(diff(
            "reservations",
            &after.reservations,
            &before.reservations,
        ));
        problems.extend(diff("node links", &after.links, &before.links));
        problems.extend(diff("tuning backups", &after.backups, &before.backups));
        problems.extend(diff("cached results", &after.cache, &before.cache));
        problems.extend(diff("bpf pins", &after.pins, &before.pins));
        let left = multiset_diff(&after.rules, &before.rules);
        let gone = multiset_diff(&before.rules, &after.rules);
        if !left.is_empty() || !gone.is_empty() {
            problems.push(format!("rules: left {left:?}, gone {gone:?}"));
        }
        Round {
            label: self.label.clone(),
            add,
            del,
            problems,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rule_lines_name_whole_addresses() {
        let r = vec![
            "ip daddr 10.91.0.2 accept".to_string(),
            "dnat to 10.91.0.20:80".to_string(),
            "-A X -d 10.91.0.2/32 -j Y".to_string(),
        ];
        assert_eq!(lines_naming(&r, "10.91.0.2"), 2);
        assert_eq!(lines_naming(&r, "10.91.0.20"), 1);
    }
}
