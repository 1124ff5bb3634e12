// CUDA paths of clip_weights and clip_scale (clip.cpp), on the current stream (so a CUDA graph
// capture records them), with clip_weight.h's arithmetic, rounded in the tensors' dtypes as on the CPU.
//
// clip_weights: one thread per weight (summing its partial sums, if given).
// clip_scale: one block per chunk of a row; the block's first thread computes the row's weight, rounds
// it to x's dtype (toward zero in fp16: weight_as), writes it out from the row's first chunk and
// shares it; every thread then scales its elements, each product computed in float (double for
// double) and rounded once, as torch's x * pdpfast.ops.clip.weights_to(w, x.dtype) does.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
// c10/cuda only (not ATen/cuda/CUDAContext.h, which pulls in cuSPARSE/cuBLAS headers a minimal
// toolkit may lack)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <limits>

#include "clip_weight.h"

namespace pdpfast {
namespace clip {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int64_t kScaleChunk = 4096;  // elements of a row one block of clip_scale scales

template <typename scalar_t>
__global__ void clip_weights_kernel(const scalar_t* __restrict__ sq, int64_t parts,
                                    const scalar_t* __restrict__ bounds, const scalar_t* __restrict__ rho,
                                    int64_t rho_parts, scalar_t* __restrict__ out, int64_t n, scalar_t offset,
                                    scalar_t cap) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x;
  if (i >= n) return;
  out[i] = clip_weight<scalar_t>(sq + i * parts, parts, bounds[i], rho == nullptr ? nullptr : rho + i * rho_parts,
                                 rho_parts, offset, cap);
}

template <typename scalar_t, typename acc_t>
__global__ void clip_scale_kernel(const scalar_t* __restrict__ x, const acc_t* __restrict__ sq, int64_t parts,
                                  const acc_t* __restrict__ bounds, const acc_t* __restrict__ rho, int64_t rho_parts,
                                  scalar_t* __restrict__ out, scalar_t* __restrict__ weights, int64_t row,
                                  int64_t chunks, acc_t offset, acc_t cap) {
  __shared__ acc_t shared_w;
  const int64_t i = static_cast<int64_t>(blockIdx.x) / chunks;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) % chunks;
  if (threadIdx.x == 0) {
    const scalar_t w = weight_as<scalar_t, acc_t>(clip_weight<acc_t>(
        sq + i * parts, parts, bounds[i], rho == nullptr ? nullptr : rho + i * rho_parts, rho_parts, offset, cap));
    if (chunk == 0) weights[i] = w;
    shared_w = static_cast<acc_t>(w);
  }
  __syncthreads();
  const acc_t w = shared_w;
  const int64_t begin = chunk * kScaleChunk;
  const int64_t end = begin + kScaleChunk < row ? begin + kScaleChunk : row;
  const scalar_t* xi = x + i * row;
  scalar_t* oi = out + i * row;
  for (int64_t j = begin + threadIdx.x; j < end; j += kThreadsPerBlock) {
    oi[j] = static_cast<scalar_t>(static_cast<acc_t>(xi[j]) * w);
  }
}

}  // namespace

void clip_weights_cuda(const at::Tensor& sq, int64_t parts, const at::Tensor& bounds, const at::Tensor* rho,
                       int64_t rho_parts, at::Tensor& out, double offset, double cap) {
  const c10::cuda::CUDAGuard device_guard(sq.device());
  const int64_t n = out.numel();
  const int64_t blocks = (n + kThreadsPerBlock - 1) / kThreadsPerBlock;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(sq.scalar_type(), "pdpfast_clip_weights_cuda", [&] {
    clip_weights_kernel<scalar_t><<<static_cast<unsigned int>(blocks), kThreadsPerBlock, 0, stream>>>(
        sq.data_ptr<scalar_t>(), parts, bounds.data_ptr<scalar_t>(),
        rho == nullptr ? nullptr : rho->data_ptr<scalar_t>(), rho_parts, out.data_ptr<scalar_t>(), n,
        static_cast<scalar_t>(offset), static_cast<scalar_t>(cap));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// x, out: contiguous, (n, ...) with n = weights.numel() > 0; sq, bounds, rho: contiguous, in x's opmath dtype
void clip_scale_cuda(const at::Tensor& x, const at::Tensor& sq, int64_t parts, const at::Tensor& bounds,
                     const at::Tensor* rho, int64_t rho_parts, at::Tensor& out, at::Tensor& weights, double offset,
                     double cap) {
  const c10::cuda::CUDAGuard device_guard(x.device());
  const int64_t n = weights.numel();
  const int64_t row = x.numel() / n;
  const int64_t chunks = row > 0 ? (row + kScaleChunk - 1) / kScaleChunk : 1;  // one block at least: the weight
  TORCH_CHECK(n * chunks <= std::numeric_limits<int32_t>::max(), "clip_scale: ", n, " rows of ", row,
              " elements are more blocks than a CUDA grid holds");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "pdpfast_clip_scale_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    clip_scale_kernel<scalar_t, acc_t><<<static_cast<unsigned int>(n * chunks), kThreadsPerBlock, 0, stream>>>(
        x.data_ptr<scalar_t>(), sq.data_ptr<acc_t>(), parts, bounds.data_ptr<acc_t>(),
        rho == nullptr ? nullptr : rho->data_ptr<acc_t>(), rho_parts, out.data_ptr<scalar_t>(),
        weights.data_ptr<scalar_t>(), row, chunks, static_cast<acc_t>(offset), static_cast<acc_t>(cap));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace clip
}  // namespace pdpfast
