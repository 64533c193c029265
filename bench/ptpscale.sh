#!/usr/bin/env bash
# ptp at scale (issue 20): ADD and DEL latency of ptp + host-local on a
# node holding 10 pods and on one holding 1000, sampled in turn (ours, and
# the reference in /usr/lib/cni on nodes of its own), p50/p90 and the ratio many/few
# (target: at most 1.5x). Runs what scripts/install ships, everything in
# namespaces ptpscale creates; exits 1 if our ADD ratio is above 1.5.
# Usage: bench/ptpscale.sh [--few 10] [--many 1000] [--samples 40]
set -euo pipefail
cd "$(dirname "$0")/.."
# BENCH_BIN=DIR benchmarks the plugins in DIR instead (see bench/lib.sh).
. bench/lib.sh
bench_bin
host=$(rustc -vV | sed -n 's/^host: //p')
exec "target/$host/release/ptpscale" --ours "$bin" "$@"
