#!/usr/bin/env bash
# Runs scripts/racecheck_cluster_probe.cu's four modes under compute-sanitizer's racecheck, one
# process each, and prints each mode's hazard summary: whether racecheck sees races on another
# block's stores into a cluster leader's shared memory (the .cu says why that matters). On a GPU
# machine (compute capability 9.0), from the repository root; FFI_INCLUDE_DIR is the XLA FFI
# headers' folder (`python3 scripts/ffi_headers.py DIR`; default jax.ffi.include_dir()).
set -uo pipefail
include=${FFI_INCLUDE_DIR:-$(python3 -c 'import jax; print(jax.ffi.include_dir())')}
binary=${TMPDIR:-/tmp}/racecheck_cluster_probe
nvcc -std=c++17 -arch=sm_90 -O3 -lineinfo -Icuda -I"$include" scripts/racecheck_cluster_probe.cu \
  -o "$binary" >"$binary.build.log" 2>&1 || { tail -20 "$binary.build.log"; exit 1; }
for mode in same-block remote-store no-wait protocol; do
  "$binary" "$mode"
  compute-sanitizer --tool racecheck "$binary" "$mode" >"$binary.$mode.log" 2>&1
  echo "  racecheck (exit $?): $(grep -m1 'RACECHECK SUMMARY' "$binary.$mode.log")"
done
