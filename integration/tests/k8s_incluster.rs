//! `rcni-node run --kubernetes` without `--kubeconfig`, as in its DaemonSet
//! pod: kube's in-cluster config (`KUBERNETES_SERVICE_HOST`/`_PORT`, the
//! service account's token and CA under
//! `/var/run/secrets/kubernetes.io/serviceaccount/`), against the fake API
//! server over TLS with a certificate made for the test.
//!
//! kube reads those files at fixed paths: the agent runs under
//! `unshare --mount` (private propagation) with a tmpfs over `/var` holding
//! them, so the host's `/var` is never written.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use rcni_fakeapi::FakeApi;
use rcni_integration::lab::kube::{Agent, knode};
use rcni_testkit::{TestNs, bin, ip, poll, tied_command_in};

const SA_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
const TOKEN: &str = "eyJhbGciOiJSUzI1NiJ9.rcni-test-token.sig";

/// A node namespace with its underlay address, and the API server on it
/// over TLS.
struct Lab {
    ns: TestNs,
    api: FakeApi,
    ca: String,
    dir: tempfile::TempDir,
}

impl Lab {
    fn new() -> Lab {
        let ns = TestNs::new();
        ip(&ns.ns, "link set lo up");
        ip(&ns.ns, "link add eth0 type veth peer name eth1");
        ip(&ns.ns, "link set eth1 up");
        ip(&ns.ns, "addr add 192.168.77.1/24 dev eth0");
        ip(&ns.ns, "link set eth0 up");
        let listener = ns
            .ns
            .run(|| std::net::TcpListener::bind("192.168.77.1:0").unwrap())
            .unwrap();
        let (api, ca) = FakeApi::start_tls(listener, "192.168.77.1");
        api.put(&knode("n1", "192.168.77.1", "10.244.1.0/24"));
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("net-conf.json"),
            r#"{"network": "10.244.0.0/16", "backend": "host-gw"}"#,
        )
        .unwrap();
        std::fs::create_dir_all(dir.path().join("home")).unwrap();
        Lab { ns, api, ca, dir }
    }

    /// The service account's files, with `ca` as its CA.
    fn service_account(&self, ca: &str) -> std::path::PathBuf {
        let sa = self.dir.path().join("sa");
        std::fs::create_dir_all(&sa).unwrap();
        std::fs::write(sa.join("token"), TOKEN).unwrap();
        std::fs::write(sa.join("ca.crt"), ca).unwrap();
        std::fs::write(sa.join("namespace"), "kube-system").unwrap();
        sa
    }

    /// The agent as its pod runs it: no kubeconfig anywhere, the service
    /// account's files at kube's paths in a mount namespace of its own.
    fn agent(&self, sa: &Path, extra: &[&str]) -> Command {
        let d = self.dir.path();
        let mut cmd = tied_command_in(&self.ns.ns, "unshare");
        cmd.args(["--mount", "--propagation", "private", "sh", "-ec"])
            .arg(format!(
                "mount -t tmpfs rcni-test /var; mkdir -p {SA_DIR}; cp \"$0\"/* {SA_DIR}/; exec \"$@\""
            ))
            .arg(sa)
            .arg(bin("rcni-node"))
            .args(["run", "--kubernetes", "--node", "n1"])
            .arg("--net-conf")
            .arg(d.join("net-conf.json"))
            .arg("--cni-conf-dir")
            .arg(d.join("net.d"))
            .arg("--state-dir")
            .arg(d.join("state"))
            .args(extra)
            .env_remove("KUBECONFIG")
            .env("HOME", d.join("home"))
            .env("KUBERNETES_SERVICE_HOST", "192.168.77.1")
            .env("KUBERNETES_SERVICE_PORT", self.api.addr().port().to_string());
        cmd
    }
}

#[test]
fn in_cluster_config_reaches_the_api_over_tls_with_the_service_account_token() {
    let lab = Lab::new();
    let sa = lab.service_account(&lab.ca);
    let out = lab.agent(&sa, &["--once"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    // It listed, wrote the node's conflist from its Node, and patched the
    // Node's annotations: every request over TLS with the token.
    let conflist = lab.dir.path().join("net.d/10-rcni.conflist");
    let text = std::fs::read_to_string(&conflist).unwrap_or_default();
    assert!(text.contains("10.244.1.0/24"), "{text}\n{err}");
    assert!(
        lab.api
            .patches()
            .iter()
            .any(|p| p.path == "/api/v1/nodes/n1"),
        "{:?}",
        lab.api.patches()
    );
    let auth = lab.api.authorizations();
    assert!(!auth.is_empty());
    assert!(
        auth.iter().all(|a| *a == format!("Bearer {TOKEN}")),
        "{auth:?}"
    );
    // Nothing of it on the host.
    assert!(!Path::new(SA_DIR).exists());
}

#[test]
fn a_server_certificate_of_another_ca_is_refused() {
    let lab = Lab::new();
    // A CA that did not sign the server's certificate.
    let other = {
        let ns = TestNs::new();
        ip(&ns.ns, "link set lo up");
        let l = ns
            .ns
            .run(|| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
            .unwrap();
        FakeApi::start_tls(l, "192.168.77.1").1
    };
    let sa = lab.service_account(&other);
    let log = lab.dir.path().join("agent.log");
    let _agent = Agent(
        lab.agent(&sa, &[])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let mut text = String::new();
    poll(Duration::from_secs(10), || {
        text = std::fs::read_to_string(&log).unwrap_or_default();
        text.contains("Kubernetes API")
    });
    // The agent spells out kube's "client error (Connect)": the
    // certificate. No request got past the handshake, and no conflist was
    // written.
    assert!(
        text.contains("(Connect): invalid peer certificate"),
        "{text}"
    );
    assert!(lab.api.requests().is_empty(), "{:?}", lab.api.requests());
    assert!(!lab.dir.path().join("net.d/10-rcni.conflist").exists());
}
