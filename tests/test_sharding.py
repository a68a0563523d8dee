"""causal_conv1d on a device mesh under plain jax.jit, with no user shard_map.

For each layout (batch, channel and sequence sharding and their combinations) the outputs and all
gradients equal the single-device run, and the compiled HLO shows how the work was split: x and y
are never gathered or moved, sequence shards exchange only (K-1)-step halos, and dweight/dbias are
summed only over the mesh axes that shard the batch or the sequence.

On the CPU, conftest gives jax 8 host devices; the `gpu` variants run on the GPUs that exist.
"""

from __future__ import annotations

import math
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, gpu_devices, random_seq_idx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_causal_conv as jcc
from jax_causal_conv import reference

PLATFORMS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=[pytest.mark.gpu,
                                         pytest.mark.skipif(not gpu_devices(), reason="no GPU")]),
]

# name: (mesh axes and sizes, x's (batch, length, channel) mesh axes)
LAYOUTS = {
    "batch": ({"data": 2}, ("data", None, None)),
    "channel": ({"model": 2}, (None, None, "model")),
    "sequence": ({"seq": 2}, (None, "seq", None)),
    "sequence4": ({"seq": 4}, (None, "seq", None)),
    "batch+channel": ({"data": 2, "model": 2}, ("data", None, "model")),
    "batch+sequence": ({"data": 2, "seq": 2}, ("data", "seq", None)),
    "all": ({"data": 2, "seq": 2, "model": 2}, ("data", "seq", "model")),
    "sequence over 2 axes": ({"a": 2, "b": 2}, (None, ("a", "b"), None)),
}

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def make_mesh(platform: str, axes: dict):
    devices = jax.devices("cpu") if platform == "cpu" else gpu_devices()
    needed = math.prod(axes.values())
    if len(devices) < needed:
        pytest.skip(f"needs {needed} {platform} devices, found {len(devices)}")
    grid = np.array(devices[:needed]).reshape(tuple(axes.values()))
    return jax.sharding.Mesh(grid, tuple(axes))


def mesh_axes_group(mesh_text: str, axes_text: str) -> int:
    """Devices in each group of replica groups that newer XLA (jax 0.11) prints as mesh axes,
    ``mesh['data'=2,'seq'=2] {'data','seq'}``: the product of the named axes' sizes (a sub-axis
    ``'data':(1)2`` counts its own size)."""
    sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", mesh_text)}
    axes = re.findall(r"'([^']+)'(?::\(\d+\)(\d+))?", axes_text)
    assert axes and re.fullmatch(r"('[^']+'(:\(\d+\)\d+)?,?\s*)+", axes_text.strip()), axes_text
    return math.prod(int(sub) if sub else sizes[name] for name, sub in axes)


def collectives(compiled_text: str) -> list[dict]:
    """Every collective in compiled HLO: its kind, the largest array it moves (elements), and the
    number of devices in each of its groups."""
    found = []
    pattern = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
    for line in compiled_text.splitlines():
        m = pattern.search(line)
        if not m:
            continue
        shapes = re.findall(r"\w+\[([\d,]*)\]", m.group(1))
        size = max(math.prod(int(n) for n in s.split(",") if n) for s in shapes)
        group = None
        if listed := re.search(r"replica_groups=\{\{([\d,]+)\}", line):
            group = len(listed.group(1).split(","))
        elif iota := re.search(r"replica_groups=\[\d+,(\d+)\]", line):
            group = int(iota.group(1))
        elif axes := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line):
            group = mesh_axes_group(axes.group(1), axes.group(2))
        elif "replica_groups={}" in line or "replica_groups" not in line:
            group = "all devices"  # HLO's empty (or omitted) groups: one group of every device
        found.append(dict(kind=m.group(2), size=size, group=group, line=line.strip()))
    return found


def seq_ids(rng, batch, length, shard):
    """Segment ids with boundaries on, just before and just after sequence-shard boundaries."""
    rows = []
    for r in range(batch):
        cuts = [shard + r - 1, 2 * shard + 1 - r, length - shard // 2]
        rows.append(random_seq_idx(rng, 1, length, boundaries=cuts, padding=r % 2 == 1)[0])
    return jnp.asarray(np.stack(rows))


def conv_and_vjp(layout, activation, with_seq):
    """jit-able (y, final_state, dx, dw, db, dinitial_state) for given cotangents."""

    def fn(x, w, b, s, q, dy, dF):
        def conv(x, w, b, s):
            return jcc.causal_conv1d(x, w, b, activation=activation, initial_state=s,
                                     seq_idx=q if with_seq else None, return_final_state=True,
                                     layout=layout)

        (y, final), vjp = jax.vjp(conv, x, w, b, s)
        return (y, final) + vjp((dy, dF))

    return fn


def inputs(rng, B, L, D, K, layout, dtype=jnp.float32):
    x_shape = (B, L, D) if layout == "BLD" else (B, D, L)
    s_shape = (B, K - 1, D) if layout == "BLD" else (B, D, K - 1)

    def normal(shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, dtype)

    return dict(x=normal(x_shape), w=normal((D, K), K ** -0.5), b=normal((D,)), s=normal(s_shape),
                dy=normal(x_shape), dF=normal(s_shape))


ARGS = ("x", "w", "b", "s", "q", "dy", "dF")  # conv_and_vjp's arguments


def shard(mesh, a, x_axes, layout):
    """conv_and_vjp's arguments placed on the mesh, for x's (batch, length, channel) mesh axes;
    weight and bias are split over the channel axes too."""
    b, l, d = x_axes
    x_spec = P(b, l, d) if layout == "BLD" else P(b, d, l)
    s_spec = P(b, None, d) if layout == "BLD" else P(b, d, None)
    spec = dict(x=x_spec, dy=x_spec, s=s_spec, dF=s_spec, q=P(b, l), w=P(d, None), b=P(d))
    return [jax.device_put(a[k], NamedSharding(mesh, spec[k])) for k in ARGS]


def mesh_count(axes: dict, names) -> int:
    """Devices along the mesh axes `names` (None, one name or a tuple of names)."""
    return math.prod(axes[n] for n in jax.tree.leaves(names))


def check_collectives(found, *, x_local, state_local, weight_size, n_reduce, n_length,
                      n_devices, gather_size=0, structure=True):
    """What moves between devices; only gathers of at most gather_size elements are allowed.

    With ``structure`` it also checks which collectives carry the halo and the reductions, and
    over which groups. That is checked on the CPU only: XLA's GPU compiler emits the small
    reductions in async forms whose groups (and, under sequence sharding, whose all-reduce) this
    text parser does not recognise, so on GPUs it checks that nothing of x's size moves.
    """
    for c in found:
        if c["kind"] in ("all-gather", "all-to-all", "reduce-scatter"):
            assert c["kind"] == "all-gather" and c["size"] <= gather_size, found
    # Only halos, states and parameter gradients move, never anything of x's size. XLA may combine
    # the small reductions (dweight and dbias, the final and initial state) into one collective.
    small_total = 2 * state_local + weight_size
    assert small_total < x_local
    for c in found:
        assert c["size"] <= small_total, c
    permutes = [c for c in found if c["kind"] == "collective-permute"]
    if not structure:
        return
    assert bool(permutes) == (n_length > 1), found
    for c in permutes:
        assert c["size"] <= state_local, c
    reduces = [c for c in found if c["kind"] == "all-reduce"]
    assert bool(reduces) == (n_reduce > 1), found
    # dweight/dbias are summed over the batch and sequence shards (not over channel shards);
    # the final and initial states over the sequence shards only.
    groups = {n_devices if c["group"] == "all devices" else c["group"] for c in reduces}
    assert groups <= {n_reduce, n_length}, found


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("with_seq", [False, True], ids=["dense", "seq_idx"])
def test_layout_matches_single_device(platform, name, with_seq):
    axes, x_axes = LAYOUTS[name]
    mesh = make_mesh(platform, axes)
    layout = "BDL" if name == "batch+channel" else "BLD"
    rng = np.random.default_rng(0)
    B, L, D, K = 4, 32, 8, 4
    a = inputs(rng, B, L, D, K, layout)
    n_batch, n_length, n_channel = (mesh_count(axes, names) for names in x_axes)
    a["q"] = seq_ids(rng, B, L, L // n_length)
    fn = jax.jit(conv_and_vjp(layout, "silu", with_seq))

    single = fn(*jax.device_put([a[k] for k in ARGS], mesh.devices.flat[0]))
    sharded_args = shard(mesh, a, x_axes, layout)
    out = fn(*sharded_args)
    names = ("y", "final_state", "dx", "dweight", "dbias", "dinitial_state")
    for o, r, what in zip(out, single, names):
        assert_close(o, r, jnp.float32, what)
    # y and dx keep x's sharding: nothing was gathered or resharded on the way out.
    assert out[0].sharding.is_equivalent_to(sharded_args[0].sharding, 3)
    assert out[2].sharding.is_equivalent_to(sharded_args[0].sharding, 3)

    q = a["q"] if with_seq else None
    ref = reference.causal_conv1d(a["x"].astype(jnp.float64), a["w"], a["b"], activation="silu",
                                  initial_state=a["s"].astype(jnp.float64), seq_idx=q,
                                  return_final_state=True, layout=layout)
    assert_close(out[0], ref[0], jnp.float32, "y vs reference")

    found = collectives(fn.lower(*sharded_args).compile().as_text())
    check_collectives(found, x_local=B * L * D // (n_batch * n_length * n_channel),
                      state_local=B * (K - 1) * D // (n_batch * n_channel), weight_size=D * (K + 1),
                      n_reduce=n_batch * n_length, n_length=n_length, n_devices=mesh.size,
                      structure=platform == "cpu")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float64],
                         ids=lambda d: d.__name__)
def test_other_dtypes(platform, dtype):
    """Data, sequence and channel sharding at once (sequence only on 2 GPUs), for the other x
    dtypes (float32 weights)."""
    axes, x_axes = LAYOUTS["all"] if platform == "cpu" else LAYOUTS["sequence"]
    # The GPU variant uses the 2-GPU layout that exercises the halo exchange.
    mesh = make_mesh(platform, axes)
    rng = np.random.default_rng(8)
    a = inputs(rng, 4, 32, 8, 4, "BLD", dtype)
    a["w"], a["b"] = a["w"].astype(jnp.float32), a["b"].astype(jnp.float32)
    a["q"] = seq_ids(rng, 4, 32, 16)
    fn = jax.jit(conv_and_vjp("BLD", "silu", True))
    single = fn(*jax.device_put([a[k] for k in ARGS], mesh.devices.flat[0]))
    out = fn(*shard(mesh, a, x_axes, "BLD"))
    for o, r, what in zip(out, single, ("y", "final_state", "dx", "dw", "db", "ds")):
        assert o.dtype == r.dtype, what
        assert_close(o, r, o.dtype, what)  # dw and db are float32 like the weights


@pytest.mark.parametrize("platform", PLATFORMS)
def test_sequence_shards_of_exactly_state_length(platform):
    """Shards of exactly K-1 steps: the halo is a whole shard; also K=1 (no halo at all)."""
    mesh = make_mesh(platform, {"seq": 2})
    rng = np.random.default_rng(1)
    for K, L in ((4, 6), (1, 6)):
        a = inputs(rng, 2, L, 3, K, "BLD")
        a["q"] = jnp.asarray(random_seq_idx(rng, 2, L, boundaries=[3]))
        fn = jax.jit(conv_and_vjp("BLD", None, True))
        single = fn(*jax.device_put([a[k] for k in ARGS], mesh.devices.flat[0]))
        out = fn(*shard(mesh, a, (None, "seq", None), "BLD"))
        for o, r in zip(out, single):
            assert_close(o, r, jnp.float32, f"K={K}")


def test_sequence_shard_shorter_than_state_raises():
    mesh = make_mesh("cpu", {"seq": 4})
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 8, 2)), jnp.float32)
    x = jax.device_put(x, NamedSharding(mesh, P(None, "seq")))
    w = jnp.full((2, 4), 0.5, jnp.float32)
    with pytest.raises(Exception, match=r"shards of 2 steps .* shorter than the state length K-1"):
        jax.jit(lambda x, w: jcc.causal_conv1d(x, w))(x, w)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("members, row_axis", [(2, None), (4, None), (2, "fsdp")])
def test_ensemble_sharded_over_members(platform, members, row_axis):
    """vmap over ensemble members (weights vmapped too), members split over the data axis.

    When the members alone carry the split, each device owns its members' weights: nothing is
    gathered and dweight is not summed over data. When rows are split too (fsdp), devices share
    members: the small weights are gathered and dweight is summed over data and fsdp."""
    axes = {"data": 2, "seq": 2} if row_axis is None else {"data": 2, "fsdp": 2, "seq": 2}
    mesh = make_mesh(platform, axes)
    rng = np.random.default_rng(3)
    B, L, D, K = 2, 32, 8, 3
    x = jnp.asarray(rng.standard_normal((members, B, L, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((members, D, K)) / np.sqrt(K), jnp.float32)
    b = jnp.asarray(rng.standard_normal((members, D)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    def fn(x, w, b, dy):
        ensemble = jax.vmap(lambda x, w, b: jcc.causal_conv1d(x, w, b, activation="silu"))
        y, vjp = jax.vjp(ensemble, x, w, b)
        return (y,) + vjp(dy)

    fn = jax.jit(fn)
    single = fn(*jax.device_put((x, w, b, dy), mesh.devices.flat[0]))
    x_sh, w_sh = NamedSharding(mesh, P("data", row_axis, "seq")), NamedSharding(mesh, P("data"))
    args = (jax.device_put(x, x_sh), jax.device_put(w, w_sh), jax.device_put(b, w_sh),
            jax.device_put(dy, x_sh))
    out = fn(*args)
    for o, r, what in zip(out, single, ("y", "dx", "dweight", "dbias")):
        assert_close(o, r, jnp.float32, what)
    ref = jax.vmap(lambda x, w, b: reference.causal_conv1d(x, w, b, activation="silu"))(
        x.astype(jnp.float64), w, b)
    assert_close(out[0], ref, jnp.float32, "y vs reference")
    n_rows = 1 if row_axis is None else axes[row_axis]
    weight_size = members * D * (K + 1)
    found = collectives(fn.lower(*args).compile().as_text())
    check_collectives(found, x_local=x.size // (4 * n_rows),
                      state_local=members * B * (K - 1) * D // (2 * n_rows),
                      weight_size=weight_size,
                      n_reduce=2 if row_axis is None else 8, n_length=2, n_devices=mesh.size,
                      gather_size=0 if row_axis is None else weight_size)


@pytest.mark.parametrize("dim", [0, 2], ids=["batch", "channel"])
def test_uneven_batch_or_channel_shards(dim):
    """A batch or channel split that does not divide evenly (possible for an intermediate value)
    gives the single-device result (that dimension then runs replicated)."""
    mesh = make_mesh("cpu", {"m": 4})
    rng = np.random.default_rng(4)
    shape = (6, 16, 4) if dim == 0 else (4, 16, 6)
    a = inputs(rng, shape[0], shape[1], shape[2], 3, "BLD")
    spec = P(*(["m" if i == dim else None for i in range(3)]))
    conv = conv_and_vjp("BLD", "silu", False)

    def fn(x, w, b, s, dy, dF):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
        return conv(x, w, b, s, None, dy, dF)

    args = [a[k] for k in ("x", "w", "b", "s", "dy", "dF")]
    single = jax.jit(conv)(*jax.device_put(args[:4] + [None] + args[4:], mesh.devices.flat[0]))
    out = jax.jit(fn)(*jax.device_put(args, NamedSharding(mesh, P())))
    for o, r in zip(out, single):
        assert_close(o, r, jnp.float32, f"dim {dim}")


def test_uneven_sequence_shards_raise():
    mesh = make_mesh("cpu", {"seq": 4})
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 18, 4)), jnp.float32)
    w = jnp.full((4, 3), 0.5, jnp.float32)

    def fn(x, w):
        x = jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P(None, "seq")))
        return jcc.causal_conv1d(x, w)

    with pytest.raises(Exception, match=r"length L=18 to be divisible by the 4 shards"):
        jax.jit(fn)(x, w)


def test_explicit_axes_mesh():
    """jax.make_mesh with Explicit axes (its default in recent jax) splits the same way."""
    devices = jax.devices("cpu")[:4]
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.make_mesh((2, 2), ("data", "seq"), axis_types=explicit, devices=devices)
    rng = np.random.default_rng(6)
    a = inputs(rng, 4, 32, 8, 4, "BLD")
    a["q"] = seq_ids(rng, 4, 32, 16)
    fn = jax.jit(conv_and_vjp("BLD", "silu", True))
    single = fn(*jax.device_put([a[k] for k in ARGS], devices[0]))
    args = shard(mesh, a, ("data", "seq", None), "BLD")
    out = fn(*args)
    for o, r in zip(out, single):
        assert_close(o, r, jnp.float32, "explicit mesh")
    check_collectives(collectives(fn.lower(*args).compile().as_text()), x_local=4 * 32 * 8 // 4,
                      state_local=2 * 3 * 8, weight_size=8 * 5, n_reduce=4, n_length=2,
                      n_devices=mesh.size)


def test_explicit_axes_types():
    """On Explicit axes the sharding is part of the type: inside jit, y is typed like x, the final
    state like x but whole along time, and each gradient like its primal. The reference works on
    such a mesh as well."""
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.make_mesh((2, 2), ("data", "seq"), axis_types=explicit,
                         devices=jax.devices("cpu")[:4])
    rng = np.random.default_rng(7)
    a = inputs(rng, 4, 32, 8, 4, "BLD")
    x = jax.device_put(a["x"], NamedSharding(mesh, P("data", "seq", None)))
    s = jax.device_put(a["s"], NamedSharding(mesh, P("data", None, None)))
    seen = {}

    def loss(conv, x, w, b, s):
        y, final = conv(x, w, b, activation="silu", initial_state=s, return_final_state=True)
        seen[conv] = jax.typeof(y).sharding.spec, jax.typeof(final).sharding.spec
        return jnp.sum(y * y) + jnp.sum(final)

    want = jax.grad(partial(loss, reference.causal_conv1d), argnums=(0, 1, 2, 3))(
        a["x"], a["w"], a["b"], a["s"])
    with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(partial(loss, jcc.causal_conv1d), argnums=(0, 1, 2, 3)))(
            x, a["w"], a["b"], s)
        # The reference runs on such a mesh too (replicated inside), for checking against it.
        ref_grads = jax.jit(jax.grad(partial(loss, reference.causal_conv1d), argnums=(0, 1, 2, 3)))(
            x, a["w"], a["b"], s)
    seen["y"], seen["final"] = seen[jcc.causal_conv1d]
    for g, r in zip(ref_grads, want):
        assert_close(g, r, jnp.float32, "reference on the explicit-axes mesh")
    assert seen["y"] == P("data", "seq", None)
    assert seen["final"] == P("data", None, None)
    for g, primal, r in zip(grads, (x, a["w"], a["b"], s), want):
        assert jax.typeof(g).sharding.spec == jax.typeof(primal).sharding.spec
        assert_close(g, r, jnp.float32, "explicit-axes gradient")


def test_per_device_function_outside_the_callers_mesh():
    """The partitioner traces the per-device function while compiling; jax 0.11 does so with the
    caller's `jax.set_mesh` still in context, where the sequence-sharded backward then mixed
    operands typed on no mesh with values typed on the caller's and failed to compile
    (test_explicit_axes_types shows it end to end on jax 0.11; jax 0.10 left no mesh in
    context). Here, on any jax: the function traces with no abstract mesh whatever the context."""
    from jax_causal_conv import _sharding

    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = jax.make_mesh((2, 2), ("data", "seq"), axis_types=explicit,
                         devices=jax.devices("cpu")[:4])
    traced = _sharding._outside_user_mesh(lambda value: (jax.sharding.get_abstract_mesh(), value))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        assert jax.sharding.get_abstract_mesh() == mesh.abstract_mesh
        inside, value = traced(3)
        assert jax.sharding.get_abstract_mesh() == mesh.abstract_mesh
    assert inside.empty and value == 3


@pytest.mark.parametrize("manual", ["all", "data"])
def test_inside_shard_map(manual):
    """Inside shard_map each device's block is convolved on its own, as for any op; with only the
    data axis manual, a value sharded over the automatic seq axis is still convolved whole."""
    mesh = make_mesh("cpu", {"data": 2, "seq": 2})
    rng = np.random.default_rng(7)
    a = inputs(rng, 4, 16, 8, 4, "BLD")
    x, w, b = a["x"], a["w"], a["b"]

    def block(x):
        if manual == "data":
            x = jax.lax.with_sharding_constraint(x, P(None, "seq"))
        return jcc.causal_conv1d(x, w, b, activation="silu")

    spec = P("data", "seq") if manual == "all" else P("data")
    names = {"data", "seq"} if manual == "all" else {"data"}
    y = jax.jit(jax.shard_map(block, mesh=mesh, in_specs=spec, out_specs=spec,
                              axis_names=names))(x)

    def ref(x):
        return reference.causal_conv1d(x.astype(jnp.float64), w, b, activation="silu")

    if manual == "all":
        expected = jnp.concatenate([ref(x[:, :8]), ref(x[:, 8:])], axis=1)
    else:
        expected = ref(x)
    assert_close(y, expected, jnp.float32, f"manual {manual}")
