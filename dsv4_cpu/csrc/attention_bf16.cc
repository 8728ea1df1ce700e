// The avx512bf16 token kernel (vdpbf16ps for QK and PV) and the AVX512BW fp8_ds_mla row decoder
// of one instruction set; empty for sets without them. Compiled once per set beside
// attention_isa.cc (build.py); the layout of the bf16 path is described there.

#include "attention_isa.h"

namespace dsv4 {
namespace DSV4_CAT(isa_, DSV4_ISA) {

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

void token_bf16(const TokenJob &j, Scratch &sc) {
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
bool decode_row_fast(const uint8_t *d, const uint8_t *sc, uint16_t *o) {
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
}  // namespace dsv4
