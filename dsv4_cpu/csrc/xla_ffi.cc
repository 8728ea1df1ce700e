// XLA FFI handlers of dsv4-prefill's CPU kernels (dsv4_cpu.h) for JAX: built by dsv4_cpu/build.py
// against jaxlib's FFI headers into a small library linked against the kernels' library (one copy
// of the kernels per process, shared with the ctypes binding), and registered as custom-call
// targets on the CPU platform by dsv4_jax/kernels/cpu/library.py. Parallel work runs on XLA's
// intra-op thread pool (the FFI ThreadPool context), never on threads of our own.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "dsv4_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The kernels' dsv4_parallel on XLA's intra-op pool: `threads` = its threads, tasks scheduled on it.
struct XlaParallel {
    ffi::ThreadPool *pool;
    dsv4_parallel par;
    explicit XlaParallel(ffi::ThreadPool &p) : pool(&p) {
        par.threads = (int32_t)std::max<int64_t>(1, p.num_threads());
        par.run = nullptr;
        par.schedule = [](void *ctx, dsv4_task_fn fn, void *arg) {
            static_cast<ffi::ThreadPool *>(ctx)->Schedule([fn, arg] { fn(arg); });
        };
        par.ctx = pool;
    }
};

}  // namespace

// out_in bf16 [R', rows, 512] (aliased to out), cache u8 [num_blocks, page_bytes], seq / glen
// s32 [R], bt s32 [R, B]: vLLM's dequantize_and_gather_k_cache.
static ffi::Error Gather(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> out_in, ffi::Buffer<ffi::U8> cache,
                         ffi::Buffer<ffi::S32> seq, ffi::Buffer<ffi::S32> glen, ffi::Buffer<ffi::S32> bt,
                         ffi::ResultBuffer<ffi::BF16> out, int64_t block_size, int64_t offset) {
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
    if (block_size < 1 || cd[1] < block_size * 584)
        return ffi::Error::InvalidArgument("dsv4_gather_dequant: pages of " + std::to_string(cd[1]) +
                                           " bytes cannot hold block_size " + std::to_string(block_size) + " slots");
    if (offset < 0) return ffi::Error::InvalidArgument("dsv4_gather_dequant: offset " + std::to_string(offset) + " < 0");
    std::vector<int64_t> s64(R), g64(R);
    const int32_t *sp = seq.typed_data(), *gp = glen.typed_data();
    for (int64_t i = 0; i < R; i++) {
        s64[i] = sp[i];
        g64[i] = gp[i];
    }
    XlaParallel xp(pool);
    int rc = dsv4_gather_dequant(o, od[1] * 512, 512, od[1], 0, cache.typed_data(), cd[1], cd[0], block_size, s64.data(),
                                 g64.data(), bt.typed_data(), 0, bd[1], bd[1], offset, R, &xp.par);
    if (rc) return ffi::Error::InvalidArgument(std::string("dsv4_gather_dequant: ") + dsv4_cpu_last_error());
    return ffi::Error::Success();
}

// The prefill's gather of one region of one chunk into the flat workspace (rows, 512), bf16
// or float32: segment s in [s0, s1) owns region rows region_start[s] .. region_start[s + 1];
// its row j is entry start[s] + j of request seg_request[s], written to workspace row
// seg_row_base[s] + dst_offset + j. bounds = (s0, s1, dst_offset), traced.
static ffi::Error GatherSegments(ffi::ThreadPool pool, ffi::AnyBuffer ws_in, ffi::Buffer<ffi::U8> cache,
                                 ffi::Buffer<ffi::S32> bt, ffi::Buffer<ffi::S32> region_start,
                                 ffi::Buffer<ffi::S32> seg_request, ffi::Buffer<ffi::S32> seg_row_base,
                                 ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::S32> bounds, ffi::Result<ffi::AnyBuffer> ws,
                                 int64_t block_size) {
    const char *call = "dsv4_gather_segments: ";
    void *o = ws->untyped_data();
    if (o != ws_in.untyped_data()) std::memcpy(o, ws_in.untyped_data(), ws_in.size_bytes());
    auto wd = ws_in.dimensions();
    auto cd = cache.dimensions();
    auto bd = bt.dimensions();
    const bool f32 = ws_in.element_type() == ffi::DataType::F32;
    if (!f32 && ws_in.element_type() != ffi::DataType::BF16)
        return ffi::Error::InvalidArgument(std::string(call) + "the workspace must be bfloat16 or float32");
    if (wd.size() != 2 || wd[1] != 512 || cd.size() != 2 || bd.size() != 2 || bounds.element_count() != 3)
        return ffi::Error::InvalidArgument(std::string(call) + "expected ws [rows, 512], 2-D pages and block table, 3 bounds");
    if (block_size < 1 || cd[1] < block_size * 584)
        return ffi::Error::InvalidArgument(std::string(call) + "pages of " + std::to_string(cd[1]) + " bytes cannot hold " +
                                           std::to_string(block_size) + " slots");
    const int64_t L = static_cast<int64_t>(seg_request.element_count());
    const int64_t nrs = static_cast<int64_t>(region_start.element_count());
    const int64_t nst = static_cast<int64_t>(start.element_count());
    if (static_cast<int64_t>(seg_row_base.element_count()) != L || nrs < 1 || (nst != 1 && nst < L))
        return ffi::Error::InvalidArgument(std::string(call) + "seg_request, seg_row_base (and start) must have one entry per "
                                           "segment and region_start one more");
    const int32_t *b = bounds.typed_data();
    const int64_t s0 = std::max<int64_t>(b[0], 0), s1 = std::min<int64_t>({(int64_t)b[1], L, nrs - 1}), dst = b[2];
    if (s1 <= s0) return ffi::Error::Success();
    const int32_t *rs = region_start.typed_data(), *req = seg_request.typed_data(), *base = seg_row_base.typed_data();
    const int32_t *st = start.typed_data();
    for (int64_t s = s0; s < s1; s++)
        if (rs[s + 1] < rs[s])
            return ffi::Error::InvalidArgument(std::string(call) + "region_start decreases at segment " + std::to_string(s));
    const int64_t first = rs[s0], n = (int64_t)rs[s1] - first;
    if (n <= 0) return ffi::Error::Success();
    const int stream = n * 512 * (f32 ? 4 : 2) > DSV4_GATHER_STREAM_BYTES;
    const int64_t esize = f32 ? 4 : 2;
    auto run = [&](int64_t a, int64_t e) {  // flat region rows [first + a, first + e)
        for (int64_t s = s0; s < s1; s++) {
            int64_t lo = std::max<int64_t>(rs[s] - first, a), hi = std::min<int64_t>(rs[s + 1] - first, e);
            if (hi <= lo) continue;
            // a segment whose request or rows are not in the arrays (padding) writes nothing
            int64_t r = req[s], g = (int64_t)rs[s + 1] - rs[s], row = (int64_t)base[s] + dst;
            if (r < 0 || r >= bd[0] || row < 0 || row >= wd[0]) continue;
            int64_t seq1 = (nst > 1 ? (int64_t)st[s] : 0) + g, cum1[2] = {0, g};
            dsv4_gather_dequant_rows((char *)o + row * 512 * esize, 0, 512, wd[0] - row, f32, stream, cache.typed_data(),
                                     cd[1], cd[0], block_size, &seq1, cum1, bt.typed_data() + r * bd[1], 0, 0, bd[1], 0, 1,
                                     lo - (rs[s] - first), hi - (rs[s] - first));
        }
    };
    XlaParallel xp(pool);
    dsv4_parallel_for(&xp.par, n, DSV4_GATHER_PARALLEL_ROWS,
                      [](void *arg, int64_t a, int64_t e) { (*static_cast<decltype(run) *>(arg))(a, e); }, &run);
    return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4GatherSegments, GatherSegments,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("block_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4GatherDequant, Gather,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("block_size")
                                  .Attr<int64_t>("offset"));

// ---------------------------------------------------------------- sparse attention ("cpu" backend)

namespace {

// dsv4_cpu.h's dtype code of a buffer element type (-1: not served).
int dtype_code(ffi::DataType t) {
    if (t == ffi::DataType::BF16) return DSV4_BF16;
    if (t == ffi::DataType::F32) return DSV4_F32;
    return -1;
}

ffi::Error kernel_error(const char *call, int rc) {
    std::string msg = std::string(call) + ": " + dsv4_cpu_last_error();
    return rc == DSV4_ERR_ARG ? ffi::Error::InvalidArgument(msg) : ffi::Error::Internal(msg);
}

std::string dims_str(ffi::Span<const int64_t> d) {
    std::string s = "(";
    for (size_t i = 0; i < d.size(); i++) s += (i ? ", " : "") + std::to_string(d[i]);
    return s + (d.size() == 1 ? ",)" : ")");
}

ffi::Error bad(const char *call, const std::string &msg) { return ffi::Error::InvalidArgument(std::string(call) + ": " + msg); }

}  // namespace

// q [T, H, D] and kv [S, D] (bf16 or float32, the same), indices s32 [T, K], topk_length s32 [T]
// or [0] (none), attn_sink f32 [H] or [0] (none) -> out [T, H, d_v] (q's dtype), max_logits and
// lse f32 [T, H]: dsv4_sparse_attention (FlashMLA's flash_mla_sparse_fwd contract).
static ffi::Error SparseAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> indices,
                                  ffi::Buffer<ffi::S32> topk_length, ffi::Buffer<ffi::F32> sink,
                                  ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> max_logits,
                                  ffi::Result<ffi::Buffer<ffi::F32>> lse, float sm_scale) {
    const char *call = "dsv4_sparse_attention";
    auto qd = q.dimensions();
    auto kd = kv.dimensions();
    auto id = indices.dimensions();
    const int dt = dtype_code(q.element_type());
    if (dt < 0 || kv.element_type() != q.element_type() || out->element_type() != q.element_type())
        return bad(call, "q, kv and out must all be bfloat16 or all float32");
    if (qd.size() != 3 || kd.size() != 2 || id.size() != 2 || kd[1] != qd[2] || id[0] != qd[0])
        return bad(call, "expected q (T, H, D), kv (S, D), indices (T, K); got q " + dims_str(qd) + ", kv " +
                             dims_str(kd) + ", indices " + dims_str(id));
    const int64_t T = qd[0], H = qd[1], D = qd[2], S = kd[0], K = id[1];
    const int64_t dv = D >= 512 ? 512 : D;
    auto od = out->dimensions();
    if (od.size() != 3 || od[0] != T || od[1] != H || od[2] != dv || max_logits->element_count() != (size_t)(T * H) ||
        lse->element_count() != (size_t)(T * H))
        return bad(call, "out must be (T, H, d_v) and max_logits / lse (T, H); got out " + dims_str(od));
    const int64_t nt = (int64_t)topk_length.element_count(), ns = (int64_t)sink.element_count();
    if (nt != 0 && nt != T) return bad(call, "topk_length: expected " + std::to_string(T) + " entries or none, got " + std::to_string(nt));
    if (ns != 0 && ns != H) return bad(call, "attn_sink: expected " + std::to_string(H) + " entries or none, got " + std::to_string(ns));
    if (T == 0 || H == 0) return ffi::Error::Success();
    dsv4_outputs o{out->untyped_data(), H * dv, dv, max_logits->typed_data(), lse->typed_data(), H};
    XlaParallel xp(pool);
    int rc = dsv4_sparse_attention(q.untyped_data(), H * D, D, dt, T, H, D, kv.untyped_data(), D, S, indices.typed_data(), K,
                                   K, nt ? topk_length.typed_data() : nullptr, sm_scale, ns ? sink.typed_data() : nullptr, &o,
                                   &xp.par, -1);
    return rc ? kernel_error(call, rc) : ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4SparseAttention, SparseAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale"));

// ---------------------------------------------------------------- one prefill layer ("cpu" backend)

// Cache layouts of dsv4_jax.prefill's sources.
enum { LAYOUT_LOGICAL = 0, LAYOUT_PAGED = 1, LAYOUT_FP8 = 2, LAYOUT_MXFP8_SPLIT = 3, LAYOUT_MXFP8_INTERLEAVED = 4 };

// The dsv4_kv_source of a cache: LAYOUT_LOGICAL rows [S, D] + offsets s32 [B]; LAYOUT_PAGED pages
// [P, page_size, D] + block table s32 [B, W]; LAYOUT_FP8 fp8_ds_mla pages u8 [P, page_bytes] + block
// table s32 [B, W] with `block_size` slots per page. Rows in q's dtype (format 0).
static ffi::Error make_source(const char *call, const char *name, int64_t layout, int64_t block_size,
                              const ffi::AnyBuffer &data, const ffi::Buffer<ffi::S32> &table, int32_t dtype, int64_t D,
                              dsv4_kv_source *s) {
    auto dd = data.dimensions();
    auto td = table.dimensions();
    std::memset(s, 0, sizeof(*s));
    s->data = data.untyped_data();
    s->table = table.typed_data();
    s->table_int64 = 0;
    if (layout == LAYOUT_LOGICAL) {
        if (dd.size() != 2 || dd[1] != D || td.size() != 1)
            return bad(call, std::string(name) + ": expected rows (S, " + std::to_string(D) + ") and offsets (B,), got " +
                                 dims_str(dd) + " and " + dims_str(td));
        if (dtype_code(data.element_type()) != dtype) return bad(call, std::string(name) + ": rows must hold q's dtype");
        s->format = 0;
        s->dtype = dtype;
        s->row_stride = D;
        s->num_rows = dd[0];
        s->table_stride = 1;
        s->table_width = 1;
        s->table_rows = td[0];
        return ffi::Error::Success();
    }
    if (td.size() != 2) return bad(call, std::string(name) + ": expected a block table (B, W), got " + dims_str(td));
    s->table_stride = td[1];
    s->table_width = td[1];
    s->table_rows = td[0];
    if (layout == LAYOUT_PAGED) {
        if (dd.size() != 3 || dd[2] != D || dd[1] < 1)
            return bad(call, std::string(name) + ": expected pages (P, page_size >= 1, " + std::to_string(D) + "), got " + dims_str(dd));
        if (dtype_code(data.element_type()) != dtype) return bad(call, std::string(name) + ": pages must hold q's dtype");
        s->format = 0;
        s->dtype = dtype;
        s->row_stride = D;
        s->num_rows = dd[0] * dd[1];
        s->page_stride = dd[1] * D;
        s->num_pages = dd[0];
        s->page_size = dd[1];
        return ffi::Error::Success();
    }
    if (layout == LAYOUT_FP8) {
        if (data.element_type() != ffi::DataType::U8 || dd.size() != 2 || block_size < 1 || dd[1] < block_size * 584)
            return bad(call, std::string(name) + ": expected fp8_ds_mla pages uint8 (P, >= block_size * 584) with block_size >= 1, got " +
                                 dims_str(dd) + ", block_size " + std::to_string(block_size));
        s->format = 1;
        s->dtype = dtype;
        s->page_stride = dd[1];
        s->num_pages = dd[0];
        s->page_size = block_size;
        return ffi::Error::Success();
    }
    if (layout == LAYOUT_MXFP8_SPLIT || layout == LAYOUT_MXFP8_INTERLEAVED) {  // DeepSeek-V4.1's 528-byte records
        if (data.element_type() != ffi::DataType::U8 || dd.size() != 2 || block_size < 1 || dd[1] < block_size * 528)
            return bad(call, std::string(name) + ": expected mxfp8 pages uint8 (P, >= block_size * 528), got " + dims_str(dd));
        s->format = layout == LAYOUT_MXFP8_SPLIT ? DSV4_MXFP8_SPLIT : DSV4_MXFP8_INTERLEAVED;
        s->page_stride = dd[1];
        s->num_pages = dd[0];
        s->page_size = block_size;
        return ffi::Error::Success();
    }
    return bad(call, std::string(name) + ": unknown layout " + std::to_string(layout));
}

// One prefill layer straight from the caches: q [T_q, H, D] (bf16 or float32); tokens s32 [3, n]
// or [4, n] (rows: q row, batch request = block-table row / offsets entry, absolute position, and
// with 4 rows each token's lowest window position, dsv4_prefill_tokens.token_window_start) of which the
// first count[0] are real (the rest are padding, skipped); raw / comp caches (make_source; comp
// ignored for SWA); topk s32 [rows, topk] (CSA; else ignored); attn_sink f32 [H] or [0]. out
// [T_q, H, d_v]: the real tokens' rows, every other row 0.
static ffi::Error PrefillAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::S32> count,
                                   ffi::AnyBuffer raw_data, ffi::Buffer<ffi::S32> raw_table, ffi::AnyBuffer comp_data,
                                   ffi::Buffer<ffi::S32> comp_table, ffi::Buffer<ffi::S32> topk, ffi::Buffer<ffi::F32> sink,
                                   ffi::Result<ffi::AnyBuffer> out, int64_t kind, int64_t window, int64_t compress_ratio,
                                   float sm_scale, int64_t raw_layout, int64_t raw_block_size, int64_t comp_layout,
                                   int64_t comp_block_size) {
    const char *call = "dsv4_prefill_attention";
    auto qd = q.dimensions();
    auto kd = tokens.dimensions();
    const int dt = dtype_code(q.element_type());
    if (dt < 0 || out->element_type() != q.element_type()) return bad(call, "q and out must be bfloat16 or float32, the same");
    if (qd.size() != 3 || kd.size() != 2 || (kd[0] != 3 && kd[0] != 4) || count.element_count() != 1)
        return bad(call, "expected q (T, H, D), tokens (3, n) or (4, n), count (1,); got q " + dims_str(qd) + ", tokens " + dims_str(kd));
    if (kind < 0 || kind > 2) return bad(call, "kind: expected 0 (SWA), 1 (CSA) or 2 (HCA), got " + std::to_string(kind));
    const int64_t Tq = qd[0], H = qd[1], D = qd[2], dv = D >= 512 ? 512 : D;
    auto od = out->dimensions();
    if (od.size() != 3 || od[0] != Tq || od[1] != H || od[2] != dv) return bad(call, "out must be (T, H, d_v), got " + dims_str(od));
    const int64_t ns = (int64_t)sink.element_count();
    if (ns != 0 && ns != H) return bad(call, "attn_sink: expected " + std::to_string(H) + " entries or none, got " + std::to_string(ns));
    auto pd = topk.dimensions();
    if (kind == 1 && pd.size() != 2) return bad(call, "topk: expected (rows, topk) for a CSA layer, got " + dims_str(pd));
    dsv4_kv_source raw, comp;
    if (auto e = make_source(call, "raw", raw_layout, raw_block_size, raw_data, raw_table, dt, D, &raw); e.failure()) return e;
    if (kind != 0)
        if (auto e = make_source(call, "comp", comp_layout, comp_block_size, comp_data, comp_table, dt, D, &comp); e.failure())
            return e;

    // The real tokens (every q row they name checked), and which out rows they write.
    const int64_t n = kd[1];
    const int32_t *tp = tokens.typed_data();
    const int64_t real = std::min<int64_t>(std::max<int64_t>(count.typed_data()[0], 0), n);
    const bool has_start = kd[0] == 4;
    std::vector<int32_t> row(real), req(real), pos(real), start(has_start ? real : 0);
    std::vector<uint8_t> written((size_t)Tq, 0);
    const int64_t topk_rows = kind == 1 ? pd[0] : 0;
    for (int64_t i = 0; i < real; i++) {
        row[i] = tp[i];
        req[i] = tp[n + i];
        pos[i] = tp[2 * n + i];
        if (has_start) start[i] = tp[3 * n + i];
        if (row[i] < 0 || row[i] >= Tq)
            return bad(call, "token " + std::to_string(i) + ": q row " + std::to_string(row[i]) + " outside 0.." + std::to_string(Tq - 1));
        if (kind == 1 && row[i] >= topk_rows)
            return bad(call, "token " + std::to_string(i) + ": row " + std::to_string(row[i]) + " outside topk_indices' " +
                                 std::to_string(topk_rows) + " rows");
        if (pos[i] < 0) return bad(call, "token " + std::to_string(i) + ": position " + std::to_string(pos[i]) + " < 0");
        written[row[i]] = 1;
    }
    const size_t row_bytes = (size_t)(H * dv) * (dt == DSV4_BF16 ? 2 : 4);
    char *o = static_cast<char *>(out->untyped_data());
    for (int64_t r = 0; r < Tq; r++)
        if (!written[r]) std::memset(o + r * row_bytes, 0, row_bytes);
    if (real == 0 || H == 0) return ffi::Error::Success();

    dsv4_prefill_tokens tk;
    std::memset(&tk, 0, sizeof(tk));
    tk.kind = (int32_t)kind;
    tk.window = (int32_t)window;
    tk.compress_ratio = (int32_t)std::max<int64_t>(compress_ratio, 1);
    tk.num_tokens = real;
    tk.token_row = row.data();
    tk.token_request = req.data();
    tk.token_position = pos.data();
    tk.token_window_start = has_start ? start.data() : nullptr;
    if (kind == 1) {
        tk.topk = topk.typed_data();
        tk.topk_int64 = 0;
        tk.topk_stride = pd[1];
        tk.topk_width = pd[1];
        tk.topk_rows = pd[0];
    }
    dsv4_outputs outs{o, H * dv, dv, nullptr, nullptr, 0};
    XlaParallel xp(pool);
    int rc = dsv4_prefill_attention(q.untyped_data(), H * D, D, dt, Tq, H, D, &tk, &raw, kind != 0 ? &comp : nullptr,
                                    sm_scale, ns ? sink.typed_data() : nullptr, &outs, &xp.par, -1);
    return rc ? kernel_error(call, rc) : ffi::Error::Success();
}

// The prefill handlers' bindings: the inputs, then (the Into variant) the output buffer to reuse,
// then the result and the attributes.
template <typename B> auto prefill_inputs(B b) {
    return std::move(b).template Ctx<ffi::ThreadPool>()
        .template Arg<ffi::AnyBuffer>()
        .template Arg<ffi::Buffer<ffi::S32>>()
        .template Arg<ffi::Buffer<ffi::S32>>()
        .template Arg<ffi::AnyBuffer>()
        .template Arg<ffi::Buffer<ffi::S32>>()
        .template Arg<ffi::AnyBuffer>()
        .template Arg<ffi::Buffer<ffi::S32>>()
        .template Arg<ffi::Buffer<ffi::S32>>()
        .template Arg<ffi::Buffer<ffi::F32>>();
}

template <typename B> auto prefill_result(B b) {
    return std::move(b).template Ret<ffi::AnyBuffer>()
        .template Attr<int64_t>("kind")
        .template Attr<int64_t>("window")
        .template Attr<int64_t>("compress_ratio")
        .template Attr<float>("sm_scale")
        .template Attr<int64_t>("raw_layout")
        .template Attr<int64_t>("raw_block_size")
        .template Attr<int64_t>("comp_layout")
        .template Attr<int64_t>("comp_block_size");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4PrefillAttention, PrefillAttention, prefill_result(prefill_inputs(ffi::Ffi::Bind())));

// The same call writing into a caller's buffer: `out_in` (q's dtype, (T, H, d_v)) is aliased to
// the result (input_output_aliases), so a donated buffer is reused instead of XLA allocating the
// output afresh (for a long prefill, tens or hundreds of MB of new pages per call). Every row of
// the result is written (a token's output, or zeros), so an unaliased out_in is not copied.
static ffi::Error PrefillAttentionInto(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::S32> count,
                                       ffi::AnyBuffer raw_data, ffi::Buffer<ffi::S32> raw_table, ffi::AnyBuffer comp_data,
                                       ffi::Buffer<ffi::S32> comp_table, ffi::Buffer<ffi::S32> topk,
                                       ffi::Buffer<ffi::F32> sink, ffi::AnyBuffer /*out_in*/, ffi::Result<ffi::AnyBuffer> out,
                                       int64_t kind, int64_t window, int64_t compress_ratio, float sm_scale,
                                       int64_t raw_layout, int64_t raw_block_size, int64_t comp_layout,
                                       int64_t comp_block_size) {
    return PrefillAttention(pool, q, tokens, count, raw_data, raw_table, comp_data, comp_table, topk, sink, out, kind,
                            window, compress_ratio, sm_scale, raw_layout, raw_block_size, comp_layout, comp_block_size);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Dsv4PrefillAttentionInto, PrefillAttentionInto,
                              prefill_result(prefill_inputs(ffi::Ffi::Bind()).template Arg<ffi::AnyBuffer>()));
