#!/usr/bin/env bash
# Hardware counters for our kernels on the main workload (or SHAPE=batch,length,channels), both
# layouts: time, DRAM, L2, L1 and SM throughput, L2 hit rate, issue activity, active warps,
# registers, instructions and grid size per kernel, as ncu's CSV (one row per kernel and metric)
# in DIR/ncu_BLD.csv and DIR/ncu_BDL.csv; then each kernel's time and grid, one line per launch.
#   scripts/ncu_main.sh DIR
#   SHAPE=8,2048,256 scripts/ncu_main.sh DIR
#   WIDTH=8 LAYOUTS=BDL scripts/ncu_main.sh DIR  # K = 8 (bf16 K = 7-8 channel-first: the
#                                                # tensor-core backward in long rows)
#   LAYOUTS=BDL STALLS=1 scripts/ncu_main.sh DIR
#   UPDATE=1 STALLS=1 scripts/ncu_main.sh DIR   # the decode step (B=256 D=8192 unless SHAPE)
#   FEATURES=1 LAYOUTS=BDL scripts/ncu_main.sh DIR  # with seq_idx (4 packed sequences a row) and
#                                                     # states: bench.py's features case
#   FEATURES=1 SEQUENCES=1 ...  # SEQUENCES packed sequences a row instead (1: no boundary;
#                               # 0: the states without seq_idx)
#   EXTRA_METRICS=lts__t_sectors_srcunit_tex_op_read.sum,... scripts/ncu_main.sh DIR  # more
#       metrics in the CSV (the summary below prints the usual ones)
#   CACHE=none SHAPE=8,2048,256 scripts/ncu_main.sh DIR  # keep the caches between replays: ncu
#       flushes them by default, where the traces' back-to-back calls at D = 256 (three 8 MB
#       tensors against 50 MB of L2) may find their operands in the L2 (the summary's l2 hit %)
# KERNELS (a regex) sets the filter; '.' also profiles every kernel JAX runs while starting and
# compiling, and did not finish the first layout in 200 s (tests/GPU.md, eighth session). Even a
# narrow filter takes minutes to reach our kernels (one layout, two kernels: about 3 minutes in
# the tenth session; still starting after 136 s in the ninth): give it a device call of its own.
# STALLS=1 adds each stall reason's warps per issued instruction (what the warps wait on), and
# the summary names the four largest per launch.
# SOURCE=1 instead samples where in the SASS the warps wait: the first LAUNCHES (default 1)
# launches that match KERNELS are profiled with ncu's SourceCounters and WarpStateStats sections
# into DIR/ncu_<layout>_source.ncu-rep, whose source page (per SASS instruction: executions and warp
# stall samples) goes to DIR/ncu_<layout>_source.csv; the summary lists the instructions with the
# most samples, TOP of them (default 40), with the running share of all samples, then the samples
# by how many times their instructions ran (a step loop's lines share one count; the forty-sixth
# session's D = 256 backward: 50-57% on its loop, 38-44% on lines run once a warp). The page
# held each launch's table twice, and LAUNCHES=10 gave two launches' tables (forty-sixth session).
#   CACHE=none SHAPE=8,2048,256 LAYOUTS=BLD KERNELS=backward_channel_last SOURCE=1 \
#     scripts/ncu_main.sh DIR
set -uo pipefail
out=${1:?usage: scripts/ncu_main.sh DIR}
mkdir -p "$out"
if [[ ${UPDATE:-0} == 1 ]]; then
  shape=${SHAPE:-256,1,8192}
  kernels=${KERNELS:-update}
  mode=(--update)
else
  shape=${SHAPE:-8,2048,4096}
  kernels=${KERNELS:-channel|reduce|short_rows}
  mode=()
  [[ ${FEATURES:-0} == 1 ]] && mode=(--features --sequences "${SEQUENCES:-4}")
fi
metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active
metrics+=,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,smsp__inst_executed.sum
metrics+=,launch__grid_size,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct
metrics+=,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_active
[[ -n ${EXTRA_METRICS:-} ]] && metrics+=,$EXTRA_METRICS
if [[ ${STALLS:-0} == 1 ]]; then
  for reason in barrier branch_resolving dispatch_stall drain imc_miss lg_throttle long_scoreboard \
      math_pipe_throttle membar mio_throttle misc no_instruction not_selected selected \
      short_scoreboard sleeping tex_throttle wait; do
    metrics+=,smsp__average_warps_issue_stalled_${reason}_per_issue_active.ratio
  done
fi
profiled=(python3 benchmarks/profile_kernels.py "${mode[@]}" --shape "$shape" --width "${WIDTH:-4}")
if [[ ${SOURCE:-0} == 1 ]]; then
  for layout in ${LAYOUTS:-BLD BDL}; do
    rep="$out/ncu_${layout}_source"
    ncu --clock-control none --cache-control "${CACHE:-all}" --kernel-name regex:"$kernels" \
      --launch-count "${LAUNCHES:-1}" --section SourceCounters --section WarpStateStats -f -o "$rep" \
      "${profiled[@]}" --layout "$layout" >"$rep.log" 2>&1
    echo "ncu $layout $shape K=${WIDTH:-4} (source): exit $?"
    ncu --import "$rep.ncu-rep" --page source --print-source sass --csv >"$rep.csv" 2>"$rep.import.log"
    echo "ncu source page: exit $? ($(wc -l <"$rep.csv") lines)"
    python3 - "$rep.csv" "${TOP:-40}" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
top = int(sys.argv[2])
# The page's header row names the columns; a kernel's rows follow it (ncu writes one table a
# profiled kernel, each after a line naming the kernel). Columns are found by name, not place.
tables, name = [], "?"
for r in rows:
    if any("Address" == c.strip('" ') for c in r):
        head = r
        tables.append((name, head, []))
    elif r[0].strip() == "Kernel Name" or len(r) == 1:
        name = next((c for c in reversed(r) if c.strip()), "?")
    elif tables and len(r) == len(tables[-1][1]):
        tables[-1][2].append(r)
def column(head, *words):
    for i, c in enumerate(head):
        if all(w.lower() in c.lower() for w in words):
            return i
    return None
if not tables:
    print("  no table with an Address column; the page's first lines:")
    for r in rows[:5]:
        print("   ", ",".join(r)[:160])
for name, head, body in tables:
    source, samples = column(head, "Source"), column(head, "Stall Sampling", "All")
    address, executed = column(head, "Address"), column(head, "Instructions Executed")
    if source is None or samples is None:
        print(f"  {name[:80]}: no source or stall-sample column in {head}")
        continue
    value = lambda r, i: float(r[i].replace(",", "") or 0) if i is not None else 0.0
    total = sum(value(r, samples) for r in body) or 1.0
    print(f"  {name[:80]}: {len(body)} instructions, {total:.0f} stall samples")
    share = 0.0
    for r in sorted(body, key=lambda r: -value(r, samples))[:top]:
        share += value(r, samples) / total
        print(f"    {r[address]:>8} {value(r, samples):8.0f} {share:6.1%}"
              f"  x{value(r, executed):<10.0f} {r[source][:70]}")
    # By how often an instruction ran: a loop's lines share a count (its trips times the warps),
    # a prologue's run once a warp; where the waits are, without a listing at hand.
    by_count = {}
    for r in body:
        entry = by_count.setdefault(value(r, executed), [0, 0.0])
        entry[0] += 1
        entry[1] += value(r, samples)
    print("    samples by executions: " + ", ".join(
        f"x{count:.0f} ({lines} lines) {s / total:.1%}"
        for count, (lines, s) in sorted(by_count.items(), key=lambda item: -item[1][1])[:6]))
PY
  done
  exit 0
fi
for layout in ${LAYOUTS:-BLD BDL}; do
  csv="$out/ncu_$layout.csv"
  ncu --clock-control none --cache-control "${CACHE:-all}" --kernel-name regex:"$kernels" --metrics "$metrics" --csv \
    "${profiled[@]}" --layout "$layout" >"$csv" 2>"$out/ncu_$layout.log"
  echo "ncu $layout $shape K=${WIDTH:-4}: exit $? ($(grep -c '^"' "$csv") rows)"
  python3 - "$csv" <<'PY'
import csv, re, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, rows = rows[0], rows[1:]
col = {name: head.index(name) for name in ("ID", "Kernel Name", "Metric Name", "Metric Value")}
unit_col = head.index("Metric Unit") if "Metric Unit" in head else None
launches, units = {}, {}  # units: the DRAM bytes come in the unit ncu picks (Kbyte, Mbyte, ...)
for r in rows:
    launch = launches.setdefault(r[col["ID"]], {"name": r[col["Kernel Name"]]})
    launch[r[col["Metric Name"]]] = r[col["Metric Value"]]
    if unit_col is not None:
        units[r[col["Metric Name"]]] = r[unit_col]
for launch_id, m in sorted(launches.items(), key=lambda item: int(item[0])):
    name = m["name"].replace("(anonymous namespace)::", "").removeprefix("void ").split("(")[0].removeprefix("causal_conv::")[:60]
    print(f"  {launch_id:>4} {name:60} {m.get('gpu__time_duration.sum', '?'):>9} ns  grid {m.get('launch__grid_size', '?'):>7}"
          f"  dram {m.get('dram__throughput.avg.pct_of_peak_sustained_elapsed', '?'):>6}%"
          f"  l2 hit {m.get('lts__t_sector_hit_rate.pct', '?')}%"
          f"  l2 {m.get('lts__throughput.avg.pct_of_peak_sustained_elapsed', '?')}%"
          f"  l1 {m.get('l1tex__throughput.avg.pct_of_peak_sustained_active', '?')}%"
          f"  regs {m.get('launch__registers_per_thread', '?')}"
          f"  dram read {m.get('dram__bytes_read.sum', '?')} {units.get('dram__bytes_read.sum', '')}"
          f" write {m.get('dram__bytes_write.sum', '?')} {units.get('dram__bytes_write.sum', '')}")
    stalls = {k.split("stalled_")[1].split("_per_issue")[0]: float(v.replace(",", ""))
              for k, v in m.items() if "_issue_stalled_" in k}
    if stalls:
        top = sorted(stalls.items(), key=lambda item: -item[1])[:4]
        print("       stalls per issue: " + ", ".join(f"{reason} {v:.2f}" for reason, v in top))
PY
done
