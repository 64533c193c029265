#!/usr/bin/env bash
# rcni against flannel under a real Kubernetes, side by side in one run:
# two labs at once (integration/src/lab/k8s.rs: Kubernetes v1.37.2 from its
# Go modules, 3 nodes each with containerd, kubelet and kube-proxy), one
# with flannel as its users install it (kube-flannel.yml of the release
# testing/flannel pins, vxlan, delegating to the reference's bridge and
# host-local), one with rcni as its users install it (deploy/rcni.yaml as it
# is: vxlan and policy). They take turns, round by round, so the machine's
# drift falls on both alike, and who goes first turns round by round. On
# each (bench/k8s_net.py):
#   startup  a Deployment of N pause pods (default 30) from `kubectl apply`
#            to N Ready, --rounds times (default 3; the median is compared)
#   rr       pod to pod across nodes, TCP request/response p50 (bench/rr.py)
#   gbit     the same pods, single-stream iperf3
# rr and gbit --dp-rounds times (default 3; the medians are compared), in
# both regimes: idle (each round trip wakes an idle CPU, which hides the
# datapath's cost) and busy (client and server on one CPU). During each rr
# and gbit round every lab process (control planes, kubelets, containerd,
# agents, pods) is stopped and resumed after, unless --no-freeze: the
# packets need none of them, and three clusters' housekeeping on 2 cores
# spread one network's rounds wider than the gap between the networks.
# Prints a table and rcni/flannel ratios; targets: startup and rr ratios
# <= 1.0, gbit ratio >= 1.0 ("at least flannel's speed on each").
#
# Usage: bench/k8s-flannel.sh [--pods N] [--rounds N] [--dp-rounds N] [--seconds N] [--rr N]
#                             [--regime idle|busy|both] [--nodes N] [--out DIR] [--ebpf]
#                             [--no-freeze]
# --ebpf: a third lab, rcni with the net-conf's "ebpf": true (eBPF
# cross-node forwarding; the manifest's option, off by default), in the
# same turns.
# Builds what is missing first (scripts/k8s-build, k8s-images,
# flannel-build, upstream-plugins, rcni's image by scripts/image). Needs
# root; about 10 min once built. Results (JSON per network, the labs' logs)
# in --out (default target/bench-k8s-flannel).
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "k8s-flannel: $*" >&2; exit 2; }
pods=30 rounds=3 dp_rounds=3 secs=5 rr=5000 regime=both nodes=3 out=$PWD/target/bench-k8s-flannel
freeze=(--freeze)
nets=(flannel rcni)
while (($#)); do
  case $1 in
    --pods) pods=${2:?}; shift 2 ;;
    --rounds) rounds=${2:?}; shift 2 ;;
    --dp-rounds) dp_rounds=${2:?}; shift 2 ;;
    --seconds) secs=${2:?}; shift 2 ;;
    --rr) rr=${2:?}; shift 2 ;;
    --regime) regime=${2:?}; shift 2 ;;
    --nodes) nodes=${2:?}; shift 2 ;;
    --out) out=${2:?}; shift 2 ;;
    --ebpf) nets+=(rcni-ebpf); shift ;;
    --no-freeze) freeze=(); shift ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) die "unknown argument $1" ;;
  esac
done
[[ $(id -u) == 0 ]] || die "the lab makes namespaces, cgroups and mounts: run it as root"
((nodes >= 2)) || die "--nodes: at least 2 (the datapath figures go across nodes)"
command -v go >/dev/null || export PATH=$PATH:/usr/local/go/bin
for t in iperf3 nsenter taskset python3; do
  command -v "$t" >/dev/null || die "$t is not installed (scripts/setup --for test installs it)"
done

scripts/k8s-build >/dev/null
scripts/k8s-images >/dev/null
flannel=$(scripts/flannel-build)
ref=$(scripts/upstream-plugins)
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
case "$(uname -m)" in x86_64) arch=amd64 ;; aarch64) arch=arm64 ;; *) arch=$(uname -m) ;; esac
image=${RCNI_IMAGE:-$PWD/target/dist/rcni-image-$arch-$version.tar}
[[ -f $image ]] || scripts/image --out "$image"
cargo build --quiet -p rcni-integration --example rcni-k8s-lab
lab=$PWD/target/debug/examples/rcni-k8s-lab

rm -rf "$out"; mkdir -p "$out/turns"
# Both labs at once, taking turns round by round (bench/k8s_net.py says
# why); a lab that fails stops the other.
pids=()
order=$(IFS=,; echo "${nets[*]}")
for net in "${nets[@]}"; do
  case $net in
    flannel) args=(--network flannel --flannel "$flannel" --reference-bin "$ref") ;;
    rcni) args=(--network rcni --image "$image") ;;
    rcni-ebpf)
      printf '{"network": "10.244.0.0/16", "backend": "vxlan", "ebpf": true}\n' >"$out/ebpf-net-conf.json"
      args=(--network rcni --image "$image" --net-conf "$out/ebpf-net-conf.json") ;;
  esac
  echo "k8s-flannel: $net ($nodes nodes), log $out/$net.log" >&2
  "$lab" --nodes "$nodes" "${args[@]}" --keep-logs "$out/logs-$net" -- \
    python3 "$PWD/bench/k8s_net.py" --out "$out/$net.json" --pods "$pods" --rounds "$rounds" \
      --seconds "$secs" --rr "$rr" --dp-rounds "$dp_rounds" --regime "$regime" \
      --turns "$out/turns" --me "$net" --order "$order" "${freeze[@]}" >"$out/$net.log" 2>&1 &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
for _ in "${pids[@]}"; do
  if ! wait -n "${pids[@]}"; then
    kill "${pids[@]}" 2>/dev/null || true
    wait || true
    tail -n 20 "$out"/*.log >&2
    die "a lab failed (logs above and in $out/logs-*)"
  fi
done
trap - EXIT
for net in "${nets[@]}"; do grep -h '^  ' "$out/$net.log" | sed "s/^/$net/" >&2 || true; done

python3 - "$out" "$pods" "${nets[@]}" <<'PY'
import json, sys
out, pods, nets = sys.argv[1], sys.argv[2], sys.argv[3:]
r = {n: json.load(open(f"{out}/{n}.json")) for n in nets}
f = r["flannel"]
others = nets[1:]
print(f"\n{'':28s} {'flannel':>10s}" + "".join(f" {n:>10s} {n + '/flannel':>18s}" for n in others))
def row(name, get, unit, target):
    a = get(f)
    line = f"{name:28s} {a:10.2f}"
    verdicts = []
    for n in others:
        b = get(r[n]); ratio = b / a
        ok = ratio <= 1.0 if target == "<=" else ratio >= 1.0
        line += f" {b:10.2f} {ratio:18.2f}"
        verdicts.append(f"{n} {'met' if ok else 'NOT met'}")
    print(f"{line}  ({unit}; target {target} 1.0: {', '.join(verdicts)})")
row(f"{pods} pods to Ready, median", lambda x: x["startup_median_s"], "s", "<=")
for regime in f["datapath"]:
    row(f"rr p50, {regime}", lambda x: x["datapath"][regime]["rr_p50_us"], "us", "<=")
    row(f"throughput, {regime}", lambda x: x["datapath"][regime]["gbit"], "Gbit/s", ">=")
print()
for n in nets:
    print(f"{n}: startup rounds (s) {sorted(round(t, 2) for t in r[n]['startup_s'])}")
    for regime, v in r[n]["datapath"].items():
        print(f"{n}: {regime} rr p50 rounds (us) {sorted(x['rr_p50_us'] for x in v['rounds'])}, "
              f"Gbit/s {sorted(round(x['gbit'], 2) for x in v['rounds'])}")
PY
