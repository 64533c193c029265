//! Running `nft` and the iptables tools inside a network namespace.
//!
//! The child enters the namespace between fork and exec, so the caller's
//! threads never switch namespace (DESIGN: namespace-bound work never runs
//! on a shared thread).

use crate::Error;
use rcni_netns::NetNs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;

/// Where the tools live when PATH does not say: runtimes often start plugins
/// with a minimal environment, and the tools are in sbin directories that a
/// non-login PATH lacks.
const FALLBACK_DIRS: &[&str] = &["/usr/sbin", "/sbin", "/usr/local/sbin", "/usr/bin", "/bin"];

/// The executable `name` from PATH, else from the usual sbin directories.
pub fn find_tool(name: &str) -> Option<PathBuf> {
    let from_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    from_path
        .into_iter()
        .chain(FALLBACK_DIRS.iter().map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// What a tool printed and whether it succeeded.
pub struct Output {
    pub success: bool,
    /// The exit code; `None` when killed by a signal.
    pub code: Option<i32>,
    pub status: String,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `tool args` inside `ns`, feeding `stdin`. A missing tool is
/// [`Error::ToolMissing`]; a failing one is returned as an [`Output`] for the
/// caller to judge (a missing nft table is not an error for teardown).
pub fn run(
    ns: &NetNs,
    tool: &'static str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<Output, Error> {
    let path = find_tool(tool).ok_or(Error::ToolMissing { tool })?;
    let mut cmd = ns.command(path);
    cmd.args(args)
        // Error texts are matched in a few places (nft's "No such file or
        // directory"): keep them untranslated.
        .env("LC_ALL", "C")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let spawn_err = |error| Error::Spawn { tool, error };
    let mut child = cmd.spawn().map_err(spawn_err)?;
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().expect("stdin is piped");
        // The tools read all of stdin before writing anything sizeable, so
        // writing first and then collecting output cannot deadlock.
        pipe.write_all(input.as_bytes()).map_err(spawn_err)?;
    }
    let out = child.wait_with_output().map_err(spawn_err)?;
    Ok(Output {
        success: out.status.success(),
        code: out.status.code(),
        status: out.status.to_string(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// Like [`run`], but a non-zero exit is [`Error::ToolFailed`]; returns stdout.
pub fn run_ok(
    ns: &NetNs,
    tool: &'static str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<String, Error> {
    let out = run(ns, tool, args, stdin)?;
    if out.success {
        Ok(out.stdout)
    } else {
        Err(failed(tool, args, stdin, &out))
    }
}

/// The error for a failed run. The input script is included: it is short,
/// and it is what an operator needs to see to understand the failure.
pub fn failed(tool: &'static str, args: &[&str], stdin: Option<&str>, out: &Output) -> Error {
    let mut stderr = out.stderr.trim().to_string();
    if let Some(input) = stdin {
        stderr.push_str("; input was:\n");
        stderr.push_str(input.trim_end());
    }
    Error::ToolFailed {
        tool,
        args: args.join(" "),
        status: out.status.clone(),
        stderr,
    }
}
