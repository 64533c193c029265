//! `rcni-node status`: one screen for a person on the node. The running
//! agent writes a status file (`--status-file`, JSON, replaced atomically)
//! after each reconcile; `status` only reads it, and says so plainly when
//! there is none or it is old (no agent running).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::metrics::{Metrics, ipam};
use crate::registry::cluster::{Cluster, Encryption};
use crate::sync::desired::WG_NAME;
use crate::wg;

/// Where the agent writes it and `status` reads it, by default.
pub const DEFAULT_FILE: &str = "/run/rcni/node-status.json";

#[derive(clap::Args)]
pub struct StatusArgs {
    /// The file the agent writes (its --status-file).
    #[arg(long, value_name = "PATH", default_value = DEFAULT_FILE)]
    pub status_file: PathBuf,
    /// The file as it is (JSON) instead of the screen.
    #[arg(long)]
    pub json: bool,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// What the agent's loop knows when it writes the file.
pub struct AgentView<'a> {
    pub node: &'a str,
    /// The node source: "cluster file ..." or "Kubernetes API".
    pub source: String,
    pub cluster: Option<&'a Cluster>,
    /// Peers not programmed, with why (the reconcile's report).
    pub refused: &'a [String],
    pub cni_conf_dir: &'a Path,
    pub pin_root: &'a Path,
    pub resync_s: u64,
}

/// The status document of the agent's main loop (the cluster modes).
pub fn agent_status(v: &AgentView<'_>) -> Value {
    let (last, last_ok) = Metrics::get().last_reconcile("agent");
    let mut doc = base(v.node, v.resync_s, last, last_ok);
    doc["source"] = json!(v.source);
    let wg_stats = wireguard_stats();
    if let Some(c) = v.cluster {
        doc["backend"] = json!(c.backend.as_str());
        doc["encryption"] = json!(match c.encryption {
            Encryption::None => "none",
            Encryption::WireGuard => "wireguard",
        });
        doc["network"] = json!(c.network.map(|n| n.to_string()));
        doc["network6"] = json!(c.network6.map(|n| n.to_string()));
        doc["datapath"] = datapath(c.ebpf, v.pin_root);
        let peers: Vec<Value> = c
            .nodes
            .iter()
            .filter(|n| n.name != v.node)
            .map(|n| {
                let quoted = format!("{:?}", n.name);
                let refused: Vec<&String> =
                    v.refused.iter().filter(|r| r.contains(&quoted)).collect();
                let mut p = json!({
                    "name": n.name,
                    "address": n.address.map(|a| a.to_string()).or(n.address6.map(|a| a.to_string())),
                    "podCIDRs": n.pod_cidr.map(|p| p.to_string()).into_iter()
                        .chain(n.pod_cidr6.map(|p| p.to_string())).collect::<Vec<_>>(),
                    "state": if refused.is_empty() { "programmed" } else { "refused" },
                });
                if let Some(r) = refused.first() {
                    p["reason"] = json!(r);
                }
                if let Some(s) = n.wireguard_key.and_then(|k| wg_stats.get(&k)) {
                    p["wireguard"] = json!({
                        "lastHandshakeSecondsAgo": s.last_handshake.map(|h| (now() - h as f64).max(0.0).floor()),
                        "rxBytes": s.rx_bytes,
                        "txBytes": s.tx_bytes,
                    });
                    if c.encryption == Encryption::WireGuard && refused.is_empty() {
                        p["state"] = json!(if s.last_handshake.is_some() {
                            "handshake done"
                        } else {
                            "no handshake yet"
                        });
                    }
                }
                p
            })
            .collect();
        doc["peers"] = json!(peers);
    }
    if let Some(sessions) = Metrics::get().bgp_sessions() {
        doc["bgpSessions"] = json!(
            sessions
                .iter()
                .map(|(peer, state)| json!({"peer": peer, "state": state}))
                .collect::<Vec<_>>()
        );
    }
    let (pool, pods) = ipam::usage(v.cni_conf_dir);
    doc["pool"] = json!(pool);
    doc["pods"] = json!(pods);
    doc
}

/// The status document of cloud mode's loop.
pub fn cloud_status(node: &str, provider: &str, cni_conf_dir: &Path, resync_s: u64) -> Value {
    let (last, last_ok) = Metrics::get().last_reconcile("cloud");
    let mut doc = base(node, resync_s, last, last_ok);
    doc["source"] = json!(format!("cloud {provider}"));
    doc["backend"] = json!(format!("cloud ({provider})"));
    let cloud = Metrics::get().cloud_pool();
    doc["cloudPool"] = json!(cloud);
    // host-local's, should another network on the node use it.
    let (pool, mut pods) = ipam::usage(cni_conf_dir);
    pods.extend(cloud.map(|c| c.pods).unwrap_or_default());
    doc["pool"] = json!(pool);
    doc["pods"] = json!(pods);
    doc
}

fn base(
    node: &str,
    resync_s: u64,
    last: Option<crate::metrics::LastReconcile>,
    last_ok: Option<f64>,
) -> Value {
    json!({
        "node": node,
        "agentVersion": env!("CARGO_PKG_VERSION"),
        "pid": std::process::id(),
        "updated": now(),
        "resyncSeconds": resync_s,
        "lastReconcile": last,
        "lastSuccess": last_ok,
    })
}

fn wireguard_stats() -> BTreeMap<wg::Key, wg::PeerStats> {
    let Ok(index) = nix::net::if_::if_nametoindex(WG_NAME) else {
        return BTreeMap::new();
    };
    wg::WgSocket::open()
        .and_then(|mut s| s.peer_stats(index))
        .map(|v| v.into_iter().map(|p| (p.key, p)).collect())
        .unwrap_or_default()
}

/// The eBPF datapath's networks pinned under `pin_root`.
fn datapath(on: bool, pin_root: &Path) -> Value {
    let mut nets = Vec::new();
    if let Ok(rd) = std::fs::read_dir(pin_root) {
        let mut dirs: Vec<_> = rd
            .flatten()
            .filter(|e| e.path().join("prog").exists())
            .collect();
        dirs.sort_by_key(|e| e.file_name());
        for e in dirs {
            let dir = e.path();
            let Ok(Some(dp)) = rcni_ebpf::Datapath::open(&dir) else {
                continue;
            };
            let endpoints = dp.endpoints().map_or(0, |v| {
                v.iter()
                    .filter(|(_, ep)| ep.flags & rcni_ebpf::EP_FASTPATH != 0)
                    .count()
            });
            nets.push(json!({
                "network": e.file_name().to_string_lossy(),
                "pinDir": dir.display().to_string(),
                "endpoints": endpoints,
                "pinnedLinks": rcni_ebpf::pinned_link_count(&dir).unwrap_or(0),
            }));
        }
    }
    json!({
        "mode": if on { "ebpf" } else { "kernel" },
        "pinRoot": pin_root.display().to_string(),
        "networks": nets,
    })
}

/// Replaces `path` with `doc` when its directory exists: the agent never
/// makes /run/rcni for it (a test's or a plain host's agent leaves no
/// trace there).
pub fn write(path: &Path, doc: &Value) {
    if path.parent().is_some_and(|d| !d.is_dir()) {
        return;
    }
    if let Err(e) = rcni_statefile::write_replace(path, format!("{doc:#}\n").as_bytes(), 0o644) {
        crate::log(format!("status file {}: {e}", path.display()));
    }
}

/// `rcni-node status`.
pub fn status(args: StatusArgs) -> ExitCode {
    let text = match std::fs::read_to_string(&args.status_file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!(
                "rcni-node status: no status file at {}: the agent is not running on this node (or runs with another --status-file)",
                args.status_file.display()
            );
            return ExitCode::from(1);
        }
        Err(e) => {
            eprintln!("rcni-node status: {}: {e}", args.status_file.display());
            return ExitCode::from(1);
        }
    };
    let doc: Value = match serde_json::from_str(&text) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("rcni-node status: {}: {e}", args.status_file.display());
            return ExitCode::from(1);
        }
    };
    if args.json {
        let mut doc = doc;
        doc["stale"] = json!(stale(&doc, now()).is_some());
        println!("{doc:#}");
    } else {
        print!("{}", screen(&doc, now()));
    }
    ExitCode::SUCCESS
}

/// Seconds since the file was written, when that is longer than the
/// agent ever waits between two passes.
pub fn stale(doc: &Value, now: f64) -> Option<f64> {
    let updated = doc["updated"].as_f64()?;
    let resync = doc["resyncSeconds"].as_f64().unwrap_or(30.0);
    let age = now - updated;
    (age > 2.0 * resync + 30.0).then_some(age)
}

fn ago(t: f64, now: f64) -> String {
    let s = (now - t).max(0.0);
    if s < 120.0 {
        format!("{s:.0}s ago")
    } else if s < 7200.0 {
        format!("{:.0}m ago", s / 60.0)
    } else {
        format!("{:.1}h ago", s / 3600.0)
    }
}

/// Seconds since the epoch as UTC, `2026-11-27T07:10:33Z`.
pub fn utc(t: f64) -> String {
    let ts = jiff::Timestamp::from_second(t.max(0.0) as i64).unwrap_or_default();
    format!("{ts:.0}")
}

fn str_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        v => v.to_string(),
    }
}

/// The screen: node and mode, last reconcile, datapath, peers, pool, pods.
pub fn screen(doc: &Value, now: f64) -> String {
    let mut o = String::new();
    let mut line = |s: String| {
        o.push_str(&s);
        o.push('\n');
    };
    line(format!(
        "node {}   rcni-node {} (pid {})   {}",
        str_of(&doc["node"]),
        str_of(&doc["agentVersion"]),
        str_of(&doc["pid"]),
        str_of(&doc["source"])
    ));
    if let Some(age) = stale(doc, now) {
        line(format!(
            "WARNING: status last written {age:.0}s ago: the agent is probably not running"
        ));
    }
    let mut mode = format!("backend {}", str_of(&doc["backend"]));
    if let Some(e) = doc["encryption"].as_str() {
        mode.push_str(&format!("   encryption {e}"));
    }
    for k in ["network", "network6"] {
        if let Some(n) = doc[k].as_str() {
            mode.push_str(&format!("   {k} {n}"));
        }
    }
    line(mode);
    let last = &doc["lastReconcile"];
    if last.is_object() {
        let t = last["time"].as_f64().unwrap_or(0.0);
        let mut s = format!(
            "last reconcile {} ({}): {} in {:.1} ms, {} kernel changes",
            ago(t, now),
            utc(t),
            if last["ok"] == true { "ok" } else { "FAILED" },
            last["durationSeconds"].as_f64().unwrap_or(0.0) * 1000.0,
            str_of(&last["changes"])
        );
        if let Some(e) = last["error"].as_str() {
            s.push_str(&format!(": {e}"));
        }
        line(s);
        if last["ok"] != true {
            line(match doc["lastSuccess"].as_f64() {
                Some(t) => format!("last success {}", ago(t, now)),
                None => "no successful reconcile yet".into(),
            });
        }
    } else {
        line("no reconcile yet".into());
    }
    let dp = &doc["datapath"];
    if dp.is_object() {
        let nets: Vec<String> = dp["networks"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|n| {
                format!(
                    "{} ({} fast-path endpoints, {} pinned links)",
                    str_of(&n["network"]),
                    str_of(&n["endpoints"]),
                    str_of(&n["pinnedLinks"])
                )
            })
            .collect();
        line(format!(
            "datapath {}   pins {}{}",
            str_of(&dp["mode"]),
            str_of(&dp["pinRoot"]),
            if nets.is_empty() {
                String::new()
            } else {
                format!(": {}", nets.join(", "))
            }
        ));
    }
    if let Some(peers) = doc["peers"].as_array() {
        line(format!("peers ({})", peers.len()));
        for p in peers {
            let mut s = format!(
                "  {:<16} {:<16} {:<34} {}",
                str_of(&p["name"]),
                str_of(&p["address"]),
                p["podCIDRs"]
                    .as_array()
                    .map(|a| a.iter().map(str_of).collect::<Vec<_>>().join(","))
                    .unwrap_or_default(),
                str_of(&p["state"])
            );
            if let Some(w) = p["wireguard"].as_object() {
                s.push_str(&format!(
                    "   wg rx {} tx {}",
                    str_of(&w["rxBytes"]),
                    str_of(&w["txBytes"])
                ));
                if let Some(h) = w["lastHandshakeSecondsAgo"].as_f64() {
                    s.push_str(&format!(" handshake {h:.0}s ago"));
                }
            }
            if let Some(r) = p["reason"].as_str() {
                s.push_str(&format!("\n      {r}"));
            }
            line(s);
        }
    }
    if let Some(sessions) = doc["bgpSessions"].as_array() {
        line(format!("BGP sessions ({})", sessions.len()));
        for x in sessions {
            line(format!(
                "  {:<40} {}",
                str_of(&x["peer"]),
                str_of(&x["state"])
            ));
        }
    }
    if let Some(c) = doc["cloudPool"].as_object() {
        line(format!(
            "cloud pool: {} used, {} free, {} cooling, {} total, max pods {}, {} API calls",
            str_of(&c["used"]),
            str_of(&c["free"]),
            str_of(&c["cooling"]),
            str_of(&c["total"]),
            str_of(&c["maxPods"]),
            str_of(&c["apiCalls"])
        ));
    }
    for r in doc["pool"].as_array().into_iter().flatten() {
        line(format!(
            "pool {} {}: {} used, {} free",
            str_of(&r["network"]),
            str_of(&r["range"]),
            str_of(&r["used"]),
            r["free"].as_f64().map_or("-".into(), |f| format!("{f:.0}"))
        ));
    }
    let pods = doc["pods"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    line(format!("pods ({})", pods.len()));
    for p in pods {
        line(format!(
            "  {:<28} {:<8} {}",
            str_of(&p["ip"]),
            str_of(&p["ifname"]),
            str_of(&p["containerId"])
        ));
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_screen_says_what_a_person_needs() {
        let doc = json!({
            "node": "n1", "agentVersion": "0.1.0", "pid": 7, "source": "cluster file /c.json",
            "updated": 1000.0, "resyncSeconds": 30,
            "backend": "vxlan", "encryption": "none", "network": "10.244.0.0/16",
            "lastReconcile": {"time": 995.0, "ok": true, "durationSeconds": 0.012, "changes": 3},
            "lastSuccess": 995.0,
            "datapath": {"mode": "ebpf", "pinRoot": "/sys/fs/bpf/rcni",
                         "networks": [{"network": "rcni", "endpoints": 2, "pinnedLinks": 3}]},
            "peers": [{"name": "n2", "address": "192.168.50.2", "podCIDRs": ["10.244.2.0/24"],
                       "state": "programmed"},
                      {"name": "n3", "address": null, "podCIDRs": [], "state": "refused",
                       "reason": "node \"n3\": no address"}],
            "pool": [{"network": "rcni", "range": "10.244.1.0/24", "used": 2, "free": 251.0}],
            "pods": [{"network": "rcni", "ip": "10.244.1.2", "containerId": "c1", "ifname": "eth0"}],
            "bgpSessions": [{"peer": "node n2 (192.168.50.2)", "state": "Established"}],
        });
        let s = screen(&doc, 1001.0);
        for want in [
            "node n1",
            "backend vxlan   encryption none   network 10.244.0.0/16",
            "last reconcile 6s ago (1970-01-01T00:16:35Z): ok in 12.0 ms, 3 kernel changes",
            "datapath ebpf",
            "rcni (2 fast-path endpoints, 3 pinned links)",
            "peers (2)",
            "programmed",
            "node \"n3\": no address",
            "pool rcni 10.244.1.0/24: 2 used, 251 free",
            "pods (1)",
            "10.244.1.2",
            "BGP sessions (1)",
            "Established",
        ] {
            assert!(s.contains(want), "{want:?} not in\n{s}");
        }
        assert!(!s.contains("WARNING"));
        assert!(screen(&doc, 1000.0 + 200.0).contains("WARNING"));
        let mut failed = doc.clone();
        failed["lastReconcile"]["ok"] = json!(false);
        failed["lastReconcile"]["error"] = json!("netlink: EPERM");
        let s = screen(&failed, 1001.0);
        assert!(
            s.contains("FAILED") && s.contains("EPERM") && s.contains("last success"),
            "{s}"
        );
    }

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0.0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400.0), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_795_763_433.5), "2026-11-27T07:10:33Z");
    }

    #[test]
    fn no_file_is_a_clear_error() {
        let d = tempfile::tempdir().unwrap();
        let code = status(StatusArgs {
            status_file: d.path().join("none.json"),
            json: false,
        });
        assert_eq!(code, ExitCode::from(1));
    }

    #[test]
    fn written_only_where_the_directory_exists() {
        let d = tempfile::tempdir().unwrap();
        let missing = d.path().join("run-rcni/node-status.json");
        write(&missing, &json!({"a": 1}));
        assert!(!missing.parent().unwrap().exists());
        let f = d.path().join("s.json");
        write(&f, &json!({"a": 1}));
        let back: Value = serde_json::from_slice(&std::fs::read(&f).unwrap()).unwrap();
        assert_eq!(back["a"], 1);
    }
}
