// One token's sparse attention (all heads at once), compiled once per instruction set.
//
// Build: dsv4_cpu/build.py compiles this file once per instruction set with
//   -DDSV4_ISA=<name> -DDSV4_WIDTH=<fp32 lanes> and that set's -m flags:
//   generic (4 lanes of GCC/Clang vector code, any CPU), avx2 (8), avx512 (16), avx512bf16 (16 +
//   the bf16 dot-product kernel). Nothing here is chosen at build time by the machine: the
//   dispatcher (attention.cc) picks a set at run time.
//
// Layout of one token's work: the H heads are the rows of a small GEMM against the token's keys,
// taken in blocks of KB keys with an online softmax between blocks (FlashAttention-2 on a CPU):
//   S[k][h]  = <key_k, q_h>            (QK: keys x heads, heads in vector lanes)
//   P[k][h]  = exp(scale S - m_h)      (the block's probabilities; m, l, alpha per head)
//   O[h][:] = alpha_h O[h][:] + sum_k P[k][h] V_k   (PV: heads x value dims, dims in lanes)
// fp32 path (any instruction set): q transposed once per token (Qt [D][Hp]), each key block
// converted to float rows (Kf [KB][Dp]); broadcast-FMA micro-kernels.
// bf16 path (avx512bf16, attention_bf16.cc): vdpbf16ps. q packed once per token as dword pairs of dims per head
// (Qp [Hp/16][D/2][16]); QK broadcasts a dword (2 dims) of each key row straight from the cache
// or staging rows; the block's values are packed as pairs of keys (Vp [KB/2][dv]) and the
// probabilities as bf16 pairs (Pp [KB/2][Hp]), so PV is vdpbf16ps too.


#include "attention_isa.h"

namespace dsv4 {
namespace DSV4_CAT(isa_, DSV4_ISA) {

// ---------------------------------------------------------------- fp32 path (every set)

// S[n][r W .. r W + W - 1] (+)= <key n, q of those heads> over dims d0 .. d1 - 1: NB keys x RB head
// vectors of accumulators, a key's dim broadcast against the group's packed queries (Qg[d][RB W],
// one contiguous stream). Keys are rows of Kf (stride Dk), S rows have stride Hs. A dim
// range continues the sums stored in S (a float stored and reloaded is the same float: the sum
// over all dims keeps its order).
template <int RB, int NB>
static inline void qk_f32(const float *__restrict Qg, int64_t d0, int64_t d1, const float *__restrict Kf, int64_t Dk,
                          float *__restrict S, int64_t Hs, bool accumulate) {
    vf acc[NB][RB];
    for (int n = 0; n < NB; n++)
        for (int r = 0; r < RB; r++) acc[n][r] = accumulate ? load(S + n * Hs + r * W) : splat(0.0f);
    for (int64_t d = d0; d < d1; d++) {
        vf q[RB];
        for (int r = 0; r < RB; r++) q[r] = load(Qg + (d * RB + r) * W);
        for (int n = 0; n < NB; n++) {
            vf k = splat(Kf[n * Dk + d]);
            for (int r = 0; r < RB; r++) acc[n][r] += k * q[r];
        }
    }
    for (int n = 0; n < NB; n++)
        for (int r = 0; r < RB; r++) store(S + n * Hs + r * W, acc[n][r]);
}

// O[r][z W ..] = alpha_r O[r][z W ..] + sum_k P[k][r] V_k[z W ..] for R heads x NZ dim vectors;
// the first block starts from 0 (what alpha 0 times the zeros O would hold gives), so O is never
// cleared.
template <int R, int NZ>
static inline void pv_f32(float *__restrict O, int64_t dvo, const float *__restrict alpha, const float *__restrict P,
                          int64_t Hs, const float *__restrict Kf, int64_t Dk, int nk, bool first) {
    vf acc[R][NZ];
    for (int r = 0; r < R; r++)
        for (int z = 0; z < NZ; z++) acc[r][z] = first ? splat(0.0f) : load(O + r * dvo + z * W) * alpha[r];
    for (int k = 0; k < nk; k++) {
        vf v[NZ];
        for (int z = 0; z < NZ; z++) v[z] = load(Kf + k * Dk + z * W);
        for (int r = 0; r < R; r++) {
            vf p = splat(P[k * Hs + r]);
            for (int z = 0; z < NZ; z++) acc[r][z] += p * v[z];
        }
    }
    for (int r = 0; r < R; r++)
        for (int z = 0; z < NZ; z++) store(O + r * dvo + z * W, acc[r][z]);
}

// The block's QK for RB head vectors: dims in chunks of QK_DIMS (the chunk of those heads'
// transposed queries, QK_DIMS x RB W floats, stays in L1 while every key of the block passes),
// keys in micro-tiles of QK_NB.
#ifndef DSV4_F32_QK_DIMS
#define DSV4_F32_QK_DIMS 128
#endif
template <int RB>
static void qk_f32_rows(const float *Qg, int64_t D, const float *Kf, int64_t Dk, float *S, int64_t Hs, int nk) {
    for (int64_t d0 = 0; d0 < D; d0 += DSV4_F32_QK_DIMS) {
        const int64_t d1 = d0 + DSV4_F32_QK_DIMS < D ? d0 + DSV4_F32_QK_DIMS : D;
        for (int k = 0; k < nk; k += QK_NB) qk_f32<RB, QK_NB>(Qg, d0, d1, Kf + k * Dk, Dk, S + k * Hs, Hs, d0 > 0);
    }
}

template <int N, class F>
static inline void dispatch_count(int n, F &&f) {  // f(std::integral_constant) for n in 1..N
    if constexpr (N >= 1) {
        if (n == N) {
            f(std::integral_constant<int, N>{});
            return;
        }
        dispatch_count<N - 1>(n, f);
    }
}

// dst[d] = src[d] as float, d < n (bf16 -> fp32 is exact: the bits shifted up by 16).
static inline void widen_bf16(const uint16_t *src, int64_t n, float *dst) {
    int64_t d = 0;
#if defined(__AVX2__)
    for (; d + 8 <= n; d += 8) {
        __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(src + d)));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst + d), _mm256_slli_epi32(x, 16));
    }
#endif
    for (; d < n; d++) dst[d] = bf16_to_f32(src[d]);
}

#if defined(__AVX2__)
// 8 x 8 transpose of floats: r[i] holds row i on entry, column i on return.
static inline void transpose8(__m256 r[8]) {
    __m256 t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    __m256 u[8];
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

template <class T>
static inline __m256 load8(const T *p) {
    if constexpr (sizeof(T) == 4) return _mm256_loadu_ps(reinterpret_cast<const float *>(p));
    else {
        __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    }
}
#endif

// The queries packed for QK, as float (0 for padding heads h >= H): head vectors (W heads) in
// groups of QK_RB (the last group may hold fewer, rb), group g at Qt + g QK_RB W D holding
// Qg[d][rb W] (a micro-kernel's queries are one contiguous stream). With AVX2 in 8 x 8 register
// blocks (the strided stores of a scalar transpose cost as much as the QK of a short key list).
static inline int64_t packed_query_index(int64_t h, int64_t d, int64_t Hp, int64_t D) {
    const int64_t v = h / W, g0 = v / QK_RB * QK_RB;
    const int64_t rb = Hp / W - g0 < QK_RB ? Hp / W - g0 : QK_RB;
    return g0 * W * D + d * rb * W + (h - g0 * W);
}

template <class T>
static void pack_queries_f32(const T *q, int64_t q_hs, int64_t H, int64_t Hp, int64_t D, float *Qt) {
    int64_t d0 = 0;
#if defined(__AVX2__)
    if (W == 8) {
        for (; d0 + 8 <= D; d0 += 8)
            for (int64_t hb = 0; hb < Hp; hb += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) r[i] = hb + i < H ? load8(q + (hb + i) * q_hs + d0) : _mm256_setzero_ps();
                transpose8(r);
                float *dst = Qt + packed_query_index(hb, d0, Hp, D);
                const int64_t rs = packed_query_index(hb, d0 + 1, Hp, D) - packed_query_index(hb, d0, Hp, D);
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + i * rs, r[i]);
            }
    }
#endif
    for (int64_t h = 0; h < Hp; h++)
        for (int64_t d = d0; d < D; d++) {
            float x = 0.0f;
            if (h < H) {
                if constexpr (sizeof(T) == 4) x = q[h * q_hs + d];
                else x = bf16_to_f32(q[h * q_hs + d]);
            }
            Qt[packed_query_index(h, d, Hp, D)] = x;
        }
}

template <class T>
static void token_f32(const TokenJob &j, Scratch &sc) {
    const int64_t H = j.H, D = j.D, dv = j.dv;
    const int64_t Hp = round_up(H, W), Dp = round_up(D, W), dvp = round_up(dv, W);
    // Row strides one cache line past a multiple of W: rows 2 KB apart (D 512) would all fall in
    // the same few L1 sets.
    const int64_t Dk = Dp + 64 / 4, Hs = Hp + 64 / 4, dvo = dvp + 64 / 4;
    float *Qt = sc.q.as<float>(D * Hp);
    float *Kf = sc.v.as<float>(KB * Dk);
    float *S = sc.s.as<float>(KB * Hs);
    float *O = sc.o.as<float>(Hp * dvo);
    float *m = sc.stat.as<float>(3 * Hp), *l = m + Hp, *alpha = l + Hp;
    pack_queries_f32(reinterpret_cast<const T *>(j.q), j.q_hs, H, Hp, D, Qt);
    for (int64_t h = 0; h < Hp; h++) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
    }
    const bool round_p = sizeof(T) == 2;
    for (int64_t k0 = 0; k0 < j.n; k0 += KB) {
        const int nk = (int)(j.n - k0 < KB ? j.n - k0 : KB);
        const int nk6 = (int)round_up(nk, QK_NB);
        for (int k = 0; k < nk6; k++) {
            float *dst = Kf + k * Dk;
            if (k < nk) {
                const T *src = reinterpret_cast<const T *>(j.keys[k0 + k]);
                if constexpr (sizeof(T) == 4) std::memcpy(dst, src, sizeof(float) * D);
                else widen_bf16(src, D, dst);
                for (int64_t d = D; d < Dp; d++) dst[d] = 0.0f;
            } else {
                std::memset(dst, 0, sizeof(float) * Dp);
            }
        }
        // the next block's key rows towards L2 while this block computes (scattered staging rows
        // or cache rows, read once per token: the widening above waited on them)
        for (int64_t k = k0 + KB; k < std::min<int64_t>(j.n, k0 + 2 * KB); k++)
            for (int64_t b = 0; b < D * (int64_t)sizeof(T); b += 64)
                __builtin_prefetch(static_cast<const char *>(j.keys[k]) + b, 0, 2);
        const int64_t hv = Hp / W;
        for (int64_t v = 0; v < hv; v += QK_RB) {
            const int rb = (int)(hv - v < QK_RB ? hv - v : QK_RB);
            dispatch_count<QK_RB>(rb, [&](auto c) {
                qk_f32_rows<decltype(c)::value>(Qt + v * W * D, D, Kf, Dk, S + v * W, Hs, nk6);
            });
        }
        softmax_block(S, nk, Hp, Hs, j.scale, m, l, alpha, round_p);
        // PV, dims outer: a strip of the block's values (nk x NZ W floats) stays in L1 while every
        // head passes; strips of PV_NZ vectors, and of 2 rather than leaving one vector alone.
        const int64_t nz = dvp / W;
        for (int64_t z = 0; z < nz;) {
            const int64_t left = nz - z;
            const int w = left == PV_NZ || left >= PV_NZ + 2 ? PV_NZ : left >= 2 ? 2 : 1;
            for (int64_t r = 0; r < H; r += PV_R) {
                const int rr = (int)(H - r < PV_R ? H - r : PV_R);
                dispatch_count<PV_R>(rr, [&](auto c) {
                    constexpr int R = decltype(c)::value;
                    float *o = O + r * dvo + z * W;
                    const float *v = Kf + z * W;
                    if (w == PV_NZ) pv_f32<R, PV_NZ>(o, dvo, alpha + r, S + r, Hs, v, Dk, nk, k0 == 0);
                    else if (w == 2) pv_f32<R, 2>(o, dvo, alpha + r, S + r, Hs, v, Dk, nk, k0 == 0);
                    else pv_f32<R, 1>(o, dvo, alpha + r, S + r, Hs, v, Dk, nk, k0 == 0);
                });
            }
            z += w;
        }
    }
    finish<T>(j, O, dvo, m, l);
}

}  // namespace isa_<name>

RowDecodeFn DSV4_CAT(row_decoder_, DSV4_ISA)() {
#if defined(DSV4_HAVE_AVX512BW)
    return &DSV4_CAT(isa_, DSV4_ISA)::decode_row_fast;
#else
    return nullptr;
#endif
}

TokenFn DSV4_CAT(token_kernel_, DSV4_ISA)(int dtype, int64_t D, int64_t dv) {
    namespace k = DSV4_CAT(isa_, DSV4_ISA);
    if (D < 1 || dv < 1 || dv > D) return nullptr;
#if defined(DSV4_HAVE_BF16_KERNEL)
    if (dtype == 1) return nullptr;  // the avx512 set's fp32 kernel serves float32
    if (D % 32 == 0 && dv % 32 == 0) return &k::token_bf16;
    return nullptr;
#else
    if (dtype == 1) return &k::token_f32<float>;
    return &k::token_f32<uint16_t>;
#endif
}

}  // namespace dsv4
