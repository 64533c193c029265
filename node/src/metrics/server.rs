//! The `/metrics` endpoint: a small HTTP/1 server on tokio that answers
//! `GET /metrics` (and `HEAD`) with the text exposition, `/readyz` with 200
//! once the agent's last passes succeeded (503 and why, otherwise: the
//! DaemonSet's readiness probe), and 404 or 405 otherwise. One request per connection (`Connection: close`), which is
//! how Prometheus' scrapes look anyway.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::Metrics;

/// The content type of the text format this module writes.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A request head larger than this is refused: a scrape's is a few lines.
const MAX_HEAD: usize = 8192;
/// A client that sends no whole request within this is dropped.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

pub async fn bind(addr: &str) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: &'static Metrics) {
    loop {
        let Ok((conn, _)) = listener.accept().await else {
            // EMFILE and the like: try again shortly.
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        tokio::spawn(async move {
            let _ = tokio::time::timeout(READ_TIMEOUT, answer(conn, metrics)).await;
        });
    }
}

/// The method and path of a request head, once it is complete.
pub fn request_line(head: &[u8]) -> Option<(String, String)> {
    let text = std::str::from_utf8(head).ok()?;
    let line = text.lines().next()?;
    let mut it = line.split(' ');
    let method = it.next()?.to_string();
    let target = it.next()?;
    // The query string is not ours to read.
    let path = target.split('?').next().unwrap_or(target).to_string();
    Some((method, path))
}

/// A request's method and path, read from `conn`; `None` when the client
/// went, or was answered already (a head too large or unreadable).
pub(crate) async fn read_request(
    conn: &mut TcpStream,
) -> std::io::Result<Option<(String, String)>> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            return Ok(None);
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_HEAD {
            respond(conn, "431 Request Header Fields Too Large", "", b"").await?;
            return Ok(None);
        }
    }
    match request_line(&head) {
        Some(r) => Ok(Some(r)),
        None => {
            respond(conn, "400 Bad Request", "", b"").await?;
            Ok(None)
        }
    }
}

async fn answer(mut conn: TcpStream, metrics: &'static Metrics) -> std::io::Result<()> {
    let Some((method, path)) = read_request(&mut conn).await? else {
        return Ok(());
    };
    if path == "/readyz" {
        return match metrics.readiness() {
            Ok(()) => respond(&mut conn, "200 OK", "text/plain", b"ok\n").await,
            Err(why) => {
                let body = format!("not ready: {why}\n");
                respond(
                    &mut conn,
                    "503 Service Unavailable",
                    "text/plain",
                    body.as_bytes(),
                )
                .await
            }
        };
    }
    if path != "/metrics" {
        return respond(
            &mut conn,
            "404 Not Found",
            "text/plain",
            b"404 not found: see /metrics or /readyz\n",
        )
        .await;
    }
    if method != "GET" && method != "HEAD" {
        return respond(&mut conn, "405 Method Not Allowed", "", b"").await;
    }
    // bpffs, netlink and files: off the runtime's threads.
    let body = tokio::task::spawn_blocking(move || metrics.render())
        .await
        .unwrap_or_default();
    if method == "HEAD" {
        // The length GET would send, and no body.
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\nContent-Type: {CONTENT_TYPE}\r\n\r\n",
            body.len()
        );
        conn.write_all(head.as_bytes()).await?;
        return conn.shutdown().await;
    }
    respond(&mut conn, "200 OK", CONTENT_TYPE, body.as_bytes()).await
}

async fn respond(
    conn: &mut TcpStream,
    status: &str,
    content_type: &str,
    body: &[u8],
) -> std::io::Result<()> {
    respond_with(conn, status, content_type, &[], body).await
}

/// One response and the end of the connection; `headers` besides the
/// length, `Connection` and the content type.
pub(crate) async fn respond_with(
    conn: &mut TcpStream,
    status: &str,
    content_type: &str,
    headers: &[(&str, String)],
    body: &[u8],
) -> std::io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if !content_type.is_empty() {
        head.push_str(&format!("Content-Type: {content_type}\r\n"));
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    conn.write_all(head.as_bytes()).await?;
    conn.write_all(body).await?;
    conn.shutdown().await
}

/// The address a listener got (for `:0`).
pub fn local_addr(l: &TcpListener) -> Option<SocketAddr> {
    l.local_addr().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines() {
        assert_eq!(
            request_line(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n"),
            Some(("GET".into(), "/metrics".into()))
        );
        assert_eq!(request_line(b"GET\r\n\r\n"), None);
    }

    #[test]
    fn serves_metrics_and_404() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let l = bind("127.0.0.1:0").await.unwrap();
            let addr = local_addr(&l).unwrap();
            let task = tokio::spawn(serve(l, Metrics::get()));
            let get = |path: &'static str| async move {
                let mut c = TcpStream::connect(addr).await.unwrap();
                c.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                    .await
                    .unwrap();
                let mut out = String::new();
                c.read_to_string(&mut out).await.unwrap();
                out
            };
            let ok = get("/metrics").await;
            assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
            assert!(
                ok.contains(CONTENT_TYPE) && ok.contains("rcni_build_info"),
                "{ok}"
            );
            // Whatever the shared metrics hold, /readyz answers 200 or 503.
            let r = get("/readyz").await;
            assert!(
                r.starts_with("HTTP/1.1 200 OK\r\n") || r.starts_with("HTTP/1.1 503"),
                "{r}"
            );
            let nf = get("/").await;
            assert!(nf.starts_with("HTTP/1.1 404"), "{nf}");
            let mut c = TcpStream::connect(addr).await.unwrap();
            c.write_all(b"HEAD /metrics HTTP/1.1\r\n\r\n")
                .await
                .unwrap();
            let mut head = String::new();
            c.read_to_string(&mut head).await.unwrap();
            assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
            assert!(
                head.ends_with("\r\n\r\n") && !head.contains("Content-Length: 0\r"),
                "{head}"
            );
            let mut c = TcpStream::connect(addr).await.unwrap();
            c.write_all(b"POST /metrics HTTP/1.1\r\n\r\n")
                .await
                .unwrap();
            let mut out = String::new();
            c.read_to_string(&mut out).await.unwrap();
            assert!(out.starts_with("HTTP/1.1 405"), "{out}");
            task.abort();
        });
    }
}
