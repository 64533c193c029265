//! Policy inputs from the Kubernetes API, the agent's half of issue 18's
//! "policy from the API" (the policy plugin's half is its `agentSocket`
//! and `policy sync`):
//!
//! - every NetworkPolicy (networking.k8s.io/v1) and Namespace, mirrored as
//!   Kubernetes-object JSON files into a directory the policy plugin reads
//!   as its `policyDir` (it takes `kind: NetworkPolicy` and `kind:
//!   Namespace` objects as they are), one file per object, written
//!   atomically, removed when the object is deleted, and the directory
//!   made equal to a fresh list after every (re)list;
//! - every Service and EndpointSlice, mirrored the same way: the eBPF
//!   backend judges a pod's egress before kube-proxy's DNAT, so it needs
//!   to know which endpoints a ClusterIP stands for;
//! - every Pod, in one cluster-wide watch, split by `spec.nodeName`:
//!   - this node's, their labels and container ports (for named ports)
//!     answered on a root-only Unix socket: one JSON line `{"namespace",
//!     "name"}` in, one out;
//!   - other nodes', as `kind: Pod` objects (namespace, name, labels,
//!     `status.podIPs`) in one file of the directory, `k8s-pods.json`,
//!     rewritten whole and atomically (a relist replaces it): the policy
//!     plugin's selectors match them by address. Left out: pods without
//!     an address yet, host-network pods (their address is their node's:
//!     matching it would admit every process of that node, and traffic
//!     from nodes passes anyway), and finished ones (phase Succeeded or
//!     Failed: their sandbox is gone and their address free for a new
//!     pod). Pending pods with an address and terminating ones are in:
//!     they still send and receive.
//!
//! After any mirrored file, a local pod's labels or named ports, or an
//! other node's pod's labels, addresses or existence change, the agent
//! runs `policy sync --network <network>` (debounced: a relist is one
//! sync), which re-reads the directory, asks this socket for every pod's
//! labels again and rewrites what differs: a changed policy, namespace
//! label or pod label reaches the node's pods without a re-add.
//!
//! As with Nodes, a lost API server changes nothing: files and answers
//! stay as last seen.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::PathError;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Resource;
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use rcni_agent_proto::pods::{ContainerPort, Pod as ListedPod, PodList};
use rcni_agent_proto::socket::{NamedPorts, PodAnswer, PodQuery};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::Notify;

/// Mirrored files' names start with this; other files in the directory
/// (an admin's own policies) are left alone.
const PREFIX: &str = "k8s-";

/// Other nodes' pods, in the policy directory.
pub use rcni_agent_proto::pods::REMOTE_PODS_FILE;

/// A burst of pod events (a rollout, a relist) is one rewrite of the
/// remote pods' file; short, as the sync waits its own [`DEBOUNCE`] too.
const REMOTE_DEBOUNCE: Duration = Duration::from_millis(20);

const BACKOFF_MIN: Duration = Duration::from_millis(200);
/// Changes come in bursts (a relist rewrites every file, a Deployment's
/// rollout relabels many pods): one sync once the burst settles, well
/// inside the second a change may take to reach the pods.
const DEBOUNCE: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// A pod on this node, as the policy plugin needs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
struct PodInfo {
    labels: BTreeMap<String, String>,
    /// Named container ports: name -> (protocol, port).
    ports: NamedPorts,
}

#[derive(Default)]
struct Pods {
    pods: BTreeMap<(String, String), PodInfo>,
    synced: bool,
}

/// A pod of another node, as policy peers need it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RemotePod {
    node: String,
    labels: BTreeMap<String, String>,
    ips: Vec<String>,
    /// Its named container ports, for egress rules that name a port.
    ports: Vec<ContainerPort>,
}

#[derive(Default)]
struct Remote {
    pods: BTreeMap<(String, String), RemotePod>,
    /// Listed at least once: before that, the file of an earlier run stays.
    synced: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// How the agent runs `policy sync`.
#[derive(Debug, Clone)]
pub struct SyncCommand {
    /// The `policy` binary.
    pub bin: PathBuf,
    pub network: String,
    /// The plugin's dataDir, when not its default.
    pub data_dir: Option<PathBuf>,
}

pub struct PolicyInputs {
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for PolicyInputs {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Whether Services and EndpointSlices are mirrored for the policy plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServiceMirror {
    /// kube-proxy translates after the pod's egress hook: the plugin
    /// needs each ClusterIP's endpoints.
    On,
    /// `"kubeProxyReplacement"`: a pod's connection leaves it with the
    /// backend's address already, so the plugin needs none, and tens of
    /// thousands of files (and a sync re-reading them per change) are
    /// spared. Files an earlier run mirrored are removed.
    Off,
}

/// Starts the mirrors and the socket (on the current tokio runtime).
pub fn start(
    client: kube::Client,
    dir: PathBuf,
    node: &str,
    socket: &Path,
    sync: Option<SyncCommand>,
    services: ServiceMirror,
) -> Result<PolicyInputs, PathError> {
    std::fs::create_dir_all(&dir).map_err(PathError::at("policy dir", &dir))?;
    let listener = bind(socket)?;
    let pods = Arc::new(Mutex::new(Pods::default()));
    let remote = Arc::new(Mutex::new(Remote::default()));
    let changed = Arc::new(Notify::new());
    let remote_changed = Arc::new(Notify::new());
    let mut tasks = vec![
        tokio::spawn(mirror(
            Api::<NetworkPolicy>::all(client.clone()),
            dir.clone(),
            "netpol",
            changed.clone(),
        )),
        tokio::spawn(mirror(
            Api::<Namespace>::all(client.clone()),
            dir.clone(),
            "ns",
            changed.clone(),
        )),
        tokio::spawn(watch_pods(
            Api::<Pod>::all(client.clone()),
            node.to_string(),
            pods.clone(),
            remote.clone(),
            changed.clone(),
            remote_changed.clone(),
        )),
        tokio::spawn(write_remote(
            dir.clone(),
            remote,
            remote_changed,
            changed.clone(),
        )),
        tokio::spawn(serve(listener, pods)),
    ];
    match services {
        ServiceMirror::On => {
            tasks.push(tokio::spawn(mirror(
                Api::<Service>::all(client.clone()),
                dir.clone(),
                "svc",
                changed.clone(),
            )));
            tasks.push(tokio::spawn(mirror(
                Api::<EndpointSlice>::all(client.clone()),
                dir.clone(),
                "eps",
                changed.clone(),
            )));
        }
        ServiceMirror::Off => {
            if remove_mirrored(&dir, &["svc", "eps"]) {
                changed.notify_one();
            }
        }
    }
    if let Some(cmd) = sync {
        tasks.push(tokio::spawn(crate::flows::run(
            cmd.clone(),
            node.to_string(),
        )));
        tasks.push(tokio::spawn(syncer(cmd, changed)));
    }
    Ok(PolicyInputs { tasks })
}

/// Removes the files mirrored for these kinds; whether one was there.
fn remove_mirrored(dir: &Path, whats: &[&str]) -> bool {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return false;
    };
    let mut any = false;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if whats
            .iter()
            .any(|w| name.starts_with(&format!("{PREFIX}{w}-")))
        {
            any |= remove(dir, &name);
        }
    }
    any
}

/// Runs `policy sync` after each burst of changes. `Notify` keeps one
/// wakeup for changes made while a sync runs, so none is missed.
async fn syncer(cmd: SyncCommand, changed: Arc<Notify>) {
    let mut missing_logged = false;
    loop {
        changed.notified().await;
        tokio::time::sleep(DEBOUNCE).await;
        let mut c = std::process::Command::new(&cmd.bin);
        c.args(["sync", "--network", &cmd.network]);
        if let Some(d) = &cmd.data_dir {
            c.arg("--data-dir").arg(d);
        }
        let bin = cmd.bin.clone();
        let out = tokio::task::spawn_blocking(move || c.output()).await;
        match out {
            Ok(Ok(o)) if o.status.success() => {
                missing_logged = false;
                let text = String::from_utf8_lossy(&o.stdout);
                crate::log(format!("policy sync: {}", text.trim()));
                let err = String::from_utf8_lossy(&o.stderr);
                if !err.trim().is_empty() {
                    crate::log(format!("policy sync: {}", err.trim()));
                }
            }
            Ok(Ok(o)) => crate::log(format!(
                "policy sync failed ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                if !missing_logged {
                    crate::log(format!(
                        "policy sync: {} not found (--cni-bin-dir): pods keep their policy \
                         until re-added",
                        bin.display()
                    ));
                    missing_logged = true;
                }
            }
            Ok(Err(e)) => crate::log(format!("policy sync: {}: {e}", bin.display())),
            Err(e) => crate::log(format!("policy sync: {e}")),
        }
    }
}

/// The socket, root-only: its directory 0700 when the agent makes it, the
/// socket itself 0600 (a pod's labels decide what it may reach).
fn bind(path: &Path) -> Result<tokio::net::UnixListener, PathError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let at = |e: std::io::Error| PathError::at("socket", path)(e);
    if let Some(parent) = path.parent()
        && !parent.exists()
    {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)
            .map_err(at)?;
    }
    // A socket left by an earlier run.
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(at(e)),
        _ => {}
    }
    let l = tokio::net::UnixListener::bind(path).map_err(at)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(at)?;
    Ok(l)
}

/// `k8s-<what>-<namespace>_<name>.json` (namespaces and names have no
/// `_`), `k8s-<what>-<name>.json` for cluster-scoped objects.
fn file_name(what: &str, ns: Option<&str>, name: &str) -> String {
    match ns {
        Some(ns) => format!("{PREFIX}{what}-{ns}_{name}.json"),
        None => format!("{PREFIX}{what}-{name}.json"),
    }
}

/// The object as the file holds it: without managedFields and status.
fn content<K: Serialize>(obj: &K) -> Vec<u8> {
    let mut v = serde_json::to_value(obj).unwrap_or(Value::Null);
    if let Some(m) = v.get_mut("metadata").and_then(Value::as_object_mut) {
        m.remove("managedFields");
    }
    if let Some(o) = v.as_object_mut() {
        o.remove("status");
    }
    serde_json::to_vec_pretty(&v).unwrap_or_default()
}

/// Whether the file changed.
fn write(dir: &Path, name: &str, data: &[u8]) -> bool {
    let path = dir.join(name);
    if std::fs::read(&path).ok().as_deref() == Some(data) {
        return false;
    }
    if let Err(e) = rcni_statefile::write_replace(&path, data, 0o644) {
        crate::log(format!("write {}: {e}", path.display()));
        return false;
    }
    true
}

/// Whether a file went.
fn remove(dir: &Path, name: &str) -> bool {
    let path = dir.join(name);
    match std::fs::remove_file(&path) {
        Ok(()) => true,
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            crate::log(format!("remove {}: {e}", path.display()));
            false
        }
        _ => false,
    }
}

/// Follows `api`'s objects: every event to `on`, errors logged and
/// retried with a backoff (kube's watcher resumes or relists by itself).
pub(crate) async fn follow<K>(
    api: Api<K>,
    config: watcher::Config,
    what: &str,
    mut on: impl FnMut(Event<K>),
) where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let mut backoff = BACKOFF_MIN;
    let mut stream = watcher::watcher(api, config).boxed();
    while let Some(item) = stream.next().await {
        match item {
            Ok(ev) => {
                backoff = BACKOFF_MIN;
                on(ev);
            }
            Err(e) => {
                crate::log(format!(
                    "Kubernetes API ({what}): {} (retrying in {backoff:?})",
                    crate::causes(&e)
                ));
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}

async fn mirror<K>(api: Api<K>, dir: PathBuf, what: &'static str, changed: Arc<Notify>)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Serialize + 'static,
{
    let own = format!("{PREFIX}{what}-");
    let name_of = |o: &K| {
        let m = o.meta();
        file_name(
            what,
            m.namespace.as_deref(),
            m.name.as_deref().unwrap_or_default(),
        )
    };
    let mut listed: Option<BTreeMap<String, Vec<u8>>> = None;
    follow(api, watcher::Config::default(), what, |ev| match ev {
        Event::Init => listed = Some(BTreeMap::new()),
        Event::InitApply(o) => {
            if let Some(l) = &mut listed {
                l.insert(name_of(&o), content(&o));
            }
        }
        Event::InitDone => {
            let l = listed.take().unwrap_or_default();
            let mut any = false;
            for (n, data) in &l {
                any |= write(&dir, n, data);
            }
            let stale: Vec<String> = std::fs::read_dir(&dir)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&own) && n.ends_with(".json") && !l.contains_key(n))
                .collect();
            for n in stale {
                any |= remove(&dir, &n);
            }
            if any {
                changed.notify_one();
            }
        }
        Event::Apply(o) => {
            if write(&dir, &name_of(&o), &content(&o)) {
                changed.notify_one();
            }
        }
        Event::Delete(o) => {
            if remove(&dir, &name_of(&o)) {
                changed.notify_one();
            }
        }
    })
    .await
}

fn pod_info(p: &Pod) -> PodInfo {
    let mut ports = BTreeMap::new();
    for c in p.spec.iter().flat_map(|s| s.containers.iter()) {
        for port in c.ports.iter().flatten() {
            if let Some(n) = &port.name {
                let proto = port.protocol.clone().unwrap_or_else(|| "TCP".into());
                ports.insert(n.clone(), (proto, port.container_port));
            }
        }
    }
    PodInfo {
        labels: p.metadata.labels.clone().unwrap_or_default(),
        ports,
    }
}

/// A pod of another node as a policy peer, or `None` when it is none
/// (see the module doc).
fn remote_pod(p: &Pod) -> Option<RemotePod> {
    let spec = p.spec.as_ref()?;
    if spec.host_network == Some(true) {
        return None;
    }
    let status = p.status.as_ref()?;
    if matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
        return None;
    }
    let mut ips: Vec<String> = status
        .pod_ips
        .iter()
        .flatten()
        .map(|i| i.ip.clone())
        .chain(status.pod_ip.clone())
        .filter(|i| !i.is_empty())
        .collect();
    ips.sort();
    ips.dedup();
    if ips.is_empty() {
        return None;
    }
    let ports = spec
        .containers
        .iter()
        .flat_map(|c| c.ports.iter().flatten())
        .filter(|port| port.name.is_some())
        .map(|port| ContainerPort {
            name: port.name.clone(),
            container_port: port.container_port.into(),
            protocol: port.protocol.clone(),
        })
        .collect();
    Some(RemotePod {
        node: spec.node_name.clone().unwrap_or_default(),
        labels: p.metadata.labels.clone().unwrap_or_default(),
        ips,
        ports,
    })
}

/// The remote pods' file: a `PodList` of the fields the plugin reads.
fn remote_content(pods: &BTreeMap<(String, String), RemotePod>) -> Vec<u8> {
    let items = pods
        .iter()
        .map(|((ns, name), p)| {
            ListedPod::remote(ns, name, p.labels.clone(), &p.node, &p.ips, p.ports.clone())
        })
        .collect();
    PodList::new(items).to_file()
}

/// Rewrites the remote pods' file after each burst of changes, and wakes
/// the syncer when it changed.
async fn write_remote(
    dir: PathBuf,
    remote: Arc<Mutex<Remote>>,
    remote_changed: Arc<Notify>,
    changed: Arc<Notify>,
) {
    loop {
        remote_changed.notified().await;
        tokio::time::sleep(REMOTE_DEBOUNCE).await;
        let data = {
            let g = lock(&remote);
            // No file is no remote pod already: nothing to sync for.
            if !g.synced || (g.pods.is_empty() && !dir.join(REMOTE_PODS_FILE).exists()) {
                continue;
            }
            remote_content(&g.pods)
        };
        let d = dir.clone();
        let wrote = tokio::task::spawn_blocking(move || write(&d, REMOTE_PODS_FILE, &data)).await;
        if wrote.unwrap_or(false) {
            changed.notify_one();
        }
    }
}

fn key(p: &Pod) -> (String, String) {
    (
        p.metadata.namespace.clone().unwrap_or_default(),
        p.metadata.name.clone().unwrap_or_default(),
    )
}

fn on_node(p: &Pod, node: &str) -> bool {
    p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
}

type Listed = (
    BTreeMap<(String, String), PodInfo>,
    BTreeMap<(String, String), RemotePod>,
);

/// One cluster-wide watch of Pods (see the module doc): this node's labels
/// and ports into `pods`, where a change to a known pod's wakes the
/// syncer (a new pod's come with its ADD, a deleted pod's go with its
/// DEL); other nodes' into `remote`, where any change wakes the file's
/// writer.
async fn watch_pods(
    api: Api<Pod>,
    node: String,
    pods: Arc<Mutex<Pods>>,
    remote: Arc<Mutex<Remote>>,
    changed: Arc<Notify>,
    remote_changed: Arc<Notify>,
) {
    let mut listed: Option<Listed> = None;
    follow(api, watcher::Config::default(), "pods", |ev| match ev {
        Event::Init => listed = Some(Default::default()),
        Event::InitApply(p) => {
            if let Some((local, others)) = &mut listed {
                if on_node(&p, &node) {
                    local.insert(key(&p), pod_info(&p));
                } else if let Some(r) = remote_pod(&p) {
                    others.insert(key(&p), r);
                }
            }
        }
        Event::InitDone => {
            let (new, others) = listed.take().unwrap_or_default();
            {
                let mut g = lock(&pods);
                let relabeled = new
                    .iter()
                    .any(|(k, p)| g.pods.get(k).is_some_and(|old| old != p));
                g.pods = new;
                g.synced = true;
                if relabeled {
                    changed.notify_one();
                }
            }
            let mut r = lock(&remote);
            r.pods = others;
            r.synced = true;
            // Written whether or not it differs: the file may be an
            // earlier run's.
            remote_changed.notify_one();
        }
        Event::Apply(p) if on_node(&p, &node) => {
            let info = pod_info(&p);
            let old = lock(&pods).pods.insert(key(&p), info.clone());
            if old.is_some_and(|o| o != info) {
                changed.notify_one();
            }
            // A pod of that name on another node before (a StatefulSet's,
            // its deletion missed): not a remote peer any more.
            if lock(&remote).pods.remove(&key(&p)).is_some() {
                remote_changed.notify_one();
            }
        }
        Event::Apply(p) => {
            let k = key(&p);
            let mut r = lock(&remote);
            let differs = match remote_pod(&p) {
                Some(new) => r.pods.insert(k, new.clone()) != Some(new),
                None => r.pods.remove(&k).is_some(),
            };
            if differs {
                remote_changed.notify_one();
            }
        }
        Event::Delete(p) => {
            lock(&pods).pods.remove(&key(&p));
            if lock(&remote).pods.remove(&key(&p)).is_some() {
                remote_changed.notify_one();
            }
        }
    })
    .await
}

/// The answer to one request line.
fn answer(pods: &Mutex<Pods>, line: &str) -> PodAnswer {
    let req: Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => return PodAnswer::error(format!("not a JSON request: {e}")),
    };
    let Ok(PodQuery { namespace, name }) = serde_json::from_value::<PodQuery>(req) else {
        return PodAnswer::error("a request is {\"namespace\": ..., \"name\": ...}");
    };
    let g = lock(pods);
    // Before the first list, "not found" would be a guess: the plugin is
    // to try again later (CNI code 11).
    if !g.synced {
        return PodAnswer::not_synced();
    }
    match g.pods.get(&(namespace, name)) {
        Some(p) => PodAnswer::found(p.labels.clone(), p.ports.clone()),
        None => PodAnswer::not_found(),
    }
}

async fn serve(listener: tokio::net::UnixListener, pods: Arc<Mutex<Pods>>) {
    loop {
        let Ok((s, _)) = listener.accept().await else {
            continue;
        };
        let pods = pods.clone();
        tokio::spawn(async move {
            let (r, mut w) = s.into_split();
            let mut lines = BufReader::new(r).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let mut out = serde_json::to_string(&answer(&pods, &line)).unwrap_or_default();
                out.push('\n');
                if w.write_all(out.as_bytes()).await.is_err() {
                    return;
                }
            }
        });
    }
}

#[cfg(test)]
mod tests;
