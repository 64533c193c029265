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
use std::str::FromStr;
use std::time::Duration;

use rcni_integration::lab::k8s::{AGNHOST, Cache, K8sLab};
use rcni_testkit::require_root;
use rcni_testkit::{HeldClient, poll};

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

/// The builds the lab needs; None (and a SKIP line) where they are missing.
fn cache_and_image() -> Option<(Cache, PathBuf)> {
    require_root();
    match Cache::find().and_then(|c| Ok((c, image()?))) {
        // scripts/test's k8s stage builds everything first: a miss there
        // is a failure, not a skip.
        Err(why) if std::env::var_os("RCNI_K8S_REQUIRED").is_some() => panic!("{why}"),
        Err(why) => {
            eprintln!("SKIP: {why}");
            None
        }
        Ok(v) => Some(v),
    }
}

/// The lab with rcni installed from deploy/, every node Ready and DNS
/// serving.
fn cluster_with_rcni(net_conf: Option<&str>) -> Option<K8sLab> {
    let (cache, image) = cache_and_image()?;
    let lab = K8sLab::start(cache, 3);
    lab.install_rcni(&image, net_conf, &[]);
    lab.wait_nodes_ready(Duration::from_secs(120));
    lab.wait_dns();
    Some(lab)
}

/// Every ingress to the `app: server` pods denied.
const DENY_SERVERS: &str = "apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: servers-deny}
spec:
  podSelector: {matchLabels: {app: server}}
  policyTypes: [Ingress]
";

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
    ports: [{{name: http, containerPort: 8080}}]
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

/// The client pod's resolver (CoreDNS, through its Service) answers
/// `servers`' name with `vip`.
fn assert_resolves(lab: &K8sLab, vip: &str) {
    let resolved = poll(Duration::from_secs(30), || {
        let o = lab.kubectl(&[
            "exec",
            "client",
            "--",
            "getent",
            "hosts",
            "servers.default.svc.cluster.local",
        ]);
        String::from_utf8_lossy(&o.stdout).contains(vip)
    });
    assert!(
        resolved,
        "servers.default.svc.cluster.local does not resolve to {vip}\n{}",
        lab.diagnose()
    );
}

/// Service `servers` for the `app: server` pods' 8080 on `port`; its
/// ClusterIP.
fn servers_service(lab: &K8sLab, port: u16) -> String {
    lab.apply(&format!(
        "apiVersion: v1
kind: Service
metadata: {{name: servers}}
spec:
  selector: {{app: server}}
  ports: [{{port: {port}, targetPort: 8080}}]
"
    ));
    lab.kubectl_ok(&[
        "get",
        "service",
        "servers",
        "-o",
        "jsonpath={.spec.clusterIP}",
    ])
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
    let vip = servers_service(&lab, 8080);
    expect(&lab, "client", &vip, true, Duration::from_secs(20));
    // And by name: the pod's resolver is CoreDNS's Service, its pods on the
    // rcni network too.
    assert_resolves(&lab, &vip);

    // Deny every ingress to the servers: nothing gets in, on the node or
    // across nodes.
    lab.apply(DENY_SERVERS);
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

    // Egress through the Service, judged by the pods behind it (the eBPF
    // backend decides before kube-proxy's DNAT), with a named port that
    // the servers on other nodes have.
    let client_egress = |to: &str| {
        lab.apply(&format!(
            "apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {{name: client-egress}}
spec:
  podSelector: {{matchLabels: {{role: client}}}}
  policyTypes: [Egress]
  egress:
  - {to}
"
        ))
    };
    client_egress("to: [{podSelector: {matchLabels: {app: server}}}]\n    ports: [{port: http}]");
    expect(&lab, "client", &vip, true, Duration::from_secs(20));
    expect(&lab, "client", &ips[1], true, Duration::from_secs(5));
    // Everything but the servers: their Service is theirs, not an address
    // inside 0.0.0.0/0.
    let except: Vec<String> = ips
        .iter()
        .chain([&s4])
        .map(|ip| format!("{ip}/32"))
        .collect();
    client_egress(&format!(
        "to: [{{ipBlock: {{cidr: 0.0.0.0/0, except: [{}]}}}}]",
        except.join(", ")
    ));
    expect(&lab, "client", &vip, false, Duration::from_secs(20));
    expect(&lab, "client", &ips[1], false, Duration::from_secs(5));
}

/// Whether the node's own network (its host network, no API involved)
/// reaches a pod's HTTP server.
fn node_reaches(lab: &K8sLab, node: usize, ip: &str) -> bool {
    lab.nodes[node]
        .netns
        .command("curl")
        .args([
            "-sf",
            "--max-time",
            "2",
            &format!("http://{ip}:8080/hostname"),
        ])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn the_api_server_away_for_30s_pods_keep_working_and_the_agents_catch_up() {
    let Some(mut lab) = cluster_with_rcni(None) else {
        return;
    };
    pod(&lab, "client", "n1", "role: client");
    pod(&lab, "s2", "n2", "app: server");
    pod(&lab, "s3", "n3", "app: server");
    wait_ready(&lab, &["client", "s2", "s3"]);
    let ips = [pod_ip(&lab, "s2"), pod_ip(&lab, "s3")];
    for ip in &ips {
        expect(&lab, "client", ip, true, Duration::from_secs(10));
    }

    let args = lab.stop_control("kube-apiserver");
    let away = std::time::Instant::now();
    // Across nodes, from n1's own network, every few seconds while the API
    // is gone: the agents' routes, FDB and neighbour entries stay.
    while away.elapsed() < Duration::from_secs(30) {
        for ip in &ips {
            assert!(
                node_reaches(&lab, 0, ip),
                "n1 lost {ip} {:?} after the API server went away",
                away.elapsed()
            );
        }
        std::thread::sleep(Duration::from_secs(3));
    }
    lab.restart_control("kube-apiserver", &args);

    // The agents watch again: a policy made now is enforced, a pod made now
    // is reachable across nodes, both without restarting anything.
    pod(&lab, "s4", "n3", "app: server");
    wait_ready(&lab, &["s4"]);
    let s4 = pod_ip(&lab, "s4");
    expect(&lab, "client", &s4, true, Duration::from_secs(30));
    lab.apply(DENY_SERVERS);
    for ip in [&ips[0], &ips[1], &s4] {
        expect(&lab, "client", ip, false, Duration::from_secs(60));
    }
    let restarts = lab.kubectl_ok(&[
        "-n",
        "rcni-system",
        "get",
        "pods",
        "-o",
        "jsonpath={.items[*].status.containerStatuses[*].restartCount}",
    ]);
    eprintln!("agent restarts across the outage: {restarts}");
}

#[test]
fn a_node_deleted_and_registered_again_gets_its_network_back() {
    let Some(mut lab) = cluster_with_rcni(None) else {
        return;
    };
    pod(&lab, "client", "n1", "role: client");
    // A pod on n3 first, so its bridge holds the old range's gateway: the
    // controller manager gives the re-registered node the next free range.
    pod(&lab, "s0", "n3", "app: server");
    wait_ready(&lab, &["client", "s0"]);
    let before = lab.kubectl_ok(&["get", "node", "n3", "-o", "jsonpath={.spec.podCIDR}"]);
    lab.kubectl_ok(&["delete", "node", "n3"]);
    // As an admin does: the kubelet registers the node again when it starts.
    lab.nodes[2].stop("kubelet");
    lab.nodes[2].start_again("kubelet");
    wait_for_node(&lab, "n3");
    lab.wait_nodes_ready(Duration::from_secs(120));
    lab.rollout("rcni-system", "daemonset/rcni-node");
    let after = lab.kubectl_ok(&["get", "node", "n3", "-o", "jsonpath={.spec.podCIDR}"]);
    eprintln!("n3's pod range: {before} before, {after} after");
    pod(&lab, "s5", "n3", "app: server");
    wait_ready(&lab, &["s5"]);
    let s5 = pod_ip(&lab, "s5");
    assert!(
        ipnetwork::Ipv4Network::from_str(&after)
            .unwrap()
            .contains(s5.parse().unwrap()),
        "s5's {s5} is not in n3's range {after}"
    );
    expect(&lab, "client", &s5, true, Duration::from_secs(30));
    assert!(node_reaches(&lab, 1, &s5), "n2 does not reach s5 {s5}");
}

fn wait_for_node(lab: &K8sLab, name: &str) {
    let back = poll(Duration::from_secs(60), || {
        lab.kubectl(&["get", "node", name]).status.success()
    });
    assert!(back, "{name} did not register again\n{}", lab.diagnose());
}

#[test]
fn a_conflist_the_agent_cannot_write_shows_and_mends() {
    let Some(cache) = cache_and_image() else {
        return;
    };
    let (cache, image) = cache;
    let lab = K8sLab::start(cache, 3);
    // n2's /etc/cni/net.d immutable (chattr +i, as configuration
    // management locks a directory), undone however the test ends: the
    // lab's directory could not be removed otherwise.
    struct Immutable(PathBuf);
    impl Immutable {
        fn set(&self, on: bool) {
            let o = std::process::Command::new("chattr")
                .arg(if on { "+i" } else { "-i" })
                .arg(&self.0)
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        }
    }
    impl Drop for Immutable {
        fn drop(&mut self) {
            let _ = std::process::Command::new("chattr")
                .arg("-i")
                .arg(&self.0)
                .status();
        }
    }
    let locked = Immutable(lab.nodes[1].dir.join("etc-cni/net.d"));
    locked.set(true);
    lab.apply_rcni(&image, None, &[]);
    // n1 and n3 get their network; n2's agent is not Ready and says why,
    // and n2 stays NotReady.
    let n2_agent = || {
        lab.kubectl_ok(&[
            "-n",
            "rcni-system",
            "get",
            "pods",
            "--field-selector=spec.nodeName=n2",
            "-o",
            "jsonpath={.items[0].metadata.name}",
        ])
    };
    let said = poll(Duration::from_secs(120), || {
        let o = lab.kubectl(&["-n", "rcni-system", "logs", &n2_agent(), "--tail=50"]);
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .any(|l| l.contains("net.d") && l.contains("not permitted"))
    });
    assert!(
        said,
        "n2's agent did not say it cannot write the conflist:\n{}",
        lab.agent_logs()
    );
    let ready = |n: &str| {
        lab.kubectl_ok(&[
            "get",
            "node",
            n,
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
        ]) == "True"
    };
    assert!(poll(Duration::from_secs(60), || ready("n1") && ready("n3")));
    let agent_ready = || {
        lab.kubectl_ok(&[
            "-n",
            "rcni-system",
            "get",
            "pod",
            &n2_agent(),
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
        ])
    };
    assert!(
        poll(Duration::from_secs(30), || agent_ready() == "False"),
        "n2's agent is Ready though it cannot write its conflist"
    );
    assert!(!ready("n2"), "n2 is Ready without a conflist");
    // Writable again: the agent's next pass writes it, n2 joins, no restart.
    locked.set(false);
    lab.rollout("rcni-system", "daemonset/rcni-node");
    lab.wait_nodes_ready(Duration::from_secs(120));
    pod(&lab, "client", "n1", "role: client");
    pod(&lab, "s2", "n2", "app: server");
    wait_ready(&lab, &["client", "s2"]);
    let s2 = pod_ip(&lab, "s2");
    expect(&lab, "client", &s2, true, Duration::from_secs(30));
}

/// kube-proxy gone from every node (stopped, `kube-proxy --cleanup`) and
/// the net-conf's "kubeProxyReplacement": true: Services are rcni's alone.
/// The agents reach the API server by its own address (the
/// kubernetes-services-endpoint ConfigMap, as a user without kube-proxy
/// sets it); CoreDNS reaches it through the `kubernetes` Service, the pods
/// CoreDNS through its ClusterIP (UDP), a pod a server across nodes, and a
/// process of the node's own (in the node's cgroup) too; an agent's restart
/// breaks no connection; a Service whose endpoints go refuses, and takes
/// the next one that comes.
#[test]
fn services_without_kube_proxy_from_pods_and_the_node() {
    let Some((cache, image)) = cache_and_image() else {
        return;
    };
    if rcni_integration::lab::k8s::cgroup2_root().is_none() {
        eprintln!("SKIP: no cgroup v2 hierarchy is mounted: the Service hooks attach only there");
        return;
    }
    let mut lab = K8sLab::start(cache, 2);
    lab.remove_kube_proxy();
    lab.install_rcni(
        &image,
        Some(r#"{"network": "10.244.0.0/16", "backend": "vxlan", "kubeProxyReplacement": true}"#),
        &[],
    );
    lab.wait_nodes_ready(Duration::from_secs(120));
    lab.wait_dns();
    let logs = lab.agent_logs();
    assert!(logs.contains("services: hooks on"), "{logs}");

    pod(&lab, "client", "n1", "role: client");
    pod(&lab, "s2", "n2", "app: server");
    wait_ready(&lab, &["client", "s2"]);
    let vip = servers_service(&lab, 80);
    let through = |want: bool| {
        let ok = poll(Duration::from_secs(20), || {
            connects(&lab, "client", &vip, 80) == want
        });
        assert!(
            ok,
            "client -> {vip}:80 should {}connect\n{}\n{}",
            if want { "" } else { "not " },
            lab.agent_logs(),
            lab.diagnose()
        );
    };
    through(true);
    // By name: the resolver's queries to CoreDNS's ClusterIP.
    assert_resolves(&lab, &vip);
    // No rule of kube-proxy's did it (iptables on either backend, and
    // nftables).
    for n in &lab.nodes {
        for cmd in [
            &["nft", "list", "ruleset"][..],
            &["iptables-save"],
            &["ip6tables-save"],
        ] {
            let o = n.command(cmd[0]).args(&cmd[1..]).output().unwrap();
            let rules = String::from_utf8_lossy(&o.stdout);
            assert!(
                !rules.contains("KUBE-SERVICES"),
                "{} {cmd:?}: {rules}",
                n.name
            );
        }
    }
    // A process of node n1's own, in its cgroup: the Service, and the
    // Service is the peer it sees.
    let n1 = &lab.nodes[0];
    let cg = n1.cgroup2().expect("a cgroup v2 tree");
    let o = n1
        .command("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {}/cgroup.procs && exec python3 -c \"$0\"",
            cg.display()
        ))
        .arg(format!(
            "import socket\ns = socket.create_connection(('{vip}', 80), timeout=5)\n\
             print(s.getpeername()[0])"
        ))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        vip,
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );

    // n1's agent restarts: its hooks stay (their links are pinned), so
    // the client's connections through the Service keep working while
    // the agent is away, and after.
    let agent = lab.kubectl_ok(&[
        "-n",
        "rcni-system",
        "get",
        "pod",
        "-l",
        "app.kubernetes.io/name=rcni",
        "--field-selector",
        "spec.nodeName=n1",
        "-o",
        "jsonpath={.items[0].metadata.name}",
    ]);
    lab.kubectl_ok(&["-n", "rcni-system", "delete", "pod", &agent, "--wait=false"]);
    let failed = (0..10)
        .filter(|_| !connects(&lab, "client", &vip, 80))
        .count();
    lab.rollout("rcni-system", "daemonset/rcni-node");
    assert_eq!(failed, 0, "connections failed while n1's agent restarted");
    through(true);

    // The endpoint goes: refused; a new one comes: reached.
    lab.kubectl_ok(&["delete", "pod", "s2", "--wait=true"]);
    through(false);
    pod(&lab, "s1", "n1", "app: server");
    wait_ready(&lab, &["s1"]);
    through(true);

    // UDP: the client pod's connected socket gets s1, the only endpoint.
    // s1 goes once s3 is there: kube-proxy would flush s1's conntrack
    // entries; here the socket is closed (ECONNABORTED), and connected
    // again it reaches s3.
    lab.apply(
        "apiVersion: v1
kind: Service
metadata: {name: udp-servers}
spec:
  selector: {app: server}
  ports: [{port: 53, targetPort: 8081, protocol: UDP}]
",
    );
    let udp_vip = lab.kubectl_ok(&[
        "get",
        "service",
        "udp-servers",
        "-o",
        "jsonpath={.spec.clusterIP}",
    ]);
    let mut udp = held_udp_client(&lab, "client", &udp_vip);
    let first = udp.line();
    assert_eq!(first, "s1", "{}", udp.rest());
    pod(&lab, "s3", "n2", "app: server");
    wait_ready(&lab, &["s3"]);
    lab.kubectl_ok(&["delete", "pod", "s1", "--wait=true"]);
    let after = udp.line_after_input();
    assert_eq!(after, "err 103 s3", "{}\n{}", udp.rest(), lab.agent_logs());
    assert!(
        lab.agent_logs()
            .contains("connected UDP sockets of removed backends closed")
    );
}

/// A client process in pod `pod`'s network namespace (entered from its
/// node, in the node's cgroup, where the Service hooks are), holding one
/// connected UDP socket to `vip:53`: prints the pod that answered
/// (agnhost netexec's `hostname` on UDP), then, after a line on stdin,
/// waits up to 60 s for the socket to fail, prints that error, connects
/// it again and prints who answers.
fn held_udp_client(lab: &K8sLab, pod: &str, vip: &str) -> HeldClient {
    let ip = pod_ip(lab, pod);
    let node = lab.kubectl_ok(&["get", "pod", pod, "-o", "jsonpath={.spec.nodeName}"]);
    let n = lab
        .nodes
        .iter()
        .find(|n| n.name == node)
        .expect("the pod's node");
    let cg = n.cgroup2().expect("a cgroup v2 tree");
    let script = format!(
        "import socket, sys\n\
         s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         def ask():\n\
         \x20   s.settimeout(5)\n\
         \x20   s.send(b'hostname')\n\
         \x20   return s.recv(64).decode()\n\
         s.connect(('{vip}', 53))\n\
         print(ask(), flush=True)\n\
         sys.stdin.readline()\n\
         s.settimeout(60)\n\
         try:\n\
         \x20   s.recv(64)\n\
         \x20   first = 'data'\n\
         except OSError as e:\n\
         \x20   first = f'err {{e.errno}}'\n\
         s.connect(('{vip}', 53))\n\
         print(first, ask(), flush=True)\n"
    );
    let child = n
        .command("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {cg}/cgroup.procs && for f in /run/netns/*; do \
             if nsenter --net=$f ip -4 -o addr show | grep -q ' {ip}/'; then \
             exec nsenter --net=$f python3 -c \"$0\"; fi; done; echo no netns with {ip}",
            cg = cg.display()
        ))
        .arg(script)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    HeldClient::new(child)
}
