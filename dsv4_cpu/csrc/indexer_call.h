// The CPU indexer's internals shared by indexer.cc (checks, instruction-set choice, key staging,
// the dense tiles and the entry points) and indexer_two_level.cc (DeepSeek-V4.1's two-level
// top-k): the call's inputs, one thread's buffers, the tie rule and the functions each side
// calls of the other.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "dsv4_cpu.h"
#include "indexer_impl.h"
#include "runtime.h"

namespace dsv4 {
namespace idx {

constexpr int64_t IDX_TILE = 16;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// OCP e4m3 (float8_e4m3fn) byte -> value: float32 and bf16 bits (both exact); 0x7F / 0xFF NaN.
struct Fp8Table {
    float f[256];
    uint16_t b[256];
    Fp8Table() {
        for (int i = 0; i < 256; i++) {
            const int e = (i >> 3) & 15, m = i & 7;
            float v = e == 0 ? std::ldexp((float)m, -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
            if ((i & 0x7F) == 0x7F) v = std::numeric_limits<float>::quiet_NaN();
            if (i & 0x80) v = -v;
            f[i] = v;
            uint32_t u;
            std::memcpy(&u, &v, 4);
            b[i] = (uint16_t)(u >> 16);
        }
    }
};
extern const Fp8Table FP8;  // (indexer.cc)

inline float bf16_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// The call's inputs that every tile reads.
struct Call {
    const char *q;
    int64_t q_s0, q_s1, H, D, depth;  // depth: D2 (pairs) or D
    int q_dtype;
    size_t q_esize;
    const float *w;
    int64_t w_s0;
    dsv4_prefill_tokens tk;
    dsv4_kv_source src;
    bool fp8_keys, pairs;
    int64_t topk;
    int32_t *out_idx;
    int64_t idx_s0;
    float *out_logits;
    int64_t logit_s0;
    IndexBlockFn fn;
    WidenE4m3Fn widen;  // e4m3 queries, the chosen instruction set's
    dsv4_index_candidates cand;  // the two-level top-k (mode 0: none)
};

inline int64_t table_at(const dsv4_kv_source &s, int64_t i) {
    return s.table_int64 ? static_cast<const int64_t *>(s.table)[i] : static_cast<const int32_t *>(s.table)[i];
}

inline int64_t visible(const dsv4_prefill_tokens &tk, int64_t t) {
    return std::max<int64_t>(0, ((int64_t)tk.token_position[t] + 1) / tk.compress_ratio);
}

// Bytes of entry e of request b (format 0: the row; format 2: the e4m3 bytes, *scale set).
// Only called for entries the checks have cleared.
inline const char *entry(const Call &c, int64_t b, int64_t e, float *scale) {
    const dsv4_kv_source &s = c.src;
    const char *base = static_cast<const char *>(s.data);
    if (c.fp8_keys) {
        const int64_t page = table_at(s, b * s.table_stride + e / s.page_size), slot = e % s.page_size;
        const char *p = base + page * s.page_stride;
        std::memcpy(scale, p + s.page_size * c.D + 4 * slot, 4);
        return p + slot * c.D;
    }
    const size_t es = s.dtype == DSV4_BF16 ? 2 : 4;
    if (s.page_size > 0) {
        const int64_t page = table_at(s, b * s.table_stride + e / s.page_size), slot = e % s.page_size;
        return base + (page * s.page_stride + slot * s.row_stride) * (int64_t)es;
    }
    const int64_t row = s.table ? table_at(s, b) + e : e;
    return base + row * s.row_stride * (int64_t)es;
}

// One thread's buffers, reused across tiles and calls.
struct Scratch {
    std::vector<uint32_t> qp, kp;  // staged q (all tokens of a tile), staged key block (pairs)
    std::vector<float> qf, kt;     // the same, f32 layout
    std::vector<float> scale, logits, val;
    std::vector<int32_t> idx;
    std::vector<int64_t> size;
    std::vector<float> th;
    std::vector<uint8_t> has_th;
    std::vector<int32_t> order, tmp_idx;
    std::vector<float> tmp_val;
};
extern thread_local Scratch t_scratch;  // (indexer.cc)

// The tie rule: a better than b (larger logit; equal logits: lower index; NaN below all).
inline bool better(float va, int32_t ia, float vb, int32_t ib) {
    const bool na = va != va, nb = vb != vb;
    if (na != nb) return nb;
    if (!na && va != vb) return va > vb;
    return ia < ib;
}

// Candidates of one piece of a split tile: per token of the tile, its best (up to k) entries among
// the piece's keys (val / idx [nt * k], count [nt]).
struct Candidates {
    float *val;
    int32_t *idx;
    int64_t *count;
    uint64_t *bkey;  // level 1: per token its best topk_blocks - 1 completed blocks' keys [nt * (topk_blocks - 1)]
    int64_t *bcount;  // [nt]
};

// indexer.cc
// Keep the best `keep` of n candidates (val, idx) in front (the keep-th best last), sorted by
// the tie rule if `sort`.
void select_best(Scratch &s, float *val, int32_t *idx, int64_t n, int64_t keep, bool sort);
// Token t's q staged in slot `slot` of s in the kernel's layout.
void stage_q(const Call &c, Scratch &s, int64_t slot, int64_t t);
// Tokens t0 .. t1 - 1 (one request) against entries e_lo .. e_hi - 1; cand: a split tile's piece.
void run_tile(const Call &c, int64_t t0, int64_t t1, int64_t e_lo, int64_t e_hi, const Candidates *cand);

// indexer_two_level.cc (level 1: DSV4_CANDIDATES_SELECT, level 2: DSV4_CANDIDATES_RESTRICT)
void select_init(const Call &c, int64_t nt);
void select_feed(const Call &c, const Scratch &s, int64_t i, int64_t n, int64_t e0, int64_t nv, const float *L);
void select_finish(const Call &c, int64_t i, int64_t t, int64_t n);
void select_piece(int64_t i, const Candidates &cand);
void select_merge(const Call &c, int64_t i, int64_t t, const std::vector<Candidates> &pieces);
int check_candidates(const Call &c);
int run_restrict(const Call &c);

}  // namespace idx
}  // namespace dsv4
