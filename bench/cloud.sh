#!/usr/bin/env bash
# Cloud mode's figure (issue 31), side by side in one run: a pod's ADD and
# DEL with its address from rcni-node's warm pool (ptp + vpc-ipam, the
# agent against the EC2 model on the VPC lab of integration/tests), against
# the reference's bridge + host-local (v1.9.1 where RCNI_REFERENCE_V191 or
# the shared tarball gives it, else Debian's 1.1.1), the reference's ptp +
# host-local (the same layout without the pool), and our bridge +
# host-local. Target: ours <= 1.0x the reference bridge's ADD (the cloud
# call is off the pod's path). Also prints the agent's EC2 calls.
# Everything lives in namespaces the test makes; the EC2 model (moto) and
# the IMDS stand-in listen only inside them.
# Usage: bench/cloud.sh [--rounds N] (default 40 pods per chain)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=40
while [ $# -gt 0 ]; do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    *) echo "usage: $0 [--rounds N]" >&2; exit 2 ;;
  esac
done
# BENCH_BIN=DIR benchmarks the plugins in DIR instead (see bench/lib.sh).
. bench/lib.sh
bench_bin
cargo build -q -p rcni-integration --test cloud_bench
BENCH_ROUNDS=$rounds RCNI_BIN_DIR=$(realpath "$bin") cargo test -q -p rcni-integration --test cloud_bench \
  -- --ignored --nocapture --test-threads 1 2>&1 | grep -v '^running\|^test result\|^$'
