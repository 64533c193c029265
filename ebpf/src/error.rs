//! The crate's error: what was being done, and the error that caused it as
//! its [`source`](std::error::Error::source).
//!
//! The message (`Display`) is the whole story, causes included: the plugins
//! put it in the CNI error's `msg` as it is. The source is there for callers
//! that want the cause itself (an aya error, an errno, a netlink error).

use std::fmt;
use std::path::{Path, PathBuf};

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An aya error, boxed: aya has one error type per object (maps, programs,
/// links, pins, the loader, tc).
pub type AyaError = Box<dyn std::error::Error + Send + Sync + 'static>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or syscall operation.
    #[error("{op}: {source}")]
    Io {
        op: String,
        #[source]
        source: std::io::Error,
    },
    /// A call through nix.
    #[error("{op}: {}", source.desc())]
    Errno {
        op: String,
        #[source]
        source: nix::errno::Errno,
    },
    /// A call into aya. The message has every layer of the cause: aya's
    /// errors say only what failed (`the BPF_OBJ_GET syscall failed`) and
    /// keep the reason a level or two down.
    #[error("{}", aya_message(op, source.as_ref()))]
    Aya {
        op: String,
        #[source]
        source: AyaError,
    },
    /// A netlink request (tc filters), with what it was for when that is
    /// not in the netlink error's own message. Boxed: it is the largest.
    #[error("{}", match op { Some(op) => format!("{op}: {source}"), None => source.to_string() })]
    Netlink {
        op: Option<String>,
        #[source]
        source: Box<rcni_netlink::Error>,
    },
    /// The network's pins are of another layout version (see
    /// [`Error::is_incompatible`]).
    #[error(
        "{}: pinned by another version of rcni ({what}): delete the network's pods, or remove \
         the directory (its pods keep the normal path, without fast path and policy, until \
         re-added), so that the next ADD loads this version",
        dir.display()
    )]
    Incompatible { dir: PathBuf, what: String },
    /// A request this crate refuses, or something missing, with no error
    /// underneath.
    #[error("{0}")]
    Msg(String),
}

impl Error {
    pub fn msg(msg: impl Into<String>) -> Error {
        Error::Msg(msg.into())
    }

    pub fn errno(op: impl fmt::Display, e: nix::errno::Errno) -> Error {
        Error::Errno {
            op: op.to_string(),
            source: e,
        }
    }

    pub fn io(op: impl fmt::Display, e: std::io::Error) -> Error {
        Error::Io {
            op: op.to_string(),
            source: e,
        }
    }

    pub(crate) fn aya(op: impl fmt::Display, e: impl Into<AyaError>) -> Error {
        Error::Aya {
            op: op.to_string(),
            source: e.into(),
        }
    }

    pub(crate) fn netlink(op: Option<String>, e: rcni_netlink::Error) -> Error {
        Error::Netlink {
            op,
            source: Box::new(e),
        }
    }

    /// Why the pins in `dir` cannot be used.
    pub(crate) fn incompatible(dir: &Path, what: impl fmt::Display) -> Error {
        Error::Incompatible {
            dir: dir.to_path_buf(),
            what: what.to_string(),
        }
    }

    /// The errno behind the failure: for aya, that of the outermost I/O
    /// error in its chain (aya wraps syscalls' errors a few levels deep).
    pub fn raw_errno(&self) -> Option<i32> {
        match self {
            Error::Io { source, .. } => source.raw_os_error(),
            Error::Errno { source, .. } => Some(*source as i32),
            Error::Aya { source, .. } => {
                let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
                while let Some(c) = cur {
                    if let Some(errno) = c
                        .downcast_ref::<std::io::Error>()
                        .and_then(std::io::Error::raw_os_error)
                    {
                        return Some(errno);
                    }
                    cur = c.source();
                }
                None
            }
            Error::Netlink { source, .. } => source.errno(),
            Error::Incompatible { .. } | Error::Msg(_) => None,
        }
    }

    pub fn is_not_found(&self) -> bool {
        self.raw_errno() == Some(libc::ENOENT)
    }

    /// The network's pins are of another layout version: nothing in them
    /// can be read or written by this build. A DEL has nothing it can undo
    /// there; the message says what the operator can do.
    pub fn is_incompatible(&self) -> bool {
        matches!(self, Error::Incompatible { .. })
    }

    /// The kernel refused for lack of privileges (CAP_BPF, CAP_NET_ADMIN,
    /// CAP_SYS_ADMIN for bpffs).
    pub fn is_permission(&self) -> bool {
        matches!(self.raw_errno(), Some(libc::EPERM) | Some(libc::EACCES))
    }
}

/// `op: e`, then each layer below `e` whose text is not in the message yet.
fn aya_message(op: &str, e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = format!("{op}: {e}");
    let mut cur = e.source();
    while let Some(c) = cur {
        let s = c.to_string();
        if !msg.contains(&s) {
            msg.push_str(": ");
            msg.push_str(&s);
        }
        cur = c.source();
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn aya_errors_keep_their_cause_and_errno() {
        let e = Error::aya(
            "open /x",
            aya::maps::MapError::SyscallError(aya::sys::SyscallError {
                call: "BPF_OBJ_GET",
                io_error: std::io::Error::from_raw_os_error(libc::ENOENT),
            }),
        );
        assert!(e.is_not_found());
        assert_eq!(
            e.to_string(),
            "open /x: `BPF_OBJ_GET` failed: No such file or directory (os error 2)"
        );
        let cause = e.source().expect("a source");
        assert!(cause.downcast_ref::<aya::maps::MapError>().is_some());
    }

    #[test]
    fn io_and_errno_messages() {
        let e = Error::io("remove /p", std::io::Error::from_raw_os_error(libc::EACCES));
        assert_eq!(e.to_string(), "remove /p: Permission denied (os error 13)");
        assert!(e.is_permission());
        assert!(e.source().is_some());
        let e = Error::errno("lock /d", nix::errno::Errno::EPERM);
        assert_eq!(e.to_string(), "lock /d: Operation not permitted");
        assert_eq!(e.raw_errno(), Some(libc::EPERM));
        let e = Error::msg("plain");
        assert!(e.source().is_none() && e.raw_errno().is_none());
        assert!(Error::incompatible(Path::new("/d"), "x").is_incompatible());
    }
}
