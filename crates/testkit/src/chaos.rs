//! The kill test: a network's ADD, run through `cnitool` the way a runtime
//! runs it (libcni semantics, result cache), is killed with SIGKILL to its
//! whole process group (cnitool, the plugin it runs, that plugin's IPAM
//! child and netfilter tools, the nfnetlink releaser) after a delay drawn
//! uniformly over the length of a normal ADD; then the runtime does what it
//! does next: DEL (with the cached result, which a killed ADD never wrote)
//! and GC with an empty valid set. Whatever the node still holds after that
//! is a leak: host-local reservations (empty ones too), links, netfilter
//! rules, tuning backups, cached results; and a failed DEL or GC is a
//! failure with its full CNI error and stderr.
//!
//! Everything runs in a node namespace of the harness's own and pod
//! namespaces held by it; state directories are temporary.

use rcni_netns::NetNs;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The netfilter backend of the chain's portmap, firewall and bridge
/// masquerading, named explicitly (the defaults differ between versions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Iptables,
    Nftables,
    /// The reference's masquerading (iptables) with portmap and firewall
    /// on nftables: the podman chain with rcni's defaults when issue 21
    /// was found.
    Mixed,
}

impl Backend {
    fn key(self) -> &'static str {
        match self {
            Backend::Iptables => "iptables",
            Backend::Nftables => "nftables",
            Backend::Mixed => "mixed",
        }
    }

    /// The backend of bridge's masquerading and of the meta plugins.
    fn keys(self) -> (&'static str, &'static str) {
        match self {
            Backend::Mixed => ("iptables", "nftables"),
            b => (b.key(), b.key()),
        }
    }
}

/// What runs: host-local alone (a list of one IPAM-only plugin), or the
/// podman chain (bridge + host-local, portmap, firewall, tuning).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setup {
    HostLocal,
    Chain(Backend),
}

impl Setup {
    pub fn label(self) -> String {
        match self {
            Setup::HostLocal => "host-local".into(),
            Setup::Chain(b) => format!("chain/{}", b.key()),
        }
    }
}

pub const NETWORK: &str = "chaosnet";
pub const BRIDGE: &str = "chaosbr0";
const SUBNET: &str = "10.90.0.0/16";
const GATEWAY: &str = "10.90.0.1";

/// The conflist of `setup` with its state in `state`, at CNI `version`.
pub fn conflist(setup: Setup, state: &Path, version: &str) -> Value {
    let ipam = json!({
        "type": "host-local",
        "dataDir": state.join("ipam"),
        "routes": [{"dst": "0.0.0.0/0"}],
        "ranges": [[{"subnet": SUBNET, "gateway": GATEWAY}]]
    });
    let plugins = match setup {
        Setup::HostLocal => json!([{"type": "host-local", "ipam": ipam}]),
        Setup::Chain(b) => json!([
            {"type": "bridge", "bridge": BRIDGE, "isGateway": true, "ipMasq": true,
             "ipMasqBackend": b.keys().0, "hairpinMode": true, "ipam": ipam},
            {"type": "portmap", "backend": b.keys().1, "capabilities": {"portMappings": true}},
            {"type": "firewall", "backend": b.keys().1},
            // Something to change, so that tuning writes a backup.
            {"type": "tuning", "dataDir": state.join("tuning"), "mtu": 1400,
             "sysctl": {"net.ipv4.conf.eth0.arp_notify": "1"}}
        ]),
    };
    json!({"cniVersion": version, "name": NETWORK, "plugins": plugins})
}

/// How a cnitool command ended.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub ok: bool,
    pub status: String,
    pub stdout: String,
    pub stderr: String,
}

impl Outcome {
    fn of(out: std::process::Output) -> Outcome {
        Outcome {
            ok: out.status.success(),
            status: out.status.to_string(),
            stdout: String::from_utf8_lossy(&out.stdout).trim().to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        }
    }

    /// The CNI error's message (or what was printed), on one line.
    pub fn message(&self) -> String {
        let msg = serde_json::from_str::<Value>(&self.stdout)
            .ok()
            .and_then(|v| {
                Some(format!(
                    "code {} {}",
                    v.get("code")?,
                    v.get("msg").and_then(Value::as_str).unwrap_or("")
                ))
            })
            .unwrap_or_else(|| self.stdout.clone());
        format!("{msg} | stderr: {}", self.stderr).replace('\n', " / ")
    }
}

/// What the node holds, in the parts a pod's attachment may leave behind.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// host-local reservation files: name -> size (0: created, never
    /// written).
    pub reservations: BTreeMap<String, u64>,
    /// Other dot files in the network's data directory (temporary files).
    pub ipam_dot: BTreeSet<String>,
    /// Links of the node namespace.
    pub links: BTreeSet<String>,
    /// Netfilter rules: `iptables-save`/`ip6tables-save` `-A` lines and the
    /// lines of rcni's own nftables tables, as a sorted multiset.
    pub rules: Vec<String>,
    /// tuning's backup files.
    pub backups: BTreeSet<String>,
    /// cnitool's cached results.
    pub cache: BTreeSet<String>,
}

/// What a trial left that the node did not hold before it.
#[derive(Clone, Debug, Default)]
pub struct Leftovers {
    pub reservations: Vec<(String, u64)>,
    pub ipam_dot: Vec<String>,
    pub links: Vec<String>,
    pub pod_links: Vec<String>,
    pub rules: Vec<String>,
    pub backups: Vec<String>,
    pub cache: Vec<String>,
}

impl Leftovers {
    pub fn is_empty(&self) -> bool {
        self.reservations.is_empty()
            && self.ipam_dot.is_empty()
            && self.links.is_empty()
            && self.pod_links.is_empty()
            && self.rules.is_empty()
            && self.backups.is_empty()
            && self.cache.is_empty()
    }
}

pub(crate) fn lines_of(cmd: &mut Command) -> Vec<String> {
    // A tool that fails must fail the check: an empty snapshot before and
    // after would compare equal and hide every leak.
    crate::stdout_of(cmd).lines().map(str::to_string).collect()
}

/// The lines of the nftables tables that are not iptables-nft's (those
/// carry counters and are read through iptables-save).
pub(crate) fn nft_rules(ns: &NetNs) -> Vec<String> {
    let mut out = Vec::new();
    let mut skip = false;
    for l in lines_of(ns.command("nft").args(["list", "ruleset"])) {
        if let Some(rest) = l.strip_prefix("table ") {
            let mut w = rest.split_whitespace();
            let (fam, name) = (w.next().unwrap_or(""), w.next().unwrap_or(""));
            skip = matches!(fam, "ip" | "ip6" | "arp" | "bridge")
                && matches!(name, "filter" | "nat" | "mangle" | "raw" | "security");
            continue;
        }
        let t = l.trim();
        if skip || t.is_empty() || t == "}" || t.starts_with("chain ") {
            continue;
        }
        out.push(t.to_string());
    }
    out
}

pub(crate) fn ipt_rules(ns: &NetNs) -> Vec<String> {
    let mut out = Vec::new();
    for tool in ["iptables-save", "ip6tables-save"] {
        out.extend(
            lines_of(&mut ns.command(tool))
                .into_iter()
                .filter(|l| l.starts_with("-A "))
                .map(|l| format!("{tool}: {l}")),
        );
    }
    out
}

pub(crate) fn link_names(ns: &NetNs) -> BTreeSet<String> {
    lines_of(ns.command("ip").args(["-o", "link", "show"]))
        .iter()
        .filter_map(|l| {
            let name = l.split(": ").nth(1)?;
            Some(name.split('@').next().unwrap_or(name).to_string())
        })
        .filter(|n| n != "lo")
        .collect()
}

pub(crate) fn dir_names(d: &Path) -> Vec<(String, u64)> {
    std::fs::read_dir(d)
        .map(|rd| {
            rd.flatten()
                .map(|e| {
                    let size = e.metadata().map(|m| m.len()).unwrap_or(0);
                    (e.file_name().to_string_lossy().into_owned(), size)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Elements of `now` not in `before`, counted as a multiset.
pub(crate) fn multiset_diff(now: &[String], before: &[String]) -> Vec<String> {
    let mut left: BTreeMap<&str, usize> = BTreeMap::new();
    for b in before {
        *left.entry(b).or_default() += 1;
    }
    let mut out = Vec::new();
    for n in now {
        match left.get_mut(n.as_str()) {
            Some(c) if *c > 0 => *c -= 1,
            _ => out.push(n.clone()),
        }
    }
    out
}

/// One killed ADD and what followed.
#[derive(Clone, Debug)]
pub struct Trial {
    pub container_id: String,
    /// Delay before the kill.
    pub delay: Duration,
    /// What was running when the kill came: the process chain under
    /// cnitool (`cnitool>bridge>host-local`), or `finished`.
    pub phase: String,
    pub add: Outcome,
    /// Whether a process of the killed ADD still existed when the DEL
    /// started (dying in the kernel, or a zombie not yet reaped by init).
    pub overlapped: bool,
    pub del: Outcome,
    /// After a failed DEL: whether a second DEL succeeded (a transient
    /// failure) and what it said.
    pub del_again: Option<Outcome>,
    pub gc: Outcome,
    pub left: Leftovers,
}

/// A node namespace, the network's state and its configuration.
pub struct Harness {
    pub setup: Setup,
    bins: PathBuf,
    pub node: NetNs,
    state: tempfile::TempDir,
    caps: String,
    before: Snapshot,
    /// Median wall time of a normal ADD.
    pub add_time: Duration,
    rng: u64,
    n: usize,
    /// A libcni client (`libcni-client add|del <confdir> <network> <netns>
    /// <containerID> <ifname> <cachedir>`) to run ADD and DEL with
    /// instead of cnitool; GC stays cnitool's (libcni 1.1 has none).
    libcni: Option<PathBuf>,
}

/// The process chain under `pid`: its own name and, while it has a child,
/// the child's, and so on (`/proc/PID/task/*/children`).
fn process_chain(pid: u32) -> String {
    let comm = |p: u32| {
        std::fs::read_to_string(format!("/proc/{p}/comm"))
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    if state
        .rsplit_once(')')
        .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
    {
        return "finished".into();
    }
    let mut chain = vec![comm(pid)];
    let mut cur = pid;
    for _ in 0..6 {
        let mut kids = Vec::new();
        if let Ok(rd) = std::fs::read_dir(format!("/proc/{cur}/task")) {
            for t in rd.flatten() {
                let p = t.path().join("children");
                for k in std::fs::read_to_string(p)
                    .unwrap_or_default()
                    .split_whitespace()
                {
                    if let Ok(k) = k.parse::<u32>() {
                        kids.push(k);
                    }
                }
            }
        }
        // The first child is the one the parent waits for; a later one
        // is the nfnetlink releaser of a plugin.
        kids.sort_unstable();
        let Some(&k) = kids.first() else { break };
        chain.push(comm(k));
        cur = k;
    }
    chain.join(">")
}

impl Harness {
    /// A node for `setup` with binaries (cnitool and the plugins) from
    /// `bins`; the node forwards, as a container host does.
    pub fn new(setup: Setup, bins: &Path, seed: u64) -> Harness {
        Harness::with_runtime(setup, bins, seed, None)
    }

    /// [`Harness::new`] with ADD and DEL run by a libcni client.
    pub fn with_runtime(setup: Setup, bins: &Path, seed: u64, libcni: Option<&Path>) -> Harness {
        crate::require_root();
        let node = NetNs::new_anonymous().expect("node namespace");
        let state = tempfile::Builder::new()
            .prefix("rcni-chaos-")
            .tempdir()
            .unwrap();
        std::fs::create_dir_all(state.path().join("conf")).unwrap();
        std::fs::write(
            state.path().join("conf/chaos.conflist"),
            // libcni 1.1 knows versions up to 1.0.0 (and so no GC).
            serde_json::to_vec_pretty(&conflist(
                setup,
                state.path(),
                if libcni.is_some() { "1.0.0" } else { "1.1.0" },
            ))
            .unwrap(),
        )
        .unwrap();
        let _ = rcni_netlink::sysctl::set(&node, "net/ipv4/ip_forward", "1");
        let caps = json!({"portMappings": [
            {"hostPort": 8080, "containerPort": 80, "protocol": "tcp"},
            {"hostPort": 8053, "containerPort": 53, "protocol": "udp"}]})
        .to_string();
        let mut h = Harness {
            setup,
            bins: bins.to_path_buf(),
            node,
            state,
            caps,
            before: Snapshot::default(),
            add_time: Duration::ZERO,
            rng: seed ^ 0x9e37_79b9_7f4a_7c15,
            n: 0,
            libcni: libcni.map(Path::to_path_buf),
        };
        h.calibrate();
        h
    }

    fn random(&mut self) -> u64 {
        // splitmix64
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn cnitool(&self, args: &[&str]) -> Command {
        let mut c = self.node.command(self.bins.join("cnitool"));
        c.env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("NETCONFPATH", self.state.path().join("conf"))
            .env("CNI_PATH", &self.bins)
            .env("CNI_CACHE_DIR", self.state.path().join("cache"))
            .env("CAP_ARGS", &self.caps)
            .env("CNI_IFNAME", "eth0")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    /// `libcni-client CMD` for the attachment, as [`Harness::cnitool`].
    fn libcni_cmd(&self, client: &Path, cmd: &str, pod: &str, cid: &str) -> Command {
        let mut c = self.node.command(client);
        c.env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("CNI_PATH", &self.bins)
            .arg(cmd)
            .arg(self.state.path().join("conf"))
            .args([NETWORK, pod, cid, "eth0"])
            .arg(self.state.path().join("cache"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    fn add_cmd(&self, pod: &str, cid: &str) -> Command {
        let mut c = match &self.libcni {
            Some(client) => self.libcni_cmd(client, "add", pod, cid),
            None => self.cnitool(&["add", NETWORK, pod, "--container-id", cid]),
        };
        // Its own process group, so that one killpg reaches every process
        // of the ADD.
        c.process_group(0);
        c
    }

    /// DEL as the runtime runs it after a failed ADD.
    pub fn del(&self, pod: &str, cid: &str) -> Outcome {
        let mut c = match &self.libcni {
            Some(client) => self.libcni_cmd(client, "del", pod, cid),
            None => self.cnitool(&["del", NETWORK, pod, "--container-id", cid]),
        };
        Outcome::of(c.output().expect("run the runtime's DEL"))
    }

    /// GC with an empty valid set.
    pub fn gc(&self) -> Outcome {
        Outcome::of(self.cnitool(&["gc", NETWORK]).output().expect("cnitool gc"))
    }

    fn cid(&mut self) -> String {
        self.n += 1;
        format!("chaos{:05}", self.n)
    }

    /// Normal ADDs and DELs: the shared state (bridge, chains, tables)
    /// exists from then on, and the median ADD time is the kill window.
    fn calibrate(&mut self) {
        self.measure(3, 10);
    }

    /// `warm` untimed and `timed` timed normal ADDs (each followed by its
    /// DEL), then GC: the median timed ADD becomes the kill window.
    fn measure(&mut self, warm: usize, timed: usize) {
        let mut times = Vec::new();
        for i in 0..warm + timed {
            let pod = NetNs::new_anonymous().expect("pod namespace");
            let path = pod.proc_path().display().to_string();
            let cid = self.cid();
            let t = Instant::now();
            let add = Outcome::of(self.add_cmd(&path, &cid).output().expect("cnitool add"));
            if i >= warm {
                times.push(t.elapsed());
            }
            assert!(add.ok, "calibration ADD failed: {}", add.message());
            let del = self.del(&path, &cid);
            assert!(del.ok, "calibration DEL failed: {}", del.message());
        }
        let gc = self.gc();
        assert!(gc.ok, "calibration GC failed: {}", gc.message());
        times.sort();
        self.add_time = times[times.len() / 2];
        self.before = self.snapshot();
    }

    fn net_dir(&self) -> PathBuf {
        self.state.path().join("ipam").join(NETWORK)
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut s = Snapshot::default();
        for (n, size) in dir_names(&self.net_dir()) {
            if n == "lock" || n.starts_with("last_reserved_ip.") {
                continue;
            }
            if n.starts_with('.') {
                s.ipam_dot.insert(n);
            } else {
                s.reservations.insert(n, size);
            }
        }
        // host-local alone touches no link and no rule.
        if self.setup != Setup::HostLocal {
            s.links = link_names(&self.node);
            let mut rules = ipt_rules(&self.node);
            rules.extend(nft_rules(&self.node));
            rules.sort();
            s.rules = rules;
        }
        s.backups = dir_names(&self.state.path().join("tuning"))
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        s.cache = dir_names(&self.state.path().join("cache/results"))
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        s
    }

    /// One trial: ADD killed after a uniform delay in [0, ADD time], then
    /// DEL and GC, then what is left.
    pub fn trial(&mut self) -> Trial {
        let window = self.add_time.as_micros().max(1) as u64;
        let delay = Duration::from_micros(self.random() % (window + 1));
        let cid = self.cid();
        let pod = NetNs::new_anonymous().expect("pod namespace");
        let path = pod.proc_path().display().to_string();
        let child = self
            .add_cmd(&path, &cid)
            .spawn()
            .expect("spawn cnitool add");
        std::thread::sleep(delay);
        let pid = child.id();
        let phase = process_chain(pid);
        // The group is ours until the child is reaped (its ID cannot be
        // reused before), so this reaches no stranger.
        // SAFETY: plain kill(2) of a process group we created.
        unsafe { libc::killpg(pid as i32, libc::SIGKILL) };
        let add = Outcome::of(child.wait_with_output().expect("wait for cnitool add"));
        // SAFETY: signal 0 only asks whether the group has a member.
        let overlapped = unsafe { libc::killpg(pid as i32, 0) } == 0;
        let del = self.del(&path, &cid);
        let del_again = (!del.ok).then(|| self.del(&path, &cid));
        let gc = self.gc();
        let pod_links = if self.setup == Setup::HostLocal {
            BTreeSet::new()
        } else {
            link_names(&pod)
        };
        drop(pod);
        let now = self.snapshot();
        let b = &self.before;
        let left = Leftovers {
            reservations: now
                .reservations
                .iter()
                .filter(|(n, _)| !b.reservations.contains_key(*n))
                .map(|(n, s)| (n.clone(), *s))
                .collect(),
            ipam_dot: now.ipam_dot.difference(&b.ipam_dot).cloned().collect(),
            links: now.links.difference(&b.links).cloned().collect(),
            pod_links: pod_links.into_iter().collect(),
            rules: multiset_diff(&now.rules, &b.rules),
            backups: now.backups.difference(&b.backups).cloned().collect(),
            cache: now.cache.difference(&b.cache).cloned().collect(),
        };
        // Each trial counts only what it left itself.
        self.before = now;
        Trial {
            container_id: cid,
            delay,
            phase,
            add,
            overlapped,
            del,
            del_again,
            gc,
            left,
        }
    }

    pub fn run(&mut self, trials: usize) -> Report {
        let mut r = Report {
            runtime: if self.libcni.is_some() {
                "libcni"
            } else {
                "cnitool"
            },
            setup: self.setup,
            add_time: self.add_time,
            trials: Vec::with_capacity(trials),
        };
        for i in 0..trials {
            // The node's load drifts (other work, caches): the window
            // follows it.
            if i > 0 && i % 100 == 0 {
                self.measure(0, 10);
                r.add_time = self.add_time;
            }
            r.trials.push(self.trial());
        }
        r
    }
}

/// Trials of one setup.
pub struct Report {
    /// What ran ADD and DEL: cnitool or libcni.
    pub runtime: &'static str,
    pub setup: Setup,
    pub add_time: Duration,
    pub trials: Vec<Trial>,
}

impl Report {
    pub fn del_failures(&self) -> Vec<&Trial> {
        self.trials.iter().filter(|t| !t.del.ok).collect()
    }

    pub fn gc_failures(&self) -> Vec<&Trial> {
        self.trials.iter().filter(|t| !t.gc.ok).collect()
    }

    pub fn leaky(&self) -> Vec<&Trial> {
        self.trials.iter().filter(|t| !t.left.is_empty()).collect()
    }

    /// Leftover counts by kind.
    pub fn leftover_counts(&self) -> BTreeMap<&'static str, usize> {
        let mut m = BTreeMap::new();
        for t in &self.trials {
            let l = &t.left;
            let empty = l.reservations.iter().filter(|(_, s)| *s == 0).count();
            for (k, n) in [
                ("reservations (written)", l.reservations.len() - empty),
                ("reservations (empty)", empty),
                ("ipam temp files", l.ipam_dot.len()),
                ("node links", l.links.len()),
                ("pod links", l.pod_links.len()),
                ("netfilter rules", l.rules.len()),
                ("tuning backups", l.backups.len()),
                ("cached results", l.cache.len()),
            ] {
                *m.entry(k).or_insert(0) += n;
            }
        }
        m
    }

    /// The summary table, and every failure and leak in full.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "== {} through {}: {} trials, kill delay uniform over [0, median normal ADD] (last: {:.1} ms)",
            self.setup.label(),
            self.runtime,
            self.trials.len(),
            self.add_time.as_secs_f64() * 1e3
        );
        let mut phases: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
        for t in &self.trials {
            let e = phases.entry(&t.phase).or_default();
            e.0 += 1;
            if !t.left.is_empty() || !t.del.ok || !t.gc.ok {
                e.1 += 1;
            }
        }
        let _ = writeln!(
            s,
            "  killed during (process chain)      trials  with leak/failure"
        );
        for (p, (n, bad)) in &phases {
            let _ = writeln!(s, "    {p:<34} {n:>6} {bad:>6}");
        }
        let _ = writeln!(s, "  leftovers after DEL + GC, by kind:");
        for (k, n) in self.leftover_counts() {
            let _ = writeln!(s, "    {k:<34} {n:>6}");
        }
        let (del, gc, leaky) = (self.del_failures(), self.gc_failures(), self.leaky());
        let _ = writeln!(
            s,
            "  trials with leftovers: {}   DEL failures: {}   GC failures: {}",
            leaky.len(),
            del.len(),
            gc.len()
        );
        let overlapped = self.trials.iter().filter(|t| t.overlapped).count();
        let _ = writeln!(
            s,
            "  DELs started while a killed process still existed: {overlapped}"
        );
        for t in &del {
            let again = match &t.del_again {
                Some(o) if o.ok => "a second DEL succeeded".to_string(),
                Some(o) => format!("a second DEL failed too: {}", o.message()),
                None => String::new(),
            };
            let _ = writeln!(
                s,
                "  DEL failed: {} (killed during {} after {} us, overlapped {}): {}; {again}",
                t.container_id,
                t.phase,
                t.delay.as_micros(),
                t.overlapped,
                t.del.message()
            );
        }
        for t in &gc {
            let _ = writeln!(
                s,
                "  GC failed: {} (killed during {}): {}",
                t.container_id,
                t.phase,
                t.gc.message()
            );
        }
        for t in leaky.iter().take(20) {
            let _ = writeln!(
                s,
                "  left by {} (killed during {} after {} us): {:?}",
                t.container_id,
                t.phase,
                t.delay.as_micros(),
                t.left
            );
        }
        if leaky.len() > 20 {
            let _ = writeln!(
                s,
                "  ... and {} more trials with leftovers",
                leaky.len() - 20
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multiset_difference_counts_repeats() {
        let v = |x: &[&str]| x.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            multiset_diff(&v(&["a", "a", "b"]), &v(&["a", "b"])),
            v(&["a"])
        );
        assert!(multiset_diff(&v(&["a"]), &v(&["a", "a"])).is_empty());
    }

    #[test]
    fn error_message_of_a_cni_error() {
        let o = Outcome {
            ok: false,
            status: "exit status: 1".into(),
            stdout: r#"{"cniVersion":"1.1.0","code":109,"msg":"boom"}"#.into(),
            stderr: "x\ny".into(),
        };
        assert_eq!(o.message(), "code 109 boom | stderr: x / y");
    }
}
