#!/usr/bin/env bash
# The per-pod cost of the eBPF plugins (issue 33): conf/80-bridge-policy.conflist
# (bridge + fastpath + policy) against the reference's bridge alone, which
# has neither, side by side in one run per attach mode: attachMode auto
# (cls_bpf on clsact) and tcx (each attach waits for an RCU grace period
# under rtnl). Chain ADD and DEL median and p99, CPU, per-plugin medians,
# ratios. Target: ADD <= 1.2x the reference bridge's. Against upstream's
# v1.9.1 where RCNI_REFERENCE_V191 or the shared tarball gives it, else
# Debian's 1.1.1 (the conflist then at cniVersion 1.0.0, the newest it
# knows). Everything runs in namespaces chainbench creates.
# Usage: bench/ebpf-add.sh [--rounds N]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=60
while [ $# -gt 0 ]; do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    *) echo "usage: $0 [--rounds N]" >&2; exit 2 ;;
  esac
done
# BENCH_BIN=DIR benchmarks the plugins in DIR instead (see bench/lib.sh).
. bench/lib.sh
bench_bin
host=$(rustc -vV | sed -n 's/^host: //p')
reference_v191
version=1.1.0
[ -n "$ref" ] || { ref=/usr/lib/cni version=1.0.0; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for mode in auto tcx; do
  python3 - "$mode" "$version" >"$tmp/$mode.conflist" <<'PY'
import json, sys
c = json.load(open("conf/80-bridge-policy.conflist"))
c["cniVersion"] = sys.argv[2]
for p in c["plugins"]:
    if p["type"] in ("fastpath", "policy"):
        p["attachMode"] = sys.argv[1]
print(json.dumps(c))
PY
  echo "== attachMode $mode, reference $ref"
  "target/$host/release/chainbench" --ours "$bin" --reference "$ref" \
    --conf "$tmp/$mode.conflist" --reference-only bridge --rounds "$rounds"
done
