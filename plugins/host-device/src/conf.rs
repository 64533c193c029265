//! The host-device config: which device (`device`, `hwaddr`, `kernelpath`,
//! `pciBusID`, or the `deviceID` capability), optional IPAM, and
//! `useInterfaceNetwork`.

use rcni_attach::AttachConf;
use rcni_cni::CniError;
use rcni_cni::skel::CmdArgs;
use rcni_netlink::MacAddr;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
struct Raw {
    #[serde(default)]
    device: String,
    #[serde(default)]
    hwaddr: String,
    #[serde(default)]
    kernelpath: String,
    #[serde(default, rename = "pciBusID")]
    pci_bus_id: String,
    #[serde(default, rename = "useInterfaceNetwork")]
    use_interface_network: bool,
}

/// How the device is named, in the reference's order of precedence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    Device(String),
    HwAddr(MacAddr),
    KernelPath(String),
    /// A PCI address (`pciBusID`, or `deviceID` naming a PCI device) or an
    /// auxiliary device (`deviceID` only); which one is told by sysfs.
    DeviceId(String),
}

/// The validated settings of one call.
#[derive(Debug)]
pub struct Conf {
    pub selector: Selector,
    /// IPAM plugin type; optional for host-device.
    pub ipam: Option<String>,
    /// `useInterfaceNetwork`: the device's addresses, routes and rules go
    /// with it into the container.
    pub use_interface_network: bool,
}

impl AttachConf for Conf {
    fn load(args: &CmdArgs) -> Result<Conf, CniError> {
        let raw: Raw = args.conf.plugin_conf()?;
        // The runtime's device (e.g. from a device plugin) overrides pciBusID.
        let device_id = args
            .conf
            .runtime_value::<String>("deviceID")?
            .filter(|d| !d.is_empty())
            .unwrap_or(raw.pci_bus_id);
        let selector = if !raw.device.is_empty() {
            Selector::Device(raw.device)
        } else if !raw.hwaddr.is_empty() {
            let mac = raw.hwaddr.parse().map_err(|_| {
                CniError::config(format!("failed to parse MAC address {:?}", raw.hwaddr))
            })?;
            Selector::HwAddr(mac)
        } else if !raw.kernelpath.is_empty() {
            Selector::KernelPath(raw.kernelpath)
        } else if !device_id.is_empty() {
            Selector::DeviceId(device_id)
        } else {
            return Err(CniError::config(
                "specify either \"device\", \"hwaddr\", \"kernelpath\" or \"pciBusID\"",
            ));
        };
        Ok(Conf {
            selector,
            ipam: rcni_attach::ipam_type(args),
            use_interface_network: raw.use_interface_network,
        })
    }

    fn ipam(&self) -> Option<&str> {
        self.ipam.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A host-device config with `extra` keys.
    fn load(extra: serde_json::Value) -> Result<Conf, CniError> {
        let mut c = json!({"cniVersion": "1.0.0", "name": "n", "type": "host-device"});
        c.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        Conf::from_json(&c)
    }

    #[test]
    fn selector_precedence_as_the_reference() {
        let all = json!({"device": "eth1", "hwaddr": "0a:00:00:00:00:01",
            "kernelpath": "/sys/devices/x", "pciBusID": "0000:04:00.1"});
        assert_eq!(load(all).unwrap().selector, Selector::Device("eth1".into()));
        let c =
            load(json!({"HWADDR": "0A:00:00:00:00:01", "kernelpath": "/sys/devices/x"})).unwrap();
        assert_eq!(
            c.selector,
            Selector::HwAddr("0a:00:00:00:00:01".parse().unwrap())
        );
        let c = load(json!({"kernelpath": "/sys/devices/x", "pciBusID": "0000:04:00.1"})).unwrap();
        assert_eq!(c.selector, Selector::KernelPath("/sys/devices/x".into()));
        let c = load(json!({"pciBusID": "0000:04:00.1"})).unwrap();
        assert_eq!(c.selector, Selector::DeviceId("0000:04:00.1".into()));
        let c = load(json!({"pciBusID": "0000:04:00.1",
            "runtimeConfig": {"deviceID": "0000:05:00.2"}}))
        .unwrap();
        assert_eq!(
            c.selector,
            Selector::DeviceId("0000:05:00.2".into()),
            "the capability overrides pciBusID"
        );
        assert!(c.ipam.is_none(), "IPAM is optional");
        assert!(!c.use_interface_network);
        let c = load(json!({"device": "eth1", "useInterfaceNetwork": true})).unwrap();
        assert!(c.use_interface_network);
    }

    #[test]
    fn errors() {
        let e = load(json!({})).unwrap_err();
        assert_eq!(e.code, 7);
        assert!(e.msg.contains("specify either"), "{}", e.msg);
        assert_eq!(load(json!({"hwaddr": "nope"})).unwrap_err().code, 7);
        assert_eq!(load(json!({"device": 5})).unwrap_err().code, 7);
    }
}
