//! rcni-k8s-lab: the Kubernetes lab (integration/src/lab/k8s.rs) for a
//! command that needs a whole cluster, such as upstream's e2e suites
//! (scripts/k8s-e2e): makes the lab, installs the network, runs the command
//! in the control namespace with KUBECONFIG set, tears the lab down and
//! exits with the command's status.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rcni_integration::lab::k8s::{Cache, K8sLab};

const USAGE: &str = "usage: rcni-k8s-lab [--nodes N] [--network rcni|reference|flannel]
                    [--image FILE] [--net-conf FILE] [--reference-bin DIR]
                    [--flannel DIR] [--agent-arg ARG]... [--no-kube-proxy]
                    [--keep-logs DIR] -- COMMAND [ARG...]

  --nodes N           nodes (default 3)
  --network rcni      rcni from deploy/rcni.yaml with the image FILE (default)
  --network reference the reference plugins in DIR (--reference-bin: bridge,
                      host-local, loopback, portmap), a bridge + host-local
                      conflist per node with its pod range, no policy
  --network flannel   flannel from DIR (--flannel: scripts/flannel-build's
                      directory) with the reference plugins of
                      --reference-bin it delegates to
  --net-conf FILE     rcni's net-conf.json in place of the manifest's
  --agent-arg ARG     added to rcni-node's command line (repeatable), e.g.
                      --policy-backend=nftables
  --no-kube-proxy     kube-proxy stopped and cleaned up on every node before
                      the network is installed (for kubeProxyReplacement)
  --keep-logs DIR     copy every component's log there at the end

COMMAND runs in the control plane's network namespace, on the lab's
underlay, with KUBECONFIG (the admin's), RCNI_LAB_DIR and RCNI_LAB_NODES
(`name=pid` per node, space-separated: the host's PID of the node's init,
for `nsenter --target pid --mount --pid --net`) in its environment.";

struct Args {
    nodes: usize,
    network: String,
    image: Option<PathBuf>,
    net_conf: Option<PathBuf>,
    reference_bin: Option<PathBuf>,
    flannel: Option<PathBuf>,
    keep_logs: Option<PathBuf>,
    agent_args: Vec<String>,
    no_kube_proxy: bool,
    command: Vec<String>,
}

/// The path made absolute: the lab runs its nodes' tools (ctr, the
/// installer) from other working directories, where a relative one would
/// name nothing.
fn existing(arg: &str, path: String) -> Result<PathBuf, String> {
    std::fs::canonicalize(&path).map_err(|e| format!("{arg} {path}: {e}"))
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        nodes: 3,
        network: "rcni".into(),
        image: None,
        net_conf: None,
        reference_bin: None,
        flannel: None,
        keep_logs: None,
        agent_args: Vec::new(),
        no_kube_proxy: false,
        command: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--nodes" => a.nodes = value()?.parse().map_err(|e| format!("--nodes: {e}"))?,
            "--network" => a.network = value()?,
            "--image" => a.image = Some(existing(&arg, value()?)?),
            "--net-conf" => a.net_conf = Some(existing(&arg, value()?)?),
            "--reference-bin" => a.reference_bin = Some(existing(&arg, value()?)?),
            "--flannel" => a.flannel = Some(existing(&arg, value()?)?),
            "--keep-logs" => a.keep_logs = Some(value()?.into()),
            "--agent-arg" => a.agent_args.push(value()?),
            "--no-kube-proxy" => a.no_kube_proxy = true,
            "-h" | "--help" => return Err(String::new()),
            "--" => {
                a.command = it.collect();
                break;
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.command.is_empty() {
        return Err("no command".into());
    }
    match a.network.as_str() {
        "rcni" if a.image.is_none() => Err("--network rcni needs --image".into()),
        "reference" if a.reference_bin.is_none() => {
            Err("--network reference needs --reference-bin".into())
        }
        "flannel" if a.flannel.is_none() || a.reference_bin.is_none() => {
            Err("--network flannel needs --flannel and --reference-bin".into())
        }
        "rcni" | "reference" | "flannel" => Ok(a),
        n => Err(format!("unknown network {n}")),
    }
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("rcni-k8s-lab: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let cache = match Cache::find() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rcni-k8s-lab: {e}");
            return ExitCode::from(2);
        }
    };
    let t0 = Instant::now();
    eprintln!(
        "rcni-k8s-lab: starting the control plane and {} nodes",
        args.nodes
    );
    let mut lab = K8sLab::start(cache, args.nodes);
    if args.no_kube_proxy {
        lab.remove_kube_proxy();
    }
    eprintln!(
        "rcni-k8s-lab: cluster up in {:.0?}; installing {}",
        t0.elapsed(),
        args.network
    );
    match args.network.as_str() {
        "rcni" => {
            let conf = args
                .net_conf
                .as_ref()
                .map(|p| std::fs::read_to_string(p).expect("read --net-conf"));
            lab.install_rcni(
                args.image.as_ref().unwrap(),
                conf.as_deref(),
                &args.agent_args,
            );
        }
        "flannel" => lab.install_flannel(
            args.flannel.as_ref().unwrap(),
            args.reference_bin.as_ref().unwrap(),
        ),
        _ => lab.install_reference(args.reference_bin.as_ref().unwrap()),
    }
    lab.wait_nodes_ready(Duration::from_secs(180));
    lab.wait_dns();
    eprintln!(
        "rcni-k8s-lab: network ready after {:.0?}; running {:?}",
        t0.elapsed(),
        args.command
    );
    // Tied: killed with this process, however it ends.
    let status = lab
        .ctl_command("setpriv")
        .args(["--pdeathsig", "KILL", "--"])
        .args(&args.command)
        .env("KUBECONFIG", lab.admin_kubeconfig())
        .env("RCNI_LAB_DIR", lab.dir.path())
        .env(
            "RCNI_LAB_NODES",
            lab.nodes
                .iter()
                .map(|n| format!("{}={}", n.name, n.pid1))
                .collect::<Vec<_>>()
                .join(" "),
        )
        .status();
    if let Some(dir) = &args.keep_logs {
        lab.copy_logs(dir);
    }
    drop(lab);
    match status {
        Ok(s) => ExitCode::from(s.code().unwrap_or(1).clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("rcni-k8s-lab: cannot run {}: {e}", args.command[0]);
            ExitCode::from(127)
        }
    }
}
