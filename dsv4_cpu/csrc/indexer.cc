// The CPU Lightning Indexer (dsv4_cpu.h): checks, instruction-set choice, key staging, the running
// top-k per token, and the work split.
//
// Work items are tiles of up to IDX_TILE consecutive tokens of one request. A tile walks its
// request's keys once, in blocks of IDX_KB: each block is read from the cache (fp8 pages, bf16 or
// float32 rows) and staged once in the kernel's layout, then every token of the tile that sees
// any of it scores it (indexer_isa.cc) and feeds the block's logits to its own running top-k, so a
// key is decoded once per tile and never a tokens x keys logits buffer exists. Work items are taken
// longest first from parallel_items' shared counter (causal tiles grow with the position). With
// fewer tiles than two per thread (decode steps, a few long requests) a tile's key range is cut
// into pieces of whole blocks: each keeps its best k per token, and a merge selects from them
// (the same logits, so the same top-k as one piece).
//
// Running top-k (one per token): candidates in an array of `cap` = 2k + 2 IDX_KB entries and a
// threshold. Until the array first overflows every logit is a candidate; then a logit is kept
// only if it beats the threshold (strictly: a later key has a higher index, so on an equal logit
// it loses), and each overflow keeps the best k (nth_element by the tie rule) and raises the
// threshold to the worst of them. The final k are sorted by the tie rule. Amortized O(1) per key.
//
// DeepSeek-V4.1's two-level top-k (dsv4_indexer_topk_candidates): level 1 rides on the tiles
// above (a running top of each token's block maxima, fed from the same block logits); level 2
// gathers each token's candidate entries instead of walking its context. See the section below.


#include "indexer_call.h"

namespace dsv4 {
namespace idx {

const Fp8Table FP8;


// The kernels built for instruction set `isa` (all nullptr if none).
IndexKernels kernels_for(int isa) {
    switch (isa) {
#if defined(DSV4_BUILT_AVX512BF16)
        case DSV4_ISA_AVX512BF16:
            return index_kernels_avx512bf16();
#endif
#if defined(DSV4_BUILT_AVX512)
        case DSV4_ISA_AVX512:
            return index_kernels_avx512();
#endif
#if defined(DSV4_BUILT_AVX2)
        case DSV4_ISA_AVX2:
            return index_kernels_avx2();
#endif
        case DSV4_ISA_GENERIC:
            return index_kernels_generic();
        default:
            return IndexKernels{};
    }
}

// Whether the bf16 "pairs" layout serves bf16-product inputs on instruction set `isa`: where
// vdpbf16ps runs it (avx512bf16); elsewhere the f32 layout is faster (keys and q widened exactly
// at staging, same products, same order of accumulation). DSV4_PREFILL_INDEXER_LAYOUT=pairs
// forces the pairs layout everywhere (its widening emulation of vdpbf16ps), so the layout the
// avx512bf16 kernel reads is tested on machines without it.
bool pairs_layout(int isa) {
    if (isa == DSV4_ISA_AVX512BF16) return true;
    const char *e = std::getenv("DSV4_PREFILL_INDEXER_LAYOUT");
    return e && std::strcmp(e, "pairs") == 0;
}

// The instruction set, layout, block kernel and e4m3 widening for a call (bf16_inputs: q and
// keys both bf16 or e4m3): DSV4_OK, or an error code with the message set.
int choose(int isa, bool bf16_inputs, IndexBlockFn *fn, WidenE4m3Fn *widen, int *chosen, bool *pairs) {
    if (env_cap() < 0)
        return fail(DSV4_ERR_ISA, std::string("DSV4_PREFILL_CPU_ISA: unknown instruction set '") +
                                      std::getenv("DSV4_PREFILL_CPU_ISA") +
                                      "' (expected generic, avx2, avx512, avx512bf16 or amx)");
    if (isa < -1 || isa > DSV4_ISA_AMX) return fail(DSV4_ERR_ARG, "isa: expected -1 .. 4, got " + std::to_string(isa));
    if (isa >= 0 && !runnable(isa))
        return fail(DSV4_ERR_ISA, std::string("isa: ") + isa_name(isa) + " cannot run on this machine");
    for (int i = isa_ceiling(isa); i >= 0; i--) {
        if (!runnable(i)) continue;
        *pairs = bf16_inputs && pairs_layout(i);
        const IndexKernels k = kernels_for(i);
        if ((*fn = *pairs ? k.block_pairs : k.block_f32) != nullptr) {
            *widen = k.widen;
            *chosen = i;
            return DSV4_OK;
        }
    }
    return fail(DSV4_ERR_ISA, "no indexer kernel runs here");
}


// Every key a token sees is readable, or an error naming the request and the entry.
int check_keys(const Call &c) {
    const dsv4_kv_source &s = c.src;
    const dsv4_prefill_tokens &tk = c.tk;
    std::vector<int64_t> need;  // per request: entries its tokens see
    int64_t all = 0;
    for (int64_t t = 0; t < tk.num_tokens; t++) {
        const int64_t b = tk.token_request[t], n = visible(tk, t);
        all = std::max(all, n);
        if (!s.table) continue;
        if (b < 0 || b >= s.table_rows)
            return fail(DSV4_ERR_ARG, "token_request: token " + std::to_string(t) + " names request " +
                                               std::to_string(b) + ", the keys' table has " +
                                               std::to_string(s.table_rows) + " rows");
        if ((int64_t)need.size() <= b) need.resize(b + 1, 0);
        need[b] = std::max(need[b], n);
    }
    if (!s.table) {
        if (s.page_size > 0) return fail(DSV4_ERR_ARG, "keys: paged keys need a block table");
        if (all > s.num_rows)
            return fail(DSV4_ERR_ARG, "keys: tokens see " + std::to_string(all) + " entries, the rows hold " +
                                               std::to_string(s.num_rows));
        return DSV4_OK;
    }
    for (int64_t b = 0; b < (int64_t)need.size(); b++) {
        const int64_t n = need[b];
        if (n == 0) continue;
        const std::string req = "keys: request " + std::to_string(b);
        if (s.page_size > 0) {
            const int64_t blocks = (n + s.page_size - 1) / s.page_size;
            if (blocks > s.table_width)
                return fail(DSV4_ERR_ARG, req + " sees " + std::to_string(n) + " entries: " + std::to_string(blocks) +
                                                   " blocks, the block table has " + std::to_string(s.table_width));
            for (int64_t k = 0; k < blocks; k++) {
                const int64_t page = table_at(s, b * s.table_stride + k);
                if (page < 0 || page >= s.num_pages)
                    return fail(DSV4_ERR_ARG, req + ", entry " + std::to_string(k * s.page_size) +
                                                       ": block-table entry " + std::to_string(k) + " is page " +
                                                       std::to_string(page) + ", outside [0, " +
                                                       std::to_string(s.num_pages) + ")");
            }
        } else {
            const int64_t off = table_at(s, b);
            if (off < 0 || off > s.num_rows - n)  // (no overflow for any offset)
                return fail(DSV4_ERR_ARG, req + ": " + std::to_string(n) + " rows from row " + std::to_string(off) +
                                                   " reach outside [0, " + std::to_string(s.num_rows) + ")");
        }
    }
    return DSV4_OK;
}

thread_local Scratch t_scratch;


// Keep the best `keep` of n candidates (val, idx) in front (the keep-th best last), sorted by
// the tie rule if `sort`.
void select_best(Scratch &s, float *val, int32_t *idx, int64_t n, int64_t keep, bool sort) {
    std::vector<int32_t> &order = s.order;
    order.resize(n);
    for (int64_t i = 0; i < n; i++) order[i] = (int32_t)i;
    auto cmp = [&](int32_t a, int32_t b) { return better(val[a], idx[a], val[b], idx[b]); };
    const int64_t m = std::min(keep, n);
    if (m < n) std::nth_element(order.begin(), order.begin() + (m - 1), order.end(), cmp);
    if (sort) std::sort(order.begin(), order.begin() + m, cmp);
    s.tmp_val.resize(m);
    s.tmp_idx.resize(m);
    for (int64_t i = 0; i < m; i++) s.tmp_val[i] = val[order[i]], s.tmp_idx[i] = idx[order[i]];
    std::copy(s.tmp_val.begin(), s.tmp_val.end(), val);
    std::copy(s.tmp_idx.begin(), s.tmp_idx.end(), idx);
}

void stage_q(const Call &c, Scratch &s, int64_t slot, int64_t t) {
    const char *row = c.q + (int64_t)c.tk.token_row[t] * c.q_s0 * (int64_t)c.q_esize;
    for (int64_t h = 0; h < c.H; h++) {
        const char *qh = row + h * c.q_s1 * (int64_t)c.q_esize;
        const uint8_t *q8 = reinterpret_cast<const uint8_t *>(qh);
        if (c.pairs) {  // the bf16 values in order are the dwords (an odd D's last one padded with 0)
            uint16_t *o = reinterpret_cast<uint16_t *>(s.qp.data() + (slot * c.H + h) * c.depth);
            if (c.q_dtype == DSV4_BF16) std::memcpy(o, qh, 2 * (size_t)c.D);
            else c.widen(q8, c.D, o, nullptr);
            if (c.D % 2) o[c.D] = 0;
        } else if (c.q_dtype == DSV4_FP8_E4M3) {
            c.widen(q8, c.D, nullptr, s.qf.data() + (slot * c.H + h) * c.depth);
        } else {
            float *o = s.qf.data() + (slot * c.H + h) * c.depth;
            for (int64_t d = 0; d < c.D; d++) {
                if (c.q_dtype == DSV4_F32) {
                    std::memcpy(o + d, qh + 4 * d, 4);
                } else {  // bf16 (e4m3 was widened above)
                    uint16_t v;
                    std::memcpy(&v, qh + 2 * d, 2);
                    o[d] = bf16_f32(v);
                }
            }
        }
    }
}

// Keys e0 .. e0+nb-1 of request b into the staging block (zero keys after nb), their scales.
void stage_keys(const Call &c, Scratch &s, int64_t b, int64_t e0, int64_t nb) {
    float *scale = s.scale.data();
    if (nb < IDX_KB) {  // zero keys after nb (their logits are never read; keep them finite)
        if (c.pairs) std::fill(s.kp.begin(), s.kp.end(), 0u);
        else std::fill(s.kt.begin(), s.kt.end(), 0.0f);
    }
    for (int64_t j = 0; j < nb; j++) {
        scale[j] = 1.0f;
        const char *r = entry(c, b, e0 + j, &scale[j]);
        if (c.pairs) {
            uint32_t *o = s.kp.data() + j;
            for (int64_t i = 0; i < c.depth; i++) {
                uint32_t lo, hi = 0;
                if (c.fp8_keys) {
                    lo = FP8.b[(uint8_t)r[2 * i]];
                    if (2 * i + 1 < c.D) hi = FP8.b[(uint8_t)r[2 * i + 1]];
                } else {  // bf16 rows
                    uint16_t a, z = 0;
                    std::memcpy(&a, r + 4 * i, 2);
                    if (2 * i + 1 < c.D) std::memcpy(&z, r + 4 * i + 2, 2);
                    lo = a, hi = z;
                }
                o[i * IDX_KB] = lo | (hi << 16);
            }
        } else {
            float *o = s.kt.data() + j;
            for (int64_t d = 0; d < c.D; d++) {
                float v;
                if (c.fp8_keys) v = FP8.f[(uint8_t)r[d]];
                else if (c.src.dtype == DSV4_BF16) {
                    uint16_t u;
                    std::memcpy(&u, r + 2 * d, 2);
                    v = bf16_f32(u);
                } else std::memcpy(&v, r + 4 * d, 4);
                o[d * IDX_KB] = v;
            }
        }
    }
}


// Tokens t0 .. t1-1 (one request) against entries [e_lo, e_hi) of their request (e_lo a multiple
// of IDX_KB): their top-k written to the outputs, or, with `cand`, their best k within the range.
void run_tile(const Call &c, int64_t t0, int64_t t1, int64_t e_lo, int64_t e_hi, const Candidates *cand) {
    Scratch &s = t_scratch;
    const dsv4_prefill_tokens &tk = c.tk;
    const int64_t nt = t1 - t0, k = c.topk, cap = 2 * k + 2 * IDX_KB;
    const int64_t b = tk.token_request[t0];
    int64_t n_max = 0;
    for (int64_t t = t0; t < t1; t++) n_max = std::max(n_max, visible(tk, t));
    n_max = std::min(n_max, e_hi);
    // A tile whose tokens see one block each (short contexts) stages each token's q right before
    // its block, in one slot that stays in L1 / L2; otherwise all of them first (read per block).
    const bool one_block = n_max - e_lo <= IDX_KB;
    const int64_t slots = one_block ? 1 : nt;
    if (c.pairs) {
        s.qp.resize((size_t)(slots * c.H * c.depth));
        s.kp.resize((size_t)(c.depth * IDX_KB));
    } else {
        s.qf.resize((size_t)(slots * c.H * c.depth));
        s.kt.resize((size_t)(c.depth * IDX_KB));
    }
    s.scale.assign(IDX_KB, 1.0f);
    s.logits.resize(IDX_KB);
    s.val.resize((size_t)(nt * cap));
    s.idx.resize((size_t)(nt * cap));
    s.size.assign(nt, 0);
    s.th.assign(nt, NEG_INF);
    s.has_th.assign(nt, 0);
    if (!one_block)
        for (int64_t t = t0; t < t1; t++) stage_q(c, s, t - t0, t);
    const bool select = c.cand.mode == DSV4_CANDIDATES_SELECT;  // (split tiles: select_piece, select_merge)
    if (select) select_init(c, nt);
    IndexBlockJob job;
    job.H = c.H;
    job.depth = c.depth;
    job.logits = s.logits.data();
    job.keys = c.pairs ? (const void *)s.kp.data() : (const void *)s.kt.data();
    for (int64_t e0 = e_lo; e0 < n_max; e0 += IDX_KB) {
        stage_keys(c, s, b, e0, std::min<int64_t>(IDX_KB, n_max - e0));
        for (int64_t t = t0; t < t1; t++) {
            const int64_t n = visible(tk, t), i = t - t0;
            if (n <= e0) continue;
            const int64_t nv = std::min<int64_t>({(int64_t)IDX_KB, n - e0, n_max - e0});
            if (one_block) stage_q(c, s, 0, t);
            const int64_t slot = one_block ? 0 : i;
            job.q = c.pairs ? (const void *)(s.qp.data() + slot * c.H * c.depth) : (const void *)(s.qf.data() + slot * c.H * c.depth);
            job.w = c.w + (int64_t)tk.token_row[t] * c.w_s0;
            job.nkeys = nv;
            c.fn(job);
            float *L = s.logits.data(), *val = s.val.data() + i * cap, th = s.th[i];
            int32_t *idx = s.idx.data() + i * cap;
            int64_t &size = s.size[i];
            const bool has = s.has_th[i];
            for (int64_t j = 0; j < nv; j++) {
                const float v = c.fp8_keys ? L[j] * s.scale[j] : L[j];
                if (!has || v > th) {
                    val[size] = v;
                    idx[size] = (int32_t)(e0 + j);
                    size++;
                }
            }
            if (select) select_feed(c, s, i, n, e0, nv, L);
            if (size > cap - IDX_KB && size > k) {  // keep the best k, raise the threshold
                select_best(s, val, idx, size, k, false);
                size = k;
                if (val[k - 1] == val[k - 1]) {  // (a NaN among the best k: keep taking everything)
                    s.th[i] = val[k - 1];
                    s.has_th[i] = 1;
                }
            }
        }
    }
    for (int64_t t = t0; t < t1; t++) {
        const int64_t i = t - t0;
        float *val = s.val.data() + i * cap;
        int32_t *idx = s.idx.data() + i * cap;
        const int64_t m = std::min(k, s.size[i]);
        if (cand) {  // the piece's best k, unsorted: the merge sorts
            select_best(s, val, idx, s.size[i], k, false);
            std::copy(val, val + m, cand->val + i * k);
            std::copy(idx, idx + m, cand->idx + i * k);
            cand->count[i] = m;
            if (select) select_piece(i, *cand);
            continue;
        }
        select_best(s, val, idx, s.size[i], k, true);
        int32_t *oi = c.out_idx + (int64_t)tk.token_row[t] * c.idx_s0;
        for (int64_t j = 0; j < k; j++) oi[j] = j < m ? idx[j] : -1;
        if (c.out_logits) {
            float *ol = c.out_logits + (int64_t)tk.token_row[t] * c.logit_s0;
            for (int64_t j = 0; j < k; j++) ol[j] = j < m ? val[j] : NEG_INF;
        }
        if (select) select_finish(c, i, t, visible(tk, t));
    }
}

// A split tile's top-k from its pieces' candidates (pieces in key order), written to the outputs.
void merge_tile(const Call &c, int64_t t0, int64_t t1, const std::vector<Candidates> &pieces) {
    Scratch &s = t_scratch;
    const int64_t k = c.topk;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t i = t - t0;
        s.val.clear();
        s.idx.clear();
        for (const Candidates &p : pieces) {
            s.val.insert(s.val.end(), p.val + i * k, p.val + i * k + p.count[i]);
            s.idx.insert(s.idx.end(), p.idx + i * k, p.idx + i * k + p.count[i]);
        }
        const int64_t n = (int64_t)s.val.size(), m = std::min(k, n);
        select_best(s, s.val.data(), s.idx.data(), n, k, true);
        int32_t *oi = c.out_idx + (int64_t)c.tk.token_row[t] * c.idx_s0;
        for (int64_t j = 0; j < k; j++) oi[j] = j < m ? s.idx[j] : -1;
        if (c.out_logits) {
            float *ol = c.out_logits + (int64_t)c.tk.token_row[t] * c.logit_s0;
            for (int64_t j = 0; j < k; j++) ol[j] = j < m ? s.val[j] : NEG_INF;
        }
        if (c.cand.mode == DSV4_CANDIDATES_SELECT) select_merge(c, i, t, pieces);
    }
}
}  // namespace idx
}  // namespace dsv4

using namespace dsv4;
using namespace dsv4::idx;

extern "C" {

int dsv4_indexer_isa(int32_t q_dtype, int32_t key_dtype, int32_t isa) {
    if (q_dtype < 0 || q_dtype > DSV4_FP8_E4M3 || key_dtype < 0 || key_dtype > DSV4_FP8_E4M3)
        return (void)fail(DSV4_ERR_ARG, "q_dtype / key_dtype: expected 0 (bf16), 1 (float32) or 2 (e4m3)"), -1;
    IndexBlockFn fn;
    WidenE4m3Fn widen;
    int chosen = -1;
    bool pairs;
    if (choose(isa, q_dtype != DSV4_F32 && key_dtype != DSV4_F32, &fn, &widen, &chosen, &pairs) != DSV4_OK) return -1;
    return chosen;
}

static int indexer_topk(const void *q, int64_t q_s0, int64_t q_s1, int32_t q_dtype, int64_t rows, int64_t H, int64_t D,
                        const float *weights, int64_t w_s0, const dsv4_prefill_tokens *tokens, const dsv4_kv_source *keys,
                        int64_t topk, int32_t *out_idx, int64_t idx_s0, float *out_logits, int64_t logit_s0,
                        const dsv4_parallel *par, int32_t isa, const dsv4_index_candidates *cand) {
    return guarded([&]() -> int {
        if (int rc = check_parallel(par)) return rc;
        if (q_dtype < 0 || q_dtype > DSV4_FP8_E4M3)
            return fail(DSV4_ERR_ARG, "q_dtype: expected 0 (bf16), 1 (float32) or 2 (e4m3), got " + std::to_string(q_dtype));
        if (H < 1 || D < 1) return fail(DSV4_ERR_ARG, "H, D: expected >= 1, got " + std::to_string(H) + ", " + std::to_string(D));
        if (rows < 0) return fail(DSV4_ERR_ARG, "rows: expected >= 0, got " + std::to_string(rows));
        if (topk < 1) return fail(DSV4_ERR_ARG, "topk: expected >= 1, got " + std::to_string(topk));
        if (!tokens || !keys) return fail(DSV4_ERR_ARG, "tokens / keys: NULL");
        Call c;
        c.tk = *tokens;
        c.src = *keys;
        const dsv4_prefill_tokens &tk = c.tk;
        if (tk.num_tokens < 0) return fail(DSV4_ERR_ARG, "num_tokens: expected >= 0");
        if (tk.num_tokens == 0) return DSV4_OK;
        if (tk.compress_ratio < 1)
            return fail(DSV4_ERR_ARG, "compress_ratio: expected >= 1, got " + std::to_string(tk.compress_ratio));
        if (!tk.token_row || !tk.token_request || !tk.token_position)
            return fail(DSV4_ERR_ARG, "token_row / token_request / token_position: NULL");
        if (!q || !weights || !out_idx) return fail(DSV4_ERR_ARG, "q / weights / out_idx: NULL");
        for (int64_t t = 0; t < tk.num_tokens; t++) {
            const int64_t row = tk.token_row[t], p = tk.token_position[t];
            if (row < 0 || row >= rows)
                return fail(DSV4_ERR_ARG, "token_row: token " + std::to_string(t) + " names row " + std::to_string(row) +
                                              ", q / weights / out have " + std::to_string(rows));
            if (p < 0 || p >= DSV4_MAX_POSITION)
                return fail(DSV4_ERR_ARG, "token_position: token " + std::to_string(t) + " is at position " + std::to_string(p) +
                                              ", outside [0, DSV4_MAX_POSITION)");
        }
        const dsv4_kv_source &s = c.src;
        if (s.format == DSV4_KV_INDEX_FP8) {
            if (s.page_size <= 0 || !s.table)
                return fail(DSV4_ERR_ARG, "keys: fp8 index pages need page_size > 0 and a block table");
            if (s.page_stride < s.page_size * (D + 4))
                return fail(DSV4_ERR_ARG, "keys: page_stride " + std::to_string(s.page_stride) + " < page_size * (D + 4) = " +
                                              std::to_string(s.page_size * (D + 4)));
        } else if (s.format == DSV4_ROWS) {
            if (s.dtype != DSV4_BF16 && s.dtype != DSV4_F32)
                return fail(DSV4_ERR_ARG, "keys: rows must be bf16 (0) or float32 (1), got dtype " + std::to_string(s.dtype));
        } else {
            return fail(DSV4_ERR_ARG, "keys: format must be 0 (rows) or 2 (fp8 index pages), got " + std::to_string(s.format));
        }
        if (!s.data) return fail(DSV4_ERR_ARG, "keys: data NULL");
        c.fp8_keys = s.format == DSV4_KV_INDEX_FP8;
        const int key_dtype = c.fp8_keys ? DSV4_FP8_E4M3 : s.dtype;
        int chosen;
        if (int rc = choose(isa, q_dtype != DSV4_F32 && key_dtype != DSV4_F32, &c.fn, &c.widen, &chosen, &c.pairs)) return rc;
        c.q = static_cast<const char *>(q);
        c.q_s0 = q_s0;
        c.q_s1 = q_s1;
        c.H = H;
        c.D = D;
        c.depth = c.pairs ? (D + 1) / 2 : D;
        c.q_dtype = q_dtype;
        c.q_esize = q_dtype == DSV4_F32 ? 4 : q_dtype == DSV4_BF16 ? 2 : 1;
        c.w = weights;
        c.w_s0 = w_s0;
        c.topk = topk;
        c.out_idx = out_idx;
        c.idx_s0 = idx_s0;
        c.out_logits = out_logits;
        c.logit_s0 = logit_s0;
        c.cand = cand ? *cand : dsv4_index_candidates{};
        if (cand)
            if (int rc = check_candidates(c)) return rc;
        if (int rc = check_keys(c)) return rc;
        if (c.cand.mode == DSV4_CANDIDATES_RESTRICT) {
            ParallelScope scope(par);
            return run_restrict(c);
        }
        // tiles: consecutive tokens of one request
        std::vector<std::pair<int64_t, int64_t>> tiles;
        std::vector<int64_t> reach;  // per tile: the most entries any of its tokens sees
        double flops = 0;
        for (int64_t t = 0; t < tk.num_tokens;) {
            int64_t e = t + 1, n = visible(tk, t);
            while (e < tk.num_tokens && e - t < IDX_TILE && tk.token_request[e] == tk.token_request[t]) n = std::max(n, visible(tk, e++));
            tiles.push_back({t, e});
            reach.push_back(n);
            flops += 2.0 * (double)n * (double)(e - t) * (double)(H * D);
            t = e;
        }
        ParallelScope scope(par);
        const int threads = (int)std::max<double>(1.0, std::min<double>((double)max_threads(), std::ceil(flops / 4e6)));
        // Work items: whole tiles, or, with fewer tiles than 2 per thread (decode steps, a few
        // long requests), pieces of a tile's key range (whole blocks, at least SPLIT_BLOCKS each)
        // whose best k per token are merged after: the same logits, so the same top-k.
        constexpr int64_t SPLIT_BLOCKS = 8;
        const int64_t want =
            threads > 1 && (int64_t)tiles.size() < 2 * threads ? (2 * threads + (int64_t)tiles.size() - 1) / (int64_t)tiles.size() : 1;
        struct Item {
            int64_t tile, e_lo, e_hi, piece;  // piece: -1 = the whole tile, written directly
            double work;
        };
        std::vector<Item> items;
        std::vector<std::vector<Candidates>> cands(tiles.size());
        std::vector<int64_t> cand_tiles;
        size_t cand_elems = 0;
        // (level 1: pieces end on whole candidate blocks too)
        const bool select = c.cand.mode == DSV4_CANDIDATES_SELECT;
        const int64_t unit = select ? std::lcm<int64_t>(IDX_KB, c.cand.block_size) : IDX_KB, keep = c.cand.topk_blocks - 1;
        for (size_t i = 0; i < tiles.size(); i++) {
            const int64_t nt = tiles[i].second - tiles[i].first, blocks = (reach[i] + unit - 1) / unit;
            const int64_t split =
                std::max<int64_t>(1, std::min<int64_t>({want, blocks, blocks * (unit / IDX_KB) / SPLIT_BLOCKS}));
            if (split == 1) {
                items.push_back({(int64_t)i, 0, reach[i], -1, (double)reach[i] * nt});
                continue;
            }
            cand_tiles.push_back((int64_t)i);
            for (int64_t p = 0; p < split; p++) {
                const int64_t lo = blocks * p / split * unit, hi = std::min(reach[i], blocks * (p + 1) / split * unit);
                items.push_back({(int64_t)i, lo, hi, (int64_t)cand_elems, (double)(hi - lo) * nt});
                cand_elems += (size_t)(nt * topk);
            }
        }
        std::vector<float> cval(cand_elems);
        std::vector<int32_t> cidx(cand_elems);
        std::vector<int64_t> ccount(cand_elems / std::max<int64_t>(topk, 1) + 1, 0);
        std::vector<uint64_t> bkey(select ? cand_elems / topk * keep : 0);  // (level 1: per token, keep per piece)
        std::vector<int64_t> bcount(select ? cand_elems / topk + 1 : 0);
        auto piece = [&](int64_t off) {
            const int64_t row = off / topk;  // the piece's first token among all pieces' tokens
            return Candidates{cval.data() + off, cidx.data() + off, ccount.data() + row,
                              select ? bkey.data() + row * keep : nullptr, select ? bcount.data() + row : nullptr};
        };
        for (Item &it : items) {
            if (it.piece < 0) continue;
            cands[it.tile].push_back(piece(it.piece));
        }
        std::stable_sort(items.begin(), items.end(), [](const Item &a, const Item &b) { return a.work > b.work; });
        parallel_items((int64_t)items.size(), threads, [&](int64_t n) {
            const Item &it = items[n];
            const auto &tile = tiles[it.tile];
            if (it.piece < 0) {
                run_tile(c, tile.first, tile.second, 0, it.e_hi, nullptr);
                return;
            }
            const Candidates cand = piece(it.piece);
            run_tile(c, tile.first, tile.second, it.e_lo, it.e_hi, &cand);
        });
        parallel_items((int64_t)cand_tiles.size(), threads, [&](int64_t n) {
            const auto &tile = tiles[cand_tiles[n]];
            merge_tile(c, tile.first, tile.second, cands[cand_tiles[n]]);
        });
        return DSV4_OK;
    });
}

int dsv4_indexer_topk(const void *q, int64_t q_s0, int64_t q_s1, int32_t q_dtype, int64_t rows, int64_t H, int64_t D,
                      const float *weights, int64_t w_s0, const dsv4_prefill_tokens *tokens, const dsv4_kv_source *keys,
                      int64_t topk, int32_t *out_idx, int64_t idx_s0, float *out_logits, int64_t logit_s0,
                      const dsv4_parallel *par, int32_t isa) {
    return indexer_topk(q, q_s0, q_s1, q_dtype, rows, H, D, weights, w_s0, tokens, keys, topk, out_idx, idx_s0, out_logits,
                        logit_s0, par, isa, nullptr);
}

int dsv4_indexer_topk_candidates(const void *q, int64_t q_s0, int64_t q_s1, int32_t q_dtype, int64_t rows, int64_t H,
                                 int64_t D, const float *weights, int64_t w_s0, const dsv4_prefill_tokens *tokens,
                                 const dsv4_kv_source *keys, int64_t topk, int32_t *out_idx, int64_t idx_s0,
                                 float *out_logits, int64_t logit_s0, const dsv4_parallel *par, int32_t isa,
                                 const dsv4_index_candidates *cand) {
    return indexer_topk(q, q_s0, q_s1, q_dtype, rows, H, D, weights, w_s0, tokens, keys, topk, out_idx, idx_s0, out_logits,
                        logit_s0, par, isa, cand);
}

}  // extern "C"
