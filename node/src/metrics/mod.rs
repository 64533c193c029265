//! The agent's Prometheus metrics (`rcni-node run --metrics-addr`): what
//! the agent counts as it goes (reconciles, kernel changes, policy flow
//! events) and what is read from the node at scrape time (the eBPF
//! datapath's verdict counters, WireGuard peers, host-local's address use,
//! the CNI commands the plugins recorded).
//!
//! One registry per process, [`Metrics::get`]: the reconcile loops and the
//! policy flow collector record into it whether or not it is served.

pub mod cnistats;
pub mod ipam;
pub mod server;
pub mod text;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use text::{Family, Histogram};

use crate::sync::desired::WG_NAME;
use crate::wg;

/// Buckets for one reconcile: a pass with nothing to change takes a few
/// milliseconds, hundreds of peers' first pass seconds.
static RECONCILE_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// The last pass of one reconcile loop, for the status screen too.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LastReconcile {
    /// Seconds since the epoch, when it ended.
    pub time: f64,
    pub ok: bool,
    #[serde(rename = "durationSeconds")]
    pub duration: f64,
    pub changes: usize,
    /// Why it failed, or what it refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The cloud pool as the last loop pass saw it.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CloudPool {
    pub used: u64,
    pub free: u64,
    pub cooling: u64,
    pub total: u64,
    #[serde(rename = "maxPods")]
    pub max_pods: u64,
    #[serde(rename = "apiCalls")]
    pub api_calls: u64,
    /// Checkpointed pods whose address the cloud's view did not show at
    /// the agent's start, by what was done (reacquired, kept, dropped).
    #[serde(rename = "checkpointMismatches")]
    pub checkpoint_mismatches: BTreeMap<String, u64>,
    /// Who holds the pool's addresses (the status file's pods).
    #[serde(skip)]
    pub pods: Vec<ipam::Reservation>,
}

/// How the registry reads cloud mode's pool at scrape time.
pub type CloudSource = std::sync::Arc<dyn Fn() -> CloudPool + Send + Sync>;

#[derive(Default)]
struct State {
    pin_root: Option<PathBuf>,
    cni_conf_dir: Option<PathBuf>,
    reconciles: BTreeMap<(&'static str, &'static str), u64>,
    durations: BTreeMap<&'static str, Histogram>,
    last_success: BTreeMap<&'static str, f64>,
    last: BTreeMap<&'static str, LastReconcile>,
    changes: BTreeMap<(&'static str, &'static str), u64>,
    flows: BTreeMap<(String, String, String, String), u64>,
    suppressed: BTreeMap<String, u64>,
    peer_names: BTreeMap<wg::Key, String>,
    cloud: Option<CloudPool>,
    /// Reads the cloud pool now (its pods change between the loop's passes).
    cloud_source: Option<CloudSource>,
    cni: Option<cnistats::CniStats>,
    /// BIRD's sessions: (what the peer is, its state or last error).
    bgp: Option<Vec<(String, String)>>,
}

pub struct Metrics {
    start: f64,
    state: Mutex<State>,
}

static METRICS: OnceLock<Metrics> = OnceLock::new();

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn l(pairs: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
    pairs.iter().map(|(k, v)| (*k, v.to_string())).collect()
}

impl Metrics {
    /// The process's registry.
    pub fn get() -> &'static Metrics {
        METRICS.get_or_init(Metrics::new)
    }

    /// A registry of its own (tests; the process uses [`Metrics::get`]).
    pub fn new() -> Metrics {
        Metrics {
            start: now(),
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere while holding it leaves counters, still good
        // to read.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One reported policy flow event: verdict is "deny", "allow" or
    /// "audit"; policy is "namespace/name" or "default-deny".
    pub fn policy_flow(&self, network: &str, policy: &str, verdict: &str, direction: &str) {
        *self
            .state()
            .flows
            .entry((
                network.to_string(),
                policy.to_string(),
                verdict.to_string(),
                direction.to_string(),
            ))
            .or_default() += 1;
    }

    /// Events the rate limit suppressed.
    pub fn policy_flows_suppressed(&self, network: &str, n: u64) {
        *self
            .state()
            .suppressed
            .entry(network.to_string())
            .or_default() += n;
    }

    /// Where the scrape-time readings look: the eBPF pin root (each
    /// network's pins below it) and the CNI conf dir (host-local's
    /// networks).
    pub fn set_sources(&self, pin_root: Option<&Path>, cni_conf_dir: Option<&Path>) {
        let mut s = self.state();
        s.pin_root = pin_root.map(Path::to_path_buf);
        s.cni_conf_dir = cni_conf_dir.map(Path::to_path_buf);
    }

    /// Reads the plugins' command lines from `dir` from now on.
    pub fn set_cni_stats_dir(&self, dir: &Path) {
        self.state().cni = Some(cnistats::CniStats::new(dir));
    }

    /// Reads what the plugins appended since the last call.
    pub fn collect_cni_stats(&self) {
        if let Some(c) = &mut self.state().cni {
            c.collect();
        }
    }

    /// One pass of a reconcile loop (`loop_`: "agent" or "cloud"): its
    /// result, time and kernel changes by kind.
    pub fn reconciled(
        &self,
        loop_: &'static str,
        result: Result<(), String>,
        took: Duration,
        kinds: &BTreeMap<&'static str, usize>,
    ) {
        let mut s = self.state();
        let t = now();
        let ok = result.is_ok();
        *s.reconciles
            .entry((loop_, if ok { "ok" } else { "error" }))
            .or_default() += 1;
        s.durations
            .entry(loop_)
            .or_insert_with(|| Histogram::new(&RECONCILE_BUCKETS))
            .observe(took.as_secs_f64());
        if ok {
            s.last_success.insert(loop_, t);
        }
        for (k, n) in kinds {
            *s.changes.entry((loop_, k)).or_default() += *n as u64;
        }
        s.last.insert(
            loop_,
            LastReconcile {
                time: t,
                ok,
                duration: took.as_secs_f64(),
                changes: kinds.values().sum(),
                error: result.err(),
            },
        );
    }

    /// Whether the agent is ready (`/readyz`, the DaemonSet's readiness
    /// probe): every loop's last pass succeeded; else why not.
    pub fn readiness(&self) -> Result<(), String> {
        readiness_of(&self.state().last)
    }

    /// The last pass of `loop_`, and the time of its last success.
    pub fn last_reconcile(&self, loop_: &str) -> (Option<LastReconcile>, Option<f64>) {
        let s = self.state();
        (
            s.last.get(loop_).cloned(),
            s.last_success.get(loop_).copied(),
        )
    }

    /// The WireGuard peers' node names, for the per-peer labels.
    pub fn set_peer_names(&self, names: BTreeMap<wg::Key, String>) {
        self.state().peer_names = names;
    }

    /// BIRD's sessions as the agent last read them: (the peer, its state:
    /// "Established", "Active", or BIRD's last error).
    pub fn set_bgp_sessions(&self, sessions: Vec<(String, String)>) {
        self.state().bgp = Some(sessions);
    }

    pub fn bgp_sessions(&self) -> Option<Vec<(String, String)>> {
        self.state().bgp.clone()
    }

    pub fn set_cloud_pool(&self, pool: CloudPool) {
        self.state().cloud = Some(pool);
    }

    /// Where the pool is read when metrics or status want it.
    pub fn set_cloud_source(&self, source: CloudSource) {
        self.state().cloud_source = Some(source);
    }

    /// The pool now (from its source), or as the loop's last pass saw it.
    pub fn cloud_pool(&self) -> Option<CloudPool> {
        let (source, last) = {
            let s = self.state();
            (s.cloud_source.clone(), s.cloud.clone())
        };
        source.map(|f| f()).or(last)
    }

    /// The text exposition: the recorded families, then what is read from
    /// the node now. Blocking (bpffs, netlink, files): call it off the
    /// runtime's threads.
    pub fn render(&self) -> String {
        self.collect_cni_stats();
        let (pin_root, conf_dir, names) = {
            let s = self.state();
            (
                s.pin_root.clone(),
                s.cni_conf_dir.clone(),
                s.peer_names.clone(),
            )
        };
        let mut fams = self.recorded();
        if let Some(root) = pin_root {
            fams.extend(datapath(&root));
        }
        fams.extend(wireguard(&names));
        if let Some(dir) = conf_dir {
            fams.push(ipam_family(&dir));
        }
        let mut out = String::new();
        for f in &fams {
            f.write_to(&mut out);
        }
        out
    }

    fn recorded(&self) -> Vec<Family> {
        let cloud = self.cloud_pool();
        let s = self.state();
        let mut v = Vec::new();
        let mut f = Family::gauge(
            "rcni_build_info",
            "The running rcni-node's version (always 1).",
        );
        f.sample(&l(&[("version", env!("CARGO_PKG_VERSION"))]), 1.0);
        v.push(f);
        let mut f = Family::gauge(
            "rcni_agent_start_time_seconds",
            "When the agent started, in seconds since the epoch.",
        );
        f.sample(&[], self.start);
        v.push(f);

        let mut f = Family::counter(
            "rcni_reconcile_total",
            "Reconcile passes by loop (agent, cloud) and result (ok, error).",
        );
        for ((lp, r), n) in &s.reconciles {
            f.sample(&l(&[("loop", lp), ("result", r)]), *n as f64);
        }
        v.push(f);
        let mut f = Family::histogram(
            "rcni_reconcile_duration_seconds",
            "Time one reconcile pass took.",
        );
        for (lp, h) in &s.durations {
            f.observed(&l(&[("loop", lp)]), h);
        }
        v.push(f);
        let mut f = Family::gauge(
            "rcni_reconcile_last_success_timestamp_seconds",
            "When a reconcile pass last succeeded, in seconds since the epoch.",
        );
        for (lp, t) in &s.last_success {
            f.sample(&l(&[("loop", lp)]), *t);
        }
        v.push(f);
        let mut f = Family::counter(
            "rcni_kernel_changes_total",
            "Kernel objects the reconciles added, replaced or removed, by kind.",
        );
        for ((lp, k), n) in &s.changes {
            f.sample(&l(&[("loop", lp), ("kind", k)]), *n as f64);
        }
        v.push(f);

        let mut f = Family::counter(
            "rcni_policy_flows_total",
            "Policy flow events reported, by network, policy (namespace/name or default-deny), verdict (allow, deny, audit) and direction.",
        );
        for ((net, pol, verdict, dir), n) in &s.flows {
            f.sample(
                &l(&[
                    ("network", net),
                    ("policy", pol),
                    ("verdict", verdict),
                    ("direction", dir),
                ]),
                *n as f64,
            );
        }
        v.push(f);
        let mut f = Family::counter(
            "rcni_policy_flows_suppressed_total",
            "Policy flow events the rate limit left out, by network.",
        );
        for (net, n) in &s.suppressed {
            f.sample(&l(&[("network", net)]), *n as f64);
        }
        v.push(f);

        if let Some(c) = &s.cni {
            let mut f = Family::counter(
                "rcni_cni_commands_total",
                "CNI commands the plugins ran on this node, by plugin, command and result code (0 success, else the CNI error code).",
            );
            for ((p, cmd, code), n) in &c.commands {
                f.sample(
                    &l(&[("plugin", p), ("command", cmd), ("code", &code.to_string())]),
                    *n as f64,
                );
            }
            v.push(f);
            let mut f = Family::histogram(
                "rcni_cni_command_duration_seconds",
                "Time a plugin took for one CNI command.",
            );
            for ((p, cmd), h) in &c.durations {
                f.observed(&l(&[("plugin", p), ("command", cmd)]), h);
            }
            v.push(f);
        }

        if let Some(sessions) = &s.bgp {
            let mut f = Family::gauge(
                "rcni_bgp_session_established",
                "1 when BIRD's BGP session with the peer (a node or a router) is Established, else 0.",
            );
            for (peer, state) in sessions {
                f.sample(
                    &l(&[("peer", peer)]),
                    if state == "Established" { 1.0 } else { 0.0 },
                );
            }
            v.push(f);
        }

        if let Some(c) = &cloud {
            let mut f = Family::gauge(
                "rcni_cloud_pool_addresses",
                "The cloud pool's pod addresses by state (used, free, cooling).",
            );
            for (st, n) in [("used", c.used), ("free", c.free), ("cooling", c.cooling)] {
                f.sample(&l(&[("state", st)]), n as f64);
            }
            v.push(f);
            let mut f = Family::gauge(
                "rcni_cloud_max_pods",
                "Pods the instance type's interfaces can hold.",
            );
            f.sample(&[], c.max_pods as f64);
            v.push(f);
            let mut f = Family::counter(
                "rcni_cloud_api_calls_total",
                "Requests the pool made to the cloud's API.",
            );
            f.sample(&[], c.api_calls as f64);
            v.push(f);
            let mut f = Family::counter(
                "rcni_cloud_checkpoint_mismatches_total",
                "Checkpointed pods whose address the cloud's view did not show at the agent's start, by action: reacquired (assigned back to its interface), kept (kept for the pod and flagged, without it), dropped (an entry contradicting another).",
            );
            for (action, n) in &c.checkpoint_mismatches {
                f.sample(&l(&[("action", action)]), *n as f64);
            }
            v.push(f);
        }
        v
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

/// "redirected", "passed" or "dropped": the first word of a verdict's
/// name, for summing by outcome; "other" for a count that is no packet's
/// outcome.
pub fn verdict_action(name: &str) -> &'static str {
    ["redirected", "passed", "dropped"]
        .into_iter()
        .find(|a| name.starts_with(a))
        .unwrap_or("other")
}

/// The eBPF programs' verdict counters of every network pinned under
/// `root` (a directory per network holding its `prog`), as `fastpath
/// stats` names them; and what this node's pods sent through the datapath
/// to each other node's pod subnet.
fn datapath(root: &Path) -> Vec<Family> {
    let mut peer_packets = Family::counter(
        "rcni_datapath_peer_sent_packets_total",
        "Packets this node's pods sent to another node's pod subnet through the eBPF datapath (bpf_redirect_neigh), by network, subnet and next hop (the peer node's address or VTEP); what a node receives is its peers' count.",
    );
    let mut peer_bytes = Family::counter(
        "rcni_datapath_peer_sent_bytes_total",
        "Bytes (L2 frames as the datapath saw them) this node's pods sent to another node's pod subnet through the eBPF datapath, by network, subnet and next hop.",
    );
    let mut f = Family::counter(
        "rcni_datapath_packets_total",
        "Packets the eBPF datapath decided on, by network and verdict (as `fastpath stats` names them); action is the verdict's outcome: redirected, passed (to the normal path), dropped, or other.",
    );
    let Ok(rd) = std::fs::read_dir(root) else {
        return vec![f, peer_packets, peer_bytes];
    };
    let mut dirs: Vec<(String, PathBuf)> = rd
        .flatten()
        .filter(|e| e.path().join("prog").exists())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .collect();
    dirs.sort();
    for (net, dir) in dirs {
        let Ok(Some(dp)) = rcni_ebpf::Datapath::open(&dir) else {
            continue;
        };
        if let Ok(peers) = dp.remote_stats() {
            for (subnet, hop, st) in peers {
                let subnet = subnet.to_string();
                let nh = hop.next_hop().map(|a| a.to_string()).unwrap_or_default();
                let labels = l(&[("network", &net), ("subnet", &subnet), ("next_hop", &nh)]);
                peer_packets.sample(&labels, st.tx_packets as f64);
                peer_bytes.sample(&labels, st.tx_bytes as f64);
            }
        }
        let Ok(verdicts) = dp.verdicts() else {
            continue;
        };
        for (v, n) in verdicts {
            let name = v.name();
            f.sample(
                &l(&[
                    ("network", &net),
                    ("verdict", name),
                    ("action", verdict_action(name)),
                ]),
                n as f64,
            );
        }
    }
    vec![f, peer_packets, peer_bytes]
}

/// The WireGuard device's peers: their count, traffic and handshake age.
fn wireguard(names: &BTreeMap<wg::Key, String>) -> Vec<Family> {
    let Ok(index) = nix::net::if_::if_nametoindex(WG_NAME) else {
        return Vec::new();
    };
    let Ok(peers) = wg::WgSocket::open().and_then(|mut s| s.peer_stats(index)) else {
        return Vec::new();
    };
    let mut count = Family::gauge("rcni_wireguard_peers", "Peers on the WireGuard device.");
    count.sample(&[], peers.len() as f64);
    let mut rx = Family::counter(
        "rcni_wireguard_peer_received_bytes_total",
        "Bytes received from a WireGuard peer (a node), by peer node name.",
    );
    let mut tx = Family::counter(
        "rcni_wireguard_peer_sent_bytes_total",
        "Bytes sent to a WireGuard peer (a node), by peer node name.",
    );
    let mut hs = Family::gauge(
        "rcni_wireguard_peer_last_handshake_seconds",
        "Seconds since the last handshake with a WireGuard peer (absent before the first).",
    );
    let t = now();
    for p in &peers {
        let name = names
            .get(&p.key)
            .cloned()
            .unwrap_or_else(|| crate::wgkey::encode(&p.key));
        let labels = l(&[("peer", &name)]);
        rx.sample(&labels, p.rx_bytes as f64);
        tx.sample(&labels, p.tx_bytes as f64);
        if let Some(h) = p.last_handshake {
            hs.sample(&labels, (t - h as f64).max(0.0).floor());
        }
    }
    vec![count, rx, tx, hs]
}

fn ipam_family(conf_dir: &Path) -> Family {
    let mut f = Family::gauge(
        "rcni_ipam_addresses",
        "host-local's addresses per network and range, by state (used, free).",
    );
    for u in ipam::usage(conf_dir).0 {
        f.sample(
            &l(&[
                ("network", &u.network),
                ("range", &u.range),
                ("state", "used"),
            ]),
            u.used as f64,
        );
        f.sample(
            &l(&[
                ("network", &u.network),
                ("range", &u.range),
                ("state", "free"),
            ]),
            u.free,
        );
    }
    f
}

/// Ready once a pass has run and no loop's last pass failed: a node whose
/// conflist, routes or tables could not be written is not, and says why.
fn readiness_of(last: &BTreeMap<&'static str, LastReconcile>) -> Result<(), String> {
    if last.is_empty() {
        return Err("no reconcile pass yet".into());
    }
    let failed: Vec<String> = last
        .iter()
        .filter(|(_, l)| !l.ok)
        .map(|(name, l)| format!("{name}: {}", l.error.as_deref().unwrap_or("failed")))
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_once_every_loops_last_pass_succeeded() {
        let m = Metrics::new();
        assert_eq!(m.readiness(), Err("no reconcile pass yet".into()));
        let none = BTreeMap::new();
        m.reconciled("agent", Ok(()), Duration::from_millis(1), &none);
        assert_eq!(m.readiness(), Ok(()));
        let why = "write /host/etc/cni/net.d/10-rcni.conflist: Read-only file system";
        m.reconciled("agent", Err(why.into()), Duration::from_millis(1), &none);
        assert_eq!(m.readiness(), Err(format!("agent: {why}")));
        // The next good pass makes it ready again.
        m.reconciled("agent", Ok(()), Duration::from_millis(1), &none);
        assert_eq!(m.readiness(), Ok(()));
    }

    #[test]
    fn recorded_families_render() {
        let m = Metrics::new();
        m.policy_flow("rcni", "default/web", "deny", "ingress");
        m.policy_flow("rcni", "default/web", "deny", "ingress");
        m.policy_flows_suppressed("rcni", 5);
        m.set_bgp_sessions(vec![
            ("node n2".into(), "Established".into()),
            ("router 10.0.0.1".into(), "Active".into()),
        ]);
        let kinds = BTreeMap::from([("route", 2), ("fdb", 1)]);
        m.reconciled("agent", Ok(()), Duration::from_millis(30), &kinds);
        m.reconciled(
            "agent",
            Err("refused".into()),
            Duration::from_millis(3),
            &BTreeMap::new(),
        );
        let out = m.render();
        for want in [
            "# TYPE rcni_reconcile_total counter\n",
            "rcni_reconcile_total{loop=\"agent\",result=\"ok\"} 1\n",
            "rcni_reconcile_total{loop=\"agent\",result=\"error\"} 1\n",
            "rcni_reconcile_duration_seconds_count{loop=\"agent\"} 2\n",
            "rcni_kernel_changes_total{loop=\"agent\",kind=\"route\"} 2\n",
            "rcni_policy_flows_total{network=\"rcni\",policy=\"default/web\",verdict=\"deny\",direction=\"ingress\"} 2\n",
            "rcni_policy_flows_suppressed_total{network=\"rcni\"} 5\n",
            "rcni_build_info{version=\"",
            "rcni_bgp_session_established{peer=\"node n2\"} 1\n",
            "rcni_bgp_session_established{peer=\"router 10.0.0.1\"} 0\n",
        ] {
            assert!(out.contains(want), "{want} not in\n{out}");
        }
        let (last, ok) = m.last_reconcile("agent");
        let last = last.unwrap();
        assert!(!last.ok && last.error.as_deref() == Some("refused"));
        assert!(ok.unwrap() <= last.time);
    }

    /// Every series deploy/grafana-dashboard.json queries is one this
    /// module writes.
    #[test]
    fn the_dashboard_asks_for_metrics_that_exist() {
        let dash = include_str!("../../../deploy/grafana-dashboard.json");
        let v: serde_json::Value = serde_json::from_str(dash).unwrap();
        assert!(v["panels"].as_array().unwrap().len() > 10);
        let src = include_str!("mod.rs");
        let mut names = std::collections::BTreeSet::new();
        for (i, _) in dash.match_indices("rcni_") {
            let name: String = dash[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            names.insert(name);
        }
        assert!(names.len() > 10, "{names:?}");
        for n in names {
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| n.strip_suffix(s))
                .unwrap_or(&n);
            assert!(
                src.contains(&format!("\"{family}\"")),
                "{n} in the dashboard is not written here"
            );
        }
    }

    #[test]
    fn verdict_actions() {
        for v in rcni_ebpf::Verdict::ALL {
            let a = verdict_action(v.name());
            assert!(v.name().starts_with(a) || a == "other", "{}", v.name());
        }
        assert_eq!(verdict_action("redirected to another node"), "redirected");
        assert_eq!(verdict_action("passed: headers cut short"), "passed");
        assert_eq!(
            verdict_action("dropped: receiver's ingress policy"),
            "dropped"
        );
    }
}
