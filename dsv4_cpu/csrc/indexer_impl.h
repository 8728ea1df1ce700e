// Internals shared by the indexer's dispatcher (indexer.cc) and its per-instruction-set block
// kernels (indexer_isa.cc, compiled once per instruction set like attention_isa.cc).
#pragma once

#include <cstdint>

namespace dsv4 {

// Keys per block: every kernel scores a token against IDX_KB staged keys at a time (the last
// block padded with zero keys, whose logits the caller ignores).
constexpr int IDX_KB = 64;

// One token against one staged key block: logits[j] = sum_h w[h] * relu(q_h . key_j), j < IDX_KB,
// heads in order. Two staging layouts:
//   pairs (bf16 products): q as dwords of two bf16 dims, Qp [H][D2]; keys Kp [D2][IDX_KB] dwords
//     (dims 2i, 2i+1 of key j in dword i * IDX_KB + j, the low half the even dim); D2 = ceil(D/2);
//   f32: Qf [H][D] floats, Kt [D][IDX_KB] floats.
struct IndexBlockJob {
    const void *q;     // Qp or Qf of the token
    const float *w;    // [H]
    const void *keys;  // Kp or Kt
    int64_t H;
    int64_t depth;     // D2 (pairs) or D (f32)
    float *logits;     // [IDX_KB], written
};

using IndexBlockFn = void (*)(const IndexBlockJob &);

// The block kernel of one instruction set: pairs = 1 for the bf16 layout, 0 for f32 (nullptr if
// the set has none).
IndexBlockFn index_block_kernel_generic(int pairs);
IndexBlockFn index_block_kernel_avx2(int pairs);
IndexBlockFn index_block_kernel_avx512(int pairs);
IndexBlockFn index_block_kernel_avx512bf16(int pairs);

}  // namespace dsv4
