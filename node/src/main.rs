//! `rcni-node`: the node agent. It programs the kernel so that this node's
//! pods reach every other node's pods (VXLAN in flannel's layout, host-gw,
//! or both), masquerades pod traffic leaving the cluster network, and
//! writes the node's CNI config; without `--once` it keeps doing so as the
//! node list changes.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use rcni_node::run::{RunArgs, run};
use rcni_node::{install, status};

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
    /// The node at a glance, from the running agent's status file:
    /// backend, datapath, peers, pods, pool use, last reconcile.
    Status(status::StatusArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run(args) => run(*args),
        Cmd::Install(args) => install::install(args),
        Cmd::Uninstall(args) => install::uninstall(args),
        Cmd::Status(args) => status::status(args),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

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
    fn cloud_command_line() {
        let a = parse(&["--cloud", "aws", "--node", "n1"]).unwrap();
        assert_eq!(a.cloud, Some(rcni_node::cloud::ProviderKind::Aws));
        assert_eq!(a.cloud_socket, PathBuf::from("/run/rcni/cloud.sock"));
        assert!(a.cluster.is_none() && !a.kubernetes);
        let a = parse(&["--net-conf", "n.json", "--node", "n1"]).unwrap();
        assert!(a.cloud.is_none() && a.net_conf.is_some());
        assert!(parse(&["--cloud", "gcp", "--node", "n1"]).is_err());
        assert!(parse(&["--cloud", "aws", "--cluster", "c.json", "--node", "n1"]).is_err());
        assert!(parse(&["--node", "n1"]).is_err());
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
    fn metrics_and_status_flags() {
        let a = parse(&["--cluster", "c", "--node", "x"]).unwrap();
        assert!(a.metrics_addr.is_none());
        assert_eq!(a.cni_stats_dir, PathBuf::from("/run/rcni/cni-stats"));
        assert_eq!(a.status_file, PathBuf::from("/run/rcni/node-status.json"));
        let a = parse(&[
            "--cluster",
            "c",
            "--node",
            "x",
            "--metrics-addr",
            "0.0.0.0:9680",
            "--cni-stats-dir",
            "/s",
            "--status-file",
            "/t.json",
        ])
        .unwrap();
        assert_eq!(a.metrics_addr.as_deref(), Some("0.0.0.0:9680"));
        assert_eq!(a.cni_stats_dir, PathBuf::from("/s"));
        assert_eq!(a.status_file, PathBuf::from("/t.json"));
        match Cli::try_parse_from(["rcni-node", "status", "--json", "--status-file", "/t"]) {
            Ok(Cli {
                cmd: Cmd::Status(s),
            }) => {
                assert!(s.json && s.status_file == std::path::Path::new("/t"));
            }
            _ => panic!("status"),
        }
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
