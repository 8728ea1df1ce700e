// Internals of DeepSeek-V4.1's mxfp8 records shared by the C++ entry points (gather_v41.cc,
// attention.cc): the check of a format 3 / 4 dsv4_kv_source.
#pragma once

#include <cstdint>
#include <string>

#include "dsv4_cpu.h"

namespace dsv4 {

// DSV4_OK, or DSV4_ERR_ARG naming `n` (D must be 512; pages, a table, page_stride >= page_size * 528).
int check_mxfp8_source(const dsv4_kv_source &s, const std::string &n, int64_t D);

}  // namespace dsv4
