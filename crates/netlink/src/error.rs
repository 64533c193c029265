use std::fmt;
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

#[derive(Debug)]
enum Source {
    Netlink(rtnetlink::Error),
    Netns(rcni_netns::Error),
    Io(io::Error),
    Message(String),
}

/// An error of this crate: what we were doing, how to classify it, and why.
///
/// `Display` reads `"<op>: <cause>"`, e.g.
/// `add address 10.0.0.2/24 to link 7: File exists (os error 17)`. The cause
/// is part of that text and therefore not repeated as `source()`.
#[derive(Debug)]
pub struct Error {
    op: String,
    kind: ErrorKind,
    source: Option<Source>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

fn classify_errno(errno: i32) -> ErrorKind {
    match errno {
        libc::EEXIST => ErrorKind::Exists,
        libc::ENODEV | libc::ENOENT | libc::ESRCH | libc::EADDRNOTAVAIL => ErrorKind::NotFound,
        _ => ErrorKind::Other,
    }
}

impl Error {
    pub fn netlink(op: impl Into<String>, err: rtnetlink::Error) -> Error {
        let mut e = Error {
            op: op.into(),
            kind: ErrorKind::Other,
            source: Some(Source::Netlink(err)),
        };
        if let Some(errno) = e.errno() {
            e.kind = classify_errno(errno);
        }
        e
    }

    pub fn io(op: impl Into<String>, err: io::Error) -> Error {
        let kind = err.raw_os_error().map_or(ErrorKind::Other, classify_errno);
        Error {
            op: op.into(),
            kind,
            source: Some(Source::Io(err)),
        }
    }

    pub fn netns(op: impl Into<String>, err: rcni_netns::Error) -> Error {
        let kind = if err.is_not_found() {
            ErrorKind::NotFound
        } else {
            ErrorKind::Other
        };
        Error {
            op: op.into(),
            kind,
            source: Some(Source::Netns(err)),
        }
    }

    pub fn not_found(op: impl Into<String>) -> Error {
        Error {
            op: op.into(),
            kind: ErrorKind::NotFound,
            source: None,
        }
    }

    pub fn other(op: impl Into<String>, msg: impl Into<String>) -> Error {
        Error {
            op: op.into(),
            kind: ErrorKind::Other,
            source: Some(Source::Message(msg.into())),
        }
    }

    /// What we were doing, e.g. `add address 10.0.0.2/24 to link 7`.
    pub fn op(&self) -> &str {
        &self.op
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn is_exists(&self) -> bool {
        self.kind == ErrorKind::Exists
    }

    pub fn is_not_found(&self) -> bool {
        self.kind == ErrorKind::NotFound
    }

    /// The positive errno the kernel (or the OS) answered with, if any.
    pub fn errno(&self) -> Option<i32> {
        match self.source.as_ref()? {
            Source::Netlink(rtnetlink::Error::NetlinkError(msg)) => {
                msg.code.map(|c| c.get().checked_abs().unwrap_or(i32::MAX))
            }
            Source::Io(e) => e.raw_os_error(),
            _ => None,
        }
    }

    /// CNI error code: 104 when the namespace is the problem, 103 for a
    /// failed netlink request, 100 for other internal failures.
    pub fn cni_code(&self) -> u32 {
        match &self.source {
            Some(Source::Netns(e)) => e.cni_code(),
            Some(Source::Netlink(_)) => 103,
            // A lookup that came back empty is a netlink answer too.
            None if self.kind == ErrorKind::NotFound => 103,
            _ => 100,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.op)?;
        match &self.source {
            Some(Source::Netlink(rtnetlink::Error::NetlinkError(msg))) => {
                write!(f, "{}", io::Error::from_raw_os_error(msg.raw_code().abs()))
            }
            Some(Source::Netlink(e)) => write!(f, "{e}"),
            Some(Source::Netns(e)) => write!(f, "{e}"),
            Some(Source::Io(e)) => write!(f, "{e}"),
            Some(Source::Message(m)) => f.write_str(m),
            None => f.write_str(match self.kind {
                ErrorKind::Exists => "already exists",
                ErrorKind::NotFound => "not found",
                ErrorKind::Other => "failed",
            }),
        }
    }
}

impl std::error::Error for Error {}

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
    }
}
