// CUDA path of clip_weights (clip.cpp): one thread per weight (summing its partial sums, if given),
// on the current stream (so a CUDA graph capture records it). The same arithmetic as the CPU loop,
// rounded in the tensor's dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
// c10/cuda only (not ATen/cuda/CUDAContext.h, which pulls in cuSPARSE/cuBLAS headers a minimal
// toolkit may lack)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

namespace pdpfast {
namespace clip {
namespace {

constexpr int kThreadsPerBlock = 256;

// sq holds `parts` values per weight, side by side (1: the squared norm itself), summed left to right
template <typename scalar_t>
__global__ void clip_weights_kernel(const scalar_t* __restrict__ sq, int64_t parts,
                                    const scalar_t* __restrict__ bounds, const scalar_t* __restrict__ rho,
                                    scalar_t* __restrict__ out, int64_t n, scalar_t offset, scalar_t cap) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x;
  if (i >= n) return;
  const scalar_t* row = sq + i * parts;
  scalar_t s = parts > 0 ? row[0] : scalar_t(0);
  for (int64_t k = 1; k < parts; ++k) s += row[k];
  scalar_t root = sqrt(s < scalar_t(0) ? scalar_t(0) : s);  // NaN stays NaN
  if (rho != nullptr) root += rho[i];
  const scalar_t w = bounds[i] / (root + offset);
  out[i] = w > cap ? cap : w;
}

}  // namespace

void clip_weights_cuda(const at::Tensor& sq, int64_t parts, const at::Tensor& bounds, const at::Tensor* rho,
                       at::Tensor& out, double offset, double cap) {
  const c10::cuda::CUDAGuard device_guard(sq.device());
  const int64_t n = out.numel();
  const int64_t blocks = (n + kThreadsPerBlock - 1) / kThreadsPerBlock;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(sq.scalar_type(), "pdpfast_clip_weights_cuda", [&] {
    clip_weights_kernel<scalar_t><<<static_cast<unsigned int>(blocks), kThreadsPerBlock, 0, stream>>>(
        sq.data_ptr<scalar_t>(), parts, bounds.data_ptr<scalar_t>(),
        rho == nullptr ? nullptr : rho->data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n,
        static_cast<scalar_t>(offset), static_cast<scalar_t>(cap));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace clip
}  // namespace pdpfast
