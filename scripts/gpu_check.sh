#!/usr/bin/env bash
# One call on a GPU machine: build from source, run the GPU-marked tests and the examples, and
# (optionally) the benchmark and compute-sanitizer; full logs under $OUT, a short summary last.
#
#   scripts/gpu_check.sh                 # build + GPU tests + examples
#   STEPS="build tests sanitizer" scripts/gpu_check.sh
#   STEPS="build sanitizer" SANITIZE=memcheck scripts/gpu_check.sh  # which sanitizer runs, of
#       "memcheck unvalidated racecheck" (default: all three; on the H200 memcheck over
#       sanitizer_cases.py took 91-104 s, racecheck reached 11 of its 19 cases in 184 s; on an
#       H100 racecheck reached 20 of 45 in 400 s, forty-second session)
#   SANITIZE=racecheck SANITIZE_START=20 ...  # memcheck and racecheck over sanitizer_cases.py
#       from case 20 on (where an earlier call stopped)
#   STEPS="build determinism extreme" scripts/gpu_check.sh   # issue 7: 1000-run determinism, extreme sizes
#   EXTREME_ARGS="--only K=256" DETERMINISM_ARGS="--runs 100"  # extra arguments for those two scripts
#   PYTEST_ARGS="tests/test_backward.py -k determinism" scripts/gpu_check.sh
#   PYTEST_JOBS=3 scripts/gpu_check.sh   # the tests dealt out to 3 processes on the one GPU
#   PYTEST_TIMEOUT=240 scripts/gpu_check.sh  # a shard still running then is stopped, and the
#                                            # summary counts what it had run
#   CMAKE_ARGS=-DCMAKE_CUDA_ARCHITECTURES=90 scripts/gpu_check.sh   # H100/H200 only: faster build
#   STEPS="build bench" BENCH_ARGS="--cases main --impls ours,copy" scripts/gpu_check.sh
#   STEPS="build trace" TRACE_SHAPES="8,2048,4096 8,2048,256" scripts/gpu_check.sh  # each op's
#       kernels and their device times, both layouts, and the B=256 D=8192 decode step's
#       (benchmarks/profile_kernels.py --trace)
#   STEPS="variants" VARIANTS=". .variants/a .variants/b" BENCH_ARGS="--cases main,decode --impls ours,copy"
#       A/B of source trees on one machine: each tree is built into its own directory (in
#       parallel), then benchmarks/bench.py of this checkout times each build in turn, for
#       VARIANT_ROUNDS rounds (default 2), so drift over the run shows as a round-to-round change.
#       A variant that is a .patch file (benchmarks/trials/) is this checkout with the patch applied;
#       a.patch+b.patch applies both, in that order (a build named a_b, so that the names of its
#       files in $OUT keep to plain characters).
#   VARIANT_TRACE="8,2048,4096 8,2048,256" (with STEPS="variants"): also, each round, each build's
#       kernel times from a trace (profile_kernels.py --trace) at those B,L,D shapes, both
#       layouts: steadier than the queued medians (seventeenth session: three rounds of a forward
#       kernel within 0.1-0.3 us where the queued medians moved by 1-2 us)
#   VARIANT_CASES="--layout BDL --features; --layout BDL --shape 8,2048,256" (with
#       STEPS="variants"): traces of those profile_kernels.py argument sets (';' between them), after
#       VARIANT_TRACE's; VARIANT_BENCH=0 leaves bench.py out, so that the rounds only trace
#   VARIANTS="build/prebuilt/main build/prebuilt/trial" (with STEPS="variants"): a variant that is
#       a folder holding an installed package (pip install --target, on a machine with the
#       device's Python, as in the thirty-seventh session) is timed as it is, without a build;
#       carry the folder (the run tool's limit of 64 MiB holds two builds of about 25 MB), or that
#       folder packed (`tar -cf - NAME | xz -6 > build/xz/NAME.tar.xz` in build/prebuilt: about 8
#       MB) as VARIANTS="build/xz/main.tar.xz build/xz/trial.tar.xz" (fiftieth session)
#   PYTHONPATH=/tmp/variant_a STEPS="tests examples determinism sanitizer" scripts/gpu_check.sh
#       a build the variants step left on a machine still warm, tested in place: without the build
#       step every step imports the package from PYTHONPATH (forty-first session)
#   REQUIRE_GPU=H200 STEPS=variants ...  # exit 3 at once, before any step, unless the GPU's name
#       holds that text: a run tool that lends an H100 or an H200 for the same request then costs
#       the start only, where the work means something on one of them (forty-ninth session: six
#       calls for an H200 got H100s)
set -uo pipefail
gpu_info=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)
if [[ -n ${REQUIRE_GPU:-} ]]; then
  if [[ ${gpu_info%%,*} != *"$REQUIRE_GPU"* ]]; then
    echo "REQUIRE_GPU=$REQUIRE_GPU: this machine's GPU is ${gpu_info%%,*}; nothing run"
    exit 3
  fi
fi
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
STEPS=${STEPS:-"build tests examples"}
# One line: a list from `ls` keeps its newlines, which split each shard's summary line in two
# (forty-third session).
PYTEST_ARGS=$(tr '\n' ' ' <<<"${PYTEST_ARGS:-tests}")
PYTEST_JOBS=${PYTEST_JOBS:-1}
PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-0}  # seconds per shard; 0: no limit
EXTREME_ARGS=${EXTREME_ARGS:-}
DETERMINISM_ARGS=${DETERMINISM_ARGS:-}
BENCH_ARGS=${BENCH_ARGS:-}
TRACE_SHAPES=${TRACE_SHAPES:-"8,2048,4096 8,2048,256"}
SANITIZE=${SANITIZE:-"memcheck unvalidated racecheck"}
VARIANTS=${VARIANTS:-.}
VARIANT_ROUNDS=${VARIANT_ROUNDS:-2}
VARIANT_TRACE=${VARIANT_TRACE:-}
VARIANT_CASES=${VARIANT_CASES:-}
VARIANT_BENCH=${VARIANT_BENCH:-1}
export PYTHONUNBUFFERED=1
summary=()

step() { [[ " $STEPS " == *" $1 "* ]]; }

if step build; then
  t0=$SECONDS
  if python3 -m pip install --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1; then
    summary+=("build: ok in $((SECONDS - t0)) s")
  else
    tail -60 "$OUT/build.log"
    echo "build: FAILED"
    exit 1
  fi
fi
summary+=("gpu: $gpu_info")
# From outside the checkout, so the installed package (with its extensions) is imported. The
# variants step alone imports none: it builds each tree into its own /tmp/variant_<name>.
probe='import jax, jax_causal_conv._native as n; print(jax.__version__, jax.devices()[0].platform, sorted(n.native_platforms))'
[[ " $STEPS " == " variants " ]] &&
  probe='import jax; print(jax.__version__, jax.devices()[0].platform, "(the package: each variant build)")'
summary+=("jax: $(cd /tmp && python3 -c "$probe" 2>&1 | tail -1)")

if step tests; then
  # Most of the time is XLA compiling on the host: PYTEST_JOBS processes share the GPU, each taking
  # every PYTEST_JOBS-th test (tests/conftest.py, JCC_TEST_SHARD), none preallocating its memory.
  # -o addopts="": not pyproject's xdist workers (the shards are the processes here, and the GPU
  # machine's Python may lack pytest-xdist).
  for ((job = 0; job < PYTEST_JOBS; job++)); do
    # shellcheck disable=SC2086
    # -P: do not put the checkout first on sys.path (it has no compiled extensions).
    JCC_TEST_SHARD=$job/$PYTEST_JOBS XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$PYTEST_TIMEOUT" \
      python3 -P -m pytest -q -m gpu -p no:cacheprovider -o addopts="" $PYTEST_ARGS >"$OUT/pytest_gpu_$job.log" 2>&1 &
  done
  wait
  count() { tr -cd "$1" <<<"$progress" | wc -c; }  # of character $1 in $progress
  for ((job = 0; job < PYTEST_JOBS; job++)); do
    log="$OUT/pytest_gpu_$job.log"
    if grep -qE "^[0-9]+ (passed|failed|error)|^no tests ran" "$log"; then
      result=$(tail -1 "$log")
    else  # stopped by PYTEST_TIMEOUT: the progress characters of -q say how far it got
      progress=$(grep -E "^[.sFEx]+( +\[ *[0-9]+%\])?$" "$log" | tr -cd '.sFEx')
      result="STOPPED after $PYTEST_TIMEOUT s: $(count .) passed, $(count F) failed, $(count E) errors, $(count s) skipped so far"
    fi
    # A list of test ids as PYTEST_ARGS (a rerun of what a stopped run left) would fill the
    # summary: its first 100 characters name it.
    args_shown=${PYTEST_ARGS:0:100}
    [[ ${#PYTEST_ARGS} -gt 100 ]] && args_shown+="... ($(wc -w <<<"$PYTEST_ARGS") arguments)"
    summary+=("pytest -m gpu $args_shown (shard $job/$PYTEST_JOBS): $result")
    grep -E "^(FAILED|ERROR)" "$log" | head -20
  done
fi

if step examples; then
  for ex in examples/*.py; do
    if python3 "$ex" >"$OUT/$(basename "$ex" .py).log" 2>&1; then r=ok; else r=FAILED; tail -20 "$OUT/$(basename "$ex" .py).log"; fi
    summary+=("example $ex: $r ($(tail -1 "$OUT/$(basename "$ex" .py).log"))")
  done
fi

if step sanitizer; then
  # Only this package's kernels are instrumented (XLA's own run unchecked), which is much faster;
  # without the filter option every kernel is checked.
  filter=()
  if compute-sanitizer --help 2>&1 | grep -q -- "--kernel-name"; then
    filter=(--kernel-name kns=causal_conv)
  fi
  sanitize() {  # tool, script, log
    # Without preallocation: the sanitizer keeps its own state in device memory, which XLA would
    # otherwise have taken (a racecheck run crashed, tests/GPU.md, fourth session). One at a time:
    # two memcheck runs sharing the GPU with a racecheck run both crashed (fifth session).
    # The sanitizer itself dies by SIGSEGV now and then with the kernel filter, at varying points
    # and never without it (tests/GPU.md, fifth session): then once more, every kernel instrumented.
    local used=("${filter[@]}") rc
    while true; do
      XLA_PYTHON_CLIENT_PREALLOCATE=false compute-sanitizer --tool "$1" "${used[@]}" \
        --error-exitcode 9 python3 $2 >"$3" 2>&1  # $2: the script and its arguments
      rc=$?
      (( rc == 139 && ${#used[@]} )) || break
      used=()
    done
    summary+=("compute-sanitizer $1 ${used[*]} $2: exit $rc ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$3" | tail -1); $(grep -E '^[0-9]+ mismatches|cases ok' "$3" | tail -1))")
  }
  # Over sanitizer_cases.py the sanitizer also died by SIGSEGV at varying cases, filtered or not
  # (tests/GPU.md, seventh session: after cases 4, 5 and 12 in three runs, no finding reported
  # before; fifty-eighth: racecheck in cases 0, 4, 8 and 9): a run that dies resumes at the case
  # it was in (--start), as long as it dies fewer than 3 times in a row without a case done.
  sanitize_cases() {  # tool, log
    local first=${SANITIZE_START:-0} crashes=0 stalls=0 rc summaries total
    local start=$first next
    : >"$2"
    while true; do
      XLA_PYTHON_CLIENT_PREALLOCATE=false compute-sanitizer --tool "$1" "${filter[@]}" \
        --error-exitcode 9 python3 scripts/sanitizer_cases.py --start "$start" >>"$2" 2>&1
      rc=$?
      next=$((first + $(grep -cE ' ok$' "$2")))
      if ((next > start)); then stalls=0; else stalls=$((stalls + 1)); fi
      (( rc == 139 && stalls < 3 )) || break
      crashes=$((crashes + 1))
      start=$next
      echo "==== resumed at case $start after a sanitizer crash" >>"$2"
    done
    summaries=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$2" | sed 's/^=* *//' | sort | uniq -c |
      tr -s ' ' | tr '\n' ';')
    total=$(grep -oE 'of [0-9]+ cases' "$2" | head -1 | cut -d' ' -f2)
    summary+=("compute-sanitizer $1 ${filter[*]} scripts/sanitizer_cases.py --start $first: exit $rc, $(grep -cE ' ok$' "$2") of ${total:-?} cases ok, $crashes sanitizer crashes resumed; summaries:${summaries:- none}")
  }
  wanted() { [[ " $SANITIZE " == *" $1 "* ]]; }
  if wanted memcheck; then
    sanitize_cases memcheck "$OUT/sanitizer_memcheck.log"
  fi
  if wanted unvalidated; then
    # Values no trace-time check can see (issue 7 item 3): seq_idx, state_indices, cache_seqlens.
    for section in conv update varlen; do
      sanitize memcheck "scripts/sanitizer_unvalidated.py $section" "$OUT/sanitizer_memcheck_unvalidated_$section.log"
    done
  fi
  if wanted racecheck; then
    # racecheck sees shared-memory hazards only; no kernel's shared-memory accesses depend on the
    # unvalidated values, so the shapes of sanitizer_cases.py cover them.
    sanitize_cases racecheck "$OUT/sanitizer_racecheck.log"
  fi
fi

if step determinism; then
  # shellcheck disable=SC2086
  python3 scripts/determinism.py $DETERMINISM_ARGS >"$OUT/determinism.log" 2>&1
  summary+=("determinism: exit $? ($(tail -1 "$OUT/determinism.log"))")
  grep -E "FAIL" "$OUT/determinism.log" | head -20
fi

if step extreme; then
  # shellcheck disable=SC2086
  python3 scripts/extreme_sizes.py $EXTREME_ARGS >"$OUT/extreme.log" 2>&1
  summary+=("extreme sizes: exit $? ($(tail -1 "$OUT/extreme.log"))")
  grep -E "FAIL" "$OUT/extreme.log" | head -20
fi

# Each op's kernel times from a jax.profiler trace: seconds a shape, where ncu takes minutes to
# start a JAX program. Prints the totals line of profile_kernels.py (us per call).
trace() {  # log, profile_kernels.py arguments
  local log=$1
  shift
  python3 benchmarks/profile_kernels.py "$@" --trace 40 >"$log" 2>&1
  sed -n 's/^totals (us per call): //p' "$log" | grep -v '^none$' || echo "no kernel times (see $log)"
}

if step trace; then
  for shape in $TRACE_SHAPES; do
    for layout in BLD BDL; do
      summary+=("trace $layout B,L,D=$shape, kernel us: $(trace "$OUT/trace_${layout}_${shape//,/x}.log" \
        --layout "$layout" --shape "$shape")")
    done
  done
  for layout in BLD BDL; do
    summary+=("trace decode $layout B=256 D=8192, kernel us: $(trace "$OUT/trace_decode_$layout.log" \
      --update --layout "$layout" --shape 256,1,8192)")
  done
fi

if step bench; then
  # shellcheck disable=SC2086
  python3 benchmarks/bench.py --out "$OUT" $BENCH_ARGS >"$OUT/bench.log" 2>&1
  summary+=("bench: exit $? (table in bench.md)")
  tail -40 "$OUT/bench.log"
fi

if step variants; then
  # A variant's name: main for this checkout, else its patches' names joined by '_'.
  variant_name() {
    [[ $1 == . ]] && { echo main; return; }
    [[ $1 == *.tar.xz ]] && { basename "$1" .tar.xz; return; }
    [[ $1 == *.patch ]] || { basename "$1"; return; }
    local part parts names=()
    IFS='+' read -ra parts <<<"$1"
    for part in "${parts[@]}"; do names+=("$(basename "$part" .patch)"); done
    (IFS='_'; echo "${names[*]}")
  }
  # The source tree of a variant: patches (a.patch+b.patch applies both, in that order) apply to
  # a copy of this checkout, without its build folder (scikit-build-core's build-dir, whose CMake
  # cache names this checkout's path).
  variant_tree() {
    local name part parts
    [[ $1 == *.patch ]] || { echo "$1"; return; }
    name=$(variant_name "$1")
    rm -rf "/tmp/variant_src_$name" && mkdir -p "/tmp/variant_src_$name"
    tar --exclude=./.git --exclude=./build --exclude=./benchmarks/results -cf - . |
      tar -xf - -C "/tmp/variant_src_$name"
    IFS='+' read -ra parts <<<"$1"
    for part in "${parts[@]}"; do
      patch -p1 -s --no-backup-if-mismatch -d "/tmp/variant_src_$name" <"$part" >&2 || return 1
    done
    echo "/tmp/variant_src_$name"
  }
  cases=()
  for shape in $VARIANT_TRACE; do
    for layout in BLD BDL; do cases+=("--layout $layout --shape $shape"); done
  done
  IFS=';' read -ra more_cases <<<"$VARIANT_CASES"
  for case in "${more_cases[@]}"; do
    read -ra words <<<"$case"  # trimmed
    (( ${#words[@]} )) && cases+=("${words[*]}")
  done
  t0=$SECONDS
  for tree in $VARIANTS; do
    name=$(variant_name "$tree")
    # A warm machine keeps an earlier call's builds, and pip --target does not replace them.
    rm -rf "/tmp/variant_$name"
    # Built elsewhere (pip install --target) and carried: told by pip's record of the install, as
    # a source tree (this checkout, ".") holds the package's sources too; or packed, a .tar.xz of
    # that folder (about 8 MB against 25, so that a call's 64 MiB carry holds five builds).
    if [[ $tree == *.tar.xz ]]; then
      mkdir -p "/tmp/variant_$name" && tar -xJf "$tree" -C "/tmp/variant_$name" --strip-components=1
      continue
    fi
    if compgen -G "$tree/jax_causal_conv-*.dist-info" >/dev/null; then
      cp -r "$tree" "/tmp/variant_$name"
      continue
    fi
    if ! source_tree=$(variant_tree "$tree"); then
      summary+=("$name: patch did not apply")
      continue
    fi
    (python3 -m pip install --no-build-isolation --no-deps --target "/tmp/variant_$name" "$source_tree" \
      >"/tmp/variant_build_$name.log" 2>&1 || tail -30 "/tmp/variant_build_$name.log") &
  done
  wait
  summary+=("variants built in $((SECONDS - t0)) s")
  for ((round = 1; round <= VARIANT_ROUNDS; round++)); do
    for tree in $VARIANTS; do
      name=$(variant_name "$tree")
      log="$OUT/bench_${name}.log"
      [[ -d /tmp/variant_$name/jax_causal_conv ]] || { summary+=("$name: build FAILED"); continue; }
      if [[ $VARIANT_BENCH != 0 ]]; then
        echo "==== round $round" >>"$log"
        # shellcheck disable=SC2086
        PYTHONPATH="/tmp/variant_$name" python3 -P benchmarks/bench.py --out "/tmp/variant_out_$name" \
          $BENCH_ARGS >>"$log" 2>&1
        # per row of bench.md: case's first word (decode) and layout, implementation, op, queue / loop us
        summary+=("round $round $name: $(awk -F' *[|] *' '$3 == "ours" || $3 == "copy" {
          n = split($2, c, " "); printf "%s%s %s %s %s/%s; ", (c[1] == "decode" ? "dec " : ""), c[n],
          $3, $4, $5, $6 }' "/tmp/variant_out_$name/bench.md")")
        grep -E 'FAILED' "$log" | sed "s/^/$name: /" | head -5
      fi
      for ((i = 0; i < ${#cases[@]}; i++)); do
        # shellcheck disable=SC2086
        times=$(PYTHONPATH="/tmp/variant_$name" trace "$OUT/trace_${name}_case${i}_$round.log" ${cases[i]})
        summary+=("round $round $name trace ${cases[i]}, kernel us: $times")
      done
    done
  done
fi

echo "==== summary ===="
printf '%s\n' "${summary[@]}"
