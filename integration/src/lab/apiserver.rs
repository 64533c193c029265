//! A real kube-apiserver and its etcd, from scripts/k8s-build's cache, in a
//! namespace of a simulated cluster: what the agents of
//! [`super::kube::KubeApi`] read when the cache holds it. No controller
//! manager, scheduler or kubelet: the tests make the Nodes, Pods and
//! policies themselves, as the fake server's tests do. RBAC is on, and the
//! agents use the DaemonSet's own service account, bound as deploy/rcni.yaml
//! binds it: a verb the manifest lacks fails here as in a cluster.

use std::path::{Path, PathBuf};
use std::process::{Child, Output};
use std::time::Duration;

use k8s_openapi::Resource;
use rcni_netns::NetNs;
use rcni_testkit::tied_command_in;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::k8s::{Cache, ca_and_sa_keys, cert};

pub struct RealApi {
    ns: NetNs,
    kubectl: PathBuf,
    dir: tempfile::TempDir,
    procs: Vec<Child>,
    /// The agents' kubeconfig: the DaemonSet's service account's token.
    pub kubeconfig: PathBuf,
}

impl RealApi {
    /// The server listening on `host` (an address of `ns`, IPv4 or IPv6)
    /// port 6443, ready, with deploy/rcni.yaml applied; or why it cannot
    /// run here (no cache: the command that builds it).
    pub fn start(ns: &NetNs, host: &str) -> Result<RealApi, String> {
        let cache = Cache::find_bin()?;
        let dir = tempfile::Builder::new()
            .prefix("rcni-apiserver.")
            .tempdir()
            .map_err(|e| e.to_string())?;
        let mut api = RealApi {
            ns: ns.try_clone().map_err(|e| e.to_string())?,
            kubectl: cache.bin.join("kubectl"),
            kubeconfig: dir.path().join("agent.kubeconfig"),
            dir,
            procs: Vec::new(),
        };
        let d = api.dir.path().to_path_buf();
        let pki = d.join("pki");
        std::fs::create_dir_all(&pki).map_err(|e| e.to_string())?;
        ca_and_sa_keys(&pki, "rcni-test-ca");
        cert(
            &pki,
            "apiserver",
            "kube-apiserver",
            "",
            &format!("IP:{host},IP:127.0.0.1"),
        );
        cert(&pki, "admin", "kubernetes-admin", "system:masters", "");
        let url = if host.contains(':') {
            format!("https://[{host}]:6443")
        } else {
            format!("https://{host}:6443")
        };
        let ca = pki.join("ca.crt");
        std::fs::write(
            d.join("admin.kubeconfig"),
            kubeconfig(
                &url,
                &ca,
                &format!(
                    "{{client-certificate: {}, client-key: {}}}",
                    pki.join("admin.crt").display(),
                    pki.join("admin.key").display()
                ),
            ),
        )
        .map_err(|e| e.to_string())?;
        let p = |rel: &str| d.join(rel).display().to_string();
        // etcd serves the server on loopback.
        rcni_testkit::ip(ns, "link set lo up");
        api.spawn(
            &cache.bin.join("etcd"),
            &[
                format!("--data-dir={}", p("etcd")),
                "--listen-client-urls=http://127.0.0.1:2379".into(),
                "--advertise-client-urls=http://127.0.0.1:2379".into(),
                "--listen-peer-urls=http://127.0.0.1:2380".into(),
                "--initial-advertise-peer-urls=http://127.0.0.1:2380".into(),
                "--initial-cluster=default=http://127.0.0.1:2380".into(),
                "--unsafe-no-fsync".into(),
            ],
            "etcd.log",
        )?;
        api.spawn(
            &cache.bin.join("kube-apiserver"),
            &[
                "--etcd-servers=http://127.0.0.1:2379".into(),
                format!("--advertise-address={host}"),
                format!("--bind-address={host}"),
                "--secure-port=6443".into(),
                format!("--tls-cert-file={}", p("pki/apiserver.crt")),
                format!("--tls-private-key-file={}", p("pki/apiserver.key")),
                format!("--client-ca-file={}", p("pki/ca.crt")),
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                format!("--service-account-key-file={}", p("pki/sa.pub")),
                format!("--service-account-signing-key-file={}", p("pki/sa.key")),
                // The Service range's family is the advertised address's.
                format!(
                    "--service-cluster-ip-range={}",
                    if host.contains(':') {
                        "fd00:96::/112"
                    } else {
                        "10.96.0.0/16"
                    }
                ),
                "--authorization-mode=RBAC".into(),
                // No controller manager makes the namespaces' default
                // service accounts the admission plugin would wait for:
                // the tests' pods run nowhere and mount nothing.
                "--disable-admission-plugins=ServiceAccount".into(),
            ],
            "kube-apiserver.log",
        )?;
        let limit = Duration::from_secs(90);
        let t0 = std::time::Instant::now();
        while !api.kubectl(&["get", "--raw", "/readyz"]).status.success() {
            let exited = api
                .procs
                .iter_mut()
                .any(|c| !matches!(c.try_wait(), Ok(None)));
            if exited || t0.elapsed() > limit {
                return Err(format!(
                    "kube-apiserver not ready ({}): {}\netcd: {}",
                    if exited {
                        "a process exited"
                    } else {
                        "timed out"
                    },
                    api.log("kube-apiserver.log"),
                    api.log("etcd.log")
                ));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        // The manifest's namespace, service account and RBAC, as a user
        // applies them (its DaemonSet would run nowhere here).
        let manifest = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/rcni.yaml"),
        )
        .map_err(|e| format!("deploy/rcni.yaml: {e}"))?;
        let rbac: Vec<&str> = manifest
            .split("\n---")
            .filter(|doc| {
                doc.lines().any(|l| {
                    matches!(
                        l.trim_end(),
                        "kind: Namespace"
                            | "kind: ServiceAccount"
                            | "kind: ClusterRole"
                            | "kind: ClusterRoleBinding"
                    )
                })
            })
            .collect();
        let o = api.kubectl_input(&["apply", "-f", "-"], Some(rbac.join("\n---\n").as_bytes()));
        if !o.status.success() {
            return Err(format!(
                "apply deploy/rcni.yaml's RBAC: {}",
                String::from_utf8_lossy(&o.stderr)
            ));
        }
        let token = api.kubectl_ok(&[
            "create",
            "token",
            "rcni-node",
            "-n",
            "rcni-system",
            "--duration=4h",
        ])?;
        std::fs::write(
            &api.kubeconfig,
            kubeconfig(&url, &ca, &format!("{{token: {}}}", token.trim())),
        )
        .map_err(|e| e.to_string())?;
        Ok(api)
    }

    fn spawn(&mut self, program: &Path, args: &[String], log: &str) -> Result<(), String> {
        let log = std::fs::File::create(self.dir.path().join(log)).map_err(|e| e.to_string())?;
        let child = tied_command_in(&self.ns, program)
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("start {}: {e}", program.display()))?;
        self.procs.push(child);
        Ok(())
    }

    fn log(&self, name: &str) -> String {
        let l = std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
        let lines: Vec<&str> = l.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// kubectl as the admin, in the server's namespace.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        self.kubectl_input(args, None)
    }

    fn kubectl_input(&self, args: &[&str], input: Option<&[u8]>) -> Output {
        use std::io::Write;
        let mut cmd = self.ns.command(&self.kubectl);
        cmd.arg(format!(
            "--kubeconfig={}",
            self.dir.path().join("admin.kubeconfig").display()
        ))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn().expect("run kubectl");
        let mut stdin = child.stdin.take().expect("kubectl's stdin");
        if let Some(i) = input {
            stdin.write_all(i).expect("write kubectl's stdin");
        }
        drop(stdin);
        child.wait_with_output().expect("wait for kubectl")
    }

    fn kubectl_ok(&self, args: &[&str]) -> Result<String, String> {
        let o = self.kubectl(args);
        if o.status.success() {
            Ok(String::from_utf8_lossy(&o.stdout).into_owned())
        } else {
            Err(format!(
                "kubectl {args:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            ))
        }
    }

    /// Creates or replaces `obj` (server-side apply as the test's field
    /// manager), its status too; its namespace made first. Returns its
    /// resourceVersion.
    pub fn put<K: Resource + Serialize>(&self, obj: &K) -> u64 {
        let mut v = serde_json::to_value(obj).expect("serialise the object");
        let status = v.as_object_mut().and_then(|o| o.remove("status"));
        let name = v["metadata"]["name"].as_str().expect("a name").to_string();
        let ns = v["metadata"]["namespace"].as_str().map(str::to_string);
        if let Some(n) = &ns {
            let o = self.kubectl(&["create", "namespace", n]);
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(
                o.status.success() || err.contains("AlreadyExists"),
                "create namespace {n}: {err}"
            );
        }
        if let Some(m) = v["metadata"].as_object_mut() {
            m.remove("resourceVersion");
        }
        let o = self.kubectl_input(
            &[
                "apply",
                "--server-side",
                "--force-conflicts",
                "--field-manager=rcni-test",
                "-o",
                "json",
                "-f",
                "-",
            ],
            Some(v.to_string().as_bytes()),
        );
        assert!(
            o.status.success(),
            "apply {name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let mut out: Value = serde_json::from_slice(&o.stdout).expect("kubectl's JSON");
        if let Some(s) = status {
            let mut args = vec![
                "patch".to_string(),
                kind::<K>(),
                name.clone(),
                "--subresource=status".into(),
                "--type=merge".into(),
                "-o".into(),
                "json".into(),
                "-p".into(),
                serde_json::json!({ "status": s }).to_string(),
            ];
            if let Some(n) = &ns {
                args.extend(["-n".to_string(), n.clone()]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let o = self.kubectl(&args);
            assert!(
                o.status.success(),
                "status of {name}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            out = serde_json::from_slice(&o.stdout).expect("kubectl's JSON");
        }
        out["metadata"]["resourceVersion"]
            .as_str()
            .and_then(|r| r.parse().ok())
            .unwrap_or(0)
    }

    pub fn get<K: Resource + DeserializeOwned>(&self, ns: Option<&str>, name: &str) -> Option<K> {
        let kind = kind::<K>();
        let mut args = vec!["get", &kind, name, "-o", "json"];
        if let Some(n) = ns {
            args.extend(["-n", n]);
        }
        let o = self.kubectl(&args);
        if !o.status.success() {
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(err.contains("NotFound"), "get {kind} {name}: {err}");
            return None;
        }
        Some(serde_json::from_slice(&o.stdout).expect("the object's JSON"))
    }

    /// Deletes at once (a pod's kubelet is nobody here: no grace).
    pub fn delete<K: Resource>(&self, ns: Option<&str>, name: &str) -> bool {
        let kind = kind::<K>();
        let mut args = vec![
            "delete",
            &kind,
            name,
            "--grace-period=0",
            "--force",
            "--wait=false",
        ];
        if let Some(n) = ns {
            args.extend(["-n", n]);
        }
        let o = self.kubectl(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            o.status.success() || err.contains("NotFound"),
            "delete {kind} {name}: {err}"
        );
        o.status.success()
    }
}

impl Drop for RealApi {
    fn drop(&mut self) {
        for c in &mut self.procs {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// kubectl's name for `K`'s resource: `nodes`, `networkpolicies.networking.k8s.io`.
fn kind<K: Resource>() -> String {
    if K::GROUP.is_empty() {
        K::URL_PATH_SEGMENT.to_string()
    } else {
        format!("{}.{}", K::URL_PATH_SEGMENT, K::GROUP)
    }
}

fn kubeconfig(url: &str, ca: &Path, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\n\
         clusters: [{{name: t, cluster: {{server: \"{url}\", certificate-authority: {}}}}}]\n\
         users: [{{name: u, user: {user}}}]\n\
         contexts: [{{name: t, context: {{cluster: t, user: u}}}}]\n\
         current-context: t\n",
        ca.display()
    )
}
