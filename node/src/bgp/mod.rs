//! `"backend": "bgp"`: pod routes over BGP, as Calico does, spoken by BIRD
//! 2 (Calico's BGP daemon too). The agent writes BIRD's configuration
//! (`conf`), runs BIRD as its child and reloads it over the control socket
//! (`control`); BIRD writes what it learns to a kernel table of its own,
//! which the agent mirrors into the main table with its route protocol
//! (`entries`), beside the VXLAN entries of `vxlanMode`.
//!
//! Restarts keep pod traffic: the kernel's routes stay when the agent (and
//! BIRD with it) goes; peers keep this node's routes for the Restart Time
//! (graceful restart, RFC 4724, negotiated on every session); a new BIRD
//! started over a non-empty table runs graceful restart recovery (`-R`)
//! and changes its table only once its sessions are back.

pub mod conf;
pub mod control;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ipnetwork::IpNetwork;
use rcni_netlink::overlay::OwnedRoute;
use rcni_netlink::{Family, Netlink};

use crate::PathError;
use crate::registry::cluster::{Cluster, Node};
use crate::sync::desired::{PeerEntries, Via};

/// `RTPROT_BIRD`: what BIRD's kernel protocol tags its routes with.
pub const RTPROT_BIRD: u8 = 12;

const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum BgpError {
    #[error(transparent)]
    Path(#[from] PathError),
    #[error("start {bird}: {err}")]
    Spawn { bird: String, err: std::io::Error },
    #[error("BIRD's control socket {socket}: {err}")]
    Control {
        socket: PathBuf,
        err: std::io::Error,
    },
    #[error("BIRD refused the configuration {conf}: {reply}")]
    Refused { conf: PathBuf, reply: String },
}

/// The routes BIRD learned, from its kernel table.
pub async fn learned(nl: &Netlink, v6: bool) -> Result<Vec<OwnedRoute>, rcni_netlink::Error> {
    let family = if v6 { Family::V6 } else { Family::V4 };
    Ok(nl
        .routes_in_table(family, Some(conf::TABLE))
        .await?
        .into_iter()
        .filter(|r| r.protocol == Some(RTPROT_BIRD))
        .map(|r| OwnedRoute {
            dst: r.dst,
            gateway: r.gateway,
            oif: r.oif,
            onlink: false,
        })
        .collect())
}

/// The main table's entries for the learned routes: those inside the pod
/// network (BIRD's import filter already says so: checked again), not the
/// node's own, not a subnet `taken` already reaches (a peer `vxlanMode`
/// tunnels). Named after the node owning the subnet, if any.
pub fn entries(
    cluster: &Cluster,
    me: &Node,
    learned: &[OwnedRoute],
    taken: &[PeerEntries],
) -> Vec<PeerEntries> {
    let inside = |dst: &IpNetwork| match dst {
        IpNetwork::V4(d) => cluster
            .network
            .is_some_and(|n| n.contains(d.network()) && d.prefix() >= n.prefix()),
        IpNetwork::V6(d) => cluster
            .network6
            .is_some_and(|n| n.contains(d.network()) && d.prefix() >= n.prefix()),
    };
    let own = |dst: &IpNetwork| {
        me.pod_cidr.is_some_and(|p| *dst == IpNetwork::V4(p))
            || me.pod_cidr6.is_some_and(|p| *dst == IpNetwork::V6(p))
    };
    learned
        .iter()
        .filter(|r| inside(&r.dst) && !own(&r.dst) && r.gateway.is_some())
        .filter(|r| !taken.iter().any(|t| t.route.dst == r.dst))
        .map(|r| {
            let owner = cluster.nodes.iter().find(|n| {
                n.pod_cidr.is_some_and(|p| r.dst == IpNetwork::V4(p))
                    || n.pod_cidr6.is_some_and(|p| r.dst == IpNetwork::V6(p))
            });
            PeerEntries {
                name: owner.map_or_else(|| format!("bgp {}", r.dst), |n| n.name.clone()),
                via: Via::Bgp,
                neighbour: None,
                fdb: None,
                route: r.clone(),
            }
        })
        .collect()
}

/// BIRD, run by the agent.
pub struct Speaker {
    dir: PathBuf,
    bird: PathBuf,
    child: Option<Child>,
    /// The configuration BIRD runs.
    applied: Option<String>,
    /// Session name -> (what it is, last logged state).
    sessions: BTreeMap<String, (String, String)>,
    described: BTreeMap<String, String>,
}

impl Speaker {
    pub fn new(state_dir: &Path, bird: &Path) -> Speaker {
        Speaker {
            dir: state_dir.join("bird"),
            bird: bird.to_path_buf(),
            child: None,
            applied: None,
            sessions: BTreeMap::new(),
            described: BTreeMap::new(),
        }
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.join("bird.ctl")
    }

    pub fn conf_path(&self) -> PathBuf {
        self.dir.join("bird.conf")
    }

    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// BIRD running with this node's configuration: started (with graceful
    /// restart recovery when its table still holds routes: `recover`), or
    /// reconfigured if the configuration changed. Log lines out.
    pub fn ensure(
        &mut self,
        cluster: &Cluster,
        me: &Node,
        recover: bool,
    ) -> Result<Vec<String>, BgpError> {
        let mut log = Vec::new();
        let plan = conf::plan(cluster, me);
        for r in &plan.refused {
            log.push(format!("bgp: refused {r}"));
        }
        self.described = plan
            .neighbours
            .iter()
            .map(|n| {
                (
                    n.name.clone(),
                    format!("{} {} (AS {})", n.what, n.ip, n.peer_as),
                )
            })
            .collect();
        let text = conf::render(&plan);
        self.reap(&mut log);
        if self.child.is_some() && self.applied.as_deref() == Some(text.as_str()) {
            return Ok(log);
        }
        std::fs::create_dir_all(&self.dir).map_err(|err| PathError {
            what: "BIRD's directory",
            path: self.dir.clone(),
            err,
        })?;
        let path = self.conf_path();
        rcni_statefile::write_replace(&path, text.as_bytes(), 0o644).map_err(|err| PathError {
            what: "BIRD's configuration",
            path: path.clone(),
            err,
        })?;
        if self.child.is_some() {
            let socket = self.socket();
            let reply = control::command(&socket, "configure", CONTROL_TIMEOUT)
                .map_err(|err| BgpError::Control { socket, err })?;
            if reply.is_error() {
                return Err(BgpError::Refused {
                    conf: path,
                    reply: reply.text(),
                });
            }
            log.push(format!(
                "bgp: BIRD reconfigured ({} sessions): {}",
                plan.neighbours.len(),
                reply.text()
            ));
        } else {
            self.spawn(recover)?;
            log.push(format!(
                "bgp: BIRD started{} with {} sessions (router id {}, {})",
                if recover {
                    " in graceful restart recovery"
                } else {
                    ""
                },
                plan.neighbours.len(),
                plan.router_id,
                path.display()
            ));
        }
        self.applied = Some(text);
        Ok(log)
    }

    fn spawn(&mut self, recover: bool) -> Result<(), BgpError> {
        // A socket left by a BIRD that died would make bind fail.
        let _ = std::fs::remove_file(self.socket());
        let mut c = Command::new(&self.bird);
        c.arg("-f")
            .arg("-c")
            .arg(self.conf_path())
            .arg("-s")
            .arg(self.socket())
            .stdin(Stdio::null());
        if recover {
            c.arg("-R");
        }
        die_with_parent(&mut c);
        let child = c.spawn().map_err(|err| BgpError::Spawn {
            bird: self.bird.display().to_string(),
            err,
        })?;
        self.child = Some(child);
        // The control socket exists once BIRD has read its configuration.
        for _ in 0..100 {
            if control::command(&self.socket(), "show status", CONTROL_TIMEOUT).is_ok() {
                return Ok(());
            }
            let mut log = Vec::new();
            self.reap(&mut log);
            if self.child.is_none() {
                return Err(BgpError::Refused {
                    conf: self.conf_path(),
                    reply: log.join("; "),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// A BIRD that exited is forgotten (the next `ensure` starts one).
    fn reap(&mut self, log: &mut Vec<String>) {
        if let Some(c) = &mut self.child
            && let Ok(Some(status)) = c.try_wait()
        {
            log.push(format!("bgp: BIRD exited ({status})"));
            self.child = None;
            self.applied = None;
        }
    }

    /// Session changes since the last call, as log lines; BIRD's exit too.
    pub fn watch(&mut self) -> Vec<String> {
        let mut log = Vec::new();
        self.reap(&mut log);
        if self.child.is_none() {
            return log;
        }
        let Ok(reply) = control::command(&self.socket(), "show protocols", CONTROL_TIMEOUT) else {
            return log;
        };
        for s in control::sessions(&reply) {
            let what = self
                .described
                .get(&s.name)
                .cloned()
                .unwrap_or_else(|| s.name.clone());
            let state = if s.info.is_empty() {
                s.state.clone()
            } else {
                s.info.clone()
            };
            let last = self
                .sessions
                .insert(s.name.clone(), (what.clone(), state.clone()));
            if last.as_ref().map(|(_, st)| st) != Some(&state) {
                log.push(format!("bgp: {what}: {state}"));
            }
        }
        crate::metrics::Metrics::get().set_bgp_sessions(self.sessions.values().cloned().collect());
        log
    }

    /// Shuts BIRD down cleanly: every peer gets a Cease and withdraws this
    /// node's routes at once (the node left the cluster, or the backend
    /// is no longer bgp), instead of keeping them for the Restart Time.
    pub fn withdraw(&mut self) {
        if self.child.is_some() {
            let _ = control::command(&self.socket(), "down", CONTROL_TIMEOUT);
            for _ in 0..250 {
                let mut log = Vec::new();
                self.reap(&mut log);
                if self.child.is_none() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.stop();
    }

    /// Kills BIRD: to the peers a lost session, whose routes they keep
    /// for the Restart Time (graceful restart).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.applied = None;
        self.sessions.clear();
        crate::metrics::Metrics::get().set_bgp_sessions(Vec::new());
    }
}

impl Drop for Speaker {
    fn drop(&mut self) {
        // Killed, not asked to stop: a BIRD that stops cleanly withdraws
        // its routes at the peers (a Cease), while a lost session leaves
        // them in place for the Restart Time.
        self.stop();
    }
}

/// BIRD gets SIGKILL when the agent's thread that started it ends, however
/// the agent ends: it never outlives the agent (nor a test's agent). The
/// policy flow collector too (crate::flows).
pub(crate) fn die_with_parent(c: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec only prctl(2), which is
    // async-signal-safe, runs; nothing is allocated or locked.
    unsafe {
        c.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(std::io::Error::from)
        });
    }
}

/// The learned routes of both families, to notice BIRD's changes between
/// reconciles.
pub async fn fingerprint(nl: &Netlink) -> Result<Vec<OwnedRoute>, rcni_netlink::Error> {
    let mut v = learned(nl, false).await?;
    v.extend(learned(nl, true).await?);
    v.sort();
    Ok(v)
}

/// Removes what BIRD left in its table (the backend is no longer bgp).
pub async fn flush(nl: &Netlink) -> Result<usize, rcni_netlink::Error> {
    let mut n = 0;
    for r in nl
        .routes_in_table(Family::All, Some(conf::TABLE))
        .await?
        .into_iter()
        .filter(|r| r.protocol == Some(RTPROT_BIRD))
    {
        match nl.del_route(&r).await {
            Ok(()) => n += 1,
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// An address's family name, for messages.
pub fn family(ip: IpAddr) -> &'static str {
    if ip.is_ipv4() { "IPv4" } else { "IPv6" }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::cluster;

    #[test]
    fn learned_routes_inside_the_network_are_mirrored_and_named_by_owner() {
        let c = cluster::parse(
            r#"{"network": "10.244.0.0/16", "backend": "bgp", "nodes": [
                {"name": "n1", "address": "192.168.50.1", "podCIDR": "10.244.1.0/24"},
                {"name": "n2", "address": "192.168.50.2", "podCIDR": "10.244.2.0/24"}]}"#,
        )
        .unwrap();
        let r = |dst: &str| OwnedRoute {
            dst: dst.parse().unwrap(),
            gateway: Some("192.168.50.254".parse().unwrap()),
            oif: Some(2),
            onlink: false,
        };
        let learned = vec![
            r("10.244.2.0/24"),
            r("10.244.9.0/24"),
            r("10.244.1.0/24"),
            r("172.16.0.0/24"),
            r("0.0.0.0/0"),
            r("10.0.0.0/8"),
        ];
        let got = entries(&c, c.node("n1").unwrap(), &learned, &[]);
        let names: Vec<(String, String)> = got
            .iter()
            .map(|e| (e.name.clone(), e.route.dst.to_string()))
            .collect();
        assert_eq!(
            names,
            vec![
                ("n2".into(), "10.244.2.0/24".into()),
                ("bgp 10.244.9.0/24".into(), "10.244.9.0/24".into()),
            ]
        );
        // A subnet a VXLAN entry reaches is left to it.
        let again = entries(&c, c.node("n1").unwrap(), &learned, &got[..1]);
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].route.dst.to_string(), "10.244.9.0/24");
    }
}
