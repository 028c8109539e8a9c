"""How much memory decode caches take and how much the device can still give them.

`cache_bytes` splits a `Decoder.init_cache` pytree by kind (the decode benchmark's and tests'
breakdown); `free_memory` is what `Decoder` checks a requested cache against before it
allocates one (generate and RL rollouts size caches from user input).
"""

from __future__ import annotations

import os

import jax

from model.config import ModelConfig
from model.inference.compressed_cache import CompressorCache
from model.layers.layer_plan import layer_kinds, plan_segments


def free_memory() -> int:
    """Bytes the first device can still allocate: its allocator's limit less what is in use
    (GPU, TPU), or the host memory available to new allocations (CPU, whose arrays live
    there: Linux's MemAvailable, which counts reclaimable caches, else the free pages)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cache_bytes(config: ModelConfig, cache) -> dict[str, int]:
    """Bytes of a decode cache (`Decoder.init_cache`) by kind: 'full' (F layers), 'swa' (the
    sliding-window rings: S and W layers, the window branch of C / H layers, the MTP heads),
    'compressed' (C / H layers' compressed entries and compressor tails), 'indexer' (the CSA
    indexers' keys and tails); the last two are 0 without DeepSeek-V4 compressed layers."""
    kinds = layer_kinds(config)
    segments = plan_segments(kinds)
    totals = {"full": 0, "swa": 0, "compressed": 0, "indexer": 0}
    for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]:
        names = [getattr(p, "key", getattr(p, "name", "")) for p in path]
        if names[0] == "layers" and names[1].startswith("segment_"):
            segment = segments[int(names[1].removeprefix("segment_"))]
            kind = kinds[segment.start + int(names[2].removeprefix("block_"))]
        elif names[0] == "layers":
            kind = kinds[int(names[1].removeprefix("layer_"))]
        else:
            kind = None  # an MTP head
        if "indexer" in names:
            category = "indexer"
        elif any(name in CompressorCache._fields for name in names):
            category = "compressed"
        else:
            category = "full" if kind is not None and kind.attention_type == "F" else "swa"
        totals[category] += leaf.size * leaf.dtype.itemsize
    return totals
