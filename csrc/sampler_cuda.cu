// CUDA path of the weighted Bernoulli (Poisson) sampler; see sampler.cpp for the generator, which
// this file must reproduce bit for bit (sampler_rng.h holds it for both).
//
// Two kernels and a scan, one thread per record:
//   1. draw: each warp draws 32 consecutive records, keeps the decisions as one 32-bit ballot word
//      and the block writes its hit count;
//   2. an inclusive scan of the block counts (at::cumsum) gives each block its output offset and
//      the total, the only value copied back to the host (the output must be allocated);
//   3. compact: each hit writes its index at block offset + earlier warps' hits + its rank among
//      the set bits of its warp's word below it. The output is therefore sorted ascending.

#include <ATen/ATen.h>

#include "sampler_rng.h"
// c10/cuda only (not ATen/cuda/CUDAContext.h, which pulls in cuSPARSE/cuBLAS headers a minimal
// toolkit may lack)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace pdpfast {
namespace sampler {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kWarpsPerBlock = kThreadsPerBlock / 32;

template <typename scalar_t>
__global__ void draw_kernel(const scalar_t* __restrict__ rates, int64_t num_records, StreamKeys keys,
                            uint32_t* __restrict__ hit_words, int64_t* __restrict__ block_hits,
                            unsigned long long* __restrict__ first_invalid) {
  __shared__ int warp_hits[kWarpsPerBlock];
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  bool hit = false;
  if (index < num_records) {
    const double rate = static_cast<double>(rates[index]);
    if (!(rate >= 0.0 && rate <= 1.0)) atomicMin(first_invalid, static_cast<unsigned long long>(index));
    hit = is_drawn(keys, static_cast<uint64_t>(index), rate);
  }
  const uint32_t word = __ballot_sync(0xffffffffu, hit);
  if (lane == 0) {
    hit_words[static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp] = word;
    warp_hits[warp] = __popc(word);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int total = 0;
    for (int w = 0; w < kWarpsPerBlock; ++w) total += warp_hits[w];
    block_hits[blockIdx.x] = total;
  }
}

__global__ void compact_kernel(const uint32_t* __restrict__ hit_words, const int64_t* __restrict__ block_hits,
                               const int64_t* __restrict__ block_hits_inclusive, int64_t* __restrict__ indices) {
  __shared__ int warp_hits[kWarpsPerBlock];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const uint32_t word = hit_words[static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp];
  if (lane == 0) warp_hits[warp] = __popc(word);
  __syncthreads();
  if (!((word >> lane) & 1u)) return;
  int64_t position = block_hits_inclusive[blockIdx.x] - block_hits[blockIdx.x];
  for (int w = 0; w < warp; ++w) position += warp_hits[w];
  position += __popc(word & ((1u << lane) - 1u));
  indices[position] = static_cast<int64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x;
}

}  // namespace

at::Tensor poisson_sample_cuda(const at::Tensor& sample_rates, uint64_t seed, uint64_t step) {
  TORCH_CHECK(sample_rates.is_cuda(), "sample_rates must be a CUDA tensor, got ", sample_rates.device());
  TORCH_CHECK(sample_rates.dim() == 1, "sample_rates must be 1-D, got shape ", sample_rates.sizes());
  TORCH_CHECK(sample_rates.scalar_type() == at::kFloat || sample_rates.scalar_type() == at::kDouble,
              "sample_rates must be float32 or float64, got ", sample_rates.scalar_type());
  const c10::cuda::CUDAGuard device_guard(sample_rates.device());
  const at::Tensor rates = sample_rates.contiguous();
  const int64_t num_records = rates.numel();
  const auto long_options = rates.options().dtype(at::kLong);
  if (num_records == 0) return at::empty({0}, long_options);

  const int64_t num_blocks = (num_records + kThreadsPerBlock - 1) / kThreadsPerBlock;
  TORCH_CHECK(num_blocks <= 0x7fffffffLL, "too many records for one launch: ", num_records);
  const StreamKeys keys = derive_keys(seed, step);
  at::Tensor hit_words = at::empty({num_blocks * kWarpsPerBlock}, rates.options().dtype(at::kInt));
  at::Tensor block_hits = at::empty({num_blocks}, long_options);
  at::Tensor first_invalid = at::full({1}, num_records, long_options);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  AT_DISPATCH_FLOATING_TYPES(rates.scalar_type(), "pdpfast_poisson_sample_cuda", [&] {
    draw_kernel<scalar_t><<<static_cast<unsigned int>(num_blocks), kThreadsPerBlock, 0, stream>>>(
        rates.data_ptr<scalar_t>(), num_records, keys, reinterpret_cast<uint32_t*>(hit_words.data_ptr<int32_t>()),
        block_hits.data_ptr<int64_t>(), reinterpret_cast<unsigned long long*>(first_invalid.data_ptr<int64_t>()));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const at::Tensor block_hits_inclusive = at::cumsum(block_hits, 0);
  // one device-to-host copy: the total sizes the output, the first invalid index validates the input
  const at::Tensor summary = at::cat({block_hits_inclusive.narrow(0, num_blocks - 1, 1), first_invalid}).cpu();
  const int64_t total_hits = summary[0].item<int64_t>();
  const int64_t invalid_index = summary[1].item<int64_t>();
  if (invalid_index < num_records) {
    const double value = rates.narrow(0, invalid_index, 1).item<double>();
    throw std::invalid_argument("sample_rates must lie in [0, 1] (no NaN); sample_rates[" +
                                std::to_string(invalid_index) + "] = " + std::to_string(value));
  }

  at::Tensor indices = at::empty({total_hits}, long_options);
  if (total_hits > 0) {
    compact_kernel<<<static_cast<unsigned int>(num_blocks), kThreadsPerBlock, 0, stream>>>(
        reinterpret_cast<const uint32_t*>(hit_words.data_ptr<int32_t>()), block_hits.data_ptr<int64_t>(),
        block_hits_inclusive.data_ptr<int64_t>(), indices.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return indices;
}

}  // namespace sampler
}  // namespace pdpfast
