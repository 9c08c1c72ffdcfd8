"""Tests for xla_hooks.inspect: collectives and memory read back from real compiled programs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from xla_hooks.inspect import (Collective, HloParseError, HloReport, MemoryStats, collectives, kernels, memory_stats,
                               report)

F32 = 4
ROWS = ((0, 1, 2, 3), (4, 5, 6, 7))  # the 'y' groups of a 2x4 ('x', 'y') mesh
COLS = ((0, 4), (1, 5), (2, 6), (3, 7))  # its 'x' groups
YX = ((0, 4, 1, 5, 2, 6, 3, 7),)  # one group over ('y', 'x'), y major


def _compile(mesh, f, args, in_specs, out_spec):
    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    outs = jax.tree.map(shard, out_spec, is_leaf=lambda x: isinstance(x, P))
    jitted = jax.jit(f, in_shardings=tuple(map(shard, in_specs)), out_shardings=outs)
    return jitted.lower(*args).compile()


def _only(cols: tuple[Collective, ...], kind: str) -> Collective:
    assert [c.kind for c in cols] == [kind], cols
    return cols[0]


# --- real compiled programs -------------------------------------------------------------------


def test_contraction_split_over_y_all_reduces_the_output(mesh_2x4):
    a, b = jnp.ones((16, 32)), jnp.ones((32, 64))
    compiled = _compile(mesh_2x4, jnp.matmul, (a, b), (P(None, "y"), P("y", None)), P())
    c = _only(collectives(compiled), "all-reduce")
    assert (c.group_size, c.num_groups, c.groups) == (4, 2, ROWS)
    assert c.dtype == "f32" and c.shape == (16, 64)
    assert c.result_bytes == c.operand_bytes == 16 * 64 * F32
    assert c.bytes_moved_per_device == pytest.approx(2 * 3 / 4 * 16 * 64 * F32)


def test_all_gather_from_dim0_sharding(mesh_2x4):
    compiled = _compile(mesh_2x4, lambda x: x * 2, (jnp.ones((16, 32)),), (P("y", None),), P())
    c = _only(collectives(compiled), "all-gather")
    assert (c.group_size, c.groups) == (4, ROWS)
    assert (c.result_bytes, c.operand_bytes) == (16 * 32 * F32, 4 * 32 * F32)
    assert c.bytes_moved_per_device == pytest.approx(3 / 4 * 16 * 32 * F32)


def test_all_gather_over_x_groups_columns(mesh_2x4):
    compiled = _compile(mesh_2x4, lambda x: x * 2, (jnp.ones((16, 32)),), (P("x", None),), P())
    c = _only(collectives(compiled), "all-gather")
    assert c.groups == COLS


def test_reduce_scatter_from_shard_map(mesh_2x4):
    def f(x):
        return jax.lax.psum_scatter(x, "y", scatter_dimension=0, tiled=True)

    g = jax.jit(jax.shard_map(f, mesh=mesh_2x4, in_specs=P(), out_specs=P("y"), check_vma=False))
    c = _only(collectives(g.lower(jnp.ones((16, 32))).compile()), "reduce-scatter")
    assert (c.group_size, c.num_groups, c.groups) == (4, 2, ROWS)
    assert (c.operand_bytes, c.result_bytes) == (16 * 32 * F32, 4 * 32 * F32)
    assert c.bytes_moved_per_device == pytest.approx(3 / 4 * 16 * 32 * F32)


def test_resharding_dim0_to_dim1_is_an_all_to_all(mesh_2x4):
    def f(x):
        return jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh_2x4, P(None, "y")))

    compiled = _compile(mesh_2x4, f, (jnp.ones((32, 32)),), (P("y", None),), P(None, "y"))
    c = _only(collectives(compiled), "all-to-all")
    assert (c.group_size, c.groups) == (4, ROWS)
    assert c.result_bytes == 8 * 32 * F32  # tuple elements summed
    assert c.bytes_moved_per_device == pytest.approx(3 / 4 * 8 * 32 * F32)


def test_collective_inside_scan_records_its_computation(mesh_2x4):
    def f(a, b):
        return jax.lax.scan(lambda c, _: (c @ b, None), a, None, length=3)[0]

    a, b = jnp.ones((16, 32)), jnp.ones((32, 32))
    compiled = _compile(mesh_2x4, f, (a, b), (P(None, "y"), P("y", None)), P())
    cols = collectives(compiled)
    entry = next(c.computation for c in cols if c.kind == "all-gather")
    loop = [c for c in cols if c.kind == "all-reduce"]
    assert loop and all(c.computation != entry for c in loop)


def test_memory_stats_counts_per_device_arguments(mesh_2x4):
    a, b = jnp.ones((16, 32)), jnp.ones((32, 64))
    compiled = _compile(mesh_2x4, jnp.matmul, (a, b), (P(None, "y"), P("y", None)), P())
    mem = memory_stats(compiled)
    assert isinstance(mem, MemoryStats)
    assert mem.argument_bytes == (16 * 8 + 8 * 64) * F32
    assert mem.output_bytes == 16 * 64 * F32
    assert mem.peak_bytes == mem.argument_bytes + mem.output_bytes + mem.temp_bytes - mem.alias_bytes


def test_report_combines_collectives_memory_and_flops(mesh_2x4):
    a, b = jnp.ones((16, 32)), jnp.ones((32, 64))
    compiled = _compile(mesh_2x4, jnp.matmul, (a, b), (P(None, "y"), P("y", None)), P())
    rep = report(compiled)
    assert isinstance(rep, HloReport)
    assert rep.counts() == {"all-reduce": 1}
    assert rep.bytes_moved_per_device() == pytest.approx(2 * 3 / 4 * 16 * 64 * F32)
    assert rep.memory == memory_stats(compiled)
    assert rep.flops is not None and rep.flops > 0
    assert "all-reduce" in rep.summary()


def test_program_without_collectives(mesh_2x4):
    compiled = _compile(mesh_2x4, lambda x: x + 1, (jnp.ones((16, 32)),), (P("y", None),), P("y", None))
    assert collectives(compiled) == ()
    assert report(compiled).bytes_moved_per_device() == 0


# --- fixed HLO snippets, one per replica-group spelling ---------------------------------------

HEADER = "HloModule m, is_scheduled=true, num_partitions=8\n\nENTRY %main (p: f32[8,16]) -> f32[8,16] {\n"


def _one(line: str, kind: str) -> Collective:
    text = HEADER + "  %p = f32[8,16]{1,0} parameter(0)\n" + f"  {line}\n}}\n"
    return _only(collectives(text), kind)


@pytest.mark.parametrize(
    "groups, expected",
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}", ROWS),
        ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", COLS),
        ("replica_groups=[2,4]<=[8]", ROWS),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", COLS),
        ("replica_groups=[1,8]<=[2,4]T(1,0)", YX),
        ("replica_groups={}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", ROWS),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}", COLS),
        # Shardy's mesh form with a permuted device order, as printed for a 2x4 jax mesh:
        ("replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}", ROWS),
        ("replica_groups=mesh['axis_0'=8,'axis_1'=1], device_ids=([2,4]T(1,0)) {'axis_0'}", YX),
        ("replica_groups=mesh['a'=2,'b'=4] {'b','a'}", YX),
        ("replica_groups=mesh['a'=8] {'a':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
        ("replica_groups=mesh['a'=2,'b'=2], device_ids=(3,2,1,0) {'a'}", ((3, 1), (2, 0))),
    ],
)
def test_replica_group_formats(groups, expected):
    line = f"ROOT %ar = f32[8,16]{{1,0}} all-reduce(%p), channel_id=1, {groups}, to_apply=%add"
    c = _one(line, "all-reduce")
    assert c.groups == expected
    assert (c.group_size, c.num_groups) == (len(expected[0]), len(expected))


def test_tuple_shape_with_index_comments():
    shape = ", ".join(["f32[8,16]{1,0}"] * 5 + ["f32[4]{0} /*index=5*/", "bf16[2,2]{1,0}"])
    line = f"%ar = ({shape}) all-reduce(%p, %p, %p, %p, %p, %p, %p), replica_groups=[2,4]<=[8]"
    c = _one(line, "all-reduce")
    assert c.result_bytes == 5 * 8 * 16 * 4 + 4 * 4 + 2 * 2 * 2
    assert c.shape == ((8, 16),) * 5 + ((4,), (2, 2))
    assert c.dtype == "f32,bf16"


def test_async_pairs_count_once():
    body = """
  %p = f32[8,16]{1,0} parameter(0)
  %ars = f32[8,16]{1,0} all-reduce-start(%p), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %ard = f32[8,16]{1,0} all-reduce-done(f32[8,16]{1,0} %ars)
  %ags = (f32[8,16]{1,0}, f32[32,16]{1,0}) all-gather-start(%ard), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}
  %agd = f32[32,16]{1,0} all-gather-done(%ags)
  %cps = (f32[32,16]{1,0}, f32[32,16]{1,0}, u32[], u32[]) collective-permute-start(%agd), channel_id=3, source_target_pairs={{0,1},{1,0}}
  ROOT %cpd = f32[32,16]{1,0} collective-permute-done(%cps)
}
"""
    cols = collectives(HEADER + body)
    assert [c.kind for c in cols] == ["all-reduce", "all-gather", "collective-permute"]
    ar, ag, cp = cols
    assert (ar.name, ar.group_size, ar.result_bytes) == ("ars", 2, 8 * 16 * 4)
    assert (ag.group_size, ag.operand_bytes, ag.result_bytes) == (4, 8 * 16 * 4, 32 * 16 * 4)
    assert (cp.group_size, cp.num_groups, cp.groups) == (2, 2, ((0, 1), (1, 0)))
    assert cp.bytes_moved_per_device == 32 * 16 * 4


def test_computation_names_and_inline_operand_shapes():
    text = """HloModule m, num_partitions=4

%body (arg: f32[8]) -> f32[8] {
  %arg = f32[8]{0} parameter(0)
  ROOT %rs = f32[2]{0} reduce-scatter(f32[8]{0} %arg), replica_groups={}, dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[8]) -> f32[8] {
  ROOT %x = f32[8]{0} parameter(0)
}
"""
    c = _only(collectives(text), "reduce-scatter")
    assert (c.computation, c.groups) == ("body", ((0, 1, 2, 3),))
    assert (c.operand_bytes, c.result_bytes) == (32, 8)
    assert c.bytes_moved_per_device == pytest.approx(3 / 4 * 32)


def test_group_of_one_moves_nothing():
    c = _one("%ar = f32[8,16]{1,0} all-reduce(%p), replica_groups={{0},{1}}, to_apply=%add", "all-reduce")
    assert c.group_size == 1 and c.bytes_moved_per_device == 0


def test_element_sizes():
    for dtype, size in [("pred", 1), ("bf16", 2), ("s64", 8), ("c128", 16), ("f8e4m3fn", 1), ("u16", 2)]:
        c = _one(f"%ar = {dtype}[10]{{0}} all-reduce(%p), replica_groups={{}}, to_apply=%add", "all-reduce")
        assert c.result_bytes == 10 * size, dtype


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", ["", "hello world", "def f(x):\n    return x\n", "x = foo bar(1)", 42, None, b"HloModule"]
)
def test_garbage_raises_value_error(bad):
    with pytest.raises(ValueError):
        collectives(bad)


def test_unreadable_collective_raises_value_error():
    with pytest.raises(ValueError, match="replica_groups"):
        _one("%ar = f32[8]{0} all-reduce(%p), replica_groups=nonsense, to_apply=%add", "all-reduce")
    with pytest.raises(ValueError, match="element type"):
        _one("%ar = q7[8]{0} all-reduce(%p), replica_groups={}, to_apply=%add", "all-reduce")


_KERNEL_HLO = """HloModule jit_step, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%fused_computation (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  %exponential.1 = f32[8]{0} exponential(%param_0)
  ROOT %add.1 = f32[8]{0} add(%exponential.1, %param_0)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %red = f32[] fusion(%x), kind=kInput, calls=%fused_computation
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %x)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %f = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_computation
  %g = (f32[8]{0}, s8[64]{0}) custom-call(%f, %f), custom_call_target="__cublas$lt$matmul"
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  ROOT %c = f32[8]{0} copy(%f)
}
"""


def test_kernels_counts_top_level_work_through_control_flow():
    """Kernels are the entry's and the while loop's instructions that launch work (fusions by kind,
    library calls, copies, the loop condition's compare), never the instructions inside a fusion."""
    assert kernels(_KERNEL_HLO) == {"compare": 1, "copy": 1, "custom-call": 1, "fusion:kInput": 1, "fusion:kLoop": 1}
    with pytest.raises(HloParseError):
        kernels("not hlo at all")


def test_kernels_of_a_compiled_cpu_program(mesh_2x4):
    """A compiled elementwise chain is one loop fusion on XLA:CPU."""
    compiled = jax.jit(lambda x: jnp.sin(x) * 2.0 + 1.0).lower(jnp.ones((64, 64))).compile()
    found = kernels(compiled)
    assert sum(v for k, v in found.items() if k.startswith("fusion")) == 1, found


def test_program_collectives_read_bf16_traffic_before_xla_cpu_widens_it(mesh_2x4):
    """XLA:CPU has no 16-bit collectives: a bf16 psum compiles to a float32 all-reduce (twice the
    bytes a GPU's NCCL moves). `compile_with_program_collectives` reads the partitioned program
    before that pass: the same all-reduce, in bf16. A float32 one is the same in both."""
    from xla_hooks.inspect import compile_with_program_collectives

    g = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "y"), mesh=mesh_2x4, in_specs=P(), out_specs=P(),
                              check_vma=False))
    for dtype, name, width in ((jnp.bfloat16, "bf16", 2), (jnp.float32, "f32", 4)):
        executable, program = compile_with_program_collectives(g.lower(jnp.ones((16, 32), dtype)))
        compiled = _only(collectives(executable), "all-reduce")
        program = _only(program, "all-reduce")
        assert compiled.dtype == "f32" and compiled.result_bytes == 16 * 32 * F32
        assert (program.dtype, program.result_bytes) == (name, 16 * 32 * width)
        assert (program.group_size, program.groups) == (compiled.group_size, compiled.groups) == (4, ROWS)


def test_collectives_in_a_scan_run_once_per_iteration(mesh_2x4):
    """A psum inside a 3-step scan is one instruction of the loop body that runs three times: its
    `trips` is the loop's known trip count, and the executed bytes are three times the static."""
    def f(x):
        def body(c, _):
            return jax.lax.psum(c * 2.0, "y"), None
        return jax.lax.scan(body, x, None, length=3)[0]

    g = jax.jit(jax.shard_map(f, mesh=mesh_2x4, in_specs=P(), out_specs=P(), check_vma=False))
    r = report(g.lower(jnp.ones((16, 32))).compile())
    c = _only(r.collectives, "all-reduce")
    assert c.trips == 3 and c.computation != "main"
    assert r.executed_bytes_moved_per_device() == pytest.approx(3 * r.bytes_moved_per_device())
