// torch's intra-op threads for the kernels: a dsv4_parallel `run` function (dsv4_cpu.h) that runs
// the work on at::parallel_for, so a kernel called from torch (dsv4_cpu/binding.py through ctypes)
// shares torch's OpenMP threads instead of competing with them. Built by dsv4_cpu/build.py
// against the installed torch's headers (its own small library, keyed by torch's version).
#include <ATen/Parallel.h>

#include <cstdint>

#include "dsv4_cpu.h"

extern "C" void dsv4_torch_parallel_run(void *ctx, int64_t n, dsv4_index_fn fn, void *arg) {
    (void)ctx;
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; i++) fn(arg, i);
    });
}

extern "C" int dsv4_torch_num_threads(void) { return at::get_num_threads(); }
