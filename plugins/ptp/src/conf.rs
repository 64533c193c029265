//! The ptp config: the reference's keys, validated before the kernel is
//! touched.

use rcni_cni::skel::CmdArgs;
use rcni_cni::{CniError, Dns};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    #[serde(default)]
    ip_masq: bool,
    #[serde(default)]
    ip_masq_backend: Option<String>,
    #[serde(default)]
    mtu: i64,
}

/// The validated settings of one call.
#[derive(Debug)]
pub struct Conf {
    pub ip_masq: bool,
    pub ip_masq_backend: Option<String>,
    /// Both veth ends; `None` leaves the kernel's default.
    pub mtu: Option<u32>,
    /// IPAM plugin type. ADD requires one (ptp routes the container's
    /// addresses); DEL, GC and STATUS go on without.
    pub ipam: Option<String>,
    /// `dns` of the config, when it sets anything: it replaces IPAM's.
    pub dns: Option<Dns>,
}

impl Conf {
    pub fn load(args: &CmdArgs) -> Result<Conf, CniError> {
        let raw: Raw = args.conf.plugin_conf()?;
        if !(0..=65535).contains(&raw.mtu) {
            return Err(CniError::unsupported("mtu", raw.mtu));
        }
        if let Some(b) = &raw.ip_masq_backend
            && b != "iptables"
            && b != "nftables"
        {
            return Err(CniError::unsupported("ipMasqBackend", format!("{b:?}")));
        }
        Ok(Conf {
            ip_masq: raw.ip_masq,
            ip_masq_backend: raw.ip_masq_backend,
            mtu: (raw.mtu > 0).then_some(raw.mtu as u32),
            ipam: rcni_attach::ipam_type(args),
            dns: args.conf.dns.clone().filter(|d| !d.is_empty()),
        })
    }

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
    use rcni_cni::{CniArgs, Command, NetConf};
    use serde_json::json;

    fn args(v: serde_json::Value) -> CmdArgs {
        let stdin = serde_json::to_vec(&v).unwrap();
        CmdArgs {
            command: Command::Add,
            container_id: "c".into(),
            netns: None,
            ifname: "eth0".into(),
            args: CniArgs::default(),
            args_raw: String::new(),
            path: vec![],
            conf: NetConf::parse(&stdin).unwrap(),
            stdin,
        }
    }

    #[test]
    fn keys_defaults_and_validation() {
        let c = Conf::load(&args(
            json!({"cniVersion": "1.0.0", "name": "n", "type": "ptp",
            "IPMASQ": true, "mtu": 1400, "ipam": {"type": "host-local"}, "dns": {}}),
        ))
        .unwrap();
        assert!(c.ip_masq, "keys match case-insensitively, as Go's decoder");
        assert_eq!(c.mtu, Some(1400));
        assert_eq!(c.required_ipam().unwrap(), "host-local");
        assert!(c.dns.is_none(), "an empty dns does not replace IPAM's");

        let c = Conf::load(&args(
            json!({"cniVersion": "1.0.0", "name": "n", "type": "ptp"}),
        ))
        .unwrap();
        assert!(!c.ip_masq && c.mtu.is_none() && c.ipam.is_none());
        assert_eq!(c.required_ipam().unwrap_err().code, 7);

        let e = Conf::load(&args(
            json!({"cniVersion": "1.0.0", "name": "n", "type": "ptp", "mtu": -1}),
        ))
        .unwrap_err();
        assert_eq!(e.code, 2);
        let e = Conf::load(&args(
            json!({"cniVersion": "1.0.0", "name": "n", "type": "ptp",
            "ipMasqBackend": "ebpf"}),
        ))
        .unwrap_err();
        assert!(e.code == 2 && e.msg.contains("ipMasqBackend"), "{e:?}");
        let e = Conf::load(&args(
            json!({"cniVersion": "1.0.0", "name": "n", "type": "ptp", "mtu": "x"}),
        ))
        .unwrap_err();
        assert_eq!(e.code, 7);
    }
}
