//! multinet through cnitool, as a runtime runs it: a pod with eth0 on
//! bridge + host-local (the default network) and net1 on macvlan over a
//! link to a LAN namespace, each network reaching its own peers only; DEL
//! from the record after the macvlan conflist is gone; a failing network
//! rolling back the others; default-route requests.

mod common;

use common::Node;
use rcni_testkit::{TestNs, bin, bin_dir, ip, ping, reservations, stdout_of};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

/// A node with the default network (cbr0), a macvlan network (macnet) on
/// `mv0`, whose other end is in `lan` with 10.77.0.1, and the runtime's
/// multinet conflist (podnet).
struct Lab {
    node: Node,
    lan: TestNs,
    netconf: tempfile::TempDir,
    default_dir: tempfile::TempDir,
    extra_dir: tempfile::TempDir,
    state: tempfile::TempDir,
    cache: tempfile::TempDir,
    mac_data: tempfile::TempDir,
}

impl Lab {
    fn new() -> Lab {
        let node = Node::with_path(format!("{}:/usr/lib/cni", bin_dir().display()));
        let lan = TestNs::new();
        ip(&node.ns.ns, "link add mv0 type veth peer name lan0");
        ip(&node.ns.ns, &format!("link set lan0 netns {}", lan.path()));
        ip(&node.ns.ns, "link set mv0 up");
        ip(&lan.ns, "addr add 10.77.0.1/24 dev lan0");
        ip(&lan.ns, "link set lan0 up");
        let lab = Lab {
            lan,
            netconf: tempfile::tempdir().unwrap(),
            default_dir: tempfile::tempdir().unwrap(),
            extra_dir: tempfile::tempdir().unwrap(),
            state: tempfile::tempdir().unwrap(),
            cache: tempfile::tempdir().unwrap(),
            mac_data: tempfile::tempdir().unwrap(),
            node,
        };
        let mut cbr0 = lab.node.conf("1.0.0", json!({"name": "cbr0"}));
        let cbr0_version = cbr0["cniVersion"].take();
        cbr0.as_object_mut().unwrap().remove("name");
        lab.write(
            lab.default_dir.path(),
            "10-cbr0.conflist",
            &json!({"cniVersion": cbr0_version, "name": "cbr0", "plugins": [cbr0]}),
        );
        lab.write_macnet("macnet", "10.77.0.10");
        // IPAM fails its ADD (a range start outside the subnet) after
        // macvlan made its link; its DEL still works.
        lab.write_macnet("badnet", "10.99.0.10");
        lab.write(
            lab.netconf.path(),
            "00-podnet.conflist",
            &json!({"cniVersion": "1.1.0", "name": "podnet", "plugins": [lab.plugin_conf()]}),
        );
        lab
    }

    fn plugin_conf(&self) -> Value {
        json!({
            "type": "multinet", "defaultNetwork": "cbr0",
            "defaultConfDir": self.default_dir.path(), "confDir": self.extra_dir.path(),
            "cacheDir": self.state.path().join("cache"),
            "statusDir": self.state.path().join("status"),
            "capabilities": {"io.kubernetes.cri.pod-annotations": true, "portMappings": true}
        })
    }

    fn write(&self, dir: &Path, name: &str, v: &Value) {
        std::fs::write(dir.join(name), serde_json::to_vec_pretty(v).unwrap()).unwrap();
    }

    fn write_macnet(&self, name: &str, range_start: &str) {
        self.write(
            self.extra_dir.path(),
            &format!("20-{name}.conflist"),
            &json!({"cniVersion": "1.0.0", "name": name, "plugins": [{
                "type": "macvlan", "master": "mv0", "mode": "bridge",
                "ipam": {"type": "host-local", "dataDir": self.mac_data.path(),
                         "ranges": [[{"subnet": "10.77.0.0/24", "rangeStart": range_start}]]}
            }]}),
        );
    }

    /// The multinet binary itself (where the test needs the CNI error
    /// code, which cnitool does not print).
    fn call(&self, cmd: &str, pod: &TestNs, cid: &str, networks: &str) -> rcni_testkit::Output {
        let mut conf = self.plugin_conf();
        conf["cniVersion"] = json!("1.1.0");
        conf["name"] = json!("podnet");
        conf["runtimeConfig"] = json!({"io.kubernetes.cri.pod-annotations":
            {"k8s.v1.cni.cncf.io/networks": networks}});
        self.node
            .call(&bin("multinet"), cmd, &pod.path(), cid, &conf)
    }

    fn cbr0_reservations(&self) -> Vec<String> {
        reservations(&self.node.data.path().join("cbr0"))
    }

    /// cnitool `cmd` of podnet for `pod`, with the networks annotation.
    fn run(
        &self,
        cmd: &str,
        pod: &TestNs,
        cid: &str,
        networks: Option<&str>,
    ) -> rcni_testkit::Output {
        let caps = match networks {
            Some(n) => json!({"io.kubernetes.cri.pod-annotations":
                {"k8s.v1.cni.cncf.io/networks": n}})
            .to_string(),
            None => "{}".into(),
        };
        // Ours first; plugin types rcni does not ship come from the reference.
        self.node.cnitool(
            self.netconf.path(),
            self.cache.path(),
            &[cmd, "podnet", &pod.path(), "--container-id", cid],
            &[
                ("CAP_ARGS", caps.as_str()),
                ("CNI_PATH", self.node.cni_path.as_str()),
            ],
        )
    }

    fn status_doc(&self, cid: &str) -> Option<Value> {
        let p = self
            .state
            .path()
            .join("status")
            .join(format!("{cid}-eth0.json"));
        std::fs::read(p)
            .ok()
            .map(|b| serde_json::from_slice(&b).unwrap())
    }

    fn records(&self) -> Vec<PathBuf> {
        std::fs::read_dir(self.state.path().join("cache"))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "json"))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn assert_nothing_left(&self, pods: &[&TestNs]) {
        assert!(
            self.cbr0_reservations().is_empty(),
            "cbr0 reservations left"
        );
        assert!(
            reservations(&self.mac_data.path().join("macnet")).is_empty(),
            "macnet reservations left"
        );
        // A dropped pod namespace takes its veth pair with it, but the
        // kernel tears namespaces down in a work item: wait for that.
        let veths = || -> Vec<String> {
            self.node
                .host_veths()
                .into_iter()
                .filter(|v| v != "mv0")
                .collect()
        };
        for _ in 0..100 {
            if veths().is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        assert!(veths().is_empty(), "host veths left: {:?}", veths());
        assert!(
            self.records().is_empty(),
            "records left: {:?}",
            self.records()
        );
        for pod in pods {
            let links = stdout_of(pod.command("ip").args(["-o", "link"]));
            assert!(!links.contains("net1"), "{links}");
            assert!(!links.contains("eth0"), "{links}");
        }
        let macvlans = stdout_of(
            self.node
                .ns
                .command("ip")
                .args(["-o", "link", "show", "type", "macvlan"]),
        );
        assert!(macvlans.trim().is_empty(), "{macvlans}");
    }
}

fn addr_on(pod: &TestNs, dev: &str) -> String {
    let out = stdout_of(
        pod.command("ip")
            .args(["-4", "-o", "addr", "show", "dev", dev]),
    );
    out.split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .unwrap_or_else(|| panic!("no IPv4 address on {dev}: {out}"))
        .split('/')
        .next()
        .unwrap()
        .to_string()
}

#[test]
fn pod_on_bridge_and_macvlan_talks_on_each_and_del_works_after_the_conflist_is_gone() {
    let lab = Lab::new();
    let pod = TestNs::new();
    let other = TestNs::new();
    let r = lab.run("add", &pod, "pod-a", Some("macnet")).ok();
    lab.run("add", &other, "pod-b", None).ok();

    // The result is the default network's, with net1 listed as well.
    let names: Vec<&str> = r["interfaces"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i.get("sandbox").is_some())
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["eth0", "net1"], "{r}");
    assert!(
        r["ips"].as_array().unwrap().iter().all(|i| i["address"]
            .as_str()
            .unwrap()
            .starts_with("10.88.")
            || i["address"].as_str().unwrap().starts_with("fd88:")),
        "the pod's IPs are the default network's: {r}"
    );
    let eth0 = addr_on(&pod, "eth0");
    let net1 = addr_on(&pod, "net1");
    assert!(eth0.starts_with("10.88.0."), "{eth0}");
    assert!(net1.starts_with("10.77.0."), "{net1}");

    let doc = lab.status_doc("pod-a").expect("network-status written");
    assert_eq!(doc[0]["name"], "cbr0");
    assert_eq!(doc[0]["interface"], "eth0");
    assert_eq!(doc[0]["default"], true);
    assert_eq!(doc[1]["name"], "macnet");
    assert_eq!(doc[1]["interface"], "net1");
    assert_eq!(doc[1]["default"], false);
    assert_eq!(doc[1]["ips"], json!([net1]));
    assert!(
        doc[1]["mac"].as_str().is_some_and(|m| m.len() == 17),
        "{doc}"
    );

    // Each network reaches its own peers.
    assert!(ping(&pod.ns, "10.77.0.1"), "pod -> LAN over net1");
    assert!(ping(&lab.lan.ns, &net1), "LAN -> pod over net1");
    let other_ip = addr_on(&other, "eth0");
    assert!(ping(&pod.ns, &other_ip), "pod -> pod over eth0");
    // ...and only those: the bridge-only pod has no way to the LAN.
    assert!(
        !ping(&other.ns, "10.77.0.1"),
        "bridge-only pod reached the LAN"
    );

    lab.run("check", &pod, "pod-a", Some("macnet")).ok();

    // DEL works from what ADD recorded, with the macvlan conflist gone.
    std::fs::remove_file(lab.extra_dir.path().join("20-macnet.conflist")).unwrap();
    lab.run("del", &pod, "pod-a", Some("macnet")).ok();
    lab.run("del", &pod, "pod-a", Some("macnet")).ok();
    assert!(lab.status_doc("pod-a").is_none());
    lab.run("del", &other, "pod-b", None).ok();
    lab.assert_nothing_left(&[&pod, &other]);
}

#[test]
fn a_failing_network_rolls_back_the_others() {
    let lab = Lab::new();
    let pod = TestNs::new();
    let e = lab.call("ADD", &pod, "pod-a", "macnet, badnet").err();
    assert!(e.1.contains("badnet"), "{e:?}");
    assert!(lab.status_doc("pod-a").is_none());
    lab.assert_nothing_left(&[&pod]);
    // An unknown network fails before anything is made.
    let e = lab.call("ADD", &pod, "pod-a", "nosuchnet").err();
    assert_eq!(e.0, 7, "{e:?}");
    assert!(e.1.contains("nosuchnet"), "{e:?}");
    lab.assert_nothing_left(&[&pod]);
}

#[test]
fn default_route_requests() {
    let lab = Lab::new();
    let pod = TestNs::new();
    lab.run(
        "add",
        &pod,
        "pod-a",
        Some(r#"[{"name": "macnet", "interface": "data0", "default-route": ["10.77.0.1"]}]"#),
    )
    .ok();
    let v4 = stdout_of(pod.command("ip").args(["-4", "route", "show", "default"]));
    assert_eq!(v4.trim(), "default via 10.77.0.1 dev data0", "{v4}");
    let v6 = stdout_of(pod.command("ip").args(["-6", "route", "show", "default"]));
    assert!(
        v6.contains("dev eth0"),
        "IPv6 stays on the default network: {v6}"
    );
    assert!(ping(&pod.ns, "10.77.0.1"));
    lab.run("del", &pod, "pod-a", None).ok();
    lab.assert_nothing_left(&[&pod]);

    // Two networks asking for the IPv4 default: refused before anything.
    let e = lab
        .call(
            "ADD",
            &pod,
            "pod-b",
            r#"[{"name": "macnet", "default-route": ["10.77.0.1"]},
                {"name": "macnet", "interface": "net9", "default-route": ["10.77.0.2"]}]"#,
        )
        .err();
    assert_eq!(e.0, 7, "{e:?}");
    assert!(e.1.contains("at most one per family"), "{e:?}");
    lab.assert_nothing_left(&[&pod]);
}

#[test]
fn gc_removes_attachments_not_valid() {
    let lab = Lab::new();
    let pod = TestNs::new();
    let keep = TestNs::new();
    lab.run("add", &pod, "pod-a", Some("macnet")).ok();
    lab.run("add", &keep, "pod-k", Some("macnet")).ok();
    assert_eq!(lab.records().len(), 2);
    let mut conf = lab.plugin_conf();
    conf["cniVersion"] = json!("1.1.0");
    conf["name"] = json!("podnet");
    // GC comes after the runtime lost the pod: its namespace is gone.
    drop(pod);
    let valid = json!([{"containerID": "pod-k", "ifname": "eth0"}]);
    lab.node.gc(&bin("multinet"), &conf, valid.clone()).ok();
    assert_eq!(
        lab.records().len(),
        1,
        "only the valid attachment's record stays"
    );
    assert_eq!(
        lab.cbr0_reservations().len(),
        2,
        "pod-k keeps its dual-stack cbr0 addresses"
    );
    assert_eq!(reservations(&lab.mac_data.path().join("macnet")).len(), 1);
    lab.node.gc(&bin("multinet"), &conf, valid).ok();
    assert_eq!(lab.records().len(), 1, "GC is idempotent");
    lab.run("del", &keep, "pod-k", None).ok();
    lab.assert_nothing_left(&[&keep]);
}
