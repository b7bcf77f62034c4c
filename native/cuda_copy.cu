// CUDA implementation of kvtier's block gather/scatter and host pinning.
//
// Depends on the CUDA runtime and the standard library only (no torch), so
// native/compile_cuda.sh can compile it anywhere nvcc is installed.
//
// Invariants:
//   * every copy is enqueued on the caller's stream; nothing here synchronizes the
//     device or the stream (the one wait is on a staging slot whose previous use was
//     enqueued 32 copies earlier, see Staging);
//   * the kernel strategy uploads its descriptor (layer table + ids) through a
//     pinned staging slot; a slot is reused only after the event recorded behind its
//     last kernel has completed;
//   * errors are returned as strings and leave no sticky CUDA error behind.
#include <cuda_runtime.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_copy.h"

namespace kvtier {
namespace cuda {
namespace {

std::string fail(const char* what, cudaError_t e) {
  cudaGetLastError();  // clear, so the error does not surface in later torch calls
  return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

#define KVTIER_CUDA_TRY(expr)                          \
  do {                                                 \
    const cudaError_t kvtier_err_ = (expr);            \
    if (kvtier_err_ != cudaSuccess) return fail(#expr, kvtier_err_); \
  } while (0)

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) == cudaSuccess && prev_ != device) {
      ok_ = cudaSetDevice(device) == cudaSuccess;
      restore_ = true;
    }
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(prev_);
  }
  bool ok() const { return ok_; }

 private:
  int prev_ = -1;
  bool ok_ = true;
  bool restore_ = false;
};

// The kernel's view of one layer (LayerGeom with fixed-width fields).
struct DevLayer {
  long long base;
  long long outer_stride;
  long long block_stride;
};

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
// NOTE: one CTA moves at most this many bytes of one segment; large blocks are split
// so that a few big blocks still spread over all SMs.
constexpr long long kPieceBytes = 64 << 10;
constexpr int kCtasPerSm = 8;

// Copies inner bytes of (layer, outer row, id) segments between the paged cache and
// the chunk. Unit u = (segment, piece); the loop is grid-stride over units.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    block_copy_kernel(const DevLayer* __restrict__ layers, const long long* __restrict__ ids,
                      long long batch, long long id_begin, long long num_ids, long long outer,
                      long long inner, long long pieces, long long units, char* chunk,
                      bool gather) {
  for (long long u = blockIdx.x; u < units; u += gridDim.x) {
    const long long seg = u / pieces;
    const long long off = (u - seg * pieces) * kPieceBytes;
    const long long i = seg % batch;
    const long long lo = seg / batch;
    const long long o = lo % outer;
    const long long l = lo / outer;
    const DevLayer g = layers[l];
    char* cache = reinterpret_cast<char*>(g.base + o * g.outer_stride + ids[i] * g.block_stride);
    char* chk = chunk + ((l * outer + o) * num_ids + id_begin + i) * inner;
    const T* src = reinterpret_cast<const T*>((gather ? cache : chk) + off);
    T* dst = reinterpret_cast<T*>((gather ? chk : cache) + off);
    const long long len = (inner - off < kPieceBytes ? inner - off : kPieceBytes);
    const long long n = len / static_cast<long long>(sizeof(T));
    // Issue kUnroll loads before the first store: host memory over PCIe/C2C has
    // microsecond latency and only many loads in flight hide it.
    for (long long k = threadIdx.x; k < n; k += static_cast<long long>(kThreads) * kUnroll) {
      T v[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const long long idx = k + static_cast<long long>(j) * kThreads;
        if (idx < n) v[j] = src[idx];
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const long long idx = k + static_cast<long long>(j) * kThreads;
        if (idx < n) dst[idx] = v[j];
      }
    }
  }
}

// Per-device ring of descriptor slots: pinned host half + device half.
struct Staging {
  static constexpr int kSlots = 32;
  static constexpr std::size_t kSlotBytes = 64 << 10;
  char* host = nullptr;
  char* dev = nullptr;
  cudaEvent_t done[kSlots] = {};
  int next = 0;
  int sm_count = 1;
  std::mutex mu;
};

// Created on first use and kept for the life of the process.
std::string staging_for(int device, Staging** out) {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<Staging>> all;
  std::lock_guard<std::mutex> lock(mu);
  auto it = all.find(device);
  if (it != all.end()) {
    *out = it->second.get();
    return "";
  }
  auto s = std::make_unique<Staging>();
  const std::size_t bytes = Staging::kSlots * Staging::kSlotBytes;
  KVTIER_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&s->host), bytes, cudaHostAllocPortable));
  KVTIER_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&s->dev), bytes));
  for (cudaEvent_t& e : s->done) {
    KVTIER_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  KVTIER_CUDA_TRY(
      cudaDeviceGetAttribute(&s->sm_count, cudaDevAttrMultiProcessorCount, device));
  *out = s.get();
  all.emplace(device, std::move(s));
  return "";
}

// Device address through which the kernel reaches the chunk; rejects pageable host
// memory and memory of another device.
std::string chunk_address(std::uintptr_t chunk, int device, bool need_mapped,
                          std::uintptr_t* out) {
  cudaPointerAttributes a{};
  KVTIER_CUDA_TRY(cudaPointerGetAttributes(&a, reinterpret_cast<void*>(chunk)));
  switch (a.type) {
    case cudaMemoryTypeDevice:
      if (a.device != device) {
        return "the chunk buffer is on cuda:" + std::to_string(a.device) +
               " but the layers are on cuda:" + std::to_string(device);
      }
      *out = chunk;
      return "";
    case cudaMemoryTypeManaged:
      *out = chunk;
      return "";
    case cudaMemoryTypeHost:
      if (need_mapped && a.devicePointer == nullptr) {
        return "the chunk buffer is pinned but not mapped into the device address "
               "space; allocate it with kvtier.ops.alloc_pinned() or use the memcpy strategy";
      }
      *out = need_mapped ? reinterpret_cast<std::uintptr_t>(a.devicePointer) : chunk;
      return "";
    default:
      return "the chunk buffer is pageable host memory; the CUDA copy needs pinned memory "
             "(kvtier.ops.alloc_pinned() or Tensor.pin_memory())";
  }
}

template <typename T>
void launch(const DevLayer* layers, const long long* ids, long long batch, long long id_begin,
            const BlockPlan& p, long long pieces, long long units, int grid, char* chunk,
            bool gather, cudaStream_t s) {
  block_copy_kernel<T><<<grid, kThreads, 0, s>>>(layers, ids, batch, id_begin, p.num_ids,
                                                 p.outer, p.inner_bytes, pieces, units,
                                                 chunk, gather);
}

std::string copy_kernel(const BlockPlan& p, CopyKind kind, cudaStream_t s, int device) {
  Staging* st = nullptr;
  std::string err = staging_for(device, &st);
  if (!err.empty()) return err;
  std::uintptr_t chunk = 0;
  err = chunk_address(p.chunk, device, /*need_mapped=*/true, &chunk);
  if (!err.empty()) return err;
  BlockPlan dev_plan = p;
  dev_plan.chunk = chunk;
  const int align = plan_alignment(dev_plan);

  const std::size_t header = p.layers.size() * sizeof(DevLayer);
  if (header + sizeof(long long) > Staging::kSlotBytes) {
    return "too many layers (" + std::to_string(p.layers.size()) +
           ") for the kernel strategy; use the memcpy strategy";
  }
  const long long per_batch =
      static_cast<long long>((Staging::kSlotBytes - header) / sizeof(long long));
  const long long pieces = (p.inner_bytes + kPieceBytes - 1) / kPieceBytes;
  const bool gather = kind == CopyKind::kGather;

  std::lock_guard<std::mutex> lock(st->mu);
  for (long long b0 = 0; b0 < p.num_ids; b0 += per_batch) {
    const long long batch = std::min(per_batch, p.num_ids - b0);
    const int slot = st->next;
    st->next = (st->next + 1) % Staging::kSlots;
    KVTIER_CUDA_TRY(cudaEventSynchronize(st->done[slot]));
    char* h = st->host + slot * Staging::kSlotBytes;
    char* d = st->dev + slot * Staging::kSlotBytes;
    auto* hl = reinterpret_cast<DevLayer*>(h);
    for (std::size_t l = 0; l < p.layers.size(); ++l) {
      hl[l] = DevLayer{static_cast<long long>(p.layers[l].base), p.layers[l].outer_stride,
                       p.layers[l].block_stride};
    }
    std::memcpy(h + header, p.ids + b0, static_cast<std::size_t>(batch) * sizeof(long long));
    const std::size_t bytes = header + static_cast<std::size_t>(batch) * sizeof(long long);
    KVTIER_CUDA_TRY(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, s));

    const auto* dl = reinterpret_cast<const DevLayer*>(d);
    const auto* di = reinterpret_cast<const long long*>(d + header);
    const long long units =
        static_cast<long long>(p.layers.size()) * p.outer * batch * pieces;
    const int grid = static_cast<int>(std::min<long long>(units, 1LL * st->sm_count * kCtasPerSm));
    char* c = reinterpret_cast<char*>(chunk);
    switch (align) {
      case 16: launch<uint4>(dl, di, batch, b0, p, pieces, units, grid, c, gather, s); break;
      case 8: launch<uint2>(dl, di, batch, b0, p, pieces, units, grid, c, gather, s); break;
      case 4: launch<unsigned>(dl, di, batch, b0, p, pieces, units, grid, c, gather, s); break;
      case 2: launch<unsigned short>(dl, di, batch, b0, p, pieces, units, grid, c, gather, s); break;
      default: launch<unsigned char>(dl, di, batch, b0, p, pieces, units, grid, c, gather, s);
    }
    KVTIER_CUDA_TRY(cudaGetLastError());
    KVTIER_CUDA_TRY(cudaEventRecord(st->done[slot], s));
  }
  return "";
}

std::string copy_memcpy(const BlockPlan& p, CopyKind kind, cudaStream_t s, int device) {
  std::uintptr_t chunk = 0;
  std::string err = chunk_address(p.chunk, device, /*need_mapped=*/false, &chunk);
  if (!err.empty()) return err;
  const std::vector<Run> runs = build_runs(p);
  const bool gather = kind == CopyKind::kGather;
  std::vector<void*> dsts(runs.size());
  std::vector<void*> srcs(runs.size());
  std::vector<std::size_t> sizes(runs.size());
  for (std::size_t i = 0; i < runs.size(); ++i) {
    void* cache = reinterpret_cast<void*>(runs[i].cache);
    void* chk = reinterpret_cast<void*>(runs[i].chunk);
    dsts[i] = gather ? chk : cache;
    srcs[i] = gather ? cache : chk;
    sizes[i] = static_cast<std::size_t>(runs[i].bytes);
  }
#if CUDART_VERSION >= 12080
  // NOTE: one batched call instead of one cudaMemcpyAsync per block; per-call
  // overhead (a few microseconds) otherwise caps small-block bandwidth.
  static std::atomic<bool> batch_supported{true};
  if (batch_supported.load() && runs.size() > 1) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    std::size_t attr_idx = 0;
#if CUDART_VERSION >= 13000
    const cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(),
                                               runs.size(), &attr, &attr_idx, 1, s);
#else
    std::size_t fail_idx = 0;
    const cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(),
                                               runs.size(), &attr, &attr_idx, 1, &fail_idx, s);
#endif
    if (e == cudaSuccess) return "";
    if (e != cudaErrorNotSupported) return fail("cudaMemcpyBatchAsync", e);
    cudaGetLastError();
    batch_supported.store(false);  // old driver: per-run copies from now on
  }
#endif
  for (std::size_t i = 0; i < runs.size(); ++i) {
    KVTIER_CUDA_TRY(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, s));
  }
  return "";
}

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

int runtime_version() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return v;
}

std::string host_register(void* p, std::size_t n) {
  KVTIER_CUDA_TRY(cudaHostRegister(p, n, cudaHostRegisterPortable | cudaHostRegisterMapped));
  return "";
}

void host_unregister(void* p) {
  if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
}

std::string copy_blocks(const BlockPlan& plan, CopyKind kind, bool use_kernel,
                        std::intptr_t stream, int device) {
  if (plan.total_bytes() == 0) return "";
  if (stream == 0) return "a dedicated CUDA stream is required (got the default stream)";
  DeviceGuard guard(device);
  if (!guard.ok()) return "cannot select cuda:" + std::to_string(device);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  return use_kernel ? copy_kernel(plan, kind, s, device) : copy_memcpy(plan, kind, s, device);
}

}  // namespace cuda
}  // namespace kvtier
