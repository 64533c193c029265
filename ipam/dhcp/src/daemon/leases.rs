//! The lease table: one slot per attachment (being acquired, or held by
//! its task), and the requests that act on it: allocate, check, release,
//! GC, and the resumption of the leases on disk at start.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::net::IpAddr;

use ipnetwork::IpNetwork;
use rcni_cni::{CniError, CniResult, ErrorCode, IpConfig};
use tokio::sync::{mpsc, oneshot, watch};

use super::flags::{Config, prefixed};
use crate::client::{self, Client};
use crate::options::{self, ClientOptions};
use crate::proto::Attachment;
use crate::store::{self, LeaseRecord, Store};

pub(super) enum Cmd {
    Release(oneshot::Sender<()>),
}

#[derive(Clone)]
enum Slot {
    /// An ADD is acquiring; others for the same attachment wait for it.
    Acquiring(watch::Receiver<Option<Result<CniResult, CniError>>>),
    Active {
        rec: watch::Receiver<LeaseRecord>,
        cmd: mpsc::Sender<Cmd>,
    },
}

pub struct Daemon {
    pub(super) cfg: Config,
    pub(super) store: Store,
    leases: Mutex<HashMap<String, Slot>>,
}

/// The reference's daemon answers every lease it could not get in time
/// (no server, or each one refusing) with exactly "no more tries", and
/// runtimes and upstream's own suite match that text: ours says it too,
/// with the cause in the details.
const NO_MORE_TRIES: &str = "no more tries";

/// Past `-timeout` + `-resendtimeout`, what an acquisition may still take
/// to end (a last exchange's send, the lease file's write).
const ACQUIRE_SLACK: Duration = Duration::from_secs(5);

fn no_lease(e: client::Error) -> CniError {
    let code = match &e {
        client::Error::NoAnswer { .. } | client::Error::Nak { .. } => {
            return CniError::new(ErrorCode::DhcpNoLease, NO_MORE_TRIES)
                .with_details(e.to_string());
        }
        client::Error::NetnsGone(_) => ErrorCode::Netns,
        client::Error::LinkGone { .. } => ErrorCode::Netlink,
        client::Error::BadAck(_) => ErrorCode::DhcpNoLease,
        client::Error::Io(_) => ErrorCode::Internal,
    };
    CniError::new(code, e.to_string())
}

/// The result for a record: address, gateway, routes, DNS of its ACK
/// (without a version, as the reference's daemon leaves it to the plugin).
fn lease_reply(rec: &LeaseRecord) -> Result<CniResult, CniError> {
    let ack = rec
        .ack()
        .map_err(|e| CniError::internal(format!("stored DHCPACK unreadable: {e}")))?;
    let g = options::granted(&ack).map_err(CniError::internal)?;
    let mut r = CniResult::new("");
    r.ips.push(IpConfig {
        interface: None,
        address: IpNetwork::V4(g.address),
        gateway: g.gateway.map(IpAddr::V4),
    });
    r.routes = g.routes;
    r.dns = g.dns;
    Ok(r)
}

/// Time from now until unix second `t` (zero if past).
pub(super) fn until_unix(t: u64) -> Duration {
    let target = std::time::UNIX_EPOCH + Duration::from_secs(t);
    target
        .duration_since(std::time::SystemTime::now())
        .unwrap_or(Duration::ZERO)
}

impl Daemon {
    pub fn new(cfg: Config) -> Arc<Daemon> {
        Arc::new(Daemon {
            store: Store::new(cfg.state_dir.clone()),
            cfg,
            leases: Mutex::new(HashMap::new()),
        })
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The client for one attachment's exchanges, with the daemon's
    /// `-broadcast` and timing flags.
    pub(super) fn client<'a>(
        &self,
        iface: &'a mut client::Iface,
        client_id: &'a str,
        options: &'a ClientOptions,
    ) -> Client<'a> {
        Client {
            iface,
            client_id,
            options,
            broadcast: self.cfg.broadcast,
            timing: self.cfg.timing,
        }
    }

    pub(super) fn netns_path(&self, netns: &str) -> PathBuf {
        prefixed(&self.cfg.host_prefix, Path::new(netns))
    }

    /// Picks up the leases on disk: those whose namespace is gone are
    /// dropped (nothing can be released from a namespace that no longer
    /// exists), the others are maintained again from where their timers
    /// stand.
    pub fn resume(self: &Arc<Self>) {
        // Temporaries of saves a kill interrupted (the previous daemon's):
        // this daemon, the directory's one writer, has not saved yet.
        match self.store.sweep() {
            Ok(0) => {}
            Ok(n) => log!("removed {n} unfinished lease file(s)"),
            Err(e) => log!("sweep {}: {e}", self.store.dir().display()),
        }
        let (records, bad) = self.store.load_all();
        for b in bad {
            log!("ignoring unreadable lease file {b}");
        }
        for rec in records {
            match rcni_netns::NetNs::open(self.netns_path(&rec.netns)) {
                Ok(ns) if ns.inode() == rec.netns_inode => {
                    log!(
                        "{}: resuming lease {} (expires in {} s)",
                        rec.client_id,
                        rec.address,
                        until_unix(rec.expires_at).as_secs()
                    );
                    self.start(rec);
                }
                _ => {
                    log!(
                        "{}: network namespace {} is gone, dropping lease {}",
                        rec.client_id,
                        rec.netns,
                        rec.address
                    );
                    if let Err(e) = self.store.remove(&rec.attachment) {
                        log!("{}: remove lease file: {e}", rec.client_id);
                    }
                }
            }
        }
    }

    /// Spawns the task maintaining `rec` and registers it.
    fn start(self: &Arc<Self>, rec: LeaseRecord) {
        let (tx, rx) = watch::channel(rec.clone());
        let (cmd_tx, cmd_rx) = mpsc::channel(4);
        self.slots().insert(
            rec.client_id.clone(),
            Slot::Active {
                rec: rx,
                cmd: cmd_tx,
            },
        );
        let d = self.clone();
        tokio::spawn(async move { d.maintain(rec, tx, cmd_rx).await });
    }

    pub(super) async fn allocate(
        self: &Arc<Self>,
        attachment: Attachment,
        netns: String,
        opts: ClientOptions,
    ) -> Result<CniResult, CniError> {
        let cid = attachment.client_id();
        let tx = loop {
            let slot = {
                let mut slots = self.slots();
                match slots.get(&cid) {
                    Some(s) => s.clone(),
                    None => {
                        let (tx, rx) = watch::channel(None);
                        slots.insert(cid.clone(), Slot::Acquiring(rx));
                        break tx;
                    }
                }
            };
            match slot {
                // The reference answers an ADD for a lease it holds with
                // that lease.
                Slot::Active { rec, .. } => {
                    let rec = rec.borrow().clone();
                    if rec.expired {
                        return Err(CniError::new(
                            ErrorCode::DhcpNoLease,
                            format!("{cid}: lease {} expired", rec.address),
                        ));
                    }
                    return lease_reply(&rec);
                }
                Slot::Acquiring(mut rx) => {
                    let done = rx
                        .wait_for(Option::is_some)
                        .await
                        .ok()
                        .and_then(|d| d.clone());
                    if let Some(result) = done {
                        return result;
                    }
                    // The acquiring call ended without a word (its task
                    // was dropped): its slot would answer every later
                    // ADD at once, and this loop would spin on it
                    // without ever yielding the daemon's one thread.
                    let mut slots = self.slots();
                    if matches!(slots.get(&cid), Some(Slot::Acquiring(now)) if now.same_channel(&rx))
                    {
                        slots.remove(&cid);
                    }
                }
            }
        };
        log!(
            "{cid}: acquiring lease on {} in {netns}",
            attachment.if_name
        );
        // The reference's own bound on an Allocate: the link's wait, then
        // -resendtimeout of exchanges. Each step keeps to it; this makes
        // sure no runtime waits past it whatever a step does.
        let bound = self.cfg.timing.timeout + self.cfg.timing.resend_timeout + ACQUIRE_SLACK;
        let r = match tokio::time::timeout(bound, self.acquire(&attachment, &netns, &opts)).await {
            Ok(r) => r,
            Err(_elapsed) => Err(CniError::new(ErrorCode::DhcpNoLease, NO_MORE_TRIES)
                .with_details(format!(
                    "acquiring a lease on {} took over {} s",
                    attachment.if_name,
                    bound.as_secs()
                ))),
        };
        match r {
            Ok(rec) => {
                log!(
                    "{cid}: lease {} acquired from {}, expires in {} s",
                    rec.address,
                    rec.server,
                    until_unix(rec.expires_at).as_secs()
                );
                let reply = lease_reply(&rec);
                self.start(rec);
                let _ = tx.send(Some(reply.clone()));
                reply
            }
            Err(e) => {
                log!("{cid}: {e}");
                self.slots().remove(&cid);
                let _ = tx.send(Some(Err(e.clone())));
                Err(e)
            }
        }
    }

    async fn acquire(
        &self,
        attachment: &Attachment,
        netns: &str,
        opts: &ClientOptions,
    ) -> Result<LeaseRecord, CniError> {
        let path = self.netns_path(netns);
        let mut iface =
            client::open_iface(&path, None, &attachment.if_name, self.cfg.timing.timeout)
                .await
                .map_err(no_lease)?;
        let inode = iface.ns.inode();
        let cid = attachment.client_id();
        let (ack, server_mac) = self
            .client(&mut iface, &cid, opts)
            .acquire(None)
            .await
            .map_err(no_lease)?;
        let mut rec = LeaseRecord::new(
            attachment.clone(),
            netns.to_string(),
            inode,
            opts.clone(),
            &ack,
            store::now(),
        )
        .map_err(|e| CniError::new(ErrorCode::DhcpNoLease, e))?;
        rec.set_server_mac(server_mac);
        if let Err(e) = self.store.save(&rec) {
            // Without its file the lease would be forgotten by a restart:
            // give it back rather than hold it unrecorded.
            let _ = self
                .client(&mut iface, &cid, opts)
                .release(rec.address, rec.server, Some(server_mac))
                .await;
            return Err(CniError::new(
                ErrorCode::IoFailure,
                format!("save lease in {}: {e}", self.store.dir().display()),
            ));
        }
        Ok(rec)
    }

    pub(super) fn check(&self, attachment: &Attachment) -> Result<CniResult, CniError> {
        let cid = attachment.client_id();
        let slot = self.slots().get(&cid).cloned();
        let failed = |m: String| CniError::new(ErrorCode::CheckFailed, m);
        match slot {
            Some(Slot::Active { rec, .. }) => {
                let rec = rec.borrow().clone();
                if rec.expired {
                    return Err(failed(format!("{cid}: lease {} expired", rec.address)));
                }
                lease_reply(&rec)
            }
            Some(Slot::Acquiring(_)) => Err(failed(format!("{cid}: lease still being acquired"))),
            None => Err(failed(format!("{cid}: no DHCP lease held"))),
        }
    }

    /// Stops maintaining the lease and sends DHCPRELEASE. Whatever happens,
    /// the lease is forgotten afterwards: DEL must succeed.
    pub(super) async fn release(self: &Arc<Self>, attachment: &Attachment) {
        let cid = attachment.client_id();
        loop {
            let slot = self.slots().get(&cid).cloned();
            match slot {
                None => break,
                Some(Slot::Acquiring(mut rx)) => {
                    let _ = rx.wait_for(Option::is_some).await;
                }
                Some(Slot::Active { cmd, .. }) => {
                    let (tx, rx) = oneshot::channel();
                    if cmd.send(Cmd::Release(tx)).await.is_ok() {
                        let _ = tokio::time::timeout(Duration::from_secs(10), rx).await;
                    }
                    self.slots().remove(&cid);
                    break;
                }
            }
        }
        if let Err(e) = self.store.remove(attachment) {
            log!("{cid}: remove lease file: {e}");
        }
    }

    /// Releases the leases of network `net` whose attachment is not in
    /// `valid`.
    pub(super) async fn gc(
        self: &Arc<Self>,
        net: &str,
        valid: &[rcni_cni::GcAttachment],
    ) -> Result<(), CniError> {
        let stale: Vec<Attachment> = self
            .slots()
            .values()
            .filter_map(|s| match s {
                Slot::Active { rec, .. } => Some(rec.borrow().attachment.clone()),
                Slot::Acquiring(_) => None,
            })
            .filter(|a| {
                a.net_name == net
                    && !valid
                        .iter()
                        .any(|v| v.container_id == a.container_id && v.ifname == a.if_name)
            })
            .collect();
        for a in stale {
            log!("{}: not in the valid attachments, releasing", a.client_id());
            self.release(&a).await;
        }
        Ok(())
    }

    pub(super) fn forget(&self, rec: &LeaseRecord) {
        self.slots().remove(&rec.client_id);
        if let Err(e) = self.store.remove(&rec.attachment) {
            log!("{}: remove lease file: {e}", rec.client_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_not_had_in_time_says_what_the_reference_says() {
        for e in [
            client::Error::NoAnswer {
                ifname: "eth1".into(),
                secs: 10,
            },
            client::Error::Nak {
                server: "192.168.1.1".parse().unwrap(),
            },
        ] {
            let cause = e.to_string();
            let c = no_lease(e);
            assert_eq!((c.code, c.msg.as_str()), (111, "no more tries"));
            assert_eq!(c.details, cause);
        }
        let c = no_lease(client::Error::NetnsGone("/run/netns/x".into()));
        assert_eq!(c.msg, "network namespace /run/netns/x is gone");
    }
}
