/* DeepSeek-V4.1's 528-byte mxfp8 records for CPUs (planner/kvcache_v41.py, the NumPy reference
   these bits equal): 512 e4m3 dims (RoPE applied before quantization) and 16 UE8M0 scale bytes,
   one per 32 dims; value = e4m3 * 2^(byte - 127) as float32, rounded to bf16 (vLLM's gather).
   Pages of S slots, in two layouts: interleaved (slot p's data at p * 528, its scales right after;
   vLLM 0.33.0's and FlashMLA's) or split (data at p * 512, scales at S * 512 + p * 16).

   One pass per row, like kvcache.c's fp8_ds_mla gather: each 32-dim group decoded with integer
   math (the same bits on a thread that flushes float subnormals), scale bytes 10..246 in 16-lane
   vector code, other bytes and groups holding subnormal or NaN codes by kvcache.c's exact scalar
   rule. A row whose position or page is not in the cache reads NaN; nothing outside is touched. */
#include <stdint.h>
#include <string.h>

#include "dsv4_cpu.h"

typedef uint8_t v41_u8x16 __attribute__((vector_size(16)));
typedef uint16_t v41_u16x16 __attribute__((vector_size(32)));
typedef int16_t v41_i16x16 __attribute__((vector_size(32)));

#define V41_NAN_BITS 0x7FC0u

/* 32 dims of one group with scale byte 10..246 and no subnormal / NaN code: bf16 bits are
   sign | (code ? (code << 4) + ((120 + k) << 7) : 0), k = byte - 127. Returns nonzero (and the
   caller redoes the group exactly) when a lane held a code this form gets wrong. */
static int v41_group_normal(const uint8_t *restrict d, uint16_t *restrict o, int k) {
    const v41_u16x16 cn = (v41_u16x16){0} + (uint16_t)((120 + k) << 7);
    v41_u8x16 special = {0};
    for (int j = 0; j < 32; j += 16) {
        v41_u8x16 xb;
        memcpy(&xb, d + j, 16);
        v41_u8x16 cb = xb & 0x7F;
        special |= (v41_u8x16)((v41_u8x16)(cb - 1) < 7) | (v41_u8x16)(cb == 0x7F);
        v41_u16x16 x = __builtin_convertvector(xb, v41_u16x16);
        v41_u16x16 code = x & 0x7F;
        v41_u16x16 nz = (v41_u16x16)((v41_i16x16)code != 0);
        v41_u16x16 r = (nz & ((code << 4) + cn)) | ((x << 8) & 0x8000);
        memcpy(o + j, &r, 32);
    }
    uint64_t w[2];
    memcpy(w, &special, 16);
    return (w[0] | w[1]) != 0;
}

void dsv4_decode_mxfp8_bf16(const uint8_t *restrict d, const uint8_t *restrict sc, uint16_t *restrict o) {
    for (int g = 0; g < 16; g++) {
        const int byte = sc[g];
        if (byte >= 10 && byte <= 246 && !v41_group_normal(d + 32 * g, o + 32 * g, byte - 127)) continue;
        for (int j = 0; j < 32; j++) o[32 * g + j] = dsv4_e4m3_scaled_bits(d[32 * g + j], byte);
    }
}

int dsv4_mxfp8_slot(const uint8_t *page, int64_t S, int64_t p, int32_t interleaved, const uint8_t **d,
                    const uint8_t **sc) {
    if (interleaved) {
        *d = page + p * 528;
        *sc = *d + 512;
    } else {
        *d = page + p * 512;
        *sc = page + S * 512 + p * 16;
    }
    return 1;
}

int dsv4_mxfp8_address(const dsv4_kv_source *s, int64_t b, int64_t e, const uint8_t **d, const uint8_t **sc) {
    if (e < 0 || b < 0 || b >= s->table_rows || s->page_size <= 0) return 0;
    const int64_t blk = e / s->page_size, slot = e % s->page_size;
    if (blk >= s->table_width) return 0;
    const int64_t i = b * s->table_stride + blk;
    const int64_t page = s->table_int64 ? ((const int64_t *)s->table)[i] : (int64_t)((const int32_t *)s->table)[i];
    if (page < 0 || page >= s->num_pages) return 0;
    return dsv4_mxfp8_slot((const uint8_t *)s->data + page * s->page_stride, s->page_size, slot,
                           s->format == DSV4_MXFP8_INTERLEAVED, d, sc);
}

void dsv4_decode_mxfp8_to(const uint8_t *d, const uint8_t *sc, void *dst, int32_t out_f32) {
    if (!out_f32) {
        dsv4_decode_mxfp8_bf16(d, sc, (uint16_t *)dst);
        return;
    }
    uint16_t t[512] __attribute__((aligned(64)));
    dsv4_decode_mxfp8_bf16(d, sc, t);
    uint32_t *o = (uint32_t *)dst;
    for (int j = 0; j < 512; j++) o[j] = (uint32_t)t[j] << 16;
}

#if defined(__SSE2__)
#include <immintrin.h>
#define V41_HAVE_STREAM 1
/* Non-temporal stores of n bytes (a multiple of 64) from an aligned buffer: an output larger than
   the caches is not read back before it leaves them, so this skips each line's write-allocate read
   (kvcache.c's fp8_ds_mla gather does the same). */
static void v41_stream(void *dst, const void *src, int n) {
#if defined(__AVX__)
    if (((uintptr_t)dst & 31) == 0) {
        for (int j = 0; j < n; j += 32)
            _mm256_stream_si256((__m256i *)((char *)dst + j), _mm256_load_si256((const __m256i *)((const char *)src + j)));
        return;
    }
#endif
    if (((uintptr_t)dst & 15) == 0) {
        for (int j = 0; j < n; j += 16)
            _mm_stream_si128((__m128i *)((char *)dst + j), _mm_load_si128((const __m128i *)((const char *)src + j)));
        return;
    }
    memcpy(dst, src, n);
}
#else
#define V41_HAVE_STREAM 0
static void v41_stream(void *dst, const void *src, int n) { memcpy(dst, src, n); }
#endif

/* dsv4_decode_mxfp8_to through an aligned buffer and streaming stores. */
static void v41_decode_stream(const uint8_t *d, const uint8_t *sc, void *dst, int32_t out_f32) {
    uint32_t t[512] __attribute__((aligned(64)));
    dsv4_decode_mxfp8_to(d, sc, t, out_f32);
    v41_stream(dst, t, out_f32 ? 2048 : 1024);
}

static void v41_nan_row(void *dst, int32_t out_f32) {
    if (out_f32) {
        uint32_t *o = (uint32_t *)dst;
        for (int j = 0; j < 512; j++) o[j] = (uint32_t)V41_NAN_BITS << 16;
    } else {
        uint16_t *o = (uint16_t *)dst;
        for (int j = 0; j < 512; j++) o[j] = V41_NAN_BITS;
    }
}

/* Page `blk` of a request's block-table row (entries row0 .. row0 + bt_w - 1), or NULL when the
   column or the page is outside the arrays. */
static inline const uint8_t *v41_page(const uint8_t *cache, int64_t page_stride, int64_t num_pages, const void *bt,
                                      int32_t bt_int64, int64_t row0, int64_t bt_w, int64_t blk) {
    if (blk < 0 || blk >= bt_w) return 0;
    const int64_t page = bt_int64 ? ((const int64_t *)bt)[row0 + blk] : (int64_t)((const int32_t *)bt)[row0 + blk];
    return page >= 0 && page < num_pages ? cache + page * page_stride : 0;
}

#define V41_AHEAD 16 /* rows prefetched ahead: pages in block-table order are scattered */

/* Rows [row0, row1) of the requests' rows laid back to back (cum: [R + 1] prefix sums of the
   gather lengths), as dsv4_gather_dequant_rows does for fp8_ds_mla pages: row i of request b is
   position seq[b] - g_b + i, slot pos % S of page bt[b * bt_s0 + pos / S], written at element
   out + b * out_s0 + (offset + i) * out_s1 when offset + i < out_rows. stream: non-temporal stores
   (outputs larger than the caches). */
void dsv4_gather_mxfp8_rows(void *out, int64_t out_s0, int64_t out_s1, int64_t out_rows, int32_t out_f32,
                            const uint8_t *cache, int64_t page_stride, int64_t num_pages, int64_t S, int32_t interleaved,
                            const int64_t *seq, const int64_t *cum, const void *bt, int32_t bt_int64, int64_t bt_s0,
                            int64_t bt_w, int64_t offset, int64_t R, int64_t row0, int64_t row1, int32_t stream) {
    const size_t esize = out_f32 ? 4 : 2;
    int64_t lo = 0, hi = R; /* the request holding row0: cum[b] <= row0 < cum[b + 1] */
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (cum[mid] <= row0) lo = mid; else hi = mid;
    }
    for (int64_t b = lo, r = row0; r < row1 && b < R; b++) {
        const int64_t g = cum[b + 1] - cum[b];
        if (g <= 0) continue;
        const int64_t i0 = r - cum[b];
        int64_t i1 = (row1 < cum[b + 1] ? row1 : cum[b + 1]) - cum[b];
        r = cum[b] + i1;
        if (offset + i1 > out_rows) i1 = out_rows - offset; /* rows past out: not written */
        if (i1 <= i0) continue;
        /* position, page-table column and slot of the row being written, and of the row prefetched
           V41_AHEAD rows ahead, advanced by one each step (no division per row) */
        int64_t pos = seq[b] - g + i0, blk = pos >= 0 ? pos / S : -1, p = pos >= 0 ? pos - blk * S : 0;
        int64_t ia = i0 + V41_AHEAD < i1 ? i0 + V41_AHEAD : i1;
        int64_t pa_pos = seq[b] - g + ia, blka = pa_pos >= 0 ? pa_pos / S : -1, pa = pa_pos >= 0 ? pa_pos - blka * S : 0;
        const uint8_t *base = 0;
        for (int64_t i = i0; i < i1; i++) {
            if (i == i0 || p == 0) base = v41_page(cache, page_stride, num_pages, bt, bt_int64, b * bt_s0, bt_w, blk);
            if (ia < i1) {
                const uint8_t *pg = v41_page(cache, page_stride, num_pages, bt, bt_int64, b * bt_s0, bt_w, blka);
                if (pg) {
                    const uint8_t *d, *sc;
                    dsv4_mxfp8_slot(pg, S, pa, interleaved, &d, &sc);
                    for (int l = 0; l < 512; l += 64) __builtin_prefetch(d + l, 0, 3);
                    __builtin_prefetch(sc, 0, 3);
                }
                ia++;
                if (blka < 0) { if (++pa_pos >= 0) { blka = 0; pa = 0; } }
                else if (++pa == S) { pa = 0; blka++; }
            }
            char *dst = (char *)out + (b * out_s0 + (offset + i) * out_s1) * (int64_t)esize;
            if (!base) {
                v41_nan_row(dst, out_f32);
            } else {
                const uint8_t *d, *sc;
                dsv4_mxfp8_slot(base, S, p, interleaved, &d, &sc);
                if (stream) v41_decode_stream(d, sc, dst, out_f32);
                else dsv4_decode_mxfp8_to(d, sc, dst, out_f32);
            }
            if (blk < 0) { if (++pos >= 0) { blk = 0; p = 0; base = 0; } }
            else if (++p == S) { p = 0; blk++; }
        }
    }
#if V41_HAVE_STREAM
    if (stream) _mm_sfence(); /* the streamed rows are visible before the call returns */
#endif
}
