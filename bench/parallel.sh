#!/usr/bin/env bash
# Concurrency (issue 20): N ADDs of the full chain (bridge + host-local,
# portmap, firewall, tuning, bandwidth, fastpath, policy) started at once
# on one node, then N DELs at once, checking no failed command (no EBUSY or
# nf_tables generation conflict reaching the runtime), no duplicate
# address, no lost or doubled rule per pod (also while half the pods are
# deleted as new ones are added) and nothing left; p50 and p99 of
# ADD and DEL for ours (full chain, and without fastpath and policy) and
# the reference (without them: it has neither) in the same run, with the
# like-for-like ratios. Runs what scripts/install ships; everything inside
# namespaces parbench creates. Exits 1 on any broken expectation.
# Usage: bench/parallel.sh [--concurrent 100] [--rounds 3]
set -euo pipefail
cd "$(dirname "$0")/.."
# BENCH_BIN=DIR benchmarks the plugins in DIR instead (see bench/lib.sh).
. bench/lib.sh
bench_bin
host=$(rustc -vV | sed -n 's/^host: //p')
exec "target/$host/release/parbench" --ours "$bin" "$@"
