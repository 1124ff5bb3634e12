// A host-side read of the CUDA caching allocator's count of the bytes allocated on one device, which
// per-layer clipping reads to let a held run of layer calls grow while the device holds no more than
// where its backward began (pdpfast/clipping.py, _allocated_bytes). torch's own read from Python
// (torch._C._cuda_memoryStats) builds a dictionary of every statistic of every pool first.
#include <torch/extension.h>

#ifdef PDPFAST_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <cstdint>

namespace pdpfast {
namespace memory {

// The allocated bytes of every pool (the statistic's aggregate, index 0) now; -1 where not counted:
// an extension built without CUDA, or an allocator that keeps no statistics (a pluggable one).
int64_t cuda_allocated_bytes(int64_t device) {
#ifdef PDPFAST_WITH_CUDA
  try {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    return stats.allocated_bytes[0].current;
  } catch (const c10::Error&) {
    return -1;
  }
#else
  (void)device;
  return -1;
#endif
}

}  // namespace memory
}  // namespace pdpfast

void register_memory(pybind11::module_& m) {
  m.def("cuda_allocated_bytes", &pdpfast::memory::cuda_allocated_bytes, pybind11::arg("device"),
        "The CUDA caching allocator's allocated bytes on `device` now (all pools), or -1 where not counted "
        "(built without CUDA, or an allocator without statistics). No synchronisation.");
}
