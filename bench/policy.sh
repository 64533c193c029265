#!/usr/bin/env bash
# Network policy cost, in one run, for the policy plugin's eBPF and nftables
# backends side by side: TCP request/response latency (p50, p99),
# connect/request/response/close latency and iperf3 throughput between two
# pods of a bridge network with 0, 100, 1,000 and 10,000 CIDR rules in the
# server's policy (and a bridge without the policy plugin for context),
# paired rounds with a rotating order, ratios N/0 per round; then the time
# `policy sync` takes to bring a changed policy to 100 pods.
# Benchmarks what scripts/install ships (the static release build).
# Needs root and iperf3. Everything runs in namespaces polbench creates.
# Usage: bench/policy.sh [polbench options, e.g. --rounds 10 --tput-secs 3]
set -euo pipefail
cd "$(dirname "$0")/.."
# BENCH_BIN=DIR benchmarks the plugins in DIR instead (see bench/lib.sh).
. bench/lib.sh
bench_bin
host=$(rustc -vV | sed -n 's/^host: //p')
exec "target/$host/release/polbench" --ours "$bin" "$@"
