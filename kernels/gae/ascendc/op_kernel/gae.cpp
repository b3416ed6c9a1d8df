// AscendC kernel of the diffpolicy::gae operator (generalised advantage estimation), float32.
//
// Written for Ascend 910B-class AI cores (dav-c220, vector units); see ../README.md: NOT compiled or
// run in this project's CI. Host tiling: ../op_host/gae_tiling.h (mirrored in diffpolicy/ops/tiling.py).
//
// Layout: rewards, values, dones, advantages, returns are (T, N) row-major in global memory (GM),
// lastValue is (N). Environments (columns) are split across AI cores (colsPerCore each, whole 32-byte
// blocks) and, inside a core, across the vector lanes: every vector instruction below processes one
// row segment of up to tileCols environments at once. For each column tile the time axis is walked in
// reverse in tiles of tileT rows; tiles move GM -> UB -> GM through double-buffered TQue queues, so
// the copy-in of the next tile overlaps the computation of this one. DataCopyPad moves row segments
// whose length and GM offset need not be 32-byte aligned (any N); in UB each row is padded to 32 bytes.
//
//   delta_t = r_t + gamma * V_{t+1} * (1 - d_t) - V_t          (V_T = last value)
//   A_t     = delta_t + gamma * lam * (1 - d_t) * A_{t+1}      (A_T = 0)
//   R_t     = A_t + V_t
//
// Per tile, everything that does not depend on the recursion is done on the whole tile at once
// (r - V, gamma (1 - d), gamma lam (1 - d), and finally A + V); the reverse row loop then costs four
// vector instructions per row.
#include "kernel_operator.h"

namespace {

constexpr int32_t BUFFER_NUM = 2;      // double buffering (kGaeBufferNum)
constexpr uint32_t ALIGN_ELEMS = 8;    // float32 per 32-byte block (kGaeAlignElems)

__aicore__ inline uint32_t AlignUp(uint32_t x) { return (x + ALIGN_ELEMS - 1) / ALIGN_ELEMS * ALIGN_ELEMS; }
__aicore__ inline uint32_t Min(uint32_t a, uint32_t b) { return a < b ? a : b; }

class KernelGae {
public:
    __aicore__ inline KernelGae() {}

    __aicore__ inline void Init(GM_ADDR rewards, GM_ADDR values, GM_ADDR dones, GM_ADDR lastValue,
                                GM_ADDR advantages, GM_ADDR returns, uint32_t totalT, uint32_t totalN,
                                uint32_t colsPerCore, uint32_t tileCols, uint32_t tileT, float gamma,
                                float lam)
    {
        this->totalT = totalT;
        this->totalN = totalN;
        this->tileCols = tileCols;
        this->tileT = tileT;
        this->gamma = gamma;
        this->gammaLam = gamma * lam;
        colStart = static_cast<uint32_t>(AscendC::GetBlockIdx()) * colsPerCore;
        coreCols = colStart < totalN ? Min(colsPerCore, totalN - colStart) : 0;

        const uint64_t numel = static_cast<uint64_t>(totalT) * totalN;
        rewardsGm.SetGlobalBuffer((__gm__ float *)rewards, numel);
        valuesGm.SetGlobalBuffer((__gm__ float *)values, numel);
        donesGm.SetGlobalBuffer((__gm__ float *)dones, numel);
        advantagesGm.SetGlobalBuffer((__gm__ float *)advantages, numel);
        returnsGm.SetGlobalBuffer((__gm__ float *)returns, numel);
        lastValueGm.SetGlobalBuffer((__gm__ float *)lastValue, totalN);

        const uint32_t rowBytes = tileCols * sizeof(float);
        const uint32_t tileBytes = tileT * rowBytes;
        pipe.InitBuffer(inRewards, BUFFER_NUM, tileBytes);
        pipe.InitBuffer(inValues, BUFFER_NUM, tileBytes);
        pipe.InitBuffer(inDones, BUFFER_NUM, tileBytes);
        pipe.InitBuffer(outAdvantages, BUFFER_NUM, tileBytes);
        pipe.InitBuffer(outReturns, BUFFER_NUM, tileBytes);
        pipe.InitBuffer(inLastValue, 1, rowBytes);
        pipe.InitBuffer(stateBuf, 3 * rowBytes);  // V_{t+1} | A_{t+1} | delta
        AscendC::LocalTensor<float> state = stateBuf.Get<float>();
        nextValue = state;
        nextAdvantage = state[tileCols];
        delta = state[2 * tileCols];
    }

    __aicore__ inline void Process()
    {
        for (uint32_t c = 0; c < coreCols; c += tileCols) {
            const uint32_t c0 = colStart + c;
            const uint32_t cols = Min(tileCols, coreCols - c);
            LoadLastValue(c0, cols);
            uint32_t tEnd = totalT;
            while (tEnd > 0) {
                const uint32_t rows = Min(tileT, tEnd);
                const uint32_t t0 = tEnd - rows;
                CopyIn(t0, rows, c0, cols);
                Compute(rows, cols);
                CopyOut(t0, rows, c0, cols);
                tEnd = t0;
            }
        }
    }

private:
    // Recursion state of a new column tile: V_T = last value, A_T = 0.
    __aicore__ inline void LoadLastValue(uint32_t c0, uint32_t cols)
    {
        AscendC::LocalTensor<float> last = inLastValue.AllocTensor<float>();
        AscendC::DataCopyExtParams params{1, static_cast<uint32_t>(cols * sizeof(float)), 0, 0, 0};
        AscendC::DataCopyPadExtParams<float> pad{false, 0, 0, 0.0f};
        AscendC::DataCopyPad(last, lastValueGm[c0], params, pad);
        inLastValue.EnQue(last);
        last = inLastValue.DeQue<float>();
        AscendC::Adds(nextValue, last, 0.0f, cols);
        AscendC::Duplicate(nextAdvantage, 0.0f, cols);
        AscendC::PipeBarrier<PIPE_V>();
        inLastValue.FreeTensor(last);
    }

    // rows x cols block at (t0, c0): GM rows are N apart (srcStride, bytes), UB rows 32-byte padded.
    __aicore__ inline void CopyIn(uint32_t t0, uint32_t rows, uint32_t c0, uint32_t cols)
    {
        const uint64_t offset = static_cast<uint64_t>(t0) * totalN + c0;
        AscendC::DataCopyExtParams params{static_cast<uint16_t>(rows), static_cast<uint32_t>(cols * sizeof(float)),
                                          static_cast<uint32_t>((totalN - cols) * sizeof(float)), 0, 0};
        AscendC::DataCopyPadExtParams<float> pad{false, 0, 0, 0.0f};
        AscendC::LocalTensor<float> r = inRewards.AllocTensor<float>();
        AscendC::LocalTensor<float> v = inValues.AllocTensor<float>();
        AscendC::LocalTensor<float> d = inDones.AllocTensor<float>();
        AscendC::DataCopyPad(r, rewardsGm[offset], params, pad);
        AscendC::DataCopyPad(v, valuesGm[offset], params, pad);
        AscendC::DataCopyPad(d, donesGm[offset], params, pad);
        inRewards.EnQue(r);
        inValues.EnQue(v);
        inDones.EnQue(d);
    }

    __aicore__ inline void Compute(uint32_t rows, uint32_t cols)
    {
        AscendC::LocalTensor<float> r = inRewards.DeQue<float>();
        AscendC::LocalTensor<float> v = inValues.DeQue<float>();
        AscendC::LocalTensor<float> d = inDones.DeQue<float>();
        AscendC::LocalTensor<float> a = outAdvantages.AllocTensor<float>();
        AscendC::LocalTensor<float> ret = outReturns.AllocTensor<float>();
        const uint32_t pitch = AlignUp(cols);
        const int32_t count = static_cast<int32_t>(rows * pitch);  // whole tile, pad lanes included

        // Recursion-free parts over the whole tile (pad lanes compute garbage that is never stored).
        AscendC::Sub(r, r, v, count);                 // r   <- r - V
        AscendC::Muls(ret, d, -gammaLam, count);      // ret <- -gamma lam d
        AscendC::PipeBarrier<PIPE_V>();
        AscendC::Muls(d, d, -gamma, count);           // d   <- -gamma d
        AscendC::Adds(ret, ret, gammaLam, count);     // ret <- gamma lam (1 - d)
        AscendC::PipeBarrier<PIPE_V>();
        AscendC::Adds(d, d, gamma, count);            // d   <- gamma (1 - d)
        AscendC::PipeBarrier<PIPE_V>();

        // The recursion, rows in reverse: four vector instructions per row of `cols` environments.
        AscendC::LocalTensor<float> nv = nextValue;
        AscendC::LocalTensor<float> na = nextAdvantage;
        for (int32_t i = static_cast<int32_t>(rows) - 1; i >= 0; --i) {
            const uint32_t o = static_cast<uint32_t>(i) * pitch;
            AscendC::Mul(delta, d[o], nv, cols);      // gamma (1 - d_t) V_{t+1}
            AscendC::Mul(a[o], ret[o], na, cols);     // gamma lam (1 - d_t) A_{t+1}
            AscendC::PipeBarrier<PIPE_V>();
            AscendC::Add(delta, delta, r[o], cols);   // delta_t
            AscendC::PipeBarrier<PIPE_V>();
            AscendC::Add(a[o], a[o], delta, cols);    // A_t
            AscendC::PipeBarrier<PIPE_V>();
            nv = v[o];
            na = a[o];
        }
        // Carry row 0 of this tile into the next (earlier) time tile.
        AscendC::Adds(nextValue, v, 0.0f, cols);
        AscendC::Adds(nextAdvantage, a, 0.0f, cols);
        AscendC::Add(ret, a, v, count);               // R = A + V
        AscendC::PipeBarrier<PIPE_V>();

        outAdvantages.EnQue<float>(a);
        outReturns.EnQue<float>(ret);
        inRewards.FreeTensor(r);
        inValues.FreeTensor(v);
        inDones.FreeTensor(d);
    }

    __aicore__ inline void CopyOut(uint32_t t0, uint32_t rows, uint32_t c0, uint32_t cols)
    {
        const uint64_t offset = static_cast<uint64_t>(t0) * totalN + c0;
        // UB -> GM: srcStride in 32-byte blocks (rows are contiguous in UB), dstStride in bytes.
        AscendC::DataCopyExtParams params{static_cast<uint16_t>(rows), static_cast<uint32_t>(cols * sizeof(float)), 0,
                                          static_cast<uint32_t>((totalN - cols) * sizeof(float)), 0};
        AscendC::LocalTensor<float> a = outAdvantages.DeQue<float>();
        AscendC::LocalTensor<float> ret = outReturns.DeQue<float>();
        AscendC::DataCopyPad(advantagesGm[offset], a, params);
        AscendC::DataCopyPad(returnsGm[offset], ret, params);
        outAdvantages.FreeTensor(a);
        outReturns.FreeTensor(ret);
    }

    AscendC::TPipe pipe;
    AscendC::TQue<AscendC::TPosition::VECIN, BUFFER_NUM> inRewards, inValues, inDones;
    AscendC::TQue<AscendC::TPosition::VECOUT, BUFFER_NUM> outAdvantages, outReturns;
    AscendC::TQue<AscendC::TPosition::VECIN, 1> inLastValue;
    AscendC::TBuf<AscendC::TPosition::VECCALC> stateBuf;
    AscendC::GlobalTensor<float> rewardsGm, valuesGm, donesGm, lastValueGm, advantagesGm, returnsGm;
    AscendC::LocalTensor<float> nextValue, nextAdvantage, delta;
    uint32_t totalT = 0;
    uint32_t totalN = 0;
    uint32_t tileCols = 0;
    uint32_t tileT = 0;
    uint32_t colStart = 0;
    uint32_t coreCols = 0;
    float gamma = 0.0f;
    float gammaLam = 0.0f;
};

}  // namespace

extern "C" __global__ __aicore__ void gae_kernel(GM_ADDR rewards, GM_ADDR values, GM_ADDR dones, GM_ADDR lastValue,
                                                 GM_ADDR advantages, GM_ADDR returns, uint32_t totalT,
                                                 uint32_t totalN, uint32_t colsPerCore, uint32_t tileCols,
                                                 uint32_t tileT, float gamma, float lam)
{
    KernelGae op;
    op.Init(rewards, values, dones, lastValue, advantages, returns, totalT, totalN, colsPerCore, tileCols, tileT,
            gamma, lam);
    op.Process();
}
