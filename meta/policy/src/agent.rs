//! The client of `rcni-node`'s pod socket (`agentSocket`): one JSON line
//! `{"namespace", "name"}` out, one line back, `{"synced": false}`,
//! `{"synced": true, "found": false}` or `{"synced": true, "found": true,
//! "labels": {...}, "ports": {"http": ["TCP", 8080]}}` (the types are
//! `rcni_agent_proto::socket`'s, shared with the agent).
//!
//! Kubernetes runtimes send no labels, only K8S_POD_NAMESPACE and
//! K8S_POD_NAME: the agent, which watches this node's Pods, is where a
//! pod's labels are. When it cannot say (not running, not yet listed, the
//! Pod not seen yet) ADD fails with code 11 so the kubelet retries, rather
//! than attach a pod policed as if it had no labels.

use crate::model::{Labels, NamedPorts, validate_labels};
use rcni_agent_proto::socket::{PodAnswer, PodQuery};
use rcni_cni::{CniError, ErrorCode};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// How long ADD keeps asking before code 11: a Pod the kubelet runs has
/// usually reached the agent's watch by then.
pub const ADD_PATIENCE: Duration = Duration::from_secs(1);
const RETRY_EVERY: Duration = Duration::from_millis(100);
/// One exchange; the agent answers from memory.
const IO_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodInfo {
    pub labels: Labels,
    pub ports: NamedPorts,
}

/// Why one attempt gave no labels.
#[derive(Debug)]
enum Miss {
    /// Worth asking again: unreachable, not synced, not found.
    Later(String),
    /// A bad answer: asking again will not help.
    Bad(String),
}

fn once(socket: &Path, ns: &str, name: &str) -> Result<PodInfo, Miss> {
    let at = |e: std::io::Error| {
        Miss::Later(format!(
            "the rcni-node agent's socket {}: {e}",
            socket.display()
        ))
    };
    let mut s = UnixStream::connect(socket).map_err(at)?;
    s.set_read_timeout(Some(IO_TIMEOUT)).map_err(at)?;
    s.set_write_timeout(Some(IO_TIMEOUT)).map_err(at)?;
    let query = PodQuery {
        namespace: ns.into(),
        name: name.into(),
    };
    let mut req = serde_json::to_string(&query).map_err(|e| Miss::Bad(e.to_string()))?;
    req.push('\n');
    s.write_all(req.as_bytes()).map_err(at)?;
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line).map_err(at)?;
    if line.is_empty() {
        return Err(Miss::Later(format!(
            "the rcni-node agent closed {} without an answer",
            socket.display()
        )));
    }
    let a: PodAnswer = serde_json::from_str(&line)
        .map_err(|e| Miss::Bad(format!("the rcni-node agent's answer {line:?}: {e}")))?;
    if let Some(e) = a.error {
        return Err(Miss::Bad(format!("the rcni-node agent: {e}")));
    }
    if !a.is_synced() {
        return Err(Miss::Later(
            "the rcni-node agent has not listed this node's Pods from the Kubernetes API yet"
                .into(),
        ));
    }
    if !a.is_found() {
        return Err(Miss::Later(format!(
            "the rcni-node agent does not know Pod {ns}/{name} on this node (yet)"
        )));
    }
    let labels = a.labels.unwrap_or_default();
    validate_labels(&labels)
        .map_err(|e| Miss::Bad(format!("the rcni-node agent's labels for {ns}/{name}: {e}")))?;
    let mut ports = NamedPorts::new();
    for (n, (proto, port)) in a.ports.unwrap_or_default() {
        // A port the model cannot use is left out: it resolves to nothing.
        if let Ok(p) = u16::try_from(port)
            && p != 0
            && crate::model::proto_number(&proto).is_some()
        {
            ports.insert(n, (proto, p));
        }
    }
    Ok(PodInfo { labels, ports })
}

/// Asks for `ns/name` until `patience` runs out; code 11 (try again
/// later) when the agent cannot say, with what to check.
pub fn ask(socket: &Path, ns: &str, name: &str, patience: Duration) -> Result<PodInfo, CniError> {
    let start = Instant::now();
    loop {
        match once(socket, ns, name) {
            Ok(p) => return Ok(p),
            Err(Miss::Bad(m)) => {
                return Err(CniError::new(
                    ErrorCode::TryAgainLater,
                    format!("policy: {m}"),
                ));
            }
            Err(Miss::Later(m)) if start.elapsed() + RETRY_EVERY > patience => {
                return Err(CniError::new(
                    ErrorCode::TryAgainLater,
                    format!(
                        "policy: {m}; the pod is not attached unpoliced: check that rcni-node \
                         runs on this node with --policy-dir and --agent-socket {} and reaches \
                         the Kubernetes API (its log)",
                        socket.display()
                    ),
                ));
            }
            Err(Miss::Later(_)) => std::thread::sleep(RETRY_EVERY),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A fake agent answering every request with `answers` in turn (the
    /// last one repeated); returns how many requests it saw.
    fn fake(path: &Path, answers: Vec<&'static str>) -> std::thread::JoinHandle<usize> {
        let l = UnixListener::bind(path).unwrap();
        l.set_nonblocking(false).unwrap();
        std::thread::spawn(move || {
            let mut n = 0;
            for s in l.incoming() {
                let Ok(s) = s else { break };
                let mut line = String::new();
                if BufReader::new(&s).read_line(&mut line).unwrap_or(0) == 0 {
                    // The test's "done" connection.
                    break;
                }
                let req: serde_json::Value = serde_json::from_str(&line).unwrap();
                assert_eq!(req["namespace"], "prod");
                assert_eq!(req["name"], "web-1");
                let a = answers[n.min(answers.len() - 1)];
                n += 1;
                (&s).write_all(format!("{a}\n").as_bytes()).unwrap();
            }
            n
        })
    }

    fn done(path: &Path, h: std::thread::JoinHandle<usize>) -> usize {
        drop(UnixStream::connect(path).unwrap());
        h.join().unwrap()
    }

    #[test]
    fn refused_or_missing_is_try_again_later() {
        let d = tempfile::tempdir().unwrap();
        let missing = d.path().join("agent.sock");
        let e = ask(&missing, "prod", "web-1", Duration::from_millis(300)).unwrap_err();
        assert_eq!(e.code, 11);
        assert!(
            e.msg.contains("rcni-node") && e.msg.contains("agent.sock"),
            "{}",
            e.msg
        );
        // A socket file nobody listens on: connection refused.
        drop(UnixListener::bind(&missing).unwrap());
        let e = ask(&missing, "prod", "web-1", Duration::from_millis(300)).unwrap_err();
        assert_eq!(e.code, 11);
        assert!(e.msg.contains("refused"), "{}", e.msg);
    }

    #[test]
    fn not_synced_is_retried_then_try_again_later() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.sock");
        let h = fake(&p, vec![r#"{"synced":false}"#]);
        let e = ask(&p, "prod", "web-1", ADD_PATIENCE).unwrap_err();
        assert_eq!(e.code, 11);
        assert!(e.msg.contains("not listed"), "{}", e.msg);
        // It asked more than once before giving up.
        assert!(done(&p, h) > 1);
    }

    #[test]
    fn found_after_not_found_gives_labels_and_ports() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.sock");
        let h = fake(
            &p,
            vec![
                r#"{"synced":true,"found":false}"#,
                r#"{"synced":true,"found":true,"labels":{"app":"web"},"ports":{"http":["TCP",8080],"bad":["ICMP",1],"big":["UDP",70000]}}"#,
            ],
        );
        let info = ask(&p, "prod", "web-1", ADD_PATIENCE).unwrap();
        assert_eq!(info.labels, [("app".to_string(), "web".to_string())].into());
        assert_eq!(
            info.ports,
            [("http".to_string(), ("TCP".to_string(), 8080))].into()
        );
        assert_eq!(done(&p, h), 2);
    }

    #[test]
    fn not_found_for_long_is_try_again_later_and_bad_answers_are_not_retried() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.sock");
        let h = fake(&p, vec![r#"{"synced":true,"found":false}"#]);
        let e = ask(&p, "prod", "web-1", Duration::from_millis(300)).unwrap_err();
        assert_eq!(e.code, 11);
        assert!(e.msg.contains("prod/web-1"), "{}", e.msg);
        done(&p, h);
        let p2 = d.path().join("b.sock");
        let h = fake(
            &p2,
            vec![r#"{"synced":true,"found":true,"labels":{"bad key":"x"}}"#],
        );
        let e = ask(&p2, "prod", "web-1", ADD_PATIENCE).unwrap_err();
        assert_eq!(e.code, 11);
        assert_eq!(done(&p2, h), 1);
    }
}
