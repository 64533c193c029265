#!/usr/bin/env bash
# What the policy plugin's eBPF programs cost per round trip under a real
# Kubernetes (the DaemonSet's defaults: vxlan and policy), with a
# NetworkPolicy in a namespace of its own that selects neither pod (without
# one the programs are not on the veths at all), side by side in one lab:
# a pod on node 1 to a pod on node 2, TCP request/response p50
# (bench/rr.py) with the programs on the two pods' host veths and with them
# taken off by hand, alternating round by round (bench/k8s_hooks.py). It measures the part of rcni's round trip against
# flannel's (bench/k8s-flannel.sh) that the programs account for.
#
# Usage: bench/k8s-hooks.sh [--rounds N] [--rr N] [--nodes N]
# Builds what is missing first (scripts/k8s-build, k8s-images, rcni's image
# by scripts/image). Needs root; about 5 min once built.
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "k8s-hooks: $*" >&2; exit 2; }
rounds=6 rr=5000 nodes=3
while (($#)); do
  case $1 in
    --rounds) rounds=${2:?}; shift 2 ;;
    --rr) rr=${2:?}; shift 2 ;;
    --nodes) nodes=${2:?}; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) die "unknown argument $1" ;;
  esac
done
[[ $(id -u) == 0 ]] || die "the lab makes namespaces, cgroups and mounts: run it as root"
((nodes >= 2)) || die "--nodes: at least 2 (the pods go on two nodes)"
command -v go >/dev/null || export PATH=$PATH:/usr/local/go/bin
for t in nsenter taskset python3 tc; do
  command -v "$t" >/dev/null || die "$t is not installed (scripts/setup --for test installs it)"
done
scripts/k8s-build >/dev/null
scripts/k8s-images >/dev/null
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
case "$(uname -m)" in x86_64) arch=amd64 ;; aarch64) arch=arm64 ;; *) arch=$(uname -m) ;; esac
image=${RCNI_IMAGE:-$PWD/target/dist/rcni-image-$arch-$version.tar}
[[ -f $image ]] || scripts/image --out "$image"
cargo build --quiet -p rcni-integration --example rcni-k8s-lab
exec "$PWD/target/debug/examples/rcni-k8s-lab" --nodes "$nodes" --network rcni --image "$image" -- \
  python3 "$PWD/bench/k8s_hooks.py" --rounds "$rounds" --rr "$rr"
