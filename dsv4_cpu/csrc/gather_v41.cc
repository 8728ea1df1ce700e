// dsv4_gather_mxfp8 (dsv4_cpu.h): vLLM's dequantize_and_gather_k_cache on DeepSeek-V4.1's 528-byte
// mxfp8 pages, its rows split into contiguous ranges on the threads the call's dsv4_parallel allows
// (kvcache_v41.c decodes one range); and the check of a format 3 / 4 dsv4_kv_source that
// dsv4_prefill_attention reads in place (attention.cc).

#include <algorithm>
#include <string>
#include <vector>

#include "kvcache_v41.h"
#include "runtime.h"

namespace dsv4 {

int check_mxfp8_source(const dsv4_kv_source &s, const std::string &n, int64_t D) {
    if (D != 512) return fail(DSV4_ERR_ARG, n + ": mxfp8 (V4.1) records hold 512 dims, q has D = " + std::to_string(D));
    if (s.page_size <= 0 || !s.table)
        return fail(DSV4_ERR_ARG, n + ": mxfp8 (V4.1) pages need page_size > 0 and a block table");
    if (s.page_size > (int64_t(1) << 40) / 528 || s.page_stride < s.page_size * 528)
        return fail(DSV4_ERR_ARG, n + ": page_stride " + std::to_string(s.page_stride) + " < page_size * 528");
    return DSV4_OK;
}

}  // namespace dsv4

using namespace dsv4;

extern "C" int dsv4_gather_mxfp8(void *out, int64_t out_s0, int64_t out_s1, int64_t out_rows, int32_t out_f32,
                                 const uint8_t *cache, int64_t page_stride, int64_t num_pages, int64_t page_size,
                                 int32_t interleaved, const int64_t *seq_lens, const int64_t *gather_lens,
                                 const void *block_table, int32_t bt_int64, int64_t bt_s0, int64_t bt_w, int64_t offset,
                                 int64_t R, const dsv4_parallel *par) {
    return guarded([&]() -> int {
        if (R < 0) return fail(DSV4_ERR_ARG, "R: expected >= 0, got " + std::to_string(R));
        if (R == 0) return DSV4_OK;
        if (int rc = check_parallel(par)) return rc;
        if (!seq_lens || !block_table) return fail(DSV4_ERR_ARG, "seq_lens / block_table: NULL");
        if (interleaved != 0 && interleaved != 1)
            return fail(DSV4_ERR_ARG, "interleaved: expected 0 or 1, got " + std::to_string(interleaved));
        if (page_size < 1 || page_size > (int64_t(1) << 40) / 528)
            return fail(DSV4_ERR_ARG, "page_size: expected >= 1, got " + std::to_string(page_size));
        if (page_stride < page_size * 528)
            return fail(DSV4_ERR_ARG, "page_stride: " + std::to_string(page_stride) + " < page_size * 528");
        if (num_pages < 0 || bt_w < 0 || out_rows < 0 || offset < 0)
            return fail(DSV4_ERR_ARG, "num_pages, bt_w, out_rows, offset: expected >= 0");
        if (R > 1 && bt_s0 < bt_w) return fail(DSV4_ERR_ARG, "bt_s0: " + std::to_string(bt_s0) + " < bt_w " + std::to_string(bt_w));
        if (num_pages > 0 && !cache) return fail(DSV4_ERR_ARG, "cache: NULL");
        if (out_s1 < 512 && out_rows > 1) return fail(DSV4_ERR_ARG, "out_s1: " + std::to_string(out_s1) + " < 512");
        std::vector<int64_t> cum((size_t)R + 1, 0);
        for (int64_t b = 0; b < R; b++) {
            if (seq_lens[b] < 0) return fail(DSV4_ERR_ARG, "seq_lens[" + std::to_string(b) + "]: " + std::to_string(seq_lens[b]) + " < 0");
            const int64_t g = gather_lens ? std::max<int64_t>(gather_lens[b], 0) : seq_lens[b];
            cum[b + 1] = cum[b] + g;
        }
        const int64_t n = cum[R];
        if (n == 0) return DSV4_OK;
        if (!out) return fail(DSV4_ERR_ARG, "out: NULL");
        const int32_t stream = n * 512 * (out_f32 ? 4 : 2) > DSV4_GATHER_STREAM_BYTES;
        const int64_t *c = cum.data();
        ParallelScope scope(par);
        const int64_t t = std::max<int64_t>(1, std::min<int64_t>(max_threads(), n / DSV4_GATHER_PARALLEL_ROWS));
        parallel_items(t, (int)t, [&](int64_t k) {
            dsv4_gather_mxfp8_rows(out, out_s0, out_s1, out_rows, out_f32, cache, page_stride, num_pages, page_size,
                                   interleaved, seq_lens, c, block_table, bt_int64, bt_s0, bt_w, offset, R, n * k / t,
                                   n * (k + 1) / t, stream);
        });
        return DSV4_OK;
    });
}
