"""Whether Mooncake's transfer engine can run here (the P/D tests over ``--disaggregation-transfer-backend
mooncake``: test_disagg, test_hybrid_pool)."""

from __future__ import annotations

import importlib


def mooncake_transfer_engine_missing() -> str | None:
    """Why Mooncake's transfer engine cannot be used here, or None when it can."""
    try:
        importlib.import_module("mooncake.engine")
    except ImportError as e:
        return f"mooncake.engine does not import ({e}): pip install mooncake-transfer-engine-non-cuda and libibverbs1"
    return None
