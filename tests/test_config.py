"""Config validation: every bad layout fails before any process group exists, with a message naming the fix."""

from __future__ import annotations

import re
import warnings

import lightning as L
import pytest

import lightning_par
from lightning_par.config import ParallelConfig, ParallelConfigError, split_world
from lightning_par.strategies.registry import STRATEGY_NAMES, strategy_kwargs

# (constructor kwargs, world size or None for static checks, exception, pattern the message must match)
BAD = [
    ({"zero_stage": 4}, None, ParallelConfigError, r"zero_stage=4 does not exist; choose one of \(0, 1, 2, 3\)"),
    ({"zero_stage": -1}, None, ParallelConfigError, r"zero_stage=-1 does not exist"),
    ({"offload": True, "zero_stage": 2}, None, ParallelConfigError, r"offload=True needs zero_stage=3.*zero3_offload"),
    ({"offload": True}, None, ParallelConfigError, r"offload=True needs zero_stage=3 \(got 0\)"),
    ({"tp": 0}, None, ParallelConfigError, r"tp=0 must be a positive int"),
    ({"pp": -2}, None, ParallelConfigError, r"pp=-2 must be a positive int"),
    ({"dp_replicate": 0}, None, ParallelConfigError, r"dp_replicate=0 must be a positive int"),
    ({"dp_shard": 0}, None, ParallelConfigError, r"dp_shard=0 must be a positive int or -1"),
    ({"ep": 0}, None, ParallelConfigError, r"ep=0 must be a positive int"),
    ({"tp": 2.0}, None, ParallelConfigError, r"tp=2.0 must be an int"),
    ({"tp": True}, None, ParallelConfigError, r"tp=True must be an int"),
    ({"activation_checkpointing": "some"}, None, ParallelConfigError, r"'some' is unknown; choose None, 'full'"),
    ({"ac_every": 0}, None, ParallelConfigError, r"ac_every=0 must be an int >= 1"),
    (
        {"activation_checkpointing": "sac"},
        None,
        ParallelConfigError,
        r"activation_checkpointing='sac' is unknown; choose None, 'full' .*'selective' .*'selective_op' .*'offload'",
    ),
    ({"activation_checkpointing": True}, None, ParallelConfigError, r"=True is unknown; choose None, 'full'"),
    (
        {"activation_checkpointing": "full", "ac_every": 3},
        None,
        ParallelConfigError,
        r"ac_every=3 only applies to activation_checkpointing='selective' \(got 'full'\)",
    ),
    ({"ac_every": 4}, None, ParallelConfigError, r"ac_every=4 only applies to .*'selective' \(got None\)"),
    ({"pp_schedule": "2f2b"}, None, ParallelConfigError, r"pp_schedule='2f2b' is unknown; choose one of"),
    ({"microbatches": 0}, None, ParallelConfigError, r"microbatches=0 must be a positive int or None"),
    ({"pp": 4, "microbatches": 2}, None, ParallelConfigError, r"microbatches=2 < pp=4.*use microbatches >= 4"),
    ({"bucket_cap_mb": 0}, None, ParallelConfigError, r"bucket_cap_mb=0 must be > 0"),
    ({"dp_shard": 3}, 2, ParallelConfigError, r"dp_shard=3 .* = 3 but the world size is 2; set dp_shard=-1"),
    ({"dp_replicate": 3}, 4, ParallelConfigError, r"= 3 does not divide the world size 4"),
    ({"dp_replicate": 2, "dp_shard": 4}, 4, ParallelConfigError, r"= 8 but the world size is 4"),
    ({"tp": 3}, 4, ParallelConfigError, r"tp=3 = 3 does not divide the world size 4"),
    (
        {"ep": 3, "dp_shard": 4},
        4,
        ParallelConfigError,
        r"ep=3 does not divide the data-parallel size 4; choose ep "
        r"in \{1, 2, 4\}",
    ),
    ({"tp": 4}, (4, 2), ParallelConfigError, r"tp=4 spans nodes \(2 devices per node\); choose tp in \{1, 2\}"),
    (
        {"tp": 4},
        (12, 6),
        ParallelConfigError,
        r"tp=4 does not divide the 6 devices per node, so some tensor-parallel groups would straddle two nodes; "
        r"choose tp in \{1, 2, 3, 6\}",
    ),
    ({"dp_replicate": 2, "dp_shard": 2}, 4, ParallelConfigError, r"hybrid sharding .* needs zero_stage >= 1"),
    ({}, 0, ParallelConfigError, r"world_size=0 must be >= 1"),
]


@pytest.mark.parametrize(("kwargs", "world", "exc", "pattern"), BAD, ids=[str(b[0]) + str(b[1]) for b in BAD])
def test_bad_config_raises_with_fix(kwargs, world, exc, pattern):
    with pytest.raises(exc, match=pattern):
        config = ParallelConfig(**kwargs)
        if world is not None:
            world, per_node = world if isinstance(world, tuple) else (world, None)
            config.resolve(world, devices_per_node=per_node)


def test_at_least_twenty_bad_configs():
    assert len(BAD) >= 20


def test_every_registered_name_constructs_none_is_refused_for_being_a_combination():
    # Issue 15: each combination of pipe, tp, cp, moe and ZeRO is implemented; a name resolves and builds its
    # strategy (what each one trains like is tested against one process in the test files named by docs/testing.md).
    for name in STRATEGY_NAMES:
        ParallelConfig(**strategy_kwargs(name))
        lightning_par.ParallelStrategy(**strategy_kwargs(name))


def test_unknown_strategy_name_is_rejected():
    with pytest.raises(ValueError, match="zero4"):
        L.Trainer(strategy="zero4", accelerator="cpu", devices=2, logger=False)
    with pytest.raises(ValueError, match=r"unknown strategy part 'zer0'"):
        strategy_kwargs("zer0_tp")


def test_bad_timeout_and_precision_are_rejected():
    with pytest.raises(ValueError, match=r"timeout_s=0 must be > 0"):
        lightning_par.ParallelStrategy(timeout_s=0)
    with pytest.raises(ValueError, match=r"precision='64-true' is not supported.*choose one of"):
        L.Trainer(strategy="zero1", accelerator="cpu", devices=2, precision="64-true", logger=False)


def test_resolve_fills_dp_shard_and_keeps_explicit_degrees():
    assert ParallelConfig().resolve(4).dp_shard == 4
    hsdp = ParallelConfig(dp_replicate=2, zero_stage=3).resolve(8)
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.dp) == (2, 4, 8)


@pytest.mark.parametrize(
    ("dims", "world", "expected"),
    [
        (("tp",), 2, {"tp": 2, "pp": 1, "dp": 1}),
        (("pp",), 2, {"tp": 1, "pp": 2, "dp": 1}),
        (("dp",), 2, {"tp": 1, "pp": 1, "dp": 2}),
        (("tp", "dp"), 4, {"tp": 2, "pp": 1, "dp": 2}),
        (("pp", "tp"), 4, {"tp": 2, "pp": 2, "dp": 1}),
        (("pp", "dp"), 4, {"tp": 1, "pp": 2, "dp": 2}),
        (("dp",), 4, {"tp": 1, "pp": 1, "dp": 4}),
        (("pp", "tp", "dp"), 8, {"tp": 2, "pp": 2, "dp": 2}),
        (("tp",), 6, {"tp": 2, "pp": 1, "dp": 3}),  # the odd factor goes to data parallel
        ((), 4, {"tp": 1, "pp": 1, "dp": 4}),
    ],
)
def test_split_world_follows_the_documented_rule(dims, world, expected):
    assert split_world(dims, world) == expected


def test_registry_names_follow_the_design_order():
    names = set(STRATEGY_NAMES)
    for name in ["zero1", "zero2", "zero3", "zero3_offload", "tp", "tp_zero3", "pipe", "pipe_tp", "pipe_zero1",
                 "pipe_tp_zero1", "moe", "moe_zero2", "pipe_tp_moe_zero1", "3d"]:  # fmt: skip
        assert name in names
        assert name in L.pytorch.strategies.StrategyRegistry
    assert all(re.fullmatch(r"(pipe_?)?(tp_?)?(cp_?)?(moe_?)?(zero[123])?(_offload)?|3d", n) for n in names)
    assert strategy_kwargs("zero3_offload") == {"zero_stage": 3, "offload": True, "auto_dims": ("dp",)}


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero3_offload"])
def test_registered_names_build_the_strategy(name):
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy, lightning_par.ParallelStrategy)
    assert strategy.config.zero_stage == int(name[4])
    assert strategy.config.offload == name.endswith("offload")
    assert isinstance(trainer.precision_plugin, lightning_par.ParallelPrecision)


def test_tp_from_a_name_never_spans_nodes():
    # "tp" on 2 nodes x 2 devices: tp takes what one node has, data parallel the rest (docs/strategies.md, "Names").
    assert split_world(("tp",), 4, tp_cap=2) == {"tp": 2, "pp": 1, "dp": 2}
    assert split_world(("tp", "dp"), 8, tp_cap=2) == {"tp": 2, "pp": 1, "dp": 4}
    assert split_world(("pp", "tp"), 16, tp_cap=2) == {"tp": 2, "pp": 8, "dp": 1}
    assert split_world(("tp",), 4, tp_cap=4) == {"tp": 4, "pp": 1, "dp": 1}
    # 6-device nodes: tp grows only while it divides them (4 would put a tp group on two nodes).
    assert split_world(("tp",), 12, tp_cap=6) == {"tp": 2, "pp": 1, "dp": 6}


def test_a_name_whose_dimension_gets_one_rank_warns():
    with pytest.warns(UserWarning, match=r"asks for tp, but world size 3 \(3 devices per node\) gives tp=1"):
        assert ParallelConfig(**strategy_kwargs("tp")).resolve(3, devices_per_node=3).tp == 1
    with pytest.warns(UserWarning, match=r"asks for pp, but world size 1 gives pp=1"):
        ParallelConfig(**strategy_kwargs("pipe")).resolve(1)
    with pytest.warns(UserWarning, match=r"asks for moe, but world size 2 leaves one data-parallel rank, so ep=1"):
        assert ParallelConfig(**strategy_kwargs("tp_moe")).resolve(2).ep == 1  # tp 2 takes the only factor
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ParallelConfig(**strategy_kwargs("tp_zero3")).resolve(4, devices_per_node=4)  # tp 2 x dp 2: no warning
        assert ParallelConfig(**strategy_kwargs("tp_moe")).resolve(4).ep == 2  # tp 2 x dp 2, ep 2


def test_one_function_resolves_names_and_degrees_and_validates_once(monkeypatch):
    # A registered name and explicit degrees go through the same ParallelConfig.resolve, at start-up.
    named = ParallelConfig(**strategy_kwargs("tp_zero3")).resolve(12, devices_per_node=6)
    assert (named.tp, named.dp_shard, named.zero_stage) == (2, 6, 3)
    moe = ParallelConfig(**strategy_kwargs("moe_zero1")).resolve(4, devices_per_node=4)
    assert (moe.ep, moe.dp, moe.tp, moe.pp) == (4, 4, 1, 1)
    explicit = ParallelConfig(pp=2, tp=2, zero_stage=1).resolve(8, devices_per_node=4)
    assert (explicit.pp, explicit.tp, explicit.dp_shard) == (2, 2, 2)
    # The static checks (unsupported combinations included) run once on a path: at construction, not again when
    # the world size is known.
    calls = []
    real = ParallelConfig.check_supported
    monkeypatch.setattr(ParallelConfig, "check_supported", lambda self: calls.append(1) or real(self))
    strategy = lightning_par.ParallelStrategy(**strategy_kwargs("pipe_tp_zero1"))
    assert len(calls) == 1
    resolved = strategy.config.resolve(8, devices_per_node=8)
    assert len(calls) == 1 and (resolved.pp, resolved.tp, resolved.dp_shard) == (2, 2, 2)


def test_the_vocabulary_is_defined_once():
    # Config, mesh, names and the planner read lightning_par.axes; a restated tuple would drift from it.
    from lightning_par import axes, mesh
    from lightning_par import config as config_module
    from lightning_par.names import name_of
    from lightning_par.parallel.pipeline.schedule import SCHEDULES as TORCH_SCHEDULES
    from lightning_par.planner.layout import SCHEDULES as PLANNED

    assert config_module.AXES == axes.AXIS_NAMES and mesh.MESH_AXES == tuple(a for a in axes.AXIS_NAMES if a != "ep")
    assert config_module.PP_SCHEDULES == tuple(axes.SCHEDULES) == tuple(TORCH_SCHEDULES) == tuple(PLANNED)
    assert all(TORCH_SCHEDULES[n].virtual == s.virtual == PLANNED[n] for n, s in axes.SCHEDULES.items())
    assert axes.does_not_divide("tp", 4, "n_heads", 6, "blocks.0.attn") == (
        "tp=4 does not divide n_heads=6 in blocks.0.attn; choose tp in {1, 2, 3, 6}"
    )
    # The name grammar read both ways: a layout's name parses back to the same dimensions and stage.
    for name in STRATEGY_NAMES:
        kwargs = strategy_kwargs(name)
        degrees = {a: 2 for a in kwargs["auto_dims"] if a != "dp"}
        assert strategy_kwargs(name_of(degrees, kwargs["zero_stage"], kwargs["offload"])) == kwargs, name
