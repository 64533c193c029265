//! The map keys and values shared with `c/fastpath.bpf.c`, mirrored field for
//! field (`#[repr(C)]`), and the attachment ids that name pinned links.

use sha2::{Digest, Sha256};
use std::fmt;
use std::net::IpAddr;

const FAMILY_V4: u32 = 4;
const FAMILY_V6: u32 = 6;

/// `struct ep_key`: an endpoint address. IPv4 sits in the first four bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointKey {
    pub family: u32,
    pub addr: [u8; 16],
}

// SAFETY: repr(C), only integers, no padding (4 + 16 bytes).
unsafe impl aya::Pod for EndpointKey {}

impl EndpointKey {
    pub fn new(ip: IpAddr) -> EndpointKey {
        let mut addr = [0u8; 16];
        match ip {
            IpAddr::V4(v4) => {
                addr[..4].copy_from_slice(&v4.octets());
                EndpointKey {
                    family: FAMILY_V4,
                    addr,
                }
            }
            IpAddr::V6(v6) => EndpointKey {
                family: FAMILY_V6,
                addr: v6.octets(),
            },
        }
    }

    /// The address, or `None` for a key of an unknown family.
    pub fn ip(&self) -> Option<IpAddr> {
        match self.family {
            FAMILY_V4 => {
                let b: [u8; 4] = self.addr[..4].try_into().expect("4 bytes");
                Some(IpAddr::from(b))
            }
            FAMILY_V6 => Some(IpAddr::from(self.addr)),
            _ => None,
        }
    }
}

impl From<IpAddr> for EndpointKey {
    fn from(ip: IpAddr) -> Self {
        EndpointKey::new(ip)
    }
}

/// `struct endpoint`: where a local pod address is delivered.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// The pod's host-side veth (node namespace).
    pub ifindex: u32,
    /// The address's counters (`rcni_ep_stats` index); chosen by
    /// [`crate::Datapath::insert_endpoints`], whatever the caller sets.
    pub slot: u32,
    pub pod_mac: [u8; 6],
    /// The pod's gateway MAC: the bridge's, or for ptp its host veth's.
    pub node_mac: [u8; 6],
    /// Zero.
    pub reserved: u32,
    /// The attachment that owns the entry ([`AttachmentId::owner`]).
    pub owner: u64,
}

// SAFETY: repr(C), integers and byte arrays: 4 + 4 + 6 + 6 + 4 + 8 bytes,
// no padding (owner starts at offset 24).
unsafe impl aya::Pod for Endpoint {}

impl Endpoint {
    pub fn new(ifindex: u32, pod_mac: [u8; 6], node_mac: [u8; 6], owner: u64) -> Endpoint {
        Endpoint {
            ifindex,
            slot: 0,
            pod_mac,
            node_mac,
            reserved: 0,
            owner,
        }
    }

    /// Same delivery and owner (the counter slot aside).
    pub fn same_as(&self, o: &Endpoint) -> bool {
        Endpoint { slot: 0, ..*self } == Endpoint { slot: 0, ..*o }
    }
}

/// Endpoints one network can have on one node (`MAX_ENDPOINTS`).
pub const MAX_ENDPOINTS: usize = 16384;

/// `struct slot_bitmap`: which counter slots are taken.
pub type SlotBitmap = [u64; MAX_ENDPOINTS / 64];

/// The lowest free slot of `bits`, marked taken; `None` when all are.
pub fn take_slot(bits: &mut SlotBitmap) -> Option<u32> {
    for (i, w) in bits.iter_mut().enumerate() {
        if *w != u64::MAX {
            let b = w.trailing_ones();
            *w |= 1 << b;
            return Some(i as u32 * 64 + b);
        }
    }
    None
}

pub fn free_slot(bits: &mut SlotBitmap, slot: u32) {
    if let Some(w) = bits.get_mut(slot as usize / 64) {
        *w &= !(1u64 << (slot % 64));
    }
}

/// `struct ep_stats`, per CPU; summed by [`crate::Datapath::stats`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EndpointStats {
    /// Packets redirected to this address.
    pub rx_packets: u64,
    pub rx_bytes: u64,
    /// Packets from this address redirected to another endpoint.
    pub tx_packets: u64,
    pub tx_bytes: u64,
}

// SAFETY: repr(C), four u64.
unsafe impl aya::Pod for EndpointStats {}

impl std::ops::AddAssign for EndpointStats {
    fn add_assign(&mut self, o: EndpointStats) {
        self.rx_packets += o.rx_packets;
        self.rx_bytes += o.rx_bytes;
        self.tx_packets += o.tx_packets;
        self.tx_bytes += o.tx_bytes;
    }
}

/// The program's decisions (`enum verdict`), counted per CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Verdict {
    Redirect = 0,
    NotIp = 1,
    Short = 2,
    UnknownDst = 3,
    UnknownSrc = 4,
    Other = 5,
}

impl Verdict {
    pub const ALL: [Verdict; 6] = [
        Verdict::Redirect,
        Verdict::NotIp,
        Verdict::Short,
        Verdict::UnknownDst,
        Verdict::UnknownSrc,
        Verdict::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Verdict::Redirect => "redirected",
            Verdict::NotIp => "passed: not IP (ARP, VLAN, ...)",
            Verdict::Short => "passed: headers cut short",
            Verdict::UnknownDst => "passed: destination not a local endpoint",
            Verdict::UnknownSrc => "passed: source not an endpoint of the veth",
            Verdict::Other => "passed: hairpin, ND, TTL 1, multicast, foreign MAC",
        }
    }
}

/// The program's return values.
pub const TC_ACT_UNSPEC: u32 = u32::MAX; // -1: next program / filter
pub const TC_ACT_REDIRECT: u32 = 7;

/// One CNI attachment (container ID, ifname): a 64-bit digest, stored as the
/// `owner` of its endpoints and naming its pinned link (`link-<hex>`): every
/// pod's interface is `eth0`, so the ifname alone cannot name a pin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AttachmentId(pub u64);

impl AttachmentId {
    pub fn new(container_id: &str, ifname: &str) -> AttachmentId {
        let mut h = Sha256::new();
        h.update(container_id.as_bytes());
        h.update([0u8]);
        h.update(ifname.as_bytes());
        let d = h.finalize();
        AttachmentId(u64::from_be_bytes(d[..8].try_into().expect("8 bytes")))
    }

    pub fn owner(self) -> u64 {
        self.0
    }

    /// The pin name of this attachment's link.
    pub fn link_pin(self) -> String {
        format!("{LINK_PREFIX}{self}")
    }

    /// The id a pin name stands for, if it is a link pin.
    pub fn from_link_pin(name: &str) -> Option<AttachmentId> {
        let hex = name.strip_prefix(LINK_PREFIX)?;
        if hex.len() != 16 {
            return None;
        }
        u64::from_str_radix(hex, 16).ok().map(AttachmentId)
    }
}

const LINK_PREFIX: &str = "link-";

impl fmt::Display for AttachmentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn fmt_mac(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_c_structs() {
        assert_eq!(std::mem::size_of::<EndpointKey>(), 20);
        assert_eq!(std::mem::size_of::<Endpoint>(), 32);
        assert_eq!(std::mem::offset_of!(Endpoint, slot), 4);
        assert_eq!(std::mem::offset_of!(Endpoint, pod_mac), 8);
        assert_eq!(std::mem::offset_of!(Endpoint, node_mac), 14);
        assert_eq!(std::mem::offset_of!(Endpoint, reserved), 20);
        assert_eq!(std::mem::offset_of!(Endpoint, owner), 24);
        assert_eq!(std::mem::size_of::<EndpointStats>(), 32);
    }

    #[test]
    fn slots_are_taken_lowest_first_and_freed() {
        let mut bits: SlotBitmap = [0; MAX_ENDPOINTS / 64];
        assert_eq!(take_slot(&mut bits), Some(0));
        assert_eq!(take_slot(&mut bits), Some(1));
        assert_eq!(take_slot(&mut bits), Some(2));
        free_slot(&mut bits, 1);
        assert_eq!(take_slot(&mut bits), Some(1));
        bits[0] = u64::MAX;
        assert_eq!(take_slot(&mut bits), Some(64));
        for _ in 65..MAX_ENDPOINTS {
            assert!(take_slot(&mut bits).is_some());
        }
        assert_eq!(take_slot(&mut bits), None);
        free_slot(&mut bits, 16383);
        assert_eq!(take_slot(&mut bits), Some(16383));
        // Out of range: ignored.
        free_slot(&mut bits, 99999);
        let a = Endpoint::new(3, [1; 6], [2; 6], 9);
        let b = Endpoint { slot: 7, ..a };
        assert!(a.same_as(&b));
        assert!(!a.same_as(&Endpoint { ifindex: 4, ..a }));
    }

    #[test]
    fn keys_round_trip() {
        let v4: IpAddr = "10.88.0.7".parse().unwrap();
        let k = EndpointKey::new(v4);
        assert_eq!(k.family, 4);
        assert_eq!(&k.addr[..4], &[10, 88, 0, 7]);
        assert!(k.addr[4..].iter().all(|b| *b == 0));
        assert_eq!(k.ip(), Some(v4));
        let v6: IpAddr = "fd88::7".parse().unwrap();
        let k6 = EndpointKey::new(v6);
        assert_eq!(k6.family, 6);
        assert_eq!(k6.ip(), Some(v6));
        assert_ne!(k, k6);
        let bad = EndpointKey {
            family: 9,
            addr: [0; 16],
        };
        assert_eq!(bad.ip(), None);
    }

    #[test]
    fn attachment_ids_are_stable_and_distinct() {
        let a = AttachmentId::new("c1", "eth0");
        assert_eq!(a, AttachmentId::new("c1", "eth0"));
        assert_ne!(a, AttachmentId::new("c2", "eth0"));
        assert_ne!(a, AttachmentId::new("c1", "eth1"));
        // The separator keeps ("ab","c") and ("a","bc") apart.
        assert_ne!(AttachmentId::new("ab", "c"), AttachmentId::new("a", "bc"));
        let pin = a.link_pin();
        assert!(pin.starts_with("link-") && pin.len() == 21, "{pin}");
        assert_eq!(AttachmentId::from_link_pin(&pin), Some(a));
        assert_eq!(AttachmentId::from_link_pin("prog"), None);
        assert_eq!(AttachmentId::from_link_pin("link-xyz"), None);
    }

    #[test]
    fn stats_add_and_macs_print() {
        let mut s = EndpointStats {
            rx_packets: 1,
            rx_bytes: 100,
            ..Default::default()
        };
        s += EndpointStats {
            rx_packets: 2,
            rx_bytes: 50,
            tx_packets: 1,
            tx_bytes: 60,
        };
        assert_eq!((s.rx_packets, s.rx_bytes, s.tx_packets), (3, 150, 1));
        assert_eq!(fmt_mac(&[0xaa, 0, 1, 2, 3, 0xff]), "aa:00:01:02:03:ff");
    }
}
