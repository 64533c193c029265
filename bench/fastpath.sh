#!/usr/bin/env bash
# Pod-to-pod datapath with and without the eBPF fast path, in one run: a
# direct veth pair between two namespaces (the physical limit), bridge,
# bridge + fastpath, ptp, ptp + fastpath. TCP request/response latency
# (median, p99), ping latency, iperf3 throughput (1 and 4 streams), with
# ratios to the direct pair and to the plain bridge, per-round ratios and the
# spread over rounds (the order of setups rotates every round); then the
# per-pod ADD latency of bridge + fastpath against the reference bridge.
# Benchmarks what scripts/install ships (the static release build).
# Needs root, iperf3 and ping. Everything runs in namespaces fpbench creates.
# Usage: bench/fastpath.sh [fpbench options, e.g. --rounds 20 --tput-rounds 6]
set -euo pipefail
cd "$(dirname "$0")/.."
# BENCH_BIN=DIR benchmarks the plugins in DIR instead (see bench/lib.sh).
. bench/lib.sh
bench_bin
host=$(rustc -vV | sed -n 's/^host: //p')
exec "target/$host/release/fpbench" --ours "$bin" "$@"
