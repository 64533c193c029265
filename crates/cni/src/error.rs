//! CNI error codes and the error JSON a plugin prints on stdout.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Error codes: the spec's well-known ones (0-99) and ours (100 up).
///
/// This enum is the one table of rcni's own codes; the README repeats it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ErrorCode {
    /// 1: the config's version is not one the plugin supports, or the
    /// operation needs a newer version (CHECK >= 0.4.0, GC/STATUS >= 1.1.0).
    IncompatibleCniVersion = 1,
    /// 2: a field holds a value the plugin does not support (message names
    /// the key and the value).
    UnsupportedField = 2,
    /// 3: the container is unknown; the runtime need not call DEL.
    UnknownContainer = 3,
    /// 4: a required `CNI_*` variable is missing or invalid.
    InvalidEnvironmentVariables = 4,
    /// 5: reading stdin or another I/O channel failed.
    IoFailure = 5,
    /// 6: stdin (or a delegate's output) is not valid JSON of the right shape.
    DecodingFailure = 6,
    /// 7: the network configuration is invalid.
    InvalidNetworkConfig = 7,
    /// 8: CNI_NETNS is the plugin's own network namespace.
    InvalidNetNs = 8,
    /// 11: transient; try again later (lock contention).
    TryAgainLater = 11,
    /// 50: STATUS: the plugin cannot service ADD now.
    PluginNotAvailable = 50,
    /// 51: STATUS: not available, and existing containers may have limited
    /// connectivity.
    PluginNotAvailableLimitedConnectivity = 51,
    /// 100: an unexpected internal failure (a bug or a panic).
    Internal = 100,
    /// 101: a delegated plugin (IPAM) was not found in CNI_PATH.
    DelegateNotFound = 101,
    /// 102: a delegated plugin failed without printing a CNI error.
    DelegateFailed = 102,
    /// 103: a netlink request to the kernel failed.
    Netlink = 103,
    /// 104: a network namespace could not be opened or entered.
    Netns = 104,
    /// 105: a runtime-side failure in cnitool (cache, config loading).
    Runtime = 105,
    /// 106: CHECK found the attachment differs from what ADD made.
    CheckFailed = 106,
    /// 107: IPAM has no free address (range set exhausted, or the requested
    /// address is taken).
    NoAddress = 107,
    /// 108: IPAM: this container and interface already hold an address in
    /// the range set.
    DuplicateAllocation = 108,
    /// 109: a netfilter tool (nft, iptables) is missing or failed.
    Netfilter = 109,
    /// 110: the dhcp daemon is not reachable on its socket.
    DhcpDaemon = 110,
    /// 111: no DHCP lease: no server answered in time, or it refused
    /// (DHCPNAK), or the lease expired.
    DhcpNoLease = 111,
    /// 112: an eBPF program or map could not be loaded, pinned or attached
    /// (kernel support, privileges, bpffs).
    Ebpf = 112,
}

impl ErrorCode {
    pub fn code(self) -> u32 {
        self as u32
    }

    /// Every code with its meaning, for docs and `--help` output.
    pub const TABLE: &'static [(ErrorCode, &'static str)] = &[
        (
            ErrorCode::IncompatibleCniVersion,
            "incompatible CNI version",
        ),
        (
            ErrorCode::UnsupportedField,
            "unsupported field in network configuration",
        ),
        (
            ErrorCode::UnknownContainer,
            "container unknown or does not exist",
        ),
        (
            ErrorCode::InvalidEnvironmentVariables,
            "invalid necessary environment variables",
        ),
        (ErrorCode::IoFailure, "I/O failure"),
        (ErrorCode::DecodingFailure, "failed to decode content"),
        (ErrorCode::InvalidNetworkConfig, "invalid network config"),
        (
            ErrorCode::InvalidNetNs,
            "CNI_NETNS is the plugin's own network namespace",
        ),
        (ErrorCode::TryAgainLater, "try again later"),
        (ErrorCode::PluginNotAvailable, "plugin not available"),
        (
            ErrorCode::PluginNotAvailableLimitedConnectivity,
            "plugin not available, existing containers may have limited connectivity",
        ),
        (ErrorCode::Internal, "rcni: internal error"),
        (
            ErrorCode::DelegateNotFound,
            "rcni: delegated plugin not found in CNI_PATH",
        ),
        (
            ErrorCode::DelegateFailed,
            "rcni: delegated plugin failed without a CNI error",
        ),
        (ErrorCode::Netlink, "rcni: netlink request failed"),
        (
            ErrorCode::Netns,
            "rcni: network namespace could not be opened or entered",
        ),
        (
            ErrorCode::Runtime,
            "rcni: runtime-side failure (cnitool cache or config)",
        ),
        (ErrorCode::DhcpDaemon, "rcni: dhcp daemon not reachable"),
        (
            ErrorCode::DhcpNoLease,
            "rcni: no DHCP lease (no answer, refused, or expired)",
        ),
        (
            ErrorCode::Ebpf,
            "rcni: eBPF program or map could not be loaded, pinned or attached",
        ),
    ];
}

/// The error a plugin reports: `{"cniVersion", "code", "msg", "details"}`.
///
/// `code` is a plain number so that errors of delegated plugins (Go plugins
/// use 999) pass through unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub details: String,
}

impl CniError {
    pub fn new(code: ErrorCode, msg: impl Into<String>) -> Self {
        CniError {
            code: code.code(),
            msg: msg.into(),
            details: String::new(),
        }
    }

    pub fn with_code(code: u32, msg: impl Into<String>) -> Self {
        CniError {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    pub fn internal(msg: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, msg)
    }

    pub fn config(msg: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidNetworkConfig, msg)
    }

    /// Code 2, with the key and the offending value in the message as the
    /// spec asks.
    pub fn unsupported(key: &str, value: impl fmt::Display) -> Self {
        Self::new(
            ErrorCode::UnsupportedField,
            format!("unsupported value {value} for field {key:?}"),
        )
    }

    /// Code 106: CHECK found the attachment differs from what ADD made.
    pub fn check_failed(msg: impl Into<String>) -> Self {
        Self::new(ErrorCode::CheckFailed, msg)
    }

    /// Success when `problems` is empty, else code 106 listing them:
    /// "`what` missing: a; b".
    pub fn check_problems(what: &str, problems: &[String]) -> Result<(), Self> {
        if problems.is_empty() {
            return Ok(());
        }
        Err(Self::check_failed(format!(
            "{what} missing: {}",
            problems.join("; ")
        )))
    }

    /// Code 5 (I/O failure) joining `errors`, where a command (GC) kept
    /// going past each of them; `Ok` without any.
    pub fn io_failures(errors: &[String]) -> Result<(), Self> {
        if errors.is_empty() {
            return Ok(());
        }
        Err(Self::new(ErrorCode::IoFailure, errors.join("; ")))
    }

    /// Prefixes the message with context, keeping code and details.
    pub fn context(mut self, ctx: impl fmt::Display) -> Self {
        self.msg = format!("{ctx}: {}", self.msg);
        self
    }

    /// The error JSON as plugins print it: the spec's shape, indented the way
    /// the Go skel indents.
    pub fn to_json(&self, cni_version: &str) -> String {
        let mut v = serde_json::Map::new();
        v.insert("cniVersion".into(), cni_version.into());
        v.insert("code".into(), self.code.into());
        v.insert("msg".into(), self.msg.clone().into());
        if !self.details.is_empty() {
            v.insert("details".into(), self.details.clone().into());
        }
        crate::to_pretty_json(&serde_json::Value::Object(v))
    }
}

impl fmt::Display for CniError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Same text as Go's types.Error.Error().
        if self.details.is_empty() {
            write!(f, "{}", self.msg)
        } else {
            write!(f, "{}; {}", self.msg, self.details)
        }
    }
}

impl std::error::Error for CniError {}

/// DEL and GC run every step whatever failed before and report the first
/// failure (the runtime gets one error; later ones are usually its
/// consequences).
pub fn first_error(
    results: impl IntoIterator<Item = Result<(), CniError>>,
) -> Result<(), CniError> {
    results
        .into_iter()
        .find_map(Result::err)
        .map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_the_spec_numbers() {
        assert_eq!(ErrorCode::IncompatibleCniVersion.code(), 1);
        assert_eq!(ErrorCode::InvalidEnvironmentVariables.code(), 4);
        assert_eq!(ErrorCode::DecodingFailure.code(), 6);
        assert_eq!(ErrorCode::InvalidNetworkConfig.code(), 7);
        assert_eq!(ErrorCode::TryAgainLater.code(), 11);
        assert_eq!(ErrorCode::PluginNotAvailable.code(), 50);
        assert_eq!(ErrorCode::PluginNotAvailableLimitedConnectivity.code(), 51);
        // Our own codes are 100 and up, each listed once.
        let mut seen = std::collections::HashSet::new();
        for (c, _) in ErrorCode::TABLE {
            assert!(seen.insert(c.code()), "duplicate {}", c.code());
        }
        assert!(
            ErrorCode::TABLE
                .iter()
                .filter(|(c, _)| c.code() >= 100)
                .count()
                >= 6
        );
    }

    #[test]
    fn json_shape() {
        let e = CniError::new(ErrorCode::InvalidNetworkConfig, "Invalid Configuration")
            .with_details("Network 192.168.0.0/31 too small to allocate from.");
        let v: serde_json::Value = serde_json::from_str(&e.to_json("1.1.0")).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"cniVersion":"1.1.0","code":7,"msg":"Invalid Configuration",
                "details":"Network 192.168.0.0/31 too small to allocate from."})
        );
        let plain = CniError::new(ErrorCode::IoFailure, "boom");
        assert!(!plain.to_json("1.0.0").contains("details"));
        assert_eq!(plain.to_string(), "boom");
        assert_eq!(
            e.to_string(),
            "Invalid Configuration; Network 192.168.0.0/31 too small to allocate from."
        );
    }

    #[test]
    fn parses_go_error_without_version() {
        let e: CniError = serde_json::from_str(r#"{"code":999,"msg":"x"}"#).unwrap();
        assert_eq!(e.code, 999);
        assert_eq!(e.details, "");
        let ctx = e.context("plugin type=\"bridge\"");
        assert_eq!(ctx.msg, "plugin type=\"bridge\": x");
        assert_eq!(CniError::unsupported("mode", "\"weird\"").code, 2);
        assert!(
            CniError::unsupported("mode", "\"weird\"")
                .msg
                .contains("mode")
        );
    }
}
