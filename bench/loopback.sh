#!/usr/bin/env bash
# ADD+DEL latency of rcni's loopback against the reference loopback, side by
# side in one run, in a throwaway namespace. Prints medians and the ratio.
# Usage: bench/loopback.sh [ROUNDS] (needs root and a built target/release/loopback)
set -euo pipefail
cd "$(dirname "$0")/.."
# RCNI_PROBE_DIR under target/ (and the helpers the bench scripts share).
. bench/lib.sh
rounds=${1:-300}
ours=${OURS:-target/release/loopback}
ref=/usr/lib/cni/loopback
[ -x "$ours" ] || cargo build --release -p loopback
ns=rcni-bench-$$
ip netns add "$ns"
trap 'ip netns del "$ns"' EXIT
conf='{"cniVersion":"0.3.1","name":"bench","type":"loopback"}'
run() { # binary -> one ADD+DEL in nanoseconds
  local t0 t1
  t0=$(date +%s%N)
  echo "$conf" | CNI_COMMAND=ADD CNI_CONTAINERID=bench CNI_NETNS=/run/netns/$ns CNI_IFNAME=eth0 CNI_PATH=/x "$1" >/dev/null
  echo "$conf" | CNI_COMMAND=DEL CNI_CONTAINERID=bench CNI_NETNS=/run/netns/$ns CNI_IFNAME=eth0 CNI_PATH=/x "$1" >/dev/null
  t1=$(date +%s%N)
  echo $((t1 - t0))
}
: >"/tmp/$ns.ours"; : >"/tmp/$ns.ref"
for _ in $(seq "$rounds"); do   # interleaved, so drift hits both alike
  run "$ours" >>"/tmp/$ns.ours"
  run "$ref" >>"/tmp/$ns.ref"
done
stat() { sort -n "$1" | awk '{a[NR]=$1} END {printf "%.0f %.0f %.0f", a[int(NR*0.5)]/1000, a[int(NR*0.1)+1]/1000, a[int(NR*0.9)]/1000}'; }
read -r om ol oh <<<"$(stat "/tmp/$ns.ours")"
read -r rm rl rh <<<"$(stat "/tmp/$ns.ref")"
rss() { /usr/bin/time -f %M sh -c "echo '$conf' | CNI_COMMAND=ADD CNI_CONTAINERID=bench CNI_NETNS=/run/netns/$ns CNI_IFNAME=eth0 CNI_PATH=/x $1 >/dev/null" 2>&1 | tail -1; }
printf "loopback ADD+DEL, %s rounds (microseconds: median [p10..p90])\n" "$rounds"
printf "  rcni      %6s [%s..%s]  max RSS %s KiB\n" "$om" "$ol" "$oh" "$(rss "$ours")"
printf "  reference %6s [%s..%s]  max RSS %s KiB\n" "$rm" "$rl" "$rh" "$(rss "$ref")"
awk -v o="$om" -v r="$rm" 'BEGIN {printf "  ratio rcni/reference: %.2f\n", o/r}'
rm -f "/tmp/$ns.ours" "/tmp/$ns.ref"
