#!/usr/bin/env bash
# The long fuzz run (issue 20 item 4): every plugin binary, every command,
# fed mutated conf/ configs and CNI_* environments by
# integration/tests/fuzz_binaries.rs, many more inputs than CI's bounded run
# (RCNI_FUZZ_ITERS=16). Any exit other than 0, or 1 with CNI error JSON, any
# code 100 (a panic) and any run over 10 s is a failure, printed with its
# input; keep crashers as regression inputs in that test.
# Usage: bench/fuzz.sh [-n ITERS_PER_PLUGIN_AND_COMMAND] [--seed S] [--plugin NAME]
set -euo pipefail
cd "$(dirname "$0")/.."
# RCNI_PROBE_DIR under target/ (and the helpers the bench scripts share).
. bench/lib.sh
iters=500
seed=$(date +%s)
while [ $# -gt 0 ]; do
  case "$1" in
    -n) iters="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --plugin) export RCNI_FUZZ_PLUGIN="$2"; shift 2 ;;
    *) echo "usage: $0 [-n ITERS] [--seed S] [--plugin NAME]" >&2; exit 2 ;;
  esac
done
echo "fuzz: $iters inputs per plugin and command, seed $seed" >&2
nice -n 10 cargo build --workspace --bins
RCNI_FUZZ_ITERS="$iters" RCNI_FUZZ_SEED="$seed" \
  cargo test -p rcni-integration --test fuzz_binaries -- --nocapture
