// SPDX-License-Identifier: Apache-2.0
//
// Network policy, included by datapath.bpf.c (it uses the endpoints map,
// count() and the verdicts defined there).
//
// Userspace (meta/policy) compiles the policies into rule sets: a rule set
// is one pod's allowed peers in one direction, as
//   - (rule set, peer identity) -> port set         rcni_pol_peer
//   - (rule set, CIDR) -> port set, longest prefix   rcni_pol_cidr
// where a port set lists (protocol, port range) pairs (rcni_pol_ports), or
// is PORTSET_NONE / PORTSET_ALL. CIDR entries come flattened for a longest
// prefix match: an `except` is a longer prefix with its own port set (often
// PORTSET_NONE), so one lookup decides. Each pod's endpoint entries name its
// identity and its ingress and egress rule sets (0: not selected, allowed).
//
// Decisions are taken at two points per pod: its egress (rcni_pol_out, on
// the ingress hook of its host veth) and its ingress (rcni_pol_in, on the
// egress hook), and for fast-path redirects both in rcni_fastpath. A point
// that allows a new flow records it in rcni_pol_ct with the point's name;
// the reply passes the other end's points through that record: at a pod's
// egress a reply to what its ingress accepted, at its ingress a reply to
// what its egress sent. Recording at each point, not per pair, is what
// lets replies pass when the other end is not selected at all.
//
// Traffic between a pod and its node is always allowed: at the ingress
// point, packets the node sends itself; at the egress point, packets to an
// address of the node (rcni_node_addrs, looked up only for packets the
// rules would drop).

#define PORTSET_NONE 0 // nothing allowed; never looked up
#define PORTSET_ALL 1  // every protocol and port; never looked up
#define MAX_PORT_RANGES 32

#define CT_EGRESS 1  // recorded at the sender's egress point
#define CT_INGRESS 2 // recorded at the receiver's ingress point

#define IP_OFFSET_MASK 0x1fff

// rcni_pol_cidr's key. prefixlen counts from rs: 64 + the CIDR's length,
// so rule set and family always match in full. IPv4 sits in addr[0..4].
struct cidr_key {
	__u32 prefixlen;
	__u32 rs;
	__u32 family;
	__u8 addr[16];
};

struct peer_key {
	__u32 rs;
	__u32 identity;
};

// Ports in host byte order; a protocol without ports (ICMP, ...) matches
// with port 0.
struct port_range {
	__u8 proto;
	__u8 pad;
	__u16 lo;
	__u16 hi;
	__u16 pad2;
};

struct portset {
	__u32 n; // ranges used, from r[0]
	__u32 pad;
	struct port_range r[MAX_PORT_RANGES];
};

// One direction of a flow as seen at one point. Ports in host byte order:
// TCP/UDP/SCTP ports, the identifier of ICMP echo request and reply (as
// both), else 0.
struct ct_key {
	__u8 family;
	__u8 proto;
	__u8 point;
	__u8 pad;
	__u16 sport;
	__u16 dport;
	__u8 saddr[16];
	__u8 daddr[16];
};

// No preallocation (an LPM trie requires it): entries cost memory only
// when written, so the limit can be generous.
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 1 << 20);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct cidr_key);
	__type(value, __u32);
} rcni_pol_cidr SEC(".maps");

// A hash allocates its buckets up front (16 bytes each) even without
// preallocated entries: 1 MiB here.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1 << 16);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct peer_key);
	__type(value, __u32);
} rcni_pol_peer SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1 << 14);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct portset);
} rcni_pol_ports SEC(".maps");

// The value is when the flow was recorded (bpf_ktime_get_ns). LRU: a full
// table forgets the least recently used flows, whose next packet is
// decided afresh (allowed again if the rules allow it).
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1 << 16);
	__type(key, struct ct_key);
	__type(value, __u64);
} rcni_pol_ct SEC(".maps");

// The node's own addresses (value unused), written by userspace.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct ep_key);
	__type(value, __u32);
} rcni_node_addrs SEC(".maps");

// Flow events (see meta/policy/src/flows): a point that denies a new flow,
// lets one through in audit mode, or (when asked) allows one by a rule set
// writes one record to rcni_pol_events, which the collector reads.
#define EV_DENY 1
#define EV_ALLOW 2
#define EV_AUDIT 3

// rcni_pol_cfg's one entry, written by the policy plugin from the
// network's flowEvents and flowRate, and whether the network has a policy.
#define EVENTS_DENY 1  // denials and audit findings
#define EVENTS_ALLOW 2 // new flows a rule set allows
// Some policy exists (on any node): pods' sources are checked and the
// points run. Without one nothing depends on a packet's source or
// destination, and a pod's packet costs the programs one array load (the
// anti-spoofing lookup alone was most of 1 us per round trip between
// nodes: bench/k8s-flannel.sh).
#define POL_ENFORCE 1
struct pol_cfg {
	__u32 events;
	__u32 rate; // events per second per pod
	__u32 flags; // POL_ENFORCE
};

struct flow_event {
	__u64 ts; // bpf_ktime_get_ns
	__u8 family;
	__u8 proto;
	__u8 verdict; // EV_*
	__u8 point;   // CT_EGRESS: the sender's policy decided; CT_INGRESS: the receiver's
	__u16 sport;  // host byte order; ICMP echo: the identifier
	__u16 dport;
	__u8 icmp_type;
	__u8 pad[3];
	__u32 rs;         // the rule set that decided
	__u32 suppressed; // this pod's events the rate limit dropped since its last one
	__u8 saddr[16];
	__u8 daddr[16];
	__u32 pad2;
};

// The same denied flow at the same point is reported once per this long:
// one event per connection attempt, not one per retransmitted SYN.
#define SEEN_NS (10ULL * 1000000000ULL)

// Per policed pod (by address): a one-second window of events.
struct pol_rl {
	__u64 window; // when the window began (ns)
	__u32 count;  // events in it
	__u32 suppressed;
};

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 18);
} rcni_pol_events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct pol_cfg);
} rcni_pol_cfg SEC(".maps");

// A constant key into an array: the verifier inlines the lookup.
static __always_inline int pol_enforcing(void)
{
	__u32 zero = 0;
	struct pol_cfg *cfg = bpf_map_lookup_elem(&rcni_pol_cfg, &zero);

	return cfg && (cfg->flags & POL_ENFORCE);
}

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1 << 14);
	__type(key, struct ep_key);
	__type(value, struct pol_rl);
} rcni_pol_rl SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1 << 14);
	__type(key, struct ct_key);
	__type(value, __u64);
} rcni_pol_seen SEC(".maps");

// What the points need of a packet.
struct flow {
	__u8 family;
	__u8 proto; // IPv6: the fixed header's next header
	__u8 icmp_type; // ICMP and ICMPv6
	__u8 l4_done; // flow_l4 ran
	__u16 sport; // as in struct ct_key
	__u16 dport;
	__u16 pport; // the port rules match: TCP/UDP/SCTP's dport, else 0
	__u16 l4_off; // where the L4 header starts; 0: none to read
	__u8 saddr[16];
	__u8 daddr[16];
};

// Reads the L4 header into f, once: ports, ICMP type and echo id. Only
// the points need it, and only for pods a rule set selects. A header cut
// short leaves zeros (the rules then see port 0).
static __always_inline void flow_l4(struct __sk_buff *skb, struct flow *f)
{
	__u32 off = f->l4_off;
	__u8 h[8];

	if (!off || f->l4_done)
		return;
	f->l4_done = 1;
	switch (f->proto) {
	case IPPROTO_TCP:
	case IPPROTO_UDP:
	case IPPROTO_SCTP:
		if (bpf_skb_load_bytes(skb, off, h, 4))
			return;
		f->sport = ((__u16)h[0] << 8) | h[1];
		f->dport = ((__u16)h[2] << 8) | h[3];
		f->pport = f->dport;
		return;
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		if (bpf_skb_load_bytes(skb, off, h, 8)) {
			if (bpf_skb_load_bytes(skb, off, h, 1))
				return;
			f->icmp_type = h[0];
			return;
		}
		f->icmp_type = h[0];
		// Echo request and reply share the identifier: as both ports it
		// makes the reply's key the reverse of the request's.
		if ((f->proto == IPPROTO_ICMP && (h[0] == 8 || h[0] == 0)) ||
		    (f->proto == IPPROTO_ICMPV6 && (h[0] == 128 || h[0] == 129))) {
			f->sport = ((__u16)h[4] << 8) | h[5];
			f->dport = f->sport;
		}
		return;
	}
	// Other protocols, and IPv6 extension headers (not walked): ports 0.
}

// Parses an IP packet's addresses for the policy programs; nonzero for what
// they leave alone: not IP, a group destination MAC, headers cut short. The
// L4 header waits for flow_l4, but for ICMPv6, whose type tells neighbour
// discovery. Invalidates packet pointers (it may pull data).
static __always_inline int flow_parse(struct __sk_buff *skb, struct flow *f)
{
	if (ensure(skb, ETH_HLEN))
		return -1;
	struct ethhdr *eth = (void *)(long)skb->data;
	if ((void *)(eth + 1) > (void *)(long)skb->data_end)
		return -1;
	if (eth->h_dest[0] & 1)
		return -1;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		if (ensure(skb, ETH_HLEN + sizeof(struct iphdr)))
			return -1;
		struct iphdr *ip = (void *)(long)skb->data + ETH_HLEN;
		if ((void *)(ip + 1) > (void *)(long)skb->data_end)
			return -1;
		if (ip->version != 4 || ip->ihl < 5)
			return -1;
		f->family = FAMILY_V4;
		f->proto = ip->protocol;
		__builtin_memcpy(f->saddr, &ip->saddr, 4);
		__builtin_memcpy(f->daddr, &ip->daddr, 4);
		// Only a datagram's first fragment carries the ports.
		if (!(ip->frag_off & bpf_htons(IP_OFFSET_MASK)))
			f->l4_off = ETH_HLEN + ip->ihl * 4;
		return 0;
	}
	if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		if (ensure(skb, ETH_HLEN + sizeof(struct ipv6hdr)))
			return -1;
		struct ipv6hdr *ip6 = (void *)(long)skb->data + ETH_HLEN;
		if ((void *)(ip6 + 1) > (void *)(long)skb->data_end)
			return -1;
		f->family = FAMILY_V6;
		f->proto = ip6->nexthdr;
		__builtin_memcpy(f->saddr, &ip6->saddr, 16);
		__builtin_memcpy(f->daddr, &ip6->daddr, 16);
		f->l4_off = ETH_HLEN + sizeof(struct ipv6hdr);
		if (f->proto == IPPROTO_ICMPV6)
			flow_l4(skb, f);
		return 0;
	}
	return -1;
}

// Neighbour discovery must reach the link unfiltered.
static __always_inline int is_nd(const struct flow *f)
{
	return f->family == FAMILY_V6 && f->proto == IPPROTO_ICMPV6 &&
	       f->icmp_type >= ICMPV6_ND_FIRST && f->icmp_type <= ICMPV6_ND_LAST;
}

// Unspecified and link-local sources: 0.0.0.0, 169.254/16, ::, fe80::/10.
static __always_inline int unchecked_source(const struct flow *f)
{
	const __u8 *a = f->saddr;

	if (f->family == FAMILY_V4)
		return (a[0] | a[1] | a[2] | a[3]) == 0 || (a[0] == 169 && a[1] == 254);
	if (a[0] == 0xfe && (a[1] & 0xc0) == 0x80)
		return 1;
	__u64 w0, w1;
	__builtin_memcpy(&w0, a, 8);
	__builtin_memcpy(&w1, a + 8, 8);
	return (w0 | w1) == 0;
}

static __always_inline struct endpoint *endpoint_of(__u8 family, const __u8 *addr)
{
	struct ep_key k = { .family = family };

	__builtin_memcpy(k.addr, addr, 16);
	return bpf_map_lookup_elem(&rcni_endpoints, &k);
}

// The identity of the pod at addr; 0 for addresses that are no pod's.
static __always_inline __u32 identity_of(__u8 family, const __u8 *addr)
{
	struct endpoint *ep = endpoint_of(family, addr);

	return ep ? ep->identity : 0;
}

static __always_inline void ct_key_of(struct ct_key *k, const struct flow *f, __u8 point,
				      int reverse)
{
	k->family = f->family;
	k->proto = f->proto;
	k->point = point;
	k->pad = 0;
	if (!reverse) {
		k->sport = f->sport;
		k->dport = f->dport;
		__builtin_memcpy(k->saddr, f->saddr, 16);
		__builtin_memcpy(k->daddr, f->daddr, 16);
	} else {
		k->sport = f->dport;
		k->dport = f->sport;
		__builtin_memcpy(k->saddr, f->daddr, 16);
		__builtin_memcpy(k->daddr, f->saddr, 16);
	}
}

static __always_inline int ct_has(const struct flow *f, __u8 point, int reverse)
{
	struct ct_key k;

	ct_key_of(&k, f, point, reverse);
	return bpf_map_lookup_elem(&rcni_pol_ct, &k) != 0;
}

static __always_inline void ct_record(const struct flow *f, __u8 point)
{
	struct ct_key k;
	__u64 now = bpf_ktime_get_ns();

	ct_key_of(&k, f, point, 0);
	bpf_map_update_elem(&rcni_pol_ct, &k, &now, BPF_ANY);
}

// Reports a point's decision on a new flow f, within the policed pod's
// rate limit. Only new flows come here (an established one is a ct_has hit
// before any rule is read), so the cost is per connection, not per packet.
static __noinline int pol_event(const struct flow *f, __u8 verdict, __u8 point, __u32 rs)
{
	__u32 zero = 0;
	struct pol_cfg *cfg = bpf_map_lookup_elem(&rcni_pol_cfg, &zero);

	if (!cfg)
		return 0;
	if (!(cfg->events & (verdict == EV_ALLOW ? EVENTS_ALLOW : EVENTS_DENY)))
		return 0;
	__u64 now = bpf_ktime_get_ns();
	// The pod's window first: under a flood, a packet over the limit
	// costs this one lookup and an atomic add, nothing written.
	struct ep_key pk = { .family = f->family };
	__builtin_memcpy(pk.addr, point == CT_EGRESS ? f->saddr : f->daddr, 16);
	struct pol_rl *r = bpf_map_lookup_elem(&rcni_pol_rl, &pk);
	if (r && now - r->window < 1000000000ULL && r->count >= cfg->rate) {
		__sync_fetch_and_add(&r->suppressed, 1);
		count(V_EV_LIMITED);
		return 0;
	}
	if (verdict == EV_DENY) {
		struct ct_key k;
		ct_key_of(&k, f, point, 0);
		__u64 *last = bpf_map_lookup_elem(&rcni_pol_seen, &k);
		if (last && now - *last < SEEN_NS)
			return 0;
		bpf_map_update_elem(&rcni_pol_seen, &k, &now, BPF_ANY);
	}
	__u32 suppressed = 0;
	if (!r) {
		struct pol_rl n = { .window = now, .count = 1 };
		bpf_map_update_elem(&rcni_pol_rl, &pk, &n, BPF_ANY);
	} else {
		// Racy across CPUs by design: a window may let a few more
		// through; the suppressed count itself is atomic.
		if (now - r->window >= 1000000000ULL) {
			r->window = now;
			r->count = 0;
		}
		r->count += 1;
		suppressed = r->suppressed;
		if (suppressed)
			__sync_fetch_and_add(&r->suppressed, -suppressed);
	}
	struct flow_event *e = bpf_ringbuf_reserve(&rcni_pol_events, sizeof(*e), 0);
	if (!e) {
		if (r && suppressed)
			__sync_fetch_and_add(&r->suppressed, suppressed + 1);
		count(V_EV_LOST);
		return 0;
	}
	e->ts = now;
	e->family = f->family;
	e->proto = f->proto;
	e->verdict = verdict;
	e->point = point;
	e->sport = f->sport;
	e->dport = f->dport;
	e->icmp_type = f->icmp_type;
	e->pad[0] = 0;
	e->pad[1] = 0;
	e->pad[2] = 0;
	e->rs = rs;
	e->suppressed = suppressed;
	__builtin_memcpy(e->saddr, f->saddr, 16);
	__builtin_memcpy(e->daddr, f->daddr, 16);
	e->pad2 = 0;
	bpf_ringbuf_submit(e, 0);
	return 0;
}

static __always_inline int ports_allow(__u32 id, __u8 proto, __u16 port)
{
	if (id == PORTSET_ALL)
		return 1;
	if (id == PORTSET_NONE)
		return 0;
	struct portset *ps = bpf_map_lookup_elem(&rcni_pol_ports, &id);
	if (!ps)
		return 0;
	__u32 n = ps->n;
	for (__u32 i = 0; i < MAX_PORT_RANGES; i++) {
		if (i >= n)
			break;
		struct port_range *r = &ps->r[i];
		if (r->proto == proto && r->lo <= port && port <= r->hi)
			return 1;
	}
	return 0;
}

// Whether rule set rs allows the peer (identity, addr) for f's protocol and
// port: by identity or by address, whichever allows.
static __always_inline int rules_allow(__u32 rs, __u32 identity, const struct flow *f,
				       const __u8 *addr)
{
	__u32 *ps;

	if (identity) {
		struct peer_key pk = { .rs = rs, .identity = identity };
		ps = bpf_map_lookup_elem(&rcni_pol_peer, &pk);
		if (ps && ports_allow(*ps, f->proto, f->pport))
			return 1;
	}
	struct cidr_key ck = {
		.prefixlen = 64 + (f->family == FAMILY_V4 ? 32 : 128),
		.rs = rs,
		.family = f->family,
	};
	__builtin_memcpy(ck.addr, addr, 16);
	ps = bpf_map_lookup_elem(&rcni_pol_cidr, &ck);
	return ps && ports_allow(*ps, f->proto, f->pport);
}

// Whether f's destination is an address of the node. Userspace keeps the
// node's addresses in rcni_node_addrs: bpf_fib_lookup, which would tell a
// local route by itself, is for GPL programs only.
static __always_inline int to_node(const struct flow *f)
{
	struct ep_key k = { .family = f->family };

	__builtin_memcpy(k.addr, f->daddr, 16);
	return bpf_map_lookup_elem(&rcni_node_addrs, &k) != 0;
}

// Pod p sends f. The peer's identity is `peer_id` when `peer_known`, else
// looked up (only when the rules are consulted). `node_check`: allow what
// the rules deny when it goes to the node. Nonzero: allowed.
static __always_inline int egress_point(const struct endpoint *p, const struct flow *f,
					int peer_known, __u32 peer_id, int node_check)
{
	if (!(p->ingress_rs | p->egress_rs))
		return 1;
	if (ct_has(f, CT_EGRESS, 0))
		return 1;
	// A reply to a flow p's ingress accepted.
	if (ct_has(f, CT_INGRESS, 1))
		return 1;
	__u32 rs = p->egress_rs;
	if (rs) {
		if (!peer_known)
			peer_id = identity_of(f->family, f->daddr);
		if (!rules_allow(rs, peer_id, f, f->daddr) && !(node_check && to_node(f))) {
			if (!(p->pol_flags & POL_AUDIT_OUT)) {
				pol_event(f, EV_DENY, CT_EGRESS, rs);
				return 0;
			}
			// Audit: reported once, then the flow passes as allowed.
			pol_event(f, EV_AUDIT, CT_EGRESS, rs);
		} else {
			pol_event(f, EV_ALLOW, CT_EGRESS, rs);
		}
	}
	ct_record(f, CT_EGRESS);
	return 1;
}

// Pod p receives f; the node's own packets are the caller's business.
static __always_inline int ingress_point(const struct endpoint *p, const struct flow *f,
					 int peer_known, __u32 peer_id)
{
	if (!(p->ingress_rs | p->egress_rs))
		return 1;
	if (ct_has(f, CT_INGRESS, 0))
		return 1;
	// A reply to a flow p's egress sent.
	if (ct_has(f, CT_EGRESS, 1))
		return 1;
	__u32 rs = p->ingress_rs;
	if (rs) {
		if (!peer_known)
			peer_id = identity_of(f->family, f->saddr);
		if (!rules_allow(rs, peer_id, f, f->saddr)) {
			if (!(p->pol_flags & POL_AUDIT_IN)) {
				pol_event(f, EV_DENY, CT_INGRESS, rs);
				return 0;
			}
			pol_event(f, EV_AUDIT, CT_INGRESS, rs);
		} else {
			pol_event(f, EV_ALLOW, CT_INGRESS, rs);
		}
	}
	ct_record(f, CT_INGRESS);
	return 1;
}
