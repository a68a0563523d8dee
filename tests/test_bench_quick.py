"""Smoke test of benchmarks/bench.py (the --quick run finishes and reports every implementation),
and of profile_kernels.py's trace reading."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"


def test_bench_quick(tmp_path):
    env = dict(os.environ)
    # Tiny programs: skip LLVM's optimisations, compile time is most of the run on CPU.
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    env["JAX_PLATFORMS"] = "cpu"
    out = tmp_path / "out"
    # From tmp_path, so the installed package (with its compiled extension) is imported.
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAILED" not in proc.stderr, proc.stderr[-3000:]

    report = (out / "bench.md").read_text()
    assert report.strip() in proc.stdout  # the same table is printed and written
    rows = [line.split("|")[1:-1] for line in report.splitlines() if re.match(r"\| bf16 ", line)]
    seen = {(cells[1].strip(), cells[2].strip()) for cells in rows}
    for impl in ("ours", "reference", "conv_general_dilated", "copy"):
        for op in ("fwd", "bwd", "fwd+bwd"):
            assert (impl, op) in seen, f"no row for {impl} {op}"
    for cells in rows:
        queue_us, loop_us = float(cells[3]), float(cells[4].rstrip(" !"))
        assert queue_us > 0 and loop_us > 0, cells
    assert (out / "bench.json").is_file()
    if importlib.util.find_spec("matplotlib") is None:
        assert "no plot" in proc.stderr
    else:
        assert (out / "bench.png").stat().st_size > 0


def load_script(name):
    """benchmarks/NAME.py as a module."""
    spec = importlib.util.spec_from_file_location(name, BENCH.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


def load_bench():
    return load_script("bench")


def target_rows(bench, prefill):
    """{(case name, target, op): (method, value)} from bench.target_lines."""
    base = bench.Case(8, 2048, 4096, 4)
    lines = bench.target_lines(prefill, {}, base, "queue", quick=False)
    rows = {}
    for line in lines:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 7 and cells[0] not in ("target", "---"):
            rows[(cells[1], cells[0], cells[2])] = (cells[3], float(cells[4]))
    return rows


def test_targets_take_the_loop_where_the_queue_is_host_bound():
    bench = load_bench()
    T = bench.Timing
    main, small, audited = (bench.Case(8, 2048, 4096, 4), bench.Case(8, 2048, 256, 4),
                            bench.Case(1, 65536, 4096, 4))

    def timings(ours, copy, audit=""):  # (queue, loop) per op for ours and the copy
        res = {}
        for op, scale in (("fwd", 1.0), ("bwd", 1.5), ("fwd+bwd", 2.5)):
            res[("ours", op)] = T(ours[0] * scale, ours[1] * scale, audit)
            res[("copy", op)] = T(copy[0] * scale, copy[1] * scale)
        return res

    prefill = {
        main: timings((80.0, 78.0), (68.0, 67.0)),  # the copy queued within 15% of its loop
        small: timings((57.0, 10.0), (33.0, 5.0)),  # the copy queued 6.6x its loop: host-bound
        audited: timings((300.0, 290.0), (260.0, 100.0), audit="copies in the loop"),
    }
    rows = target_rows(bench, prefill)
    assert rows[(main.name, "time / copy", "fwd")] == ("queue", round(80.0 / 68.0, 2))
    assert rows[(main.name, "fwd+bwd us", "fwd+bwd")] == ("queue", 200.0)
    assert rows[(small.name, "time / copy within 15%", "fwd")] == ("loop", 2.0)
    assert rows[(small.name, "time / copy within 15%", "bwd")] == ("loop", 2.0)
    # ours' loop failed the audit: the queue for the whole case, though its copy looks host-bound
    assert rows[(audited.name, "time / copy within 15%", "fwd")] == ("queue", round(300 / 260, 2))


@pytest.mark.parametrize("layout", ["BLD", "BDL"])
@pytest.mark.parametrize("features", [False, True])
@pytest.mark.parametrize("op", ["fwd", "bwd", "fwd+bwd"])
def test_loop_runs_nothing_but_our_calls(op, features, layout):
    """The loop method's body, for ours, holds our custom calls and the loop counter only: no
    kernel of the harness's own (dw and db's scale once ran as two a call) and no copy."""
    import jax

    bench = load_bench()
    case = bench.Case(2, 64, 32, 4, layout=layout, features=features)
    sets = bench.make_inputs(case, 2)
    fn = bench.make_ops(bench.CONV_FNS["ours"], case)[op]
    step, depth, first_carry = bench.loop_step(op, fn, "ours", case)
    carry = tuple(first_carry(x, w, b, s0, dy, dF) for x, w, b, s0, _, dy, dF in sets)
    loop = jax.jit(lambda c, seq: jax.lax.fori_loop(0, 3, lambda i, c: step(c, seq), c),
                   donate_argnums=0)
    comps, entry = bench._computations(loop.lower(carry, sets[0][4]).compile().as_text())
    body = comps[bench._find_while_body(comps, entry)]
    calls = [i for i, _, opcode, _ in body if opcode == "custom-call"]
    others = [(i, shape) for i, shape, opcode, _ in body
              if opcode in bench._HEAVY and opcode != "custom-call" and not shape.endswith("[]")]
    per_call = 2 if op == "fwd+bwd" else 1  # fwd+bwd: the forward's call and the backward's
    # (a multiple where XLA unrolls the loop)
    assert calls and len(calls) % (per_call * depth * len(sets)) == 0, calls
    assert others == [], others


def test_widths_option_selects_the_widths_group():
    bench = load_bench()
    args = bench.parse_args(["--cases", "widths", "--widths", "5,7", "--layouts", "BDL"])
    prefill, decode, _ = bench.select_cases(args.groups, args.layouts, args.quick, args.widths)
    assert [(c.K, c.layout) for c in prefill] == [(5, "BDL"), (7, "BDL")]
    assert decode == []
    default = bench.parse_args(["--cases", "widths"])
    prefill, _, _ = bench.select_cases(default.groups, default.layouts, default.quick,
                                       default.widths)
    assert sorted({c.K for c in prefill}) == list(range(2, 9))


def test_widths_option_rejects_bad_values(capsys):
    bench = load_bench()
    for bad in ("4,x", "0", ","):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(["--widths", bad])
        assert exc.value.code == 2
        assert "--widths" in capsys.readouterr().err


def test_match_option_keeps_the_cases_named_by_it(capsys):
    bench = load_bench()
    args = bench.parse_args(["--cases", "shapes,decode", "--match", "D256,L128"])
    prefill, decode, _ = bench.select_cases(args.groups, args.layouts, args.quick, args.widths,
                                            args.match)
    assert [(c.B, c.L, c.D, c.layout) for c in prefill] == [
        (64, 128, 4096, "BLD"), (64, 128, 4096, "BDL"), (8, 2048, 256, "BLD"), (8, 2048, 256, "BDL")]
    assert decode == []
    everything = bench.parse_args(["--cases", "shapes"])
    assert len(bench.select_cases(everything.groups, everything.layouts, everything.quick,
                                  everything.widths, everything.match)[0]) == 8
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--cases", "shapes", "--match", "D999"])
    assert exc.value.code == 2
    assert "--match D999" in capsys.readouterr().err


def test_consistency_note_flags_a_disturbed_median():
    bench = load_bench()
    T = bench.Timing

    def results(fwd, bwd, both):
        return {("ours", "fwd"): T(queue_us=fwd), ("ours", "bwd"): T(queue_us=bwd),
                ("ours", "fwd+bwd"): T(queue_us=both), ("copy", "fwd"): T(queue_us=68.0)}

    # the seventh session's BDL K=3 forward: 132.8 us, while fwd+bwd - bwd gave 77.6
    note = bench.consistency_note(results(132.8, 144.3, 221.9))
    assert "132.8" in note and "221.9" in note and "again" in note
    assert bench.consistency_note(results(77.9, 123.5, 200.2)) == ""  # the main workload
    assert bench.consistency_note(results(50.0, 100.0, 180.0)) != ""  # too slow a fwd+bwd
    partial = results(77.9, 123.5, 200.2)
    del partial[("ours", "bwd")]
    assert bench.consistency_note(partial) == ""


def test_copy_outlier_notes_name_the_disturbed_case():
    bench = load_bench()
    T = bench.Timing
    main = dict(B=8, L=2048, D=4096, K=4)
    # the twenty-seventh session's features run: one case's copy 81.4 us, the others' about 68
    copies = {bench.Case(layout="BLD", features=True, **main): (81.4, 97.5),
              bench.Case(layout="BLD", **main): (68.2, 97.1),
              bench.Case(layout="BDL", features=True, **main): (67.8, 97.3),
              bench.Case(layout="BDL", **main): (67.9, 113.0)}
    prefill = {case: {("copy", "fwd"): T(queue_us=f), ("copy", "bwd"): T(queue_us=b)}
               for case, (f, b) in copies.items()}
    notes = bench.copy_outlier_notes(prefill, "queue")
    assert len(notes) == 2
    assert notes[0].startswith("bf16 B8 L2048 D4096 K4 BLD +seq_idx+states: the copy's fwd took 81.4")
    assert notes[1].startswith("bf16 B8 L2048 D4096 K4 BDL: the copy's bwd took 113.0")
    # fewer than three cases of the same bytes, or small (host-bound) copies: nothing to compare
    assert bench.copy_outlier_notes(dict(list(prefill.items())[:2]), "queue") == []
    small = {bench.Case(B=1, L=128, D=256, K=k): {("copy", "fwd"): T(queue_us=5.0 * k)}
             for k in (2, 3, 4)}
    assert bench.copy_outlier_notes(small, "queue") == []


def test_profile_trace_parsing(tmp_path):
    """profile_kernels.py --trace counts the kernels on the GPU's stream rows only."""
    profile = load_script("profile_kernels")

    kernel = "void causal_conv::(anonymous namespace)::reduce_partials_kernel<float, float, 8, 4>(x)"
    def named(what, pid, name, tid=None):
        return {"ph": "M", "name": what, "pid": pid, "tid": tid, "args": {"name": name}}

    stream = "Stream #13(Compute)"
    meta = [named("process_name", 1, "/device:GPU:0"), named("thread_name", 1, stream, 7),
            named("thread_name", 1, "XLA Ops", 8), named("process_name", 2, "/host:CPU"),
            named("thread_name", 2, stream, 7)]
    durations = [3.5, 1.25, 2.0]
    kernels = [{"ph": "X", "pid": 1, "tid": 7, "ts": i, "dur": d, "name": kernel}
               for i, d in enumerate(durations)]
    others = [{"ph": "X", "pid": 1, "tid": 8, "ts": 0, "dur": 99.0, "name": kernel},  # op row
              {"ph": "X", "pid": 2, "tid": 7, "ts": 0, "dur": 99.0, "name": kernel}]  # host
    trace = tmp_path / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
    trace.parent.mkdir(parents=True)
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": meta + others + kernels}, f)

    times, rows = profile.kernel_times(tmp_path)
    assert times == {kernel: durations}
    assert "/device:GPU:0 / XLA Ops" in rows
    assert profile.short_name(kernel) == "reduce_partials_kernel"


def launch(name: str, ts: float, dur: float) -> dict:
    """A kernel launch as profile_kernels.kernel_events gives it (times in us)."""
    return {"name": name, "ts": ts, "dur": dur}


def test_profile_call_spans():
    """A call's span runs from its first kernel's start to its last kernel's end, so a dependent
    kernel placed while the one before it runs (its trace time holding the wait) counts once."""
    profile = load_script("profile_kernels")

    # two calls of a backward (10 us) and its reduction, placed 2 us in, ending 1.5 us after it
    kernels = [launch("bwd", 0.0, 10.0), launch("reduce", 2.0, 9.5),
               launch("bwd", 20.0, 10.0), launch("reduce", 21.0, 11.0)]
    assert profile.call_spans(kernels, 2) == [11.5, 12.0]
    assert profile.call_spans(kernels[:3], 2) == []  # the calls' kernels do not split evenly
    assert profile.call_spans([launch("copy", 5.0, 3.0)], 1) == [3.0]
    assert profile.call_spans([], 1) == []


def test_profile_call_idle():
    """The idle time of a call is its span less the union of its kernels' intervals: an overlap
    (a dependent kernel placed early) counts nothing, a gap between kernels counts in full."""
    profile = load_script("profile_kernels")

    kernels = [launch("bwd", 0.0, 10.0), launch("reduce", 2.0, 9.5),  # overlapping: no idle
               launch("bwd", 20.0, 9.0), launch("reduce", 32.5, 2.0),  # 3.5 us between them
               launch("reduce", 45.0, 2.0), launch("bwd", 40.0, 4.0)]  # out of order: 1 us
    assert profile.call_idle(kernels, 3) == [0.0, 3.5, 1.0]
    assert profile.call_idle(kernels[:5], 3) == []
    assert profile.call_idle([launch("copy", 5.0, 3.0)], 1) == [0.0]


def test_profile_trace_leaves_out_the_flush(monkeypatch, capsys):
    """With --flush-l2, trace_ops runs the flush before each traced call and leaves the flush's
    kernels out of the op's kernel times, spans and idle times."""
    profile = load_script("profile_kernels")
    import jax.numpy as jnp

    # two calls of a backward and its reduction (spans 11.5 and 12.0), each after a 50 us flush
    events = [launch("flush", 0.0, 50.0), launch("bwd", 50.0, 10.0), launch("reduce", 52.0, 9.5),
              launch("flush", 70.0, 50.0), launch("bwd", 120.0, 10.0), launch("reduce", 122.0, 10.0)]
    monkeypatch.setattr(profile, "kernel_events", lambda trace_dir: (events, []))
    flushes = []
    flush = (lambda: flushes.append(len(flushes)), frozenset({"flush"}))
    profile.trace_ops({"bwd": (lambda: jnp.zeros(()), ())}, 2, flush)
    out = capsys.readouterr().out
    assert flushes == [0, 1]  # once before each traced call, not before the warm-up call
    assert "flush" not in out
    assert re.search(r"\(span of a call: first start to last end\)\s+11\.75", out)
    assert "idle median 0.00" in out
    assert out.splitlines()[-1] == "totals (us per call): bwd 11.75"
