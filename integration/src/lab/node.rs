//! [`Node`]: the lab most plugin tests run in, one node namespace with
//! host-local's data dir and pods on one bridge, and the checks a main
//! plugin's tests share (CHECK catching damage, DEL surviving repeats).

use crate::{Damage, ip, merged, nl};
use rcni_testkit::{Call, Output, PersistentNs, TestNs, bin, bin_dir};
use serde_json::{Value, json};
use std::path::Path;

/// A node namespace, a host-local data dir, and pods attached to one bridge.
pub struct Node {
    pub ns: TestNs,
    pub data: tempfile::TempDir,
    pub cni_path: String,
}

impl Default for Node {
    fn default() -> Self {
        Self::new()
    }
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
        let c = json!({
            "cniVersion": version, "name": "podnet", "type": "bridge", "bridge": "cni0",
            "isGateway": true, "isDefaultGateway": true,
            "ipam": {"type": "host-local", "dataDir": self.data.path(),
                     "ranges": [[{"subnet": "10.88.0.0/24"}], [{"subnet": "fd88::/64"}]]}
        });
        merged(c, extra)
    }

    pub fn call(&self, bin: &Path, cmd: &str, pod: &str, cid: &str, conf: &Value) -> Output {
        Call::new(bin, cmd)
            .env("CNI_PATH", &self.cni_path)
            .env("CNI_CONTAINERID", cid)
            .netns(pod)
            .stdin(conf)
            .run_in(&self.ns.ns)
    }

    /// Our cnitool with NETCONFPATH, CNI_PATH, a cache dir and `env`, run
    /// in the node namespace (none of the test's own CNI_* variables).
    pub fn cnitool(
        &self,
        confdir: &Path,
        cache: &Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Output {
        let mut cmd = rcni_testkit::command_in(&self.ns.ns, bin("cnitool"));
        for (k, _) in std::env::vars() {
            if k.starts_with("CNI_") || k == "NETCONFPATH" || k == "CAP_ARGS" {
                cmd.env_remove(k);
            }
        }
        cmd.arg("--cache-dir")
            .arg(cache)
            .args(args)
            .env("NETCONFPATH", confdir)
            .env("CNI_PATH", bin_dir())
            .envs(env.iter().copied())
            .output()
            .unwrap()
            .into()
    }

    pub fn add(&self, pod: &TestNs, cid: &str, conf: &Value) -> Value {
        self.call(&bin("bridge"), "ADD", &pod.path(), cid, conf)
            .ok()
    }

    /// GC of `conf`'s network with the valid set `valid`, as a runtime
    /// sends it: no container, no interface.
    pub fn gc(&self, plugin: &Path, conf: &Value, valid: Value) -> Output {
        let mut gc = conf.clone();
        gc["cni.dev/valid-attachments"] = valid;
        Call::new(plugin, "GC")
            .env("CNI_PATH", &self.cni_path)
            .env("CNI_CONTAINERID", "")
            .env("CNI_IFNAME", "")
            .stdin(&gc)
            .run_in(&self.ns.ns)
    }

    pub fn status(&self, plugin: &Path, conf: &Value) -> Output {
        Call::new(plugin, "STATUS")
            .env("CNI_PATH", &self.cni_path)
            .stdin(conf)
            .run_in(&self.ns.ns)
    }

    /// CHECK of a fresh attachment passes, and fails with 106 after each
    /// `damage`; without prevResult it is a config error (7). Each
    /// attachment is deleted again.
    pub fn check_catches(&self, plugin: &Path, conf: &Value, damage: &[(&str, Damage)]) {
        for (what, f) in damage {
            let pod = TestNs::new();
            let r = self.call(plugin, "ADD", &pod.path(), "ctr", conf).ok();
            let with = Node::with_prev(conf, &r);
            self.call(plugin, "CHECK", &pod.path(), "ctr", &with).ok();
            f(&self.ns.ns, &pod.ns, &r);
            let (code, msg) = self.call(plugin, "CHECK", &pod.path(), "ctr", &with).err();
            assert_eq!(code, 106, "{what}: {msg}");
            self.call(plugin, "DEL", &pod.path(), "ctr", &with).ok();
        }
        let pod = TestNs::new();
        self.call(plugin, "ADD", &pod.path(), "ctr", conf).ok();
        let (code, msg) = self.call(plugin, "CHECK", &pod.path(), "ctr", conf).err();
        assert_eq!(code, 7, "CHECK without prevResult: {msg}");
        self.call(plugin, "DEL", &pod.path(), "ctr", conf).ok();
    }

    /// DEL twice succeeds, and so does DEL after the netns is deleted, with
    /// and without prevResult: the addresses are released and no host
    /// veth is left behind.
    pub fn del_survives_repeats_and_a_deleted_netns(&self, plugin: &Path, conf: &Value) {
        let pod = TestNs::new();
        let r = self.call(plugin, "ADD", &pod.path(), "twice", conf).ok();
        let with = Node::with_prev(conf, &r);
        self.call(plugin, "DEL", &pod.path(), "twice", &with).ok();
        self.call(plugin, "DEL", &pod.path(), "twice", &with).ok();

        let gone = PersistentNs::new();
        let path = gone.path.display().to_string();
        let r = self.call(plugin, "ADD", &path, "gone", conf).ok();
        gone.delete();
        self.call(plugin, "DEL", &path, "gone", &Node::with_prev(conf, &r))
            .ok();
        self.call(plugin, "DEL", &path, "gone", conf).ok();
        self.assert_nothing_left();
    }

    /// CHECK, then DEL, of an attachment ADD made: both succeed.
    pub fn check_and_del(&self, plugin: &Path, pod: &TestNs, cid: &str, conf: &Value, r: &Value) {
        let with = Node::with_prev(conf, r);
        self.call(plugin, "CHECK", &pod.path(), cid, &with).ok();
        self.call(plugin, "DEL", &pod.path(), cid, &with).ok();
    }

    /// After the last DEL: no reservation, no host veth.
    pub fn assert_nothing_left(&self) {
        assert_eq!(
            self.reservations(),
            Vec::<String>::new(),
            "reservations left"
        );
        assert_eq!(
            self.host_veths(),
            Vec::<String>::new(),
            "host veths left on the node"
        );
    }

    pub fn with_prev(conf: &Value, prev: &Value) -> Value {
        let mut c = conf.clone();
        c["prevResult"] = prev.clone();
        c
    }

    /// veth (and netkit) links in the node namespace (pods' host ends),
    /// sorted.
    pub fn host_veths(&self) -> Vec<String> {
        let mut v: Vec<String> = nl(&self.ns.ns, async |n| n.links().await.unwrap())
            .into_iter()
            .filter(|l| matches!(l.kind.as_deref(), Some("veth" | "netkit")))
            .map(|l| l.name)
            .collect();
        v.sort();
        v
    }

    /// This node with two masters on one wire, the lower devices of
    /// macvlan, ipvlan and vlan pods: its veth pair m1 <-> m2, both up (a
    /// carrier, or IPv6 DAD never ends).
    pub fn wired(self) -> Node {
        ip(&self.ns.ns, "link add m1 type veth peer name m2");
        ip(&self.ns.ns, "link set m1 up");
        ip(&self.ns.ns, "link set m2 up");
        self
    }

    /// STATUS and GC of a plugin that hands both to IPAM (macvlan, vlan),
    /// with `conf`'s IPAM replaced by host-local on `<net>.0/24`: of two
    /// reservations GC keeps only the valid one; STATUS passes, and is 50
    /// once a /30 of `net` has its one address taken.
    pub fn ipam_status_and_gc(&self, plugin: &str, conf: &Value, net: &str) {
        let ipam = |prefix: u8| {
            json!({"ipam": {"type": "host-local", "dataDir": self.data.path(),
                "ranges": [[{"subnet": format!("{net}.0/{prefix}")}]]}})
        };
        let c = merged(conf.clone(), ipam(24));
        let pod = TestNs::new();
        for cid in ["keep", "stale"] {
            Call::new(bin("host-local"), "ADD")
                .env("CNI_CONTAINERID", cid)
                .netns(&pod.path())
                .stdin(&c)
                .run_in(&self.ns.ns)
                .ok();
        }
        let valid = json!([{"containerID": "keep", "ifname": "eth0"}]);
        self.gc(&bin(plugin), &c, valid).ok();
        assert_eq!(self.reservations(), [format!("{net}.2")]);
        self.status(&bin(plugin), &c).ok();
        let small = merged(c, ipam(30));
        let (code, _) = self.status(&bin(plugin), &small).err();
        assert_eq!(code, 50, "the /30's one address is taken");
    }

    /// host-local's reservations for the network `podnet`.
    pub fn reservations(&self) -> Vec<String> {
        rcni_testkit::reservations(&self.data.path().join("podnet"))
    }
}
