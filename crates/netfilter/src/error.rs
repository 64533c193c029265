//! The crate's error, with the CNI code each case reaches the runtime with.

use crate::ipmasq::Backend;

/// Errors of this crate; [`Error::cni_code`] gives the CNI code.
#[derive(thiserror::Error, Debug)]
pub enum Error {
    #[error(
        "unsupported value {0:?} for field \"ipMasqBackend\" (expected \"iptables\" or \"nftables\")"
    )]
    UnknownBackend(String),
    #[error("{tool} not found (searched PATH and the sbin directories)")]
    ToolMissing { tool: &'static str },
    #[error("cannot run {tool}: {error}")]
    Spawn {
        tool: &'static str,
        error: std::io::Error,
    },
    #[error("{tool} {args} failed ({status}): {stderr}")]
    ToolFailed {
        tool: &'static str,
        args: String,
        status: String,
        stderr: String,
    },
    #[error("cannot parse the output of {tool}: {msg}")]
    Parse { tool: &'static str, msg: String },
    /// CHECK found rules missing or different.
    #[error("ipMasq rules of {backend} missing: {}", .problems.join("; "))]
    Missing {
        backend: Backend,
        problems: Vec<String>,
    },
    /// Reading or writing nf_tables (or conntrack) over nfnetlink failed.
    #[error(transparent)]
    Netlink(#[from] rcni_netlink::Error),
    /// Teardown and GC keep going after an error and report them all.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Several(Vec<Error>),
}

impl Error {
    /// CNI code: 2 for an unknown backend name (a config value), 106 when
    /// CHECK finds rules missing, 109 when a tool is missing or fails.
    pub fn cni_code(&self) -> u32 {
        use rcni_cni::ErrorCode;
        match self {
            Error::UnknownBackend(_) => ErrorCode::UnsupportedField.code(),
            Error::Missing { .. } => ErrorCode::CheckFailed.code(),
            Error::Netlink(e) => e.cni_code(),
            Error::Several(v) => v
                .first()
                .map_or(ErrorCode::Netfilter.code(), Error::cni_code),
            _ => ErrorCode::Netfilter.code(),
        }
    }

    pub(crate) fn several(mut errors: Vec<Error>) -> Result<(), Error> {
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.remove(0)),
            _ => Err(Error::Several(errors)),
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

    #[test]
    fn codes() {
        let missing = Error::Missing {
            backend: Backend::Iptables,
            problems: vec!["a".into(), "b".into()],
        };
        assert_eq!(missing.cni_code(), 106);
        assert_eq!(
            missing.to_string(),
            "ipMasq rules of iptables missing: a; b"
        );
        assert_eq!(Error::ToolMissing { tool: "nft" }.cni_code(), 109);
        let several = Error::Several(vec![
            Error::ToolMissing { tool: "nft" },
            Error::ToolMissing {
                tool: "iptables-save",
            },
        ]);
        assert_eq!(several.cni_code(), 109);
        assert!(several.to_string().contains("; iptables-save not found"));
        assert!(Error::several(vec![]).is_ok());
    }
}
