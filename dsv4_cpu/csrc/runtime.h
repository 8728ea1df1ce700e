// Internals shared by the library's entry points (attention.cc, gather.cc, runtime.cc): error
// reporting, the instruction-set choice and the parallel loop over work items.
#pragma once

#include <cstdint>
#include <functional>
#include <new>
#include <stdexcept>
#include <string>

#include "attention_impl.h"
#include "dsv4_cpu.h"

namespace dsv4 {

// ---------------------------------------------------------------- errors

// Record `msg` as this thread's last error (dsv4_cpu_last_error) and return `code`.
int fail(int code, const std::string &msg);

// f() with allocation failures and exceptions turned into return codes.
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

// ---------------------------------------------------------------- instruction sets

const char *isa_name(int isa);
// The cap set by DSV4_PREFILL_CPU_ISA (DSV4_ISA_AMX when unset; -1 for an unknown name).
int env_cap();
bool runnable(int isa);  // built into this library and supported by this CPU
// The token kernel of a call: `isa` (-1: the best allowed), or the highest set below it with a
// kernel for this dtype and shape. Returns DSV4_OK or an error code (message recorded).
int choose(int isa, int dtype, int64_t D, int64_t dv, TokenFn *fn);
TokenFn kernel_for(int isa, int dtype, int64_t D, int64_t dv);
// The fastest bit-exact fp8_ds_mla slot decoder among the sets up to max_isa (nullptr: the C one).
RowDecodeFn row_decoder(int max_isa);
// The highest set a call may use (the cap, or `isa` itself when named).
int isa_ceiling(int isa);

// ---------------------------------------------------------------- parallel work

// The calling entry point's dsv4_parallel for the duration of its call (thread-local).
class ParallelScope {
  public:
    explicit ParallelScope(const dsv4_parallel *par);
    ~ParallelScope();
    ParallelScope(const ParallelScope &) = delete;
    ParallelScope &operator=(const ParallelScope &) = delete;

  private:
    const dsv4_parallel *prev_;
};

// Threads the current call may use (its dsv4_parallel's `threads`; 1 without one).
int max_threads();

// Check a dsv4_parallel argument (NULL is fine).
int check_parallel(const dsv4_parallel *par);

// Run work items 0 .. n-1 on up to `threads` threads (capped by max_threads()), taken one at a
// time from a shared counter, so a slow or late thread takes fewer; the first exception an item
// throws is rethrown here after every running item has finished.
void parallel_items(int64_t n, int threads, const std::function<void(int64_t)> &item);

}  // namespace dsv4
