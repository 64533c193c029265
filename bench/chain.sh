#!/usr/bin/env bash
# podman's default chain, bridge + portmap + firewall + tuning
# (conf/70-podman-chain.conflist), rcni against the reference plugins side
# by side in one run: chain ADD and DEL median and p99 latency, the CPU
# time of every process the chain starts, per-plugin medians, and the
# ratios. Benchmarks what scripts/install ships (the static release build).
# Everything runs in namespaces chainbench creates.
# Usage: bench/chain.sh [chainbench options, e.g. --rounds 200]
#        bench/chain.sh --conf bench/podman-chain-nftables.conflist   (ours on nftables)
set -euo pipefail
cd "$(dirname "$0")/.."
# BENCH_BIN=DIR benchmarks the plugins in DIR instead (see bench/lib.sh).
. bench/lib.sh
bench_bin
host=$(rustc -vV | sed -n 's/^host: //p')
exec "target/$host/release/chainbench" --ours "$bin" "$@"
