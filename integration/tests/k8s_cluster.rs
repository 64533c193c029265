//! rcni under a real Kubernetes (integration/src/lab/k8s.rs): three nodes
//! of kubelet, containerd and kube-proxy built from the release's modules;
//! rcni installed as a user installs it, `kubectl apply -f deploy/rcni.yaml`
//! with its image; pods started by kubelet through containerd's CRI.
//!
//! Needs the caches scripts/k8s-build and scripts/k8s-images fill, and the
//! image scripts/image makes (target/dist/rcni-image-<arch>-<version>.tar,
//! or RCNI_IMAGE): without them each test says SKIP and which command makes
//! what is missing (fails, with RCNI_K8S_REQUIRED set, as scripts/test's k8s
//! stage sets it after making them).

use std::path::PathBuf;
use std::time::Duration;

use rcni_integration::lab::k8s::{AGNHOST, Cache, K8sLab};
use rcni_testkit::poll;
use rcni_testkit::require_root;

fn image() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("RCNI_IMAGE") {
        return Ok(p.into());
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        a => a,
    };
    let p = root.join(format!(
        "target/dist/rcni-image-{arch}-{}.tar",
        env!("CARGO_PKG_VERSION")
    ));
    if p.is_file() {
        Ok(p)
    } else {
        Err(format!("no {} (scripts/image makes it)", p.display()))
    }
}

/// The lab with rcni installed from deploy/, every node Ready; None (and a
/// SKIP line) where the builds are missing.
fn cluster_with_rcni(net_conf: Option<&str>) -> Option<K8sLab> {
    require_root();
    let (cache, image) = match Cache::find().and_then(|c| Ok((c, image()?))) {
        Ok(v) => v,
        // scripts/test's k8s stage builds everything first: a miss there
        // is a failure, not a skip.
        Err(why) if std::env::var_os("RCNI_K8S_REQUIRED").is_some() => panic!("{why}"),
        Err(why) => {
            eprintln!("SKIP: {why}");
            return None;
        }
    };
    let lab = K8sLab::start(cache, 3);
    lab.install_rcni(&image, net_conf, &[]);
    lab.wait_nodes_ready(Duration::from_secs(120));
    lab.wait_dns();
    Some(lab)
}

/// An agnhost pod on `node` serving HTTP on 8080 (netexec), with `labels`.
fn pod(lab: &K8sLab, name: &str, node: &str, labels: &str) {
    lab.apply(&format!(
        "apiVersion: v1
kind: Pod
metadata:
  name: {name}
  labels: {{{labels}}}
spec:
  nodeName: {node}
  terminationGracePeriodSeconds: 0
  containers:
  - name: c
    image: {AGNHOST}
    args: [netexec, --http-port=8080]
    ports: [{{containerPort: 8080}}]
    readinessProbe:
      httpGet: {{path: /healthz, port: 8080}}
      periodSeconds: 1
"
    ));
}

fn wait_ready(lab: &K8sLab, pods: &[&str]) {
    for p in pods {
        let o = lab.kubectl(&[
            "wait",
            "--for=condition=Ready",
            &format!("pod/{p}"),
            "--timeout=120s",
        ]);
        assert!(
            o.status.success(),
            "pod {p} not Ready: {}\n{}",
            String::from_utf8_lossy(&o.stderr),
            lab.diagnose()
        );
    }
}

fn pod_ip(lab: &K8sLab, p: &str) -> String {
    lab.kubectl_ok(&["get", "pod", p, "-o", "jsonpath={.status.podIP}"])
}

/// Whether `from` opens a TCP connection to `to:port` (agnhost connect,
/// as the NetworkPolicy e2e suite probes).
fn connects(lab: &K8sLab, from: &str, to: &str, port: u16) -> bool {
    lab.kubectl(&[
        "exec",
        from,
        "--",
        "/agnhost",
        "connect",
        &format!("{to}:{port}"),
        "--timeout=2s",
        "--protocol=tcp",
    ])
    .status
    .success()
}

/// Connectivity settles after a change (policy sync, a restart): waits up to
/// `limit` for `from -> to` to be `want`, then asserts it stays so.
fn expect(lab: &K8sLab, from: &str, to: &str, want: bool, limit: Duration) {
    let reached = poll(limit, || connects(lab, from, to, 8080) == want);
    assert!(
        reached && connects(lab, from, to, 8080) == want,
        "{from} -> {to}:8080 should {}connect\n{}\n{}",
        if want { "" } else { "not " },
        lab.agent_logs(),
        lab.diagnose()
    );
}

#[test]
fn rcni_from_deploy_pods_across_nodes_services_policy_and_a_rollout() {
    let Some(lab) = cluster_with_rcni(None) else {
        return;
    };
    // The manifest's RBAC is all the agent has: nothing it asks is refused.
    let logs = lab.agent_logs();
    assert!(
        !logs.contains("forbidden"),
        "the agent was refused:\n{logs}"
    );

    pod(&lab, "client", "n1", "role: client");
    pod(&lab, "other", "n1", "role: other");
    pod(&lab, "s1", "n1", "app: server");
    pod(&lab, "s2", "n2", "app: server");
    pod(&lab, "s3", "n3", "app: server");
    wait_ready(&lab, &["client", "other", "s1", "s2", "s3"]);
    let ips: Vec<String> = ["s1", "s2", "s3"].iter().map(|p| pod_ip(&lab, p)).collect();
    for (p, ip) in ["s1", "s2", "s3"].iter().zip(&ips) {
        assert!(
            ip.starts_with("10.244."),
            "{p}'s address {ip} is not from the cluster network"
        );
    }
    // On the node and across nodes (vxlan).
    for ip in &ips {
        expect(&lab, "client", ip, true, Duration::from_secs(10));
    }
    // Through a Service: kube-proxy's DNAT to a pod on another node.
    lab.apply(
        "apiVersion: v1
kind: Service
metadata: {name: servers}
spec:
  selector: {app: server}
  ports: [{port: 8080, targetPort: 8080}]
",
    );
    let vip = lab.kubectl_ok(&[
        "get",
        "service",
        "servers",
        "-o",
        "jsonpath={.spec.clusterIP}",
    ]);
    expect(&lab, "client", &vip, true, Duration::from_secs(20));
    // And by name: the pod's resolver is CoreDNS's Service, its pods on the
    // rcni network too.
    let resolved = poll(Duration::from_secs(30), || {
        let o = lab.kubectl(&[
            "exec",
            "client",
            "--",
            "getent",
            "hosts",
            "servers.default.svc.cluster.local",
        ]);
        String::from_utf8_lossy(&o.stdout).contains(&vip)
    });
    assert!(
        resolved,
        "servers.default.svc.cluster.local does not resolve to {vip}\n{}",
        lab.diagnose()
    );

    // Deny every ingress to the servers: nothing gets in, on the node or
    // across nodes.
    lab.apply(
        "apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: servers-deny}
spec:
  podSelector: {matchLabels: {app: server}}
  policyTypes: [Ingress]
",
    );
    for ip in &ips {
        expect(&lab, "client", ip, false, Duration::from_secs(20));
    }
    // Allow the clients: they get in, the others still do not.
    lab.apply(
        "apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: servers-allow-clients}
spec:
  podSelector: {matchLabels: {app: server}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {role: client}}}]
    ports: [{port: 8080}]
",
    );
    for ip in &ips {
        expect(&lab, "client", ip, true, Duration::from_secs(20));
        expect(&lab, "other", ip, false, Duration::from_secs(5));
    }

    // A rollout of the agent: running pods keep their network and policy,
    // and a pod started after it gets both.
    lab.kubectl_ok(&[
        "-n",
        "rcni-system",
        "rollout",
        "restart",
        "daemonset/rcni-node",
    ]);
    lab.rollout("rcni-system", "daemonset/rcni-node");
    for ip in &ips {
        expect(&lab, "client", ip, true, Duration::from_secs(30));
        expect(&lab, "other", ip, false, Duration::from_secs(5));
    }
    pod(&lab, "s4", "n3", "app: server");
    wait_ready(&lab, &["s4"]);
    let s4 = pod_ip(&lab, "s4");
    expect(&lab, "client", &s4, true, Duration::from_secs(20));
    expect(&lab, "other", &s4, false, Duration::from_secs(5));
}
