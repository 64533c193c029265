//! `rcni-node`: the node agent. It programs the kernel so that this node's
//! pods reach every other node's pods (VXLAN in flannel's layout, host-gw,
//! or both), masquerades pod traffic leaving the cluster network, and
//! writes the node's CNI config; without `--once` it keeps doing so as the
//! node list changes.

mod agent;
mod cluster;
mod conflist;
mod desired;
mod forward;
mod install;
mod k8s;
mod k8s_policy;
mod masq;
mod registry;
mod wg;
mod wgkey;
mod xnode;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};

use crate::cluster::ClusterError;
use crate::registry::{FileRegistry, Registry};

/// How long `--once --kubernetes` waits for the first list of Nodes.
const ONCE_SYNC_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Parser)]
#[command(
    name = "rcni-node",
    version,
    about = "rcni's node agent: pod networking across nodes"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Program this node from the cluster description and keep it so.
    // Boxed: the other commands' arguments are small.
    Run(Box<RunArgs>),
    /// Copy the plugin binaries into the host's CNI bin directory (the
    /// DaemonSet's init container).
    Install(install::InstallArgs),
    /// Remove what `install` wrote, and the agent's conflist.
    Uninstall(install::UninstallArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// The cluster file (JSON: network, backend, vni, port, nodes).
    #[arg(
        long,
        value_name = "FILE",
        required_unless_present = "kubernetes",
        conflicts_with = "kubernetes"
    )]
    cluster: Option<PathBuf>,
    /// Nodes from the Kubernetes API (Node objects) instead of a cluster
    /// file; needs --net-conf.
    #[arg(long, requires = "net_conf")]
    kubernetes: bool,
    /// With --kubernetes: the cluster file's JSON without "nodes" (network,
    /// backend, ebpf, encryption, vni, port), as flannel's net-conf.json.
    // (Not `requires = "kubernetes"`: a flag's implicit `false` satisfies
    // it; with one of --cluster and --kubernetes required, this is the same.)
    #[arg(long, value_name = "FILE", conflicts_with = "cluster")]
    net_conf: Option<PathBuf>,
    /// With --kubernetes: the kubeconfig to use; without it, the in-cluster
    /// config (the pod's service account), or KUBECONFIG.
    #[arg(long, value_name = "FILE", conflicts_with = "cluster")]
    kubeconfig: Option<PathBuf>,
    /// With --kubernetes: mirror NetworkPolicy and Namespace objects into
    /// DIR (the policy plugin's policyDir) and answer this node's pods'
    /// labels on --agent-socket.
    #[arg(long, value_name = "DIR", conflicts_with = "cluster")]
    policy_dir: Option<PathBuf>,
    /// With --policy-dir: the root-only socket the policy plugin asks for
    /// a pod's labels.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/run/rcni/agent.sock",
        requires = "policy_dir"
    )]
    agent_socket: PathBuf,
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
    cni_bin_dir: PathBuf,
    /// With --policy-dir: the policy plugin's dataDir (its default,
    /// /var/lib/cni/rcni-policy, when unset).
    #[arg(long, value_name = "DIR", requires = "policy_dir")]
    policy_data_dir: Option<PathBuf>,
    /// This node's name (in the cluster file, or its Node object's).
    #[arg(long, value_name = "NAME", env = "NODE_NAME")]
    node: String,
    /// Where the node's CNI config (10-rcni.conflist) is written.
    #[arg(long, value_name = "DIR", default_value = "/etc/cni/net.d")]
    cni_conf_dir: PathBuf,
    /// Reconcile once and exit.
    #[arg(long)]
    once: bool,
    /// The agent's own state (created if missing); it keeps the last
    /// applied summary there.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/rcni-node")]
    state_dir: PathBuf,
    /// With "ebpf": true, the bpffs directory of the fastpath plugin's pins
    /// (its pinRoot in the written config): the agent keeps the network's
    /// other-node map there and mounts a bpffs when there is none.
    #[arg(long, value_name = "DIR", default_value = xnode::DEFAULT_PIN_ROOT)]
    bpf_pin_root: PathBuf,
    /// host-local's dataDir in the written config (its default when unset).
    #[arg(long, value_name = "DIR")]
    ipam_data_dir: Option<PathBuf>,
    /// How often the cluster file is checked for changes.
    #[arg(long, value_name = "MS", default_value_t = 500)]
    poll_ms: u64,
    /// A full reconcile against the kernel at least this often, changed
    /// file or not: entries someone removed come back.
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    resync_s: u64,
}

/// Exit status for a cluster file or command line that is wrong.
const EXIT_CONFIG: u8 = 2;
/// Exit status for a feature asked for that is not implemented.
const EXIT_NOT_IMPLEMENTED: u8 = 3;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run(args) => run(*args),
        Cmd::Install(args) => install::install(args),
        Cmd::Uninstall(args) => install::uninstall(args),
    }
}

fn log(msg: impl std::fmt::Display) {
    eprintln!("rcni-node: {msg}");
}

/// An error with its causes: kube's and hyper's top-level messages ("client
/// error (Connect)") leave out what an operator needs (a refused
/// connection, an unknown certificate authority).
fn causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(c) = next {
        let m = c.to_string();
        // Some layers repeat their cause in their own message.
        if !out.contains(&m) {
            out.push_str(": ");
            out.push_str(&m);
        }
        next = c.source();
    }
    out
}

fn run(args: RunArgs) -> ExitCode {
    let rt = match rcni_netlink::runtime() {
        Ok(rt) => rt,
        Err(e) => {
            log(e);
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
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
        loop {
            let status = once(&mut *registry, &nl, &opts, &args.state_dir).await;
            // A Kubernetes node without its Node or podCIDR yet waits for
            // them; a cluster file that lacks the node is a mistake.
            if args.once || (first && status == Some(EXIT_CONFIG_NODE) && !args.kubernetes) {
                return match status {
                    None => ExitCode::SUCCESS,
                    Some(c) => ExitCode::from(c),
                };
            }
            first = false;
            // Wait for a change of the file, the periodic resync, or the
            // end. Exiting flushes nothing: what is programmed stays, and
            // the next start reconciles from it.
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(args.poll_ms)) => {}
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
            }
            last_full = Instant::now();
        }
    })
}

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
    let mut registry =
        k8s::KubeRegistry::start(client.clone(), net, args.node.clone(), wireguard_key);
    if let Some(dir) = &args.policy_dir {
        let sync = k8s_policy::SyncCommand {
            bin: args.cni_bin_dir.join("policy"),
            network: conflist::NETWORK_NAME.into(),
            data_dir: args.policy_data_dir.clone(),
        };
        let p = k8s_policy::start(
            client,
            dir.clone(),
            &args.node,
            &args.agent_socket,
            Some(sync),
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
    state_dir: &std::path::Path,
) -> Option<u8> {
    let cluster = match registry.load() {
        Ok(c) => c,
        Err(e @ ClusterError::Invalid(_)) => {
            log(format!("invalid cluster, nothing changed: {e}"));
            return Some(EXIT_CONFIG);
        }
        Err(e @ ClusterError::NotImplemented(_)) => {
            log(e);
            return Some(EXIT_NOT_IMPLEMENTED);
        }
        Err(e @ ClusterError::ThisNode(_)) => {
            log(format!(
                "this node cannot be programmed yet, nothing changed: {e}"
            ));
            return Some(EXIT_CONFIG_NODE);
        }
    };
    let t0 = Instant::now();
    match agent::reconcile(nl, &cluster, opts).await {
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
                t0.elapsed().as_secs_f64() * 1000.0,
                report.changes
            ));
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
                None
            } else {
                Some(EXIT_CONFIG)
            }
        }
        Err(e @ agent::AgentError::Config(_)) => {
            log(e);
            Some(EXIT_CONFIG_NODE)
        }
        Err(e @ agent::AgentError::Kernel(_)) => {
            log(e);
            Some(1)
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn causes_are_spelled_out_once() {
        #[derive(Debug)]
        struct E(&'static str, Option<Box<E>>);
        impl std::fmt::Display for E {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for E {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.1.as_deref().map(|e| e as _)
            }
        }
        let e = E(
            "client error (Connect)",
            Some(Box::new(E(
                "tls: invalid peer certificate: UnknownIssuer",
                Some(Box::new(E("invalid peer certificate: UnknownIssuer", None))),
            ))),
        );
        assert_eq!(
            causes(&e),
            "client error (Connect): tls: invalid peer certificate: UnknownIssuer"
        );
    }
    use super::*;

    fn parse(args: &[&str]) -> Result<RunArgs, String> {
        let mut v = vec!["rcni-node", "run"];
        v.extend_from_slice(args);
        match Cli::try_parse_from(v) {
            Ok(Cli { cmd: Cmd::Run(a) }) => Ok(*a),
            Ok(_) => Err("not `run`".into()),
            Err(e) => Err(e.to_string()),
        }
    }

    #[test]
    fn kubernetes_command_line() {
        let a = parse(&[
            "--kubernetes",
            "--net-conf",
            "/etc/rcni/net-conf.json",
            "--node",
            "n1",
            "--cni-conf-dir",
            "/d",
            "--once",
        ])
        .unwrap();
        assert!(a.kubernetes && a.once && a.cluster.is_none() && a.kubeconfig.is_none());
        assert_eq!(a.node, "n1");
        let a = parse(&[
            "--kubernetes",
            "--net-conf",
            "n.json",
            "--kubeconfig",
            "/k",
            "--node",
            "n1",
        ])
        .unwrap();
        assert_eq!(a.kubeconfig.unwrap(), PathBuf::from("/k"));
        // Either source, not both; --net-conf and --kubeconfig belong to
        // --kubernetes, which needs --net-conf.
        let both = parse(&[
            "--cluster",
            "c",
            "--kubernetes",
            "--net-conf",
            "n",
            "--node",
            "x",
        ]);
        assert!(both.is_err());
        assert!(parse(&["--kubernetes", "--node", "x"]).is_err());
        assert!(parse(&["--cluster", "c", "--net-conf", "n", "--node", "x"]).is_err());
        assert!(parse(&["--cluster", "c", "--kubeconfig", "k", "--node", "x"]).is_err());
        assert!(parse(&["--node", "x"]).is_err());
        assert!(parse(&["--cluster", "c", "--node", "x"]).is_ok());
    }

    #[test]
    fn policy_flags() {
        let k = ["--kubernetes", "--net-conf", "n", "--node", "x"];
        let a = parse(&[&k[..], &["--policy-dir", "/run/rcni/policy.d"]].concat()).unwrap();
        assert_eq!(a.cni_bin_dir, PathBuf::from("/opt/cni/bin"));
        assert_eq!(a.agent_socket, PathBuf::from("/run/rcni/agent.sock"));
        assert!(a.policy_data_dir.is_none());
        // Meaningless without the policy inputs.
        assert!(parse(&[&k[..], &["--cni-bin-dir", "/b"]].concat()).is_err());
        assert!(parse(&[&k[..], &["--policy-data-dir", "/d"]].concat()).is_err());
    }
}
