//! Conformance harness: conflists from `conf/` run through our cnitool and
//! through a libcni client (Go, built against Debian's libcni), with
//! CNI_PATH pointing at our plugins or at the reference plugins, so the
//! harness itself is checked against the reference.

use rcni_testkit::{Output, REFERENCE_DIR, bin, bin_dir, blank_veth, is_mac};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The system bus address the plugins get: none there, so firewall (ours
/// and the reference's) never reaches the machine's firewalld and picks
/// iptables, as on a node without firewalld.
pub const NO_SYSTEM_BUS: &str = "unix:path=/nonexistent/rcni-test-no-system-bus";

/// Whose plugins CNI_PATH points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plugins {
    Ours,
    Reference,
}

impl Plugins {
    /// Ours first, then the reference's: every differential test runs both.
    pub const BOTH: [Plugins; 2] = [Plugins::Ours, Plugins::Reference];

    pub fn dir(self) -> PathBuf {
        match self {
            Plugins::Ours => bin_dir(),
            Plugins::Reference => PathBuf::from(REFERENCE_DIR),
        }
    }
}

/// The repository's `conf/` directory.
pub fn conf_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("conf")
}

/// A config directory holding copies of some `conf/` files, and a cache
/// directory of its own; both removed on drop.
pub struct Harness {
    pub plugins: Plugins,
    pub confdir: tempfile::TempDir,
    pub cache: tempfile::TempDir,
    /// host-local state of the copied configs.
    pub data: tempfile::TempDir,
    /// When set, cnitool runs inside this namespace (the node).
    pub node: Option<rcni_testkit::TestNs>,
}

/// Removes the runtime variables the test process itself may carry (those
/// the command sets stay).
fn clean_env(cmd: &mut Command) {
    let set: Vec<std::ffi::OsString> = cmd.get_envs().map(|(k, _)| k.to_owned()).collect();
    for (k, _) in std::env::vars() {
        if (k.starts_with("CNI_") || k == "NETCONFPATH" || k == "CAP_ARGS")
            && !set.iter().any(|s| *s == *k)
        {
            cmd.env_remove(k);
        }
    }
}

fn run(mut cmd: Command) -> Output {
    clean_env(&mut cmd);
    let out = cmd.stdin(Stdio::null()).output().expect("spawn");
    Output {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

impl Harness {
    pub fn new(plugins: Plugins, confs: &[&str]) -> Harness {
        rcni_testkit::require_root();
        let tmp = |p: &str| tempfile::Builder::new().prefix(p).tempdir().unwrap();
        let (confdir, data, cache) = (tmp("rcni-conf-"), tmp("rcni-ipam-"), tmp("rcni-cache-"));
        for c in confs {
            let text =
                std::fs::read(conf_dir().join(c)).unwrap_or_else(|e| panic!("conf/{c}: {e}"));
            let mut v: serde_json::Value = serde_json::from_slice(&text).unwrap();
            // Keep host-local's state in the test's own directory.
            let plugins = match v.get_mut("plugins") {
                Some(p) => p.as_array_mut().unwrap().iter_mut().collect::<Vec<_>>(),
                None => vec![&mut v],
            };
            for p in plugins {
                if p["ipam"]["type"] == "host-local" {
                    p["ipam"]["dataDir"] = data.path().display().to_string().into();
                }
            }
            std::fs::write(
                confdir.path().join(c),
                serde_json::to_vec_pretty(&v).unwrap(),
            )
            .unwrap();
        }
        Harness {
            plugins,
            confdir,
            cache,
            data,
            node: None,
        }
    }

    /// Runs cnitool from inside a fresh node namespace (where bridges live).
    pub fn with_node(mut self) -> Harness {
        self.node = Some(rcni_testkit::TestNs::new());
        self
    }

    /// The node namespace of [`Harness::with_node`].
    pub fn node_ns(&self) -> &rcni_netns::NetNs {
        &self.node.as_ref().expect("Harness::with_node").ns
    }

    /// A config written by the test itself.
    pub fn write_conf(&self, file: &str, body: &serde_json::Value) {
        std::fs::write(
            self.confdir.path().join(file),
            serde_json::to_vec_pretty(body).unwrap(),
        )
        .unwrap();
    }

    /// Our cnitool with NETCONFPATH, CNI_PATH and the cache dir set.
    pub fn cnitool(&self, args: &[&str]) -> Output {
        self.cnitool_env(args, &[])
    }

    pub fn cnitool_env(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut cmd = self.cnitool_command(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        run(cmd)
    }

    /// Our cnitool as [`Harness::cnitool`] runs it, not started.
    pub fn cnitool_command(&self, args: &[&str]) -> Command {
        let mut cmd = match &self.node {
            Some(n) => n.command(bin("cnitool")),
            None => Command::new(bin("cnitool")),
        };
        cmd.arg("--cache-dir").arg(self.cache.path()).args(args);
        cmd.env("NETCONFPATH", self.confdir.path())
            .env("CNI_PATH", self.plugins.dir())
            .env("DBUS_SYSTEM_BUS_ADDRESS", NO_SYSTEM_BUS);
        clean_env(&mut cmd);
        cmd
    }

    /// The libcni client: `add|check|del` for (netns, containerID, ifname).
    pub fn libcni(&self, cmd: &str, net: &str, netns: &str, cid: &str, ifname: &str) -> Output {
        self.libcni_env(cmd, net, netns, cid, ifname, &[])
    }

    /// [`Harness::libcni`] with `env` set (`CAP_ARGS`, or a `CNI_PATH` of
    /// its own), run in the node namespace when there is one.
    pub fn libcni_env(
        &self,
        cmd: &str,
        net: &str,
        netns: &str,
        cid: &str,
        ifname: &str,
        env: &[(&str, &str)],
    ) -> Output {
        let mut c = match &self.node {
            Some(n) => n.command(libcni_client()),
            None => Command::new(libcni_client()),
        };
        c.args([
            cmd,
            &self.confdir.path().display().to_string(),
            net,
            netns,
            cid,
            ifname,
        ])
        .arg(self.cache.path())
        .env("CNI_PATH", self.plugins.dir())
        .env("DBUS_SYSTEM_BUS_ADDRESS", NO_SYSTEM_BUS);
        for (k, v) in env {
            c.env(k, v);
        }
        run(c)
    }

    /// host-local's reservations of network `net` (see
    /// [`rcni_testkit::reservations`]).
    pub fn reservations(&self, net: &str) -> Vec<String> {
        rcni_testkit::reservations(&self.data.path().join(net))
    }

    pub fn cache_file(&self, net: &str, cid: &str, ifname: &str) -> PathBuf {
        self.cache
            .path()
            .join("results")
            .join(format!("{net}-{cid}-{ifname}"))
    }
}

/// A differential run: `run` once against our plugins and once against the
/// reference's, each time with `confs` installed and cnitool in a fresh node
/// namespace. Returns what each run returned, ours first.
pub fn ours_and_reference<T>(confs: &[&str], run: impl Fn(Plugins, &Harness) -> T) -> [T; 2] {
    Plugins::BOTH.map(|plugins| run(plugins, &Harness::new(plugins, confs).with_node()))
}

/// The libcni client binary, built on first use: `go build` in module mode
/// against libcni v1.1.2 (Debian 12's, pinned in go/libcni-client/go.mod;
/// the module comes from the Go module proxy, or from the module cache that
/// `scripts/setup` fills).
pub fn libcni_client() -> PathBuf {
    let out = bin_dir().join("libcni-client");
    if out.is_file() {
        return out;
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("go/libcni-client");
    // Build to a private name and rename: tests run as parallel processes.
    let tmp = bin_dir().join(format!("libcni-client.{}", std::process::id()));
    let gocache = bin_dir().join("go-build-cache");
    let status = Command::new("go")
        .args(["build", "-mod=readonly", "-o"])
        .arg(&tmp)
        .arg(".")
        .current_dir(&src)
        .env("GO111MODULE", "on")
        .env("GOFLAGS", "-buildvcs=false")
        .env("GOCACHE", &gocache)
        .status()
        .expect("run go (Go 1.19 or newer on PATH: scripts/setup --for test)");
    assert!(status.success(), "building the libcni client failed");
    std::fs::rename(&tmp, &out).unwrap();
    out
}

/// `ip ARGS` inside `ns` as sorted lines, with what differs between two
/// otherwise identical runs blanked: random veth names become `veth`,
/// `@ifN` peers `@if`, MAC and link-local addresses go.
pub fn ip_lines(ns: &rcni_netns::NetNs, args: &[&str]) -> Vec<String> {
    let out = rcni_testkit::command_in(ns, "ip")
        .args(args)
        .output()
        .expect("run ip");
    let mut lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.trim_start().starts_with("fe80"))
        .map(|l| {
            l.split_whitespace()
                .filter(|w| !is_mac(w) && !w.starts_with("fe80"))
                .map(blank_veth)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    lines.sort();
    lines
}

/// The masquerade rules (iptables and nftables) in `ns`, with the
/// per-container chain hashes and container IDs blanked.
pub fn masq_rules(ns: &rcni_netns::NetNs) -> Vec<String> {
    let mut text = String::new();
    for (tool, args) in [
        ("iptables-save", &["-t", "nat"][..]),
        ("ip6tables-save", &["-t", "nat"][..]),
        ("nft", &["list", "ruleset"][..]),
    ] {
        let out = rcni_testkit::command_in(ns, tool).args(args).output();
        if let Ok(o) = out {
            text.push_str(&String::from_utf8_lossy(&o.stdout));
        }
    }
    let mut lines: Vec<String> = text
        .lines()
        .filter(|l| l.contains("masq") || l.contains("MASQ") || l.contains("CNI-"))
        .map(|l| {
            let mut after_id = false;
            l.split_whitespace()
                .map(|w| {
                    // Counters differ with the traffic each run happened to send.
                    let out = if after_id {
                        "<id>".to_string()
                    } else if w.starts_with("CNI-") || w.starts_with(":CNI-") {
                        "CNI-<hash>".to_string()
                    } else {
                        w.to_string()
                    };
                    after_id = matches!(w, "id:" | "packets" | "bytes");
                    out
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    lines.sort();
    lines
}
