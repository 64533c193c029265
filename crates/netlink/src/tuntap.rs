//! TUN/TAP devices and dummy links.
//!
//! The kernel refuses to create a TUN/TAP device over rtnetlink ("tun/tap
//! creation via rtnetlink is not supported"): it is made with ioctls on
//! `/dev/net/tun`, as iproute2's `ip tuntap add` does, and made persistent so
//! that it outlives the file descriptor. Its settings are read back over
//! rtnetlink (`IFLA_TUN_*` in the link's info data).

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use rcni_netns::NetNs;
use rtnetlink::LinkDummy;
use rtnetlink::packet_core::Nla;
use rtnetlink::packet_route::link::{InfoData, InfoTun};

use crate::{Error, Link, Netlink, Result, describe_ns, links::info_data};

/// `IFF_TAP`: an Ethernet device (`IFF_TUN` would be IP only).
pub const IFF_TAP: u16 = libc::IFF_TAP as u16;
/// `IFF_NO_PI`: frames come without the 4-byte packet information header.
pub const IFF_NO_PI: u16 = libc::IFF_NO_PI as u16;
/// `IFF_VNET_HDR`: frames carry a virtio-net header (offloads for VMs).
pub const IFF_VNET_HDR: u16 = libc::IFF_VNET_HDR as u16;
/// `IFF_MULTI_QUEUE`: more than one file descriptor may attach a queue.
pub const IFF_MULTI_QUEUE: u16 = libc::IFF_MULTI_QUEUE as u16;

/// A TAP device to create: its name, `IFF_*` flags (with [`IFF_TAP`]) and,
/// when given, the user and group allowed to attach to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TapSpec {
    pub name: String,
    pub flags: u16,
    pub owner: Option<u32>,
    pub group: Option<u32>,
}

/// A TUN/TAP device's settings as the kernel reports them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TunInfo {
    /// TAP (Ethernet) rather than TUN (IP).
    pub tap: bool,
    /// Packet information header on (the absence of `IFF_NO_PI`).
    pub pi: bool,
    pub vnet_hdr: bool,
    pub multi_queue: bool,
    pub persist: bool,
    /// `None`: anyone with CAP_NET_ADMIN may attach (no owner set).
    pub owner: Option<u32>,
    pub group: Option<u32>,
}

// IFLA_TUN_* (linux/if_link.h).
const IFLA_TUN_OWNER: u16 = 1;
const IFLA_TUN_GROUP: u16 = 2;
const IFLA_TUN_TYPE: u16 = 3;
const IFLA_TUN_PI: u16 = 4;
const IFLA_TUN_VNET_HDR: u16 = 5;
const IFLA_TUN_PERSIST: u16 = 6;
const IFLA_TUN_MULTI_QUEUE: u16 = 7;

/// `struct ifreq` as TUNSETIFF reads it: the name, then the flags, in a
/// union the size of the largest member (24 bytes on 64-bit).
#[repr(C)]
struct IfReqFlags {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Creates the persistent TAP device `spec` in `ns`, from a throwaway thread
/// inside it (the device belongs to the namespace `/dev/net/tun` was opened
/// in).
pub fn create_tap(ns: &NetNs, spec: &TapSpec) -> Result<()> {
    let op = || format!("create tap {} in {}", spec.name, describe_ns(ns));
    let spec = spec.clone();
    ns.run(move || create_tap_here(&spec))
        .map_err(|e| Error::netns(op(), e))?
        .map_err(|e| Error::io(op(), e))
}

/// [`create_tap`] in the calling thread's namespace, for a process already
/// there (a helper exec'd under another security label).
pub fn create_tap_here(spec: &TapSpec) -> io::Result<()> {
    if spec.name.is_empty() || spec.name.len() >= libc::IFNAMSIZ {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let tun = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/net/tun")?;
    let fd = tun.as_raw_fd();
    let mut req = IfReqFlags {
        name: [0; libc::IFNAMSIZ],
        flags: spec.flags as libc::c_short,
        _pad: [0; 22],
    };
    req.name[..spec.name.len()].copy_from_slice(spec.name.as_bytes());
    // SAFETY: `fd` is an open /dev/net/tun; TUNSETIFF reads (and writes back
    // the name into) a `struct ifreq`, which `req` is laid out as, with the
    // full union size, and it lives across the call.
    let rc = unsafe { libc::ioctl(fd, libc::TUNSETIFF, &mut req as *mut IfReqFlags) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // Once TUNSETIFF succeeded the device exists: until it is persistent,
    // closing `tun` on an error below removes it again.
    if let Some(uid) = spec.owner {
        ioctl_int(fd, libc::TUNSETOWNER, uid as libc::c_ulong)?;
    }
    if let Some(gid) = spec.group {
        ioctl_int(fd, libc::TUNSETGROUP, gid as libc::c_ulong)?;
    }
    ioctl_int(fd, libc::TUNSETPERSIST, 1)
}

/// A TUN ioctl whose argument is an integer passed by value.
fn ioctl_int(fd: RawFd, request: libc::Ioctl, arg: libc::c_ulong) -> io::Result<()> {
    // SAFETY: TUNSETOWNER, TUNSETGROUP and TUNSETPERSIST take their argument
    // as an integer, not a pointer: the kernel dereferences nothing of ours.
    let rc = unsafe { libc::ioctl(fd, request, arg) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl Netlink {
    /// Creates a dummy link `name` in this namespace, down.
    pub async fn create_dummy(&self, name: &str) -> Result<Link> {
        let op = format!("create dummy {name} in {}", describe_ns(self.netns()));
        self.add_link(&op, LinkDummy::new(name).build()).await?;
        self.link_by_name(name).await
    }

    /// The TUN/TAP settings of link `index`; `None` if it is no TUN/TAP
    /// device.
    pub async fn tun_info(&self, index: u32) -> Result<Option<TunInfo>> {
        let msg = self.link_message(index).await?;
        let Some(InfoData::Tun(nlas)) = info_data(&msg) else {
            return Ok(None);
        };
        let mut info = TunInfo::default();
        for nla in nlas {
            let InfoTun::Other(nla) = nla else { continue };
            let mut buf = vec![0u8; nla.value_len()];
            nla.emit_value(&mut buf);
            let u8v = buf.first().copied().unwrap_or(0);
            let u32v = buf
                .get(..4)
                .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
            match nla.kind() {
                IFLA_TUN_TYPE => info.tap = u8v == IFF_TAP as u8,
                IFLA_TUN_PI => info.pi = u8v != 0,
                IFLA_TUN_VNET_HDR => info.vnet_hdr = u8v != 0,
                IFLA_TUN_MULTI_QUEUE => info.multi_queue = u8v != 0,
                IFLA_TUN_PERSIST => info.persist = u8v != 0,
                IFLA_TUN_OWNER => info.owner = u32v,
                IFLA_TUN_GROUP => info.group = u32v,
                _ => {}
            }
        }
        Ok(Some(info))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ifreq_is_the_kernels_size() {
        assert_eq!(
            std::mem::size_of::<IfReqFlags>(),
            std::mem::size_of::<libc::ifreq>()
        );
    }

    #[test]
    fn names_the_kernel_cannot_take_are_refused_before_the_device() {
        let long = TapSpec {
            name: "a-name-too-long-for-ifnamsiz".into(),
            flags: IFF_TAP,
            owner: None,
            group: None,
        };
        assert_eq!(
            create_tap_here(&long).unwrap_err().raw_os_error(),
            Some(libc::EINVAL)
        );
    }
}
