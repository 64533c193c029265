//! The macvlan config: the reference's keys (1.1.1's, plus `linkInContainer`
//! and `bcqueuelen` of later releases), validated before the kernel is
//! touched. The master and the MTU bound it sets are ADD's and CHECK's to
//! look up; DEL needs neither.

use rcni_attach::AttachConf;
use rcni_attach::lower::{self, LowerConf};
use rcni_cni::CniError;
use rcni_cni::skel::CmdArgs;
use rcni_netlink::{MacAddr, MacvlanMode};
use serde::Deserialize;

/// macvlan's own keys, beside [`LowerConf`]'s.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    #[serde(default)]
    mode: String,
    #[serde(default)]
    mtu: i64,
    #[serde(default)]
    mac: String,
    #[serde(default)]
    bcqueuelen: u32,
}

/// The validated settings of one call.
#[derive(Debug)]
pub struct Conf {
    pub lower: LowerConf,
    pub mode: MacvlanMode,
    /// The `mtu` key as given (0: the master's); bounded by the master's
    /// MTU at ADD.
    pub mtu: i64,
    /// `mac`, overridden by CNI_ARGS `MAC`, then by `runtimeConfig.mac`;
    /// parsed by ADD, the only command that uses it.
    pub mac: Option<String>,
    pub bc_queue_len: Option<u32>,
}

const MODES: &[(&str, MacvlanMode)] = &[
    ("bridge", MacvlanMode::Bridge),
    ("private", MacvlanMode::Private),
    ("vepa", MacvlanMode::Vepa),
    ("passthru", MacvlanMode::Passthru),
];

impl AttachConf for Conf {
    fn load(args: &CmdArgs) -> Result<Conf, CniError> {
        let lower = LowerConf::load(args)?;
        let raw: Raw = args.conf.plugin_conf()?;
        if raw.mtu < 0 {
            return Err(CniError::config(format!(
                "invalid MTU {}, must be [0, master MTU]",
                raw.mtu
            )));
        }
        let mut mac = Some(raw.mac).filter(|m| !m.is_empty());
        if let Some(m) = args.args.get("MAC").filter(|m| !m.is_empty()) {
            mac = Some(m.to_string());
        }
        if let Some(m) = args
            .conf
            .runtime_value::<String>("mac")?
            .filter(|m| !m.is_empty())
        {
            mac = Some(m);
        }
        Ok(Conf {
            lower,
            mode: lower::mode(&raw.mode, MODES)?,
            mtu: raw.mtu,
            mac,
            bc_queue_len: (raw.bcqueuelen > 0).then_some(raw.bcqueuelen),
        })
    }

    fn ipam(&self) -> Option<&str> {
        self.lower.ipam.as_deref()
    }
}

impl Conf {
    /// ADD: the MAC to give the link, if any.
    pub fn mac(&self) -> Result<Option<MacAddr>, CniError> {
        self.mac
            .as_deref()
            .map(|m| {
                m.parse()
                    .map_err(|_| CniError::config(format!("invalid args {m} for MAC addr")))
            })
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_defaults_and_validation() {
        let c = Conf::from_json(
            &json!({"cniVersion": "1.0.0", "name": "n", "type": "macvlan",
            "master": "eth1", "mode": "vepa", "MTU": 1400, "linkInContainer": true,
            "mac": "02:00:00:00:00:01", "bcqueuelen": 100, "ipam": {"type": "static"}}),
        )
        .unwrap();
        assert_eq!(
            (
                c.lower.master.as_str(),
                c.mode,
                c.mtu,
                c.lower.link_in_container
            ),
            ("eth1", MacvlanMode::Vepa, 1400, true)
        );
        assert_eq!(c.mac().unwrap(), Some("02:00:00:00:00:01".parse().unwrap()));
        assert_eq!(
            (c.bc_queue_len, c.lower.ipam.as_deref()),
            (Some(100), Some("static"))
        );

        let c = Conf::from_json(&json!({"cniVersion": "1.0.0", "name": "n", "type": "macvlan"}))
            .unwrap();
        assert_eq!(
            (c.lower.master.as_str(), c.mode, c.mtu),
            ("", MacvlanMode::Bridge, 0)
        );
        assert_eq!(
            (c.mac().unwrap(), c.lower.ipam, c.bc_queue_len),
            (None, None, None)
        );

        // runtimeConfig wins over the config's own key.
        let c = Conf::from_json(
            &json!({"cniVersion": "1.0.0", "name": "n", "type": "macvlan",
            "mac": "02:00:00:00:00:01", "runtimeConfig": {"mac": "02:00:00:00:00:02"}}),
        )
        .unwrap();
        assert_eq!(c.mac().unwrap(), Some("02:00:00:00:00:02".parse().unwrap()));
        let c = Conf::from_json(
            &json!({"cniVersion": "1.0.0", "name": "n", "type": "macvlan",
            "mac": "nonsense"}),
        )
        .unwrap();
        assert_eq!(c.mac().unwrap_err().code, 7);

        let e = Conf::from_json(
            &json!({"cniVersion": "1.0.0", "name": "n", "type": "macvlan", "mode": "source"}),
        )
        .unwrap_err();
        assert_eq!(e.code, 2);
        assert!(
            e.msg.contains("source") && e.msg.contains("mode"),
            "{}",
            e.msg
        );
        let e = Conf::from_json(
            &json!({"cniVersion": "1.0.0", "name": "n", "type": "macvlan", "mtu": -1}),
        )
        .unwrap_err();
        assert_eq!(e.code, 7);
    }
}
