//! A DHCP lab for the dhcp tests: a node namespace, a server namespace
//! running dnsmasq, the daemon, and pods, all with files in one temporary
//! directory. Guards stop dnsmasq and the daemon however a test ends.

use crate::{ip, nl};
use rcni_testkit::{Call, Output, TestNs, bin, poll, wait_for};
use serde_json::{Value, json};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub const DNSMASQ: &str = "/usr/sbin/dnsmasq";
pub const SERVER_IP: &str = "10.77.0.1";
pub const NET: &str = "dhcpnet";

/// A child process killed (SIGTERM, then SIGKILL) when dropped.
pub struct Guard(pub Option<Child>);

impl Guard {
    pub fn stop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            if poll(Duration::from_secs(5), || {
                matches!(c.try_wait(), Ok(Some(_)))
            }) {
                return;
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts `cmd` (`what`, for the panic) without stdin, its stdout and
/// stderr to `log`, guarded.
fn spawn_logged(cmd: &mut Command, log: File, what: &str) -> Guard {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("start {what}: {e:?}"));
    Guard(Some(child))
}

/// A lease a pod holds: the pod, its config, ADD's result and the address.
pub struct Leased {
    pub pod: TestNs,
    pub conf: Value,
    pub result: Value,
    pub ip: String,
}

/// An example config of the repository's conf/ directory.
pub fn conflist(file: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../conf")
        .join(file);
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// Node namespace with bridge `br`, a server namespace on it (dnsmasq at
/// 10.77.0.1), a temporary directory for every file, and the daemon.
pub struct Lab {
    pub node: TestNs,
    pub server: TestNs,
    pub dir: tempfile::TempDir,
    pub bridge: String,
    /// The server's interface dnsmasq listens on.
    pub server_if: String,
    pub dnsmasq: Guard,
    pub daemon: Guard,
    pub pods: u32,
}

impl Lab {
    /// Node and server namespaces, nothing wired.
    pub fn bare() -> Lab {
        assert!(
            Path::new(DNSMASQ).is_file(),
            "{DNSMASQ} is missing: apt-get install dnsmasq-base"
        );
        Lab {
            node: TestNs::new(),
            server: TestNs::new(),
            dir: tempfile::tempdir().unwrap(),
            bridge: String::new(),
            server_if: "srv0".into(),
            dnsmasq: Guard(None),
            daemon: Guard(None),
            pods: 0,
        }
    }

    /// The server on bridge `bridge` of the node, at 10.77.0.1/24 on srv0.
    pub fn new(bridge: &str) -> Lab {
        let mut lab = Lab::bare();
        let (node, server) = (&lab.node, &lab.server);
        ip(&node.ns, &format!("link add {bridge} type bridge"));
        ip(&node.ns, &format!("link set {bridge} up"));
        ip(
            &node.ns,
            &format!(
                "link add srv-n type veth peer name srv0 netns {}",
                server.path()
            ),
        );
        ip(&node.ns, &format!("link set srv-n master {bridge} up"));
        ip(&server.ns, &format!("addr add {SERVER_IP}/24 dev srv0"));
        ip(&server.ns, "link set srv0 up");
        ip(&server.ns, "link set lo up");
        lab.bridge = bridge.into();
        lab
    }

    /// The lab on bridge `bridge` with dnsmasq (`dnsmasq` options, as
    /// [`Lab::start_dnsmasq`]) and the daemon running.
    pub fn serving_on(bridge: &str, dnsmasq: &[&str]) -> Lab {
        let mut lab = Lab::new(bridge);
        lab.start_dnsmasq(dnsmasq);
        lab.start_daemon(&[]);
        lab
    }

    /// [`Lab::serving_on`] bridge `br0`.
    pub fn serving(dnsmasq: &[&str]) -> Lab {
        Lab::serving_on("br0", dnsmasq)
    }

    /// A new pod with a lease for container `c1`, its address on eth0 as
    /// the interface plugin would apply it.
    pub fn leased_pod(&mut self) -> Leased {
        let pod = self.pod();
        let conf = self.conf(json!({}));
        let result = self.call("ADD", "c1", Some(&pod.path()), &conf).ok();
        let addr = addr_ip(&result);
        ip(&pod.ns, &format!("addr add {addr}/24 dev eth0"));
        Leased {
            pod,
            conf,
            result,
            ip: addr,
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn socket(&self) -> PathBuf {
        self.path("dhcp.sock")
    }

    pub fn state_dir(&self) -> PathBuf {
        self.path("state")
    }

    /// dnsmasq on srv0 with a 2-minute lease (its minimum) and `extra`
    /// options. No DNS (`--port=0`), no ping before offering.
    pub fn start_dnsmasq(&mut self, extra: &[&str]) {
        let mut args = vec!["--dhcp-range=10.77.0.50,10.77.0.150,255.255.255.0,2m"];
        args.extend_from_slice(extra);
        self.start_dnsmasq_with_range(&args);
    }

    /// dnsmasq as above; `args` include the `--dhcp-range`.
    pub fn start_dnsmasq_with_range(&mut self, extra: &[&str]) {
        let pidfile = self.path("dnsmasq.pid");
        let log = std::fs::File::create(self.path("dnsmasq.log")).unwrap();
        // dnsmasq clears the parent-death signal: a PID namespace of its own.
        let mut cmd = rcni_testkit::tied_tree_command_in(&self.server.ns, DNSMASQ);
        cmd.args([
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-hosts",
            "--no-resolv",
            "--port=0",
            "--bind-interfaces",
            &format!("--interface={}", self.server_if),
            "--except-interface=lo",
            "--no-ping",
            "--log-dhcp",
            "--log-facility=-",
            "--user=root",
            "--dhcp-authoritative",
        ])
        .arg(format!(
            "--dhcp-leasefile={}",
            self.path("leases").display()
        ))
        .arg(format!("--pid-file={}", pidfile.display()))
        .args(extra);
        self.dnsmasq = spawn_logged(&mut cmd, log, "dnsmasq");
        // A limit, not a figure: the emulated VM under load has needed
        // more than 5 s.
        wait_for(Duration::from_secs(30), "dnsmasq to start", || {
            pidfile.exists()
        });
    }

    /// The daemon in the node namespace, everything in the temp dir.
    pub fn start_daemon(&mut self, extra: &[&str]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path("daemon.log"))
            .unwrap();
        let mut cmd = rcni_testkit::tied_command_in(&self.node.ns, bin("dhcp"));
        cmd.arg("daemon")
            .arg("-socketpath")
            .arg(self.socket())
            .arg("-statedir")
            .arg(self.state_dir())
            .arg("-pidfile")
            .arg(self.path("dhcp.pid"))
            .args(["-timeout", "2s"])
            .args(extra);
        let log_path = self.path("daemon.log");
        let listening = || {
            std::fs::read_to_string(&log_path)
                .unwrap_or_default()
                .matches("dhcp daemon: listening")
                .count()
        };
        let before = listening();
        self.daemon = spawn_logged(&mut cmd, log, "dhcp daemon");
        // Its socket takes connections from the bind on, before it has
        // resumed (or dropped) the leases on disk: ready is its word.
        wait_for(Duration::from_secs(30), "the daemon listening", || {
            listening() > before
        });
    }

    /// Another suite's daemon (the reference's) in the node namespace:
    /// its socket in the temp dir, no other flag but `extra` (its leases
    /// live in its memory only; it has no state directory).
    pub fn start_foreign_daemon(&mut self, daemon: &Path, extra: &[&str]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path("daemon.log"))
            .unwrap();
        let mut cmd = rcni_testkit::tied_command_in(&self.node.ns, daemon);
        cmd.arg("daemon")
            .arg("-socketpath")
            .arg(self.socket())
            .arg("-pidfile")
            .arg(self.path("dhcp.pid"))
            .args(extra);
        self.daemon = spawn_logged(&mut cmd, log, "foreign dhcp daemon");
        let sock = self.socket();
        wait_for(Duration::from_secs(30), "the daemon's socket", || {
            std::os::unix::net::UnixStream::connect(&sock).is_ok()
        });
    }

    /// A CNI_PATH directory whose `dhcp` is `plugin` (another suite's IPAM
    /// binary for an interface plugin of ours to delegate to).
    pub fn cni_path_with_dhcp(&self, plugin: &Path) -> PathBuf {
        let dir = self.path("cni-bin");
        std::fs::create_dir_all(&dir).unwrap();
        let link = dir.join("dhcp");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(plugin, &link).unwrap();
        dir
    }

    pub fn stop_daemon(&mut self) {
        self.daemon.stop();
    }

    /// A pod: a veth whose container end is `eth0` (left down: the daemon
    /// sets it up), host end on the bridge.
    pub fn pod(&mut self) -> TestNs {
        let pod = TestNs::new();
        self.attach(&pod.path());
        pod
    }

    pub fn attach(&mut self, netns_path: &str) {
        self.pods += 1;
        let host = format!("pod{}-n", self.pods);
        ip(
            &self.node.ns,
            &format!("link add {host} type veth peer name eth0 netns {netns_path}"),
        );
        ip(
            &self.node.ns,
            &format!("link set {host} master {} up", self.bridge),
        );
    }

    pub fn conf(&self, ipam_extra: Value) -> Value {
        let mut ipam = json!({"type": "dhcp", "daemonSocketPath": self.socket()});
        for (k, v) in ipam_extra.as_object().unwrap() {
            ipam[k] = v.clone();
        }
        json!({"cniVersion": "1.1.0", "name": NET, "type": "bridge", "ipam": ipam})
    }

    pub fn call(&self, cmd: &str, cid: &str, netns: Option<&str>, conf: &Value) -> Output {
        let mut c = Call::new(bin("dhcp"), cmd)
            .env("CNI_CONTAINERID", cid)
            .env("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAME=web-0")
            .stdin(conf);
        if let Some(n) = netns {
            c = c.netns(n);
        }
        c.run_in(&self.node.ns)
    }

    /// dnsmasq's lease table: (expiry, ip, hostname, client id) per line.
    pub fn leases(&self) -> Vec<(u64, String, String, String)> {
        std::fs::read_to_string(self.path("leases"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.len() >= 5).then(|| {
                    (
                        f[0].parse().unwrap_or(0),
                        f[2].to_string(),
                        f[3].to_string(),
                        f[4].to_string(),
                    )
                })
            })
            .collect()
    }

    pub fn lease_of(&self, ip: &str) -> Option<(u64, String, String, String)> {
        self.leases().into_iter().find(|l| l.1 == ip)
    }

    /// Asserts that dnsmasq forgets the lease of `ip` within 5 s (`what`
    /// says why it should).
    pub fn assert_released(&self, ip: &str, what: &str) {
        assert!(
            poll(Duration::from_secs(5), || self.lease_of(ip).is_none()),
            "{what}: dnsmasq still lists {ip}: {:?}\n{}",
            self.leases(),
            self.logs()
        );
    }

    /// Asserts that dnsmasq's lease of `ip` is extended past expiry
    /// `since` within `limit` (`what` says why it should).
    pub fn assert_renewed(&self, ip: &str, since: u64, limit: Duration, what: &str) {
        assert!(
            poll(limit, || self.lease_of(ip).is_some_and(|l| l.0 > since)),
            "{what}: {:?}\n{}",
            self.leases(),
            self.logs()
        );
    }

    /// The config of a conflist's first plugin as a runtime hands it over
    /// (with the list's cniVersion and name), its dhcp IPAM pointed at
    /// this lab's daemon.
    pub fn first_plugin_conf(&self, list: &Value) -> Value {
        let mut conf = list["plugins"][0].clone();
        conf["cniVersion"] = list["cniVersion"].clone();
        conf["name"] = list["name"].clone();
        conf["ipam"]["daemonSocketPath"] = json!(self.socket());
        conf
    }

    /// CHECK, then DEL, through `call` (a chain's first plugin, given the
    /// command and its stdin) with `result` as prevResult: both succeed and
    /// the daemon holds no lease after. Returns the config with prevResult.
    pub fn check_and_del(
        &self,
        call: impl Fn(&str, &Value) -> Output,
        conf: &Value,
        result: &Value,
    ) -> Value {
        let mut with_prev = conf.clone();
        with_prev["prevResult"] = result.clone();
        call("CHECK", &with_prev).ok();
        call("DEL", &with_prev).ok();
        assert!(self.state_files().is_empty(), "{}", self.logs());
        with_prev
    }

    pub fn state_files(&self) -> Vec<String> {
        rcni_testkit::file_names(&self.state_dir())
    }

    pub fn daemon_log(&self) -> String {
        std::fs::read_to_string(self.path("daemon.log")).unwrap_or_default()
    }

    pub fn logs(&self) -> String {
        format!(
            "--- daemon log ---\n{}\n--- dnsmasq log ---\n{}",
            self.daemon_log(),
            std::fs::read_to_string(self.path("dnsmasq.log")).unwrap_or_default()
        )
    }
}

pub fn addr_ip(result: &Value) -> String {
    result["ips"][0]["address"]
        .as_str()
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_string()
}

/// The hex client ID dnsmasq prints: type 0, then the text.
pub fn dnsmasq_client_id(id: &str) -> String {
    std::iter::once(0u8)
        .chain(id.bytes())
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

pub fn addresses(ns: &rcni_netns::NetNs, dev: &str) -> Vec<String> {
    let dev = dev.to_string();
    nl(ns, async move |n| {
        let l = n.link_by_name(&dev).await.unwrap();
        n.addresses(Some(l.index))
            .await
            .unwrap()
            .into_iter()
            .map(|a| a.addr.to_string())
            .collect()
    })
}

// ---- the dhcp daemon's wire, by hand (for tests that abuse it) ----

fn gob_uint(b: &[u8], pos: &mut usize) -> Option<u64> {
    let first = *b.get(*pos)?;
    *pos += 1;
    if first < 128 {
        return Some(u64::from(first));
    }
    let n = (-(first as i8)) as usize;
    let bytes = b.get(*pos..*pos + n)?;
    *pos += n;
    Some(bytes.iter().fold(0, |u, x| (u << 8) | u64::from(*x)))
}

fn gob_put_uint(out: &mut Vec<u8>, u: u64) {
    if u < 128 {
        out.push(u as u8);
    } else {
        let bytes = u.to_be_bytes();
        let skip = bytes.iter().take_while(|x| **x == 0).count();
        out.push((-((8 - skip) as i8)) as u8);
        out.extend_from_slice(&bytes[skip..]);
    }
}

/// The messages of a gob stream (each without its length).
fn gob_messages(mut b: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let mut pos = 0;
        let Some(n) = gob_uint(b, &mut pos) else {
            break;
        };
        let Some(m) = b.get(pos..pos + n as usize) else {
            break;
        };
        out.push(m);
        b = &b[pos + n as usize..];
    }
    out
}

/// What Go's net/rpc client writes on a new connection for one call of
/// `method` whose `skel.CmdArgs` carry only `stdin` (what a daemon's
/// STATUS or GC reads): the HTTP CONNECT, then the type definitions the
/// reference's v1.9.1 plugin sends (taken from its recorded stream in
/// ipam/dhcp/tests/gob) and the two values.
pub fn rpc_call_bytes(method: &str, stdin: &[u8]) -> Vec<u8> {
    let go = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../ipam/dhcp/tests/gob/v1.9.1-allocate-request.bin"),
    )
    .unwrap();
    let msgs = gob_messages(&go);
    // Request's definition (id 65), its value, CmdArgs' definition (66).
    let (request_def, args_def) = (msgs[0], msgs[2]);
    let mut out = b"CONNECT /_goRPC_ HTTP/1.0\n\n".to_vec();
    let mut frame = |m: &[u8]| {
        gob_put_uint(&mut out, m.len() as u64);
        out.extend_from_slice(m);
    };
    frame(request_def);
    // Request{ServiceMethod: method} (Seq 0 is left out, as Go does).
    let mut v = vec![0xff, 0x82, 0x01];
    gob_put_uint(&mut v, method.len() as u64);
    v.extend_from_slice(method.as_bytes());
    v.push(0);
    frame(&v);
    frame(args_def);
    // CmdArgs{StdinData: stdin}: field 6, delta 7.
    let mut v = vec![0xff, 0x84, 0x07];
    gob_put_uint(&mut v, stdin.len() as u64);
    v.extend_from_slice(stdin);
    v.push(0);
    frame(&v);
    out
}

/// Whether `answer` (all a daemon sent for [`rpc_call_bytes`]) accepted
/// the CONNECT and answered a Response without an error.
pub fn rpc_answer_ok(answer: &[u8]) -> bool {
    let Some(rest) = answer.strip_prefix(b"HTTP/1.0 200 Connected to Go RPC\n\n") else {
        return false;
    };
    // The first value message is the Response: ServiceMethod (field 0),
    // Seq (1), Error (2).
    for m in gob_messages(rest) {
        let mut pos = 0;
        let Some(id) = gob_uint(m, &mut pos) else {
            return false;
        };
        if id & 1 == 1 {
            continue; // a negative id: a type definition
        }
        let mut field: i64 = -1;
        loop {
            match gob_uint(m, &mut pos) {
                None => return false,
                Some(0) => return true,
                Some(d) => field += d as i64,
            }
            match field {
                0 | 2 => {
                    let Some(n) = gob_uint(m, &mut pos) else {
                        return false;
                    };
                    if field == 2 {
                        return false;
                    }
                    pos += n as usize;
                }
                1 => {
                    gob_uint(m, &mut pos);
                }
                _ => return false,
            }
        }
    }
    false
}
