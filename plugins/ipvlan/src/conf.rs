//! The ipvlan config: the reference's keys (1.1.1's, plus `linkInContainer`
//! of later releases). Without `master`, a chained ipvlan takes the single
//! interface of `prevResult`, an unchained one the default route's
//! interface; without `ipam`, a chained one takes `prevResult`'s addresses.

use rcni_attach::AttachConf;
use rcni_attach::lower::{self, LowerConf};
use rcni_cni::skel::CmdArgs;
use rcni_cni::{CniError, CniResult};
use rcni_netlink::IpvlanMode;
use serde::Deserialize;

/// ipvlan's own keys, beside [`LowerConf`]'s.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    #[serde(default)]
    mode: String,
    #[serde(default)]
    mtu: i64,
}

/// The validated settings of one call.
#[derive(Debug)]
pub struct Conf {
    /// An empty master: see [`Conf::master_for_add`]; no IPAM: `prevResult`'s
    /// addresses.
    pub lower: LowerConf,
    pub mode: IpvlanMode,
    /// 0: the master's (the reference sends no MTU for 0 or less either).
    pub mtu: i64,
    /// The previous plugin's result, when chained.
    pub prev: Option<CniResult>,
}

const MODES: &[(&str, IpvlanMode)] = &[
    ("l2", IpvlanMode::L2),
    ("l3", IpvlanMode::L3),
    ("l3s", IpvlanMode::L3s),
];

impl AttachConf for Conf {
    fn load(args: &CmdArgs) -> Result<Conf, CniError> {
        let lower = LowerConf::load(args)?;
        let raw: Raw = args.conf.plugin_conf()?;
        Ok(Conf {
            lower,
            mode: lower::mode(&raw.mode, MODES)?,
            mtu: raw.mtu.max(0),
            prev: args.conf.prev_result()?,
        })
    }

    fn ipam(&self) -> Option<&str> {
        self.lower.ipam.as_deref()
    }
}

impl Conf {
    /// ADD's master: the configured one; else, chained, the single named
    /// interface of `prevResult`; else `None`, the default route's.
    pub fn master_for_add(&self) -> Result<Option<&str>, CniError> {
        if !self.lower.master.is_empty() {
            return Ok(Some(&self.lower.master));
        }
        let Some(prev) = &self.prev else {
            return Ok(None);
        };
        match prev.interfaces.as_slice() {
            [only] if !only.name.is_empty() => Ok(Some(&only.name)),
            _ => Err(CniError::config(
                "chained master failure. PrevResult lacks a single named interface",
            )),
        }
    }

    /// ADD without IPAM: `prevResult`, when it has addresses.
    pub fn prev_with_ips(&self) -> Option<&CniResult> {
        self.prev.as_ref().filter(|p| !p.ips.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_defaults_and_chaining() {
        let c = Conf::from_json(
            &json!({"cniVersion": "1.0.0", "name": "n", "type": "ipvlan",
            "master": "eth1", "mode": "l3s", "mtu": 1400, "linkInContainer": true,
            "ipam": {"type": "static"}}),
        )
        .unwrap();
        assert_eq!(
            (
                c.master_for_add().unwrap(),
                c.mode,
                c.mtu,
                c.lower.link_in_container
            ),
            (Some("eth1"), IpvlanMode::L3s, 1400, true)
        );
        let c = Conf::from_json(
            &json!({"cniVersion": "1.0.0", "name": "n", "type": "ipvlan", "mtu": -5}),
        )
        .unwrap();
        assert_eq!(
            (c.master_for_add().unwrap(), c.mode, c.mtu),
            (None, IpvlanMode::L2, 0)
        );
        assert!(c.prev_with_ips().is_none());

        let prev = json!({"cniVersion": "1.0.0",
            "interfaces": [{"name": "eth9", "sandbox": "/run/netns/x"}],
            "ips": [{"address": "10.1.0.5/24", "interface": 0}]});
        let c = Conf::from_json(
            &json!({"cniVersion": "1.0.0", "name": "n", "type": "ipvlan",
            "prevResult": prev}),
        )
        .unwrap();
        assert_eq!(c.master_for_add().unwrap(), Some("eth9"));
        assert_eq!(c.prev_with_ips().unwrap().ips.len(), 1);
        let two = json!({"cniVersion": "1.0.0", "interfaces": [{"name": "a"}, {"name": "b"}]});
        let c = Conf::from_json(
            &json!({"cniVersion": "1.0.0", "name": "n", "type": "ipvlan",
            "prevResult": two}),
        )
        .unwrap();
        assert_eq!(c.master_for_add().unwrap_err().code, 7);

        let e = Conf::from_json(
            &json!({"cniVersion": "1.0.0", "name": "n", "type": "ipvlan", "mode": "l4"}),
        )
        .unwrap_err();
        assert_eq!(e.code, 2);
    }
}
