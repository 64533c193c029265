//! The operator's tool, run in the node's namespaces:
//!
//! - `policy sync --network NET`: re-reads the policies (the config kept
//!   from the network's last ADD, or `--config FILE`, and its policyDir)
//!   and applies them to every pod of the network on this node, without
//!   re-adding any; prints what changed. With `agentSocket`, every pod's
//!   labels and named ports are asked of the agent again first (a pod it
//!   cannot answer for keeps what it had): rcni-node runs this after a
//!   NetworkPolicy, Namespace or Pod changes.
//! - `policy show --network NET`: pods with their identity and rule sets,
//!   and the rule sets.

use crate::conf::Conf;
use crate::state::{DEFAULT_DATA_DIR, Locked};
use clap::{Parser, Subcommand};
use rcni_cni::CniError;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(
    name = "policy",
    about = "rcni network policy: operator commands (run without arguments, with CNI_COMMAND set, it is the CNI plugin)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Re-apply the policies in force to every pod of a network.
    Sync {
        #[arg(long)]
        network: String,
        /// The state directory (the config's dataDir).
        #[arg(long, default_value = DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        /// A .conflist or .conf whose policy plugin config replaces the
        /// one kept from the network's last ADD.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Policy flow events as JSON lines (schema version 1, in
    /// docs/components/policy.md): the connections the network's policies
    /// denied, audited or (with "flowEvents": "all") allowed.
    Flows {
        /// The CNI network (the conflist's name).
        #[arg(long)]
        network: String,
        #[arg(long, default_value = DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        /// Keep printing events as they happen (else: what the log holds,
        /// then what is waiting in the kernel, and exit).
        #[arg(long)]
        follow: bool,
        /// deny, allow, audit or all.
        #[arg(long, default_value = "all")]
        verdict: String,
        /// The node name in the events (default: $NODE_NAME, else the
        /// host name).
        #[arg(long)]
        node: Option<String>,
    },
    /// Show the network's pods, identities and rule sets.
    Show {
        #[arg(long)]
        network: String,
        #[arg(long, default_value = DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        #[arg(long)]
        json: bool,
    },
}

/// Runs a subcommand; returns the exit status.
pub fn run(args: &[String]) -> i32 {
    let argv = std::iter::once("policy".to_string()).chain(args.iter().cloned());
    let cli = match Cli::try_parse_from(argv) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    let r = match cli.cmd {
        Cmd::Sync {
            network,
            data_dir,
            config,
        } => sync(&network, &data_dir, config.as_deref()),
        Cmd::Show {
            network,
            data_dir,
            json,
        } => show(&network, &data_dir, json),
        Cmd::Flows {
            network,
            data_dir,
            follow,
            verdict,
            node,
        } => flows(&network, &data_dir, follow, &verdict, node),
    };
    match r {
        Ok(out) => {
            print!("{out}");
            0
        }
        Err(e) => {
            eprintln!("policy: {}", e.msg.trim_start_matches("policy: "));
            1
        }
    }
}

/// The policy plugin's config in a .conflist (with the list's name and
/// version) or a .conf.
fn conf_from_file(path: &Path, network: &str) -> Result<Value, CniError> {
    let bytes =
        std::fs::read(path).map_err(|e| CniError::config(format!("{}: {e}", path.display())))?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| CniError::config(format!("{}: {e}", path.display())))?;
    let name = v.get("name").and_then(Value::as_str).unwrap_or(network);
    if name != network {
        return Err(CniError::config(format!(
            "{} is network {name}, not {network}",
            path.display()
        )));
    }
    let mut conf = match v.get("plugins").and_then(Value::as_array) {
        Some(plugins) => plugins
            .iter()
            .find(|p| p.get("type").and_then(Value::as_str) == Some("policy"))
            .cloned()
            .ok_or_else(|| {
                CniError::config(format!("{} has no plugin of type policy", path.display()))
            })?,
        None => v.clone(),
    };
    if let Some(m) = conf.as_object_mut() {
        m.insert("name".into(), json!(network));
        if let Some(ver) = v.get("cniVersion") {
            m.entry("cniVersion").or_insert(ver.clone());
        }
    }
    Ok(conf)
}

fn sync(network: &str, data_dir: &Path, config: Option<&Path>) -> Result<String, CniError> {
    let t = Instant::now();
    let Some(mut locked) = Locked::existing(data_dir, network)? else {
        return Ok(format!(
            "network {network}: no pods on this node, nothing to sync\n"
        ));
    };
    let conf_v = match config {
        Some(p) => conf_from_file(p, network)?,
        None => locked.state.conf.clone().ok_or_else(|| {
            CniError::config(format!("network {network}: no config kept; pass --config"))
        })?,
    };
    let conf = Conf::from_value(&conf_v, network)?;
    // Invalid policies change nothing.
    let set = conf.policies()?;
    let mut relabeled = 0;
    if let Some(socket) = &conf.agent_socket {
        for p in locked.state.pods.values_mut() {
            let Some(name) = &p.name else { continue };
            match crate::agent::ask(socket, &p.namespace, name, std::time::Duration::ZERO) {
                Ok(info) => {
                    if p.labels != info.labels || p.ports != info.ports {
                        relabeled += 1;
                    }
                    p.labels = info.labels;
                    p.ports = info.ports;
                }
                Err(e) => eprintln!(
                    "policy: {}/{name}: labels kept: {}",
                    p.namespace,
                    e.msg.trim_start_matches("policy: ")
                ),
            }
        }
    }
    let mut backend = crate::backend::recorded(&conf, network, Some(&locked.state));
    let before = locked.state.desired.clone();
    crate::reconcile(Some(&set), &mut locked.state, backend.as_mut(), None)?;
    locked.state.conf = Some(crate::conf::stored(&conf_v));
    let after = locked.state.desired.clone().unwrap_or_default();
    locked.save()?;
    let changed = after
        .pods
        .iter()
        .filter(|(k, p)| before.as_ref().and_then(|b| b.pods.get(*k)) != Some(*p))
        .count();
    let rs_changed = after
        .rulesets
        .iter()
        .filter(|(k, r)| before.as_ref().and_then(|b| b.rulesets.get(*k)) != Some(*r))
        .count();
    Ok(format!(
        "network {network}: {} policies, {} pods ({relabeled} relabeled, {changed} with new identity or rule sets), \
         {} rule sets ({rs_changed} changed), backend {}, in {:.1} ms\n",
        set.policies.len(),
        after.pods.len(),
        after.rulesets.len(),
        backend.kind().as_str(),
        t.elapsed().as_secs_f64() * 1e3
    ))
}

fn show(network: &str, data_dir: &Path, as_json: bool) -> Result<String, CniError> {
    let Some(locked) = Locked::existing(data_dir, network)? else {
        return Ok(if as_json {
            "{\"pods\":{},\"rulesets\":{},\"identities\":{}}\n".into()
        } else {
            format!("network {network}: no pods on this node\n")
        });
    };
    let st = &locked.state;
    let d = st.desired.clone().unwrap_or_default();
    if as_json {
        let pods: serde_json::Map<String, Value> = st
            .pods
            .iter()
            .map(|(k, p)| {
                let pol = d.pods.get(k).copied().unwrap_or_default();
                (
                    k.clone(),
                    json!({"namespace": p.namespace, "labels": p.labels, "addrs": p.addrs,
                           "hostIfname": p.host_ifname, "identity": pol.identity,
                           "ingress": pol.ingress, "egress": pol.egress}),
                )
            })
            .collect();
        let v = json!({"backend": st.backend, "pods": pods, "identities": d.identities,
                       "rulesets": d.rulesets});
        return Ok(format!(
            "{}\n",
            serde_json::to_string_pretty(&v).expect("json")
        ));
    }
    let mut out = format!(
        "network {network}: backend {}, {} pods\n",
        st.backend.as_deref().unwrap_or("?"),
        st.pods.len()
    );
    for (k, p) in &st.pods {
        let pol = d.pods.get(k).copied().unwrap_or_default();
        let addrs: Vec<String> = p.addrs.iter().map(|a| a.to_string()).collect();
        out += &format!(
            "  {k} {} [{}] on {}: identity {} ingress {} egress {}\n",
            p.namespace,
            addrs.join(" "),
            p.host_ifname,
            pol.identity,
            pol.ingress,
            pol.egress
        );
    }
    for (id, rs) in &d.rulesets {
        out += &format!(
            "  rule set {id} ({}; {}): {} identity peers, {} remote pod addresses, {} prefixes\n",
            rs.dir.as_str(),
            rs.policies.join(", "),
            rs.peers.len(),
            rs.remote.len(),
            rs.cidrs.len()
        );
    }
    Ok(out)
}

/// `policy flows`: prints events as JSON lines, straight to stdout (a
/// follower's output is live, not buffered to the end).
fn flows(
    network: &str,
    data_dir: &Path,
    follow: bool,
    verdict: &str,
    node: Option<String>,
) -> Result<String, CniError> {
    use crate::flows::{self, CollectorLock, Filter};
    use std::io::Write;
    let filter = Filter::parse(verdict).ok_or_else(|| {
        CniError::unsupported(
            "--verdict",
            format!("{verdict:?} (deny, allow, audit or all)"),
        )
    })?;
    let node = node.unwrap_or_else(flows::node_name);
    let stdout = std::io::stdout();
    // A closed stdout (the reader went away) ends the run.
    let print = |line: &str| -> bool {
        let mut o = stdout.lock();
        writeln!(o, "{line}").and_then(|_| o.flush()).is_ok()
    };
    let wanted = |line: &str| {
        serde_json::from_str::<flows::Event>(line).is_ok_and(|e| filter.wants(e.verdict))
    };
    let (lines, pos) = flows::history(data_dir, network);
    if !follow {
        for l in lines.iter().filter(|l| wanted(l)) {
            if !print(l) {
                return Ok(String::new());
            }
        }
    }
    let tick = Duration::from_millis(100);
    let mut pos = pos;
    loop {
        match CollectorLock::try_acquire(data_dir, network)? {
            Some(lock) => {
                // No collector runs: this run is the network's collector.
                let mut source = flows::source(data_dir, network)?;
                let mut idle = 0;
                let r = flows::collect(&lock, network, &node, source.as_mut(), tick, |e| match e {
                    Some(e) => {
                        !filter.wants(e.verdict)
                            || print(&serde_json::to_string(e).expect("serializable"))
                    }
                    // Without --follow: stop once the kernel has nothing
                    // waiting.
                    None => {
                        idle += 1;
                        follow || idle < 2
                    }
                });
                match r {
                    // The datapath was loaded again: collect from the new.
                    Err(e) if follow && e.code == rcni_cni::ErrorCode::TryAgainLater as u32 => {
                        drop(source);
                        continue;
                    }
                    r => r?,
                }
                return Ok(String::new());
            }
            None if !follow => return Ok(String::new()),
            None => {
                // Another process collects: read what it writes, and take
                // over when it goes (checked every second).
                let mut ticks = 0;
                let mut closed = false;
                let mut free = false;
                flows::follow(data_dir, network, pos, tick, |l| match l {
                    Some(l) => {
                        closed = wanted(l) && !print(l);
                        !closed
                    }
                    None => {
                        ticks += 1;
                        if ticks % 10 == 0 {
                            free = CollectorLock::is_free(data_dir, network);
                        }
                        !free
                    }
                })?;
                if closed {
                    return Ok(String::new());
                }
                pos = flows::history(data_dir, network).1;
            }
        }
    }
}
