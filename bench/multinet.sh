#!/usr/bin/env bash
# multinet's own cost: ADD of a pod on two networks (bridge + host-local as
# eth0, macvlan + host-local as net1) through multinet, against the same two
# delegates run directly one after the other, in alternating rounds of one
# run. Prints medians and p90 of both and multinet's overhead (target: at
# most 2 ms over the sum of its delegates). Everything lives in namespaces
# and a temporary directory made here, removed on exit.
# Usage: bench/multinet.sh [--rounds N] [--bin-dir DIR]   (default: 40 rounds,
#        the static release build installed into target/bench-bin)
set -euo pipefail
cd "$(dirname "$0")/.."
# RCNI_PROBE_DIR under target/ (and the helpers the bench scripts share).
. bench/lib.sh
rounds=40
bin=
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --bin-dir) bin=$2; shift 2 ;;
    *) echo "usage: $0 [--rounds N] [--bin-dir DIR]" >&2; exit 2 ;;
  esac
done
if [ -z "$bin" ]; then
  bin=$PWD/target/bench-bin
  scripts/install --bin-dir "$bin" >/dev/null
fi
bin=$(cd "$bin" && pwd)
# Ours first; a plugin type rcni does not ship comes from the reference.
path=$bin:/usr/lib/cni
tag=rcni-mnbench-$$
node=$tag-node
lan=$tag-lan
work=$(mktemp -d "/tmp/$tag.XXXXXX")
cleanup() {
  set +e
  ip netns pids "$node" 2>/dev/null | xargs -r kill 2>/dev/null
  for n in $(ip netns list | awk '{print $1}' | grep "^$tag-"); do ip netns del "$n"; done
  rm -rf "$work"
}
trap cleanup EXIT

ip netns add "$node"
ip netns add "$lan"
ip -n "$node" link add mv0 type veth peer name lan0
ip -n "$node" link set lan0 netns "$lan"
ip -n "$node" link set mv0 up
ip -n "$lan" link set lan0 up
mkdir -p "$work/net.d" "$work/multinet.d"
cbr0='{"type": "bridge", "bridge": "mnb0", "isGateway": true,
       "ipam": {"type": "host-local", "dataDir": "'$work'/ipam",
                "ranges": [[{"subnet": "10.97.0.0/16"}]]}}'
macnet='{"type": "macvlan", "master": "mv0", "mode": "bridge",
         "ipam": {"type": "host-local", "dataDir": "'$work'/ipam",
                  "ranges": [[{"subnet": "10.98.0.0/16"}]]}}'
echo '{"cniVersion": "1.0.0", "name": "cbr0", "plugins": ['"$cbr0"']}' > "$work/net.d/10-cbr0.conflist"
echo '{"cniVersion": "1.0.0", "name": "macnet", "plugins": ['"$macnet"']}' > "$work/multinet.d/20-macnet.conflist"
multinet='{"cniVersion": "1.0.0", "name": "podnet", "type": "multinet",
  "defaultNetwork": "cbr0", "defaultConfDir": "'$work'/net.d", "confDir": "'$work'/multinet.d",
  "cacheDir": "'$work'/mncache", "statusDir": "'$work'/mnstatus",
  "runtimeConfig": {"io.kubernetes.cri.pod-annotations": {"k8s.v1.cni.cncf.io/networks": "macnet"}}}'

# The first of CNI_PATH holding plugin type $1, as a runtime finds it;
# resolved once, so the rounds time the plugins and nothing of this script.
which_plugin() {
  local d
  for d in ${path//:/ }; do [ -x "$d/$1" ] && { echo "$d/$1"; return; }; done
  echo "plugin $1 not found in $path" >&2; exit 1
}
declare -A exe
for t in multinet bridge macvlan; do exe[$t]=$(which_plugin "$t"); done
# plugin CMD CID NETNS IFNAME TYPE CONF: one plugin call, from the node
# namespace this shell runs in (entered once, below).
plugin() {
  CNI_COMMAND=$1 CNI_CONTAINERID=$2 CNI_NETNS=$3 CNI_IFNAME=$4 CNI_PATH=$path \
    "${exe[$5]}" <<<"$6" >/dev/null
}
now() { date +%s%N; }
single() { echo "$1" | sed 's/^{/{"cniVersion": "1.0.0", "name": "'"$2"'", /'; }
cbr0_single=$(single "$cbr0" cbr0)
macnet_single=$(single "$macnet" macnet)

rounds_in_node() {
  : > "$work/mn.txt"; : > "$work/sum.txt"
  for i in $(seq 1 "$rounds"); do
    local pod=$tag-pod$i
    ip netns add "$pod"
    local ns=/run/netns/$pod
    local t0 t1 t2 t3
    t0=$(now); plugin ADD m$i "$ns" eth0 multinet "$multinet"; t1=$(now)
    plugin DEL m$i "$ns" eth0 multinet "$multinet"
    t2=$(now); plugin ADD d$i "$ns" eth0 bridge "$cbr0_single"
    plugin ADD d$i "$ns" net1 macvlan "$macnet_single"; t3=$(now)
    plugin DEL d$i "$ns" net1 macvlan "$macnet_single"
    plugin DEL d$i "$ns" eth0 bridge "$cbr0_single"
    ip netns del "$pod"
    echo $(( (t1 - t0) / 1000 )) >> "$work/mn.txt"
    echo $(( (t3 - t2) / 1000 )) >> "$work/sum.txt"
  done
}
# The rounds run in a shell inside the node namespace: one nsenter for the
# whole run instead of one per plugin call.
export tag work path rounds multinet cbr0_single macnet_single
nsenter --net="/run/netns/$node" bash -c "set -euo pipefail
  $(declare -f plugin now rounds_in_node)
  declare -A exe=($(for t in "${!exe[@]}"; do printf '[%s]=%q ' "$t" "${exe[$t]}"; done))
  rounds_in_node"
stats() { sort -n "$1" | awk '{a[NR]=$1} END {printf "%.2f %.2f", a[int((NR+1)/2)]/1000, a[int(NR*0.9+0.5)]/1000}'; }
read -r mn_p50 mn_p90 <<<"$(stats "$work/mn.txt")"
read -r sum_p50 sum_p90 <<<"$(stats "$work/sum.txt")"
over=$(awk -v a="$mn_p50" -v b="$sum_p50" 'BEGIN {printf "%.2f", a - b}')
printf '%-44s %8s %8s\n' "ADD, $rounds rounds (ms)" p50 p90
printf '%-44s %8s %8s\n' "multinet (bridge eth0 + macvlan net1)" "$mn_p50" "$mn_p90"
printf '%-44s %8s %8s\n' "bridge then macvlan, run directly" "$sum_p50" "$sum_p90"
printf 'multinet overhead over its delegates: %s ms (target <= 2 ms); ratio %s\n' "$over" \
  "$(awk -v a="$mn_p50" -v b="$sum_p50" 'BEGIN {printf "%.2f", a / b}')"
