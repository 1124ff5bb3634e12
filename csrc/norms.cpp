// Per-sample gradients of a GroupNorm's (and an InstanceNorm's) affine parameters on the CPU, reading
// the layer's input and output gradient from memory once (DESIGN.md §2; pdpfast/ops/norm.py).
//
// For sample i and channel c of group g, with x̂ = (x - μ_ig)·rstd_ig the normalized input:
//
//   ∂ℓ_i/∂γ_c = Σ_t o_ict x̂_ict = rstd_ig · Σ_t o_ict (x_ict - μ_ig)      ∂ℓ_i/∂β_c = Σ_t o_ict
//
// The torch route normalizes the whole input, multiplies and reduces: a dozen ops per cache-sized
// chunk of samples, and as many passes over memory. Here each (sample, group) slab, C/G channels of
// L positions, is read once for its mean and once more, from cache, for the centred sums; nothing
// of the input's size is written. Sums are taken in double, so the result is at least as exact as
// torch's fp32 route. On x86-64 with GCC the inner loops are compiled for AVX-512, AVX2 and the
// baseline, and the loader picks the widest the CPU has.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PDPFAST_TARGET_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PDPFAST_TARGET_CLONES
#endif

namespace pdpfast {
namespace norms {

// Work below this many input elements per task is not split further across threads.
constexpr int64_t kMinElementsPerTask = 1 << 15;

// One (sample, group) slab: channels x[c·L .. c·L + L) for c < channels. Writes the group's
// weight gradients (and bias gradients when bias is non-null), one per channel.
template <typename scalar_t>
PDPFAST_TARGET_CLONES void group_slab(const scalar_t* x, const scalar_t* o, int64_t channels, int64_t L,
                                      double eps, scalar_t* weight, scalar_t* bias) {
  const int64_t n = channels * L;
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t k = 0; k < n; ++k) sum += static_cast<double>(x[k]);
  const double mean = sum / static_cast<double>(n);
  double sq_dev = 0.0;
  std::vector<double> centred(static_cast<size_t>(channels));
  for (int64_t c = 0; c < channels; ++c) {
    const scalar_t* xc = x + c * L;
    const scalar_t* oc = o + c * L;
    double sq = 0.0, so = 0.0, sox = 0.0;
#pragma omp simd reduction(+ : sq, so, sox)
    for (int64_t k = 0; k < L; ++k) {
      const double d = static_cast<double>(xc[k]) - mean;
      const double g = static_cast<double>(oc[k]);
      sq += d * d;
      so += g;
      sox += g * d;
    }
    sq_dev += sq;
    centred[static_cast<size_t>(c)] = sox;
    if (bias != nullptr) bias[c] = static_cast<scalar_t>(so);
  }
  // torch's GroupNorm: the biased variance, eps added inside the root
  const double rstd = 1.0 / std::sqrt(sq_dev / static_cast<double>(n) + eps);
  for (int64_t c = 0; c < channels; ++c) weight[c] = static_cast<scalar_t>(centred[static_cast<size_t>(c)] * rstd);
}

// (weight (B, C), bias (B, C) or an undefined tensor): the per-sample gradients of a GroupNorm with
// num_groups groups over x (B, C, *spatial) and its output gradient o (same shape and dtype).
std::vector<at::Tensor> group_norm_per_sample_grads_cpu(at::Tensor x, at::Tensor o, int64_t num_groups, double eps,
                                                        bool with_bias) {
  TORCH_CHECK(x.device().is_cpu() && o.device().is_cpu(), "x and o must be CPU tensors");
  TORCH_CHECK(x.dim() >= 2, "x must be (B, C, *spatial), got ", x.dim(), " dims");
  TORCH_CHECK(o.sizes() == x.sizes(), "o must have x's shape ", x.sizes(), ", got ", o.sizes());
  TORCH_CHECK(o.scalar_type() == x.scalar_type(), "o must have x's dtype");
  const int64_t B = x.size(0), C = x.size(1);
  TORCH_CHECK(num_groups > 0 && C % num_groups == 0, "num_groups (", num_groups, ") must divide the channels (", C,
              ")");
  x = x.contiguous();
  o = o.contiguous();
  const int64_t L = B * C == 0 ? 0 : x.numel() / (B * C);
  const int64_t channels = C / num_groups;
  at::Tensor weight = at::empty({B, C}, x.options());
  at::Tensor bias = with_bias ? at::empty({B, C}, o.options()) : at::Tensor();
  const int64_t slab = std::max<int64_t>(1, channels * L);
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / slab);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "group_norm_per_sample_grads_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* op = o.data_ptr<scalar_t>();
    scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* bp = with_bias ? bias.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, B * num_groups, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        group_slab<scalar_t>(xp + i * channels * L, op + i * channels * L, channels, L, eps, wp + i * channels,
                             bp == nullptr ? nullptr : bp + i * channels);
      }
    });
  });
  return {weight, bias};
}

}  // namespace norms
}  // namespace pdpfast

void register_norms(pybind11::module_& m) {
  m.def("group_norm_per_sample_grads_cpu", &pdpfast::norms::group_norm_per_sample_grads_cpu,
        "(weight (B, C), bias (B, C) or None): per-sample gradients of a GroupNorm's affine parameters",
        pybind11::arg("x"), pybind11::arg("o"), pybind11::arg("num_groups"), pybind11::arg("eps"),
        pybind11::arg("with_bias"), pybind11::call_guard<pybind11::gil_scoped_release>());
}
