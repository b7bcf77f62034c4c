// CUDA side of the kvtier ops, callable from host C++ without CUDA or torch headers.
//
// Everything here uses the CUDA runtime only (cuda_copy.cu); the torch binding in
// ops_cuda.cpp translates tensors into a BlockPlan and errors into TORCH_CHECKs.
// Functions return an empty string on success and a message otherwise; none throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "copy_plan.h"

namespace kvtier {
namespace cuda {

enum class CopyKind { kGather, kScatter };

// Number of visible devices; 0 when there is no device or no driver.
int device_count();

// cudaRuntimeGetVersion(), e.g. 13000.
int runtime_version();

// Page-locks [p, p+n) and maps it for every device (Portable | Mapped).
std::string host_register(void* p, std::size_t n);
void host_unregister(void* p);

// Enqueues the copy described by `plan` on `stream` (a cudaStream_t, never the
// legacy default stream) of device `device` and returns without waiting. The cache
// side of the plan is device memory of `device`; the chunk is device memory or
// page-locked host memory (for the kernel strategy: mapped page-locked memory).
//   use_kernel=false: one DMA copy per run (cudaMemcpyBatchAsync where the runtime
//                     has it, else cudaMemcpyAsync per run);
//   use_kernel=true:  one gather/scatter kernel launch per batch of ids; the kernel
//                     reads or writes host memory through its mapped device address.
// The plan's ids are read before the function returns; the caller may free them.
std::string copy_blocks(const BlockPlan& plan, CopyKind kind, bool use_kernel,
                        std::intptr_t stream, int device);

}  // namespace cuda
}  // namespace kvtier
