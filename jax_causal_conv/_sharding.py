"""causal_conv1d under plain ``jax.jit`` on a device mesh: batch, channel and sequence sharding.

Each primitive call is wrapped in ``jax.experimental.custom_partitioning`` with a Shardy sharding
rule, so the partitioner keeps the shardings of x (and lets them flow to y) instead of gathering.
It then calls ``_partition`` with the shardings it chose, and every device runs the kernel on its
own shard:

- Batch (B) and channel (D) shards are independent: no communication in the forward; the backward
  sums dweight and dbias (psum, in the accumulation dtype) over the mesh axes that shard B or L,
  never over those sharding D.
- Sequence (L) shards (context parallelism): each device sends the last K-1 steps of its x (and
  of seq_idx) to the next device with a collective-permute; they become that device's initial
  state, while the first shard uses the real initial_state. The final state is the last shard's.
  The backward sends each shard's initial-state gradient back to the previous device, which adds
  it to the gradient of its last K-1 steps; only the first shard's is the initial_state gradient.
- With seq_idx, the kernel treats a shard's initial state as part of the shard's first segment.
  Halo rows of another segment are therefore zeroed (and so get no gradient). This is exact when
  every segment id labels one contiguous run of positions, which is what packed sequences are.

``custom_partitioning`` has no vmap rule, so the wrapped call is also a
``jax.custom_batching.custom_vmap`` whose rule folds the vmapped axis into the batch, as the
primitives' own batching rule does: a vmapped call stays one kernel launch.

Inside ``shard_map`` the primitives are bound directly: each device's block is then a whole
problem, as for any other op.
"""

from __future__ import annotations

import functools
import math
import re
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _primitives
from .reference import accumulation_dtype

_STATE_SLOTS = ("initial_state", "final_state", "dfinal_state", "dinitial_state")
_X_SLOTS = ("x", "y", "dy", "dx")


class _Plan(NamedTuple):
    """How one call is split over the mesh: the axes that shard x's batch, length and channels."""

    mesh: jax.sharding.Mesh
    batch_axes: tuple
    length_axes: tuple
    channel_axes: tuple
    group_axes: tuple  # the batch axes, when they split the weight groups evenly; else ()
    channel_last: bool
    batch: int
    groups: int
    state_len: int

    def count(self, axes) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    @property
    def time_axis(self) -> int:
        return 1 if self.channel_last else 2

    def spec(self, slot: str) -> P:
        b, l, d = (a or None for a in (self.batch_axes, self.length_axes, self.channel_axes))
        if slot in _X_SLOTS:
            return P(b, l, d) if self.channel_last else P(b, d, l)
        if slot in _STATE_SLOTS:
            return P(b, None, d) if self.channel_last else P(b, d, None)
        if slot == "seq_idx":
            return P(b, l)
        g = self.group_axes or None
        if slot in ("weight", "dweight"):
            return P(g, d, None)
        return P(g, d)  # bias, dbias

    def sharding(self, slot: str) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(slot))


def _axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _make_plan(mesh, x, weight, channel_last: bool) -> _Plan:
    """Reads the plan off x's sharding; falls back to replicating the batch or the channels
    where their split cannot work, and raises for sequence splits that cannot work."""
    if channel_last:
        batch, length, channels = x.shape
    else:
        batch, channels, length = x.shape
    groups, width = weight.shape[0], weight.shape[2]
    state_len = width - 1
    sharding = x.sharding
    if mesh.empty or not isinstance(sharding, NamedSharding):
        raise ValueError(
            "causal_conv1d: partitioning over several devices needs the inputs' shardings to be "
            f"NamedShardings of a jax.sharding.Mesh, got {sharding}"
        )
    spec = tuple(sharding.spec) + (None,) * (3 - len(sharding.spec))
    b, l, d = (spec[0], spec[1], spec[2]) if channel_last else (spec[0], spec[2], spec[1])
    plan = _Plan(mesh, _axes(b), _axes(l), _axes(d), (), channel_last, batch, groups, state_len)

    n_batch = plan.count(plan.batch_axes)
    rows = batch // n_batch
    per_group = batch // groups
    # Uneven shards, or batch shards that split weight groups unevenly, are gathered instead.
    if batch % n_batch or (groups > 1 and rows % per_group and per_group % rows):
        plan = plan._replace(batch_axes=())
    elif groups > 1 and groups % n_batch == 0:
        plan = plan._replace(group_axes=plan.batch_axes)
    if channels % plan.count(plan.channel_axes):
        plan = plan._replace(channel_axes=())
    n_length = plan.count(plan.length_axes)
    if n_length > 1:
        if length % n_length:
            raise ValueError(
                f"causal_conv1d: sequence sharding needs x's length L={length} to be divisible by "
                f"the {n_length} shards of mesh axes {plan.length_axes}"
            )
        if length // n_length < state_len:
            raise ValueError(
                f"causal_conv1d: sequence sharding over mesh axes {plan.length_axes} gives shards "
                f"of {length // n_length} steps (L={length} / {n_length}), shorter than the state "
                f"length K-1={state_len}; each shard must hold at least K-1 steps"
            )
    return plan


# ---- per-device computations ----

def _local_groups(plan: _Plan, weight, bias):
    """The weight groups this device's batch rows use, and the index of the first one when they
    are sliced here from all groups (None when weight and bias arrive as they are needed)."""
    n_batch = plan.count(plan.batch_axes)
    if plan.groups == 1 or n_batch == 1 or plan.group_axes:
        return weight, bias, None
    rows = plan.batch // n_batch
    per_group = plan.batch // plan.groups
    count = max(rows // per_group, 1)
    start = lax.axis_index(plan.batch_axes) * rows // per_group
    return (
        lax.dynamic_slice_in_dim(weight, start, count, 0),
        lax.dynamic_slice_in_dim(bias, start, count, 0),
        start,
    )


def _to_all_groups(plan: _Plan, grad, start):
    if start is None:
        return grad
    full = jnp.zeros((plan.groups,) + grad.shape[1:], grad.dtype)
    return lax.dynamic_update_slice_in_dim(full, grad, start, 0)


def _splits_length(plan: _Plan) -> bool:
    return plan.count(plan.length_axes) > 1 and plan.state_len > 0


def _state_mask(plan: _Plan, keep):
    """A (B, P) mask broadcast against a state tensor of the plan's layout."""
    return keep[:, :, None] if plan.channel_last else keep[:, None, :]


class _Halo(NamedTuple):
    state: jax.Array  # this shard's initial state
    keep: Optional[jax.Array]  # (B, P): halo rows kept (same segment as the shard's first step)
    index: jax.Array  # this device's position along the sequence
    count: int


def _halo(plan: _Plan, x, initial_state, seq_idx) -> _Halo:
    """Receives the previous shard's last K-1 steps; the first shard uses initial_state."""
    axes, n, p = plan.length_axes, plan.count(plan.length_axes), plan.state_len
    steps = x.shape[plan.time_axis]
    to_next = [(i, i + 1) for i in range(n - 1)]
    halo = lax.ppermute(lax.slice_in_dim(x, steps - p, steps, axis=plan.time_axis), axes, to_next)
    keep = None
    if seq_idx is not None:
        halo_ids = lax.ppermute(seq_idx[:, steps - p:], axes, to_next)
        keep = halo_ids == seq_idx[:, :1]
        halo = jnp.where(_state_mask(plan, keep), halo, 0)
    index = lax.axis_index(axes)
    first = jnp.zeros_like(halo) if initial_state is None else initial_state
    return _Halo(jnp.where(index == 0, first, halo), keep, index, n)


def _forward_local(plan: _Plan, params, *operands):
    a = dict(zip(_primitives._present(_primitives.FWD_SLOTS, params), operands))
    weight, bias, _ = _local_groups(plan, a["weight"], a["bias"])
    flags = dict(silu=params["silu"], channel_last=params["channel_last"],
                 return_final_state=params["return_final_state"])
    if not _splits_length(plan):
        out = _primitives.forward(a["x"], weight, bias, a.get("initial_state"), a.get("seq_idx"),
                                  **flags)
        return out if params["return_final_state"] else (out,)
    halo = _halo(plan, a["x"], a.get("initial_state"), a.get("seq_idx"))
    out = _primitives.forward(a["x"], weight, bias, halo.state, a.get("seq_idx"), **flags)
    if not params["return_final_state"]:
        return (out,)
    y, final = out
    final = lax.psum(jnp.where(halo.index == halo.count - 1, final, 0), plan.length_axes)
    return y, final


def _backward_local(plan: _Plan, params, *operands):
    a = dict(zip(_primitives._present(_primitives.BWD_SLOTS, params), operands))
    x, seq_idx = a["x"], a.get("seq_idx")
    weight, bias, start = _local_groups(plan, a["weight"], a["bias"])
    # Weight groups split over the batch axes get all their rows' terms on one device.
    reduce_axes = (() if plan.group_axes else plan.batch_axes) + plan.length_axes
    params_dtype = weight.dtype
    if reduce_axes:
        # The devices' dweight/dbias terms are summed in the accumulation dtype, as one device
        # sums its own, and rounded to the params' dtype once.
        acc = accumulation_dtype(x.dtype)
        weight, bias = weight.astype(acc), bias.astype(acc)
    flags = dict(silu=params["silu"], channel_last=params["channel_last"])
    if not _splits_length(plan):
        dx, dweight, dbias, dinitial = _primitives.backward(
            x, weight, bias, a.get("initial_state"), seq_idx, a["dy"], a.get("dfinal_state"),
            **flags,
        )
    else:
        halo = _halo(plan, x, a.get("initial_state"), seq_idx)
        last = halo.index == halo.count - 1
        dfinal = a.get("dfinal_state")
        dfinal = None if dfinal is None else jnp.where(last, dfinal, 0)
        dx, dweight, dbias, dstate = _primitives.backward(
            x, weight, bias, halo.state, seq_idx, a["dy"], dfinal, **flags
        )
        dhalo = dstate if halo.keep is None else jnp.where(_state_mask(plan, halo.keep), dstate, 0)
        to_previous = [(i + 1, i) for i in range(halo.count - 1)]
        dhalo = lax.ppermute(dhalo, plan.length_axes, to_previous)
        steps, p = x.shape[plan.time_axis], plan.state_len
        tail = lax.slice_in_dim(dx, steps - p, steps, axis=plan.time_axis) + dhalo
        dx = lax.dynamic_update_slice_in_dim(dx, tail, steps - p, plan.time_axis)
        dinitial = None
        if params["has_initial_state"]:
            dinitial = lax.psum(jnp.where(halo.index == 0, dstate, 0), plan.length_axes)
    dweight = _to_all_groups(plan, dweight, start)
    dbias = _to_all_groups(plan, dbias, start)
    if reduce_axes:
        dweight, dbias = lax.psum((dweight, dbias), reduce_axes)
        dweight, dbias = dweight.astype(params_dtype), dbias.astype(params_dtype)
    outs = (dx, dweight, dbias)
    return outs + (dinitial,) if params["has_initial_state"] else outs


# ---- custom_partitioning and custom_vmap wrappers ----

def _factors(slot: str, channel_last: bool) -> str:
    if slot in _X_SLOTS:
        return "b l d" if channel_last else "b d l"
    if slot in _STATE_SLOTS:
        return "b p d" if channel_last else "b d p"
    return {"seq_idx": "b l", "weight": "g d k", "dweight": "g d k", "bias": "g d",
            "dbias": "g d"}[slot]


def _outside_user_mesh(local):
    """``local`` traced with no abstract mesh in context, as its operands are typed.

    The partitioner traces the per-device function while compiling, and jax 0.11 leaves the
    caller's ``jax.set_mesh`` in context there: the values that ``ppermute``, ``axis_index`` and
    ``where`` create were then typed on that (Explicit) mesh, the operands on none, and
    ``dynamic_update_slice`` refused to mix them. jax 0.10 traced it with no mesh.
    """

    @functools.wraps(local)
    def traced(*operands):
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            return local(*operands)

    return traced


def _partition(local, params, slots, results, mesh, arg_shapes, result_shape):
    """custom_partitioning's callback: the shardings to run with, and the per-device function."""
    del result_shape  # the results' shardings follow from x's
    shapes = dict(zip(slots, arg_shapes))
    plan = _make_plan(mesh, shapes["x"], shapes["weight"], params["channel_last"])
    return (
        mesh,
        _outside_user_mesh(functools.partial(local, plan, params)),
        tuple(plan.sharding(r) for r in results),
        tuple(plan.sharding(s) for s in slots),
    )


@functools.lru_cache(maxsize=None)
def _sharded_call(prim, frozen_params):
    """The primitive with these params, as a partitioned and vmappable function of its operands."""
    params = dict(frozen_params)
    if prim is _primitives.forward_p:
        slots, results, local = _primitives.FWD_SLOTS, _primitives.FWD_RESULTS, _forward_local
    else:
        slots, results, local = _primitives.BWD_SLOTS, _primitives.BWD_RESULTS, _backward_local
    slots = tuple(_primitives._present(slots, params))
    results = tuple(_primitives._present(results, params))

    def call(*operands):
        return tuple(prim.bind(*operands, **params))

    partitioned = custom_partitioning(call)
    channel_last = params["channel_last"]
    rule = " -> ".join(
        ", ".join(_factors(s, channel_last) for s in group) for group in (slots, results)
    )
    # Neither K nor the state length is ever split.
    replicated = tuple(f for f in ("k", "p") if f in re.findall(r"\w+", rule))
    partitioned.def_partition(
        partition=functools.partial(_partition, local, params, slots, results),
        sharding_rule=rule,
        need_replication_factors=replicated,
    )

    @custom_vmap
    def op(*operands):
        return partitioned(*operands)

    @op.def_vmap
    def _fold(axis_size, in_batched, *operands):
        del axis_size
        dims = [0 if batched else None for batched in in_batched]
        outs, _ = _primitives.fold_batch(op, operands, dims)
        return tuple(outs), (True,) * len(outs)

    return op


def bind(prim, *operands, **params):
    """Binds a causal_conv1d primitive so that it partitions over meshes and folds under vmap."""
    if jax.sharding.get_abstract_mesh().manual_axes:
        # Inside shard_map each device's block is a problem of its own, as for any other op;
        # XLA replicates the custom call over the axes that stay automatic.
        return prim.bind(*operands, **params)
    return _sharded_call(prim, tuple(sorted(params.items())))(*operands)


def forward(*args, **kwargs):
    """_primitives.forward, partitioned under jit on a mesh."""
    return _primitives.forward(*args, bind=bind, **kwargs)


def backward(*args, **kwargs):
    """_primitives.backward, partitioned under jit on a mesh."""
    return _primitives.backward(*args, bind=bind, **kwargs)
