// SPDX-License-Identifier: Apache-2.0
//
// Kubernetes Services at the socket (issue 51): cgroup sock_addr programs
// that give a connection to a Service's address one backend when it is
// made, as Cilium's and Calico's socket load balancing do. A TCP
// connect() or a connected UDP socket is rewritten once, and its packets
// then carry the backend's address from the socket on: no per-packet NAT,
// no conntrack entry of the node's, and network policy sees the real
// destination. Unconnected UDP is rewritten per datagram (sendmsg), and
// the replies' source turned back into the Service's address (recvmsg),
// as is the peer getpeername() reports, so a client sees only the address
// it asked for.
//
// The agent attaches these to a cgroup v2 directory (its node's root, the
// whole host by default) and keeps the maps equal to the Services and
// EndpointSlices it watches. The maps hold no state of the programs'
// except the reverse entries, so an agent restart changes nothing for a
// connection already made.
//
// Layout mirrored by ebpf/src/services.rs.

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define ECONNREFUSED 111

#define FAM_V4 4
#define FAM_V6 6

// A Service's address, protocol and port. IPv4 sits in addr[0], the rest
// zero. Port in network order.
struct svc_key {
	__u32 addr[4];
	__u16 port;
	__u8 proto;
	__u8 family;
};

struct svc_val {
	// Its backends are (id, 0 .. count-1) in rcni_svc_be. The agent gives
	// a changed frontend a new id, writes its backends, then swaps this
	// value: a connection never sees half of an update.
	__u32 id;
	// 0: the Service has no endpoint, a connection is refused
	// (ECONNREFUSED), as kube-proxy's REJECT answers it.
	__u32 count;
	// sessionAffinity: ClientIP, its timeout in seconds; 0: none. The
	// client is the socket's network namespace (a pod, or the host), as
	// Cilium's socket balancing keys it: one pod, one address.
	__u32 affinity_s;
	__u32 pad;
};

struct be_key {
	__u32 id;
	__u32 slot;
};

struct be_val {
	__u32 addr[4];
	__u16 port;
	__u8 family;
	__u8 pad;
};

// A socket and the backend it was given, to the Service's address.
struct rev_key {
	__u64 cookie;
	__u32 addr[4];
	__u16 port;
	__u8 family;
	__u8 pad[5];
};

struct rev_val {
	__u32 addr[4];
	__u16 port;
	__u8 family;
	__u8 pad;
};

// A client's backend of a Service with affinity, and when it last
// connected.
struct aff_key {
	__u64 netns;
	struct svc_key k;
	__u32 pad;
};

struct aff_val {
	struct be_val be;
	__u32 pad;
	__u64 at_ns;
};

// (id, backend) -> slot, for Services with affinity: whether a client's
// remembered backend is still one of the Service's.
struct be_idx_key {
	__u32 id;
	struct be_val be;
};

// Counters, per CPU: translated (a connection or a datagram given a
// backend), refused (no endpoint), reversed (a reply's source or a peer's
// name turned back).
#define ST_TRANSLATED 0
#define ST_REFUSED 1
#define ST_REVERSED 2
#define ST_MAX 3

#define MAX_SERVICES 65536
#define MAX_BACKENDS 262144
#define MAX_REVERSE 262144

// The layout of the maps below; ebpf/src/services.rs refuses pins of
// another one.
#define SVC_LAYOUT 1
#define MAX_AFFINITY 262144

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_SERVICES);
	__type(key, struct svc_key);
	__type(value, struct svc_val);
} rcni_svc SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_BACKENDS);
	__type(key, struct be_key);
	__type(value, struct be_val);
} rcni_svc_be SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_REVERSE);
	__type(key, struct rev_key);
	__type(value, struct rev_val);
} rcni_svc_rev SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_AFFINITY);
	__type(key, struct aff_key);
	__type(value, struct aff_val);
} rcni_svc_aff SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_BACKENDS);
	__type(key, struct be_idx_key);
	__type(value, __u32);
} rcni_svc_be_idx SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, ST_MAX);
	__type(key, __u32);
	__type(value, __u64);
} rcni_svc_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} rcni_svc_layout SEC(".maps");

static __always_inline void count(__u32 what)
{
	__u64 *n = bpf_map_lookup_elem(&rcni_svc_stats, &what);

	if (n)
		*n += 1;
}

// The backend for a connection or datagram to k, NULL when k is no
// Service's. *refuse is set when it is one without an endpoint. With
// affinity, the client's last backend while it is still the Service's and
// the timeout has not passed since its last connection (kube-proxy's
// `recent` match, refreshed by each connection); out is where the chosen
// backend is copied.
static __always_inline struct be_val *pick(void *ctx, struct svc_key *k, int *refuse,
					   struct be_val *out)
{
	struct svc_val *s = bpf_map_lookup_elem(&rcni_svc, k);
	struct be_key bk = {};
	struct aff_key ak = {};
	struct aff_val av = {};
	struct aff_val *seen;
	struct be_val *b;
	__u64 now = 0;
	__u32 aff, n;

	*refuse = 0;
	if (!s)
		return NULL;
	// Each read once: the agent may replace the value meanwhile.
	n = s->count;
	aff = s->affinity_s;
	if (!n) {
		*refuse = 1;
		return NULL;
	}
	if (aff) {
		now = bpf_ktime_get_ns();
		ak.netns = bpf_get_netns_cookie(ctx);
		ak.k = *k;
		seen = bpf_map_lookup_elem(&rcni_svc_aff, &ak);
		if (seen && now - seen->at_ns < (__u64)aff * 1000000000ULL) {
			struct be_idx_key ik = {};

			ik.id = s->id;
			ik.be = seen->be;
			if (bpf_map_lookup_elem(&rcni_svc_be_idx, &ik)) {
				seen->at_ns = now;
				*out = seen->be;
				return out;
			}
		}
	}
	bk.id = s->id;
	bk.slot = bpf_get_prandom_u32() % n;
	b = bpf_map_lookup_elem(&rcni_svc_be, &bk);
	if (!b)
		return NULL;
	*out = *b;
	if (aff) {
		av.be = *b;
		av.at_ns = now;
		bpf_map_update_elem(&rcni_svc_aff, &ak, &av, BPF_ANY);
	}
	return out;
}

static __always_inline void remember(void *ctx, struct be_val *b, struct svc_key *k)
{
	struct rev_key rk = {};
	struct rev_val rv = {};

	rk.cookie = bpf_get_socket_cookie(ctx);
	__builtin_memcpy(rk.addr, b->addr, sizeof(rk.addr));
	rk.port = b->port;
	rk.family = b->family;
	__builtin_memcpy(rv.addr, k->addr, sizeof(rv.addr));
	rv.port = k->port;
	rv.family = k->family;
	bpf_map_update_elem(&rcni_svc_rev, &rk, &rv, BPF_ANY);
}

static __always_inline int is_v4_mapped(const __u32 *a)
{
	return a[0] == 0 && a[1] == 0 && a[2] == bpf_htonl(0xffff);
}

static __always_inline int refused(void)
{
	count(ST_REFUSED);
	// 0 alone would fail the call with EPERM.
	bpf_set_retval(-ECONNREFUSED);
	return 0;
}

static __always_inline int xlate4(struct bpf_sock_addr *ctx, int remember_it)
{
	struct svc_key k = {};
	struct be_val chosen = {};
	struct be_val *b;
	int refuse;
	// A volatile 4-byte read: the verifier takes no narrower load of it.
	volatile __u32 port = ctx->user_port;

	if (ctx->protocol != IPPROTO_TCP && ctx->protocol != IPPROTO_UDP)
		return 1;
	k.addr[0] = ctx->user_ip4;
	k.port = (__u16)port;
	k.proto = ctx->protocol;
	k.family = FAM_V4;
	b = pick(ctx, &k, &refuse, &chosen);
	if (refuse)
		return refused();
	if (!b || b->family != FAM_V4)
		return 1;
	ctx->user_ip4 = b->addr[0];
	ctx->user_port = b->port;
	if (remember_it)
		remember(ctx, b, &k);
	count(ST_TRANSLATED);
	return 1;
}

static __always_inline int xlate6(struct bpf_sock_addr *ctx, int remember_it)
{
	struct svc_key k = {};
	struct be_val chosen = {};
	struct be_val *b;
	int refuse, mapped;
	volatile __u32 port = ctx->user_port;
	__u32 a[4];

	if (ctx->protocol != IPPROTO_TCP && ctx->protocol != IPPROTO_UDP)
		return 1;
	a[0] = ctx->user_ip6[0];
	a[1] = ctx->user_ip6[1];
	a[2] = ctx->user_ip6[2];
	a[3] = ctx->user_ip6[3];
	// An IPv6 socket reaching an IPv4 Service (::ffff:a.b.c.d), as a
	// dual-stack socket does.
	mapped = is_v4_mapped(a);
	if (mapped) {
		k.addr[0] = a[3];
		k.family = FAM_V4;
	} else {
		__builtin_memcpy(k.addr, a, sizeof(a));
		k.family = FAM_V6;
	}
	k.port = (__u16)port;
	k.proto = ctx->protocol;
	b = pick(ctx, &k, &refuse, &chosen);
	if (refuse)
		return refused();
	if (!b || b->family != k.family)
		return 1;
	if (mapped) {
		ctx->user_ip6[0] = 0;
		ctx->user_ip6[1] = 0;
		ctx->user_ip6[2] = bpf_htonl(0xffff);
		ctx->user_ip6[3] = b->addr[0];
	} else {
		ctx->user_ip6[0] = b->addr[0];
		ctx->user_ip6[1] = b->addr[1];
		ctx->user_ip6[2] = b->addr[2];
		ctx->user_ip6[3] = b->addr[3];
	}
	ctx->user_port = b->port;
	if (remember_it)
		remember(ctx, b, &k);
	count(ST_TRANSLATED);
	return 1;
}

SEC("cgroup/connect4")
int rcni_svc_conn4(struct bpf_sock_addr *ctx)
{
	return xlate4(ctx, 1);
}

SEC("cgroup/connect6")
int rcni_svc_conn6(struct bpf_sock_addr *ctx)
{
	return xlate6(ctx, 1);
}

SEC("cgroup/sendmsg4")
int rcni_svc_send4(struct bpf_sock_addr *ctx)
{
	return xlate4(ctx, 1);
}

SEC("cgroup/sendmsg6")
int rcni_svc_send6(struct bpf_sock_addr *ctx)
{
	return xlate6(ctx, 1);
}

// The peer a reply came from (recvmsg) or the socket is connected to
// (getpeername), back to the Service's address. These hooks must return 1.
static __always_inline int reverse4(struct bpf_sock_addr *ctx)
{
	struct rev_key rk = {};
	struct rev_val *rv;
	volatile __u32 port = ctx->user_port;

	rk.cookie = bpf_get_socket_cookie(ctx);
	rk.addr[0] = ctx->user_ip4;
	rk.port = (__u16)port;
	rk.family = FAM_V4;
	rv = bpf_map_lookup_elem(&rcni_svc_rev, &rk);
	if (!rv || rv->family != FAM_V4)
		return 1;
	ctx->user_ip4 = rv->addr[0];
	ctx->user_port = rv->port;
	count(ST_REVERSED);
	return 1;
}

static __always_inline int reverse6(struct bpf_sock_addr *ctx)
{
	struct rev_key rk = {};
	struct rev_val *rv;
	volatile __u32 port = ctx->user_port;
	__u32 a[4];
	int mapped;

	a[0] = ctx->user_ip6[0];
	a[1] = ctx->user_ip6[1];
	a[2] = ctx->user_ip6[2];
	a[3] = ctx->user_ip6[3];
	mapped = is_v4_mapped(a);
	rk.cookie = bpf_get_socket_cookie(ctx);
	if (mapped) {
		rk.addr[0] = a[3];
		rk.family = FAM_V4;
	} else {
		__builtin_memcpy(rk.addr, a, sizeof(a));
		rk.family = FAM_V6;
	}
	rk.port = (__u16)port;
	rv = bpf_map_lookup_elem(&rcni_svc_rev, &rk);
	if (!rv || rv->family != rk.family)
		return 1;
	if (mapped) {
		ctx->user_ip6[3] = rv->addr[0];
	} else {
		ctx->user_ip6[0] = rv->addr[0];
		ctx->user_ip6[1] = rv->addr[1];
		ctx->user_ip6[2] = rv->addr[2];
		ctx->user_ip6[3] = rv->addr[3];
	}
	ctx->user_port = rv->port;
	count(ST_REVERSED);
	return 1;
}

SEC("cgroup/recvmsg4")
int rcni_svc_recv4(struct bpf_sock_addr *ctx)
{
	return reverse4(ctx);
}

SEC("cgroup/recvmsg6")
int rcni_svc_recv6(struct bpf_sock_addr *ctx)
{
	return reverse6(ctx);
}

SEC("cgroup/getpeername4")
int rcni_svc_peer4(struct bpf_sock_addr *ctx)
{
	return reverse4(ctx);
}

SEC("cgroup/getpeername6")
int rcni_svc_peer6(struct bpf_sock_addr *ctx)
{
	return reverse6(ctx);
}

char _license[] SEC("license") = "GPL";
