//! The vlan config: the reference's keys, validated before the kernel is
//! touched. The master's MTU bound is checked by ADD, which looks the master
//! up anyway; DEL does not need the master at all.

use rcni_attach::AttachConf;
use rcni_attach::lower::LowerConf;
use rcni_cni::CniError;
use rcni_cni::skel::CmdArgs;
use serde::Deserialize;

/// vlan's own keys, beside [`LowerConf`]'s.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    #[serde(default)]
    vlan_id: i64,
    #[serde(default)]
    mtu: i64,
}

/// The validated settings of one call.
#[derive(Debug)]
pub struct Conf {
    /// The master is never empty here.
    pub lower: LowerConf,
    pub vlan_id: u16,
    /// `None` leaves the kernel's default, the master's MTU.
    pub mtu: Option<u32>,
}

impl AttachConf for Conf {
    fn load(args: &CmdArgs) -> Result<Conf, CniError> {
        let lower = LowerConf::load(args)?;
        let raw: Raw = args.conf.plugin_conf()?;
        if lower.master.is_empty() {
            return Err(CniError::config(
                "\"master\" field is required. It specifies the host interface name to create the VLAN for",
            ));
        }
        if !(0..=4094).contains(&raw.vlan_id) {
            return Err(CniError::config(format!(
                "invalid VLAN ID {} (must be between 0 and 4094)",
                raw.vlan_id
            )));
        }
        // The veth plugins' bounds, but vlan's wording and code (a bad
        // vlan config is code 7, as the reference's loadConf error).
        let mtu = rcni_attach::mtu(raw.mtu).map_err(|_| {
            CniError::config(format!("invalid MTU {}, must be [0, master MTU]", raw.mtu))
        })?;
        Ok(Conf {
            lower,
            vlan_id: raw.vlan_id as u16,
            mtu,
        })
    }

    fn ipam(&self) -> Option<&str> {
        self.lower.ipam.as_deref()
    }
}

impl Conf {
    /// ADD: the MTU may not exceed the master's.
    pub fn check_mtu(&self, master_mtu: u32) -> Result<(), CniError> {
        match self.mtu {
            Some(m) if m > master_mtu => Err(CniError::config(format!(
                "invalid MTU {m}, must be [0, master MTU({master_mtu})]"
            ))),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_defaults_and_validation() {
        let c = Conf::from_json(&json!({"cniVersion": "1.0.0", "name": "n", "type": "vlan",
            "master": "eth1", "VLANID": 100, "mtu": 1400, "linkInContainer": true,
            "ipam": {"type": "static"}}))
        .unwrap();
        assert_eq!(
            (
                c.lower.master.as_str(),
                c.vlan_id,
                c.mtu,
                c.lower.link_in_container
            ),
            ("eth1", 100, Some(1400), true)
        );
        assert_eq!(c.lower.ipam.as_deref(), Some("static"));
        assert!(c.check_mtu(1500).is_ok());
        assert_eq!(c.check_mtu(1300).unwrap_err().code, 7);

        let c = Conf::from_json(
            &json!({"cniVersion": "1.0.0", "name": "n", "type": "vlan", "master": "eth1"}),
        )
        .unwrap();
        assert_eq!((c.vlan_id, c.mtu, c.lower.ipam), (0, None, None));

        for bad in [
            json!({"cniVersion": "1.0.0", "name": "n", "type": "vlan", "vlanId": 5}),
            json!({"cniVersion": "1.0.0", "name": "n", "type": "vlan", "master": "e", "vlanId": 4095}),
            json!({"cniVersion": "1.0.0", "name": "n", "type": "vlan", "master": "e", "vlanId": -1}),
            json!({"cniVersion": "1.0.0", "name": "n", "type": "vlan", "master": "e", "mtu": -1}),
        ] {
            assert_eq!(Conf::from_json(&bad).unwrap_err().code, 7, "{bad}");
        }
    }
}
