// One clip weight, the formula every clip op of pdpfast._C computes (clip.cpp on the CPU, clip_cuda.cu
// on a GPU): w = min(cap, bound / (sqrt(max(s, 0)) + r + offset)), where s = sq[0] + ... + sq[parts-1]
// and r = rho[0] + ... + rho[rho_parts-1] (0 when rho is null), each summed left to right: the
// per-program partial sums a norm kernel wrote (parts = 1: the value itself). Each step is rounded
// once in T; NaN propagates (a comparison written this way keeps it, as torch.clamp does) and a
// bound of 0 (a masked row) gives 0.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

namespace pdpfast {
namespace clip {

template <typename T>
C10_HOST_DEVICE inline T clip_weight(const T* sq, int64_t parts, T bound, const T* rho, int64_t rho_parts, T offset,
                                     T cap) {
  T s = parts > 0 ? sq[0] : T(0);
  for (int64_t k = 1; k < parts; ++k) s += sq[k];
#ifdef __CUDA_ARCH__
  T root = sqrt(s < T(0) ? T(0) : s);
#else
  T root = std::sqrt(s < T(0) ? T(0) : s);
#endif
  if (rho != nullptr) {
    T r = rho_parts > 0 ? rho[0] : T(0);
    for (int64_t k = 1; k < rho_parts; ++k) r += rho[k];
    root += r;
  }
  const T w = bound / (root + offset);
  return w > cap ? cap : w;
}

}  // namespace clip
}  // namespace pdpfast
