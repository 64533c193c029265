# Shared by the bench scripts (sourced from the repository root).

# The plugins keep the iptables probe's answer for the boot in
# /run/rcni/probe; benchmarked plugins keep theirs under target/, off the host.
export RCNI_PROBE_DIR=${RCNI_PROBE_DIR:-$PWD/target/tmp/probe}

# Sets $bin to the plugins to benchmark: the static release build that
# scripts/install ships (installed into target/bench-bin), or BENCH_BIN=DIR
# for an earlier build's plugins (a before/after table; the drivers still
# come from this build, built once if missing).
bench_bin() {
  bin=${BENCH_BIN:-target/bench-bin}
  if [ -z "${BENCH_BIN:-}" ]; then
    scripts/install --bin-dir "$bin" >/dev/null
  else
    local host
    host=$(rustc -vV | sed -n 's/^host: //p')
    [ -x "target/$host/release/cnitool" ] || scripts/install --bin-dir target/bench-bin >/dev/null
  fi
}
