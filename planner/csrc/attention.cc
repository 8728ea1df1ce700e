// The CPU sparse-attention backend's entry points (dsv4_cpu.h): instruction-set choice at run
// time, a small thread pool, the generic call on a flat workspace and the fused prefill call
// that reads the caches directly.
//
// Work is split by tokens: a work item is a tile of consecutive tokens, taken by the threads
// from one atomic counter (a thread that is slow, for example because its core is busy with
// another process, takes fewer tiles, and a worker that starts late is not waited for: more
// threads never make a call slower than fewer). A call wakes only as many threads as its work
// (keys x heads x dims) pays for, so small calls (decode steps of a small model) run inline.
// Every token's result depends only on its own keys and their order, never on the tiling or
// the thread that ran it.
//
// Prefill (dsv4_prefill_attention): a tile is up to TILE_TOKENS consecutive tokens of one
// request at consecutive positions. Keys in q's dtype are read in place (row pointers into the
// pages / rows); fp8_ds_mla pages are dequantized once per tile into the thread's staging rows
// (the window rows of the whole tile, and the compressed entries any of its tokens reads), so a
// row shared by the tile's tokens (127 of 128 window rows between neighbours, every HCA entry)
// is decoded once, not once per token.

#include <algorithm>
#include <cmath>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <pthread.h>
#include <unistd.h>

#include "attention_impl.h"
#include "dsv4_cpu.h"

namespace dsv4 {
namespace {

thread_local std::string g_error;

int fail(int code, const std::string &msg) {
    g_error = msg;
    return code;
}

// ---------------------------------------------------------------- instruction sets

bool hw_supported(int isa) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    switch (isa) {
        case DSV4_ISA_GENERIC:
            return true;
        case DSV4_ISA_AVX2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        case DSV4_ISA_AVX512:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
        case DSV4_ISA_AVX512BF16:
#if defined(DSV4_BUILT_AVX512BF16)
            return hw_supported(DSV4_ISA_AVX512) && __builtin_cpu_supports("avx512bf16");
#else
            return false;
#endif
        default:
            return false;  // AMX: no kernel yet
    }
#else
    return isa == DSV4_ISA_GENERIC;
#endif
}

bool built(int isa) {
    switch (isa) {
        case DSV4_ISA_GENERIC:
            return true;
#if defined(DSV4_BUILT_AVX2)
        case DSV4_ISA_AVX2:
            return true;
#endif
#if defined(DSV4_BUILT_AVX512)
        case DSV4_ISA_AVX512:
            return true;
#endif
#if defined(DSV4_BUILT_AVX512BF16)
        case DSV4_ISA_AVX512BF16:
            return true;
#endif
        default:
            return false;
    }
}

const char *const ISA_NAMES[] = {"generic", "avx2", "avx512", "avx512bf16", "amx"};

int env_cap() {
    const char *e = std::getenv("DSV4_PREFILL_CPU_ISA");
    if (!e || !*e) return DSV4_ISA_AMX;
    for (int i = 0; i <= DSV4_ISA_AMX; i++)
        if (std::strcmp(e, ISA_NAMES[i]) == 0) return i;
    return -1;  // unknown name: reported by dsv4_cpu_best_isa's callers
}

TokenFn kernel_for(int isa, int dtype, int64_t D, int64_t dv) {
    switch (isa) {
#if defined(DSV4_BUILT_AVX512BF16)
        case DSV4_ISA_AVX512BF16:
            return token_kernel_avx512bf16(dtype, D, dv);
#endif
#if defined(DSV4_BUILT_AVX512)
        case DSV4_ISA_AVX512:
            return token_kernel_avx512(dtype, D, dv);
#endif
#if defined(DSV4_BUILT_AVX2)
        case DSV4_ISA_AVX2:
            return token_kernel_avx2(dtype, D, dv);
#endif
        case DSV4_ISA_GENERIC:
            return token_kernel_generic(dtype, D, dv);
        default:
            return nullptr;
    }
}

// The kernel for a call: `isa` (-1: best allowed) or the highest set below it that has a kernel
// for this dtype and shape (the bf16 kernel needs D and d_v multiples of 32; other shapes take
// the fp32 kernel of the next set down, same contract).
int choose(int isa, int dtype, int64_t D, int64_t dv, TokenFn *fn) {
    int cap = env_cap();
    if (cap < 0) return fail(DSV4_ERR_ISA, std::string("DSV4_PREFILL_CPU_ISA: unknown instruction set '") +
                                               std::getenv("DSV4_PREFILL_CPU_ISA") +
                                               "' (expected generic, avx2, avx512, avx512bf16 or amx)");
    if (isa > DSV4_ISA_AMX || isa < -1) return fail(DSV4_ERR_ARG, "isa: expected -1 .. 4, got " + std::to_string(isa));
    if (isa >= 0 && !(hw_supported(isa) && built(isa)))
        return fail(DSV4_ERR_ISA, std::string("isa: ") + ISA_NAMES[isa] + " cannot run on this machine");
    int top = isa >= 0 ? isa : std::min(cap, (int)DSV4_ISA_AMX);
    for (int i = top; i >= 0; i--) {
        if (!(hw_supported(i) && built(i))) continue;
        if ((*fn = kernel_for(i, dtype, D, dv)) != nullptr) return DSV4_OK;
    }
    return fail(DSV4_ERR_ARG, "no kernel for D=" + std::to_string(D) + ", d_v=" + std::to_string(dv));
}

// ---------------------------------------------------------------- thread pool

// Workers sleep on a condition variable between calls; a call hands them `job(thread_id)` and
// runs thread 0 itself. Work items are taken dynamically, so the caller never waits for a worker
// that has not started: when the caller is done with the items it closes the call, waits only
// for the workers that joined, and a worker that wakes later finds the call closed and sleeps
// again. (On a busy machine, e.g. with OpenMP threads still spinning on the other cores after a
// torch op, a late worker would otherwise hold the call up for a scheduler time slice.) One
// call at a time uses the pool; a call that finds it busy (another framework thread in a call)
// runs on its own thread only.
class Pool {
  public:
    void run(int threads, const std::function<void(int)> &job) {
        if (threads <= 1) {
            job(0);
            return;
        }
        std::unique_lock<std::mutex> busy(call_mu_, std::try_to_lock);
        if (!busy.owns_lock() || !ensure(threads - 1)) {
            job(0);
            return;
        }
        {
            std::lock_guard<std::mutex> g(mu_);
            job_ = &job;
            wanted_ = threads - 1;
            open_ = true;
            active_ = 0;
            generation_++;
        }
        cv_.notify_all();
        job(0);
        std::unique_lock<std::mutex> g(mu_);
        open_ = false;  // no worker joins from now on
        done_cv_.wait(g, [&] { return active_ == 0; });
        job_ = nullptr;
    }

  private:
    bool ensure(int n) {
        try {
            while ((int)workers_.size() < n) {
                int id = (int)workers_.size() + 1;
                std::thread t([this, id] { loop(id); });
                t.detach();
                workers_.push_back(id);
            }
        } catch (...) {
            return false;
        }
        return true;
    }

    void loop(int id) {
        uint64_t seen = 0;
        for (;;) {
            const std::function<void(int)> *job;
            {
                std::unique_lock<std::mutex> g(mu_);
                cv_.wait(g, [&] { return generation_ != seen; });
                seen = generation_;
                if (id > wanted_ || !open_) continue;  // not wanted, or the call is over already
                job = job_;
                active_++;
            }
            (*job)(id);
            std::lock_guard<std::mutex> g(mu_);
            if (--active_ == 0 && !open_) done_cv_.notify_one();
        }
    }

    std::mutex call_mu_, mu_;
    std::condition_variable cv_, done_cv_;
    const std::function<void(int)> *job_ = nullptr;
    std::vector<int> workers_;
    uint64_t generation_ = 0;
    int wanted_ = 0, active_ = 0;
    bool open_ = false;
};

// The process's pool. Never destroyed (detached workers outlive static destructors). A forked
// child inherits none of the workers, and possibly a mutex a worker held at the fork: its first
// use after the fork gets a new pool (the parent's is left as it was, unused).
std::atomic<Pool *> g_pool{nullptr};

void reset_pool_in_child() { g_pool.store(nullptr); }

Pool &pool() {
    Pool *p = g_pool.load();
    if (p) return *p;
    static std::once_flag registered;
    std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, reset_pool_in_child); });
    Pool *fresh = new Pool();
    if (!g_pool.compare_exchange_strong(p, fresh)) {
        delete fresh;  // another thread installed one first
        return *p;
    }
    return *fresh;
}

// Run work items 0 .. n-1 on up to `threads` threads; the first exception is rethrown.
void parallel_items(int64_t n, int threads, const std::function<void(int64_t)> &item) {
    if (n <= 0) return;
    threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, n));
    std::atomic<int64_t> next{0};
    std::atomic<bool> failed{false};
    std::exception_ptr error;
    std::mutex error_mu;
    pool().run(threads, [&](int) {
        for (int64_t i; !failed.load(std::memory_order_relaxed) && (i = next.fetch_add(1)) < n;) {
            try {
                item(i);
            } catch (...) {
                std::lock_guard<std::mutex> g(error_mu);
                if (!failed.exchange(true)) error = std::current_exception();
            }
        }
    });
    if (error) std::rethrow_exception(error);
}

// Threads worth waking for `flops` of work: a thread gets at least GRAIN_FLOPS (about 10-20 us
// on one core), so a small call (a decode step of a small model) runs on the caller's thread
// instead of paying a wake-up per worker.
constexpr double GRAIN_FLOPS = 4e6;

int threads_for(double flops, int threads) {
    return (int)std::max<double>(1.0, std::min<double>((double)threads, std::ceil(flops / GRAIN_FLOPS)));
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

int check_common(const void *q, int32_t dtype, int64_t H, int64_t D, int32_t threads) {
    if (dtype != DSV4_BF16 && dtype != DSV4_F32) return fail(DSV4_ERR_ARG, "dtype: expected 0 (bf16) or 1 (float32)");
    if (H < 1) return fail(DSV4_ERR_ARG, "H: expected >= 1, got " + std::to_string(H));
    if (D < 1) return fail(DSV4_ERR_ARG, "D: expected >= 1, got " + std::to_string(D));
    if (threads < 1) return fail(DSV4_ERR_ARG, "threads: expected >= 1, got " + std::to_string(threads));
    (void)q;
    return DSV4_OK;
}

template <class F>
int guarded(F &&f) {
    try {
        return f();
    } catch (const std::bad_alloc &) {
        return fail(DSV4_ERR_MEMORY, "out of memory");
    } catch (const std::exception &e) {
        return fail(DSV4_ERR_ARG, e.what());
    }
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
    if (!s) return fail(DSV4_ERR_ARG, std::string(name) + ": NULL");
    if (s->format == 1) {
        if (D != 512) return fail(DSV4_ERR_ARG, std::string(name) + ": fp8_ds_mla rows have D = 512, q has " + std::to_string(D));
        if (s->page_size <= 0 || !s->table)
            return fail(DSV4_ERR_ARG, std::string(name) + ": fp8_ds_mla pages need page_size > 0 and a block table");
        if (s->page_stride < s->page_size * 584)
            return fail(DSV4_ERR_ARG, std::string(name) + ": page_stride " + std::to_string(s->page_stride) + " < page_size * 584");
        return DSV4_OK;
    }
    if (s->format != 0) return fail(DSV4_ERR_ARG, std::string(name) + ": format must be 0 (rows) or 1 (fp8_ds_mla)");
    if (s->dtype != dtype) return fail(DSV4_ERR_ARG, std::string(name) + ": rows must hold q's dtype");
    if (s->page_size > 0 && !s->table) return fail(DSV4_ERR_ARG, std::string(name) + ": paged rows need a block table");
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
               tk.token_position[e] == tk.token_position[e - 1] + 1)
            e++;
        tiles.push_back({t, e});
        t = e;
    }
    return tiles;
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

// The fastest bit-exact slot decoder among the instruction sets the call may use (max_isa).
RowDecodeFn row_decoder(int max_isa) {
#if defined(DSV4_BUILT_AVX512)
    if (max_isa >= DSV4_ISA_AVX512 && hw_supported(DSV4_ISA_AVX512)) return row_decoder_avx512();
#endif
    (void)max_isa;
    return nullptr;
}

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

const char *dsv4_cpu_last_error(void) { return g_error.c_str(); }

const char *dsv4_cpu_isa_name(int32_t isa) { return (isa >= 0 && isa <= DSV4_ISA_AMX) ? ISA_NAMES[isa] : "unknown"; }

int dsv4_cpu_isa_supported(int32_t isa) { return (isa >= 0 && isa <= DSV4_ISA_AMX && hw_supported(isa) && built(isa)) ? 1 : 0; }

int dsv4_cpu_best_isa(int32_t dtype) {
    int cap = env_cap();
    if (cap < 0) return -1;
    for (int i = cap; i >= 0; i--)
        if (hw_supported(i) && built(i) && kernel_for(i, dtype, 512, 512)) return i;
    return DSV4_ISA_GENERIC;
}

int dsv4_cpu_decode_row(int32_t isa, const uint8_t *d, const uint8_t *sc, uint16_t *o) {
    if (isa < -1 || isa > DSV4_ISA_AMX) return fail(DSV4_ERR_ARG, "isa: expected -1 .. 4, got " + std::to_string(isa));
    if (isa >= 0 && !(hw_supported(isa) && built(isa)))
        return fail(DSV4_ERR_ISA, std::string("isa: ") + ISA_NAMES[isa] + " cannot run on this machine");
    decode_to(d, sc, o, DSV4_BF16, row_decoder(isa >= 0 ? isa : std::min(env_cap(), (int)DSV4_ISA_AMX)));
    return DSV4_OK;
}

int dsv4_sparse_attention(const void *q, int64_t q_s0, int64_t q_s1, int32_t dtype, int64_t T, int64_t H, int64_t D,
                          const void *kv, int64_t kv_s0, int64_t S, const int32_t *indices, int64_t idx_s0, int64_t K,
                          const int32_t *topk_length, float sm_scale, const float *attn_sink,
                          const dsv4_outputs *outputs, int32_t threads, int32_t isa) {
    return guarded([&]() -> int {
        if (int rc = check_common(q, dtype, H, D, threads)) return rc;
        if (int rc = check_outputs(outputs, T)) return rc;
        if (T < 0 || K < 0 || S < 0) return fail(DSV4_ERR_ARG, "T, K, S: expected >= 0");
        if (T > 0 && K > 0 && !indices) return fail(DSV4_ERR_ARG, "indices: NULL");
        const int64_t dv = value_dim(D);
        TokenFn fn;
        if (int rc = choose(isa, dtype, D, dv, &fn)) return rc;
        const size_t esize = dtype == DSV4_BF16 ? 2 : 4;
        Rows rows(dtype, D);
        const CallArgs call{q, q_s0, q_s1, H, D, dv, esize, sm_scale, attn_sink, *outputs, rows.zero.data()};
        // tiles of a few tokens: enough items to balance threads, few enough to stay cheap
        threads = threads_for(2.0 * (double)T * (double)K * (double)H * (double)(D + dv), threads);
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

int dsv4_prefill_attention(const void *q, int64_t q_s0, int64_t q_s1, int32_t dtype, int64_t H, int64_t D,
                           const dsv4_prefill_tokens *tokens, const dsv4_kv_source *raw, const dsv4_kv_source *comp,
                           float sm_scale, const float *attn_sink, const dsv4_outputs *outputs, int32_t threads,
                           int32_t isa) {
    return guarded([&]() -> int {
        if (int rc = check_common(q, dtype, H, D, threads)) return rc;
        if (!tokens) return fail(DSV4_ERR_ARG, "tokens: NULL");
        const dsv4_prefill_tokens tk = *tokens;
        if (tk.kind < 0 || tk.kind > 2) return fail(DSV4_ERR_ARG, "kind: expected 0 (SWA), 1 (CSA) or 2 (HCA)");
        if (tk.window < 1) return fail(DSV4_ERR_ARG, "window: expected >= 1, got " + std::to_string(tk.window));
        if (tk.kind != 0 && tk.compress_ratio < 1)
            return fail(DSV4_ERR_ARG, "compress_ratio: expected >= 1, got " + std::to_string(tk.compress_ratio));
        if (tk.num_tokens < 0) return fail(DSV4_ERR_ARG, "num_tokens: expected >= 0");
        if (tk.num_tokens > 0 && (!tk.token_row || !tk.token_request || !tk.token_position))
            return fail(DSV4_ERR_ARG, "token_row / token_request / token_position: NULL");
        if (tk.kind == 1 && tk.num_tokens > 0 && tk.topk_width > 0 && !tk.topk) return fail(DSV4_ERR_ARG, "topk: NULL for a CSA layer");
        if (int rc = check_outputs(outputs, tk.num_tokens)) return rc;
        if (int rc = check_source(raw, "raw", dtype, D)) return rc;
        if (tk.kind != 0)
            if (int rc = check_source(comp, "comp", dtype, D)) return rc;
        const int64_t dv = value_dim(D);
        TokenFn fn;
        if (int rc = choose(isa, dtype, D, dv, &fn)) return rc;
        const RowDecodeFn fast = row_decoder(isa >= 0 ? isa : std::min(env_cap(), (int)DSV4_ISA_AMX));
        const size_t esize = dtype == DSV4_BF16 ? 2 : 4;
        const int64_t row_bytes = D * (int64_t)esize;
        Rows rows(dtype, D);
        const CallArgs call{q, q_s0, q_s1, H, D, dv, esize, sm_scale, attn_sink, *outputs, rows.zero.data()};
        const std::vector<Tile> tiles = make_tiles(tk);
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
            threads = threads_for(2.0 * keys * (double)H * (double)(D + dv), threads);
        }
        const int64_t W = tk.window;
        const bool raw_fp8 = raw->format == 1, comp_fp8 = tk.kind != 0 && comp->format == 1;
        parallel_items((int64_t)tiles.size(), threads, [&](int64_t it) {
            Scratch &sc = t_scratch;
            const Tile tile = tiles[it];
            const int64_t b = tk.token_request[tile.t0];
            const int64_t p_first = tk.token_position[tile.t0], p_last = tk.token_position[tile.t1 - 1];
            const int64_t w_lo = std::max<int64_t>(0, p_first - W + 1);
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
            auto decode_row = [&](const dsv4_kv_source &src, int64_t e, int64_t i) {
                const uint8_t *d, *s;
                if (fp8_address(src, b, e, &d, &s)) decode_to(d, s, stage + i * row_bytes, dtype, fast);
                else std::memcpy(stage + i * row_bytes, rows.nan.data(), row_bytes);
            };
            auto prefetch_row = [&](const dsv4_kv_source &src, int64_t e) {  // pages are scattered
                const uint8_t *d, *s;
                if (!fp8_address(src, b, e, &d, &s)) return;
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
                              std::min<int64_t>(p + 1, W);
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
                for (int64_t pos = std::max<int64_t>(0, p - W + 1); pos <= p; pos++) {
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
