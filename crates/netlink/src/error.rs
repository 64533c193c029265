use std::io;

/// How an error should be treated by idempotent callers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The object already exists (`EEXIST`).
    Exists,
    /// The object (or the link it refers to) does not exist
    /// (`ENODEV`, `ENOENT`, `ESRCH`, `EADDRNOTAVAIL`, or an empty lookup).
    NotFound,
    /// Anything else.
    Other,
}

/// An error of this crate: what we were doing (`op`) and why.
///
/// `Display` reads `"<op>: <cause>"`, e.g.
/// `add address 10.0.0.2/24 to link 7: File exists (os error 17)`: the
/// whole sentence is what the runtime gets as the CNI error message. The
/// cause is also the error's `source()`, so callers can inspect the
/// rtnetlink, I/O or namespace error itself (a printer that walks the chain
/// sees the cause's text twice).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The kernel refused a netlink request, or the connection failed.
    #[error("{op}: {}", netlink_cause(source))]
    Netlink {
        op: String,
        #[source]
        source: rtnetlink::Error,
    },
    /// A system call failed.
    #[error("{op}: {source}")]
    Io {
        op: String,
        #[source]
        source: io::Error,
    },
    /// The namespace could not be opened or entered.
    #[error("{op}: {source}")]
    Netns {
        op: String,
        #[source]
        source: rcni_netns::Error,
    },
    /// A lookup came back empty.
    #[error("{op}: not found")]
    NotFound { op: String },
    /// Anything else; `reason` says what.
    #[error("{op}: {reason}")]
    Other { op: String, reason: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The kernel's refusal reads as the errno's text, as the reference's
/// messages do; anything else as rtnetlink words it.
fn netlink_cause(e: &rtnetlink::Error) -> String {
    match e {
        rtnetlink::Error::NetlinkError(msg) => {
            io::Error::from_raw_os_error(msg.raw_code().abs()).to_string()
        }
        e => e.to_string(),
    }
}

fn classify_errno(errno: i32) -> ErrorKind {
    match errno {
        libc::EEXIST => ErrorKind::Exists,
        libc::ENODEV | libc::ENOENT | libc::ESRCH | libc::EADDRNOTAVAIL => ErrorKind::NotFound,
        _ => ErrorKind::Other,
    }
}

impl Error {
    pub fn netlink(op: impl Into<String>, err: rtnetlink::Error) -> Error {
        Error::Netlink {
            op: op.into(),
            source: err,
        }
    }

    pub fn io(op: impl Into<String>, err: io::Error) -> Error {
        Error::Io {
            op: op.into(),
            source: err,
        }
    }

    pub fn netns(op: impl Into<String>, err: rcni_netns::Error) -> Error {
        Error::Netns {
            op: op.into(),
            source: err,
        }
    }

    pub fn not_found(op: impl Into<String>) -> Error {
        Error::NotFound { op: op.into() }
    }

    pub fn other(op: impl Into<String>, reason: impl Into<String>) -> Error {
        Error::Other {
            op: op.into(),
            reason: reason.into(),
        }
    }

    /// What we were doing, e.g. `add address 10.0.0.2/24 to link 7`.
    pub fn op(&self) -> &str {
        match self {
            Error::Netlink { op, .. }
            | Error::Io { op, .. }
            | Error::Netns { op, .. }
            | Error::NotFound { op }
            | Error::Other { op, .. } => op,
        }
    }

    /// How idempotent callers treat the error, from the errno (or the
    /// namespace error) that caused it.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Netns { source, .. } if source.is_not_found() => ErrorKind::NotFound,
            Error::NotFound { .. } => ErrorKind::NotFound,
            _ => self.errno().map_or(ErrorKind::Other, classify_errno),
        }
    }

    pub fn is_exists(&self) -> bool {
        self.kind() == ErrorKind::Exists
    }

    pub fn is_not_found(&self) -> bool {
        self.kind() == ErrorKind::NotFound
    }

    /// EOPNOTSUPP: e.g. a link kind the kernel has no driver for.
    pub fn is_not_supported(&self) -> bool {
        self.errno() == Some(libc::EOPNOTSUPP)
    }

    /// The positive errno the kernel (or the OS) answered with, if any.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Netlink {
                source: rtnetlink::Error::NetlinkError(msg),
                ..
            } => msg.code.map(|c| c.get().checked_abs().unwrap_or(i32::MAX)),
            Error::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }

    /// CNI error code: 104 when the namespace is the problem, 103 for a
    /// failed netlink request, 100 for other internal failures.
    pub fn cni_code(&self) -> u32 {
        match self {
            Error::Netns { source, .. } => source.cni_code(),
            // A lookup that came back empty is a netlink answer too.
            Error::Netlink { .. } | Error::NotFound { .. } => 103,
            Error::Io { .. } | Error::Other { .. } => 100,
        }
    }
}

impl From<Error> for rcni_cni::CniError {
    fn from(e: Error) -> Self {
        rcni_cni::CniError::with_code(e.cni_code(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtnetlink::packet_core::ErrorMessage;
    use std::num::NonZeroI32;

    fn nl_err(errno: i32) -> rtnetlink::Error {
        let mut msg = ErrorMessage::default();
        msg.code = NonZeroI32::new(-errno);
        rtnetlink::Error::NetlinkError(msg)
    }

    #[test]
    fn classifies_by_errno() {
        let e = Error::netlink("add address 10.0.0.2/24 to link 7", nl_err(libc::EEXIST));
        assert!(e.is_exists());
        assert_eq!(e.errno(), Some(libc::EEXIST));
        assert_eq!(e.cni_code(), 103);
        assert_eq!(
            e.to_string(),
            "add address 10.0.0.2/24 to link 7: File exists (os error 17)"
        );
        for errno in [libc::ENODEV, libc::ENOENT, libc::ESRCH, libc::EADDRNOTAVAIL] {
            assert!(Error::netlink("x", nl_err(errno)).is_not_found(), "{errno}");
        }
        let e = Error::netlink("x", nl_err(libc::EPERM));
        assert_eq!(e.kind(), ErrorKind::Other);
        assert_eq!(e.errno(), Some(libc::EPERM));
    }

    #[test]
    fn empty_lookup_and_others() {
        let e = Error::not_found("get link eth9");
        assert!(e.is_not_found());
        assert_eq!(e.errno(), None);
        assert_eq!(e.cni_code(), 103);
        assert_eq!(e.to_string(), "get link eth9: not found");
        let e = Error::other("ensure bridge br0", "link br0 is a veth, not a bridge");
        assert_eq!(e.cni_code(), 100);
        let e = Error::netns("connect", rcni_netns::Error::NotFound("/x".into()));
        assert_eq!(e.cni_code(), 104);
        assert!(e.is_not_found());
        let e = Error::netlink("x", rtnetlink::Error::RequestFailed);
        assert_eq!(e.cni_code(), 103);
        assert_eq!(e.errno(), None);
        let e = Error::io("x", io::Error::from_raw_os_error(libc::ENOENT));
        assert!(e.is_not_found());
        assert_eq!(e.cni_code(), 100);
    }

    #[test]
    fn the_cause_is_the_source() {
        use std::error::Error as _;
        let e = Error::netlink("add route", nl_err(libc::EEXIST));
        let src = e.source().expect("source");
        match src.downcast_ref::<rtnetlink::Error>() {
            Some(rtnetlink::Error::NetlinkError(m)) => assert_eq!(m.raw_code(), -libc::EEXIST),
            other => panic!("{other:?}"),
        }
        let e = Error::io("open", io::Error::from_raw_os_error(libc::EPERM));
        let io = e.source().and_then(|s| s.downcast_ref::<io::Error>());
        assert_eq!(io.and_then(io::Error::raw_os_error), Some(libc::EPERM));
        let e = Error::netns("connect", rcni_netns::Error::NotFound("/x".into()));
        let ns = e
            .source()
            .and_then(|s| s.downcast_ref::<rcni_netns::Error>());
        assert!(ns.is_some_and(rcni_netns::Error::is_not_found));
        assert_eq!(
            e.to_string(),
            "connect: network namespace /x does not exist"
        );
        assert!(Error::not_found("x").source().is_none());
        assert!(Error::other("x", "why").source().is_none());
        assert_eq!(Error::other("x", "why").to_string(), "x: why");
    }
}
