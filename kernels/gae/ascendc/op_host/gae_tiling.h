// Host-side tiling of the AscendC GAE kernel: how a (T, N) problem splits into AI cores and
// unified-buffer (UB) tiles. Plain C++ with no CANN dependency, so the formulas can be compiled and
// checked anywhere; diffpolicy/ops/tiling.py mirrors them line by line and tests/test_gae_tiling.py
// compares the two.
//
// Split: the N environment columns go to cores in whole 32-byte blocks (8 float32), colsPerCore each
// (the last core takes the tail). Inside a core, columns go to tiles of tileCols (a multiple of 8,
// the last tile takes the tail), and for each column tile the time axis is walked in reverse in
// tiles of tileT rows (the earliest tile takes the tail). One UB tile holds tileT rows of each stream,
// each row padded to a 32-byte multiple.
#ifndef DIFFPOLICY_GAE_TILING_H
#define DIFFPOLICY_GAE_TILING_H

#include <algorithm>
#include <cstdint>

namespace diffpolicy {

constexpr uint32_t kGaeBlockBytes = 32;                             // UB and DMA alignment unit
constexpr uint32_t kGaeAlignElems = kGaeBlockBytes / sizeof(float);  // 8 float32 per block
constexpr uint32_t kGaeBufferNum = 2;                               // double-buffered queues
constexpr uint32_t kGaeTileStreams = 5;                             // r, V, d in; A, R out
constexpr uint32_t kGaeRowBuffers = 4;                              // V_{t+1}, A_{t+1}, delta, last value
constexpr uint32_t kGaeMaxTileCols = 512;                           // 2 KiB per row and stream
constexpr uint32_t kGaeMaxTileT = 4095;                             // DataCopyPad blockCount is 12 bits
constexpr uint32_t kGaeUbReserveBytes = 16 * 1024;                  // left to the runtime

struct GaeTilingData {
  uint32_t totalT;       // T, decisions
  uint32_t totalN;       // N, environments
  uint32_t usedCores;    // launch blockDim; every used core owns >= 1 column
  uint32_t colsPerCore;  // columns per core, multiple of kGaeAlignElems (last core: the rest)
  uint32_t tileCols;     // columns per UB tile, multiple of kGaeAlignElems (last tile: the rest)
  uint32_t tileT;        // rows per UB tile (earliest tile: the rest)
};

inline uint32_t GaeCeilDiv(uint32_t a, uint32_t b) { return (a + b - 1) / b; }
inline uint32_t GaeAlignUp(uint32_t a) { return GaeCeilDiv(a, kGaeAlignElems) * kGaeAlignElems; }

// coreNum: vector (AIV) cores available; ubBytes: usable unified buffer per core, after the reserve.
inline GaeTilingData ComputeGaeTiling(uint32_t T, uint32_t N, uint32_t coreNum, uint32_t ubBytes) {
  GaeTilingData tiling{T, N, 0, 0, 0, 0};
  if (T == 0 || N == 0 || coreNum == 0) {
    return tiling;
  }
  const uint32_t groups = GaeCeilDiv(N, kGaeAlignElems);  // 32-byte column groups
  const uint32_t groupsPerCore = GaeCeilDiv(groups, std::min(coreNum, groups));
  tiling.colsPerCore = groupsPerCore * kGaeAlignElems;
  tiling.usedCores = GaeCeilDiv(groups, groupsPerCore);
  tiling.tileCols = std::min(tiling.colsPerCore, kGaeMaxTileCols);
  const uint32_t rowBytes = tiling.tileCols * static_cast<uint32_t>(sizeof(float));
  const uint32_t fixedBytes = kGaeRowBuffers * rowBytes;
  const uint32_t perRowBytes = kGaeTileStreams * kGaeBufferNum * rowBytes;
  const uint32_t fit = ubBytes > fixedBytes ? (ubBytes - fixedBytes) / perRowBytes : 0;
  tiling.tileT = std::max<uint32_t>(1, std::min({T, kGaeMaxTileT, fit}));
  return tiling;
}

// UB bytes the kernel allocates for a tiling (what InitBuffer is called with, summed).
inline uint32_t GaeUbBytes(const GaeTilingData& tiling) {
  const uint32_t rowBytes = tiling.tileCols * static_cast<uint32_t>(sizeof(float));
  return kGaeTileStreams * kGaeBufferNum * tiling.tileT * rowBytes + kGaeRowBuffers * rowBytes;
}

}  // namespace diffpolicy

#endif  // DIFFPOLICY_GAE_TILING_H
