// SPDX-License-Identifier: Apache-2.0
//
// rcni fast path: a tc program on the ingress hook of each pod's host-side
// veth. A packet from a pod to another pod of the same network on this node
// is rewritten as the normal path would (bridge: unchanged at L2, or routed
// through the gateway; ptp: routed) and handed with bpf_redirect_peer straight
// to the destination pod's interface: it skips the bridge, netfilter, the
// routing lookup and the destination host veth's backlog queue. Everything
// else (ARP, neighbour discovery, unknown addresses, other nodes) continues on
// the normal path untouched.
//
// The layouts of the map keys and values are mirrored by #[repr(C)] types in
// ebpf/src/types.rs; change both together. The maps carry no pinning
// attribute: the loader pins them per network (and tests load them unpinned).

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

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
	__u32 reserved; // zero; keeps the layout free of padding
	// Which CNI attachment owns the entry; only userspace reads it.
	__u64 owner;
};

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
	V_NOT_IP = 1,      // ARP, VLAN tags, other ethertypes
	V_SHORT = 2,       // headers cut short
	V_UNKNOWN_DST = 3, // not a local endpoint: other nodes, the node itself
	V_UNKNOWN_SRC = 4, // source address not an endpoint behind this veth
	V_OTHER = 5,       // hairpin, neighbour discovery, TTL 1, multicast MAC
	V_MAX = 8,
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

SEC("classifier")
int rcni_fastpath(struct __sk_buff *skb)
{
	struct ep_key dst = {}, src = {};
	__u32 l3_len;
	int v6;

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
	}

	struct endpoint *to = bpf_map_lookup_elem(&rcni_endpoints, &dst);
	if (!to)
		return pass(V_UNKNOWN_DST);
	// The source must be an endpoint behind the veth the packet came in
	// on: its gateway MAC tells a routed packet from a bridged one, and a
	// pod cannot use the fast path with another pod's address.
	struct endpoint *from = bpf_map_lookup_elem(&rcni_endpoints, &src);
	if (!from || from->ifindex != skb->ifindex)
		return pass(V_UNKNOWN_SRC);
	if (to->ifindex == skb->ifindex)
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

	__u8 hop_limit = 0;
	if (routed) {
		if (!v6) {
			struct iphdr *ip = data + ETH_HLEN;
			if ((void *)(ip + 1) > data_end)
				return pass(V_SHORT);
			// TTL 1 expires here: the normal path answers with ICMP.
			if (ip->ttl <= 1)
				return pass(V_OTHER);
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
			if (ip6->hop_limit <= 1)
				return pass(V_OTHER);
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
	// Into the peer of the destination's host veth, i.e. the pod's own
	// interface, at its ingress: no second pass through the host veth (its
	// TX counters stay still) nor through the node's stack.
	return bpf_redirect_peer(ifindex, 0);
}

char _license[] SEC("license") = "Apache-2.0";
