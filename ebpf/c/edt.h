// SPDX-License-Identifier: Apache-2.0
// The byte account of an earliest-departure-time limit, shared by rcni_edt
// (shape.bpf.c: the pod's own shaping) and the port policer
// (datapath.bpf.c: the node side's check of the same limit), so that the
// two cannot drift apart: a pod that keeps its shaping must never meet the
// policer.
#ifndef RCNI_EDT_H
#define RCNI_EDT_H

#include <linux/types.h>

#ifndef NSEC_PER_SEC
#define NSEC_PER_SEC 1000000000ULL
#endif

// *t_last is when the bytes so far are paid off at `rate` (bytes per
// second); up to burst_ns of that may lie in the past after a quiet spell
// (a token bucket's depth). Charges `len` bytes and returns when they are
// paid off, or 0 where that is more than horizon_ns from now: the packet
// is to be dropped and the account stays as it was. Without a lock: two
// CPUs charging at once may lose one update, which lets one packet by.
static __always_inline __u64 edt_charge(__u64 *t_last, __u64 now, __u64 len, __u64 rate,
					__u64 burst_ns, __u64 horizon_ns)
{
	__u64 last = *t_last;
	if (now > burst_ns && last < now - burst_ns)
		last = now - burst_ns;
	__u64 next = last + len * NSEC_PER_SEC / rate;
	if (next > now && next - now > horizon_ns)
		return 0;
	*t_last = next;
	return next;
}

#endif
