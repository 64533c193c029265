#!/usr/bin/env bash
# The kill test at scale (issue 21): ADD killed with SIGKILL to its whole
# process group at a moment drawn uniformly over a normal ADD's length, then
# DEL and GC as a runtime runs them, for host-local alone and the podman
# chain (bridge + host-local, portmap, firewall, tuning) on the nftables and
# the iptables backends. Prints, per setup, the kills by phase (what was
# running), leftovers by kind (reservations, empty ones apart, links, rules,
# tuning backups, cached results) and every failed DEL or GC with its CNI
# error and stderr. Goal: 0 leftovers and 0 failures in 1000 trials.
# Runs what scripts/install ships (the static release build), everything
# inside namespaces chaosbench creates; exits 1 if anything was left.
# chain-mixed is the chain as issue 21 ran it (masquerading on iptables,
# portmap and firewall on nftables). --libcni CLIENT runs ADD and DEL with
# cnitool-tests' Go libcni client instead of cnitool (build it with
# `cargo nextest run -p rcni-cnitool-tests --test loopback` or `go build` in
# cnitool-tests/go/libcni-client): libcni's non-atomic cache write is where
# issue 21's failed DEL comes from (about 1 in 1000 trials).
# --plugins all (or a list) kills each plugin inside a full chain instead
# (bridge/ptp/host-device/vlan + host-local or bridge + dhcp, portmap,
# firewall, tuning, bandwidth, and fastpath + policy with the bridge;
# multinet delegating to that chain): its ADD and, separately, its DEL,
# at a moment uniform over that plugin's own run in the command
# (calibrated first), then DEL again and GC; also counted: qdiscs, BPF pins
# and map entries, policy and multinet state, dhcp leases (daemon and
# server), node links gone. vlan needs 802.1q (skipped where missing: run
# it in the VM). Plugins run --jobs at a time, each in namespaces of its
# own; --minutes stops every plugin's trials at a deadline (exact counts).
# Usage: bench/chaos.sh [-n TRIALS] [--setups host-local,chain-nftables,chain-iptables,chain-mixed]
#                       [--seed S] [--libcni CLIENT]
#        bench/chaos.sh --plugins all [--kill add,del] [-n 1000] [--jobs 4] [--minutes M]
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -n|--trials) args+=(--trials "$2"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
# BENCH_BIN=DIR benchmarks the plugins in DIR instead (see bench/lib.sh).
. bench/lib.sh
bench_bin
host=$(rustc -vV | sed -n 's/^host: //p')
exec "target/$host/release/chaosbench" --bins "$bin" "${args[@]}"
