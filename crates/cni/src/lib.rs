//! The CNI specification, with no syscalls: config and result types for
//! every spec version and the conversions between them, version negotiation,
//! error codes, `CNI_ARGS`, the plugin skeleton and delegation.

pub mod args;
pub mod ci;
pub mod error;
pub mod invoke;
pub mod rollback;
pub mod skel;
pub mod types;
pub mod version;

#[cfg(test)]
mod tests;

pub use args::CniArgs;
pub use error::first_error;
pub use error::{CniError, ErrorCode};
pub use skel::{About, CmdArgs, Command, Plugin};
pub use types::{CniResult, Dns, GcAttachment, Interface, IpConfig, NetConf, Route, subnet};

/// JSON indented with four spaces, as Go's `json.MarshalIndent(v, "", "    ")`
/// prints results and errors.
pub fn to_pretty_json(v: &serde_json::Value) -> String {
    use serde::Serialize;
    let mut buf = Vec::new();
    let fmt = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
    v.serialize(&mut ser).expect("a Value always serializes");
    String::from_utf8(buf).expect("serde_json writes UTF-8")
}
