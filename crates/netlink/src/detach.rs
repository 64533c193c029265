//! Work the plugin hands to a forked child so that the runtime does not wait
//! for it: the kernel's deferred part of a netlink request (an RCU grace
//! period or barrier) that nothing after the plugin depends on.
//!
//! The child closes every descriptor but the ones it needs at once, so the
//! runtime's pipes reach EOF when the plugin exits, and it is never waited
//! for: when the plugin exits first it is re-parented (to init or the
//! nearest subreaper), which reaps it.

use crate::{Error, Result};
use rcni_netns::NetNs;
use std::os::fd::{FromRawFd, OwnedFd};

/// Forks. In the child, closes every descriptor but `keep` and runs `child`,
/// which must make only async-signal-safe calls (the parent may have other
/// threads), then exits. `None` when fork failed.
///
/// # Safety
/// `child` runs in a forked copy of a possibly multithreaded process: no
/// allocation, no locks, only raw syscalls on memory prepared before the
/// call.
pub unsafe fn fork_child(keep: &[i32], child: impl FnOnce()) -> Option<libc::pid_t> {
    // Sorted before the fork: the child may not allocate.
    let mut ks = [-1i32; 4];
    assert!(
        keep.len() <= ks.len(),
        "fork_child keeps at most 4 descriptors"
    );
    ks[..keep.len()].copy_from_slice(keep);
    ks.sort_unstable();
    // SAFETY: the caller promises `child` is async-signal-safe; before it
    // the child only calls close_range.
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
                child();
                libc::_exit(0)
            }
            pid if pid > 0 => Some(pid),
            _ => None,
        }
    }
}

/// A raw netlink socket of protocol `proto` (`NETLINK_ROUTE`,
/// `NETLINK_NETFILTER`) bound to `ns`: a socket talks to the namespace it was
/// created in.
pub fn netlink_socket(ns: &NetNs, proto: i32, op: &str) -> Result<OwnedFd> {
    ns.run(|| {
        // SAFETY: plain socket(2); the fd is owned right away.
        let fd =
            unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd was just returned by socket(2) and is not owned elsewhere.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    })
    .map_err(|e| Error::netns(op, e))?
    .map_err(|e| Error::io(op, e))
}

/// A close-on-exec pipe: (read end, write end).
pub fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut p = [0i32; 2];
    // SAFETY: pipe2 fills both fds on success; each is owned once.
    unsafe {
        if libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok((OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])))
    }
}
