// XLA FFI handler of dsv4_gather_mxfp8 (DeepSeek-V4.1's 528-byte mxfp8 pages, dsv4_cpu.h) for JAX:
// built with xla_ffi.cc into the handlers' library (dsv4_cpu/build.py), registered by
// dsv4_jax/kernels/cpu/library.py. Parallel work on XLA's intra-op pool (the FFI ThreadPool).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "dsv4_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct V41Parallel {
    dsv4_parallel par;
    explicit V41Parallel(ffi::ThreadPool &p) {
        par.threads = (int32_t)std::max<int64_t>(1, p.num_threads());
        par.run = nullptr;
        par.schedule = [](void *ctx, dsv4_task_fn fn, void *arg) {
            static_cast<ffi::ThreadPool *>(ctx)->Schedule([fn, arg] { fn(arg); });
        };
        par.ctx = &p;
    }
};

// out_in bf16 / f32 [R', rows, 512] (aliased to out), cache u8 [num_blocks, page_stride], seq /
// glen s32 [R], bt s32 [R, B]: vLLM's dequantize_and_gather_k_cache on mxfp8 pages of block_size
// slots (interleaved 1 / split 0).
ffi::Error GatherMxfp8(ffi::ThreadPool pool, ffi::AnyBuffer out_in, ffi::Buffer<ffi::U8> cache, ffi::Buffer<ffi::S32> seq,
                       ffi::Buffer<ffi::S32> glen, ffi::Buffer<ffi::S32> bt, ffi::Result<ffi::AnyBuffer> out,
                       int64_t block_size, int64_t offset, int64_t interleaved) {
    const char *call = "dsv4_gather_mxfp8: ";
    void *o = out->untyped_data();
    if (o != out_in.untyped_data()) std::memcpy(o, out_in.untyped_data(), out_in.size_bytes());
    auto od = out_in.dimensions();
    auto cd = cache.dimensions();
    auto bd = bt.dimensions();
    const bool f32 = out_in.element_type() == ffi::DataType::F32;
    if (!f32 && out_in.element_type() != ffi::DataType::BF16)
        return ffi::Error::InvalidArgument(std::string(call) + "out must be bf16 or float32");
    if (od.size() != 3 || od[2] != 512 || cd.size() != 2 || bd.size() != 2)
        return ffi::Error::InvalidArgument(std::string(call) + "expected out [R, rows, 512], 2-D pages and block table");
    const int64_t R = static_cast<int64_t>(seq.element_count());
    if (static_cast<int64_t>(glen.element_count()) != R || bd[0] < R || od[0] < R)
        return ffi::Error::InvalidArgument(std::string(call) + "seq_lens, gather_lens, block_table, out disagree on R");
    if (offset < 0) return ffi::Error::InvalidArgument(std::string(call) + "offset " + std::to_string(offset) + " < 0");
    std::vector<int64_t> s64(R), g64(R);
    const int32_t *sp = seq.typed_data(), *gp = glen.typed_data();
    for (int64_t i = 0; i < R; i++) {
        s64[i] = sp[i];
        g64[i] = gp[i];
    }
    V41Parallel xp(pool);
    int rc = dsv4_gather_mxfp8(o, od[1] * 512, 512, od[1], f32 ? 1 : 0, cache.typed_data(), cd[1], cd[0], block_size,
                               (int32_t)interleaved, s64.data(), g64.data(), bt.typed_data(), 0, bd[1], bd[1], offset, R,
                               &xp.par);
    if (rc) return ffi::Error::InvalidArgument(std::string(call) + dsv4_cpu_last_error());
    return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4GatherMxfp8, GatherMxfp8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("block_size")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("interleaved"));
