//! The node's policy flow events: rcni-node runs the policy plugin's
//! collector (`policy flows --follow`) for its network, writes each event
//! as one JSON line to its standard output (the DaemonSet's log, which the
//! cluster's log pipeline collects; the agent's own messages go to
//! standard error) and counts them in the metrics. The events' schema is
//! the policy plugin's (meta/policy/src/flows).
//!
//! A separate process because the collector is the plugin's code (the
//! agent does not link the plugin): a ring buffer or NFLOG group has one
//! reader, and the plugin's `flows.lock` makes that reader whoever holds
//! it. The collector dies with the agent (`PR_SET_PDEATHSIG`, as BIRD);
//! were one left behind anyway, the new agent's collector follows the log
//! and takes over when the lock comes free.

use crate::k8s_policy::SyncCommand;
use crate::metrics::Metrics;
use serde_json::Value;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// The longest wait between two starts of the collector.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Counts one event in the metrics.
pub fn count(network: &str, e: &Value) {
    let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or_default();
    let m = Metrics::get();
    m.policy_flow(network, s("policy"), s("verdict"), s("direction"));
    if let Some(n) = e
        .get("suppressed")
        .and_then(Value::as_u64)
        .filter(|n| *n > 0)
    {
        m.policy_flows_suppressed(network, n);
    }
}

/// Runs the collector for `cmd.network` for as long as the agent runs,
/// restarting it (with backoff) when it exits: before the network's first
/// pod there is no policy state to collect for.
pub async fn run(cmd: SyncCommand, node: String) {
    let mut backoff = Duration::from_secs(1);
    let mut last_err = String::new();
    loop {
        let mut std_cmd = std::process::Command::new(&cmd.bin);
        std_cmd.args([
            "flows",
            "--follow",
            "--network",
            &cmd.network,
            "--node",
            &node,
        ]);
        if let Some(d) = &cmd.data_dir {
            std_cmd.arg("--data-dir").arg(d);
        }
        crate::bgp::die_with_parent(&mut std_cmd);
        let mut c = tokio::process::Command::from(std_cmd);
        c.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let started = std::time::Instant::now();
        match c.spawn() {
            Ok(mut child) => {
                let out = child.stdout.take().expect("piped");
                let err = child.stderr.take().expect("piped");
                let errors = tokio::spawn(async move {
                    let mut lines = BufReader::new(err).lines();
                    let mut last = String::new();
                    while let Ok(Some(l)) = lines.next_line().await {
                        last = l;
                    }
                    last
                });
                let mut lines = BufReader::new(out).lines();
                let mut stdout = tokio::io::stdout();
                while let Ok(Some(l)) = lines.next_line().await {
                    if let Ok(v) = serde_json::from_str::<Value>(&l) {
                        count(&cmd.network, &v);
                    }
                    let _ = stdout.write_all(format!("{l}\n").as_bytes()).await;
                    let _ = stdout.flush().await;
                }
                let status = child.wait().await;
                let msg = errors.await.unwrap_or_default();
                let why = match status {
                    Ok(s) => format!("{s}: {msg}"),
                    Err(e) => e.to_string(),
                };
                // Said once per distinct reason: before the first pod it
                // fails the same way every time.
                if why != last_err {
                    crate::log(format!("policy flows exited ({why}); restarting"));
                    last_err = why;
                }
            }
            Err(e) => {
                let why = format!("{}: {e}", cmd.bin.display());
                if why != last_err {
                    crate::log(format!("policy flows: {why}"));
                    last_err = why;
                }
            }
        }
        if started.elapsed() > MAX_BACKOFF {
            backoff = Duration::from_secs(1);
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}
