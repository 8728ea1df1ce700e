// Internals shared by the dispatcher (attention.cc) and the per-instruction-set token kernels
// (attention_isa.cc and attention_bf16.cc, compiled once per instruction set with their own flags).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

namespace dsv4 {

// Keys per block of the online softmax. Every kernel processes a token's keys in blocks of KB
// (the last one padded with zero rows whose probabilities are exactly 0).
constexpr int KB = 48;

// A growable, 64-byte aligned buffer.
struct Buffer {
    void *p = nullptr;
    size_t n = 0;
    ~Buffer() { std::free(p); }
    void *get(size_t bytes) {
        if (bytes > n) {
            std::free(p);
            n = (bytes + 4095) & ~size_t(4095);
            p = std::aligned_alloc(64, n);
            if (!p) {
                n = 0;
                throw std::bad_alloc();
            }
        }
        return p;
    }
    template <class T>
    T *as(size_t count) { return static_cast<T *>(get(count * sizeof(T) + 64)); }
};

// One thread's scratch: reused across calls (thread_local in the dispatcher).
struct Scratch {
    Buffer q, s, p, v, o, stat, keys, stage, misc;  // misc: the dispatcher's key lists
};

// One token's attention: rows of H heads (q, head stride q_hs elements), n keys given as row
// pointers (D elements each, the token's dtype; NaN rows for unreadable keys), in order.
struct TokenJob {
    const void *q;
    int64_t q_hs;
    int64_t H, D, dv;
    const void *const *keys;
    int64_t n;
    float scale;
    const float *sink;  // [H] or nullptr
    void *out;          // [H, dv], head stride out_hs, the token's dtype
    int64_t out_hs;
    float *max_logits;  // [H] or nullptr
    float *lse;         // [H] or nullptr
    const void *zero_row;  // D zero elements of the dtype: padding keys
};

using TokenFn = void (*)(const TokenJob &, Scratch &);

// The token kernel of one instruction set for one dtype (0 bf16, 1 float32), or nullptr when that
// instruction set has no kernel for the dtype or the shape (D, dv).
TokenFn token_kernel_generic(int dtype, int64_t D, int64_t dv);

// A fast fp8_ds_mla slot decoder of one instruction set (bit-exact with dsv4_decode_row_bf16; returns
// false for the slots it does not handle), or nullptr.
using RowDecodeFn = bool (*)(const uint8_t *d, const uint8_t *sc, uint16_t *o);
RowDecodeFn row_decoder_generic();
RowDecodeFn row_decoder_avx2();
RowDecodeFn row_decoder_avx512();
RowDecodeFn row_decoder_avx512bf16();
TokenFn token_kernel_avx2(int dtype, int64_t D, int64_t dv);
TokenFn token_kernel_avx512(int dtype, int64_t D, int64_t dv);
TokenFn token_kernel_avx512bf16(int dtype, int64_t D, int64_t dv);

}  // namespace dsv4
