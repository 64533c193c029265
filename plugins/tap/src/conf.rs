//! The tap config: the reference's keys (v1.4.0+), validated before the
//! kernel is touched, and the device they describe.

use rcni_attach::AttachConf;
use rcni_cni::CniError;
use rcni_cni::skel::CmdArgs;
use rcni_netlink::MacAddr;
use rcni_netlink::tuntap::{IFF_MULTI_QUEUE, IFF_NO_PI, IFF_TAP, IFF_VNET_HDR, TapSpec};
use serde::Deserialize;

/// `IFF_TUN_EXCL`: TUNSETIFF on an existing device's name fails (EBUSY)
/// instead of attaching to that device. The kernel does not keep it as a
/// device flag, so nothing of it shows afterwards.
const IFF_TUN_EXCL: u16 = 0x8000;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    #[serde(default)]
    multi_queue: bool,
    #[serde(default)]
    mtu: i64,
    #[serde(default)]
    mac: String,
    #[serde(default)]
    owner: Option<u32>,
    #[serde(default)]
    group: Option<u32>,
    #[serde(default)]
    selinux_context: String,
    #[serde(default)]
    bridge: String,
}

/// The validated settings of one call.
#[derive(Debug)]
pub struct Conf {
    pub multi_queue: bool,
    /// `None` leaves the kernel's default (1500).
    pub mtu: Option<u32>,
    /// The config's `mac`, overridden by CNI_ARGS `MAC`, overridden by
    /// `runtimeConfig.mac` (the reference's order). Read by ADD and CHECK
    /// only: DEL needs no MAC and does not fail on a bad one.
    pub mac: Option<MacAddr>,
    pub owner: Option<u32>,
    pub group: Option<u32>,
    /// The SELinux label the device is created under.
    pub selinux_context: Option<String>,
    /// A bridge in the container's namespace the tap becomes a port of.
    pub bridge: Option<String>,
    /// `None`: an L2-only tap, brought up without addresses.
    pub ipam: Option<String>,
}

impl AttachConf for Conf {
    fn load(args: &CmdArgs) -> Result<Conf, CniError> {
        let raw: Raw = args.conf.plugin_conf()?;
        let mtu = rcni_attach::mtu(raw.mtu)?;
        let mut mac = raw.mac;
        let mut parsed = None;
        if args.strict_args() {
            // The reference's LoadArgs: a malformed pair, or an unknown key
            // without IgnoreUnknown, fails ADD and CHECK (code 4).
            let env = args.env_args()?;
            env.check_known(&["MAC"])?;
            if let Some(m) = env.get("MAC").filter(|m| !m.is_empty()) {
                mac = m.to_string();
            }
            if let Some(m) = args
                .conf
                .runtime_value::<String>("mac")?
                .filter(|m| !m.is_empty())
            {
                mac = m;
            }
            if !mac.is_empty() {
                parsed = Some(mac.parse::<MacAddr>().map_err(|_| {
                    CniError::config(format!(
                        "invalid args {mac} for MAC addr: address {mac}: invalid MAC address"
                    ))
                })?);
            }
        }
        let non_empty = |s: String| (!s.is_empty()).then_some(s);
        Ok(Conf {
            multi_queue: raw.multi_queue,
            mtu,
            mac: parsed,
            owner: raw.owner,
            group: raw.group,
            selinux_context: non_empty(raw.selinux_context),
            bridge: non_empty(raw.bridge),
            ipam: rcni_attach::ipam_type(args),
        })
    }

    fn ipam(&self) -> Option<&str> {
        self.ipam.as_deref()
    }
}

impl Conf {
    /// The device to create, named `name`. Its flags are the reference's,
    /// which depend on how it makes the device: with an owner and a group
    /// (and no SELinux label) through its netlink library, with a virtio-net
    /// header and, multi-queue, without packet information; otherwise
    /// through `ip tuntap add`, without packet information and without a
    /// virtio-net header.
    pub fn tap_spec(&self, name: &str) -> TapSpec {
        let netlink_path =
            self.selinux_context.is_none() && self.owner.is_some() && self.group.is_some();
        let mut flags = IFF_TAP | IFF_TUN_EXCL;
        flags |= match (netlink_path, self.multi_queue) {
            (true, false) => IFF_VNET_HDR,
            (true, true) => IFF_VNET_HDR | IFF_MULTI_QUEUE | IFF_NO_PI,
            (false, false) => IFF_NO_PI,
            (false, true) => IFF_NO_PI | IFF_MULTI_QUEUE,
        };
        TapSpec {
            name: name.to_string(),
            flags,
            owner: self.owner,
            group: self.group,
        }
    }

    /// CHECK: the device's settings against the config's.
    pub fn tap_matches(&self, info: &rcni_netlink::tuntap::TunInfo) -> Result<(), String> {
        let want = self.tap_spec("");
        let checks = [
            ("type tap", info.tap, true),
            ("multi_queue", info.multi_queue, self.multi_queue),
            ("vnet_hdr", info.vnet_hdr, want.flags & IFF_VNET_HDR != 0),
            ("pi", info.pi, want.flags & IFF_NO_PI == 0),
        ];
        for (what, got, want) in checks {
            if got != want {
                return Err(format!("{what} is {got}, configured {want}"));
            }
        }
        if self.owner.is_some() && info.owner != self.owner {
            return Err(format!(
                "owner is {:?}, configured {:?}",
                info.owner, self.owner
            ));
        }
        if self.group.is_some() && info.group != self.group {
            return Err(format!(
                "group is {:?}, configured {:?}",
                info.group, self.group
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcni_cni::args::CniArgs;
    use serde_json::{Value, json};

    fn load(conf: Value, cni_args: &str) -> Result<Conf, CniError> {
        let mut args = CmdArgs::for_conf(&conf)?;
        args.args = CniArgs::parse(cni_args);
        Conf::load(&args)
    }

    fn base() -> Value {
        json!({"cniVersion": "1.0.0", "name": "n", "type": "tap"})
    }

    #[test]
    fn keys_and_defaults() {
        let c = load(base(), "").unwrap();
        assert_eq!(
            (c.multi_queue, c.mtu, c.mac, c.owner, c.group),
            (false, None, None, None, None)
        );
        assert_eq!((c.selinux_context, c.bridge, c.ipam), (None, None, None));

        let c = load(
            json!({"cniVersion": "1.0.0", "name": "n", "type": "tap", "MultiQueue": true,
                "mtu": 9000, "mac": "02:00:00:00:00:01", "owner": 1000, "group": 100,
                "selinuxContext": "system_u:system_r:container_t:s0", "bridge": "br0",
                "ipam": {"type": "static"}}),
            "",
        )
        .unwrap();
        assert!(c.multi_queue);
        assert_eq!(c.mtu, Some(9000));
        assert_eq!(c.mac.unwrap().to_string(), "02:00:00:00:00:01");
        assert_eq!((c.owner, c.group), (Some(1000), Some(100)));
        assert_eq!(c.bridge.as_deref(), Some("br0"));
        assert_eq!(c.ipam.as_deref(), Some("static"));
    }

    #[test]
    fn mac_precedence_config_then_cni_args_then_runtime_config() {
        let mut c = base();
        c["mac"] = json!("02:00:00:00:00:01");
        let mac = |c: &Value, a: &str| load(c.clone(), a).unwrap().mac.unwrap().to_string();
        assert_eq!(mac(&c, ""), "02:00:00:00:00:01");
        assert_eq!(mac(&c, "MAC=02:00:00:00:00:02"), "02:00:00:00:00:02");
        assert_eq!(mac(&c, "MAC="), "02:00:00:00:00:01", "empty is unset");
        c["runtimeConfig"] = json!({"mac": "02:00:00:00:00:03"});
        assert_eq!(mac(&c, "MAC=02:00:00:00:00:02"), "02:00:00:00:00:03");
    }

    #[test]
    fn bad_values() {
        let mut c = base();
        c["mac"] = json!("not-a-mac");
        let e = load(c, "").unwrap_err();
        assert_eq!(e.code, 7);
        assert!(e.msg.starts_with("invalid args not-a-mac for MAC addr"));
        for (k, v) in [
            ("owner", json!(-1)),
            ("group", json!("x")),
            ("mtu", json!(70000)),
        ] {
            let mut c = base();
            c[k] = v;
            assert!(load(c.clone(), "").is_err(), "{c}");
        }
        // CNI_ARGS as Go's LoadArgs reads them.
        assert_eq!(load(base(), "FOO=1").unwrap_err().code, 4);
        assert!(load(base(), "IgnoreUnknown=1;FOO=1").is_ok());
        assert_eq!(load(base(), "none").unwrap_err().code, 4);
    }

    #[test]
    fn flags_follow_the_references_two_paths() {
        let spec = |extra: Value| {
            let mut c = base();
            for (k, v) in extra.as_object().unwrap() {
                c[k] = v.clone();
            }
            load(c, "").unwrap().tap_spec("t").flags & !IFF_TUN_EXCL
        };
        assert_eq!(spec(json!({})), IFF_TAP | IFF_NO_PI);
        assert_eq!(
            spec(json!({"multiQueue": true, "owner": 0})),
            IFF_TAP | IFF_NO_PI | IFF_MULTI_QUEUE
        );
        assert_eq!(
            spec(json!({"owner": 0, "group": 0})),
            IFF_TAP | IFF_VNET_HDR
        );
        assert_eq!(
            spec(json!({"owner": 0, "group": 0, "multiQueue": true})),
            IFF_TAP | IFF_VNET_HDR | IFF_NO_PI | IFF_MULTI_QUEUE
        );
        assert_eq!(
            spec(json!({"owner": 0, "group": 0, "selinuxContext": "x"})),
            IFF_TAP | IFF_NO_PI
        );
    }
}
