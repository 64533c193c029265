//! `rcni-node run --metrics-addr`: the agent of a simulated cluster node
//! (rcni_integration::lab::cluster) serves /metrics inside its node
//! namespace; `promtool check metrics` (Debian's prometheus) accepts it,
//! and its counters move with a real reconcile (a node joins the cluster
//! file), real pod traffic across nodes on the eBPF datapath, and the
//! plugins' real ADD and DEL. `rcni-node status` reads what the agent
//! wrote.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rcni_integration::addr_of;
use rcni_integration::lab::cluster::{Cluster, ClusterNode, SETTLE};
use rcni_integration::lab::metrics::promtool_check;
use rcni_netns::NetNs;
use rcni_testkit::{Call, TestNs, bin, ping};
use serde_json::{Value, json};

/// The agent's port inside its node namespace (each node has its own
/// loopback: no clash with anything on the host).
const PORT: u16 = 9680;
const TO_REMOTE: &str = "redirected to another node";

/// A running agent: killed (and waited for) on drop, its stderr kept.
struct Agent {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Agent {
    fn start(node: &ClusterNode, file: &Path, extra: &[&std::ffi::OsStr]) -> Agent {
        let mut child = node
            .agent(file)
            // A pass (and a status file) every second besides the
            // file's changes.
            .args(["--poll-ms", "50", "--resync-s", "1"])
            .args(extra)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let err = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        Agent { child, log }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits until the log holds `what`.
    fn wait_for(&self, what: &str) {
        let t0 = Instant::now();
        while !self.log().contains(what) {
            assert!(
                t0.elapsed() < SETTLE,
                "no {what:?} in the agent's log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
    }
}

/// An HTTP GET of `path` on the agent's port, from inside `ns`: (status
/// line, body).
fn get(ns: &NetNs, path: &str) -> (String, String) {
    let path = path.to_string();
    ns.run(move || {
        let mut c = std::net::TcpStream::connect(("127.0.0.1", PORT)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        write!(c, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        (head.lines().next().unwrap().to_string(), body.to_string())
    })
    .unwrap()
}

fn scrape(ns: &NetNs) -> String {
    let (status, body) = get(ns, "/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    body
}

/// Whether `net` ("a.b.c.d/len" or an IPv6 prefix) holds `ip`.
fn net_contains(net: &str, ip: std::net::IpAddr) -> bool {
    net.parse::<ipnetwork::IpNetwork>()
        .is_ok_and(|n| n.contains(ip))
}

/// The value of the series `series` (name and labels exactly as written),
/// 0 when absent.
fn value(body: &str, series: &str) -> f64 {
    rcni_integration::lab::metrics::value(body, series).unwrap_or(0.0)
}

/// Polls /metrics until `ok` holds for it.
fn scrape_until(ns: &NetNs, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let t0 = Instant::now();
    loop {
        let body = scrape(ns);
        if ok(&body) {
            return body;
        }
        assert!(t0.elapsed() < SETTLE, "{what}:\n{body}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A pod through the node's conflist (bridge + host-local, then
/// fastpath), each plugin recording into `stats`.
fn add_pod(node: &ClusterNode, stats: &Path, cid: &str) -> (TestNs, Value) {
    let pod = TestNs::new();
    let list: Value =
        serde_json::from_slice(&std::fs::read(node.conf_dir().join("10-rcni.conflist")).unwrap())
            .unwrap();
    let mut prev = Value::Null;
    for p in list["plugins"].as_array().unwrap() {
        let mut c = p.clone();
        c["cniVersion"] = list["cniVersion"].clone();
        c["name"] = list["name"].clone();
        if !prev.is_null() {
            c["prevResult"] = prev.clone();
        }
        prev = Call::new(bin(p["type"].as_str().unwrap()), "ADD")
            .env("CNI_CONTAINERID", cid)
            .env("RCNI_CNI_STATS_DIR", stats.to_str().unwrap())
            .netns(&pod.path())
            .stdin(&c)
            .run_in(&node.ns.ns)
            .ok();
    }
    (pod, prev)
}

/// DEL through the conflist, last plugin first.
fn del_pod(node: &ClusterNode, stats: &Path, cid: &str, pod: &TestNs, result: &Value) {
    let list: Value =
        serde_json::from_slice(&std::fs::read(node.conf_dir().join("10-rcni.conflist")).unwrap())
            .unwrap();
    for p in list["plugins"].as_array().unwrap().iter().rev() {
        let mut c = p.clone();
        c["cniVersion"] = list["cniVersion"].clone();
        c["name"] = list["name"].clone();
        c["prevResult"] = result.clone();
        Call::new(bin(p["type"].as_str().unwrap()), "DEL")
            .env("CNI_CONTAINERID", cid)
            .env("RCNI_CNI_STATS_DIR", stats.to_str().unwrap())
            .netns(&pod.path())
            .stdin(&c)
            .run_in(&node.ns.ns)
            .ok();
    }
}

fn status_of(file: &Path, json: bool) -> (i32, String, String) {
    let mut c = Command::new(bin("rcni-node"));
    c.arg("status").arg("--status-file").arg(file);
    if json {
        c.arg("--json");
    }
    let out = c.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn metrics_move_with_reconciles_traffic_and_plugins_and_promtool_accepts_them() {
    let c = Cluster::new(&[0, 0, 0]);
    let on = json!({"ebpf": true});
    c.write_with("host-gw", &[0, 1], on.clone());
    let (n1, n2) = (&c.nodes[0], &c.nodes[1]);
    n2.reconcile(&c.file);
    let tmp = tempfile::tempdir().unwrap();
    let stats: PathBuf = tmp.path().join("cni-stats");
    let status_file = tmp.path().join("node-status.json");
    let (code, _, err) = status_of(&status_file, false);
    assert_eq!(code, 1);
    assert!(err.contains("the agent is not running"), "{err}");

    let addr = format!("127.0.0.1:{PORT}");
    let mut agent = Agent::start(
        n1,
        &c.file,
        &[
            "--metrics-addr".as_ref(),
            addr.as_ref(),
            "--cni-stats-dir".as_ref(),
            stats.as_os_str(),
            "--status-file".as_ref(),
            status_file.as_os_str(),
        ],
    );
    agent.wait_for("serving metrics on http://127.0.0.1:9680/metrics");
    agent.wait_for("kernel changes");
    assert!(stats.is_dir(), "the agent makes the stats directory");

    let ok = "rcni_reconcile_total{loop=\"agent\",result=\"ok\"}";
    let routes = "rcni_kernel_changes_total{loop=\"agent\",kind=\"route\"}";
    let body = scrape_until(&n1.ns.ns, "the first reconcile", |b| value(b, ok) >= 1.0);
    promtool_check(&body);
    assert!(body.contains("# TYPE rcni_reconcile_duration_seconds histogram"));
    assert_eq!(
        value(
            &body,
            "rcni_reconcile_duration_seconds_count{loop=\"agent\"}"
        ),
        value(&body, ok)
    );
    assert!(
        value(
            &body,
            "rcni_reconcile_last_success_timestamp_seconds{loop=\"agent\"}"
        ) > 1.7e9
    );
    assert!(value(&body, "rcni_agent_start_time_seconds") > 1.7e9);
    assert!(body.contains("rcni_build_info{version=\""));
    // The first pass made n2's route (and the datapath's map entry).
    assert!(value(&body, routes) >= 1.0, "{body}");
    assert!(
        value(
            &body,
            "rcni_kernel_changes_total{loop=\"agent\",kind=\"ebpf\"}"
        ) >= 1.0
    );
    let (status, nf) = get(&n1.ns.ns, "/");
    assert!(status.starts_with("HTTP/1.1 404"), "{status} {nf}");

    // A real reconcile: n3 joins the file, the agent routes to it.
    let (oks, changed) = (value(&body, ok), value(&body, routes));
    c.write_with("host-gw", &[0, 1, 2], on.clone());
    let body = scrape_until(&n1.ns.ns, "a reconcile for n3", |b| {
        value(b, ok) > oks && value(b, routes) > changed
    });
    assert_eq!(
        value(
            &body,
            "rcni_reconcile_total{loop=\"agent\",result=\"error\"}"
        ),
        0.0
    );

    // Pods: the plugins record their commands, host-local's files are the
    // pool's use.
    let (p1, r1) = add_pod(n1, &stats, "p1");
    let (p1b, r1b) = add_pod(n1, &stats, "p1b");
    let (p2, r2) = n2.add_pod("p2");
    let a2 = addr_of(&r2, true);
    // A config that does not parse: the runtime's error code (6, decoding)
    // is what is counted.
    let bad = Call::new(bin("bridge"), "ADD")
        .env("CNI_CONTAINERID", "bad")
        .env("RCNI_CNI_STATS_DIR", stats.to_str().unwrap())
        .netns(&p1.path())
        .stdin_raw(b"{not json")
        .run_in(&n1.ns.ns);
    assert_eq!(bad.err().0, 6);
    let cmd = |p: &str, c: &str, code: u32| {
        format!("rcni_cni_commands_total{{plugin=\"{p}\",command=\"{c}\",code=\"{code}\"}}")
    };
    let used = "rcni_ipam_addresses{network=\"rcni\",range=\"10.244.1.0/24\",state=\"used\"}";
    let free = "rcni_ipam_addresses{network=\"rcni\",range=\"10.244.1.0/24\",state=\"free\"}";
    let body = scrape(&n1.ns.ns);
    promtool_check(&body);
    for (p, n) in [("bridge", 2.0), ("host-local", 2.0), ("fastpath", 2.0)] {
        assert_eq!(value(&body, &cmd(p, "ADD", 0)), n, "{p}\n{body}");
    }
    assert_eq!(value(&body, &cmd("bridge", "ADD", 6)), 1.0, "{body}");
    assert_eq!(
        value(
            &body,
            "rcni_cni_command_duration_seconds_count{plugin=\"bridge\",command=\"ADD\"}"
        ),
        3.0
    );
    assert!(
        value(
            &body,
            "rcni_cni_command_duration_seconds_sum{plugin=\"bridge\",command=\"ADD\"}"
        ) > 0.0
    );
    assert_eq!(value(&body, used), 2.0, "{body}");
    assert_eq!(value(&body, free), 251.0, "{body}");

    // Real traffic across the nodes on the eBPF datapath: its "to another
    // node" counter moves, as `fastpath stats` says.
    let series = format!(
        "rcni_datapath_packets_total{{network=\"rcni\",verdict=\"{TO_REMOTE}\",action=\"redirected\"}}"
    );
    let before = value(&body, &series);
    // And per peer: what went to the subnet a2 is in.
    let to_peer = |body: &str| -> (f64, f64) {
        let dst: std::net::IpAddr = a2.parse().unwrap();
        let sum = |name: &str| {
            body.lines()
                .filter_map(|l| l.strip_prefix(name))
                .filter(|l| {
                    l.split("subnet=\"")
                        .nth(1)
                        .and_then(|r| r.split('"').next())
                        .is_some_and(|n| net_contains(n, dst))
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>()
        };
        (
            sum("rcni_datapath_peer_sent_packets_total{"),
            sum("rcni_datapath_peer_sent_bytes_total{"),
        )
    };
    let peer_before = to_peer(&body);
    assert!(ping(&p1.ns, &a2), "ping {a2}");
    assert!(ping(&p1b.ns, &a2), "ping {a2}");
    let body = scrape(&n1.ns.ns);
    let after = value(&body, &series);
    assert!(after >= before + 2.0, "{before} -> {after}\n{body}");
    assert!(after <= n1.verdict(TO_REMOTE) as f64);
    let peer_after = to_peer(&body);
    assert!(
        peer_after.0 >= peer_before.0 + 2.0 && peer_after.1 >= peer_before.1 + 2.0 * 98.0,
        "per peer: {peer_before:?} -> {peer_after:?}\n{body}"
    );
    promtool_check(&body);

    // The status screen: what the agent wrote after its last pass.
    let t0 = Instant::now();
    let screen = loop {
        let (code, out, err) = status_of(&status_file, false);
        assert_eq!(code, 0, "{err}");
        if out.contains("pods (2)") {
            break out;
        }
        // The pods came after the last pass: the next resync writes them.
        assert!(t0.elapsed() < SETTLE, "{out}");
        std::thread::sleep(Duration::from_millis(100));
    };
    for want in [
        "node n1",
        "backend host-gw   encryption none   network 10.244.0.0/16",
        "datapath ebpf",
        "peers (2)",
        "n2 ",
        "n3 ",
        "programmed",
        "pool rcni 10.244.1.0/24: 2 used, 251 free",
        "p1b",
        "last reconcile",
    ] {
        assert!(screen.contains(want), "{want:?} not in\n{screen}");
    }
    let (code, out, _) = status_of(&status_file, true);
    assert_eq!(code, 0);
    let doc: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["lastReconcile"]["ok"], true, "{doc}");
    assert_eq!(doc["stale"], false);
    assert_eq!(doc["peers"].as_array().unwrap().len(), 2);

    // DEL: counted, and the addresses are free again.
    del_pod(n1, &stats, "p1", &p1, &r1);
    del_pod(n1, &stats, "p1b", &p1b, &r1b);
    let body = scrape(&n1.ns.ns);
    for p in ["bridge", "host-local", "fastpath"] {
        assert_eq!(value(&body, &cmd(p, "DEL", 0)), 2.0, "{p}\n{body}");
    }
    assert_eq!(value(&body, used), 0.0, "{body}");
    assert_eq!(value(&body, free), 253.0, "{body}");
    promtool_check(&body);
    drop(p2);
    agent.stop();
}

#[test]
fn without_metrics_addr_nothing_is_served_and_no_stats_directory_is_made() {
    let c = Cluster::new(&[0]);
    c.write("host-gw", &[0]);
    let n1 = &c.nodes[0];
    let tmp = tempfile::tempdir().unwrap();
    let stats = tmp.path().join("cni-stats");
    let agent = Agent::start(
        n1,
        &c.file,
        &["--cni-stats-dir".as_ref(), stats.as_os_str()],
    );
    agent.wait_for("kernel changes");
    assert!(!stats.exists());
    let refused = n1
        .ns
        .ns
        .run(|| std::net::TcpStream::connect(("127.0.0.1", PORT)).is_err())
        .unwrap();
    assert!(refused);
    // A plugin finds no directory and records nothing.
    let (pod, r) = add_pod(n1, &stats, "p1");
    assert!(!stats.exists());
    del_pod(n1, &stats, "p1", &pod, &r);
}

#[test]
fn an_address_in_use_is_a_config_error() {
    let c = Cluster::new(&[0]);
    c.write("host-gw", &[0]);
    let n1 = &c.nodes[0];
    let tmp = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{PORT}");
    let _holder = n1
        .ns
        .ns
        .run(|| std::net::TcpListener::bind(("127.0.0.1", PORT)).unwrap())
        .unwrap();
    let out = n1
        .agent(&c.file)
        .args(["--metrics-addr", &addr])
        .arg("--cni-stats-dir")
        .arg(tmp.path().join("s"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--metrics-addr 127.0.0.1:9680") && err.contains("in use"),
        "{err}"
    );
}

/// The session gauge of every BGP peer in `body`: (peer label, value).
fn bgp_sessions(body: &str) -> Vec<(String, f64)> {
    body.lines()
        .filter_map(|l| l.strip_prefix("rcni_bgp_session_established{peer=\""))
        .filter_map(|rest| {
            let (peer, v) = rest.rsplit_once("\"} ")?;
            Some((peer.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// The BGP backend's full mesh: BIRD's session with the other node shows
/// as Established in /metrics and on the status screen, and as down once
/// that node's agent (and its BIRD) is gone.
#[test]
fn bgp_sessions_follow_birds() {
    let f = rcni_integration::lab::fabric::Fabric::one_l2(2);
    f.write(&[0, 1], json!({}));
    let tmp = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{PORT}");
    let status_file = tmp.path().join("status.json");
    let a1 = Agent::start(
        &f.nodes[0],
        &f.file,
        &[
            "--metrics-addr".as_ref(),
            addr.as_ref(),
            "--cni-stats-dir".as_ref(),
            tmp.path().join("s1").as_os_str(),
            "--status-file".as_ref(),
            status_file.as_os_str(),
        ],
    );
    let mut a2 = Agent::start(
        &f.nodes[1],
        &f.file,
        &[
            "--cni-stats-dir".as_ref(),
            tmp.path().join("s2").as_os_str(),
        ],
    );
    a1.wait_for("serving metrics on");
    let ns = &f.nodes[0].ns.ns;
    let t0 = Instant::now();
    let body = loop {
        let body = scrape(ns);
        let s = bgp_sessions(&body);
        if s.len() == 1 && s[0].1 == 1.0 {
            break body;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{s:?}\n{}\n{}",
            a1.log(),
            a2.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    promtool_check(&body);
    let t0 = Instant::now();
    loop {
        let (code, out, err) = status_of(&status_file, false);
        assert_eq!(code, 0, "{err}");
        if out.contains("BGP sessions (1)") && out.contains("Established") {
            assert!(out.contains("backend bgp"), "{out}");
            break;
        }
        assert!(t0.elapsed() < SETTLE, "{out}");
        std::thread::sleep(Duration::from_millis(100));
    }

    a2.stop();
    let body = scrape_until(ns, "the session down", |b| {
        bgp_sessions(b).iter().all(|(_, v)| *v == 0.0) && !bgp_sessions(b).is_empty()
    });
    promtool_check(&body);
    drop(a1);
}

/// Cloud mode (`--cloud azure`, against the fake of Azure's API that
/// cloud_azure.rs uses: no emulator of Azure exists): the pool's gauges
/// and the cloud loop's passes in /metrics, a pod's address as used, the
/// vpc-ipam plugin's commands counted, the pod on the status screen.
#[test]
fn cloud_pool_use_shows_in_metrics_and_status() {
    const MAC: &str = "00:0D:3A:F8:06:EC";
    const MD: &str = "169.254.169.254";
    let ns = TestNs::new();
    let tmp = tempfile::tempdir().unwrap();
    for a in [
        "link set lo up".to_string(),
        format!("addr add {MD}/32 dev lo"),
        "link add eth0 type veth peer name vnet0".into(),
        format!("link set eth0 address {}", MAC.to_lowercase()),
        "link set eth0 up".into(),
        "link set vnet0 up".into(),
    ] {
        rcni_testkit::ip(&ns.ns, &a);
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cloud/azure_fake.py");
    let mut fake = rcni_testkit::tied_command_in(&ns.ns, "python3")
        .arg(script)
        .args([
            "--listen",
            &format!("{MD}:80"),
            "--vm",
            "node-1",
            "--mac",
            MAC,
        ])
        .args(["--subnet", "10.1.0.0/24", "--vnet", "10.1.0.0/16"])
        .args(["--retry-after", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("python3 azure_fake.py");
    let mut line = String::new();
    BufReader::new(fake.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    struct Kill(Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _fake = Kill(fake);
    let url = format!("http://{MD}");
    let stats = tmp.path().join("stats");
    let status_file = tmp.path().join("status.json");
    let mut child = rcni_testkit::tied_command_in(&ns.ns, bin("rcni-node"))
        .args(["run", "--cloud", "azure", "--node", "node-1"])
        .arg("--cni-conf-dir")
        .arg(tmp.path().join("net.d"))
        .arg("--state-dir")
        .arg(tmp.path().join("state"))
        .arg("--cloud-socket")
        .arg(tmp.path().join("cloud.sock"))
        .args(["--metrics-addr", &format!("127.0.0.1:{PORT}")])
        .arg("--cni-stats-dir")
        .arg(&stats)
        .arg("--status-file")
        .arg(&status_file)
        // The status file is rewritten at each pass: one a second.
        .args(["--resync-s", "1"])
        .env("RCNI_AZURE_IMDS_ENDPOINT", &url)
        .env("RCNI_AZURE_ARM_ENDPOINT", &url)
        .env("RCNI_AZURE_MAX_IP_CONFIGS", "8")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = Arc::new(Mutex::new(String::new()));
    let (err, sink) = (child.stderr.take().unwrap(), log.clone());
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            sink.lock().unwrap().push_str(&(l + "\n"));
        }
    });
    let agent = Agent { child, log };
    agent.wait_for("cloud: serving vpc-ipam");

    let free = "rcni_cloud_pool_addresses{state=\"free\"}";
    let used = "rcni_cloud_pool_addresses{state=\"used\"}";
    let body = scrape_until(&ns.ns, "a warm pool", |b| value(b, free) >= 1.0);
    promtool_check(&body);
    assert_eq!(value(&body, used), 0.0);
    assert!(value(&body, "rcni_reconcile_total{loop=\"cloud\",result=\"ok\"}") >= 1.0);
    assert!(value(&body, "rcni_cloud_api_calls_total") >= 1.0);

    let list: Value =
        serde_json::from_slice(&std::fs::read(tmp.path().join("net.d/10-rcni.conflist")).unwrap())
            .unwrap();
    let mut conf = list["plugins"][0].clone();
    conf["cniVersion"] = list["cniVersion"].clone();
    conf["name"] = list["name"].clone();
    let pod = TestNs::new();
    let r = Call::new(bin("ptp"), "ADD")
        .env("CNI_CONTAINERID", "cloudpod")
        .env("RCNI_CNI_STATS_DIR", stats.to_str().unwrap())
        .netns(&pod.path())
        .stdin(&conf)
        .run_in(&ns.ns)
        .ok();
    let ip = addr_of(&r, true);
    let body = scrape_until(&ns.ns, "the pod's address used", |b| value(b, used) == 1.0);
    promtool_check(&body);
    assert_eq!(
        value(
            &body,
            "rcni_cni_commands_total{plugin=\"vpc-ipam\",command=\"ADD\",code=\"0\"}"
        ),
        1.0,
        "{body}"
    );
    let t0 = Instant::now();
    loop {
        let (code, out, err) = status_of(&status_file, false);
        assert_eq!(code, 0, "{err}");
        if out.contains("pods (1)") {
            assert!(out.contains(&ip) && out.contains("cloudpod"), "{out}");
            assert!(out.contains("backend cloud (azure)"), "{out}");
            assert!(out.contains("cloud pool: 1 used"), "{out}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{out}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut c = conf.clone();
    c["prevResult"] = r;
    Call::new(bin("ptp"), "DEL")
        .env("CNI_CONTAINERID", "cloudpod")
        .netns(&pod.path())
        .stdin(&c)
        .run_in(&ns.ns)
        .ok();
    scrape_until(&ns.ns, "the address back in the pool", |b| {
        value(b, used) == 0.0
    });
}
