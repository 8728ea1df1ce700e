// DeepSeek-V4.1's two-level top-k in the CPU indexer (dsv4_indexer_topk_candidates): level 1's
// running top of block maxima, fed by indexer.cc's tiles, and level 2's gathered candidates.

#include "indexer_call.h"

namespace dsv4 {
namespace idx {

// ---------------------------------------------------------------- DeepSeek-V4.1's two-level top-k
//
// Level 1 (DSV4_CANDIDATES_SELECT): run_tile hands each token's block logits to select_feed,
// which folds them into the current candidate block's max (candidate blocks may cross key blocks)
// and offers every completed block before the token's pinned (newest) one to a running
// top-(topk_blocks - 1): the entries' scheme (a threshold once the array first fills, strict: a
// later block loses an equal score; amortized O(1) per block). select_finish writes the row.
// Level 2 (DSV4_CANDIDATES_RESTRICT): restrict_token gathers one token's candidate entries
// (blocks ascending, so entries ascending), stages them IDX_KB at a time (stage_gather: rows
// widened, then transposed) for the same block kernel, and keeps a running top-k of their
// logits: the work of a token is its candidates', whatever the context. Tokens whose candidates
// are every block they see (contexts up to topk_blocks x block_size) run in the dense tiles
// instead (run_restrict): the same top-k, with the staging shared by a tile's tokens. A split
// tile's pieces (few tiles: decode steps) end on whole candidate blocks; each keeps its best
// blocks per token (select_piece) and select_merge picks the row from them.

struct BlockState {  // level 1: one thread's running top blocks, per token of its tile
    std::vector<uint64_t> key, th;  // block_key()s
    std::vector<float> cur_max;
    std::vector<int64_t> size, cur;
    std::vector<uint8_t> has_th;
    int64_t cap = 0, keep = 0;
};
thread_local BlockState t_blocks;

// A block's rank as one integer, larger = better: its score's order-preserving bits (a number:
// NaN never enters; -0.0 as 0.0), then the lower block first. Sorting these is the tie rule.
inline uint64_t block_key(float v, int64_t blk) {
    v += 0.0f;
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((uint64_t)u << 32) | (uint64_t)(0xFFFFFFFFu - (uint32_t)blk);
}
inline int32_t block_of(uint64_t key) { return (int32_t)(0xFFFFFFFFu - (uint32_t)key); }

inline int64_t pinned_block(const Call &c, int64_t n) { return n > 0 ? (n - 1) / c.cand.block_size : -1; }

void select_init(const Call &c, int64_t nt) {
    BlockState &b = t_blocks;
    b.keep = c.cand.topk_blocks - 1;  // besides the pinned block
    b.cap = 2 * b.keep + 2 * IDX_KB + 2;
    if (b.keep == 0) return;
    b.key.resize((size_t)(nt * b.cap));
    b.size.assign(nt, 0);
    b.cur.assign(nt, -1);
    b.cur_max.assign(nt, NEG_INF);
    b.th.assign(nt, 0);
    b.has_th.assign(nt, 0);
}

// Token i's completed block `blk` scoring v, offered to its running top (NaN and -inf dropped).
inline void select_offer(BlockState &b, int64_t i, int64_t blk, float v) {
    if (v != v || v == NEG_INF) return;
    const uint64_t k = block_key(v, blk);
    if (b.has_th[i] && !(k > b.th[i])) return;
    uint64_t *key = b.key.data() + i * b.cap;
    int64_t &size = b.size[i];
    key[size] = k;
    if (++size == b.cap) {  // keep the best, raise the threshold
        std::nth_element(key, key + (b.keep - 1), key + size, std::greater<uint64_t>());
        size = b.keep;
        b.th[i] = key[b.keep - 1];
        b.has_th[i] = 1;
    }
}

// Token i (n visible entries) scored entries e0 .. e0+nv-1: logits L (times scale for fp8 keys).
void select_feed(const Call &c, const Scratch &s, int64_t i, int64_t n, int64_t e0, int64_t nv, const float *L) {
    BlockState &b = t_blocks;
    if (b.keep == 0) return;
    const int64_t bs = c.cand.block_size, edge = pinned_block(c, n) * bs;  // entries before the pinned block
    const int64_t stop = std::min(e0 + nv, edge);
    int64_t cur = b.cur[i];
    float m = b.cur_max[i];
    int64_t next = cur >= 0 ? (cur + 1) * bs : e0;  // where the block in progress ends (no division per entry)
    for (int64_t e = e0; e < stop; e++) {
        const float v = c.fp8_keys ? L[e - e0] * s.scale[e - e0] : L[e - e0];
        if (e >= next) {  // a new block starts at e
            if (cur >= 0) select_offer(b, i, cur, m);
            cur = e / bs;
            next = (cur + 1) * bs;
            m = v;
        } else if (m == m && (v != v || v > m)) {  // (a NaN-propagating max)
            m = v;
        }
    }
    if (e0 + nv >= edge && cur >= 0) {  // the last block before the pinned one is complete
        select_offer(b, i, cur, m);
        cur = -1;
    }
    b.cur[i] = cur;
    b.cur_max[i] = m;
}

// Token t (tile slot i, n visible entries): its row of candidate blocks.
void select_finish(const Call &c, int64_t i, int64_t t, int64_t n) {
    BlockState &b = t_blocks;
    int32_t *o = c.cand.blocks + (int64_t)c.tk.token_row[t] * c.cand.blocks_s0;
    int64_t w = 0;
    if (n > 0) o[w++] = (int32_t)pinned_block(c, n);
    if (n > 0 && b.keep > 0) {
        uint64_t *key = b.key.data() + i * b.cap;
        const int64_t size = b.size[i], m = std::min(b.keep, size);
        if (m < size) std::nth_element(key, key + (m - 1), key + size, std::greater<uint64_t>());
        std::sort(key, key + m, std::greater<uint64_t>());
        for (int64_t j = 0; j < m; j++) o[w++] = block_of(key[j]);
    }
    for (; w < c.cand.topk_blocks; w++) o[w] = -1;
}

struct RestrictState {  // level 2: one thread's candidate blocks and entries of a token
    std::vector<int32_t> blk;
    std::vector<int64_t> ents;
    std::vector<uint32_t> rows;  // a gathered key block as rows [IDX_KB][depth rounded up to 4]
};
thread_local RestrictState t_restrict;

typedef uint32_t u32x4 __attribute__((vector_size(16)));
typedef uint32_t u32x4_u __attribute__((vector_size(16), aligned(4)));
#if defined(__clang__)
#define DSV4_SHUFFLE(a, b, i, j, k, l) __builtin_shufflevector(a, b, i, j, k, l)
#else
#define DSV4_SHUFFLE(a, b, i, j, k, l) __builtin_shuffle(a, b, u32x4{i, j, k, l})
#endif

// Entries ents[0 .. nb-1] of request b into the staging block, as stage_keys writes it, for one
// token (no tile shares it): each key widened as a row by the instruction set's vector widening
// (e4m3) or a shift (bf16), then the rows transposed four by four words into the layout.
void stage_gather(const Call &c, Scratch &s, RestrictState &r, int64_t b, const int64_t *ents, int64_t nb) {
    const int64_t dep = c.depth, dp = (dep + 3) & ~int64_t(3);
    r.rows.resize((size_t)(IDX_KB * dp));
    uint32_t *rows = r.rows.data();
    for (int64_t j = 0; j < IDX_KB; j++) {
        uint32_t *o = rows + j * dp;
        std::fill(o + (j < nb ? dep - 1 : 0), o + dp, 0u);  // padding (and the odd D's last pair)
        if (j >= nb) continue;
        s.scale[j] = 1.0f;
        const char *src = entry(c, b, ents[j], &s.scale[j]);
        const uint8_t *u8 = reinterpret_cast<const uint8_t *>(src);
        if (c.pairs) {  // dwords of two bf16 dims
            if (c.fp8_keys) c.widen(u8, c.D, reinterpret_cast<uint16_t *>(o), nullptr);
            else std::memcpy(o, src, 2 * (size_t)c.D);
        } else if (c.fp8_keys) {
            c.widen(u8, c.D, nullptr, reinterpret_cast<float *>(o));
        } else if (c.src.dtype == DSV4_BF16) {
            for (int64_t d = 0; d < c.D; d++) {
                uint16_t u;
                std::memcpy(&u, src + 2 * d, 2);
                o[d] = (uint32_t)u << 16;
            }
        } else {
            std::memcpy(o, src, 4 * (size_t)c.D);
        }
    }
    uint32_t *K = c.pairs ? s.kp.data() : reinterpret_cast<uint32_t *>(s.kt.data());
    for (int64_t j = 0; j < IDX_KB; j += 4)
        for (int64_t i = 0; i < dep; i += 4) {
            const u32x4 a = *reinterpret_cast<const u32x4_u *>(rows + j * dp + i);
            const u32x4 e = *reinterpret_cast<const u32x4_u *>(rows + (j + 1) * dp + i);
            const u32x4 f = *reinterpret_cast<const u32x4_u *>(rows + (j + 2) * dp + i);
            const u32x4 g = *reinterpret_cast<const u32x4_u *>(rows + (j + 3) * dp + i);
            const u32x4 t0 = DSV4_SHUFFLE(a, e, 0, 4, 1, 5), t1 = DSV4_SHUFFLE(a, e, 2, 6, 3, 7);
            const u32x4 t2 = DSV4_SHUFFLE(f, g, 0, 4, 1, 5), t3 = DSV4_SHUFFLE(f, g, 2, 6, 3, 7);
            const u32x4 col[4] = {DSV4_SHUFFLE(t0, t2, 0, 1, 4, 5), DSV4_SHUFFLE(t0, t2, 2, 3, 6, 7),
                                  DSV4_SHUFFLE(t1, t3, 0, 1, 4, 5), DSV4_SHUFFLE(t1, t3, 2, 3, 6, 7)};
            for (int64_t x = 0; x < 4 && i + x < dep; x++) *reinterpret_cast<u32x4_u *>(K + (i + x) * IDX_KB + j) = col[x];
        }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Level 2 for token t: its top-k among the visible entries of its candidate blocks, written to the
// outputs. Returns -1, or a block it lists twice (its outputs then unwritten).
int64_t restrict_token(const Call &c, int64_t t) {
    Scratch &s = t_scratch;
    RestrictState &r = t_restrict;
    const dsv4_prefill_tokens &tk = c.tk;
    const int64_t n = visible(tk, t), bs = c.cand.block_size, k = c.topk, cap = 2 * k + 2 * IDX_KB;
    const int32_t *row = c.cand.blocks + (int64_t)tk.token_row[t] * c.cand.blocks_s0;
    r.blk.clear();
    for (int64_t j = 0; j < c.cand.topk_blocks; j++)
        if (row[j] >= 0) r.blk.push_back(row[j]);
    std::sort(r.blk.begin(), r.blk.end());
    for (size_t j = 1; j < r.blk.size(); j++)
        if (r.blk[j] == r.blk[j - 1]) return r.blk[j];
    r.ents.clear();
    for (int32_t b : r.blk)
        for (int64_t e = (int64_t)b * bs, end = std::min(e + bs, n); e < end; e++) r.ents.push_back(e);
    const int64_t m = (int64_t)r.ents.size(), req = tk.token_request[t];
    if (c.pairs) {
        s.qp.resize((size_t)(c.H * c.depth));
        s.kp.resize((size_t)(c.depth * IDX_KB));
    } else {
        s.qf.resize((size_t)(c.H * c.depth));
        s.kt.resize((size_t)(c.depth * IDX_KB));
    }
    s.scale.assign(IDX_KB, 1.0f);
    s.logits.resize(IDX_KB);
    s.val.resize((size_t)cap);
    s.idx.resize((size_t)cap);
    float *val = s.val.data(), th = NEG_INF;
    int32_t *idx = s.idx.data();
    int64_t size = 0;
    bool has = false;
    if (m > 0) stage_q(c, s, 0, t);
    IndexBlockJob job;
    job.H = c.H;
    job.depth = c.depth;
    job.logits = s.logits.data();
    job.keys = c.pairs ? (const void *)s.kp.data() : (const void *)s.kt.data();
    job.q = c.pairs ? (const void *)s.qp.data() : (const void *)s.qf.data();
    job.w = c.w + (int64_t)tk.token_row[t] * c.w_s0;
    for (int64_t a = 0; a < m; a += IDX_KB) {
        const int64_t nb = std::min<int64_t>(IDX_KB, m - a);
        const int64_t *e = r.ents.data() + a;
        stage_gather(c, s, r, req, e, nb);
        job.nkeys = nb;
        c.fn(job);
        const float *L = s.logits.data();
        for (int64_t j = 0; j < nb; j++) {
            const float v = c.fp8_keys ? L[j] * s.scale[j] : L[j];
            if (!has || v > th) {  // (entries ascending: a later one loses an equal logit)
                val[size] = v;
                idx[size] = (int32_t)e[j];
                size++;
            }
        }
        if (size > cap - IDX_KB && size > k) {
            select_best(s, val, idx, size, k, false);
            size = k;
            if (val[k - 1] == val[k - 1]) th = val[k - 1], has = true;
        }
    }
    const int64_t kept = std::min(k, size);
    select_best(s, val, idx, size, k, true);
    int32_t *oi = c.out_idx + (int64_t)tk.token_row[t] * c.idx_s0;
    for (int64_t j = 0; j < k; j++) oi[j] = j < kept ? idx[j] : -1;
    if (c.out_logits) {
        float *ol = c.out_logits + (int64_t)tk.token_row[t] * c.logit_s0;
        for (int64_t j = 0; j < k; j++) ol[j] = j < kept ? val[j] : NEG_INF;
    }
    return -1;
}

// The candidates argument: DSV4_OK or DSV4_ERR_ARG naming what is wrong. Level 2: every listed
// block one its token sees (a token's duplicates are found by restrict_token).
int check_candidates(const Call &c) {
    const dsv4_index_candidates &d = c.cand;
    if (d.mode != DSV4_CANDIDATES_SELECT && d.mode != DSV4_CANDIDATES_RESTRICT)
        return fail(DSV4_ERR_ARG, "cand: mode must be 1 (select) or 2 (restrict), got " + std::to_string(d.mode));
    if (d.block_size < 1 || d.block_size > INT32_MAX || d.topk_blocks < 1 || d.topk_blocks > INT32_MAX)
        return fail(DSV4_ERR_ARG, "cand: block_size and topk_blocks must be in [1, 2^31), got " +
                                      std::to_string(d.block_size) + " and " + std::to_string(d.topk_blocks));
    if (d.topk_blocks * d.block_size < c.topk)
        return fail(DSV4_ERR_ARG, "cand: topk_blocks x block_size = " + std::to_string(d.topk_blocks) + " x " +
                                      std::to_string(d.block_size) + " = " + std::to_string(d.topk_blocks * d.block_size) +
                                      " positions cannot hold topk = " + std::to_string(c.topk) + " entries");
    if (!d.blocks || d.blocks_s0 < d.topk_blocks)
        return fail(DSV4_ERR_ARG, "cand: blocks NULL or its row stride " + std::to_string(d.blocks_s0) + " < topk_blocks " +
                                      std::to_string(d.topk_blocks));
    if (d.mode != DSV4_CANDIDATES_RESTRICT) return DSV4_OK;
    for (int64_t t = 0; t < c.tk.num_tokens; t++) {
        const int32_t *row = d.blocks + (int64_t)c.tk.token_row[t] * d.blocks_s0;
        const int64_t n = visible(c.tk, t), nb = ceil_div(n, d.block_size);
        for (int64_t j = 0; j < d.topk_blocks; j++)
            if (row[j] < -1 || row[j] >= nb)
                return fail(DSV4_ERR_ARG, "candidates: token " + std::to_string(t) + ", column " + std::to_string(j) +
                                              " is block " + std::to_string(row[j]) + ", outside [-1, " + std::to_string(nb) +
                                              ") (the token sees " + std::to_string(n) + " entries)");
    }
    return DSV4_OK;
}


// Whether token t's candidates are every block it sees, each once: its level 2 is then its plain
// top-k, which the dense tiles compute with the staging shared by a tile's tokens (contexts up
// to topk_blocks x block_size). seen: scratch flags.
bool covers_all(const Call &c, int64_t t, std::vector<uint8_t> &seen) {
    const int64_t nb = ceil_div(visible(c.tk, t), c.cand.block_size);
    if (nb > c.cand.topk_blocks) return false;
    const int32_t *row = c.cand.blocks + (int64_t)c.tk.token_row[t] * c.cand.blocks_s0;
    seen.assign((size_t)nb, 0);
    int64_t count = 0;
    for (int64_t j = 0; j < c.cand.topk_blocks; j++) {
        if (row[j] < 0) continue;
        if (seen[row[j]]) return false;  // (a duplicate: restrict_token names it)
        seen[row[j]] = 1;
        count++;
    }
    return count == nb;
}

// Level 2 for every token of a checked call: tiles of consecutive tokens whose candidates are
// every block they see run densely (run_tile); every other token is a work item of its own.
int run_restrict(const Call &c) {
    const dsv4_prefill_tokens &tk = c.tk;
    const int64_t T = tk.num_tokens, reach = c.cand.topk_blocks * c.cand.block_size;
    struct Item {
        int64_t t0, t1, e_hi;  // e_hi < 0: one gathered token
        double work;
    };
    std::vector<Item> items;
    std::vector<uint8_t> seen;
    double flops = 0;
    for (int64_t t = 0; t < T;) {
        if (!covers_all(c, t, seen)) {
            const double n = (double)std::min(visible(tk, t), reach);
            items.push_back({t, t + 1, -1, n});
            flops += 2.0 * n * (double)(c.H * c.D);
            t++;
            continue;
        }
        int64_t e = t + 1, n = visible(tk, t);
        while (e < T && e - t < IDX_TILE && tk.token_request[e] == tk.token_request[t] && covers_all(c, e, seen))
            n = std::max(n, visible(tk, e++));
        items.push_back({t, e, n, (double)n * (double)(e - t)});
        flops += 2.0 * (double)n * (double)(e - t) * (double)(c.H * c.D);
        t = e;
    }
    const int threads = (int)std::max<double>(1.0, std::min<double>((double)max_threads(), std::ceil(flops / 4e6)));
    std::stable_sort(items.begin(), items.end(), [](const Item &a, const Item &b) { return a.work > b.work; });
    std::vector<int64_t> dup((size_t)T, -1);
    parallel_items((int64_t)items.size(), threads, [&](int64_t i) {
        const Item &it = items[i];
        if (it.e_hi >= 0) run_tile(c, it.t0, it.t1, 0, it.e_hi, nullptr);
        else dup[it.t0] = restrict_token(c, it.t0);
    });
    for (int64_t t = 0; t < T; t++)
        if (dup[t] >= 0)
            return fail(DSV4_ERR_ARG, "candidates: token " + std::to_string(t) + " lists block " + std::to_string(dup[t]) +
                                          " more than once");
    return DSV4_OK;
}


// Level 1 in a piece of a split tile (pieces end on whole candidate blocks): token i's block in
// progress is complete at the piece's end; its best blocks go to the piece's candidates.
void select_piece(int64_t i, const Candidates &cand) {
    BlockState &b = t_blocks;
    if (b.keep == 0) return;
    if (b.cur[i] >= 0) select_offer(b, i, b.cur[i], b.cur_max[i]);
    uint64_t *key = b.key.data() + i * b.cap;
    const int64_t size = b.size[i], m = std::min(b.keep, size);
    if (m < size) std::nth_element(key, key + (m - 1), key + size, std::greater<uint64_t>());
    std::copy(key, key + m, cand.bkey + i * b.keep);
    cand.bcount[i] = m;
}

// Level 1 of a split tile: token t's (tile slot i) row from its pieces' best blocks.
void select_merge(const Call &c, int64_t i, int64_t t, const std::vector<Candidates> &pieces) {
    BlockState &b = t_blocks;
    const int64_t n = visible(c.tk, t), keep = c.cand.topk_blocks - 1;
    int32_t *o = c.cand.blocks + (int64_t)c.tk.token_row[t] * c.cand.blocks_s0;
    int64_t w = 0;
    if (n > 0) o[w++] = (int32_t)pinned_block(c, n);
    if (n > 0 && keep > 0) {
        b.key.clear();
        for (const Candidates &p : pieces) b.key.insert(b.key.end(), p.bkey + i * keep, p.bkey + i * keep + p.bcount[i]);
        const int64_t size = (int64_t)b.key.size(), m = std::min(keep, size);
        if (m < size) std::nth_element(b.key.begin(), b.key.begin() + (m - 1), b.key.end(), std::greater<uint64_t>());
        std::sort(b.key.begin(), b.key.begin() + m, std::greater<uint64_t>());
        for (int64_t j = 0; j < m; j++) o[w++] = block_of(b.key[j]);
    }
    for (; w < c.cand.topk_blocks; w++) o[w] = -1;
}

}  // namespace idx
}  // namespace dsv4
