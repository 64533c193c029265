//! Running plugin binaries: the runtime side (cnitool) and delegation (a
//! main plugin running its IPAM plugin from CNI_PATH with the same stdin).

use crate::error::{CniError, ErrorCode};
use crate::types::CniResult;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Splits a `CNI_PATH`-style list.
pub fn split_path(list: &str) -> Vec<PathBuf> {
    list.split(':')
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .collect()
}

/// A plugin type names a file in CNI_PATH, never a path: `/`, `.` and
/// `..` would lead out of it (CVE-2021-20206 in libcni). Code 7.
pub fn validate_plugin_name(name: &str) -> Result<(), CniError> {
    if name.is_empty() || name.contains('/') || name.contains('\\') || name == "." || name == ".." {
        return Err(CniError::config(format!("invalid plugin name: {name:?}")));
    }
    Ok(())
}

/// Finds plugin `name` in the directories of `path`, first match wins.
pub fn find_in_path(name: &str, path: &[PathBuf]) -> Result<PathBuf, CniError> {
    validate_plugin_name(name)?;
    if path.is_empty() {
        return Err(CniError::new(
            ErrorCode::DelegateNotFound,
            "no paths provided (CNI_PATH is empty)",
        ));
    }
    for dir in path {
        let p = dir.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    let dirs: Vec<String> = path.iter().map(|p| p.display().to_string()).collect();
    Err(CniError::new(
        ErrorCode::DelegateNotFound,
        format!(
            "failed to find plugin {name:?} in path [{}]",
            dirs.join(" ")
        ),
    ))
}

/// What a plugin run produced.
#[derive(Debug)]
pub struct Output {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Runs `plugin` with `stdin` and the current environment plus `env`
/// (later entries win). Success is exit 0; otherwise the CNI error from
/// stdout, or one built from stderr when stdout holds none, as libcni does.
/// `stderr` from a successful run is returned for the caller to forward.
pub fn exec_plugin(
    plugin: &Path,
    stdin: &[u8],
    env: &[(String, String)],
) -> Result<Output, CniError> {
    let mut attempt = 0;
    loop {
        let mut cmd = Command::new(plugin);
        cmd.envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = match cmd.spawn() {
            // ETXTBSY: the binary is being written (an upgrade in progress); libcni
            // retries for up to five seconds.
            Err(e) if e.raw_os_error() == Some(26) && attempt < 5 => {
                attempt += 1;
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
            Err(e) => {
                return Err(CniError::new(
                    ErrorCode::DelegateFailed,
                    format!("failed to run plugin {}: {e}", plugin.display()),
                ));
            }
            Ok(c) => c,
        };
        let mut child_stdin = child.stdin.take().expect("stdin is piped");
        let input = stdin.to_vec();
        // Written from a thread: a plugin that prints before it has read all of
        // stdin would otherwise deadlock against us.
        let writer = std::thread::spawn(move || {
            let _ = child_stdin.write_all(&input);
        });
        let out = child.wait_with_output().map_err(|e| {
            CniError::new(
                ErrorCode::IoFailure,
                format!("waiting for {}: {e}", plugin.display()),
            )
        })?;
        let _ = writer.join();
        if out.status.success() {
            return Ok(Output {
                stdout: out.stdout,
                stderr: out.stderr,
            });
        }
        return Err(plugin_error(
            &out.stdout,
            &out.stderr,
            &exit_text(out.status),
        ));
    }
}

/// The error a failed plugin reported. `exit` is how it ended, as Go's
/// `ProcessState.String` says it ([`exit_text`]): libcni (cni v1.3.1)
/// appends it when the plugin printed nothing on stdout, and a runtime or
/// a log scraper comparing texts with a Go delegating plugin sees the same.
pub fn plugin_error(stdout: &[u8], stderr: &[u8], exit: &str) -> CniError {
    let text = String::from_utf8_lossy(stdout);
    if !text.trim().is_empty() {
        return match serde_json::from_slice::<CniError>(stdout) {
            Ok(e) => e,
            Err(err) => CniError::new(
                ErrorCode::DecodingFailure,
                format!(
                    "netplugin failed but error parsing its diagnostic message {:?}: {err}",
                    text.trim()
                ),
            ),
        };
    }
    let msg = if stderr.is_empty() {
        format!("netplugin failed with no error message: {exit}")
    } else {
        format!("netplugin failed: {}: {exit}", go_quote(stderr))
    };
    CniError::new(ErrorCode::DelegateFailed, msg)
}

/// Go's `ProcessState.String()`: `exit status N`, or `signal: <name>` for a
/// plugin killed by a signal, ` (core dumped)` appended when it dumped core.
pub fn exit_text(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    let mut s = match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(sig)) => format!("signal: {}", go_signal_name(sig)),
        (None, None) => format!("{status}"),
    };
    if status.core_dumped() {
        s.push_str(" (core dumped)");
    }
    s
}

/// The names Go's `syscall.Signal.String` gives the signals a plugin
/// plausibly dies of; others as Go prints a signal it has no name for.
fn go_signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "hangup",
        libc::SIGINT => "interrupt",
        libc::SIGQUIT => "quit",
        libc::SIGILL => "illegal instruction",
        libc::SIGTRAP => "trace/breakpoint trap",
        libc::SIGABRT => "aborted",
        libc::SIGBUS => "bus error",
        libc::SIGFPE => "floating point exception",
        libc::SIGKILL => "killed",
        libc::SIGUSR1 => "user defined signal 1",
        libc::SIGSEGV => "segmentation fault",
        libc::SIGUSR2 => "user defined signal 2",
        libc::SIGPIPE => "broken pipe",
        libc::SIGALRM => "alarm clock",
        libc::SIGTERM => "terminated",
        libc::SIGXCPU => "CPU time limit exceeded",
        libc::SIGXFSZ => "file size limit exceeded",
        libc::SIGSYS => "bad system call",
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}

/// `bytes` as Go's `%q` prints a string: double-quoted, the usual
/// backslash escapes, `\xNN` for other control bytes and for bytes that
/// are not UTF-8. (Rust's `{:?}` writes `\u{1}` where Go writes `\x01`.)
fn go_quote(bytes: &[u8]) -> String {
    let mut out = String::from("\"");
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\x07' => out.push_str("\\a"),
                '\x08' => out.push_str("\\b"),
                '\x0c' => out.push_str("\\f"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\x0b' => out.push_str("\\v"),
                '\\' => out.push_str("\\\\"),
                '"' => out.push_str("\\\""),
                c if (c as u32) < 0x20 || c == '\x7f' => {
                    out.push_str(&format!("\\x{:02x}", c as u32));
                }
                c => out.push(c),
            }
        }
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out.push('"');
    out
}

/// Delegation: runs IPAM (or any) plugin `name` found in `path` with the
/// full network config on stdin and this process's `CNI_*` environment,
/// `CNI_COMMAND` set to `command`. Its stderr is forwarded to ours.
pub fn delegate(
    name: &str,
    command: &str,
    stdin: &[u8],
    path: &[PathBuf],
) -> Result<Vec<u8>, CniError> {
    let plugin = find_in_path(name, path)?;
    let out = exec_plugin(&plugin, stdin, &[("CNI_COMMAND".into(), command.into())]);
    match out {
        Ok(o) => {
            let _ = std::io::stderr().write_all(&o.stderr);
            Ok(o.stdout)
        }
        Err(e) => Err(e),
    }
}

/// Delegated ADD, with the result parsed (IPAM results carry no interfaces).
pub fn delegate_add(
    name: &str,
    stdin: &[u8],
    path: &[PathBuf],
    cni_version: &str,
) -> Result<CniResult, CniError> {
    let out = delegate(name, "ADD", stdin, path)?;
    CniResult::from_slice(&out, cni_version)
        .map_err(|e| e.context(format!("delegated plugin {name:?}")))
}

/// A delegated ADD running on its own thread, so that the IPAM plugin's
/// process start and work overlap the caller's netlink work: most of a main
/// plugin's ADD is waiting on one or the other. Unless [`PendingAdd::commit`]
/// is reached, dropping it (an early return, a panic) waits for the ADD and
/// undoes it with DEL: a process that exited without joining would leave the
/// delegate's reservation behind.
pub struct PendingAdd {
    delegate: Arc<Delegate>,
    state: AddState,
    added: bool,
    committed: bool,
}

/// What a pending call needs, shared with the thread running it.
struct Delegate {
    name: String,
    stdin: Vec<u8>,
    path: Vec<PathBuf>,
}

impl Delegate {
    fn new(name: &str, stdin: &[u8], path: &[PathBuf]) -> Arc<Delegate> {
        Arc::new(Delegate {
            name: name.to_string(),
            stdin: stdin.to_vec(),
            path: path.to_vec(),
        })
    }

    fn add(&self, cni_version: &str) -> Result<CniResult, CniError> {
        delegate_add(&self.name, &self.stdin, &self.path, cni_version)
    }

    fn cmd(&self, command: &str) -> Result<(), CniError> {
        delegate_cmd(&self.name, command, &self.stdin, &self.path)
    }
}

enum AddState {
    Running(JoinHandle<Result<CniResult, CniError>>),
    /// Runs at [`PendingAdd::wait`], after the caller's link work.
    Deferred(String),
    Taken,
}

/// IPAM plugins that never touch the container's interface, so they may run
/// alongside the link work. Any other (dhcp acquires and releases on the
/// interface itself; a third-party plugin may expect it) keeps the
/// reference's order: ADD after the link exists, DEL before it goes.
pub fn runs_beside_links(ipam: &str) -> bool {
    matches!(ipam, "host-local" | "static")
}

impl PendingAdd {
    pub fn start(name: &str, stdin: &[u8], path: &[PathBuf], cni_version: &str) -> PendingAdd {
        let delegate = Delegate::new(name, stdin, path);
        let state = if runs_beside_links(name) {
            let (d, v) = (Arc::clone(&delegate), cni_version.to_string());
            AddState::Running(std::thread::spawn(move || d.add(&v)))
        } else {
            AddState::Deferred(cni_version.to_string())
        };
        PendingAdd {
            delegate,
            state,
            added: false,
            committed: false,
        }
    }

    /// The delegate's result (once; later calls are an internal error).
    pub fn wait(&mut self) -> Result<CniResult, CniError> {
        let name = &self.delegate.name;
        let r = match std::mem::replace(&mut self.state, AddState::Taken) {
            AddState::Running(h) => h.join().unwrap_or_else(|_| {
                Err(CniError::internal(format!(
                    "delegated ADD of {name:?} panicked"
                )))
            }),
            AddState::Deferred(version) => self.delegate.add(&version),
            AddState::Taken => {
                return Err(CniError::internal(format!(
                    "delegated ADD of {name:?} already taken"
                )));
            }
        };
        self.added = r.is_ok();
        r
    }

    /// [`PendingAdd::wait`] that, for a delegate not [`runs_beside_links`],
    /// puts its DEL on `undo`: a failed ADD then releases before the links
    /// pushed earlier go, as the reference's deferred `ipam.ExecDel` (dhcp
    /// sends its DHCPRELEASE on the container's interface; without it the
    /// server keeps the lease until it expires). host-local and static keep
    /// releasing after the links, which then no longer hold the addresses.
    pub fn wait_into(
        &mut self,
        undo: &mut crate::rollback::Rollback<'_>,
    ) -> Result<CniResult, CniError> {
        let r = self.wait()?;
        if !runs_beside_links(&self.delegate.name) {
            self.added = false;
            let d = Arc::clone(&self.delegate);
            undo.push(format!("IPAM {}", d.name), move || d.cmd("DEL"));
        }
        Ok(r)
    }

    /// The attachment succeeded: keep what the delegate allocated.
    pub fn commit(mut self) {
        self.committed = true;
    }
}

impl Drop for PendingAdd {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        // A deferred ADD that never ran has nothing to undo.
        if matches!(self.state, AddState::Running(_)) {
            let _ = self.wait();
        }
        // A failed ADD gets no DEL, as in the reference: its error may be
        // "already allocated" for an attachment that owns the address.
        if self.added
            && let Err(e) = self.delegate.cmd("DEL")
        {
            // stderr is the runtime's log; stdout carries the error JSON.
            eprintln!("rcni: undo IPAM {}: {e}", self.delegate.name);
        }
    }
}

/// A delegated DEL/CHECK/STATUS/GC (see [`PendingAdd`]): for IPAM that
/// [`runs_beside_links`], on its own thread, so DEL's release of addresses
/// overlaps the kernel's slow link removal; for any other, run at once,
/// before the caller removes links.
pub enum PendingCmd {
    Running(JoinHandle<Result<(), CniError>>),
    Done(Result<(), CniError>),
}

impl PendingCmd {
    pub fn start(name: &str, command: &str, stdin: &[u8], path: &[PathBuf]) -> PendingCmd {
        if !runs_beside_links(name) {
            return PendingCmd::Done(delegate_cmd(name, command, stdin, path));
        }
        let (d, c) = (Delegate::new(name, stdin, path), command.to_string());
        PendingCmd::Running(std::thread::spawn(move || d.cmd(&c)))
    }

    pub fn wait(self) -> Result<(), CniError> {
        match self {
            PendingCmd::Running(h) => h
                .join()
                .unwrap_or_else(|_| Err(CniError::internal("delegated command panicked"))),
            PendingCmd::Done(r) => r,
        }
    }
}

/// Delegated DEL/CHECK/STATUS/GC: success or the delegate's error.
pub fn delegate_cmd(
    name: &str,
    command: &str,
    stdin: &[u8],
    path: &[PathBuf],
) -> Result<(), CniError> {
    delegate(name, command, stdin, path).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_from_output() {
        let e = plugin_error(
            br#"{"code":7,"msg":"bad","details":"d"}"#,
            b"",
            "exit status 1",
        );
        assert_eq!(
            (e.code, e.msg.as_str(), e.details.as_str()),
            (7, "bad", "d")
        );
        // cni v1.3.1's texts, stderr quoted whole as Go's %q does.
        let e = plugin_error(b"", b"panic: boom\n", "exit status 2");
        assert_eq!(e.code, 102);
        assert_eq!(e.msg, r#"netplugin failed: "panic: boom\n": exit status 2"#);
        let e = plugin_error(b"", b"", "signal: killed");
        assert_eq!(
            e.msg,
            "netplugin failed with no error message: signal: killed"
        );
        let e = plugin_error(b"not json", b"", "exit status 1");
        assert_eq!(e.code, 6);
    }

    #[test]
    fn exit_and_stderr_as_go_prints_them() {
        use std::os::unix::process::ExitStatusExt;
        use std::process::ExitStatus;
        assert_eq!(exit_text(ExitStatus::from_raw(3 << 8)), "exit status 3");
        assert_eq!(exit_text(ExitStatus::from_raw(9)), "signal: killed");
        assert_eq!(
            exit_text(ExitStatus::from_raw(libc::SIGSEGV | 0x80)),
            "signal: segmentation fault (core dumped)"
        );
        assert_eq!(exit_text(ExitStatus::from_raw(40)), "signal: signal 40");
        assert_eq!(
            go_quote(b"a\"b\\c\t\x01\x7f\xff\xc3\xa9\n"),
            r#""a\"b\\c\t\x01\x7f\xffé\n""#
        );
    }

    #[test]
    fn path_lookup() {
        assert_eq!(
            split_path("/a::/b"),
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        let e = find_in_path(
            "nope-not-here",
            &split_path("/nonexistent/x:/nonexistent/y"),
        )
        .unwrap_err();
        assert_eq!(e.code, 101);
        assert!(e.msg.contains("/nonexistent/x /nonexistent/y"), "{}", e.msg);
        assert_eq!(
            find_in_path("../sh", &split_path("/bin")).unwrap_err().code,
            7
        );
        assert_eq!(find_in_path("sh", &[]).unwrap_err().code, 101);
        assert!(
            find_in_path("sh", &split_path("/nonexistent:/bin"))
                .unwrap()
                .ends_with("sh")
        );
    }

    #[test]
    fn exec_success_failure_and_missing() {
        let sh = find_in_path("sh", &split_path("/bin:/usr/bin")).unwrap();
        // exec_plugin runs binaries without arguments; use a tiny script file.
        let dir = std::env::temp_dir().join(format!("rcni-invoke-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ok = dir.join("ok");
        std::fs::write(
            &ok,
            format!(
                "#!{}\nread x; echo \"$x-$CNI_COMMAND\"; echo log >&2\n",
                sh.display()
            ),
        )
        .unwrap();
        let bad = dir.join("bad");
        std::fs::write(
            &bad,
            format!(
                "#!{}\necho '{{\"code\":11,\"msg\":\"busy\"}}'; exit 1\n",
                sh.display()
            ),
        )
        .unwrap();
        let ipam = dir.join("ipam");
        std::fs::write(
            &ipam,
            format!(
                "#!{}\ncat >/dev/null; echo '{{\"cniVersion\":\"0.4.0\",\"ips\":[{{\"version\":\"4\",\"address\":\"10.1.0.5/16\",\"gateway\":\"10.1.0.1\"}}]}}'\n",
                sh.display()
            ),
        )
        .unwrap();
        for p in [&ok, &bad, &ipam] {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let out = exec_plugin(&ok, b"hello\n", &[("CNI_COMMAND".into(), "ADD".into())]).unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "hello-ADD\n");
        assert_eq!(String::from_utf8_lossy(&out.stderr), "log\n");
        let e = exec_plugin(&bad, b"", &[]).unwrap_err();
        assert_eq!((e.code, e.msg.as_str()), (11, "busy"));
        let e = delegate_cmd("bad", "DEL", b"{}", std::slice::from_ref(&dir)).unwrap_err();
        assert_eq!(e.code, 11);
        // An IPAM result (no interfaces) read at its own version.
        let r = delegate_add("ipam", b"{}", std::slice::from_ref(&dir), "1.0.0").unwrap();
        assert_eq!(r.cni_version, "0.4.0");
        assert_eq!(r.ips[0].address.to_string(), "10.1.0.5/16");
        assert_eq!(r.ips[0].interface, None);
        let e = delegate_add("ok", b"{}", std::slice::from_ref(&dir), "1.0.0").unwrap_err();
        assert_eq!(e.code, 6, "a non-JSON result is a decoding failure: {e}");
        let e = exec_plugin(&dir.join("missing"), b"", &[]).unwrap_err();
        assert_eq!(e.code, 102);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
