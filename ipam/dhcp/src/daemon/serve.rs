//! Serving the plugin, the reference's or ours: Go net/rpc over HTTP
//! (see [`crate::proto`]), calls in order on each connection; and the
//! daemon's main loop until SIGTERM or SIGINT.

use std::sync::Arc;
use std::time::Duration;

use rcni_cni::{CniError, CniResult, ErrorCode, NetConf};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};

use super::Daemon;
use super::flags::{Config, prefixed};
use super::listener::{activation_listener, bind_socket};
use crate::gob;
use crate::options;
use crate::proto::{self, Attachment, CmdArgs, RequestHeader, ServerCodec};

/// The `ipam` keys the daemon reads from the config in `StdinData`.
fn ipam_of(conf: &NetConf) -> Result<crate::IpamConf, CniError> {
    let net: crate::Net = conf.plugin_conf()?;
    net.ipam
        .ok_or_else(|| CniError::config("IPAM config missing 'ipam' key"))
}

fn attachment(args: &CmdArgs, conf: &NetConf) -> Attachment {
    Attachment {
        container_id: args.container_id.clone(),
        net_name: conf.name.clone(),
        if_name: args.if_name.clone(),
    }
}

/// As the reference's Allocate: the config's `priority` on every route.
fn with_priority(mut r: CniResult, ipam: &crate::IpamConf) -> CniResult {
    if let Some(p) = ipam.priority.filter(|p| *p != 0) {
        for route in &mut r.routes {
            route.priority = Some(p);
        }
    }
    r
}

impl Daemon {
    /// Answers one call: `Some` result for Allocate and Check.
    pub async fn handle(
        self: &Arc<Self>,
        method: &str,
        args: &CmdArgs,
    ) -> Result<Option<CniResult>, CniError> {
        let conf = NetConf::parse(&args.stdin_data)?;
        match method {
            proto::ALLOCATE => {
                let ipam = ipam_of(&conf)?;
                let cni_args = rcni_cni::CniArgs::parse(&args.args);
                let opts = options::prepare(&ipam.provide, &ipam.request, &|k| {
                    cni_args.get(k).map(String::from)
                })
                .map_err(CniError::config)?;
                if args.netns.is_empty() {
                    return Err(CniError::new(
                        ErrorCode::InvalidEnvironmentVariables,
                        "CNI_NETNS is empty",
                    ));
                }
                let r = self
                    .allocate(attachment(args, &conf), args.netns.clone(), opts)
                    .await?;
                Ok(Some(with_priority(r, &ipam)))
            }
            proto::CHECK => {
                let ipam = ipam_of(&conf)?;
                let r = self.check(&attachment(args, &conf))?;
                Ok(Some(with_priority(r, &ipam)))
            }
            proto::RELEASE => {
                self.release(&attachment(args, &conf)).await;
                Ok(None)
            }
            proto::STATUS => Ok(None),
            proto::GC => {
                let valid = conf.gc_required_valid_attachments("releases")?;
                self.gc(&conf.name, &valid).await.map(|_| None)
            }
            _ => unreachable!("methods are checked by the caller"),
        }
    }
}

/// Longest request head accepted; anything longer is not a Go client.
const MAX_HEAD: u64 = 8 << 10;

/// How long a connection may wait for its handshake or its next call.
const IDLE: Duration = Duration::from_secs(30);

/// Reads the HTTP request head: `Ok(None)` when it is Go's CONNECT to the
/// RPC path, else the response to send before closing.
async fn handshake(
    r: &mut (impl AsyncBufReadExt + Unpin),
) -> std::io::Result<Option<&'static str>> {
    let mut head = r.take(MAX_HEAD);
    let mut first = String::new();
    if head.read_line(&mut first).await? == 0 {
        // Closed without a word: nothing to answer (as Go's server).
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    loop {
        let mut line = String::new();
        let n = head.read_line(&mut line).await?;
        if n == 0 || line.trim_end().is_empty() {
            break;
        }
    }
    let mut parts = first.split_whitespace();
    let (method, path, version) = (parts.next(), parts.next(), parts.next());
    // As Go's net/http and rpc.Server.ServeHTTP answer.
    Ok(match (method, path, version) {
        (Some("CONNECT"), Some(proto::RPC_PATH), Some(v)) if v.starts_with("HTTP/") => None,
        (Some(_), Some(proto::RPC_PATH), Some(v)) if v.starts_with("HTTP/") => Some(
            "HTTP/1.0 405 Method Not Allowed\r\nContent-Type: text/plain; charset=utf-8\r\n\r\n405 must CONNECT\n",
        ),
        (Some(_), Some(_), Some(v)) if v.starts_with("HTTP/") => Some(
            "HTTP/1.0 404 Not Found\r\nContent-Type: text/plain; charset=utf-8\r\n\r\n404 page not found\n",
        ),
        _ => Some(
            "HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n400 Bad Request",
        ),
    })
}

/// Reads one gob message off the connection.
async fn read_message(r: &mut (impl AsyncRead + Unpin)) -> std::io::Result<Vec<u8>> {
    let bad = |e: gob::Error| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
    let first = r.read_u8().await?;
    let mut more = vec![0u8; gob::len_bytes_after(first)];
    r.read_exact(&mut more).await?;
    let n = gob::message_len(first, &more).map_err(bad)?;
    let mut msg = vec![0u8; n];
    r.read_exact(&mut msg).await?;
    Ok(msg)
}

/// The next value of the request stream.
async fn read_value(
    r: &mut (impl AsyncRead + Unpin),
    codec: &mut ServerCodec,
) -> std::io::Result<gob::Value> {
    loop {
        let msg = read_message(r).await?;
        match codec.message(&msg) {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
        }
    }
}

/// net/rpc's own errors for a method name we do not serve (the same text
/// as Go's server, which our plugin and a Go client recognise).
fn unknown_method(m: &str) -> Option<String> {
    let Some((service, _)) = m.rsplit_once('.') else {
        return Some(format!("rpc: service/method request ill-formed: {m}"));
    };
    if service != "DHCP" {
        return Some(format!("rpc: can't find service {m}"));
    }
    if ![
        proto::ALLOCATE,
        proto::RELEASE,
        proto::CHECK,
        proto::STATUS,
        proto::GC,
    ]
    .contains(&m)
    {
        return Some(format!("rpc: can't find method {m}"));
    }
    None
}

async fn serve_conn(d: Arc<Daemon>, stream: tokio::net::UnixStream) {
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    match tokio::time::timeout(IDLE, handshake(&mut r)).await {
        Ok(Ok(None)) => {}
        Ok(Ok(Some(refusal))) => {
            let _ = w.write_all(refusal.as_bytes()).await;
            let _ = w.shutdown().await;
            return;
        }
        _ => return,
    }
    let connected = format!("HTTP/1.0 {}\n\n", proto::CONNECTED);
    if w.write_all(connected.as_bytes()).await.is_err() {
        return;
    }
    let mut codec = ServerCodec::new();
    loop {
        let read = async {
            let header = read_value(&mut r, &mut codec).await?;
            let body = read_value(&mut r, &mut codec).await?;
            Ok::<_, std::io::Error>((ServerCodec::header(&header), body))
        };
        // A closed or idle connection, or a stream that is no gob: Go's
        // server drops those too.
        let Ok(Ok((h, body))) = tokio::time::timeout(IDLE, read).await else {
            return;
        };
        let reply = answer(&d, &mut codec, &h, &body).await;
        match reply {
            Ok(bytes) if w.write_all(&bytes).await.is_ok() => {}
            _ => return,
        }
    }
}

async fn answer(
    d: &Arc<Daemon>,
    codec: &mut ServerCodec,
    h: &RequestHeader,
    body: &gob::Value,
) -> Result<Vec<u8>, gob::Error> {
    if let Some(e) = unknown_method(&h.method) {
        return codec.reply_error(h, &e, None);
    }
    let args = CmdArgs::from_value(body);
    match d.handle(&h.method, &args).await {
        Ok(Some(r)) => codec.reply_result(h, &r),
        Ok(None) => codec.reply_empty(h),
        Err(e) => codec.reply_error(h, &e.msg, Some(&e)),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_methods_get_go_s_errors() {
        assert_eq!(unknown_method(proto::ALLOCATE), None);
        assert_eq!(unknown_method(proto::GC), None);
        assert_eq!(
            unknown_method("DHCP.Renew").as_deref(),
            Some("rpc: can't find method DHCP.Renew")
        );
        assert_eq!(
            unknown_method("Other.Allocate").as_deref(),
            Some("rpc: can't find service Other.Allocate")
        );
        assert!(unknown_method("nodot").unwrap().contains("ill-formed"));
        // What our plugin takes for a daemon without the method.
        let e = proto::RpcError {
            msg: unknown_method("DHCP.Nope").unwrap(),
            cni: None,
        };
        assert!(e.is_unknown_method());
    }
}
