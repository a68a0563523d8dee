#!/usr/bin/env bash
# One call on a GPU machine: build from source, run the GPU-marked tests and the examples, and
# (optionally) the benchmark and compute-sanitizer; full logs under $OUT, a short summary last.
#
#   scripts/gpu_check.sh                 # build + GPU tests + examples
#   STEPS="build tests sanitizer" scripts/gpu_check.sh
#   PYTEST_ARGS="tests/test_backward.py -k determinism" scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
STEPS=${STEPS:-"build tests examples"}
PYTEST_ARGS=${PYTEST_ARGS:-tests}
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
summary+=("gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)")
# From outside the checkout, so the installed package (with its extensions) is imported.
summary+=("jax: $(cd /tmp && python3 -c 'import jax, jax_causal_conv._native as n; print(jax.__version__, jax.devices()[0].platform, sorted(n.native_platforms))' 2>&1 | tail -1)")

if step tests; then
  # shellcheck disable=SC2086
  # -P: do not put the checkout first on sys.path (it has no compiled extensions).
  python3 -P -m pytest -q -m gpu -p no:cacheprovider $PYTEST_ARGS >"$OUT/pytest_gpu.log" 2>&1
  summary+=("pytest -m gpu $PYTEST_ARGS: $(tail -1 "$OUT/pytest_gpu.log")")
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.log" | head -20
fi

if step examples; then
  for ex in examples/*.py; do
    if python3 "$ex" >"$OUT/$(basename "$ex" .py).log" 2>&1; then r=ok; else r=FAILED; tail -20 "$OUT/$(basename "$ex" .py).log"; fi
    summary+=("example $ex: $r ($(tail -1 "$OUT/$(basename "$ex" .py).log"))")
  done
fi

if step sanitizer; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 python3 scripts/sanitizer_cases.py \
      >"$OUT/sanitizer_$tool.log" 2>&1
    summary+=("compute-sanitizer $tool: exit $? ($(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1))")
  done
fi

if step bench; then
  python3 benchmarks/bench.py --out "$OUT" >"$OUT/bench.log" 2>&1
  summary+=("bench: exit $? (table in bench.md)")
  tail -40 "$OUT/bench.log"
fi

echo "==== summary ===="
printf '%s\n' "${summary[@]}"
