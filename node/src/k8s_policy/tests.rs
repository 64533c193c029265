//! The policy inputs against `rcni_fakeapi` with the real `kube` client.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, ContainerPort, Namespace, Pod, PodSpec};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicySpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use super::*;
use crate::registry::k8s::tests::{until, with_api};
use serde_json::json;

fn meta(ns: Option<&str>, name: &str, labels: &[(&str, &str)]) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: ns.map(str::to_string),
        labels: (!labels.is_empty()).then(|| {
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        }),
        ..Default::default()
    }
}

fn netpol(ns: &str, name: &str, app: &str) -> NetworkPolicy {
    NetworkPolicy {
        metadata: meta(Some(ns), name, &[]),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some([("app".to_string(), app.to_string())].into()),
                ..Default::default()
            }),
            policy_types: Some(vec!["Ingress".into()]),
            ..Default::default()
        }),
    }
}

fn pod(ns: &str, name: &str, node: &str, labels: &[(&str, &str)]) -> Pod {
    Pod {
        metadata: meta(Some(ns), name, labels),
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            containers: vec![Container {
                name: "c".into(),
                ports: Some(vec![ContainerPort {
                    name: Some("http".into()),
                    container_port: 8080,
                    ..Default::default()
                }]),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: None,
    }
}

async fn ask(socket: &Path, ns: &str, name: &str) -> Value {
    ask_raw(socket, &json!({"namespace": ns, "name": name}).to_string()).await
}

fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn policies_namespaces_mirrored_and_pod_labels_answered() {
    with_api(async |api, kc| {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("policy.d");
        let socket = tmp.path().join("run/agent.sock");
        std::fs::create_dir_all(&dir).unwrap();
        // An admin's own file, and a stale mirror of a policy deleted
        // while the agent was not running.
        std::fs::write(dir.join("local.json"), "[]").unwrap();
        std::fs::write(dir.join("k8s-netpol-prod_gone.json"), "[]").unwrap();
        api.put(&netpol("prod", "web", "web"));
        api.put(&Namespace {
            metadata: meta(None, "prod", &[("team", "a")]),
            ..Default::default()
        });
        api.put(&pod("prod", "web-1", "n1", &[("app", "web")]));
        api.put(&pod("prod", "db-1", "n2", &[("app", "db")]));

        let client = crate::registry::k8s::client(Some(&kc)).await.unwrap();
        let _inputs = start(client, dir.clone(), "n1", &socket, None, ServiceMirror::On).unwrap();
        {
            use std::os::unix::fs::PermissionsExt;
            let m = std::fs::metadata(&socket).unwrap().permissions().mode();
            assert_eq!(m & 0o777, 0o600);
        }
        until("first list mirrored", || {
            files(&dir) == ["k8s-netpol-prod_web.json", "k8s-ns-prod.json", "local.json"]
        })
        .await;
        let v: Value =
            serde_json::from_slice(&std::fs::read(dir.join("k8s-netpol-prod_web.json")).unwrap())
                .unwrap();
        assert_eq!(v["kind"], "NetworkPolicy");
        assert_eq!(v["spec"]["podSelector"]["matchLabels"]["app"], "web");
        let v: Value =
            serde_json::from_slice(&std::fs::read(dir.join("k8s-ns-prod.json")).unwrap()).unwrap();
        assert_eq!(
            (v["kind"].as_str(), v["metadata"]["labels"]["team"].as_str()),
            (Some("Namespace"), Some("a"))
        );

        // Changed, added, deleted: the files follow.
        api.put(&netpol("prod", "web", "web2"));
        until("policy changed", || {
            std::fs::read_to_string(dir.join("k8s-netpol-prod_web.json"))
                .is_ok_and(|t| t.contains("web2"))
        })
        .await;
        api.put(&netpol("dev", "all", "x"));
        until("policy added", || {
            dir.join("k8s-netpol-dev_all.json").exists()
        })
        .await;
        api.delete::<NetworkPolicy>(Some("prod"), "web");
        until("policy deleted", || {
            !dir.join("k8s-netpol-prod_web.json").exists()
        })
        .await;

        // This node's pods only, with labels and named ports.
        let mut a = Value::Null;
        for _ in 0..500 {
            a = ask(&socket, "prod", "web-1").await;
            if a["found"] == true {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(a["labels"]["app"], "web", "{a}");
        assert_eq!(a["ports"]["http"], json!(["TCP", 8080]), "{a}");
        let b = ask(&socket, "prod", "db-1").await;
        assert_eq!(
            (b["synced"].clone(), b["found"].clone()),
            (json!(true), json!(false)),
            "{b}"
        );
        // A label change reaches the answer, no re-add.
        api.put(&pod(
            "prod",
            "web-1",
            "n1",
            &[("app", "web"), ("tier", "front")],
        ));
        for _ in 0..500 {
            a = ask(&socket, "prod", "web-1").await;
            if a["labels"]["tier"] == "front" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(a["labels"]["tier"], "front", "{a}");
        assert!(ask(&socket, "x", "y").await["found"] == false);
        let bad = ask_raw(&socket, "nonsense").await;
        assert!(bad["error"].is_string(), "{bad}");

        // The API server gone: files and answers stay.
        api.set_down(true);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(dir.join("k8s-netpol-dev_all.json").exists());
        assert_eq!(ask(&socket, "prod", "web-1").await["found"], true);
    });
}

async fn ask_raw(socket: &Path, line: &str) -> Value {
    let s = tokio::net::UnixStream::connect(socket).await.unwrap();
    let (r, mut w) = s.into_split();
    w.write_all(format!("{line}\n").as_bytes()).await.unwrap();
    let line = BufReader::new(r)
        .lines()
        .next_line()
        .await
        .unwrap()
        .unwrap();
    serde_json::from_str(&line).unwrap()
}

/// A stand-in `policy` binary that appends its arguments to `calls`.
/// With kube-proxy replaced, Services reach the plugin already
/// translated: no Service or EndpointSlice is mirrored, and those an
/// earlier run mirrored go.
#[test]
fn without_kube_proxy_services_are_not_mirrored_and_old_mirrors_go() {
    with_api(async |api, kc| {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("policy.d");
        let socket = tmp.path().join("run/agent.sock");
        std::fs::create_dir_all(&dir).unwrap();
        for f in [
            "k8s-svc-prod_web.json",
            "k8s-eps-prod_web-x.json",
            "local.json",
        ] {
            std::fs::write(dir.join(f), "{}").unwrap();
        }
        api.put(&netpol("prod", "web", "web"));
        api.put(&k8s_openapi::api::core::v1::Service {
            metadata: meta(Some("prod"), "web", &[]),
            ..Default::default()
        });
        let client = crate::registry::k8s::client(Some(&kc)).await.unwrap();
        let _inputs = start(client, dir.clone(), "n1", &socket, None, ServiceMirror::Off).unwrap();
        until("first list mirrored", || {
            files(&dir) == ["k8s-netpol-prod_web.json", "local.json"]
        })
        .await;
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert_eq!(files(&dir), ["k8s-netpol-prod_web.json", "local.json"]);
    });
}

fn fake_policy(dir: &Path) -> (PathBuf, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let bin = dir.join("policy");
    let calls = dir.join("calls");
    std::fs::write(
        &bin,
        format!("#!/bin/sh\necho \"$*\" >> {}\n", calls.display()),
    )
    .unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    (bin, calls)
}

/// Once the syncs have stopped coming (none for five debounce times): a
/// change seen during a debounce leaves one more sync behind the first,
/// which under load can start well after the debounce.
async fn settled(path: &Path) {
    let mut n = calls(path).len();
    for _ in 0..40 {
        tokio::time::sleep(DEBOUNCE * 5).await;
        let now = calls(path).len();
        if now == n {
            return;
        }
        n = now;
    }
    panic!("the syncs never stopped: {:?}", calls(path));
}

/// The `policy sync` runs (the flow collector's are [`collector_runs`]).
fn calls(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.starts_with("flows "))
        .map(str::to_string)
        .collect()
}

/// The runs of the flow collector (`policy flows --follow`).
fn collector_runs(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("flows "))
        .map(str::to_string)
        .collect()
}

#[test]
fn changes_run_policy_sync_debounced_and_new_pods_do_not() {
    with_api(async |api, kc| {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("policy.d");
        let socket = tmp.path().join("agent.sock");
        let (bin, log) = fake_policy(tmp.path());
        api.put(&pod("prod", "web-1", "n1", &[("app", "web")]));
        let client = crate::registry::k8s::client(Some(&kc)).await.unwrap();
        let sync = SyncCommand {
            bin,
            network: "rcni".into(),
            data_dir: Some("/d".into()),
        };
        let _inputs = start(
            client,
            dir.clone(),
            "n1",
            &socket,
            Some(sync),
            ServiceMirror::On,
        )
        .unwrap();
        for _ in 0..500 {
            if ask(&socket, "prod", "web-1").await["synced"] == true {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Nothing mirrored, no pod changed: no sync.
        tokio::time::sleep(DEBOUNCE * 3).await;
        assert_eq!(calls(&log), Vec::<String>::new());

        // A burst of policies: one sync (two at most, if the burst
        // straddles a run), with the network and the data dir.
        for i in 0..5 {
            api.put(&netpol("prod", &format!("p{i}"), "web"));
        }
        until("a sync", || !calls(&log).is_empty()).await;
        settled(&log).await;
        let c = calls(&log);
        assert!((1..=2).contains(&c.len()), "{c:?}");
        assert_eq!(c[0], "sync --network rcni --data-dir /d");

        // A new pod's labels come with its ADD: no sync; a label change
        // of a known pod does.
        api.put(&pod("prod", "web-2", "n1", &[("app", "web")]));
        tokio::time::sleep(DEBOUNCE * 3).await;
        let n = calls(&log).len();
        assert_eq!(n, c.len());
        api.put(&pod("prod", "web-1", "n1", &[("app", "db")]));
        until("a sync for the label", || calls(&log).len() > n).await;
        // The flow collector runs beside, for the same network and data
        // dir; this fake exits at once, so it is started again with
        // backoff (1 s, 2 s, ...), not in a loop.
        let runs = collector_runs(&log);
        assert!((1..=4).contains(&runs.len()), "{runs:?}");
        assert_eq!(
            runs[0],
            "flows --follow --network rcni --node n1 --data-dir /d"
        );
    });
}

fn remote_pod_of(ns: &str, name: &str, node: &str, app: &str, ips: &[&str]) -> Pod {
    use k8s_openapi::api::core::v1::{PodIP, PodStatus};
    let mut p = pod(ns, name, node, &[("app", app)]);
    p.status = Some(PodStatus {
        phase: Some("Running".into()),
        pod_ip: ips.first().map(|i| i.to_string()),
        pod_ips: Some(ips.iter().map(|i| PodIP { ip: i.to_string() }).collect()),
        ..Default::default()
    });
    p
}

/// The remote pods' file as (namespace/name, app label, addresses).
fn remote_file(dir: &Path) -> Option<Vec<(String, String, Vec<String>)>> {
    let v: Value = serde_json::from_slice(&std::fs::read(dir.join(REMOTE_PODS_FILE)).ok()?).ok()?;
    assert_eq!(v["kind"], "PodList");
    Some(
        v["items"]
            .as_array()?
            .iter()
            .map(|p| {
                (
                    format!(
                        "{}/{}",
                        p["metadata"]["namespace"].as_str().unwrap(),
                        p["metadata"]["name"].as_str().unwrap()
                    ),
                    p["metadata"]["labels"]["app"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                    p["status"]["podIPs"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|i| i["ip"].as_str().unwrap().to_string())
                        .collect(),
                )
            })
            .collect(),
    )
}

fn entry(name: &str, app: &str, ips: &[&str]) -> (String, String, Vec<String>) {
    (
        name.to_string(),
        app.to_string(),
        ips.iter().map(|i| i.to_string()).collect(),
    )
}

#[test]
fn other_nodes_pods_are_written_for_the_plugin_and_follow_the_api() {
    with_api(async |api, kc| {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("policy.d");
        let socket = tmp.path().join("agent.sock");
        let (bin, log) = fake_policy(tmp.path());
        std::fs::create_dir_all(&dir).unwrap();
        // An earlier run's file: replaced by the first list.
        std::fs::write(
            dir.join(REMOTE_PODS_FILE),
            remote_content(
                &[(
                    ("prod".to_string(), "gone".to_string()),
                    RemotePod {
                        node: "n9".into(),
                        labels: Default::default(),
                        ips: vec!["10.244.9.9".into()],
                        ports: vec![],
                    },
                )]
                .into(),
            ),
        )
        .unwrap();
        api.put(&remote_pod_of(
            "prod",
            "web-1",
            "n1",
            "web",
            &["10.244.1.5"],
        ));
        api.put(&remote_pod_of(
            "prod",
            "client",
            "n2",
            "client",
            &["10.244.2.5", "fd00:2::5"],
        ));
        // Not peers: no address yet, host network, finished.
        api.put(&pod("prod", "pending", "n2", &[("app", "client")]));
        let mut host = remote_pod_of("prod", "host", "n2", "client", &["192.168.50.2"]);
        host.spec.as_mut().unwrap().host_network = Some(true);
        api.put(&host);
        let mut done = remote_pod_of("prod", "done", "n3", "client", &["10.244.3.9"]);
        done.status.as_mut().unwrap().phase = Some("Succeeded".into());
        api.put(&done);

        let client = crate::registry::k8s::client(Some(&kc)).await.unwrap();
        let sync = SyncCommand {
            bin,
            network: "rcni".into(),
            data_dir: None,
        };
        let _inputs = start(
            client,
            dir.clone(),
            "n1",
            &socket,
            Some(sync),
            ServiceMirror::On,
        )
        .unwrap();
        let d = dir.as_path();
        let want =
            |v: Vec<(String, String, Vec<String>)>| move || remote_file(d) == Some(v.clone());
        until(
            "the first list written",
            want(vec![entry(
                "prod/client",
                "client",
                &["10.244.2.5", "fd00:2::5"],
            )]),
        )
        .await;
        // With its named ports, for egress rules that name the peer's port.
        let file: Value =
            serde_json::from_slice(&std::fs::read(dir.join(REMOTE_PODS_FILE)).unwrap()).unwrap();
        assert_eq!(
            file["items"][0]["spec"]["containers"],
            json!([{"ports": [{"name": "http", "containerPort": 8080}]}])
        );
        // This node's pod is answered on the socket, as before.
        assert_eq!(ask(&socket, "prod", "web-1").await["found"], true);
        until("a sync for the file", || !calls(&log).is_empty()).await;

        // Added (its address came), relabeled, re-addressed, deleted: the
        // file follows, and each change runs a sync.
        let log = log.as_path();
        let syncs = |n: usize| move || calls(log).len() > n;
        let n = calls(log).len();
        api.put(&remote_pod_of(
            "prod",
            "pending",
            "n2",
            "client",
            &["10.244.2.6"],
        ));
        until(
            "added",
            want(vec![
                entry("prod/client", "client", &["10.244.2.5", "fd00:2::5"]),
                entry("prod/pending", "client", &["10.244.2.6"]),
            ]),
        )
        .await;
        until("a sync for the new pod", syncs(n)).await;
        let n = calls(log).len();
        api.put(&remote_pod_of(
            "prod",
            "client",
            "n2",
            "other",
            &["10.244.2.5", "fd00:2::5"],
        ));
        until(
            "relabeled",
            want(vec![
                entry("prod/client", "other", &["10.244.2.5", "fd00:2::5"]),
                entry("prod/pending", "client", &["10.244.2.6"]),
            ]),
        )
        .await;
        until("a sync for the label", syncs(n)).await;
        // The same pod again, nothing a peer depends on changed: no sync.
        settled(log).await;
        let n = calls(log).len();
        let mut same = remote_pod_of("prod", "pending", "n2", "client", &["10.244.2.6"]);
        same.metadata.annotations = Some([("x".to_string(), "y".to_string())].into());
        api.put(&same);
        tokio::time::sleep(DEBOUNCE * 3).await;
        assert_eq!(calls(log).len(), n);
        // Finished: it goes.
        let mut fin = remote_pod_of("prod", "pending", "n2", "client", &["10.244.2.6"]);
        fin.status.as_mut().unwrap().phase = Some("Failed".into());
        api.put(&fin);
        until(
            "finished",
            want(vec![entry(
                "prod/client",
                "other",
                &["10.244.2.5", "fd00:2::5"],
            )]),
        )
        .await;
        assert!(api.delete::<Pod>(Some("prod"), "pending"));
        api.put(&remote_pod_of("dev", "db", "n3", "db", &["10.244.3.7"]));
        until(
            "another added",
            want(vec![
                entry("dev/db", "db", &["10.244.3.7"]),
                entry("prod/client", "other", &["10.244.2.5", "fd00:2::5"]),
            ]),
        )
        .await;
        let n = calls(log).len();
        assert!(api.delete::<Pod>(Some("dev"), "db"));
        until(
            "deleted",
            want(vec![entry(
                "prod/client",
                "other",
                &["10.244.2.5", "fd00:2::5"],
            )]),
        )
        .await;
        until("a sync for the deletion", syncs(n)).await;

        // The server gone: the file stays, however long.
        api.set_down(true);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            remote_file(&dir),
            Some(vec![entry(
                "prod/client",
                "other",
                &["10.244.2.5", "fd00:2::5"]
            )])
        );
        // Changes it missed, and a history that no longer reaches back:
        // back up, the watch is told 410 Gone, lists again, and the list
        // replaces the file.
        let lists = api.lists_of("/api/v1/pods");
        assert!(api.delete::<Pod>(Some("prod"), "client"));
        api.put(&remote_pod_of(
            "prod",
            "new",
            "n3",
            "client",
            &["10.244.3.8"],
        ));
        api.compact();
        api.set_down(false);
        until(
            "relisted after 410",
            want(vec![entry("prod/new", "client", &["10.244.3.8"])]),
        )
        .await;
        assert!(api.lists_of("/api/v1/pods") > lists);
    });
}
