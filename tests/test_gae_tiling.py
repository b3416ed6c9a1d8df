"""Tiling of the AscendC GAE kernel, checked on the CPU: the Python mirror covers every element of a
(T, N) problem exactly once with 32-byte alignment, and agrees with the C++ host tiling."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from diffpolicy.ops import tiling
from diffpolicy.ops._loader import KERNELS_DIR

AWKWARD = [
    (1, 1),
    (1, 7),
    (7, 1),
    (5, 7),
    (3, 8),
    (2, 9),
    (4, 8 * 48),
    (4, 8 * 48 + 3),
    (33, 8 * 48 * 2 + 5),
    (1, 100_003),
    (2048, 64),
    (1024, 1024),
    (10_000, 3),
    (5000, 4099),
]
CORES = [1, 40, 48]


@pytest.mark.parametrize("T,N", AWKWARD)
@pytest.mark.parametrize("cores", CORES)
def test_every_element_exactly_once(T, N, cores):
    t = tiling.gae_tiling(T, N, core_num=cores)
    assert 1 <= t.used_cores <= min(cores, N)
    count = np.zeros((T, N), dtype=np.int32)
    last_core, last_c0, t_end = -1, -1, None
    for tile in tiling.schedule(t):
        count[tile.t0 : tile.t0 + tile.rows, tile.c0 : tile.c0 + tile.cols] += 1
        # 32-byte alignment: column offsets in whole blocks, UB rows padded to whole blocks
        assert tile.c0 % tiling.ALIGN_ELEMS == 0
        assert tile.row_pitch % tiling.ALIGN_ELEMS == 0 and tile.row_pitch >= tile.cols
        assert tile.row_pitch * tile.rows <= t.tile_t * t.tile_cols  # fits the queue buffer
        assert 1 <= tile.rows <= min(t.tile_t, tiling.MAX_TILE_T) and 1 <= tile.cols <= t.tile_cols
        # time tiles of one column tile are walked in reverse, contiguously, ending at t = 0
        if (tile.core, tile.c0) != (last_core, last_c0):
            assert t_end in (None, 0)
            assert tile.t0 + tile.rows == T
        else:
            assert tile.t0 + tile.rows == t_end
        last_core, last_c0, t_end = tile.core, tile.c0, tile.t0
    assert t_end == 0
    assert count.min() == 1 and count.max() == 1
    # each core owns one contiguous column range; all but the last are whole blocks
    assert t.cols_per_core % tiling.ALIGN_ELEMS == 0 and t.tile_cols % tiling.ALIGN_ELEMS == 0
    assert (t.used_cores - 1) * t.cols_per_core < N <= t.used_cores * t.cols_per_core
    assert tiling.ub_bytes(t) <= tiling.UB_BYTES_910B - tiling.UB_RESERVE_BYTES


def test_large_problems_use_every_core_and_fill_the_buffer():
    t = tiling.gae_tiling(4096, 4096, core_num=48)
    # 512 column blocks, ceil(512 / 48) = 11 blocks (88 columns) per core, ceil(512 / 11) = 47 cores
    assert (t.cols_per_core, t.used_cores) == (88, 47)
    assert t.tile_cols == 88 and t.tile_t > 16
    assert tiling.ub_bytes(t) > 0.8 * (tiling.UB_BYTES_910B - tiling.UB_RESERVE_BYTES)


def test_empty_problem_launches_nothing():
    assert tiling.gae_tiling(0, 5).used_cores == 0
    assert list(tiling.schedule(tiling.gae_tiling(5, 0))) == []


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_cpp_host_tiling_matches_python_mirror(tmp_path):
    header = KERNELS_DIR / "gae" / "ascendc" / "op_host" / "gae_tiling.h"
    cases = [(T, N, cores, ub) for T, N in AWKWARD for cores in CORES for ub in (176 * 1024, 240 * 1024)]
    driver = tmp_path / "driver.cpp"
    driver.write_text(
        '#include <cstdio>\n#include "gae_tiling.h"\nint main() {\n  unsigned c[][4] = {'
        + ",".join("{" + ",".join(map(str, case)) + "}" for case in cases)
        + "};\n  for (auto& x : c) {\n"
        "    auto t = diffpolicy::ComputeGaeTiling(x[0], x[1], x[2], x[3]);\n"
        '    std::printf("[%u,%u,%u,%u,%u,%u,%u]\\n", t.totalT, t.totalN, t.usedCores, t.colsPerCore,'
        " t.tileCols, t.tileT, diffpolicy::GaeUbBytes(t));\n  }\n}\n"
    )
    exe = tmp_path / "driver"
    subprocess.run(
        ["c++", "-std=c++17", "-O1", f"-I{header.parent}", str(driver), "-o", str(exe)], check=True
    )
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    assert len(lines) == len(cases)
    for (T, N, cores, ub), line in zip(cases, lines):
        t = tiling.gae_tiling(T, N, core_num=cores, ub_bytes=ub)
        expected = [
            t.total_t,
            t.total_n,
            t.used_cores,
            t.cols_per_core,
            t.tile_cols,
            t.tile_t,
            tiling.ub_bytes(t),
        ]
        assert json.loads(line) == expected, (T, N, cores, ub)
