//! A stand-in for kube-apiserver, for tests: no kube-apiserver package exists
//! on these machines, and the agent's Kubernetes code must be tested with the
//! real `kube` client. It speaks the part of the API protocol that client
//! uses, over plain HTTP/1.1, or over TLS ([`FakeApi::start_tls`], with a
//! certificate made for the occasion) as a pod's in-cluster config
//! expects:
//!
//! - list (`GET /api/v1/nodes`, `/apis/<group>/<version>/...`, namespaced or
//!   not): a `<Kind>List` carrying the store's resourceVersion;
//! - watch (`?watch=true&resourceVersion=N`): a chunked stream of
//!   `{"type": "ADDED" | "MODIFIED" | "DELETED" | "BOOKMARK" | "ERROR"}`
//!   events, one JSON object per chunk; the events after N replayed first;
//!   BOOKMARKs only to watches that asked (`allowWatchBookmarks=true`); a
//!   resourceVersion older than the last [`FakeApi::compact`] gets an ERROR
//!   event with a 410 Status (what the real watch cache sends), or with
//!   [`FakeApi::set_http_gone`] an HTTP 410 response;
//! - get and PATCH of one object (JSON merge patch; a strategic merge patch
//!   is applied the same way, which is exact for maps such as annotations),
//!   every patch recorded;
//! - `fieldSelector` of equalities on dotted paths (`spec.nodeName=n1`).
//!
//! Failures on demand: watches dropped mid-stream (no terminating chunk),
//! watches ended with a 410 ERROR event, the server "down" (every connection
//! closed at once, live watches dropped).
//!
//! Objects are kept as JSON; the typed helpers take k8s-openapi types.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use k8s_openapi::Resource;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

/// A client connection: TCP, or TLS over it.
trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for T {}

/// One stored change, as watches replay it.
#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    coll: String,
    ns: String,
    kind: &'static str,
    obj: Value,
}

/// A recorded PATCH.
#[derive(Debug, Clone, PartialEq)]
pub struct Patch {
    /// The object's path (`/api/v1/nodes/n1`).
    pub path: String,
    pub content_type: String,
    pub body: Value,
}

#[derive(Default)]
struct Inner {
    rv: u64,
    /// collection (`v1/nodes`) -> (namespace or "", name) -> object.
    objects: BTreeMap<String, BTreeMap<(String, String), Value>>,
    /// List kinds of the collections seen (`v1/nodes` -> `NodeList`).
    list_kinds: BTreeMap<String, String>,
    history: Vec<Change>,
    /// Watches from a resourceVersion below this are too old (410).
    compacted: u64,
    http_gone: bool,
    down: bool,
    /// Bumped to end every live watch: dropped, or with a 410 event.
    drop_gen: u64,
    expire_gen: u64,
    bookmark_gen: u64,
    /// BOOKMARK events written to a connection (flushed to the socket).
    bookmarks_sent: u64,
    requests: Vec<String>,
    /// Each request's Authorization header ("" for none), in order.
    authorizations: Vec<String>,
    patches: Vec<Patch>,
}

/// The running server; stopped when dropped.
pub struct FakeApi {
    inner: Arc<Mutex<Inner>>,
    tick: Arc<tokio::sync::watch::Sender<u64>>,
    addr: SocketAddr,
    tls: bool,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    // A panicking test thread must not hide the server from the others.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `v1/nodes`, `networking.k8s.io/v1/networkpolicies`.
fn coll_of<K: Resource>() -> String {
    format!("{}/{}", K::API_VERSION, K::URL_PATH_SEGMENT)
}

impl FakeApi {
    /// Serves on `listener` (bound by the caller, in whatever network
    /// namespace the clients are) from a thread of its own.
    pub fn start(listener: std::net::TcpListener) -> FakeApi {
        Self::serve_on(listener, None)
    }

    /// Serves HTTPS on `listener` with a certificate for `host` (an IP
    /// address or a DNS name) signed by a CA made here; the CA's PEM, what a
    /// service account's `ca.crt` holds, is returned with it.
    pub fn start_tls(listener: std::net::TcpListener, host: &str) -> (FakeApi, String) {
        let ca_key = rcgen::KeyPair::generate().expect("CA key");
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "rcni-fakeapi CA");
        let ca = ca_params.self_signed(&ca_key).expect("CA certificate");
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let key = rcgen::KeyPair::generate().expect("server key");
        let params = rcgen::CertificateParams::new(vec![host.to_string()]).expect("server");
        let cert = params.signed_by(&key, &issuer).expect("server certificate");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .expect("server TLS config");
        let api = Self::serve_on(
            listener,
            Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))),
        );
        (api, ca.pem())
    }

    fn serve_on(
        listener: std::net::TcpListener,
        tls: Option<tokio_rustls::TlsAcceptor>,
    ) -> FakeApi {
        let is_tls = tls.is_some();
        listener
            .set_nonblocking(true)
            .expect("nonblocking listener");
        let addr = listener.local_addr().expect("listener address");
        let inner = Arc::new(Mutex::new(Inner {
            rv: 1,
            ..Inner::default()
        }));
        let tick = Arc::new(tokio::sync::watch::channel(0u64).0);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (i2, t2) = (inner.clone(), tick.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            rt.block_on(async move {
                let listener = TcpListener::from_std(listener).expect("tokio listener");
                let accept = async {
                    loop {
                        let Ok((s, _)) = listener.accept().await else {
                            continue;
                        };
                        if lock(&i2).down {
                            drop(s);
                            continue;
                        }
                        let (i, t) = (i2.clone(), t2.clone());
                        match &tls {
                            None => {
                                tokio::spawn(serve(s, i, t));
                            }
                            Some(acceptor) => {
                                let accept = acceptor.accept(s);
                                tokio::spawn(async move {
                                    // A client refusing the certificate
                                    // ends the handshake: nothing to serve.
                                    if let Ok(s) = accept.await {
                                        serve(s, i, t).await;
                                    }
                                });
                            }
                        }
                    }
                };
                tokio::select! {
                    _ = accept => {}
                    _ = stopped => {}
                }
            });
        });
        FakeApi {
            inner,
            tick,
            addr,
            tls: is_tls,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server's URL, for a kubeconfig.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// Each request's Authorization header so far ("" for none).
    pub fn authorizations(&self) -> Vec<String> {
        lock(&self.inner).authorizations.clone()
    }

    /// A kubeconfig that points at this server (no credentials: the
    /// server checks none).
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n\
             current-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            self.url()
        )
    }

    fn changed(&self) {
        self.tick.send_modify(|t| *t += 1);
    }

    /// Creates or replaces an object (ADDED or MODIFIED); its new
    /// resourceVersion.
    pub fn put<K: Resource + Serialize>(&self, obj: &K) -> u64 {
        let mut v = serde_json::to_value(obj).expect("serializable object");
        let coll = coll_of::<K>();
        let rv = {
            let mut g = lock(&self.inner);
            g.list_kinds
                .insert(coll.clone(), format!("{}List", K::KIND));
            g.put_value(&coll, &mut v)
        };
        self.changed();
        rv
    }

    /// Deletes an object (DELETED); whether it existed.
    pub fn delete<K: Resource>(&self, ns: Option<&str>, name: &str) -> bool {
        let coll = coll_of::<K>();
        let ok = {
            let mut g = lock(&self.inner);
            let key = (ns.unwrap_or("").to_string(), name.to_string());
            match g.objects.get_mut(&coll).and_then(|m| m.remove(&key)) {
                Some(mut obj) => {
                    g.rv += 1;
                    let rv = g.rv;
                    obj["metadata"]["resourceVersion"] = json!(rv.to_string());
                    g.history.push(Change {
                        rv,
                        coll,
                        ns: key.0,
                        kind: "DELETED",
                        obj,
                    });
                    true
                }
                None => false,
            }
        };
        self.changed();
        ok
    }

    /// An object as the server holds it now.
    pub fn get<K: Resource + DeserializeOwned>(&self, ns: Option<&str>, name: &str) -> Option<K> {
        let g = lock(&self.inner);
        let key = (ns.unwrap_or("").to_string(), name.to_string());
        let v = g.objects.get(&coll_of::<K>())?.get(&key)?.clone();
        Some(serde_json::from_value(v).expect("stored object of its type"))
    }

    /// The PATCHes received, in order.
    pub fn patches(&self) -> Vec<Patch> {
        lock(&self.inner).patches.clone()
    }

    /// The requests received (`GET /api/v1/nodes?watch=true&...`), in
    /// order.
    pub fn requests(&self) -> Vec<String> {
        lock(&self.inner).requests.clone()
    }

    /// Lists served so far (requests without `watch=true` on `coll_path`,
    /// e.g. `/api/v1/nodes`).
    pub fn lists_of(&self, coll_path: &str) -> usize {
        self.requests()
            .iter()
            .filter(|r| {
                r.starts_with("GET ")
                    && r[4..].split('?').next() == Some(coll_path)
                    && !r.contains("watch=true")
            })
            .count()
    }

    /// The store's resourceVersion now.
    pub fn resource_version(&self) -> u64 {
        lock(&self.inner).rv
    }

    /// Forgets the history: a watch from any resourceVersion before now is
    /// told 410 Gone.
    pub fn compact(&self) {
        let mut g = lock(&self.inner);
        g.compacted = g.rv;
        g.history.clear();
    }

    /// Too-old resourceVersions answered with an HTTP 410 response instead
    /// of an ERROR event in a 200 stream.
    pub fn set_http_gone(&self, on: bool) {
        lock(&self.inner).http_gone = on;
    }

    /// Every live watch cut mid-stream: the connection closed without the
    /// chunked body's end.
    pub fn drop_watches(&self) {
        lock(&self.inner).drop_gen += 1;
        self.changed();
    }

    /// Every live watch ended with an ERROR event carrying a 410 Status
    /// (the watch cache's "too old resource version"), and the history
    /// compacted so that resuming fails too: the client must list again.
    pub fn expire_watches(&self) {
        self.compact();
        lock(&self.inner).expire_gen += 1;
        self.changed();
    }

    /// A BOOKMARK with the current resourceVersion to every watch that
    /// allows them.
    pub fn bookmark(&self) {
        lock(&self.inner).bookmark_gen += 1;
        self.changed();
    }

    /// BOOKMARK events written so far: once one is, a watch cut after it
    /// has the bookmark before the cut.
    pub fn bookmarks_sent(&self) -> u64 {
        lock(&self.inner).bookmarks_sent
    }

    /// Down: every new connection closed at once and live watches dropped;
    /// up again: served as before, from the same store.
    pub fn set_down(&self, down: bool) {
        let mut g = lock(&self.inner);
        g.down = down;
        if down {
            g.drop_gen += 1;
        }
        drop(g);
        self.changed();
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Inner {
    /// Stores `v` (its metadata.resourceVersion set), records the change.
    fn put_value(&mut self, coll: &str, v: &mut Value) -> u64 {
        self.rv += 1;
        let rv = self.rv;
        v["metadata"]["resourceVersion"] = json!(rv.to_string());
        let ns = v["metadata"]["namespace"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let name = v["metadata"]["name"]
            .as_str()
            .expect("an object with metadata.name")
            .to_string();
        let m = self.objects.entry(coll.to_string()).or_default();
        let kind = if m.insert((ns.clone(), name), v.clone()).is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        self.history.push(Change {
            rv,
            coll: coll.to_string(),
            ns,
            kind,
            obj: v.clone(),
        });
        rv
    }
}

/// A parsed request path: which collection, which namespace, which object.
struct Target {
    coll: String,
    ns: Option<String>,
    name: Option<String>,
}

/// `/api/v1/nodes[/n]`, `/api/v1/namespaces/x/pods[/p]`,
/// `/apis/networking.k8s.io/v1/[namespaces/x/]networkpolicies[/p]`.
fn target(path: &str) -> Option<Target> {
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (gv, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] => (v.to_string(), rest),
        ["apis", g, v, rest @ ..] => (format!("{g}/{v}"), rest),
        _ => return None,
    };
    let (ns, plural, name) = match rest {
        ["namespaces", ns, plural] => (Some(ns), *plural, None),
        ["namespaces", ns, plural, name] => (Some(ns), *plural, Some(name)),
        [plural] => (None, *plural, None),
        [plural, name] => (None, *plural, Some(name)),
        _ => return None,
    };
    Some(Target {
        coll: format!("{gv}/{plural}"),
        ns: ns.map(|s| s.to_string()),
        name: name.map(|s| s.to_string()),
    })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(x) => {
                        out.push(x);
                        i += 3;
                        continue;
                    }
                    None => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query(q: &str) -> BTreeMap<String, String> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (percent_decode(k), percent_decode(v)),
            None => (percent_decode(p), String::new()),
        })
        .collect()
}

/// `fieldSelector`: comma-separated `path=value` / `path==value` /
/// `path!=value` on dotted paths.
fn fields_match(sel: Option<&String>, obj: &Value) -> bool {
    let Some(sel) = sel else { return true };
    sel.split(',').filter(|t| !t.is_empty()).all(|term| {
        let (path, want, neg) = if let Some((p, v)) = term.split_once("!=") {
            (p, v, true)
        } else if let Some((p, v)) = term.split_once("==") {
            (p, v, false)
        } else if let Some((p, v)) = term.split_once('=') {
            (p, v, false)
        } else {
            return true;
        };
        let mut cur = obj;
        for k in path.split('.') {
            cur = &cur[k];
        }
        let have = cur.as_str().unwrap_or("");
        (have == want) != neg
    })
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
           "status": "Failure", "message": message, "reason": reason, "code": code})
}

fn not_found(name: &str) -> Value {
    status(404, "NotFound", &format!("{name} not found"))
}

async fn respond(s: &mut impl Stream, code: u16, body: &Value) {
    let text = body.to_string();
    let reason = match code {
        200 => "OK",
        404 => "Not Found",
        410 => "Gone",
        415 => "Unsupported Media Type",
        _ => "Error",
    };
    let head = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        text.len()
    );
    let _ = s.write_all(head.as_bytes()).await;
    let _ = s.write_all(text.as_bytes()).await;
    let _ = s.shutdown().await;
}

async fn chunk(s: &mut impl Stream, v: &Value) -> std::io::Result<()> {
    let text = format!("{v}\n");
    s.write_all(format!("{:x}\r\n{text}\r\n", text.len()).as_bytes())
        .await
}

/// RFC 7386.
fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            let t = target.as_object_mut().expect("made an object");
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

async fn serve(
    stream: impl Stream,
    inner: Arc<Mutex<Inner>>,
    tick: Arc<tokio::sync::watch::Sender<u64>>,
) {
    let mut r = BufReader::new(stream);
    let mut line = String::new();
    if r.read_line(&mut line).await.unwrap_or(0) == 0 {
        return;
    }
    let mut parts = line.split_whitespace();
    let (method, uri) = match (parts.next(), parts.next()) {
        (Some(m), Some(u)) => (m.to_string(), u.to_string()),
        _ => return,
    };
    let mut len = 0usize;
    let mut content_type = String::new();
    let mut authorization = String::new();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).await.unwrap_or(0) == 0 {
            return;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            match k.trim().to_ascii_lowercase().as_str() {
                "content-length" => len = v.trim().parse().unwrap_or(0),
                "content-type" => content_type = v.trim().to_string(),
                "authorization" => authorization = v.trim().to_string(),
                _ => {}
            }
        }
    }
    let mut body = vec![0u8; len];
    if r.read_exact(&mut body).await.is_err() {
        return;
    }
    let mut s = r.into_inner();
    {
        let mut g = lock(&inner);
        g.requests.push(format!("{method} {uri}"));
        g.authorizations.push(authorization);
    }
    let (path, q) = uri.split_once('?').unwrap_or((&uri, ""));
    let q = query(q);
    let Some(t) = target(path) else {
        respond(&mut s, 404, &status(404, "NotFound", "no such path")).await;
        return;
    };
    match (method.as_str(), &t.name) {
        ("GET", None) if q.get("watch").map(String::as_str) == Some("true") => {
            watch(s, &t, &q, inner, tick).await
        }
        ("GET", None) => {
            let body = {
                let g = lock(&inner);
                let items: Vec<Value> = g
                    .objects
                    .get(&t.coll)
                    .into_iter()
                    .flat_map(|m| m.iter())
                    .filter(|((ns, _), _)| t.ns.as_ref().is_none_or(|want| want == ns))
                    .map(|(_, v)| v)
                    .filter(|v| fields_match(q.get("fieldSelector"), v))
                    .cloned()
                    .collect();
                let kind = g
                    .list_kinds
                    .get(&t.coll)
                    .cloned()
                    .unwrap_or_else(|| "List".into());
                let api_version = t.coll.rsplit_once('/').map(|(a, _)| a).unwrap_or("v1");
                json!({"kind": kind, "apiVersion": api_version,
                   "metadata": {"resourceVersion": g.rv.to_string()},
                   "items": items})
            };
            respond(&mut s, 200, &body).await;
        }
        ("GET", Some(name)) => {
            let key = (t.ns.clone().unwrap_or_default(), name.clone());
            let v = lock(&inner)
                .objects
                .get(&t.coll)
                .and_then(|m| m.get(&key))
                .cloned();
            match v {
                Some(v) => respond(&mut s, 200, &v).await,
                None => respond(&mut s, 404, &not_found(name)).await,
            }
        }
        ("PATCH", Some(name)) => {
            let ct = content_type.split(';').next().unwrap_or("").trim();
            if ct != "application/merge-patch+json"
                && ct != "application/strategic-merge-patch+json"
            {
                respond(
                    &mut s,
                    415,
                    &status(415, "UnsupportedMediaType", &format!("patch type {ct}")),
                )
                .await;
                return;
            }
            let Ok(patch) = serde_json::from_slice::<Value>(&body) else {
                respond(&mut s, 400, &status(400, "BadRequest", "patch is not JSON")).await;
                return;
            };
            let key = (t.ns.clone().unwrap_or_default(), name.clone());
            let patched = {
                let mut g = lock(&inner);
                g.patches.push(Patch {
                    path: path.to_string(),
                    content_type: ct.to_string(),
                    body: patch.clone(),
                });
                let obj = g.objects.get(&t.coll).and_then(|m| m.get(&key)).cloned();
                obj.map(|mut obj| {
                    merge_patch(&mut obj, &patch);
                    g.put_value(&t.coll, &mut obj);
                    obj
                })
            };
            match patched {
                Some(obj) => {
                    tick.send_modify(|t| *t += 1);
                    respond(&mut s, 200, &obj).await;
                }
                None => respond(&mut s, 404, &not_found(name)).await,
            }
        }
        _ => {
            respond(
                &mut s,
                405,
                &status(405, "MethodNotAllowed", "not served here"),
            )
            .await
        }
    }
}

async fn watch(
    mut s: impl Stream,
    t: &Target,
    q: &BTreeMap<String, String>,
    inner: Arc<Mutex<Inner>>,
    tick: Arc<tokio::sync::watch::Sender<u64>>,
) {
    let mut ticks = tick.subscribe();
    let bookmarks = q.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let since: Option<u64> = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .filter(|v| *v != 0);
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .map(std::time::Duration::from_secs);
    let deadline = timeout.map(|d| tokio::time::Instant::now() + d);
    let kind = {
        let g = lock(&inner);
        g.list_kinds
            .get(&t.coll)
            .map(|k| k.trim_end_matches("List").to_string())
            .unwrap_or_default()
    };
    let api_version = t
        .coll
        .rsplit_once('/')
        .map(|(a, _)| a.to_string())
        .unwrap_or_default();
    let matches = |c: &Change| {
        c.coll == t.coll
            && t.ns.as_ref().is_none_or(|n| *n == c.ns)
            && fields_match(q.get("fieldSelector"), &c.obj)
    };
    // What to send first, and the generation counters this watch ends on.
    let http_gone = {
        let g = lock(&inner);
        g.http_gone && since.is_some_and(|rv| rv < g.compacted)
    };
    if http_gone {
        respond(
            &mut s,
            410,
            &status(410, "Expired", "too old resource version"),
        )
        .await;
        return;
    }
    let (first, mut cursor, drop_gen, expire_gen, mut bookmark_gen) = {
        let g = lock(&inner);
        let gone = since.is_some_and(|rv| rv < g.compacted);
        let first: Vec<Value> = if gone {
            vec![
                json!({"type": "ERROR", "object": status(410, "Expired", "too old resource version")}),
            ]
        } else {
            match since {
                // From "now": what exists, as ADDED.
                None => g
                    .objects
                    .get(&t.coll)
                    .into_iter()
                    .flat_map(|m| m.iter())
                    .filter(|((ns, _), v)| {
                        t.ns.as_ref().is_none_or(|n| n == ns)
                            && fields_match(q.get("fieldSelector"), v)
                    })
                    .map(|(_, v)| json!({"type": "ADDED", "object": v}))
                    .collect(),
                Some(rv) => g
                    .history
                    .iter()
                    .filter(|c| c.rv > rv && matches(c))
                    .map(|c| json!({"type": c.kind, "object": c.obj}))
                    .collect(),
            }
        };
        let cursor = if gone { u64::MAX } else { g.rv };
        (first, cursor, g.drop_gen, g.expire_gen, g.bookmark_gen)
    };
    let head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
    if s.write_all(head.as_bytes()).await.is_err() {
        return;
    }
    for e in &first {
        if chunk(&mut s, e).await.is_err() {
            return;
        }
    }
    if cursor == u64::MAX {
        let _ = s.write_all(b"0\r\n\r\n").await;
        let _ = s.shutdown().await;
        return;
    }
    loop {
        let (events, end) = {
            let g = lock(&inner);
            if g.drop_gen != drop_gen {
                // Cut: no terminating chunk.
                return;
            }
            let mut events: Vec<Value> = g
                .history
                .iter()
                .filter(|c| c.rv > cursor && matches(c))
                .map(|c| json!({"type": c.kind, "object": c.obj}))
                .collect();
            cursor = g.rv;
            if g.bookmark_gen != bookmark_gen {
                bookmark_gen = g.bookmark_gen;
                if bookmarks {
                    events.push(json!({"type": "BOOKMARK", "object": {
                        "kind": kind, "apiVersion": api_version,
                        "metadata": {"resourceVersion": g.rv.to_string()}}}));
                }
            }
            let end = g.expire_gen != expire_gen;
            if end {
                events.push(json!({"type": "ERROR", "object": status(410, "Expired", "too old resource version")}));
            }
            (events, end)
        };
        for e in &events {
            if chunk(&mut s, e).await.is_err() {
                return;
            }
            if e["type"] == "BOOKMARK" {
                lock(&inner).bookmarks_sent += 1;
            }
        }
        if end {
            let _ = s.write_all(b"0\r\n\r\n").await;
            let _ = s.shutdown().await;
            return;
        }
        let wait = ticks.changed();
        let timed_out = match deadline {
            Some(d) => tokio::time::timeout_at(d, wait).await.is_err(),
            None => wait.await.is_err(),
        };
        if timed_out {
            let _ = s.write_all(b"0\r\n\r\n").await;
            let _ = s.shutdown().await;
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_queries_and_patches() {
        let t = target("/api/v1/nodes/n1").unwrap();
        assert_eq!(
            (t.coll.as_str(), t.ns, t.name.as_deref()),
            ("v1/nodes", None, Some("n1"))
        );
        let t = target("/api/v1/namespaces/a/pods").unwrap();
        assert_eq!((t.coll.as_str(), t.ns.as_deref()), ("v1/pods", Some("a")));
        let t = target("/api/v1/namespaces/a").unwrap();
        assert_eq!(
            (t.coll.as_str(), t.name.as_deref()),
            ("v1/namespaces", Some("a"))
        );
        let t = target("/apis/networking.k8s.io/v1/networkpolicies").unwrap();
        assert_eq!(t.coll, "networking.k8s.io/v1/networkpolicies");
        let q = query("fieldSelector=spec.nodeName%3Dn1&watch=true");
        assert_eq!(q["fieldSelector"], "spec.nodeName=n1");
        let pod = json!({"spec": {"nodeName": "n1"}});
        assert!(fields_match(q.get("fieldSelector"), &pod));
        assert!(!fields_match(Some(&"spec.nodeName=n2".to_string()), &pod));
        let mut o = json!({"metadata": {"annotations": {"a": "1", "b": "2"}}});
        merge_patch(
            &mut o,
            &json!({"metadata": {"annotations": {"a": null, "c": "3"}}}),
        );
        assert_eq!(
            o,
            json!({"metadata": {"annotations": {"b": "2", "c": "3"}}})
        );
    }
}
