// One clip weight, the formula every clip op of pdpfast._C computes (clip.cpp on the CPU, clip_cuda.cu
// on a GPU): w = min(cap, bound / (sqrt(max(s, 0)) + r + offset)), where s = sq[0] + ... + sq[parts-1]
// and r = rho[0] + ... + rho[rho_parts-1] (0 when rho is null), each summed left to right: the
// per-program partial sums a norm kernel wrote (parts = 1: the value itself). Each step is rounded
// once in T; NaN propagates (a comparison written this way keeps it, as torch.clamp does) and a
// bound of 0 (a masked row) gives 0.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

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

// A weight w >= 0 cast to the dtype of the tensor it scales. fp16 rounds toward zero: below its
// smallest normal (2^-14) fp16 rounds in absolute steps of 2^-24, so a weight rounded to nearest
// could grow by 2^-25, and times an unclipped gradient ‖g_i‖ ~ c_i / w that is a relative error of
// 2^-25 / w (19% at w = 1e-7); rounded toward zero it never grows. Other dtypes round to nearest (bf16
// has fp32's exponent range: the fixed relative margin covers it). pdpfast.ops.clip.weights_to is
// the torch twin.
template <typename scalar_t, typename acc_t>
C10_HOST_DEVICE inline scalar_t weight_as(acc_t w) {
  scalar_t cast = static_cast<scalar_t>(w);
  if constexpr (std::is_same<scalar_t, c10::Half>::value) {
    const acc_t back = static_cast<acc_t>(cast);
    if (back > w && back > acc_t(0)) cast = c10::Half(static_cast<uint16_t>(cast.x - 1), c10::Half::from_bits());
  }
  return cast;
}

}  // namespace clip
}  // namespace pdpfast
