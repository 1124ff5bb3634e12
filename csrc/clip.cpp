// Clip weights w_i = min(cap, c_i / (sqrt(max(sq_i, 0)) + rho_i + offset)) in one call (rho_i, the
// per-record bound on a low-precision clipped sum's rounding, optional: 0 without it). With parts,
// sq_i = sq[i, 0] + ... + sq[i, K-1] is summed here, left to right: the per-program partial sums a
// norm kernel wrote, so per-layer clipping needs no launch of its own to sum them.
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
void clip_weights_cuda(const at::Tensor& sq, int64_t parts, const at::Tensor& bounds, const at::Tensor* rho,
                       at::Tensor& out, double offset, double cap);  // clip_cuda.cu
#endif

namespace {

// sq holds `parts` values per weight, side by side (1: the squared norm itself)
template <typename scalar_t>
void clip_weights_cpu(const scalar_t* sq, int64_t parts, const scalar_t* bounds, const scalar_t* rho, scalar_t* out,
                      int64_t n, scalar_t offset, scalar_t cap) {
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* row = sq + i * parts;
    scalar_t s = parts > 0 ? row[0] : scalar_t(0);
    for (int64_t k = 1; k < parts; ++k) s += row[k];
    // torch.clamp_min keeps NaN; a comparison written this way does too
    scalar_t root = std::sqrt(s < scalar_t(0) ? scalar_t(0) : s);
    if (rho != nullptr) root += rho[i];
    const scalar_t w = bounds[i] / (root + offset);
    out[i] = w > cap ? cap : w;  // NaN stays NaN, as torch.clamp_ leaves it
  }
}

}  // namespace

// sq and bounds (and rho, when given): same shape (with parts, sq has one more trailing dim, summed),
// same device, float32 or float64 alike. cap = +inf for automatic clipping (no upper bound). Returns a
// new tensor shaped like bounds.
at::Tensor clip_weights(const at::Tensor& sq, const at::Tensor& bounds, double offset, double cap,
                        const std::optional<at::Tensor>& rounding, bool parts) {
  if (parts) {
    TORCH_CHECK(sq.dim() == bounds.dim() + 1 && sq.sizes().slice(0, bounds.dim()) == bounds.sizes(),
                "clip_weights: with parts, sq_norms must be clip_norms' shape ", bounds.sizes(),
                " plus a dim of partial sums, got ", sq.sizes());
  } else {
    TORCH_CHECK(sq.sizes() == bounds.sizes(), "clip_weights: sq_norms of shape ", sq.sizes(),
                " and clip_norms of shape ", bounds.sizes(), " must match");
  }
  const int64_t k = parts ? sq.size(-1) : 1;
  TORCH_CHECK(sq.scalar_type() == bounds.scalar_type(), "clip_weights: sq_norms (", sq.scalar_type(),
              ") and clip_norms (", bounds.scalar_type(), ") must have one dtype");
  TORCH_CHECK(sq.scalar_type() == at::kFloat || sq.scalar_type() == at::kDouble,
              "clip_weights: float32 or float64 tensors, got ", sq.scalar_type());
  TORCH_CHECK(sq.device() == bounds.device(), "clip_weights: sq_norms on ", sq.device(), " and clip_norms on ",
              bounds.device(), " must be on one device");
  at::Tensor r;
  if (rounding.has_value()) {
    TORCH_CHECK(rounding->sizes() == bounds.sizes() && rounding->scalar_type() == sq.scalar_type() &&
                    rounding->device() == sq.device(),
                "clip_weights: rounding must have clip_norms' shape and sq_norms' dtype and device, got ",
                rounding->sizes(), " ", rounding->scalar_type(), " on ", rounding->device());
    r = rounding->contiguous();
  }
  const at::Tensor* rho = r.defined() ? &r : nullptr;
  const at::Tensor s = sq.contiguous();
  const at::Tensor b = bounds.contiguous();
  at::Tensor out = at::empty_like(b);
  if (out.numel() == 0) return out;
  if (s.is_cuda()) {
#ifdef PDPFAST_WITH_CUDA
    clip_weights_cuda(s, k, b, rho, out, offset, cap);
    return out;
#else
    TORCH_CHECK(false, "clip_weights: pdpfast._C was built without CUDA");
#endif
  }
  TORCH_CHECK(s.device().is_cpu(), "clip_weights: CPU or CUDA tensors, got ", s.device());
  AT_DISPATCH_FLOATING_TYPES(s.scalar_type(), "pdpfast_clip_weights_cpu", [&] {
    clip_weights_cpu<scalar_t>(s.data_ptr<scalar_t>(), k, b.data_ptr<scalar_t>(),
                               rho == nullptr ? nullptr : rho->data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                               out.numel(), static_cast<scalar_t>(offset), static_cast<scalar_t>(cap));
  });
  return out;
}

}  // namespace clip
}  // namespace pdpfast

void register_clip(pybind11::module_& m) {
  m.def("clip_weights", &pdpfast::clip::clip_weights, pybind11::arg("sq_norms"), pybind11::arg("clip_norms"),
        pybind11::arg("offset"), pybind11::arg("cap"), pybind11::arg("rounding") = pybind11::none(),
        pybind11::arg("parts") = false,
        "min(cap, clip_norms / (sqrt(max(sq_norms, 0)) + rounding + offset)) elementwise, in one call: sq_norms, "
        "clip_norms (and rounding, or None for 0) of one shape, dtype (float32/float64) and device (CPU, or CUDA "
        "when built with it); cap = inf for no upper bound. parts=True: sq_norms has one more trailing dim of "
        "partial sums, summed first.");
  m.attr("clip_takes_rounding") = true;  // builds before the rounding argument lack it (ops/clip.py)
  m.attr("clip_takes_parts") = true;     // likewise for parts
#ifdef PDPFAST_WITH_CUDA
  m.attr("clip_with_cuda") = true;
#else
  m.attr("clip_with_cuda") = false;
#endif
}
