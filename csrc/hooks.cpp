// A DP layer call's backward attached to the autograd node that computed its output, from C++.
//
// pdpfast/nn/layers.py (record_call) hangs a LayerCall on that node as a pre-hook: it fires with the
// call's output gradient and hands (x, ∂L/∂out) to the clipping state. From Python, node.register_prehook
// costs every layer call of every forward a Python wrapper of the node, a call back into Python
// (torch.autograd.Function._register_hook), an OrderedDict and a RemovableHandle with two weak
// references, all for a handle nobody removes: ~9-15 µs of host time a call on the width-16 BERT of
// bench_overhead, a tenth of what a private forward adds to a non-private one. Here it is one C++
// hook holding the LayerCall, and at backward time one Python call with the one gradient it wants
// instead of a tuple of all the node's.
#include <torch/extension.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/python_variable.h>

#include <memory>
#include <optional>
#include <vector>

namespace pdpfast {
namespace hooks {
namespace {

// Calls hook(grads[output_nr]) before the node runs, where that gradient is defined (an output that
// did not reach the loss has none); the gradients pass on unchanged.
struct CallPreHook final : torch::autograd::FunctionPreHook {
  CallPreHook(PyObject* hook, int64_t output_nr) : hook_(hook), output_nr_(output_nr) { Py_INCREF(hook_); }

  ~CallPreHook() override {
    if (Py_IsInitialized()) {  // (at interpreter exit the object is leaked, as torch's own hooks leak theirs)
      pybind11::gil_scoped_acquire gil;
      Py_DECREF(hook_);
    }
  }

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    const at::Tensor& o = grads.at(output_nr_);
    if (!o.defined()) return grads;
    pybind11::gil_scoped_acquire gil;
    PyObject* arg = THPVariable_Wrap(o);
    if (arg == nullptr) throw python_error();
    PyObject* result = PyObject_CallOneArg(hook_, arg);
    Py_DECREF(arg);
    // the hook's exception (e.g. "modified in place after its forward") reaches backward()'s caller as raised
    if (result == nullptr) throw python_error();
    Py_DECREF(result);
    return grads;
  }

 private:
  PyObject* hook_;
  int64_t output_nr_;
};

}  // namespace

// hook(o) as a pre-hook of out's autograd node, o the gradient of out; False (nothing done) where out
// has no node (a leaf: nothing before it needs a gradient).
bool add_call_hook(const at::Tensor& out, pybind11::handle hook) {
  const auto& node = out.grad_fn();
  if (!node) return false;
  node->add_pre_hook(std::make_unique<CallPreHook>(hook.ptr(), out.output_nr()));
  return true;
}

// A DP linear layer's private forward after its checks (ClippingState.forward, pdpfast/nn/linear.py's
// _FlatLinear): F.linear on the input's (B·T, d) rows and the detached parameters, hook(o) on the
// output's node (add_call_hook), the output's leading dims restored. What the Python route spends
// around the one GEMM (a dictionary of detached parameters, three frames down to F.linear, the hook,
// a view) was ~10 µs of host time a call on bench_overhead's width-16 BERT, most of what its private
// forward adds to nn.Linear's. Where the output has no node (nothing before the layer needs a
// gradient), the (B·T, p) output comes back unhooked: the caller attaches DPLayerFunction, which
// marks its input modified in place and so must not get a view.
at::Tensor linear_call(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       bool transposed, pybind11::handle hook) {
  const bool flat = x.dim() == 2;
  const at::Tensor rows = flat ? x : x.reshape({-1, x.size(-1)});
  const at::Tensor w = transposed ? weight.detach().t() : weight.detach();
  const std::optional<at::Tensor> b = bias.has_value() ? std::optional<at::Tensor>(bias->detach()) : std::nullopt;
  at::Tensor out;
  {
    pybind11::gil_scoped_release no_gil;  // as torch's own binding of F.linear
    out = at::linear(rows, w, b);
  }
  if (!add_call_hook(out, hook) || flat) return out;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out.size(-1);
  return out.view(shape);
}

}  // namespace hooks
}  // namespace pdpfast

void register_hooks(pybind11::module_& m) {
  m.def("add_call_hook", &pdpfast::hooks::add_call_hook, pybind11::arg("out"), pybind11::arg("hook"),
        "Register hook(grad) as a pre-hook of out.grad_fn, called with out's own gradient (where defined) "
        "before the node runs; no handle (it lives as long as the node). False where out has no grad_fn.");
  m.def("linear_call", &pdpfast::hooks::linear_call, pybind11::arg("x"), pybind11::arg("weight"),
        pybind11::arg("bias"), pybind11::arg("transposed"), pybind11::arg("hook"),
        "F.linear(x, weight (or its transpose, transposed: stored (d, p)), bias) on x's rows with the parameters "
        "detached and hook(o) as add_call_hook registers it: the output with x's leading dims, or, where it has no "
        "grad_fn (nothing hooked), the (rows, p) output.");
}
