// Boundary checks shared by the CPU and CUDA implementations of the kvtier ops.
//
// Every argument error is a TORCH_CHECK (a Python RuntimeError naming the op, the
// argument and the offending value); nothing past these checks can fault on a bad
// argument.
#pragma once

#include <torch/types.h>

#include "copy_plan.h"

namespace kvtier {

enum class Direction { kGather, kScatter };

// Copy strategies of the CUDA implementation (the `strategy` op argument).
// 0 lets the implementation choose (memcpy); the CPU implementation ignores it.
enum class Strategy : std::int64_t { kDefault = 0, kMemcpy = 1, kKernel = 2 };

// Validates layers / block_ids / chunk for `op` and returns the plan. Device
// placement is checked by the caller (it differs per implementation).
//   layers:    non-empty; each a 3-D block view (outer, num_blocks, inner) with a
//              unit-stride last dim; all of one dtype, shape and device.
//   block_ids: 1-D contiguous int64 CPU tensor, every id in [0, num_blocks);
//              for a scatter no id may repeat (a block is written once).
//   chunk:     contiguous uint8 tensor of exactly len(layers)*outer*len(ids)*inner
//              bytes.
BlockPlan check_block_args(const char* op, Direction dir, at::TensorList layers,
                           const at::Tensor& block_ids, const at::Tensor& chunk);

}  // namespace kvtier
