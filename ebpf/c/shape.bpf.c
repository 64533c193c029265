// SPDX-License-Identifier: Apache-2.0
//
// rcni_edt: a rate limit by earliest departure time (EDT), as Cilium's
// bandwidth manager shapes: on a device's egress hook, each packet gets the
// time it may leave (skb->tstamp) so that the device's bytes keep to the
// rate, and the device's root fq qdisc holds it until then. Unlike a token
// bucket qdisc (TBF), nothing queues in front of the fq's flows: a flow's
// packets wait in its own fq queue, and TCP sees the delay at its socket
// (TCP small queues count bytes held in fq) instead of filling a shared
// queue. bandwidth loads one instance per shaped device (its own
// rcni_edt_cfg): the pod's interface for its egress, the pod's host veth
// for its ingress.
//
// Layout mirrored by ebpf/src/shape.rs.

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#include "edt.h"

struct edt_cfg {
	// Bytes per second (the configured bits / 8); 0: not shaped.
	__u64 rate;
	// The burst as time at the rate: that much sending may lie in the past,
	// i.e. go at once after a quiet spell (a token bucket's depth).
	__u64 burst_ns;
	// A packet that could not leave within this long is dropped (the
	// reference's TBF queues up to its latency, 25 ms, too): the bound on
	// the queue for senders no socket backpressure reaches (forwarded
	// traffic).
	__u64 horizon_ns;
	// When the bytes sent so far are paid off at the rate. Written by
	// every CPU without a lock: a lost update lets one packet go early,
	// as Cilium accepts.
	__u64 t_last;
	// Packets stamped with a later departure time, and dropped past the
	// horizon: for `bandwidth` CHECK and the tests.
	__u64 delayed;
	__u64 dropped;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct edt_cfg);
} rcni_edt_cfg SEC(".maps");

// A flow's departure time so far, by skb hash: a small packet leaves after
// its own flow's earlier packets (fq would otherwise reorder the flow by
// time), not after everyone's.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u64);
} rcni_edt_flows SEC(".maps");

// Packets up to this many bytes on the wire (requests, responses, pure
// ACKs) are charged to the rate but wait only for their own flow: a pod's
// request/response traffic does not queue behind its own bulk transfer, as
// everything does behind a TBF. A flood of small packets still keeps to
// the rate over the horizon: past it they are dropped.
#define EDT_SMALL 256

SEC("classifier")
int rcni_edt(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct edt_cfg *c = bpf_map_lookup_elem(&rcni_edt_cfg, &zero);
	if (!c || !c->rate)
		return TC_ACT_UNSPEC;
	__u64 now = bpf_ktime_get_ns();
	// TCP's own pacing may already have set a later time.
	__u64 t = skb->tstamp > now ? skb->tstamp : now;
	// The bytes on the wire: wire_len counts every segment of a GSO packet
	// with its headers (qdisc_pkt_len, set before the egress hook), as TBF
	// counts them.
	__u64 len = skb->wire_len ? skb->wire_len : skb->len;
	__u64 next = edt_charge(&c->t_last, now, len, c->rate, c->burst_ns, c->horizon_ns);
	if (!next) {
		__sync_fetch_and_add(&c->dropped, 1);
		return TC_ACT_SHOT;
	}
	// Within the burst, or small: leaves when it would have.
	__u64 dep = (next <= t || len <= EDT_SMALL) ? t : next;
	__u32 hash = bpf_get_hash_recalc(skb);
	__u64 *flow = bpf_map_lookup_elem(&rcni_edt_flows, &hash);
	if (flow && *flow > dep)
		dep = *flow;
	if (dep > t) {
		skb->tstamp = dep;
		__sync_fetch_and_add(&c->delayed, 1);
	}
	bpf_map_update_elem(&rcni_edt_flows, &hash, &dep, BPF_ANY);
	return TC_ACT_UNSPEC;
}

char _license[] SEC("license") = "Apache-2.0";
