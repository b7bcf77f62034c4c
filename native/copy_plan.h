// Block copy plan: the device-independent description of one gather or scatter.
//
// This header depends on the C++ standard library only (no torch, no CUDA), so the
// CPU implementation, the CUDA implementation (.cu, compiled by nvcc) and the torch
// binding all share it.
//
// Chunk layout (the single source of truth is kvtier/ops/layout.py's docstring):
// every layer is a block view (outer, num_blocks, inner) whose inner bytes are
// contiguous; the chunk holds, in this order,
//     for layer in layers: for o in range(outer): for b in block_ids: inner bytes.
//
// Invariants of a BlockPlan built by check_block_args (ops_common.h):
//   * every id in ids[0, num_ids) is in [0, num_blocks);
//   * inner_bytes > 0 and every layer's (outer_stride, block_stride) addresses a
//     region that does not overlap another block's inner bytes;
//   * chunk addresses exactly total_bytes() bytes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvtier {

// One layer's block view, in bytes.
struct LayerGeom {
  std::uintptr_t base;     // address of element (0, 0, 0)
  std::int64_t outer_stride;
  std::int64_t block_stride;
};

struct BlockPlan {
  std::vector<LayerGeom> layers;
  std::int64_t outer = 1;
  std::int64_t num_blocks = 0;
  std::int64_t inner_bytes = 0;
  const std::int64_t* ids = nullptr;  // host memory, num_ids entries
  std::int64_t num_ids = 0;
  std::uintptr_t chunk = 0;  // address of the chunk buffer (host or device)

  std::int64_t num_segments() const {
    return static_cast<std::int64_t>(layers.size()) * outer * num_ids;
  }
  std::int64_t total_bytes() const { return num_segments() * inner_bytes; }
};

// A contiguous byte range that is contiguous on both sides.
struct Run {
  std::uintptr_t cache;
  std::uintptr_t chunk;
  std::int64_t bytes;
};

// The plan's segments in chunk order, with neighbours merged where both the cache
// side and the chunk side are contiguous (consecutive ids in a dense layer, or whole
// layers when blocks and outer rows happen to line up). Chunk offsets of the
// returned runs are strictly increasing and add up to total_bytes().
inline std::vector<Run> build_runs(const BlockPlan& p) {
  std::vector<Run> runs;
  runs.reserve(static_cast<std::size_t>(p.num_segments()));
  std::uintptr_t chunk = p.chunk;
  for (const LayerGeom& g : p.layers) {
    for (std::int64_t o = 0; o < p.outer; ++o) {
      const std::uintptr_t row = g.base + static_cast<std::uintptr_t>(o * g.outer_stride);
      for (std::int64_t i = 0; i < p.num_ids; ++i) {
        const std::uintptr_t cache =
            row + static_cast<std::uintptr_t>(p.ids[i] * g.block_stride);
        if (!runs.empty()) {
          Run& last = runs.back();
          if (last.cache + static_cast<std::uintptr_t>(last.bytes) == cache &&
              last.chunk + static_cast<std::uintptr_t>(last.bytes) == chunk) {
            last.bytes += p.inner_bytes;
            chunk += static_cast<std::uintptr_t>(p.inner_bytes);
            continue;
          }
        }
        runs.push_back(Run{cache, chunk, p.inner_bytes});
        chunk += static_cast<std::uintptr_t>(p.inner_bytes);
      }
    }
  }
  return runs;
}

// Largest power of two (<= 16) that divides every address, stride and size the plan
// touches; the CUDA kernel uses it as its access width.
inline int plan_alignment(const BlockPlan& p) {
  std::uintptr_t bits = static_cast<std::uintptr_t>(p.inner_bytes) | p.chunk | 16u;
  for (const LayerGeom& g : p.layers) {
    bits |= g.base;
    if (p.outer > 1) bits |= static_cast<std::uintptr_t>(g.outer_stride);
    bits |= static_cast<std::uintptr_t>(g.block_stride);
  }
  return static_cast<int>(bits & (~bits + 1));  // lowest set bit
}

}  // namespace kvtier
