//! `CNI_ARGS`: `K=V;K=V`, with Go's `IgnoreUnknown` rule.

use crate::error::{CniError, ErrorCode};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniArgs {
    pairs: Vec<(String, String)>,
}

impl CniArgs {
    /// Splits `CNI_ARGS`. A pair without `=` is an error (code 4, it is an
    /// environment variable); empty pairs (a trailing `;`) are skipped and a
    /// value may itself contain `=`, both of which Go rejects: accepting more
    /// breaks nothing that works with the reference.
    pub fn parse(s: &str) -> Result<CniArgs, CniError> {
        let mut pairs = Vec::new();
        for pair in s.split(';').filter(|p| !p.trim().is_empty()) {
            let Some((k, v)) = pair.split_once('=') else {
                return Err(CniError::new(
                    ErrorCode::InvalidEnvironmentVariables,
                    format!("ARGS: invalid pair {pair:?}"),
                ));
            };
            pairs.push((k.to_string(), v.to_string()));
        }
        Ok(CniArgs { pairs })
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

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// `IgnoreUnknown` parsed as Go's strconv.ParseBool.
    pub fn ignore_unknown(&self) -> bool {
        matches!(
            self.get("IgnoreUnknown"),
            Some("1" | "t" | "T" | "true" | "TRUE" | "True")
        )
    }

    /// Errors (code 4) on keys the plugin does not know, unless
    /// `IgnoreUnknown` is true, like Go's `types.LoadArgs`.
    pub fn check_known(&self, known: &[&str]) -> Result<(), CniError> {
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
        )
        .unwrap();
        assert_eq!(a.get("K8S_POD_NAME"), Some("web-0"));
        assert!(a.ignore_unknown());
        assert!(a.check_known(&["IP"]).is_ok());
    }

    #[test]
    fn unknown_keys_need_ignore_unknown() {
        let a = CniArgs::parse("IP=10.0.0.5;FOO=bar").unwrap();
        assert!(a.check_known(&["IP", "FOO"]).is_ok());
        let e = a.check_known(&["IP"]).unwrap_err();
        assert_eq!(e.code, 4);
        assert_eq!(e.msg, r#"ARGS: unknown args ["FOO"]"#);
        for off in [
            "IgnoreUnknown=0",
            "IgnoreUnknown=false",
            "IgnoreUnknown=yes",
        ] {
            let a = CniArgs::parse(&format!("{off};FOO=1")).unwrap();
            assert!(a.check_known(&[]).is_err(), "{off}");
        }
        for on in [
            "IgnoreUnknown=true",
            "IgnoreUnknown=T",
            "IgnoreUnknown=True",
        ] {
            let a = CniArgs::parse(&format!("{on};FOO=1")).unwrap();
            assert!(a.check_known(&[]).is_ok(), "{on}");
        }
    }

    #[test]
    fn edge_cases() {
        assert!(CniArgs::parse("").unwrap().is_empty());
        let a = CniArgs::parse("A=1;;B=x=y;").unwrap();
        assert_eq!(a.get("B"), Some("x=y"));
        assert_eq!(a.pairs().len(), 2);
        assert_eq!(CniArgs::parse("A=1;A=2").unwrap().get("A"), Some("2"));
        assert_eq!(CniArgs::parse("A=").unwrap().get("A"), Some(""));
        let e = CniArgs::parse("A=1;novalue").unwrap_err();
        assert_eq!(e.code, 4);
        assert!(e.msg.contains("novalue"));
    }
}
