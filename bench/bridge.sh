#!/usr/bin/env bash
# bridge + host-local, rcni against the reference plugins side by side in one
# run: ADD/DEL median and p99 latency, CPU and peak RSS per operation and their
# ratios, ADD latency at 10/100/1000 pods on one bridge, and concurrent ADDs
# checked for duplicate addresses. Benchmarks what scripts/install ships (the
# static release build). Everything runs in namespaces cnibench creates.
# Usage: bench/bridge.sh [cnibench options, e.g. --rounds 200 --settle 20]
set -euo pipefail
cd "$(dirname "$0")/.."
# BENCH_BIN=DIR benchmarks the plugins in DIR instead (see bench/lib.sh).
. bench/lib.sh
bench_bin
host=$(rustc -vV | sed -n 's/^host: //p')
exec "target/$host/release/cnibench" --ours "$bin" "$@"
