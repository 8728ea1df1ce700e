// The Lightning Indexer's block kernels, compiled once per instruction set (dsv4_cpu/build.py:
// -DDSV4_ISA=<name> -DDSV4_WIDTH=<fp32 lanes> and that set's -m flags, as attention_isa.cc).
//
// One call scores one token (all its heads) against one block of IDX_KB staged keys:
//   logits[j] = sum_h w[h] * relu(q_h . key_j)
// as a small GEMM with keys in vector lanes: a register tile of RH heads x NV key vectors of
// accumulators runs down the head dimension (a broadcast of q per head, NV key vectors loaded
// per step), then ReLU, the head weight and the sum over heads are applied to the tile in
// registers and added to the block's logits (heads in increasing order for every key, whatever
// the tiling).
// bf16 products ("pairs" layout: dwords of two bf16 dims): vdpbf16ps on avx512bf16; elsewhere
// each dword vector is split into its even and odd dims as float32 (exact) and multiplied with
// FMAs. float32 inputs: the f32 layout and FMAs.

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "indexer_impl.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef DSV4_ISA
#error "compile with -DDSV4_ISA=<name> -DDSV4_WIDTH=<lanes>"
#endif

#define DSV4_CAT2(a, b) a##b
#define DSV4_CAT(a, b) DSV4_CAT2(a, b)

namespace dsv4 {
namespace DSV4_CAT(idx_, DSV4_ISA) {

constexpr int W = DSV4_WIDTH;
typedef float vf __attribute__((vector_size(4 * W)));
typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef float vf_u __attribute__((vector_size(4 * W), aligned(4)));
typedef uint32_t vu_u __attribute__((vector_size(4 * W), aligned(4)));

static_assert(IDX_KB % W == 0, "a key block is whole vectors");

// Register tiles (heads x key vectors), sized for each set's register file: accumulators plus
// the loaded key vectors (two per vector when split into even / odd dims) plus the broadcasts.
#if DSV4_WIDTH >= 16
#if defined(DSV4_HAVE_BF16_KERNEL)
constexpr int P_RH = 6, P_NV = 4;  // 24 accumulators, 4 key vectors, 1 broadcast
#else
constexpr int P_RH = 4, P_NV = 4;  // 16 + 8 + 2
#endif
constexpr int F_RH = 6, F_NV = 4;  // 24 + 4 + 1
#elif DSV4_WIDTH == 8
constexpr int P_RH = 3, P_NV = 2;  // 6 + 4 + 2 of 16 registers
constexpr int F_RH = 6, F_NV = 2;  // 12 + 2 + 1
#else
constexpr int P_RH = 2, P_NV = 2;
constexpr int F_RH = 4, F_NV = 2;
#endif

static inline vf loadf(const float *p) { return *reinterpret_cast<const vf_u *>(p); }
static inline void storef(float *p, vf v) { *reinterpret_cast<vf_u *>(p) = v; }
static inline vu loadu(const uint32_t *p) { return *reinterpret_cast<const vu_u *>(p); }

static inline float bits_f32(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// ReLU that keeps NaN (as the float64 oracle's maximum(x, 0) does).
static inline vf relu(vf a) { return (a < 0.0f) ? vf{} : a; }

// Heads h0 .. h0+RH-1 against key vectors v0 .. v0+NV-1 of a pairs-layout block, added to L
// (DC: D2 as a constant, as f32_tile's).
template <int RH, int NV, int DC = 0>
static inline void pairs_tile(const uint32_t *Qp, const float *w, const uint32_t *Kp, int64_t D2rt, int64_t h0, int v0,
                              float *L) {
    const int64_t D2 = DC ? DC : D2rt;
    vf acc[RH][NV];
    for (int r = 0; r < RH; r++)
        for (int n = 0; n < NV; n++) acc[r][n] = vf{};
    const uint32_t *k = Kp + v0 * W;
    const uint32_t *q = Qp + h0 * D2;
    for (int64_t i = 0; i < D2; i++, k += IDX_KB) {
#if defined(DSV4_HAVE_BF16_KERNEL)
        __m512bh kv[NV];
        for (int n = 0; n < NV; n++) kv[n] = (__m512bh)_mm512_loadu_si512(k + n * W);
        for (int r = 0; r < RH; r++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q[r * D2 + i]);
            for (int n = 0; n < NV; n++) acc[r][n] = (vf)_mm512_dpbf16_ps((__m512)acc[r][n], kv[n], qb);
        }
#else
        vf ke[NV], ko[NV];
        for (int n = 0; n < NV; n++) {
            const vu kd = loadu(k + n * W);
            ke[n] = (vf)(kd << 16);
            ko[n] = (vf)(kd & 0xFFFF0000u);
        }
        for (int r = 0; r < RH; r++) {
            const uint32_t qd = q[r * D2 + i];
            const float qe = bits_f32(qd << 16), qo = bits_f32(qd & 0xFFFF0000u);
            for (int n = 0; n < NV; n++) {
                acc[r][n] += qe * ke[n];
                acc[r][n] += qo * ko[n];
            }
        }
#endif
    }
    for (int n = 0; n < NV; n++) {
        vf l = loadf(L + (v0 + n) * W);
        for (int r = 0; r < RH; r++) l += w[h0 + r] * relu(acc[r][n]);
        storef(L + (v0 + n) * W, l);
    }
}

// Heads h0 .. h0+RH-1 against key vectors v0 .. v0+NV-1 of an f32-layout block, added to L.
// DC: the depth D as a constant (the V4 indexer's 128: each head's q is then a constant
// displacement from one register, where a run-time stride needs a register per head and the loop
// spilled its pointers), or 0 for D at run time.
template <int RH, int NV, int DC = 0>
static inline void f32_tile(const float *Qf, const float *w, const float *Kt, int64_t Drt, int64_t h0, int v0, float *L) {
    const int64_t D = DC ? DC : Drt;
    vf acc[RH][NV];
    for (int r = 0; r < RH; r++)
        for (int n = 0; n < NV; n++) acc[r][n] = vf{};
    const float *k = Kt + v0 * W;
    const float *q = Qf + h0 * D;
    for (int64_t d = 0; d < D; d++, k += IDX_KB) {
        vf kv[NV];
        for (int n = 0; n < NV; n++) kv[n] = loadf(k + n * W);
        for (int r = 0; r < RH; r++) {
            const float qs = q[r * D + d];
            for (int n = 0; n < NV; n++) acc[r][n] += qs * kv[n];
        }
    }
    for (int n = 0; n < NV; n++) {
        vf l = loadf(L + (v0 + n) * W);
        for (int r = 0; r < RH; r++) l += w[h0 + r] * relu(acc[r][n]);
        storef(L + (v0 + n) * W, l);
    }
}

// f(integral_constant N) for N = n, 1 <= n <= NMAX.
template <int NMAX, class F>
static inline void dispatch_upto(int64_t n, F &&f) {
    if constexpr (NMAX > 1) {
        if (n < NMAX) return dispatch_upto<NMAX - 1>(n, f);
    }
    f(std::integral_constant<int, NMAX>{});
}

// One block for one token: heads in register tiles of RH (the heads left after the last full
// tile as one tile of that many: every head's accumulators stay independent, where one head at a
// time would leave the FMA units waiting on each chain's latency), keys in tiles of NV vectors
// over the first nkeys keys only (a token that sees part of the block; the last tile narrower).
// Every key's sum over heads runs in increasing head order whatever the tiles.
template <int RH, int NV, class Tile>
static inline void block(const IndexBlockJob &j, Tile &&tile) {
    std::memset(j.logits, 0, sizeof(float) * IDX_KB);
    const int nvec = (int)((j.nkeys + W - 1) / W);
    auto heads = [&](auto rh, int64_t h) {
        int v0 = 0;
        for (; v0 + NV <= nvec; v0 += NV) tile(rh, std::integral_constant<int, NV>{}, h, v0);
        if (v0 < nvec) dispatch_upto<NV>(nvec - v0, [&](auto nv) { tile(rh, nv, h, v0); });
    };
    int64_t h = 0;
    for (; h + RH <= j.H; h += RH) heads(std::integral_constant<int, RH>{}, h);
    if (h < j.H) dispatch_upto<RH>(j.H - h, [&](auto rh) { heads(rh, h); });
}

static void block_pairs(const IndexBlockJob &j) {
    const auto *Qp = static_cast<const uint32_t *>(j.q);
    const auto *Kp = static_cast<const uint32_t *>(j.keys);
    if (j.depth == 64)
        block<P_RH, P_NV>(j, [&](auto rh, auto nv, int64_t h, int v0) {
            pairs_tile<decltype(rh)::value, decltype(nv)::value, 64>(Qp, j.w, Kp, 64, h, v0, j.logits);
        });
    else
        block<P_RH, P_NV>(j, [&](auto rh, auto nv, int64_t h, int v0) {
            pairs_tile<decltype(rh)::value, decltype(nv)::value>(Qp, j.w, Kp, j.depth, h, v0, j.logits);
        });
}

static void block_f32(const IndexBlockJob &j) {
    const auto *Qf = static_cast<const float *>(j.q);
    const auto *Kt = static_cast<const float *>(j.keys);
    if (j.depth == 128)
        block<F_RH, F_NV>(j, [&](auto rh, auto nv, int64_t h, int v0) {
            f32_tile<decltype(rh)::value, decltype(nv)::value, 128>(Qf, j.w, Kt, 128, h, v0, j.logits);
        });
    else
        block<F_RH, F_NV>(j, [&](auto rh, auto nv, int64_t h, int v0) {
            f32_tile<decltype(rh)::value, decltype(nv)::value>(Qf, j.w, Kt, j.depth, h, v0, j.logits);
        });
}

// e4m3 -> bf16 bits, W bytes at a time: normal values move their exponent and mantissa into
// place and rebias (7 -> 127); subnormals (m x 2^-9, m < 8) go through float32, exactly; 0x7F NaN.
static inline vu e4m3_bf16_bits(vu x) {
    const vu v = x & 0x7Fu, m = x & 7u;
    const vf sub = __builtin_convertvector(m, vf) * (1.0f / 512.0f);
    vu r = ((v >> 3) == 0u) ? ((vu)sub >> 16) : (v << 4) + (120u << 7);
    r = (v == 0x7Fu) ? vu{} + 0x7FC0u : r;
    return r | ((x & 0x80u) << 8);
}

// W bytes zero-extended to dword lanes, and dword lanes (< 2^16) stored as W uint16 (GCC's
// generic vector conversions for these come out as scalar inserts).
static inline vu load_bytes(const uint8_t *p) {
#if DSV4_WIDTH == 16 && defined(__AVX512F__)
    return (vu)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
#elif DSV4_WIDTH == 8 && defined(__AVX2__)
    return (vu)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)));
#else
    vu x;
    for (int i = 0; i < W; i++) x[i] = p[i];
    return x;
#endif
}

static inline void store_halves(uint16_t *p, vu r) {
#if DSV4_WIDTH == 16 && defined(__AVX512F__)
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), _mm512_cvtepi32_epi16((__m512i)r));
#elif DSV4_WIDTH == 8 && defined(__AVX2__)
    const __m256i packed = _mm256_packus_epi32((__m256i)r, (__m256i)r);  // lanes 0-3, 0-3, 4-7, 4-7
    _mm_storeu_si128(reinterpret_cast<__m128i *>(p), _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
#else
    for (int i = 0; i < W; i++) p[i] = (uint16_t)r[i];
#endif
}

#if defined(__F16C__) && defined(__AVX2__)
// 16 e4m3 bytes -> 16 floats, exactly: the byte's 7 value bits shifted up 7 are the fp16 with the
// same exponent and mantissa bits (exponent bias 15 instead of 7, so x 2^8 after; e4m3 subnormals
// are fp16 subnormals, which vcvtph2ps converts exactly whatever MXCSR.DAZ says), sign on top,
// 0x7F as the fp16 quiet NaN 0x7E00 (-> 0x7FC00000 as the table's). The products by 256 are exact.
static inline void e4m3_16_f32(const uint8_t *src, float *dst) {
    const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(src)));
    const __m256i code = _mm256_and_si256(x, _mm256_set1_epi16(0x7F));
    const __m256i nan = _mm256_cmpeq_epi16(code, _mm256_set1_epi16(0x7F));
    __m256i h = _mm256_blendv_epi8(_mm256_slli_epi16(code, 7), _mm256_set1_epi16(0x7E00), nan);
    h = _mm256_or_si256(h, _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8));
    const __m256 k = _mm256_set1_ps(256.0f);
    _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k));
    _mm256_storeu_ps(dst + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k));
}
#endif

static void widen_e4m3(const uint8_t *src, int64_t n, uint16_t *bf16, float *f32) {
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
    if (!bf16)
        for (; i + 16 <= n; i += 16) e4m3_16_f32(src + i, f32 + i);
#endif
    for (; i + W <= n; i += W) {
        const vu r = e4m3_bf16_bits(load_bytes(src + i));
        if (bf16) store_halves(bf16 + i, r);
        else storef(f32 + i, (vf)(r << 16));
    }
    for (; i < n; i++) {
        vu x = vu{};
        x[0] = src[i];
        const uint32_t r = e4m3_bf16_bits(x)[0];
        if (bf16) bf16[i] = (uint16_t)r;
        else f32[i] = bits_f32(r << 16);
    }
}

}  // namespace idx_<name>

IndexKernels DSV4_CAT(index_kernels_, DSV4_ISA)() {
    namespace k = DSV4_CAT(idx_, DSV4_ISA);
    return IndexKernels{&k::block_pairs, &k::block_f32, &k::widen_e4m3};
}

}  // namespace dsv4
