//! `CNI_ARGS`: `K=V;K=V`, with Go's `IgnoreUnknown` rule.
//!
//! The reference plugins parse CNI_ARGS only where they read it (Go's
//! `types.LoadArgs` in bridge, host-local, static and tuning; dhcp splits
//! it itself and skips what does not split), so a malformed value such as
//! `CNI_ARGS=none` (upstream's loopback suite) fails only those. Parsing
//! here never fails: the pairs that split are kept with the ones that did
//! not, and a plugin that reads CNI_ARGS asks for [`CniArgs::strict`] where
//! the reference would fail.

use crate::error::{CniError, ErrorCode};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniArgs {
    pairs: Vec<(String, String)>,
    /// The pairs without `=`, in order.
    invalid: Vec<String>,
}

impl CniArgs {
    /// Splits `CNI_ARGS`, keeping pairs without `=` aside for
    /// [`CniArgs::strict`]. Empty pairs (a trailing `;`) are skipped and a
    /// value may itself contain `=`, both of which Go rejects: accepting
    /// more breaks nothing that works with the reference.
    pub fn parse(s: &str) -> CniArgs {
        let mut args = CniArgs::default();
        for pair in s.split(';').filter(|p| !p.trim().is_empty()) {
            match pair.split_once('=') {
                Some((k, v)) => args.pairs.push((k.to_string(), v.to_string())),
                None => args.invalid.push(pair.to_string()),
            }
        }
        args
    }

    /// The args, or Go's `LoadArgs` error (code 4, it is an environment
    /// variable) for the first pair without `=`: what a plugin that reads
    /// CNI_ARGS answers on ADD and CHECK, as the reference does.
    pub fn strict(&self) -> Result<&CniArgs, CniError> {
        match self.invalid.first() {
            None => Ok(self),
            Some(pair) => Err(CniError::new(
                ErrorCode::InvalidEnvironmentVariables,
                format!("ARGS: invalid pair {pair:?}"),
            )),
        }
    }

    /// The pairs without `=`.
    pub fn invalid(&self) -> &[String] {
        &self.invalid
    }

    /// The last value given for `key` (case-sensitive, as Go's field lookup).
    pub fn get(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    pub fn pairs(&self) -> &[(String, String)] {
        &self.pairs
    }

    /// Nothing given, not even a malformed pair (Go's `LoadArgs` runs
    /// only for a non-empty CNI_ARGS).
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty() && self.invalid.is_empty()
    }

    /// `IgnoreUnknown` parsed as Go's strconv.ParseBool.
    pub fn ignore_unknown(&self) -> bool {
        matches!(
            self.get("IgnoreUnknown"),
            Some("1" | "t" | "T" | "true" | "TRUE" | "True")
        )
    }

    /// Errors (code 4) on a malformed pair ([`CniArgs::strict`]) and on
    /// keys the plugin does not know, unless `IgnoreUnknown` is true, like
    /// Go's `types.LoadArgs`.
    pub fn check_known(&self, known: &[&str]) -> Result<(), CniError> {
        self.strict()?;
        if self.ignore_unknown() {
            return Ok(());
        }
        let unknown: Vec<String> = self
            .pairs
            .iter()
            .filter(|(k, _)| k != "IgnoreUnknown" && !known.contains(&k.as_str()))
            .map(|(k, _)| format!("{k:?}"))
            .collect();
        if unknown.is_empty() {
            Ok(())
        } else {
            Err(CniError::new(
                ErrorCode::InvalidEnvironmentVariables,
                format!("ARGS: unknown args [{}]", unknown.join(" ")),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kubelet_args() {
        let a = CniArgs::parse(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u",
        );
        assert_eq!(a.get("K8S_POD_NAME"), Some("web-0"));
        assert!(a.ignore_unknown());
        assert!(a.check_known(&["IP"]).is_ok());
    }

    #[test]
    fn unknown_keys_need_ignore_unknown() {
        let a = CniArgs::parse("IP=10.0.0.5;FOO=bar");
        assert!(a.check_known(&["IP", "FOO"]).is_ok());
        let e = a.check_known(&["IP"]).unwrap_err();
        assert_eq!(e.code, 4);
        assert_eq!(e.msg, r#"ARGS: unknown args ["FOO"]"#);
        for off in [
            "IgnoreUnknown=0",
            "IgnoreUnknown=false",
            "IgnoreUnknown=yes",
        ] {
            let a = CniArgs::parse(&format!("{off};FOO=1"));
            assert!(a.check_known(&[]).is_err(), "{off}");
        }
        for on in [
            "IgnoreUnknown=true",
            "IgnoreUnknown=T",
            "IgnoreUnknown=True",
        ] {
            let a = CniArgs::parse(&format!("{on};FOO=1"));
            assert!(a.check_known(&[]).is_ok(), "{on}");
        }
    }

    #[test]
    fn edge_cases() {
        assert!(CniArgs::parse("").is_empty());
        let a = CniArgs::parse("A=1;;B=x=y;");
        assert_eq!(a.get("B"), Some("x=y"));
        assert_eq!(a.pairs().len(), 2);
        assert_eq!(CniArgs::parse("A=1;A=2").get("A"), Some("2"));
        assert_eq!(CniArgs::parse("A=").get("A"), Some(""));
        assert!(CniArgs::parse("A=1;;B=x=y;").strict().is_ok());
    }

    /// A pair without `=` (upstream's loopback suite runs with
    /// `CNI_ARGS=none`) does not fail the parse: the pairs that split stay
    /// readable, and `strict` (what ADD and CHECK of a plugin that reads
    /// CNI_ARGS use) gives Go's error, code 4.
    #[test]
    fn malformed_pairs_fail_only_strict_readers() {
        let a = CniArgs::parse("none");
        assert!(!a.is_empty());
        assert!(a.pairs().is_empty());
        assert_eq!(a.invalid(), ["none"]);
        let e = a.strict().unwrap_err();
        assert_eq!(e.code, 4);
        assert_eq!(e.msg, r#"ARGS: invalid pair "none""#);

        let a = CniArgs::parse("A=1;novalue;MAC=02:00:00:00:00:01;other");
        assert_eq!(a.get("A"), Some("1"));
        assert_eq!(a.get("MAC"), Some("02:00:00:00:00:01"));
        assert_eq!(a.get("novalue"), None);
        assert_eq!(a.invalid(), ["novalue", "other"]);
        let e = a.strict().unwrap_err();
        assert_eq!(e.code, 4);
        assert!(e.msg.contains("novalue"), "{}", e.msg);
        // LoadArgs reports a malformed pair before unknown keys, even with
        // IgnoreUnknown.
        let e = CniArgs::parse("IgnoreUnknown=1;FOO=1;bad")
            .check_known(&[])
            .unwrap_err();
        assert_eq!((e.code, e.msg.as_str()), (4, r#"ARGS: invalid pair "bad""#));
    }
}
