// The XLA FFI handler of the Lightning Indexer (dsv4_cpu.h) for JAX, built with xla_ffi.cc into the
// FFI library (dsv4_cpu/build.py) and registered by dsv4_jax/kernels/cpu/library.py. Parallel work runs
// on XLA's intra-op thread pool.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dsv4_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct XlaPool {  // dsv4_parallel on XLA's intra-op pool (as xla_ffi.cc's)
    dsv4_parallel par;
    explicit XlaPool(ffi::ThreadPool &p) {
        par.threads = (int32_t)std::max<int64_t>(1, p.num_threads());
        par.run = nullptr;
        par.schedule = [](void *ctx, dsv4_task_fn fn, void *arg) {
            static_cast<ffi::ThreadPool *>(ctx)->Schedule([fn, arg] { fn(arg); });
        };
        par.ctx = &p;
    }
};

ffi::Error bad(const std::string &msg) { return ffi::Error::InvalidArgument("dsv4_indexer_topk: " + msg); }

std::string dims(ffi::Span<const int64_t> d) {
    std::string s = "(";
    for (size_t i = 0; i < d.size(); i++) s += (i ? ", " : "") + std::to_string(d[i]);
    return s + (d.size() == 1 ? ",)" : ")");
}

enum { LAYOUT_ROWS = 0, LAYOUT_INDEX_FP8 = 2 };

}  // namespace

// q [T, H, D] (bf16 / f32 / f8e4m3fn), weights f32 [T, H]; keys: layout 0 rows [S, D] (bf16 / f32)
// + offsets s32 [B] (entry e of request b: row offsets[b] + e), layout 2 vLLM's fp8 index pages
// u8 [P, page_size, D + 4] + block table s32 [B, W]; token_request, token_position, valid s32 [T]
// (tokens with valid == 0 are padding: their rows come out -1 / -inf, nothing of them is read)
// -> indices s32 [T, topk], logits f32 [T, topk]: dsv4_indexer_topk, or with `cand` (its blocks
// [T, topk_blocks] s32, written or read) dsv4_indexer_topk_candidates.
static ffi::Error Run(ffi::ThreadPool &pool, ffi::AnyBuffer q, ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer keys,
                      ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> request, ffi::Buffer<ffi::S32> position,
                      ffi::Buffer<ffi::S32> valid, ffi::ResultBuffer<ffi::S32> &indices, ffi::ResultBuffer<ffi::F32> &logits,
                      int64_t layout, int64_t compress_ratio, int64_t topk, dsv4_index_candidates *cand) {
    auto qd = q.dimensions();
    auto kd = keys.dimensions();
    auto td = table.dimensions();
    if (qd.size() != 3) return bad("q: expected (T, H, D), got " + dims(qd));
    const int64_t T = qd[0], H = qd[1], D = qd[2];
    int32_t q_dtype;
    switch (q.element_type()) {
        case ffi::DataType::BF16: q_dtype = DSV4_BF16; break;
        case ffi::DataType::F32: q_dtype = DSV4_F32; break;
        case ffi::DataType::F8E4M3FN: q_dtype = DSV4_FP8_E4M3; break;
        default: return bad("q: expected bfloat16, float32 or float8_e4m3fn");
    }
    if (weights.dimensions().size() != 2 || weights.dimensions()[0] != T || weights.dimensions()[1] != H)
        return bad("weights: expected (T, H) = (" + std::to_string(T) + ", " + std::to_string(H) + "), got " + dims(weights.dimensions()));
    if ((int64_t)request.element_count() != T || (int64_t)position.element_count() != T || (int64_t)valid.element_count() != T)
        return bad("token_request / token_position / valid: expected " + std::to_string(T) + " entries each");
    auto id = indices->dimensions();
    if (id.size() != 2 || id[0] != T || id[1] != topk || (int64_t)logits->element_count() != T * topk)
        return bad("indices / logits: expected (T, topk), got " + dims(id));
    dsv4_kv_source s;
    std::memset(&s, 0, sizeof(s));
    s.data = keys.untyped_data();
    s.table = table.typed_data();
    if (layout == LAYOUT_ROWS) {
        if (kd.size() != 2 || kd[1] != D || td.size() != 1)
            return bad("keys: expected rows (S, " + std::to_string(D) + ") and offsets (B,), got " + dims(kd) + " and " + dims(td));
        if (keys.element_type() != ffi::DataType::BF16 && keys.element_type() != ffi::DataType::F32)
            return bad("keys: rows must be bfloat16 or float32");
        s.format = DSV4_ROWS;
        s.dtype = keys.element_type() == ffi::DataType::BF16 ? DSV4_BF16 : DSV4_F32;
        s.row_stride = D;
        s.num_rows = kd[0];
        s.table_stride = s.table_width = 1;
        s.table_rows = td[0];
    } else if (layout == LAYOUT_INDEX_FP8) {
        if (kd.size() != 3 || kd[2] != D + 4 || kd[1] < 1 || td.size() != 2 || keys.element_type() != ffi::DataType::U8)
            return bad("keys: expected uint8 pages (P, page_size, D + 4 = " + std::to_string(D + 4) + ") and a block table (B, W), got " +
                       dims(kd) + " and " + dims(td));
        s.format = DSV4_KV_INDEX_FP8;
        s.page_stride = kd[1] * kd[2];
        s.num_pages = kd[0];
        s.page_size = kd[1];
        s.table_stride = s.table_width = td[1];
        s.table_rows = td[0];
    } else {
        return bad("layout: expected 0 (rows) or 2 (fp8 index pages), got " + std::to_string(layout));
    }
    int32_t *oi = indices->typed_data();
    float *ol = logits->typed_data();
    std::fill(oi, oi + T * topk, -1);
    std::fill(ol, ol + T * topk, -std::numeric_limits<float>::infinity());
    std::vector<int32_t> row, req, pos;
    const int32_t *v = valid.typed_data(), *r = request.typed_data(), *p = position.typed_data();
    for (int64_t t = 0; t < T; t++)
        if (v[t]) row.push_back((int32_t)t), req.push_back(r[t]), pos.push_back(p[t]);
    if (row.empty()) return ffi::Error::Success();
    dsv4_prefill_tokens tk;
    std::memset(&tk, 0, sizeof(tk));
    tk.kind = DSV4_CSA;
    tk.window = 1;
    tk.compress_ratio = (int32_t)compress_ratio;
    tk.num_tokens = (int64_t)row.size();
    tk.token_row = row.data();
    tk.token_request = req.data();
    tk.token_position = pos.data();
    XlaPool xp(pool);
    int rc = dsv4_indexer_topk_candidates(q.untyped_data(), H * D, D, q_dtype, T, H, D, weights.typed_data(), H, &tk, &s, topk,
                                          oi, topk, ol, topk, &xp.par, -1, cand);
    if (rc == DSV4_OK) return ffi::Error::Success();
    std::string msg = std::string("dsv4_indexer_topk: ") + dsv4_cpu_last_error();
    return rc == DSV4_ERR_ARG ? ffi::Error::InvalidArgument(msg) : ffi::Error::Internal(msg);
}

static ffi::Error IndexerTopk(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer keys,
                              ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> request, ffi::Buffer<ffi::S32> position,
                              ffi::Buffer<ffi::S32> valid, ffi::ResultBuffer<ffi::S32> indices,
                              ffi::ResultBuffer<ffi::F32> logits, int64_t layout, int64_t compress_ratio, int64_t topk) {
    return Run(pool, q, weights, keys, table, request, position, valid, indices, logits, layout, compress_ratio, topk, nullptr);
}

// Level 1 of DeepSeek-V4.1's two-level top-k: IndexerTopk, and each token's candidate blocks
// [T, topk_blocks] s32 (padding tokens' rows -1).
static ffi::Error IndexerTopkSelect(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer keys,
                                    ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> request,
                                    ffi::Buffer<ffi::S32> position, ffi::Buffer<ffi::S32> valid,
                                    ffi::ResultBuffer<ffi::S32> indices, ffi::ResultBuffer<ffi::F32> logits,
                                    ffi::ResultBuffer<ffi::S32> blocks, int64_t layout, int64_t compress_ratio, int64_t topk,
                                    int64_t block_size, int64_t topk_blocks) {
    auto bd = blocks->dimensions();
    const int64_t T = q.dimensions().size() ? q.dimensions()[0] : 0;
    if (bd.size() != 2 || bd[0] != T || bd[1] != topk_blocks || topk_blocks < 1)
        return bad("blocks: expected (T, topk_blocks) = (" + std::to_string(T) + ", " + std::to_string(topk_blocks) + "), got " +
                   dims(bd));
    std::fill(blocks->typed_data(), blocks->typed_data() + T * topk_blocks, -1);
    dsv4_index_candidates c{DSV4_CANDIDATES_SELECT, block_size, topk_blocks, blocks->typed_data(), topk_blocks};
    return Run(pool, q, weights, keys, table, request, position, valid, indices, logits, layout, compress_ratio, topk, &c);
}

// Level 2: IndexerTopk inside each token's candidate blocks [T, W] s32 (-1 = none).
static ffi::Error IndexerTopkRestrict(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer keys,
                                      ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> request,
                                      ffi::Buffer<ffi::S32> position, ffi::Buffer<ffi::S32> valid,
                                      ffi::Buffer<ffi::S32> candidates, ffi::ResultBuffer<ffi::S32> indices,
                                      ffi::ResultBuffer<ffi::F32> logits, int64_t layout, int64_t compress_ratio, int64_t topk,
                                      int64_t block_size) {
    auto cd = candidates.dimensions();
    const int64_t T = q.dimensions().size() ? q.dimensions()[0] : 0;
    if (cd.size() != 2 || cd[0] != T || cd[1] < 1)
        return bad("candidates: expected (T, blocks) with T = " + std::to_string(T) + ", got " + dims(cd));
    // (the kernel reads the candidates, never writes them)
    dsv4_index_candidates c{DSV4_CANDIDATES_RESTRICT, block_size, cd[1], const_cast<int32_t *>(candidates.typed_data()), cd[1]};
    return Run(pool, q, weights, keys, table, request, position, valid, indices, logits, layout, compress_ratio, topk, &c);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4IndexerTopk, IndexerTopk,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layout")
                                  .Attr<int64_t>("compress_ratio")
                                  .Attr<int64_t>("topk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4IndexerTopkSelect, IndexerTopkSelect,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("layout")
                                  .Attr<int64_t>("compress_ratio")
                                  .Attr<int64_t>("topk")
                                  .Attr<int64_t>("block_size")
                                  .Attr<int64_t>("topk_blocks"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4IndexerTopkRestrict, IndexerTopkRestrict,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layout")
                                  .Attr<int64_t>("compress_ratio")
                                  .Attr<int64_t>("topk")
                                  .Attr<int64_t>("block_size"));
