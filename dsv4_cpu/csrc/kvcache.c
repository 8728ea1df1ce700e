/* The fp8_ds_mla gather-dequantize for CPUs (vLLM's dequantize_and_gather_k_cache), shared by
   both frameworks; the parallel entry point is gather.cc's dsv4_gather_dequant. Layout:
   planner/kvcache.py (the NumPy reference these bits equal).

   One pass per row: the page from the block table, the 448 e4m3 dims decoded, the RoPE dims
   copied, scattered pages prefetched AHEAD rows ahead. Each 64-dim group is decoded with integer
   math only (a thread that flushes float subnormals, as XLA's CPU threads do, gets the same
   bits): scale bytes 10..246 in 16-lane vector code (GCC/Clang vector types), other scale bytes
   (never written by vLLM's writer) by an exact scalar rounding. Every read and write is
   bounds-checked: a row whose position or block-table entry is not a page of the cache comes out
   NaN, rows past out_rows are not written. */
#include <stdint.h>
#include <string.h>
#include <stddef.h>

#include "dsv4_cpu.h"

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int16_t i16x16 __attribute__((vector_size(32)));

#define NAN_BITS 0x7FC0u

/* e4m3 byte b times 2^(byte - 127) as bf16 bits, exactly as float32 math then RTNE gives it
   (the float32 product is exact for every scale byte <= 254), any scale byte. Integer only. */
static uint16_t exact_bits(uint32_t b, int byte) {
    uint32_t code = b & 0x7Fu, sign = (b & 0x80u) << 8;
    if (code == 0x7Fu) return NAN_BITS;
    if (byte == 255) return code == 0 ? NAN_BITS : (uint16_t)(sign | 0x7F80u); /* x * inf */
    if (code == 0) return (uint16_t)sign;
    int e = (int)(code >> 3);
    int M = e ? 8 + (int)(code & 7u) : (int)(code & 7u);
    int E = (e ? e : 1) - 10 + (byte - 127); /* value = M * 2^E */
    while (M < 8) { M <<= 1; E -= 1; }
    int x = E + 3; /* value = (M / 8) * 2^x, M in 8..15 */
    if (x > 127) return (uint16_t)(sign | 0x7F80u);
    if (x >= -126) return (uint16_t)(sign | ((uint32_t)(x + 127) << 7) | ((uint32_t)(M - 8) << 4));
    /* a bf16 subnormal f * 2^-133: f = M * 2^(x + 130), rounded to nearest even */
    int sh = x + 130, f;
    if (sh >= 0) f = M << sh;
    else if (-sh > 5) f = 0;
    else {
        int s = -sh, q = M >> s, rem = M & ((1 << s) - 1), half = 1 << (s - 1);
        f = q + (rem > half || (rem == half && (q & 1)));
    }
    return (uint16_t)(sign | (uint32_t)f);
}

static void decode_group_exact(const uint8_t *restrict d, uint16_t *restrict o, int byte) {
    for (int j = 0; j < 64; j++) o[j] = exact_bits(d[j], byte);
}

/* Scale bytes 10..246 (k = byte - 127 in [-117, 119]), the common case first: for normal and
   zero codes the bits are sign | (code ? (code << 4) + (120 + k) << 7 : 0). Returns nonzero when
   the group held a subnormal (1..7) or NaN (0x7F) code, whose lanes this form gets wrong: the
   caller then redoes the group with decode_group_vector. */
static int decode_group_normal(const uint8_t *restrict d, uint16_t *restrict o, int k) {
    const u16x16 cn = (u16x16){0} + (uint16_t)((120 + k) << 7);
    u8x16 special = {0};
    for (int j = 0; j < 64; j += 16) {
        u8x16 xb;
        memcpy(&xb, d + j, 16);
        u8x16 cb = xb & 0x7F;
        special |= (u8x16)((u8x16)(cb - 1) < 7) | (u8x16)(cb == 0x7F);
        u16x16 x = __builtin_convertvector(xb, u16x16);
        u16x16 code = x & 0x7F;
        u16x16 nz = (u16x16)((i16x16)code != 0);
        u16x16 r = (nz & ((code << 4) + cn)) | ((x << 8) & 0x8000);
        memcpy(o + j, &r, 32);
    }
    uint64_t w[2];
    memcpy(w, &special, 16);
    return (w[0] | w[1]) != 0;
}

/* Scale bytes 10..246, any code: subnormal codes m = 1..7 (m * 2^-9) get exponent
   118 + k + h (h = 0, 1, 2 for m in 1, 2..3, 4..7) and fraction (m << (7 - h)) & 0x7F;
   NaN codes 0x7FC0. */
static void decode_group_vector(const uint8_t *restrict d, uint16_t *restrict o, int k) {
    const u16x16 cn = (u16x16){0} + (uint16_t)((120 + k) << 7);
    const u16x16 cs = (u16x16){0} + (uint16_t)((118 + k) << 7);
    for (int j = 0; j < 64; j += 16) {
        u8x16 xb;
        memcpy(&xb, d + j, 16);
        u16x16 x = __builtin_convertvector(xb, u16x16);
        u16x16 code = x & 0x7F;
        u16x16 sign = (x << 8) & 0x8000;
        u16x16 norm = (code << 4) + cn;
        i16x16 c = (i16x16)code;
        u16x16 ge2 = (u16x16)(c > 1), ge4 = (u16x16)(c > 3), issub = (u16x16)(c < 8);
        u16x16 nz = (u16x16)(c != 0), nan = (u16x16)(c == 0x7F);
        u16x16 mul = 128 - (ge2 & 64) - (ge4 & 32);
        u16x16 sub = (cs + ((ge2 & 128) + (ge4 & 128))) | ((code * mul) & 0x7F);
        u16x16 v = (issub & nz & sub) | (~issub & norm);
        u16x16 r = (nan & NAN_BITS) | (~nan & (v | sign));
        memcpy(o + j, &r, 32);
    }
}

void dsv4_decode_row_bf16(const uint8_t *restrict d, const uint8_t *restrict sc, uint16_t *restrict o) {
    for (int g = 0; g < 7; g++) {
        int byte = sc[g];
        if (byte < 10 || byte > 246) decode_group_exact(d + 64 * g, o + 64 * g, byte);
        else if (decode_group_normal(d + 64 * g, o + 64 * g, byte - 127))
            decode_group_vector(d + 64 * g, o + 64 * g, byte - 127);
    }
    memcpy(o + 448, d + 448, 128); /* RoPE dims: little-endian bf16 bytes */
}

#if defined(__SSE2__)
#include <immintrin.h>
#define HAVE_STREAM 1
/* Non-temporal stores of n bytes (a multiple of 64) from an aligned buffer: a large gather's
   output is not read back before it leaves the caches, so this skips reading every written line
   first (the write-allocate), about a third of the memory traffic. */
static inline void stream_bytes(void *dst, const void *src, int n) {
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
#define HAVE_STREAM 0
static inline void stream_bytes(void *dst, const void *src, int n) { memcpy(dst, src, n); }
#endif

static void write_row(void *out, int64_t o, int out_f32, const uint16_t *row, int stream) {
    if (out_f32) {
        uint32_t t[512] __attribute__((aligned(64)));
        for (int j = 0; j < 512; j++) t[j] = (uint32_t)row[j] << 16;
        if (stream) stream_bytes((uint32_t *)out + o, t, 2048);
        else memcpy((uint32_t *)out + o, t, 2048);
    } else if (stream) {
        stream_bytes((uint16_t *)out + o, row, 1024);
    } else {
        memcpy((uint16_t *)out + o, row, 1024);
    }
}

static void decode_to(void *out, int64_t o, int out_f32, const uint8_t *d, const uint8_t *sc, int stream) {
    if (out_f32 || stream) {
        uint16_t t[512] __attribute__((aligned(64)));
        dsv4_decode_row_bf16(d, sc, t);
        write_row(out, o, out_f32, t, stream);
    } else {
        dsv4_decode_row_bf16(d, sc, (uint16_t *)out + o);
    }
}

static void nan_row(void *out, int64_t o, int out_f32) {
    uint16_t t[512] __attribute__((aligned(64)));
    for (int j = 0; j < 512; j++) t[j] = NAN_BITS;
    write_row(out, o, out_f32, t, 0);
}

static inline int64_t page_of(const void *bt, int bt_int64, int64_t i) {
    return bt_int64 ? ((const int64_t *)bt)[i] : (int64_t)((const int32_t *)bt)[i];
}

#define AHEAD 32 /* rows prefetched ahead: pages in block-table order are scattered */

/* Rows [row0, row1) of the requests' rows laid back to back (cum: [R + 1] prefix sums of the
   gather lengths). Row i of request b is position seq[b] - (cum[b+1] - cum[b]) + i, read from
   page bt[b * bt_s0 + pos / S] slot pos % S, written at element out + b * out_s0 +
   (offset + i) * out_s1 (bf16, or float32 holding the bf16 values) when offset + i < out_rows.
   stream: write with non-temporal stores (calls whose output is larger than the caches). */
void dsv4_gather_dequant_rows(void *out, int64_t out_s0, int64_t out_s1, int64_t out_rows, int out_f32, int stream,
                              const uint8_t *cache, int64_t page_stride, int64_t num_blocks, int64_t S,
                              const int64_t *seq, const int64_t *cum,
                              const void *bt, int bt_int64, int64_t bt_s0, int64_t bt_w,
                              int64_t offset, int64_t R, int64_t row0, int64_t row1) {
    int64_t lo = 0, hi = R; /* the request holding row0: cum[b] <= row0 < cum[b + 1] */
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (cum[mid] <= row0) lo = mid; else hi = mid;
    }
    for (int64_t b = lo, r = row0; r < row1 && b < R; b++) {
        int64_t g = cum[b + 1] - cum[b];
        if (g <= 0) continue;
        int64_t i0 = r - cum[b];
        int64_t i1 = (row1 < cum[b + 1] ? row1 : cum[b + 1]) - cum[b];
        r = cum[b] + i1;
        if (offset + i1 > out_rows) i1 = out_rows - offset; /* rows past out: not written */
        if (i1 <= i0) continue;
        int64_t pos = seq[b] - g + i0;
        int64_t blk = pos >= 0 ? pos / S : -1, p = pos >= 0 ? pos - blk * S : 0;
        int64_t ia = i0 + AHEAD < i1 ? i0 + AHEAD : i1;
        int64_t pa_pos = seq[b] - g + ia;
        int64_t blka = pa_pos >= 0 ? pa_pos / S : -1, pa = pa_pos >= 0 ? pa_pos - blka * S : 0;
        const uint8_t *base = 0;
        for (int64_t i = i0; i < i1; i++) {
            int64_t o = b * out_s0 + (offset + i) * out_s1;
            if (i == i0 || p == 0) {
                int64_t page = (blk >= 0 && blk < bt_w) ? page_of(bt, bt_int64, b * bt_s0 + blk) : -1;
                base = (page >= 0 && page < num_blocks) ? cache + page * page_stride : 0;
            }
            if (ia < i1) {
                if (blka >= 0 && blka < bt_w) {
                    int64_t pg = page_of(bt, bt_int64, b * bt_s0 + blka);
                    if (pg >= 0 && pg < num_blocks) {
                        const uint8_t *ba = cache + pg * page_stride;
                        for (int l = 0; l < 576; l += 64) __builtin_prefetch(ba + pa * 576 + l, 0, 3);
                        __builtin_prefetch(ba + S * 576 + pa * 8, 0, 3);
                    }
                }
                ia++;
                if (blka < 0) { if (++pa_pos >= 0) { blka = 0; pa = 0; } }
                else if (++pa == S) { pa = 0; blka++; }
            }
            if (base) decode_to(out, o, out_f32, base + p * 576, base + S * 576 + p * 8, stream);
            else nan_row(out, o, out_f32);
            if (blk < 0) { if (++pos >= 0) { blk = 0; p = 0; base = 0; } }
            else if (++p == S) { p = 0; blk++; }
        }
    }
#if HAVE_STREAM
    if (stream) _mm_sfence(); /* the streamed rows are visible before the call returns */
#endif
}

/* exact_bits for other records' decoders (kvcache_v41.c: the 528-byte mxfp8 records). */
uint16_t dsv4_e4m3_scaled_bits(uint32_t b, int32_t byte) { return exact_bits(b, byte); }
