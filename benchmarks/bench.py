#!/usr/bin/env python3
"""Benchmark causal_conv1d against the reference under XLA, lax.conv_general_dilated and a copy.

One command, one process:

    python3 benchmarks/bench.py --cases main --out DIR      # the issue's workload + decode
    python3 benchmarks/bench.py --cases all --out DIR       # every case group
    python3 benchmarks/bench.py --quick --out DIR           # tiny shapes, CPU, seconds

Implementations: ``ours`` (jax_causal_conv.causal_conv1d), ``reference`` (the pure-jnp reference,
jitted, so XLA fuses it), ``conv_general_dilated`` (lax.conv_general_dilated with
feature_group_count=D) and ``copy`` (the memory roofline: a device pass over the same bytes).
Ops: ``fwd`` (y from x), ``bwd`` (dx, dw, db from x and dy: jax.vjp's backward function applied to
dy, jitted together with the vjp so each implementation recomputes what its backward needs) and
``fwd+bwd`` (y, dx, dw, db in one jit). The copy's ``fwd`` is ``-x`` (1 read + 1 write; on
32-bit words for 16-bit dtypes), its ``bwd`` is ``dy - x`` (2 reads + 1 write), its ``fwd+bwd``
the sum of the two times.
Decode (``causal_conv1d_update``, one token, shift mode) is timed when the package exports it.

Two timings per op, both device-bound rather than per-call-Python-bound:

* queue: after compile and 3 warm-up calls, a Python loop enqueues N calls (rotating over several
  input sets, so that L2 does not serve repeats) and blocks once at the end; per-call time = loop
  time / N, N chosen so one loop lasts about --min-time; the median over --reps loops.
  JAX dispatch is asynchronous, so the GPU stays busy whenever a call outlasts its dispatch.
* loop: one jitted lax.fori_loop runs the op many times inside a single executable. Every output
  feeds the next call (y and dx -> x and dy, final state -> initial state; for XLA's
  implementations dw and db scaled -> w and b) or, ours' dw and db, the loop's carry (see
  loop_step), two calls deep (three for bwd), so nothing can be hoisted out of the loop or
  dropped, and each loop-carried buffer is rewritten by a call that runs after its last read, so
  XLA inserts no copy: the dependence costs nothing, and no kernel runs around our calls. The
  compiled loop is audited (its large kernels against the single call's, copies); a number that
  fails the audit is marked ``!`` and counted or explained in the notes. Decode runs the natural
  decode loop, (y, state) = update(x, state) with the state donated, and reports copies of large
  arrays in the loop body.

The derived columns (GB/s, fraction of copy bandwidth, time over the copy, speed-ups) use the
--primary method (queue by default); decode always uses the loop (a decode step is shorter than
a dispatch). GB/s counts the floor bytes only: fwd reads x and writes y, bwd reads x and dy and
writes dx, fwd+bwd is the sum; dw, db, states and seq_idx are not counted.

Disturbed medians are flagged in the notes (not corrected): ours' fwd + bwd far from its fwd+bwd,
and a copy more than 5% slower than the median copy of the run's cases of the same bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import statistics
import sys
import time
import warnings
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_causal_conv as jcc
from jax_causal_conv import reference

IMPLS = ("ours", "reference", "conv_general_dilated", "copy")
OPS = ("fwd", "bwd", "fwd+bwd")
GROUPS = ("main", "dtypes", "widths", "shapes", "features", "decode")
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
COPY_MIN_BYTES = 64 << 20  # the copy-bandwidth check applies to arrays at least this large
H200_COPY_FLOOR_TBPS = 3.9  # issue 6: the roofline copy must reach this on the H200

# ------------------------------------------------------------------------------------------ cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One prefill configuration: activation silu and a bias, always."""

    B: int
    L: int
    D: int
    K: int
    dtype: str = "bfloat16"
    layout: str = "BLD"
    features: bool = False  # seq_idx + initial_state + final state (and their gradients)

    @property
    def name(self) -> str:
        extra = " +seq_idx+states" if self.features else ""
        return (f"{DTYPE_NAMES[self.dtype]} B{self.B} L{self.L} D{self.D} K{self.K} "
                f"{self.layout}{extra}")

    @property
    def x_shape(self):
        return (self.B, self.L, self.D) if self.layout == "BLD" else (self.B, self.D, self.L)

    @property
    def state_shape(self):
        P = self.K - 1
        return (self.B, P, self.D) if self.layout == "BLD" else (self.B, self.D, P)

    @property
    def x_bytes(self) -> int:
        return self.B * self.L * self.D * jnp.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One decode step: one token per row, shift mode (no cache_seqlens), silu, bias."""

    B: int
    D: int
    K: int
    dtype: str = "bfloat16"
    layout: str = "BLD"

    @property
    def name(self) -> str:
        return f"decode {DTYPE_NAMES[self.dtype]} B{self.B} D{self.D} K{self.K} {self.layout}"

    @property
    def state_shape(self):
        P = self.K - 1
        return (self.B, P, self.D) if self.layout == "BLD" else (self.B, self.D, P)

    @property
    def floor_bytes(self) -> int:
        # read x and the state, write y and the shifted state
        item = jnp.dtype(self.dtype).itemsize
        return item * (2 * self.B * self.D + 2 * self.B * (self.K - 1) * self.D)


def select_cases(groups, layouts, quick: bool, widths=tuple(range(2, 9)), match=()):
    """The prefill and decode cases of the chosen groups and layouts, in order, no duplicates.

    widths: the K values of the widths group. match: if given, only the cases with one of these
    words in their name (``D256`` for ``bf16 B8 L2048 D256 K4 BLD``).
    """
    if quick:
        B, L, D, K = 2, 64, 32, 4
        shapes = [(4, 16, D), (1, 512, D), (B, L, 8), (B, L, 64)]
        decode = DecodeCase(4, 32, 4)
    else:
        B, L, D, K = 8, 2048, 4096, 4
        shapes = [(64, 128, D), (1, 65536, D), (B, L, 256), (B, L, 8192)]
        decode = DecodeCase(256, 8192, 4)
    prefill, decodes = [], []
    for group in groups:
        if group == "main":
            prefill += [Case(B, L, D, K, layout=lay) for lay in layouts]
            decodes += [dataclasses.replace(decode, layout=lay) for lay in layouts]
        elif group == "dtypes":
            prefill += [Case(B, L, D, K, dtype=dt, layout=lay)
                        for dt in ("float32", "float16") for lay in layouts]
        elif group == "widths":
            prefill += [Case(B, L, D, k, layout=lay) for k in widths for lay in layouts]
        elif group == "shapes":
            prefill += [Case(b, l, d, K, layout=lay) for b, l, d in shapes for lay in layouts]
        elif group == "features":
            prefill += [Case(B, L, D, K, layout=lay, features=f)
                        for lay in layouts for f in (False, True)]
        elif group == "decode":
            decodes += [dataclasses.replace(decode, layout=lay) for lay in layouts]
    keep = lambda case: not match or bool(set(match) & set(case.name.split()))  # noqa: E731
    return ([c for c in dict.fromkeys(prefill) if keep(c)],
            [c for c in dict.fromkeys(decodes) if keep(c)], Case(B, L, D, K))


# ------------------------------------------------------------------------------ implementations


def conv_general(x, weight, bias, initial_state=None, seq_idx=None, *, activation, layout,
                 return_final_state=False):
    """causal_conv1d through lax.conv_general_dilated (feature_group_count=D); no states/seq_idx."""
    del initial_state, seq_idx, return_final_state  # cases with them skip this implementation
    D, K = weight.shape
    if layout == "BLD":
        rhs, dims, bias_shape = weight.T[:, None, :], ("NWC", "WIO", "NWC"), (D,)
    else:
        rhs, dims, bias_shape = weight[:, None, :], ("NCW", "OIW", "NCW"), (D, 1)
    z = lax.conv_general_dilated(
        x, rhs.astype(x.dtype), window_strides=(1,), padding=[(K - 1, 0)],
        dimension_numbers=dims, feature_group_count=D, precision=lax.Precision.HIGHEST,
    )
    z = z.astype(jnp.float32) + bias.astype(jnp.float32).reshape(bias_shape)
    y = z * jax.nn.sigmoid(z) if activation == "silu" else z
    return y.astype(x.dtype)


CONV_FNS = {"ours": jcc.causal_conv1d, "reference": reference.causal_conv1d,
            "conv_general_dilated": conv_general}


def make_ops(conv_fn, case: Case):
    """fwd, bwd and fwd+bwd of one implementation, each returning a flat tuple of arrays.

    Arguments of all three: (x, w, b, s0, seq, dy, dF); fwd ignores dy and dF. Outputs:
    fwd -> (y[, F]); bwd -> (dx, dw, db[, ds0]); fwd+bwd -> (y[, F], dx, dw, db[, ds0]).
    """
    kw = dict(activation="silu", layout=case.layout)

    def primal(x, w, b, s0, seq):
        if case.features:
            return conv_fn(x, w, b, initial_state=s0, seq_idx=seq, return_final_state=True, **kw)
        return (conv_fn(x, w, b, **kw),)

    def vjp(x, w, b, s0, seq):
        if case.features:
            return jax.vjp(lambda x, w, b, s0: primal(x, w, b, s0, seq), x, w, b, s0)
        return jax.vjp(lambda x, w, b: primal(x, w, b, None, None), x, w, b)

    def cotangent(dy, dF):
        return (dy, dF) if case.features else (dy,)

    def fwd(x, w, b, s0, seq, dy, dF):
        del dy, dF
        return tuple(primal(x, w, b, s0, seq))

    def bwd(x, w, b, s0, seq, dy, dF):
        _, pull = vjp(x, w, b, s0, seq)
        return tuple(pull(cotangent(dy, dF)))

    def fwd_bwd(x, w, b, s0, seq, dy, dF):
        out, pull = vjp(x, w, b, s0, seq)
        return tuple(out) + tuple(pull(cotangent(dy, dF)))

    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


def flip_sign(x):
    """-x, computed on 32-bit words for 16-bit dtypes: XLA's elementwise kernel for bf16 ``-x``
    reaches only about 3.0 TB/s on the H200, its 32-bit one 3.75 (measured; see RESULTS.md)."""
    if x.dtype.itemsize != 2 or x.shape[-1] % 2:
        return -x
    words = lax.bitcast_convert_type(x.reshape(*x.shape[:-1], -1, 2), jnp.uint32)
    return lax.bitcast_convert_type(words ^ jnp.uint32(0x80008000), x.dtype).reshape(x.shape)


def copy_ops():
    """The roofline: one elementwise pass over x (fwd) or over x and dy (bwd)."""
    return {"fwd": lambda x, w, b, s0, seq, dy, dF: (flip_sign(x),),
            "bwd": lambda x, w, b, s0, seq, dy, dF: (dy - x,)}


# ---------------------------------------------------------------- loop bodies (the loop method)


def loop_step(op: str, fn: Callable, impl: str, case: Case):
    """One fori_loop iteration over every input set; returns (step, calls per set, first_carry).

    The carry per set is (x, w, b, s0, dy, dF), the arguments of the next call, then (ours only)
    the dw and db of each of the set's calls in the last iteration. Every output of a call is an
    argument of the next one (y -> x or dy, dx -> dy or x, F -> s0, ds0 -> s0 or dF) or kept in
    the carry until the next iteration replaces it, so XLA can neither drop part of the work nor
    hoist it out of the loop. The carry is written by a call that depends on every read of it,
    which lets XLA write it in place (no copy): for that a call's fed-back outputs go through two
    (fwd, fwd+bwd) or three (bwd) calls per iteration.

    dw and db: XLA's implementations compute them apart from dx, in reductions that read x and
    dy, so the next call takes them in, as its w and b (scaled by 1 / (B*L) to stay near 1, in
    small elementwise kernels their times include); without that order XLA copies x, which the
    next call rewrites. Ours computes dx, dw and db in one custom call, which the next call's dx
    input already waits for, and which cannot take the scale in: it ran as two elementwise
    kernels after each of our calls, timed as ours. So ours' dw and db go to the carry, and its w
    and b stay fixed. first_carry(x, w, b, s0, dy, dF) copies one set's arrays (the loop donates
    its carry) and adds zeros where ours' dw and db go.

    The values drift over the iterations: the forward's grow past bf16's range within a few
    hundred, and so do ours' backwards now (with the scaled feedback they shrank to zero). On the
    GPU the kernels take the same time whatever the values: no branch on them, and its arithmetic
    runs at one speed for infinities, NaNs and denormals alike.
    """
    if impl == "copy":  # elementwise passes can write in place one call deep: x <- -x, dy - x
        def copy_step(carry, seq):
            return tuple((fn(x, w, b, s0, seq, dy, dF)[0], w, b, s0, dy, dF)
                         for x, w, b, s0, dy, dF in carry)
        return copy_step, 1, lambda *arrays: _copies(arrays)

    depth = {"fwd": 2, "bwd": 3, "fwd+bwd": 2}[op]
    dx_at = (2 if case.features else 1) if op == "fwd+bwd" else 0  # dx's index in a call's outputs
    feed_back = impl != "ours"
    kept = 0 if op == "fwd" or feed_back else depth  # calls a set whose dw, db the carry keeps
    scale = 1.0 / (case.B * case.L)

    def first_carry(x, w, b, s0, dy, dF):
        return _copies((x, w, b, s0, dy, dF)) + tuple(
            jnp.zeros_like(a) for _ in range(kept) for a in (w, b))

    def call(args, seq):
        x, w, b, s0, dy, dF = args[:6]
        return fn(x, w, b, s0, seq, dy, dF)

    def params_after(args, out):  # the next call's (w, b)
        if feed_back:
            return out[dx_at + 1] * scale, out[dx_at + 2] * scale
        return args[1], args[2]

    def grads(*outs):  # what the carry keeps of these calls' outputs
        return tuple(a for out in outs for a in out[dx_at + 1:dx_at + 3]) if kept else ()

    def after_fwd(args, out):  # (fwd's carry holds no dw, db)
        x, w, b, s0, dy, dF = args
        return (out[0], w, b, out[1] if case.features else s0, dy, dF)

    def after_bwd(args, out, dy):
        s0, dF = args[3], args[5]
        return (out[0], *params_after(args, out), out[3] if case.features else s0, dy, dF)

    def after_fwd_bwd(args, out):  # dx -> x, y -> dy: then the next call's y waits for this dx
        s0, dF = (out[1], out[dx_at + 3]) if case.features else (args[3], args[5])
        return (out[dx_at], *params_after(args, out), s0, out[0], dF)

    def step(carry, seq):
        if op == "fwd":  # A = f(x); B = f(A.y); carry <- B
            A = [after_fwd(c, call(c, seq)) for c in carry]
            return tuple(after_fwd(a, call(a, seq)) for a in A)
        if op == "bwd":  # A = g(x, dy); B = g(A.dx, dy); C = g(B.dx, A.dx); x <- B.dx, rest <- C
            A = [call(c, seq) for c in carry]
            B_args = [after_bwd(c, a, c[4]) for c, a in zip(carry, A)]
            B = [call(b, seq) for b in B_args]
            C_args = [after_bwd(b_args, bo, a[0]) for b_args, bo, a in zip(B_args, B, A)]
            C = [call(c, seq) for c in C_args]
            return tuple((bo[0],) + after_bwd(c_args, co, co[0])[1:4] + (co[0], c_args[5])
                         + grads(a, bo, co) for a, bo, c_args, co in zip(A, B, C_args, C))
        # fwd+bwd: A = h(x, dy); B = h(A.dx, A.y); x <- B.dx, dy <- B.y
        A = [call(c, seq) for c in carry]
        B_args = [after_fwd_bwd(c, a) for c, a in zip(carry, A)]
        B = [call(b, seq) for b in B_args]
        return tuple(after_fwd_bwd(b_args, bo) + grads(a, bo)
                     for b_args, a, bo in zip(B_args, A, B))

    return step, depth, first_carry


def _copies(arrays):
    return tuple(None if a is None else jnp.copy(a) for a in arrays)


# ----------------------------------------------------------------------------------- HLO audit

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"\b(?:pred|[suf]\d+|bf16|f8\w*)\[([\d,]*)\]")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|branch_computations)=\{?%?([\w.\-]+)")
_HEAVY = {"fusion", "custom-call", "convolution", "copy", "copy-start", "dot", "reduce",
          "reduce-window", "select-and-scatter", "scatter", "gather", "transpose", "concatenate",
          "dynamic-update-slice", "sort"}


def _computations(hlo: str):
    comps, name, entry = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY\s+)?%([\w.\-]+) .*\{\s*$", line)
        if head:
            name = head.group(2)
            comps[name] = []
            if head.group(1):
                entry = name
        elif line.startswith("}"):
            name = None
        elif name is not None:
            m = _INSTR.match(line)
            if m:
                comps[name].append(m.groups())
    return comps, entry


def _largest(shape: str) -> int:
    return max([math.prod(int(d) for d in dims.split(",") if d) for dims in _ARRAY.findall(shape)]
               or [0])


def _count(comps, name, big, seen=()):
    """(kernels, copies) producing an array of >= big elements in a computation, through calls."""
    kernels = copies = 0
    for instr, shape, opcode, rest in comps.get(name, []):
        if opcode in ("call", "async-start", "conditional", "while"):
            for callee in _CALLED.findall(rest):
                if callee not in seen:
                    k, c = _count(comps, callee, big, seen + (name,))
                    kernels, copies = kernels + k, copies + c
        elif opcode in _HEAVY and _largest(shape) >= big:
            kernels += 1
            copies += opcode in ("copy", "copy-start") or "copy" in instr.split(".")[0]
    return kernels, copies


def _find_while_body(comps, name, seen=()):
    for _, _, opcode, rest in comps.get(name, []):
        if opcode == "while":
            m = re.search(r"\bbody=%?([\w.\-]+)", rest)
            return m.group(1) if m else None
        if opcode in ("call", "async-start", "conditional"):
            for callee in _CALLED.findall(rest):
                if callee not in seen:
                    found = _find_while_body(comps, callee, seen + (name,))
                    if found:
                        return found
    return None


def audit_loop(single_hlo: str, loop_hlo: str, calls_per_iter: int, iters: int, big: int):
    """'' when the loop runs calls_per_iter x the single call's large kernels, else the problem."""
    comps, entry = _computations(single_hlo)
    per_call, _ = _count(comps, entry, big)
    comps, entry = _computations(loop_hlo)
    body = _find_while_body(comps, entry)
    if body is None:  # unrolled: the whole program holds iters x the body
        kernels, copies = _count(comps, entry, big)
        expected = per_call * calls_per_iter * iters
    else:
        kernels, copies = _count(comps, body, big)
        expected = per_call * calls_per_iter
    if kernels == expected or (expected and not copies and kernels % expected == 0):
        return ""  # a multiple: XLA unrolled the body
    if copies and kernels - copies == expected:
        return f"{copies} copies of large arrays per loop iteration"
    return (f"loop iteration has {kernels} large kernels ({copies} copies), {expected} expected "
            f"({calls_per_iter} calls x {per_call}): fused across calls or hoisted")


def count_copies(loop_hlo: str, big: int) -> int:
    comps, entry = _computations(loop_hlo)
    body = _find_while_body(comps, entry)
    return _count(comps, body, big)[1] if body else 0


# -------------------------------------------------------------------------------------- timing


@dataclasses.dataclass
class Timing:
    queue_us: Optional[float] = None
    loop_us: Optional[float] = None
    audit: str = ""  # why the loop number is not the single call's work ('' when it is)


def _block(tree):
    jax.block_until_ready(tree)


def time_queue(call: Callable[[int], object], n: int, inputs, reps: int, min_time: float):
    """Median per-call seconds of N asynchronously enqueued calls; call(i) runs input set i % n."""
    _block(call(0))  # compiles
    for i in range(1, 4):  # 3 warm-up runs
        out = call(i % n)
    _block(out)

    def run(calls):
        _block(inputs)
        t0 = time.perf_counter()
        for i in range(calls):
            out = call(i % n)
        _block(out)
        return time.perf_counter() - t0

    calls = n
    elapsed = run(calls)
    while elapsed < min_time / 10 and calls < 1_000_000:
        calls *= 10
        elapsed = run(calls)
    calls = max(n, math.ceil(calls * min_time / elapsed))
    return statistics.median(run(calls) / calls for _ in range(reps))


def time_loop(step, calls_per_iter: int, carry, consts, args, per_call_guess: float):
    """Median per-call seconds of a jitted fori_loop of `step`, its trip count and its HLO.

    The carry is donated (so the loop runs in place) and replaced after each run. The trip
    count aims at --min-time per run from the queue method's per-call time; when that guess was
    inflated by dispatch, the loop is rebuilt longer once (not in --quick).
    """
    def build(iters):
        def loop(carry, consts):
            return lax.fori_loop(0, iters, lambda i, c: step(c, consts), carry)
        return jax.jit(loop, donate_argnums=0).lower(carry, consts).compile()

    def run(compiled, carry):
        _block(carry)
        t0 = time.perf_counter()
        carry = compiled(carry, consts)
        _block(carry)
        return time.perf_counter() - t0, carry

    # at least 2 iterations: XLA removes a loop of trip count 1
    iters = max(2, math.ceil(args.min_time / (per_call_guess * calls_per_iter)))
    compiled = build(iters)
    _, carry = run(compiled, carry)  # warm-up
    elapsed, carry = run(compiled, carry)
    if elapsed < args.min_time / 2 and not args.quick:
        iters = max(iters + 1, math.ceil(iters * args.min_time / elapsed))
        compiled = build(iters)
        _, carry = run(compiled, carry)
    samples = []
    for _ in range(args.reps):
        elapsed, carry = run(compiled, carry)
        samples.append(elapsed / (iters * calls_per_iter))
    return statistics.median(samples), iters, compiled.as_text()


# ------------------------------------------------------------------------------------- inputs


def n_input_sets(bytes_per_call: int, l2_bytes: int, quick: bool) -> int:
    """Enough sets that one rotation touches 3x the L2, at least 3 (16 at most; 2 in --quick)."""
    if quick:
        return 2
    return int(min(16, max(3, math.ceil(3 * l2_bytes / max(bytes_per_call, 1)))))


def make_params(rng, case, param_dtype: Optional[str] = None):
    """Weight (D, K) and bias (D,) of a prefill or decode case, drawn from rng, in param_dtype or
    in x's dtype when it is None."""
    params = jnp.dtype(param_dtype or case.dtype)
    w = jnp.asarray(rng.uniform(-1, 1, (case.D, case.K)) / math.sqrt(case.K), params)
    b = jnp.asarray(rng.uniform(-0.5, 0.5, (case.D,)), params)
    return w, b


def packed_seq_idx(rng, batch: int, length: int, sequences: int = 4):
    """seq_idx of `sequences` packed sequences per row, at random boundaries (the features cases'
    four; one: a single id, no boundary)."""
    cuts = np.sort(rng.choice(np.arange(1, length), size=(batch, sequences - 1), replace=True),
                   axis=1)
    return jnp.asarray((np.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)


def make_inputs(case: Case, n_sets: int, seed: int = 0, param_dtype: Optional[str] = None):
    """n_sets tuples (x, w, b, s0, seq, dy, dF); w and b (and seq_idx) shared by all sets.

    w and b are in param_dtype, or in x's dtype when it is None.
    """
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(case.dtype)
    w, b = make_params(rng, case, param_dtype)
    seq = None
    if case.features:
        seq = packed_seq_idx(rng, case.B, case.L)
    key = jax.random.PRNGKey(seed)
    sets = []
    for _ in range(n_sets):
        key, kx, kdy, ks, kf = jax.random.split(key, 5)
        x = jax.random.normal(kx, case.x_shape, dtype)
        dy = jax.random.normal(kdy, case.x_shape, dtype)
        s0 = jax.random.normal(ks, case.state_shape, dtype) if case.features else None
        dF = jax.random.normal(kf, case.state_shape, dtype) if case.features else None
        sets.append((x, w, b, s0, seq, dy, dF))
    return sets


def rel_err(out, ref) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


def check_case(case: Case, inputs, impls):
    """Largest relative error of fwd+bwd outputs of each implementation against float32."""
    up = tuple(a if a is None or a.dtype == jnp.int32 else a.astype(jnp.float32) for a in inputs)
    oracle = jax.jit(make_ops(reference.causal_conv1d, case)["fwd+bwd"])(*up)
    errs = {}
    for impl in impls:
        got = jax.jit(make_ops(CONV_FNS[impl], case)["fwd+bwd"])(*inputs)
        errs[impl] = max(rel_err(g, r) for g, r in zip(got, oracle))
    return errs


# ------------------------------------------------------------------------------ bench a case


def bench_case(case: Case, args: argparse.Namespace, log):
    """Check and time every implementation and op of one prefill case; (results, notes)."""
    impls = [i for i in args.impls if not (i == "conv_general_dilated" and case.features)]
    n_sets = n_input_sets(2 * case.x_bytes, args.l2_mb << 20, args.quick)
    sets = make_inputs(case, n_sets, param_dtype=args.param_dtype)
    big = case.B * case.L * case.D // 2
    results, notes = {}, []
    if not args.no_check:
        errs = check_case(case, sets[0], [i for i in impls if i != "copy"])
        for impl, err in errs.items():
            tol = reference.TOLERANCE[jnp.dtype(case.dtype)]
            status = "ok" if err <= tol else "FAILED"
            log(f"  check {impl}: max rel err {err:.2e} (tolerance {tol:.0e}) {status}")
            if err > tol:
                notes.append(f"{impl}: max relative error {err:.2e} > {tol:.0e} against the "
                             "float32 reference")
    for impl in impls:
        ops = copy_ops() if impl == "copy" else make_ops(CONV_FNS[impl], case)
        for op, fn in ops.items():
            compiled = jax.jit(fn).lower(*sets[0]).compile()
            timing = Timing()
            timing.queue_us = 1e6 * time_queue(lambda i: compiled(*sets[i]), n_sets, sets,
                                               args.reps, args.min_time)
            if not args.no_loop:
                step, depth, first_carry = loop_step(op, fn, impl, case)
                carry = tuple(first_carry(x, w, b, s0, dy, dF)
                              for x, w, b, s0, _, dy, dF in sets)
                per_call, iters, loop_hlo = time_loop(
                    step, depth * n_sets, carry, sets[0][4], args, timing.queue_us * 1e-6)
                timing.loop_us = 1e6 * per_call
                timing.audit = audit_loop(compiled.as_text(), loop_hlo, depth * n_sets, iters,
                                          big)
            results[(impl, op)] = timing
            log(f"  {impl:>20} {op:>7}: queue {timing.queue_us:9.1f} us"
                + (f", loop {timing.loop_us:9.1f} us" if timing.loop_us is not None else "")
                + (f"  [{timing.audit}]" if timing.audit else ""))
    if "copy" in impls:
        cf, cb = results[("copy", "fwd")], results[("copy", "bwd")]
        results[("copy", "fwd+bwd")] = Timing(
            queue_us=cf.queue_us + cb.queue_us,
            loop_us=None if cf.loop_us is None else cf.loop_us + cb.loop_us)
    # (not in --quick: there every call is host-bound, and one dispatch of fwd+bwd saves one)
    note = "" if args.quick else consistency_note(results)
    if note:
        notes.append(note)
        log(f"  {note}")
    return results, notes


# ours' fwd+bwd runs the same kernels as its fwd and its bwd (custom calls: XLA fuses nothing
# across them), so its median is their sum within a few percent; beyond this, one of the three
# medians was disturbed (a queue median once came out at 1.7x its value in the same run).
CONSISTENCY_TOLERANCE = 0.15


def consistency_note(results) -> str:
    """A note when ours' fwd + bwd and fwd+bwd queue medians disagree by more than
    CONSISTENCY_TOLERANCE of fwd+bwd ('' when they agree or are not all there)."""
    times = [results.get(("ours", op)) for op in ("fwd", "bwd", "fwd+bwd")]
    if any(t is None or t.queue_us is None for t in times):
        return ""
    fwd, bwd, both = (t.queue_us for t in times)
    if abs(fwd + bwd - both) <= CONSISTENCY_TOLERANCE * both:
        return ""
    return (f"ours: fwd + bwd = {fwd:.1f} + {bwd:.1f} us against fwd+bwd {both:.1f} us (queue): "
            "one of the three medians was disturbed; time this case again")


# Cases whose arrays have the same bytes get the same copy, whose medians in one run agree within
# 1-2% on the device; the twenty-seventh session's features run read one case's copy 20% slower
# than the others' (81.4 against 67.4-68.2 us), along with that case's own kernels and the case
# before it: a disturbed device, which the consistency note above (7.7% there) did not flag.
COPY_SPREAD_TOLERANCE = 0.05


def copy_outlier_notes(prefill, primary: str) -> list:
    """Notes naming each case whose copy ran more than COPY_SPREAD_TOLERANCE slower than the
    median copy of the run's cases with the same bytes (at least three, each of at least
    COPY_MIN_BYTES: smaller copies are host-bound and vary by construction)."""
    groups = {}
    for case, results in prefill.items():
        if case.x_bytes >= COPY_MIN_BYTES:
            groups.setdefault(case.x_bytes, []).append((case, results))
    notes = []
    for members in groups.values():
        if len(members) < 3:
            continue
        for op in ("fwd", "bwd"):
            times = [(case, primary_us(results[("copy", op)], primary))
                     for case, results in members if ("copy", op) in results]
            times = [(case, t) for case, t in times if t is not None]
            if len(times) < 3:
                continue
            median = float(np.median([t for _, t in times]))
            notes += [f"{case.name}: the copy's {op} took {t:.1f} us against {median:.1f} us, the "
                      "median of this run's cases of the same bytes: the device was disturbed "
                      "while this case ran; time it again"
                      for case, t in times if t > (1 + COPY_SPREAD_TOLERANCE) * median]
    return notes


def make_decode_inputs(case: DecodeCase, n_sets: int, seed: int = 0,
                       param_dtype: Optional[str] = None):
    """n_sets tokens x and states, and the shared weight and bias (in param_dtype, or x's)."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(case.dtype)
    w, b = make_params(rng, case, param_dtype)
    key = jax.random.PRNGKey(seed)
    xs, states = [], []
    for _ in range(n_sets):
        key, kx, ks = jax.random.split(key, 3)
        xs.append(jax.random.normal(kx, (case.B, case.D), dtype))
        states.append(jax.random.normal(ks, case.state_shape, dtype))
    return xs, states, w, b


def bench_decode(case: DecodeCase, args: argparse.Namespace, log):
    """Per-step time of causal_conv1d_update (ours, the reference) and a same-bytes copy."""
    impls = {}
    if "ours" in args.impls:
        impls["ours"] = jcc.causal_conv1d_update
    if "reference" in args.impls and hasattr(reference, "causal_conv1d_update"):
        impls["reference"] = reference.causal_conv1d_update
    n_sets = n_input_sets(case.floor_bytes, args.l2_mb << 20, args.quick)
    xs, states, w, b = make_decode_inputs(case, n_sets, param_dtype=args.param_dtype)
    results, notes = {}, []

    def update_fn(impl):
        return lambda x, s, w, b: impls[impl](x, s, w, b, activation="silu", layout=case.layout)

    if not args.no_check and "reference" in impls:
        x32, s32 = xs[0].astype(jnp.float32), states[0].astype(jnp.float32)
        oracle = jax.jit(update_fn("reference"))(x32, s32, w.astype(jnp.float32),
                                                 b.astype(jnp.float32))
        for impl in impls:
            got = jax.jit(update_fn(impl))(xs[0], states[0], w, b)
            err = max(rel_err(g, r) for g, r in zip(got, oracle))
            tol = reference.TOLERANCE[jnp.dtype(case.dtype)]
            log(f"  check {impl}: max rel err {err:.2e} (tolerance {tol:.0e}) "
                f"{'ok' if err <= tol else 'FAILED'}")
            if err > tol:
                notes.append(f"{impl}: max relative error {err:.2e} > {tol:.0e}")

    for impl in impls:
        fn = update_fn(impl)
        timing = Timing()
        # queue: one jitted step per call, the donated state threaded through
        step_fn = jax.jit(fn, donate_argnums=1)
        live = [jnp.copy(s) for s in states]

        def queued(i):
            y, live[i] = step_fn(xs[i], live[i], w, b)
            return y

        timing.queue_us = 1e6 * time_queue(queued, n_sets, xs, args.reps, args.min_time)

        # loop: per set, (y, state) <- update(x, state); x fixed, y into a slot
        def step(carry, consts):
            w, b, xs_ = consts
            return tuple(fn(x, s, w, b) for x, (_, s) in zip(xs_, carry))

        carry = tuple((jnp.zeros((case.B, case.D), jnp.dtype(case.dtype)), jnp.copy(s))
                      for s in states)
        per_call, _, loop_hlo = time_loop(step, n_sets, carry, (w, b, tuple(xs)), args,
                                          timing.queue_us * 1e-6)
        timing.loop_us = 1e6 * per_call
        copies = count_copies(loop_hlo, case.B * case.D)
        timing.audit = f"{copies} copies of large arrays per loop iteration" if copies else ""
        results[(impl, "update")] = timing
        log(f"  {impl:>20}  update: queue {timing.queue_us:9.1f} us, loop {timing.loop_us:9.1f} us"
            + (f"  [{timing.audit}]" if timing.audit else ""))

    # the same bytes as one read + one write of (x, state), negated on 32-bit words as the prefill
    # copy (bf16 `-a` runs XLA's 16-bit elementwise kernel, the slower one: see flip_sign)
    flat = case.floor_bytes // 2 // jnp.dtype(case.dtype).itemsize
    arrays = [jax.random.normal(jax.random.PRNGKey(i), (flat,), jnp.dtype(case.dtype))
              for i in range(n_sets)]
    neg = jax.jit(flip_sign)
    timing = Timing(queue_us=1e6 * time_queue(lambda i: neg(arrays[i]), n_sets, arrays,
                                              args.reps, args.min_time))
    per_call, _, _ = time_loop(lambda c, _: tuple(flip_sign(a) for a in c), n_sets,
                               tuple(jnp.copy(a) for a in arrays), (), args,
                               timing.queue_us * 1e-6)
    timing.loop_us = 1e6 * per_call
    results[("copy", "update")] = timing
    log(f"  {'copy':>20}  update: queue {timing.queue_us:9.1f} us, loop {timing.loop_us:9.1f} us")
    return results, notes


# ------------------------------------------------------------------------------------- report


def floor_bytes(case: Case, op: str) -> int:
    return {"fwd": 2, "bwd": 3, "fwd+bwd": 5}[op] * case.x_bytes


def primary_us(timing: Timing, primary: str) -> Optional[float]:
    if primary == "loop" and timing.loop_us is not None:
        return timing.loop_us
    return timing.queue_us


def _fmt(v, spec, suffix=""):
    return "-" if v is None else f"{v:{spec}}{suffix}"


def table_rows(case_name, results, op_bytes, primary, ops):
    """Markdown rows for one case; op_bytes(op) gives the floor bytes of an op."""
    rows = []
    for op in ops:
        copy = results.get(("copy", op))
        base = {i: results.get((i, op)) for i in ("reference", "conv_general_dilated")}
        for impl in IMPLS:
            t = results.get((impl, op))
            if t is None:
                continue
            us = primary_us(t, primary)
            gbs = op_bytes(op) / (us * 1e-6) / 1e9
            frac = primary_us(copy, primary) / us if copy else None
            speed = {k: (primary_us(v, primary) / us if v else None) for k, v in base.items()}
            loop = _fmt(t.loop_us, ".1f") + (" !" if t.audit else "")
            rows.append(
                f"| {case_name} | {impl} | {op} | {_fmt(t.queue_us, '.1f')} | {loop} "
                f"| {gbs:.4g} | {_fmt(frac, '.2f')} | {_fmt(frac and 1 / frac, '.2f')} "
                f"| {_fmt(speed['reference'], '.2f', 'x')} "
                f"| {_fmt(speed['conv_general_dilated'], '.2f', 'x')} |")
    return rows


HEADER = ("| case | implementation | op | median us (queue) | median us (loop) | GB/s | "
          "fraction of copy BW | time / copy | speed-up vs reference | "
          "speed-up vs conv_general_dilated |\n|---|---|---|---|---|---|---|---|---|---|")


def audit_notes(results) -> list:
    """Every failed loop audit of ours and the copy; a count for the baselines (XLA fuses them
    across calls or hoists parts of them in a loop, which the queue numbers do not see)."""
    notes, flagged, total = [], 0, 0
    for case, res in results.items():
        for (impl, op), t in res.items():
            if t.loop_us is None:
                continue
            if impl in ("ours", "copy"):
                if t.audit:
                    notes.append(f"{case.name}: {impl} {op}, loop method: {t.audit}")
            else:
                total += 1
                flagged += bool(t.audit)
    if flagged:
        notes.append(f"{flagged} of {total} baseline loop numbers failed the audit (XLA fused "
                     "consecutive calls or hoisted work out of the loop, so the loop does other "
                     "work than the single call); details under 'audit' in bench.json")
    return notes


# The issue's targets for ours: time over the same-bytes copy, and absolute times on the H200.
RATIO_TARGET = {"fwd": 1.10, "bwd": 1.20}
# A copy this many times slower queued than in the loop: the queue is host-bound (target_lines).
HOST_BOUND = 1.15
FWD_BWD_US_TARGET = 195.0
DECODE_US_TARGET = 12.0


def target_lines(prefill, decode, base: Case, primary: str, quick: bool):
    """A markdown table of the issue's targets met or missed by ours, from what was run.

    A case whose copy takes over HOST_BOUND times longer queued than in the loop is host-bound in
    the queue for every implementation (small tensors): its rows take the loop method, where ours
    and the copy have loop numbers that passed the audit.
    """
    def method(case):
        res = prefill.get(case, {})
        copy = res.get(("copy", "fwd"))
        loops_ok = all(t.loop_us is not None and not t.audit
                       for (impl, _), t in res.items() if impl in ("ours", "copy"))
        if (primary == "queue" and copy is not None and loops_ok
                and copy.queue_us > HOST_BOUND * copy.loop_us):
            return "loop"
        return primary

    def us(case, op, impl="ours"):
        t = prefill.get(case, {}).get((impl, op))
        return None if t is None else primary_us(t, method(case))

    def over_copy(case, op):
        mine, copy = us(case, op), us(case, op, "copy")
        return None if mine is None or copy is None else mine / copy

    rows = []

    def add(what, case, op, value, limit, how=None):
        if value is not None:
            rows.append(f"| {what} | {case.name} | {op} | {how or method(case)} | {value:.3g} "
                        f"| {limit:.3g} | {'yes' if value <= limit else '**no**'} |")

    for case in prefill:
        main = dataclasses.replace(base, layout=case.layout)
        same_shape = (case.B, case.L, case.D) == (main.B, main.L, main.D)
        for op, limit in RATIO_TARGET.items():
            if case == main or (same_shape and case.K == main.K and not case.features):
                add("time / copy", case, op, over_copy(case, op), limit)
            elif not same_shape and case.K == main.K and case.dtype == main.dtype:
                add("time / copy within 15%", case, op, over_copy(case, op), 1.15 * limit)
        if case == main:
            add("fwd+bwd us", case, "fwd+bwd", us(case, "fwd+bwd"), FWD_BWD_US_TARGET)
        for op in OPS:
            if same_shape and case.K != main.K and case.dtype == main.dtype:
                ref = us(main, op)
                add("time / time at K=%d" % main.K, case, op,
                    None if ref is None or us(case, op) is None else us(case, op) / ref, 1.10)
            if case.features:
                plain = dataclasses.replace(case, features=False)
                ref = us(plain, op)
                add("time / time without", case, op,
                    None if ref is None or us(case, op) is None else us(case, op) / ref, 1.10)
    for case, res in decode.items():
        t = res.get(("ours", "update"))
        if t is not None:
            add("update us per step", case, "update", t.loop_us, DECODE_US_TARGET, how="loop")
    if not rows:
        return []
    head = ["", "## Targets (issue 6) for ours", ""]
    if quick:
        head += ["A --quick run: tiny shapes on whatever device this is; the limits are the "
                 "H200's, so 'no' here means nothing.", ""]
    return head + ["| target | case | op | method | value | limit | met |",
                   "|---|---|---|---|---|---|---|"] + rows


def report_lines(env, primary, prefill, decode):
    lines = ["# causal_conv1d benchmark", "",
             f"{env}. Command: `{' '.join(['benchmarks/bench.py'] + sys.argv[1:])}`", "",
             f"Derived columns from the **{primary}** method (decode: loop). GB/s counts the "
             "floor bytes (fwd: read x, write y; bwd: read x and dy, write dx; fwd+bwd: both; "
             "decode: read x and the state, write y and the state). 'time / copy' is the "
             "implementation's time over the same-bytes copy's (targets: fwd <= 1.10, "
             "bwd <= 1.20); the copy's fwd+bwd is the sum of its fwd and bwd. Loop times "
             "marked ! failed the HLO audit (see the notes).", "",
             HEADER]
    for case, res in prefill.items():
        lines += table_rows(case.name, res, lambda op, c=case: floor_bytes(c, op), primary, OPS)
    for case, res in decode.items():
        lines += table_rows(case.name, res, lambda op, c=case: c.floor_bytes, "loop", ("update",))
    return lines


def plot(path, prefill, primary, main_case: Case, title: str, log):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    same = lambda c: (c.dtype, c.K, c.D, c.features) == (  # noqa: E731
        main_case.dtype, main_case.K, main_case.D, main_case.features)
    cases = sorted((c for c in prefill if same(c)), key=lambda c: c.L)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = dict(zip(IMPLS, ("tab:blue", "tab:green", "tab:purple", "tab:gray")))
    for ax, op in zip(axes, ("fwd", "bwd")):
        for impl in IMPLS:
            for layout, style in (("BLD", "-o"), ("BDL", "--s")):
                pts = [(c.L, floor_bytes(c, op) / (primary_us(prefill[c][(impl, op)], primary)
                                                   * 1e-6) / 1e9)
                       for c in cases if c.layout == layout and (impl, op) in prefill[c]]
                if pts:
                    ax.plot(*zip(*pts), style, color=colors[impl], label=f"{impl} {layout}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("L (B varies with L: see the table)")
        ax.set_ylabel("effective GB/s (floor bytes / time)")
        ax.set_title(f"{op}: {DTYPE_NAMES[main_case.dtype]}, D={main_case.D}, K={main_case.K}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def environment() -> str:
    dev = jax.devices()[0]
    return (f"{dev.platform} {getattr(dev, 'device_kind', '')}, jax {jax.__version__}, "
            f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="main",
                   help=f"comma-separated groups from {', '.join(GROUPS)}, or 'all'")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help="comma-separated implementations (default: all)")
    p.add_argument("--layouts", default=None,
                   help="comma-separated layouts (default BLD,BDL; BLD in --quick)")
    p.add_argument("--widths", default="2,3,4,5,6,7,8",
                   help="comma-separated K values of the widths group (default 2 to 8)")
    p.add_argument("--match", default="",
                   help="comma-separated words: time only the chosen groups' cases with one of "
                        "them in their name, e.g. D256,L128")
    p.add_argument("--out", default=None, help="folder for bench.md, bench.png and bench.json")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes and few repetitions: a CPU smoke run in seconds")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 20; 3 quick)")
    p.add_argument("--min-time", type=float, default=None,
                   help="seconds per timed loop (default 0.02; 0.002 quick)")
    p.add_argument("--primary", choices=("queue", "loop"), default="queue",
                   help="method behind the derived columns (decode always uses loop)")
    p.add_argument("--no-loop", action="store_true", help="skip the fori_loop method (prefill)")
    p.add_argument("--no-check", action="store_true", help="skip the accuracy check")
    p.add_argument("--param-dtype", choices=("float32",), default=None,
                   help="weight and bias dtype (default: x's dtype); float32 as in "
                        "mixed-precision training")
    p.add_argument("--l2-mb", type=int, default=50, help="L2 size used to size the input rotation")
    p.add_argument("--copy-min-tbps", type=float, default=None,
                   help="warn on a GPU when the copy of a large array is slower than this "
                        f"(default: issue 6's {H200_COPY_FLOOR_TBPS} TB/s on an H200, no check on "
                        "other GPUs, whose memory is another speed)")
    args = p.parse_args(argv)
    groups = GROUPS if args.cases == "all" else tuple(g for g in args.cases.split(",") if g)
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        p.error(f"unknown case group(s) {bad}; choose from {GROUPS} or 'all'")
    args.groups = groups
    args.impls = tuple(i for i in args.impls.split(",") if i)
    bad = [i for i in args.impls if i not in IMPLS]
    if bad:
        p.error(f"unknown implementation(s) {bad}; choose from {IMPLS}")
    args.layouts = tuple((args.layouts or ("BLD" if args.quick else "BLD,BDL")).split(","))
    bad = [lay for lay in args.layouts if lay not in ("BLD", "BDL")]
    if bad:
        p.error(f"unknown layout(s) {bad}; choose from BLD, BDL")
    try:
        args.widths = tuple(int(k) for k in args.widths.split(",") if k)
    except ValueError:
        p.error(f"--widths takes comma-separated integers, got {args.widths!r}")
    bad = [k for k in args.widths if k < 1]
    if bad or not args.widths:
        p.error(f"--widths needs kernel widths >= 1, got {args.widths!r}")
    args.match = tuple(word for word in args.match.split(",") if word)
    if args.match and not any(select_cases(args.groups, args.layouts, args.quick, args.widths,
                                           args.match)[:2]):
        p.error(f"--match {','.join(args.match)} selects none of the chosen groups' cases")
    args.reps = args.reps or (3 if args.quick else 20)
    args.min_time = args.min_time or (0.002 if args.quick else 0.02)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    env = environment()
    on_gpu = jax.devices()[0].platform == "gpu"
    copy_floor = args.copy_min_tbps
    if copy_floor is None and "H200" in getattr(jax.devices()[0], "device_kind", ""):
        copy_floor = H200_COPY_FLOOR_TBPS
    log(f"bench: {env}; groups {','.join(args.groups)}; reps {args.reps}, "
        f"min time {args.min_time * 1e3:g} ms, primary {args.primary}")
    prefill_cases, decode_cases, base = select_cases(args.groups, args.layouts, args.quick,
                                                     args.widths, args.match)
    prefill, decode, notes, warn = {}, {}, [], []
    t_start = time.perf_counter()
    for case in prefill_cases:
        t0 = time.perf_counter()
        log(f"case {case.name}")
        prefill[case], case_notes = bench_case(case, args, log)
        notes += [f"{case.name}: {n}" for n in case_notes]
        copy = prefill[case].get(("copy", "fwd"))
        if copy is not None:
            tbps = floor_bytes(case, "fwd") / (primary_us(copy, args.primary) * 1e-6) / 1e12
            log(f"  copy bandwidth {tbps:.2f} TB/s; case took {time.perf_counter() - t0:.1f} s")
            if (on_gpu and copy_floor is not None and case.x_bytes >= COPY_MIN_BYTES
                    and tbps < copy_floor):
                warn.append(f"{case.name}: the copy reached {tbps:.2f} TB/s < "
                            f"{copy_floor} TB/s: the roofline itself is off")
    for case in decode_cases:
        if not hasattr(jcc, "causal_conv1d_update"):
            notes.append("decode skipped: jax_causal_conv does not export causal_conv1d_update")
            log(notes[-1])
            break
        log(f"case {case.name}")
        decode[case], case_notes = bench_decode(case, args, log)
        notes += [f"{case.name}: {n}" for n in case_notes]
    if decode and not hasattr(reference, "causal_conv1d_update"):
        notes.append("decode: no reference.causal_conv1d_update to compare with")
    for w in warn:
        log(f"WARNING: {w}")
    copy_notes = [] if args.quick else copy_outlier_notes(prefill, args.primary)
    for n in copy_notes:
        log(f"WARNING: {n}")
    notes = warn + copy_notes + notes + audit_notes({**prefill, **decode})
    lines = report_lines(env, args.primary, prefill, decode)
    lines += target_lines(prefill, decode, base, args.primary, args.quick)
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    lines += ["", f"Total time {time.perf_counter() - t_start:.0f} s."]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench.md"), "w") as f:
            f.write(report)
        raw = [{"case": c.name, **dataclasses.asdict(c), "impl": i, "op": o,
                **dataclasses.asdict(t)}
               for group in (prefill, decode) for c, res in group.items()
               for (i, o), t in res.items()]
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump({"environment": env, "primary": args.primary, "results": raw}, f, indent=1)
        if prefill:
            main_case = next(iter(prefill))
            png = os.path.join(args.out, "bench.png")
            if plot(png, prefill, args.primary, main_case, env, log):
                log(f"wrote {png}")
        log(f"wrote {os.path.join(args.out, 'bench.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
