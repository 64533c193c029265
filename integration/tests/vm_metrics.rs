//! `rcni-node run --metrics-addr` with `"encryption": "wireguard"`: the
//! per-peer WireGuard series (traffic, seconds since the handshake, the
//! peer count) follow real pod traffic between two nodes, and the status
//! screen shows the handshake. This host's kernel has no wireguard module:
//! scripts/test runs this binary under scripts/vm-run.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rcni_integration::lab::cluster::{Cluster, SETTLE};
use rcni_integration::lab::metrics::{promtool_check, value};
use rcni_netns::NetNs;
use rcni_testkit::{bin, ping};
use serde_json::{Value, json};

const PORT: u16 = 9680;

/// The cluster file of nodes `which` (node i on its own subnet behind the
/// router), with their public keys once they have them.
fn write_wg(c: &Cluster, which: &[usize], keys: bool) {
    let nodes: Vec<Value> = which
        .iter()
        .map(|&i| {
            let n = &c.nodes[i];
            let mut v = json!({"name": n.name,
                "address": format!("192.168.{}.{}", 50 + 10 * i, i + 1),
                "podCIDR": format!("10.244.{}.0/24", i + 1)});
            if keys {
                let k = std::fs::read_to_string(n.dir.path().join("state/wireguard.pub")).unwrap();
                v["wireguardPublicKey"] = json!(k.trim());
            }
            v
        })
        .collect();
    let f = json!({"network": "10.244.0.0/16", "backend": "auto",
                   "encryption": "wireguard", "nodes": nodes});
    std::fs::write(&c.file, serde_json::to_vec_pretty(&f).unwrap()).unwrap();
}

fn get_metrics(ns: &NetNs) -> String {
    ns.run(|| {
        let mut c = std::net::TcpStream::connect(("127.0.0.1", PORT)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
        body.to_string()
    })
    .unwrap()
}

struct Agent(Child, Arc<Mutex<String>>);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.0.wait();
    }
}

#[test]
fn wireguard_peers_traffic_and_handshakes_show_in_metrics_and_status() {
    let c = Cluster::new(&[0, 1]);
    // The first pass makes each node's key; the second programs the peers.
    write_wg(&c, &[0, 1], false);
    for n in &c.nodes {
        n.run_once(&c.file);
    }
    write_wg(&c, &[0, 1], true);
    let (n1, n2) = (&c.nodes[0], &c.nodes[1]);
    n2.reconcile(&c.file);
    let tmp = tempfile::tempdir().unwrap();
    let status_file = tmp.path().join("status.json");
    let mut child = n1
        .agent(&c.file)
        .args(["--metrics-addr", &format!("127.0.0.1:{PORT}")])
        .arg("--cni-stats-dir")
        .arg(tmp.path().join("stats"))
        .arg("--status-file")
        .arg(&status_file)
        .args(["--resync-s", "1"])
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
    let agent = Agent(child, log);
    let t0 = Instant::now();
    while !agent.1.lock().unwrap().contains("kernel changes") {
        assert!(t0.elapsed() < SETTLE * 6, "{}", agent.1.lock().unwrap());
        std::thread::sleep(Duration::from_millis(50));
    }

    let (p1, _) = n1.pod("p1");
    let (_p2, a2) = n2.pod("p2");
    let body = get_metrics(&n1.ns.ns);
    assert_eq!(value(&body, "rcni_wireguard_peers"), Some(1.0), "{body}");
    let sent = "rcni_wireguard_peer_sent_bytes_total{peer=\"n2\"}";
    let received = "rcni_wireguard_peer_received_bytes_total{peer=\"n2\"}";
    let handshake = "rcni_wireguard_peer_last_handshake_seconds{peer=\"n2\"}";
    let before = value(&body, sent).unwrap();
    assert!(ping(&p1.ns, &a2), "ping {a2}");
    let body = get_metrics(&n1.ns.ns);
    promtool_check(&body);
    assert!(value(&body, sent).unwrap() > before, "{body}");
    assert!(value(&body, received).unwrap() > 0.0, "{body}");
    let age = value(&body, handshake).expect("a handshake");
    assert!((0.0..120.0).contains(&age), "{age}");

    let t0 = Instant::now();
    loop {
        let out = Command::new(bin("rcni-node"))
            .arg("status")
            .arg("--status-file")
            .arg(&status_file)
            .output()
            .unwrap();
        let screen = String::from_utf8_lossy(&out.stdout).into_owned();
        if screen.contains("handshake done") {
            assert!(screen.contains("encryption wireguard"), "{screen}");
            break;
        }
        assert!(t0.elapsed() < SETTLE * 3, "{screen}");
        std::thread::sleep(Duration::from_millis(200));
    }
}
