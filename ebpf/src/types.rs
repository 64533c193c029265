//! The map keys and values shared with `c/datapath.bpf.c` and `c/policy.h`,
//! mirrored field for field (`#[repr(C)]`), and the attachment ids that name
//! pinned links.

use sha2::{Digest, Sha256};
use std::fmt;
use std::mem::{offset_of, size_of};
use std::net::IpAddr;
use zerocopy::{FromBytes, Immutable, IntoBytes};

/// Marks map keys and values as [`aya::Pod`]. aya copies them to and from
/// the kernel as bytes, which is sound only for a type without padding
/// (no uninitialized byte goes out) whose every bit pattern is a value (any
/// bytes may come back): zerocopy's derives prove exactly that, `IntoBytes`
/// refusing to compile on padding and `FromBytes` on a field with invalid
/// bit patterns, and `pod!` takes only types that derive both.
macro_rules! pod {
    ($($t:ty),* $(,)?) => {$(
        const _: () = proven_pod::<$t>();
        // SAFETY: `proven_pod` compiles only for a type that zerocopy
        // proved padding-free and valid for every bit pattern (see above).
        unsafe impl aya::Pod for $t {}
    )*};
}

const fn proven_pod<T: FromBytes + IntoBytes + Immutable + Copy + 'static>() {}

pod!(
    EdtCfg,
    Police,
    EndpointKey,
    Endpoint,
    EndpointStats,
    PortRange,
    PortSet,
    PeerKey,
    CidrData,
    CtKey,
    RemoteData,
    RemoteHop,
    RemoteStats,
    PolicyConfig,
    SvcKey,
    SvcVal,
    SvcBackendKey,
    SvcBackend,
    SvcBackendIdx,
    SvcRevKey,
);

const FAMILY_V4: u32 = 4;
const FAMILY_V6: u32 = 6;

/// `struct ep_key`: an endpoint address. IPv4 sits in the first four bytes.
#[repr(C)]
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, FromBytes, IntoBytes, Immutable,
)]
pub struct EndpointKey {
    pub family: u32,
    pub addr: [u8; 16],
}

const _: () = assert!(size_of::<EndpointKey>() == 20);

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

/// `struct endpoint`: a local pod address, as the fast path (where to
/// deliver it) and the policy plugin (who it is, which rules apply) know it.
/// Both write the same entry, each its own fields and flag.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub struct Endpoint {
    /// The pod's host-side veth (node namespace).
    pub ifindex: u32,
    /// The address's counters (`rcni_ep_stats` index); chosen by the
    /// [`crate::Datapath`], whatever the caller sets.
    pub slot: u32,
    pub pod_mac: [u8; 6],
    /// The pod's gateway MAC: the bridge's, or for ptp its host veth's.
    pub node_mac: [u8; 6],
    /// Which plugins wrote the entry: [`EP_FASTPATH`], [`EP_POLICY`]; and
    /// [`EP_NORMAL_PATH`], [`EP_NETKIT`].
    pub flags: u32,
    /// The attachment that owns the entry ([`AttachmentId::owner`]).
    pub owner: u64,
    /// The pod's label-set identity; 0: none.
    pub identity: u32,
    /// The rule set deciding traffic to the pod; 0: not selected.
    pub ingress_rs: u32,
    /// The rule set deciding traffic from the pod; 0: not selected.
    pub egress_rs: u32,
    /// [`POL_AUDIT_IN`], [`POL_AUDIT_OUT`]: that direction's rule set is
    /// audit-only (reports what it would deny, lets it through).
    pub pol_flags: u32,
}

/// The ingress rule set reports instead of denying.
pub const POL_AUDIT_IN: u32 = 1;
/// The egress rule set reports instead of denying.
pub const POL_AUDIT_OUT: u32 = 2;

const _: () = {
    assert!(size_of::<Endpoint>() == 48);
    assert!(offset_of!(Endpoint, slot) == 4);
    assert!(offset_of!(Endpoint, pod_mac) == 8);
    assert!(offset_of!(Endpoint, node_mac) == 14);
    assert!(offset_of!(Endpoint, flags) == 20);
    assert!(offset_of!(Endpoint, owner) == 24);
    assert!(offset_of!(Endpoint, identity) == 32);
    assert!(offset_of!(Endpoint, ingress_rs) == 36);
    assert!(offset_of!(Endpoint, egress_rs) == 40);
};

/// The fast path wrote the entry: its MACs are valid, it may redirect.
pub const EP_FASTPATH: u32 = 1;
/// The policy plugin wrote the entry: identity and rule sets are valid.
pub const EP_POLICY: u32 = 2;
/// With [`EP_FASTPATH`]: the pod's traffic keeps the normal path, to it and
/// from it (its host veth is shaped, or an isolated bridge port). Part of
/// the fast path's fields.
pub const EP_NORMAL_PATH: u32 = 4;

/// With [`EP_FASTPATH`]: the pod's fast path runs on its netkit primary's
/// peer hook, i.e. at the pod's transmit and not at an ingress hook, where
/// bpf_redirect_peer is refused: packets for local pods are handed to the
/// destination's node-side device with bpf_redirect instead.
pub const EP_NETKIT: u32 = 8;

/// With [`EP_FASTPATH`]: set by `bandwidth`, which shapes the pod's ingress
/// on its host veth (an fq qdisc and `rcni_edt` on its egress hook):
/// packets for it are handed to the host veth with bpf_redirect, which
/// passes that hook and qdisc, instead of bpf_redirect_peer past both.
pub const EP_SHAPED: u32 = 16;

/// The fast path's own flags: what it writes and takes out again
/// (`EP_SHAPED` goes with the rest of the fast path's part).
const FASTPATH_FLAGS: u32 = EP_FASTPATH | EP_NORMAL_PATH | EP_NETKIT | EP_SHAPED;

impl Endpoint {
    /// The fast path's endpoint.
    pub fn new(ifindex: u32, pod_mac: [u8; 6], node_mac: [u8; 6], owner: u64) -> Endpoint {
        Endpoint {
            ifindex,
            pod_mac,
            node_mac,
            flags: EP_FASTPATH,
            owner,
            ..Default::default()
        }
    }

    /// The policy plugin's endpoint.
    pub fn policy(
        ifindex: u32,
        owner: u64,
        identity: u32,
        ingress_rs: u32,
        egress_rs: u32,
    ) -> Endpoint {
        Endpoint {
            ifindex,
            flags: EP_POLICY,
            owner,
            identity,
            ingress_rs,
            egress_rs,
            ..Default::default()
        }
    }

    /// [`Endpoint::policy`] with audit flags ([`POL_AUDIT_IN`],
    /// [`POL_AUDIT_OUT`]).
    pub fn policy_audited(self, pol_flags: u32) -> Endpoint {
        Endpoint { pol_flags, ..self }
    }

    /// This fast path endpoint, kept on the normal path or not (see
    /// [`EP_NORMAL_PATH`]).
    pub fn normal_path(self, on: bool) -> Endpoint {
        self.with_flag(EP_NORMAL_PATH, on)
    }

    /// This fast path endpoint, its program on a netkit hook or not (see
    /// [`EP_NETKIT`]).
    pub fn netkit(self, on: bool) -> Endpoint {
        self.with_flag(EP_NETKIT, on)
    }

    pub(crate) fn with_flag(self, flag: u32, on: bool) -> Endpoint {
        let flags = if on {
            self.flags | flag
        } else {
            self.flags & !flag
        };
        Endpoint { flags, ..self }
    }

    /// Whether the fast path knows the entry but leaves its traffic to the
    /// normal path.
    pub fn keeps_normal_path(&self) -> bool {
        self.flags & (EP_FASTPATH | EP_NORMAL_PATH) == EP_FASTPATH | EP_NORMAL_PATH
    }

    /// The same fast path fields (delivery, owner, the flags), whatever the
    /// policy plugin wrote and the counter slot.
    /// `EP_SHAPED` is `bandwidth`'s, which checks it itself.
    pub fn same_as(&self, o: &Endpoint) -> bool {
        const FP: u32 = FASTPATH_FLAGS & !EP_SHAPED;
        self.ifindex == o.ifindex
            && self.pod_mac == o.pod_mac
            && self.node_mac == o.node_mac
            && self.owner == o.owner
            && self.flags & FP == o.flags & FP
    }

    /// The same policy fields (host veth, owner, identity, rule sets, the
    /// flag), whatever the fast path wrote.
    pub fn same_policy_as(&self, o: &Endpoint) -> bool {
        self.ifindex == o.ifindex
            && self.owner == o.owner
            && self.identity == o.identity
            && self.ingress_rs == o.ingress_rs
            && self.egress_rs == o.egress_rs
            && self.pol_flags == o.pol_flags
            && self.flags & EP_POLICY == o.flags & EP_POLICY
    }

    /// What a plugin writes its part for `owner` over: `old` (the entry in
    /// the map) with `old`'s slot. Another owner's entry is replaced whole:
    /// what the other plugin wrote there was about a pod that is gone.
    fn base(old: Option<Endpoint>, owner: u64) -> Endpoint {
        let base = match old {
            Some(o) if o.owner == owner => o,
            _ => Endpoint::default(),
        };
        Endpoint {
            slot: old.map_or(0, |o| o.slot),
            owner,
            ..base
        }
    }

    /// `old` (the entry in the map) with the fast path's fields of `fp`
    /// (see [`Endpoint::base`]).
    pub(crate) fn merge_fastpath(old: Option<Endpoint>, fp: &Endpoint) -> Endpoint {
        let base = Endpoint::base(old, fp.owner);
        Endpoint {
            ifindex: fp.ifindex,
            pod_mac: fp.pod_mac,
            node_mac: fp.node_mac,
            flags: (base.flags & !FASTPATH_FLAGS) | (fp.flags & FASTPATH_FLAGS) | EP_FASTPATH,
            ..base
        }
    }

    /// `old` with the policy plugin's fields of `pol` (see
    /// [`Endpoint::merge_fastpath`]).
    pub(crate) fn merge_policy(old: Option<Endpoint>, pol: &Endpoint) -> Endpoint {
        let base = Endpoint::base(old, pol.owner);
        Endpoint {
            ifindex: pol.ifindex,
            flags: base.flags | EP_POLICY,
            identity: pol.identity,
            ingress_rs: pol.ingress_rs,
            egress_rs: pol.egress_rs,
            pol_flags: pol.pol_flags,
            ..base
        }
    }

    /// Without the fast path's fields; `None` when nothing is left.
    pub(crate) fn without_fastpath(self) -> Option<Endpoint> {
        let flags = self.flags & !FASTPATH_FLAGS;
        (flags != 0).then_some(Endpoint {
            pod_mac: [0; 6],
            node_mac: [0; 6],
            flags,
            ..self
        })
    }

    /// Without the policy plugin's fields; `None` when nothing is left.
    pub(crate) fn without_policy(self) -> Option<Endpoint> {
        let flags = self.flags & !EP_POLICY;
        (flags != 0).then_some(Endpoint {
            identity: 0,
            ingress_rs: 0,
            egress_rs: 0,
            pol_flags: 0,
            flags,
            ..self
        })
    }
}

/// Endpoints one network can have on one node (`MAX_ENDPOINTS`).
pub const MAX_ENDPOINTS: usize = 16384;

/// Port indexes below this live in `rcni_ports_direct`, an array (as
/// `PORTS_DIRECT` in datapath.bpf.c); larger ones in the `rcni_ports` hash.
pub const PORTS_DIRECT: u32 = 16384;

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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub struct EndpointStats {
    /// Packets redirected to this address.
    pub rx_packets: u64,
    pub rx_bytes: u64,
    /// Packets from this address redirected to another endpoint.
    pub tx_packets: u64,
    pub tx_bytes: u64,
}

const _: () = assert!(size_of::<EndpointStats>() == 32);

impl std::ops::AddAssign for EndpointStats {
    fn add_assign(&mut self, o: EndpointStats) {
        self.rx_packets += o.rx_packets;
        self.rx_bytes += o.rx_bytes;
        self.tx_packets += o.tx_packets;
        self.tx_bytes += o.tx_bytes;
    }
}

/// The programs' decisions (`enum verdict`), counted per CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Verdict {
    Redirect = 0,
    NotIp = 1,
    Short = 2,
    UnknownDst = 3,
    UnknownSrc = 4,
    Other = 5,
    PolicyDenyIn = 6,
    PolicyDenyOut = 7,
    PolicySpoof = 8,
    NormalPath = 9,
    ToRemote = 10,
    FromRemote = 11,
    TooBig = 12,
    NatFlow = 13,
    EventLost = 14,
    EventLimited = 15,
}

impl Verdict {
    pub const ALL: [Verdict; 16] = [
        Verdict::Redirect,
        Verdict::NotIp,
        Verdict::Short,
        Verdict::UnknownDst,
        Verdict::UnknownSrc,
        Verdict::Other,
        Verdict::PolicyDenyIn,
        Verdict::PolicyDenyOut,
        Verdict::PolicySpoof,
        Verdict::NormalPath,
        Verdict::ToRemote,
        Verdict::FromRemote,
        Verdict::TooBig,
        Verdict::NatFlow,
        Verdict::EventLost,
        Verdict::EventLimited,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Verdict::Redirect => "redirected",
            Verdict::NotIp => "passed: not IP (ARP, VLAN, ...)",
            Verdict::Short => "passed: headers cut short",
            Verdict::UnknownDst => "passed: destination not a local endpoint",
            Verdict::UnknownSrc => {
                "passed: source not an endpoint of the veth, nor another node's pod"
            }
            Verdict::Other => "passed: hairpin, ND, TTL 1, multicast, foreign MAC",
            Verdict::NormalPath => "passed: an end keeps the normal path (shaped, isolated)",
            Verdict::PolicyDenyIn => "dropped: receiver's ingress policy",
            Verdict::PolicyDenyOut => "dropped: sender's egress policy",
            Verdict::PolicySpoof => "dropped: source address not the pod's",
            Verdict::ToRemote => "redirected to another node",
            Verdict::FromRemote => "redirected from another node",
            Verdict::TooBig => "passed: over the out device's MTU",
            Verdict::NatFlow => "passed: a flow the node's NAT translates",
            Verdict::EventLost => "policy flow event lost: ring buffer full",
            Verdict::EventLimited => "policy flow event suppressed: pod's rate limit",
        }
    }
}

// ---- policy ----

/// Port set id: nothing allowed (reserved, never stored).
pub const PORTSET_NONE: u32 = 0;
/// Port set id: every protocol and port (reserved, never stored).
pub const PORTSET_ALL: u32 = 1;
/// Ranges one port set holds.
pub const MAX_PORT_RANGES: usize = 32;

/// `struct port_range`: one protocol's ports `lo..=hi` (host order). A
/// protocol without ports (ICMP, ...) matches as port 0.
#[repr(C)]
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    FromBytes,
    IntoBytes,
    Immutable,
)]
pub struct PortRange {
    pub proto: u8,
    _pad: u8,
    pub lo: u16,
    pub hi: u16,
    _pad2: u16,
}

const _: () = {
    assert!(size_of::<PortRange>() == 8);
    assert!(offset_of!(PortRange, lo) == 2);
};

impl PortRange {
    pub fn new(proto: u8, lo: u16, hi: u16) -> PortRange {
        PortRange {
            proto,
            lo,
            hi,
            ..Default::default()
        }
    }
}

/// `struct portset`.
#[repr(C)]
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, Immutable)]
pub(crate) struct PortSet {
    pub n: u32,
    pub pad: u32,
    pub r: [PortRange; MAX_PORT_RANGES],
}

const _: () = assert!(size_of::<PortSet>() == 8 + 8 * MAX_PORT_RANGES);

/// `struct peer_key`: a rule set's entry for a peer identity.
#[repr(C)]
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, FromBytes, IntoBytes, Immutable,
)]
pub struct PeerKey {
    pub rs: u32,
    pub identity: u32,
}

const _: () = assert!(size_of::<PeerKey>() == 8);

/// `struct cidr_key` after its prefix length (aya's LPM key puts that in
/// front): rule set, family, address.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub(crate) struct CidrData {
    pub rs: u32,
    pub family: u32,
    pub addr: [u8; 16],
}

const _: () = {
    assert!(size_of::<CidrData>() == 24);
    // The C `struct cidr_key`, prefix length in front.
    assert!(size_of::<aya::maps::lpm_trie::Key<CidrData>>() == 28);
};

/// `rcni_pol_cidr`'s prefix length covers rule set and family (64 bits)
/// before the address.
pub(crate) const CIDR_PREFIX_BASE: u32 = 64;

/// `ip` masked to its first `len` bits, as a CIDR key; `None` when `len`
/// is too long for the family.
pub(crate) fn cidr_key(rs: u32, ip: IpAddr, len: u8) -> Option<aya::maps::lpm_trie::Key<CidrData>> {
    let bits = if ip.is_ipv4() { 32 } else { 128 };
    if u32::from(len) > bits {
        return None;
    }
    let EndpointKey { family, mut addr } = EndpointKey::new(ip);
    mask(&mut addr, len);
    Some(aya::maps::lpm_trie::Key::new(
        CIDR_PREFIX_BASE + u32::from(len),
        CidrData { rs, family, addr },
    ))
}

/// What a CIDR key says: (rule set, network address, prefix length).
pub(crate) fn cidr_of(k: &aya::maps::lpm_trie::Key<CidrData>) -> Option<(u32, IpAddr, u8)> {
    let d = k.data();
    let ip = EndpointKey {
        family: d.family,
        addr: d.addr,
    }
    .ip()?;
    let len = k.prefix_len().checked_sub(CIDR_PREFIX_BASE)?;
    Some((d.rs, ip, len as u8))
}

// ---- cross-node ----

/// `struct remote_key` after its prefix length: family, address.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub(crate) struct RemoteData {
    pub family: u32,
    pub addr: [u8; 16],
}

const _: () = assert!(size_of::<aya::maps::lpm_trie::Key<RemoteData>>() == 24);

/// `rcni_remote`'s prefix length covers the family (32 bits) first.
const REMOTE_PREFIX_BASE: u32 = 32;

/// `AF_INET`, `AF_INET6`: `struct bpf_redir_neigh`'s `nh_family`.
const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;

/// `struct remote`: where packets to another node's pod subnet go.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub struct RemoteHop {
    /// The uplink or the VXLAN device.
    pub ifindex: u32,
    /// That device's MTU.
    pub mtu: u32,
    /// `AF_INET` or `AF_INET6`.
    pub nh_family: u32,
    /// The next hop; IPv4 in the first four bytes.
    pub nh: [u8; 16],
    /// Its counters (`rcni_remote_stats` index); chosen by the
    /// [`crate::Datapath`], whatever the caller sets.
    pub slot: u32,
}

const _: () = assert!(size_of::<RemoteHop>() == 32);

/// `struct remote_stats`, per CPU: what went to one peer subnet.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub struct RemoteStats {
    pub tx_packets: u64,
    pub tx_bytes: u64,
}

/// `MAX_REMOTES`: peer subnets (both families) a datapath holds.
pub const MAX_REMOTES: u32 = 8192;

impl RemoteHop {
    pub fn new(ifindex: u32, mtu: u32, next_hop: IpAddr) -> RemoteHop {
        let EndpointKey { family, addr } = EndpointKey::new(next_hop);
        RemoteHop {
            ifindex,
            mtu,
            nh_family: if family == FAMILY_V4 {
                AF_INET
            } else {
                AF_INET6
            },
            nh: addr,
            slot: 0,
        }
    }

    /// The same device, MTU and next hop, whatever the slots.
    pub fn same_hop(&self, o: &RemoteHop) -> bool {
        RemoteHop { slot: 0, ..*self } == RemoteHop { slot: 0, ..*o }
    }

    /// The next hop; `None` for an unknown family.
    pub fn next_hop(&self) -> Option<IpAddr> {
        let family = match self.nh_family {
            AF_INET => FAMILY_V4,
            AF_INET6 => FAMILY_V6,
            _ => return None,
        };
        EndpointKey {
            family,
            addr: self.nh,
        }
        .ip()
    }
}

/// `ip/len` masked, as an `rcni_remote` key; `None` when `len` is too long.
pub(crate) fn remote_key(ip: IpAddr, len: u8) -> Option<aya::maps::lpm_trie::Key<RemoteData>> {
    let bits = if ip.is_ipv4() { 32 } else { 128 };
    if u32::from(len) > bits {
        return None;
    }
    let EndpointKey { family, mut addr } = EndpointKey::new(ip);
    mask(&mut addr, len);
    Some(aya::maps::lpm_trie::Key::new(
        REMOTE_PREFIX_BASE + u32::from(len),
        RemoteData { family, addr },
    ))
}

/// What an `rcni_remote` key says: (network address, prefix length).
pub(crate) fn remote_of(k: &aya::maps::lpm_trie::Key<RemoteData>) -> Option<(IpAddr, u8)> {
    let d = k.data();
    let ip = EndpointKey {
        family: d.family,
        addr: d.addr,
    }
    .ip()?;
    let len = k.prefix_len().checked_sub(REMOTE_PREFIX_BASE)?;
    Some((ip, len as u8))
}

fn mask(addr: &mut [u8; 16], len: u8) {
    for (i, b) in addr.iter_mut().enumerate() {
        let keep = (u32::from(len)).saturating_sub(i as u32 * 8).min(8);
        *b &= if keep == 0 { 0 } else { 0xffu8 << (8 - keep) };
    }
}

/// `struct pol_cfg`, `rcni_pol_cfg`'s one value: which decisions become
/// flow events and how many per second per pod, and whether the network
/// has a policy.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub struct PolicyConfig {
    /// [`EVENTS_DENY`] | [`EVENTS_ALLOW`].
    pub events: u32,
    pub rate: u32,
    /// [`POL_ENFORCE`].
    pub flags: u32,
}

/// The network has a policy (on any node): the programs check pods'
/// sources and run the policy points. Clear, they pass every packet after
/// one array load.
pub const POL_ENFORCE: u32 = 1;

/// Denials and audit findings become flow events.
pub const EVENTS_DENY: u32 = 1;
/// New flows a rule set allows become flow events.
pub const EVENTS_ALLOW: u32 = 2;

/// A flow event's verdict (`EV_*`).
pub const EV_DENY: u8 = 1;
pub const EV_ALLOW: u8 = 2;
pub const EV_AUDIT: u8 = 3;

/// `struct flow_event`: one record of `rcni_pol_events`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub struct FlowEvent {
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC).
    pub ts: u64,
    pub family: u8,
    pub proto: u8,
    /// [`EV_DENY`], [`EV_ALLOW`], [`EV_AUDIT`].
    pub verdict: u8,
    /// [`CT_EGRESS`]: the sender's policy decided; [`CT_INGRESS`]: the
    /// receiver's.
    pub point: u8,
    pub sport: u16,
    pub dport: u16,
    pub icmp_type: u8,
    pub pad: [u8; 3],
    /// The rule set that decided.
    pub rs: u32,
    /// The policed pod's events its rate limit dropped since its last one.
    pub suppressed: u32,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub pad2: u32,
}

const _: () = {
    assert!(size_of::<FlowEvent>() == 64);
    assert!(offset_of!(FlowEvent, sport) == 12);
    assert!(offset_of!(FlowEvent, rs) == 20);
    assert!(offset_of!(FlowEvent, saddr) == 28);
};

impl FlowEvent {
    fn addr(&self, a: &[u8; 16]) -> IpAddr {
        if self.family == 4 {
            IpAddr::from([a[0], a[1], a[2], a[3]])
        } else {
            IpAddr::from(*a)
        }
    }

    pub fn src(&self) -> IpAddr {
        self.addr(&self.saddr)
    }

    pub fn dst(&self) -> IpAddr {
        self.addr(&self.daddr)
    }
}

/// `struct nat_sock` (the key of `rcni_nat_socks`).
pub(crate) const NAT_SOCK_SIZE: usize = 20;

/// Connection tracking: recorded at the sender's egress point.
pub const CT_EGRESS: u8 = 1;
/// Connection tracking: recorded at the receiver's ingress point.
pub const CT_INGRESS: u8 = 2;

/// `struct ct_key`: one direction of a flow as one point recorded it.
/// Ports in host order (ICMP echo: the identifier as both; else 0).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, FromBytes, IntoBytes, Immutable,
)]
pub struct CtKey {
    pub family: u8,
    pub proto: u8,
    /// [`CT_EGRESS`] or [`CT_INGRESS`].
    pub point: u8,
    pub pad: u8,
    pub sport: u16,
    pub dport: u16,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
}

const _: () = {
    assert!(size_of::<CtKey>() == 40);
    assert!(offset_of!(CtKey, sport) == 4);
    assert!(offset_of!(CtKey, saddr) == 8);
};

impl CtKey {
    /// The source address as an endpoint key.
    pub fn src(&self) -> EndpointKey {
        EndpointKey {
            family: u32::from(self.family),
            addr: self.saddr,
        }
    }

    pub fn dst(&self) -> EndpointKey {
        EndpointKey {
            family: u32::from(self.family),
            addr: self.daddr,
        }
    }
}

/// The programs' return values.
pub const TC_ACT_UNSPEC: u32 = u32::MAX; // -1: next program / filter
pub const TC_ACT_SHOT: u32 = 2;
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
const POLICY_IN_PREFIX: &str = "link-pol-in-";
const POLICY_OUT_PREFIX: &str = "link-pol-out-";

impl AttachmentId {
    /// The pin names of this attachment's policy links: `rcni_pol_in`'s
    /// (egress hook) and `rcni_pol_out`'s (ingress hook). Not link pins
    /// for [`AttachmentId::from_link_pin`]: fastpath's GC leaves them be.
    pub fn policy_link_pins(self) -> [String; 2] {
        [
            format!("{POLICY_IN_PREFIX}{self}"),
            format!("{POLICY_OUT_PREFIX}{self}"),
        ]
    }

    /// The id a policy link pin (either) stands for.
    pub fn from_policy_link_pin(name: &str) -> Option<AttachmentId> {
        let hex = name
            .strip_prefix(POLICY_IN_PREFIX)
            .or_else(|| name.strip_prefix(POLICY_OUT_PREFIX))?;
        if hex.len() != 16 {
            return None;
        }
        u64::from_str_radix(hex, 16).ok().map(AttachmentId)
    }
}

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

/// The configuration and counters of one `rcni_edt` instance (`struct
/// edt_cfg` in `c/shape.bpf.c`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub struct EdtCfg {
    /// Bytes per second.
    pub rate: u64,
    pub burst_ns: u64,
    pub horizon_ns: u64,
    pub t_last: u64,
    /// Packets given a later departure time.
    pub delayed: u64,
    /// Packets dropped past the horizon.
    pub dropped: u64,
}

/// A port's egress policer in `rcni_police` (`struct police` in
/// `c/datapath.bpf.c`): bandwidth's node-side backstop for the shaping
/// inside the pod.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub struct Police {
    /// Bytes per second.
    pub rate: u64,
    pub burst_ns: u64,
    /// How far ahead of the rate a packet may run before it is dropped.
    pub horizon_ns: u64,
    pub t_last: u64,
    /// Packets let through, and dropped.
    pub passed: u64,
    pub dropped: u64,
}

impl Police {
    /// The policer behind shaping `cfg` (rcni_edt's): the same rate and
    /// burst, twice its horizon, so that a pod sending as its shaping lets
    /// it is never dropped.
    pub fn behind(cfg: &EdtCfg) -> Police {
        Police {
            rate: cfg.rate,
            burst_ns: cfg.burst_ns,
            horizon_ns: cfg.horizon_ns.saturating_mul(2),
            ..Police::default()
        }
    }

    /// The same limits (not the run-time state).
    pub fn same_limits(&self, o: &Police) -> bool {
        (self.rate, self.burst_ns, self.horizon_ns) == (o.rate, o.burst_ns, o.horizon_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policer_keeps_the_shapings_rate_and_burst_with_twice_its_horizon() {
        let c = EdtCfg {
            rate: 1_250_000,
            burst_ns: 8_000_000,
            horizon_ns: 25_000_000,
            t_last: 7,
            ..EdtCfg::default()
        };
        let p = Police::behind(&c);
        assert_eq!(
            (p.rate, p.burst_ns, p.horizon_ns),
            (1_250_000, 8_000_000, 50_000_000)
        );
        assert_eq!((p.t_last, p.passed, p.dropped), (0, 0, 0));
        assert!(p.same_limits(&Police {
            t_last: 9,
            dropped: 3,
            ..p
        }));
        assert!(!p.same_limits(&Police { rate: 1, ..p }));
    }

    #[test]
    fn fastpath_and_policy_share_an_entry() {
        let fp = Endpoint::new(3, [1; 6], [2; 6], 9);
        let pol = Endpoint::policy(3, 9, 100, 5, 6);
        // Either order, the same merged entry.
        let a = Endpoint::merge_policy(Some(Endpoint::merge_fastpath(None, &fp)), &pol);
        let b = Endpoint::merge_fastpath(Some(Endpoint::merge_policy(None, &pol)), &fp);
        assert_eq!(a, b);
        assert_eq!(a.flags, EP_FASTPATH | EP_POLICY);
        assert!(a.same_as(&fp) && a.same_policy_as(&pol));
        assert_eq!(
            (a.pod_mac, a.identity, a.ingress_rs, a.egress_rs),
            ([1; 6], 100, 5, 6)
        );
        // The slot stays with the entry.
        let slotted = Endpoint { slot: 7, ..a };
        assert_eq!(Endpoint::merge_policy(Some(slotted), &pol).slot, 7);
        // Removing one plugin's part keeps the other's.
        let only_pol = a.without_fastpath().unwrap();
        assert_eq!(only_pol.flags, EP_POLICY);
        assert_eq!((only_pol.pod_mac, only_pol.identity), ([0; 6], 100));
        assert!(!only_pol.same_as(&fp) && only_pol.same_policy_as(&pol));
        let only_fp = a.without_policy().unwrap();
        assert_eq!(
            (only_fp.flags, only_fp.identity, only_fp.egress_rs),
            (EP_FASTPATH, 0, 0)
        );
        assert!(only_fp.same_as(&fp));
        assert_eq!(only_fp.without_fastpath(), None);
        assert_eq!(only_pol.without_policy(), None);
        // Another owner's entry is replaced, not merged into.
        let other = Endpoint::merge_fastpath(
            Some(Endpoint { slot: 4, ..a }),
            &Endpoint::new(8, [3; 6], [4; 6], 10),
        );
        assert_eq!(
            (other.flags, other.identity, other.owner, other.slot),
            (EP_FASTPATH, 0, 10, 4)
        );
    }

    #[test]
    fn the_normal_path_mark_is_the_fast_paths() {
        let fp = Endpoint::new(3, [1; 6], [2; 6], 9);
        let shaped = fp.normal_path(true);
        assert!(shaped.keeps_normal_path() && !fp.keeps_normal_path());
        assert!(!shaped.same_as(&fp));
        // Kept through the policy plugin's writes, set by the fast path's.
        let pol = Endpoint::policy(3, 9, 100, 5, 6);
        let both = Endpoint::merge_policy(Some(Endpoint::merge_fastpath(None, &shaped)), &pol);
        assert!(both.keeps_normal_path() && both.same_as(&shaped));
        assert!(!Endpoint::merge_fastpath(Some(both), &fp).keeps_normal_path());
        // It goes with the fast path's part; alone it means nothing.
        let only_pol = both.without_fastpath().unwrap();
        assert_eq!(only_pol.flags, EP_POLICY);
        assert!(
            !Endpoint::policy(3, 9, 1, 0, 0)
                .normal_path(true)
                .keeps_normal_path()
        );
    }

    #[test]
    fn the_netkit_mark_is_the_fast_paths() {
        let fp = Endpoint::new(3, [1; 6], [2; 6], 9);
        let nk = fp.netkit(true);
        assert!(!nk.same_as(&fp));
        let pol = Endpoint::policy(3, 9, 100, 5, 6);
        let both = Endpoint::merge_policy(Some(Endpoint::merge_fastpath(None, &nk)), &pol);
        assert!(both.flags & EP_NETKIT != 0 && both.same_as(&nk));
        let back = Endpoint::merge_fastpath(Some(both), &fp);
        assert_eq!(back.flags & EP_NETKIT, 0);
        assert_eq!(both.without_fastpath().unwrap().flags, EP_POLICY);
    }

    #[test]
    fn cidr_keys_are_masked_and_read_back() {
        let k = cidr_key(3, "10.1.2.3".parse().unwrap(), 20).unwrap();
        assert_eq!(k.prefix_len(), 84);
        let d = k.data();
        assert_eq!((d.rs, d.family), (3, 4));
        assert_eq!(&d.addr[..4], &[10, 1, 0, 0]);
        assert_eq!(cidr_of(&k), Some((3, "10.1.0.0".parse().unwrap(), 20)));
        let k6 = cidr_key(1, "fd00::1:2:3".parse().unwrap(), 127).unwrap();
        assert_eq!(cidr_of(&k6), Some((1, "fd00::1:2:2".parse().unwrap(), 127)));
        let all = cidr_key(1, "1.2.3.4".parse().unwrap(), 0).unwrap();
        assert_eq!(cidr_of(&all), Some((1, "0.0.0.0".parse().unwrap(), 0)));
        assert!(cidr_key(1, "1.2.3.4".parse().unwrap(), 33).is_none());
        assert!(cidr_key(1, "::".parse().unwrap(), 129).is_none());
    }

    #[test]
    fn remote_keys_and_hops_round_trip() {
        let k = remote_key("10.244.2.9".parse().unwrap(), 24).unwrap();
        assert_eq!(k.prefix_len(), 56);
        assert_eq!(remote_of(&k), Some(("10.244.2.0".parse().unwrap(), 24)));
        let k6 = remote_key("fd00:0:0:2::5".parse().unwrap(), 64).unwrap();
        assert_eq!(k6.prefix_len(), 96);
        assert_eq!(remote_of(&k6), Some(("fd00:0:0:2::".parse().unwrap(), 64)));
        assert!(remote_key("10.0.0.0".parse().unwrap(), 33).is_none());
        let h = RemoteHop::new(3, 1450, "10.244.2.0".parse().unwrap());
        assert_eq!((h.nh_family, &h.nh[..4]), (2, &[10, 244, 2, 0][..]));
        assert_eq!(h.next_hop(), Some("10.244.2.0".parse().unwrap()));
        let h6 = RemoteHop::new(3, 1500, "fd50::2".parse().unwrap());
        assert_eq!(h6.nh_family, 10);
        assert_eq!(h6.next_hop(), Some("fd50::2".parse().unwrap()));
        assert_eq!(RemoteHop { nh_family: 7, ..h6 }.next_hop(), None);
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
        assert!(a.same_as(&Endpoint { identity: 4, ..a }));
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
        let [pin_in, pin_out] = a.policy_link_pins();
        assert_eq!(pin_in, format!("link-pol-in-{a}"));
        assert_eq!(AttachmentId::from_link_pin(&pin_in), None);
        assert_eq!(AttachmentId::from_link_pin(&pin_out), None);
        assert_eq!(AttachmentId::from_policy_link_pin(&pin_in), Some(a));
        assert_eq!(AttachmentId::from_policy_link_pin(&pin_out), Some(a));
        assert_eq!(AttachmentId::from_policy_link_pin(&pin), None);
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

/// `struct svc_key` of `c/services.bpf.c`: a Service's address (IPv4 in
/// the first four bytes), protocol and port (network order).
#[repr(C)]
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, FromBytes, IntoBytes, Immutable,
)]
pub struct SvcKey {
    pub addr: [u8; 16],
    pub port_be: u16,
    pub proto: u8,
    /// 4 or 6.
    pub family: u8,
}

const _: () = assert!(size_of::<SvcKey>() == 20);

/// `struct svc_val`: the Service's backends are `(id, 0..count)`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub struct SvcVal {
    pub id: u32,
    pub count: u32,
    /// `sessionAffinity: ClientIP`'s timeout; 0: none.
    pub affinity_s: u32,
    pub pad: u32,
}

/// `struct be_idx_key`: a backend of a Service with affinity.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub struct SvcBackendIdx {
    pub id: u32,
    pub be: SvcBackend,
}

const _: () = assert!(size_of::<SvcBackendIdx>() == 24);

/// `struct be_key`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub struct SvcBackendKey {
    pub id: u32,
    pub slot: u32,
}

/// `struct be_val` (and `struct rev_val`, the same layout): an address
/// and port, network order.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub struct SvcBackend {
    pub addr: [u8; 16],
    pub port_be: u16,
    pub family: u8,
    pub pad: u8,
}

const _: () = assert!(size_of::<SvcBackend>() == 20);

/// `struct rev_key` of c/services.bpf.c: a socket (its cookie) and the
/// backend it was given; the value, a [`SvcBackend`], is the frontend.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, Immutable)]
pub struct SvcRevKey {
    pub cookie: u64,
    pub be: SvcBackend,
    pub pad: [u8; 4],
}

const _: () = assert!(size_of::<SvcRevKey>() == 32);

fn ip_bytes(ip: IpAddr) -> ([u8; 16], u8) {
    let mut addr = [0u8; 16];
    match ip {
        IpAddr::V4(v4) => {
            addr[..4].copy_from_slice(&v4.octets());
            (addr, 4)
        }
        IpAddr::V6(v6) => (v6.octets(), 6),
    }
}

fn bytes_ip(addr: [u8; 16], family: u8) -> IpAddr {
    if family == 4 {
        IpAddr::from([addr[0], addr[1], addr[2], addr[3]])
    } else {
        IpAddr::from(addr)
    }
}

impl SvcKey {
    pub fn new(ip: IpAddr, proto: u8, port: u16) -> SvcKey {
        let (addr, family) = ip_bytes(ip);
        SvcKey {
            addr,
            port_be: port.to_be(),
            proto,
            family,
        }
    }

    pub fn ip(&self) -> IpAddr {
        bytes_ip(self.addr, self.family)
    }

    pub fn port(&self) -> u16 {
        u16::from_be(self.port_be)
    }
}

impl SvcBackend {
    pub fn new(sa: std::net::SocketAddr) -> SvcBackend {
        let (addr, family) = ip_bytes(sa.ip());
        SvcBackend {
            addr,
            port_be: sa.port().to_be(),
            family,
            pad: 0,
        }
    }

    pub fn socket_addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::new(bytes_ip(self.addr, self.family), u16::from_be(self.port_be))
    }
}
