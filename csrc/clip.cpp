// Clip weights w_i = min(cap, c_i / (sqrt(max(sq_i, 0)) + rho_i + offset)) in one call (rho_i, the
// per-record bound on a low-precision clipped sum's rounding, optional: 0 without it).
//
// The torch route (pdpfast/ops/clip.py) takes five tensor ops on B values, each a dispatch (and on
// a GPU a kernel launch) that costs far more than its arithmetic; per-layer clipping computes clip
// weights once per layer call, so those five ops were most of what it issued beyond book-keeping.
// Each step is rounded once in the tensor's dtype (IEEE square root and division are correctly
// rounded); torch's CPU square root is not always, so the two routes agree to 2 ulp
// (tests/test_clip_weights.py). NaN propagates and a bound of 0 (a masked row) gives 0.
#include <torch/extension.h>

#include <cmath>
#include <limits>

namespace pdpfast {
namespace clip {

#ifdef PDPFAST_WITH_CUDA
void clip_weights_cuda(const at::Tensor& sq, const at::Tensor& bounds, const at::Tensor* rho, at::Tensor& out,
                       double offset, double cap);  // clip_cuda.cu
#endif

namespace {

template <typename scalar_t>
void clip_weights_cpu(const scalar_t* sq, const scalar_t* bounds, const scalar_t* rho, scalar_t* out, int64_t n,
                      scalar_t offset, scalar_t cap) {
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t s = sq[i];
    // torch.clamp_min keeps NaN; a comparison written this way does too
    scalar_t root = std::sqrt(s < scalar_t(0) ? scalar_t(0) : s);
    if (rho != nullptr) root += rho[i];
    const scalar_t w = bounds[i] / (root + offset);
    out[i] = w > cap ? cap : w;  // NaN stays NaN, as torch.clamp_ leaves it
  }
}

}  // namespace

// sq and bounds (and rho, when given): same shape, same device, float32 or float64 alike. cap = +inf
// for automatic clipping (no upper bound). Returns a new tensor shaped like sq.
at::Tensor clip_weights(const at::Tensor& sq, const at::Tensor& bounds, double offset, double cap,
                        const std::optional<at::Tensor>& rounding) {
  TORCH_CHECK(sq.sizes() == bounds.sizes(), "clip_weights: sq_norms of shape ", sq.sizes(),
              " and clip_norms of shape ", bounds.sizes(), " must match");
  TORCH_CHECK(sq.scalar_type() == bounds.scalar_type(), "clip_weights: sq_norms (", sq.scalar_type(),
              ") and clip_norms (", bounds.scalar_type(), ") must have one dtype");
  TORCH_CHECK(sq.scalar_type() == at::kFloat || sq.scalar_type() == at::kDouble,
              "clip_weights: float32 or float64 tensors, got ", sq.scalar_type());
  TORCH_CHECK(sq.device() == bounds.device(), "clip_weights: sq_norms on ", sq.device(), " and clip_norms on ",
              bounds.device(), " must be on one device");
  at::Tensor r;
  if (rounding.has_value()) {
    TORCH_CHECK(rounding->sizes() == sq.sizes() && rounding->scalar_type() == sq.scalar_type() &&
                    rounding->device() == sq.device(),
                "clip_weights: rounding must have sq_norms' shape, dtype and device, got ", rounding->sizes(), " ",
                rounding->scalar_type(), " on ", rounding->device());
    r = rounding->contiguous();
  }
  const at::Tensor* rho = r.defined() ? &r : nullptr;
  const at::Tensor s = sq.contiguous();
  const at::Tensor b = bounds.contiguous();
  at::Tensor out = at::empty_like(s);
  if (s.numel() == 0) return out;
  if (s.is_cuda()) {
#ifdef PDPFAST_WITH_CUDA
    clip_weights_cuda(s, b, rho, out, offset, cap);
    return out;
#else
    TORCH_CHECK(false, "clip_weights: pdpfast._C was built without CUDA");
#endif
  }
  TORCH_CHECK(s.device().is_cpu(), "clip_weights: CPU or CUDA tensors, got ", s.device());
  AT_DISPATCH_FLOATING_TYPES(s.scalar_type(), "pdpfast_clip_weights_cpu", [&] {
    clip_weights_cpu<scalar_t>(s.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(),
                               rho == nullptr ? nullptr : rho->data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                               s.numel(), static_cast<scalar_t>(offset), static_cast<scalar_t>(cap));
  });
  return out;
}

}  // namespace clip
}  // namespace pdpfast

void register_clip(pybind11::module_& m) {
  m.def("clip_weights", &pdpfast::clip::clip_weights, pybind11::arg("sq_norms"), pybind11::arg("clip_norms"),
        pybind11::arg("offset"), pybind11::arg("cap"), pybind11::arg("rounding") = pybind11::none(),
        "min(cap, clip_norms / (sqrt(max(sq_norms, 0)) + rounding + offset)) elementwise, in one call: sq_norms, "
        "clip_norms (and rounding, or None for 0) of one shape, dtype (float32/float64) and device (CPU, or CUDA "
        "when built with it); cap = inf for no upper bound.");
  m.attr("clip_takes_rounding") = true;  // builds before the rounding argument lack it (ops/clip.py)
#ifdef PDPFAST_WITH_CUDA
  m.attr("clip_with_cuda") = true;
#else
  m.attr("clip_with_cuda") = false;
#endif
}
