// The one pybind11 module of pdpfast._C: every csrc/ file exposes a register_* function and this
// file calls them all, so adding a file never makes two PYBIND11_MODULE definitions clash.
#include <torch/extension.h>

void register_clip(pybind11::module_& m);
void register_hooks(pybind11::module_& m);
void register_linear_sums(pybind11::module_& m);
void register_memory(pybind11::module_& m);
void register_noise(pybind11::module_& m);
void register_norms(pybind11::module_& m);
void register_sampler(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_clip(m);
  register_hooks(m);
  register_linear_sums(m);
  register_memory(m);
  register_noise(m);
  register_norms(m);
  register_sampler(m);
}
