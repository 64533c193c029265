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

/// What runs: host-local alone (a list of one IPAM-only plugin), the
/// podman chain (bridge + host-local, portmap, firewall, tuning), or a
/// full chain holding one plugin under test, killed while that plugin runs
/// (see [`Plugin::chain`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setup {
    HostLocal,
    Chain(Backend),
    Plugin(Plugin),
}

impl Setup {
    pub fn label(self) -> String {
        match self {
            Setup::HostLocal => "host-local".into(),
            Setup::Chain(b) => format!("chain/{}", b.key()),
            Setup::Plugin(p) => format!("plugin/{}", p.name()),
        }
    }
}

/// Which command the kill interrupts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kill {
    /// The ADD (then DEL with what the runtime cached, then GC).
    Add,
    /// The DEL of a pod added normally (then the DEL again, then GC).
    Del,
}

impl Kill {
    pub fn name(self) -> &'static str {
        match self {
            Kill::Add => "ADD",
            Kill::Del => "DEL",
        }
    }
}

/// A plugin killed while it runs inside a full chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plugin {
    Bridge,
    Ptp,
    Vlan,
    HostDevice,
    Dhcp,
    Portmap,
    Firewall,
    Tuning,
    Bandwidth,
    Fastpath,
    Policy,
    Multinet,
}

impl Plugin {
    pub const ALL: [Plugin; 12] = [
        Plugin::Bridge,
        Plugin::Ptp,
        Plugin::Vlan,
        Plugin::HostDevice,
        Plugin::Dhcp,
        Plugin::Portmap,
        Plugin::Firewall,
        Plugin::Tuning,
        Plugin::Bandwidth,
        Plugin::Fastpath,
        Plugin::Policy,
        Plugin::Multinet,
    ];

    /// The binary's name (and its process's `comm`).
    pub fn name(self) -> &'static str {
        match self {
            Plugin::Bridge => "bridge",
            Plugin::Ptp => "ptp",
            Plugin::Vlan => "vlan",
            Plugin::HostDevice => "host-device",
            Plugin::Dhcp => "dhcp",
            Plugin::Portmap => "portmap",
            Plugin::Firewall => "firewall",
            Plugin::Tuning => "tuning",
            Plugin::Bandwidth => "bandwidth",
            Plugin::Fastpath => "fastpath",
            Plugin::Policy => "policy",
            Plugin::Multinet => "multinet",
        }
    }

    pub fn parse(s: &str) -> Option<Plugin> {
        Plugin::ALL.into_iter().find(|p| p.name() == s)
    }

    /// Why the plugin cannot be tried on this kernel, if it cannot.
    pub fn unavailable(self) -> Option<String> {
        if self != Plugin::Vlan {
            return None;
        }
        // A VLAN link needs the 8021q module, which containers and CI
        // hosts without module loading lack (the VM tests have it).
        let probe = NetNs::new_anonymous().ok()?;
        let ok = probe
            .command("ip")
            .args(["link", "add", "p0", "type", "veth", "peer", "name", "p1"])
            .status()
            .is_ok_and(|s| s.success())
            && probe
                .command("ip")
                .args([
                    "link", "add", "link", "p0", "name", "p0.5", "type", "vlan", "id", "5",
                ])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
        (!ok).then(|| "no 802.1q on this kernel (VLAN links): run it in the VM".to_string())
    }

    /// The interface plugin of the chain, with `ipam`.
    fn main_plugin(self, ipam: Value) -> Value {
        match self {
            Plugin::Ptp => json!({"type": "ptp", "ipMasq": true, "ipMasqBackend": "nftables",
                                   "mtu": 1400, "ipam": ipam}),
            Plugin::Vlan => json!({"type": "vlan", "master": TRUNK, "vlanId": 42, "ipam": ipam}),
            Plugin::HostDevice => {
                json!({"type": "host-device", "device": HOST_DEVICE, "ipam": ipam})
            }
            // The server is on the bridge: no gateway address, no masquerading.
            Plugin::Dhcp => json!({"type": "bridge", "bridge": BRIDGE, "ipam": ipam}),
            _ => json!({"type": "bridge", "bridge": BRIDGE, "isGateway": true, "ipMasq": true,
                        "ipMasqBackend": "nftables", "hairpinMode": true, "ipam": ipam}),
        }
    }

    /// The full chain around the plugin: its interface plugin and IPAM,
    /// portmap, firewall, tuning, bandwidth (not with host-device and
    /// vlan: no host-side link to shape), and fastpath and policy with the
    /// bridge (they need a host veth); multinet delegates to that chain as
    /// its default network.
    pub fn chain(self, state: &Path, pins: &Path) -> Vec<Value> {
        let ipam = if self == Plugin::Dhcp {
            json!({"type": "dhcp", "daemonSocketPath": state.join("dhcp.sock")})
        } else {
            json!({"type": "host-local", "dataDir": state.join("ipam"),
                   "routes": [{"dst": "0.0.0.0/0"}],
                   "ranges": [[{"subnet": SUBNET, "gateway": GATEWAY}]]})
        };
        let mut plugins = vec![
            self.main_plugin(ipam),
            json!({"type": "portmap", "backend": "nftables",
                   "capabilities": {"portMappings": true}}),
            json!({"type": "firewall", "backend": "nftables"}),
            json!({"type": "tuning", "dataDir": state.join("tuning"), "mtu": 1400,
                   "sysctl": {"net.ipv4.conf.eth0.arp_notify": "1"}}),
        ];
        if !matches!(self, Plugin::HostDevice | Plugin::Vlan) {
            plugins.push(json!({"type": "bandwidth",
                "ingressRate": 100_000_000u64, "ingressBurst": 1_000_000,
                "egressRate": 100_000_000u64, "egressBurst": 1_000_000}));
        }
        if matches!(
            self,
            Plugin::Bridge
                | Plugin::Portmap
                | Plugin::Firewall
                | Plugin::Tuning
                | Plugin::Bandwidth
                | Plugin::Fastpath
                | Plugin::Policy
                | Plugin::Multinet
        ) {
            plugins.push(json!({"type": "fastpath", "pinRoot": pins}));
            plugins.push(json!({"type": "policy", "backend": "ebpf", "pinRoot": pins,
                "dataDir": state.join("policy"), "policyDir": state.join("policy.d"),
                "policies": [{"name": "prod-only", "namespace": "prod", "podSelector": {},
                    "ingress": [{"from": [{"namespaceSelector": {"matchLabels":
                        {"kubernetes.io/metadata.name": "prod"}}}]}]}],
                "args": {"cni": {"labels": {"app": "chaos"}, "namespace": "prod"}}}));
        }
        plugins
    }
}

pub const NETWORK: &str = "chaosnet";
pub const BRIDGE: &str = "chaosbr0";
/// The network multinet delegates to.
pub const DEFAULT_NETWORK: &str = "chaosdef";
/// host-device's device, a veth of the node.
pub const HOST_DEVICE: &str = "chaoshd0";
/// vlan's master, a veth of the node.
pub const TRUNK: &str = "chaostrunk0";
/// The DHCP server's address, on the bridge.
pub const DHCP_SERVER: &str = "10.78.0.1";

const SUBNET: &str = "10.90.0.0/16";
const GATEWAY: &str = "10.90.0.1";

/// The conflist of `setup` with its state in `state` (and BPF pins under
/// `pins`), at CNI `version`; for multinet, also the default network's
/// conflist it delegates to.
pub fn conflists(setup: Setup, state: &Path, pins: &Path, version: &str) -> (Value, Option<Value>) {
    let Setup::Plugin(p) = setup else {
        return (conflist(setup, state, version), None);
    };
    let chain = p.chain(state, pins);
    if p != Plugin::Multinet {
        return (
            json!({"cniVersion": version, "name": NETWORK, "plugins": chain}),
            None,
        );
    }
    let multinet = json!({"type": "multinet", "defaultNetwork": DEFAULT_NETWORK,
        "defaultConfDir": state.join("default.d"), "confDir": state.join("extra.d"),
        "cacheDir": state.join("multinet/cache"), "statusDir": state.join("multinet/status"),
        "capabilities": {"portMappings": true}});
    (
        json!({"cniVersion": version, "name": NETWORK, "plugins": [multinet]}),
        Some(json!({"cniVersion": version, "name": DEFAULT_NETWORK, "plugins": chain})),
    )
}

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
        Setup::Plugin(_) => return conflists(setup, state, state, version).0,
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
    /// `tc qdisc show` lines of the node (bandwidth's shaping).
    pub qdiscs: Vec<String>,
    /// Files under the bpffs (fastpath's and policy's pins).
    pub pins: BTreeSet<String>,
    /// BPF map entries, as the harness's lister prints them.
    pub bpf: Vec<String>,
    /// policy's state files.
    pub policy: BTreeSet<String>,
    /// The dhcp daemon's lease files and the server's leases (`server IP`).
    pub leases: BTreeSet<String>,
    /// multinet's cache and status files.
    pub multinet: BTreeSet<String>,
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
    /// Links of the node that are gone (host-device's device not given
    /// back).
    pub links_gone: Vec<String>,
    pub qdiscs: Vec<String>,
    pub pins: Vec<String>,
    pub bpf: Vec<String>,
    pub policy: Vec<String>,
    pub leases: Vec<String>,
    pub multinet: Vec<String>,
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
            && self.links_gone.is_empty()
            && self.qdiscs.is_empty()
            && self.pins.is_empty()
            && self.bpf.is_empty()
            && self.policy.is_empty()
            && self.leases.is_empty()
            && self.multinet.is_empty()
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

/// One killed ADD or DEL and what followed.
#[derive(Clone, Debug)]
pub struct Trial {
    pub container_id: String,
    /// With kills during DEL: the normal ADD before it (a failure counts).
    pub first_add: Option<Outcome>,
    /// Delay before the kill.
    pub delay: Duration,
    /// What was running when the kill came: the process chain under
    /// cnitool (`cnitool>bridge>host-local`), or `finished`.
    pub phase: String,
    /// The killed command's outcome.
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

/// Lists the BPF map entries under a bpffs (the node namespace, the
/// bpffs): testkit does not link the datapath crate, a caller that does
/// supplies this.
pub type BpfLister = fn(&NetNs, &Path) -> Vec<String>;

/// A child killed and reaped when dropped.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The DHCP side of the dhcp setup: dnsmasq in a server namespace on the
/// node's bridge, and the dhcp daemon in the node.
struct DhcpSide {
    _server: NetNs,
    _dnsmasq: Reaped,
    daemon: Reaped,
}

/// A node namespace, the network's state and its configuration.
pub struct Harness {
    pub setup: Setup,
    pub kill: Kill,
    /// The process name whose run the kill window covers (`None`: the
    /// whole command).
    target: Option<&'static str>,
    /// The kill window: the target's run within the killed command, from
    /// the command's start (medians of the calibration runs).
    pub window: (Duration, Duration),
    bpffs: Option<crate::Bpffs>,
    bpf_lister: Option<BpfLister>,
    dhcp: Option<DhcpSide>,
    /// Timed normal runs per calibration.
    calibration: usize,
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

impl DhcpSide {
    /// dnsmasq serving 10.78.0.0/24 from a server namespace on the node's
    /// bridge, and the daemon in the node with its socket and state under
    /// `state`; both tied to this process.
    fn start(node: &NetNs, state: &Path, bins: &Path) -> DhcpSide {
        let server = NetNs::new_anonymous().expect("server namespace");
        let ip = |ns: &NetNs, args: &str| crate::ip(ns, args);
        ip(node, &format!("link add {BRIDGE} type bridge"));
        ip(node, &format!("link set {BRIDGE} up"));
        ip(
            node,
            &format!(
                "link add srv-n type veth peer name srv0 netns {}",
                server.proc_path().display()
            ),
        );
        ip(node, &format!("link set srv-n master {BRIDGE} up"));
        ip(&server, &format!("addr add {DHCP_SERVER}/24 dev srv0"));
        ip(&server, "link set srv0 up");
        ip(&server, "link set lo up");
        let log = |name: &str| std::fs::File::create(state.join(name)).unwrap();
        let pidfile = state.join("dnsmasq.pid");
        // dnsmasq clears the parent-death signal: a PID namespace of its own.
        let dnsmasq = crate::tied_tree_command_in(&server, "/usr/sbin/dnsmasq")
            .args([
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-hosts",
                "--no-resolv",
                "--port=0",
                "--bind-interfaces",
                "--interface=srv0",
                "--except-interface=lo",
                "--no-ping",
                "--log-facility=-",
                "--user=root",
                "--dhcp-authoritative",
                "--dhcp-range=10.78.0.50,10.78.0.250,255.255.255.0,2m",
            ])
            .arg(format!(
                "--dhcp-leasefile={}",
                state.join("dnsmasq.leases").display()
            ))
            .arg(format!("--pid-file={}", pidfile.display()))
            .stdin(Stdio::null())
            .stdout(log("dnsmasq.log"))
            .stderr(log("dnsmasq.err"))
            .spawn()
            .expect("start dnsmasq (apt-get install dnsmasq-base)");
        let dnsmasq = Reaped(dnsmasq);
        let daemon = crate::tied_command_in(node, bins.join("dhcp"))
            .arg("daemon")
            .arg("-socketpath")
            .arg(state.join("dhcp.sock"))
            .arg("-statedir")
            .arg(state.join("dhcp-state"))
            .arg("-pidfile")
            .arg(state.join("dhcp.pid"))
            .stdin(Stdio::null())
            .stdout(log("daemon.log"))
            .stderr(log("daemon.err"))
            .spawn()
            .expect("start the dhcp daemon");
        let daemon = Reaped(daemon);
        let until = Instant::now() + Duration::from_secs(10);
        while !(pidfile.exists()
            && std::os::unix::net::UnixStream::connect(state.join("dhcp.sock")).is_ok())
        {
            assert!(
                Instant::now() < until,
                "dnsmasq or the dhcp daemon did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        DhcpSide {
            _server: server,
            _dnsmasq: dnsmasq,
            daemon,
        }
    }
}

impl Harness {
    /// The dhcp daemon's PID, with the dhcp setup.
    pub fn dhcp_daemon_pid(&self) -> Option<u32> {
        self.dhcp.as_ref().map(|d| d.daemon.0.id())
    }

    /// A node for `setup` with binaries (cnitool and the plugins) from
    /// `bins`; the node forwards, as a container host does.
    pub fn new(setup: Setup, bins: &Path, seed: u64) -> Harness {
        Harness::with_runtime(setup, bins, seed, None)
    }

    /// [`Harness::new`] with ADD and DEL run by a libcni client.
    pub fn with_runtime(setup: Setup, bins: &Path, seed: u64, libcni: Option<&Path>) -> Harness {
        Harness::build(setup, Kill::Add, bins, seed, libcni, None, 10)
    }

    /// A node with the full chain around `plugin`, its `kill` command
    /// killed while `plugin` runs (the window measured over `calibration`
    /// normal runs); `bpf` lists BPF map entries.
    pub fn plugin(
        plugin: Plugin,
        kill: Kill,
        bins: &Path,
        seed: u64,
        bpf: Option<BpfLister>,
        calibration: usize,
    ) -> Harness {
        Harness::build(
            Setup::Plugin(plugin),
            kill,
            bins,
            seed,
            None,
            bpf,
            calibration,
        )
    }

    fn build(
        setup: Setup,
        kill: Kill,
        bins: &Path,
        seed: u64,
        libcni: Option<&Path>,
        bpf_lister: Option<BpfLister>,
        calibration: usize,
    ) -> Harness {
        crate::require_root();
        let node = NetNs::new_anonymous().expect("node namespace");
        let state = tempfile::Builder::new()
            .prefix("rcni-chaos-")
            .tempdir()
            .unwrap();
        for d in ["conf", "policy.d", "default.d", "extra.d"] {
            std::fs::create_dir_all(state.path().join(d)).unwrap();
        }
        let plugin = match setup {
            Setup::Plugin(p) => Some(p),
            _ => None,
        };
        let bpffs = plugin.map(|_| crate::Bpffs::mount());
        let pins = bpffs
            .as_ref()
            .map_or(state.path().to_path_buf(), |b| b.path().to_path_buf());
        // libcni 1.1 knows versions up to 1.0.0 (and so no GC).
        let version = if libcni.is_some() { "1.0.0" } else { "1.1.0" };
        let (list, default) = conflists(setup, state.path(), &pins, version);
        std::fs::write(
            state.path().join("conf/chaos.conflist"),
            serde_json::to_vec_pretty(&list).unwrap(),
        )
        .unwrap();
        if let Some(d) = default {
            std::fs::write(
                state.path().join("default.d/10-default.conflist"),
                serde_json::to_vec_pretty(&d).unwrap(),
            )
            .unwrap();
        }
        let _ = rcni_netlink::sysctl::set(&node, "net/ipv4/ip_forward", "1");
        let ip = |args: &str| crate::ip(&node, args);
        let mut dhcp = None;
        match plugin {
            // veth pairs: this host's kernel may lack dummy links.
            Some(Plugin::HostDevice) => {
                ip(&format!(
                    "link add {HOST_DEVICE} type veth peer name {HOST_DEVICE}p"
                ));
                ip(&format!("link set {HOST_DEVICE}p up"));
            }
            Some(Plugin::Vlan) => {
                ip(&format!("link add {TRUNK} type veth peer name {TRUNK}p"));
                ip(&format!("link set {TRUNK}p up"));
                ip(&format!("link set {TRUNK} up"));
            }
            Some(Plugin::Dhcp) => dhcp = Some(DhcpSide::start(&node, state.path(), bins)),
            _ => {}
        }
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
            kill,
            target: plugin.map(Plugin::name),
            window: (Duration::ZERO, Duration::ZERO),
            bpffs,
            bpf_lister,
            dhcp,
            calibration: 10,
        };
        h.calibration = calibration.max(1);
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
        // setpriv execs cnitool: the PID, and so the process group, stay.
        let mut c = crate::tied_command_in(&self.node, self.bins.join("cnitool"));
        crate::keep_probe_dir(c.env_clear())
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
        crate::keep_probe_dir(c.env_clear())
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

    fn del_cmd(&self, pod: &str, cid: &str) -> Command {
        let mut c = match &self.libcni {
            Some(client) => self.libcni_cmd(client, "del", pod, cid),
            None => self.cnitool(&["del", NETWORK, pod, "--container-id", cid]),
        };
        c.process_group(0);
        c
    }

    /// The command the trials kill.
    fn killed_cmd(&self, pod: &str, cid: &str) -> Command {
        match self.kill {
            Kill::Add => self.add_cmd(pod, cid),
            Kill::Del => self.del_cmd(pod, cid),
        }
    }

    /// DEL as the runtime runs it after a failed ADD.
    pub fn del(&self, pod: &str, cid: &str) -> Outcome {
        Outcome::of(
            self.del_cmd(pod, cid)
                .output()
                .expect("run the runtime's DEL"),
        )
    }

    /// Runs `c` to its end, watching which processes run: its outcome,
    /// wall time and when the target process was first and last seen.
    fn run_watched(&self, mut c: Command) -> (Outcome, Duration, Option<(Duration, Duration)>) {
        let t = Instant::now();
        let mut child = c.spawn().expect("spawn cnitool");
        let pid = child.id();
        let mut seen: Option<(Duration, Duration)> = None;
        if let Some(target) = self.target {
            while child.try_wait().expect("wait for cnitool").is_none() {
                if process_chain(pid).split('>').any(|p| p == target) {
                    let now = t.elapsed();
                    seen = Some((seen.map_or(now, |s| s.0), now));
                }
                std::thread::yield_now();
            }
        }
        let out = child.wait_with_output().expect("wait for cnitool");
        (Outcome::of(out), t.elapsed(), seen)
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
        self.measure(3.min(self.calibration), self.calibration);
    }

    /// `warm` untimed and `timed` timed normal ADDs (each followed by its
    /// DEL), then GC: the median timed ADD becomes the kill window.
    fn measure(&mut self, warm: usize, timed: usize) {
        let mut times = Vec::new();
        let (mut starts, mut ends) = (Vec::new(), Vec::new());
        for i in 0..warm + timed {
            let pod = NetNs::new_anonymous().expect("pod namespace");
            let path = pod.proc_path().display().to_string();
            let cid = self.cid();
            let (add, add_took, add_seen) = self.run_watched(self.add_cmd(&path, &cid));
            assert!(add.ok, "calibration ADD failed: {}", add.message());
            let (del, del_took, del_seen) = self.run_watched(self.del_cmd(&path, &cid));
            assert!(del.ok, "calibration DEL failed: {}", del.message());
            if i >= warm {
                let (took, seen) = match self.kill {
                    Kill::Add => (add_took, add_seen),
                    Kill::Del => (del_took, del_seen),
                };
                times.push(took);
                if let Some((s, e)) = seen {
                    starts.push(s);
                    ends.push(e);
                }
            }
        }
        let gc = self.gc();
        assert!(gc.ok, "calibration GC failed: {}", gc.message());
        times.sort();
        starts.sort();
        ends.sort();
        self.add_time = times[times.len() / 2];
        self.window = match (starts.get(starts.len() / 2), ends.get(ends.len() / 2)) {
            // Seen between two looks at /proc: its run reaches at most the
            // next look, a fraction of a millisecond later.
            (Some(&s), Some(&e)) => (s, e.max(s) + Duration::from_micros(300)),
            _ => (Duration::ZERO, self.add_time),
        };
        self.before = self.snapshot();
    }

    fn net_dir(&self) -> PathBuf {
        let net = if self.setup == Setup::Plugin(Plugin::Multinet) {
            DEFAULT_NETWORK
        } else {
            NETWORK
        };
        self.state.path().join("ipam").join(net)
    }

    /// Files under `d`, recursively, as paths relative to it.
    fn tree(d: &Path) -> BTreeSet<String> {
        fn walk(root: &Path, d: &Path, out: &mut BTreeSet<String>) {
            for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
                let p = e.path();
                if p.is_dir() {
                    walk(root, &p, out);
                } else if p.file_name().is_some_and(|n| n != "lock") {
                    out.insert(p.strip_prefix(root).unwrap().display().to_string());
                }
            }
        }
        let mut out = BTreeSet::new();
        walk(d, d, &mut out);
        out
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
        if matches!(self.setup, Setup::Plugin(_)) {
            s.qdiscs = lines_of(self.node.command("tc").args(["qdisc", "show"]));
            s.qdiscs.sort();
            s.policy = Self::tree(&self.state.path().join("policy"));
            s.multinet = Self::tree(&self.state.path().join("multinet"));
        }
        if let Some(b) = &self.bpffs {
            s.pins = b.files();
            if let Some(list) = self.bpf_lister {
                s.bpf = list(&self.node, b.path());
                s.bpf.sort();
            }
        }
        if self.dhcp.is_some() {
            s.leases = Self::tree(&self.state.path().join("dhcp-state"));
            for l in std::fs::read_to_string(self.state.path().join("dnsmasq.leases"))
                .unwrap_or_default()
                .lines()
            {
                if let Some(ip) = l.split_whitespace().nth(2) {
                    s.leases.insert(format!("server {ip}"));
                }
            }
        }
        s
    }

    /// One trial: ADD killed after a uniform delay in [0, ADD time], then
    /// DEL and GC, then what is left.
    pub fn trial(&mut self) -> Trial {
        let (from, to) = self.window;
        let span = (to.saturating_sub(from)).as_micros().max(1) as u64;
        let delay = from + Duration::from_micros(self.random() % (span + 1));
        let cid = self.cid();
        let pod = NetNs::new_anonymous().expect("pod namespace");
        let path = pod.proc_path().display().to_string();
        let first_add = (self.kill == Kill::Del)
            .then(|| Outcome::of(self.add_cmd(&path, &cid).output().expect("run cnitool add")));
        let started = Instant::now();
        let child = self.killed_cmd(&path, &cid).spawn().expect("spawn cnitool");
        let pid = child.id();
        match self.target {
            // Anchored on the plugin's start as it happens (then uniform
            // over its calibrated length): on a loaded node a command's
            // pace drifts from the calibration's, and a delay counted from
            // the command's start lands in other plugins.
            Some(target) => {
                let limit = to * 4 + Duration::from_secs(1);
                loop {
                    let chain = process_chain(pid);
                    if chain == "finished"
                        || chain.split('>').any(|p| p == target)
                        || started.elapsed() > limit
                    {
                        break;
                    }
                    std::thread::sleep(Duration::from_micros(50));
                }
                std::thread::sleep(Duration::from_micros(self.random() % (span + 1)));
            }
            None => std::thread::sleep(delay),
        }
        let delay = started.elapsed();
        let phase = process_chain(pid);
        // The group is ours until the child is reaped (its ID cannot be
        // reused before), so this reaches no stranger.
        // SAFETY: plain kill(2) of a process group we created.
        unsafe { libc::killpg(pid as i32, libc::SIGKILL) };
        let add = Outcome::of(child.wait_with_output().expect("wait for cnitool"));
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
        let now = self.settled_snapshot();
        let mut left = self.diff(&now);
        left.pod_links = pod_links.into_iter().collect();
        // Each trial counts only what it left itself.
        self.before = now;
        Trial {
            container_id: cid,
            first_add,
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

    /// A snapshot, once dnsmasq has dropped the leases released: it does
    /// when it handles the DHCPRELEASE, which the daemon sends without
    /// waiting for an answer.
    fn settled_snapshot(&self) -> Snapshot {
        let mut now = self.snapshot();
        let until = Instant::now() + Duration::from_secs(3);
        while self.dhcp.is_some()
            && now.leases.difference(&self.before.leases).next().is_some()
            && Instant::now() < until
        {
            std::thread::sleep(Duration::from_millis(50));
            now = self.snapshot();
        }
        now
    }

    /// What the node holds now that it did not after calibration (or the
    /// last trial).
    pub fn leftovers(&self) -> Leftovers {
        self.diff(&self.settled_snapshot())
    }

    /// One normal ADD of a new pod and its DEL, both through the runtime
    /// (a soak's cycle; callable from several threads at once).
    pub fn cycle(&self, cid: &str) -> (Outcome, Outcome) {
        let pod = NetNs::new_anonymous().expect("pod namespace");
        let path = pod.proc_path().display().to_string();
        let add = Outcome::of(self.add_cmd(&path, cid).output().expect("run cnitool add"));
        let del = self.del(&path, cid);
        (add, del)
    }

    fn diff(&self, now: &Snapshot) -> Leftovers {
        let b = &self.before;
        Leftovers {
            reservations: now
                .reservations
                .iter()
                .filter(|(n, _)| !b.reservations.contains_key(*n))
                .map(|(n, s)| (n.clone(), *s))
                .collect(),
            ipam_dot: now.ipam_dot.difference(&b.ipam_dot).cloned().collect(),
            links: now.links.difference(&b.links).cloned().collect(),
            pod_links: Vec::new(),
            rules: multiset_diff(&now.rules, &b.rules),
            backups: now.backups.difference(&b.backups).cloned().collect(),
            cache: now.cache.difference(&b.cache).cloned().collect(),
            links_gone: b.links.difference(&now.links).cloned().collect(),
            qdiscs: multiset_diff(&now.qdiscs, &b.qdiscs),
            pins: now.pins.difference(&b.pins).cloned().collect(),
            bpf: multiset_diff(&now.bpf, &b.bpf),
            policy: now.policy.difference(&b.policy).cloned().collect(),
            leases: now.leases.difference(&b.leases).cloned().collect(),
            multinet: now.multinet.difference(&b.multinet).cloned().collect(),
        }
    }

    pub fn run(&mut self, trials: usize) -> Report {
        self.run_until(trials, None)
    }

    /// [`Harness::run`], stopping early at `deadline` (the report holds
    /// the trials run).
    pub fn run_until(&mut self, trials: usize, deadline: Option<Instant>) -> Report {
        let mut r = Report {
            runtime: if self.libcni.is_some() {
                "libcni"
            } else {
                "cnitool"
            },
            setup: self.setup,
            kill: self.kill,
            add_time: self.add_time,
            window: self.window,
            trials: Vec::with_capacity(trials),
        };
        for i in 0..trials {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            // The node's load drifts (other work, caches): the window
            // follows it.
            if i > 0 && i % 100 == 0 {
                self.measure(0, self.calibration);
                r.add_time = self.add_time;
                r.window = self.window;
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
    pub kill: Kill,
    /// The killed command's median time, and the kill window.
    pub add_time: Duration,
    pub window: (Duration, Duration),
    pub trials: Vec<Trial>,
}

impl Report {
    /// Trials whose normal ADD (before a killed DEL) failed.
    pub fn add_failures(&self) -> Vec<&Trial> {
        self.trials
            .iter()
            .filter(|t| t.first_add.as_ref().is_some_and(|a| !a.ok))
            .collect()
    }

    /// Trials with a leftover or a failed command.
    pub fn bad(&self) -> usize {
        self.trials
            .iter()
            .filter(|t| {
                !t.left.is_empty()
                    || !t.del.ok
                    || !t.gc.ok
                    || t.first_add.as_ref().is_some_and(|a| !a.ok)
            })
            .count()
    }

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
                ("node links gone", l.links_gone.len()),
                ("qdiscs", l.qdiscs.len()),
                ("bpf pins", l.pins.len()),
                ("bpf map entries", l.bpf.len()),
                ("policy state", l.policy.len()),
                ("dhcp leases", l.leases.len()),
                ("multinet state", l.multinet.len()),
            ] {
                *m.entry(k).or_insert(0) += n;
            }
        }
        m
    }

    /// The summary table, and every failure and leak in full.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        match self.setup {
            Setup::Plugin(p) => {
                let _ = writeln!(
                    s,
                    "== {} {} killed, through {}: {} trials, killed at a moment uniform over {}'s run, from its start (calibrated: {:.1} to {:.1} ms into a {:.1} ms {}, medians)",
                    self.setup.label(),
                    self.kill.name(),
                    self.runtime,
                    self.trials.len(),
                    p.name(),
                    ms(self.window.0),
                    ms(self.window.1),
                    ms(self.add_time),
                    self.kill.name(),
                );
            }
            _ => {
                let _ = writeln!(
                    s,
                    "== {} through {}: {} trials, kill delay uniform over [0, median normal ADD] (last: {:.1} ms)",
                    self.setup.label(),
                    self.runtime,
                    self.trials.len(),
                    ms(self.add_time)
                );
            }
        }
        let mut phases: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
        for t in &self.trials {
            let e = phases.entry(&t.phase).or_default();
            e.0 += 1;
            if !t.left.is_empty()
                || !t.del.ok
                || !t.gc.ok
                || t.first_add.as_ref().is_some_and(|a| !a.ok)
            {
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
        for t in self.add_failures() {
            let _ = writeln!(
                s,
                "  ADD before the killed DEL failed: {}: {}",
                t.container_id,
                t.first_add
                    .as_ref()
                    .map(Outcome::message)
                    .unwrap_or_default()
            );
        }
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
