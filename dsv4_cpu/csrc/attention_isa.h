// What the token kernels of one instruction set share: vector types, exp, bf16 rounding, the
// online-softmax step of a key block and the output finish. Included by attention_isa.cc (the
// fp32 path and the set's exported kernel table) and attention_bf16.cc (the avx512bf16 path and
// the AVX512BW fp8_ds_mla row decoder), both compiled once per instruction set (build.py) with
// -DDSV4_ISA=<name> -DDSV4_WIDTH=<fp32 lanes>.

#pragma once

#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "attention_impl.h"

#if defined(DSV4_HAVE_BF16_KERNEL) || defined(DSV4_HAVE_AVX512BW) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef DSV4_ISA
#error "compile with -DDSV4_ISA=<name> -DDSV4_WIDTH=<lanes>"
#endif

#define DSV4_CAT2(a, b) a##b
#define DSV4_CAT(a, b) DSV4_CAT2(a, b)

namespace dsv4 {
namespace DSV4_CAT(isa_, DSV4_ISA) {


constexpr int W = DSV4_WIDTH;
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef float vf_u __attribute__((vector_size(4 * W), aligned(4)));

// Register blocking of the fp32 micro-kernels: QK keeps NB keys x RB head vectors of
// accumulators, PV R heads x NZ dim vectors. Sized for the register file of each set.
#if DSV4_WIDTH >= 16
constexpr int QK_RB = 4, QK_NB = 6, PV_R = 6, PV_NZ = 4;
#elif DSV4_WIDTH == 8
constexpr int QK_RB = 2, QK_NB = 6, PV_R = 4, PV_NZ = 3;
#else
constexpr int QK_RB = 2, QK_NB = 6, PV_R = 3, PV_NZ = 3;
#endif
static_assert(KB % QK_NB == 0, "QK micro-tiles must tile a key block");

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr float POS_INF = std::numeric_limits<float>::infinity();

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
static inline vf load(const float *p) { return *reinterpret_cast<const vf_u *>(p); }
static inline void store(float *p, vf v) { *reinterpret_cast<vf_u *>(p) = v; }
// A true broadcast (one vbroadcastss): `vf{} + x` would cost an add per use in the micro-kernels
// and turn -0 into +0.
static inline vf splat(float x) {
#if DSV4_WIDTH == 16 && defined(__AVX512F__)
    return (vf)_mm512_set1_ps(x);
#elif DSV4_WIDTH == 8 && defined(__AVX2__)
    return (vf)_mm256_set1_ps(x);
#else
    static_assert(W == 4, "a broadcast for this width");
    return vf{x, x, x, x};
#endif
}

// exp(x) per lane, Cephes' single-precision polynomial (about 1 ulp): -inf and anything below
// -87.34 give 0, above 88.38 +inf, NaN stays NaN.
static inline vf vexp(vf x0) {
    const vf lo = splat(-87.3365447504f), hi = splat(88.3762626647949f);
    vi nan = x0 != x0, under = x0 < lo, over = x0 > hi;
    vf x = x0 < lo ? lo : x0;
    x = x > hi ? hi : x;
    x = nan ? lo : x;
    vf fx = x * 1.44269504088896341f + 0.5f;
    vi n = __builtin_convertvector(fx, vi);
    vf fn = __builtin_convertvector(n, vf);
    n = n + (fn > fx);  // truncation -> floor
    fn = __builtin_convertvector(n, vf);
    x = x - fn * 0.693359375f;
    x = x - fn * -2.12194440e-4f;
    vf z = x * x;
    vf y = splat(1.9875691500E-4f);
    y = y * x + 1.3981999507E-3f;
    y = y * x + 8.3334519073E-3f;
    y = y * x + 4.1665795894E-2f;
    y = y * x + 1.6666665459E-1f;
    y = y * x + 5.0000001201E-1f;
    y = y * z + x + 1.0f;
    vf r = y * (vf)((n + 127) << 23);
    r = under ? splat(0.0f) : r;
    r = over ? splat(POS_INF) : r;
    return nan ? x0 : r;
}

// Round to the nearest bf16 (ties to even), kept as float; NaN stays NaN.
static inline vf round_bf16(vf x) {
    vi b = (vi)x;
    vi r = (b + 0x7FFF + ((b >> 16) & 1)) & (int32_t)0xFFFF0000u;
    return (vf)((x != x) ? b : r);
}

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The online-softmax step of one key block, heads in lanes. S [KB][Hp] (row stride Hs) holds the block's raw
// dot products for its first nk keys; on return rows k < nk hold the probabilities
// exp(scale S - m_new) (rounded to bf16 when round_p, as FlashMLA feeds them to PV) and rows
// nk .. round_up(nk, 2) - 1 hold 0. m (running max of the scaled logits), l (running sum of the
// unrounded probabilities) are updated, alpha receives each head's rescale factor for O. NaN
// logits propagate (to m, l and the output), as in the float64 oracle.
static inline void softmax_block(float *S, int nk, int64_t Hp, int64_t Hs, float scale, float *m, float *l, float *alpha,
                          bool round_p) {
    for (int64_t h = 0; h < Hp; h += W) {
        vf mx = splat(NEG_INF);
        for (int k = 0; k < nk; k++) {
            vf s = load(S + k * Hs + h) * scale;
            store(S + k * Hs + h, s);
            mx = (s > mx || s != s) ? s : mx;
        }
        vf mo = load(m + h);
        vf mn = (mx > mo || mx != mx) ? mx : mo;
        vf mref = (mn == splat(NEG_INF)) ? splat(0.0f) : mn;  // rows whose logits are all -inf keep 0
        vf a = vexp(mo - mref);
        vf sum = splat(0.0f);
        for (int k = 0; k < nk; k++) {
            vf p = vexp(load(S + k * Hs + h) - mref);
            sum += p;
            store(S + k * Hs + h, round_p ? round_bf16(p) : p);
        }
        for (int k = nk; k < (nk + 1) / 2 * 2; k++) store(S + k * Hs + h, splat(0.0f));
        store(l + h, load(l + h) * a + sum);
        store(m + h, mn);
        store(alpha + h, a);
    }
}

typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef uint16_t vh __attribute__((vector_size(2 * W)));

// x * f rounded to bf16 bits (ties to even; NaN stays a quiet NaN), W lanes.
static inline vh scaled_bf16(vf x, float f) {
    vu b = (vu)(x * f);
    vu r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    vu n = (b >> 16) | 0x40u;
    vi isnan = (vi)((b & 0x7FFFFFFFu) > 0x7F800000u);
    return __builtin_convertvector((vu)(isnan ? (vi)n : (vi)r), vh);
}

// out[h] = O[h] / l_h / (1 + exp(sink_h - lse_h)); lse_h = m_h + ln l_h. n == 0: out 0,
// lse +inf, max -inf. O rows have stride dvp.
template <class T>
static void finish(const TokenJob &j, const float *O, int64_t dvp, const float *m, const float *l) {
    for (int64_t h = 0; h < j.H; h++) {
        T *o = reinterpret_cast<T *>(j.out) + h * j.out_hs;
        if (j.n == 0) {
            if (j.max_logits) j.max_logits[h] = NEG_INF;
            if (j.lse) j.lse[h] = POS_INF;
            std::memset(o, 0, sizeof(T) * j.dv);
            continue;
        }
        const float lse = m[h] + std::log(l[h]);
        const float sink = j.sink ? j.sink[h] : NEG_INF;
        const float f = 1.0f / (l[h] * (1.0f + std::exp(sink - lse)));
        if (j.max_logits) j.max_logits[h] = m[h];
        if (j.lse) j.lse[h] = lse;
        const float *src = O + h * dvp;
        int64_t d = 0;
        if constexpr (sizeof(T) == 4) {
            for (; d + W <= j.dv; d += W) {
                vf x = load(src + d) * f;
                std::memcpy(o + d, &x, sizeof(x));
            }
            for (; d < j.dv; d++) o[d] = src[d] * f;
        } else {
            for (; d + W <= j.dv; d += W) {
                vh x = scaled_bf16(load(src + d), f);
                std::memcpy(o + d, &x, sizeof(x));
            }
            for (; d < j.dv; d++) o[d] = f32_to_bf16(src[d] * f);
        }
    }
}

#if defined(DSV4_HAVE_BF16_KERNEL)
// attention_bf16.cc: one token, every head, with vdpbf16ps (D % 32 == 0, dv % 32 == 0).
void token_bf16(const TokenJob &j, Scratch &sc);
#endif
#if defined(DSV4_HAVE_AVX512BW)
// attention_bf16.cc: an fp8_ds_mla slot decoded to bf16 bits with AVX512BW (false: scale out of range).
bool decode_row_fast(const uint8_t *d, const uint8_t *sc, uint16_t *o);
#endif

}  // namespace isa_<name>
}  // namespace dsv4
