//! Finding a device's interface names from sysfs (`kernelpath`, `pciBusID`,
//! the `deviceID` capability) and whether a PCI device is bound to a
//! userspace (DPDK) driver.
//!
//! sysfs lists the interfaces of the namespace that mounted it: the plugin
//! runs in the node's mount namespace, so these are the node's; the names
//! are then looked up through netlink.

use std::io;
use std::path::{Path, PathBuf};

/// Drivers that hand a PCI device to userspace: such a device has no
/// kernel interface to move (DPDK mode).
const USERSPACE_DRIVERS: &[&str] = &["vfio-pci", "uio_pci_generic", "igb_uio"];

/// A sysfs tree: `/sys`, or a fake one in tests.
#[derive(Debug, Clone)]
pub struct Sysfs {
    root: PathBuf,
}

impl Default for Sysfs {
    fn default() -> Self {
        Sysfs {
            root: PathBuf::from("/sys"),
        }
    }
}

fn entries(dir: &Path) -> io::Result<Vec<String>> {
    let mut v: Vec<String> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    // read_dir order is the filesystem's; sysfs lists in creation order,
    // which is what "the first" means for the reference.
    v.sort();
    Ok(v)
}

impl Sysfs {
    #[cfg(test)]
    pub fn at(root: impl Into<PathBuf>) -> Sysfs {
        Sysfs { root: root.into() }
    }

    fn pci_dir(&self, addr: &str) -> PathBuf {
        self.root.join("bus/pci/devices").join(addr)
    }

    fn aux_dir(&self, id: &str) -> PathBuf {
        self.root.join("bus/auxiliary/devices").join(id)
    }

    pub fn is_auxiliary(&self, id: &str) -> bool {
        self.aux_dir(id).exists()
    }

    /// Whether the PCI device is bound to a userspace driver.
    pub fn pci_is_dpdk(&self, addr: &str) -> io::Result<bool> {
        let driver = std::fs::canonicalize(self.pci_dir(addr).join("driver"))?;
        let name = driver
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(USERSPACE_DRIVERS.contains(&name.as_str()))
    }

    /// Interface names of a PCI device (a virtio device keeps them one
    /// level down, under `virtio<N>/net`).
    pub fn pci_netdevs(&self, addr: &str) -> Result<Vec<String>, String> {
        let dir = self.pci_dir(addr);
        let mut net = dir.join("net");
        if !net.exists() {
            net = entries(&dir)
                .unwrap_or_default()
                .into_iter()
                .filter(|e| e.starts_with("virtio"))
                .map(|e| dir.join(e).join("net"))
                .find(|p| p.exists())
                .ok_or_else(|| format!("no net directory under pci device {addr}"))?;
        }
        entries(&net).map_err(|e| format!("failed to read net directory {}: {e}", net.display()))
    }

    /// Interface names of an auxiliary device (a function of a NIC, as
    /// mlx5's subfunctions).
    pub fn aux_netdevs(&self, id: &str) -> Result<Vec<String>, String> {
        let net = self.aux_dir(id).join("net");
        entries(&net).map_err(|_| format!("no net directory under auxiliary device {id}"))
    }

    /// Interface names under a `kernelpath` (`/sys/devices/...`).
    pub fn kernelpath_netdevs(&self, kernelpath: &str) -> Result<Vec<String>, String> {
        let rel = kernelpath
            .strip_prefix("/sys/devices/")
            .filter(|_| Path::new(kernelpath).is_absolute() && !kernelpath.contains("/../"))
            .ok_or_else(|| {
                format!(
                    "kernel device path {kernelpath:?} must be absolute and begin with /sys/devices/"
                )
            })?;
        let net = self.root.join("devices").join(rel).join("net");
        entries(&net).map_err(|_| {
            format!(
                "failed to find network devices at {:?}",
                net.display().to_string()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake() -> (tempfile::TempDir, Sysfs) {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        let mk = |p: &str| std::fs::create_dir_all(r.join(p)).unwrap();
        mk("bus/pci/drivers/vfio-pci");
        mk("bus/pci/drivers/ixgbe");
        mk("bus/pci/devices/0000:04:00.1/net/ens4f1");
        mk("bus/pci/devices/0000:05:00.0/virtio3/net/eth7");
        mk("bus/pci/devices/0000:06:00.0");
        mk("bus/auxiliary/devices/mlx5_core.sf.4/net/enp4s0f0s4");
        mk("devices/pci0000:00/0000:00:19.0/net/eno1");
        let link = |dev: &str, drv: &str| {
            std::os::unix::fs::symlink(
                r.join("bus/pci/drivers").join(drv),
                r.join("bus/pci/devices").join(dev).join("driver"),
            )
            .unwrap()
        };
        link("0000:04:00.1", "ixgbe");
        link("0000:06:00.0", "vfio-pci");
        let s = Sysfs::at(r);
        (d, s)
    }

    #[test]
    fn pci_and_auxiliary_devices() {
        let (_d, s) = fake();
        assert_eq!(s.pci_netdevs("0000:04:00.1").unwrap(), ["ens4f1"]);
        assert_eq!(s.pci_netdevs("0000:05:00.0").unwrap(), ["eth7"], "virtio");
        assert!(
            s.pci_netdevs("0000:06:00.0")
                .unwrap_err()
                .contains("no net directory")
        );
        assert!(!s.pci_is_dpdk("0000:04:00.1").unwrap());
        assert!(s.pci_is_dpdk("0000:06:00.0").unwrap());
        assert!(s.pci_is_dpdk("0000:05:00.0").is_err(), "no driver bound");
        assert!(s.is_auxiliary("mlx5_core.sf.4"));
        assert_eq!(s.aux_netdevs("mlx5_core.sf.4").unwrap(), ["enp4s0f0s4"]);
    }

    #[test]
    fn kernelpath_rules() {
        let (_d, s) = fake();
        assert_eq!(
            s.kernelpath_netdevs("/sys/devices/pci0000:00/0000:00:19.0")
                .unwrap(),
            ["eno1"]
        );
        for bad in [
            "sys/devices/x",
            "/sys/class/net/eth0",
            "/sys/devices/../class",
        ] {
            assert!(
                s.kernelpath_netdevs(bad)
                    .unwrap_err()
                    .contains("must be absolute"),
                "{bad}"
            );
        }
        assert!(s.kernelpath_netdevs("/sys/devices/nothing").is_err());
    }
}
