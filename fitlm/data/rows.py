"""How a `SequenceLoader` (fitlm.data.loader) lays out rows: the epoch order of its windows, a pure function of
(seed, epoch), and the greedy in-order packing of whole documents into rows, with positions restarting at
each document."""

from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def window_order(num_windows: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled row order of one epoch, a pure function of (seed, epoch).

    Sorting by a fixed integer hash (splitmix64) rather than calling a library RNG keeps the order
    identical across numpy/torch versions and platforms, so a resumed run on new software still
    continues the same sequence.
    """
    key = _splitmix64(np.array([seed & _MASK64], dtype=np.uint64))
    key = _splitmix64(key ^ np.uint64(epoch & _MASK64))
    keys = _splitmix64(np.arange(num_windows, dtype=np.uint64) ^ key)
    return np.argsort(keys, kind="stable")


def restart_positions(doc: np.ndarray) -> np.ndarray:
    """Positions along the last axis that restart at 0 wherever `doc` changes (and at index 0)."""
    idx = np.arange(doc.shape[-1])
    starts = np.ones(doc.shape, dtype=bool)
    starts[..., 1:] = doc[..., 1:] != doc[..., :-1]
    return idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=-1)


def pack_rows(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Greedy in-order packing: row starts (document indices, plus the end) so that each row's
    documents sum to at most `capacity` tokens. Lengths must already be <= capacity."""
    starts = [0]
    fill = 0
    for i, n in enumerate(lengths.tolist()):
        if fill + n > capacity:
            starts.append(i)
            fill = 0
        fill += n
    if lengths.size:
        starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)


__all__ = ["pack_rows", "restart_positions", "window_order"]
