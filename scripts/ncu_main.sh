#!/usr/bin/env bash
# Hardware counters for our kernels on the main workload (both layouts), one line per kernel:
# time, DRAM and SM throughput, issue activity, active warps, registers, instructions.
#   scripts/ncu_main.sh > ncu.csv
set -uo pipefail
metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active
metrics+=,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,smsp__inst_executed.sum
for layout in BLD BDL; do
  ncu --clock-control none --kernel-name regex:"channel|reduce" --metrics "$metrics" --csv \
    python3 benchmarks/profile_kernels.py --layout "$layout" 2>/dev/null | grep -E '^"' |
    awk -v layout="$layout" -F'","' 'NR == 1 {next} {gsub(/"/, ""); split($5, k, "<"); print layout "," k[1] "," $(NF-2) "," $NF}'
done
