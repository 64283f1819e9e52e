// src_info: where a dispatched row came from, one int32 per row (epserve/dispatch/host_plan.py packs it).
//   bits  0..3   slot j      (top_k <= 16)
//   bits  4..23  token t     (max_tokens_per_rank <= 2^20)
//   bits 24..30  source rank (world <= 128); the sign bit stays clear
#pragma once
#include "common/types.cuh"

namespace epserve {

struct RowSource {
  int rank, token, slot;
};

__device__ __forceinline__ RowSource decode_src_info(int v) {
  return RowSource{(v >> 24) & 0x7f, (v >> 4) & 0xfffff, v & 0xf};
}

}  // namespace epserve
