//! The tuning config: the reference's keys (`sysctl`, `mac`, `mtu`,
//! `promisc`, `allmulti`, `txQLen`, `dataDir`) with its override order:
//! CNI_ARGS `MAC`, then `runtimeConfig.mac`, then `args.cni.*` (highest).

use rcni_cni::CniError;
use rcni_cni::skel::CmdArgs;
use rcni_netlink::MacAddr;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Where interface backups live (the reference's path, on tmpfs so a
/// reboot forgets them with the interfaces).
pub const DEFAULT_DATA_DIR: &str = "/run/cni/tuning";
/// The node's sysctl allowlist (one regular expression per line); no file
/// allows every `net.*` sysctl.
pub const ALLOWLIST: &str = "/etc/cni/tuning/allowlist.conf";

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    #[serde(default)]
    data_dir: String,
    #[serde(default)]
    sysctl: BTreeMap<String, String>,
    #[serde(default)]
    mac: String,
    #[serde(default)]
    promisc: bool,
    #[serde(default)]
    mtu: i64,
    #[serde(default)]
    allmulti: Option<bool>,
    #[serde(default, rename = "txQLen")]
    tx_qlen: Option<i64>,
}

/// `args.cni`: the same settings per attachment.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ArgsCni {
    #[serde(default)]
    sysctl: Option<BTreeMap<String, String>>,
    #[serde(default)]
    mac: Option<String>,
    #[serde(default)]
    promisc: Option<bool>,
    #[serde(default)]
    mtu: Option<i64>,
    #[serde(default)]
    allmulti: Option<bool>,
    #[serde(default, rename = "txQLen")]
    tx_qlen: Option<i64>,
}

/// The validated settings of one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conf {
    pub data_dir: PathBuf,
    /// Keys as configured (with `IFNAME`), values as written.
    pub sysctl: BTreeMap<String, String>,
    /// The MAC as configured (the result reports this string) and parsed.
    pub mac: Option<(String, MacAddr)>,
    pub promisc: bool,
    pub mtu: Option<u32>,
    pub allmulti: Option<bool>,
    pub txqlen: Option<u32>,
}

fn mac(s: &str) -> Result<(String, MacAddr), CniError> {
    let m: MacAddr = s
        .parse()
        .map_err(|_| CniError::config(format!("invalid args {s} for MAC addr")))?;
    Ok((s.to_string(), m))
}

fn non_negative(key: &str, v: i64) -> Result<Option<u32>, CniError> {
    match v {
        0 => Ok(None),
        1..=0xffff_ffff => Ok(Some(v as u32)),
        _ => Err(CniError::unsupported(key, v)),
    }
}

impl Conf {
    pub fn load(args: &CmdArgs) -> Result<Conf, CniError> {
        let raw: Raw = args.conf.plugin_conf()?;
        let mut mac_s = raw.mac;
        // ADD and CHECK fail on a malformed CNI_ARGS as the reference's
        // LoadArgs; DEL and GC restore from the backup and need no MAC, so
        // they do not stop there (the reference's DEL does).
        if args.strict_args()
            && let Some(m) = args.args.strict()?.get("MAC").filter(|m| !m.is_empty())
        {
            mac_s = m.to_string();
        }
        if let Some(m) = args
            .conf
            .runtime_value::<String>("mac")?
            .filter(|m| !m.is_empty())
        {
            mac_s = m;
        }
        let a: ArgsCni = match args.conf.args.as_ref().and_then(|a| a.get("cni")) {
            Some(v) => rcni_cni::ci::from_value(v.clone())
                .map_err(|e| CniError::config(format!("invalid args.cni: {e}")))?,
            None => ArgsCni::default(),
        };
        let mut sysctl = raw.sysctl;
        if let Some(more) = a.sysctl {
            sysctl.extend(more);
        }
        if let Some(m) = a.mac {
            mac_s = m;
        }
        let promisc = a.promisc.unwrap_or(raw.promisc);
        let mtu = non_negative("mtu", a.mtu.unwrap_or(raw.mtu))?;
        let allmulti = a.allmulti.or(raw.allmulti);
        let txqlen = match a.tx_qlen.or(raw.tx_qlen) {
            None => None,
            Some(q @ 0..=0xffff_ffff) => Some(q as u32),
            Some(q) => return Err(CniError::unsupported("txQLen", q)),
        };
        let data_dir = if raw.data_dir.is_empty() {
            PathBuf::from(DEFAULT_DATA_DIR)
        } else {
            PathBuf::from(raw.data_dir)
        };
        Ok(Conf {
            data_dir,
            sysctl,
            mac: if mac_s.is_empty() {
                None
            } else {
                Some(mac(&mac_s)?)
            },
            promisc,
            mtu,
            allmulti,
            txqlen,
        })
    }

    /// Whether any interface attribute changes (and so needs a backup).
    pub fn changes_link(&self) -> bool {
        self.mac.is_some()
            || self.promisc
            || self.mtu.is_some()
            || self.allmulti.is_some()
            || self.txqlen.is_some()
    }

    /// The sysctls with `IFNAME` replaced: `(configured key, real key,
    /// value)`. Keys outside `net.*` are refused (code 7), as are keys
    /// the node's allowlist does not allow.
    pub fn sysctls(
        &self,
        ifname: &str,
        allowlist: Option<&[String]>,
    ) -> Result<Vec<(String, String, String)>, CniError> {
        let mut out = Vec::new();
        for (key, value) in &self.sysctl {
            let real = key.replace("IFNAME", ifname);
            rcni_netlink::sysctl::key_path(&real)
                .map_err(|_| CniError::config(format!("invalid net sysctl key: {key:?}")))?;
            if let Some(patterns) = allowlist {
                allowed(key, &real, patterns)?;
            }
            out.push((key.clone(), real, value.clone()));
        }
        Ok(out)
    }
}

/// Checks a sysctl against the allowlist's regular expressions (matched
/// anywhere in the key, as Go's `regexp.MatchString`); the key as
/// configured or with IFNAME replaced may match.
fn allowed(key: &str, real: &str, patterns: &[String]) -> Result<(), CniError> {
    for p in patterns {
        let re = regex_lite::Regex::new(p).map_err(|e| {
            CniError::config(format!(
                "invalid regular expression {p:?} in {ALLOWLIST}: {e}"
            ))
        })?;
        if re.is_match(key) || re.is_match(real) {
            return Ok(());
        }
    }
    Err(CniError::config(format!(
        "Sysctl {key} is not allowed. Only the following sysctls are allowed: {patterns:?}"
    )))
}

/// The allowlist's patterns (blank lines and `#` comments skipped), or
/// `None` when the file does not exist.
pub fn read_allowlist(path: &std::path::Path) -> Result<Option<Vec<String>>, CniError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from)
                .collect(),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(CniError::new(
            rcni_cni::ErrorCode::IoFailure,
            format!("read {}: {e}", path.display()),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcni_cni::skel::Command;
    use serde_json::json;

    fn load(v: serde_json::Value, cni_args: &str) -> Result<Conf, CniError> {
        let mut a = CmdArgs::for_conf(&v)?;
        a.args = rcni_cni::CniArgs::parse(cni_args);
        Conf::load(&a)
    }

    fn base() -> serde_json::Value {
        json!({"cniVersion": "1.0.0", "name": "n", "type": "tuning"})
    }

    #[test]
    fn defaults_and_keys() {
        let c = load(base(), "").unwrap();
        assert_eq!(c.data_dir, PathBuf::from(DEFAULT_DATA_DIR));
        assert!(!c.changes_link());
        let mut v = base();
        v["mtu"] = json!(1400);
        v["txQLen"] = json!(0);
        v["allmulti"] = json!(false);
        v["sysctl"] = json!({"net.ipv4.conf.IFNAME.arp_filter": "1"});
        let c = load(v, "").unwrap();
        assert_eq!(
            (c.mtu, c.txqlen, c.allmulti),
            (Some(1400), Some(0), Some(false))
        );
        assert!(c.changes_link());
        let s = c.sysctls("eth1", None).unwrap();
        assert_eq!(s[0].1, "net.ipv4.conf.eth1.arp_filter");
    }

    #[test]
    fn mac_override_order() {
        let mut v = base();
        v["mac"] = json!("02:00:00:00:00:01");
        assert_eq!(
            load(v.clone(), "").unwrap().mac.unwrap().0,
            "02:00:00:00:00:01"
        );
        assert_eq!(
            load(v.clone(), "IgnoreUnknown=1;MAC=02:00:00:00:00:02")
                .unwrap()
                .mac
                .unwrap()
                .0,
            "02:00:00:00:00:02"
        );
        v["runtimeConfig"] = json!({"mac": "02:00:00:00:00:03"});
        assert_eq!(
            load(v.clone(), "MAC=02:00:00:00:00:02")
                .unwrap()
                .mac
                .unwrap()
                .0,
            "02:00:00:00:00:03"
        );
        v["args"] = json!({"cni": {"mac": "02:00:00:00:00:04", "mtu": 1300, "sysctl": {"net.core.somaxconn": "10"}}});
        let c = load(v.clone(), "").unwrap();
        assert_eq!(c.mac.unwrap().0, "02:00:00:00:00:04");
        assert_eq!(c.mtu, Some(1300));
        assert_eq!(c.sysctl["net.core.somaxconn"], "10");
        v["mac"] = json!("nonsense");
        v.as_object_mut().unwrap().remove("args");
        v.as_object_mut().unwrap().remove("runtimeConfig");
        assert_eq!(load(v, "").unwrap_err().code, 7);
    }

    /// The reference's LoadArgs fails ADD and CHECK on a pair without `=`
    /// (code 4 here); DEL and GC restore from the backup and must not stop
    /// there, and need no MAC.
    #[test]
    fn malformed_cni_args_fail_add_and_check_only() {
        for cmd in [Command::Add, Command::Check, Command::Del, Command::Gc] {
            for cni_args in ["none", "MAC=02:00:00:00:00:02;none"] {
                let mut a = CmdArgs::for_conf(&base()).unwrap();
                a.command = cmd;
                a.args = rcni_cni::CniArgs::parse(cni_args);
                match cmd {
                    Command::Add | Command::Check => {
                        let e = Conf::load(&a).unwrap_err();
                        assert_eq!(
                            (e.code, e.msg.as_str()),
                            (4, r#"ARGS: invalid pair "none""#),
                            "{cmd:?}"
                        );
                    }
                    _ => assert_eq!(Conf::load(&a).unwrap().mac, None, "{cmd:?}"),
                }
            }
        }
    }

    #[test]
    fn sysctl_validation_and_allowlist() {
        let mut v = base();
        v["sysctl"] = json!({"kernel.hostname": "x"});
        let c = load(v, "").unwrap();
        assert_eq!(c.sysctls("eth0", None).unwrap_err().code, 7);
        let mut v = base();
        v["sysctl"] = json!({"net.ipv4.conf.IFNAME.arp_filter": "1", "net.core.somaxconn": "5"});
        let c = load(v, "").unwrap();
        let list = vec![r"^net\.ipv4\.conf\.IFNAME\.[a-z_]*$".to_string()];
        let e = c.sysctls("eth0", Some(&list)).unwrap_err();
        assert!(e.msg.contains("net.core.somaxconn"), "{}", e.msg);
        let list = vec![
            r"^net\.ipv4\.conf\.IFNAME\.".to_string(),
            "somaxconn".to_string(),
        ];
        assert_eq!(c.sysctls("eth0", Some(&list)).unwrap().len(), 2);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("allowlist.conf");
        assert_eq!(read_allowlist(&p).unwrap(), None);
        std::fs::write(&p, "# comment\n\n^net\\.core\\.\n").unwrap();
        assert_eq!(
            read_allowlist(&p).unwrap().unwrap(),
            vec![r"^net\.core\.".to_string()]
        );
    }
}
