/* dsv4-prefill's CPU kernels: the public C interface (framework-free; plain pointers).

   Both frameworks call these: dsv4_torch through ctypes (dsv4_cpu/binding.py), dsv4_jax through
   the XLA FFI handlers of xla_ffi.cc (a second library linked against this one, so one copy of
   the kernels serves both). Built once per machine by dsv4_cpu/build.py (`python -m dsv4_cpu build`).

   Every entry point checks its arguments before it forms a pointer from them: a bad argument
   returns DSV4_ERR_ARG and dsv4_cpu_last_error() names it; nothing outside the arrays described
   by the arguments is read or written. Index arithmetic is 64-bit.

   Threads: every call takes a `dsv4_parallel` saying how it may run work in parallel: on the host
   framework's threads (torch's intra-op pool through at::parallel_for, XLA's intra-op pool
   through its FFI thread pool), on this library's own pool (standalone use), or, with NULL, on
   the calling thread only. A call's results never depend on the threads it ran on.

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

enum { DSV4_BF16 = 0, DSV4_F32 = 1, DSV4_FP8_E4M3 = 2 /* OCP e4m3 bytes: the indexer's queries and keys */ };

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

/* How a call runs its parallel work.
   threads: how many threads the call may use (>= 1; the call uses fewer when its work is small).
   Then at most one of:
     run (fork-join, e.g. at::parallel_for): run(ctx, n, fn, arg) calls fn(arg, i) for every i in
       [0, n), concurrently on up to n threads, and returns when every call has returned;
     schedule (a task pool, e.g. XLA's): schedule(ctx, fn, arg) runs fn(arg) once, later, on one of
       the pool's threads; the library waits only for the tasks that started before its work ran
       out (a task that starts later returns at once).
   With neither, the library's own pool of `threads - 1` workers (created on first use). */
typedef void (*dsv4_index_fn)(void *arg, int64_t i);
typedef void (*dsv4_task_fn)(void *arg);
typedef struct {
    int32_t threads;
    void (*run)(void *ctx, int64_t n, dsv4_index_fn fn, void *arg);
    void (*schedule)(void *ctx, dsv4_task_fn fn, void *arg);
    void *ctx;
} dsv4_parallel;

/* Kinds of a prefill layer (what its compressed part holds). */
enum { DSV4_SWA = 0, DSV4_CSA = 1, DSV4_HCA = 2 };

/* Layouts of a dsv4_kv_source: rows (bf16 / float32), vLLM's fp8_ds_mla attention pages, vLLM's
   indexer key pages (see the Lightning Indexer below). */
enum { DSV4_ROWS = 0, DSV4_FP8_DS_MLA = 1, DSV4_KV_INDEX_FP8 = 2, DSV4_MXFP8_SPLIT = 3, DSV4_MXFP8_INTERLEAVED = 4 };

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
   formats 3 / 4, DeepSeek-V4.1's 528-byte mxfp8 records (D = 512; see dsv4_gather_mxfp8): pages as
     format 1, slots split (3: all data, then all scales) or interleaved (4: vLLM 0.33's).
   A row whose page, offset or index is outside the arrays reads as NaN (never out of bounds).
   The caller vouches that data holds num_rows rows (flat / logical) or num_pages pages, and the
   table table_rows x table_width entries; every index taken from them is checked against those. */
typedef struct {
    int32_t format;       /* DSV4_ROWS (rows in dtype), DSV4_FP8_DS_MLA, DSV4_KV_INDEX_FP8 */
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
   attn_sink [H] float32 or NULL (no sink). par: see dsv4_parallel (NULL: the calling thread). */
int dsv4_sparse_attention(const void *q, int64_t q_s0, int64_t q_s1, int32_t dtype, int64_t T, int64_t H, int64_t D,
                          const void *kv, int64_t kv_s0, int64_t S, const int32_t *indices, int64_t idx_s0, int64_t K,
                          const int32_t *topk_length, float sm_scale, const float *attn_sink,
                          const dsv4_outputs *outputs, const dsv4_parallel *par, int32_t isa);

/* The key sets of one layer's prefill tokens (spec section 3, without the workspace): token t
   (plan order) at absolute position p = token_position[t] of request b = token_request[t] reads
     compressed part: CSA: the first min((p+1)//r, topk_width) entries of its top-k row
       (topk + token_row[t] * topk_stride; entries outside 0 .. (p+1)//r - 1 are skipped);
       HCA: entries 0 .. (p+1)//r - 1; SWA: none;
     window part: raw positions max(0, p-W+1, token_window_start[t]) .. p (token_window_start
       NULL: 0 for every token; DeepSeek-V4.1's replay_start and replay-band floors);
   and writes row token_row[t] of q / out.
   Checked before any work, for every token: 0 <= token_row < q_rows (and < topk_rows for CSA),
   0 <= token_request < each source's table_rows (a source with a table), 0 <= position <
   DSV4_MAX_POSITION, 0 <= token_window_start <= position (when given), and the position's raw row and visible compressed entries addressable in the
   sources (a block table wide enough, logical rows present): a ValueError-style DSV4_ERR_ARG
   naming the token otherwise, before anything is allocated. */
typedef struct {
    int32_t kind;            /* DSV4_SWA, DSV4_CSA, DSV4_HCA */
    int32_t window;          /* W >= 1 */
    int32_t compress_ratio;  /* r >= 1 (CSA / HCA) */
    int64_t num_tokens;
    const int32_t *token_row;
    const int32_t *token_request;
    const int32_t *token_position;
    const void *topk;        /* CSA: [topk_rows, topk_stride] int32 / int64 */
    int32_t topk_int64;
    int64_t topk_stride;
    int64_t topk_width;
    int64_t topk_rows;
    const int32_t *token_window_start; /* NULL, or the lowest window position of each token */
} dsv4_prefill_tokens;

/* Positions a prefill token may have: below 2^31 - 2^20 (room for the window and ratio math). */
#define DSV4_MAX_POSITION ((int64_t)2147483647 - (1 << 20))

/* One prefill layer straight from the caches (no workspace): q [q_rows, H, D]; raw = the window
   cache, comp = the compressed cache (NULL for SWA). Rows of out not named by token_row are not
   written. Sources of DSV4_ROWS must hold q's dtype; fp8_ds_mla pages serve bf16 and float32 q. */
int dsv4_prefill_attention(const void *q, int64_t q_s0, int64_t q_s1, int32_t dtype, int64_t q_rows, int64_t H,
                           int64_t D, const dsv4_prefill_tokens *tokens, const dsv4_kv_source *raw,
                           const dsv4_kv_source *comp, float sm_scale, const float *attn_sink,
                           const dsv4_outputs *outputs, const dsv4_parallel *par, int32_t isa);

/* vLLM's dequantize_and_gather_k_cache on fp8_ds_mla pages (spec: shared/docs/real-formats.md):
   for request b < R, rows i < g_b (g_b = gather_lens[b], or seq_lens[b] when gather_lens is NULL)
   are positions seq_lens[b] - g_b + i (a negative position reads as NaN), read from page
   block_table[b * bt_s0 + pos / page_size] slot pos % page_size of `cache` (num_pages pages of
   page_stride bytes) and written to out + b * out_s0 + (offset + i) * out_s1 elements (bf16, or
   float32 holding the bf16 values when out_f32) while offset + i < out_rows; row i of a request
   whose page is outside the cache or the table (bt_w entries per row) is NaN. seq_lens /
   gather_lens int64 [R]; block_table int32 or int64. */
int dsv4_gather_dequant(void *out, int64_t out_s0, int64_t out_s1, int64_t out_rows, int32_t out_f32,
                        const uint8_t *cache, int64_t page_stride, int64_t num_pages, int64_t page_size,
                        const int64_t *seq_lens, const int64_t *gather_lens, const void *block_table,
                        int32_t bt_int64, int64_t bt_s0, int64_t bt_w, int64_t offset, int64_t R,
                        const dsv4_parallel *par);

/* dsv4_gather_dequant splits a call across threads only with at least this many rows per thread,
   and writes with non-temporal stores when its output is larger than this many bytes. */
#define DSV4_GATHER_PARALLEL_ROWS 4096
#define DSV4_GATHER_STREAM_BYTES ((int64_t)8 << 20)

/* One thread's share of a gather: rows [row0, row1) of the requests' rows laid back to back
   (cum [R + 1]: prefix sums of the gather lengths, seq [R] int64), as dsv4_gather_dequant
   describes them; stream: write with non-temporal stores (for outputs larger than the caches). */
void dsv4_gather_dequant_rows(void *out, int64_t out_s0, int64_t out_s1, int64_t out_rows, int out_f32, int stream,
                              const uint8_t *cache, int64_t page_stride, int64_t num_blocks, int64_t page_size,
                              const int64_t *seq, const int64_t *cum, const void *bt, int bt_int64, int64_t bt_s0,
                              int64_t bt_w, int64_t offset, int64_t R, int64_t row0, int64_t row1);

/* fn(arg, begin, end) over [0, n) in contiguous ranges of at least `grain` items each, on the
   threads `par` allows (XLA FFI handlers use it for their own loops). */
void dsv4_parallel_for(const dsv4_parallel *par, int64_t n, int64_t grain,
                       void (*fn)(void *arg, int64_t begin, int64_t end), void *arg);

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
   bf16 bits, exactly (kvcache.c). */
void dsv4_decode_row_bf16(const uint8_t *d, const uint8_t *sc, uint16_t *o);

/* DeepSeek-V4.1's 528-byte mxfp8 records (kvcache_v41.c; planner/kvcache_v41.py): 512 e4m3 dims +
   16 UE8M0 scale bytes (one per 32 dims), value e4m3 * 2^(byte - 127) rounded to bf16. A page of
   page_size slots holds them interleaved (interleaved = 1: slot p's data at byte p * 528, its
   scales right after; vLLM 0.33's) or split (0: data at p * 512, scales at page_size * 512 +
   p * 16). dsv4_gather_mxfp8: vLLM's dequantize_and_gather_k_cache on such pages, with the
   arguments and row rules of dsv4_gather_dequant. */
int dsv4_gather_mxfp8(void *out, int64_t out_s0, int64_t out_s1, int64_t out_rows, int32_t out_f32,
                      const uint8_t *cache, int64_t page_stride, int64_t num_pages, int64_t page_size,
                      int32_t interleaved, const int64_t *seq_lens, const int64_t *gather_lens, const void *block_table,
                      int32_t bt_int64, int64_t bt_s0, int64_t bt_w, int64_t offset, int64_t R,
                      const dsv4_parallel *par);
void dsv4_gather_mxfp8_rows(void *out, int64_t out_s0, int64_t out_s1, int64_t out_rows, int32_t out_f32,
                            const uint8_t *cache, int64_t page_stride, int64_t num_pages, int64_t page_size,
                            int32_t interleaved, const int64_t *seq, const int64_t *cum, const void *bt,
                            int32_t bt_int64, int64_t bt_s0, int64_t bt_w, int64_t offset, int64_t R, int64_t row0,
                            int64_t row1, int32_t stream);
/* One record's 512 data bytes and 16 scale bytes as 512 bf16 bits, exactly; _to: bf16 or float32
   (out_f32) at dst. dsv4_mxfp8_slot: slot p's data and scales in a page. dsv4_mxfp8_address: entry
   e of request b of a format 3 / 4 source (0 when its page is outside the arrays). */
void dsv4_decode_mxfp8_bf16(const uint8_t *d, const uint8_t *sc, uint16_t *o);
void dsv4_decode_mxfp8_to(const uint8_t *d, const uint8_t *sc, void *dst, int32_t out_f32);
int dsv4_mxfp8_slot(const uint8_t *page, int64_t page_size, int64_t p, int32_t interleaved, const uint8_t **d,
                    const uint8_t **sc);
int dsv4_mxfp8_address(const dsv4_kv_source *s, int64_t b, int64_t e, const uint8_t **d, const uint8_t **sc);
/* e4m3 byte b times 2^(byte - 127) as bf16 bits, as float32 math then RTNE gives it (kvcache.c). */
uint16_t dsv4_e4m3_scaled_bits(uint32_t b, int32_t byte);

/* ---------------------------------------------------------------- the Lightning Indexer

   dsv4-prefill's CPU Lightning Indexer: the public C interface (framework-free; plain pointers).

   One call scores a layer's prefill tokens against the compressed index keys of their requests
   and keeps each token's top-k, fused: logits in key blocks shared by the tokens of a request,
   ReLU and the head-weighted sum in registers, a running top-k per token. No tokens x keys logits
   buffer exists; memory is O(threads x tile tokens x k).

     logit[t, s] = scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])     for s < (p + 1) / r

   (p = token_position[t], r = compress_ratio; scale[s] = the key's fp32 scale for fp8 keys, 1 for
   rows). Products of the input values are exact in float32 for bf16 / e4m3 inputs and accumulated
   in float32, dims in order within a head's dot product, heads in order within the sum; float32
   inputs: float32 products. The same on every instruction set up to float32 rounding of the
   accumulation (`dsv4_cpu_isa_name`).

   Tie rule (planner/indexer_oracle.py): token t keeps min(topk, visible) entries, the largest
   logits first and, among equal logits, the lower entry index first; NaN ranks below every
   number. Row token_row[t] of out_idx lists them in that order, then -1; out_logits (optional)
   their float32 logits, then -inf.

   vLLM's indexer key pages (dsv4_kv_source.format DSV4_KV_INDEX_FP8, its `indexer_k_quant_and_cache`
   layout): page p starts at byte p * page_stride of data and holds page_size slots of D e4m3 bytes,
   then page_size little-endian float32 scales (slot j's at byte page_size * D + 4 * j); entry e of
   request b is slot e % page_size of page table[b * table_stride + e / page_size]. DSV4_ROWS
   sources (bf16 or float32 rows, flat / logical / paged) serve too. */

/* The Lightning Indexer's top-k for the tokens of `tokens` (a dsv4_prefill_tokens: num_tokens,
   token_row, token_request, token_position and compress_ratio are read; kind, window and the
   top-k fields are not).
   q [rows, H, D] (strides q_s0, q_s1 elements, last dim contiguous) in q_dtype (DSV4_BF16,
   DSV4_F32, DSV4_FP8_E4M3); weights [rows, H] float32 (row stride w_s0); keys: D-dim index keys.
   out_idx [rows, topk] int32 (row stride idx_s0); out_logits [rows, topk] float32 (row stride
   logit_s0) or NULL. Rows not named by token_row are not written.
   Checked before any work: 0 <= token_row < rows and 0 <= position < DSV4_MAX_POSITION for every
   token, and every key a token sees readable (its request a row of the keys' table, its
   block-table entries pages of the cache, its logical rows present): DSV4_ERR_ARG naming the token
   or the request and the entry otherwise. par: see dsv4_parallel (NULL: the calling thread); isa:
   as in dsv4_cpu.h (-1: the best allowed). */
int dsv4_indexer_topk(const void *q, int64_t q_s0, int64_t q_s1, int32_t q_dtype, int64_t rows, int64_t H, int64_t D,
                      const float *weights, int64_t w_s0, const dsv4_prefill_tokens *tokens, const dsv4_kv_source *keys,
                      int64_t topk, int32_t *out_idx, int64_t idx_s0, float *out_logits, int64_t logit_s0,
                      const dsv4_parallel *par, int32_t isa);

/* The instruction set dsv4_indexer_topk runs for these dtypes (q_dtype; key_dtype DSV4_BF16,
   DSV4_F32 or DSV4_FP8_E4M3 for fp8 pages) when asked for `isa` (-1: the best allowed), or -1
   with dsv4_cpu_last_error() set. */
int dsv4_indexer_isa(int32_t q_dtype, int32_t key_dtype, int32_t isa);

/* DeepSeek-V4.1's two-level top-k (planner/indexer_oracle.py states the rules; vLLM's and
   transformers' `select_candidate_blocks`). Blocks are request-local: block i of a request holds
   its entries i * block_size .. i * block_size + block_size - 1.

   DSV4_CANDIDATES_SELECT (level 1, the candidate source): the call's top-k is the ordinary one,
   and row token_row[t] of `blocks` gets token t's candidate blocks: the block of its newest
   visible entry, (visible - 1) / block_size, first; then its other blocks by score (the max
   logit of the block's entries, NaN if any is NaN) descending, the lower block first on equal
   scores, blocks scoring -inf or NaN dropped; topk_blocks in all, then -1. Streaming: a running
   top-(topk_blocks - 1) of completed blocks per token, no logits buffer.

   DSV4_CANDIDATES_RESTRICT (level 2, a later index source): row token_row[t] of `blocks` lists
   token t's candidate blocks (topk_blocks columns, -1 = none, any order). Only the visible
   entries of those blocks are scored and selectable (gathered per token: the cost of a token is
   at most topk_blocks * block_size entries, whatever its context); its top-k among them by the
   tie rule, min(topk, selectable) entries, then -1. Checked before any work: each listed block
   is one the token sees, in [0, ceil(visible / block_size)), and listed once (DSV4_ERR_ARG
   naming the token, the column and the block otherwise).

   Both: topk_blocks * block_size must hold topk entries. */
enum { DSV4_CANDIDATES_SELECT = 1, DSV4_CANDIDATES_RESTRICT = 2 };
typedef struct {
    int32_t mode;         /* DSV4_CANDIDATES_SELECT or DSV4_CANDIDATES_RESTRICT */
    int64_t block_size;   /* entries per block, >= 1 */
    int64_t topk_blocks;  /* blocks per row (the columns of `blocks`), >= 1 */
    int32_t *blocks;      /* [rows, topk_blocks], row stride blocks_s0 (>= topk_blocks): written (select) or read (restrict) */
    int64_t blocks_s0;
} dsv4_index_candidates;

/* dsv4_indexer_topk with the two-level top-k: the same arguments, and `cand` (NULL: none, the
   same as dsv4_indexer_topk). */
int dsv4_indexer_topk_candidates(const void *q, int64_t q_s0, int64_t q_s1, int32_t q_dtype, int64_t rows, int64_t H,
                                 int64_t D, const float *weights, int64_t w_s0, const dsv4_prefill_tokens *tokens,
                                 const dsv4_kv_source *keys, int64_t topk, int32_t *out_idx, int64_t idx_s0,
                                 float *out_logits, int64_t logit_s0, const dsv4_parallel *par, int32_t isa,
                                 const dsv4_index_candidates *cand);

/* The library's version of this header (a binding checks it against its own). */
#define DSV4_CPU_ABI 4
int dsv4_cpu_abi(void);

#ifdef __cplusplus
}
#endif

#endif
