//! multinet's test lab, shared by multinet.rs and vm_multinet.rs: a node
//! with the default network (cbr0: bridge + host-local), a macvlan network
//! (macnet) on `mv0`, whose other end is in `lan` with 10.77.0.1, and the
//! runtime's multinet conflist (podnet).

use crate::Node;
use rcni_testkit::{TestNs, bin, bin_dir, ip, poll, reservations, stdout_of};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

pub struct Lab {
    pub node: Node,
    pub lan: TestNs,
    pub netconf: tempfile::TempDir,
    pub default_dir: tempfile::TempDir,
    pub extra_dir: tempfile::TempDir,
    pub state: tempfile::TempDir,
    pub cache: tempfile::TempDir,
    pub mac_data: tempfile::TempDir,
}

impl Default for Lab {
    fn default() -> Self {
        Self::new()
    }
}

impl Lab {
    pub fn new() -> Lab {
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

    pub fn plugin_conf(&self) -> Value {
        json!({
            "type": "multinet", "defaultNetwork": "cbr0",
            "defaultConfDir": self.default_dir.path(), "confDir": self.extra_dir.path(),
            "cacheDir": self.state.path().join("cache"),
            "statusDir": self.state.path().join("status"),
            "capabilities": {"io.kubernetes.cri.pod-annotations": true, "portMappings": true}
        })
    }

    pub fn write(&self, dir: &Path, name: &str, v: &Value) {
        std::fs::write(dir.join(name), serde_json::to_vec_pretty(v).unwrap()).unwrap();
    }

    pub fn write_macnet(&self, name: &str, range_start: &str) {
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
    pub fn call(&self, cmd: &str, pod: &TestNs, cid: &str, networks: &str) -> rcni_testkit::Output {
        let mut conf = self.plugin_conf();
        conf["cniVersion"] = json!("1.1.0");
        conf["name"] = json!("podnet");
        conf["runtimeConfig"] = json!({"io.kubernetes.cri.pod-annotations":
            {"k8s.v1.cni.cncf.io/networks": networks}});
        self.node
            .call(&bin("multinet"), cmd, &pod.path(), cid, &conf)
    }

    pub fn cbr0_reservations(&self) -> Vec<String> {
        reservations(&self.node.data.path().join("cbr0"))
    }

    /// cnitool `cmd` of podnet for `pod`, with the networks annotation.
    pub fn run(
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

    pub fn status_doc(&self, cid: &str) -> Option<Value> {
        let p = self
            .state
            .path()
            .join("status")
            .join(format!("{cid}-eth0.json"));
        std::fs::read(p)
            .ok()
            .map(|b| serde_json::from_slice(&b).unwrap())
    }

    pub fn records(&self) -> Vec<PathBuf> {
        std::fs::read_dir(self.state.path().join("cache"))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "json"))
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn assert_nothing_left(&self, pods: &[&TestNs]) {
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
                // The LAN links the tests make themselves.
                .filter(|v| v != "mv0" && v != "iv0")
                .collect()
        };
        assert!(
            poll(std::time::Duration::from_secs(10), || veths().is_empty()),
            "host veths left: {:?}",
            veths()
        );
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

/// The names of a result's interfaces in the pod (those with a sandbox).
pub fn pod_ifnames(r: &Value) -> Vec<&str> {
    r["interfaces"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i.get("sandbox").is_some())
        .map(|i| i["name"].as_str().unwrap())
        .collect()
}

pub fn addr_on(pod: &TestNs, dev: &str) -> String {
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
