//! Work the plugin hands to a forked child so that the runtime does not wait
//! for it: the kernel's deferred part of a netlink request (an RCU grace
//! period or barrier) that nothing after the plugin depends on.
//!
//! The child closes every descriptor but the ones it needs at once, so the
//! runtime's pipes reach EOF when the plugin exits, and it is never waited
//! for: when the plugin exits first it is re-parented (to init or the
//! nearest subreaper), which reaps it.

use nix::fcntl::OFlag;
use nix::sys::socket::{MsgFlags, recv, send};
use nix::unistd::Pid;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::Duration;

pub use crate::nlsock::netlink_socket;

/// What a forked child may do. Only these jobs run after a fork, so the
/// fork itself stays behind a safe interface: each is bare syscalls (nix's
/// wrappers do not allocate) on memory prepared before the fork, which is
/// all a forked copy of a multithreaded process may do.
enum Job<'a> {
    /// Keep `sock` until `eof` reaches end of file, pause `delay`, exit
    /// (which closes it).
    Release {
        sock: BorrowedFd<'a>,
        eof: BorrowedFd<'a>,
        delay: Duration,
    },
    /// Send `request` on `sock`, read the answer, write the kernel's errno
    /// (0 for an ACK, EIO when none came) to `report`.
    SendAndReport {
        sock: BorrowedFd<'a>,
        request: &'a [u8],
        report: BorrowedFd<'a>,
    },
}

impl Job<'_> {
    fn keep(&self) -> [RawFd; 2] {
        match self {
            Job::Release { sock, eof, .. } => [sock.as_raw_fd(), eof.as_raw_fd()],
            Job::SendAndReport { sock, report, .. } => [sock.as_raw_fd(), report.as_raw_fd()],
        }
    }

    fn run(self) {
        match self {
            Job::Release { eof, delay, .. } => {
                let mut b = [0u8; 1];
                while nix::unistd::read(eof, &mut b) == Err(nix::errno::Errno::EINTR) {}
                // clock_nanosleep(2) itself: std's sleep promises nothing
                // about allocating.
                let t = nix::sys::time::TimeSpec::from_duration(delay);
                let _ = nix::time::clock_nanosleep(
                    nix::time::ClockId::CLOCK_MONOTONIC,
                    nix::time::ClockNanosleepFlags::empty(),
                    &t,
                );
            }
            Job::SendAndReport {
                sock,
                request,
                report,
            } => {
                let s = sock.as_raw_fd();
                // On the stack: nothing is allocated after the fork. An
                // error's ack echoes the request; the header and the errno
                // fit, a truncated read is fine.
                let mut ack = [0u8; 512];
                let mut errno: i32 = libc::EIO;
                if send(s, request, MsgFlags::empty()) == Ok(request.len()) {
                    let n = recv(s, &mut ack, MsgFlags::empty()).unwrap_or(0);
                    // nlmsghdr (16 bytes) of type NLMSG_ERROR (2), then the
                    // negative errno, 0 for an ACK.
                    if n >= 20 && u16::from_ne_bytes([ack[4], ack[5]]) == 2 {
                        // wrapping: a panic (i32::MIN) would lock and allocate.
                        errno =
                            i32::from_ne_bytes([ack[16], ack[17], ack[18], ack[19]]).wrapping_neg();
                    }
                }
                let _ = nix::unistd::write(report, &errno.to_ne_bytes());
            }
        }
    }
}

/// Forks a child that closes every descriptor but the job's, runs it and
/// exits; it is never waited for here (re-parented when the plugin exits
/// first). `None` when fork failed.
fn fork_job(job: Job<'_>) -> Option<Pid> {
    let mut ks = job.keep();
    ks.sort_unstable();
    // SAFETY: the child runs only a `Job` (bare syscalls on memory prepared
    // before the fork, see `Job`) after close_range, then _exits; the parent
    // returns at once. No crate makes fork safe (nix's `fork` is unsafe for
    // this very reason).
    unsafe {
        match libc::fork() {
            0 => {
                let mut next = 0u32;
                for &fd in ks.iter().filter(|&&fd| fd >= 0) {
                    if fd as u32 > next {
                        libc::syscall(libc::SYS_close_range, next, fd as u32 - 1, 0);
                    }
                    next = fd as u32 + 1;
                }
                libc::syscall(libc::SYS_close_range, next, u32::MAX, 0);
                job.run();
                libc::_exit(0)
            }
            pid if pid > 0 => Some(Pid::from_raw(pid)),
            _ => None,
        }
    }
}

/// Makes a child that holds a reference to `sock` and releases it only
/// `delay` after this process has closed its own copy (when the returned
/// pipe write end is closed), so that the caller never waits for the
/// release. `None` when no child could be made (the caller then closes the
/// socket itself, waiting as before).
pub fn spawn_releaser(sock: &impl AsFd, delay: Duration) -> Option<OwnedFd> {
    let (r, w) = pipe().ok()?;
    let job = Job::Release {
        sock: sock.as_fd(),
        eof: r.as_fd(),
        delay,
    };
    fork_job(job).map(|_| w)
}

/// Forks a child that sends `request` on `sock`, reads the answer and
/// writes the kernel's errno (4 bytes, native order; 0 for success) to
/// `report`. The child's pid, or `None` when fork failed.
pub(crate) fn spawn_send_and_report(
    sock: &impl AsFd,
    request: &[u8],
    report: &impl AsFd,
) -> Option<Pid> {
    fork_job(Job::SendAndReport {
        sock: sock.as_fd(),
        request,
        report: report.as_fd(),
    })
}

/// A close-on-exec pipe: (read end, write end).
pub(crate) fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    Ok(nix::unistd::pipe2(OFlag::O_CLOEXEC)?)
}
