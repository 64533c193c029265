// SPDX-License-Identifier: Apache-2.0
//
// rcni's datapath: one object per network, tc programs on each pod's
// host-side veth sharing every map (the endpoints above all: fast path and
// policy know the same pods from one table). On the default clsact hooks a
// pod has one program per hook: rcni_pod on ingress (the policy plugin's
// egress check, then the fast path, as rcni_ports says), rcni_pol_in on
// egress. On tcx and netkit hooks each plugin attaches its own program:
// rcni_pol_out, then rcni_fastpath.
//
// rcni_fastpath (ingress hook of the host veth): a packet from a pod to
// another pod of the same network on this node is rewritten as the normal
// path would (bridge: unchanged at L2, or routed through the gateway; ptp:
// routed) and handed with bpf_redirect_peer straight to the destination
// pod's interface: it skips the bridge, netfilter, the routing lookup and the
// destination host veth's backlog queue. Everything else (ARP, neighbour
// discovery, unknown addresses, other nodes) continues on the normal path
// untouched.
//
// Cross-node (the rcni-node agent with "ebpf": true): a routed packet from a
// pod to a pod subnet of another node (rcni_remote, kept by the agent) leaves
// with bpf_redirect_neigh on the uplink (native routing) or the VXLAN device
// (whose permanent neighbour and FDB entries the agent writes), skipping the
// bridge, netfilter and the routing lookup; rcni_from_net, on the ingress
// hook of the uplink and the VXLAN devices, hands a packet for a local pod
// straight to it with bpf_redirect_peer.
//
// rcni_pol_out (ingress hook, in front of rcni_fastpath) and rcni_pol_in
// (egress hook) enforce network policy, see policy.h. The redirect skips the
// receiver's host veth and with it rcni_pol_in: so rcni_fastpath decides the
// sender's egress and the receiver's ingress policy itself before it
// redirects.
//
// The layouts of the map keys and values are mirrored by #[repr(C)] types in
// ebpf/src/types.rs; change both together, and bump DATAPATH_VERSION there
// when a layout or a meaning changes. The maps carry no pinning attribute:
// the loader pins them per network (and tests load them unpinned).

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>
#include "edt.h"

#define FAMILY_V4 4
#define FAMILY_V6 6

// An endpoint address: IPv4 in the first four bytes of addr (network order),
// the rest zero.
struct ep_key {
	__u32 family;
	__u8 addr[16];
};

struct endpoint {
	// The pod's host-side veth in the node namespace: bpf_redirect_peer
	// delivers into its peer, the pod's interface.
	__u32 ifindex;
	// The address's counters in rcni_ep_stats (allocated by userspace).
	__u32 slot;
	__u8 pod_mac[6];
	// The MAC of the pod's gateway (the bridge, or for ptp the pod's host
	// veth): the source MAC of routed packets delivered to this pod, and the
	// destination MAC of routed packets this pod sends.
	__u8 node_mac[6];
	// Which plugins wrote the entry (EP_*). Each keeps its own fields and
	// leaves the other's alone; the entry goes when no flag is left.
	__u32 flags;
	// Which CNI attachment owns the entry; only userspace reads it.
	__u64 owner;
	// Policy (EP_POLICY): the pod's label-set identity (0: none) and the
	// rule sets deciding traffic to it and from it (0: not selected, all
	// allowed).
	__u32 identity;
	__u32 ingress_rs;
	__u32 egress_rs;
	// POL_AUDIT_*: a direction whose rule set is audit-only reports what it
	// would deny and lets it through.
	__u32 pol_flags;
};

#define POL_AUDIT_IN 1
#define POL_AUDIT_OUT 2

// The fast path added the entry: the MACs are valid, it may redirect.
#define EP_FASTPATH 1
// The policy plugin added the entry: identity and rule sets are valid.
#define EP_POLICY 2
// With EP_FASTPATH: the pod's traffic keeps the normal path both ways. Its
// host veth carries traffic control that a redirect would skip (bandwidth's
// TBF root qdisc, or its ingress redirect to an IFB, which runs after tcx),
// or bridge port isolation the bridge alone enforces.
#define EP_NORMAL_PATH 4
// With EP_FASTPATH: the pod's fast path runs on its netkit primary's peer
// hook (the pod's transmit), where bpf_redirect_peer is refused (it needs an
// ingress hook): its packets for local pods go out of the destination's
// node-side device with bpf_redirect, which delivers to the pod's end as the
// veth or netkit driver does.
#define EP_NETKIT 8
// With EP_FASTPATH: bandwidth shapes the pod's ingress on its host veth (an
// fq root qdisc and rcni_edt, shape.bpf.c, on the veth's egress hook):
// packets for it go out of the host veth with bpf_redirect, through that
// hook and qdisc, instead of bpf_redirect_peer past both.
#define EP_SHAPED 16

// Per address: rx = redirected to it, tx = redirected from it.
struct ep_stats {
	__u64 rx_packets;
	__u64 rx_bytes;
	__u64 tx_packets;
	__u64 tx_bytes;
};

// Why a packet was passed on or redirected; one per-CPU counter each.
enum verdict {
	V_REDIRECT = 0,
	V_NOT_IP = 1,       // ARP, VLAN tags, other ethertypes
	V_SHORT = 2,        // headers cut short
	V_UNKNOWN_DST = 3,  // not a fast path endpoint: other nodes, the node
	V_UNKNOWN_SRC = 4,  // source not an endpoint behind this veth, nor a remote pod
	V_OTHER = 5,        // hairpin, ND, TTL 1, multicast MAC, foreign source MAC
	V_POL_DENY_IN = 6,  // dropped: the receiver's ingress policy
	V_POL_DENY_OUT = 7, // dropped: the sender's egress policy
	V_POL_SPOOF = 8,    // dropped: a pod sent from an address not its own
	V_NORMAL_PATH = 9,  // an end keeps the normal path (EP_NORMAL_PATH)
	V_TO_REMOTE = 10,   // redirected to another node (bpf_redirect_neigh)
	V_FROM_REMOTE = 11, // from another node, redirected to a local pod
	V_TOO_BIG = 12,     // over the out device's MTU: the normal path answers
	V_NAT_FLOW = 13,    // a flow the node's NAT translated keeps the normal path
	V_EV_LOST = 14,     // a policy flow event the full ring buffer refused
	V_EV_LIMITED = 15,  // a policy flow event a pod's rate limit suppressed
	V_MAX = 16,
};

// Addresses of one network on one node (both families count).
#define MAX_ENDPOINTS 16384

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_ENDPOINTS);
	__type(key, struct ep_key);
	__type(value, struct endpoint);
} rcni_endpoints SEC(".maps");

// Counters by slot: a per-CPU array lookup costs a fraction of a per-CPU
// hash lookup keyed by address (~10 ns against ~55 ns here, twice per
// packet), and per-CPU values need no atomic operations.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MAX_ENDPOINTS);
	__type(key, __u32);
	__type(value, struct ep_stats);
} rcni_ep_stats SEC(".maps");

// Which slots are taken: a bitmap that only userspace reads and writes
// (under the network's directory lock); the program never touches it.
struct slot_bitmap {
	__u64 words[MAX_ENDPOINTS / 64];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct slot_bitmap);
} rcni_slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, V_MAX);
	__type(key, __u32);
	__type(value, __u64);
} rcni_verdicts SEC(".maps");

// The layout version the loader wrote (DATAPATH_VERSION in ebpf/src); the
// programs never read it. Opening pins of another version fails instead of
// reading garbage.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} rcni_version SEC(".maps");

// Another node's pod subnet (rcni-node keeps it): an LPM trie keyed by
// family then address, prefixlen = 32 + the subnet's prefix length.
struct remote_key {
	__u32 prefixlen;
	__u32 family;
	__u8 addr[16];
};

struct remote {
	// The uplink (native routing) or the VXLAN device.
	__u32 ifindex;
	// That device's MTU: a bigger packet takes the normal path, which
	// answers "fragmentation needed" (bpf_check_mtu is GPL-only).
	__u32 mtu;
	// The next hop: the peer's node address (host-gw) or its VTEP's
	// address on the VXLAN device (which has a permanent neighbour entry).
	struct bpf_redir_neigh nh;
	// The peer's counters in rcni_remote_stats (allocated by userspace).
	__u32 slot;
};

// What this node's pods sent to each peer subnet through the datapath, by
// the entry's slot: per-CPU, no atomic operation on the way out. A peer's
// traffic from this node is its senders' count: the receiving side is not
// counted (it would cost another LPM lookup per packet).
struct remote_stats {
	__u64 tx_packets;
	__u64 tx_bytes;
};

#define MAX_REMOTES 8192

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MAX_REMOTES);
	__type(key, __u32);
	__type(value, struct remote_stats);
} rcni_remote_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, MAX_REMOTES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct remote_key);
	__type(value, struct remote);
} rcni_remote SEC(".maps");

// Sockets whose traffic the node's NAT translates (a local pod's connection
// to a service address DNATed to a remote pod, a remote pod's connection to
// a hostPort): (family, protocol, address, port) of the end that opened a
// flow to an address that is no pod's. The other direction must take the
// normal path too, or it would skip the reverse translation in the node's
// conntrack. The port is the one flow_l4 reads (ICMP echo: the identifier).
// Every flow with such a socket at either end keeps the normal path both
// ways (nat_flow): the socket may share its port with flows to pods (a
// server, a reused ephemeral port, a new pod on a deleted one's address),
// and conntrack must see both directions of those or none.
struct nat_sock {
	__u8 family;
	__u8 proto;
	__u16 port;
	__u8 addr[16];
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct nat_sock);
	__type(value, __u64);
} rcni_nat_socks SEC(".maps");

// The pods' host-side devices whose ingress hook runs rcni_pod, by
// ifindex: which plugins share it (PORT_*). Each plugin sets its bit at ADD
// and clears it at DEL; the last one takes the program off the hook.
#define PORT_FASTPATH 1
#define PORT_POLICY 2
// bandwidth's egress limit, policed where the pod cannot reach it (its
// entry in rcni_police): see police().
#define PORT_POLICE 4

// Indexes below PORTS_DIRECT (a node's veths, until churn has used that
// many) live in an array, whose lookup the verifier inlines into a bounds
// check and a load: the fast path's BPF_PROG_TEST_RUN cost stays at 102-103
// ns a packet in rcni_pod, where a hash lookup made it 125. Larger ones in
// the hash.
#define PORTS_DIRECT 16384

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, PORTS_DIRECT);
	__type(key, __u32);
	__type(value, __u32);
} rcni_ports_direct SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_ENDPOINTS);
	__type(key, __u32);
	__type(value, __u32);
} rcni_ports SEC(".maps");

// Two call sites, each with its map: clang would otherwise merge the two
// lookups into one call whose map the verifier cannot know, which it then
// leaves to the generic helper instead of inlining the array's (~13 ns a
// packet more). The empty asm keeps them apart.
static __always_inline __u32 port_parts(__u32 ifindex)
{
	if (ifindex < PORTS_DIRECT) {
		__u32 *p = bpf_map_lookup_elem(&rcni_ports_direct, &ifindex);
		return p ? *p : 0;
	}
	asm volatile("" ::: "memory");
	__u32 *h = bpf_map_lookup_elem(&rcni_ports, &ifindex);
	return h ? *h : 0;
}

// bandwidth shapes a fast path pod's egress inside the pod (an fq root
// qdisc and rcni_edt on its interface, shape.bpf.c), where a pod with
// CAP_NET_ADMIN could take it off. The node side keeps the limit anyway:
// the same account of bytes against the rate (edt.h, as rcni_edt keeps it),
// checked on the pod's host-side device, drops what runs further ahead of
// the rate than the pod's own shaping ever lets through (its horizon is
// the pod's twice). A pod that keeps its shaping never meets it.
struct police {
	__u64 rate;        // bytes per second
	__u64 burst_ns;    // the burst as time at the rate
	__u64 horizon_ns;  // how far ahead of the rate a packet may be
	__u64 t_last;      // when the bytes so far are paid off at the rate
	__u64 passed;      // packets let through, and dropped
	__u64 dropped;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_ENDPOINTS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct police);
} rcni_police SEC(".maps");

// Whether the packet goes past the pod's limit (and is dropped). skb->len
// at an ingress hook counts a GSO packet's headers once (the pod's shaping
// counts each segment's): the policer errs on the pod's side.
static __always_inline int police_drops(struct __sk_buff *skb)
{
	__u32 ifindex = skb->ifindex;
	struct police *p = bpf_map_lookup_elem(&rcni_police, &ifindex);
	if (!p || !p->rate)
		return 0;
	if (!edt_charge(&p->t_last, bpf_ktime_get_ns(), skb->len, p->rate, p->burst_ns,
			p->horizon_ns)) {
		__sync_fetch_and_add(&p->dropped, 1);
		return 1;
	}
	__sync_fetch_and_add(&p->passed, 1);
	return 0;
}

static __always_inline void count(__u32 v)
{
	__u64 *c = bpf_map_lookup_elem(&rcni_verdicts, &v);
	if (c)
		*c += 1;
}

// TC_ACT_UNSPEC, not TC_ACT_OK: on tcx it means "next program", on a
// cls_bpf filter "next filter", so whatever else sits on the hook (the
// policy plugin, a bandwidth plugin's ingress redirect) still sees the packet.
static __always_inline int pass(__u32 v)
{
	count(v);
	return TC_ACT_UNSPEC;
}

static __always_inline int drop(__u32 v)
{
	count(v);
	return TC_ACT_SHOT;
}

// Makes the first `need` bytes linear (direct packet access reaches only the
// linear part). Packet pointers are invalid afterwards.
static __always_inline int ensure(struct __sk_buff *skb, __u32 need)
{
	if ((void *)(long)skb->data + need <= (void *)(long)skb->data_end)
		return 0;
	if (skb->len < need)
		return -1;
	return bpf_skb_pull_data(skb, need);
}

static __always_inline int mac_eq(const __u8 *a, const __u8 *b)
{
	return ((a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3]) |
		(a[4] ^ b[4]) | (a[5] ^ b[5])) == 0;
}

#define ICMPV6_ND_FIRST 133 // router solicitation
#define ICMPV6_ND_LAST 137  // redirect

#include "policy.h"

#ifndef AF_INET
#define AF_INET 2
#define AF_INET6 10
#endif

static __always_inline struct remote *remote_of(__u32 family, const __u8 *addr)
{
	struct remote_key k = { .family = family };

	k.prefixlen = 32 + (family == FAMILY_V4 ? 32 : 128);
	__builtin_memcpy(k.addr, addr, 16);
	return bpf_map_lookup_elem(&rcni_remote, &k);
}

static __always_inline void nat_sock_of(struct nat_sock *k, const struct flow *f, int src)
{
	k->family = f->family;
	k->proto = f->proto;
	k->port = src ? f->sport : f->dport;
	__builtin_memcpy(k->addr, src ? f->saddr : f->daddr, 16);
}

// Whether f's packet may open a flow: of TCP only a bare SYN, of ICMP
// anything but an echo reply, any other packet. A server answering the node
// or the outside (a kubelet probe, a host-network client, a NodePort) opens
// nothing, and recording its listening socket would send every pod's
// connection to it through the node.
static __always_inline int opens(struct __sk_buff *skb, const struct flow *f)
{
	if (f->proto == IPPROTO_TCP) {
		__u8 flags;
		if (!f->l4_off || bpf_skb_load_bytes(skb, f->l4_off + 13, &flags, 1))
			return 0;
		// The flags byte: SYN 0x02, ACK 0x10.
		return (flags & 0x12) == 0x02;
	}
	if (f->proto == IPPROTO_ICMP)
		return f->icmp_type != 0;
	if (f->proto == IPPROTO_ICMPV6)
		return f->icmp_type != 129;
	return 1;
}

// The source socket of f talks to an address that is no pod's.
static __always_inline void nat_sock_record(struct __sk_buff *skb, const struct flow *f)
{
	struct nat_sock k = {};
	__u64 now = bpf_ktime_get_ns();

	nat_sock_of(&k, f, 1);
	// Every packet a pod sends past the cluster's pods comes here: a
	// flow already recorded only has its time written in place (the LRU's
	// lookup marks it used), as an update would replace the element (a
	// fresh one from the free list, the old one freed after RCU): 220 ns a
	// packet against 84 (program_cost, "unknown v4").
	__u64 *seen = bpf_map_lookup_elem(&rcni_nat_socks, &k);
	if (seen) {
		*seen = now;
		return;
	}
	if (!opens(skb, f))
		return;
	bpf_map_update_elem(&rcni_nat_socks, &k, &now, BPF_ANY);
}

// f has a socket recorded above at either end.
static __always_inline int nat_flow(const struct flow *f)
{
	struct nat_sock k = {};

	nat_sock_of(&k, f, 0);
	if (bpf_map_lookup_elem(&rcni_nat_socks, &k))
		return 1;
	nat_sock_of(&k, f, 1);
	return bpf_map_lookup_elem(&rcni_nat_socks, &k) != 0;
}

// Whether the packet (or, GSO, each of its segments: the headers before l4_off
// and the L4 header, then gso_size bytes) fits the out device's mtu. A pod
// whose MTU is bigger than the path's (a cluster switched from host-gw to
// vxlan keeps its pods' MTU) is told so by the normal path, as routing
// would: "fragmentation needed".
static __always_inline int fits(struct __sk_buff *skb, __u32 mtu, __u32 l4_off, __u8 proto)
{
	if (!skb->gso_size)
		return skb->len <= mtu + ETH_HLEN;
	__u32 hdr = l4_off - ETH_HLEN;
	if (proto == IPPROTO_TCP) {
		__u8 doff;
		if (bpf_skb_load_bytes(skb, l4_off + 12, &doff, 1))
			return 0;
		hdr += (doff >> 4) * 4;
	} else if (proto == IPPROTO_UDP) {
		hdr += 8;
	} else {
		return 0;
	}
	return skb->gso_size + hdr <= mtu;
}

// Routing's TTL / hop limit decrement (the caller checked it is above 1).
// IPv4: ip_decrease_ttl's incremental checksum, so that a CHECKSUM_COMPLETE
// skb->csum stays right; IPv6 has no header checksum and the helper fixes
// skb->csum. Nonzero on failure. Invalidates packet pointers.
static __always_inline int decrement_ttl(struct __sk_buff *skb, int v6)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;

	if (!v6) {
		struct iphdr *ip = data + ETH_HLEN;
		if ((void *)(ip + 1) > data_end)
			return -1;
		__u32 check = ip->check;
		check += bpf_htons(0x0100);
		ip->check = (__u16)(check + (check >= 0xffff));
		ip->ttl -= 1;
		return 0;
	}
	struct ipv6hdr *ip6 = data + ETH_HLEN;
	if ((void *)(ip6 + 1) > data_end)
		return -1;
	__u8 hop_limit = ip6->hop_limit - 1;
	return bpf_skb_store_bytes(skb, ETH_HLEN + offsetof(struct ipv6hdr, hop_limit), &hop_limit,
				   1, BPF_F_RECOMPUTE_CSUM);
}

// The TTL or hop limit of the IP header after the Ethernet header; 0 when
// cut short.
static __always_inline __u8 ttl_of(struct __sk_buff *skb, int v6)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;

	if (!v6) {
		struct iphdr *ip = data + ETH_HLEN;
		if ((void *)(ip + 1) > data_end)
			return 0;
		return ip->ttl;
	}
	struct ipv6hdr *ip6 = data + ETH_HLEN;
	if ((void *)(ip6 + 1) > data_end)
		return 0;
	return ip6->hop_limit;
}

// A routed packet from pod `from` to an address that is no local endpoint:
// to another node's pod subnet it leaves through the out device with
// bpf_redirect_neigh; anything else (the node, the outside world, a service
// address) goes on to the normal path, its socket noted when the node may
// translate it.
static __always_inline int to_remote(struct __sk_buff *skb, struct endpoint *from,
				     struct ep_key *dst, struct ep_key *src, __u8 proto,
				     __u32 l4_off, int has_l4, int v6)
{
	struct flow f = {};
	f.family = src->family;
	f.proto = proto;
	__builtin_memcpy(f.saddr, src->addr, 16);
	__builtin_memcpy(f.daddr, dst->addr, 16);
	f.l4_off = has_l4 ? l4_off : 0;
	flow_l4(skb, &f);

	struct remote *r = remote_of(dst->family, dst->addr);
	if (!r) {
		nat_sock_record(skb, &f);
		return pass(V_UNKNOWN_DST);
	}
	// A reply to a remote socket that reached this pod through the node's
	// NAT (a hostPort): the reverse translation is the node's.
	if (nat_flow(&f))
		return pass(V_NAT_FLOW);
	if (!fits(skb, r->mtu, l4_off, proto))
		return pass(V_TOO_BIG);
	// TTL 1 expires here: the normal path answers with ICMP.
	if (ttl_of(skb, v6) <= 1)
		return pass(V_OTHER);
	// The receiver's ingress policy is its node's to decide; the sender's
	// egress is decided here (rcni_pol_out in front has already, when the
	// policy plugin is attached: the flow record makes this a lookup).
	// A remote pod's identity is not known here: its address is.
	if ((from->ingress_rs | from->egress_rs) && !egress_point(from, &f, 0, 0, 0))
		return drop(V_POL_DENY_OUT);
	if (decrement_ttl(skb, v6))
		return pass(V_SHORT);
	struct bpf_redir_neigh nh = r->nh;
	__u32 ifindex = r->ifindex;
	__u32 peer_slot = r->slot;
	__u64 len = skb->len;
	struct ep_stats *s = bpf_map_lookup_elem(&rcni_ep_stats, &from->slot);
	if (s) {
		s->tx_packets += 1;
		s->tx_bytes += len;
	}
	struct remote_stats *ps = bpf_map_lookup_elem(&rcni_remote_stats, &peer_slot);
	if (ps) {
		ps->tx_packets += 1;
		ps->tx_bytes += len;
	}
	count(V_TO_REMOTE);
	// The neighbour subsystem fills in both MACs (the out device's, the
	// next hop's) and queues the packet on the device: no routing lookup,
	// no netfilter, no bridge.
	return bpf_redirect_neigh(ifindex, &nh, sizeof(nh), 0);
}

static __always_inline int fastpath(struct __sk_buff *skb)
{
	struct ep_key dst = {}, src = {};
	__u32 l3_len, l4_off;
	__u8 proto;
	int v6, has_l4 = 1;

	if (ensure(skb, ETH_HLEN))
		return pass(V_SHORT);
	struct ethhdr *eth = (void *)(long)skb->data;
	if ((void *)(eth + 1) > (void *)(long)skb->data_end)
		return pass(V_SHORT);
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		v6 = 0;
		l3_len = sizeof(struct iphdr);
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		v6 = 1;
		// One byte past the header: the ICMPv6 type, if that follows.
		l3_len = sizeof(struct ipv6hdr) + 1;
	} else {
		return pass(V_NOT_IP);
	}
	// A destination pod's group address never is an endpoint; a multicast
	// or broadcast frame goes to the bridge, which floods it.
	if (eth->h_dest[0] & 1)
		return pass(V_OTHER);

	if (ensure(skb, ETH_HLEN + (v6 ? sizeof(struct ipv6hdr) : l3_len)))
		return pass(V_SHORT);
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	eth = data;
	if (!v6) {
		struct iphdr *ip = data + ETH_HLEN;
		if ((void *)(ip + 1) > data_end)
			return pass(V_SHORT);
		if (ip->version != 4 || ip->ihl < 5)
			return pass(V_SHORT);
		dst.family = FAMILY_V4;
		src.family = FAMILY_V4;
		__builtin_memcpy(dst.addr, &ip->daddr, 4);
		__builtin_memcpy(src.addr, &ip->saddr, 4);
		proto = ip->protocol;
		l4_off = ETH_HLEN + ip->ihl * 4;
		// Only a datagram's first fragment carries the ports.
		has_l4 = !(ip->frag_off & bpf_htons(IP_OFFSET_MASK));
	} else {
		struct ipv6hdr *ip6 = data + ETH_HLEN;
		if ((void *)(ip6 + 1) > data_end)
			return pass(V_SHORT);
		// Neighbour discovery keeps to the normal path: its messages
		// must arrive with hop limit 255 on the link they were sent on.
		if (ip6->nexthdr == IPPROTO_ICMPV6) {
			__u8 *type = (void *)(ip6 + 1);
			if ((void *)(type + 1) > data_end) {
				if (ensure(skb, ETH_HLEN + l3_len))
					return pass(V_SHORT);
				data = (void *)(long)skb->data;
				data_end = (void *)(long)skb->data_end;
				eth = data;
				ip6 = data + ETH_HLEN;
				type = (void *)(ip6 + 1);
				if ((void *)(type + 1) > data_end)
					return pass(V_SHORT);
			}
			if (*type >= ICMPV6_ND_FIRST && *type <= ICMPV6_ND_LAST)
				return pass(V_OTHER);
		}
		dst.family = FAMILY_V6;
		src.family = FAMILY_V6;
		__builtin_memcpy(dst.addr, &ip6->daddr, 16);
		__builtin_memcpy(src.addr, &ip6->saddr, 16);
		proto = ip6->nexthdr;
		l4_off = ETH_HLEN + sizeof(struct ipv6hdr);
	}

	// Both ends must be the fast path's own endpoints (an entry the
	// policy plugin alone wrote has no MACs to deliver with), or the
	// destination another node's pod.
	struct endpoint *to = bpf_map_lookup_elem(&rcni_endpoints, &dst);
	if (to && !(to->flags & EP_FASTPATH))
		return pass(V_UNKNOWN_DST);
	// The source must be an endpoint behind the veth the packet came in
	// on: its gateway MAC tells a routed packet from a bridged one, and a
	// pod cannot use the fast path with another pod's address.
	struct endpoint *from = bpf_map_lookup_elem(&rcni_endpoints, &src);
	if (!from || from->ifindex != skb->ifindex || !(from->flags & EP_FASTPATH)) {
		if (!to)
			return pass(V_UNKNOWN_DST);
		return pass(V_UNKNOWN_SRC);
	}
	if (!to) {
		// Not local: another node's pod, if routed through the
		// gateway by a pod that may use the fast path.
		if (from->flags & EP_NORMAL_PATH)
			return pass(V_NORMAL_PATH);
		if (!mac_eq(eth->h_source, from->pod_mac) ||
		    !mac_eq(eth->h_dest, from->node_mac))
			return pass(V_OTHER);
		return to_remote(skb, from, &dst, &src, proto, l4_off, has_l4, v6);
	}
	// A shaped or isolated pod: the redirect would skip the qdiscs of its
	// host veth (or the bridge's isolation), so both directions stay off.
	if ((from->flags | to->flags) & EP_NORMAL_PATH)
		return pass(V_NORMAL_PATH);
	if (to->ifindex == skb->ifindex)
		return pass(V_OTHER);
	// The pod's own MAC only: a frame with another source MAC is the
	// bridge's to judge (macspoofchk drops it), never delivered past it.
	if (!mac_eq(eth->h_source, from->pod_mac))
		return pass(V_OTHER);

	int routed;
	if (mac_eq(eth->h_dest, to->pod_mac)) {
		// Bridged: sent to the pod's own MAC; the bridge would forward
		// the frame unchanged.
		routed = 0;
	} else if (mac_eq(eth->h_dest, from->node_mac)) {
		// Routed through the gateway: the node would decrement the TTL
		// and send with its own MAC from the destination's gateway.
		routed = 1;
	} else {
		return pass(V_OTHER);
	}

	// TTL 1 expires here: the normal path answers with ICMP.
	if (routed) {
		if (!v6) {
			struct iphdr *ip = data + ETH_HLEN;
			if ((void *)(ip + 1) > data_end)
				return pass(V_SHORT);
			if (ip->ttl <= 1)
				return pass(V_OTHER);
		} else {
			struct ipv6hdr *ip6 = data + ETH_HLEN;
			if ((void *)(ip6 + 1) > data_end)
				return pass(V_SHORT);
			if (ip6->hop_limit <= 1)
				return pass(V_OTHER);
		}
	}

	struct flow f = {};
	f.family = src.family;
	f.proto = proto;
	__builtin_memcpy(f.saddr, src.addr, 16);
	__builtin_memcpy(f.daddr, dst.addr, 16);
	f.l4_off = has_l4 ? l4_off : 0;
	flow_l4(skb, &f);
	// A reply to a socket that talked to a service address the node
	// DNATed to this pod, on this node: it carries this pod's address where
	// the socket waits for the service's, and only the node's conntrack
	// puts that back. Redirected, it reached the socket untranslated and
	// was refused (the NetworkPolicy suite's probes through each pod's
	// Service, with "ebpf": true).
	if (nat_flow(&f))
		return pass(V_NAT_FLOW);

	// The redirect skips the receiver's host veth, where rcni_pol_in
	// would decide: both ends' policies are decided here, before anything
	// is rewritten. Pods no policy selects cost the four reads.
	if (from->ingress_rs | from->egress_rs | to->ingress_rs | to->egress_rs) {
		// The destination is a pod, never the node: no node exception.
		if (!egress_point(from, &f, 1, to->identity, 0))
			return drop(V_POL_DENY_OUT);
		if (!ingress_point(to, &f, 1, from->identity))
			return drop(V_POL_DENY_IN);
	}

	__u8 hop_limit = 0;
	if (routed) {
		if (!v6) {
			struct iphdr *ip = data + ETH_HLEN;
			if ((void *)(ip + 1) > data_end)
				return pass(V_SHORT);
			// ip_decrease_ttl: the header still sums to 0xffff, so a
			// CHECKSUM_COMPLETE skb->csum stays right too.
			__u32 check = ip->check;
			check += bpf_htons(0x0100);
			ip->check = (__u16)(check + (check >= 0xffff));
			ip->ttl -= 1;
		} else {
			struct ipv6hdr *ip6 = data + ETH_HLEN;
			if ((void *)(ip6 + 1) > data_end)
				return pass(V_SHORT);
			hop_limit = ip6->hop_limit - 1;
		}
		__builtin_memcpy(eth->h_source, to->node_mac, 6);
		__builtin_memcpy(eth->h_dest, to->pod_mac, 6);
		// Unlike IPv4's, the IPv6 header has no checksum that keeps the
		// sum constant: the helper fixes a CHECKSUM_COMPLETE skb->csum
		// (the node's forwarding would drop COMPLETE instead).
		if (hop_limit &&
		    bpf_skb_store_bytes(skb, ETH_HLEN + offsetof(struct ipv6hdr, hop_limit),
					&hop_limit, 1, BPF_F_RECOMPUTE_CSUM))
			return pass(V_SHORT);
	}

	__u32 ifindex = to->ifindex;
	__u64 len = skb->len;
	struct ep_stats *s = bpf_map_lookup_elem(&rcni_ep_stats, &to->slot);
	if (s) {
		s->rx_packets += 1;
		s->rx_bytes += len;
	}
	s = bpf_map_lookup_elem(&rcni_ep_stats, &from->slot);
	if (s) {
		s->tx_packets += 1;
		s->tx_bytes += len;
	}
	count(V_REDIRECT);
	if ((from->flags & EP_NETKIT) || (to->flags & EP_SHAPED))
		return bpf_redirect(ifindex, 0);
	// Into the peer of the destination's host veth, i.e. the pod's own
	// interface, at its ingress: no second pass through the host veth (its
	// TX counters stay still) nor through the node's stack.
	return bpf_redirect_peer(ifindex, 0);
}

// On netkit's peer hook (the pod's transmit, skb->ifindex the node's
// primary) rcni_fastpath runs alone, after policy's own program: the
// policer goes in front of it there.
SEC("classifier")
int rcni_fastpath(struct __sk_buff *skb)
{
	if ((port_parts(skb->ifindex) & PORT_POLICE) && police_drops(skb))
		return TC_ACT_SHOT;
	return fastpath(skb);
}

// Whether the source is a tunnelled peer node's own address in its pod
// subnet: its VTEP's (the subnet's first address, the peer entry's next
// hop) or the next one (its bridge's). A node's own traffic into the tunnel
// comes from one of them, and this node's NAT shows it to the pods as that
// node's address (the agent's snat rules), so it keeps the normal path.
// r is the peer's entry, whose subnet holds the source. Only sources whose
// last byte could be such an address for a subnet of /26 or shorter (IPv6:
// /122) are compared: pods' packets rarely are.
static __always_inline int from_peer_node(const struct flow *f, const struct remote *r)
{
	int v6 = f->family == FAMILY_V6;
	__u8 last = v6 ? f->saddr[15] : f->saddr[3];
	if (last & 0x3e)
		return 0;
	__u32 s[4], n[4] = {};
	__builtin_memcpy(s, f->saddr, 16);
	if (v6) {
		if (r->nh.nh_family != 10 /* AF_INET6 */)
			return 0;
		__builtin_memcpy(n, r->nh.ipv6_nh, 16);
		if (s[0] != n[0] || s[1] != n[1] || s[2] != n[2])
			return 0;
		return s[3] == n[3] || s[3] == (n[3] | bpf_htonl(1));
	}
	if (r->nh.nh_family != 2 /* AF_INET */)
		return 0;
	n[0] = r->nh.ipv4_nh;
	return s[0] == n[0] || s[0] == (n[0] | bpf_htonl(1));
}

// From another node: on the ingress hook of the node's uplink (native
// routing) and of its VXLAN devices (after decapsulation). A packet routed to
// a local fast path pod is rewritten as the node's forwarding would (TTL or
// hop limit decremented, source MAC the pod's gateway, destination MAC the
// pod's) and handed to the pod with bpf_redirect_peer, after the pod's
// ingress policy (its host veth's egress hook, where rcni_pol_in would
// decide, is skipped). Only another node's pod is forwarded so: the node's
// own traffic, another node's own (from_peer_node) and the outside world's
// continue unchanged (TC_ACT_UNSPEC), as the replies to them do.
SEC("classifier")
int rcni_from_net(struct __sk_buff *skb)
{
	struct flow f = {};

	// Sent to this node's MAC: not another host's frame seen on a shared
	// segment or flooded by a switch.
	if (skb->pkt_type != 0 /* PACKET_HOST */)
		return TC_ACT_UNSPEC;
	if (flow_parse(skb, &f) || is_nd(&f))
		return TC_ACT_UNSPEC;
	struct endpoint *to = endpoint_of(f.family, f.daddr);
	if (!to || !(to->flags & EP_FASTPATH)) {
		// A remote pod talking to the node or a service address: its
		// socket's replies keep the normal path (the node's NAT).
		if (remote_of(f.family, f.saddr)) {
			flow_l4(skb, &f);
			nat_sock_record(skb, &f);
		}
		return TC_ACT_UNSPEC;
	}
	if (to->flags & EP_NORMAL_PATH)
		return pass(V_NORMAL_PATH);
	// Only another node's pod: the pod's replies to anything else (a node,
	// the outside world) take the normal path (to_remote passes them), so
	// its packets must too, or the node's conntrack sees one direction
	// (the replies then INVALID, or masqueraded as a flow of their own).
	struct remote *r = remote_of(f.family, f.saddr);
	if (!r)
		return pass(V_UNKNOWN_SRC);
	if (from_peer_node(&f, r))
		return pass(V_NAT_FLOW);
	int v6 = f.family == FAMILY_V6;
	if (ttl_of(skb, v6) <= 1)
		return pass(V_OTHER);
	flow_l4(skb, &f);
	// A reply to a local socket whose traffic the node translated (a
	// service address DNATed to a remote pod).
	if (nat_flow(&f))
		return pass(V_NAT_FLOW);
	if (!ingress_point(to, &f, 0, 0))
		return drop(V_POL_DENY_IN);
	if (decrement_ttl(skb, v6))
		return pass(V_SHORT);
	if (ensure(skb, ETH_HLEN))
		return pass(V_SHORT);
	struct ethhdr *eth = (void *)(long)skb->data;
	if ((void *)(eth + 1) > (void *)(long)skb->data_end)
		return pass(V_SHORT);
	__builtin_memcpy(eth->h_source, to->node_mac, 6);
	__builtin_memcpy(eth->h_dest, to->pod_mac, 6);
	__u32 ifindex = to->ifindex;
	__u64 len = skb->len;
	struct ep_stats *s = bpf_map_lookup_elem(&rcni_ep_stats, &to->slot);
	if (s) {
		s->rx_packets += 1;
		s->rx_bytes += len;
	}
	count(V_FROM_REMOTE);
	if (to->flags & EP_SHAPED)
		return bpf_redirect(ifindex, 0);
	return bpf_redirect_peer(ifindex, 0);
}

// The pod's egress: packets the pod sends, on its host veth's ingress hook,
// in front of rcni_fastpath. TC_ACT_UNSPEC lets the packet on to the next
// program (the fast path) and the normal path.
static __always_inline int pol_out(struct __sk_buff *skb)
{
	struct flow f = {};

	if (!pol_enforcing())
		return TC_ACT_UNSPEC;
	if (flow_parse(skb, &f) || is_nd(&f))
		return TC_ACT_UNSPEC;
	// DHCP, duplicate address detection and link-local talk to the node
	// or the link, not through it: nothing to check them against.
	if (unchecked_source(&f))
		return TC_ACT_UNSPEC;
	// The pod must send from its own addresses: with another it could
	// slip out of its egress policy (and into another pod's replies).
	struct endpoint *p = endpoint_of(f.family, f.saddr);
	if (!p || p->ifindex != skb->ifindex)
		return drop(V_POL_SPOOF);
	if (!(p->ingress_rs | p->egress_rs))
		return TC_ACT_UNSPEC;
	flow_l4(skb, &f);
	if (!egress_point(p, &f, 0, 0, 1))
		return drop(V_POL_DENY_OUT);
	return TC_ACT_UNSPEC;
}

SEC("classifier")
int rcni_pol_out(struct __sk_buff *skb)
{
	return pol_out(skb);
}

// The pod's ingress: packets to the pod, on its host veth's egress hook
// (the fast path's redirects never come here: rcni_fastpath decides those).
SEC("classifier")
int rcni_pol_in(struct __sk_buff *skb)
{
	struct flow f = {};

	// Sent by the node itself (kubelet's probes, host-network processes):
	// always allowed. A forwarded packet, bridged or routed, carries the
	// device it came in on.
	if (skb->ingress_ifindex == 0 || !pol_enforcing())
		return TC_ACT_UNSPEC;
	if (flow_parse(skb, &f) || is_nd(&f))
		return TC_ACT_UNSPEC;
	// Not to one of the pod's own addresses (multicast, a network the pod
	// routes for): nothing this program decides.
	struct endpoint *p = endpoint_of(f.family, f.daddr);
	if (!p || p->ifindex != skb->ifindex)
		return TC_ACT_UNSPEC;
	if (!(p->ingress_rs | p->egress_rs))
		return TC_ACT_UNSPEC;
	flow_l4(skb, &f);
	if (!ingress_point(p, &f, 0, 0))
		return drop(V_POL_DENY_IN);
	return TC_ACT_UNSPEC;
}

// One program on a pod's host-side ingress hook for both plugins (the
// default clsact hook): each attach or detach of a filter is an rtnl round
// and a program to run per packet, and one filter serves both. The port's
// entry says which parts run: the policy plugin's egress check first (it
// must decide before anything is redirected), then the fast path. A port
// without parts (its plugins' DEL ran) passes everything on.
SEC("classifier")
int rcni_pod(struct __sk_buff *skb)
{
	__u32 parts = port_parts(skb->ifindex);

	if (parts & PORT_POLICY) {
		int r = pol_out(skb);
		if (r != TC_ACT_UNSPEC)
			return r;
	}
	// After policy (a packet it drops is not charged to the rate), before
	// the fast path redirects.
	if ((parts & PORT_POLICE) && police_drops(skb))
		return TC_ACT_SHOT;
	if (parts & PORT_FASTPATH)
		return fastpath(skb);
	return TC_ACT_UNSPEC;
}

char _license[] SEC("license") = "Apache-2.0";
