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
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Resource;
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use rcni_ebpf::services::{ServiceLb, remove_services};
use std::collections::BTreeMap;
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
}

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
}

impl Store {
    fn listed(&self) -> bool {
        self.services.listed && self.slices.listed && self.nodes.listed
    }

    /// Every node's InternalIP and ExternalIP addresses with the node's
    /// name, and each node's zone label.
    fn nodes(&self) -> model::Nodes {
        let mut out = model::Nodes::default();
        for ((_, name), n) in &self.nodes.objs {
            let addrs = n.status.as_ref().and_then(|s| s.addresses.as_ref());
            for a in addrs.into_iter().flatten() {
                if (a.type_ == "InternalIP" || a.type_ == "ExternalIP")
                    && let Ok(ip) = a.address.parse()
                {
                    out.addrs.insert(ip, name.clone());
                }
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
            |s| &mut s.services,
        )),
        tokio::spawn(watch(
            Api::<EndpointSlice>::all(client.clone()),
            "endpointslices",
            store.clone(),
            changed.clone(),
            |s| &mut s.slices,
        )),
        tokio::spawn(watch(
            Api::<Node>::all(client),
            "nodes",
            store.clone(),
            changed.clone(),
            |s| &mut s.nodes,
        )),
        tokio::spawn(writer(lb, store, changed, conf.node)),
    ];
    Ok(ServiceProxy { tasks })
}

type Key = (String, String);

/// Follows one kind into its part of the store (`kind`).
async fn watch<K>(
    api: Api<K>,
    what: &'static str,
    store: Arc<Mutex<Store>>,
    changed: Arc<Notify>,
    kind: fn(&mut Store) -> &mut Kind<K>,
) where
    K: Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + 'static,
{
    let mut listing: Option<BTreeMap<Key, K>> = None;
    follow(api, watcher::Config::default(), what, |ev| match ev {
        Event::Init => listing = Some(BTreeMap::new()),
        Event::InitApply(o) => {
            if let Some(l) = &mut listing {
                l.insert(key(&o), o);
            }
        }
        Event::InitDone => {
            let mut st = lock(&store);
            let k = kind(&mut st);
            k.objs = listing.take().unwrap_or_default();
            k.listed = true;
            changed.notify_one();
        }
        Event::Apply(o) => {
            kind(&mut lock(&store)).objs.insert(key(&o), o);
            changed.notify_one();
        }
        Event::Delete(o) => {
            kind(&mut lock(&store)).objs.remove(&key(&o));
            changed.notify_one();
        }
    })
    .await
}

/// Writes the maps after each burst of changes, once every kind was
/// listed (before that, the maps an earlier run wrote stand).
async fn writer(lb: ServiceLb, store: Arc<Mutex<Store>>, changed: Arc<Notify>, node: String) {
    let lb = Arc::new(Mutex::new(lb));
    let mut health = health::Health::new();
    loop {
        changed.notified().await;
        tokio::time::sleep(DEBOUNCE).await;
        let (want, ports) = {
            let s = lock(&store);
            if !s.listed() {
                continue;
            }
            let want = model::frontends(
                s.services.objs.values(),
                s.slices.objs.values(),
                &node,
                &s.nodes(),
            );
            let ports =
                model::health_ports(s.services.objs.values(), s.slices.objs.values(), &node);
            (want, ports)
        };
        let lb = lb.clone();
        let started = Instant::now();
        let done =
            tokio::task::spawn_blocking(move || lock(&lb).sync(&want).map(|r| (r, want.len())))
                .await;
        match done {
            Ok(Ok((r, n))) if r != Default::default() => crate::log(format!(
                "services: {n} frontends ({} added, {} changed, {} removed) in {:?}",
                r.added,
                r.changed,
                r.removed,
                started.elapsed()
            )),
            Ok(Ok(_)) => {}
            // The next change or relist tries again.
            Ok(Err(e)) => {
                crate::log(format!("services: writing the maps: {e}"));
                continue;
            }
            Err(e) => {
                crate::log(format!("services: {e}"));
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
