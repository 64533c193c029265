//! Services in the eBPF datapath (issue 51), the agent's half, with the
//! net-conf's `"kubeProxyReplacement": true`: every Service and
//! EndpointSlice from the API, turned into frontends and backends
//! ([`model`]) and written into the socket programs' maps
//! (`rcni_ebpf::services`), which are attached to the node's cgroup v2
//! root: a connection a pod or a host process makes to a Service's address
//! goes to a backend from its first packet, with no NAT on the way.
//!
//! Nodes are watched too, for their addresses (node ports) and zones
//! (topology hints). The maps are
//! written once every list came, then after each burst of
//! changes. A lost API server changes nothing: the maps stay as last
//! written, and so do the hooks while the agent is gone (their links are
//! pinned).

pub mod health;
pub mod model;

use crate::k8s_policy::follow;
use crate::registry::cluster::NodePortAddresses;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Resource;
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use rcni_ebpf::services::{Backends, Frontend, ServiceLb, remove_services};
use rcni_ebpf::sockterm::close_gone_udp;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// A burst of changes (a relist, a rollout's endpoint updates) is one
/// write of the maps; short, as kube-proxy's own wait is 1 s.
const DEBOUNCE: Duration = Duration::from_millis(20);

/// The node label topology hints name zones by.
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

#[derive(Debug, thiserror::Error)]
pub enum ServicesError {
    #[error("the Service maps in {dir}: {source}")]
    Load {
        dir: PathBuf,
        source: rcni_ebpf::Error,
    },
    #[error("hooking the Service programs to {cgroup}: {source}")]
    Attach {
        cgroup: PathBuf,
        source: rcni_ebpf::Error,
    },
    #[error("the bpffs at {dir}: {source}")]
    Bpffs {
        dir: PathBuf,
        source: rcni_ebpf::Error,
    },
    #[error(
        "no cgroup v2 hierarchy is mounted (the Service hooks attach only there): mount one, or \
         name it with --cgroup-root"
    )]
    NoCgroup2,
}

pub struct Config {
    /// The bpffs pin root; the maps and links go into `services/` below it.
    pub pin_root: PathBuf,
    /// The cgroup v2 directory whose processes' connections are
    /// translated: the host's root, or a node's in a lab.
    pub cgroup: PathBuf,
    pub node: String,
    /// The net-conf's `nodePortAddresses`.
    pub node_port_addresses: NodePortAddresses,
    /// Where the runtime keeps pods' network namespaces (containerd's,
    /// CRI-O's and podman's /run/netns): a UDP socket connected to a
    /// backend that went is closed in each, and in the agent's own.
    pub netns_dir: PathBuf,
}

/// The runtimes' directory of pods' network namespaces.
pub const NETNS_DIR: &str = "/run/netns";

/// The pin directory below a pin root.
pub fn pin_dir(pin_root: &Path) -> PathBuf {
    pin_root.join("services")
}

/// The host's cgroup v2 mount: `/sys/fs/cgroup` on a unified host, the
/// hybrid layout's `/sys/fs/cgroup/unified`, or wherever mountinfo says.
pub fn default_cgroup_root() -> Result<PathBuf, ServicesError> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    cgroup2_mount(&info).ok_or(ServicesError::NoCgroup2)
}

fn cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    // The hierarchy's root (field 4 is "/"), not a bind of one of its
    // directories (a container runtime's).
    mountinfo.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        let f: Vec<&str> = left.split_whitespace().collect();
        (right.split_whitespace().next() == Some("cgroup2") && f.get(3) == Some(&"/"))
            .then(|| f.get(4).map(PathBuf::from))
            .flatten()
    })
}

/// `dir` itself when it is a cgroup v2 directory, else its hybrid
/// layout's `unified` child when that is one: a host's /sys/fs/cgroup
/// mounted into the agent's pod names either layout.
fn v2_dir(dir: &Path) -> PathBuf {
    let is_v2 = |p: &Path| {
        nix::sys::statfs::statfs(p)
            .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
    };
    let unified = dir.join("unified");
    if !is_v2(dir) && is_v2(&unified) {
        unified
    } else {
        dir.to_path_buf()
    }
}

/// Takes the Service programs off and removes their maps: the
/// `"kubeProxyReplacement": false` state (kube-proxy's rules answer
/// Services again). Nothing there is fine.
pub fn stop(pin_root: &Path) -> Result<bool, ServicesError> {
    let dir = pin_dir(pin_root);
    if !dir.exists() {
        return Ok(false);
    }
    remove_services(&dir).map_err(|source| ServicesError::Load {
        dir: dir.clone(),
        source,
    })?;
    Ok(true)
}

/// One kind's objects by (namespace, name), and whether it was listed.
struct Kind<K> {
    objs: BTreeMap<Key, K>,
    listed: bool,
}

impl<K> Default for Kind<K> {
    fn default() -> Self {
        Kind {
            objs: BTreeMap::new(),
            listed: false,
        }
    }
}

#[derive(Default)]
struct Store {
    services: Kind<Service>,
    slices: Kind<EndpointSlice>,
    /// For node ports and topology: every node's addresses and zone.
    nodes: Kind<Node>,
    /// The slices labelled with each Service's (namespace, name).
    slices_of: BTreeMap<Key, BTreeSet<Key>>,
    /// Services whose objects or slices changed since the last write.
    dirty: BTreeSet<Key>,
    /// Everything to be written again: a relist, a Node changed (node
    /// ports and zones), or a write that failed.
    all_dirty: bool,
}

/// An object kind the writer follows: where the store keeps it, and which
/// Services' frontends a change to one makes stale.
trait Tracked: Resource<DynamicType = ()> + Sized {
    fn store_of(s: &mut Store) -> &mut Kind<Self>;
    /// `None`: every Service's.
    fn feeds(&self) -> Option<Key>;
    /// Keeps an index of the kind up to date (slices by Service).
    fn indexed(_s: &mut Store, _key: &Key, _old: Option<&Self>, _new: Option<&Self>) {}
    /// Whether the change from `old` is one the frontends do not see.
    fn unseen(_old: &Self, _new: &Self) -> bool {
        false
    }
}

impl Tracked for Service {
    fn store_of(s: &mut Store) -> &mut Kind<Self> {
        &mut s.services
    }
    fn feeds(&self) -> Option<Key> {
        Some(key(self))
    }
}

fn labelled_service(sl: &EndpointSlice) -> Option<Key> {
    let svc = sl
        .metadata
        .labels
        .as_ref()?
        .get(model::SERVICE_NAME_LABEL)?;
    Some((
        sl.metadata.namespace.clone().unwrap_or_default(),
        svc.clone(),
    ))
}

impl Tracked for EndpointSlice {
    fn store_of(s: &mut Store) -> &mut Kind<Self> {
        &mut s.slices
    }
    fn feeds(&self) -> Option<Key> {
        // A slice of no Service feeds none: the Service "" stands for it.
        Some(labelled_service(self).unwrap_or_default())
    }
    fn indexed(s: &mut Store, key: &Key, old: Option<&Self>, new: Option<&Self>) {
        if let Some(svc) = old.and_then(labelled_service)
            && let Some(set) = s.slices_of.get_mut(&svc)
        {
            set.remove(key);
            if set.is_empty() {
                s.slices_of.remove(&svc);
            }
        }
        if let Some(svc) = new.and_then(labelled_service) {
            s.slices_of.entry(svc).or_default().insert(key.clone());
        }
    }
}

impl Tracked for Node {
    fn store_of(s: &mut Store) -> &mut Kind<Self> {
        &mut s.nodes
    }
    fn feeds(&self) -> Option<Key> {
        None
    }
    /// Only addresses and the zone reach the frontends: a status
    /// heartbeat or a condition does not rewrite every Service.
    fn unseen(old: &Self, new: &Self) -> bool {
        let seen = |n: &Node| {
            (
                n.status.as_ref().and_then(|s| s.addresses.clone()),
                n.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(ZONE_LABEL).cloned()),
            )
        };
        seen(old) == seen(new)
    }
}

impl Store {
    fn stale(&mut self, feeds: Option<Key>) {
        match feeds {
            Some(k) => {
                self.dirty.insert(k);
            }
            None => self.all_dirty = true,
        }
    }

    fn apply<K: Tracked>(&mut self, o: K) {
        let k = key(&o);
        let old = K::store_of(self).objs.remove(&k);
        match &old {
            Some(old) if K::unseen(old, &o) => {}
            Some(old) => {
                self.stale(old.feeds());
                self.stale(o.feeds());
            }
            None => self.stale(o.feeds()),
        }
        K::indexed(self, &k, old.as_ref(), Some(&o));
        K::store_of(self).objs.insert(k, o);
    }

    fn delete<K: Tracked>(&mut self, o: &K) {
        let k = key(o);
        if let Some(old) = K::store_of(self).objs.remove(&k) {
            self.stale(old.feeds());
            K::indexed(self, &k, Some(&old), None);
        }
    }

    fn relisted<K: Tracked>(&mut self, objs: BTreeMap<Key, K>) {
        let old = std::mem::take(&mut K::store_of(self).objs);
        for (k, o) in &old {
            K::indexed(self, k, Some(o), None);
        }
        for (k, o) in &objs {
            K::indexed(self, k, None, Some(o));
        }
        let kind = K::store_of(self);
        kind.objs = objs;
        kind.listed = true;
        self.all_dirty = true;
    }

    /// One Service's frontends as the objects now stand (none when it is
    /// gone).
    fn frontends_of(&self, svc: &Key, node: &str, nodes: &model::Nodes) -> model::Frontends {
        let Some(s) = self.services.objs.get(svc) else {
            return model::Frontends::new();
        };
        let slices = self
            .slices_of
            .get(svc)
            .into_iter()
            .flatten()
            .filter_map(|k| self.slices.objs.get(k));
        model::frontends([s], slices, node, nodes)
    }

    fn listed(&self) -> bool {
        self.services.listed && self.slices.listed && self.nodes.listed
    }

    /// Every node's addresses that answer node ports (`which`) with the
    /// node's name, and each node's zone label.
    fn nodes(&self, which: &NodePortAddresses) -> model::Nodes {
        let mut out = model::Nodes::default();
        for ((_, name), n) in &self.nodes.objs {
            let addrs: Vec<(&str, IpAddr)> = n
                .status
                .as_ref()
                .and_then(|s| s.addresses.as_ref())
                .into_iter()
                .flatten()
                .filter_map(|a| Some((a.type_.as_str(), a.address.parse().ok()?)))
                .collect();
            for ip in model::node_port_addrs(&addrs, which) {
                out.addrs.insert(ip, name.clone());
            }
            if let Some(z) = n.metadata.labels.as_ref().and_then(|l| l.get(ZONE_LABEL)) {
                out.zones.insert(name.clone(), z.clone());
            }
        }
        out
    }
}

fn key<K: Resource>(o: &K) -> (String, String) {
    let m = o.meta();
    (
        m.namespace.clone().unwrap_or_default(),
        m.name.clone().unwrap_or_default(),
    )
}

pub struct ServiceProxy {
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for ServiceProxy {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Loads and attaches the programs (the maps as an earlier run left them
/// until the first lists came), then follows the API on the current tokio
/// runtime.
pub fn start(client: kube::Client, conf: Config) -> Result<ServiceProxy, ServicesError> {
    rcni_ebpf::bpffs::ensure_root(&conf.pin_root).map_err(|source| ServicesError::Bpffs {
        dir: conf.pin_root.clone(),
        source,
    })?;
    let cgroup = v2_dir(&conf.cgroup);
    let dir = pin_dir(&conf.pin_root);
    let mut lb = ServiceLb::open_or_load(&dir).map_err(|source| ServicesError::Load {
        dir: dir.clone(),
        source,
    })?;
    lb.attach(&cgroup).map_err(|source| ServicesError::Attach {
        cgroup: cgroup.clone(),
        source,
    })?;
    crate::log(format!(
        "services: hooks on {}, maps in {}",
        cgroup.display(),
        dir.display()
    ));
    let store = Arc::new(Mutex::new(Store::default()));
    let changed = Arc::new(Notify::new());
    let tasks = vec![
        tokio::spawn(watch(
            Api::<Service>::all(client.clone()),
            "services",
            store.clone(),
            changed.clone(),
        )),
        tokio::spawn(watch(
            Api::<EndpointSlice>::all(client.clone()),
            "endpointslices",
            store.clone(),
            changed.clone(),
        )),
        tokio::spawn(watch(
            Api::<Node>::all(client),
            "nodes",
            store.clone(),
            changed.clone(),
        )),
        tokio::spawn(writer(
            Maps {
                lb,
                netns_dir: conf.netns_dir,
            },
            store,
            changed,
            conf.node,
            conf.node_port_addresses,
        )),
    ];
    Ok(ServiceProxy { tasks })
}

type Key = (String, String);

/// Follows one kind into the store.
async fn watch<K>(api: Api<K>, what: &'static str, store: Arc<Mutex<Store>>, changed: Arc<Notify>)
where
    K: Tracked + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let mut listing: Option<BTreeMap<Key, K>> = None;
    follow(api, watcher::Config::default(), what, |ev| match ev {
        Event::Init => listing = Some(BTreeMap::new()),
        Event::InitApply(o) => {
            if let Some(l) = &mut listing {
                l.insert(key(&o), slim(o));
            }
        }
        Event::InitDone => {
            lock(&store).relisted(listing.take().unwrap_or_default());
            changed.notify_one();
        }
        Event::Apply(o) => {
            lock(&store).apply(slim(o));
            changed.notify_one();
        }
        Event::Delete(o) => {
            lock(&store).delete(&o);
            changed.notify_one();
        }
    })
    .await
}

/// The object without what no frontend reads and most of its size is at
/// 10,000 Services: the field managers' records and the annotations
/// (kubectl's last-applied copy of the whole object).
fn slim<K: Resource>(mut o: K) -> K {
    let m = o.meta_mut();
    m.managed_fields = None;
    m.annotations = None;
    o
}

/// What the writer last wrote, per Service: a change to one Service is
/// written as the difference of its own frontends, not by comparing all
/// of them (10,000 Services are tens of milliseconds each time).
#[derive(Default)]
struct Written {
    per_svc: BTreeMap<Key, model::Frontends>,
    /// The Service each frontend was written for (two Services naming
    /// the same external address and port: the last written holds it
    /// until the next full write).
    owner: BTreeMap<Frontend, Key>,
}

/// What to write: everything (`Full`), or the named frontends only.
enum Plan {
    Full(model::Frontends),
    Some(BTreeMap<Frontend, Option<Backends>>),
}

impl Written {
    fn full(&mut self, s: &Store, node: &str, nodes: &model::Nodes) -> model::Frontends {
        *self = Written::default();
        let mut all = model::Frontends::new();
        for k in s.services.objs.keys() {
            let fs = s.frontends_of(k, node, nodes);
            for (f, b) in &fs {
                self.owner.insert(*f, k.clone());
                all.insert(*f, b.clone());
            }
            if !fs.is_empty() {
                self.per_svc.insert(k.clone(), fs);
            }
        }
        all
    }

    fn changes(
        &mut self,
        s: &Store,
        dirty: &BTreeSet<Key>,
        node: &str,
        nodes: &model::Nodes,
    ) -> BTreeMap<Frontend, Option<Backends>> {
        let mut out = BTreeMap::new();
        for k in dirty {
            let new = s.frontends_of(k, node, nodes);
            let old = self.per_svc.remove(k).unwrap_or_default();
            for f in old.keys().filter(|f| !new.contains_key(f)) {
                if self.owner.get(f) == Some(k) {
                    self.owner.remove(f);
                    out.insert(*f, None);
                }
            }
            for (f, b) in &new {
                if old.get(f) != Some(b) || self.owner.get(f) != Some(k) {
                    self.owner.insert(*f, k.clone());
                    out.insert(*f, Some(b.clone()));
                }
            }
            if !new.is_empty() {
                self.per_svc.insert(k.clone(), new);
            }
        }
        out
    }
}

/// The Services' maps, and where the pods' network namespaces are.
struct Maps {
    lb: ServiceLb,
    netns_dir: PathBuf,
}

impl Maps {
    /// Closes the connected UDP sockets of the backends the last write
    /// removed, in the agent's network namespace and every pod's. Returns
    /// how many; a namespace that cannot be entered (a pod gone meanwhile)
    /// is skipped, and one that fails does not stop the others (the first
    /// error is returned after).
    fn close_gone_udp(&mut self) -> Result<usize, rcni_ebpf::Error> {
        let gone = self.lb.take_udp_gone();
        if gone.is_empty() {
            return Ok(0);
        }
        let mut spaces: Vec<rcni_netns::NetNs> = rcni_netns::NetNs::current().into_iter().collect();
        let entries = std::fs::read_dir(&self.netns_dir).into_iter().flatten();
        spaces.extend(
            entries
                .flatten()
                .filter_map(|e| rcni_netns::NetNs::open(e.path()).ok()),
        );
        let (mut closed, mut first_err) = (0, None);
        for ns in &spaces {
            match close_gone_udp(&self.lb, ns, &gone) {
                Ok(n) => closed += n,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(closed),
        }
    }
}

/// Writes the maps after each burst of changes, once every kind was
/// listed (before that, the maps an earlier run wrote stand).
async fn writer(
    maps: Maps,
    store: Arc<Mutex<Store>>,
    changed: Arc<Notify>,
    node: String,
    node_ports: NodePortAddresses,
) {
    let maps = Arc::new(Mutex::new(maps));
    let mut health = health::Health::new();
    let mut written = Written::default();
    loop {
        changed.notified().await;
        tokio::time::sleep(DEBOUNCE).await;
        let (plan, ports) = {
            let mut s = lock(&store);
            if !s.listed() {
                continue;
            }
            let nodes = s.nodes(&node_ports);
            let dirty = std::mem::take(&mut s.dirty);
            let plan = if std::mem::take(&mut s.all_dirty) {
                Plan::Full(written.full(&s, &node, &nodes))
            } else {
                Plan::Some(written.changes(&s, &dirty, &node, &nodes))
            };
            let ports =
                model::health_ports(s.services.objs.values(), s.slices.objs.values(), &node);
            (plan, ports)
        };
        let maps = maps.clone();
        let started = Instant::now();
        let done = tokio::task::spawn_blocking(move || {
            let mut maps = lock(&maps);
            let written = match &plan {
                Plan::Full(want) => maps.lb.sync(want).map(|r| (r, want.len())),
                Plan::Some(changes) => maps.lb.update(changes).map(|r| (r, changes.len())),
            };
            // After the maps: a socket closed now reconnects to a backend
            // still there.
            match maps.close_gone_udp() {
                Ok(0) => {}
                Ok(n) => crate::log(format!(
                    "services: {n} connected UDP sockets of removed backends closed"
                )),
                Err(e) => crate::log(format!(
                    "services: closing UDP sockets of removed backends: {e}"
                )),
            }
            written
        })
        .await;
        match done {
            Ok(Ok((r, n))) if r != Default::default() => crate::log(format!(
                "services: {n} frontends written ({} added, {} changed, {} removed) in {:?}",
                r.added,
                r.changed,
                r.removed,
                started.elapsed()
            )),
            Ok(Ok(_)) => {}
            // The next change writes everything again.
            Ok(Err(e)) => {
                crate::log(format!("services: writing the maps: {e}"));
                lock(&store).all_dirty = true;
                continue;
            }
            Err(e) => {
                crate::log(format!("services: {e}"));
                lock(&store).all_dirty = true;
                continue;
            }
        }
        health.update(ports).await;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn service(name: &str, ip: &str, port: u16) -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"clusterIP": ip, "ports": [{"name": "p", "port": port}]},
        }))
        .unwrap()
    }

    fn slice(name: &str, svc: &str, addrs: &[&str]) -> EndpointSlice {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns",
                          "labels": {model::SERVICE_NAME_LABEL: svc}},
            "addressType": "IPv4",
            "ports": [{"name": "p", "port": 8080}],
            "endpoints": addrs.iter().map(|a| json!({"addresses": [a]})).collect::<Vec<_>>(),
        }))
        .unwrap()
    }

    #[test]
    fn kept_objects_lose_field_managers_and_annotations_not_labels() {
        let svc: Service = serde_json::from_value(json!({
            "metadata": {"name": "a", "namespace": "ns",
                          "labels": {"app": "a"},
                          "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"},
                          "managedFields": [{"manager": "kubectl", "operation": "Apply"}]},
            "spec": {"clusterIP": "10.96.0.1"},
        }))
        .unwrap();
        let m = slim(svc).metadata;
        assert!(m.managed_fields.is_none() && m.annotations.is_none());
        assert_eq!(m.labels.unwrap()["app"], "a");
    }

    /// Each step's changes, applied to what was written, give what a full
    /// write of the objects as they now stand gives.
    #[test]
    fn writing_only_the_changed_services_ends_where_a_full_write_does() {
        let nodes = model::Nodes::default();
        let mut st = Store::default();
        st.relisted::<Service>(BTreeMap::new());
        st.relisted::<EndpointSlice>(BTreeMap::new());
        st.relisted::<Node>(BTreeMap::new());
        let mut w = Written::default();
        let mut maps = w.full(&st, "n1", &nodes);
        st.all_dirty = false;
        type Step = Box<dyn Fn(&mut Store)>;
        let steps: Vec<Step> = vec![
            Box::new(|s| s.apply(service("a", "10.96.0.1", 80))),
            Box::new(|s| s.apply(slice("a-1", "a", &["10.1.0.1"]))),
            Box::new(|s| s.apply(slice("a-2", "a", &["10.1.0.2"]))),
            Box::new(|s| s.apply(service("b", "10.96.0.2", 80))),
            // A slice before its Service, then the Service.
            Box::new(|s| s.apply(slice("c-1", "c", &["10.1.0.3"]))),
            Box::new(|s| s.apply(service("c", "10.96.0.3", 53))),
            // A slice moved to another Service by its label.
            Box::new(|s| s.apply(slice("a-2", "b", &["10.1.0.2"]))),
            Box::new(|s| s.apply(service("a", "10.96.0.1", 81))),
            Box::new(|s| s.delete(&slice("a-1", "a", &[]))),
            Box::new(|s| s.delete(&service("c", "", 0))),
            Box::new(|s| s.apply(slice("x", "nobody", &["10.1.0.9"]))),
        ];
        for (i, step) in steps.iter().enumerate() {
            step(&mut st);
            let dirty = std::mem::take(&mut st.dirty);
            for (f, b) in w.changes(&st, &dirty, "n1", &nodes) {
                match b {
                    Some(b) => maps.insert(f, b),
                    None => maps.remove(&f),
                };
            }
            let mut again = Written::default();
            assert_eq!(maps, again.full(&st, "n1", &nodes), "step {i}");
        }
        assert!(!st.all_dirty);
        // A Node's heartbeat rewrites nothing; a new address everything.
        let node = |addr: &str, hb: &str| -> Node {
            serde_json::from_value(json!({
                "metadata": {"name": "n1", "labels": {ZONE_LABEL: "z"}},
                "status": {"addresses": [{"type": "InternalIP", "address": addr}],
                           "conditions": [{"type": "Ready", "status": "True",
                                           "lastHeartbeatTime": hb}]},
            }))
            .unwrap()
        };
        st.apply(node("172.30.0.11", "2026-12-07T00:00:00Z"));
        assert!(std::mem::take(&mut st.all_dirty));
        st.apply(node("172.30.0.11", "2026-12-07T00:00:10Z"));
        assert!(!st.all_dirty);
        st.apply(node("172.30.0.12", "2026-12-07T00:00:20Z"));
        assert!(st.all_dirty);
        assert_eq!(
            st.slices_of.keys().cloned().collect::<Vec<_>>(),
            [
                ("ns".to_string(), "b".to_string()),
                ("ns".to_string(), "c".to_string()),
                ("ns".to_string(), "nobody".to_string())
            ]
        );
    }

    #[test]
    fn the_cgroup2_mount_is_found_in_either_layout() {
        let hybrid = "\
35 25 0:30 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
36 35 0:31 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw
37 35 0:32 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu
";
        assert_eq!(
            cgroup2_mount(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let unified = "\
30 24 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
90 30 0:26 /kubepods /run/x/cg rw - cgroup2 cgroup2 rw
";
        assert_eq!(
            cgroup2_mount(unified),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
        assert_eq!(
            cgroup2_mount("37 35 0:32 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw\n"),
            None
        );
    }
}
