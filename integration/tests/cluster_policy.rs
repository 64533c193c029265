//! A simulated cluster (rcni_integration::lab::cluster) with Canal-style
//! agents: NetworkPolicies from the Kubernetes API enforced on pods
//! across nodes.

use rcni_integration::lab::cluster::{Cluster, ClusterNode, SETTLE};
use rcni_integration::lab::kube::{Agent, KubeApi, knode};
use rcni_integration::lab::traffic::{listen_ok, talks};
use rcni_integration::{addr_of, link_names};
use rcni_testkit::{Call, TestNs, bin, command_in, wait_for, wait_for_value};
use serde_json::{Value, json};

/// A Pod object on `node` as the scheduler leaves it: labels, and a
/// container port named `http` (8080).
fn kpod(name: &str, node: &str, app: &str) -> k8s_openapi::api::core::v1::Pod {
    use k8s_openapi::api::core::v1::{Container, ContainerPort, Pod, PodSpec};
    Pod {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            labels: Some([("app".to_string(), app.to_string())].into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            containers: vec![Container {
                name: "c".into(),
                image: Some("registry.k8s.io/pause:3.10.2".into()),
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

/// A NetworkPolicy in `default` for app=web: ingress from the cluster
/// network on `port` (a number or a container port's name). [`kpod`]'s
/// Pods carry no address, so another node's pod is no selector peer: the
/// peer is an ipBlock.
fn knetpol(port: Value) -> k8s_openapi::api::networking::v1::NetworkPolicy {
    serde_json::from_value(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"ipBlock": {"cidr": "10.244.0.0/16"}}],
                              "ports": [{"port": port}]}]}
    }))
    .unwrap()
}

/// The Canal-style node: its conflist's bridge and policy plugins, the
/// policy plugin on a private bpffs (never the host's).
struct PolicyNode<'a> {
    n: &'a ClusterNode,
    fs: rcni_integration::Bpffs,
    /// The policy plugin's backend, when not the conflist's (auto).
    backend: Option<&'static str>,
}

impl PolicyNode<'_> {
    fn plugins(&self) -> (Value, Value) {
        let text = std::fs::read(self.n.conf_dir().join("10-rcni.conflist")).unwrap();
        let list: Value = serde_json::from_slice(&text).unwrap();
        let with = |mut c: Value| {
            c["cniVersion"] = list["cniVersion"].clone();
            c["name"] = list["name"].clone();
            c
        };
        assert_eq!(list["plugins"][1]["type"], "policy", "{list}");
        let mut pol = with(list["plugins"][1].clone());
        pol["pinRoot"] = json!(self.fs.root());
        if let Some(b) = self.backend {
            pol["backend"] = json!(b);
        }
        (with(list["plugins"][0].clone()), pol)
    }

    fn call(
        &self,
        plugin: &str,
        cmd: &str,
        pod: &TestNs,
        cid: &str,
        name: &str,
        conf: &Value,
    ) -> rcni_testkit::Output {
        Call::new(bin(plugin), cmd)
            .env("CNI_CONTAINERID", cid)
            .env(
                "CNI_ARGS",
                &format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name}"),
            )
            .netns(&pod.path())
            .stdin(conf)
            .run_in(&self.n.ns.ns)
    }

    /// bridge then policy, as a runtime runs the chain; on policy's
    /// failure the runtime's DEL of the chain. Ok(address) or Err((code,
    /// message)).
    fn add(&self, pod: &TestNs, cid: &str, name: &str) -> Result<String, (u64, String)> {
        let (br, pol) = self.plugins();
        let r = self.call("bridge", "ADD", pod, cid, name, &br).ok();
        let mut with = pol.clone();
        with["prevResult"] = r.clone();
        let out = self.call("policy", "ADD", pod, cid, name, &with);
        if out.code == 0 {
            return Ok(addr_of(&r, true));
        }
        let e = out.err();
        self.call("policy", "DEL", pod, cid, name, &with).ok();
        let mut brd = br.clone();
        brd["prevResult"] = r;
        self.call("bridge", "DEL", pod, cid, name, &brd).ok();
        Err(e)
    }

    /// [`Self::add`] again while it fails with code 11 ("try again
    /// later"), as the kubelet does: the agent answers so until its first
    /// list of the Pods is in, which under CI's load can take longer than
    /// the plugin's patience.
    fn add_retrying(&self, pod: &TestNs, cid: &str, name: &str) -> Result<String, (u64, String)> {
        wait_for_value(SETTLE, &format!("{name}'s ADD past code 11"), || match self
            .add(pod, cid, name)
        {
            Err((11, _)) => None,
            r => Some(r),
        })
    }

    /// The policy plugin's pods (attachment keys) on this node.
    fn policed(&self) -> Vec<String> {
        let out = command_in(&self.n.ns.ns, bin("policy"))
            .args(["show", "--network", "rcni", "--json", "--data-dir"])
            .arg(self.n.dir.path().join("policy-state"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["pods"].as_object().unwrap().keys().cloned().collect()
    }
}

/// Every node of `c` registered in `k`'s API, its Canal-style agent
/// running until its conflist and its two peers are there, and the
/// policy plugin's view of it (`backend`: the plugin's, when not auto).
fn policy_cluster<'a>(
    c: &'a Cluster,
    k: &KubeApi,
    backend: Option<&'static str>,
) -> (Vec<Agent>, Vec<PolicyNode<'a>>) {
    for (i, n) in c.nodes.iter().enumerate() {
        k.api.put(&knode(
            &n.name,
            &c.address(i),
            &format!("10.244.{}.0/24", i + 1),
        ));
    }
    let agents: Vec<Agent> = c.nodes.iter().map(|n| policy_agent(k, n)).collect();
    for n in &c.nodes {
        wait_for(SETTLE, &format!("{}'s conflist and peers", n.name), || {
            n.entries().2.len() == 2 && n.conf_dir().join("10-rcni.conflist").exists()
        });
    }
    let nodes = c
        .nodes
        .iter()
        .map(|n| PolicyNode {
            n,
            fs: rcni_integration::Bpffs::empty(),
            backend,
        })
        .collect();
    (agents, nodes)
}

#[test]
fn network_policies_from_the_api_reach_running_pods_across_nodes() {
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    let c = Cluster::new(&[0, 0, 0]);
    let k = KubeApi::new(&c, r#"{"network": "10.244.0.0/16", "backend": "vxlan"}"#);
    let api = &k.api;
    let (agents, nodes) = policy_cluster(&c, &k, None);
    let agent = |n: &ClusterNode| policy_agent(&k, n);
    let mut agents: Vec<Option<Agent>> = agents.into_iter().map(Some).collect();
    let log = |i: usize| {
        std::fs::read_to_string(c.nodes[i].dir.path().join("agent.log")).unwrap_or_default()
    };

    // The Pods are in the API before their sandboxes, as the kubelet
    // runs them: a client on n1, the web pod on n2.
    api.put(&kpod("client", "n1", "client"));
    api.put(&kpod("web", "n2", "web"));
    let client = TestNs::new();
    let web = TestNs::new();
    nodes[0]
        .add_retrying(&client, "c-client", "client")
        .unwrap();
    let web_addr = nodes[1].add_retrying(&web, "c-web", "web").unwrap();
    listen_ok(&web.ns, 8080);
    listen_ok(&web.ns, 9090);
    let policed = nodes[1].policed();
    assert_eq!(policed, ["c-web/eth0"]);
    let expect = |what: &str, http: bool, other: bool| {
        wait_for(SETTLE, what, || {
            talks(&client.ns, &web_addr, 8080) == http
                && talks(&client.ns, &web_addr, 9090) == other
        });
    };
    expect("no policy: all open", true, true);

    // Created, with the named port "http": only the web pod's 8080.
    api.put(&knetpol(json!("http")));
    expect("the policy with its named port", true, false);
    // n2's agent logs the denied connections as flow events on its
    // standard output (the DaemonSet's log).
    wait_for(SETTLE, "n2's agent logs a denied connection", || {
        std::fs::read_to_string(c.nodes[1].dir.path().join("agent.out"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .any(|v| {
                v["verdict"] == "deny"
                    && v["node"] == "n2"
                    && v["dst"]["pod"] == "default/web"
                    && v["dst"]["port"] == 9090
                    && v["policies"] == json!(["default/web"])
            })
    });
    // Changed: 9090 by number.
    api.put(&knetpol(json!(9090)));
    expect("the changed policy", false, true);
    // The pod's label changes: no policy selects it any more.
    api.put(&kpod("web", "n2", "api"));
    expect("web relabeled out of the policy", true, true);
    api.put(&kpod("web", "n2", "web"));
    expect("web relabeled back", false, true);
    // Deleted: open again.
    assert!(api.delete::<NetworkPolicy>(Some("default"), "web"));
    expect("the policy deleted", true, true);
    // All of it without a re-add: the same attachment, and syncs did it.
    assert_eq!(nodes[1].policed(), policed);
    assert!(log(1).contains("policy sync: network rcni"), "{}", log(1));

    // n2's agent stops: a new pod is refused with "try again later", and
    // nothing of it stays (no veth, no address, no policy record).
    api.put(&kpod("late", "n2", "web"));
    agents[1] = None;
    let links_before = link_names(&c.nodes[1].ns.ns);
    let late = TestNs::new();
    let (code, msg) = nodes[1].add(&late, "c-late", "late").unwrap_err();
    assert_eq!(code, 11, "{msg}");
    assert!(msg.contains("rcni-node"), "{msg}");
    assert_eq!(link_names(&c.nodes[1].ns.ns), links_before);
    assert_eq!(nodes[1].policed(), policed);
    let ipam_dir = c.nodes[1].dir.path().join("ipam/rcni");
    let leases: Vec<String> = std::fs::read_dir(&ipam_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("10.244."))
        .collect();
    assert_eq!(leases, [web_addr.as_str()], "{ipam_dir:?}");
    // Back: the same pod goes in.
    agents[1] = Some(agent(&c.nodes[1]));
    // Listening, not only there: the killed agent's socket file stays.
    wait_for(SETTLE, "n2's agent back", || {
        std::os::unix::net::UnixStream::connect(c.nodes[1].dir.path().join("run/agent.sock"))
            .is_ok()
    });
    let late_addr = nodes[1].add_retrying(&late, "c-late", "late");
    assert!(late_addr.is_ok(), "{late_addr:?}");
    drop(agents);
    // The agents' flow collectors die with them.
    let state = c.nodes[1].dir.path().join("policy-state");
    let collectors = || {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
            .filter(|c| {
                let c = String::from_utf8_lossy(c);
                c.contains("flows") && c.contains(&*state.to_string_lossy())
            })
            .count()
    };
    wait_for(SETTLE, "no flow collector left", || collectors() == 0);
}

/// The Canal-style agent of `n`, reading `k`'s API, with the policy
/// inputs under the node's directory.
fn policy_agent(k: &KubeApi, n: &ClusterNode) -> Agent {
    let bin_dir = bin("policy").parent().unwrap().to_path_buf();
    let mut cmd = k.agent_command(n);
    cmd.arg("--policy-dir")
        .arg(n.dir.path().join("policy.d"))
        .arg("--agent-socket")
        .arg(n.dir.path().join("run/agent.sock"))
        .arg("--policy-data-dir")
        .arg(n.dir.path().join("policy-state"))
        .arg("--cni-bin-dir")
        .arg(&bin_dir)
        .args(["--node", &n.name])
        .stdout(std::fs::File::create(n.dir.path().join("agent.out")).unwrap())
        .stderr(std::fs::File::create(n.dir.path().join("agent.log")).unwrap());
    Agent(cmd.spawn().unwrap())
}

/// [`kpod`] once its sandbox is up: the kubelet has written its address
/// into the status.
fn kpod_at(name: &str, node: &str, app: &str, addr: &str) -> k8s_openapi::api::core::v1::Pod {
    use k8s_openapi::api::core::v1::{PodIP, PodStatus};
    let mut p = kpod(name, node, app);
    p.status = Some(PodStatus {
        phase: Some("Running".into()),
        pod_ip: Some(addr.into()),
        pod_ips: Some(vec![PodIP { ip: addr.into() }]),
        ..Default::default()
    });
    p
}

/// Whether the policy the node enforces names `addr` as a peer (a host
/// prefix of a rule set, eBPF; an element of a set, nftables): read from
/// the kernel, not from the plugin's state.
fn kernel_names(node: &PolicyNode, backend: &str, addr: &str) -> bool {
    let a: std::net::IpAddr = addr.parse().unwrap();
    match backend {
        "ebpf" => rcni_ebpf::Datapath::open(&node.fs.path().join("rcni"))
            .unwrap()
            .is_some_and(|dp| {
                dp.cidrs(None)
                    .unwrap()
                    .iter()
                    .any(|(_, ip, len, _)| *ip == a && *len == 32)
            }),
        _ => {
            let out = command_in(&node.n.ns.ns, "nft")
                .args(["list", "table", "inet", "rcni_policy_rcni"])
                .output()
                .unwrap();
            // The rule sets' peer sets only: the flow event sets (flows
            // recently reported, per-pod rates and counters) hold the
            // addresses of denied traffic too.
            let mut peers = true;
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| {
                    let l = l.trim_start();
                    if l.starts_with("set ") || l.starts_with("map ") || l.starts_with("chain ") {
                        peers = !["_seen", "_rl", "_sup"].iter().any(|s| l.contains(s));
                    }
                    peers
                })
                .flat_map(|l| l.split(|c: char| !(c.is_ascii_digit() || c == '.')))
                .any(|w| w == addr)
        }
    }
}

/// Milliseconds from now until `f` holds (polled every millisecond,
/// bounded at 10 s).
fn ms_until(what: &str, f: impl Fn() -> bool) -> f64 {
    let t = std::time::Instant::now();
    while !f() {
        assert!(t.elapsed().as_secs() < 10, "{what} never happened");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    t.elapsed().as_secs_f64() * 1e3
}

fn figure(what: &str, mut v: Vec<f64>) {
    v.sort_by(f64::total_cmp);
    println!(
        "figure: {what}: min {:.0} ms, median {:.0} ms, max {:.0} ms ({} runs)",
        v[0],
        v[v.len() / 2],
        v[v.len() - 1],
        v.len()
    );
}

#[test]
fn pod_selectors_from_the_api_admit_pods_of_other_nodes() {
    pod_selectors_across_nodes(None);
}

#[test]
fn pod_selectors_from_the_api_admit_pods_of_other_nodes_nftables() {
    pod_selectors_across_nodes(Some("nftables"));
}

fn pod_selectors_across_nodes(backend: Option<&'static str>) {
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    let c = Cluster::new(&[0, 0, 0]);
    let k = KubeApi::new(&c, r#"{"network": "10.244.0.0/16", "backend": "vxlan"}"#);
    let api = &k.api;
    let (agents, nodes) = policy_cluster(&c, &k, backend);

    // A client on n1, the web pod on n2, a pod that is no client on n3;
    // once each runs, the kubelet writes its address into the API.
    let (client, web, other) = (TestNs::new(), TestNs::new(), TestNs::new());
    let mut addrs = Vec::new();
    for (i, ns, name, app) in [
        (0, &client, "client", "client"),
        (1, &web, "web", "web"),
        (2, &other, "other", "other"),
    ] {
        let node = &c.nodes[i].name;
        api.put(&kpod(name, node, app));
        let a = nodes[i]
            .add_retrying(ns, &format!("c-{name}"), name)
            .unwrap();
        api.put(&kpod_at(name, node, app, &a));
        addrs.push(a);
    }
    let (client_addr, web_addr, other_addr) = (&addrs[0], &addrs[1], &addrs[2]);
    listen_ok(&web.ns, 8080);
    let policed = nodes[1].policed();
    let backend = {
        let out = command_in(&c.nodes[1].ns.ns, bin("policy"))
            .args(["show", "--network", "rcni", "--json", "--data-dir"])
            .arg(c.nodes[1].dir.path().join("policy-state"))
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["backend"].as_str().unwrap().to_string()
    };
    let expect = |what: &str, from_client: bool, from_other: bool| {
        wait_for(SETTLE, what, || {
            talks(&client.ns, web_addr, 8080) == from_client
                && talks(&other.ns, web_addr, 8080) == from_other
        });
    };
    expect("no policy: all open", true, true);

    // Ingress from podSelector app=client: the client on n1 is admitted
    // by its labels, the pod on n3 refused.
    let netpol: NetworkPolicy = serde_json::from_value(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}],
                              "ports": [{"port": 8080}]}]}
    }))
    .unwrap();
    api.put(&netpol);
    expect("the client on n1 admitted, n3's pod refused", true, false);
    assert!(kernel_names(&nodes[1], &backend, client_addr));
    assert!(!kernel_names(&nodes[1], &backend, other_addr));

    // The labels change on the API, the pods stay: n3's pod becomes a
    // client, n1's stops being one.
    api.put(&kpod_at("other", "n3", "client", other_addr));
    api.put(&kpod_at("client", "n1", "former", client_addr));
    expect("relabeled: n3's pod admitted, n1's refused", false, true);
    // Deleted from the API (its sandbox still up): refused too.
    assert!(api.delete::<k8s_openapi::api::core::v1::Pod>(Some("default"), "other"));
    expect("n3's pod gone from the API", false, false);
    api.put(&kpod_at("other", "n3", "client", other_addr));
    expect("n3's pod back", false, true);
    // None of it re-added a pod: the syncs did it.
    assert_eq!(nodes[1].policed(), policed);

    // How long from the API write to the kernel (not a bound: a figure).
    let (mut relabel_in, mut relabel_out, mut np_in, mut np_out) = (vec![], vec![], vec![], vec![]);
    for _ in 0..5 {
        api.put(&kpod_at("client", "n1", "client", client_addr));
        relabel_in.push(ms_until("relabeled in", || {
            kernel_names(&nodes[1], &backend, client_addr)
        }));
        api.put(&kpod_at("client", "n1", "former", client_addr));
        relabel_out.push(ms_until("relabeled out", || {
            !kernel_names(&nodes[1], &backend, client_addr)
        }));
        assert!(api.delete::<NetworkPolicy>(Some("default"), "web"));
        np_out.push(ms_until("policy deleted", || {
            !kernel_names(&nodes[1], &backend, other_addr)
        }));
        api.put(&netpol);
        np_in.push(ms_until("policy created", || {
            kernel_names(&nodes[1], &backend, other_addr)
        }));
    }
    println!("figure: backend {backend}, API write to kernel entry on the web pod's node");
    figure("a remote pod relabeled into the policy", relabel_in);
    figure("a remote pod relabeled out of it", relabel_out);
    figure("the NetworkPolicy deleted", np_out);
    figure("the NetworkPolicy created", np_in);

    // Egress: n1's pod (now app=former) may reach app=web pods only; the
    // web pod on n2 is one, n3's pod is not, until the labels say so.
    assert!(api.delete::<NetworkPolicy>(Some("default"), "web"));
    listen_ok(&other.ns, 8080);
    let egress = |to: &str| -> NetworkPolicy {
        serde_json::from_value(json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "former", "namespace": "default"},
            "spec": {"podSelector": {"matchLabels": {"app": "former"}}, "policyTypes": ["Egress"],
                     "egress": [{"to": [{"podSelector": {"matchLabels": {"app": to}}}],
                                 "ports": [{"port": 8080}]}]}
        }))
        .unwrap()
    };
    let reaches = |what: &str, web_ok: bool, other_ok: bool| {
        wait_for(SETTLE, what, || {
            talks(&client.ns, web_addr, 8080) == web_ok
                && talks(&client.ns, other_addr, 8080) == other_ok
        });
    };
    reaches("no policy: n1's pod reaches both", true, true);
    api.put(&egress("web"));
    reaches("egress to app=web: n2's web pod only", true, false);
    api.put(&kpod_at("web", "n2", "db", web_addr));
    api.put(&kpod_at("other", "n3", "web", other_addr));
    reaches("relabeled: n3's pod only", false, true);
    assert_eq!(nodes[0].policed(), ["c-client/eth0"]);
    drop(agents);
}
