#!/usr/bin/env bash
# rcni against flannel under a real Kubernetes, side by side in one run: the
# same lab (integration/src/lab/k8s.rs: Kubernetes v1.37.2 from its Go
# modules, 3 nodes with containerd, kubelet and kube-proxy), made once with
# flannel as its users install it (kube-flannel.yml of the release
# testing/flannel pins, vxlan, delegating to the reference's bridge and
# host-local) and once with rcni as its users install it (deploy/rcni.yaml
# as it is: vxlan and policy). On each (bench/k8s_net.py):
#   startup  a Deployment of N pause pods (default 30) from `kubectl apply`
#            to N Ready, --rounds times (the median is compared)
#   rr       pod to pod across nodes, TCP request/response p50 (bench/rr.py)
#   gbit     the same pods, single-stream iperf3
# rr and gbit --dp-rounds times (default 3; the medians are compared), in
# both regimes: idle (each round trip wakes an idle CPU,
# which hides the datapath's cost) and busy (client and server on one CPU).
# Prints a table and rcni/flannel ratios; targets: startup and rr ratios
# <= 1.0, gbit ratio >= 1.0 ("at least flannel's speed on each").
#
# Usage: bench/k8s-flannel.sh [--pods N] [--rounds N] [--dp-rounds N] [--seconds N] [--rr N]
#                             [--regime idle|busy|both] [--nodes N] [--out DIR]
# Builds what is missing first (scripts/k8s-build, k8s-images,
# flannel-build, upstream-plugins, rcni's image by scripts/image). Needs
# root; about 10 min once built. Results (JSON per network, the labs' logs)
# in --out (default target/bench-k8s-flannel).
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "k8s-flannel: $*" >&2; exit 2; }
pods=30 rounds=3 dp_rounds=3 secs=5 rr=5000 regime=both nodes=3 out=$PWD/target/bench-k8s-flannel
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

rm -rf "$out"; mkdir -p "$out"
for net in flannel rcni; do
  case $net in
    flannel) args=(--network flannel --flannel "$flannel" --reference-bin "$ref") ;;
    rcni) args=(--network rcni --image "$image") ;;
  esac
  echo "k8s-flannel: $net ($nodes nodes)" >&2
  "$lab" --nodes "$nodes" "${args[@]}" --keep-logs "$out/logs-$net" -- \
    python3 "$PWD/bench/k8s_net.py" --out "$out/$net.json" --pods "$pods" --rounds "$rounds" \
      --seconds "$secs" --rr "$rr" --dp-rounds "$dp_rounds" --regime "$regime" ||
    die "the $net run failed (logs in $out/logs-$net)"
done

python3 - "$out" "$pods" <<'PY'
import json, sys
out, pods = sys.argv[1], sys.argv[2]
r = {n: json.load(open(f"{out}/{n}.json")) for n in ("flannel", "rcni")}
f, c = r["flannel"], r["rcni"]
print(f"\n{'':28s} {'flannel':>10s} {'rcni':>10s} {'rcni/flannel':>13s}")
def row(name, a, b, unit, target):
    ratio = b / a
    ok = ratio <= 1.0 if target == "<=" else ratio >= 1.0
    print(f"{name:28s} {a:10.2f} {b:10.2f} {ratio:13.2f}  ({unit}; target {target} 1.0: {'met' if ok else 'NOT met'})")
row(f"{pods} pods to Ready, median", f["startup_median_s"], c["startup_median_s"], "s", "<=")
for regime in f["datapath"]:
    a, b = f["datapath"][regime], c["datapath"][regime]
    row(f"rr p50, {regime}", a["rr_p50_us"], b["rr_p50_us"], "us", "<=")
    row(f"throughput, {regime}", a["gbit"], b["gbit"], "Gbit/s", ">=")
print(f"\nstartup rounds (s): flannel {['%.2f' % t for t in f['startup_s']]}, rcni {['%.2f' % t for t in c['startup_s']]}")
PY
