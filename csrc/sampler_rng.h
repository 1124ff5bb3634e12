// The counter-based generator of the Poisson sampler, shared by the C++ (sampler.cpp) and CUDA
// (sampler_cuda.cu) paths; pdpfast/sampling.py reproduces it bit for bit in torch. See sampler.cpp
// for the definition and why it is built this way.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define PDPFAST_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PDPFAST_HOST_DEVICE inline
#endif

namespace pdpfast {
namespace sampler {

constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kSeedSalt = 0x243F6A8885A308D3ULL;    // pi, so that seed 0 is not mix64's fixed point
constexpr uint64_t kOutputSalt = 0x13198A2E03707344ULL;  // next digits of pi
constexpr double kTwoPowMinus53 = 1.0 / 9007199254740992.0;

PDPFAST_HOST_DEVICE uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

struct StreamKeys {
  uint64_t stream;
  uint64_t out;
};

PDPFAST_HOST_DEVICE StreamKeys derive_keys(uint64_t seed, uint64_t step) {
  // For a fixed seed, step -> key_stream is a bijection (odd multiplier, then bijective mixes), so
  // two different steps never share a stream key.
  const uint64_t stream = mix64(mix64(seed ^ kSeedSalt) + step * kGoldenGamma);
  return {stream, mix64(stream ^ kOutputSalt)};
}

PDPFAST_HOST_DEVICE uint64_t random_bits(const StreamKeys& keys, uint64_t index) {
  return mix64(mix64(keys.stream + index * kGoldenGamma) ^ keys.out);
}

PDPFAST_HOST_DEVICE bool is_drawn(const StreamKeys& keys, uint64_t index, double sample_rate) {
  // 53 bits -> double is exact, and so is the scaling by 2^-53: the comparison is the same
  // integer comparison in every implementation.
  return static_cast<double>(random_bits(keys, index) >> 11) * kTwoPowMinus53 < sample_rate;
}

}  // namespace sampler
}  // namespace pdpfast
