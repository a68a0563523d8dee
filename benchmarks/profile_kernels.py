"""Runs the main workload's forward and backward (or another shape's) for a profiler.

Under ncu, each call once (compilation and warm-up happen before the profiled calls, so each of
our kernels shows up once per call in the profiler's output):

    ncu --clock-control none --kernel-name regex:"forward|backward|reduce" \\
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \\
        python3 benchmarks/profile_kernels.py --layout BLD

With --trace N, without ncu: N calls of each op (and of the same-bytes copy bench.py times
against) under `jax.profiler.trace`, then each kernel's median device time from the trace, one
line per kernel and op. ncu takes minutes to start a JAX program; the trace takes seconds, and
says how an op's time splits between its kernels (the backward's second one, the dw/db
reduction, included) and how much of a loop-timed op is kernel time. On Hopper the reduction is
a programmatic dependent launch, placed while the backward kernel runs: its trace duration then
includes that wait, so the sum over the backward's kernels counts most of the backward twice,
and the span of a call (first kernel's start to last kernel's end) is the op's device time:

    python3 benchmarks/profile_kernels.py --shape 8,2048,256 --trace 50

For an op of more than one kernel a call, a last line gives the spans' least and greatest and the
device's idle time between a call's kernels (median, 90th percentile, greatest): where the span
moves and the kernels' medians do not, the launches' gap moved.

With --flush-l2 MIB (and --trace), each call follows a call that reads and writes MIB MiB, more
than the L2 holds, so that no call finds its operands there, as in a model where other layers run
between two calls of one layer; the trace leaves that call's kernels out. Back to back, a small
problem's operands can stay in the L2 from one call to the next (B=8 L=2048 D=256: three 8 MB
tensors against the H100's and H200's 50 MB), for one implementation more than for another:

    python3 benchmarks/profile_kernels.py --shape 8,2048,256 --trace 50 --flush-l2 256

With --update, the decode step instead (one token a row, shift mode, the state donated and passed
from call to call, as bench.py's decode case; --shape B,1,D) and a copy of its bytes; without
--trace, three steps for ncu (scripts/ncu_main.sh with UPDATE=1):

    python3 benchmarks/profile_kernels.py --update --shape 256,1,8192 --trace 50

With --features, bench.py's features case instead of the plain call: four packed sequences a row
(seq_idx), an initial state, the final state returned, and the backward from dy and a final-state
cotangent (dx, dw, db and the initial state's gradient):

    python3 benchmarks/profile_kernels.py --layout BDL --features --trace 50

--sequences N sets the sequences a row of --features (N - 1 random cuts; 1: one id throughout,
every segment uniform), to split a packed call's time into what its boundaries cost and what the
seq_idx path costs without them; 0: no seq_idx (the states alone, the kernels without seq_idx).

x, dy, weight and bias are bf16 (bench.py's default: the params in x's dtype); --dtype float16
or float32 for the others (the forward and backward, not --update).
"""

import argparse
import collections
import gzip
import json
import os
import pathlib
import statistics
import sys
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_causal_conv as jcc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import flip_sign, packed_seq_idx  # noqa: E402  (as bench.py times and builds them)


def parse_shape(text: str) -> tuple[int, int, int]:
    """`batch,length,channels` as three ints."""
    batch, length, channels = (int(n) for n in text.split(","))
    return batch, length, channels


def kernel_events(trace_dir: pathlib.Path) -> tuple[list[dict], list[str]]:
    """The kernel launches in a perfetto trace, in order of their start (each a dict of name, ts
    and dur, the times in us), and the rows (process / thread) the trace has.

    Only the events on the GPU's stream rows count: the trace also holds host events and XLA's op
    rows, which would count each kernel twice.
    """
    (trace,) = trace_dir.rglob("perfetto_trace.json.gz")
    with gzip.open(trace) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    process, thread = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[e["pid"], e["tid"]] = e["args"]["name"]
    kernels = []
    for e in events:
        on_gpu = "GPU" in process.get(e.get("pid"), "")
        on_stream = "Stream" in thread.get((e.get("pid"), e.get("tid")), "")
        if e.get("ph") == "X" and on_gpu and on_stream:
            kernels.append({"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"])})
    rows = sorted({f"{process.get(pid, pid)} / {name}" for (pid, _), name in thread.items()})
    return sorted(kernels, key=lambda k: k["ts"]), rows


def durations_by_name(kernels: list[dict]) -> dict[str, list[float]]:
    """kernel_events' launches as each kernel name's device times (us), in launch order."""
    times = collections.defaultdict(list)
    for k in kernels:
        times[k["name"]].append(k["dur"])
    return times


def kernel_times(trace_dir: pathlib.Path) -> tuple[dict[str, list[float]], list[str]]:
    """Device time (us) of each kernel launch in a perfetto trace, by kernel name, and the rows
    (process / thread) the trace has (see kernel_events)."""
    kernels, rows = kernel_events(trace_dir)
    return durations_by_name(kernels), rows


def call_groups(kernels: list[dict], calls: int) -> list[list[dict]]:
    """kernel_events' launches split into `calls` calls in order, as many for each; empty where
    they do not split evenly."""
    if calls <= 0 or not kernels or len(kernels) % calls:
        return []
    per_call = len(kernels) // calls
    return [kernels[i:i + per_call] for i in range(0, len(kernels), per_call)]


def call_spans(kernels: list[dict], calls: int) -> list[float]:
    """The device span of each of `calls` calls, from its first kernel's start to its last
    kernel's end, its kernels as call_groups takes them. A kernel placed before the one before it
    ends (a programmatic dependent launch, whose trace time includes its wait) counts once here,
    where the sum of kernel times counts the overlap twice."""
    return [max(k["ts"] + k["dur"] for k in g) - g[0]["ts"] for g in call_groups(kernels, calls)]


def call_idle(kernels: list[dict], calls: int) -> list[float]:
    """The device time of each call (grouped as in call_spans) in which none of its kernels runs:
    its span less the union of its kernels' intervals. A backward's reduction that starts late
    after the backward kernel (a launch gap, seen at D = 256 as spans of 10.8-21.3 us over runs
    whose kernels' medians stayed within 0.1 us, forty-first session) shows here and not in the
    kernels' times."""
    idle = []
    for group in call_groups(kernels, calls):
        group = sorted(group, key=lambda k: k["ts"])
        gap, reach = 0.0, group[0]["ts"]
        for k in group:
            gap += max(0.0, k["ts"] - reach)
            reach = max(reach, k["ts"] + k["dur"])
        idle.append(gap)
    return idle


def short_name(name: str) -> str:
    """A kernel's name without namespaces, template arguments and parameters."""
    name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    name = name.split("(")[0].split("<")[0]
    return name.rsplit("::", 1)[-1][:48]


def traced_kernels(run: Callable[[], None]) -> tuple[list[dict], list[str]]:
    """kernel_events of a jax.profiler trace of run()."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            run()
        return kernel_events(pathlib.Path(tmp))


# l2_flush's call and the names of its kernels.
Flush = tuple[Callable[[], jax.Array], frozenset[str]]


def l2_flush(mebibytes: int) -> Flush:
    """A call that reads and writes `mebibytes` MiB (the population count of that many uint32s),
    and the names of its kernels, from a trace of it alone, for trace_ops to leave out."""
    words = jnp.zeros(mebibytes * 2**18, jnp.uint32)
    count = jax.jit(jax.lax.population_count)
    jax.block_until_ready(count(words))
    kernels, _ = traced_kernels(lambda: jax.block_until_ready(count(words)))
    return (lambda: count(words)), frozenset(k["name"] for k in kernels)


def trace_ops(ops: dict, calls: int, flush: Flush | None = None) -> None:
    """Prints each op's kernels: launches per call and median device time; then the sum of its
    kernels' medians x launches per call and the median device span of a call (call_spans); last,
    one line of each op's span (its sum where the calls' kernels do not split evenly), which
    scripts/gpu_check.sh reads. flush: l2_flush's call, run before each traced call, and its
    kernels' names, left out of the trace's launches."""
    print(f"{'op':10} {'kernel':48} {'per call':>8} {'median us':>10}")
    before, flush_kernels = flush if flush else (None, frozenset())
    totals = []
    for label, (fn, args) in ops.items():
        jax.block_until_ready(fn(*args))

        def run(fn=fn, args=args):
            for _ in range(calls):
                if before:
                    before()
                jax.block_until_ready(fn(*args))

        kernels, rows = traced_kernels(run)
        kernels = [k for k in kernels if k["name"] not in flush_kernels]
        if not kernels:
            print(f"{label:10} no kernel events on a GPU stream row; the trace's rows: {rows[:12]}")
            continue
        total = 0.0
        by_name = durations_by_name(kernels).items()
        for name, durations in sorted(by_name, key=lambda item: -sum(item[1])):
            median = statistics.median(durations)
            total += median * len(durations) / calls
            print(f"{label:10} {short_name(name):48} {len(durations) / calls:8.2f} {median:10.2f}")
        print(f"{label:10} {'(sum of medians x launches per call)':48} {'':8} {total:10.2f}")
        spans = call_spans(kernels, calls)
        if spans:
            total = statistics.median(spans)
            span_label = "(span of a call: first start to last end)"
            print(f"{label:10} {span_label:48} {'':8} {total:10.2f}")
            if len(kernels) > calls:  # more than one kernel a call: the gaps between them
                idle = sorted(call_idle(kernels, calls))
                spread = (f"span min {min(spans):.2f} max {max(spans):.2f}; idle median "
                          f"{statistics.median(idle):.2f} p90 {idle[(len(idle) * 9) // 10]:.2f} "
                          f"max {idle[-1]:.2f}")
                print(f"{label:10} {'(device idle between its kernels)':48} {'':8} {spread}")
        totals.append(f"{label} {total:.2f}")
    print("totals (us per call): " + (", ".join(totals) or "none"))


def update_ops(batch: int, channels: int, width: int, layout: str) -> dict:
    """The decode step and a copy of the same bytes (one read and one write of x and the state),
    as trace_ops takes them: the step threads its donated state from call to call."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((batch, channels)), jnp.bfloat16)
    state_shape = (batch, width - 1, channels) if layout == "BLD" else (batch, channels, width - 1)
    state = [jnp.asarray(rng.standard_normal(state_shape), jnp.bfloat16)]
    w = jnp.asarray(rng.standard_normal((channels, width)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(channels), jnp.bfloat16)
    step = jax.jit(lambda x, s: jcc.causal_conv1d_update(x, s, w, b, activation="silu",
                                                         layout=layout), donate_argnums=1)

    def update():
        y, state[0] = step(x, state[0])
        return y

    same_bytes = jnp.asarray(rng.standard_normal(x.size + state[0].size), jnp.bfloat16)
    return {"update": (update, ()), "copy": (jax.jit(flip_sign), (same_bytes,))}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="BLD", choices=("BLD", "BDL"))
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--shape", default="8,2048,4096", type=parse_shape,
                        help="batch,length,channels")
    parser.add_argument("--trace", type=int, default=0, metavar="N",
                        help="time N calls of each op (and of the copy) from a jax.profiler trace")
    parser.add_argument("--update", action="store_true",
                        help="the decode step (--shape B,1,D) instead of the forward and backward")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="x, dy, the weight, bias and states (forward and backward only)")
    parser.add_argument("--features", action="store_true",
                        help="with seq_idx (four packed sequences a row), initial and final states")
    parser.add_argument("--sequences", type=int, default=None, metavar="N",
                        help="packed sequences a row with --features (N - 1 random cuts; "
                             "default 4; 0: the states without seq_idx)")
    parser.add_argument("--flush-l2", type=int, default=0, metavar="MIB",
                        help="with --trace: before each call, a call that reads and writes MIB "
                             "MiB (more than the L2), left out of the trace")
    args = parser.parse_args()
    batch, length, channels = args.shape
    if args.update and length != 1:
        parser.error(f"--update takes one token a row: --shape B,1,D, got length {length}")
    if args.update and args.features:
        parser.error("--features is for the forward and backward, not --update")
    if args.update and args.dtype != "bfloat16":
        parser.error("--dtype is for the forward and backward; --update times bf16")
    if args.sequences is not None and (args.sequences < 0 or not args.features):
        parser.error(f"--sequences takes N >= 0 and --features, got {args.sequences}")
    if args.flush_l2 < 0 or (args.flush_l2 and not args.trace):
        parser.error(f"--flush-l2 takes MIB >= 0 and --trace, got {args.flush_l2}")
    sequences = 4 if args.sequences is None else args.sequences
    flush = None
    if args.flush_l2:
        flush = l2_flush(args.flush_l2)
        print(f"before each call: {args.flush_l2} MiB read and written (the L2 flushed)")
    if args.update:
        ops = update_ops(batch, channels, args.width, args.layout)
        if args.trace:
            print(f"decode {args.layout} B={batch} D={channels} K={args.width} bf16, "
                  f"{args.trace} calls each, {jax.devices()[0].device_kind}")
            trace_ops(ops, args.trace, flush)
        else:  # under ncu: the first call compiles, then two steps
            update, _ = ops["update"]
            for _ in range(3):
                jax.block_until_ready(update())
        return
    rng, dtype = np.random.default_rng(0), jnp.dtype(args.dtype)
    shape = (batch, length, channels) if args.layout == "BLD" else (batch, channels, length)
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    dy = jnp.asarray(rng.standard_normal(shape), dtype)
    w = jnp.asarray(rng.standard_normal((channels, args.width)), dtype)
    b = jnp.asarray(rng.standard_normal(channels), dtype)
    # seq_idx is an argument of the jitted calls, not a constant in them: XLA would fold the one
    # id of --sequences 1 into a broadcast, a kernel of its own before ours on every call.
    state = seq_idx = None
    cotangents = dy
    if args.features:
        state_shape = ((batch, args.width - 1, channels) if args.layout == "BLD"
                       else (batch, channels, args.width - 1))
        state = jnp.asarray(rng.standard_normal(state_shape), dtype)
        cotangents = (dy, jnp.asarray(rng.standard_normal(state_shape), dtype))
        if sequences > 0:
            seq_idx = packed_seq_idx(rng, batch, length, sequences)

    def fwd(x, w, b, state, seq_idx):  # state, seq_idx: None without --features
        return jcc.causal_conv1d(x, w, b, activation="silu", layout=args.layout,
                                 initial_state=state, seq_idx=seq_idx,
                                 return_final_state=args.features)

    def bwd(x, w, b, state, seq_idx, cotangents):  # cotangents: dy, or (dy, the final state's)
        _, vjp = jax.vjp(lambda x, w, b, state: fwd(x, w, b, state, seq_idx), x, w, b, state)
        return vjp(cotangents)

    fwd_jit, bwd_jit = jax.jit(fwd), jax.jit(bwd)
    fwd_args, bwd_args = (x, w, b, state, seq_idx), (x, w, b, state, seq_idx, cotangents)
    if args.trace:
        features = ""
        if args.features:
            packed = "" if args.sequences is None else f"({sequences} sequences a row)"
            features = f" +seq_idx{packed}+states" if sequences > 0 else " +states"
        print(f"{args.layout} B={batch} L={length} D={channels} K={args.width} {args.dtype}"
              f"{features}, {args.trace} calls each, {jax.devices()[0].device_kind}")
        # bench.py's roofline: one read and one write (fwd), two reads and one write (bwd).
        copy_fwd = jax.jit(flip_sign)
        copy_bwd = jax.jit(lambda x, dy: dy - x)
        trace_ops({"fwd": (fwd_jit, fwd_args), "bwd": (bwd_jit, bwd_args),
                   "copy fwd": (copy_fwd, (x,)), "copy bwd": (copy_bwd, (x, dy))}, args.trace,
                  flush)
        return
    for _ in range(2):
        jax.block_until_ready(fwd_jit(*fwd_args))
        jax.block_until_ready(bwd_jit(*bwd_args))


if __name__ == "__main__":
    main()
