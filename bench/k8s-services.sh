#!/usr/bin/env bash
# Services without kube-proxy (issue 51) against kube-proxy from the same
# release in its iptables and nftables modes, side by side on one lab node:
# connect() to a ClusterIP from a pod (p50, p99, idle and busy) and
# connections per second at each number of Services, with the backend
# pod's own address as the baseline; the time from an EndpointSlice written
# to the first connection through it; kube-proxy's and rcni-node's memory;
# at the first size, round trip and throughput through a ClusterIP against
# the backend pod's own address.
# bench/k8s_services.py says how each is taken.
#
# Usage: bench/k8s-services.sh [--sizes 100,1000,10000,30000]
#          [--proxies rcni,iptables,nftables] [--endpoints N] [--probes N]
#          [--passes N] [--changes N] [--cps-seconds S] [--dp-rounds N]
#          [--rr N] [--dp-seconds S] [--out FILE]
# Results in --out (default target/bench-k8s-services.json) and a table
# with rcni's ratio to each mode. Builds what is missing first
# (scripts/k8s-build, k8s-images, rcni's image by scripts/image). Needs
# root; about 25 min at the default sizes once built.
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "k8s-services: $*" >&2; exit 2; }
out=$PWD/target/bench-k8s-services.json
pass=()
while (($#)); do
  case $1 in
    --sizes|--proxies|--endpoints|--probes|--passes|--changes|--cps-seconds|--dp-rounds|--rr|--dp-seconds) pass+=("$1" "${2:?}"); shift 2 ;;
    --out) out=$(realpath -m "${2:?}"); shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) die "unknown argument $1" ;;
  esac
done
[[ $(id -u) == 0 ]] || die "the lab makes namespaces, cgroups and mounts: run it as root"
command -v go >/dev/null || export PATH=$PATH:/usr/local/go/bin
for t in nsenter taskset python3 nft iperf3; do
  command -v "$t" >/dev/null || die "$t is not installed (scripts/setup --for test installs it)"
done
scripts/k8s-build >/dev/null
scripts/k8s-images >/dev/null
bin=$(scripts/k8s-build --print-dir)
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
case "$(uname -m)" in x86_64) arch=amd64 ;; aarch64) arch=arm64 ;; *) arch=$(uname -m) ;; esac
image=${RCNI_IMAGE:-$PWD/target/dist/rcni-image-$arch-$version.tar}
[[ -f $image ]] || scripts/image --out "$image"
cargo build --quiet -p rcni-integration --example rcni-k8s-lab
mkdir -p "$(dirname "$out")"
conf=$(mktemp); trap 'rm -f "$conf"' EXIT
printf '{"network": "10.244.0.0/16", "backend": "vxlan", "kubeProxyReplacement": true}\n' >"$conf"
RCNI_KUBE_PROXY=$bin/kube-proxy "$PWD/target/debug/examples/rcni-k8s-lab" --nodes 1 \
  --network rcni --image "$image" --net-conf "$conf" --no-kube-proxy -- \
  env RCNI_KUBE_PROXY="$bin/kube-proxy" python3 "$PWD/bench/k8s_services.py" --out "$out" "${pass[@]}"
