#!/usr/bin/env bash
# Hardware counters for our kernels on the main workload, both layouts: time, DRAM and SM
# throughput, issue activity, active warps, registers and instructions per kernel, as ncu's CSV
# (one row per kernel and metric) in DIR/ncu_BLD.csv and DIR/ncu_BDL.csv.
#   scripts/ncu_main.sh DIR
set -uo pipefail
out=${1:?usage: scripts/ncu_main.sh DIR}
metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active
metrics+=,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,smsp__inst_executed.sum
for layout in BLD BDL; do
  ncu --clock-control none --kernel-name regex:"channel|reduce" --metrics "$metrics" --csv \
    python3 benchmarks/profile_kernels.py --layout "$layout" >"$out/ncu_$layout.csv" 2>"$out/ncu_$layout.log"
  echo "ncu $layout: exit $? ($(grep -c '^"' "$out/ncu_$layout.csv") rows)"
done
