//! Work the plugin hands to a forked child so that the runtime does not wait
//! for it: the kernel's deferred part of a netlink request (an RCU grace
//! period or barrier) that nothing after the plugin depends on.
//!
//! The child closes every descriptor but the ones it needs at once, so the
//! runtime's pipes reach EOF when the plugin exits, and it is never waited
//! for: when the plugin exits first it is re-parented (to init or the
//! nearest subreaper), which reaps it.

use crate::{Error, Result};
use nix::fcntl::OFlag;
use nix::sys::socket::{AddressFamily, SockFlag, SockProtocol, SockType};
use rcni_netns::NetNs;
use std::os::fd::OwnedFd;

/// Forks. In the child, closes every descriptor but `keep` and runs `child`,
/// which must make only async-signal-safe calls (the parent may have other
/// threads), then exits. `None` when fork failed.
///
/// # Safety
/// `child` runs in a forked copy of a possibly multithreaded process: no
/// allocation, no locks, only raw syscalls on memory prepared before the
/// call. (No crate makes fork safe: nix's `fork` is `unsafe` for this very
/// reason.)
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
///
/// From nix rather than netlink-sys: callers (also crates/netfilter) keep an
/// `OwnedFd`, which netlink-sys's `Socket` becomes only through an unsafe
/// `from_raw_fd`.
pub fn netlink_socket(ns: &NetNs, proto: i32, op: &str) -> Result<OwnedFd> {
    let proto = match proto {
        libc::NETLINK_ROUTE => SockProtocol::NetlinkRoute,
        libc::NETLINK_NETFILTER => SockProtocol::NetlinkNetFilter,
        _ => {
            return Err(Error::io(
                op,
                std::io::Error::from_raw_os_error(libc::EPROTONOSUPPORT),
            ));
        }
    };
    ns.run(|| {
        nix::sys::socket::socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            proto,
        )
    })
    .map_err(|e| Error::netns(op, e))?
    .map_err(|e| Error::io(op, e.into()))
}

/// A close-on-exec pipe: (read end, write end).
pub fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    Ok(nix::unistd::pipe2(OFlag::O_CLOEXEC)?)
}
