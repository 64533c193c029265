//! `rcni-node run --cloud azure` end to end against the fake of Azure's
//! published API (integration/cloud/azure_fake.py; no emulator of Azure
//! exists, so this is a fake, not Azure): the agent finds its VM through
//! the Instance Metadata Service, fills the primary NIC with IP
//! configurations through Azure Resource Manager, and pods attached from
//! the conflist it writes get those addresses and talk.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::Duration;

use rcni_integration::lab::vpc::pod_ip;
use rcni_testkit::{Call, TestNs, bin, ping, require_root, tied_command_in};
use serde_json::{Value, json};

const MAC: &str = "00:0D:3A:F8:06:EC";
const MD: &str = "169.254.169.254";

struct Node {
    ns: TestNs,
    dir: tempfile::TempDir,
    fake: Child,
    agent: Option<Child>,
}

impl Drop for Node {
    fn drop(&mut self) {
        for c in [self.agent.as_mut(), Some(&mut self.fake)]
            .into_iter()
            .flatten()
        {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Node {
    fn ip(&self, args: &str) {
        let st = self
            .ns
            .command("ip")
            .args(args.split(' '))
            .status()
            .unwrap();
        assert!(st.success(), "ip {args}");
    }

    fn state(&self) -> Value {
        let out = self
            .ns
            .command("curl")
            .args(["-s", &format!("http://{MD}/_rcni/state")])
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    fn plugin(&self) -> Value {
        let text = std::fs::read(self.dir.path().join("net.d/10-rcni.conflist")).unwrap();
        let list: Value = serde_json::from_slice(&text).unwrap();
        let mut c = list["plugins"][0].clone();
        c["cniVersion"] = list["cniVersion"].clone();
        c["name"] = list["name"].clone();
        c
    }
}

fn node() -> Node {
    require_root();
    let ns = TestNs::new();
    let dir = tempfile::tempdir().unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cloud/azure_fake.py");
    let mut n = Node {
        ns,
        dir,
        fake: std::process::Command::new("true").spawn().unwrap(),
        agent: None,
    };
    n.ip("link set lo up");
    n.ip(&format!("addr add {MD}/32 dev lo"));
    // The VM's NIC: a dummy-like end of a veth with the NIC's MAC.
    n.ip("link add eth0 type veth peer name vnet0");
    n.ip(&format!("link set eth0 address {}", MAC.to_lowercase()));
    n.ip("link set eth0 up");
    n.ip("link set vnet0 up");
    let mut fake = tied_command_in(&n.ns.ns, "python3");
    fake.arg(script)
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
        .stderr(Stdio::null());
    let mut child = fake.spawn().expect("python3 azure_fake.py");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    n.fake = child;
    n
}

#[test]
fn agent_on_azure_gives_pods_nic_ip_configurations() {
    let mut n = node();
    let log = std::fs::File::create(n.dir.path().join("agent.log")).unwrap();
    let url = format!("http://{MD}");
    let mut agent = tied_command_in(&n.ns.ns, bin("rcni-node"));
    agent
        .args(["run", "--cloud", "azure", "--node", "node-1"])
        .arg("--cni-conf-dir")
        .arg(n.dir.path().join("net.d"))
        .arg("--state-dir")
        .arg(n.dir.path().join("state"))
        .arg("--cloud-socket")
        .arg(n.dir.path().join("cloud.sock"))
        .env("RCNI_AZURE_IMDS_ENDPOINT", &url)
        .env("RCNI_AZURE_ARM_ENDPOINT", &url)
        .env("RCNI_AZURE_MAX_IP_CONFIGS", "8")
        .env("IP_COOLDOWN_PERIOD", "1")
        .stdout(Stdio::null())
        .stderr(log);
    n.agent = Some(agent.spawn().unwrap());
    rcni_testkit::wait_for(Duration::from_secs(60), "the agent's pool", || {
        n.dir.path().join("cloud.sock").exists()
            && n.state().as_object().is_some_and(|m| m.len() >= 4)
    });
    let conf = n.plugin();
    assert_eq!(conf["ipam"]["type"], "vpc-ipam", "{conf}");
    let mut pods = Vec::new();
    for cid in ["a", "b"] {
        let pod = TestNs::new();
        let r = Call::new(bin("ptp"), "ADD")
            .env("CNI_CONTAINERID", cid)
            .netns(&pod.path())
            .stdin(&conf)
            .run_in(&n.ns.ns)
            .ok();
        pods.push((pod, cid, r));
    }
    let state = n.state();
    let configs: Vec<&str> = state
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    for (_, _, r) in &pods {
        let ip = pod_ip(r).to_string();
        assert!(
            configs.contains(&ip.as_str()),
            "{ip} not in {state}\n{}",
            n.log()
        );
    }
    let b = pod_ip(&pods[1].2).to_string();
    assert!(ping(&pods[0].0.ns, &b), "pod a -> pod b {b}\n{}", n.log());
    for (pod, cid, r) in &pods {
        let mut c = conf.clone();
        c["prevResult"] = r.clone();
        Call::new(bin("ptp"), "DEL")
            .env("CNI_CONTAINERID", cid)
            .netns(&pod.path())
            .stdin(&c)
            .run_in(&n.ns.ns)
            .ok();
    }
    let cp: Value =
        serde_json::from_slice(&std::fs::read(n.dir.path().join("state/cloud-ipam.json")).unwrap())
            .unwrap();
    assert_eq!(cp["allocations"], json!([]), "{cp}");
}
