// CUDA implementations of kvtier::gather_blocks / scatter_blocks: a thin binding.
//
// Checks the device placement, builds the BlockPlan (ops_common.h) and hands it to
// cuda_copy.cu. Includes no CUDA header, so it compiles against a CPU-only torch.
//
// Invariants: the copy is only enqueued on `stream`; the op returns before it
// completes. The caller keeps the layers and the chunk alive, and does not touch the
// bytes being copied, until an event recorded on `stream` after the op has completed
// (the Python wrapper returns such an event as a CopyHandle).
#include <torch/library.h>
#include <torch/types.h>

#include "cuda_copy.h"
#include "ops_common.h"

namespace kvtier {
namespace {

void run(const char* op, Direction dir, at::TensorList layers, const at::Tensor& block_ids,
         const at::Tensor& chunk, std::int64_t stream, std::int64_t strategy) {
  const BlockPlan plan = check_block_args(op, dir, layers, block_ids, chunk);
  const char* chunk_name = dir == Direction::kGather ? "dst" : "src";
  const at::Device dev = layers[0].device();
  TORCH_CHECK(dev.is_cuda(), op, ": ", chunk_name, " is on ", chunk.device(),
              " but the layers are on ", dev, "; the CUDA implementation needs the "
              "layers on a CUDA device");
  TORCH_CHECK(chunk.device().is_cpu() || chunk.device() == dev, op, ": ", chunk_name,
              " is on ", chunk.device(), " but the layers are on ", dev);
  TORCH_CHECK(strategy >= 0 && strategy <= static_cast<std::int64_t>(Strategy::kKernel), op,
              ": unknown strategy ", strategy, " (0 default, 1 memcpy, 2 kernel)");
  const bool use_kernel = static_cast<Strategy>(strategy) == Strategy::kKernel;
  const cuda::CopyKind kind =
      dir == Direction::kGather ? cuda::CopyKind::kGather : cuda::CopyKind::kScatter;
  const std::string err = cuda::copy_blocks(plan, kind, use_kernel, stream, dev.index());
  TORCH_CHECK(err.empty(), op, " (", use_kernel ? "kernel" : "memcpy", " strategy): ", err);
}

void gather_blocks_cuda(at::TensorList layers, const at::Tensor& block_ids,
                        const at::Tensor& dst, std::int64_t stream, std::int64_t strategy) {
  run("gather_blocks", Direction::kGather, layers, block_ids, dst, stream, strategy);
}

void scatter_blocks_cuda(const at::Tensor& src, at::TensorList layers,
                         const at::Tensor& block_ids, std::int64_t stream,
                         std::int64_t strategy) {
  run("scatter_blocks", Direction::kScatter, layers, block_ids, src, stream, strategy);
}

}  // namespace
}  // namespace kvtier

TORCH_LIBRARY_IMPL(kvtier, CUDA, m) {
  m.impl("gather_blocks", &kvtier::gather_blocks_cuda);
  m.impl("scatter_blocks", &kvtier::scatter_blocks_cuda);
}
