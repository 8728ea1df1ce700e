/* dsv4-prefill's CPU kernels: the public C interface (framework-free; plain pointers).

   Both frameworks call these: dsv4_torch through ctypes, dsv4_jax through XLA FFI handlers
   (dsv4_jax/kernels/csrc/cpu_ffi.cc). Built once per machine by planner/ckernel.py.

   Sparse attention (the FlashMLA `flash_mla_sparse_fwd` contract, spec section 2):
     P[t,h,k] = sm_scale * <q[t,h,:D], key_k[:D]> over token t's valid keys;
     out[t,h]  = sum_k exp(P - lse) v_k / (1 + exp(sink_h - lse)),  v_k = key_k[:d_v];
     lse = ln sum_k exp(P), max_logits = max_k P; a token with no valid key gets out 0,
     lse +inf, max_logits -inf. Duplicated keys count once per occurrence.
   Numerics: bf16 inputs: bf16 x bf16 products accumulated in fp32, the probabilities rounded to
   bf16 before the PV product (FlashMLA's); fp32 inputs: fp32 throughout. Same contract on every
   instruction set (`dsv4_cpu_isa_name`).
*/
#ifndef DSV4_CPU_H
#define DSV4_CPU_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { DSV4_BF16 = 0, DSV4_F32 = 1 };

/* Instruction sets, lowest first. `isa` arguments: -1 = the best this machine runs (capped by
   the environment variable DSV4_PREFILL_CPU_ISA=generic|avx2|avx512|avx512bf16|amx). */
enum { DSV4_ISA_GENERIC = 0, DSV4_ISA_AVX2 = 1, DSV4_ISA_AVX512 = 2, DSV4_ISA_AVX512BF16 = 3, DSV4_ISA_AMX = 4 };

/* Return codes. */
enum {
    DSV4_OK = 0,
    DSV4_ERR_ARG = 1,     /* a bad argument: dsv4_cpu_last_error() names it */
    DSV4_ERR_ISA = 2,     /* the requested instruction set cannot run here */
    DSV4_ERR_MEMORY = 3,  /* an allocation failed */
};

/* A source of key rows: the latents a key index (generic call) or a (request, entry) pair
   (prefill) resolves to. Rows are D elements, last dim contiguous.
   format 0, rows in `dtype`:
     page_size == 0, table == NULL: flat rows, row i at data + i * row_stride, 0 <= i < num_rows;
     page_size == 0, table != NULL: logical rows, entry e of request b is flat row table[b] + e;
     page_size > 0: paged rows, entry e of request b is slot e % page_size of page
       table[b * table_stride + e / page_size], at data + page * page_stride + slot * row_stride.
   format 1, vLLM's fp8_ds_mla pages (D = 512): page p starts at byte p * page_stride of data,
     page_size slots (448 e4m3 dims + 64 bf16 RoPE dims per slot, then 8 scale bytes per slot);
     rows dequantize exactly as dequantize_and_gather_k_cache does.
   A row whose page, offset or index is outside the arrays reads as NaN (never out of bounds). */
typedef struct {
    int32_t format;       /* 0: rows in dtype; 1: fp8_ds_mla pages */
    int32_t dtype;        /* format 0: DSV4_BF16 / DSV4_F32 */
    const void *data;
    int64_t row_stride;   /* elements between slots (format 0) */
    int64_t num_rows;     /* flat / logical rows: rows addressable from data */
    int64_t page_stride;  /* paged: elements (format 0) or bytes (format 1) between pages */
    int64_t num_pages;
    int64_t page_size;    /* slots per page; 0 = not paged */
    const void *table;    /* block table [table_rows, table_width] or offsets [table_rows] */
    int32_t table_int64;
    int64_t table_stride; /* elements between block-table rows */
    int64_t table_width;
    int64_t table_rows;
} dsv4_kv_source;

/* Outputs of both calls: out [T, H, d_v] in q's dtype (d_v = 512 if D >= 512 else D), element
   strides out_s0 / out_s1, last dim contiguous; max_logits / lse [T, H] float32 (row stride
   stat_s0), either may be NULL. */
typedef struct {
    void *out;
    int64_t out_s0, out_s1;
    float *max_logits;
    float *lse;
    int64_t stat_s0;
} dsv4_outputs;

/* sparse_attention on a flat workspace. q [T, H, D] (strides q_s0, q_s1, last dim contiguous),
   kv [S, D] (row stride kv_s0), both `dtype`. indices [T, K] int32 (row stride idx_s0): an entry
   is valid iff 0 <= idx < S and its column < topk_length[t] (topk_length NULL: K).
   attn_sink [H] float32 or NULL (no sink). threads: worker threads (>= 1). */
int dsv4_sparse_attention(const void *q, int64_t q_s0, int64_t q_s1, int32_t dtype, int64_t T, int64_t H, int64_t D,
                          const void *kv, int64_t kv_s0, int64_t S, const int32_t *indices, int64_t idx_s0, int64_t K,
                          const int32_t *topk_length, float sm_scale, const float *attn_sink,
                          const dsv4_outputs *outputs, int32_t threads, int32_t isa);

/* The key sets of one layer's prefill tokens (spec section 3, without the workspace): token t
   (plan order) at absolute position p = token_position[t] of request b = token_request[t] reads
     compressed part: CSA: the first min((p+1)//r, topk_width) entries of its top-k row
       (topk + token_row[t] * topk_stride; entries outside 0 .. (p+1)//r - 1 are skipped);
       HCA: entries 0 .. (p+1)//r - 1; SWA: none;
     window part: raw positions max(0, p-W+1) .. p;
   and writes row token_row[t] of q / out. */
typedef struct {
    int32_t kind;            /* 0 SWA, 1 CSA, 2 HCA */
    int32_t window;          /* W >= 1 */
    int32_t compress_ratio;  /* r >= 1 (CSA / HCA) */
    int64_t num_tokens;
    const int32_t *token_row;
    const int32_t *token_request;
    const int32_t *token_position;
    const void *topk;        /* CSA: [rows, topk_stride] int32 / int64 */
    int32_t topk_int64;
    int64_t topk_stride;
    int64_t topk_width;
} dsv4_prefill_tokens;

/* One prefill layer straight from the caches (no workspace): raw = the window cache, comp = the
   compressed cache (NULL for SWA). q's rows not named by token_row are not written. Sources in
   format 0 must hold q's dtype; fp8_ds_mla pages serve bf16 and float32 q. */
int dsv4_prefill_attention(const void *q, int64_t q_s0, int64_t q_s1, int32_t dtype, int64_t H, int64_t D,
                           const dsv4_prefill_tokens *tokens, const dsv4_kv_source *raw, const dsv4_kv_source *comp,
                           float sm_scale, const float *attn_sink, const dsv4_outputs *outputs, int32_t threads,
                           int32_t isa);

/* The best instruction set this machine runs for `dtype` (after the DSV4_PREFILL_CPU_ISA cap),
   the name of an instruction set, and whether one can run here (1/0). */
int dsv4_cpu_best_isa(int32_t dtype);
const char *dsv4_cpu_isa_name(int32_t isa);
int dsv4_cpu_isa_supported(int32_t isa);

/* One fp8_ds_mla slot decoded as dsv4_prefill_attention's staging decodes it when running at
   instruction set `isa` (-1: the best allowed): the same bits as dsv4_decode_row_bf16 (tests check
   that). Returns DSV4_OK or DSV4_ERR_ISA. */
int dsv4_cpu_decode_row(int32_t isa, const uint8_t *d, const uint8_t *sc, uint16_t *o);

/* The message of this thread's last DSV4_ERR_* return. */
const char *dsv4_cpu_last_error(void);

/* fp8_ds_mla: one slot's 448 e4m3 bytes + 64 bf16 RoPE dims (d) and its 7 scale bytes (sc) as 512
   bf16 bits, exactly (planner/csrc/kvcache.c). */
void dsv4_decode_row_bf16(const uint8_t *d, const uint8_t *sc, uint16_t *o);

#ifdef __cplusplus
}
#endif

#endif
