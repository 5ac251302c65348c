"""Recurrent-state snapshots on the unified storage grid (issue 59, cache/storage/state_cells.py): the
cells one TP size writes assemble, on a rank of another TP size, into exactly the shard of every state
tensor that rank's model holds (LFM2's conv channels; a gated DeltaNet's q, k, v conv channels of its
key heads and its value heads' recurrent matrices), both ways; a cell no rank holds whole is refused
in one sentence. No engine: the planning and the objects' bytes, against the shards written out by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hicache.cache.state_pool import StatePool
from hicache.cache.storage.state_cells import StateShard, plan_states
from hicache.cache.storage.state_objects import CellState
from hicache.config import ConfigError, EngineConfig
from hicache.model.parallel import ModelShard, model_shard
from hicache.model.random_model import parse_random_spec
from hicache.model.spec import LayerKind, ModelSpec
from hicache.runtime.storage_layout import unified_plans

pytestmark = pytest.mark.storage

SLOT = 1


def config(tp: int, **kw) -> EngineConfig:
    return EngineConfig(tp_size=tp, enable_hierarchical_cache=True, hicache_storage_backend="file",
                        hicache_storage_key_scheme="unified", **kw)


def my_part(spec: ModelSpec, shard: ModelShard, layer: int, whole: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """What ``shard``'s pool holds of a whole-model state (``whole``: layer ``layer``'s tensors), as
    model/parallel.py cuts the layer's weights."""
    if spec.layer_kinds[layer] == LayerKind.CONV:
        return [whole[0][shard.conv_channels.start:shard.conv_channels.stop]]
    kh, vh, dk, dv, keys = shard.gdn_key_heads, shard.gdn_value_heads, spec.gdn_key_dim, spec.gdn_value_dim, \
        spec.gdn_key_heads * spec.gdn_key_dim
    conv = torch.cat([whole[0][kh.start * dk:kh.stop * dk], whole[0][keys + kh.start * dk:keys + kh.stop * dk],
                      whole[0][2 * keys + vh.start * dv:2 * keys + vh.stop * dv]])
    return [conv, whole[1][vh.start:vh.stop]]


def deployment(spec: ModelSpec, tp: int, whole: list[tuple[torch.Tensor, ...]] | None, **kw) -> list[tuple]:
    """Each rank's (plan, pool, model shard) at TP ``tp``; its pool's slot holds its part of ``whole``
    (None: zeros)."""
    ranks = []
    for rank, plan in enumerate(unified_plans(config(tp, **kw), spec)):
        shard = model_shard(spec, rank, tp, 0, 1)
        layers = [tuple((shape, torch.float32) for shape in shard.state_shapes(spec, i)) for i in spec.recurrent_layers]
        pool = StatePool(layers, running=1, snapshots=1, grid=4, device="cpu")
        if whole is not None:
            for buffers, layer, tensors in zip(pool.buffers, spec.recurrent_layers, whole):
                for buffer, part in zip(buffers, my_part(spec, shard, layer, tensors)):
                    buffer[SLOT].copy_(part)
        ranks.append((plan, pool, shard))
    return ranks


def whole_state(spec: ModelSpec) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(3)
    return [tuple(torch.randn(shape, generator=gen) for shape in spec.state_shapes(i)) for i in spec.recurrent_layers]


def stored(ranks: list[tuple]) -> dict[str, bytes]:
    """Every rank's written cells, by key suffix (each cell written by exactly one rank)."""
    out: dict[str, bytes] = {}
    for plan, pool, _ in ranks:
        for cell in plan.states.writes:
            assert cell.suffix not in out
            out[cell.suffix] = CellState(pool, plan.states, cell).payload(SLOT)
    return out


def assemble(ranks: list[tuple], objects: dict[str, bytes]) -> None:
    """Each rank loads every cell it reads into its slot."""
    for plan, pool, _ in ranks:
        for cell in plan.states.reads:
            assert CellState(pool, plan.states, cell).load(SLOT, memoryview(objects[cell.suffix]))


def assert_holds(spec: ModelSpec, ranks: list[tuple], whole: list[tuple[torch.Tensor, ...]]) -> None:
    for _, pool, shard in ranks:
        for buffers, layer, tensors in zip(pool.buffers, spec.recurrent_layers, whole):
            for buffer, part in zip(buffers, my_part(spec, shard, layer, tensors)):
                assert torch.equal(buffer[SLOT], part)


@pytest.mark.parametrize("preset,writer_tp,reader_tp", [("lfm2-tiny", 1, 2), ("lfm2-tiny", 2, 1), ("lfm2-tiny", 4, 2),
                                                        ("gdn-tiny", 1, 2), ("gdn-tiny", 2, 1)])
def test_cells_written_at_one_tp_size_assemble_at_another(preset: str, writer_tp: int, reader_tp: int) -> None:
    spec = parse_random_spec(preset)
    whole = whole_state(spec)
    objects = stored(deployment(spec, writer_tp, whole, hicache_storage_layer_partition=1))
    groups = {"lfm2-tiny": 4, "gdn-tiny": 2}[preset]  # the model's 4 attention heads, at most its units (2 key heads)
    assert sorted(objects) == sorted(f"L{i}-{i + 1}_G{g}_state" for i in spec.recurrent_layers for g in range(groups))
    reader = deployment(spec, reader_tp, None, hicache_storage_layer_partition=1)
    assemble(reader, objects)
    assert_holds(spec, reader, whole)


def test_a_reader_off_the_state_groups_takes_its_slice_and_a_writer_off_them_is_refused() -> None:
    """lfm2-tiny at TP3 holds 22, 21 and 21 of its 64 channels: no rank holds group 1 or 2 (16 channels
    each) whole, so TP3 cannot write them (refused at start-up), but each rank reads the cells that cover
    its channels and takes its rows (planned here beside a rank that could write them all)."""
    spec = parse_random_spec("lfm2-tiny")
    whole = whole_state(spec)
    objects = stored(deployment(spec, 1, whole))
    with pytest.raises(ConfigError) as caught:
        unified_plans(config(3), spec)
    message = str(caught.value)
    assert "holds the whole state group 1 of recurrent layers 0-2" in message and "--tp-size" in message
    assert message.endswith(".") and ". " not in message
    grid = unified_plans(config(1), spec)[0].states.grid
    shards = [StateShard(r, tuple(model_shard(spec, r, 3, 0, 1).state_units(spec, s.layer) for s in grid.layers))
              for r in range(3)] + [StateShard(3, tuple(range(s.units) for s in grid.layers))]
    reader = []
    for rank in range(3):
        plan = SimpleNamespace(states=plan_states(grid, shards, rank))
        assert [c.group for c in plan.states.reads] == [[0, 1], [1, 2], [2, 3]][rank]
        assert [c.group for c in plan.states.writes] == [[0], [], [3]][rank]  # the groups it holds whole
        shard = model_shard(spec, rank, 3, 0, 1)
        layers = [tuple((shape, torch.float32) for shape in shard.state_shapes(spec, i)) for i in spec.recurrent_layers]
        reader.append((plan, StatePool(layers, running=1, snapshots=1, grid=4, device="cpu"), shard))
    assemble(reader, objects)
    assert_holds(spec, reader, whole)


def test_the_layout_report_names_a_snapshots_cells_under_the_engines_namespace(tmp_path) -> None:
    """What a router reads (``GET /get_hicache_l3_cache_layout``): the state cells' key pattern, each
    rank's state cells beside its page cells (those of the attention layer: layers 0 and 1 have no KV),
    and the namespace digest the engine's keys really use."""
    from hicache import Engine

    engine = Engine("random:gdn-tiny", dtype="float32", page_size=4, max_total_tokens=320,
                    enable_hierarchical_cache=True, hicache_storage_backend="file",
                    hicache_storage_backend_extra_config=f'{{"path": "{tmp_path}"}}',
                    hicache_storage_key_scheme="unified", hicache_storage_layer_partition=1)
    try:
        layout = engine.storage_layout()
        assert layout["namespace_digest"] == engine.cache.keys.digest(engine.model_namespace).hex()
        assert layout["state_cells"].startswith("{page_hash}_{namespace_digest}_L{start_layer}-{end_layer}_G")
        cells = ["L2-3_H0", "L2-3_H1"] + [f"L{i}-{i + 1}_G{g}_state" for i in (0, 1) for g in (0, 1)]
        assert layout["ranks"][0]["reads"] == layout["ranks"][0]["writes"] == cells
    finally:
        engine.shutdown()
