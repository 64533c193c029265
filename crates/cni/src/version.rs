//! Spec versions, their ordering, and the negotiation rules of SPEC.md.

use crate::error::{CniError, ErrorCode};

/// Every spec version this project can read and write, oldest first.
pub const ALL: &[&str] = &[
    "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0",
];

/// The newest spec version implemented.
pub const CURRENT: &str = "1.1.0";

/// A config without `cniVersion` is 0.1.0 (`pkg/version/conf.go`).
pub const DEFAULT_CONFIG_VERSION: &str = "0.1.0";

/// Parses `MAJOR.MINOR.PATCH` (no pre-release suffix: no CNI version has one).
pub fn parse(v: &str) -> Result<(u64, u64, u64), CniError> {
    let bad = || {
        CniError::new(
            ErrorCode::DecodingFailure,
            format!("invalid version {v:?}: the version must be of the form X.Y.Z"),
        )
    };
    let mut parts = v.split('.');
    let mut next = || -> Result<u64, CniError> {
        let p = parts.next().ok_or_else(bad)?;
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        p.parse().map_err(|_| bad())
    };
    let out = (next()?, next()?, next()?);
    if parts.next().is_some() {
        return Err(bad());
    }
    Ok(out)
}

/// `a >= b` by semver precedence.
pub fn at_least(a: &str, b: &str) -> Result<bool, CniError> {
    Ok(parse(a)? >= parse(b)?)
}

/// The config's version must be one the plugin supports, string for string
/// (`pkg/version/reconcile.go`).
pub fn reconcile(config_version: &str, supported: &[&str]) -> Result<(), CniError> {
    if supported.contains(&config_version) {
        return Ok(());
    }
    let list: Vec<String> = supported.iter().map(|v| format!("{v:?}")).collect();
    Err(CniError::new(
        ErrorCode::IncompatibleCniVersion,
        "incompatible CNI versions",
    )
    .with_details(format!(
        "config is {config_version:?}, plugin supports [{}]",
        list.join(" ")
    )))
}

/// The version a runtime uses for a conflist: the highest of `cniVersion` and
/// `cniVersions` that this implementation knows (libcni drops newer ones).
pub fn negotiate_list_version(cni_version: &str, cni_versions: &[String]) -> Option<String> {
    std::iter::once(cni_version)
        .chain(cni_versions.iter().map(String::as_str))
        .filter_map(|v| parse(v).ok().map(|p| (p, v)))
        .filter(|(p, _)| *p <= parse(CURRENT).expect("CURRENT parses"))
        .max_by_key(|(p, _)| *p)
        .map(|(_, v)| v.to_string())
}

/// The result family a version's result is encoded in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResultFamily {
    /// 0.1.0 and 0.2.0: `ip4` / `ip6` objects.
    V020,
    /// 0.3.0, 0.3.1, 0.4.0: `ips[].version`, `interfaces`.
    V040,
    /// 1.0.0 and 1.1.0.
    V100,
}

pub fn result_family(v: &str) -> Result<ResultFamily, CniError> {
    match v {
        "0.1.0" | "0.2.0" => Ok(ResultFamily::V020),
        "0.3.0" | "0.3.1" | "0.4.0" => Ok(ResultFamily::V040),
        "1.0.0" | "1.1.0" => Ok(ResultFamily::V100),
        other => Err(CniError::new(
            ErrorCode::IncompatibleCniVersion,
            format!("unsupported CNI result version {other:?}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_order() {
        assert_eq!(parse("1.10.3").unwrap(), (1, 10, 3));
        for bad in [
            "",
            "1",
            "1.0",
            "1.0.0.0",
            "a.b.c",
            "1.0.x",
            "1..0",
            "-1.0.0",
            "1.0.0-rc1",
        ] {
            let e = parse(bad).unwrap_err();
            assert_eq!(e.code, 6, "{bad}");
        }
        assert!(at_least("0.4.0", "0.4.0").unwrap());
        assert!(at_least("1.0.0", "0.4.0").unwrap());
        assert!(!at_least("0.3.1", "0.4.0").unwrap());
        assert!(at_least("0.10.0", "0.4.0").unwrap());
    }

    #[test]
    fn reconcile_exact_match_only() {
        assert!(reconcile("0.3.1", ALL).is_ok());
        let e = reconcile("0.3.2", ALL).unwrap_err();
        assert_eq!(e.code, 1);
        assert_eq!(e.msg, "incompatible CNI versions");
        assert_eq!(
            e.details,
            r#"config is "0.3.2", plugin supports ["0.1.0" "0.2.0" "0.3.0" "0.3.1" "0.4.0" "1.0.0" "1.1.0"]"#
        );
    }

    #[test]
    fn list_version_picks_highest_known() {
        let vs = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(negotiate_list_version("0.4.0", &[]).unwrap(), "0.4.0");
        assert_eq!(
            negotiate_list_version("0.4.0", &vs(&["1.0.0", "1.1.0", "0.3.1"])).unwrap(),
            "1.1.0"
        );
        // Versions newer than ours are ignored, as libcni does.
        assert_eq!(
            negotiate_list_version("1.0.0", &vs(&["2.0.0", "1.5.0"])).unwrap(),
            "1.0.0"
        );
        assert_eq!(
            negotiate_list_version("", &vs(&["garbage", "0.3.1"])).unwrap(),
            "0.3.1"
        );
        assert!(negotiate_list_version("", &[]).is_none());
    }

    #[test]
    fn families() {
        assert_eq!(result_family("0.1.0").unwrap(), ResultFamily::V020);
        assert_eq!(result_family("0.3.0").unwrap(), ResultFamily::V040);
        assert_eq!(result_family("1.1.0").unwrap(), ResultFamily::V100);
        assert_eq!(result_family("0.5.0").unwrap_err().code, 1);
    }
}
