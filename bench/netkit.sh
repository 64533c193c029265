#!/usr/bin/env bash
# Pods on netkit pairs (ptp `linkType: netkit`, the fast path on netkit's
# peer hook) against veth pairs and the direct veth pair, in one run:
# fpbench --netkit (TCP request/response p50/p99, ping, iperf3; paired
# per-round ratios). Where this kernel has netkit it runs here; where it has
# none (this project's CI host) it runs in scripts/vm-run's VM on Debian's
# 6.12 kernel, which here is software-emulated (TCG): its figures are
# INDICATIVE ONLY, each setup paying the emulator's cost per packet; the
# issue's targets are for a native kernel with netkit.
# Benchmarks what scripts/install ships (the static release build).
# Needs root, iperf3. Everything runs in namespaces fpbench creates.
# Usage: bench/netkit.sh [--vm] [fpbench options, e.g. --rounds 5]
#   --vm   run in the VM even where this kernel has netkit
set -euo pipefail
cd "$(dirname "$0")/.."
# BENCH_BIN=DIR benchmarks the plugins in DIR instead (see bench/lib.sh).
. bench/lib.sh
vm=
if [ "${1:-}" = --vm ]; then vm=1; shift; fi
bench_bin
host=$(rustc -vV | sed -n 's/^host: //p')
fpbench=target/$host/release/fpbench
[ -x "$fpbench" ] || cargo build --release --target "$host" -p rcni-bench --bin fpbench
# Does this kernel create netkit links? (in a throwaway namespace)
if [ -z "$vm" ] && unshare --net sh -c 'ip link add nkprobe type netkit' 2>/dev/null; then
  echo "# native kernel $(uname -r) with netkit"
  exec "$fpbench" --ours "$bin" --netkit --add-pods 0 "$@"
fi
echo "# kernel $(uname -r) has no netkit (or --vm): in scripts/vm-run's VM (software-emulated: INDICATIVE ONLY)"
# The VM's 2 vCPUs are host threads: one RR pair pinned to vCPU 1 as on
# a native run; fewer exchanges, as each costs the emulator ~10x more.
exec scripts/vm-run --timeout 3000 --env RCNI_PROBE_DIR=/run/rcni-probe -- \
  "$fpbench" --ours "$bin" --netkit --add-pods 0 --rr 1000 --pings 500 --rounds 5 \
  --tput-rounds 2 "$@"
