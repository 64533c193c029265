//! The node list from the Kubernetes API: every Node object, watched (kube's
//! watcher: list, then watch from the list's resourceVersion with bookmarks,
//! resumed after a dropped connection, listed again after 410 Gone), kept in
//! memory and turned into the same `Cluster` the cluster file gives. This
//! node's lease is its `spec.podCIDRs`; what peers need from it (its VTEP
//! MAC, its public address, its backend) it publishes as annotations on its
//! own Node, and it reads theirs (and flannel's, so that rcni and flannel
//! nodes of one cluster reach each other).
//!
//! A lost API server changes nothing: the last state is kept (stale routes
//! are better than none) until the watch is back. A deleted Node is removed.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node as KNode;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher::{self, Event};
use rcni_netlink::MacAddr;
use serde_json::{Value, json};

use crate::registry::Registry;
use crate::registry::cluster::{Backend, Cluster, ClusterError, NetConf, Node};
use crate::sync::desired;

/// The node's public address as it publishes it (peers send to it).
pub const ANN_PUBLIC_IP: &str = "rcni.io/public-ip";
pub const ANN_PUBLIC_IP6: &str = "rcni.io/public-ip6";
/// Set by the admin: the address to publish instead of the InternalIP
/// (flannel's `public-ip-overwrite`).
pub const ANN_PUBLIC_IP_OVERWRITE: &str = "rcni.io/public-ip-overwrite";
pub const ANN_VTEP_MAC: &str = "rcni.io/vtep-mac";
pub const ANN_VTEP_MAC6: &str = "rcni.io/vtep-mac6";
pub const ANN_BACKEND: &str = "rcni.io/backend";
/// Set by the admin, as Calico's per-node BGP settings: the node's AS
/// (`"65101"`) and its own peers (`[{"peerIP": "...", "asNumber": N}]`).
pub const ANN_BGP_AS_NUMBER: &str = "rcni.io/bgp-as-number";
pub const ANN_BGP_PEERS: &str = "rcni.io/bgp-peers";
/// Published with backend bgp: the addresses the node's BGP sessions use
/// (IPv4, then IPv6, comma-separated), as Calico's `projectcalico.org/IPv4Address`.
pub const ANN_BGP_ADDRESS: &str = "rcni.io/bgp-address";
/// The node's WireGuard public key (base64), when the cluster encrypts.
pub const ANN_WIREGUARD_KEY: &str = "rcni.io/wireguard-public-key";

/// flannel's annotations, read so that a flannel node is a peer too.
const FLANNEL_PUBLIC_IP: &str = "flannel.alpha.coreos.com/public-ip";
const FLANNEL_PUBLIC_IP6: &str = "flannel.alpha.coreos.com/public-ipv6";
const FLANNEL_PUBLIC_IP_OVERWRITE: &str = "flannel.alpha.coreos.com/public-ip-overwrite";
const FLANNEL_PUBLIC_IP6_OVERWRITE: &str = "flannel.alpha.coreos.com/public-ipv6-overwrite";
const FLANNEL_BACKEND_DATA: &str = "flannel.alpha.coreos.com/backend-data";
const FLANNEL_BACKEND_DATA6: &str = "flannel.alpha.coreos.com/backend-v6-data";

/// What the agent uses of a Node: compared on every event, so that a
/// status heartbeat costs no reconcile.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    internal: Vec<IpAddr>,
    external: Vec<IpAddr>,
    pod_cidrs: Vec<String>,
    /// rcni's and flannel's annotations only.
    annotations: BTreeMap<String, String>,
}

fn seen(n: &KNode) -> Seen {
    let mut s = Seen {
        internal: Vec::new(),
        external: Vec::new(),
        pod_cidrs: Vec::new(),
        annotations: BTreeMap::new(),
    };
    if let Some(st) = &n.status {
        for a in st.addresses.iter().flatten() {
            let Ok(ip) = a.address.parse::<IpAddr>() else {
                continue;
            };
            match a.type_.as_str() {
                "InternalIP" => s.internal.push(ip),
                "ExternalIP" => s.external.push(ip),
                _ => {}
            }
        }
    }
    if let Some(spec) = &n.spec {
        match &spec.pod_cidrs {
            Some(l) if !l.is_empty() => s.pod_cidrs = l.clone(),
            _ => s.pod_cidrs.extend(spec.pod_cidr.clone()),
        }
    }
    for (k, v) in n.metadata.annotations.iter().flatten() {
        if k.starts_with("rcni.io/") || k.starts_with("flannel.alpha.coreos.com/") {
            s.annotations.insert(k.clone(), v.clone());
        }
    }
    s
}

#[derive(Default)]
struct State {
    nodes: BTreeMap<String, Seen>,
    /// Bumped on every change of `nodes`.
    generation: u64,
    /// The first full list is in: before it, an empty map means nothing.
    synced: bool,
    /// This node's annotations are what it publishes (or it has no Node).
    published: bool,
}

struct Shared {
    state: Mutex<State>,
    synced: tokio::sync::Notify,
}

fn lock(s: &Shared) -> MutexGuard<'_, State> {
    s.state.lock().unwrap_or_else(|e| e.into_inner())
}

pub struct KubeRegistry {
    net: NetConf,
    node: String,
    shared: Arc<Shared>,
    seen: u64,
    skipped: Vec<String>,
    task: tokio::task::JoinHandle<()>,
    /// The policy inputs' watches and socket, when asked for: they live as
    /// long as the node source.
    pub policy: Option<crate::k8s_policy::PolicyInputs>,
    /// The Service programs' feed (`"kubeProxyReplacement": true`).
    pub services: Option<crate::services::ServiceProxy>,
}

impl Drop for KubeRegistry {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Where the API is: `--kubeconfig`, else kube's inference (`KUBECONFIG`,
/// `~/.kube/config`, then the in-cluster service account and
/// `KUBERNETES_SERVICE_HOST`/`_PORT`).
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client, ClientError> {
    let config = match kubeconfig {
        Some(p) => {
            let at = |err| ClientError::Kubeconfig {
                path: p.to_path_buf(),
                err,
            };
            let kc = kube::config::Kubeconfig::read_from(p).map_err(at)?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(at)?
        }
        None => kube::Config::infer().await.map_err(ClientError::Infer)?,
    };
    kube::Client::try_from(config).map_err(ClientError::Client)
}

/// Why there is no API client. The cause is part of each message (kube's
/// errors chain their own causes), not a `source()`.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("--kubeconfig {}: {err}", path.display())]
    Kubeconfig {
        path: std::path::PathBuf,
        err: kube::config::KubeconfigError,
    },
    #[error(
        "no Kubernetes API config ({0}); in a pod the service account's is used, elsewhere pass --kubeconfig"
    )]
    Infer(kube::config::InferConfigError),
    #[error("Kubernetes client: {0}")]
    Client(kube::Error),
}

impl KubeRegistry {
    /// Starts watching every Node (on the current tokio runtime).
    /// `wireguard_key`: this node's WireGuard public key (base64) to publish
    /// as [`ANN_WIREGUARD_KEY`], when the cluster encrypts.
    pub fn start(
        client: kube::Client,
        net: NetConf,
        node: String,
        wireguard_key: Option<String>,
    ) -> KubeRegistry {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            synced: tokio::sync::Notify::new(),
        });
        let api: Api<KNode> = Api::all(client);
        let task = tokio::spawn(watch_nodes(
            api,
            shared.clone(),
            net.clone(),
            node.clone(),
            wireguard_key,
        ));
        KubeRegistry {
            net,
            node,
            shared,
            seen: 0,
            skipped: Vec::new(),
            task,
            policy: None,
            services: None,
        }
    }

    /// Returns once the first full list of Nodes is in: before it, an
    /// empty node list would remove every peer's routes.
    pub async fn synced(&self) {
        self.until(|s| s.synced).await
    }

    /// Returns once this node's annotations are published (`--once` exits
    /// only after peers can see them).
    pub async fn published(&self) {
        self.until(|s| s.synced && s.published).await
    }

    async fn until(&self, f: impl Fn(&State) -> bool) {
        loop {
            let n = self.shared.synced.notified();
            if f(&lock(&self.shared)) {
                return;
            }
            n.await;
        }
    }
}

impl Registry for KubeRegistry {
    fn load(&mut self) -> Result<Cluster, ClusterError> {
        let st = lock(&self.shared);
        self.seen = st.generation;
        let me = st.nodes.get(&self.node).ok_or_else(|| {
            ClusterError::ThisNode(format!(
                "there is no Node {:?} in the API ({} Nodes); --node or NODE_NAME must be the node's name as `kubectl get nodes` shows it (in a DaemonSet: NODE_NAME from fieldRef spec.nodeName)",
                self.node,
                st.nodes.len()
            ))
        })?;
        let mut nodes =
            vec![node_of(&self.net, &self.node, me, true).map_err(ClusterError::ThisNode)?];
        let mut skipped = Vec::new();
        for (name, s) in st.nodes.iter().filter(|(n, _)| **n != self.node) {
            match node_of(&self.net, name, s, false) {
                Ok(n) => match crate::registry::cluster::conflict(&nodes, &n) {
                    None => nodes.push(n),
                    Some(m) => skipped.push(m),
                },
                Err(m) => skipped.push(m),
            }
        }
        drop(st);
        if skipped != self.skipped {
            for m in &skipped {
                crate::log(format!("peer skipped: {m}"));
            }
            self.skipped = skipped;
        }
        self.net.with_nodes(nodes)
    }

    fn maybe_changed(&mut self) -> bool {
        lock(&self.shared).generation != self.seen
    }

    fn describe(&self) -> String {
        "the Kubernetes API's Nodes".into()
    }
}

fn ann<'a>(s: &'a Seen, keys: &[&str]) -> Option<&'a str> {
    keys.iter()
        .find_map(|k| s.annotations.get(*k))
        .map(String::as_str)
        .filter(|v| !v.is_empty())
}

/// The VTEP MAC in flannel's backend data (`{"VNIMAC": "..."}`, as
/// flannel's vxlan backend writes it).
fn flannel_mac(s: &Seen, key: &str) -> Option<String> {
    let v: Value = serde_json::from_str(s.annotations.get(key)?).ok()?;
    v.get("VNIMAC")?.as_str().map(str::to_string)
}

fn first_v4(l: &[IpAddr]) -> Option<Ipv4Addr> {
    l.iter().find_map(|a| match a {
        IpAddr::V4(a) => Some(*a),
        _ => None,
    })
}

fn first_v6(l: &[IpAddr]) -> Option<Ipv6Addr> {
    l.iter().find_map(|a| match a {
        IpAddr::V6(a) => Some(*a),
        _ => None,
    })
}

/// This node's own addresses: the overwrite annotation, else its
/// InternalIP (flannel's order; ExternalIP when it has no InternalIP). On
/// an IPv6-only cluster its one address (the first) is IPv6: our overwrite
/// annotation or flannel's IPv6 one, else its IPv6 InternalIP.
fn own_addresses(net: &NetConf, s: &Seen) -> (Option<String>, Option<Ipv6Addr>) {
    if net.network.is_none() {
        let v6 = ann(s, &[ANN_PUBLIC_IP_OVERWRITE, FLANNEL_PUBLIC_IP6_OVERWRITE])
            .map(str::to_string)
            .or_else(|| {
                first_v6(&s.internal)
                    .or_else(|| first_v6(&s.external))
                    .map(|a| a.to_string())
            });
        return (v6, None);
    }
    let v4 = ann(s, &[ANN_PUBLIC_IP_OVERWRITE, FLANNEL_PUBLIC_IP_OVERWRITE])
        .map(str::to_string)
        .or_else(|| {
            first_v4(&s.internal)
                .or_else(|| first_v4(&s.external))
                .map(|a| a.to_string())
        });
    let v6 = first_v6(&s.internal).or_else(|| first_v6(&s.external));
    (v4, v6)
}

/// A Node as the cluster file would list it, checked as strictly; `Err`
/// says what is wrong and, for this node, what to do about it.
fn node_of(net: &NetConf, name: &str, s: &Seen, own: bool) -> Result<Node, String> {
    let (address, address6) = if own {
        own_addresses(net, s)
    } else if net.network.is_none() {
        // IPv6-only: the peer's published IPv6 address is its "address".
        let (a, _) = own_addresses(net, s);
        (
            ann(s, &[ANN_PUBLIC_IP6, FLANNEL_PUBLIC_IP6])
                .map(str::to_string)
                .or(a),
            None,
        )
    } else {
        // What the peer published, else what it would publish.
        let (a, a6) = own_addresses(net, s);
        (
            ann(s, &[ANN_PUBLIC_IP, FLANNEL_PUBLIC_IP])
                .map(str::to_string)
                .or(a),
            ann(s, &[ANN_PUBLIC_IP6, FLANNEL_PUBLIC_IP6])
                .and_then(|a| a.parse().ok())
                .or(a6),
        )
    };
    let Some(address) = address else {
        let ipv6 = if net.network.is_none() { "IPv6 " } else { "" };
        return Err(format!(
            "Node {name:?} has no {ipv6}InternalIP (status.addresses) and no {ANN_PUBLIC_IP_OVERWRITE} annotation"
        ));
    };
    if s.pod_cidrs.is_empty() {
        return Err(if own {
            format!(
                "Node {name:?} has no spec.podCIDRs: no pod subnet was assigned to it. Let kube-controller-manager assign them (--allocate-node-cidrs=true --cluster-cidr={}), or set it on the Node (kubectl patch node {name} -p '{{\"spec\":{{\"podCIDR\":\"...\",\"podCIDRs\":[\"...\"]}}}}')",
                net.network.map_or_else(
                    || net.network6.map(|n| n.to_string()).unwrap_or_default(),
                    |n| n.to_string()
                )
            )
        } else {
            format!("Node {name:?} has no spec.podCIDRs yet")
        });
    }
    // IPv6 pod subnets of a cluster the net-conf makes single-stack are
    // not this agent's to route, nor IPv4 ones of an IPv6-only net-conf.
    let cidrs: Vec<&String> = s
        .pod_cidrs
        .iter()
        .filter(|c| match net.network {
            None => c.contains(':'),
            Some(_) => net.network6.is_some() || !c.contains(':'),
        })
        .collect();
    if cidrs.is_empty() && net.network.is_none() {
        return Err(format!(
            "Node {name:?} has no IPv6 spec.podCIDRs ({}): the net-conf's \"network\" is IPv6 (an IPv6-only cluster)",
            s.pod_cidrs.join(", ")
        ));
    }
    let mut o = json!({"name": name, "address": address, "podCIDRs": cidrs});
    // Peers' keys are checked as a cluster file's `wireguardPublicKey` is.
    if let Some(k) = ann(s, &[ANN_WIREGUARD_KEY]) {
        o["wireguardPublicKey"] = json!(k);
    }
    if let Some(a6) = address6
        && net.network6.is_some()
    {
        o["address6"] = json!(a6.to_string());
    }
    if let Some(v) = ann(s, &[ANN_BGP_AS_NUMBER]) {
        o["asNumber"] = json!(v);
    }
    if let Some(v) = ann(s, &[ANN_BGP_PEERS]) {
        o["peers"] = serde_json::from_str(v).map_err(|e| {
            format!("Node {name:?}: annotation {ANN_BGP_PEERS}: {v:?} is not JSON ({e})")
        })?;
    }
    let mut n = crate::registry::cluster::parse_node("Kubernetes Node", &o, net.network, net.network6)
        .map_err(|e| {
            let m = e.to_string();
            if own && m.contains("outside") {
                format!(
                    "{m}: the net-conf's \"network\" must contain the pod subnets Kubernetes assigns (kube-controller-manager's --cluster-cidr)"
                )
            } else {
                m
            }
        })?;
    if !own {
        let mac = |keys: &[&str], flannel: &str| -> Result<Option<MacAddr>, String> {
            let text = ann(s, keys)
                .map(str::to_string)
                .or_else(|| flannel_mac(s, flannel));
            match text {
                None => Ok(None),
                Some(t) => t
                    .parse::<MacAddr>()
                    .map(Some)
                    .map_err(|_| format!("Node {name:?}: VTEP MAC {t:?} is not a MAC address")),
            }
        };
        n.vtep_mac = mac(&[ANN_VTEP_MAC], FLANNEL_BACKEND_DATA)?;
        n.vtep_mac6 = mac(&[ANN_VTEP_MAC6], FLANNEL_BACKEND_DATA6)?;
    }
    Ok(n)
}

/// The annotations this node publishes (only those it can know now).
fn wanted(
    net: &NetConf,
    name: &str,
    s: &Seen,
    wireguard_key: Option<&str>,
) -> BTreeMap<String, String> {
    let mut w = BTreeMap::new();
    if let Some(k) = wireguard_key {
        w.insert(ANN_WIREGUARD_KEY.to_string(), k.to_string());
    }
    let (a, a6) = own_addresses(net, s);
    w.insert(ANN_BACKEND.to_string(), net.backend.as_str().to_string());
    // An IPv6-only node's one address and VTEP are IPv6 ones (as flannel's
    // IPv6-only nodes publish only public-ipv6 and backend-v6-data).
    let v6_only = net.network.is_none();
    if let Some(a) = &a {
        let key = if v6_only {
            ANN_PUBLIC_IP6
        } else {
            ANN_PUBLIC_IP
        };
        w.insert(key.to_string(), a.clone());
    }
    if matches!(net.backend, Backend::Bgp(_)) {
        let both: Vec<String> = a
            .iter()
            .cloned()
            .chain(
                a6.iter()
                    .filter(|_| net.network6.is_some())
                    .map(|a6| a6.to_string()),
            )
            .collect();
        if !both.is_empty() {
            w.insert(ANN_BGP_ADDRESS.to_string(), both.join(","));
        }
    }
    if net.backend.uses_vxlan() && v6_only {
        w.insert(
            ANN_VTEP_MAC6.to_string(),
            desired::vtep_mac6(name, net.vni).to_string(),
        );
    } else if net.backend.uses_vxlan() {
        w.insert(
            ANN_VTEP_MAC.to_string(),
            desired::vtep_mac(name, net.vni).to_string(),
        );
    }
    if net.network6.is_some()
        && let Some(a6) = a6
    {
        w.insert(ANN_PUBLIC_IP6.to_string(), a6.to_string());
        if net.backend.uses_vxlan() {
            w.insert(
                ANN_VTEP_MAC6.to_string(),
                desired::vtep_mac6(name, net.vni).to_string(),
            );
        }
    }
    w
}

/// The merge patch that makes the node's annotations `wanted`, if any is
/// needed.
fn patch_for(net: &NetConf, name: &str, s: &Seen, wireguard_key: Option<&str>) -> Option<Value> {
    let w = wanted(net, name, s, wireguard_key);
    let mut ann = serde_json::Map::new();
    for (k, v) in &w {
        if s.annotations.get(k) != Some(v) {
            ann.insert(k.clone(), json!(v));
        }
    }
    // Ours that no longer apply (the IPv6 ones of a node gone
    // single-stack, the MAC of a host-gw node) are removed.
    for k in [
        ANN_PUBLIC_IP6,
        ANN_VTEP_MAC,
        ANN_VTEP_MAC6,
        ANN_WIREGUARD_KEY,
    ] {
        if s.annotations.contains_key(k) && !w.contains_key(k) {
            ann.insert(k.to_string(), Value::Null);
        }
    }
    (!ann.is_empty()).then(|| json!({"metadata": {"annotations": ann}}))
}

const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Whether an error is an HTTP 410 on starting a watch: kube's watcher
/// retries such a watch from the same resourceVersion forever, so the
/// stream is made anew (a fresh list).
fn gone_on_start(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::WatchStartFailed(kube::Error::Api(s)) if s.code == 410)
}

async fn watch_nodes(
    api: Api<KNode>,
    shared: Arc<Shared>,
    net: NetConf,
    me: String,
    wireguard_key: Option<String>,
) {
    let mut backoff = BACKOFF_MIN;
    // The patch still to make when the last one failed.
    let mut pending: Option<Value> = None;
    loop {
        // Bookmarks on (the default): a resumed watch starts from the last
        // bookmark's resourceVersion, not from a 410 and a full list.
        let config = watcher::Config::default();
        debug_assert!(config.bookmarks);
        let mut stream = watcher::watcher(api.clone(), config).boxed();
        // A relist is buffered and replaces the store only when complete.
        let mut buffer: Option<BTreeMap<String, Seen>> = None;
        loop {
            let (retrying, delay) = (pending.is_some(), backoff);
            let retry = async move {
                if retrying {
                    tokio::time::sleep(delay).await
                } else {
                    std::future::pending().await
                }
            };
            let item = tokio::select! {
                item = stream.next() => item,
                _ = retry => {
                    pending = publish(&api, &me, pending.take()).await;
                    set_published(&shared, pending.is_none());
                    continue;
                }
            };
            let Some(item) = item else { break };
            let ev = match item {
                Ok(ev) => {
                    backoff = BACKOFF_MIN;
                    ev
                }
                Err(e) => {
                    crate::log(format!(
                        "Kubernetes API: {} (retrying in {backoff:?})",
                        crate::causes(&e)
                    ));
                    if gone_on_start(&e) {
                        break;
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    continue;
                }
            };
            let mut own_changed = false;
            match ev {
                Event::Init => buffer = Some(BTreeMap::new()),
                Event::InitApply(n) => {
                    if let Some(b) = &mut buffer {
                        b.insert(n.metadata.name.clone().unwrap_or_default(), seen(&n));
                    }
                }
                Event::InitDone => {
                    let nodes = buffer.take().unwrap_or_default();
                    let mut st = lock(&shared);
                    if !st.synced || st.nodes != nodes {
                        st.nodes = nodes;
                        st.generation += 1;
                    }
                    st.synced = true;
                    own_changed = true;
                    drop(st);
                    shared.synced.notify_waiters();
                }
                Event::Apply(n) => {
                    let name = n.metadata.name.clone().unwrap_or_default();
                    let s = seen(&n);
                    let mut st = lock(&shared);
                    if st.nodes.get(&name) != Some(&s) {
                        st.nodes.insert(name.clone(), s);
                        st.generation += 1;
                        own_changed = name == me;
                    }
                }
                Event::Delete(n) => {
                    let name = n.metadata.name.clone().unwrap_or_default();
                    let mut st = lock(&shared);
                    if st.nodes.remove(&name).is_some() {
                        st.generation += 1;
                    }
                }
            }
            if own_changed {
                let p = lock(&shared)
                    .nodes
                    .get(&me)
                    .and_then(|s| patch_for(&net, &me, s, wireguard_key.as_deref()));
                pending = publish(&api, &me, p).await;
                set_published(&shared, pending.is_none());
            }
        }
    }
}

fn set_published(shared: &Shared, done: bool) {
    lock(shared).published = done;
    shared.synced.notify_waiters();
}

/// Applies `patch` to this node's Node; what is still to do (`Some` when
/// the API refused or was unreachable: retried later).
async fn publish(api: &Api<KNode>, me: &str, patch: Option<Value>) -> Option<Value> {
    let patch = patch?;
    match api
        .patch(me, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {
            crate::log(format!("published {}", patch["metadata"]["annotations"]));
            None
        }
        Err(e) => {
            crate::log(format!(
                "patching Node {me:?} failed: {} (will retry)",
                crate::causes(&e)
            ));
            Some(patch)
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
