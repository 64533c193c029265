#!/usr/bin/env bash
# What policy flow events cost, in one run, for the policy plugin's eBPF and
# nftables backends side by side: TCP request/response latency (p50, p99),
# connect/request/response/close latency and iperf3 throughput between two
# pods of a bridge network whose server a policy selects, with flow events
# off ("flowEvents": "none") and on ("deny", the collector `policy flows
# --follow` running as rcni-node runs it), first while nothing is denied,
# then while a third pod floods the server with denied datagrams (a new
# flow each, paced at --flood-pps). Paired rounds in a rotating order;
# ratios on/off per round. Targets: <= 5 % cost while nothing is denied,
# and a flood of denials slows allowed traffic by <= 5 % more with events
# on than off. Benchmarks what scripts/install ships (the static release
# build). Needs root and iperf3; everything runs in namespaces it creates.
# Usage: bench/flows.sh [polbench options, e.g. --rounds 10 --flood-pps 50000]
set -euo pipefail
cd "$(dirname "$0")/.."
# BENCH_BIN=DIR benchmarks the plugins in DIR instead (see bench/lib.sh).
. bench/lib.sh
bench_bin
host=$(rustc -vV | sed -n 's/^host: //p')
exec "target/$host/release/polbench" --ours "$bin" --flows --sync-pods 0 "$@"
