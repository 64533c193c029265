//! `rcni-node run`: the agent's loop, one reconcile per change of the node
//! source (a cluster file or the Kubernetes API) and a full one every
//! `--resync-s`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use crate::install::conflist;
use crate::k8s_policy;
use crate::metrics::{self, Metrics};
use crate::registry::cluster::{self, ClusterError};
use crate::registry::k8s;
use crate::registry::{FileRegistry, Registry};
use crate::sync::{agent, xnode};
use crate::{bgp, cloud, log, services, status, wgkey};
use rcni_netlink::route_watch::RouteWatch;

/// How long `--once --kubernetes` waits for the first list of Nodes.
const ONCE_SYNC_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(clap::Args)]
pub struct RunArgs {
    /// The cluster file (JSON: network, backend, vni, port, nodes).
    #[arg(
        long,
        value_name = "FILE",
        required_unless_present_any = ["kubernetes", "cloud", "net_conf"],
        conflicts_with = "kubernetes"
    )]
    pub cluster: Option<PathBuf>,
    /// Pods on the cloud network's own addresses (AWS VPC CNI / Azure CNI
    /// mode): a warm pool of the node's secondary addresses, served to the
    /// vpc-ipam plugin on --cloud-socket. Also set by the net-conf's
    /// "cloud" section; tuned by its keys or the AWS VPC CNI's variables
    /// (WARM_ENI_TARGET, WARM_IP_TARGET, MINIMUM_IP_TARGET,
    /// ENABLE_PREFIX_DELEGATION, ...).
    #[arg(long, value_enum, value_name = "PROVIDER", conflicts_with = "cluster")]
    pub cloud: Option<cloud::ProviderKind>,
    /// In cloud mode: the socket the vpc-ipam plugin asks (its "socket").
    #[arg(long, value_name = "PATH", default_value = rcni_agent_proto::ipam::DEFAULT_SOCKET)]
    pub cloud_socket: PathBuf,
    /// Nodes from the Kubernetes API (Node objects) instead of a cluster
    /// file; needs --net-conf.
    #[arg(long, requires = "net_conf")]
    pub kubernetes: bool,
    /// With --kubernetes: the cluster file's JSON without "nodes" (network,
    /// backend, ebpf, encryption, vni, port), as flannel's net-conf.json.
    // (Not `requires = "kubernetes"`: a flag's implicit `false` satisfies
    // it; with one of --cluster and --kubernetes required, this is the same.)
    #[arg(long, value_name = "FILE", conflicts_with = "cluster")]
    pub net_conf: Option<PathBuf>,
    /// With --kubernetes: the kubeconfig to use; without it, the in-cluster
    /// config (the pod's service account), or KUBECONFIG.
    #[arg(long, value_name = "FILE", conflicts_with = "cluster")]
    pub kubeconfig: Option<PathBuf>,
    /// With --kubernetes: mirror NetworkPolicy and Namespace objects into
    /// DIR (the policy plugin's policyDir) and answer this node's pods'
    /// labels on --agent-socket.
    #[arg(long, value_name = "DIR", conflicts_with = "cluster")]
    pub policy_dir: Option<PathBuf>,
    /// With --policy-dir: the root-only socket the policy plugin asks for
    /// a pod's labels.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/run/rcni/agent.sock",
        requires = "policy_dir"
    )]
    pub agent_socket: PathBuf,
    /// With --policy-dir: the directory holding the `policy` plugin, run
    /// as `policy sync` after a NetworkPolicy, Namespace or Pod label
    /// change (in the DaemonSet, the image's copy). --policy-dir and
    /// --agent-socket go into the conflist as they are: the node must see
    /// them at the same paths.
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/opt/cni/bin",
        requires = "policy_dir"
    )]
    pub cni_bin_dir: PathBuf,
    /// With --policy-dir: the policy plugin's dataDir (its default,
    /// /var/lib/cni/rcni-policy, when unset).
    #[arg(long, value_name = "DIR", requires = "policy_dir")]
    pub policy_data_dir: Option<PathBuf>,
    /// With --policy-dir: the policy plugin's "backend" in the conflist:
    /// auto (its default: eBPF where the kernel takes it, else nftables),
    /// ebpf or nftables.
    #[arg(
        long,
        value_name = "BACKEND",
        default_value = "auto",
        value_parser = ["auto", "ebpf", "nftables"],
        requires = "policy_dir"
    )]
    pub policy_backend: String,
    /// This node's name (in the cluster file, or its Node object's).
    #[arg(long, value_name = "NAME", env = "NODE_NAME")]
    pub node: String,
    /// Where the node's CNI config (10-rcni.conflist) is written.
    #[arg(long, value_name = "DIR", default_value = "/etc/cni/net.d")]
    pub cni_conf_dir: PathBuf,
    /// Reconcile once and exit.
    #[arg(long)]
    pub once: bool,
    /// The agent's own state (created if missing); it keeps the last
    /// applied summary there.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/rcni-node")]
    pub state_dir: PathBuf,
    /// With "ebpf": true, the bpffs directory of the fastpath plugin's pins
    /// (its pinRoot in the written config): the agent keeps the network's
    /// other-node map there and mounts a bpffs when there is none.
    #[arg(long, value_name = "DIR", default_value = xnode::DEFAULT_PIN_ROOT)]
    pub bpf_pin_root: PathBuf,
    /// With the net-conf's "kubeProxyReplacement": true, the cgroup v2
    /// directory whose processes' connections to Services are translated
    /// (the host's cgroup v2 root when unset: every pod and host process).
    #[arg(long, value_name = "DIR")]
    pub cgroup_root: Option<PathBuf>,
    /// host-local's dataDir in the written config (its default when unset).
    #[arg(long, value_name = "DIR")]
    pub ipam_data_dir: Option<PathBuf>,
    /// How often the cluster file is checked for changes.
    #[arg(long, value_name = "MS", default_value_t = 500)]
    pub poll_ms: u64,
    /// With "backend": "bgp": the BIRD 2 daemon to run (Debian's bird2;
    /// the DaemonSet image has it).
    #[arg(long, value_name = "PATH", default_value = "bird")]
    pub bird: PathBuf,
    /// A full reconcile against the kernel at least this often, changed
    /// file or not: entries someone removed come back.
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    pub resync_s: u64,
    /// Serve Prometheus metrics on http://ADDR/metrics (host:port, e.g.
    /// 0.0.0.0:9680); off when unset.
    #[arg(long, value_name = "ADDR", env = "RCNI_METRICS_ADDR")]
    pub metrics_addr: Option<String>,
    /// With --metrics-addr: the directory the plugins record their CNI
    /// commands in (their RCNI_CNI_STATS_DIR); the agent makes it, and
    /// plugins record nothing where it does not exist.
    #[arg(long, value_name = "DIR", default_value = metrics::cnistats::DEFAULT_DIR)]
    pub cni_stats_dir: PathBuf,
    /// The status file `rcni-node status` reads, replaced after each
    /// reconcile; written only when its directory exists.
    #[arg(long, value_name = "PATH", default_value = status::DEFAULT_FILE)]
    pub status_file: PathBuf,
}

/// Exit status for a cluster file or command line that is wrong.
const EXIT_CONFIG: u8 = 2;
/// Exit status for a feature asked for that is not implemented.
const EXIT_NOT_IMPLEMENTED: u8 = 3;

pub fn run(args: RunArgs) -> ExitCode {
    let rt = match rcni_netlink::runtime() {
        Ok(rt) => rt,
        Err(e) => {
            log(e);
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
        if let Err(code) = start_metrics(&args).await {
            return code;
        }
        match cloud_conf(&args) {
            Ok(Some(c)) => return run_cloud(&args, c).await,
            Ok(None) => {}
            Err(code) => return code,
        }
        if !args.kubernetes && args.cluster.is_none() {
            log("--net-conf without --kubernetes is for cloud mode: it needs a \"cloud\" section");
            return ExitCode::from(EXIT_CONFIG);
        }
        let mut registry: Box<dyn Registry> = match (&args.cluster, &args.net_conf) {
            (Some(file), _) => Box::new(FileRegistry::new(file)),
            (None, Some(net_conf)) => match kube_registry(&args, net_conf).await {
                Ok(r) => r,
                Err(code) => return code,
            },
            (None, None) => unreachable!("clap requires --cluster or --kubernetes --net-conf"),
        };
        let opts = agent::Options {
            node: args.node.clone(),
            cni_conf_dir: args.cni_conf_dir.clone(),
            ipam_data_dir: args.ipam_data_dir.clone(),
            state_dir: args.state_dir.clone(),
            policy: args.policy_dir.as_ref().map(|d| conflist::PolicyPlugin {
                policy_dir: d.clone(),
                agent_socket: args.agent_socket.clone(),
                data_dir: args.policy_data_dir.clone(),
                backend: (args.policy_backend != "auto").then(|| args.policy_backend.clone()),
            }),
            bpf_pin_root: args.bpf_pin_root.clone(),
        };
        let nl = match rcni_netlink::Netlink::connect_current().await {
            Ok(nl) => nl,
            Err(e) => {
                log(e);
                return ExitCode::FAILURE;
            }
        };
        if let Err(e) = std::fs::create_dir_all(&args.state_dir) {
            log(format!("state dir {}: {e}", args.state_dir.display()));
            return ExitCode::FAILURE;
        }
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    log(format!("SIGTERM handler: {e}"));
                    return ExitCode::FAILURE;
                }
            };
        let mut last_full = Instant::now();
        let mut first = true;
        let mut speaker = bgp::Speaker::new(&args.state_dir, &args.bird);
        let mut seen_bgp;
        // With BIRD running, its table's changes wake the loop at once; the
        // poll below still catches what a lost notification would miss.
        let mut routes: Option<RouteWatch> = None;
        loop {
            // Read before the reconcile: a route BIRD adds while it runs
            // differs from this, and makes the next one.
            if let Some(w) = &mut routes {
                w.drain();
            }
            // (Only with BIRD running: other backends pay no dump.)
            seen_bgp = if speaker.running() {
                bgp::fingerprint(&nl).await.unwrap_or_default()
            } else {
                Vec::new()
            };
            let status = once(
                &mut *registry,
                &nl,
                &opts,
                &args,
                (!args.once).then_some(&mut speaker),
            )
            .await;
            // A Kubernetes node without its Node or podCIDR yet waits for
            // them; a cluster file that lacks the node is a mistake.
            if args.once || (first && status == Some(EXIT_CONFIG_NODE) && !args.kubernetes) {
                return match status {
                    None => ExitCode::SUCCESS,
                    Some(c) => ExitCode::from(c),
                };
            }
            first = false;
            match (speaker.running(), routes.is_some()) {
                (true, false) => match RouteWatch::open(bgp::conf::TABLE) {
                    Ok(w) => routes = Some(w),
                    Err(e) => log(format!("bgp: {e}: BIRD's table is polled only")),
                },
                (false, true) => routes = None,
                _ => {}
            }
            // Wait for a change of the file, the periodic resync, or the
            // end. Exiting flushes nothing: what is programmed stays, and
            // the next start reconciles from it.
            // BIRD's table is read this often too: a route it learns is
            // mirrored within this.
            let tick = if speaker.running() {
                args.poll_ms.min(BGP_POLL_MS)
            } else {
                args.poll_ms
            };
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(tick)) => {}
                    _ = table_changed(&mut routes), if speaker.running() => {}
                    _ = term.recv() => {
                        log("SIGTERM: exiting, kernel state kept");
                        return ExitCode::SUCCESS;
                    }
                    _ = tokio::signal::ctrl_c() => {
                        log("SIGINT: exiting, kernel state kept");
                        return ExitCode::SUCCESS;
                    }
                }
                if registry.maybe_changed() {
                    log(format!("{} changed", registry.describe()));
                    break;
                }
                if last_full.elapsed() >= Duration::from_secs(args.resync_s) {
                    break;
                }
                if speaker.running() {
                    for l in speaker.watch() {
                        log(l);
                    }
                    let now = bgp::fingerprint(&nl).await.unwrap_or_default();
                    if now != seen_bgp || !speaker.running() {
                        break;
                    }
                }
            }
            last_full = Instant::now();
        }
    })
}

/// Cloud mode's settings, when the command line or the net-conf asks for
/// it.
fn cloud_conf(args: &RunArgs) -> Result<Option<cloud::CloudConf>, ExitCode> {
    let net = match (&args.cluster, &args.net_conf) {
        (None, Some(f)) => {
            let v = std::fs::read_to_string(f)
                .map_err(|e| e.to_string())
                .and_then(|t| {
                    serde_json::from_str::<serde_json::Value>(&t).map_err(|e| e.to_string())
                });
            match v {
                Ok(v) => Some(v),
                // Not cloud mode's to report: the cluster parser names it.
                Err(_) if args.cloud.is_none() => return Ok(None),
                Err(e) => {
                    log(format!("--net-conf {}: {e}", f.display()));
                    return Err(ExitCode::from(EXIT_CONFIG));
                }
            }
        }
        _ => None,
    };
    cloud::conf(net.as_ref(), args.cloud, &|k| std::env::var(k).ok()).map_err(|e| {
        log(e);
        ExitCode::from(EXIT_CONFIG)
    })
}

async fn run_cloud(args: &RunArgs, conf: cloud::CloudConf) -> ExitCode {
    // With --kubernetes --policy-dir, policy comes from the API as in the
    // other modes (the Canal-style preset); the guard keeps it running.
    let mut _policy = None;
    if let (true, Some(dir)) = (args.kubernetes, &args.policy_dir) {
        let client = match k8s::client(args.kubeconfig.as_deref()).await {
            Ok(c) => c,
            Err(e) => {
                log(e);
                return ExitCode::from(EXIT_CONFIG);
            }
        };
        let sync = k8s_policy::SyncCommand {
            bin: args.cni_bin_dir.join("policy"),
            network: conflist::NETWORK_NAME.into(),
            data_dir: args.policy_data_dir.clone(),
        };
        match k8s_policy::start(
            client,
            dir.clone(),
            &args.node,
            &args.agent_socket,
            Some(sync),
            k8s_policy::ServiceMirror::On,
        ) {
            Ok(p) => _policy = Some(p),
            Err(e) => {
                log(e);
                return ExitCode::FAILURE;
            }
        }
    }
    let opts = cloud::Options {
        node: args.node.clone(),
        cni_conf_dir: args.cni_conf_dir.clone(),
        state_dir: args.state_dir.clone(),
        socket: args.cloud_socket.clone(),
        policy: args.policy_dir.as_ref().map(|d| conflist::PolicyPlugin {
            policy_dir: d.clone(),
            agent_socket: args.agent_socket.clone(),
            data_dir: args.policy_data_dir.clone(),
            backend: (args.policy_backend != "auto").then(|| args.policy_backend.clone()),
        }),
        once: args.once,
        resync: Duration::from_secs(args.resync_s),
        status_file: Some(args.status_file.clone()),
    };
    cloud::run(conf, opts).await
}

async fn table_changed(w: &mut Option<RouteWatch>) {
    match w {
        Some(w) => w.changed().await,
        None => std::future::pending().await,
    }
}

/// With `"kubeProxyReplacement": true`, the Service programs hooked and
/// fed from the API; without, what an earlier run hooked taken off.
fn services_for(
    args: &RunArgs,
    on: Option<cluster::NodePortAddresses>,
    client: &kube::Client,
) -> Result<Option<services::ServiceProxy>, services::ServicesError> {
    let Some(node_port_addresses) = on else {
        if services::stop(&args.bpf_pin_root)? {
            log("services: kubeProxyReplacement is off: the Service hooks and maps were removed");
        }
        return Ok(None);
    };
    let cgroup = match &args.cgroup_root {
        Some(c) => c.clone(),
        None => services::default_cgroup_root()?,
    };
    let conf = services::Config {
        pin_root: args.bpf_pin_root.clone(),
        cgroup,
        node: args.node.clone(),
        node_port_addresses,
        netns_dir: services::NETNS_DIR.into(),
    };
    services::start(client.clone(), conf).map(Some)
}

/// How often BIRD's table and sessions are looked at, at most.
const BGP_POLL_MS: u64 = 100;

/// Exit status for this node not being in the cluster (or not fitting it).
const EXIT_CONFIG_NODE: u8 = 4;

/// One load and reconcile; `None` on full success, else the exit status
/// `--once` ends with. A file that cannot be loaded keeps what is
/// programmed.
/// The Kubernetes node source, its first list of Nodes in.
async fn kube_registry(
    args: &RunArgs,
    net_conf: &std::path::Path,
) -> Result<Box<dyn Registry>, ExitCode> {
    let net = std::fs::read_to_string(net_conf)
        .map_err(|e| ClusterError::Invalid(format!("cannot read {}: {e}", net_conf.display())))
        .and_then(|t| cluster::parse_net_conf(&t))
        .map_err(|e| {
            log(format!("--net-conf {}: {e}", net_conf.display()));
            ExitCode::from(match e {
                ClusterError::NotImplemented(_) => EXIT_NOT_IMPLEMENTED,
                _ => EXIT_CONFIG,
            })
        })?;
    let client = k8s::client(args.kubeconfig.as_deref()).await.map_err(|e| {
        log(e);
        ExitCode::from(EXIT_CONFIG)
    })?;
    // Made (or read) before the agent's first pass makes the device, so
    // peers learn the key from the Node as early as possible.
    let wireguard_key = match net.encryption {
        cluster::Encryption::WireGuard => {
            let keys = wgkey::load_or_create(&args.state_dir).map_err(|e| {
                log(e);
                ExitCode::FAILURE
            })?;
            Some(wgkey::encode(&keys.public))
        }
        cluster::Encryption::None => None,
    };
    let kube_proxy_replacement = net
        .kube_proxy_replacement
        .then(|| net.node_port_addresses.clone());
    let mut registry =
        k8s::KubeRegistry::start(client.clone(), net, args.node.clone(), wireguard_key);
    registry.services =
        services_for(args, kube_proxy_replacement.clone(), &client).map_err(|e| {
            log(e);
            ExitCode::FAILURE
        })?;
    if let Some(dir) = &args.policy_dir {
        let sync = k8s_policy::SyncCommand {
            bin: args.cni_bin_dir.join("policy"),
            network: conflist::NETWORK_NAME.into(),
            data_dir: args.policy_data_dir.clone(),
        };
        let mirror = match kube_proxy_replacement {
            Some(_) => k8s_policy::ServiceMirror::Off,
            None => k8s_policy::ServiceMirror::On,
        };
        let p = k8s_policy::start(
            client,
            dir.clone(),
            &args.node,
            &args.agent_socket,
            Some(sync),
            mirror,
        )
        .map_err(|e| {
            log(e);
            ExitCode::FAILURE
        })?;
        registry.policy = Some(p);
    }
    if args.once {
        if tokio::time::timeout(ONCE_SYNC_TIMEOUT, registry.synced())
            .await
            .is_err()
        {
            log(format!(
                "no list of Nodes from the Kubernetes API within {ONCE_SYNC_TIMEOUT:?}"
            ));
            return Err(ExitCode::FAILURE);
        }
        // The annotations are not this run's to wait for forever: a
        // refused patch is logged, and the next run tries again.
        let _ = tokio::time::timeout(ONCE_SYNC_TIMEOUT, registry.published()).await;
    } else {
        registry.synced().await;
    }
    log("listed the Kubernetes API's Nodes");
    Ok(Box::new(registry))
}

async fn once(
    registry: &mut dyn Registry,
    nl: &rcni_netlink::Netlink,
    opts: &agent::Options,
    args: &RunArgs,
    speaker: Option<&mut bgp::Speaker>,
) -> Option<u8> {
    let t0 = Instant::now();
    let loaded = registry.load();
    let (exit, cluster, refused) = match loaded {
        Ok(cluster) => {
            let (exit, refused) =
                reconcile_loaded(registry, nl, opts, args, speaker, &cluster).await;
            (exit, Some(cluster), refused)
        }
        Err(e) => {
            let (msg, exit) = match &e {
                ClusterError::Invalid(_) => (
                    format!("invalid cluster, nothing changed: {e}"),
                    EXIT_CONFIG,
                ),
                ClusterError::NotImplemented(_) => (e.to_string(), EXIT_NOT_IMPLEMENTED),
                ClusterError::ThisNode(_) => (
                    format!("this node cannot be programmed yet, nothing changed: {e}"),
                    EXIT_CONFIG_NODE,
                ),
            };
            log(&msg);
            Metrics::get().reconciled("agent", Err(msg), t0.elapsed(), &Default::default());
            (Some(exit), None, Vec::new())
        }
    };
    let doc = status::agent_status(&status::AgentView {
        node: &opts.node,
        source: registry.describe(),
        cluster: cluster.as_ref(),
        refused: &refused,
        cni_conf_dir: &opts.cni_conf_dir,
        pin_root: &opts.bpf_pin_root,
        resync_s: args.resync_s,
    });
    status::write(&args.status_file, &doc);
    exit
}

/// The reconcile of a loaded cluster: the exit status `--once` ends with
/// (`None` on full success) and the peers refused.
async fn reconcile_loaded(
    registry: &mut dyn Registry,
    nl: &rcni_netlink::Netlink,
    opts: &agent::Options,
    args: &RunArgs,
    speaker: Option<&mut bgp::Speaker>,
    cluster: &cluster::Cluster,
) -> (Option<u8>, Vec<String>) {
    let state_dir = &args.state_dir;
    Metrics::get().set_peer_names(
        cluster
            .nodes
            .iter()
            .filter_map(|n| Some((n.wireguard_key?, n.name.clone())))
            .collect(),
    );
    if let Some(speaker) = speaker {
        bgp_speaker(speaker, nl, cluster, &opts.node).await;
    }
    let t0 = Instant::now();
    let result = agent::reconcile(nl, cluster, opts).await;
    let took = t0.elapsed();
    match result {
        Ok(report) => {
            for l in &report.log {
                log(l);
            }
            for r in &report.refused {
                log(format!("refused {r}"));
            }
            log(format!(
                "reconciled {} nodes ({}) in {:.1} ms: {} kernel changes",
                cluster.nodes.len(),
                cluster.backend.as_str(),
                took.as_secs_f64() * 1000.0,
                report.changes
            ));
            // Refused peers are the cluster's mistake, not the pass's: the
            // rest is programmed.
            Metrics::get().reconciled("agent", Ok(()), took, &report.kinds);
            let summary = serde_json::json!({
                "cluster": registry.describe(),
                "node": opts.node,
                "backend": cluster.backend.as_str(),
                "nodes": cluster.nodes.len(),
                "refused": report.refused,
            });
            let _ = rcni_statefile::write_replace(
                &state_dir.join("applied.json"),
                summary.to_string().as_bytes(),
                0o644,
            );
            if report.refused.is_empty() {
                (None, report.refused)
            } else {
                (Some(EXIT_CONFIG), report.refused)
            }
        }
        Err(e) => {
            log(&e);
            let exit = match e {
                agent::AgentError::Config(_) => EXIT_CONFIG_NODE,
                agent::AgentError::Kernel(_) => 1,
            };
            Metrics::get().reconciled("agent", Err(crate::causes(&e)), took, &Default::default());
            (Some(exit), Vec::new())
        }
    }
}

/// `--metrics-addr`: the registry's sources, the plugins' stats
/// directory, and the server, running on the agent's runtime.
async fn start_metrics(args: &RunArgs) -> Result<(), ExitCode> {
    let Some(addr) = &args.metrics_addr else {
        return Ok(());
    };
    let m = Metrics::get();
    m.set_sources(Some(&args.bpf_pin_root), Some(&args.cni_conf_dir));
    // Made here only: without a reader, the plugins' lines would pile up.
    match std::fs::create_dir_all(&args.cni_stats_dir) {
        Ok(()) => {
            m.set_cni_stats_dir(&args.cni_stats_dir);
            // Read often enough that the file stays small between scrapes.
            tokio::spawn(async {
                loop {
                    tokio::time::sleep(CNI_STATS_EVERY).await;
                    let _ =
                        tokio::task::spawn_blocking(|| Metrics::get().collect_cni_stats()).await;
                }
            });
        }
        Err(e) => log(format!(
            "cni stats dir {}: {e}: CNI commands are not counted",
            args.cni_stats_dir.display()
        )),
    }
    let listener = metrics::server::bind(addr).await.map_err(|e| {
        log(format!("--metrics-addr {addr}: {e}"));
        ExitCode::from(EXIT_CONFIG)
    })?;
    log(format!(
        "serving metrics on http://{}/metrics",
        metrics::server::local_addr(&listener).map_or(addr.clone(), |a| a.to_string())
    ));
    tokio::spawn(metrics::server::serve(listener, m));
    Ok(())
}

/// How often the plugins' command lines are read besides each scrape.
const CNI_STATS_EVERY: Duration = Duration::from_secs(10);

/// BIRD running with the cluster's sessions when the backend is bgp, and
/// stopped (its table emptied) when it no longer is. Without `--once`
/// only: a one-off run mirrors what BIRD's table holds.
async fn bgp_speaker(
    speaker: &mut bgp::Speaker,
    nl: &rcni_netlink::Netlink,
    cluster: &cluster::Cluster,
    node: &str,
) {
    let me = cluster.node(node);
    match (cluster.backend, me) {
        (cluster::Backend::Bgp(_), Some(me)) => {
            // A table that still holds routes is a restart: BIRD recovers
            // (keeps them) until its sessions are back.
            let recover =
                !speaker.running() && !bgp::fingerprint(nl).await.unwrap_or_default().is_empty();
            match speaker.ensure(cluster, me, recover) {
                Ok(lines) => lines.into_iter().for_each(log),
                Err(e) => log(format!("bgp: {e}")),
            }
        }
        _ if speaker.running() => {
            speaker.withdraw();
            let why = match me {
                None => format!("node {node:?} left the cluster"),
                Some(_) => format!("backend {}", cluster.backend.as_str()),
            };
            match bgp::flush(nl).await {
                Ok(n) => log(format!(
                    "bgp: BIRD shut down, routes withdrawn at the peers ({why}); {n} routes of its table removed"
                )),
                Err(e) => log(format!("bgp: BIRD stopped; its table: {e}")),
            }
        }
        _ => {}
    }
}
