"""Unified vs rank-suffix storage layout: backup and restore bandwidth on the same host pages,
measured side by side in one run, and objects / bytes per page.

    python benchmarks/bench_unified.py [--pages 256] [--layers 30] [--kv-heads 3] [--head-dim 64]
                                       [--layer-partition 15] [--head-partition 1] [--repeats 3]
                                       [--backend {file,valkey}]

One rank's host pool (SmolLM2's KV shape by default: 30 layers x 3 KV heads x 64, float32,
16-token pages, 737 KiB a page) full of random values is backed up to an empty store (a file
folder, or a local valkey-server with ``--backend valkey``) and read back into other host pages by the real :class:`StorageController`, once with one object per
page (rank-suffix, page_first host pages) and twice on the unified grid (one object per cell:
``layers / L x heads / H`` per page): written and read in place from page_unified host pages,
and cut out of / scattered into page_first pages. Restored bytes are checked equal to the
originals. The file store sits in the OS page cache (both layouts alike), so the figures are the
engine's cost of cutting, encoding, checksumming and storing objects (a file each: ~0.4 ms to
create one on the VM measured), not the disk's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
import uuid

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")]  # tests/: local_server

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hicache.cache.host_pool import HostKVPool  # noqa: E402
from hicache.cache.pools import DeviceKVPool  # noqa: E402
from hicache.cache.storage.keys import page_hashes  # noqa: E402
from hicache.cache.storage.page_objects import GridCell, WholePage  # noqa: E402
from hicache.cache.storage.prefetch_backup import StorageController  # noqa: E402
from hicache.cache.storage.registry import create_backend  # noqa: E402
from hicache.cache.storage.unified import StorageGrid  # noqa: E402
from local_server import start_valkey_server  # noqa: E402

STORES = {"file": "file backend in the page cache", "valkey": "valkey backend (a local valkey-server on loopback)"}


def measure(host: HostKVPool, objects: list, pages: int, repeats: int, store: str, server) -> dict:
    """Best-of-``repeats`` backup and restore seconds of pages 1..pages into pages+1..2*pages,
    each repeat on an empty store (a fresh folder, or a fresh key prefix on the one server)."""
    best = {"backup_s": float("inf"), "restore_s": float("inf")}
    digest = bytes(32)
    src = np.arange(1, pages + 1)
    dst = np.arange(pages + 1, 2 * pages + 1)
    stored_bytes = 0
    for r in range(repeats):
        root = tempfile.mkdtemp(prefix="bench-unified-")
        config = {"path": root} if store == "file" else \
            {"host": server[0], "port": server[1], "prefix": f"bench-{uuid.uuid4().hex}:"}
        backend = create_backend(store, config)
        ctrl = StorageController(backend, host, reads=objects)
        hashes = page_hashes(np.arange(pages * host.page_size, dtype=np.int32) + r, host.page_size, digest)
        t0 = time.perf_counter()
        op = ctrl.backup(digest, hashes, src, [])
        op.done.wait()
        best["backup_s"] = min(best["backup_s"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        read = ctrl.prefetch("bench", digest, hashes, dst)
        read.done.wait()
        best["restore_s"] = min(best["restore_s"], time.perf_counter() - t0)
        assert op.written == pages and read.progress[-2][0] == pages, (op.failure, read.failure)
        assert torch.equal(host.buffer[1:pages + 1], host.buffer[pages + 1:2 * pages + 1]), "restored bytes differ"
        host.buffer[pages + 1:].zero_()
        stored_bytes = backend.stats().bytes_written
        backend.clear()
        ctrl.shutdown()
        shutil.rmtree(root)
    return {**best, "objects_per_page": len(objects), "stored_bytes_per_page": stored_bytes / pages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layer-partition", type=int, default=15)
    ap.add_argument("--head-partition", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", choices=("file", "valkey"), default="file")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(start_valkey_server()).address if args.backend == "valkey" else None
        run(args, server)


def run(args: argparse.Namespace, server: tuple[str, int] | None) -> None:
    device = DeviceKVPool(args.layers, args.kv_heads, args.head_dim, 2, 16, torch.float32, "cpu")
    hosts = {layout: HostKVPool(device, 2 * args.pages + 1, layout, pin_memory=False, cell_heads=args.head_partition)
             for layout in ("page_first", "page_unified")}
    for host in hosts.values():
        host.buffer.copy_(torch.randn(host.buffer.shape))
    page_mib = device.bytes_per_page / 2**20
    grid = StorageGrid(args.layers, args.kv_heads, args.layer_partition, args.head_partition)
    print(f"bench_unified: {args.pages} pages of {page_mib:.2f} MiB ({args.layers} layers x {args.kv_heads} KV heads "
          f"x {args.head_dim}, float32, page 16), {STORES[args.backend]}, {os.cpu_count()} CPUs")
    rows = {"rank-suffix (page_first)": measure(hosts["page_first"], [WholePage(hosts["page_first"])], args.pages,
                                                args.repeats, args.backend, server)}
    for layout, how in (("page_unified", "in place"), ("page_first", "cut out")):
        cells = [GridCell(hosts[layout], c, grid, 0, 0) for c in grid.cells()]
        rows[f"unified, {how}"] = measure(hosts[layout], cells, args.pages, args.repeats, args.backend, server)
    print(f"unified grid {grid.describe()}: 'in place' = the page_unified host layout the scheme selects, "
          "'cut out' = the same cells copied out of page_first pages")
    base = rows["rank-suffix (page_first)"]
    total = args.pages * page_mib / 1024
    print(f"\n{'layout':<26}{'objects/page':>13}{'bytes/page':>12}{'backup GB/s':>13}{'restore GB/s':>14}"
          f"{'backup x':>10}{'restore x':>11}")
    for name, r in rows.items():
        print(f"{name:<26}{r['objects_per_page']:>13}{r['stored_bytes_per_page']:>12.0f}"
              f"{total / r['backup_s']:>13.2f}{total / r['restore_s']:>14.2f}"
              f"{base['backup_s'] / r['backup_s']:>10.2f}{base['restore_s'] / r['restore_s']:>11.2f}")


if __name__ == "__main__":
    main()
