//! kube-proxy's health endpoints, served in its place:
//!
//! - each `healthCheckNodePort` (a LoadBalancer Service with
//!   `externalTrafficPolicy: Local`): a cloud load balancer asks it which
//!   nodes have an endpoint. The answer is kube-proxy's JSON, `{"service":
//!   {"namespace", "name"}, "localEndpoints": N, "serviceProxyHealthy":
//!   true}`, with 200 when this node has a ready endpoint and 503 when it
//!   has none (terminating ones do not count), and the
//!   `X-Load-Balancing-Endpoint-Weight` header;
//! - the proxy's own `/healthz` and `/livez` on port 10256 (kube-proxy's
//!   `healthzBindAddress`), which load balancers probe to tell a node
//!   with a working proxy: 200 once the maps were written, with kube-proxy's
//!   `lastUpdated`, `currentTime` and `nodeEligible`.
//!
//! A port that cannot be bound (kube-proxy still running beside the agent,
//! or another program on it) is logged once and tried again at the next
//! change.

use crate::metrics::server::{read_request, respond_with};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tokio::net::{TcpListener, TcpStream};

/// kube-proxy's `healthzBindAddress` port.
pub const PROXY_HEALTH_PORT: u16 = 10256;
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// One health check node port's Service and its ready endpoints on this
/// node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthPort {
    pub namespace: String,
    pub name: String,
    pub local_endpoints: usize,
}

#[derive(Default)]
struct State {
    ports: BTreeMap<u16, HealthPort>,
    /// When the maps were last written.
    updated: Option<SystemTime>,
}

/// The listeners, one task each.
pub struct Health {
    state: Arc<Mutex<State>>,
    listeners: BTreeMap<u16, tokio::task::JoinHandle<()>>,
    /// Ports whose bind failed, logged once.
    failed: BTreeMap<u16, String>,
}

impl Drop for Health {
    fn drop(&mut self) {
        for t in self.listeners.values() {
            t.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Health {
    pub fn new() -> Health {
        Health {
            state: Arc::default(),
            listeners: BTreeMap::new(),
            failed: BTreeMap::new(),
        }
    }

    /// After a write of the maps: the node ports' answers as `ports` says,
    /// listeners opened and closed to match, 10256 among them.
    pub async fn update(&mut self, ports: BTreeMap<u16, HealthPort>) {
        let wanted: Vec<u16> = std::iter::once(PROXY_HEALTH_PORT)
            .chain(ports.keys().copied())
            .collect();
        {
            let mut st = lock(&self.state);
            st.ports = ports;
            st.updated = Some(SystemTime::now());
        }
        self.listeners.retain(|port, task| {
            let keep = wanted.contains(port);
            if !keep {
                task.abort();
            }
            keep
        });
        for port in wanted {
            if self.listeners.contains_key(&port) {
                continue;
            }
            match TcpListener::bind(("0.0.0.0", port)).await {
                Ok(l) => {
                    self.failed.remove(&port);
                    let state = self.state.clone();
                    self.listeners
                        .insert(port, tokio::spawn(serve(l, port, state)));
                }
                Err(e) => {
                    let msg = e.to_string();
                    if self.failed.get(&port) != Some(&msg) {
                        crate::log(format!("services: health port {port}: {msg}"));
                        self.failed.insert(port, msg);
                    }
                }
            }
        }
    }
}

impl Default for Health {
    fn default() -> Self {
        Self::new()
    }
}

async fn serve(l: TcpListener, port: u16, state: Arc<Mutex<State>>) {
    loop {
        let Ok((conn, _)) = l.accept().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(READ_TIMEOUT, answer(conn, port, state)).await;
        });
    }
}

/// The status line, headers and body for a request of `path` on `port`.
fn response(
    port: u16,
    path: &str,
    state: &State,
    now: SystemTime,
) -> (&'static str, Vec<(&'static str, String)>, String) {
    if port == PROXY_HEALTH_PORT {
        if path != "/healthz" && path != "/livez" {
            return ("404 Not Found", Vec::new(), "404 page not found\n".into());
        }
        let stamp = |t: SystemTime| {
            jiff::Timestamp::try_from(t)
                .map(|t| format!("{t:.9}"))
                .unwrap_or_default()
        };
        let body = serde_json::json!({
            "lastUpdated": state.updated.map(stamp).unwrap_or_default(),
            "currentTime": stamp(now),
            "nodeEligible": true,
        });
        let status = if state.updated.is_some() {
            "200 OK"
        } else {
            "503 Service Unavailable"
        };
        return (status, Vec::new(), body.to_string());
    }
    let Some(h) = state.ports.get(&port) else {
        return ("503 Service Unavailable", Vec::new(), String::new());
    };
    let body = serde_json::json!({
        "service": {"namespace": h.namespace, "name": h.name},
        "localEndpoints": h.local_endpoints,
        "serviceProxyHealthy": true,
    });
    let status = if h.local_endpoints > 0 {
        "200 OK"
    } else {
        "503 Service Unavailable"
    };
    let headers = vec![
        ("X-Content-Type-Options", "nosniff".to_string()),
        (
            "X-Load-Balancing-Endpoint-Weight",
            h.local_endpoints.to_string(),
        ),
    ];
    (status, headers, body.to_string())
}

async fn answer(mut conn: TcpStream, port: u16, state: Arc<Mutex<State>>) -> std::io::Result<()> {
    let Some((_, path)) = read_request(&mut conn).await? else {
        return Ok(());
    };
    let (status, headers, body) = response(port, &path, &lock(&state), SystemTime::now());
    respond_with(
        &mut conn,
        status,
        "application/json",
        &headers,
        body.as_bytes(),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_port_answers_its_local_endpoints_as_kube_proxy_does() {
        let mut st = State::default();
        st.ports.insert(
            31000,
            HealthPort {
                namespace: "ns".into(),
                name: "web".into(),
                local_endpoints: 2,
            },
        );
        st.ports.insert(
            31001,
            HealthPort {
                namespace: "ns".into(),
                name: "none".into(),
                local_endpoints: 0,
            },
        );
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let (status, headers, body) = response(31000, "/anything", &st, now);
        assert_eq!(status, "200 OK");
        assert!(headers.contains(&("X-Load-Balancing-Endpoint-Weight", "2".into())));
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"service": {"namespace": "ns", "name": "web"},
                               "localEndpoints": 2, "serviceProxyHealthy": true})
        );
        assert_eq!(response(31001, "/", &st, now).0, "503 Service Unavailable");
        // A port no Service has (any more).
        assert_eq!(response(31002, "/", &st, now).0, "503 Service Unavailable");
    }

    #[test]
    fn the_proxy_health_is_ready_once_the_maps_were_written() {
        let mut st = State::default();
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert_eq!(
            response(PROXY_HEALTH_PORT, "/healthz", &st, now).0,
            "503 Service Unavailable"
        );
        st.updated = Some(now - Duration::from_secs(1));
        let (status, _, body) = response(PROXY_HEALTH_PORT, "/livez", &st, now);
        assert_eq!(status, "200 OK");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["nodeEligible"], true);
        assert_eq!(v["currentTime"], "2027-01-15T08:00:00.000000000Z");
        assert_eq!(v["lastUpdated"], "2027-01-15T07:59:59.000000000Z");
        assert_eq!(
            response(PROXY_HEALTH_PORT, "/metrics", &st, now).0,
            "404 Not Found"
        );
    }
}
