#!/usr/bin/env bash
# Soak (issue 20): ADD/DEL cycles of the full chain (bridge + host-local,
# portmap, firewall, tuning, bandwidth, fastpath, policy) through cnitool,
# N at a time, with the dhcp daemon serving a second network (one cycle in
# --dhcp-every also cycles a pod there) and the rcni-node agent running on
# a cluster file in a namespace of its own. Prints the daemon's and the
# agent's RSS and open fds and the processes in the run's namespaces
# (detached helpers included) at the start, every tenth and the end; then
# every failed command and what the nodes hold that they did not before.
# Runs what scripts/install ships, everything in namespaces soakbench
# creates; exits 1 on a failure or a leftover.
# Usage: bench/soak.sh [--cycles 10000] [--concurrent 20] [--dhcp-every 5]
#                      [--agent-nodes 100]
set -euo pipefail
cd "$(dirname "$0")/.."
# BENCH_BIN=DIR benchmarks the plugins in DIR instead (see bench/lib.sh).
. bench/lib.sh
bench_bin
host=$(rustc -vV | sed -n 's/^host: //p')
exec "target/$host/release/soakbench" --bins "$bin" "$@"
