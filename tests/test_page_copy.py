"""Page copies between device and host page views: bit-exact against a per-page reference for
scattered, consecutive, mixed and empty page lists, every host layout, both directions; the plan's
cut into runs; the GPU paths' logic run on CPU tensors; a whole transfer through the controller."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.cache import page_copy
from hicache.cache.host_pool import HostKVPool, device_page_view
from hicache.cache.host_transfer import BACKUP, LOAD, TransferController
from hicache.cache.page_copy import PagePlan, copy_pages, page_items
from hicache.cache.pools import DeviceKVPool

pytestmark = pytest.mark.cache

LAYERS, HEADS, DIM, PAGE, PAGES = 3, 2, 8, 4, 64
PATTERNS = ("scattered", "consecutive", "mixed", "reversed", "single", "empty")


def random_bits(shape: tuple[int, ...]) -> torch.Tensor:
    """bf16 with arbitrary bit patterns (NaNs, -0.0, denormals): only a byte-exact copy matches."""
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16).view(torch.bfloat16)


def blocks(rng: np.random.Generator, num_pages: int) -> np.ndarray:
    """Pages 1..num_pages-1 cut into blocks of 1-9 consecutive pages, blocks shuffled."""
    cuts = np.cumsum(rng.integers(1, 10, num_pages))
    parts = np.split(np.arange(1, num_pages), cuts[cuts < num_pages - 1])
    return np.concatenate([parts[i] for i in rng.permutation(len(parts))])


def page_lists(pattern: str, n: int, src_pages: int, dst_pages: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if pattern == "empty":
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if pattern == "single":
        return rng.integers(1, src_pages, 1), rng.integers(1, dst_pages, 1)
    if pattern == "consecutive":
        a, b = rng.integers(1, src_pages - n + 1), rng.integers(1, dst_pages - n + 1)
        return np.arange(a, a + n), np.arange(b, b + n)
    if pattern == "reversed":  # consecutive on both sides, but descending: no run longer than 1
        return np.arange(n, 0, -1), np.arange(dst_pages - 1, dst_pages - 1 - n, -1)
    if pattern == "mixed":
        return blocks(rng, src_pages)[:n], blocks(rng, dst_pages)[:n]
    return rng.permutation(np.arange(1, src_pages))[:n], rng.permutation(np.arange(1, dst_pages))[:n]


def reference(src: torch.Tensor, src_pages: np.ndarray, dst: torch.Tensor, dst_pages: np.ndarray) -> torch.Tensor:
    out = dst.clone()
    for s, d in zip(src_pages.tolist(), dst_pages.tolist()):
        out[d] = src[s]
    return out


def maximal_runs(sp: list[int], dp: list[int]) -> list[tuple[int, int, int]]:
    runs: list[list[int]] = []
    for s, d in zip(sp, dp):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def host_view(layout: str, num_pages: int) -> torch.Tensor:
    """Layer 1's V of a host buffer: contiguous pages (layer_first) or strided pages (page_first)."""
    row = (PAGE, HEADS, DIM)
    if layout == "layer_first":
        return random_bits((LAYERS, 2, num_pages, *row))[1, 1]
    return random_bits((num_pages, LAYERS, 2, *row))[:, 1, 1]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("direction", [BACKUP, LOAD])
@pytest.mark.parametrize("min_run", [1, 4, 10**6])
def test_copy_matches_per_page_reference(pattern: str, layout: str, direction: str, min_run: int) -> None:
    device = device_page_view(random_bits((PAGES * PAGE, HEADS, DIM)), PAGE)
    host = host_view(layout, PAGES + 17)
    src, dst = (device, host) if direction == BACKUP else (host, device)
    for seed in range(5):
        sp, dp = page_lists(pattern, 1 + 7 * seed, src.shape[0], dst.shape[0], seed)
        plan = PagePlan(sp, dp, min_run=min_run)
        expected = reference(src, sp, dst, dp)
        before, dst_before = src.clone(), dst.clone()
        staging = random_bits((len(plan.src_rest) + 3, PAGE, HEADS, DIM))
        for args in ((src, dst, plan), (src, dst, plan, staging), (page_items(src), page_items(dst), plan)):
            dst.copy_(dst_before)
            copy_pages(*args)
            assert same_bits(dst, expected), (pattern, seed)
        assert same_bits(src, before)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_gpu_paths_match_reference(monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    """The paths taken when a CUDA device is involved, run here on CPU tensors: between two views
    on one device (slice copy_, index_select into the staging buffer, index_copy_), and between a
    device and host memory (:func:`page_copy.copy_staged`: the device side gathered or scattered
    through the staging buffer -- one larger than the op, or of 3 pages: the op in chunks --, the
    host side copied in runs of consecutive host pages)."""
    device = device_page_view(random_bits((PAGES * PAGE, HEADS, DIM)), PAGE)
    for direction in (BACKUP, LOAD):
        host = host_view(layout, PAGES + 17)
        src, dst = (device, host) if direction == BACKUP else (host, device)
        for pattern in PATTERNS:
            sp, dp = page_lists(pattern, 25, src.shape[0], dst.shape[0], seed=7)
            plan = PagePlan(sp, dp)
            expected, before = reference(src, sp, dst, dp), dst.clone()
            with monkeypatch.context() as m:  # one device, not the CPU's numpy path
                m.setattr(page_copy, "_on_cpu", lambda buf: False)
                staging = random_bits((len(plan.src_rest), PAGE, HEADS, DIM)) if pattern != "mixed" else None
                copy_pages(src, dst, plan, staging, non_blocking=True)
            assert same_bits(dst, expected), (direction, pattern)
            for staging in (None, random_bits((len(sp) + 5, PAGE, HEADS, DIM)), random_bits((3, PAGE, HEADS, DIM))):
                dst.copy_(before)
                page_copy.copy_staged(src, dst, plan, to_host=direction == BACKUP, staging=staging)
                assert same_bits(dst, expected), (direction, pattern, staging is None)


def test_staged_copies_move_host_pages_in_runs() -> None:
    """Host memory is touched in whole runs of consecutive host pages, whatever order the device
    pages are in: one slice per run (cut too where a staging buffer's chunk ends)."""
    plan = PagePlan(np.array([9, 3, 4, 30, 2, 7]), np.array([5, 6, 7, 8, 20, 21]))
    assert plan.side_runs(True) == [(0, 5, 4), (4, 20, 2)]
    assert plan.side_runs(False) == [(0, 9, 1), (1, 3, 2), (3, 30, 1), (4, 2, 1), (5, 7, 1)]
    assert plan.side_runs(True, chunk=3) == [(0, 5, 3), (3, 8, 1), (4, 20, 2)]  # cut where a 3-page buffer fills
    assert PagePlan(np.zeros(0, np.int64), np.zeros(0, np.int64)).side_runs(True) == []


@pytest.mark.parametrize("pattern", PATTERNS)
def test_plan_cuts_runs_consecutive_on_both_sides(pattern: str) -> None:
    for seed in range(10):
        sp, dp = page_lists(pattern, 40, 200, 300, seed)
        plan = PagePlan(sp, dp, min_run=3)
        covered = [(s + i, d + i) for s, d, n in plan.runs for i in range(n)]
        covered += list(zip(plan.src_rest.tolist(), plan.dst_rest.tolist()))
        assert sorted(covered) == sorted(zip(sp.tolist(), dp.tolist()))
        assert plan.runs == [r for r in maximal_runs(sp.tolist(), dp.tolist()) if r[2] >= 3]
    assert PagePlan(np.arange(5, 9), np.arange(20, 24)).runs == [(5, 20, 4)]


def test_plan_rejects_bad_page_lists() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        PagePlan(np.arange(3), np.arange(4))
    with pytest.raises(ValueError, match="repeat"):
        PagePlan(np.array([1, 2, 3]), np.array([5, 6, 5]))
    with pytest.raises(IndexError):
        PagePlan(np.array([-1]), np.array([1]))
    src = device_page_view(random_bits((8 * PAGE, HEADS, DIM)), PAGE)
    dst = torch.zeros_like(src)
    for sp, dp in (([8], [1]), ([1], [8]), ([4, 5, 6, 7, 8], [1, 2, 3, 4, 5])):
        with pytest.raises(IndexError):
            copy_pages(src, dst, PagePlan(np.array(sp), np.array(dp)))
    assert not dst.view(torch.int16).any()
    one = PagePlan(np.array([1]), np.array([1]))
    for other in (torch.zeros(8, PAGE, HEADS, DIM), torch.zeros(8, PAGE, HEADS, 2 * DIM, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="rows differ"):
            copy_pages(src, other, one)
    with pytest.raises(ValueError, match="rows differ"):  # as numpy page items: a different page size
        copy_pages(page_items(src), page_items(torch.zeros(8, 2 * PAGE, HEADS, DIM)), one)


# (layout, KV heads per unified object): page_unified with one head per group (rows strided),
# one group per page (rows contiguous), and an MLA latent (one "head", K and V halves interleaved).
HOST_LAYOUTS = [("layer_first", None), ("page_first", None), ("page_unified", 1), ("page_unified", HEADS),
                ("page_unified", 0)]


@pytest.mark.parametrize("layout, cell_heads", HOST_LAYOUTS)
@pytest.mark.parametrize("pattern", ["scattered", "mixed", "consecutive"])
def test_controller_backup_then_load_round_trips(layout: str, cell_heads: int | None, pattern: str) -> None:
    heads = 1 if cell_heads == 0 else HEADS
    pool = DeviceKVPool(LAYERS, heads, DIM, num_pages=PAGES, page_size=PAGE, dtype=torch.bfloat16, device="cpu")
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_(random_bits(buf.shape))
    host = HostKVPool(pool, PAGES + 9, layout, cell_heads=cell_heads)
    ctl = TransferController(pool, host)
    try:
        dev_pages, host_pages = page_lists(pattern, 30, PAGES, host.num_pages, seed=3)
        before = [device_page_view(b, PAGE).clone() for b in pool.k_buffers + pool.v_buffers]
        ctl.submit(BACKUP, dev_pages, host_pages, [])
        assert len(ctl.pop(BACKUP, 1)) == 1
        for layer in range(LAYERS):
            for kv in range(2):
                got = host.page_view(layer, kv)[host_pages].reshape(len(host_pages), PAGE, heads, DIM)
                assert same_bits(got, before[kv * LAYERS + layer][dev_pages])
        targets = np.random.default_rng(4).permutation(np.arange(1, PAGES))[: len(dev_pages)]
        ctl.submit(LOAD, targets, host_pages, [])
        ctl.pop(LOAD, 1)
        for i, buf in enumerate(pool.k_buffers + pool.v_buffers):
            expected = reference(before[i], dev_pages, before[i], targets)
            assert same_bits(device_page_view(buf, PAGE), expected)
    finally:
        ctl.shutdown()
