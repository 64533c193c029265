//! Serving the plugin: one JSON request line per connection, one reply
//! line; and the daemon's main loop until SIGTERM or SIGINT.

use std::sync::Arc;
use std::time::Duration;

use rcni_cni::{CniError, ErrorCode};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use super::Daemon;
use super::flags::{Config, prefixed};
use super::listener::{activation_listener, bind_socket};
use crate::proto::{Reply, Request};

impl Daemon {
    /// Answers one request of the plugin.
    pub async fn handle(self: &Arc<Self>, req: Request) -> Reply {
        let r = match req {
            Request::Allocate {
                attachment,
                netns,
                options,
            } => self.allocate(attachment, netns, options).await.map(Some),
            Request::Check { attachment } => self.check(&attachment).map(Some),
            Request::Release { attachment } => {
                self.release(&attachment).await;
                Ok(None)
            }
            Request::Status => Ok(None),
            Request::Gc { net_name, valid } => self.gc(&net_name, &valid).await.map(|_| None),
        };
        match r {
            Ok(lease) => Reply::ok(lease),
            Err(e) => Reply::err(e),
        }
    }
}

/// Longest request line accepted.
const MAX_REQUEST: u64 = 1 << 20;

async fn serve_conn(d: Arc<Daemon>, stream: tokio::net::UnixStream) {
    let (r, mut w) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(tokio::io::AsyncReadExt::take(r, MAX_REQUEST));
    let read = tokio::time::timeout(Duration::from_secs(30), reader.read_line(&mut line)).await;
    let reply = match read {
        Ok(Ok(n)) if n > 0 => match serde_json::from_str::<Request>(&line) {
            Ok(req) => d.handle(req).await,
            Err(e) => Reply::err(CniError::new(
                ErrorCode::DecodingFailure,
                format!("dhcp daemon: bad request: {e}"),
            )),
        },
        _ => return,
    };
    let mut out = serde_json::to_vec(&reply).unwrap_or_default();
    out.push(b'\n');
    let _ = w.write_all(&out).await;
    let _ = w.shutdown().await;
}

/// Runs the daemon until SIGTERM or SIGINT. Leases are not released on the
/// way out: they stay on disk and the next daemon resumes them.
pub fn run(cfg: Config) -> Result<(), String> {
    let activated = activation_listener().map_err(|e| format!("Error getting listener: {e}"))?;
    let socket_path = prefixed(&cfg.host_prefix, &cfg.socket_path);
    let (listener, owned_path) = match activated {
        Some(l) => (l, None),
        None => {
            let l = bind_socket(&socket_path, cfg.socket_group.as_deref())
                .map_err(|e| format!("Error getting listener: {e}"))?;
            (l, Some(socket_path.clone()))
        }
    };
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("listener: {e}"))?;
    if let Some(p) = &cfg.pidfile {
        // Whole or absent: a supervisor reading it while we are killed
        // never gets an empty or partial pid.
        rcni_statefile::write_replace(p, std::process::id().to_string().as_bytes(), 0o644)
            .map_err(|e| format!("Error writing pidfile {:?}: {e}", p.display()))?;
    }
    let pidfile = cfg.pidfile.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    let r = rt.block_on(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let listener =
            tokio::net::UnixListener::from_std(listener).map_err(|e| format!("listener: {e}"))?;
        let mut term = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
        let mut int = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
        let d = Daemon::new(cfg);
        d.resume();
        log!("listening");
        loop {
            tokio::select! {
                c = listener.accept() => match c {
                    Ok((stream, _)) => {
                        tokio::spawn(serve_conn(d.clone(), stream));
                    }
                    Err(e) => {
                        log!("accept: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                _ = term.recv() => break,
                _ = int.recv() => break,
            }
        }
        log!(
            "exiting; leases stay recorded in {}",
            d.store.dir().display()
        );
        Ok::<(), String>(())
    });
    if let Some(p) = owned_path {
        let _ = std::fs::remove_file(p);
    }
    if let Some(p) = pidfile {
        let _ = std::fs::remove_file(p);
    }
    // Lease tasks may be mid-exchange: they are dropped with the runtime.
    drop(rt);
    r
}
