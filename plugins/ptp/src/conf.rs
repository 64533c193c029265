//! The ptp config: the reference's keys, validated before the kernel is
//! touched.

use rcni_attach::{AttachConf, LinkType};
use rcni_cni::CniError;
use rcni_cni::skel::CmdArgs;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    #[serde(default)]
    ip_masq_backend: Option<String>,
    #[serde(default)]
    mtu: i64,
    #[serde(default)]
    link_type: Option<String>,
}

/// The validated settings of one call.
#[derive(Debug)]
pub struct Conf {
    pub ip_masq: bool,
    pub ip_masq_backend: Option<String>,
    /// Both veth ends; `None` leaves the kernel's default.
    pub mtu: Option<u32>,
    /// `linkType`: veth (the reference's, the default) or netkit.
    pub link_type: LinkType,
    /// IPAM plugin type. ADD requires one (ptp routes the container's
    /// addresses); DEL, GC and STATUS go on without.
    pub ipam: Option<String>,
}

impl AttachConf for Conf {
    fn load(args: &CmdArgs) -> Result<Conf, CniError> {
        let raw: Raw = args.conf.plugin_conf()?;
        let mtu = rcni_attach::mtu(raw.mtu)?;
        Ok(Conf {
            ip_masq: args.conf.ip_masq,
            ip_masq_backend: rcni_attach::masq::backend_key(raw.ip_masq_backend)?,
            mtu,
            link_type: LinkType::from_config(raw.link_type.as_deref())?,
            ipam: rcni_attach::ipam_type(args),
        })
    }

    fn ipam(&self) -> Option<&str> {
        self.ipam.as_deref()
    }

    fn ip_masq(&self) -> bool {
        self.ip_masq
    }
}

impl Conf {
    /// The IPAM plugin, which ADD and CHECK cannot do without.
    pub fn required_ipam(&self) -> Result<&str, CniError> {
        self.ipam
            .as_deref()
            .ok_or_else(|| CniError::config("ptp needs an IPAM plugin: \"ipam\" has no \"type\""))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_defaults_and_validation() {
        let c = Conf::from_json(&json!({"cniVersion": "1.0.0", "name": "n", "type": "ptp",
            "IPMASQ": true, "mtu": 1400, "ipam": {"type": "host-local"}}))
        .unwrap();
        assert!(c.ip_masq, "keys match case-insensitively, as Go's decoder");
        assert_eq!(c.mtu, Some(1400));
        assert_eq!(c.required_ipam().unwrap(), "host-local");

        let c =
            Conf::from_json(&json!({"cniVersion": "1.0.0", "name": "n", "type": "ptp"})).unwrap();
        assert!(!c.ip_masq && c.mtu.is_none() && c.ipam.is_none());
        assert_eq!(c.link_type, LinkType::Veth);
        let c = Conf::from_json(
            &json!({"cniVersion": "1.0.0", "name": "n", "type": "ptp", "linkType": "netkit"}),
        )
        .unwrap();
        assert_eq!(c.link_type, LinkType::Netkit);
        assert_eq!(c.required_ipam().unwrap_err().code, 7);

        for (bad, code) in [
            (json!({"mtu": -1}), 2),
            (json!({"ipMasqBackend": "ebpf"}), 2),
            (json!({"mtu": "x"}), 7),
            (json!({"linkType": "macvlan"}), 2),
        ] {
            let mut v = json!({"cniVersion": "1.0.0", "name": "n", "type": "ptp"});
            v.as_object_mut()
                .unwrap()
                .extend(bad.as_object().unwrap().clone());
            assert_eq!(Conf::from_json(&v).unwrap_err().code, code, "{bad}");
        }
    }
}
