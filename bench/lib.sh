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

# Sets $ref to upstream's v1.9.1 plugins where RCNI_REFERENCE_V191 (a
# directory, or the release tarball) or the tarball the project's CI keeps
# beside the checkout gives them (unpacked once into
# target/reference-v1.9.1), else empty: a user's clone has neither.
reference_v191() {
  local src=${RCNI_REFERENCE_V191:-../shared/reference/cni-plugins-v1.9.1.tgz}
  ref=
  if [ -d "$src" ]; then
    ref=$src
  elif [ -f "$src" ]; then
    mkdir -p target/reference-v1.9.1
    [ -x target/reference-v1.9.1/bridge ] || tar -C target/reference-v1.9.1 -xzf "$src"
    ref=target/reference-v1.9.1
  fi
}
