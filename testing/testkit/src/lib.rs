//! Test support: throwaway namespaces, running built plugin binaries the way
//! a runtime does, real packets, bounded waits ([`wait_for`] and its
//! kin) and leak checks. Dev-only.

pub mod chaos;
mod held;
pub mod killpoints;
pub mod parallel;
mod wait;

pub use held::HeldClient;
pub use wait::{NotReady, poll, wait_for, wait_for_async, wait_for_value, wait_while_running};

use rcni_netns::NetNs;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// Kernel tests need root; say so plainly instead of failing obscurely.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (network namespaces, netlink, BPF)"
    );
}

/// A name unique to this test process: `rcni-<pid>-<n>`.
pub fn unique_name(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "rcni-{}-{tag}{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// The names of the workspace's plugin binaries (the crates under
/// plugins/, ipam/ and meta/), sorted.
pub fn plugin_names() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut out = Vec::new();
    for d in ["plugins", "ipam", "meta"] {
        for e in std::fs::read_dir(root.join(d))
            .into_iter()
            .flatten()
            .flatten()
        {
            if e.path().join("Cargo.toml").is_file() {
                out.push(e.file_name().to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    assert!(out.contains(&"loopback".to_string()), "found {out:?}");
    out
}

/// `target/<profile>`, where cargo put the workspace's binaries.
pub fn bin_dir() -> PathBuf {
    if let Ok(d) = std::env::var("RCNI_BIN_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test-binary>
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps");
    dir.to_path_buf()
}

/// A built binary of this workspace; panics with a hint when it is missing.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.is_file(),
        "{} is missing: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

/// Where the reference plugins (Debian's containernetworking-plugins) live.
pub const REFERENCE_DIR: &str = "/usr/lib/cni";

pub fn reference_bin(name: &str) -> PathBuf {
    let p = Path::new(REFERENCE_DIR).join(name);
    assert!(
        p.is_file(),
        "{} is missing: apt-get install containernetworking-plugins",
        p.display()
    );
    p
}

/// Puts `RCNI_PROBE_DIR` (where the plugins keep the iptables probe's
/// answer; scripts/test points it under target/) back on a command whose
/// environment was cleared, so that its plugins leave nothing in the
/// host's /run.
pub fn keep_probe_dir(c: &mut Command) -> &mut Command {
    if let Some(d) = std::env::var_os("RCNI_PROBE_DIR") {
        c.env("RCNI_PROBE_DIR", d);
    }
    c
}

/// Where upstream's current release (v1.9.1) is looked for: `RCNI_REFERENCE_V191`
/// names a directory of its binaries or its release tarball; without it, the
/// tarball the project's own CI keeps beside the checkout. A user's clone has
/// neither, and the tests comparing against v1.9.1 then skip (see
/// [`reference_v191_bin`]).
pub const REFERENCE_V191_ENV: &str = "RCNI_REFERENCE_V191";

/// The v1.9.1 reference binary `name`, or `None` (with a line on stderr saying
/// why the caller skips) where no v1.9.1 release is at hand. A tarball is
/// unpacked once into `target/reference-v1.9.1/` (by rename, so tests racing to
/// unpack it see a whole directory or none).
pub fn reference_v191_bin(name: &str) -> Option<PathBuf> {
    let dir = reference_v191_dir();
    let p = dir.as_ref().map(|d| d.join(name));
    match p {
        Some(p) if p.is_file() => Some(p),
        _ => {
            eprintln!(
                "SKIP: no v1.9.1 reference `{name}`: set {REFERENCE_V191_ENV} to a directory \
                 of upstream's v1.9.1 binaries or to cni-plugins-linux-amd64-v1.9.1.tgz"
            );
            None
        }
    }
}

/// Where upstream's newest release (v1.10.0, testing/upstream's pin) is
/// looked for: `RCNI_REFERENCE_V110` names a directory of its binaries,
/// which `scripts/upstream-plugins` builds from the Go module (the test
/// command sets it from that script's output).
pub const REFERENCE_V110_ENV: &str = "RCNI_REFERENCE_V110";

/// The v1.10.0 binary `name`, or `None` (with a line on stderr saying why the
/// caller skips) where none is at hand.
pub fn reference_v110_bin(name: &str) -> Option<PathBuf> {
    let p = std::env::var_os(REFERENCE_V110_ENV).map(|d| PathBuf::from(d).join(name));
    match p {
        Some(p) if p.is_file() => Some(p),
        _ => {
            eprintln!(
                "SKIP: no v1.10.0 reference `{name}`: set {REFERENCE_V110_ENV} to the directory \
                 scripts/upstream-plugins prints"
            );
            None
        }
    }
}

fn reference_v191_dir() -> Option<PathBuf> {
    let src = match std::env::var_os(REFERENCE_V191_ENV) {
        Some(v) => PathBuf::from(v),
        None => Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/reference/cni-plugins-v1.9.1.tgz"),
    };
    if src.is_dir() {
        return Some(src);
    }
    if !src.is_file() {
        return None;
    }
    let out = bin_dir()
        .parent()
        .unwrap_or(Path::new("/tmp"))
        .join("reference-v1.9.1");
    if out.join("bridge").is_file() {
        return Some(out);
    }
    let parent = out.parent()?;
    let tmp = tempfile::Builder::new()
        .prefix(".reference-v1.9.1.")
        .tempdir_in(parent)
        .ok()?;
    let ok = Command::new("tar")
        .arg("-C")
        .arg(tmp.path())
        .arg("-xzf")
        .arg(&src)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        return None;
    }
    let tmp = tmp.keep();
    // Another test may have unpacked it first: its directory stands.
    if std::fs::rename(&tmp, &out).is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    out.join("bridge").is_file().then_some(out)
}

/// A namespace held only by this process: the kernel frees it when the test
/// ends, however it ends, so nothing can leak.
pub struct TestNs {
    pub ns: NetNs,
}

impl TestNs {
    pub fn new() -> TestNs {
        require_root();
        own_mounts();
        TestNs {
            ns: NetNs::new_anonymous().expect("create a network namespace"),
        }
    }

    /// A path other processes (plugins) can open while this lives.
    pub fn path(&self) -> String {
        self.ns.proc_path().display().to_string()
    }

    /// Runs a command inside this namespace (network namespace only: the
    /// mount namespace and /sys stay the host's, as for a runtime).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        command_in(&self.ns, program)
    }
}

impl Default for TestNs {
    fn default() -> Self {
        Self::new()
    }
}

/// Switches the current thread into a namespace and back on drop (most
/// tests want [`NetNs::run`] or a [`TestNs`] command instead, which leave
/// the test's thread alone).
///
/// `!Send`, so it cannot migrate to another thread; never hold it across an
/// `.await`.
///
/// ```compile_fail
/// fn assert_send<T: Send>() {}
/// assert_send::<rcni_testkit::NsGuard>();
/// ```
#[derive(Debug)]
pub struct NsGuard {
    previous: NetNs,
    _not_send: std::marker::PhantomData<*const ()>,
}

/// Enters `ns` on the current thread until the returned guard is dropped.
pub fn enter(ns: &NetNs) -> NsGuard {
    use std::os::fd::AsFd;
    let previous = NetNs::current().expect("open the current network namespace");
    nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
        .expect("enter the network namespace");
    NsGuard {
        previous,
        _not_send: std::marker::PhantomData,
    }
}

impl Drop for NsGuard {
    fn drop(&mut self) {
        use std::os::fd::AsFd;
        if let Err(e) =
            nix::sched::setns(self.previous.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
        {
            // A thread stuck in the wrong namespace would silently act on the
            // wrong network (the next test on it could touch the host's);
            // stopping is the only safe option.
            eprintln!("rcni-testkit: cannot restore network namespace: {e}");
            std::process::abort();
        }
    }
}

/// `program` set up to run inside `ns`.
pub fn command_in(ns: &NetNs, program: impl AsRef<std::ffi::OsStr>) -> Command {
    ns.command(program)
}

/// `program` run inside `ns` as a child of a test or bench (a server, a
/// traffic generator) that the kernel SIGKILLs when the thread that started
/// it ends (`setpriv --pdeathsig`). A test or bench killed by a signal
/// (nextest's timeout, ^C, SIGTERM) runs no Drop guard, and a child left
/// running would keep its namespace, and everything in it, alive.
pub fn tied_command_in(ns: &NetNs, program: impl AsRef<std::ffi::OsStr>) -> Command {
    tie(ns.command("setpriv"), program)
}

/// [`tied_command_in`] for a program that enters its namespaces itself
/// (`nsenter`, `unshare`). Its exec chain must not fork: the signal is the
/// process's, kept across exec.
pub fn tied_command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    tie(Command::new("setpriv"), program)
}

/// [`tied_command_in`] for a program that clears the parent-death signal
/// (dnsmasq does when it sets its credentials) or forks: it runs in a PID
/// namespace of its own under a shell as init, which keeps the signal
/// (`unshare --kill-child`); when that init dies the kernel kills every
/// process in the namespace. Killing the returned child stops them all.
pub fn tied_tree_command_in(ns: &NetNs, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = tied_command_in(ns, "unshare");
    // Not `exec`: the shell must stay the namespace's init.
    c.args(["--pid", "--fork", "--kill-child=KILL", "--"])
        .args(["sh", "-c", "\"$@\"; exit $?", "sh"])
        .arg(program);
    c
}

fn tie(mut setpriv: Command, program: impl AsRef<std::ffi::OsStr>) -> Command {
    setpriv.args(["--pdeathsig", "KILL", "--"]).arg(program);
    setpriv
}

/// An iperf3 server in a namespace ([`tied_command_in`]), listening when
/// [`IperfServer::start`] returns, stopped on drop.
pub struct IperfServer(std::process::Child);

impl IperfServer {
    /// Serves on `port`, bound to `addr` when given.
    pub fn start(ns: &NetNs, addr: Option<&str>, port: u16) -> IperfServer {
        let port_s = port.to_string();
        let mut cmd = tied_command_in(ns, "iperf3");
        cmd.args(["-s", "-p", &port_s]);
        if let Some(a) = addr {
            cmd.args(["-B", a]);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("iperf3 (apt-get install iperf3)");
        let server = IperfServer(child);
        // Listening, as ss sees it: a probe connection would count as a test
        // the server may still be busy with when the real one comes ("the
        // server is busy running a test"), under load.
        let filter = format!("sport = :{port}");
        for _ in 0..250 {
            let out = ns.command("ss").args(["-Hltn", &filter]).output().unwrap();
            if !out.stdout.is_empty() {
                return server;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        panic!("iperf3 server on port {port} never listened");
    }
}

impl Drop for IperfServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A pin root of a test's or bench's own on a temporary directory:
/// [`Bpffs::mount`] mounts a bpffs there, [`Bpffs::empty`] leaves that to
/// the plugin (which mounts one where none is). Unmounted (pins and links
/// go with it) and removed on drop.
pub struct Bpffs(tempfile::TempDir);

impl Bpffs {
    /// An empty directory; the plugin under test mounts the bpffs.
    pub fn empty() -> Bpffs {
        own_mounts();
        Bpffs(
            tempfile::Builder::new()
                .prefix("rcni-bpffs-")
                .tempdir()
                .unwrap(),
        )
    }

    /// A bpffs mounted on a fresh directory.
    pub fn mount() -> Bpffs {
        let b = Bpffs::empty();
        nix::mount::mount(
            Some("bpf"),
            b.path(),
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .unwrap_or_else(|e| panic!("mount bpffs on {}: {e}", b.path().display()));
        b
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }

    pub fn root(&self) -> String {
        self.path().display().to_string()
    }

    /// Every file below the mount, relative to it.
    pub fn files(&self) -> std::collections::BTreeSet<String> {
        fn walk(root: &Path, d: &Path, out: &mut std::collections::BTreeSet<String>) {
            for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
                let p = e.path();
                if p.is_dir() {
                    walk(root, &p, out);
                } else {
                    out.insert(p.strip_prefix(root).unwrap().display().to_string());
                }
            }
        }
        let mut out = std::collections::BTreeSet::new();
        walk(self.path(), self.path(), &mut out);
        out
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        // A plugin may have stacked a bpffs of its own on ours: detached
        // unmounts until nothing is mounted there (EINVAL).
        for _ in 0..4 {
            if nix::mount::umount2(self.path(), nix::mount::MntFlags::MNT_DETACH).is_err() {
                break;
            }
        }
    }
}

/// Gives this process a mount namespace of its own, every mount private:
/// a bench killed by a signal runs no Drop guard, and the bpffs it mounted
/// would stay on the machine; in its own namespace its mounts go with its
/// last process. It moves the calling thread (and the threads and children
/// it starts afterwards): call it first in `main`, before any child or
/// thread that should share the bench's mounts.
/// [`private_mounts`] once per process, from the first test helper that
/// makes something a killed test would leave (a namespace, a bind mount, a
/// bpffs): the test's thread, whose children and later threads follow it.
/// A test killed by nextest's timeout then leaves no mount behind.
fn own_mounts() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(private_mounts);
}

pub fn private_mounts() {
    use nix::mount::{MsFlags, mount};
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)
        .unwrap_or_else(|e| panic!("unshare the mount namespace: {e}"));
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .unwrap_or_else(|e| panic!("make mounts private: {e}"));
}

/// The names of the files in `dir`, sorted; none when it does not exist.
pub fn file_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Runs `cmd`, which must succeed (its stderr is the failure message), and
/// returns its stdout.
pub fn stdout_of(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A named namespace at a path of its own (for tests that delete the
/// namespace under a plugin); removed on drop.
pub struct PersistentNs {
    pub path: PathBuf,
    _dir: tempfile::TempDir,
}

impl PersistentNs {
    pub fn new() -> PersistentNs {
        require_root();
        own_mounts();
        let dir = tempfile::Builder::new()
            .prefix("rcni-ns-")
            .tempdir()
            .expect("tempdir");
        let path = dir.path().join("ns");
        rcni_netns::create_at(&path).expect("create persistent namespace");
        PersistentNs { path, _dir: dir }
    }

    pub fn delete(&self) {
        rcni_netns::delete_at(&self.path).expect("delete namespace");
    }
}

impl Default for PersistentNs {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for PersistentNs {
    fn drop(&mut self) {
        let _ = rcni_netns::delete_at(&self.path);
    }
}

/// What a plugin run printed.
#[derive(Debug)]
pub struct Output {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// Asserts success and returns stdout as JSON (Null when empty).
    pub fn ok(&self) -> Value {
        assert_eq!(
            self.code, 0,
            "plugin failed: stdout {} stderr {}",
            self.stdout, self.stderr
        );
        if self.stdout.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&self.stdout)
                .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", self.stdout))
        }
    }

    /// Asserts failure with an error JSON and returns (code, msg).
    pub fn err(&self) -> (u64, String) {
        assert_ne!(
            self.code, 0,
            "plugin unexpectedly succeeded: {}",
            self.stdout
        );
        let v: Value = serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "error is not JSON on stdout ({e}): {:?} stderr {}",
                self.stdout, self.stderr
            )
        });
        (
            v["code"].as_u64().expect("code"),
            v["msg"].as_str().unwrap_or_default().to_string(),
        )
    }
}

/// Runs `plugin` in-process through the skel, as its binary would:
/// `CNI_COMMAND=cmd` for container `cid` on eth0, in a namespace path that
/// is never opened. Returns the exit code and stdout as JSON (Null when
/// empty).
pub fn dispatch<P: rcni_cni::Plugin>(
    plugin: &P,
    cmd: &str,
    cid: &str,
    stdin: &Value,
) -> (i32, Value) {
    let env = |k: &str| -> Option<String> {
        Some(
            match k {
                "CNI_COMMAND" => cmd,
                "CNI_CONTAINERID" => cid,
                "CNI_IFNAME" => "eth0",
                "CNI_NETNS" => "/run/rcni-unit-test/netns-never-opened",
                "CNI_PATH" => "/nonexistent",
                _ => return None,
            }
            .to_string(),
        )
    };
    let input = serde_json::to_vec(stdin).unwrap();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = rcni_cni::skel::dispatch(plugin, &env, &mut input.as_slice(), &mut out, &mut err);
    let v = if out.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&out).unwrap()
    };
    (code, v)
}

impl From<std::process::Output> for Output {
    /// The exit code (-1 when killed by a signal) and the text printed.
    fn from(out: std::process::Output) -> Output {
        Output {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

/// One plugin invocation with the `CNI_*` protocol variables.
#[derive(Clone)]
pub struct Call {
    pub bin: PathBuf,
    pub env: Vec<(String, String)>,
    pub stdin: Vec<u8>,
}

impl Call {
    /// `command` with a container ID, ifname eth0 and CNI_PATH of our bin
    /// dir; netns unset.
    pub fn new(bin: impl Into<PathBuf>, command: &str) -> Call {
        Call {
            bin: bin.into(),
            env: vec![
                ("CNI_COMMAND".into(), command.into()),
                ("CNI_CONTAINERID".into(), "rcni-test-container".into()),
                ("CNI_IFNAME".into(), "eth0".into()),
                ("CNI_PATH".into(), bin_dir().display().to_string()),
            ],
            stdin: Vec::new(),
        }
    }

    pub fn env(mut self, k: &str, v: &str) -> Call {
        self.env.retain(|(key, _)| key != k);
        self.env.push((k.into(), v.into()));
        self
    }

    pub fn without(mut self, k: &str) -> Call {
        self.env.retain(|(key, _)| key != k);
        self
    }

    pub fn netns(self, path: &str) -> Call {
        self.env("CNI_NETNS", path)
    }

    pub fn stdin(mut self, v: &Value) -> Call {
        self.stdin = serde_json::to_vec(v).expect("serialize");
        self
    }

    pub fn stdin_raw(mut self, b: &[u8]) -> Call {
        self.stdin = b.to_vec();
        self
    }

    /// Runs the plugin in this process's namespace.
    pub fn run(&self) -> Output {
        self.run_cmd(Command::new(&self.bin))
    }

    /// Runs the plugin from inside `host` (a test's node namespace).
    pub fn run_in(&self, host: &NetNs) -> Output {
        self.run_cmd(command_in(host, &self.bin))
    }

    /// Starts the plugin from inside `host` with its stdin written and
    /// closed, and returns at once: for tests that kill it midway. Its
    /// output is discarded.
    pub fn spawn_in(&self, host: &NetNs) -> std::process::Child {
        let mut cmd = command_in(host, &self.bin);
        self.prepare(&mut cmd);
        cmd.stdout(Stdio::null()).stderr(Stdio::null());
        self.start(cmd)
    }

    /// The plugin as a command to run from inside `host`, with the
    /// protocol variables set and its stdin: for
    /// [`killpoints::run_killed_at`].
    pub fn command_in(&self, host: &NetNs) -> (Command, Vec<u8>) {
        let mut cmd = command_in(host, &self.bin);
        self.prepare(&mut cmd);
        (cmd, self.stdin.clone())
    }

    /// The protocol variables we set and only those: a CNI_* leaking in
    /// from the caller's environment must not change what the test means.
    fn prepare(&self, cmd: &mut Command) {
        for (k, _) in std::env::vars() {
            if k.starts_with("CNI_") {
                cmd.env_remove(k);
            }
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
    }

    fn start(&self, mut cmd: Command) -> std::process::Child {
        cmd.stdin(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.bin.display()));
        {
            use std::io::Write;
            let mut stdin = child.stdin.take().expect("piped");
            let _ = stdin.write_all(&self.stdin);
        }
        child
    }

    fn run_cmd(&self, mut cmd: Command) -> Output {
        self.prepare(&mut cmd);
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        self.start(cmd)
            .wait_with_output()
            .expect("wait for plugin")
            .into()
    }
}

/// `ip ARGS` inside `ns` (a test's own topology: links the plugins then
/// use); panics with ip's message on failure.
pub fn ip(ns: &NetNs, args: &str) {
    let out = command_in(ns, "ip")
        .args(args.split_whitespace())
        .output()
        .expect("run ip");
    assert!(
        out.status.success(),
        "ip {args}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One ICMP echo from inside `ns` to `dst`; true if answered.
pub fn ping(ns: &NetNs, dst: &str) -> bool {
    command_in(ns, "ping")
        .args(["-c", "1", "-W", "2", "-n", "-q", dst])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// A TCP server in `ns` on `addr` (a port the kernel picks) for the rest of
/// the process: every connection is handed to `serve` on a thread of its
/// own. Returns the server's address.
pub fn tcp_server<F>(ns: &NetNs, addr: std::net::IpAddr, serve: F) -> std::net::SocketAddr
where
    F: Fn(std::net::TcpStream) + Send + Clone + 'static,
{
    let l = ns
        .run(move || std::net::TcpListener::bind((addr, 0)))
        .unwrap()
        .unwrap();
    let local = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { return };
            let serve = serve.clone();
            std::thread::spawn(move || serve(s));
        }
    });
    local
}

/// Asserts that nothing this test process named (`rcni-<pid>-*`) is left in
/// the root namespace: links or /run/netns entries.
pub fn assert_no_leaks() {
    let prefix = format!("rcni-{}-", std::process::id());
    let netns: Vec<String> = rcni_netns::list_named()
        .unwrap_or_default()
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .collect();
    assert!(netns.is_empty(), "leaked network namespaces: {netns:?}");
    let out = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .expect("ip link");
    let links: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&prefix))
        .map(String::from)
        .collect();
    assert!(
        links.is_empty(),
        "leaked links in the root namespace: {links:?}"
    );
}

/// The result of `v` re-read through our parser, so results of different
/// versions and plugins compare by content.
pub fn normalize_result(v: &Value, version: &str) -> rcni_cni::CniResult {
    rcni_cni::CniResult::from_value(v, version)
        .unwrap_or_else(|e| panic!("not a result ({e}): {v}"))
}

/// [`normalize_result`] with what differs between two otherwise identical
/// runs cleared: MACs, sandbox paths, random veth names.
pub fn normalized_result(v: &Value, version: &str) -> rcni_cni::CniResult {
    let mut r = normalize_result(v, version);
    for i in &mut r.interfaces {
        i.mac.clear();
        i.sandbox.clear();
        i.name = blank_veth(&i.name);
    }
    r
}

/// `veth1a2b3c4d@if7:` -> `veth@if:`: a random host veth name and a peer's
/// interface index, which differ between otherwise identical runs.
pub fn blank_veth(w: &str) -> String {
    let mut w = w.to_string();
    if let Some(i) = w.find("veth") {
        let hex = w[i + 4..].bytes().take_while(u8::is_ascii_hexdigit).count();
        if hex == 8 {
            w.replace_range(i + 4..i + 12, "");
        }
    }
    if let Some(i) = w.find("@if") {
        let n = w[i + 3..].bytes().take_while(u8::is_ascii_digit).count();
        w.replace_range(i + 3..i + 3 + n, "");
    }
    w
}

/// `0a:58:0a:00:00:02` and the like.
pub fn is_mac(w: &str) -> bool {
    w.len() == 17 && w.split(':').count() == 6 && w.split(':').all(|p| p.len() == 2)
}

/// The addresses of a result's `ips`, without their prefix length.
pub fn result_ips(result: &Value) -> Vec<String> {
    result["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| i["address"].as_str())
        .map(|a| a.split('/').next().unwrap_or(a).to_string())
        .collect()
}

/// host-local's reservations (address files) in a network's data directory:
/// what a DEL must have released. Its lock, the round-robin cursors
/// (`last_reserved_ip.N`) and our `.rcni-*` files (the owner index, the
/// cursors' spares) are state, not reservations. A killed writer's
/// temporary file counts: the next command must have swept it.
pub fn reservations(net_dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(net_dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| {
                    n != "lock" && !n.starts_with("last_reserved_ip.") && !n.starts_with(".rcni-")
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// `comm(pid)` of every process in the network namespaces whose inode
/// numbers are `inodes`, sorted: what a soak counts at its start and end.
pub fn processes_in(inodes: &[u64]) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(m) = std::fs::metadata(format!("/proc/{pid}/ns/net")) else {
            continue;
        };
        if inodes.contains(&m.ino()) {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            out.push(format!("{}({pid})", comm.trim()));
        }
    }
    out.sort();
    out
}

/// The Python that has the test tools scripts/setup installs (moto for
/// the cloud tests): its venv (`RCNI_VENV`, else
/// `$XDG_DATA_HOME/rcni/venv` or `~/.local/share/rcni/venv`, as
/// scripts/setup makes it), when that has `module`; else the first
/// `python3` on PATH that has it. `None` when none does: the caller skips
/// and says to run scripts/setup --for test.
pub fn python_with(module: &str) -> Option<PathBuf> {
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    let data = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(&home).join(".local/share"));
    let venv = std::env::var_os("RCNI_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| data.join("rcni/venv"));
    let has = |py: &Path| {
        std::process::Command::new(py)
            .args(["-c", &format!("import {module}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let candidates = [venv.join("bin/python3"), PathBuf::from("python3")];
    candidates.into_iter().find(|p| has(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blanks_what_differs_between_runs() {
        assert_eq!(blank_veth("veth1a2b3c4d@if7:"), "veth@if:");
        assert_eq!(blank_veth("veth1a2b3c4d"), "veth");
        assert_eq!(blank_veth("eth0@if12"), "eth0@if");
        assert_eq!(blank_veth("vethernet"), "vethernet");
        assert!(is_mac("0a:58:0a:00:00:02"));
        assert!(!is_mac("fd24::1/128"));
    }

    #[test]
    fn ips_of_a_result() {
        let r = serde_json::json!({"ips": [{"address": "10.1.0.2/24"}, {"address": "fd00::2/64"}]});
        assert_eq!(result_ips(&r), ["10.1.0.2", "fd00::2"]);
        assert!(result_ips(&Value::Null).is_empty());
    }

    #[test]
    fn reservations_leave_out_host_locals_own_state() {
        let d = tempfile::tempdir().unwrap();
        for f in [
            "lock",
            "last_reserved_ip.0",
            ".rcni-owners",
            ".rcni-spare.last_reserved_ip.0",
            "10.1.0.2",
            "10.1.0.3",
            ".10.1.0.4.77.0.rcni-tmp",
        ] {
            std::fs::write(d.path().join(f), "").unwrap();
        }
        assert_eq!(
            reservations(d.path()),
            [".10.1.0.4.77.0.rcni-tmp", "10.1.0.2", "10.1.0.3"]
        );
        assert!(reservations(&d.path().join("none")).is_empty());
    }
}
