//! The policy plugin chained after bridge (and after fastpath), with real
//! traffic between pods of a throwaway node namespace, for both backends:
//! allowed ingress passes and its replies return, pods outside a selector
//! are blocked, ports and port ranges, ipBlock with except, egress default
//! deny, a new pod matching a peer selector is reachable at once, a policy
//! edit followed by `policy sync` changes what passes, and DEL leaves no
//! rule, map entry or identity behind.
//!
//! eBPF tests pin under a bpffs of their own (mounted on a temporary
//! directory by the plugin, unmounted on drop); nftables tests keep their
//! table in the node namespace, which goes with it.

use rcni_ebpf::{Datapath, PORT_FASTPATH};
use rcni_integration::{Bpffs, Node, addr_of};
use rcni_netns::NetNs;
use rcni_testkit::{Output, TestNs, bin, command_in, normalize_result, ping, stdout_of};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Backend {
    Ebpf,
    /// eBPF with fastpath before policy in the chain.
    EbpfFastpath,
    Nftables,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Ebpf | Backend::EbpfFastpath => "ebpf",
            Backend::Nftables => "nftables",
        }
    }
}

const ALL: [Backend; 3] = [Backend::Ebpf, Backend::EbpfFastpath, Backend::Nftables];

/// A node with the bridge network, a policy config and pods.
struct Lab {
    node: Node,
    fs: Bpffs,
    state: tempfile::TempDir,
    policy_dir: tempfile::TempDir,
    backend: Backend,
    policies: Value,
    /// More keys of the policy plugin's config.
    extra: Value,
    pods: Vec<Pod>,
}

struct Pod {
    ns: TestNs,
    cid: String,
    labels: Value,
    namespace: String,
    bridge: Value,
    /// What the chain's last plugin returned.
    result: Value,
}

impl Pod {
    fn v4(&self) -> String {
        addr_of(&self.bridge, true)
    }

    fn v6(&self) -> String {
        addr_of(&self.bridge, false)
    }

    fn ip4(&self) -> IpAddr {
        self.v4().parse().unwrap()
    }
}

impl Lab {
    fn new(backend: Backend, policies: Value) -> Lab {
        Lab {
            node: Node::new(),
            fs: Bpffs::empty(),
            state: tempfile::tempdir().unwrap(),
            policy_dir: tempfile::tempdir().unwrap(),
            backend,
            policies,
            extra: json!({}),
            pods: vec![],
        }
    }

    fn data_dir(&self) -> PathBuf {
        self.state.path().to_path_buf()
    }

    fn policy_conf(&self, labels: &Value, namespace: &str, prev: &Value) -> Value {
        let mut c = json!({"cniVersion": "1.1.0", "name": "podnet", "type": "policy",
            "backend": self.backend.name(), "pinRoot": self.fs.root(),
            "dataDir": self.data_dir(), "policyDir": self.policy_dir.path(),
            "policies": self.policies,
            "args": {"cni": {"labels": labels, "namespace": namespace}}});
        if !prev.is_null() {
            c["prevResult"] = prev.clone();
        }
        for (k, v) in self.extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    fn fp_conf(&self, prev: &Value) -> Value {
        let mut c = json!({"cniVersion": "1.1.0", "name": "podnet", "type": "fastpath",
               "pinRoot": self.fs.root(), "prevResult": prev});
        // The same hook as the policy plugin's.
        if let Some(m) = self.extra.get("attachMode") {
            c["attachMode"] = m.clone();
        }
        c
    }

    fn policy(&self, cmd: &str, pod: &Pod, prev: &Value) -> Output {
        let c = self.policy_conf(&pod.labels, &pod.namespace, prev);
        self.node
            .call(&bin("policy"), cmd, &pod.ns.path(), &pod.cid, &c)
    }

    /// bridge ADD, fastpath ADD where the backend says, policy ADD; checks
    /// that policy passes prevResult through.
    fn add_in(&mut self, labels: Value, namespace: &str) -> usize {
        let ns = TestNs::new();
        let cid = format!("ctr-{}", self.pods.len());
        let bc = self.node.conf("1.1.0", json!({}));
        let bridge = self.node.add(&ns, &cid, &bc);
        let mut prev = bridge.clone();
        if self.backend == Backend::EbpfFastpath {
            let c = self.fp_conf(&prev);
            prev = self
                .node
                .call(&bin("fastpath"), "ADD", &ns.path(), &cid, &c)
                .ok();
        }
        let mut pod = Pod {
            ns,
            cid,
            labels,
            namespace: namespace.into(),
            bridge,
            result: Value::Null,
        };
        let out = self.policy("ADD", &pod, &prev).ok();
        assert_eq!(
            normalize_result(&out, "1.1.0"),
            normalize_result(&prev, "1.1.0"),
            "policy must pass prevResult through"
        );
        pod.result = out;
        self.pods.push(pod);
        self.pods.len() - 1
    }

    /// A lab with pods app=web, app=client and app=other, in that order.
    fn three(backend: Backend, policies: Value) -> (Lab, usize, usize, usize) {
        let mut lab = Lab::new(backend, policies);
        let web = lab.add("web");
        let client = lab.add("client");
        let other = lab.add("other");
        (lab, web, client, other)
    }

    /// DEL of every pod, then nothing of the policy may be left.
    fn del_all(&self) {
        for i in 0..self.pods.len() {
            self.del(i);
        }
        self.assert_clean();
    }

    fn add(&mut self, app: &str) -> usize {
        self.add_in(json!([{"key": "app", "value": app}]), "default")
    }

    fn prev_of(&self, i: usize) -> Value {
        self.pods[i].result.clone()
    }

    /// DEL through the chain, in reverse.
    fn del(&self, i: usize) {
        let p = &self.pods[i];
        self.policy("DEL", p, &p.result).ok();
        if self.backend == Backend::EbpfFastpath {
            let c = self.fp_conf(&p.result);
            self.node
                .call(&bin("fastpath"), "DEL", &p.ns.path(), &p.cid, &c)
                .ok();
        }
        let bc = Node::with_prev(&self.node.conf("1.1.0", json!({})), &p.bridge);
        self.node
            .call(&bin("bridge"), "DEL", &p.ns.path(), &p.cid, &bc)
            .ok();
    }

    fn check(&self, i: usize) -> Output {
        let p = &self.pods[i];
        self.policy("CHECK", p, &self.prev_of(i))
    }

    /// `policy <args> --network podnet --data-dir ...` in the node namespace.
    fn operator(&self, args: &[&str]) -> String {
        let dd = self.data_dir().display().to_string();
        stdout_of(
            command_in(&self.node.ns.ns, bin("policy"))
                .args(args)
                .args(["--network", "podnet", "--data-dir", &dd]),
        )
    }

    /// `policy sync` in the node namespace.
    fn sync(&self) -> String {
        self.operator(&["sync"])
    }

    fn show(&self) -> Value {
        serde_json::from_str(&self.operator(&["show", "--json"])).unwrap()
    }

    fn write_policy(&self, file: &str, v: Value) {
        let p = self.policy_dir.path().join(file);
        std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    }

    /// Whether both policy programs run for pod `i`: `rcni_pol_in` on its
    /// host veth's egress hook, and `rcni_pod` on its ingress hook with
    /// the policy part in the port's entry.
    fn policy_hooked(&self, i: usize) -> bool {
        let v = self.pods[i].bridge["interfaces"][1]["name"]
            .as_str()
            .unwrap()
            .to_string();
        let dir = self.pin_dir();
        self.node
            .ns
            .ns
            .run(move || {
                let i = nix::net::if_::if_nametoindex(v.as_str()).unwrap();
                let rt = rcni_netlink::runtime().unwrap();
                let egress = rt.block_on(async {
                    let n = rcni_netlink::Netlink::connect_current().await.unwrap();
                    // No clsact there at all (nothing ever hooked): none.
                    n.egress_bpf_filters(i).await.unwrap_or_default()
                });
                let pol_in = egress
                    .iter()
                    .any(|f| f.name.as_deref() == Some(rcni_ebpf::POLICY_IN_PROGRAM));
                let pol_out = match Datapath::open(&dir).unwrap() {
                    Some(mut dp) => dp.pod_attached(&v, rcni_ebpf::PORT_POLICY).unwrap(),
                    None => false,
                };
                assert_eq!(pol_in, pol_out, "{v}: one policy program without the other");
                pol_in
            })
            .unwrap()
    }

    fn pin_dir(&self) -> PathBuf {
        self.fs.path().join("podnet")
    }

    /// Nothing of the policy left: state, map entries, links, table.
    fn assert_clean(&self) {
        let show = self.show();
        assert_eq!(show["pods"], json!({}), "{show}");
        let left: Vec<_> = std::fs::read_dir(self.data_dir().join("podnet"))
            .map(|rd| rd.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        // The flow log is history, kept with the network's lock.
        assert!(
            left.iter()
                .all(|f| f == "lock" || f.to_string_lossy().starts_with("flows.")),
            "state left: {left:?}"
        );
        match self.backend {
            Backend::Nftables => {
                let out = command_in(&self.node.ns.ns, "nft")
                    .args(["list", "tables"])
                    .output()
                    .unwrap();
                let t = String::from_utf8_lossy(&out.stdout);
                assert!(!t.contains("policy"), "tables left: {t}");
            }
            _ => {
                let dir = self.pin_dir();
                let dp = self
                    .node
                    .ns
                    .ns
                    .run(move || Datapath::open(&dir))
                    .unwrap()
                    .unwrap();
                // Every pod added went through the datapath: it must be
                // there to be checked, not skipped.
                assert!(
                    dp.is_some() || self.pods.is_empty(),
                    "no datapath pinned in {}",
                    self.pin_dir().display()
                );
                if let Some(dp) = dp {
                    let eps = dp.endpoints().unwrap();
                    assert!(
                        eps.iter().all(|(_, e)| e.flags & rcni_ebpf::EP_POLICY == 0),
                        "policy endpoints left: {eps:?}"
                    );
                    assert!(dp.cidrs(None).unwrap().is_empty(), "cidr entries left");
                    assert!(dp.peers().unwrap().is_empty(), "peer entries left");
                    assert!(dp.portsets().unwrap().is_empty(), "port sets left");
                    assert!(dp.ct_entries().unwrap().is_empty(), "ct entries left");
                }
                let links: Vec<String> = std::fs::read_dir(self.pin_dir())
                    .map(|rd| {
                        rd.flatten()
                            .map(|e| e.file_name().to_string_lossy().into_owned())
                            .filter(|n| n.starts_with("link-pol"))
                            .collect()
                    })
                    .unwrap_or_default();
                assert!(links.is_empty(), "policy links left: {links:?}");
            }
        }
    }
}

/// A TCP server in `ns` on `addr:port` that writes "ok" to each client.
fn listen(ns: &NetNs, addr: IpAddr, port: u16) {
    let l = ns
        .run(move || TcpListener::bind((addr, port)))
        .unwrap()
        .unwrap_or_else(|e| panic!("bind {addr}:{port}: {e}"));
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let _ = s.write_all(b"ok");
        }
    });
}

/// Whether a client in `ns` gets "ok" from `addr:port` (the SYN, the
/// SYN-ACK and the data all passed) within a second.
fn talks(ns: &NetNs, addr: IpAddr, port: u16) -> bool {
    let to = SocketAddr::new(addr, port);
    ns.run(move || {
        let Ok(mut s) = TcpStream::connect_timeout(&to, Duration::from_secs(1)) else {
            return false;
        };
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let mut buf = [0u8; 2];
        s.read_exact(&mut buf).is_ok() && &buf == b"ok"
    })
    .unwrap()
}

fn root() -> bool {
    rcni_testkit::require_root();
    true
}

/// Web (app=web) accepts TCP 8080 and 9000-9002 from app=client only.
fn web_policy() -> Value {
    json!([{"name": "web", "podSelector": {"matchLabels": {"app": "web"}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}],
                         "ports": [{"port": 8080}, {"port": 9000, "endPort": 9002}]}]}])
}

#[test]
fn ingress_peers_and_ports() {
    root();
    for b in ALL {
        let (lab, web, client, other) = Lab::three(b, web_policy());
        let w = lab.pods[web].ip4();
        for port in [8080, 8081, 9000, 9002, 9003] {
            listen(&lab.pods[web].ns.ns, w, port);
        }
        let c = &lab.pods[client].ns.ns;
        let o = &lab.pods[other].ns.ns;
        assert!(talks(c, w, 8080), "{b:?}: client -> web:8080");
        assert!(talks(c, w, 9000) && talks(c, w, 9002), "{b:?}: port range");
        assert!(
            !talks(c, w, 8081) && !talks(c, w, 9003),
            "{b:?}: ports outside"
        );
        assert!(!talks(o, w, 8080), "{b:?}: a pod outside the selector");
        assert!(
            !ping(c, &lab.pods[web].v4()),
            "{b:?}: ICMP is no allowed port"
        );
        // Web has no egress policy: its pings go out and the replies come
        // back through its ingress policy as replies.
        assert!(
            ping(&lab.pods[web].ns.ns, &lab.pods[client].v4()),
            "{b:?}: web -> client"
        );
        // The node always reaches its pods.
        assert!(
            ping(&lab.node.ns.ns, &lab.pods[web].v4()),
            "{b:?}: node -> web"
        );
        // Unselected pods talk freely.
        assert!(ping(c, &lab.pods[other].v4()), "{b:?}: client -> other");
        // IPv6 alike (its addresses may still be tentative: a few tries).
        let w6: IpAddr = lab.pods[web].v6().parse().unwrap();
        listen(&lab.pods[web].ns.ns, w6, 8080);
        let ok6 = (0..30).any(|_| {
            talks(c, w6, 8080) || {
                std::thread::sleep(Duration::from_millis(100));
                false
            }
        });
        assert!(ok6, "{b:?}: client -> web:8080 over IPv6");
        assert!(!talks(o, w6, 8080), "{b:?}: other -> web over IPv6");
        for i in 0..3 {
            lab.check(i).ok();
        }
        lab.del_all();
    }
}

#[test]
fn ip_block_with_except() {
    root();
    for b in ALL {
        let (lab, web, client, other) = Lab::three(b, json!([]));
        lab.write_policy(
            "block.json",
            json!({"kind": "NetworkPolicy", "metadata": {"name": "block"},
                   "spec": {"podSelector": {"matchLabels": {"app": "web"}},
                   "ingress": [{"from": [{"ipBlock": {"cidr": "10.88.0.0/24",
                        "except": [format!("{}/32", lab.pods[client].v4())]}}]}]}}),
        );
        lab.sync();
        let w = lab.pods[web].v4();
        assert!(ping(&lab.pods[other].ns.ns, &w), "{b:?}: inside the block");
        assert!(!ping(&lab.pods[client].ns.ns, &w), "{b:?}: the except");
        lab.del_all();
    }
}

#[test]
fn egress_default_deny_keeps_replies() {
    root();
    for b in ALL {
        let policies = json!([{"name": "lockdown", "podSelector": {"matchLabels": {"app": "client"}},
                               "policyTypes": ["Egress"]}]);
        let mut lab = Lab::new(b, policies);
        let web = lab.add("web");
        let client = lab.add("client");
        let c = &lab.pods[client];
        assert!(!ping(&c.ns.ns, &lab.pods[web].v4()), "{b:?}: egress denied");
        // Connections to the client are replied to: replies are not new
        // egress.
        listen(&c.ns.ns, c.ip4(), 7000);
        assert!(
            talks(&lab.pods[web].ns.ns, c.ip4(), 7000),
            "{b:?}: reply to web"
        );
        assert!(ping(&lab.pods[web].ns.ns, &c.v4()), "{b:?}: ping reply");
        // The node is always reachable.
        assert!(ping(&c.ns.ns, "10.88.0.1"), "{b:?}: client -> node");
        lab.del(0);
        lab.del(1);
        lab.assert_clean();
    }
}

#[test]
fn a_new_pod_matching_a_peer_selector_is_reachable_at_once() {
    root();
    for b in ALL {
        let mut lab = Lab::new(b, web_policy());
        let web = lab.add("web");
        let w = lab.pods[web].ip4();
        listen(&lab.pods[web].ns.ns, w, 8080);
        let c1 = lab.add("client");
        assert!(talks(&lab.pods[c1].ns.ns, w, 8080), "{b:?}: first client");
        let before = lab.show();
        // Same labels: same identity, no rule set changes.
        let c2 = lab.add("client");
        assert!(
            talks(&lab.pods[c2].ns.ns, w, 8080),
            "{b:?}: second client at once"
        );
        let after = lab.show();
        assert_eq!(before["rulesets"], after["rulesets"], "{b:?}");
        let id = |v: &Value, cid: &str| v["pods"][format!("{cid}/eth0")]["identity"].clone();
        assert_eq!(id(&after, "ctr-1"), id(&after, "ctr-2"));
        // New labels in a namespace the selector matches: a new identity,
        // added to the rule set as a peer.
        let policies = json!([{"name": "web", "podSelector": {"matchLabels": {"app": "web"}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}},
                                  {"namespaceSelector": {"matchLabels": {"team": "a"}}}]}]}]);
        lab.policies = policies;
        lab.write_policy(
            "ns.json",
            json!({"kind": "Namespace", "metadata": {"name": "team-a", "labels": {"team": "a"}}}),
        );
        lab.sync();
        let c3 = lab.add_in(json!([{"key": "role", "value": "batch"}]), "team-a");
        assert!(
            talks(&lab.pods[c3].ns.ns, w, 8080),
            "{b:?}: namespace peer at once"
        );
        let c4 = lab.add_in(json!([{"key": "role", "value": "batch"}]), "team-b");
        assert!(
            !talks(&lab.pods[c4].ns.ns, w, 8080),
            "{b:?}: other namespace"
        );
        lab.del_all();
    }
}

/// The eBPF backends put their programs on the pods' veths only while the
/// network has a policy (none of them costs a packet anything before), on
/// every pod's once one exists, selected or not, and take them off again
/// when the last goes; CHECK passes in each state.
#[test]
fn an_edit_and_a_sync_change_what_passes() {
    root();
    for b in ALL {
        let (lab, web, client, other) = Lab::three(b, json!([]));
        let ebpf = !matches!(b, Backend::Nftables);
        let hooked = |lab: &Lab| [web, client, other].map(|i| lab.policy_hooked(i));
        let w = lab.pods[web].ip4();
        listen(&lab.pods[web].ns.ns, w, 8080);
        assert!(
            talks(&lab.pods[other].ns.ns, w, 8080),
            "{b:?}: no policy yet"
        );
        assert_eq!(hooked(&lab), [false; 3], "{b:?}: no policy, no programs");
        lab.check(web).ok();
        lab.write_policy("web.json", web_policy()[0].clone());
        // A new file takes effect at the next ADD, DEL or sync.
        let out = lab.sync();
        assert!(out.contains("1 policies"), "{out}");
        assert_eq!(hooked(&lab), [ebpf; 3], "{b:?}: a policy, every pod's veth");
        lab.check(client).ok();
        assert!(!talks(&lab.pods[other].ns.ns, w, 8080), "{b:?}: after sync");
        assert!(
            talks(&lab.pods[client].ns.ns, w, 8080),
            "{b:?}: client still"
        );
        // Widen to app=other.
        let mut p = web_policy()[0].clone();
        p["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app"] = json!("other");
        lab.write_policy("web.json", p);
        lab.sync();
        assert!(talks(&lab.pods[other].ns.ns, w, 8080), "{b:?}: widened");
        assert!(
            !talks(&lab.pods[client].ns.ns, w, 8080),
            "{b:?}: client now out"
        );
        // CHECK agrees with what is applied, and notices an unsynced edit.
        lab.check(web).ok();
        std::fs::remove_file(lab.policy_dir.path().join("web.json")).unwrap();
        let (code, msg) = lab.check(web).err();
        assert_eq!(code, 106, "{msg}");
        lab.sync();
        assert!(
            talks(&lab.pods[client].ns.ns, w, 8080),
            "{b:?}: policy gone"
        );
        assert_eq!(hooked(&lab), [false; 3], "{b:?}: the last policy gone");
        lab.check(web).ok();
        lab.del_all();
    }
}

#[test]
fn bad_input_fails_cleanly_and_del_gc_are_idempotent() {
    root();
    for b in ALL {
        let mut lab = Lab::new(
            b,
            json!([{"name": "bad", "podSelector": {},
            "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["11.0.0.0/16"]}}]}]}]),
        );
        let ns = TestNs::new();
        let bc = lab.node.conf("1.1.0", json!({}));
        let r = lab.node.add(&ns, "ctr-bad", &bc);
        let pod = Pod {
            ns,
            cid: "ctr-bad".into(),
            labels: json!([]),
            namespace: "default".into(),
            bridge: r.clone(),
            result: r.clone(),
        };
        let (code, msg) = lab.policy("ADD", &pod, &r).err();
        assert_eq!(code, 7, "{msg}");
        assert!(
            msg.contains("default/bad") && msg.contains("except"),
            "{msg}"
        );
        lab.assert_clean();
        // Without prevResult: code 7 too.
        let (code, _) = lab.policy("ADD", &pod, &Value::Null).err();
        assert_eq!(code, 7);
        lab.policies = json!([]);
        lab.pods.push(pod);
        let out = lab.policy("ADD", &lab.pods[0], &r).ok();
        assert_eq!(
            normalize_result(&out, "1.1.0"),
            normalize_result(&r, "1.1.0")
        );
        lab.pods[0].result = out;
        // STATUS, GC keeping the pod, then GC dropping it; DEL twice.
        let conf = lab.policy_conf(&json!([]), "default", &Value::Null);
        lab.node.status(&bin("policy"), &conf).ok();
        lab.node
            .gc(
                &bin("policy"),
                &conf,
                json!([{"containerID": "ctr-bad", "ifname": "eth0"}]),
            )
            .ok();
        assert_eq!(lab.show()["pods"].as_object().unwrap().len(), 1);
        lab.check(0).ok();
        lab.node.gc(&bin("policy"), &conf, json!([])).ok();
        lab.assert_clean();
        lab.del(0);
        lab.policy("DEL", &lab.pods[0], &Value::Null).ok();
        lab.assert_clean();
    }
}

/// The reference's bandwidth before policy on clsact (attachMode tc): its
/// egress limit leaves a plain ingress qdisc on the host veth, which keeps
/// clsact off and has one filter block, so a filter for clsact's egress
/// hook would join it and run on what comes in. ADD fails saying so, and
/// leaves none of policy's filters or state.
#[test]
fn tc_mode_beside_the_reference_bandwidths_ingress_qdisc_fails_cleanly() {
    root();
    let mut lab = Lab::new(Backend::Ebpf, json!([]));
    lab.extra = json!({"attachMode": "tc"});
    let ns = TestNs::new();
    // Debian's reference plugins (1.1.1) speak up to 1.0.0.
    let bc = lab.node.conf("1.0.0", json!({}));
    let r = lab.node.add(&ns, "ctr-bw", &bc);
    let bw = json!({"cniVersion": "1.0.0", "name": "podnet", "type": "bandwidth",
        "egressRate": 10_000_000, "egressBurst": 256_000, "prevResult": r});
    let rb = lab
        .node
        .call(
            &rcni_testkit::reference_bin("bandwidth"),
            "ADD",
            &ns.path(),
            "ctr-bw",
            &bw,
        )
        .ok();
    // The bridge's result: the bridge, the host veth, the pod's interface.
    let veth = r["interfaces"][1]["name"].as_str().unwrap().to_string();
    let qdiscs = stdout_of(command_in(&lab.node.ns.ns, "tc").args(["qdisc", "show", "dev", &veth]));
    assert!(qdiscs.contains("qdisc ingress"), "{qdiscs}");
    let pod = Pod {
        ns,
        cid: "ctr-bw".into(),
        labels: json!([]),
        namespace: "default".into(),
        bridge: r.clone(),
        result: rb.clone(),
    };
    let (_, msg) = lab.policy("ADD", &pod, &rb).err();
    assert!(
        msg.contains("ingress qdisc") && msg.contains("egress"),
        "{msg}"
    );
    // (No egress hook to list without clsact: tc's failure there is fine.)
    for hook in ["ingress", "egress"] {
        let out = command_in(&lab.node.ns.ns, "tc")
            .args(["filter", "show", "dev", &veth, hook])
            .output()
            .unwrap();
        let f = String::from_utf8_lossy(&out.stdout);
        assert!(!f.contains("rcni_"), "{hook}: {f}");
    }
    lab.assert_clean();
}

/// With fastpath in the chain, allowed pod-to-pod traffic is redirected
/// (the fast path's counter rises) and denied traffic is dropped before the
/// redirect (the policy's deny counter rises).
#[test]
fn fastpath_redirects_only_what_policy_allows() {
    fastpath_redirects_only_what_policy_allows_on(None);
}

/// The same on tcx links: one link per port for both plugins' rcni_pod.
#[test]
fn fastpath_redirects_only_what_policy_allows_on_tcx() {
    fastpath_redirects_only_what_policy_allows_on(Some("tcx"));
}

fn fastpath_redirects_only_what_policy_allows_on(mode: Option<&str>) {
    root();
    let mut lab = Lab::new(Backend::EbpfFastpath, web_policy());
    if let Some(m) = mode {
        lab.extra = json!({"attachMode": m});
    }
    let tcx = mode == Some("tcx");
    let web = lab.add("web");
    let client = lab.add("client");
    let other = lab.add("other");
    let w = lab.pods[web].ip4();
    listen(&lab.pods[web].ns.ns, w, 8080);
    let dir = lab.pin_dir();
    let verdicts = |dir: PathBuf| {
        lab.node
            .ns
            .ns
            .run(move || {
                let dp = Datapath::open(&dir).unwrap().unwrap();
                dp.verdicts().unwrap()
            })
            .unwrap()
    };
    let count = |v: &[(rcni_ebpf::Verdict, u64)], which: rcni_ebpf::Verdict| {
        v.iter()
            .find(|(k, _)| *k == which)
            .map(|(_, n)| *n)
            .unwrap_or(0)
    };
    let v0 = verdicts(dir.clone());
    assert!(talks(&lab.pods[client].ns.ns, w, 8080));
    let v1 = verdicts(dir.clone());
    assert!(
        count(&v1, rcni_ebpf::Verdict::Redirect) > count(&v0, rcni_ebpf::Verdict::Redirect),
        "allowed traffic takes the fast path: {v0:?} -> {v1:?}"
    );
    assert!(!talks(&lab.pods[other].ns.ns, w, 8080));
    let v2 = verdicts(dir.clone());
    assert!(
        count(&v2, rcni_ebpf::Verdict::PolicyDenyIn) > count(&v1, rcni_ebpf::Verdict::PolicyDenyIn),
        "denied before the redirect: {v1:?} -> {v2:?}"
    );
    // One program on a pod's ingress hook for both plugins: policy's DEL
    // takes its part out and leaves the program to the fast path.
    let web_veth = lab.pods[web].bridge["interfaces"][1]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let hook = |lab: &Lab| {
        let (dir, v) = (lab.pin_dir(), web_veth.clone());
        lab.node
            .ns
            .ns
            .run(move || {
                let mut dp = Datapath::open(&dir).unwrap().unwrap();
                let i = nix::net::if_::if_nametoindex(v.as_str()).unwrap();
                let rt = rcni_netlink::runtime().unwrap();
                let filters = rt.block_on(async {
                    let n = rcni_netlink::Netlink::connect_current().await.unwrap();
                    n.ingress_bpf_filters(i).await.unwrap()
                });
                let mut names: Vec<String> = filters.into_iter().filter_map(|f| f.name).collect();
                // tcx: the programs on the hook, rcni_pod by its id.
                let pod = dp.program_id_of(rcni_ebpf::Program::Pod).unwrap();
                for id in rcni_ebpf::tcx_programs(&v).unwrap() {
                    names.push(if id == pod {
                        format!("tcx {}", rcni_ebpf::POD_PROGRAM)
                    } else {
                        format!("tcx {id}")
                    });
                }
                let parts = dp.port_parts(i).unwrap();
                (names, parts, dp.pod_attached(&v, PORT_FASTPATH).unwrap())
            })
            .unwrap()
    };
    let pod = vec![format!(
        "{}{}",
        if tcx { "tcx " } else { "" },
        rcni_ebpf::POD_PROGRAM
    )];
    assert_eq!(
        hook(&lab),
        (pod.clone(), PORT_FASTPATH | rcni_ebpf::PORT_POLICY, true)
    );
    let links = |lab: &Lab| rcni_ebpf::pinned_port_links(&lab.pin_dir()).unwrap().len();
    assert_eq!(links(&lab), if tcx { 3 } else { 0 }, "a link per port");
    lab.check(web).ok();
    lab.policy("DEL", &lab.pods[web], &lab.pods[web].result)
        .ok();
    assert_eq!(hook(&lab), (pod, PORT_FASTPATH, true));
    let v3 = verdicts(dir.clone());
    assert!(
        talks(&lab.pods[other].ns.ns, w, 8080),
        "web has no policy left"
    );
    let v4 = verdicts(dir.clone());
    assert!(
        count(&v4, rcni_ebpf::Verdict::Redirect) > count(&v3, rcni_ebpf::Verdict::Redirect),
        "the fast path still runs on web's veth: {v3:?} -> {v4:?}"
    );
    lab.del_all();
    assert_eq!(links(&lab), 0);
}

/// conf/80-bridge-policy.conflist as a runtime runs it (cnitool: ADD in
/// order, CHECK, STATUS, GC, DEL in reverse), namespaces from CNI_ARGS:
/// prod pods accept prod only.
#[test]
fn example_conflist_runs_through_cnitool() {
    root();
    let file = "80-bridge-policy.conflist";
    let net = "bridge-policy";
    let node = Node::new();
    let fs = Bpffs::empty();
    let (confdir, cache, state) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../conf")
        .join(file);
    let mut v: Value = serde_json::from_slice(&std::fs::read(src).unwrap()).unwrap();
    for p in v["plugins"].as_array_mut().unwrap() {
        match p["type"].as_str().unwrap() {
            "bridge" => p["ipam"]["dataDir"] = json!(node.data.path()),
            "fastpath" => p["pinRoot"] = json!(fs.root()),
            _ => {
                p["pinRoot"] = json!(fs.root());
                p["dataDir"] = json!(state.path());
                p["policyDir"] = json!(state.path().join("policies"));
            }
        }
    }
    std::fs::write(confdir.path().join(file), v.to_string()).unwrap();
    let run = |ns: &str, args: &[&str]| {
        let a = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={ns}");
        node.cnitool(
            confdir.path(),
            cache.path(),
            args,
            &[("CNI_ARGS", a.as_str())],
        )
    };
    let pods: Vec<(TestNs, &str, &str)> = vec![
        (TestNs::new(), "prod", "ctr-a"),
        (TestNs::new(), "prod", "ctr-b"),
        (TestNs::new(), "dev", "ctr-c"),
    ];
    let results: Vec<Value> = pods
        .iter()
        .map(|(p, ns, cid)| run(ns, &["add", net, &p.path(), "--container-id", cid]).ok())
        .collect();
    run(
        "prod",
        &["check", net, &pods[0].0.path(), "--container-id", "ctr-a"],
    )
    .ok();
    run("prod", &["status", net]).ok();
    let a4 = addr_of(&results[0], true);
    assert!(ping(&pods[1].0.ns, &a4), "prod -> prod");
    assert!(!ping(&pods[2].0.ns, &a4), "dev -> prod");
    assert!(
        ping(&pods[0].0.ns, &addr_of(&results[2], true)),
        "prod -> dev"
    );
    // GC with only A valid: B and C go from the policy's state.
    run("prod", &["gc", net, "--valid", "ctr-a/eth0"]).ok();
    let dd = state.path().display().to_string();
    let out = command_in(&node.ns.ns, bin("policy"))
        .args(["show", "--network", net, "--data-dir", &dd, "--json"])
        .output()
        .unwrap();
    let show: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(show["pods"].as_object().unwrap().len(), 1, "{show}");
    for _ in 0..2 {
        run(
            "prod",
            &["del", net, &pods[0].0.path(), "--container-id", "ctr-a"],
        )
        .ok();
    }
    assert!(node.host_veths().is_empty(), "{:?}", node.host_veths());
}

/// `policy flows --follow` in the node namespace: its lines as they come.
struct Flows {
    child: std::process::Child,
    rx: std::sync::mpsc::Receiver<Value>,
}

impl Flows {
    fn start(lab: &Lab) -> Flows {
        let dd = lab.data_dir().display().to_string();
        let mut child = rcni_testkit::tied_command_in(&lab.node.ns.ns, bin("policy"))
            .args([
                "flows",
                "--follow",
                "--network",
                "podnet",
                "--data-dir",
                &dd,
            ])
            .args(["--node", "node-a"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let v: Value = serde_json::from_str(&l).unwrap_or_else(|e| panic!("{l}: {e}"));
                if tx.send(v).is_err() {
                    return;
                }
            }
        });
        // Collecting once it holds the network's collector lock and has
        // its source open behind it.
        let lock = lab.data_dir().join("podnet").join("flows.lock");
        let held = || {
            std::fs::File::open(&lock).is_ok_and(|f| {
                nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock).is_err()
            })
        };
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while !held() {
            if let Some(st) = child.try_wait().unwrap() {
                panic!("policy flows exited: {st}");
            }
            assert!(
                std::time::Instant::now() < until,
                "policy flows never started"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        if lab.backend == Backend::Nftables {
            // NFLOG drops what comes before its bind: bound once the node's
            // namespace lists an instance (a fixed wait once lost the first
            // datagram's event under CI's load).
            let log = "/proc/thread-self/net/netfilter/nfnetlink_log";
            rcni_testkit::wait_for(Duration::from_secs(10), "policy flows' NFLOG bind", || {
                lab.node
                    .ns
                    .ns
                    .run(|| std::fs::read_to_string(log))
                    .is_ok_and(|r| r.is_ok_and(|t| !t.trim().is_empty()))
            });
        }
        // And a moment for the collector past its source (the eBPF
        // backend's ring reader shows no sign of its own to wait for).
        std::thread::sleep(Duration::from_millis(300));
        Flows { child, rx }
    }

    /// The next event within `t`.
    fn next(&self, t: Duration) -> Option<Value> {
        self.rx.recv_timeout(t).ok()
    }

    /// Every event that comes within `t`.
    fn drain(&self, t: Duration) -> Vec<Value> {
        let until = std::time::Instant::now() + t;
        let mut v = vec![];
        while let Some(left) = until.checked_duration_since(std::time::Instant::now()) {
            match self.rx.recv_timeout(left) {
                Ok(e) => v.push(e),
                Err(_) => break,
            }
        }
        v
    }
}

impl Drop for Flows {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One UDP datagram from `ns` to `addr:port`, from source port `sport`.
fn udp_send(ns: &NetNs, addr: IpAddr, sport: u16, port: u16) {
    ns.run(move || {
        let s = std::net::UdpSocket::bind((std::net::Ipv4Addr::UNSPECIFIED, sport)).unwrap();
        s.send_to(b"rcni", (addr, port)).unwrap();
    })
    .unwrap();
}

fn pod_name(lab: &Lab, i: usize) -> String {
    format!("default/{}", lab.pods[i].cid)
}

/// A denied UDP datagram and a denied TCP connection produce one event
/// each, naming both pods and the selecting policy; an
/// allowed connection produces none (flowEvents defaults to "deny").
#[test]
fn flow_events_report_each_denied_connection_once() {
    root();
    for b in ALL {
        let (lab, web, client, other) = Lab::three(b, web_policy());
        let w = lab.pods[web].ip4();
        let o = lab.pods[other].ip4();
        listen(&lab.pods[web].ns.ns, w, 8080);
        let flows = Flows::start(&lab);
        assert!(talks(&lab.pods[client].ns.ns, w, 8080), "{b:?}");
        udp_send(&lab.pods[other].ns.ns, w, 5353, 8080);
        let e = flows
            .next(Duration::from_secs(10))
            .unwrap_or_else(|| panic!("{b:?}: no event within 10 s for the denied datagram"));
        assert_eq!(e["version"], 1);
        assert_eq!(e["node"], "node-a");
        assert_eq!(e["network"], "podnet");
        assert_eq!(e["verdict"], "deny", "{b:?}: {e}");
        assert_eq!(e["direction"], "ingress", "{e}");
        assert_eq!(e["protocol"], "UDP", "{e}");
        assert_eq!(e["src"]["ip"], o.to_string(), "{e}");
        assert_eq!(e["src"]["port"], 5353, "{e}");
        assert_eq!(e["src"]["pod"], pod_name(&lab, other), "{e}");
        assert_eq!(e["dst"]["ip"], w.to_string(), "{e}");
        assert_eq!(e["dst"]["port"], 8080, "{e}");
        assert_eq!(e["dst"]["pod"], pod_name(&lab, web), "{e}");
        assert_eq!(e["policy"], "default-deny", "{e}");
        assert_eq!(e["policies"], json!(["default/web"]), "{e}");
        // A TCP connection: SYN retransmissions are the same attempt.
        let ns = lab.pods[other].ns.ns.try_clone().unwrap();
        let t = std::thread::spawn(move || talks(&ns, w, 8080));
        let e = flows
            .next(Duration::from_secs(10))
            .unwrap_or_else(|| panic!("{b:?}: no event within 10 s for the denied connection"));
        assert!(!t.join().unwrap(), "{b:?}: denied");
        assert_eq!(e["protocol"], "TCP", "{e}");
        assert_eq!(e["dst"]["port"], 8080, "{e}");
        assert_eq!(e["src"]["pod"], pod_name(&lab, other), "{e}");
        let more = flows.drain(Duration::from_millis(1500));
        assert!(more.is_empty(), "{b:?}: one event per denial: {more:?}");
        // The log keeps them for later readers.
        let past = lab.operator(&["flows", "--verdict", "deny"]);
        assert_eq!(past.lines().count(), 2, "{b:?}: {past}");
        drop(flows);
        lab.del_all();
    }
}

/// With "flowEvents": "all", a connection a policy allows is reported
/// with the policy that allowed it.
#[test]
fn flow_events_report_allowed_connections_when_asked() {
    root();
    for b in ALL {
        let mut lab = Lab::new(b, web_policy());
        lab.extra = json!({"flowEvents": "all"});
        let web = lab.add("web");
        let client = lab.add("client");
        let w = lab.pods[web].ip4();
        listen(&lab.pods[web].ns.ns, w, 9001);
        let flows = Flows::start(&lab);
        assert!(talks(&lab.pods[client].ns.ns, w, 9001));
        let e = flows
            .next(Duration::from_secs(10))
            .unwrap_or_else(|| panic!("{b:?}: no event for the allowed connection"));
        assert_eq!(e["verdict"], "allow", "{e}");
        assert_eq!(e["policy"], "default/web", "{e}");
        assert_eq!(e["dst"]["port"], 9001, "{e}");
        assert_eq!(e["src"]["pod"], pod_name(&lab, client), "{e}");
        // Only the connection's first packet: nothing more.
        let more = flows.drain(Duration::from_millis(500));
        assert!(more.is_empty(), "{b:?}: {more:?}");
        drop(flows);
        lab.del_all();
    }
}

/// A flood of denied datagrams (a new flow each) from one pod: the events
/// stay within the policed pod's rate limit, and the rest are counted.
#[test]
fn a_flood_of_denials_stays_within_the_rate_limit() {
    root();
    for b in ALL {
        let mut lab = Lab::new(b, web_policy());
        lab.extra = json!({"flowRate": 5});
        let web = lab.add("web");
        let other = lab.add("other");
        let w = lab.pods[web].ip4();
        let flows = Flows::start(&lab);
        let start = std::time::Instant::now();
        lab.pods[other]
            .ns
            .ns
            .run(move || {
                let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
                // 2000 flows (source port is fixed, destination port varies).
                for i in 0..2000u16 {
                    let _ = s.send_to(b"x", (w, 20000 + i));
                }
            })
            .unwrap();
        let secs = start.elapsed().as_secs_f64();
        let events = flows.drain(Duration::from_millis(1200));
        // One more after the window: it carries the count of the rest.
        udp_send(&lab.pods[other].ns.ns, w, 4444, 19999);
        let last: Vec<Value> = flows
            .next(Duration::from_secs(10))
            .into_iter()
            .chain(flows.drain(Duration::from_millis(300)))
            .collect();
        let all: Vec<&Value> = events.iter().chain(last.iter()).collect();
        let windows = secs.ceil() as usize + 2;
        assert!(
            events.len() <= 5 * windows,
            "{b:?}: {} events in {secs:.2} s",
            events.len()
        );
        assert!(events.len() >= 5, "{b:?}: {} events", events.len());
        let suppressed: u64 = all.iter().map(|e| e["suppressed"].as_u64().unwrap()).sum();
        assert!(
            suppressed + all.len() as u64 >= 1900,
            "{b:?}: {} events, {suppressed} suppressed of 2001 denials",
            all.len()
        );
        drop(flows);
        lab.del_all();
    }
}

/// An audit-only policy (the annotation, and the network-wide switch)
/// lets the traffic through and reports what it would deny.
#[test]
fn audit_mode_lets_traffic_through_and_reports_it() {
    root();
    let mut spec = json!([{"kind": "NetworkPolicy", "apiVersion": "networking.k8s.io/v1",
        "metadata": {"name": "web", "namespace": "default",
                     "annotations": {"rcni.io/audit": "true"}},
        "spec": web_policy()[0].clone()}]);
    spec[0]["spec"].as_object_mut().unwrap().remove("name");
    for b in ALL {
        for network_wide in [false, true] {
            let mut lab = Lab::new(
                b,
                if network_wide {
                    web_policy()
                } else {
                    spec.clone()
                },
            );
            if network_wide {
                lab.extra = json!({"audit": true});
            }
            let web = lab.add("web");
            let other = lab.add("other");
            let w = lab.pods[web].ip4();
            listen(&lab.pods[web].ns.ns, w, 8080);
            let flows = Flows::start(&lab);
            assert!(
                talks(&lab.pods[other].ns.ns, w, 8080),
                "{b:?}: audit never denies"
            );
            let e = flows
                .next(Duration::from_secs(10))
                .unwrap_or_else(|| panic!("{b:?}: no audit event"));
            assert_eq!(e["verdict"], "audit", "{e}");
            assert_eq!(e["policy"], "default-deny", "{e}");
            assert_eq!(e["policies"], json!(["default/web"]), "{e}");
            assert_eq!(e["src"]["pod"], pod_name(&lab, other), "{e}");
            let more = flows.drain(Duration::from_millis(500));
            assert!(more.is_empty(), "{b:?}: once per connection: {more:?}");
            drop(flows);
            lab.del_all();
        }
    }
}
