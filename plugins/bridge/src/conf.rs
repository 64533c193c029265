//! The bridge config: every reference key, validated before the kernel is
//! touched.

use rcni_attach::AttachConf;
use rcni_cni::skel::CmdArgs;
use rcni_cni::{CniError, ErrorCode};
use rcni_netlink::MacAddr;
use serde::Deserialize;

fn default_bridge() -> String {
    "cni0".into()
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    #[serde(default = "default_bridge")]
    bridge: String,
    #[serde(default)]
    is_gateway: bool,
    #[serde(default)]
    is_default_gateway: bool,
    #[serde(default)]
    force_address: bool,
    #[serde(default)]
    ip_masq_backend: Option<String>,
    #[serde(default)]
    mtu: i64,
    #[serde(default)]
    hairpin_mode: bool,
    #[serde(default)]
    promisc_mode: bool,
    #[serde(default)]
    vlan: i64,
    #[serde(default)]
    vlan_trunk: Option<Vec<VlanTrunk>>,
    // False since upstream v1.8.0 ("complete vlan isolation"): a port with
    // `vlan` or `vlanTrunk` leaves the default VLAN; 1.1.1 to v1.7 kept it.
    #[serde(default)]
    preserve_default_vlan: bool,
    #[serde(default, rename = "macspoofchk")]
    mac_spoof_chk: bool,
    #[serde(default, rename = "enabledad")]
    enable_dad: bool,
    #[serde(default)]
    disable_container_interface: bool,
    #[serde(default)]
    port_isolation: bool,
    #[serde(default)]
    link_type: Option<String>,
}

#[derive(Debug, Deserialize)]
struct VlanTrunk {
    #[serde(default, rename = "minID")]
    min_id: Option<i64>,
    #[serde(default, rename = "maxID")]
    max_id: Option<i64>,
    #[serde(default)]
    id: Option<i64>,
}

/// The validated settings of one call.
#[derive(Debug)]
pub struct Conf {
    pub bridge: String,
    pub is_gateway: bool,
    pub is_default_gateway: bool,
    pub force_address: bool,
    pub ip_masq: bool,
    pub ip_masq_backend: Option<String>,
    pub mtu: Option<u32>,
    /// `linkType`: veth (the reference's, the default) or netkit.
    pub link_type: rcni_attach::LinkType,
    pub hairpin: bool,
    pub promisc: bool,
    /// Access VLAN (0: none).
    pub vlan: u16,
    /// Trunk VLANs, sorted and unique.
    pub trunk: Vec<u16>,
    /// `vlan` or any `vlanTrunk`, even `[]`: a bridge we create filters
    /// VLANs (the reference tests its trunk slice for nil).
    pub vlan_filtering: bool,
    pub preserve_default_vlan: bool,
    pub mac_spoof_chk: bool,
    pub enable_dad: bool,
    pub disable_container_interface: bool,
    pub port_isolation: bool,
    pub mac: Option<MacAddr>,
    /// IPAM plugin type; `None` is an L2-only attachment.
    pub ipam: Option<String>,
}

fn bad(msg: impl Into<String>) -> CniError {
    CniError::new(ErrorCode::InvalidNetworkConfig, msg)
}

fn vid(v: i64, what: &str) -> Result<u16, CniError> {
    if (1..=4094).contains(&v) {
        Ok(v as u16)
    } else {
        Err(bad(format!("incorrect trunk {what} parameter")))
    }
}

fn collect_trunk(trunk: &[VlanTrunk]) -> Result<Vec<u16>, CniError> {
    let mut out = std::collections::BTreeSet::new();
    for t in trunk {
        match (t.min_id, t.max_id) {
            (Some(lo), Some(hi)) => {
                let (lo, hi) = (vid(lo, "minID")?, vid(hi, "maxID")?);
                if hi < lo {
                    return Err(bad("minID is greater than maxID in trunk parameter"));
                }
                out.extend(lo..=hi);
            }
            (None, Some(_)) => {
                return Err(bad(
                    "minID and maxID should be configured simultaneously, minID is missing",
                ));
            }
            (Some(_), None) => {
                return Err(bad(
                    "minID and maxID should be configured simultaneously, maxID is missing",
                ));
            }
            (None, None) => {}
        }
        if let Some(id) = t.id {
            out.insert(vid(id, "id")?);
        }
    }
    Ok(out.into_iter().collect())
}

fn parse_mac(s: &str, source: &str) -> Result<MacAddr, CniError> {
    s.parse()
        .map_err(|_| bad(format!("invalid MAC address {s:?} in {source}")))
}

impl AttachConf for Conf {
    fn load(args: &CmdArgs) -> Result<Conf, CniError> {
        let raw: Raw = args.conf.plugin_conf()?;
        rcni_cni::types::validate_ifname(&raw.bridge)
            .map_err(|e| bad(format!("invalid bridge name {:?}: {}", raw.bridge, e.msg)))?;
        if !(0..=4094).contains(&raw.vlan) {
            return Err(bad(format!(
                "invalid VLAN ID {} (must be between 0 and 4094)",
                raw.vlan
            )));
        }
        // Both together since upstream v1.8.0: `vlan` is the trunk's
        // native (untagged) VLAN.
        let trunk = collect_trunk(raw.vlan_trunk.as_deref().unwrap_or_default())?;
        let mtu = rcni_attach::mtu(raw.mtu)?;
        if raw.hairpin_mode && raw.promisc_mode {
            return Err(bad(
                "cannot set hairpin mode and promiscuous mode at the same time",
            ));
        }
        let ipam = rcni_attach::ipam_type(args);
        if raw.disable_container_interface && ipam.is_some() {
            return Err(bad(
                "cannot use IPAM when DisableContainerInterface flag is set",
            ));
        }
        let ip_masq_backend = rcni_attach::masq::backend_key(raw.ip_masq_backend)?;
        // MAC: runtimeConfig > args.cni > CNI_ARGS, as the reference.
        // CNI_ARGS is read as Go's LoadArgs on ADD and CHECK only: DEL needs
        // no MAC, and a malformed CNI_ARGS must not stop its cleanup (the
        // reference's DEL fails there).
        let mut mac = None;
        if args.strict_args() {
            args.args.check_known(&["MAC"])?;
            if let Some(m) = args.args.get("MAC").filter(|m| !m.is_empty()) {
                mac = Some(parse_mac(m, "CNI_ARGS")?);
            }
        }
        if let Some(m) = args
            .conf
            .cni_arg::<String>("mac")?
            .filter(|m| !m.is_empty())
        {
            mac = Some(parse_mac(&m, "args.cni.mac")?);
        }
        if let Some(m) = args
            .conf
            .runtime_value::<String>("mac")?
            .filter(|m| !m.is_empty())
        {
            mac = Some(parse_mac(&m, "runtimeConfig.mac")?);
        }
        Ok(Conf {
            bridge: raw.bridge,
            is_gateway: raw.is_gateway || raw.is_default_gateway,
            is_default_gateway: raw.is_default_gateway,
            force_address: raw.force_address,
            ip_masq: args.conf.ip_masq,
            ip_masq_backend,
            mtu,
            link_type: rcni_attach::LinkType::from_config(raw.link_type.as_deref())?,
            hairpin: raw.hairpin_mode,
            promisc: raw.promisc_mode,
            vlan: raw.vlan as u16,
            trunk,
            vlan_filtering: raw.vlan != 0 || raw.vlan_trunk.is_some(),
            preserve_default_vlan: raw.preserve_default_vlan,
            mac_spoof_chk: raw.mac_spoof_chk,
            enable_dad: raw.enable_dad,
            disable_container_interface: raw.disable_container_interface,
            port_isolation: raw.port_isolation,
            mac,
            ipam,
        })
    }

    fn ipam(&self) -> Option<&str> {
        self.ipam.as_deref()
    }

    fn ip_masq(&self) -> bool {
        self.ip_masq
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn trunk(v: serde_json::Value) -> Result<Vec<u16>, CniError> {
        collect_trunk(&rcni_cni::ci::from_value::<Vec<VlanTrunk>>(v).unwrap())
    }

    fn load(extra: serde_json::Value) -> Result<Conf, CniError> {
        let mut c = json!({"cniVersion": "1.0.0", "name": "n", "type": "bridge"});
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        Conf::load(&CmdArgs::for_conf(&c).unwrap())
    }

    /// v1.8.0's VLAN changes: the default VLAN no longer preserved unless
    /// asked, `vlan` beside `vlanTrunk`, and any `vlanTrunk` (even empty)
    /// turning VLAN filtering on.
    #[test]
    fn vlan_defaults_as_v191() {
        let c = load(json!({"vlan": 100})).unwrap();
        assert!(!c.preserve_default_vlan && c.vlan_filtering);
        let c = load(json!({"vlan": 100, "preserveDefaultVlan": true})).unwrap();
        assert!(c.preserve_default_vlan);
        let c = load(json!({"vlan": 7, "vlanTrunk": [{"id": 100}]})).unwrap();
        assert_eq!((c.vlan, c.trunk), (7, vec![100]));
        let c = load(json!({"vlanTrunk": []})).unwrap();
        assert!(c.vlan_filtering && c.trunk.is_empty());
        let c = load(json!({"vlanTrunk": null})).unwrap();
        assert!(!c.vlan_filtering);
        assert!(!load(json!({})).unwrap().vlan_filtering);
    }

    #[test]
    fn vlan_trunk_rules() {
        assert_eq!(
            trunk(json!([{"minID": 5, "maxID": 7}, {"id": 3}, {"id": 6}])).unwrap(),
            [3, 5, 6, 7]
        );
        assert!(
            trunk(json!([{"minID": 7, "maxID": 5}]))
                .unwrap_err()
                .msg
                .contains("greater")
        );
        assert!(
            trunk(json!([{"maxID": 5}]))
                .unwrap_err()
                .msg
                .contains("minID is missing")
        );
        assert!(
            trunk(json!([{"minID": 5}]))
                .unwrap_err()
                .msg
                .contains("maxID is missing")
        );
        assert!(trunk(json!([{"id": 0}])).is_err());
        assert!(trunk(json!([{"id": 4095}])).is_err());
        assert!(trunk(json!([])).unwrap().is_empty());
        // Key case as Go accepts it.
        assert_eq!(trunk(json!([{"MinId": 1, "MAXID": 2}])).unwrap(), [1, 2]);
    }
}
