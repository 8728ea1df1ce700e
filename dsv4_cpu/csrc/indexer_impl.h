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
    float *logits;     // [IDX_KB]: logits[j] written for j < nkeys (later ones unspecified)
    int64_t nkeys;     // 1 .. IDX_KB: the keys of the block the caller reads (a token that sees
                       // only part of the last block: the kernel skips the key vectors past it)
};

using IndexBlockFn = void (*)(const IndexBlockJob &);

// n e4m3 (float8_e4m3fn) bytes widened exactly: to bf16 bits (bf16 != nullptr) or to float32
// (f32 != nullptr); 0x7F / 0xFF to NaN. The same values as indexer.cc's table, in vector lanes.
using WidenE4m3Fn = void (*)(const uint8_t *src, int64_t n, uint16_t *bf16, float *f32);

// One instruction set's kernels: the block kernel of each layout (pairs: bf16 products; f32) and
// its e4m3 widening.
struct IndexKernels {
    IndexBlockFn block_pairs, block_f32;
    WidenE4m3Fn widen;
};

IndexKernels index_kernels_generic();
IndexKernels index_kernels_avx2();
IndexKernels index_kernels_avx512();
IndexKernels index_kernels_avx512bf16();

}  // namespace dsv4
