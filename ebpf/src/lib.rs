//! rcni's eBPF datapath: the tc programs of `c/datapath.bpf.c` (the fast
//! path, and network policy from `c/policy.h`), compiled by clang in
//! `build.rs` and embedded here, and their loader.
//!
//! One copy of the programs and their maps serves a whole network, for the
//! fastpath and policy plugins alike: whichever comes first loads it and
//! pins programs and maps under the network's pin directory
//! (`/sys/fs/bpf/rcni/<network>/`); every later call opens the pins, so a
//! pod's ADD is an attach and a few map updates. Both plugins write their
//! part of the same endpoint entry per pod address. Each pod's attachment is
//! a tcx link pinned per attachment id (the plugin process exits after every
//! call, and an unpinned tcx link dies with its last fd), or on kernels
//! without tcx a cls_bpf filter on a clsact qdisc, which lives on its own.
//!
//! The code, by concern: loading the object or opening the pins, with the
//! layout checks, in `load.rs`; the endpoints and their
//! counters in `endpoints.rs`; the policy plugin's rule maps in `policy.rs`;
//! hooking programs to veths and taking them off in `attach.rs`; the map
//! types shared with the C in `types.rs`; errors in `error.rs`.

mod attach;
pub mod bpffs;
mod endpoints;
mod error;
mod load;
pub mod netkit;
mod policy;
mod remote;
pub mod services;
pub mod shape;
pub mod sockterm;
mod types;

pub use attach::{
    Hook, detach_policy, detach_policy_links_except, detach_policy_tc, detach_policy_tcx,
    detach_port_link, detach_tc, detach_tcx, netkit_peer_programs, open_attached,
    pinned_link_count, pinned_links, pinned_policy_links, pinned_port_links, policy_hook_on,
    port_link_pin, tcx_egress_programs, tcx_programs,
};
pub use error::{AyaError, Error, Result};
pub use load::{Datapath, entry_keys_under, remove_network};
pub use policy::{FlowEvents, flow_events_id};
pub use remote::{detach_net, net_links};
pub use types::{
    AttachmentId, CT_EGRESS, CT_INGRESS, CtKey, EP_FASTPATH, EP_NETKIT, EP_NORMAL_PATH, EP_POLICY,
    EP_SHAPED, EV_ALLOW, EV_AUDIT, EV_DENY, EVENTS_ALLOW, EVENTS_DENY, Endpoint, EndpointKey,
    EndpointStats, FlowEvent, MAX_ENDPOINTS, MAX_PORT_RANGES, MAX_REMOTES, POL_AUDIT_IN,
    POL_AUDIT_OUT, POL_ENFORCE, PORTS_DIRECT, PORTSET_ALL, PORTSET_NONE, PeerKey, Police,
    PolicyConfig, PortRange, RemoteHop, RemoteStats, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC,
    Verdict, fmt_mac,
};

/// The fast path program's name in the object (and in the kernel: under 16
/// bytes).
pub const PROGRAM: &str = "rcni_fastpath";
/// The pod's ingress policy, on the egress hook of its host veth.
pub const POLICY_IN_PROGRAM: &str = "rcni_pol_in";
/// The pod's egress policy, on the ingress hook, in front of the fast path.
pub const POLICY_OUT_PROGRAM: &str = "rcni_pol_out";
/// From other nodes, on the ingress hook of the uplink and VXLAN devices.
pub const FROM_NET_PROGRAM: &str = "rcni_from_net";
/// Both plugins' one program on a pod's clsact ingress hook: the policy
/// plugin's egress check, then the fast path, each where the port's entry
/// in `rcni_ports` says its plugin is attached ([`PORT_POLICY`],
/// [`PORT_FASTPATH`]).
pub const POD_PROGRAM: &str = "rcni_pod";
/// A port's part in `rcni_ports`: the fast path runs in `rcni_pod`.
pub const PORT_FASTPATH: u32 = 1;
/// A port's part in `rcni_ports`: the policy plugin's egress check runs in
/// `rcni_pod`.
pub const PORT_POLICY: u32 = 2;
/// A port's part in `rcni_ports`: bandwidth's egress policer (its entry in
/// `rcni_police`) runs in `rcni_pod`, or in `rcni_fastpath` on netkit.
pub const PORT_POLICE: u32 = 4;

/// The object's programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Program {
    Fastpath = 0,
    PolicyIn = 1,
    PolicyOut = 2,
    FromNet = 3,
    Pod = 4,
}

impl Program {
    pub const ALL: [Program; 5] = [
        Program::Fastpath,
        Program::PolicyIn,
        Program::PolicyOut,
        Program::FromNet,
        Program::Pod,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Program::Fastpath => PROGRAM,
            Program::PolicyIn => POLICY_IN_PROGRAM,
            Program::PolicyOut => POLICY_OUT_PROGRAM,
            Program::FromNet => FROM_NET_PROGRAM,
            Program::Pod => POD_PROGRAM,
        }
    }

    /// Its pin in the network's directory. The fast path's, `prog`, is
    /// pinned last: its presence means everything else is there too.
    pub(crate) fn pin(self) -> &'static str {
        match self {
            Program::Fastpath => PROG_PIN,
            Program::PolicyIn => "prog-pol-in",
            Program::PolicyOut => "prog-pol-out",
            Program::FromNet => "prog-net",
            Program::Pod => "prog-pod",
        }
    }
}

/// The layout of the pinned maps and what they mean, written into
/// `rcni_version` at load. Pins of another version are refused (1 was the
/// fast path alone, before the map held a version). Bump it with any change
/// of a key, a value or their meaning (3: `EP_NORMAL_PATH`, which a version
/// 2 program would ignore; 4: `rcni_remote`, `rcni_nat_socks` and
/// `rcni_from_net`, cross-node forwarding; 5: the endpoint's `pol_flags`
/// (audit), policy flow events and their maps, the remote entry's counter
/// slot and `rcni_remote_stats`; 6: `EP_NETKIT`, without which a program
/// on a netkit hook would hand packets to bpf_redirect_peer, which drops
/// them there; 7: `EP_SHAPED`, without which a program would deliver past
/// the pod's ingress shaping; 8: `rcni_ports` and `rcni_pod`, one program
/// on a pod's clsact ingress hook for both plugins; 9: `rcni_police` and
/// `PORT_POLICE`, bandwidth's node-side egress policer; 10: `rcni_pol_cfg`'s
/// value grows by `flags`, `POL_ENFORCE`).
pub const DATAPATH_VERSION: u32 = 10;

/// The fast path program's pin, pinned last.
const PROG_PIN: &str = "prog";

#[repr(C, align(8))]
struct Aligned<T: ?Sized>(T);

// ELF parsing wants the object aligned; include_bytes! gives no guarantee.
static OBJECT: &Aligned<[u8]> =
    &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/datapath.bpf.o")));

/// The compiled object (ELF, BPF target), as embedded.
pub fn object() -> &'static [u8] {
    &OBJECT.0
}
