//! Work the plugin hands to a forked child so that the runtime does not wait
//! for it: the kernel's deferred part of a netlink request (an RCU grace
//! period or barrier) that nothing after the plugin depends on.
//!
//! The child closes every descriptor but the ones it needs at once, so the
//! runtime's pipes reach EOF when the plugin exits, and it is never waited
//! for: when the plugin exits first it is re-parented (to init or the
//! nearest subreaper), which reaps it.

use std::os::fd::{FromRawFd, OwnedFd};

/// Forks. In the child, closes every descriptor but `keep` and runs `child`,
/// which must make only async-signal-safe calls (the parent may have other
/// threads), then exits. `None` when fork failed.
///
/// # Safety
/// `child` runs in a forked copy of a possibly multithreaded process: no
/// allocation, no locks, only raw syscalls on memory prepared before the
/// call.
pub(crate) unsafe fn fork_child(keep: &[i32], child: impl FnOnce()) -> Option<libc::pid_t> {
    // SAFETY: the caller promises `child` is async-signal-safe; before it
    // the child only calls close_range.
    unsafe {
        match libc::fork() {
            0 => {
                let mut next = 0u32;
                let mut ks = [i32::MAX; 4];
                for (k, &fd) in ks.iter_mut().zip(keep) {
                    *k = fd;
                }
                ks.sort_unstable();
                for &fd in ks.iter().filter(|&&fd| fd >= 0 && fd != i32::MAX) {
                    if fd as u32 > next {
                        libc::syscall(libc::SYS_close_range, next, fd as u32 - 1, 0);
                    }
                    next = fd as u32 + 1;
                }
                libc::syscall(libc::SYS_close_range, next, u32::MAX, 0);
                child();
                libc::_exit(0)
            }
            pid if pid > 0 => Some(pid),
            _ => None,
        }
    }
}

/// A close-on-exec pipe: (read end, write end).
pub(crate) fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut p = [0i32; 2];
    // SAFETY: pipe2 fills both fds on success; each is owned once.
    unsafe {
        if libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok((OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])))
    }
}
