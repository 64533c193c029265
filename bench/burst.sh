#!/usr/bin/env bash
# Pod bursts (issue 33), side by side in one run per reference: serial
# bridge + host-local ADDs with ipMasq on the default backend (iptables,
# as podman's and containerd's bridge configs leave it), then 110 ADDs
# started at once (p50, p99), both with ipMasq and without. Each plugin is
# started by the driver as libcni in a runtime starts it (no cnitool
# process in between). Against upstream's v1.9.1 where RCNI_REFERENCE_V191
# or the shared tarball gives it, and Debian's 1.1.1. Targets: serial ADD
# <= 0.4x, concurrent ADD p99 <= 0.5x the reference. Everything runs in
# namespaces cnibench creates.
# Usage: bench/burst.sh [--rounds N] [--concurrent N] [--concurrent-rounds N]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=100 concurrent=110 crounds=3
while [ $# -gt 0 ]; do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --concurrent) concurrent=$2; shift 2 ;;
    --concurrent-rounds) crounds=$2; shift 2 ;;
    *) echo "usage: $0 [--rounds N] [--concurrent N] [--concurrent-rounds N]" >&2; exit 2 ;;
  esac
done
# BENCH_BIN=DIR benchmarks the plugins in DIR instead (see bench/lib.sh).
. bench/lib.sh
bench_bin
host=$(rustc -vV | sed -n 's/^host: //p')
reference_v191
refs=(${ref:+"$ref"} /usr/lib/cni)
for ref in "${refs[@]}"; do
  for masq in --ip-masq ""; do
    echo "== reference $ref ${masq:-(no ipMasq)}"
    "target/$host/release/cnibench" --ours "$bin" --reference "$ref" --rounds "$rounds" \
      --skip-scale $masq --concurrent "$concurrent" --concurrent-rounds "$crounds" |
      grep -v ' round [0-9]*:'
  done
done
