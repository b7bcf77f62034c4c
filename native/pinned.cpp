// alloc_pinned: page-aligned, pre-touched host memory, pinned when CUDA can pin it.
//
// Invariants:
//   * the buffer is a 1-D uint8 CPU tensor of exactly nbytes, 2 MiB aligned, every
//     page touched before return (no first-touch faults on the copy path);
//   * `is_pinned` is true only if cudaHostRegister succeeded (the memory is then
//     page-locked and mapped into the device address space of every device);
//   * when a CUDA device is present and pinning fails, the call raises rather than
//     returning pageable memory the caller believes is pinned;
//   * failures name the sizes: requested, and MemAvailable from /proc/meminfo.
#include <torch/types.h>
#include <ATen/Parallel.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>

#ifdef KVTIER_WITH_CUDA
#include "cuda_copy.h"
#endif

namespace kvtier {
namespace {

constexpr std::size_t kAlign = std::size_t{2} << 20;  // one transparent huge page

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f GiB", bytes / double(1ull << 30));
  return buf;
}

// MemAvailable in bytes, or -1 when /proc/meminfo cannot be read.
std::int64_t mem_available() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  std::int64_t kib = 0;
  std::string unit;
  while (f >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return -1;
}

std::string describe_failure(std::int64_t nbytes, const std::string& why) {
  std::ostringstream s;
  s << "alloc_pinned: cannot allocate " << gib(double(nbytes)) << " ("
    << nbytes << " bytes) of pinned host memory";
  const std::int64_t avail = mem_available();
  if (avail >= 0) s << " (MemAvailable " << gib(double(avail)) << ")";
  s << ": " << why;
  return s.str();
}

// Maps nbytes rounded up to kAlign at a kAlign-aligned address.
void* map_aligned(std::size_t len) {
  const std::size_t span = len + kAlign;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = (start + kAlign - 1) & ~(std::uintptr_t{kAlign} - 1);
  if (aligned > start) munmap(raw, aligned - start);
  const std::uintptr_t tail = start + span - (aligned + len);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + len), tail);
  return reinterpret_cast<void*>(aligned);
}

// Writes one byte per page, in parallel: the kernel backs every page now.
void pre_touch(char* p, std::size_t len) {
  const auto page = static_cast<std::int64_t>(sysconf(_SC_PAGESIZE));
  const auto pages = static_cast<std::int64_t>((len + page - 1) / page);
  at::parallel_for(0, pages, 4096, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) p[i * page] = 0;
  });
}

}  // namespace

std::tuple<at::Tensor, bool> alloc_pinned(std::int64_t nbytes) {
  TORCH_CHECK(nbytes > 0, "alloc_pinned: nbytes must be > 0, got ", nbytes);
  const std::int64_t avail = mem_available();
  TORCH_CHECK(avail < 0 || nbytes <= avail,
              describe_failure(nbytes, "more than the memory available"));
  const std::size_t len = (static_cast<std::size_t>(nbytes) + kAlign - 1) & ~(kAlign - 1);
  void* p = map_aligned(len);
  TORCH_CHECK(p != nullptr, describe_failure(nbytes, std::string("mmap failed: ") +
                                                         std::strerror(errno)));
  madvise(p, len, MADV_HUGEPAGE);  // best effort; fewer TLB misses on big copies
  pre_touch(static_cast<char*>(p), len);

  bool pinned = false;
#ifdef KVTIER_WITH_CUDA
  if (cuda::device_count() > 0) {
    const std::string err = cuda::host_register(p, len);
    if (!err.empty()) {
      munmap(p, len);
      TORCH_CHECK(false, describe_failure(nbytes, err + " (check `ulimit -l`)"));
    }
    pinned = true;
  }
#endif
  auto deleter = [len, pinned](void* ptr) {
#ifdef KVTIER_WITH_CUDA
    if (pinned) cuda::host_unregister(ptr);
#else
    (void)pinned;
#endif
    munmap(ptr, len);
  };
  at::Tensor t = torch::from_blob(p, {nbytes}, deleter,
                                  torch::TensorOptions().dtype(torch::kUInt8));
  return {t, pinned};
}

}  // namespace kvtier
