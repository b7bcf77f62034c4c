// kvtier native ops: schemas, argument checks and the CPU implementation.
//
// Schemas (namespace kvtier), one per op, with one implementation per device:
//   gather_blocks(Tensor[] layers, Tensor block_ids, Tensor(a!) dst,
//                 int stream=0, int strategy=0) -> ()
//   scatter_blocks(Tensor src, Tensor(a!)[] layers, Tensor block_ids,
//                  int stream=0, int strategy=0) -> ()
//   alloc_pinned(int nbytes) -> (Tensor, bool)        (pinned.cpp)
//   build_info() -> str
// `stream` is a cudaStream_t as an integer and `strategy` a kvtier::Strategy; the
// CPU implementation ignores both. The Python wrapper (kvtier/ops) is the intended
// caller: it builds the block views and owns the CUDA stream and events.
//
// CPU invariants: copies are whole runs of contiguous bytes (memcpy), never per
// element; the chunk is split into equal byte ranges, one per thread, so threads do
// equal work whatever the block size; the op returns when every byte is copied.
// NOTE: the threads are at::parallel_for's (torch's OpenMP pool of the calling
// thread, at::get_num_threads() of them). On a loaded machine an OpenMP barrier
// waits for the slowest, possibly descheduled, thread.
#include <Python.h>
#include <torch/library.h>
#include <torch/types.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <string>
#include <unordered_set>

#include "copy_plan.h"
#include "ops_common.h"
#ifdef KVTIER_WITH_CUDA
#include "cuda_copy.h"
#endif

namespace kvtier {

BlockPlan check_block_args(const char* op, Direction dir, at::TensorList layers,
                           const at::Tensor& block_ids, const at::Tensor& chunk) {
  const char* chunk_name = dir == Direction::kGather ? "dst" : "src";
  TORCH_CHECK(!layers.empty(), op, ": layers must not be empty");
  const at::Tensor& first = layers[0];
  BlockPlan plan;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const at::Tensor& t = layers[i];
    TORCH_CHECK(t.dim() == 3, op, ": layers[", i, "] must be a 3-D block view "
                "(outer, num_blocks, inner), got ", t.dim(), " dims ", t.sizes(),
                "; build it with kvtier.ops.KVLayout.block_view()");
    TORCH_CHECK(t.scalar_type() == first.scalar_type(), op, ": layers[", i,
                "] has dtype ", t.scalar_type(), " but layers[0] has ", first.scalar_type());
    TORCH_CHECK(t.device() == first.device(), op, ": layers[", i, "] is on ", t.device(),
                " but layers[0] is on ", first.device());
    TORCH_CHECK(t.sizes() == first.sizes(), op, ": layers[", i, "] has shape ", t.sizes(),
                " but layers[0] has ", first.sizes());
    TORCH_CHECK(t.size(2) == 1 || t.stride(2) == 1, op, ": layers[", i,
                "] must have a contiguous last dim (stride 1), got strides ", t.strides());
    TORCH_CHECK(t.stride(0) >= 0 && t.stride(1) >= 0, op, ": layers[", i,
                "] has negative strides ", t.strides());
    const std::int64_t es = static_cast<std::int64_t>(t.element_size());
    const std::int64_t inner = t.size(2) * es;
    const std::int64_t bs = t.stride(1) * es, os = t.stride(0) * es;
    TORCH_CHECK(t.size(1) <= 1 || bs >= inner, op, ": layers[", i,
                "] blocks overlap (block stride ", bs, " B < block size ", inner, " B)");
    TORCH_CHECK(t.size(0) <= 1 || os >= (t.size(1) - 1) * bs + inner, op, ": layers[", i,
                "] outer rows overlap (outer stride ", os, " B)");
    TORCH_CHECK(t.numel() > 0, op, ": layers[", i, "] is empty ", t.sizes());
    plan.layers.push_back(LayerGeom{reinterpret_cast<std::uintptr_t>(t.data_ptr()), os, bs});
  }
  plan.outer = first.size(0);
  plan.num_blocks = first.size(1);
  plan.inner_bytes = first.size(2) * static_cast<std::int64_t>(first.element_size());

  TORCH_CHECK(block_ids.scalar_type() == at::kLong, op, ": block_ids must be int64, got ",
              block_ids.scalar_type());
  TORCH_CHECK(block_ids.device().is_cpu(), op, ": block_ids must be a CPU tensor, got ",
              block_ids.device());
  // NOTE: block_ids must live on the CPU: reading ids from device memory would
  // synchronize the device once per id.
  TORCH_CHECK(block_ids.dim() == 1 && block_ids.is_contiguous(), op,
              ": block_ids must be a contiguous 1-D tensor, got shape ", block_ids.sizes());
  plan.ids = block_ids.data_ptr<std::int64_t>();
  plan.num_ids = block_ids.numel();
  std::unordered_set<std::int64_t> seen;
  for (std::int64_t i = 0; i < plan.num_ids; ++i) {
    const std::int64_t id = plan.ids[i];
    TORCH_CHECK(id >= 0 && id < plan.num_blocks, op, ": block_ids[", i, "] = ", id,
                " is out of range [0, ", plan.num_blocks, ")");
    if (dir == Direction::kScatter) {
      TORCH_CHECK(seen.insert(id).second, op, ": block id ", id,
                  " appears twice in block_ids; a scatter writes each block once");
    }
  }

  TORCH_CHECK(chunk.scalar_type() == at::kByte, op, ": ", chunk_name,
              " must be a uint8 buffer, got ", chunk.scalar_type());
  TORCH_CHECK(chunk.is_contiguous(), op, ": ", chunk_name, " must be contiguous");
  TORCH_CHECK(chunk.numel() == plan.total_bytes(), op, ": ", chunk_name, " has ",
              chunk.numel(), " bytes but ", layers.size(), " layers x ", plan.outer,
              " outer x ", plan.num_ids, " blocks x ", plan.inner_bytes, " B = ",
              plan.total_bytes(), " bytes are needed");
  plan.chunk = reinterpret_cast<std::uintptr_t>(chunk.data_ptr());
  return plan;
}

namespace {

// NOTE: below this many bytes a copy runs on the calling thread; waking the OpenMP
// team costs more than it saves.
constexpr std::int64_t kSerialBytes = 256 << 10;
// Each thread gets at least this many bytes.
constexpr std::int64_t kMinBytesPerThread = 128 << 10;

// Copies chunk bytes [begin, end) of `runs` (chunk order) in direction `dir`.
void copy_range(const std::vector<Run>& runs, const std::vector<std::int64_t>& offsets,
                std::int64_t begin, std::int64_t end, Direction dir) {
  // First run whose chunk range contains `begin`.
  auto it = std::upper_bound(offsets.begin(), offsets.end(), begin);
  std::size_t r = static_cast<std::size_t>(it - offsets.begin()) - 1;
  std::int64_t pos = begin;
  while (pos < end) {
    const Run& run = runs[r];
    const std::int64_t skip = pos - offsets[r];
    const std::int64_t n = std::min(run.bytes - skip, end - pos);
    char* cache = reinterpret_cast<char*>(run.cache) + skip;
    char* chunk = reinterpret_cast<char*>(run.chunk) + skip;
    if (dir == Direction::kGather) {
      std::memcpy(chunk, cache, static_cast<std::size_t>(n));
    } else {
      std::memcpy(cache, chunk, static_cast<std::size_t>(n));
    }
    pos += n;
    ++r;
  }
}

void copy_cpu(const BlockPlan& plan, Direction dir) {
  const std::int64_t total = plan.total_bytes();
  if (total == 0) return;
  const std::vector<Run> runs = build_runs(plan);
  std::vector<std::int64_t> offsets(runs.size());
  std::int64_t acc = 0;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    offsets[i] = acc;
    acc += runs[i].bytes;
  }
  std::int64_t threads = std::min<std::int64_t>(at::get_num_threads(),
                                                total / kMinBytesPerThread);
  if (total < kSerialBytes || threads <= 1 || at::in_parallel_region()) {
    copy_range(runs, offsets, 0, total, dir);
    return;
  }
  // Equal byte ranges, 64-byte aligned so no two threads share a cache line.
  const std::int64_t per = ((total + threads - 1) / threads + 63) & ~std::int64_t{63};
  at::parallel_for(0, threads, 1, [&](std::int64_t tb, std::int64_t te) {
    for (std::int64_t t = tb; t < te; ++t) {
      const std::int64_t b = std::min(total, t * per), e = std::min(total, b + per);
      if (b < e) copy_range(runs, offsets, b, e, dir);
    }
  });
}

void check_cpu(const char* op, at::TensorList layers, const at::Tensor& chunk,
               const char* chunk_name) {
  TORCH_CHECK(layers[0].device().is_cpu(), op, ": the CPU implementation got layers on ",
              layers[0].device());
  TORCH_CHECK(chunk.device().is_cpu(), op, ": ", chunk_name, " is on ", chunk.device(),
              " but layers are on the CPU");
}

void gather_blocks_cpu(at::TensorList layers, const at::Tensor& block_ids,
                       const at::Tensor& dst, std::int64_t /*stream*/,
                       std::int64_t /*strategy*/) {
  const BlockPlan plan =
      check_block_args("gather_blocks", Direction::kGather, layers, block_ids, dst);
  check_cpu("gather_blocks", layers, dst, "dst");
  copy_cpu(plan, Direction::kGather);
}

void scatter_blocks_cpu(const at::Tensor& src, at::TensorList layers,
                        const at::Tensor& block_ids, std::int64_t /*stream*/,
                        std::int64_t /*strategy*/) {
  const BlockPlan plan =
      check_block_args("scatter_blocks", Direction::kScatter, layers, block_ids, src);
  check_cpu("scatter_blocks", layers, src, "src");
  copy_cpu(plan, Direction::kScatter);
}

std::string build_info() {
#ifdef KVTIER_WITH_CUDA
  return "cuda=1 cudart=" + std::to_string(cuda::runtime_version());
#else
  return "cuda=0";
#endif
}

}  // namespace

// Defined in pinned.cpp.
std::tuple<at::Tensor, bool> alloc_pinned(std::int64_t nbytes);

}  // namespace kvtier

TORCH_LIBRARY(kvtier, m) {
  m.def("gather_blocks(Tensor[] layers, Tensor block_ids, Tensor(a!) dst, "
        "int stream=0, int strategy=0) -> ()");
  m.def("scatter_blocks(Tensor src, Tensor(a!)[] layers, Tensor block_ids, "
        "int stream=0, int strategy=0) -> ()");
  m.def("alloc_pinned(int nbytes) -> (Tensor, bool)", &kvtier::alloc_pinned);
  m.def("build_info() -> str", &kvtier::build_info);
}

TORCH_LIBRARY_IMPL(kvtier, CPU, m) {
  m.impl("gather_blocks", &kvtier::gather_blocks_cpu);
  m.impl("scatter_blocks", &kvtier::scatter_blocks_cpu);
}

// Importing kvtier._C registers the ops above with torch; the module itself is empty.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr,
                               nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
