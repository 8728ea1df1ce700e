/* dsv4-prefill's CPU Lightning Indexer: the public C interface (framework-free; plain pointers).

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
*/
#ifndef DSV4_INDEXER_H
#define DSV4_INDEXER_H

#include <stdint.h>

#include "dsv4_cpu.h"

#ifdef __cplusplus
extern "C" {
#endif

/* q dtype beyond DSV4_BF16 / DSV4_F32: OCP e4m3 bytes (vLLM's fp8 index queries, their scale
   folded into the weights). */
enum { DSV4_FP8_E4M3 = 2 };

/* dsv4_kv_source.format of vLLM's indexer key pages (its `indexer_k_quant_and_cache` layout):
   page p starts at byte p * page_stride of data and holds page_size slots of D e4m3 bytes, then
   page_size little-endian float32 scales (slot j's at byte page_size * D + 4 * j); entry e of
   request b is slot e % page_size of page table[b * table_stride + e / page_size]. Format 0
   sources (bf16 or float32 rows, flat / logical / paged, as in dsv4_cpu.h) serve too. */
enum { DSV4_KV_INDEX_FP8 = 2 };

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

#ifdef __cplusplus
}
#endif

#endif
