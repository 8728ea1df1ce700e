// The library's runtime: error messages, the instruction-set choice at run time, and parallel
// work on the host framework's threads (or the library's own pool when it runs standalone).
//
// Parallel work (parallel_items): a call's work is a list of items taken one at a time from a
// shared counter. With a fork-join runner (torch's at::parallel_for) every worker it starts takes
// items until none are left. With a task pool (XLA's, or our own), the caller schedules
// threads - 1 tasks and takes items itself; when the items run out it closes the call and waits
// only for the tasks that joined before that: a task that starts later (its thread was busy, e.g.
// behind a framework op still running on that core) finds the call closed and returns at once, so
// a late thread never holds a call up. The call's state is reference-counted for those late tasks.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <pthread.h>

#include "runtime.h"

namespace dsv4 {
namespace {
thread_local std::string g_error;
thread_local const dsv4_parallel *t_par = nullptr;
}  // namespace

int fail(int code, const std::string &msg) {
    g_error = msg;
    return code;
}

// ---------------------------------------------------------------- instruction sets

namespace {

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

}  // namespace

const char *isa_name(int isa) { return (isa >= 0 && isa <= DSV4_ISA_AMX) ? ISA_NAMES[isa] : "unknown"; }

bool runnable(int isa) { return isa >= 0 && isa <= DSV4_ISA_AMX && hw_supported(isa) && built(isa); }

int env_cap() {
    const char *e = std::getenv("DSV4_PREFILL_CPU_ISA");
    if (!e || !*e) return DSV4_ISA_AMX;
    for (int i = 0; i <= DSV4_ISA_AMX; i++)
        if (std::strcmp(e, ISA_NAMES[i]) == 0) return i;
    return -1;  // unknown name: reported by the callers
}

int isa_ceiling(int isa) { return isa >= 0 ? isa : std::min(env_cap(), (int)DSV4_ISA_AMX); }

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

// The bf16 kernel needs D and d_v multiples of 32; other shapes take the fp32 kernel of the next
// set down (same contract).
int choose(int isa, int dtype, int64_t D, int64_t dv, TokenFn *fn) {
    const int cap = env_cap();
    if (cap < 0)
        return fail(DSV4_ERR_ISA, std::string("DSV4_PREFILL_CPU_ISA: unknown instruction set '") +
                                      std::getenv("DSV4_PREFILL_CPU_ISA") +
                                      "' (expected generic, avx2, avx512, avx512bf16 or amx)");
    if (isa > DSV4_ISA_AMX || isa < -1) return fail(DSV4_ERR_ARG, "isa: expected -1 .. 4, got " + std::to_string(isa));
    if (isa >= 0 && !runnable(isa))
        return fail(DSV4_ERR_ISA, std::string("isa: ") + ISA_NAMES[isa] + " cannot run on this machine");
    for (int i = isa_ceiling(isa); i >= 0; i--) {
        if (!runnable(i)) continue;
        if ((*fn = kernel_for(i, dtype, D, dv)) != nullptr) return DSV4_OK;
    }
    return fail(DSV4_ERR_ARG, "no kernel for D=" + std::to_string(D) + ", d_v=" + std::to_string(dv));
}

RowDecodeFn row_decoder(int max_isa) {
#if defined(DSV4_BUILT_AVX512)
    if (max_isa >= DSV4_ISA_AVX512 && hw_supported(DSV4_ISA_AVX512)) return row_decoder_avx512();
#endif
    (void)max_isa;
    return nullptr;
}

// ---------------------------------------------------------------- the library's own pool

namespace {

// A task queue served by detached workers (standalone use only: bindings pass their framework's
// threads). Never destroyed (detached workers outlive static destructors). A forked child
// inherits none of the workers, and possibly a mutex a worker held at the fork: its first use
// after the fork gets a new pool (the parent's is left as it was, unused).
class Pool {
  public:
    void schedule(dsv4_task_fn fn, void *arg, int workers) {
        ensure(workers);
        {
            std::lock_guard<std::mutex> g(mu_);
            tasks_.emplace_back(fn, arg);
        }
        cv_.notify_one();
    }

  private:
    void ensure(int n) {
        std::lock_guard<std::mutex> g(spawn_mu_);
        while (spawned_ < n) {
            std::thread([this] { loop(); }).detach();  // throws std::system_error when it cannot
            spawned_++;
        }
    }

    void loop() {
        for (;;) {
            std::pair<dsv4_task_fn, void *> t;
            {
                std::unique_lock<std::mutex> g(mu_);
                cv_.wait(g, [&] { return !tasks_.empty(); });
                t = tasks_.front();
                tasks_.pop_front();
            }
            t.first(t.second);
        }
    }

    std::mutex mu_, spawn_mu_;
    std::condition_variable cv_;
    std::deque<std::pair<dsv4_task_fn, void *>> tasks_;
    int spawned_ = 0;
};

std::atomic<Pool *> g_pool{nullptr};

void reset_pool_in_child() { g_pool.store(nullptr); }

Pool &own_pool() {
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

// One parallel call's shared state.
struct Call {
    const std::function<void(int64_t)> *item = nullptr;
    int64_t n = 0;
    std::atomic<int64_t> next{0};
    std::atomic<bool> failed{false};
    std::exception_ptr error;
    std::mutex mu;
    std::condition_variable done;
    int active = 0;     // tasks inside work()
    bool open = true;   // false once the caller ran out of items: late tasks return at once
    std::atomic<int> refs{1};

    void work() {
        for (int64_t i; !failed.load(std::memory_order_relaxed) && (i = next.fetch_add(1)) < n;) {
            try {
                (*item)(i);
            } catch (...) {
                std::lock_guard<std::mutex> g(mu);
                if (!failed.exchange(true)) error = std::current_exception();
            }
        }
    }
    void release() {
        if (refs.fetch_sub(1) == 1) delete this;
    }
};

void task_entry(void *arg) {  // a scheduled task: join the call if it is still open
    Call *c = static_cast<Call *>(arg);
    bool joined = false;
    {
        std::lock_guard<std::mutex> g(c->mu);
        if (c->open) {
            c->active++;
            joined = true;
        }
    }
    if (joined) {
        c->work();
        std::lock_guard<std::mutex> g(c->mu);
        if (--c->active == 0 && !c->open) c->done.notify_all();
    }
    c->release();
}

void run_entry(void *arg, int64_t) { static_cast<Call *>(arg)->work(); }

}  // namespace

ParallelScope::ParallelScope(const dsv4_parallel *par) : prev_(t_par) { t_par = par; }
ParallelScope::~ParallelScope() { t_par = prev_; }

int max_threads() { return t_par ? std::max(1, (int)t_par->threads) : 1; }

int check_parallel(const dsv4_parallel *par) {
    if (!par) return DSV4_OK;
    if (par->threads < 1) return fail(DSV4_ERR_ARG, "par.threads: expected >= 1, got " + std::to_string(par->threads));
    if (par->run && par->schedule) return fail(DSV4_ERR_ARG, "par: set run or schedule, not both");
    return DSV4_OK;
}

void parallel_items(int64_t n, int threads, const std::function<void(int64_t)> &item) {
    if (n <= 0) return;
    const dsv4_parallel *par = t_par;
    threads = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)threads, n, (int64_t)max_threads()}));
    if (threads <= 1 || !par) {
        for (int64_t i = 0; i < n; i++) item(i);
        return;
    }
    Call *c = new Call();
    c->item = &item;
    c->n = n;
    if (par->run) {  // fork-join: every worker returns before run does
        par->run(par->ctx, threads, run_entry, c);
    } else {
        int scheduled = 0;
        try {
            for (int k = 1; k < threads; k++) {
                c->refs.fetch_add(1);
                if (par->schedule) par->schedule(par->ctx, task_entry, c);
                else own_pool().schedule(task_entry, c, threads - 1);
                scheduled++;
            }
        } catch (...) {  // no more threads to be had: the tasks already scheduled and this one do it
            c->refs.fetch_sub(1);
        }
        (void)scheduled;
        c->work();
        std::unique_lock<std::mutex> g(c->mu);
        c->open = false;
        c->done.wait(g, [&] { return c->active == 0; });
    }
    std::exception_ptr error = c->error;
    c->release();
    if (error) std::rethrow_exception(error);
}

}  // namespace dsv4

using namespace dsv4;

extern "C" {

int dsv4_cpu_abi(void) { return DSV4_CPU_ABI; }

const char *dsv4_cpu_last_error(void) { return g_error.c_str(); }

const char *dsv4_cpu_isa_name(int32_t isa) { return isa_name(isa); }

int dsv4_cpu_isa_supported(int32_t isa) { return runnable(isa) ? 1 : 0; }

int dsv4_cpu_best_isa(int32_t dtype) {
    const int cap = env_cap();
    if (cap < 0) return -1;
    for (int i = cap; i >= 0; i--)
        if (runnable(i) && kernel_for(i, dtype, 512, 512)) return i;
    return DSV4_ISA_GENERIC;
}

int dsv4_cpu_decode_row(int32_t isa, const uint8_t *d, const uint8_t *sc, uint16_t *o) {
    if (isa < -1 || isa > DSV4_ISA_AMX) return fail(DSV4_ERR_ARG, "isa: expected -1 .. 4, got " + std::to_string(isa));
    if (isa >= 0 && !runnable(isa))
        return fail(DSV4_ERR_ISA, std::string("isa: ") + isa_name(isa) + " cannot run on this machine");
    if (!d || !sc || !o) return fail(DSV4_ERR_ARG, "d, sc, o: NULL");
    RowDecodeFn fast = row_decoder(isa_ceiling(isa));
    if (!fast || !fast(d, sc, o)) dsv4_decode_row_bf16(d, sc, o);
    return DSV4_OK;
}

void dsv4_parallel_for(const dsv4_parallel *par, int64_t n, int64_t grain, void (*fn)(void *, int64_t, int64_t),
                       void *arg) {
    if (n <= 0 || !fn) return;
    const int64_t t = std::max<int64_t>(
        1, std::min<int64_t>(par && par->threads > 0 ? par->threads : 1, n / std::max<int64_t>(grain, 1)));
    if (t <= 1 || check_parallel(par) != DSV4_OK) {
        fn(arg, 0, n);
        return;
    }
    ParallelScope scope(par);
    try {
        parallel_items(t, (int)t, [&](int64_t k) { fn(arg, n * k / t, n * (k + 1) / t); });
    } catch (...) {  // no memory for the call's state: one range on this thread
        fn(arg, 0, n);
    }
}

}  // extern "C"
