//! Policy flow events: what the policies denied (and, with
//! `"flowEvents": "all"`, every new connection they allowed), as JSON
//! lines for people and log pipelines.
//!
//! The backends report raw decisions ([`RawEvent`]): the eBPF datapath
//! through a BPF ring buffer ([`ebpf`]), nftables through NFLOG
//! ([`nft`]). Both report one event per connection attempt (a denied flow
//! once per 10 s at each point, an allowed one when it is first recorded)
//! within a per-pod rate limit (`flowRate` per second), the events over the
//! limit counted in the next one's `suppressed`. The collector ([`collect`])
//! names the pods and the policies from the network's policy state and
//! writes [`Event`]s.
//!
//! A ring buffer and an NFLOG group each have one reader, so one collector
//! runs per network: whoever holds `<dataDir>/<network>/flows.lock`
//! (rcni-node's, or a `policy flows` run while none does). It appends every
//! event to `<dataDir>/<network>/flows.jsonl` (kept under
//! [`MAX_LOG_BYTES`], the older half in `flows.jsonl.1`), which other
//! `policy flows` runs read and follow.
//!
//! # Schema, version 1
//!
//! ```json
//! {"version": 1, "time": "2026-11-27T08:00:00.123456Z", "node": "n1",
//!  "network": "k8s-pod-network", "verdict": "deny", "direction": "ingress",
//!  "protocol": "TCP",
//!  "src": {"ip": "10.244.1.5", "port": 41234, "pod": "shop/frontend"},
//!  "dst": {"ip": "10.244.1.9", "port": 8080, "pod": "shop/db"},
//!  "policy": "default-deny", "policies": ["shop/db-ingress"], "suppressed": 0}
//! ```
//!
//! - `verdict`: `deny` (dropped), `audit` (an audit-only policy would have
//!   denied it; it passed), `allow` (a policy allowed a new connection).
//! - `direction`: whose policy decided: `egress` the sender's, `ingress`
//!   the receiver's.
//! - `protocol`: `TCP`, `UDP`, `SCTP`, `ICMP`, `ICMPv6`, or the IP protocol
//!   number; `icmpType` for ICMP. `port` is left out where there is none.
//! - `pod`: `namespace/name` of this node's pods and of the other nodes'
//!   pods the agent lists; left out for other addresses.
//! - `policy`: for `allow`, the policy (`namespace/name`) whose rule
//!   allowed it; for `deny` and `audit`, `default-deny`, with `policies`
//!   the policies that selected the pod that way (none of which allows it).
//! - `suppressed`: events of the same policed pod the rate limit dropped
//!   since its previous event.
//!
//! New fields may be added within a version; a changed meaning bumps it.

pub mod ebpf;
pub mod nft;

use crate::compile::{Desired, PodPolicy, PodView, compile};
use crate::conf::Conf;
use crate::model::{Dir, PolicySet};
use crate::state::State;
use rcni_cni::{CniError, ErrorCode};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufRead, BufReader, Seek, SeekFrom, Write};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// The schema version every event carries.
pub const SCHEMA_VERSION: u32 = 1;
/// `flows.jsonl` is rotated (to `flows.jsonl.1`) past this size.
pub const MAX_LOG_BYTES: u64 = 8 << 20;
const LOG: &str = "flows.jsonl";
const LOG_OLD: &str = "flows.jsonl.1";
const LOCK: &str = "flows.lock";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Deny,
    Allow,
    Audit,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Deny => "deny",
            Verdict::Allow => "allow",
            Verdict::Audit => "audit",
        }
    }
}

/// A backend's report of one decision, before the pods and policies are
/// named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawEvent {
    pub time: SystemTime,
    pub verdict: Verdict,
    /// Whose policy decided: egress the sender's, ingress the receiver's.
    pub dir: Dir,
    pub proto: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    /// Host order; 0 where the protocol has none (ICMP echo: the id).
    pub sport: u16,
    pub dport: u16,
    pub icmp_type: Option<u8>,
    pub suppressed: u64,
}

/// Where raw events come from: a backend's kernel channel.
pub trait Source {
    /// Waits up to `timeout` for events; what arrived (maybe nothing).
    fn poll(&mut self, timeout: Duration) -> Result<Vec<RawEvent>, CniError>;
    /// Whether the kernel side was replaced (the network's datapath
    /// removed and loaded again): the collector must open a new source.
    fn stale(&self) -> bool {
        false
    }
}

/// How often the collector checks its source is still the network's.
const STALE_CHECK: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peer {
    pub ip: IpAddr,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
}

/// One flow event (schema [`SCHEMA_VERSION`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Event {
    pub version: u32,
    pub time: String,
    pub node: String,
    pub network: String,
    pub verdict: Verdict,
    pub direction: String,
    pub protocol: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub icmp_type: Option<u8>,
    pub src: Peer,
    pub dst: Peer,
    pub policy: String,
    #[serde(default)]
    pub policies: Vec<String>,
    #[serde(default)]
    pub suppressed: u64,
}

/// The `policy` of a denial: no policy allowed it.
pub const DEFAULT_DENY: &str = "default-deny";

pub fn protocol_name(proto: u8) -> String {
    match proto {
        6 => "TCP".into(),
        17 => "UDP".into(),
        132 => "SCTP".into(),
        1 => "ICMP".into(),
        58 => "ICMPv6".into(),
        n => n.to_string(),
    }
}

fn has_ports(proto: u8) -> bool {
    matches!(proto, 6 | 17 | 132)
}

/// RFC 3339 in UTC with microseconds.
pub fn rfc3339(t: SystemTime) -> String {
    match jiff::Timestamp::try_from(t) {
        Ok(ts) => format!("{ts:.6}"),
        Err(_) => "1970-01-01T00:00:00.000000Z".into(),
    }
}

/// Names pods and policies from a network's policy state.
#[derive(Default)]
pub struct Attributor {
    node: String,
    network: String,
    /// Address -> `namespace/name` (this node's pods, then other nodes').
    pods: HashMap<IpAddr, String>,
    /// This node's pods by address: their identity and rule sets.
    local: HashMap<IpAddr, PodPolicy>,
    desired: Desired,
    /// For naming the policy that allowed a flow: each policy compiled
    /// alone, lazily.
    set: Option<PolicySet>,
    views: BTreeMap<String, PodView>,
    ids: crate::compile::Ids,
    keys: HashMap<IpAddr, String>,
    alone: HashMap<String, Option<Desired>>,
}

impl Attributor {
    pub fn new(st: &State, node: &str, network: &str) -> Attributor {
        let desired = st.desired.clone().unwrap_or_default();
        let mut a = Attributor {
            node: node.into(),
            network: network.into(),
            views: st.views(),
            ids: st.ids.clone(),
            ..Default::default()
        };
        let set = st
            .conf
            .as_ref()
            .and_then(|c| Conf::from_value(c, network).ok())
            .and_then(|c| c.policies().ok());
        if let Some(set) = &set {
            for r in &set.remote_pods {
                for ip in &r.addrs {
                    a.pods.insert(*ip, format!("{}/{}", r.namespace, r.name));
                }
            }
        }
        for (key, p) in &st.pods {
            let name = match &p.name {
                Some(n) => format!("{}/{n}", p.namespace),
                None => format!("{}/{}", p.namespace, p.container_id),
            };
            for ip in &p.addrs {
                a.pods.insert(*ip, name.clone());
                a.keys.insert(*ip, key.clone());
                if let Some(pp) = desired.pods.get(key) {
                    a.local.insert(*ip, *pp);
                }
            }
        }
        a.set = set;
        a.desired = desired;
        a
    }

    /// The policy that allows `raw` by itself, trying the rule set's
    /// policies in order.
    fn allowing(&mut self, policies: &[String], raw: &RawEvent) -> Option<String> {
        let (pod, peer) = match raw.dir {
            Dir::Egress => (raw.src, raw.dst),
            Dir::Ingress => (raw.dst, raw.src),
        };
        let key = self.keys.get(&pod)?.clone();
        let peer_id = self
            .local
            .get(&peer)
            .map(|p| p.identity)
            .unwrap_or_default();
        let port = if has_ports(raw.proto) { raw.dport } else { 0 };
        for id in policies {
            if !self.alone.contains_key(id) {
                let d = self.set.as_ref().and_then(|set| {
                    let one = PolicySet {
                        policies: set
                            .policies
                            .iter()
                            .filter(|p| &p.id() == id)
                            .cloned()
                            .collect(),
                        namespaces: set.namespaces.clone(),
                        remote_pods: set.remote_pods.clone(),
                        services: set.services.clone(),
                        slices: set.slices.clone(),
                    };
                    compile(&one, &self.views, &mut self.ids.clone()).ok()
                });
                self.alone.insert(id.clone(), d);
            }
            let Some(Some(d)) = self.alone.get(id) else {
                continue;
            };
            let allows = d
                .pods
                .get(&key)
                .map(|pp| pp.rule_set(raw.dir))
                .and_then(|rs| d.rulesets.get(&rs))
                .is_some_and(|rs| rs.allows(peer_id, peer, raw.proto, port));
            if allows {
                return Some(id.clone());
            }
        }
        None
    }

    pub fn event(&mut self, raw: &RawEvent) -> Event {
        let pod = match raw.dir {
            Dir::Egress => raw.src,
            Dir::Ingress => raw.dst,
        };
        let policies: Vec<String> = self
            .local
            .get(&pod)
            .map(|pp| pp.rule_set(raw.dir))
            .and_then(|rs| self.desired.rulesets.get(&rs))
            .map(|rs| rs.policies.clone())
            .unwrap_or_default();
        let policy = match raw.verdict {
            Verdict::Allow => self
                .allowing(&policies, raw)
                .unwrap_or_else(|| policies.join(",")),
            Verdict::Deny | Verdict::Audit => DEFAULT_DENY.into(),
        };
        let ports = has_ports(raw.proto);
        Event {
            version: SCHEMA_VERSION,
            time: rfc3339(raw.time),
            node: self.node.clone(),
            network: self.network.clone(),
            verdict: raw.verdict,
            direction: raw.dir.as_str().into(),
            protocol: protocol_name(raw.proto),
            icmp_type: raw.icmp_type,
            src: Peer {
                ip: raw.src,
                port: ports.then_some(raw.sport),
                pod: self.pods.get(&raw.src).cloned(),
            },
            dst: Peer {
                ip: raw.dst,
                port: ports.then_some(raw.dport),
                pod: self.pods.get(&raw.dst).cloned(),
            },
            policy,
            policies: if raw.verdict == Verdict::Allow {
                Vec::new()
            } else {
                policies
            },
            suppressed: raw.suppressed,
        }
    }
}

fn io_err(what: impl std::fmt::Display, e: impl std::fmt::Display) -> CniError {
    CniError::new(ErrorCode::IoFailure, format!("policy: {what}: {e}"))
}

/// The network's state as last saved (atomically renamed: no lock needed
/// to read it).
pub fn read_state(data_dir: &Path, network: &str) -> Result<Option<State>, CniError> {
    let path = data_dir.join(network).join("state.json");
    match std::fs::read(&path) {
        Ok(b) => serde_json::from_slice(&b).map(Some).map_err(|e| {
            CniError::new(
                ErrorCode::DecodingFailure,
                format!("policy: {}: {e}", path.display()),
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(path.display(), e)),
    }
}

/// This node's name for the events: `$NODE_NAME` (the DaemonSet's
/// downward API), else the host name.
pub fn node_name() -> String {
    std::env::var("NODE_NAME")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| {
            nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
        })
        .unwrap_or_default()
}

/// The collector's lock on a network, held while it lives.
pub struct CollectorLock {
    _f: nix::fcntl::Flock<File>,
    dir: PathBuf,
}

impl CollectorLock {
    /// `None` when another collector holds it.
    pub fn try_acquire(data_dir: &Path, network: &str) -> Result<Option<CollectorLock>, CniError> {
        let dir = data_dir.join(network);
        std::fs::create_dir_all(&dir).map_err(|e| io_err(dir.display(), e))?;
        let p = dir.join(LOCK);
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(|e| io_err(p.display(), e))?;
        match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(f) => Ok(Some(CollectorLock { _f: f, dir })),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, e)) => Err(io_err(format!("lock {}", p.display()), e)),
        }
    }
}

impl CollectorLock {
    /// Whether no collector holds the network's lock (a follower's cue to
    /// take over).
    pub fn is_free(data_dir: &Path, network: &str) -> bool {
        let p = data_dir.join(network).join(LOCK);
        File::open(&p).is_ok_and(|f| {
            nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockSharedNonblock).is_ok()
        })
    }
}

/// The source for the network's backend.
pub fn source(data_dir: &Path, network: &str) -> Result<Box<dyn Source>, CniError> {
    let st = read_state(data_dir, network)?.ok_or_else(|| {
        CniError::config(format!(
            "policy: network {network} has no policy state in {} (no pod was added with the policy plugin)",
            data_dir.display()
        ))
    })?;
    let conf_v = st.conf.clone().ok_or_else(|| {
        CniError::config(format!("policy: network {network} has no stored config"))
    })?;
    let conf = Conf::from_value(&conf_v, network)?;
    match st.backend() {
        crate::conf::Backend::Ebpf => Ok(Box::new(ebpf::RingSource::open(&conf.pin_dir)?)),
        crate::conf::Backend::Nftables => Ok(Box::new(nft::NflogSource::open(network)?)),
    }
}

/// Appends events to the network's log, rotating it past
/// [`MAX_LOG_BYTES`].
struct LogWriter {
    dir: PathBuf,
    f: Option<File>,
    size: u64,
}

impl LogWriter {
    fn new(dir: &Path) -> LogWriter {
        LogWriter {
            dir: dir.to_path_buf(),
            f: None,
            size: 0,
        }
    }

    fn write(&mut self, line: &str) {
        if self.f.is_none() || self.size > MAX_LOG_BYTES {
            let p = self.dir.join(LOG);
            if self.size > MAX_LOG_BYTES {
                let _ = std::fs::rename(&p, self.dir.join(LOG_OLD));
            }
            self.f = File::options().create(true).append(true).open(&p).ok();
            self.size = self
                .f
                .as_ref()
                .and_then(|f| f.metadata().ok())
                .map_or(0, |m| m.len());
        }
        if let Some(f) = &mut self.f
            && f.write_all(line.as_bytes()).is_ok()
        {
            self.size += line.len() as u64;
        }
    }
}

/// Runs the collector until `out` returns false or the source fails:
/// reads `source`, names pods and policies from the state (re-read when it
/// changes), appends each event to the network's log and hands it to
/// `out`. `lock` proves this is the network's one collector.
pub fn collect(
    lock: &CollectorLock,
    network: &str,
    node: &str,
    source: &mut dyn Source,
    tick: Duration,
    mut out: impl FnMut(Option<&Event>) -> bool,
) -> Result<(), CniError> {
    let state_path = lock.dir.join("state.json");
    let mtime = || {
        std::fs::metadata(&state_path)
            .and_then(|m| m.modified())
            .ok()
    };
    let data_dir = lock.dir.parent().unwrap_or(Path::new("/"));
    let mut seen = mtime();
    let mut attr = Attributor::new(
        &read_state(data_dir, network)?.unwrap_or_default(),
        node,
        network,
    );
    let mut log = LogWriter::new(&lock.dir);
    let mut checked = std::time::Instant::now();
    loop {
        if checked.elapsed() >= STALE_CHECK {
            checked = std::time::Instant::now();
            if source.stale() {
                return Err(CniError::new(
                    ErrorCode::TryAgainLater,
                    format!(
                        "policy: network {network}: its datapath was loaded again; run the collector again"
                    ),
                ));
            }
        }
        let raw = source.poll(tick)?;
        if !raw.is_empty() && mtime() != seen {
            seen = mtime();
            if let Ok(Some(st)) = read_state(data_dir, network) {
                attr = Attributor::new(&st, node, network);
            }
        }
        for r in &raw {
            let e = attr.event(r);
            let mut line = serde_json::to_string(&e).expect("serializable");
            line.push('\n');
            log.write(&line);
            if !out(Some(&e)) {
                return Ok(());
            }
        }
        // A tick without events: the caller may stop.
        if raw.is_empty() && !out(None) {
            return Ok(());
        }
    }
}

/// Which events to show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    Deny,
    Allow,
    Audit,
    All,
}

impl Filter {
    pub fn parse(s: &str) -> Option<Filter> {
        match s {
            "deny" => Some(Filter::Deny),
            "allow" => Some(Filter::Allow),
            "audit" => Some(Filter::Audit),
            "all" => Some(Filter::All),
            _ => None,
        }
    }

    pub fn wants(self, v: Verdict) -> bool {
        match self {
            Filter::All => true,
            Filter::Deny => v == Verdict::Deny,
            Filter::Allow => v == Verdict::Allow,
            Filter::Audit => v == Verdict::Audit,
        }
    }
}

/// The log's lines so far (the rotated half first), and the position
/// reached in the current file.
pub fn history(data_dir: &Path, network: &str) -> (Vec<String>, u64) {
    let dir = data_dir.join(network);
    let mut lines = Vec::new();
    for name in [LOG_OLD, LOG] {
        if let Ok(f) = File::open(dir.join(name)) {
            lines.extend(BufReader::new(f).lines().map_while(Result::ok));
        }
    }
    let pos = std::fs::metadata(dir.join(LOG)).map_or(0, |m| m.len());
    (lines, pos)
}

/// Follows the network's log from `pos` (another process collects):
/// calls `out` with each new line, and with `None` at least every `tick`;
/// stops when `out` returns false.
pub fn follow(
    data_dir: &Path,
    network: &str,
    mut pos: u64,
    tick: Duration,
    mut out: impl FnMut(Option<&str>) -> bool,
) -> Result<(), CniError> {
    let path = data_dir.join(network).join(LOG);
    let mut partial = String::new();
    loop {
        let len = std::fs::metadata(&path).map_or(0, |m| m.len());
        // Rotated: the new file starts from the beginning.
        if len < pos {
            pos = 0;
            partial.clear();
        }
        if len > pos
            && let Ok(mut f) = File::open(&path)
        {
            f.seek(SeekFrom::Start(pos))
                .map_err(|e| io_err(path.display(), e))?;
            let mut r = BufReader::new(f);
            loop {
                let mut l = String::new();
                let n = r.read_line(&mut l).map_err(|e| io_err(path.display(), e))?;
                if n == 0 {
                    break;
                }
                pos += n as u64;
                partial.push_str(&l);
                if partial.ends_with('\n') {
                    let line = std::mem::take(&mut partial);
                    if !out(Some(line.trim_end())) {
                        return Ok(());
                    }
                }
            }
        }
        if !out(None) {
            return Ok(());
        }
        std::thread::sleep(tick);
    }
}

#[cfg(test)]
mod tests;
