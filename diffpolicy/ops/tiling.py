"""Pure-Python mirror of the AscendC GAE kernel's host tiling (``kernels/gae/ascendc/op_host``).

Same formulas as ``ComputeGaeTiling`` in ``gae_tiling.h``, plus :func:`schedule`, the order in which
``op_kernel/gae.cpp`` visits its tiles, so a CPU test can check for any (T, N) that every element is
computed exactly once, that column offsets and UB rows are 32-byte aligned, and that the buffers fit
the unified buffer. T decisions, N environments; float32 throughout (8 elements per 32-byte block).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

BLOCK_BYTES = 32
"""UB and DMA alignment unit."""
ALIGN_ELEMS = BLOCK_BYTES // 4
"""float32 elements per 32-byte block."""
BUFFER_NUM = 2
"""Double-buffered copy-in/copy-out queues."""
TILE_STREAMS = 5
"""Tiles in UB per buffer: rewards, values, dones in; advantages, returns out."""
ROW_BUFFERS = 4
"""Single rows in UB: V_{t+1}, A_{t+1}, delta, last value."""
MAX_TILE_COLS = 512
"""Columns per UB tile at most (2 KiB per row and stream)."""
MAX_TILE_T = 4095
"""Rows per UB tile at most: DataCopyPad's blockCount has 12 bits."""
UB_RESERVE_BYTES = 16 * 1024
"""UB left to the runtime."""
UB_BYTES_910B = 192 * 1024
"""Unified buffer of one Ascend 910B vector core."""


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def align_up(a: int) -> int:
    """Round a count of float32 up to whole 32-byte blocks."""
    return ceil_div(a, ALIGN_ELEMS) * ALIGN_ELEMS


@dataclass(frozen=True)
class GaeTiling:
    """Mirror of ``GaeTilingData``: the split of a (T, N) problem into cores and UB tiles."""

    total_t: int
    """T, decisions."""
    total_n: int
    """N, environments."""
    used_cores: int
    """Launch blockDim; every used core owns at least one column."""
    cols_per_core: int
    """Columns per core, a multiple of 8 (the last core takes the rest)."""
    tile_cols: int
    """Columns per UB tile, a multiple of 8 (the last tile of a core takes the rest)."""
    tile_t: int
    """Rows per UB tile (the earliest tile in time takes the rest)."""


@dataclass(frozen=True)
class Tile:
    """One UB tile as the kernel processes it: rows [t0, t0 + rows) x columns [c0, c0 + cols)."""

    core: int
    c0: int
    cols: int
    t0: int
    rows: int

    @property
    def row_pitch(self) -> int:
        """Elements between rows of this tile in UB (rows padded to 32 bytes by DataCopyPad)."""
        return align_up(self.cols)


def gae_tiling(
    t: int, n: int, core_num: int = 48, ub_bytes: int = UB_BYTES_910B - UB_RESERVE_BYTES
) -> GaeTiling:
    """``ComputeGaeTiling(T, N, coreNum, ubBytes)`` of ``gae_tiling.h``."""
    if t == 0 or n == 0 or core_num == 0:
        return GaeTiling(t, n, 0, 0, 0, 0)
    groups = ceil_div(n, ALIGN_ELEMS)
    groups_per_core = ceil_div(groups, min(core_num, groups))
    cols_per_core = groups_per_core * ALIGN_ELEMS
    used_cores = ceil_div(groups, groups_per_core)
    tile_cols = min(cols_per_core, MAX_TILE_COLS)
    row_bytes = tile_cols * 4
    fixed_bytes = ROW_BUFFERS * row_bytes
    per_row_bytes = TILE_STREAMS * BUFFER_NUM * row_bytes
    fit = (ub_bytes - fixed_bytes) // per_row_bytes if ub_bytes > fixed_bytes else 0
    tile_t = max(1, min(t, MAX_TILE_T, fit))
    return GaeTiling(t, n, used_cores, cols_per_core, tile_cols, tile_t)


def ub_bytes(tiling: GaeTiling) -> int:
    """``GaeUbBytes``: UB bytes the kernel allocates with InitBuffer for this tiling."""
    row_bytes = tiling.tile_cols * 4
    return TILE_STREAMS * BUFFER_NUM * tiling.tile_t * row_bytes + ROW_BUFFERS * row_bytes


def schedule(tiling: GaeTiling) -> Iterator[Tile]:
    """The tiles in the order the kernel visits them: per core, per column tile, time tiles in reverse."""
    for core in range(tiling.used_cores):
        col_start = core * tiling.cols_per_core
        core_cols = min(tiling.cols_per_core, tiling.total_n - col_start)
        for c in range(0, core_cols, tiling.tile_cols):
            cols = min(tiling.tile_cols, core_cols - c)
            t_end = tiling.total_t
            while t_end > 0:
                rows = min(tiling.tile_t, t_end)
                yield Tile(core, col_start + c, cols, t_end - rows, rows)
                t_end -= rows
