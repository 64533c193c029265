//! Helpers for the chained (meta) plugin tests: a node namespace with an
//! uplink to a client namespace ("outside"), pods attached by our bridge
//! plugin, the chain run the way a runtime runs it, and real TCP/UDP
//! traffic between the namespaces (sockets created inside a namespace stay
//! there, so the test process talks from any of them).

use rcni_netlink::Netlink;
use rcni_netns::NetNs;
use rcni_testkit::{Call, Output, TestNs, bin, bin_dir};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const NODE_UPLINK_V4: &str = "10.99.0.1";
pub const NODE_UPLINK_V6: &str = "fd99::1";
pub const CLIENT_V4: &str = "10.99.0.2";
pub const CLIENT_V6: &str = "fd99::2";
/// The bridge's gateway addresses (bridge plugin, isGateway).
pub const BRIDGE_V4: &str = "10.88.0.1";

pub use crate::nl;

/// Runs a tool inside `ns`; returns (success, stdout+stderr).
pub fn sh(ns: &NetNs, prog: &str, args: &[&str]) -> (bool, String) {
    let out = rcni_testkit::command_in(ns, prog)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {prog}: {e}"));
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// The whole nftables ruleset and both iptables nat and filter tables of
/// `ns`, as text.
pub fn ruleset(ns: &NetNs) -> String {
    let mut s = sh(ns, "nft", &["list", "ruleset"]).1;
    for tool in ["iptables-save", "ip6tables-save"] {
        s.push_str(&sh(ns, tool, &[]).1);
    }
    s
}

/// Gives link `index` `v4`/24 and `v6`/64 without DAD, and brings it and
/// lo up.
async fn up_with(n: &Netlink, index: u32, v4: &str, v6: &str) {
    for a in [format!("{v4}/24"), format!("{v6}/64")] {
        n.ensure_address_nodad(index, a.parse().unwrap())
            .await
            .unwrap();
    }
    n.set_up(index).await.unwrap();
    let lo = n.link_by_name("lo").await.unwrap();
    n.set_up(lo.index).await.unwrap();
}

/// `base` with the keys of `extra` set: a test's variation of a config.
pub fn merged(mut base: Value, extra: Value) -> Value {
    for (k, v) in extra.as_object().expect("extra keys") {
        base[k] = v.clone();
    }
    base
}

/// Asserts that a plugin run succeeded.
pub fn assert_success(out: &Output) {
    assert_eq!(out.code, 0, "{}", out.stdout);
}

/// The system bus address plugins get unless a test gives its own: none
/// there, so a plugin that talks D-Bus (firewall's firewalld backend) never
/// reaches the machine's system bus and the firewalld on it.
pub const NO_SYSTEM_BUS: &str = "unix:path=/nonexistent/rcni-test-no-system-bus";

/// A node namespace (the "host") with an uplink to a client namespace.
pub struct Lan {
    pub node: TestNs,
    pub client: TestNs,
    pub data: tempfile::TempDir,
    pub cni_path: String,
    /// Environment of every plugin run from the node (after the `CNI_*`
    /// variables): `DBUS_SYSTEM_BUS_ADDRESS` is [`NO_SYSTEM_BUS`] unless
    /// a test sets its own.
    pub env: Vec<(String, String)>,
}

impl Lan {
    pub fn new() -> Lan {
        Lan::with_path(bin_dir().display().to_string())
    }

    /// A LAN whose plugins are looked up in `cni_path`.
    pub fn with_path(cni_path: String) -> Lan {
        let node = TestNs::new();
        let client = TestNs::new();
        let up = nl(&node.ns, async |n| {
            n.create_veth("up0", "eth0", Some(&client.ns), None)
                .await
                .unwrap()
        });
        // A real uplink finished DAD long before its pods came; in fresh
        // namespaces it would keep both ends' link-local addresses
        // tentative for a second or two, and the kernel solicits no
        // neighbour for a forwarded packet from a tentative link-local.
        for (ns, dev) in [(&node.ns, "up0"), (&client.ns, "eth0")] {
            let _ = rcni_netlink::sysctl::set(ns, &format!("net.ipv6.conf.{dev}.accept_dad"), "0");
        }
        nl(&node.ns, async |n| {
            up_with(n, up.index, NODE_UPLINK_V4, NODE_UPLINK_V6).await;
        });
        nl(&client.ns, async |n| {
            let eth = n.link_by_name("eth0").await.unwrap();
            up_with(n, eth.index, CLIENT_V4, CLIENT_V6).await;
            for (dst, gw) in [("0.0.0.0/0", NODE_UPLINK_V4), ("::/0", NODE_UPLINK_V6)] {
                let r = rcni_netlink::Route::new(dst.parse().unwrap())
                    .gateway(gw.parse().unwrap())
                    .oif(eth.index);
                n.add_route(&r).await.unwrap();
            }
        });
        for key in ["net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding"] {
            rcni_netlink::sysctl::set(&node.ns, key, "1").unwrap();
        }
        Lan {
            node,
            client,
            data: tempfile::tempdir().unwrap(),
            cni_path,
            env: vec![("DBUS_SYSTEM_BUS_ADDRESS".into(), NO_SYSTEM_BUS.into())],
        }
    }

    /// Sets `k` in the environment of the plugins run from the node.
    pub fn set_env(&mut self, k: &str, v: &str) {
        self.env.retain(|(key, _)| key != k);
        self.env.push((k.into(), v.into()));
    }

    /// The bridge plugin config every chain here starts with.
    pub fn bridge_conf(&self, version: &str) -> Value {
        json!({
            "cniVersion": version, "name": "podnet", "type": "bridge", "bridge": "cni0",
            "isGateway": true, "isDefaultGateway": true, "hairpinMode": true,
            "ipam": {"type": "host-local", "dataDir": self.data.path(),
                     "ranges": [[{"subnet": "10.88.0.0/24"}], [{"subnet": "fd88::/64"}]]}
        })
    }

    /// The bridge config (without its name) chained with `plugin`, whose
    /// keys `extra` overrides.
    pub fn chain_with(&self, version: &str, plugin: Value, extra: Value) -> Chain {
        let mut br = self.bridge_conf(version);
        br.as_object_mut().unwrap().remove("name");
        Chain::new(version, vec![br, merged(plugin, extra)])
    }

    /// Runs `plugin` with `cmd` for `pod`'s eth0.
    pub fn run(&self, plugin: &Path, cmd: &str, pod: &TestNs, cid: &str, conf: &Value) -> Output {
        self.call(plugin, cmd, Some(&pod.path()), cid, "eth0", conf)
    }

    /// What `prog args` printed in the node, whether it succeeded or not.
    pub fn on_node(&self, prog: &str, args: &[&str]) -> String {
        sh(&self.node.ns, prog, args).1
    }

    /// Runs `prog args` in the node; it must succeed.
    pub fn on_node_ok(&self, prog: &str, args: &[&str]) {
        let (ok, msg) = sh(&self.node.ns, prog, args);
        assert!(ok, "{msg}");
    }

    /// Runs `plugin` (a path) with `cmd` for a pod, from the node.
    pub fn call(
        &self,
        plugin: &Path,
        cmd: &str,
        pod: Option<&str>,
        cid: &str,
        ifname: &str,
        conf: &Value,
    ) -> Output {
        let mut c = self
            .with_env(Call::new(plugin, cmd))
            .env("CNI_PATH", &self.cni_path)
            .env("CNI_CONTAINERID", cid)
            .env("CNI_IFNAME", ifname)
            .stdin(conf);
        if let Some(p) = pod {
            c = c.netns(p);
        }
        c.run_in(&self.node.ns)
    }

    /// `call` with [`Lan::env`].
    pub fn with_env(&self, mut call: Call) -> Call {
        for (k, v) in &self.env {
            call = call.env(k, v);
        }
        call
    }
}

impl Default for Lan {
    fn default() -> Self {
        Self::new()
    }
}

/// A conflist run the way libcni runs it: ADD in order with prevResult,
/// DEL in reverse with the final result, CHECK with it.
#[derive(Clone)]
pub struct Chain {
    pub version: String,
    pub name: String,
    /// Plugin objects (without name/cniVersion, which are injected).
    pub plugins: Vec<Value>,
    /// Capability args (`portMappings`, `bandwidth`, `mac`, ...).
    pub caps: Value,
    /// Where the binaries are.
    pub dir: PathBuf,
}

impl Chain {
    pub fn new(version: &str, plugins: Vec<Value>) -> Chain {
        Chain {
            version: version.into(),
            name: "podnet".into(),
            plugins,
            caps: json!({}),
            dir: bin_dir(),
        }
    }

    pub fn caps(mut self, caps: Value) -> Chain {
        self.caps = caps;
        self
    }

    pub fn dir(mut self, dir: impl Into<PathBuf>) -> Chain {
        self.dir = dir.into();
        self
    }

    /// This chain with plugin `i` alone.
    pub fn only(&self, i: usize) -> Chain {
        Chain {
            plugins: vec![self.plugins[i].clone()],
            ..self.clone()
        }
    }

    /// The stdin of plugin `i`: its object with name, version, the
    /// runtimeConfig of its declared capabilities, and prevResult.
    pub fn stdin(&self, i: usize, prev: Option<&Value>) -> Value {
        let mut p = self.plugins[i].clone();
        p["name"] = json!(self.name);
        p["cniVersion"] = json!(self.version);
        let mut rc = serde_json::Map::new();
        if let Some(caps) = p.get("capabilities").and_then(Value::as_object) {
            for (k, on) in caps {
                if on.as_bool() == Some(true)
                    && let Some(v) = self.caps.get(k)
                {
                    rc.insert(k.clone(), v.clone());
                }
            }
        }
        if !rc.is_empty() {
            p["runtimeConfig"] = Value::Object(rc);
        }
        if let Some(prev) = prev {
            p["prevResult"] = prev.clone();
        }
        p
    }

    fn bin(&self, i: usize) -> PathBuf {
        let ty = self.plugins[i]["type"].as_str().unwrap();
        let p = self.dir.join(ty);
        assert!(p.is_file(), "{} missing", p.display());
        p
    }

    pub fn add(&self, lan: &Lan, pod: &str, cid: &str, ifname: &str) -> Value {
        self.try_add(lan, pod, cid, ifname)
            .unwrap_or_else(|(i, o)| panic!("ADD of plugin {i} failed: {} {}", o.stdout, o.stderr))
    }

    /// Runs plugin `i` alone with `cmd` for `pod`'s eth0, `prev` its
    /// prevResult.
    pub fn run(
        &self,
        lan: &Lan,
        i: usize,
        cmd: &str,
        pod: &TestNs,
        cid: &str,
        prev: Option<&Value>,
    ) -> Output {
        self.call_plugin(lan, i, cmd, (Some(&pod.path()), cid, "eth0"), prev)
    }

    /// Runs plugin `i` with `cmd` for (netns, container ID, interface),
    /// `prev` its prevResult.
    fn call_plugin(
        &self,
        lan: &Lan,
        i: usize,
        cmd: &str,
        (pod, cid, ifname): (Option<&str>, &str, &str),
        prev: Option<&Value>,
    ) -> Output {
        lan.call(&self.bin(i), cmd, pod, cid, ifname, &self.stdin(i, prev))
    }

    /// ADD of plugin 0, then of plugin 1 with its result: both results.
    pub fn add_in_two(&self, lan: &Lan, pod: &TestNs, cid: &str) -> (Value, Value) {
        let first = self.run(lan, 0, "ADD", pod, cid, None).ok();
        let second = self.run(lan, 1, "ADD", pod, cid, Some(&first)).ok();
        (first, second)
    }

    /// ADD of plugin 1 without prevResult: its error (code, msg).
    pub fn add_unchained(&self, lan: &Lan, pod: &TestNs) -> (u64, String) {
        self.run(lan, 1, "ADD", pod, "x", None).err()
    }

    /// ADD through the chain; on failure the index of the failing plugin.
    pub fn try_add(
        &self,
        lan: &Lan,
        pod: &str,
        cid: &str,
        ifname: &str,
    ) -> Result<Value, (usize, Output)> {
        let mut prev: Option<Value> = None;
        for i in 0..self.plugins.len() {
            let out = self.call_plugin(lan, i, "ADD", (Some(pod), cid, ifname), prev.as_ref());
            if out.code != 0 {
                return Err((i, out));
            }
            prev = Some(serde_json::from_str(&out.stdout).unwrap());
        }
        Ok(prev.unwrap())
    }

    /// CHECK every plugin; the first failure.
    pub fn check(
        &self,
        lan: &Lan,
        pod: &str,
        cid: &str,
        ifname: &str,
        result: &Value,
    ) -> Result<(), (usize, Output)> {
        for i in 0..self.plugins.len() {
            let out = self.call_plugin(lan, i, "CHECK", (Some(pod), cid, ifname), Some(result));
            if out.code != 0 {
                return Err((i, out));
            }
        }
        Ok(())
    }

    /// CHECK of `pod`'s eth0 passes.
    pub fn check_ok(&self, lan: &Lan, pod: &TestNs, cid: &str, result: &Value) {
        self.check(lan, &pod.path(), cid, "eth0", result)
            .unwrap_or_else(|(i, o)| panic!("CHECK {i}: {} {}", o.stdout, o.stderr));
    }

    /// CHECK fails in plugin 1 with code 106: its message.
    pub fn check_fails(
        &self,
        lan: &Lan,
        pod: &TestNs,
        cid: &str,
        ifname: &str,
        result: &Value,
    ) -> String {
        let (i, out) = self
            .check(lan, &pod.path(), cid, ifname, result)
            .unwrap_err();
        assert_eq!(i, 1);
        let (code, msg) = out.err();
        assert_eq!(code, 106, "{msg}");
        msg
    }

    /// DEL in reverse order; every plugin must succeed.
    pub fn del(
        &self,
        lan: &Lan,
        pod: Option<&str>,
        cid: &str,
        ifname: &str,
        result: Option<&Value>,
    ) {
        for i in (0..self.plugins.len()).rev() {
            let out = self.call_plugin(lan, i, "DEL", (pod, cid, ifname), result);
            assert_eq!(
                out.code, 0,
                "DEL of plugin {i}: {} {}",
                out.stdout, out.stderr
            );
        }
    }

    /// DEL of `pod`'s eth0 with `result`.
    pub fn del_pod(&self, lan: &Lan, pod: &TestNs, cid: &str, result: &Value) {
        self.del(lan, Some(&pod.path()), cid, "eth0", Some(result));
    }

    /// GC every plugin with the valid attachments `valid` ((cid, ifname)).
    pub fn gc(&self, lan: &Lan, valid: &[(&str, &str)]) {
        let list: Vec<Value> = valid
            .iter()
            .map(|(c, i)| json!({"containerID": c, "ifname": i}))
            .collect();
        for i in 0..self.plugins.len() {
            let mut conf = self.stdin(i, None);
            conf.as_object_mut().unwrap().remove("runtimeConfig");
            conf["cni.dev/valid-attachments"] = json!(list);
            conf["cni.dev/attachments"] = json!(list);
            let out = lan
                .with_env(Call::new(self.bin(i), "GC"))
                .env("CNI_PATH", &lan.cni_path)
                .without("CNI_CONTAINERID")
                .without("CNI_IFNAME")
                .stdin(&conf)
                .run_in(&lan.node.ns);
            assert_eq!(
                out.code, 0,
                "GC of plugin {i}: {} {}",
                out.stdout, out.stderr
            );
        }
    }
}

/// The first address of a family in a result.
pub fn ip_of(result: &Value, v4: bool) -> String {
    rcni_testkit::result_ips(result)
        .into_iter()
        .find(|a| a.contains('.') == v4)
        .unwrap()
}

/// The host end of the pod's veth in a bridge result (its second
/// interface).
pub fn host_veth(r: &Value) -> String {
    r["interfaces"][1]["name"].as_str().unwrap().to_string()
}

/// A TCP server in `ns` on `port` (both families) answering every
/// connection with `reply` and the peer address it saw; stops with the
/// test process.
pub fn tcp_server(ns: &NetNs, port: u16, reply: &str) {
    for addr in [format!("0.0.0.0:{port}"), format!("[::]:{port}")] {
        let l = ns
            .run(|| {
                if addr.starts_with('[') {
                    // v6-only so both binds succeed.
                    socket_v6_only(&addr).unwrap()
                } else {
                    TcpListener::bind(&addr).unwrap()
                }
            })
            .unwrap();
        let reply = reply.to_string();
        std::thread::spawn(move || {
            for mut c in l.incoming().flatten() {
                let peer = c
                    .peer_addr()
                    .map(|p| p.ip().to_string())
                    .unwrap_or_default();
                let _ = c.write_all(format!("{reply} {peer}").as_bytes());
            }
        });
    }
}

fn socket_v6_only(addr: &str) -> std::io::Result<TcpListener> {
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockType, SockaddrIn6, bind, listen, setsockopt, socket,
        sockopt,
    };
    use std::os::fd::AsRawFd;
    let SocketAddr::V6(v6) = addr.parse().unwrap() else {
        panic!("{addr} is not an IPv6 socket address")
    };
    let fd = socket(
        AddressFamily::Inet6,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    setsockopt(&fd, sockopt::Ipv6V6Only, &true)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    bind(fd.as_raw_fd(), &SockaddrIn6::from(v6))?;
    listen(&fd, Backlog::new(128)?)?;
    Ok(TcpListener::from(fd))
}

/// Connects from `ns` to `addr` ("ip:port" or "[ip6]:port") and returns
/// what the server said, or `None` if nothing answered within 4 s (long
/// enough for the SYN retransmitted at 3 s: a fresh bridge's IPv6
/// link-local address is tentative for about a second, and the node sends
/// no neighbour solicitation towards a pod until it is not).
pub fn tcp_get(ns: &NetNs, addr: &str) -> Option<String> {
    tcp_get_within(ns, addr, Duration::from_secs(4))
}

/// [`tcp_get`] with a shorter wait, for connections that must fail (a
/// dropped SYN is never answered): only a path that works in time can make
/// a "blocked" assertion fail.
pub fn tcp_blocked(ns: &NetNs, addr: &str) -> bool {
    tcp_get_within(ns, addr, Duration::from_millis(1500)).is_none()
}

pub fn tcp_get_within(ns: &NetNs, addr: &str, wait: Duration) -> Option<String> {
    let sa: SocketAddr = addr.parse().unwrap();
    let stream = ns
        .run(|| TcpStream::connect_timeout(&sa, wait))
        .unwrap()
        .ok()?;
    let mut stream = stream;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut s = String::new();
    stream.read_to_string(&mut s).ok()?;
    Some(s)
}

/// A UDP echo server in `ns` (IPv4, `port`): answers each datagram with
/// `reply`.
pub fn udp_server(ns: &NetNs, port: u16, reply: &str) {
    let s = ns
        .run(|| UdpSocket::bind(format!("0.0.0.0:{port}")).unwrap())
        .unwrap();
    let reply = reply.to_string();
    std::thread::spawn(move || {
        let mut buf = [0u8; 1500];
        while let Ok((_, from)) = s.recv_from(&mut buf) {
            let _ = s.send_to(reply.as_bytes(), from);
        }
    });
}

/// A UDP socket in `ns` bound to `local_port` (fixed, so conntrack sees the
/// same flow each time).
pub fn udp_client(ns: &NetNs, local_port: u16) -> UdpSocket {
    let s = ns
        .run(|| UdpSocket::bind(format!("0.0.0.0:{local_port}")).unwrap())
        .unwrap();
    s.set_read_timeout(Some(Duration::from_millis(700)))
        .unwrap();
    s
}

/// Sends one datagram and waits for an answer.
pub fn udp_ask(s: &UdpSocket, to: &str) -> Option<String> {
    s.send_to(b"hi", to).ok()?;
    let mut buf = [0u8; 1500];
    let (n, _) = s.recv_from(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

pub fn plugin_bin(name: &str) -> PathBuf {
    bin(name)
}

/// Each version: ADD of plugin 0, then of plugin 1 with its result, of the
/// chain `chain` makes; plugin 1 returns what `want` makes of plugin 0's
/// result. DEL of both.
pub fn chained_add_per_version(
    lan: &Lan,
    versions: &[&str],
    chain: impl Fn(&str) -> Chain,
    want: impl Fn(Value) -> Value,
) {
    for &version in versions {
        let c = chain(version);
        let pod = TestNs::new();
        let cid = format!("pod-{}", version.replace('.', "-"));
        let (first, second) = c.add_in_two(lan, &pod, &cid);
        assert_eq!(second, want(first), "{version}");
        c.del_pod(lan, &pod, &cid, &second);
    }
}

/// The VERSION answer of our plugin `name`.
pub fn version_of(name: &str) -> Value {
    Call::new(bin(name), "VERSION").run().ok()
}

/// Asserts that `checker`'s CHECK of what `adder` set up for `pod`'s eth0
/// passes.
pub fn assert_checks(
    lan: &Lan,
    checker: &Path,
    adder: &Path,
    pod: &TestNs,
    cid: &str,
    conf: &Value,
) {
    let out = lan.run(checker, "CHECK", pod, cid, conf);
    assert_eq!(
        out.code,
        0,
        "{} checking {}: {}",
        checker.display(),
        adder.display(),
        out.stdout
    );
}
