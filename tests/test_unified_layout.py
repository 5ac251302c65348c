"""The unified storage layout (issue 15, seed Figure 4): one grid of layer ranges x KV-head
groups per page, so deployments with different TP / PP layouts share their L3 objects."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache import Engine, SamplingParams
from hicache.cache.host_pool import HostKVPool
from hicache.cache.host_transfer import BACKUP, TransferController
from hicache.cache.pools import DeviceKVPool
from hicache.cache.storage.page_objects import GridCell
from hicache.cache.storage.unified import Cell, RankShard, StorageGrid, plan_rank
from hicache.config import ConfigError, EngineConfig

pytestmark = pytest.mark.storage

SRC = str(Path(__file__).resolve().parents[1] / "src")
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
PROMPT = [(i * 37 + 11) % 240 + 5 for i in range(400)]  # 24 whole pages (of 16) before its last token
# The seed's example: 60 layers, 8 KV heads; objects of 30 layers x 2 heads.
SEED_MODEL = 'random:{"num_layers": 60, "num_heads": 8, "num_kv_heads": 8, "hidden_size": 64, "head_dim": 8, ' \
             '"intermediate_size": 64}'
SEED_GRID = dict(hicache_storage_layer_partition=30, hicache_storage_head_partition=2)


def shards(layers: int, heads: int, tp: int, pp: int) -> list[RankShard]:
    """Every rank's shard of an even TP x PP split (rank = pp_rank * tp + tp_rank)."""
    per_stage, per_rank = layers // pp, heads // tp
    return [RankShard(p * tp + t, range(p * per_stage, (p + 1) * per_stage), range(t * per_rank, (t + 1) * per_rank))
            for p in range(pp) for t in range(tp)]


# ---- the grid and who reads / writes what ----------------------------------------------------
def test_seed_example_writers_and_readers() -> None:
    grid = StorageGrid(60, 8, layer_partition=30, head_partition=2)
    assert [c.suffix for c in grid.cells()] == [f"L{a}-{a + 30}_H{g}" for a in (0, 30) for g in range(4)]
    writer = shards(60, 8, tp=4, pp=2)
    plans = [plan_rank(grid, writer, r) for r in range(8)]
    assert all(len(p.writes) == 1 and p.reads == p.writes for p in plans)  # one object per rank
    assert sorted(p.writes[0].suffix for p in plans) == sorted(c.suffix for c in grid.cells())
    assert plans[5].writes[0] == Cell(30, 60, 1)  # PP1/TP1: layers 30-59, heads 2-3
    reader = shards(60, 8, tp=2, pp=1)
    tp0, tp1 = plan_rank(grid, reader, 0), plan_rank(grid, reader, 1)
    assert {c.suffix for c in tp0.reads} == {"L0-30_H0", "L0-30_H1", "L30-60_H0", "L30-60_H1"}
    assert {c.suffix for c in tp1.reads} == {"L0-30_H2", "L0-30_H3", "L30-60_H2", "L30-60_H3"}


@pytest.mark.parametrize("mla", [False, True])
def test_an_object_has_the_same_bytes_from_every_host_layout(mla: bool) -> None:
    """page_unified hands out each cell as a slice of the page (no copy); the bytes equal the
    cell cut out of a page_first or layer_first page, and load back into any of them."""
    heads = 1 if mla else 4
    grid = StorageGrid(6, heads, layer_partition=4, head_partition=1 if mla else 2, mla=mla)
    pool = DeviceKVPool(6, heads, 8, num_pages=8, page_size=4, dtype=torch.float32, device="cpu")
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_(torch.randn(buf.shape))
    hosts = [HostKVPool(pool, 8, "page_unified", cell_heads=0 if mla else 2), HostKVPool(pool, 8, "page_first"),
             HostKVPool(pool, 8, "layer_first")]
    pages = np.array([3, 5, 6])
    for host in hosts:
        ctl = TransferController(pool, host)
        ctl.submit(BACKUP, pages, pages, [])
        ctl.pop(BACKUP, 1)
        ctl.shutdown()
    cells = [[GridCell(h, c, grid, 0, 0) for c in grid.cells()] for h in hosts]
    assert [c.cell.suffix for c in cells[0]] == (["L0-4", "L4-6"] if mla else ["L0-4_H0", "L0-4_H1", "L4-6_H0", "L4-6_H1"])
    for unified, *others in zip(*cells):
        payload = unified.page_bytes(5)
        assert payload.obj is not None and np.shares_memory(np.asarray(payload), hosts[0].buffer.numpy())
        for other in others:
            assert bytes(other.page_bytes(5)) == bytes(payload)
            other.load(2, payload)
            assert bytes(other.page_bytes(2)) == bytes(payload)
        unified.load(1, others[0].page_bytes(6))
        assert bytes(unified.page_bytes(1)) == bytes(others[1].page_bytes(6))


def test_replicated_heads_have_one_writer() -> None:
    """SmolLM2 at TP2 holds KV head 1 on both ranks: the lower rank writes it, both read it."""
    grid = StorageGrid(30, 3, layer_partition=15, head_partition=1)
    both = [RankShard(0, range(30), range(0, 2)), RankShard(1, range(30), range(1, 3))]
    r0, r1 = plan_rank(grid, both, 0), plan_rank(grid, both, 1)
    assert {c.suffix for c in r0.writes} == {"L0-15_H0", "L15-30_H0", "L0-15_H1", "L15-30_H1"}
    assert {c.suffix for c in r1.writes} == {"L0-15_H2", "L15-30_H2"}
    assert {c.suffix for c in r1.reads} == {"L0-15_H1", "L15-30_H1", "L0-15_H2", "L15-30_H2"}


def test_a_layout_off_the_grid_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="--hicache-storage-head-partition must divide the model's 8 KV heads"):
        StorageGrid(60, 8, layer_partition=30, head_partition=3)
    grid = StorageGrid(60, 8, layer_partition=25, head_partition=2)
    with pytest.raises(ConfigError, match="layers 0-29, which do not start and end on the storage grid's layer "
                                          "ranges of 25; set --hicache-storage-layer-partition"):
        plan_rank(grid, shards(60, 8, tp=1, pp=2), 0)
    grid = StorageGrid(60, 8, layer_partition=30, head_partition=4)
    with pytest.raises(ConfigError, match="KV heads 0-1, which are not whole groups of 4; set "
                                          "--hicache-storage-head-partition"):
        plan_rank(grid, shards(60, 8, tp=4, pp=1), 0)
    with pytest.raises(ConfigError, match="needs --hicache-storage-backend"):
        Engine("random:tiny", hicache_storage_key_scheme="unified")


# ---- engines ----------------------------------------------------------------------------------
def unified(path: Path, **kw) -> dict:
    opts = dict(dtype="float32", page_size=16, max_total_tokens=2048, enable_hierarchical_cache=True,
                hicache_storage_backend="file", hicache_storage_backend_extra_config=json.dumps({"path": str(path)}),
                hicache_storage_prefetch_threshold=64, hicache_storage_prefetch_policy="wait_complete",
                hicache_storage_key_scheme="unified")
    opts.update(kw)
    return opts


def objects(path: Path) -> collections.Counter:
    """Stored objects per grid cell (the key's tail)."""
    return collections.Counter(p.name.split("_", 2)[2] for p in path.rglob("*") if p.is_file() and p.name.count("_") >= 2)


def read_in_new_process(model: str, opts: dict, prompt: list[int]) -> dict:
    code = f"""
import json
from hicache import Engine, SamplingParams
e = Engine({model!r}, **{opts!r})
r = e.generate([{prompt!r}], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
print(json.dumps({{"ids": r.output_ids, "details": r.cached_tokens_details}}))
e.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=SRC))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.multirank
@pytest.mark.slow
def test_seed_example_tp4_pp2_writer_tp2_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cold = Engine(SEED_MODEL, dtype="float32", max_total_tokens=2048).generate([PROMPT], GREEDY)[0].output_ids
    monkeypatch.setenv("HICACHE_RANK_CONSENSUS_CHECKER", "1")
    writer = Engine(SEED_MODEL, tp_size=4, pp_size=2, **unified(tmp_path, **SEED_GRID))
    assert writer.generate([PROMPT], GREEDY)[0].output_ids == cold
    writer.shutdown()  # flushes its pages down to the store
    stored = objects(tmp_path)
    pages = stored["L0-30_H0"]
    assert pages >= 24 and stored == collections.Counter({c: pages for c in stored}) and len(stored) == 8
    # The reader's two ranks are new processes, sharing nothing with the writer's eight but the store.
    reader = Engine(SEED_MODEL, tp_size=2, **unified(tmp_path, **SEED_GRID))
    try:
        res = reader.generate([PROMPT], GREEDY)[0]
    finally:
        reader.shutdown()
    assert res.cached_tokens_details["storage"] == 384 and res.output_ids == cold


def test_other_salt_dtype_page_size_or_grid_never_hit(tmp_path: Path) -> None:
    writer = Engine("random:tiny", **unified(tmp_path, hicache_storage_layer_partition=1))
    writer.generate([PROMPT], GREEDY)
    writer.shutdown()
    hit = Engine("random:tiny", **unified(tmp_path, hicache_storage_layer_partition=1))
    assert hit.generate([PROMPT], GREEDY)[0].cached_tokens_details["storage"] == 384
    assert hit.generate([PROMPT], GREEDY, cache_salt="other")[0].cached_tokens == 0
    hit.shutdown()
    for other in (dict(hicache_storage_layer_partition=2), dict(page_size=8, hicache_storage_layer_partition=1),
                  dict(dtype="bfloat16", hicache_storage_layer_partition=1)):
        engine = Engine("random:tiny", **unified(tmp_path, **other))
        assert engine.generate([PROMPT], GREEDY)[0].cached_tokens == 0, other
        engine.shutdown()


def test_a_corrupt_cell_shortens_the_hit_to_the_pages_before_it(tmp_path: Path) -> None:
    cold = Engine("random:tiny", dtype="float32", max_total_tokens=2048).generate([PROMPT], GREEDY)[0].output_ids
    writer = Engine("random:tiny", **unified(tmp_path, hicache_storage_layer_partition=1))
    writer.generate([PROMPT], GREEDY)
    writer.shutdown()
    reader = Engine("random:tiny", **unified(tmp_path, hicache_storage_layer_partition=1))
    chain = reader.cache.keys.digest(reader.model_namespace)
    from hicache.cache.storage.keys import page_hashes
    tenth = page_hashes(PROMPT[:160], 16, chain)[9].hex()  # the 10th page's hash
    victim = next(p for p in tmp_path.rglob(f"{tenth}_*_L1-2_H1"))
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in one of the page's four objects
    victim.write_bytes(bytes(data))
    res = reader.generate([PROMPT], GREEDY)[0]
    assert res.cached_tokens_details["storage"] == 9 * 16 and res.output_ids == cold


@pytest.mark.server
def test_the_layout_endpoint_describes_grid_namespace_and_rank_cells(tmp_path: Path) -> None:
    import httpx

    from hicache.server.serve import ServerThread

    engine = Engine("random:tiny", **unified(tmp_path, hicache_storage_layer_partition=1))
    srv = ServerThread(engine, served_model_name="tiny")
    base_url = srv.start()
    try:
        layout = httpx.get(base_url + "/get_hicache_l3_cache_layout", timeout=10).json()
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
        assert httpx.post(base_url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        srv.stop()
    engine.shutdown()  # the pages go down to the store
    assert layout["key_scheme"] == "unified" and layout["grid"]["objects_per_page"] == 4
    assert layout["ranks"] == [{"rank": 0, "tp_rank": 0, "pp_rank": 0, "layers": [0, 2], "kv_heads": [0, 2],
                                "reads": ["L0-1_H0", "L0-1_H1", "L1-2_H0", "L1-2_H1"],
                                "writes": ["L0-1_H0", "L0-1_H1", "L1-2_H0", "L1-2_H1"]}]
    # a router can name every object of a page from the report alone
    digest = layout["namespace_digest"]
    names = {p.name for p in tmp_path.rglob("*") if p.is_file()}
    assert names and all(n.split("_")[1] == digest[:layout["key_namespace_digest_chars"]] for n in names)


@pytest.mark.multirank
def test_valkey_backend_serves_a_tp2_writer_to_a_tp1_reader(valkey_server) -> None:
    host, port = valkey_server
    cold = Engine("random:small", dtype="float32", max_total_tokens=2048).generate([PROMPT], GREEDY)[0].output_ids
    opts = unified(Path("/unused"), hicache_storage_backend="valkey",
                   hicache_storage_backend_extra_config=json.dumps({"host": host, "port": port}))
    writer = Engine("random:small", tp_size=2, **opts)
    writer.generate([PROMPT], GREEDY)
    writer.shutdown()
    reader = Engine("random:small", **opts)
    res = reader.generate([PROMPT], GREEDY)[0]
    assert res.cached_tokens_details["storage"] == 384 and res.output_ids == cold
    reader.shutdown()


@pytest.mark.multirank
def test_mla_latent_is_written_once_and_read_by_any_layout(tmp_path: Path) -> None:
    """An MLA latent is the same on every TP rank: TP2 writes each cell once (rank 0), and a
    one-rank reader assembles its pages from them."""
    cold = Engine("random:mla-tiny", dtype="float32", max_total_tokens=2048).generate([PROMPT], GREEDY)[0].output_ids
    opts = unified(tmp_path, hicache_storage_layer_partition=1)
    writer = Engine("random:mla-tiny", tp_size=2, **opts)
    writer.generate([PROMPT], GREEDY)
    writer.shutdown()
    stored = objects(tmp_path)
    assert set(stored) == {"L0-1", "L1-2"} and stored["L0-1"] == stored["L1-2"] >= 24
    reader = Engine("random:mla-tiny", **opts)
    res = reader.generate([PROMPT], GREEDY)[0]
    assert res.cached_tokens_details["storage"] == 384 and res.output_ids == cold
    reader.shutdown()


@pytest.mark.multirank
@pytest.mark.cp
def test_context_parallel_writers_share_objects_with_one_rank(tmp_path: Path) -> None:
    """CP2 with page-sharded KV: each page's objects are written by the rank that owns the page
    (a page neither rank wrote would end the reader's hit), and a one-rank reader serves every
    page. (Replicated CP plans like TP: the first CP rank writes.)"""
    cold = Engine("random:small", dtype="float32", max_total_tokens=2048).generate([PROMPT], GREEDY)[0].output_ids
    opts = unified(tmp_path, hicache_storage_layer_partition=2)
    writer = Engine("random:small", tp_size=2, attn_cp_size=2, enable_kv_cache_sharding=True, **opts)
    assert writer.generate([PROMPT], GREEDY)[0].output_ids == cold
    writer.shutdown()
    stored = objects(tmp_path)
    assert set(stored) == {"L0-2_H0", "L0-2_H1", "L2-4_H0", "L2-4_H1"} and len(set(stored.values())) == 1
    reader = Engine("random:small", **opts)
    res = reader.generate([PROMPT], GREEDY)[0]
    assert res.cached_tokens_details["storage"] == 384 and res.output_ids == cold
    reader.shutdown()


@pytest.mark.multirank
@pytest.mark.spec
@pytest.mark.parametrize("layout,writer_tp", [("packed", 2), ("sidecar", 1)])
def test_draft_kv_has_cells_of_its_own_and_comes_back_with_the_target(tmp_path: Path, layout: str,
                                                                      writer_tp: int) -> None:
    """Speculative decoding on the unified layout: the writer stores the draft's KV as cells
    ``draft_L..`` beside the target's; a one-rank reader restores both, so its acceptance equals
    the cold run's."""
    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="random:small:int4-g16",
                speculative_num_steps=3, speculative_draft_kv_layout=layout)
    cold = Engine("random:small", dtype="float32", max_total_tokens=2048, **spec).generate([PROMPT], GREEDY)[0]
    opts = unified(tmp_path, hicache_storage_layer_partition=2, **spec)
    writer = Engine("random:small", tp_size=writer_tp, **opts)
    writer.generate([PROMPT], GREEDY)
    writer.shutdown()
    stored = objects(tmp_path)
    assert {"draft_L0-2_H0", "draft_L2-4_H1"} <= set(stored) and len(stored) == 8 and len(set(stored.values())) == 1
    reader = Engine("random:small", **opts)
    res = reader.generate([PROMPT], GREEDY)[0]
    assert res.cached_tokens_details["storage"] == 384
    assert (res.output_ids, res.spec_accept_length) == (cold.output_ids, cold.spec_accept_length)
    reader.shutdown()


def test_holders_per_stage_follow_the_kv_placement() -> None:
    """Who plans together: every TP rank when each holds every page; one CP rank's attention-TP
    ranks with page-sharded KV (each page's owner writes it); one holder for an MLA latent
    sharded over TP ranks."""
    from hicache.runtime.storage_layout import plan_index, stage_holders

    def cfg(**kw) -> EngineConfig:
        return EngineConfig(enable_hierarchical_cache=True, hicache_storage_backend="file",
                            hicache_storage_key_scheme="unified", **kw)

    plain, cp_sharded = cfg(tp_size=4, pp_size=2), cfg(tp_size=4, attn_cp_size=2, enable_kv_cache_sharding=True)
    latent = cfg(tp_size=2, enable_kv_cache_sharding=True)
    assert (stage_holders(plain), stage_holders(cp_sharded), stage_holders(latent)) == (4, 2, 1)
    assert plan_index(plain, 1, 3) == 7
    assert [plan_index(cp_sharded, 0, t) for t in range(4)] == [0, 1, 0, 1]  # CP rank 1 plans like CP rank 0
    assert [plan_index(latent, 0, t) for t in range(2)] == [0, 0]


# SmolLM2's attention geometry (9 heads over 3 KV heads of 64) on a two-layer random model: the
# SmolLM2 grid's shape (2 layer ranges x 3 single heads) at one layer per range. Its greedy tokens
# depend on every layer's KV (unlike a deep random model's, which repeat one token).
SMOLLM2_HEADS = 'random:{"num_heads": 9, "num_kv_heads": 3, "head_dim": 64}'


@pytest.mark.multirank
@pytest.mark.slow
def test_tp3_pp2_writes_a_tp1_reader_reads_on_mooncake(mooncake_store) -> None:
    """SmolLM2's grid shape (2 layer ranges x 3 single KV heads) on a Mooncake Store: six ranks
    (TP3 x PP2) write one object each per page into the store service's memory, a one-rank engine
    in a new process reads every page back. (Both directions on Valkey:
    test_tp1_and_tp3_pp2_continue_each_others_sessions.)"""
    cold = Engine(SMOLLM2_HEADS, dtype="float32", max_total_tokens=2048).generate([PROMPT], GREEDY)[0].output_ids
    opts = unified(Path("/unused"), hicache_storage_backend="mooncake", hicache_storage_layer_partition=1,
                   hicache_storage_head_partition=1,
                   hicache_storage_backend_extra_config=json.dumps(dict(mooncake_store, prefix="smollm2-tp-pp:")))
    wide = Engine(SMOLLM2_HEADS, tp_size=3, pp_size=2, **opts)
    res = wide.generate([PROMPT], GREEDY)[0]
    assert res.output_ids == cold and res.cached_tokens_details["storage"] == 0
    wide.shutdown()
    got = read_in_new_process(SMOLLM2_HEADS, opts, PROMPT)
    assert got["ids"] == cold
    assert got["details"]["storage"] == (res.prompt_tokens - 1) // 16 * 16 == 384


@pytest.mark.multirank
@pytest.mark.slow
def test_tp1_and_tp3_pp2_continue_each_others_sessions(valkey_server) -> None:
    """SmolLM2's grid shape on Valkey, both ways: TP1 writes a session; a TP3 x PP2 engine (6
    ranks: one KV head and one layer each -- one object per rank and page) continues it from L3
    and stores its longer turn; a new TP1 engine reads all of that turn back (from a new process:
    the Mooncake test above). Every output equals the cache-off engine's. (SmolLM2 itself at TP3 and across TP sizes:
    test_parallel.py; issue 15's first figures ran this on SmolLM2 and now cost CI 20-40 s.)"""
    host, port = valkey_server
    turn1, turn2 = PROMPT[:300], PROMPT
    cold = Engine(SMOLLM2_HEADS, dtype="float32", max_total_tokens=2048)
    cold1, cold2 = (r.output_ids for r in cold.generate([turn1, turn2], GREEDY))
    cold.shutdown()
    opts = unified(Path("/unused"), hicache_storage_backend="valkey", hicache_storage_layer_partition=1,
                   hicache_storage_head_partition=1,
                   hicache_storage_backend_extra_config=json.dumps({"host": host, "port": port, "prefix": "tp-pp:"}))
    first = Engine(SMOLLM2_HEADS, **opts)
    res1 = first.generate([turn1], GREEDY)[0]
    assert res1.output_ids == cold1 and res1.cached_tokens_details["storage"] == 0
    first.shutdown()  # its pages reach the store
    wide = Engine(SMOLLM2_HEADS, tp_size=3, pp_size=2, **opts)
    res2 = wide.generate([turn2], GREEDY)[0]
    assert res2.output_ids == cold2
    assert res2.cached_tokens_details["storage"] == (res1.prompt_tokens - 1) // 16 * 16  # turn 1's whole pages
    wide.shutdown()
    last = Engine(SMOLLM2_HEADS, **opts)  # a fresh tree and pools: its hits come from the store
    res3 = last.generate([turn2], GREEDY)[0]
    last.shutdown()
    assert res3.output_ids == cold2
    assert res3.cached_tokens_details["storage"] == (res2.prompt_tokens - 1) // 16 * 16  # pages only the 6 ranks wrote
