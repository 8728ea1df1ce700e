// The sparse-attention entry points (dsv4_cpu.h): the generic call on a flat workspace and the
// fused prefill call that reads the caches directly.
//
// Work is split by tokens: a work item is a tile of consecutive tokens, taken by the threads
// from one shared counter (runtime.cc's parallel_items: a thread that is slow or starts late takes
// fewer tiles). A call uses only as many threads as its work (keys x heads x dims) pays for, so
// small calls (decode steps of a small model) run inline. Every token's result depends only on
// its own keys and their order, never on the tiling or the thread that ran it.
//
// Prefill (dsv4_prefill_attention): a tile is up to TILE_TOKENS consecutive tokens of one
// request at consecutive positions. Keys in q's dtype are read in place (row pointers into the
// pages / rows); fp8_ds_mla pages are dequantized once per tile into the thread's staging rows
// (the window rows of the whole tile, and the compressed entries any of its tokens reads), so a
// row shared by the tile's tokens (127 of 128 window rows between neighbours, every HCA entry)
// is decoded once, not once per token.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kvcache_v41.h"
#include "runtime.h"

namespace dsv4 {
namespace {

// Threads worth using for `flops` of work: a thread gets at least GRAIN_FLOPS (about 10-20 us
// on one core), so a small call (a decode step of a small model) runs on the caller's thread.
constexpr double GRAIN_FLOPS = 4e6;

int threads_for(double flops) {
    return (int)std::max<double>(1.0, std::min<double>((double)max_threads(), std::ceil(flops / GRAIN_FLOPS)));
}

// ---------------------------------------------------------------- helpers

// What every token of one call shares; run_token attends one token (q row and out row `row`)
// over its key rows.
struct CallArgs {
    const void *q;
    int64_t q_s0, q_s1, H, D, dv;
    size_t esize;
    float scale;
    const float *sink;
    dsv4_outputs o;
    const void *zero_row;
};

void run_token(TokenFn fn, Scratch &sc, const CallArgs &c, int64_t row, const void *const *keys, int64_t n) {
    TokenJob j;
    j.q = static_cast<const char *>(c.q) + row * c.q_s0 * (int64_t)c.esize;
    j.q_hs = c.q_s1;
    j.H = c.H;
    j.D = c.D;
    j.dv = c.dv;
    j.keys = keys;
    j.n = n;
    j.scale = c.scale;
    j.sink = c.sink;
    j.out = static_cast<char *>(c.o.out) + row * c.o.out_s0 * (int64_t)c.esize;
    j.out_hs = c.o.out_s1;
    j.max_logits = c.o.max_logits ? c.o.max_logits + row * c.o.stat_s0 : nullptr;
    j.lse = c.o.lse ? c.o.lse + row * c.o.stat_s0 : nullptr;
    j.zero_row = c.zero_row;
    fn(j, sc);
}


thread_local Scratch t_scratch;

int64_t value_dim(int64_t D) { return D >= 512 ? 512 : D; }

struct Rows {  // per-call constant rows of the dtype: zeros (padding keys) and NaN (unreadable keys)
    std::vector<uint32_t> zero, nan;
    Rows(int dtype, int64_t D) : zero((size_t)D, 0u), nan((size_t)D) {
        for (auto &x : nan) x = dtype == DSV4_BF16 ? 0x7FC07FC0u : 0x7FC00000u;
    }
};

int check_outputs(const dsv4_outputs *o, int64_t T) {
    if (!o) return fail(DSV4_ERR_ARG, "outputs: NULL");
    if (T > 0 && !o->out) return fail(DSV4_ERR_ARG, "out: NULL");
    return DSV4_OK;
}

int check_common(const void *q, int32_t dtype, int64_t H, int64_t D, const dsv4_parallel *par) {
    if (dtype != DSV4_BF16 && dtype != DSV4_F32)
        return fail(DSV4_ERR_ARG, "dtype: expected 0 (bf16) or 1 (float32), got " + std::to_string(dtype));
    if (H < 1) return fail(DSV4_ERR_ARG, "H: expected >= 1, got " + std::to_string(H));
    if (D < 1) return fail(DSV4_ERR_ARG, "D: expected >= 1, got " + std::to_string(D));
    if (!q) return fail(DSV4_ERR_ARG, "q: NULL");
    return check_parallel(par);
}

inline int64_t table_at(const dsv4_kv_source &s, int64_t i) {
    return s.table_int64 ? static_cast<const int64_t *>(s.table)[i] : static_cast<const int32_t *>(s.table)[i];
}

// Address of entry e of request b of a format-0 source, or nullptr when it is outside the arrays.
const char *row_address(const dsv4_kv_source &s, int64_t b, int64_t e, size_t esize) {
    const char *base = static_cast<const char *>(s.data);
    if (e < 0 || b < 0) return nullptr;
    if (s.page_size > 0) {
        int64_t blk = e / s.page_size, slot = e % s.page_size;
        if (b >= s.table_rows || blk >= s.table_width) return nullptr;
        int64_t page = table_at(s, b * s.table_stride + blk);
        if (page < 0 || page >= s.num_pages) return nullptr;
        return base + (page * s.page_stride + slot * s.row_stride) * (int64_t)esize;
    }
    int64_t row = e;
    if (s.table) {
        if (b >= s.table_rows) return nullptr;
        row = table_at(s, b) + e;
    }
    if (row < 0 || row >= s.num_rows) return nullptr;
    return base + row * s.row_stride * (int64_t)esize;
}

// fp8_ds_mla: the slot bytes (448 e4m3 + 128 RoPE bytes) and scale bytes of entry e of request
// b, or false when the page is outside the arrays.
bool fp8_address(const dsv4_kv_source &s, int64_t b, int64_t e, const uint8_t **d, const uint8_t **sc) {
    if (e < 0 || b < 0 || b >= s.table_rows || s.page_size <= 0) return false;
    int64_t blk = e / s.page_size, slot = e % s.page_size;
    if (blk >= s.table_width) return false;
    int64_t page = table_at(s, b * s.table_stride + blk);
    if (page < 0 || page >= s.num_pages) return false;
    const uint8_t *p = static_cast<const uint8_t *>(s.data) + page * s.page_stride;
    *d = p + slot * 576;
    *sc = p + s.page_size * 576 + slot * 8;
    return true;
}

int check_source(const dsv4_kv_source *s, const char *name, int32_t dtype, int64_t D) {
    const std::string n(name);
    if (!s) return fail(DSV4_ERR_ARG, n + ": NULL");
    if (s->num_rows < 0 || s->num_pages < 0 || s->page_size < 0 || s->table_rows < 0 || s->table_width < 0)
        return fail(DSV4_ERR_ARG, n + ": negative num_rows / num_pages / page_size / table_rows / table_width");
    if (s->table && s->table_rows > 1 && s->table_stride < (s->page_size > 0 ? s->table_width : 1))
        return fail(DSV4_ERR_ARG, n + ": table_stride " + std::to_string(s->table_stride) + " is smaller than a table row");
    if (!s->table && s->table_rows > 0) return fail(DSV4_ERR_ARG, n + ": table NULL with table_rows > 0");
    if (!s->data && (s->num_rows > 0 || s->num_pages > 0)) return fail(DSV4_ERR_ARG, n + ": data NULL");
    if (s->format == DSV4_FP8_DS_MLA) {
        if (D != 512) return fail(DSV4_ERR_ARG, n + ": fp8_ds_mla rows have D = 512, q has " + std::to_string(D));
        if (s->page_size <= 0 || !s->table)
            return fail(DSV4_ERR_ARG, n + ": fp8_ds_mla pages need page_size > 0 and a block table");
        if (s->page_size > (int64_t(1) << 40) / 584 || s->page_stride < s->page_size * 584)
            return fail(DSV4_ERR_ARG, n + ": page_stride " + std::to_string(s->page_stride) + " < page_size * 584");
        return DSV4_OK;
    }
    if (s->format == DSV4_MXFP8_SPLIT || s->format == DSV4_MXFP8_INTERLEAVED) return check_mxfp8_source(*s, n, D);
    if (s->format != DSV4_ROWS) return fail(DSV4_ERR_ARG, n + ": format must be 0 (rows), 1 (fp8_ds_mla) or 3 / 4 (mxfp8)");
    if (s->dtype != dtype) return fail(DSV4_ERR_ARG, n + ": rows must hold q's dtype");
    if (s->row_stride < D && (s->num_rows > 1 || s->page_size > 1))
        return fail(DSV4_ERR_ARG, n + ": row_stride " + std::to_string(s->row_stride) + " < D");
    if (s->page_size > 0 && !s->table) return fail(DSV4_ERR_ARG, n + ": paged rows need a block table");
    return DSV4_OK;
}

// Entries of request b the source can address: 0 .. capacity - 1 (a logical source's rows up to
// its end from the request's offset, the slots of the pages its block-table row names); -1:
// request b has no table row.
int64_t capacity(const dsv4_kv_source &s, int64_t b) {
    if (s.page_size > 0) return b < s.table_rows ? s.table_width * s.page_size : -1;
    if (!s.table) return s.num_rows;
    if (b >= s.table_rows) return -1;
    return std::max<int64_t>(0, s.num_rows - table_at(s, b));  // a negative offset: rows before 0 read NaN
}

// Every token's row, request and position, before any pointer is formed from them.
int check_tokens(const dsv4_prefill_tokens &tk, int64_t q_rows, const dsv4_kv_source &raw, const dsv4_kv_source *comp) {
    auto bad = [](int64_t t, const std::string &what) {
        return fail(DSV4_ERR_ARG, "tokens[" + std::to_string(t) + "]: " + what);
    };
    for (int64_t t = 0; t < tk.num_tokens; t++) {
        const int64_t row = tk.token_row[t], b = tk.token_request[t], p = tk.token_position[t];
        if (row < 0 || row >= q_rows)
            return bad(t, "row " + std::to_string(row) + " outside q's rows 0.." + std::to_string(q_rows - 1));
        if (tk.kind == DSV4_CSA && row >= tk.topk_rows)
            return bad(t, "row " + std::to_string(row) + " outside topk's " + std::to_string(tk.topk_rows) + " rows");
        if (p < 0 || p >= DSV4_MAX_POSITION)
            return bad(t, "position " + std::to_string(p) + " outside 0.." + std::to_string(DSV4_MAX_POSITION - 1));
        if (b < 0) return bad(t, "request " + std::to_string(b) + " < 0");
        if (tk.token_window_start && (tk.token_window_start[t] < 0 || tk.token_window_start[t] > p))
            return bad(t, "window start " + std::to_string(tk.token_window_start[t]) + " outside 0.." + std::to_string(p) +
                              " (its position)");
        const int64_t raw_cap = capacity(raw, b);
        if (raw_cap < 0) return bad(t, "request " + std::to_string(b) + " has no row in raw's table (" + std::to_string(raw.table_rows) + " rows)");
        if (p >= raw_cap)
            return bad(t, "position " + std::to_string(p) + " of request " + std::to_string(b) +
                              " is past what raw addresses (" + std::to_string(raw_cap) + " entries)");
        if (comp) {
            const int64_t cap = capacity(*comp, b), vis = (p + 1) / tk.compress_ratio;
            if (cap < 0) return bad(t, "request " + std::to_string(b) + " has no row in comp's table (" + std::to_string(comp->table_rows) + " rows)");
            if (vis > cap)
                return bad(t, "position " + std::to_string(p) + " of request " + std::to_string(b) + " sees " +
                                  std::to_string(vis) + " compressed entries, comp addresses " + std::to_string(cap));
        }
    }
    return DSV4_OK;
}

// ---------------------------------------------------------------- prefill tiles

struct Tile {
    int64_t t0, t1;  // plan tokens t0 .. t1 - 1: one request, consecutive positions
};

constexpr int64_t TILE_TOKENS = 16;

std::vector<Tile> make_tiles(const dsv4_prefill_tokens &tk) {
    std::vector<Tile> tiles;
    int64_t t = 0, T = tk.num_tokens;
    while (t < T) {
        int64_t e = t + 1;
        while (e < T && e - t < TILE_TOKENS && tk.token_request[e] == tk.token_request[t] &&
               (int64_t)tk.token_position[e] == (int64_t)tk.token_position[e - 1] + 1 &&
               (!tk.token_window_start || tk.token_window_start[e] == tk.token_window_start[t]))
            e++;
        tiles.push_back({t, e});
        t = e;
    }
    return tiles;
}

// The first window position of token t at position p: max(0, p - W + 1, its window start).
inline int64_t window_lo(const dsv4_prefill_tokens &tk, int64_t t, int64_t p) {
    const int64_t lo = std::max<int64_t>(0, p - (int64_t)tk.window + 1);
    return tk.token_window_start ? std::max<int64_t>(lo, tk.token_window_start[t]) : lo;
}

inline int64_t topk_at(const dsv4_prefill_tokens &tk, int64_t row, int64_t j) {
    int64_t i = row * tk.topk_stride + j;
    return tk.topk_int64 ? static_cast<const int64_t *>(tk.topk)[i] : static_cast<const int32_t *>(tk.topk)[i];
}

// The compressed entries token t reads, in order (CSA: its used top-k entries; HCA: 0 .. vis-1).
template <class F>
void for_compressed(const dsv4_prefill_tokens &tk, int64_t t, F &&f) {
    if (tk.kind == 0) return;
    const int64_t p = tk.token_position[t];
    const int64_t vis = (p + 1) / tk.compress_ratio;
    if (tk.kind == 2) {
        for (int64_t e = 0; e < vis; e++) f(e);
        return;
    }
    const int64_t used = std::min<int64_t>(vis, tk.topk_width);
    const int64_t row = tk.token_row[t];
    for (int64_t j = 0; j < used; j++) {
        int64_t e = topk_at(tk, row, j);
        if (e >= 0 && e < vis) f(e);
    }
}

// One thread's staging of fp8_ds_mla rows for a tile: decoded rows (bf16 bits, or float32 for
// float32 q) and, per compressed entry, its staging row (generation-stamped, so it is never
// cleared).
struct Staging {
    std::vector<int32_t> slot;
    std::vector<uint32_t> stamp;
    std::vector<int64_t> entries;  // this tile's compressed entries, in staging order
    std::vector<int64_t> mine;     // private mode: one token's compressed entries
    uint32_t generation = 0;
    void reset(int64_t entries) {
        if ((int64_t)slot.size() < entries) {
            slot.resize(entries);
            stamp.resize(entries, 0);
        }
        if (++generation == 0) {
            std::fill(stamp.begin(), stamp.end(), 0u);
            generation = 1;
        }
    }
};
thread_local Staging t_staging;

void decode_to(const uint8_t *d, const uint8_t *sc, void *dst, int32_t dtype, RowDecodeFn fast) {
    if (dtype == DSV4_BF16) {
        if (!fast || !fast(d, sc, static_cast<uint16_t *>(dst))) dsv4_decode_row_bf16(d, sc, static_cast<uint16_t *>(dst));
        return;
    }
    alignas(64) uint16_t t[512];
    if (!fast || !fast(d, sc, t)) dsv4_decode_row_bf16(d, sc, t);
    uint32_t *o = static_cast<uint32_t *>(dst);
    for (int i = 0; i < 512; i++) o[i] = (uint32_t)t[i] << 16;
}

}  // namespace
}  // namespace dsv4

using namespace dsv4;

extern "C" {

int dsv4_sparse_attention(const void *q, int64_t q_s0, int64_t q_s1, int32_t dtype, int64_t T, int64_t H, int64_t D,
                          const void *kv, int64_t kv_s0, int64_t S, const int32_t *indices, int64_t idx_s0, int64_t K,
                          const int32_t *topk_length, float sm_scale, const float *attn_sink,
                          const dsv4_outputs *outputs, const dsv4_parallel *par, int32_t isa) {
    return guarded([&]() -> int {
        if (int rc = check_common(q, dtype, H, D, par)) return rc;
        if (int rc = check_outputs(outputs, T)) return rc;
        if (T < 0 || K < 0 || S < 0)
            return fail(DSV4_ERR_ARG, "T, K, S: expected >= 0, got " + std::to_string(T) + ", " + std::to_string(K) + ", " +
                                          std::to_string(S));
        if (T > 0 && K > 0 && !indices) return fail(DSV4_ERR_ARG, "indices: NULL");
        if (T > 0 && K > 0 && idx_s0 < K && T > 1)
            return fail(DSV4_ERR_ARG, "idx_s0: " + std::to_string(idx_s0) + " < K = " + std::to_string(K));
        if (S > 0 && !kv) return fail(DSV4_ERR_ARG, "kv: NULL");
        ParallelScope scope(par);
        const int64_t dv = value_dim(D);
        TokenFn fn;
        if (int rc = choose(isa, dtype, D, dv, &fn)) return rc;
        const size_t esize = dtype == DSV4_BF16 ? 2 : 4;
        Rows rows(dtype, D);
        const CallArgs call{q, q_s0, q_s1, H, D, dv, esize, sm_scale, attn_sink, *outputs, rows.zero.data()};
        // tiles of a few tokens: enough items to balance threads, few enough to stay cheap
        const int threads = threads_for(2.0 * (double)T * (double)K * (double)H * (double)(D + dv));
        const int64_t per = std::max<int64_t>(1, std::min<int64_t>(8, T / (8 * (int64_t)threads)));
        const int64_t items = (T + per - 1) / per;
        parallel_items(items, threads, [&](int64_t it) {
            Scratch &sc = t_scratch;
            const void **keys = sc.misc.as<const void *>(K > 0 ? K : 1);
            for (int64_t t = it * per; t < std::min(T, (it + 1) * per); t++) {
                int64_t lim = K;
                if (topk_length) lim = std::max<int64_t>(0, std::min<int64_t>(K, topk_length[t]));
                int64_t n = 0;
                const int32_t *row = indices + t * idx_s0;
                for (int64_t c = 0; c < lim; c++) {
                    int32_t i = row[c];
                    if (i >= 0 && i < S) keys[n++] = static_cast<const char *>(kv) + (int64_t)i * kv_s0 * (int64_t)esize;
                }
                run_token(fn, sc, call, t, keys, n);
            }
        });
        return DSV4_OK;
    });
}

int dsv4_prefill_attention(const void *q, int64_t q_s0, int64_t q_s1, int32_t dtype, int64_t q_rows, int64_t H,
                           int64_t D, const dsv4_prefill_tokens *tokens, const dsv4_kv_source *raw,
                           const dsv4_kv_source *comp, float sm_scale, const float *attn_sink,
                           const dsv4_outputs *outputs, const dsv4_parallel *par, int32_t isa) {
    return guarded([&]() -> int {
        if (int rc = check_common(q, dtype, H, D, par)) return rc;
        if (!tokens) return fail(DSV4_ERR_ARG, "tokens: NULL");
        const dsv4_prefill_tokens tk = *tokens;
        if (q_rows < 0) return fail(DSV4_ERR_ARG, "q_rows: expected >= 0, got " + std::to_string(q_rows));
        if (tk.kind < 0 || tk.kind > 2)
            return fail(DSV4_ERR_ARG, "kind: expected 0 (SWA), 1 (CSA) or 2 (HCA), got " + std::to_string(tk.kind));
        if (tk.window < 1) return fail(DSV4_ERR_ARG, "window: expected >= 1, got " + std::to_string(tk.window));
        if (tk.kind != 0 && tk.compress_ratio < 1)
            return fail(DSV4_ERR_ARG, "compress_ratio: expected >= 1, got " + std::to_string(tk.compress_ratio));
        if (tk.num_tokens < 0) return fail(DSV4_ERR_ARG, "num_tokens: expected >= 0");
        if (tk.num_tokens > 0 && (!tk.token_row || !tk.token_request || !tk.token_position))
            return fail(DSV4_ERR_ARG, "token_row / token_request / token_position: NULL");
        if (tk.kind == DSV4_CSA) {
            if (tk.topk_width < 0 || tk.topk_rows < 0)
                return fail(DSV4_ERR_ARG, "topk_width / topk_rows: expected >= 0");
            if (tk.num_tokens > 0 && tk.topk_width > 0 && !tk.topk) return fail(DSV4_ERR_ARG, "topk: NULL for a CSA layer");
            if (tk.topk_rows > 1 && tk.topk_stride < tk.topk_width)
                return fail(DSV4_ERR_ARG, "topk_stride: " + std::to_string(tk.topk_stride) + " < topk_width " +
                                              std::to_string(tk.topk_width));
        }
        if (int rc = check_outputs(outputs, tk.num_tokens)) return rc;
        if (int rc = check_source(raw, "raw", dtype, D)) return rc;
        if (tk.kind != DSV4_SWA)
            if (int rc = check_source(comp, "comp", dtype, D)) return rc;
        if (int rc = check_tokens(tk, q_rows, *raw, tk.kind != DSV4_SWA ? comp : nullptr)) return rc;
        ParallelScope scope(par);
        const int64_t dv = value_dim(D);
        TokenFn fn;
        if (int rc = choose(isa, dtype, D, dv, &fn)) return rc;
        const RowDecodeFn fast = row_decoder(isa_ceiling(isa));
        const size_t esize = dtype == DSV4_BF16 ? 2 : 4;
        const int64_t row_bytes = D * (int64_t)esize;
        Rows rows(dtype, D);
        const CallArgs call{q, q_s0, q_s1, H, D, dv, esize, sm_scale, attn_sink, *outputs, rows.zero.data()};
        const std::vector<Tile> tiles = make_tiles(tk);
        int threads;
        {  // the call's work: each token's keys (window, then compressed part) x heads x (D + d_v)
            double keys = 0;
            for (int64_t t = 0; t < tk.num_tokens; t++) {
                const int64_t p = tk.token_position[t];
                keys += (double)std::min<int64_t>(tk.window, std::max<int64_t>(p + 1, 0));
                if (tk.kind == 1)
                    keys += (double)std::min<int64_t>(tk.topk_width, std::max<int64_t>((p + 1) / tk.compress_ratio, 0));
                else if (tk.kind == 2)
                    keys += (double)std::max<int64_t>((p + 1) / tk.compress_ratio, 0);
            }
            threads = threads_for(2.0 * keys * (double)H * (double)(D + dv));
        }
        const bool raw_fp8 = raw->format != DSV4_ROWS, comp_fp8 = tk.kind != 0 && comp->format != DSV4_ROWS;  // byte pages
        parallel_items((int64_t)tiles.size(), threads, [&](int64_t it) {
            Scratch &sc = t_scratch;
            const Tile tile = tiles[it];
            const int64_t b = tk.token_request[tile.t0];
            const int64_t p_first = tk.token_position[tile.t0], p_last = tk.token_position[tile.t1 - 1];
            const int64_t w_lo = window_lo(tk, tile.t0, p_first);  // a tile shares one window start
            // staging: the tile's window rows, then the compressed entries its tokens read: their
            // union (shared mode), or, when the tokens share few entries (the union is more than
            // half of what they read in all), each token's own entries in turn, in a region reused
            // by the next token (private mode: a few hundred rows, which stay in L2).
            const int64_t n_win = raw_fp8 ? p_last - w_lo + 1 : 0;
            const int64_t vis_last = tk.kind != 0 ? (p_last + 1) / tk.compress_ratio : 0;
            Staging &st = t_staging;
            std::vector<int64_t> &entries = st.entries;
            entries.clear();
            int64_t reads = 0, most = 0;  // compressed reads of the tile's tokens; the most of one token
            if (comp_fp8) {
                st.reset(std::max<int64_t>(vis_last, 1));
                for (int64_t t = tile.t0; t < tile.t1; t++) {
                    int64_t mine = 0;
                    for_compressed(tk, t, [&](int64_t e) {
                        mine++;
                        if (st.stamp[e] != st.generation) {
                            st.stamp[e] = st.generation;
                            st.slot[e] = (int32_t)(n_win + (int64_t)entries.size());
                            entries.push_back(e);
                        }
                    });
                    reads += mine;
                    most = std::max(most, mine);
                }
            }
            const bool shared = tile.t1 - tile.t0 == 1 || 2 * (int64_t)entries.size() <= reads;
            const int64_t n_stage = n_win + (shared ? (int64_t)entries.size() : most);
            char *stage = n_stage ? static_cast<char *>(sc.stage.get((size_t)(n_stage * row_bytes))) : nullptr;
            auto address = [&](const dsv4_kv_source &src, int64_t e, const uint8_t **d, const uint8_t **s) {
                return src.format == DSV4_FP8_DS_MLA ? fp8_address(src, b, e, d, s) : dsv4_mxfp8_address(&src, b, e, d, s) != 0;
            };
            auto decode_row = [&](const dsv4_kv_source &src, int64_t e, int64_t i) {
                const uint8_t *d, *s;
                if (!address(src, e, &d, &s)) std::memcpy(stage + i * row_bytes, rows.nan.data(), row_bytes);
                else if (src.format == DSV4_FP8_DS_MLA) decode_to(d, s, stage + i * row_bytes, dtype, fast);
                else dsv4_decode_mxfp8_to(d, s, stage + i * row_bytes, dtype == DSV4_F32);  // V4.1 records (kvcache_v41.c)
            };
            auto prefetch_row = [&](const dsv4_kv_source &src, int64_t e) {  // pages are scattered
                const uint8_t *d, *s;
                if (!address(src, e, &d, &s)) return;
                for (int l = 0; l < 576; l += 64) __builtin_prefetch(d + l, 0, 3);
                __builtin_prefetch(s, 0, 3);
            };
            constexpr int64_t AHEAD = 8;
            for (int64_t i = 0; i < n_win; i++) {
                if (i + AHEAD < n_win) prefetch_row(*raw, w_lo + i + AHEAD);
                decode_row(*raw, w_lo + i, i);
            }
            if (shared)
                for (int64_t i = 0; i < (int64_t)entries.size(); i++) {
                    if (i + AHEAD < (int64_t)entries.size()) prefetch_row(*comp, entries[i + AHEAD]);
                    decode_row(*comp, entries[i], n_win + i);
                }
            for (int64_t t = tile.t0; t < tile.t1; t++) {
                const int64_t p = tk.token_position[t];
                int64_t cap = (tk.kind == 2 ? (p + 1) / tk.compress_ratio
                               : tk.kind == 1 ? std::min<int64_t>((p + 1) / tk.compress_ratio, tk.topk_width)
                                              : 0) +
                              (p - window_lo(tk, t, p) + 1);
                const void **keys = sc.misc.as<const void *>(std::max<int64_t>(cap, 1));
                int64_t n = 0;
                if (comp_fp8 && !shared) {  // private mode: this token's entries, decoded now
                    std::vector<int64_t> &mine = st.mine;
                    mine.clear();
                    for_compressed(tk, t, [&](int64_t e) { mine.push_back(e); });
                    for (int64_t i = 0; i < (int64_t)mine.size(); i++) {
                        if (i + AHEAD < (int64_t)mine.size()) prefetch_row(*comp, mine[i + AHEAD]);
                        decode_row(*comp, mine[i], n_win + i);
                        keys[n++] = stage + (n_win + i) * row_bytes;
                    }
                } else {
                    for_compressed(tk, t, [&](int64_t e) {
                        const void *r = comp_fp8 ? stage + (int64_t)st.slot[e] * row_bytes : row_address(*comp, b, e, esize);
                        keys[n++] = r ? r : rows.nan.data();
                    });
                }
                for (int64_t pos = window_lo(tk, t, p); pos <= p; pos++) {
                    const void *r = raw_fp8 ? stage + (pos - w_lo) * row_bytes : row_address(*raw, b, pos, esize);
                    keys[n++] = r ? r : rows.nan.data();
                }
                run_token(fn, sc, call, tk.token_row[t], keys, n);
            }
        });
        return DSV4_OK;
    });
}

}  // extern "C"
