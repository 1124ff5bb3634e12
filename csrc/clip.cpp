// Clip weights w_i = min(cap, c_i / (sqrt(max(sq_i, 0)) + rho_i + offset)) in one call (rho_i, the
// per-record bound on a low-precision clipped sum's rounding, optional: 0 without it), and the same
// weights applied to a tensor's rows in the call that computes them (clip_scale). With parts, sq_i =
// sq[i, 0] + ... + sq[i, K-1] is summed here, left to right (rho_i likewise, where rho has that dim
// too): the per-program partial sums a norm kernel wrote, so per-layer clipping needs no launch of its
// own to sum them. The formula is clip_weight.h's.
//
// The torch route (pdpfast/ops/clip.py) takes five tensor ops on B values, each a dispatch (and on
// a GPU a kernel launch) that costs far more than its arithmetic; per-layer clipping computes clip
// weights once per layer call, so those five ops were most of what it issued beyond book-keeping.
// clip_scale also takes the row scaling w_i·x_i of the layer's clipped sum (and, in a low precision,
// the weights' cast to x's dtype), so a per-layer call issues one op where it issued three.
// Each step is rounded once in the tensor's dtype (IEEE square root and division are correctly
// rounded); torch's CPU square root is not always, so the two routes agree to 2 ulp
// (tests/test_clip_weights.py). NaN propagates and a bound of 0 (a masked row) gives 0.
#include <torch/extension.h>

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <limits>
#include <tuple>

#include "clip_weight.h"

namespace pdpfast {
namespace clip {

#ifdef PDPFAST_WITH_CUDA
void clip_weights_cuda(const at::Tensor& sq, int64_t parts, const at::Tensor& bounds, const at::Tensor* rho,
                       int64_t rho_parts, at::Tensor& out, double offset, double cap);  // clip_cuda.cu
void clip_scale_cuda(const at::Tensor& x, const at::Tensor& sq, int64_t parts, const at::Tensor& bounds,
                     const at::Tensor* rho, int64_t rho_parts, at::Tensor& out, at::Tensor& weights, double offset,
                     double cap);  // clip_cuda.cu
#endif

namespace {

template <typename scalar_t>
void clip_weights_cpu(const scalar_t* sq, int64_t parts, const scalar_t* bounds, const scalar_t* rho,
                      int64_t rho_parts, scalar_t* out, int64_t n, scalar_t offset, scalar_t cap) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = clip_weight<scalar_t>(sq + i * parts, parts, bounds[i], rho == nullptr ? nullptr : rho + i * rho_parts,
                                   rho_parts, offset, cap);
  }
}

// x and out: n rows of `row` elements; weights: n, in x's dtype. Each weight is computed in acc_t
// (sq's dtype), rounded to x's dtype (toward zero in fp16: weight_as), and each product x·w computed
// in acc_t and rounded once: what torch's x * weights_to(w, x.dtype) computes, bit for bit.
template <typename scalar_t, typename acc_t>
void clip_scale_cpu(const scalar_t* x, const acc_t* sq, int64_t parts, const acc_t* bounds, const acc_t* rho,
                    int64_t rho_parts, scalar_t* out, scalar_t* weights, int64_t n, int64_t row, acc_t offset,
                    acc_t cap) {
  for (int64_t i = 0; i < n; ++i) {
    weights[i] = weight_as<scalar_t, acc_t>(clip_weight<acc_t>(
        sq + i * parts, parts, bounds[i], rho == nullptr ? nullptr : rho + i * rho_parts, rho_parts, offset, cap));
  }
  if (row == 0) return;
  at::parallel_for(0, n * row, at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end;) {
      const int64_t i = j / row;
      const int64_t stop = std::min(end, (i + 1) * row);
      const acc_t w = static_cast<acc_t>(weights[i]);
      for (; j < stop; ++j) out[j] = static_cast<scalar_t>(static_cast<acc_t>(x[j]) * w);
    }
  });
}

// The checks both ops share: sq (with parts, one more trailing dim of partial sums) and rounding
// (bounds' shape, or with parts that shape plus a dim of partial sums) against bounds. Returns the
// number of partial sums per value of sq and of rounding (1: none).
std::pair<int64_t, int64_t> check_norms(const char* op, const at::Tensor& sq, const at::Tensor& bounds,
                                        const std::optional<at::Tensor>& rounding, bool parts) {
  if (parts) {
    TORCH_CHECK(sq.dim() == bounds.dim() + 1 && sq.sizes().slice(0, bounds.dim()) == bounds.sizes(), op,
                ": with parts, sq_norms must be clip_norms' shape ", bounds.sizes(), " plus a dim of partial sums, got ",
                sq.sizes());
  } else {
    TORCH_CHECK(sq.sizes() == bounds.sizes(), op, ": sq_norms of shape ", sq.sizes(), " and clip_norms of shape ",
                bounds.sizes(), " must match");
  }
  TORCH_CHECK(sq.scalar_type() == bounds.scalar_type(), op, ": sq_norms (", sq.scalar_type(), ") and clip_norms (",
              bounds.scalar_type(), ") must have one dtype");
  TORCH_CHECK(sq.scalar_type() == at::kFloat || sq.scalar_type() == at::kDouble, op,
              ": float32 or float64 norms, got ", sq.scalar_type());
  TORCH_CHECK(sq.device() == bounds.device(), op, ": sq_norms on ", sq.device(), " and clip_norms on ",
              bounds.device(), " must be on one device");
  int64_t rho_parts = 1;
  if (rounding.has_value()) {
    const bool summed = rounding->sizes() == bounds.sizes();
    const bool partial = parts && rounding->dim() == bounds.dim() + 1 &&
                         rounding->sizes().slice(0, bounds.dim()) == bounds.sizes();
    TORCH_CHECK((summed || partial) && rounding->scalar_type() == sq.scalar_type() &&
                    rounding->device() == sq.device(),
                op, ": rounding must have clip_norms' shape (with parts, or that shape plus a dim of partial sums) "
                "and sq_norms' dtype and device, got ", rounding->sizes(), " ", rounding->scalar_type(), " on ",
                rounding->device());
    rho_parts = partial ? rounding->size(-1) : 1;
  }
  return {parts ? sq.size(-1) : 1, rho_parts};
}

}  // namespace

// sq and bounds (and rho, when given): same shape (with parts, sq has one more trailing dim, summed;
// rho may have it too), same device, float32 or float64 alike. cap = +inf for automatic clipping (no
// upper bound). Returns a new tensor shaped like bounds.
at::Tensor clip_weights(const at::Tensor& sq, const at::Tensor& bounds, double offset, double cap,
                        const std::optional<at::Tensor>& rounding, bool parts) {
  const auto [k, rho_parts] = check_norms("clip_weights", sq, bounds, rounding, parts);
  at::Tensor r;
  if (rounding.has_value()) r = rounding->contiguous();
  const at::Tensor* rho = r.defined() ? &r : nullptr;
  const at::Tensor s = sq.contiguous();
  const at::Tensor b = bounds.contiguous();
  at::Tensor out = at::empty_like(b);
  if (out.numel() == 0) return out;
  if (s.is_cuda()) {
#ifdef PDPFAST_WITH_CUDA
    clip_weights_cuda(s, k, b, rho, rho_parts, out, offset, cap);
    return out;
#else
    TORCH_CHECK(false, "clip_weights: pdpfast._C was built without CUDA");
#endif
  }
  TORCH_CHECK(s.device().is_cpu(), "clip_weights: CPU or CUDA tensors, got ", s.device());
  AT_DISPATCH_FLOATING_TYPES(s.scalar_type(), "pdpfast_clip_weights_cpu", [&] {
    clip_weights_cpu<scalar_t>(s.data_ptr<scalar_t>(), k, b.data_ptr<scalar_t>(),
                               rho == nullptr ? nullptr : rho->data_ptr<scalar_t>(), rho_parts,
                               out.data_ptr<scalar_t>(), out.numel(), static_cast<scalar_t>(offset),
                               static_cast<scalar_t>(cap));
  });
  return out;
}

// (x scaled row by row by its clip weights, the weights in x's dtype): x (B, ...) float32, float64,
// float16 or bfloat16 on sq's device; bounds (B,); sq (B,) or with parts (B, K); rounding as in
// clip_weights; sq in float64 for a float64 x, else float32 (the dtype torch computes x·w in).
std::tuple<at::Tensor, at::Tensor> clip_scale(const at::Tensor& x, const at::Tensor& sq, const at::Tensor& bounds,
                                              double offset, double cap, const std::optional<at::Tensor>& rounding,
                                              bool parts) {
  TORCH_CHECK(bounds.dim() == 1, "clip_scale: clip_norms must be (B,), got ", bounds.sizes());
  const auto [k, rho_parts] = check_norms("clip_scale", sq, bounds, rounding, parts);
  TORCH_CHECK(x.dim() >= 1 && x.size(0) == bounds.size(0), "clip_scale: x must be (B, ...) with B = ",
              bounds.size(0), " rows, got ", x.sizes());
  const auto x_type = x.scalar_type();
  TORCH_CHECK(x_type == at::kFloat || x_type == at::kDouble || x_type == at::kHalf || x_type == at::kBFloat16,
              "clip_scale: x must be float32, float64, float16 or bfloat16, got ", x_type);
  const auto acc_type = x_type == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(sq.scalar_type() == acc_type, "clip_scale: the norms of a ", x_type, " x must be ", acc_type, ", got ",
              sq.scalar_type());
  TORCH_CHECK(x.device() == sq.device(), "clip_scale: x on ", x.device(), " and sq_norms on ", sq.device(),
              " must be on one device");
  at::Tensor r;
  if (rounding.has_value()) r = rounding->contiguous();
  const at::Tensor* rho = r.defined() ? &r : nullptr;
  const at::Tensor s = sq.contiguous();
  const at::Tensor b = bounds.contiguous();
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  at::Tensor weights = at::empty({bounds.size(0)}, x.options());
  const int64_t n = bounds.size(0);
  if (n == 0) return {out, weights};
  if (xc.is_cuda()) {
#ifdef PDPFAST_WITH_CUDA
    clip_scale_cuda(xc, s, k, b, rho, rho_parts, out, weights, offset, cap);
    return {out, weights};
#else
    TORCH_CHECK(false, "clip_scale: pdpfast._C was built without CUDA");
#endif
  }
  TORCH_CHECK(xc.device().is_cpu(), "clip_scale: CPU or CUDA tensors, got ", xc.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x_type, "pdpfast_clip_scale_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    clip_scale_cpu<scalar_t, acc_t>(xc.data_ptr<scalar_t>(), s.data_ptr<acc_t>(), k, b.data_ptr<acc_t>(),
                                    rho == nullptr ? nullptr : rho->data_ptr<acc_t>(), rho_parts,
                                    out.data_ptr<scalar_t>(), weights.data_ptr<scalar_t>(), n, xc.numel() / n,
                                    static_cast<acc_t>(offset), static_cast<acc_t>(cap));
  });
  return {out, weights};
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
        "partial sums, summed first (rounding may have it too).");
  m.def("clip_scale", &pdpfast::clip::clip_scale, pybind11::arg("x"), pybind11::arg("sq_norms"),
        pybind11::arg("clip_norms"), pybind11::arg("offset"), pybind11::arg("cap"),
        pybind11::arg("rounding") = pybind11::none(), pybind11::arg("parts") = false,
        "(x * w.to(x.dtype) row by row, w.to(x.dtype)) for w = clip_weights(sq_norms, clip_norms, offset, cap, "
        "rounding, parts), in one call: x (B, ...) float32/float64/float16/bfloat16, clip_norms (B,), the norms "
        "float64 for a float64 x, else float32.");
  m.attr("clip_takes_rounding") = true;  // builds before the rounding argument lack it (ops/clip.py)
  m.attr("clip_takes_parts") = true;     // likewise for parts (and clip_scale, for rounding with that dim)
#ifdef PDPFAST_WITH_CUDA
  m.attr("clip_with_cuda") = true;
#else
  m.attr("clip_with_cuda") = false;
#endif
}
