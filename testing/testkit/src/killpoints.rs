//! Kill tests at every point that matters: a command runs under ptrace and
//! its whole process group is SIGKILLed on entry to its k-th system call
//! with a lasting effect (a write, a rename, a file created or truncated, a
//! netlink message, ...), counted over every thread and process it starts.
//! A kill between two such calls leaves what a kill at the next one
//! leaves (nothing else the process does is seen outside it), so running
//! k = 1, 2, ... until the command finishes unkilled covers every moment a
//! runtime could kill it, deterministically, where sleeping a random time
//! before a kill hits a short window only now and then.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use nix::errno::Errno;
use nix::sys::ptrace::{self, Options};
use nix::sys::signal::{Signal, killpg};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

/// How a run under [`run_killed_at`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// Killed on entry to the k-th call, this one (its name).
    Killed(&'static str),
    /// Ran to its end (exit status), having made this many such calls.
    Finished { code: i32, calls: u32 },
}

/// Runs `cmd` with `stdin` in a process group of its own, traced, and kills
/// the group on entry to its `k`-th lasting system call (1-based); see the
/// module doc. Output goes nowhere. The calling thread must have no other
/// child process running meanwhile (this waits for any of its own).
pub fn run_killed_at(mut cmd: Command, stdin: &[u8], k: u32) -> Ending {
    cmd.process_group(0)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: PTRACE_TRACEME is one async-signal-safe syscall between fork
    // and exec; the exec then stops the child until we resume it.
    unsafe {
        cmd.pre_exec(|| ptrace::traceme().map_err(std::io::Error::from));
    }
    // Reaped below by the tracer's waitpid(-1), which std cannot know.
    #[allow(clippy::zombie_processes)]
    let mut child = cmd.spawn().expect("spawn a traced command");
    if let Some(mut s) = child.stdin.take() {
        let _ = s.write_all(stdin);
    }
    let pid = Pid::from_raw(child.id() as i32);
    // The exec stop.
    match waitpid(pid, Some(WaitPidFlag::__WALL)) {
        Ok(WaitStatus::Stopped(_, Signal::SIGTRAP)) => {}
        other => panic!("traced child did not stop at exec: {other:?}"),
    }
    ptrace::setoptions(
        pid,
        Options::PTRACE_O_TRACESYSGOOD
            | Options::PTRACE_O_TRACECLONE
            | Options::PTRACE_O_TRACEFORK
            | Options::PTRACE_O_TRACEVFORK
            | Options::PTRACE_O_TRACEEXEC
            | Options::PTRACE_O_EXITKILL,
    )
    .expect("ptrace options");
    let _ = ptrace::syscall(pid, None);
    let mut calls = 0u32;
    let mut killed = None;
    let mut code = None;
    loop {
        // __WNOTHREAD: this thread's children and tracees only, so the
        // children of the other tests' threads (`cargo test` runs tests as
        // threads of one process) are left to their own waits.
        let st = match waitpid(
            Pid::from_raw(-1),
            Some(WaitPidFlag::__WALL | WaitPidFlag::__WNOTHREAD),
        ) {
            Ok(st) => st,
            Err(Errno::EINTR) => continue,
            Err(Errno::ECHILD) => break,
            Err(e) => panic!("waitpid: {e}"),
        };
        match st {
            WaitStatus::PtraceSyscall(tid) => {
                if killed.is_none()
                    && let Some(name) = lasting_call_entry(tid)
                {
                    calls += 1;
                    if calls == k {
                        killed = Some(name);
                        let _ = killpg(pid, Signal::SIGKILL);
                    }
                }
                let _ = ptrace::syscall(tid, None);
            }
            WaitStatus::PtraceEvent(tid, ..) => {
                let _ = ptrace::syscall(tid, None);
            }
            // New tracees start with a SIGSTOP of ptrace's own: swallowed.
            WaitStatus::Stopped(tid, Signal::SIGSTOP) => {
                let _ = ptrace::syscall(tid, None);
            }
            WaitStatus::Stopped(tid, sig) => {
                let _ = ptrace::syscall(tid, Some(sig));
            }
            WaitStatus::Exited(p, c) if p == pid => code = Some(c),
            WaitStatus::Signaled(p, s, _) if p == pid => code = Some(128 + s as i32),
            _ => {}
        }
    }
    // The group may hold processes the dead command left (a plugin it
    // started): nothing of a kill survives it.
    if killed.is_some() {
        let _ = killpg(pid, Signal::SIGKILL);
    }
    match killed {
        Some(name) => Ending::Killed(name),
        None => Ending::Finished {
            code: code.expect("the traced command's end was seen"),
            calls,
        },
    }
}

/// At a syscall-entry stop of `tid`, the name of the call if it has an
/// effect outside the process; `None` at an exit stop or for other calls.
#[cfg(target_arch = "x86_64")]
fn lasting_call_entry(tid: Pid) -> Option<&'static str> {
    let regs = ptrace::getregs(tid).ok()?;
    // The kernel sets rax to -ENOSYS on entry; on exit it holds the result.
    if regs.rax as i64 != -i64::from(libc::ENOSYS) {
        return None;
    }
    let creates = |flags: u64| flags & (libc::O_CREAT | libc::O_TRUNC) as u64 != 0;
    let nr = regs.orig_rax as i64;
    Some(match nr {
        libc::SYS_write => "write",
        libc::SYS_writev => "writev",
        libc::SYS_pwrite64 => "pwrite64",
        libc::SYS_pwritev => "pwritev",
        libc::SYS_sendto => "sendto",
        libc::SYS_sendmsg => "sendmsg",
        libc::SYS_sendmmsg => "sendmmsg",
        libc::SYS_rename => "rename",
        libc::SYS_renameat => "renameat",
        libc::SYS_renameat2 => "renameat2",
        libc::SYS_link => "link",
        libc::SYS_linkat => "linkat",
        libc::SYS_symlink => "symlink",
        libc::SYS_symlinkat => "symlinkat",
        libc::SYS_unlink => "unlink",
        libc::SYS_unlinkat => "unlinkat",
        libc::SYS_rmdir => "rmdir",
        libc::SYS_mkdir => "mkdir",
        libc::SYS_mkdirat => "mkdirat",
        libc::SYS_ftruncate => "ftruncate",
        libc::SYS_truncate => "truncate",
        libc::SYS_fallocate => "fallocate",
        libc::SYS_fchmod => "fchmod",
        libc::SYS_fchmodat => "fchmodat",
        libc::SYS_fchown => "fchown",
        libc::SYS_fchownat => "fchownat",
        libc::SYS_mount => "mount",
        libc::SYS_umount2 => "umount2",
        libc::SYS_bpf => "bpf",
        libc::SYS_creat => "creat",
        libc::SYS_open if creates(regs.rsi) => "open",
        libc::SYS_openat if creates(regs.rdx) => "openat",
        _ => return None,
    })
}

#[cfg(not(target_arch = "x86_64"))]
fn lasting_call_entry(_tid: Pid) -> Option<&'static str> {
    compile_error!("killpoints reads syscall registers of x86_64 only");
}

/// Runs `cmd` killed at each lasting call in turn (a fresh command from
/// `make` each time), then once to its end; after each run, `after(k,
/// ending)` checks what the next command makes of what it left. Returns
/// how many kill points there were. Panics if the command needs more than
/// `max` (a guard against a loop).
pub fn at_every_point(
    mut make: impl FnMut() -> (Command, Vec<u8>),
    max: u32,
    mut after: impl FnMut(u32, &Ending),
) -> u32 {
    for k in 1..=max {
        let (cmd, stdin) = make();
        let ending = run_killed_at(cmd, &stdin, k);
        after(k, &ending);
        if let Ending::Finished { calls, .. } = ending {
            return calls;
        }
    }
    panic!("more than {max} kill points");
}
