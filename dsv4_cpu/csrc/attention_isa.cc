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
// bf16 path (avx512bf16): vdpbf16ps. q packed once per token as dword pairs of dims per head
// (Qp [Hp/16][D/2][16]); QK broadcasts a dword (2 dims) of each key row straight from the cache
// or staging rows; the block's values are packed as pairs of keys (Vp [KB/2][dv]) and the
// probabilities as bf16 pairs (Pp [KB/2][Hp]), so PV is vdpbf16ps too.

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
static void softmax_block(float *S, int nk, int64_t Hp, int64_t Hs, float scale, float *m, float *l, float *alpha,
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

// ---------------------------------------------------------------- bf16 path (avx512bf16)

#if defined(DSV4_HAVE_BF16_KERNEL)

static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// S[n][16 r .. 16 r + 15] (+)= <key n, q of heads 16 r ..> over dim pairs d0 .. d1 - 1. `next`:
// the next micro-tile's NB rows (or nullptr), prefetched over the same dims, a cache line of each
// per 16 dim pairs: scattered keys (CSA's top-k over a long context) come from L3 or memory.
template <int RB, int NB>
static inline void qk_bf16(const uint32_t *__restrict Qp, int64_t D2, int64_t d0, int64_t d1, const void *const *keys,
                           const void *const *next, float *__restrict S, int64_t Hp, bool accumulate) {
    __m512 acc[NB][RB];
    const char *kr[NB];
    for (int n = 0; n < NB; n++) {
        kr[n] = static_cast<const char *>(keys[n]);
        for (int r = 0; r < RB; r++) acc[n][r] = accumulate ? _mm512_load_ps(S + n * Hp + r * 16) : _mm512_setzero_ps();
    }
    for (int64_t d = d0; d < d1; d++) {
        if (next && (d & 15) == 0)
            for (int n = 0; n < NB; n++) _mm_prefetch(static_cast<const char *>(next[n]) + 4 * d, _MM_HINT_T0);
        __m512bh q[RB];
        for (int r = 0; r < RB; r++) q[r] = as_bh(_mm512_load_si512(Qp + (r * D2 + d) * 16));
        for (int n = 0; n < NB; n++) {
            int32_t pair;
            std::memcpy(&pair, kr[n] + 4 * d, 4);
            __m512bh k = as_bh(_mm512_set1_epi32(pair));
            for (int r = 0; r < RB; r++) acc[n][r] = _mm512_dpbf16_ps(acc[n][r], q[r], k);
        }
    }
    for (int n = 0; n < NB; n++)
        for (int r = 0; r < RB; r++) _mm512_store_ps(S + n * Hp + r * 16, acc[n][r]);
}

template <int R, int NZ>
static inline void pv_bf16(float *__restrict O, int64_t dvp, const float *__restrict alpha,
                           const uint32_t *__restrict Pp, int64_t Hp, const uint32_t *__restrict Vp, int64_t npairs,
                           bool first, uint16_t *out, int64_t out_hs, const float *fo) {
    __m512 acc[R][NZ];
    for (int r = 0; r < R; r++) {
        __m512 a = _mm512_set1_ps(alpha[r]);
        for (int z = 0; z < NZ; z++)
            acc[r][z] = first ? _mm512_setzero_ps() : _mm512_mul_ps(_mm512_load_ps(O + r * dvp + z * 16), a);
    }
    for (int64_t p = 0; p < npairs; p++) {
        __m512bh v[NZ];
        for (int z = 0; z < NZ; z++) v[z] = as_bh(_mm512_load_si512(Vp + p * dvp + z * 16));
        for (int r = 0; r < R; r++) {
            __m512bh pr = as_bh(_mm512_set1_epi32((int32_t)Pp[p * Hp + r]));
            for (int z = 0; z < NZ; z++) acc[r][z] = _mm512_dpbf16_ps(acc[r][z], v[z], pr);
        }
    }
    if (out) {
        for (int r = 0; r < R; r++) {
            __m512 f = _mm512_set1_ps(fo[r]);
            for (int z = 0; z < NZ; z++)
                _mm256_storeu_si256(reinterpret_cast<__m256i *>(out + r * out_hs + z * 16),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][z], f)));
        }
        return;
    }
    for (int r = 0; r < R; r++)
        for (int z = 0; z < NZ; z++) _mm512_store_ps(O + r * dvp + z * 16, acc[r][z]);
}

constexpr int BQK_RB = 4, BQK_NB = 6, BPV_R = 6, BPV_NZ = 4;
static_assert(KB % BQK_NB == 0 && KB % 2 == 0, "bf16 micro-tiles must tile a key block");

// The block's QK for head vectors of one group: dims in chunks of QK_DIMS pairs (the group's packed
// queries for one chunk stay in L1 while every key of the block passes), keys in micro-tiles.
#ifndef DSV4_QK_DIMS
#define DSV4_QK_DIMS 128
#endif
template <int RB>
static void qk_bf16_rows(const uint32_t *Qp, int64_t D2, const void *const *keys, float *S, int64_t Hp, int nk) {
    for (int64_t d0 = 0; d0 < D2; d0 += DSV4_QK_DIMS) {
        const int64_t d1 = d0 + DSV4_QK_DIMS < D2 ? d0 + DSV4_QK_DIMS : D2;
        for (int k = 0; k < nk; k += BQK_NB)
            qk_bf16<RB, BQK_NB>(Qp, D2, d0, d1, keys + k, k + BQK_NB < nk ? keys + k + BQK_NB : nullptr, S + k * Hp, Hp,
                                d0 > 0);
    }
}

template <int R>
static void pv_bf16_dims(float *O, int64_t dvp, const float *alpha, const uint32_t *Pp, int64_t Hp, const uint32_t *Vp,
                         int64_t npairs, bool first, uint16_t *out, int64_t out_hs, const float *fo) {
    const int64_t nz = dvp / 16;
    int64_t z = 0;
    for (; z + BPV_NZ <= nz; z += BPV_NZ)
        pv_bf16<R, BPV_NZ>(O + z * 16, dvp, alpha, Pp, Hp, Vp + z * 16, npairs, first, out ? out + z * 16 : nullptr,
                           out_hs, fo);
    for (; z < nz; z++)
        pv_bf16<R, 1>(O + z * 16, dvp, alpha, Pp, Hp, Vp + z * 16, npairs, first, out ? out + z * 16 : nullptr, out_hs,
                      fo);
}

// The value rows of key pair p as dword pairs: Vp[p][d] = V[2p][d] | V[2p+1][d] << 16.
static void pack_values(const void *const *keys, int npairs, int64_t dv, uint32_t *Vp) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                        36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int p = 0; p < npairs; p++) {
        const char *a = static_cast<const char *>(keys[2 * p]);
        const char *b = static_cast<const char *>(keys[2 * p + 1]);
        uint32_t *dst = Vp + p * dv;
        for (int64_t d = 0; d < dv; d += 32) {
            __m512i va = _mm512_loadu_si512(a + 2 * d), vb = _mm512_loadu_si512(b + 2 * d);
            _mm512_store_si512(dst + d, _mm512_permutex2var_epi16(va, lo, vb));
            _mm512_store_si512(dst + d + 16, _mm512_permutex2var_epi16(va, hi, vb));
        }
    }
}

// The block's probabilities (S rows, float, heads in lanes) as bf16 pairs of keys:
// Pp[p][h] = bf16(P[2p][h]) | bf16(P[2p+1][h]) << 16.
static void pack_probs(const float *S, int npairs, int64_t Hp, uint32_t *Pp) {
    const __m512i il = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                                        20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int p = 0; p < npairs; p++)
        for (int64_t h = 0; h < Hp; h += 16) {
            __m512bh two = _mm512_cvtne2ps_pbh(_mm512_load_ps(S + (2 * p + 1) * Hp + h), _mm512_load_ps(S + 2 * p * Hp + h));
            _mm512_store_si512(Pp + p * Hp + h, _mm512_permutexvar_epi16(il, (__m512i)two));
        }
}

// 16 x 16 transpose of dwords: r[i] holds row i on entry, column i on return.
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // r[4a + b] now holds, per 128-bit lane L, element 4L + ... of rows 4a..4a+3: combine lanes
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
    }
}

// Qp[h / 16][d][h % 16] = dims 2d, 2d + 1 of head h (0 for padding heads h >= H), D2 % 16 == 0.
static void pack_queries(const uint16_t *q, int64_t q_hs, int64_t H, int64_t Hp, int64_t D2, uint32_t *Qp) {
    for (int64_t hb = 0; hb < Hp; hb += 16) {
        uint32_t *dst = Qp + hb * D2;
        for (int64_t d = 0; d < D2; d += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = hb + i < H ? _mm512_loadu_si512(q + (hb + i) * q_hs + 2 * d) : _mm512_setzero_si512();
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_store_si512(dst + (d + i) * 16, r[i]);
        }
    }
}

static void token_bf16(const TokenJob &j, Scratch &sc) {
    const int64_t H = j.H, D = j.D, dv = j.dv, D2 = D / 2;
    const int64_t Hp = round_up(H, 16);
    uint32_t *Qp = sc.q.as<uint32_t>(Hp * D2);
    float *S = sc.s.as<float>(KB * Hp);
    uint32_t *Pp = sc.p.as<uint32_t>(KB / 2 * Hp);
    uint32_t *Vp = sc.v.as<uint32_t>(KB / 2 * dv);
    float *O = sc.o.as<float>(Hp * dv);
    float *m = sc.stat.as<float>(4 * Hp), *l = m + Hp, *alpha = l + Hp, *fo = alpha + Hp;
    const void **blk = sc.keys.as<const void *>(KB);
    const uint16_t *q = reinterpret_cast<const uint16_t *>(j.q);
    pack_queries(q, j.q_hs, H, Hp, D2, Qp);
    for (int64_t h = 0; h < Hp; h++) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
    }
    if (j.n == 0) {
        finish<uint16_t>(j, O, dv, m, l);  // no key: out 0, lse +inf, max -inf
        return;
    }
    uint16_t *out = reinterpret_cast<uint16_t *>(j.out);
    for (int64_t k0 = 0; k0 < j.n; k0 += KB) {
        const int nk = (int)(j.n - k0 < KB ? j.n - k0 : KB);
        const int nk6 = (int)round_up(nk, BQK_NB);
        for (int k = 0; k < nk6; k++) blk[k] = k < nk ? j.keys[k0 + k] : j.zero_row;
        const int64_t hv = Hp / 16;
        for (int64_t v = 0; v < hv; v += BQK_RB) {
            const int rb = (int)(hv - v < BQK_RB ? hv - v : BQK_RB);
            dispatch_count<BQK_RB>(rb, [&](auto c) {
                qk_bf16_rows<decltype(c)::value>(Qp + v * D2 * 16, D2, blk, S + v * 16, Hp, nk6);
            });
        }
        if (k0 + KB < j.n)  // the next block's first micro-tile, while this block's PV runs
            for (int64_t k = k0 + KB; k < std::min<int64_t>(j.n, k0 + KB + BQK_NB); k++)
                for (int64_t b = 0; b < 4 * D2; b += 64) _mm_prefetch(static_cast<const char *>(j.keys[k]) + b, _MM_HINT_T1);
        softmax_block(S, nk, Hp, Hp, j.scale, m, l, alpha, false);
        const int npairs = (nk + 1) / 2;
        pack_probs(S, npairs, Hp, Pp);
        pack_values(blk, npairs, dv, Vp);
        const bool first = k0 == 0, last = k0 + KB >= j.n;
        if (last)  // the output factor 1 / (l (1 + exp(sink - lse))), and the statistics
            for (int64_t h = 0; h < H; h++) {
                const float lse = m[h] + std::log(l[h]);
                const float sink = j.sink ? j.sink[h] : NEG_INF;
                fo[h] = 1.0f / (l[h] * (1.0f + std::exp(sink - lse)));
                if (j.max_logits) j.max_logits[h] = m[h];
                if (j.lse) j.lse[h] = lse;
            }
        for (int64_t r = 0; r < H; r += BPV_R) {
            const int rr = (int)(H - r < BPV_R ? H - r : BPV_R);
            dispatch_count<BPV_R>(rr, [&](auto c) {
                pv_bf16_dims<decltype(c)::value>(O + r * dv, dv, alpha + r, Pp + r, Hp, Vp, npairs, first,
                                                 last ? out + r * j.out_hs : nullptr, j.out_hs, fo + r);
            });
        }
    }
}

#endif  // DSV4_HAVE_BF16_KERNEL

#if defined(DSV4_HAVE_AVX512BW)

// fp8_ds_mla slot -> 512 bf16 bits, bit-exact with dsv4_decode_row_bf16 (kvcache.c), for scale
// bytes 10..246 (every nonzero result is then a normal bf16: the exponent shift is an integer add);
// returns false, writing nothing, when a group's scale byte is outside that range.
// Per 32 codes: normal codes (8..126) -> (code << 4) + ((120 + k) << 7); subnormal codes 1..7 from
// a table (c * 2^-9, exponent-shifted the same way); 0 -> 0; 0x7F -> NaN 0x7FC0; sign bit on top.
static bool decode_row_fast(const uint8_t *d, const uint8_t *sc, uint16_t *o) {
    for (int g = 0; g < 7; g++)
        if (sc[g] < 10 || sc[g] > 246) return false;
    const __m512i sub0 = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                          0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0);
    const __m512i m7f = _mm512_set1_epi16(0x7F), m80 = _mm512_set1_epi16(0x80), nanv = _mm512_set1_epi16(0x7FC0);
    for (int g = 0; g < 7; g++) {
        const int16_t k7 = (int16_t)((sc[g] - 127) * 128);
        const __m512i shift = _mm512_set1_epi16(k7);
        const __m512i sub = _mm512_mask_add_epi16(sub0, 0xFEu, sub0, shift);  // entry 0 (zero) stays 0
        const __m512i norm = _mm512_set1_epi16((int16_t)(0x3C00 + k7));
        for (int j = 0; j < 64; j += 32) {
            __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(d + 64 * g + j)));
            __m512i c = _mm512_and_si512(x, m7f);
            __m512i v = _mm512_add_epi16(_mm512_slli_epi16(c, 4), norm);
            v = _mm512_mask_permutexvar_epi16(v, _mm512_cmplt_epu16_mask(c, _mm512_set1_epi16(8)), c, sub);
            v = _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(x, m80), 8));
            v = _mm512_mask_mov_epi16(v, _mm512_cmpeq_epi16_mask(c, m7f), nanv);
            _mm512_storeu_si512(o + 64 * g + j, v);
        }
    }
    std::memcpy(o + 448, d + 448, 128);  // RoPE dims: little-endian bf16 bytes
    return true;
}

#endif  // DSV4_HAVE_AVX512BW

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
