//! Helpers shared by the bridge test binaries.
#![allow(dead_code)]

use rcni_netlink::Netlink;
use rcni_netns::NetNs;
use rcni_testkit::{Call, Output, TestNs, bin, bin_dir};
use serde_json::{Value, json};
use std::path::Path;

/// A node namespace, a host-local data dir, and pods attached to one bridge.
pub struct Node {
    pub ns: TestNs,
    pub data: tempfile::TempDir,
    pub cni_path: String,
}

impl Node {
    pub fn new() -> Node {
        Node::with_path(bin_dir().display().to_string())
    }

    pub fn with_path(cni_path: String) -> Node {
        Node {
            ns: TestNs::new(),
            data: tempfile::tempdir().unwrap(),
            cni_path,
        }
    }

    /// A bridge config; `extra` keys are merged in.
    pub fn conf(&self, version: &str, extra: Value) -> Value {
        let mut c = json!({
            "cniVersion": version, "name": "podnet", "type": "bridge", "bridge": "cni0",
            "isGateway": true, "isDefaultGateway": true,
            "ipam": {"type": "host-local", "dataDir": self.data.path(),
                     "ranges": [[{"subnet": "10.88.0.0/24"}], [{"subnet": "fd88::/64"}]]}
        });
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    pub fn call(&self, bin: &Path, cmd: &str, pod: &str, cid: &str, conf: &Value) -> Output {
        Call::new(bin, cmd)
            .env("CNI_PATH", &self.cni_path)
            .env("CNI_CONTAINERID", cid)
            .netns(pod)
            .stdin(conf)
            .run_in(&self.ns.ns)
    }

    pub fn add(&self, pod: &TestNs, cid: &str, conf: &Value) -> Value {
        self.call(&bin("bridge"), "ADD", &pod.path(), cid, conf)
            .ok()
    }

    pub fn with_prev(conf: &Value, prev: &Value) -> Value {
        let mut c = conf.clone();
        c["prevResult"] = prev.clone();
        c
    }

    /// veth links in the node namespace (pods' host ends), sorted.
    pub fn host_veths(&self) -> Vec<String> {
        let mut v: Vec<String> = nl(&self.ns.ns, async |n| n.links().await.unwrap())
            .into_iter()
            .filter(|l| l.kind.as_deref() == Some("veth"))
            .map(|l| l.name)
            .collect();
        v.sort();
        v
    }

    pub fn reservations(&self) -> Vec<String> {
        let dir = self.data.path().join("podnet");
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.retain(|n| n != "lock" && !n.starts_with("last_reserved_ip") && n != ".rcni-owners");
        v.sort();
        v
    }
}

pub fn nl<T>(ns: &NetNs, f: impl AsyncFnOnce(&Netlink) -> T) -> T {
    let rt = rcni_netlink::runtime().unwrap();
    rt.block_on(async {
        let n = Netlink::connect(ns).await.unwrap();
        f(&n).await
    })
}

pub fn addr_of(result: &Value, v4: bool) -> String {
    result["ips"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            i["address"]
                .as_str()
                .unwrap()
                .split('/')
                .next()
                .unwrap()
                .to_string()
        })
        .find(|a| a.contains('.') == v4)
        .unwrap()
}

/// `ip -d -j link show dev` inside a namespace, as JSON.
pub fn ip_link_json(ns: &NetNs, dev: &str) -> Value {
    let out = rcni_testkit::command_in(ns, "ip")
        .args(["-d", "-j", "link", "show", "dev", dev])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    v[0].clone()
}

pub fn bridge_vlans(ns: &NetNs, dev: &str) -> Vec<(u64, bool)> {
    let out = rcni_testkit::command_in(ns, "bridge")
        .args(["-j", "vlan", "show", "dev", dev])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(json!([]));
    let mut res = vec![];
    for port in v.as_array().into_iter().flatten() {
        for vl in port["vlans"].as_array().into_iter().flatten() {
            let flags = vl["flags"]
                .as_array()
                .map(|f| f.iter().any(|x| x == "PVID"))
                .unwrap_or(false);
            res.push((vl["vlan"].as_u64().unwrap(), flags));
        }
    }
    res
}

/// `ip ARGS` inside `ns` (test topology: links the plugins then use);
/// panics with ip's message on failure.
pub fn ip(ns: &NetNs, args: &str) {
    let out = rcni_testkit::command_in(ns, "ip")
        .args(args.split_whitespace())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ip {args}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// (address/prefix, tentative) of the IPv6 global addresses of `dev`.
pub fn ipv6_addrs(ns: &NetNs, dev: &str) -> Vec<(String, bool)> {
    let out = rcni_testkit::command_in(ns, "ip")
        .args(["-j", "-6", "addr", "show", "dev", dev, "scope", "global"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(json!([]));
    let mut res = vec![];
    for l in v.as_array().into_iter().flatten() {
        // `ip -j` lists an empty object for an address filtered out.
        for a in l["addr_info"].as_array().into_iter().flatten() {
            if let Some(local) = a["local"].as_str() {
                res.push((
                    format!("{local}/{}", a["prefixlen"]),
                    a["tentative"].as_bool().unwrap_or(false),
                ));
            }
        }
    }
    res
}

/// The masquerade rules in `ns` (iptables for both families, and the whole
/// nftables ruleset), as text.
pub fn masq_rules(ns: &NetNs) -> String {
    let mut text = String::new();
    for (tool, args) in [
        ("iptables-save", &["-t", "nat"][..]),
        ("ip6tables-save", &["-t", "nat"][..]),
        ("nft", &["list", "ruleset"][..]),
    ] {
        let out = rcni_testkit::command_in(ns, tool)
            .args(args)
            .output()
            .unwrap();
        text.push_str(&String::from_utf8_lossy(&out.stdout));
    }
    text.lines()
        .filter(|l| l.contains("masq") || l.contains("MASQ") || l.contains("CNI-"))
        .collect::<Vec<_>>()
        .join("\n")
}
