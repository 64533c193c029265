#!/usr/bin/env bash
# The bgp backend's figures (issue 30), side by side in one run:
#  convergence  N nodes (--nodes, default "3 100") against one route
#               reflector (BIRD, iBGP AS 64512, every node an rr client):
#               the measured node a real `rcni-node run` ("backend": "bgp",
#               no mesh, the reflector as its peer), the N-1 others
#               simulated by ONE BIRD in one namespace (N-1 addresses on the
#               L2 of the reflector and the node, one session per simulated
#               node with its own local address, router id and import
#               table, each announcing its pod /24). Timed by
#               bench/bgp_conv.py, polling every 10 ms: (a) from the agent's
#               start until its prefix is in every simulated table and the
#               N-1 prefixes are in the node's main table with proto 0x52;
#               (b) from the node's removal from the cluster file until its
#               prefix is in no simulated table. Median and max of --reps;
#               stages (BIRD up, session Established, ...) to say where the
#               time goes. Target: under 1 s at 100 nodes (the max).
#  memory       the node in a full mesh of 101 nodes, the 100 peers one
#               BIRD (100 sessions, a /24 each): once all are Established
#               and the 100 routes mirrored, VmRSS/VmHWM of rcni-node and
#               of its BIRD child, and their CPU time over --seconds of
#               steady state. Target: agent peak RSS under 30 MB.
#  traffic      two racks (192.168.50.0/24, 192.168.60.0/24) behind two
#               linked ToRs, one node per rack, one pod per node attached
#               with cnitool from the conflist the agent writes: single-
#               stream TCP (iperf3) and 1-byte TCP request/response p50
#               (crossnode.sh's ping-pong) pod to pod, for (a) rcni-node
#               backend bgp with the ToRs running BIRD (eBGP, per-node
#               asNumber, routes learned) and (b) the same topology with the
#               same routes written by this script (the limit; the agent
#               run --once, which starts no BIRD). Both in two regimes:
#               idle CPUs, and busy (a shell busy loop pinned to each CPU,
#               nice 0); --rounds rounds alternating bgp and static,
#               medians compared. Targets: p50 bgp/static <= 1.05,
#               throughput bgp/static >= 0.95.
# Everything lives in namespaces and a temporary directory made here,
# removed on exit; every BIRD and agent runs with PR_SET_PDEATHSIG (setpriv)
# and is killed with its namespace's processes; traffic only between them.
# Usage: bench/bgp.sh [--nodes LIST] [--reps N] [--seconds N] [--rr N]
#                     [--rounds N] [--reflector-defaults] [--bin-dir DIR]
#                     [--only convergence|memory|traffic]
#        (default: "3 100", 5 reps, 10 s (iperf3, the CPU window), 5000
#        round trips, 3 rounds, the static release build installed into
#        target/bench-bin by scripts/install). KEEP=1 keeps the temporary
#        directory (BIRD configurations and logs, the agents' stderr).
set -euo pipefail
cd "$(dirname "$0")/.."
# RCNI_PROBE_DIR under target/ (and the helpers the bench scripts share).
. bench/lib.sh
nodes_list="3 100"
reps=5
secs=10
rr=5000
rounds=3
rr_defaults=0
bin=
only=
usage() {
  echo "usage: $0 [--nodes LIST] [--reps N] [--seconds N] [--rr N] [--rounds N] [--reflector-defaults] [--bin-dir DIR] [--only convergence|memory|traffic]" >&2
  exit 2
}
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) nodes_list=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --seconds) secs=$2; shift 2 ;;
    --rr) rr=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --reflector-defaults) rr_defaults=1; shift ;;
    --bin-dir) bin=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    *) usage ;;
  esac
done
case "$only" in "" | convergence | memory | traffic) ;; *) usage ;; esac
for n in $nodes_list; do
  # One /24 of underlay (the reflector at .254) and pod /24s 10.244.<i>.0.
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 2 ] && [ "$n" -le 250 ] ||
    { echo "$0: --nodes: each N from 2 to 250" >&2; exit 2; }
done
for t in bird birdc iperf3 python3 ip setpriv taskset; do
  command -v "$t" >/dev/null || { echo "$0: needs $t" >&2; exit 1; }
done
bird=$(command -v bird)
host=$(rustc -vV | sed -n 's/^host: //p')
if [ -z "$bin" ]; then
  bin=$PWD/target/bench-bin
  scripts/install --only rcni-node,cnitool,bridge,host-local,loopback,portmap \
    --bin-dir "$bin" >/dev/null
  node_bin=$PWD/target/$host/release/rcni-node
else
  node_bin=$(cd "$bin" && pwd)/rcni-node
fi
bin=$(cd "$bin" && pwd)
[ -x "$node_bin" ] || { echo "$0: no rcni-node at $node_bin" >&2; exit 1; }
conv_py=$PWD/bench/bgp_conv.py

tag=rcni-bgpbench-$$
work=$(mktemp -d "/tmp/$tag.XXXXXX")
cleanup() {
  set +e
  for n in $(ip netns list | awk '{print $1}' | grep "^$tag-"); do
    ip netns pids "$n" 2>/dev/null | xargs -r kill -KILL 2>/dev/null
  done
  sleep 0.2
  for n in $(ip netns list | awk '{print $1}' | grep "^$tag-"); do ip netns del "$n"; done
  [ -n "${KEEP:-}" ] || rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
nsx() { local ns=$1; shift; ip netns exec "$ns" "$@"; }
newns() {
  ip netns add "$1"
  nsx "$1" ip link set lo up
}
dropns() {
  local n
  for n in "$@"; do
    ip netns pids "$n" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
  done
  sleep 0.1
  for n in "$@"; do ip netns del "$n" 2>/dev/null || true; done
}
# bird_start NS NAME CONF: BIRD in the foreground in NS, SIGKILLed if this
# script dies (started by `ip netns exec`, not nsx: a function in the
# background would be a subshell, the parent PR_SET_PDEATHSIG watches);
# returns once its control socket answers.
bird_start() {
  local ns=$1 name=$2
  printf '%s\n' "$3" >"$work/$name.conf"
  ip netns exec "$ns" setpriv --pdeathsig KILL "$bird" -f -c "$work/$name.conf" \
    -s "$work/$name.ctl" >"$work/$name.log" 2>&1 &
  disown $!
  local i
  for i in $(seq 100); do
    birdc -s "$work/$name.ctl" show status >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  echo "$0: BIRD $name did not start:" >&2
  cat "$work/$name.log" >&2
  exit 1
}
established() { birdc -s "$1" show protocols | grep -c Established || true; }
results=$work/results
: >"$results"

# ---------------------------------------------------------------- convergence
# One L2 (a bridge in the sw namespace): the node at 192.168.50.1, the
# simulated nodes at .2 ... .N in the sim namespace, the reflector at .254.
l2() {
  local sw=$1
  shift
  newns "$sw"
  nsx "$sw" ip link add br0 type bridge
  nsx "$sw" ip link set br0 up
  local ns port
  for ns in "$@"; do
    port=p$(( $(nsx "$sw" ip -o link show master br0 | wc -l) + 1 ))
    nsx "$sw" ip link add "$port" type veth peer name eth0 netns "$ns"
    nsx "$sw" ip link set "$port" master br0 up
    nsx "$ns" ip link set eth0 up
  done
}

# The timers are those of the agent's sessions (node/src/bgp/conf.rs), so
# that neither side is the slow one by configuration: the reflector retries
# a refused connection about every second, so the node's session comes up
# when the node's BIRD connects (its connect delay, 1 s: BIRD's floor,
# jittered down to ~0.85 s) or the reflector retries, whichever is first.
# A reflector on BIRD's default timers (connect delay 5 s, retry 120 s;
# --reflector-defaults) leaves it to the node: up ~1.04 s at N=100.
TIMERS="connect delay time 1; connect retry time 5; error wait time 1, 30; graceful restart on;"
RR_TIMERS=$TIMERS
[ "$rr_defaults" = 1 ] && RR_TIMERS="graceful restart on;"

# sim_conf FIRST LAST NEIGHBOUR: one BGP session per simulated node i in
# FIRST..LAST (local 192.168.50.i, router id the same, table t<i>,
# announcing 10.244.i.0/24), to NEIGHBOUR (the reflector, or the node).
# BIRD 2.0.12 runs one session per neighbour address and port (its object
# lock has no local address): sessions to the same neighbour from
# different local addresses would wait for each other forever. So the
# simulated sessions are passive (the reflector or the node connects,
# always to port 179) and each names a port of its own for the neighbour,
# which only tells the locks apart: a passive session never connects, and
# BIRD matches an incoming connection by addresses, not the remote port.
sim_conf() {
  local first=$1 last=$2 peer=$3 i
  printf 'log stderr { warning, error, fatal, bug };\nrouter id 192.168.50.%s;\nprotocol device { }\n' "$first"
  printf 'template bgp simnode { direct; %s }\n' "$TIMERS"
  for ((i = first; i <= last; i++)); do
    printf 'ipv4 table t%d;\n' "$i"
    printf 'protocol static s%d { ipv4 { table t%d; }; route 10.244.%d.0/24 blackhole; }\n' "$i" "$i" "$i"
    printf 'protocol bgp b%d from simnode { router id 192.168.50.%d; local 192.168.50.%d as 64512; neighbor %s port %d as 64512; passive on;\n' "$i" "$i" "$i" "$peer" $((10000 + i))
    printf '  ipv4 { table t%d; gateway direct; import all; export where source = RTS_STATIC; }; }\n' "$i"
  done
}

# cluster_json N MESH PEERS SKIP: nodes n1..nN (n<i> at 192.168.50.i,
# pods 10.244.i.0/24), node SKIP left out.
cluster_json() {
  python3 - "$@" <<'PY'
import json, sys
n, mesh, peers, skip = int(sys.argv[1]), sys.argv[2] == "true", json.loads(sys.argv[3]), int(sys.argv[4])
nodes = [{"name": f"n{i}", "address": f"192.168.50.{i}", "podCIDR": f"10.244.{i}.0/24"}
         for i in range(1, n + 1) if i != skip]
print(json.dumps({"network": "10.244.0.0/16", "backend": "bgp",
                  "bgp": {"nodeToNodeMeshEnabled": mesh, "peers": peers}, "nodes": nodes}))
PY
}

agent_args() {
  local d=$1
  echo run --cluster "$d/cluster.json" --node n1 --cni-conf-dir "$d/net.d" \
    --state-dir "$d/state" --ipam-data-dir "$d/ipam" --bird "$bird"
}

convergence() {
  local n=$1 rep i
  local sw=$tag-c$n-sw rrns=$tag-c$n-rr sim=$tag-c$n-sim node=$tag-c$n-node
  local d=$work/c$n
  mkdir -p "$d"
  for i in "$rrns" "$sim" "$node"; do newns "$i"; done
  l2 "$sw" "$rrns" "$sim" "$node"
  nsx "$rrns" ip addr add 192.168.50.254/24 dev eth0
  nsx "$node" ip addr add 192.168.50.1/24 dev eth0
  for ((i = 2; i <= n; i++)); do echo "addr add 192.168.50.$i/24 dev eth0"; done |
    nsx "$sim" ip -batch -
  # The reflector: every node a client; next hops (the nodes' own
  # addresses) resolved through the connected /24.
  local c
  c="log stderr { warning, error, fatal, bug };
router id 192.168.50.254;
protocol device { }
protocol direct { ipv4; interface \"eth0\"; }
template bgp rrclient { local 192.168.50.254 as 64512; rr client; direct; $RR_TIMERS
  ipv4 { import all; export all; }; }"
  for ((i = 1; i <= n; i++)); do
    c+=$'\n'"protocol bgp c$i from rrclient { neighbor 192.168.50.$i as 64512; }"
  done
  bird_start "$rrns" "c$n-rr" "$c"
  bird_start "$sim" "c$n-sim" "$(sim_conf 2 "$n" 192.168.50.254)"
  # The simulated nodes' sessions up (and their routes reflected) first.
  for i in $(seq 300); do
    [ "$(established "$work/c$n-sim.ctl")" -eq $((n - 1)) ] && break
    sleep 0.1
  done
  [ "$(established "$work/c$n-sim.ctl")" -eq $((n - 1)) ] ||
    { echo "$0: convergence N=$n: simulated sessions not up" >&2; birdc -s "$work/c$n-sim.ctl" show protocols >&2; exit 1; }
  sleep 1
  local peers='[{"peerIP": "192.168.50.254", "asNumber": 64512}]'
  cluster_json "$n" false "$peers" 0 >"$d/with.json"
  cluster_json "$n" false "$peers" 1 >"$d/without.json"
  echo "== convergence: N=$n ($((n - 1)) simulated), $reps reps, reflector timers: $RR_TIMERS; load: $(cut -d' ' -f1-3 /proc/loadavg)"
  for ((rep = 1; rep <= reps; rep++)); do
    cp "$d/with.json" "$d/cluster.json"
    rm -rf "$d/state"
    # shellcheck disable=SC2046
    if ! python3 "$conv_py" --ns "$node" --n "$n" --prefix 10.244.1.0/24 \
        --sim-sock "$work/c$n-sim.ctl" --rr-sock "$work/c$n-rr.ctl" --rr-proto c1 \
        --node-sock "$d/state/bird/bird.ctl" --cluster "$d/cluster.json" \
        --cluster-without "$d/without.json" --log "$d/agent.log" -- \
        ip netns exec "$node" setpriv --pdeathsig KILL "$node_bin" $(agent_args "$d") \
        >"$d/rep$rep.json"; then
      echo "$0: convergence N=$n rep $rep: $(cat "$d/rep$rep.json")" >&2
      tail -30 "$d/agent.log" >&2
      exit 1
    fi
    python3 - "$d/rep$rep.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
u, d = r["up"], r["down"]
print(f"  up {r['up_ms']:6.1f} ms: BIRD started {u.get('started', -1):.0f}, answers {u['ctl']:.0f}, "
      f"Established {u['est']:.0f}, at the sims {u['sims']:.0f}, table 252 {u['k252']:.0f}, "
      f"main {u['main']:.0f}   down {r['down_ms']:5.1f} ms: file seen {d.get('changed', -1):.0f}, "
      f"session down {d.get('down', -1):.0f}, BIRD gone {d.get('shut', -1):.0f}")
PY
    echo "conv $n $(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["up_ms"], r["down_ms"])' "$d/rep$rep.json")" >>"$results"
    # Next rep from scratch: what the agent left in the kernel goes (an
    # agent that exits keeps its routes, on purpose), and the reflector
    # gets time to see the session closed.
    nsx "$node" ip route flush proto 0x52 2>/dev/null || true
    nsx "$node" ip route flush table 252 2>/dev/null || true
    sleep 1
  done
  cp "$d/agent.log" "$work/agent-c$n.log"
  dropns "$node" "$sim" "$rrns" "$sw"
}

# --------------------------------------------------------------------- memory
memory() {
  local n=101 i
  local sw=$tag-m-sw sim=$tag-m-sim node=$tag-m-node d=$work/m
  mkdir -p "$d"
  newns "$sim"
  newns "$node"
  l2 "$sw" "$sim" "$node"
  nsx "$node" ip addr add 192.168.50.1/24 dev eth0
  for ((i = 2; i <= n; i++)); do echo "addr add 192.168.50.$i/24 dev eth0"; done |
    nsx "$sim" ip -batch -
  bird_start "$sim" m-sim "$(sim_conf 2 "$n" 192.168.50.1)"
  cluster_json "$n" true '[]' 0 >"$d/cluster.json"
  echo "== memory: the node in a full mesh of $n nodes ($((n - 1)) BGP sessions, one BIRD simulating the peers); load: $(cut -d' ' -f1-3 /proc/loadavg)"
  # shellcheck disable=SC2046
  ip netns exec "$node" setpriv --pdeathsig KILL "$node_bin" $(agent_args "$d") 2>"$d/agent.log" &
  local agent=$! t0=$SECONDS est=0 routes=0
  while [ $((SECONDS - t0)) -lt 120 ]; do
    est=$( [ -S "$d/state/bird/bird.ctl" ] && established "$d/state/bird/bird.ctl" || echo 0)
    routes=$(nsx "$node" ip route show proto 0x52 | wc -l)
    [ "$est" -eq $((n - 1)) ] && [ "$routes" -eq $((n - 1)) ] && break
    sleep 0.2
  done
  [ "$est" -eq $((n - 1)) ] && [ "$routes" -eq $((n - 1)) ] ||
    { echo "$0: memory: $est sessions Established, $routes routes after 120 s" >&2; tail -20 "$d/agent.log" >&2; exit 1; }
  echo "  $est sessions Established, $routes routes proto 0x52 after $((SECONDS - t0)) s"
  local child
  child=$(cat /proc/"$agent"/task/*/children | tr ' ' '\n' | grep . | head -1)
  [ -n "$child" ] || { echo "$0: memory: no BIRD child of the agent" >&2; exit 1; }
  # Steady state: a few seconds for the agent's first full passes.
  sleep 2
  python3 - "$agent" "$child" "$secs" "$results" <<'PY'
import os, sys, time
agent, child, secs, results = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
tck = os.sysconf("SC_CLK_TCK")
def status(pid):
    d = {}
    for l in open(f"/proc/{pid}/status"):
        k, _, v = l.partition(":")
        if k in ("VmRSS", "VmHWM"):
            d[k] = int(v.split()[0]) / 1024
    return d
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / tck   # utime, stime (fields 14, 15)
c0 = {p: cpu(p) for p in (agent, child)}
t0 = time.monotonic()
time.sleep(secs)
dt = time.monotonic() - t0
used = {p: cpu(p) - c0[p] for p in (agent, child)}
sa, sc = status(agent), status(child)
for name, p, s in (("rcni-node", agent, sa), ("bird", child, sc)):
    print(f"  {name:10s} VmRSS {s['VmRSS']:6.1f} MB  VmHWM {s['VmHWM']:6.1f} MB  "
          f"CPU {used[p]:.2f} s in {dt:.1f} s ({100 * used[p] / dt:.1f} %)")
print(f"  {'sum':10s} VmRSS {sa['VmRSS'] + sc['VmRSS']:6.1f} MB  VmHWM {sa['VmHWM'] + sc['VmHWM']:6.1f} MB  "
      f"CPU {100 * (used[agent] + used[child]) / dt:.1f} %")
with open(results, "a") as f:
    f.write(f"mem {sa['VmRSS']:.1f} {sa['VmHWM']:.1f} {sc['VmRSS']:.1f} {sc['VmHWM']:.1f} "
            f"{100 * used[agent] / dt:.2f} {100 * used[child] / dt:.2f}\n")
PY
  kill "$agent" 2>/dev/null || true
  wait "$agent" 2>/dev/null || true
  cp "$d/agent.log" "$work/agent-m.log"
  dropns "$node" "$sim" "$sw"
}

# -------------------------------------------------------------------- traffic
# The request/response client and server (bench/rr.py, crossnode.sh's too):
# one connection, 1 byte each way, TCP_NODELAY.
rr_py=$PWD/bench/rr.py

# racks V: ToRs V-tor1/V-tor2 (a bridge "rack" each, 192.168.5<r-1>0.254,
# linked to each other over 192.168.255.0/24), node V-n<r> at
# 192.168.<50|60>.1 (AS 6510<r>, its ToR AS 6500<r> as its peer), pods
# 10.244.<r>.0/24.
rack_net() { [ "$1" = 1 ] && echo 192.168.50 || echo 192.168.60; }
racks() {
  local v=$1 r
  for r in 1 2; do
    local t=$tag-$v-tor$r n=$tag-$v-n$r s
    s=$(rack_net "$r")
    newns "$t"
    newns "$n"
    nsx "$t" sysctl -qw net.ipv4.ip_forward=1
    nsx "$t" ip link add rack type bridge
    nsx "$t" ip addr add "$s.254/24" dev rack
    nsx "$t" ip link set rack up
    nsx "$t" ip link add port1 type veth peer name eth0 netns "$n"
    nsx "$t" ip link set port1 master rack up
    nsx "$n" ip link set eth0 up
    nsx "$n" ip addr add "$s.1/24" dev eth0
  done
  nsx "$tag-$v-tor1" ip link add tor type veth peer name tor netns "$tag-$v-tor2"
  for r in 1 2; do
    nsx "$tag-$v-tor$r" ip addr add "192.168.255.$r/24" dev tor
    nsx "$tag-$v-tor$r" ip link set tor up
  done
  python3 - >"$work/$v.json" <<'PY'
import json
nodes = [{"name": f"n{r}", "address": f"{s}.1", "podCIDR": f"10.244.{r}.0/24",
          "asNumber": 65100 + r, "peers": [{"peerIP": f"{s}.254", "asNumber": 65000 + r}]}
         for r, s in ((1, "192.168.50"), (2, "192.168.60"))]
print(json.dumps({"network": "10.244.0.0/16", "backend": "bgp",
                  "bgp": {"nodeToNodeMeshEnabled": False}, "nodes": nodes}))
PY
}

# A ToR's BIRD: its rack subnet from direct, learned routes into its
# kernel, eBGP to the other ToR (pods and rack subnets) and to its node
# (pods only), as integration/src/lab/fabric.rs's ToRs.
tor_conf() {
  local r=$1 o=$((3 - $1)) s
  s=$(rack_net "$r")
  cat <<CONF
log stderr { warning, error, fatal, bug };
router id 192.168.255.$r;
protocol device { }
protocol direct { ipv4; interface "rack"; }
protocol kernel { ipv4 { import none; export where source = RTS_BGP; }; }
filter pods { if net ~ [ 10.244.0.0/16{16,32} ] then accept; reject; }
filter fabric { if net ~ [ 10.244.0.0/16{16,32}, 192.168.50.0/24, 192.168.60.0/24 ] then accept; reject; }
protocol bgp tor { local 192.168.255.$r as 6500$r; neighbor 192.168.255.$o as 6500$o; $TIMERS
  ipv4 { import filter fabric; export filter fabric; }; }
protocol bgp node { local $s.254 as 6500$r; neighbor $s.1 as 6510$r; $TIMERS
  ipv4 { import filter pods; export filter pods; }; }
CONF
}

# pods V: a pod per node, attached with cnitool from the agent's conflist;
# sets pod_ip.
pods() {
  local v=$1 r
  for r in 1 2; do
    local n=$tag-$v-n$r p=$tag-$v-p$r d=$work/$v-n$r
    newns "$p"
    pod_ip[r]=$(CNI_PATH=$bin NETCONFPATH=$d/net.d CNI_CACHE_DIR=$d/cache \
      nsx "$n" "$bin/cnitool" add rcni "/run/netns/$p" |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["ips"][0]["address"].split("/")[0])')
  done
}

traffic_setup() {
  local r i
  # (a) bgp: BIRD on the ToRs, the agent (and its BIRD) on the nodes.
  racks bgp
  for r in 1 2; do
    bird_start "$tag-bgp-tor$r" "bgp-tor$r" "$(tor_conf "$r")"
    local d=$work/bgp-n$r
    mkdir -p "$d"
    ip netns exec "$tag-bgp-n$r" setpriv --pdeathsig KILL "$node_bin" run --cluster "$work/bgp.json" \
      --node "n$r" --cni-conf-dir "$d/net.d" --state-dir "$d/state" --ipam-data-dir "$d/ipam" \
      --bird "$bird" 2>"$d.agent.log" &
    disown $!
  done
  for i in $(seq 300); do
    [ "$(nsx "$tag-bgp-n1" ip route show proto 0x52 | wc -l)" -ge 1 ] &&
      [ "$(nsx "$tag-bgp-n2" ip route show proto 0x52 | wc -l)" -ge 1 ] && break
    sleep 0.1
  done
  for r in 1 2; do
    [ "$(nsx "$tag-bgp-n$r" ip route show proto 0x52 | wc -l)" -ge 1 ] ||
      { echo "$0: traffic: node n$r learned no route" >&2; cat "$work/bgp-n$r.agent.log" >&2; exit 1; }
  done
  pods bgp
  bgp_ip=${pod_ip[2]}
  # (b) static: the agent once (conflist, forwarding; --once starts no
  # BIRD), then the routes BGP would have put there.
  racks static
  for r in 1 2; do
    local d=$work/static-n$r
    nsx "$tag-static-n$r" "$node_bin" run --once --cluster "$work/static.json" \
      --node "n$r" --cni-conf-dir "$d/net.d" --state-dir "$d/state" --ipam-data-dir "$d/ipam" \
      --bird "$bird" 2>"$d.agent.log" || { cat "$d.agent.log" >&2; exit 1; }
  done
  nsx "$tag-static-n1" ip route add 10.244.2.0/24 via 192.168.50.254 dev eth0
  nsx "$tag-static-n2" ip route add 10.244.1.0/24 via 192.168.60.254 dev eth0
  nsx "$tag-static-tor1" ip route add 10.244.1.0/24 via 192.168.50.1 dev rack
  nsx "$tag-static-tor1" ip route add 10.244.2.0/24 via 192.168.255.2 dev tor
  nsx "$tag-static-tor1" ip route add 192.168.60.0/24 via 192.168.255.2 dev tor
  nsx "$tag-static-tor2" ip route add 10.244.2.0/24 via 192.168.60.1 dev rack
  nsx "$tag-static-tor2" ip route add 10.244.1.0/24 via 192.168.255.1 dev tor
  nsx "$tag-static-tor2" ip route add 192.168.50.0/24 via 192.168.255.1 dev tor
  pods static
  static_ip=${pod_ip[2]}
  echo "  routes on n1: bgp: $(nsx "$tag-bgp-n1" ip route show 10.244.2.0/24)"
  echo "                static: $(nsx "$tag-static-n1" ip route show 10.244.2.0/24)"
  echo "  routes on tor1: bgp: $(nsx "$tag-bgp-tor1" ip route show 10.244.2.0/24)"
  echo "                  static: $(nsx "$tag-static-tor1" ip route show 10.244.2.0/24)"
}

# measure NAME REGIME SRC_NS DST_NS DST_IP: appends "traffic NAME REGIME p50
# gbit". Client and server pinned to CPUs of their own (the last two): left
# to the scheduler, the ping-pong's p50 is bimodal (11 or 19 us here, same
# CPU or not), run to run, whatever the routes.
measure() {
  local name=$1 regime=$2 src=$3 dst=$4 ip=$5
  nsx "$src" ping -c 1 -W 2 -q "$ip" >/dev/null || { echo "$0: $name: $ip unreachable" >&2; exit 1; }
  nsx "$dst" taskset -c "$cpu_srv" iperf3 -s -1 -p 5201 >/dev/null 2>&1 &
  local srv=$!
  sleep 0.3
  local gbit
  gbit=$(nsx "$src" taskset -c "$cpu_cli" iperf3 -c "$ip" -p 5201 -t "$secs" -J |
    python3 -c 'import json,sys; print("%.2f" % (json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"] / 1e9))')
  wait "$srv" || true
  nsx "$dst" taskset -c "$cpu_srv" python3 "$rr_py" server >"$work/rr.ready" &
  srv=$!
  for _ in $(seq 50); do [ -s "$work/rr.ready" ] && break; sleep 0.1; done
  local p50
  p50=$(nsx "$src" taskset -c "$cpu_cli" python3 "$rr_py" client "$ip" "$rr")
  wait "$srv" || true
  rm -f "$work/rr.ready"
  echo "traffic $name $regime $p50 $gbit" >>"$results"
  printf '  round %d  %-7s %-5s p50 %8s us   %7s Gbit/s\n' "$round" "$name" "$regime" "$p50" "$gbit"
}

busy_on() {
  local c
  busy=()
  for c in $(seq 0 $(($(nproc) - 1))); do
    nsx "$tag-busy" taskset -c "$c" sh -c 'while :; do :; done' &
    busy+=($!)
  done
}
busy_off() {
  kill "${busy[@]}" 2>/dev/null || true
  wait "${busy[@]}" 2>/dev/null || true
  busy=()
}

traffic() {
  echo "== traffic: pod to pod across two racks; $secs s iperf3, $rr round trips; load: $(cut -d' ' -f1-3 /proc/loadavg)"
  declare -ga pod_ip=()
  traffic_setup
  newns "$tag-busy"
  cpu_cli=$(($(nproc) > 1 ? $(nproc) - 2 : 0))
  cpu_srv=$(($(nproc) - 1))
  local regime
  for regime in idle busy; do
    [ "$regime" = busy ] && busy_on
    # Alternating, the order flipped each round: drift and warm-up fall
    # on both sides.
    for ((round = 1; round <= rounds; round++)); do
      if [ $((round % 2)) = 1 ]; then
        measure bgp "$regime" "$tag-bgp-p1" "$tag-bgp-p2" "$bgp_ip"
        measure static "$regime" "$tag-static-p1" "$tag-static-p2" "$static_ip"
      else
        measure static "$regime" "$tag-static-p1" "$tag-static-p2" "$static_ip"
        measure bgp "$regime" "$tag-bgp-p1" "$tag-bgp-p2" "$bgp_ip"
      fi
    done
    [ "$regime" = busy ] && busy_off
  done
}

echo "== bgp: rcni-node $node_bin, $("$bird" --version 2>&1 | head -1), $(nproc) CPUs"
if [ -z "$only" ] || [ "$only" = convergence ]; then
  for n in $nodes_list; do convergence "$n"; done
fi
if [ -z "$only" ] || [ "$only" = memory ]; then memory; fi
if [ -z "$only" ] || [ "$only" = traffic ]; then traffic; fi

echo "== summary"
python3 - "$results" <<'PY'
import statistics, sys
conv, mem, tr = {}, None, {}
for line in open(sys.argv[1]):
    f = line.split()
    if f[0] == "conv":
        conv.setdefault(int(f[1]), []).append((float(f[2]), float(f[3])))
    elif f[0] == "mem":
        mem = [float(x) for x in f[1:]]
    elif f[0] == "traffic":
        tr.setdefault((f[1], f[2]), []).append((float(f[3]), float(f[4])))
rows = []
def verdict(ok):
    return "PASS" if ok else "MISS"
for n, rs in sorted(conv.items()):
    for i, what in ((0, "up"), (1, "withdraw")):
        v = [r[i] for r in rs]
        med, mx = statistics.median(v), max(v)
        target = "max < 1000 ms" if n >= 100 else "-"
        rows.append((f"convergence N={n} {what}", f"median {med:.0f} ms, max {mx:.0f} ms",
                     target, verdict(mx < 1000) if n >= 100 else "-"))
if mem:
    arss, ahwm, brss, bhwm, acpu, bcpu = mem
    rows.append(("agent RSS, 100 peers", f"{arss:.1f} MB (peak {ahwm:.1f})", "peak < 30 MB", verdict(ahwm < 30)))
    rows.append(("BIRD RSS, 100 peers", f"{brss:.1f} MB (peak {bhwm:.1f})", "-", "-"))
    rows.append(("agent + BIRD RSS", f"{arss + brss:.1f} MB (peak {ahwm + bhwm:.1f})", "-", "-"))
    rows.append(("CPU, steady state", f"agent {acpu:.2f} %, BIRD {bcpu:.2f} %", "-", "-"))
for regime in ("idle", "busy"):
    if ("bgp", regime) in tr and ("static", regime) in tr:
        # The median of the rounds' p50s and throughputs.
        med = lambda v, i: statistics.median(x[i] for x in v)
        b = (med(tr[("bgp", regime)], 0), med(tr[("bgp", regime)], 1))
        s = (med(tr[("static", regime)], 0), med(tr[("static", regime)], 1))
        rows.append((f"pod-pod p50 bgp/static ({regime})", f"{b[0]:.1f}/{s[0]:.1f} us = {b[0] / s[0]:.2f}",
                     "<= 1.05", verdict(b[0] / s[0] <= 1.05)))
        rows.append((f"pod-pod tput bgp/static ({regime})", f"{b[1]:.2f}/{s[1]:.2f} Gbit/s = {b[1] / s[1]:.2f}",
                     ">= 0.95", verdict(b[1] / s[1] >= 0.95)))
w = [max(len(r[i]) for r in rows) for i in range(4)] if rows else [0] * 4
hdr = ("figure", "measured", "target", "")
w = [max(w[i], len(hdr[i])) for i in range(4)]
for r in [hdr] + rows:
    print("  " + "  ".join(r[i].ljust(w[i]) for i in range(4)).rstrip())
PY
