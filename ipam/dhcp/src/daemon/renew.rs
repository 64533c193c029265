//! One lease's task: RENEWING at T1 (unicast to its server), REBINDING at
//! T2 (broadcast), the interface set down at expiry, DHCPRELEASE on request.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::Daemon;
use super::leases::{Cmd, until_unix};
use crate::client;
use crate::store::{self, LeaseRecord};

impl Daemon {
    async fn iface(&self, rec: &LeaseRecord) -> Result<client::Iface, client::Error> {
        client::open_iface(
            &self.netns_path(&rec.netns),
            Some(rec.netns_inode),
            &rec.attachment.if_name,
            Duration::ZERO,
        )
        .await
    }

    /// Sends DHCPRELEASE for `rec`, best effort.
    pub(super) async fn send_release(&self, rec: &LeaseRecord) {
        let mut iface = match self.iface(rec).await {
            Ok(i) => i,
            Err(e) => {
                log!("{}: cannot release {}: {e}", rec.client_id, rec.address);
                return;
            }
        };
        let r = self
            .client(&mut iface, &rec.client_id, &rec.options)
            .release(rec.address, rec.server, rec.server_mac())
            .await;
        match r {
            Ok(()) => log!("{}: lease {} released", rec.client_id, rec.address),
            Err(e) => log!("{}: release {}: {e}", rec.client_id, rec.address),
        }
    }

    /// RENEWING (`rebind` false) or REBINDING: one exchange until the next
    /// deadline.
    async fn extend(&self, rec: &LeaseRecord, rebind: bool) -> Result<LeaseRecord, client::Error> {
        let mut iface = self.iface(rec).await?;
        let (server, deadline) = if rebind {
            (std::net::Ipv4Addr::BROADCAST, rec.expires_at)
        } else {
            (rec.server, rec.rebind_at)
        };
        let ack = self
            .client(&mut iface, &rec.client_id, &rec.options)
            .extend(rec.address, server, Instant::now() + until_unix(deadline))
            .await?;
        if ack.yiaddr() != rec.address {
            log!(
                "{}: server acknowledged {} instead of {}; keeping {}",
                rec.client_id,
                ack.yiaddr(),
                rec.address,
                rec.address
            );
        }
        let mut new = LeaseRecord::new(
            rec.attachment.clone(),
            rec.netns.clone(),
            rec.netns_inode,
            rec.options.clone(),
            &ack,
            store::now(),
        )
        .map_err(client::Error::BadAck)?;
        new.address = rec.address;
        new.server_mac = rec.server_mac.clone();
        Ok(new)
    }

    /// The lease ran out: as the reference, set the interface down so the
    /// container stops using an address that may be given to another host.
    async fn expire(&self, rec: &mut LeaseRecord) {
        log!(
            "{}: lease {} expired, setting interface down",
            rec.client_id,
            rec.address
        );
        match self.iface(rec).await {
            Ok(i) => {
                if let Err(e) = i.nl.set_down(i.index).await {
                    log!("{}: set {} down: {e}", rec.client_id, i.name);
                }
            }
            Err(e) => log!("{}: {e}", rec.client_id),
        }
        rec.expired = true;
        if let Err(e) = self.store.save(rec) {
            log!("{}: save lease: {e}", rec.client_id);
        }
    }

    pub(super) async fn maintain(
        self: Arc<Self>,
        mut rec: LeaseRecord,
        tx: watch::Sender<LeaseRecord>,
        mut cmds: mpsc::Receiver<Cmd>,
    ) {
        enum Step {
            Wait(Duration),
            Extend { rebind: bool },
            Expire,
            Idle,
        }
        loop {
            let now = store::now();
            let step = if rec.expired {
                Step::Idle
            } else if now < rec.renew_at {
                Step::Wait(until_unix(rec.renew_at))
            } else if now < rec.rebind_at {
                Step::Extend { rebind: false }
            } else if now < rec.expires_at {
                Step::Extend { rebind: true }
            } else {
                Step::Expire
            };
            let work = async {
                match step {
                    Step::Wait(d) => {
                        tokio::time::sleep(d).await;
                        None
                    }
                    Step::Idle => std::future::pending().await,
                    Step::Expire => Some(None),
                    Step::Extend { rebind } => {
                        log!(
                            "{}: {} lease {}",
                            rec.client_id,
                            if rebind { "rebinding" } else { "renewing" },
                            rec.address
                        );
                        Some(Some(self.extend(&rec, rebind).await))
                    }
                }
            };
            let outcome = tokio::select! {
                o = work => o,
                cmd = cmds.recv() => {
                    match cmd {
                        Some(Cmd::Release(done)) => {
                            if !rec.expired {
                                self.send_release(&rec).await;
                            }
                            let _ = self.store.remove(&rec.attachment);
                            let _ = done.send(());
                        }
                        None => {}
                    }
                    return;
                }
            };
            match outcome {
                None => {}
                Some(None) => {
                    self.expire(&mut rec).await;
                    let _ = tx.send(rec.clone());
                }
                Some(Some(Ok(new))) => {
                    log!(
                        "{}: lease {} extended, expires in {} s",
                        new.client_id,
                        new.address,
                        until_unix(new.expires_at).as_secs()
                    );
                    rec = new;
                    if let Err(e) = self.store.save(&rec) {
                        log!("{}: save lease: {e}", rec.client_id);
                    }
                    let _ = tx.send(rec.clone());
                }
                Some(Some(Err(e))) if e.is_gone() => {
                    log!("{}: {e}; dropping lease {}", rec.client_id, rec.address);
                    self.forget(&rec);
                    return;
                }
                Some(Some(Err(client::Error::Nak { server }))) => {
                    // The server took the address back: it is no longer ours.
                    log!(
                        "{}: {server} refused to extend {}",
                        rec.client_id,
                        rec.address
                    );
                    self.expire(&mut rec).await;
                    let _ = tx.send(rec.clone());
                }
                Some(Some(Err(e))) => {
                    log!("{}: {e}", rec.client_id);
                    // Not past the deadline yet (a send failed): try again
                    // shortly rather than spin.
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }
}
