// A linear call's clipped sums added into its parameters' .grad in one call of the extension:
// Σ_i w_i o_iᵀ a_i (the weight-gradient GEMM on row-scaled rows) and Σ_i w_i Σ_t o_{i,t} (the bias),
// then each cast to its parameter's dtype and added to (or set as) its .grad.
//
// These are the very torch ops the Python route issues (pdpfast/ops/linear.py: linear_clipped_grads,
// and ClippingState._accumulate_param in pdpfast/clipping.py), in the same order on the same operands,
// so the results are the same bits. What goes is the Python around them: a book-keeping step runs this
// for every linear call at the end of its backward, per-layer clipping once per call inside it, and
// there the interpreter's cost per call (argument handling, dispatch through four Python functions,
// two .grad updates) was most of what a call cost the host beyond its ops.
//
// The weights come either computed (w, already in o's dtype: ops/linear.py weights_as) or pending
// (their clip_weights arguments: then clip_scale computes them and scales the rows in one op).
#include <torch/extension.h>

#include <optional>
#include <tuple>

namespace pdpfast {
namespace clip {
std::tuple<at::Tensor, at::Tensor> clip_scale(const at::Tensor& x, const at::Tensor& sq, const at::Tensor& bounds,
                                              double offset, double cap, const std::optional<at::Tensor>& rounding,
                                              bool parts);  // clip.cpp
}  // namespace clip

namespace linear {
namespace {

// ClippingState._accumulate_param: g cast to p's dtype and shape, set as p.grad or added to it.
void accumulate(const at::Tensor& p, at::Tensor g) {
  if (g.scalar_type() != p.scalar_type()) g = g.to(p.scalar_type());
  if (g.sizes() != p.sizes()) g = g.reshape(p.sizes());
  at::Tensor& grad = p.mutable_grad();
  if (!grad.defined()) {
    grad = g.data_ptr() == p.data_ptr() ? g.clone() : g.contiguous();
  } else {
    grad.add_(g);
  }
}

// The call's input and output gradient as (B, T, d) and (B, T, p), T the product of x's middle dims
// (1 for a 2-D x, and for a 1-D one: its single dim is both B and d), as nn/linear.py's as_btd.
std::pair<at::Tensor, at::Tensor> as_btd(const at::Tensor& x, const at::Tensor& o) {
  TORCH_CHECK(x.dim() >= 1, "linear_clipped_into: the input must be (B, ..., d), got a 0-dim tensor");
  const int64_t B = x.size(0), d = x.size(-1);
  int64_t T = 1;
  for (int64_t k = 1; k + 1 < x.dim(); ++k) T *= x.size(k);
  return {x.reshape({B, T, d}), o.reshape({B, T, o.size(-1)})};
}

// Σ_i w_i o_iᵀ a_i and the bias's sum from the scaled operand (scale_o: o's rows were scaled, else
// a's) and the weights in o's dtype; linear_clipped_grads' steps after the scaling.
void sums_into(const at::Tensor& a, const at::Tensor& o, const at::Tensor& scaled, const at::Tensor& w, bool scale_o,
               const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, bool transposed) {
  const int64_t d = a.size(-1), p = o.size(-1);
  const at::Tensor a2 = (scale_o ? a : scaled).reshape({-1, d});
  const at::Tensor o2 = (scale_o ? scaled : o).reshape({-1, p});
  if (weight.has_value()) accumulate(*weight, transposed ? a2.t().mm(o2) : o2.t().mm(a2));
  if (bias.has_value()) accumulate(*bias, scale_o ? o2.sum(0) : at::matmul(w, o.sum(1)));
}

bool scales_o(const at::Tensor& a, const at::Tensor& o, const std::optional<at::Tensor>& weight) {
  return o.size(-1) <= a.size(-1) || !weight.has_value();
}

}  // namespace

// weights: (B,) clip weights in o's dtype.
void linear_clipped_into(const at::Tensor& x, const at::Tensor& o, const std::optional<at::Tensor>& weight,
                         const std::optional<at::Tensor>& bias, bool transposed, const at::Tensor& weights) {
  at::NoGradGuard no_grad;
  const auto [a, g] = as_btd(x, o);
  const bool scale_o = scales_o(a, g, weight);
  const at::Tensor w = weights.view({-1, 1, 1});
  sums_into(a, g, scale_o ? g * w : a * w, weights, scale_o, weight, bias, transposed);
}

// The weights pending: clip_weights(sq_norms, clip_norms, offset, cap, rounding, parts), computed by
// clip_scale in the op that scales the rows.
void linear_clip_scale_into(const at::Tensor& x, const at::Tensor& o, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, bool transposed, const at::Tensor& sq_norms,
                            const at::Tensor& clip_norms, double offset, double cap,
                            const std::optional<at::Tensor>& rounding, bool parts) {
  at::NoGradGuard no_grad;
  const auto [a, g] = as_btd(x, o);
  const bool scale_o = scales_o(a, g, weight);
  const auto [scaled, w] = clip::clip_scale(scale_o ? g : a, sq_norms, clip_norms, offset, cap, rounding, parts);
  sums_into(a, g, scaled, w, scale_o, weight, bias, transposed);
}

}  // namespace linear
}  // namespace pdpfast

void register_linear_sums(pybind11::module_& m) {
  m.def("linear_clipped_into", &pdpfast::linear::linear_clipped_into, pybind11::arg("x"), pybind11::arg("o"),
        pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("transposed"), pybind11::arg("weights"),
        "A linear call's clipped sums added into weight.grad and bias.grad (each None when not trained): "
        "x (B, ..., d), o its output gradient (B·T·p values), weights (B,) in o's dtype; transposed: the "
        "weight is stored (d, p). No autograd.");
  m.def("linear_clip_scale_into", &pdpfast::linear::linear_clip_scale_into, pybind11::arg("x"), pybind11::arg("o"),
        pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("transposed"), pybind11::arg("sq_norms"),
        pybind11::arg("clip_norms"), pybind11::arg("offset"), pybind11::arg("cap"),
        pybind11::arg("rounding") = pybind11::none(), pybind11::arg("parts") = false,
        "linear_clipped_into with the weights computed by clip_scale (its arguments) in the op that scales "
        "the rows.");
}
