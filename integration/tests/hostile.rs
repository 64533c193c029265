//! Hostile input (issue 20, item 5): what a compromised or buggy runtime,
//! or a tenant who can name networks and plugins, may send.
//!
//! - Plugin type names with `/` or `..` are refused wherever a plugin is
//!   looked up by name: IPAM delegation, multinet's delegates, cnitool's
//!   chained plugins (CVE-2021-20206 in libcni), before anything is made.
//! - Container IDs, interface names and network names with `/`, `..`, NUL
//!   or over-long are refused by every plugin binary with code 4 (the
//!   environment) or 7 (the config), as skel and libcni do, before any
//!   file, link or rule exists.
//! - host-local's dataDir cannot be escaped through the network name.
//! - The dhcp daemon refuses other users, survives malformed and oversized
//!   requests and 1000 clients at once.
//! - Pinned BPF objects (fastpath, policy) are 0600.
//!
//! State is compared before and after each refused call: the links of the
//! node and the pod, every file below the test's directories, the node's
//! nftables and iptables rules.

use rcni_integration::lab::multinet;
use rcni_testkit::Bpffs;
use rcni_testkit::parallel::{Chain, Node};
use rcni_testkit::{Call, Output, TestNs, bin, bin_dir, require_root};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

fn plugins() -> Vec<String> {
    rcni_testkit::plugin_names()
}

fn files_below(root: &Path) -> BTreeSet<String> {
    fn walk(d: &Path, out: &mut BTreeSet<String>) {
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            let p = e.path();
            out.insert(p.display().to_string());
            if p.is_dir() && !p.is_symlink() {
                walk(&p, out);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(root, &mut out);
    out
}

fn lines(ns: &rcni_netns::NetNs, prog: &str, args: &[&str]) -> String {
    // stdout_of asserts success: a failed tool must not pass for "no rules".
    rcni_testkit::stdout_of(rcni_testkit::command_in(ns, prog).args(args))
}

/// What a refused call must not change.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    node_links: Vec<String>,
    pod_links: Vec<String>,
    files: BTreeSet<String>,
    rules: String,
}

/// A node with a pod, a master link for the plugins that need one, and
/// every path a plugin may write to inside `dir`.
struct Bench {
    node: TestNs,
    pod: TestNs,
    dir: tempfile::TempDir,
    bpffs: Bpffs,
}

impl Bench {
    fn new() -> Bench {
        require_root();
        let node = TestNs::new();
        for l in ["hmaster0", "hdev0"] {
            assert!(
                rcni_testkit::command_in(&node.ns, "ip")
                    // No dummy module on every kernel: a veth pair.
                    .args(["link", "add", l, "type", "veth", "peer", "name"])
                    .arg(format!("{l}p"))
                    .status()
                    .unwrap()
                    .success()
            );
        }
        Bench {
            node,
            pod: TestNs::new(),
            dir: tempfile::tempdir().unwrap(),
            bpffs: Bpffs::mount(),
        }
    }

    fn snapshot(&self) -> Snapshot {
        let mut rules = lines(&self.node.ns, "nft", &["list", "ruleset"]);
        for t in ["iptables-save", "ip6tables-save"] {
            rules.extend(
                lines(&self.node.ns, t, &[])
                    .lines()
                    .filter(|l| !l.starts_with('#'))
                    .map(|l| format!("{l}\n")),
            );
        }
        Snapshot {
            node_links: rcni_integration::link_names(&self.node.ns),
            pod_links: rcni_integration::link_names(&self.pod.ns),
            files: files_below(self.dir.path())
                .into_iter()
                .chain(files_below(self.bpffs.path()))
                .collect(),
            rules,
        }
    }

    fn p(&self, sub: &str) -> String {
        self.dir.path().join(sub).display().to_string()
    }

    /// A config `plugin` would act on (were the identity valid): every
    /// path inside the test's directory, links that exist, an IPAM.
    fn conf(&self, plugin: &str, name: &str) -> Value {
        json!({
            "cniVersion": "1.1.0", "name": name, "type": plugin,
            "bridge": "hbr0", "master": "hmaster0", "device": "hdev0", "vlanId": 42,
            "dataDir": self.p("data"), "cacheDir": self.p("cache"), "stateDir": self.p("state"),
            "statusDir": self.p("status"), "policyDir": self.p("policy.d"),
            "confDir": self.p("conf.d"), "defaultConfDir": self.p("default.d"),
            "daemonSocketPath": self.p("dhcp.sock"), "socketPath": self.p("dhcp.sock"),
            "pinRoot": self.bpffs.path(), "backend": "nftables", "mtu": 1400,
            "ingressRate": 1_000_000, "ingressBurst": 100_000,
            "ipam": {"type": "host-local", "dataDir": self.p("ipam"),
                     "ranges": [[{"subnet": "10.93.0.0/24"}]]},
            "prevResult": {"cniVersion": "1.1.0",
                "interfaces": [{"name": "eth0", "sandbox": self.pod.path()}],
                "ips": [{"address": "10.93.0.2/24", "interface": 0}]},
            "runtimeConfig": {"portMappings": [{"hostPort": 8080, "containerPort": 80,
                                                "protocol": "tcp"}]}
        })
    }

    fn call(&self, plugin: &str, cmd: &str, cid: &str, ifname: &str, conf: &Value) -> Output {
        Call::new(bin(plugin), cmd)
            .env("CNI_CONTAINERID", cid)
            .env("CNI_IFNAME", ifname)
            .env("CNI_NETNS", &self.pod.path())
            .env(
                "DBUS_SYSTEM_BUS_ADDRESS",
                rcni_integration::lab::chain::NO_SYSTEM_BUS,
            )
            .stdin(conf)
            .run_in(&self.node.ns)
    }
}

fn code_of(o: &Output) -> Option<u64> {
    serde_json::from_str::<Value>(&o.stdout).ok()?["code"].as_u64()
}

/// Every plugin, ADD, DEL and CHECK: a hostile container ID, interface name
/// or network name is refused with code 4 or 7 and nothing changes.
#[test]
fn hostile_identities_refused_by_every_plugin_before_anything_is_made() {
    let b = Bench::new();
    let long_if = "x".repeat(16);
    // (what, container ID, ifname, network name, expected code)
    let cases: Vec<(&str, String, String, String, u64)> = vec![
        ("cid /", "../../etc".into(), "eth0".into(), "hnet".into(), 4),
        ("cid slash", "a/b".into(), "eth0".into(), "hnet".into(), 4),
        ("cid ..", "..".into(), "eth0".into(), "hnet".into(), 4),
        ("cid space", "a b".into(), "eth0".into(), "hnet".into(), 4),
        ("ifname /", "c1".into(), "a/b".into(), "hnet".into(), 4),
        ("ifname ..", "c1".into(), "..".into(), "hnet".into(), 4),
        ("ifname .", "c1".into(), ".".into(), "hnet".into(), 4),
        ("ifname long", "c1".into(), long_if, "hnet".into(), 4),
        ("ifname :", "c1".into(), "eth0:1".into(), "hnet".into(), 4),
        ("name ..", "c1".into(), "eth0".into(), "..".into(), 7),
        ("name /", "c1".into(), "eth0".into(), "../../x".into(), 7),
        ("name slash", "c1".into(), "eth0".into(), "a/b".into(), 7),
        ("name NUL", "c1".into(), "eth0".into(), "a\u{0}b".into(), 7),
        ("name dot", "c1".into(), "eth0".into(), ".hidden".into(), 7),
    ];
    let mut bad = Vec::new();
    let before = b.snapshot();
    for p in plugins() {
        for cmd in ["ADD", "DEL", "CHECK"] {
            for (what, cid, ifname, name, want) in &cases {
                // The refusal must be for the hostile value, not another
                // config error with the same code.
                let word = match what.split(' ').next() {
                    Some("cid") => "containerID",
                    Some("ifname") => "interface name",
                    _ => "network name",
                };
                let o = b.call(&p, cmd, cid, ifname, &b.conf(&p, name));
                if o.code == 0 || code_of(&o) != Some(*want) || !o.stdout.contains(word) {
                    bad.push(format!(
                        "{p} {cmd} {what}: exit {} code {:?}, want {want}: {}",
                        o.code,
                        code_of(&o),
                        o.stdout.trim()
                    ));
                }
                let now = b.snapshot();
                if now != before {
                    bad.push(format!(
                        "{p} {cmd} {what}: state changed: {:?} -> {:?}",
                        before, now
                    ));
                    break;
                }
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Plugin type names that leave CNI_PATH.
const BAD_TYPES: [&str; 6] = [
    "../host-local",
    "/usr/lib/cni/host-local",
    "..",
    ".",
    "sub/../host-local",
    "host-local/",
];

/// IPAM delegation: every plugin with an `ipam` refuses a type naming a
/// path (code 7), and makes nothing: no link, no file, no rule.
#[test]
fn ipam_type_with_a_path_refused_before_anything_is_made() {
    let b = Bench::new();
    // Proof that nothing was run comes from the state.
    let mut bad = Vec::new();
    for p in ["bridge", "ptp", "macvlan", "ipvlan", "vlan", "host-device"] {
        for t in BAD_TYPES {
            let before = b.snapshot();
            let mut c = b.conf(p, "hnet");
            c["ipam"]["type"] = json!(t);
            c.as_object_mut().unwrap().remove("prevResult");
            let o = b.call(p, "ADD", "c1", "eth0", &c);
            if o.code == 0 || code_of(&o) != Some(7) || !o.stdout.contains("invalid plugin name") {
                bad.push(format!(
                    "{p} ipam.type {t:?}: exit {} code {:?}: {}",
                    o.code,
                    code_of(&o),
                    o.stdout.trim()
                ));
            }
            let now = b.snapshot();
            if now != before {
                bad.push(format!(
                    "{p} ipam.type {t:?}: state changed:\n{before:?}\n{now:?}"
                ));
                // Clean up for the next case (DEL leaves the bridge).
                let _ = b.call(p, "DEL", "c1", "eth0", &b.conf(p, "hnet"));
                let _ = rcni_testkit::command_in(&b.node.ns, "ip")
                    .args(["link", "del", "hbr0"])
                    .stderr(Stdio::null())
                    .status();
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// cnitool, like libcni after CVE-2021-20206: a chained plugin's type
/// naming a path is refused, and nothing of the chain runs.
#[test]
fn cnitool_refuses_plugin_types_with_a_path() {
    let b = Bench::new();
    let conf = tempfile::tempdir().unwrap();
    let before = b.snapshot();
    for (i, t) in BAD_TYPES.iter().enumerate() {
        for pos in [0, 1] {
            let mut bridge = b.conf("bridge", "hnet");
            for k in ["name", "cniVersion", "prevResult", "runtimeConfig"] {
                bridge.as_object_mut().unwrap().remove(k);
            }
            let mut plugins = vec![bridge, json!({"type": "tuning", "mtu": 1300})];
            plugins[pos]["type"] = json!(t);
            let list = json!({"cniVersion": "1.1.0", "name": "hnet", "plugins": plugins});
            std::fs::write(
                conf.path().join("hnet.conflist"),
                serde_json::to_vec(&list).unwrap(),
            )
            .unwrap();
            let o = rcni_testkit::command_in(&b.node.ns, bin("cnitool"))
                .env_clear()
                .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
                .env("NETCONFPATH", conf.path())
                .env("CNI_PATH", bin_dir())
                .env("CNI_CACHE_DIR", b.dir.path().join("cache"))
                .args(["add", "hnet", &b.pod.path(), "--container-id"])
                .arg(format!("c{i}"))
                .output()
                .unwrap();
            assert!(!o.status.success(), "type {t:?} at {pos} ran");
            let err = String::from_utf8_lossy(&o.stdout).to_string()
                + &String::from_utf8_lossy(&o.stderr);
            assert!(err.contains("invalid plugin name"), "{t:?}: {err}");
            // The bridge (first) must not have run when the bad type is
            // second: the list is checked before anything runs.
            assert_eq!(b.snapshot(), before, "type {t:?} at {pos}: {err}");
        }
    }
}

/// multinet: a network whose plugin type names a path is refused, its
/// other networks' attachments rolled back, nothing left.
#[test]
fn multinet_refuses_delegate_types_with_a_path() {
    let lab = multinet::Lab::new();
    let pod = TestNs::new();
    for t in BAD_TYPES {
        lab.write(
            lab.extra_dir.path(),
            "30-evil.conflist",
            &json!({"cniVersion": "1.0.0", "name": "evil", "plugins": [{
                "type": t, "master": "mv0", "mode": "bridge",
                "ipam": {"type": "host-local", "dataDir": lab.mac_data.path(),
                         "ranges": [[{"subnet": "10.77.0.0/24", "rangeStart": "10.77.0.50"}]]}
            }]}),
        );
        let o = lab.call("ADD", &pod, "evil1", "evil");
        assert_ne!(o.code, 0, "type {t:?}: {}", o.stdout);
        assert!(
            o.stdout.contains("invalid plugin name"),
            "type {t:?}: {}",
            o.stdout
        );
        let o = lab.call("DEL", &pod, "evil1", "evil");
        assert_eq!(o.code, 0, "DEL after a refused ADD: {}", o.stdout);
        lab.assert_nothing_left(&[&pod]);
    }
}

/// host-local: no network name leads out of dataDir; a refused one makes
/// nothing anywhere.
#[test]
fn host_local_data_dir_cannot_be_escaped_by_the_network_name() {
    let b = Bench::new();
    let outer = b.dir.path().join("outer");
    let data = outer.join("data");
    std::fs::create_dir_all(&data).unwrap();
    for name in [
        "..",
        "../..",
        "../escape",
        "a/../../escape",
        "/tmp/escape",
        "a\u{0}b",
        ".",
    ] {
        let conf = json!({"cniVersion": "1.1.0", "name": name, "type": "host-local",
            "ipam": {"type": "host-local", "dataDir": data,
                     "ranges": [[{"subnet": "10.94.0.0/24"}]]}});
        for cmd in ["ADD", "DEL", "CHECK", "GC", "STATUS"] {
            let o = b.call("host-local", cmd, "c1", "eth0", &conf);
            assert_eq!(code_of(&o), Some(7), "{name:?} {cmd}: {}", o.stdout);
            assert_eq!(
                files_below(&outer),
                BTreeSet::from([data.display().to_string()]),
                "{name:?} {cmd}"
            );
        }
    }
    assert!(!Path::new("/tmp/escape").exists());
}

/// The dhcp daemon in a directory of the test's: socket 0600 (root only),
/// so another user (nobody) cannot connect even where the directory is
/// open to all; a bad request gets an error, a huge one or an abandoned
/// connection is dropped, and 1000 clients at once all get their answer.
#[test]
fn dhcp_daemon_refuses_strangers_and_survives_abuse() {
    require_root();
    // Our own end holds 1000 connections.
    let _ = nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, 8192, 8192);
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let sock = dir.path().join("dhcp.sock");
    let node = TestNs::new();
    let mut daemon = rcni_integration::lab::dhcp::Guard(Some(
        rcni_testkit::tied_command_in(&node.ns, bin("dhcp"))
            .arg("daemon")
            .arg("-socketpath")
            .arg(&sock)
            .arg("-statedir")
            .arg(dir.path().join("state"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    ));
    rcni_testkit::wait_for(Duration::from_secs(10), "the socket", || {
        UnixStream::connect(&sock).is_ok()
    });
    use rcni_integration::lab::dhcp::{rpc_answer_ok, rpc_call_bytes};
    let conf = |name: &str| {
        serde_json::to_vec(
            &json!({"cniVersion": "1.1.0", "name": name, "type": "bridge",
            "ipam": {"type": "dhcp"}, "cni.dev/valid-attachments": []}),
        )
        .unwrap()
    };
    // One call on its own connection, as Go's net/rpc client makes it:
    // everything the daemon answered until it closed.
    let exchange = |bytes: &[u8]| -> Option<Vec<u8>> {
        let mut s = UnixStream::connect(&sock).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(60))).ok()?;
        let _ = s.write_all(bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        Some(out)
    };
    let status_call = rpc_call_bytes("DHCP.Status", &conf("n"));
    let status = || exchange(&status_call).is_some_and(|a| rpc_answer_ok(&a));
    assert!(status(), "status");

    // Another user: refused by the socket's mode.
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode & 0o007, 0, "socket mode {mode:o}");
    let nobody = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "perl"])
        .args([
            "-MIO::Socket::UNIX",
            "-e",
            "IO::Socket::UNIX->new(Peer => $ARGV[0]) ? exit 0 : exit 3",
        ])
        .arg(&sock)
        .status()
        .unwrap();
    assert_eq!(nobody.code(), Some(3), "nobody connected to the daemon");

    // Malformed requests: each gets an error reply, Go's HTTP refusal, or
    // is dropped. A network name that tries to escape is refused (code 7)
    // before any lease is looked up; releasing or collecting what was
    // never leased is a success (DEL and GC are idempotent).
    let hostile_args = |method: &str| rpc_call_bytes(method, &conf("../n"));
    let connect = b"CONNECT /_goRPC_ HTTP/1.0\n\n".to_vec();
    let junk: Vec<(Vec<u8>, Option<bool>)> = vec![
        (b"not http\n\n".to_vec(), Some(false)),
        (hostile_args("DHCP.Allocate"), Some(false)),
        (hostile_args("DHCP.Release"), Some(false)),
        (rpc_call_bytes("DHCP.GC", &conf("../../..")), Some(false)),
        (rpc_call_bytes("DHCP.Release", &conf("n")), Some(true)),
        (rpc_call_bytes("DHCP.GC", &conf("n")), Some(true)),
        ([&connect[..], &[0xff, 0xfe, 0, 1]].concat(), None),
        ([b"[".repeat(100_000), b"\n".to_vec()].concat(), Some(false)),
        // A message claiming more than the daemon accepts (4 MiB).
        (
            [
                &connect[..],
                &[0xfc, 0x00, 0x40, 0x00, 0x01],
                &vec![b'a'; 3 << 20][..],
            ]
            .concat(),
            None,
        ),
        (vec![b'a'; 3 << 20], Some(false)),
        (Vec::new(), None),
    ];
    for (j, ok) in &junk {
        let reply = exchange(j).unwrap_or_default();
        if let Some(ok) = ok {
            assert_eq!(
                rpc_answer_ok(&reply),
                *ok,
                "{}: {}",
                String::from_utf8_lossy(&j[..j.len().min(80)]),
                String::from_utf8_lossy(&reply[..reply.len().min(200)])
            );
        }
        assert!(status(), "daemon alive after junk");
    }
    // Nothing written outside the state directory.
    for f in files_below(dir.path()) {
        assert!(
            f.starts_with(&dir.path().join("state").display().to_string())
                || f == sock.display().to_string(),
            "{f}"
        );
    }
    assert!(!Path::new("/etc/passwd.lease").exists());

    // 1000 clients at once: all connected before any asks.
    let conns: Vec<UnixStream> = (0..1000)
        .map(|i| UnixStream::connect(&sock).unwrap_or_else(|e| panic!("connection {i}: {e}")))
        .collect();
    for mut c in &conns {
        c.write_all(&status_call).unwrap();
        c.shutdown(std::net::Shutdown::Write).unwrap();
    }
    let mut answered = 0;
    for mut c in conns {
        c.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let mut reply = Vec::new();
        c.read_to_end(&mut reply).unwrap();
        assert!(rpc_answer_ok(&reply), "{reply:?}");
        answered += 1;
    }
    assert_eq!(answered, 1000);
    assert!(status(), "alive at the end");
    daemon.stop();
}

/// fastpath's and policy's pins (both backends' maps and programs) are
/// readable and writable by root alone.
#[test]
fn pinned_bpf_objects_are_0600() {
    let bins: PathBuf = bin_dir();
    let node = Node::new("pins", Chain::Full, &bins.join("cnitool"), &bins);
    let pod = rcni_netns::NetNs::new_anonymous().unwrap();
    let path = pod.proc_path().display().to_string();
    let r = node.add(&path, "pins1");
    assert!(r.ok, "{} {}", r.stdout, r.stderr);
    let mut seen = 0;
    let mut bad = Vec::new();
    for f in files_below(node.bpffs.path()) {
        // The kernel's own read-only iterators, there at mount time.
        if f.ends_with("/maps.debug") || f.ends_with("/progs.debug") {
            continue;
        }
        let md = std::fs::symlink_metadata(&f).unwrap();
        let mode = md.permissions().mode() & 0o777;
        if md.is_dir() {
            if mode & 0o022 != 0 {
                bad.push(format!("{f}: directory {mode:o}"));
            }
        } else {
            seen += 1;
            if mode != 0o600 {
                bad.push(format!("{f}: {mode:o}"));
            }
        }
    }
    let d = node.del(&path, "pins1");
    assert!(d.ok, "{} {}", d.stdout, d.stderr);
    assert!(seen > 0, "no pins");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
