#!/usr/bin/env bash
# The rcni-node agent's own cost: a cluster file of N nodes (default 1000,
# backend vxlan: 3 kernel entries per peer) applied by `rcni-node run --once`
# in a node namespace with an uplink, timed, with its peak RSS (GNU time);
# then one node's address changed and `--once` run again: the kernel changes
# it reports must be that node's entries only. Targets: 1000 nodes in under
# 1 s, peak RSS under 30 MB. Everything lives in a namespace and a temporary
# directory made here, removed on exit; no traffic is sent.
# Usage: bench/agent.sh [--nodes N] [--bin-dir DIR]
#        (default: the static release build's rcni-node, built by
#        scripts/install --bin-dir target/bench-bin)
set -euo pipefail
cd "$(dirname "$0")/.."
# RCNI_PROBE_DIR under target/ (and the helpers the bench scripts share).
. bench/lib.sh
nodes=1000
bin=
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) nodes=$2; shift 2 ;;
    --bin-dir) bin=$2; shift 2 ;;
    *) echo "usage: $0 [--nodes N] [--bin-dir DIR]" >&2; exit 2 ;;
  esac
done
[ -x /usr/bin/time ] || { echo "$0: needs /usr/bin/time (Debian package time)" >&2; exit 1; }
host=$(rustc -vV | sed -n 's/^host: //p')
if [ -z "$bin" ]; then
  scripts/install --bin-dir target/bench-bin >/dev/null
  node_bin=$PWD/target/$host/release/rcni-node
else
  node_bin=$(cd "$bin" && pwd)/rcni-node
fi
[ -x "$node_bin" ] || { echo "$0: no rcni-node at $node_bin" >&2; exit 1; }

tag=rcni-agentbench-$$
node=$tag-node
work=$(mktemp -d "/tmp/$tag.XXXXXX")
cleanup() {
  set +e
  ip netns del "$node" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

# The node: eth0 (a veth whose peer stays in the namespace as a stub) at
# 192.168.0.1/16; peers are VTEPs at 192.168.<i/250>.<i%250+1>, so no peer
# needs to answer: vxlan entries are programmed, not probed.
ip netns add "$node"
ip -n "$node" link set lo up
ip -n "$node" link add eth0 type veth peer name stub0
ip -n "$node" link set stub0 up
ip -n "$node" link set eth0 up
ip -n "$node" addr add 192.168.0.1/16 dev eth0

# gen FILE CHANGED: N nodes, pod subnets /24s of 10.0.0.0/8; node CHANGED
# (0 for none) gets another address.
gen() {
  python3 - "$1" "$nodes" "$2" <<'PY'
import json, sys
path, n, changed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
nodes = []
for i in range(n):
    a = f"192.168.{i // 250}.{i % 250 + 1}"
    if i + 1 == changed:
        a = "192.168.250.1"
    nodes.append({"name": f"n{i + 1}", "address": a,
                  "podCIDR": f"10.{1 + i // 256}.{i % 256}.0/24"})
json.dump({"network": "10.0.0.0/8", "backend": "vxlan", "nodes": nodes}, open(path, "w"))
PY
}
gen "$work/cluster.json" 0
changed=$((nodes / 2))

# run LABEL: one `--once` under GNU time; prints wall time, peak RSS and
# the agent's own summary line.
run() {
  ip netns exec "$node" /usr/bin/time -v -o "$work/time" "$node_bin" run --once \
    --cluster "$work/cluster.json" --node n1 --cni-conf-dir "$work/net.d" \
    --state-dir "$work/state" --ipam-data-dir "$work/ipam" 2>"$work/log" ||
    { cat "$work/log" >&2; exit 1; }
  local wall rss summary
  wall=$(sed -n 's/.*Elapsed (wall clock) time.*: //p' "$work/time")
  rss=$(sed -n 's/.*Maximum resident set size (kbytes): //p' "$work/time")
  summary=$(grep -o 'reconciled .*' "$work/log")
  printf '  %-22s wall %s   peak RSS %.1f MB   %s\n' "$1" "$wall" "$(awk "BEGIN{print $rss/1024}")" "$summary"
}

echo "== agent: $nodes nodes, backend vxlan; load: $(cut -d' ' -f1-3 /proc/loadavg)"
run "first apply"
counts() {
  printf 'neigh %s  fdb %s  routes %s' \
    "$(ip -n "$node" neigh show dev rcni.1 nud permanent | wc -l)" \
    "$(bridge -n "$node" fdb show dev rcni.1 | grep -c ' dst ')" \
    "$(ip -n "$node" route show proto 0x52 | wc -l)"
}
echo "  kernel entries: $(counts)"
run "unchanged (no-op)"
gen "$work/cluster.json" "$changed"
run "n$changed moved"
echo "  kernel entries: $(counts)"
echo "  (n$changed's entries: its FDB entry's destination is the one that has to change)"
