//! The cloud IPAM socket: `vpc-ipam` asks, the pool answers from memory
//! (no cloud call on the pod's path), and the pod's routing rules are in
//! place before the answer leaves.

use std::path::Path;
use std::sync::Arc;

use ipnetwork::Ipv4Network;
use rcni_agent_proto::ipam::{Attachment, IpamAnswer, IpamRequest};
use rcni_cloud::Provider;
use rcni_cloud::manager::{AllocError, Allocation, Manager};
use rcni_netlink::Netlink;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use super::datapath::{self, PodAddr, Snat};
use crate::log;

/// What every connection needs.
pub struct Ctx<P: Provider> {
    pub pool: Arc<Manager<P>>,
    pub nl: Netlink,
    pub vpc: Vec<Ipv4Network>,
    pub snat: Snat,
    /// Held across a change of the pool's allocations and of the pods'
    /// rules that follow it (ADD, DEL, GC), and by the loop's pass from its
    /// read of the allocations to the rules it makes of them: a pass that
    /// read the pool before a GC would otherwise put back the rules the GC
    /// had just removed, until its next pass.
    pub rules: tokio::sync::Mutex<()>,
    /// See [`super::CloudConf::pass_delay`].
    pub pass_delay: std::time::Duration,
}

/// Listens on `path` (root only: 0600; a stale socket replaced) until the
/// task is dropped.
pub fn listen(path: &Path) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let l = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

pub async fn serve<P: Provider + 'static>(l: UnixListener, ctx: Arc<Ctx<P>>) {
    loop {
        match l.accept().await {
            Ok((s, _)) => {
                let ctx = ctx.clone();
                tokio::spawn(async move {
                    if let Err(e) = one(s, &ctx).await {
                        log(format!("cloud: socket: {e}"));
                    }
                });
            }
            Err(e) => {
                log(format!("cloud: socket accept: {e}"));
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

async fn one<P: Provider + 'static>(s: UnixStream, ctx: &Ctx<P>) -> std::io::Result<()> {
    let (r, mut w) = s.into_split();
    let mut line = String::new();
    BufReader::new(r).read_line(&mut line).await?;
    let answer = match serde_json::from_str::<IpamRequest>(&line) {
        Ok(req) => handle(ctx, req).await,
        Err(e) => IpamAnswer::error(7, format!("a request the agent cannot read: {e}")),
    };
    let mut out = serde_json::to_string(&answer).map_err(std::io::Error::other)?;
    out.push('\n');
    w.write_all(out.as_bytes()).await
}

fn pod(a: &Allocation) -> PodAddr {
    PodAddr {
        ip: a.ip,
        device_index: a.device_index,
    }
}

fn found(a: &Allocation) -> IpamAnswer {
    IpamAnswer {
        ip: Some(a.ip),
        interface: Some(a.interface.clone()),
        device_index: Some(a.device_index),
        ..IpamAnswer::default()
    }
}

fn who(a: &Attachment) -> String {
    format!("{}/{}", a.container_id, a.if_name)
}

pub async fn handle<P: Provider + 'static>(ctx: &Ctx<P>, req: IpamRequest) -> IpamAnswer {
    let _rules = match req {
        IpamRequest::Add { .. } | IpamRequest::Del { .. } | IpamRequest::Gc { .. } => {
            Some(ctx.rules.lock().await)
        }
        IpamRequest::Check { .. } | IpamRequest::Status => None,
    };
    match req {
        IpamRequest::Add { attachment } => match ctx.pool.allocate(&attachment) {
            Ok(a) => {
                if let Err(e) = datapath::add_pod(&ctx.nl, pod(&a), &ctx.vpc, &ctx.snat).await {
                    // Nothing half-made: the address goes back.
                    let _ = datapath::del_pod(&ctx.nl, pod(&a), &ctx.vpc, &ctx.snat).await;
                    ctx.pool.release(&attachment);
                    return IpamAnswer::error(
                        999,
                        format!("routing rules for {} ({}): {e}", a.ip, who(&attachment)),
                    );
                }
                found(&a)
            }
            Err(e @ AllocError::Empty) => IpamAnswer::error(11, e.to_string()),
            Err(e) => IpamAnswer::error(999, e.to_string()),
        },
        IpamRequest::Del { attachment } => {
            if let Some(a) = ctx.pool.release(&attachment)
                && let Err(e) = datapath::del_pod(&ctx.nl, pod(&a), &ctx.vpc, &ctx.snat).await
            {
                // The address is back in the pool (cooling down); the
                // next reconcile removes the rules.
                log(format!("cloud: rules of {}: {e}", a.ip));
            }
            IpamAnswer::default()
        }
        IpamRequest::Check { attachment } => match ctx.pool.lookup(&attachment) {
            Some(a) => found(&a),
            None => IpamAnswer::default(),
        },
        IpamRequest::Gc { valid } => {
            let gone = ctx.pool.gc(&valid);
            for (who_, a) in &gone {
                log(format!("cloud: GC released {} of {}", a.ip, who(who_)));
                if let Err(e) = datapath::del_pod(&ctx.nl, pod(a), &ctx.vpc, &ctx.snat).await {
                    log(format!("cloud: rules of {}: {e}", a.ip));
                }
            }
            IpamAnswer {
                released: Some(gone.len() as u32),
                ..IpamAnswer::default()
            }
        }
        IpamRequest::Status => {
            let s = ctx.pool.snapshot();
            if s.free == 0 && s.allocations.len() as u32 >= s.max_pods {
                IpamAnswer::error(
                    50,
                    format!("this node's {} pod addresses are all in use", s.max_pods),
                )
            } else {
                IpamAnswer::default()
            }
        }
    }
}
