//! `rcni-node`: the node agent. It programs the kernel so that this node's
//! pods reach every other node's pods (VXLAN in flannel's layout, host-gw,
//! or both), masquerades pod traffic leaving the cluster network, and
//! writes the node's CNI config; without `--once` it keeps doing so as the
//! node list changes.

mod agent;
mod cluster;
mod conflist;
mod desired;
mod install;
mod masq;
mod registry;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};

use crate::cluster::ClusterError;
use crate::registry::{FileRegistry, Registry};

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
    Run(RunArgs),
    /// Copy the plugin binaries into the host's CNI bin directory (the
    /// DaemonSet's init container).
    Install(install::InstallArgs),
    /// Remove what `install` wrote, and the agent's conflist.
    Uninstall(install::UninstallArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// The cluster file (JSON: network, backend, vni, port, nodes).
    #[arg(long, value_name = "FILE")]
    cluster: PathBuf,
    /// This node's name in the cluster file.
    #[arg(long, value_name = "NAME")]
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
        Cmd::Run(args) => run(args),
        Cmd::Install(args) => install::install(args),
        Cmd::Uninstall(args) => install::uninstall(args),
    }
}

fn log(msg: impl std::fmt::Display) {
    eprintln!("rcni-node: {msg}");
}

fn run(args: RunArgs) -> ExitCode {
    let rt = match rcni_netlink::runtime() {
        Ok(rt) => rt,
        Err(e) => {
            log(e);
            return ExitCode::FAILURE;
        }
    };
    let mut registry = FileRegistry::new(&args.cluster);
    rt.block_on(async move {
        let opts = agent::Options {
            node: args.node.clone(),
            cni_conf_dir: args.cni_conf_dir.clone(),
            ipam_data_dir: args.ipam_data_dir.clone(),
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
            let status = once(&mut registry, &nl, &opts, &args.state_dir).await;
            if args.once || (first && status == Some(EXIT_CONFIG_NODE)) {
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
async fn once(
    registry: &mut impl Registry,
    nl: &rcni_netlink::Netlink,
    opts: &agent::Options,
    state_dir: &std::path::Path,
) -> Option<u8> {
    let cluster = match registry.load() {
        Ok(c) => c,
        Err(e @ ClusterError::Invalid(_)) => {
            log(format!("invalid cluster file, nothing changed: {e}"));
            return Some(EXIT_CONFIG);
        }
        Err(e @ ClusterError::NotImplemented(_)) => {
            log(e);
            return Some(EXIT_NOT_IMPLEMENTED);
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
