// XLA FFI handlers of dsv4-prefill's CPU kernels (planner/csrc/dsv4_cpu.h) for JAX: built by
// planner/ckernel.py together with the kernels, against jaxlib's FFI headers, and registered as
// custom-call targets on the CPU platform by dsv4_jax/kernels/cpu_kvcache.py.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Rows [0, n) in `t` contiguous ranges (t = threads, fewer for small calls), run(a, b) each:
// t - 1 std::threads and the calling one.
template <class F>
static void parallel_rows(int64_t n, int64_t threads, int64_t min_rows, F run) {
    const int64_t t = std::max<int64_t>(1, std::min<int64_t>(threads, n / std::max<int64_t>(min_rows, 1)));
    std::vector<std::thread> pool;
    for (int64_t k = 1; k < t; k++) pool.emplace_back(run, n * k / t, n * (k + 1) / t);
    run(0, n / t);
    for (auto &th : pool) th.join();
}

extern "C" void dsv4_gather_dequant(void *out, int64_t out_s0, int64_t out_s1, int64_t out_rows, int out_f32, int stream,
                                    const uint8_t *cache, int64_t page_stride, int64_t num_blocks, int64_t S,
                                    const int64_t *seq, const int64_t *cum, const void *bt, int bt_int64,
                                    int64_t bt_s0, int64_t bt_w, int64_t offset, int64_t R, int64_t row0,
                                    int64_t row1);

// out_in bf16 [R', rows, 512] (aliased to out), cache u8 [num_blocks, page_bytes], seq / glen
// s32 [R], bt s32 [R, B]: vLLM's dequantize_and_gather_k_cache.
static ffi::Error Gather(ffi::Buffer<ffi::BF16> out_in, ffi::Buffer<ffi::U8> cache, ffi::Buffer<ffi::S32> seq,
                         ffi::Buffer<ffi::S32> glen, ffi::Buffer<ffi::S32> bt, ffi::ResultBuffer<ffi::BF16> out,
                         int64_t block_size, int64_t offset, int64_t threads, int64_t min_rows,
                         int64_t stream_bytes) {
    void *o = out->untyped_data();
    if (o != out_in.untyped_data()) std::memcpy(o, out_in.untyped_data(), out_in.size_bytes());
    auto od = out_in.dimensions();
    auto cd = cache.dimensions();
    auto bd = bt.dimensions();
    if (od.size() != 3 || od[2] != 512 || cd.size() != 2 || bd.size() != 2)
        return ffi::Error::InvalidArgument("dsv4_gather_dequant: expected out [R, rows, 512], 2-D pages and block table");
    const int64_t R = static_cast<int64_t>(seq.element_count());
    if (static_cast<int64_t>(glen.element_count()) != R || bd[0] < R || od[0] < R)
        return ffi::Error::InvalidArgument("dsv4_gather_dequant: seq_lens, gather_lens, block_table, out disagree on R");
    std::vector<int64_t> s64(R), cum(R + 1, 0);
    const int32_t *sp = seq.typed_data(), *gp = glen.typed_data();
    for (int64_t i = 0; i < R; i++) {
        s64[i] = sp[i];
        cum[i + 1] = cum[i] + std::max<int64_t>(gp[i], 0);
    }
    const int64_t n = cum[R];
    if (n == 0) return ffi::Error::Success();
    const int stream = n * 1024 > stream_bytes;
    auto run = [&](int64_t a, int64_t b) {
        dsv4_gather_dequant(o, od[1] * 512, 512, od[1], 0, stream, cache.typed_data(), cd[1], cd[0], block_size, s64.data(),
                            cum.data(), bt.typed_data(), 0, bd[1], bd[1], offset, R, a, b);
    };
    parallel_rows(n, threads, min_rows, run);
    return ffi::Error::Success();
}

// The prefill's gather of one region of one chunk into the flat workspace (rows, 512), bf16
// or float32: segment s in [s0, s1) owns region rows region_start[s] .. region_start[s + 1];
// its row j is entry start[s] + j of request seg_request[s], written to workspace row
// seg_row_base[s] + dst_offset + j. bounds = (s0, s1, dst_offset), traced.
static ffi::Error GatherSegments(ffi::AnyBuffer ws_in, ffi::Buffer<ffi::U8> cache, ffi::Buffer<ffi::S32> bt,
                                 ffi::Buffer<ffi::S32> region_start, ffi::Buffer<ffi::S32> seg_request,
                                 ffi::Buffer<ffi::S32> seg_row_base, ffi::Buffer<ffi::S32> start,
                                 ffi::Buffer<ffi::S32> bounds, ffi::Result<ffi::AnyBuffer> ws, int64_t block_size,
                                 int64_t threads, int64_t min_rows, int64_t stream_bytes) {
    void *o = ws->untyped_data();
    if (o != ws_in.untyped_data()) std::memcpy(o, ws_in.untyped_data(), ws_in.size_bytes());
    auto wd = ws_in.dimensions();
    auto cd = cache.dimensions();
    auto bd = bt.dimensions();
    const bool f32 = ws_in.element_type() == ffi::DataType::F32;
    if (!f32 && ws_in.element_type() != ffi::DataType::BF16)
        return ffi::Error::InvalidArgument("dsv4_gather_segments: the workspace must be bfloat16 or float32");
    if (wd.size() != 2 || wd[1] != 512 || cd.size() != 2 || bd.size() != 2 || bounds.element_count() != 3)
        return ffi::Error::InvalidArgument("dsv4_gather_segments: expected ws [rows, 512], 2-D pages and block table");
    const int64_t L = static_cast<int64_t>(seg_request.element_count());
    const int64_t nrs = static_cast<int64_t>(region_start.element_count());
    const int32_t *b = bounds.typed_data();
    const int64_t s0 = std::max<int64_t>(b[0], 0), s1 = std::min<int64_t>({(int64_t)b[1], L, nrs - 1}), dst = b[2];
    if (s1 <= s0) return ffi::Error::Success();
    const int32_t *rs = region_start.typed_data(), *req = seg_request.typed_data(), *base = seg_row_base.typed_data();
    const int32_t *st = start.typed_data();
    const int64_t nst = static_cast<int64_t>(start.element_count());
    const int64_t first = rs[s0], n = rs[s1] - first;
    if (n <= 0) return ffi::Error::Success();
    const int stream = n * 512 * (f32 ? 4 : 2) > stream_bytes;
    const int64_t esize = f32 ? 4 : 2;
    auto run = [&](int64_t a, int64_t e) {  // flat region rows [first + a, first + e)
        for (int64_t s = s0; s < s1; s++) {
            int64_t lo = std::max<int64_t>(rs[s] - first, a), hi = std::min<int64_t>(rs[s + 1] - first, e);
            if (hi <= lo) continue;
            int64_t r = req[s], g = rs[s + 1] - rs[s], row = (int64_t)base[s] + dst;
            if (r < 0 || r >= bd[0] || row < 0 || row > wd[0]) continue;  // not in the arrays: nothing to do
            int64_t seq1 = (s < nst ? st[s] : 0) + g, cum1[2] = {0, g};
            dsv4_gather_dequant((char *)o + row * 512 * esize, 0, 512, wd[0] - row, f32, stream, cache.typed_data(),
                                cd[1], cd[0], block_size, &seq1, cum1, bt.typed_data() + r * bd[1], 0, 0, bd[1], 0, 1,
                                lo - (rs[s] - first), hi - (rs[s] - first));
        }
    };
    parallel_rows(n, threads, min_rows, run);
    return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4GatherSegments, GatherSegments,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("block_size")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("min_rows")
                                  .Attr<int64_t>("stream_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4GatherDequant, Gather,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("block_size")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("min_rows")
                                  .Attr<int64_t>("stream_bytes"));
