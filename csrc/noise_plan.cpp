// The launch plan of kernels/noise.py's add_noise_ (one launch per device and dtype) from C++.
//
// Every step noises every trainable gradient: the plan reads each one's dtype, size, layout and
// address, and gives each its first Philox counter and first block. In Python that is ~1.75 µs of
// host time a tensor (BERT-base's 201 gradients: ~0.35 ms a step, on a GPU too), here a fraction
// of it. The plan, and so the noise, is the Python route's (kernels/noise.py, _groups).
#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace pdpfast {
namespace noise {
namespace {

struct Group {
  at::Tensor first;
  std::vector<int64_t> ptrs, numels, counters, first_blocks;
  int64_t blocks = 0;
};

}  // namespace

// (groups, writebacks) as kernels/noise.py's _groups returns them, or None where a tensor is not
// floating point (the Python route raises, naming its dtype).
pybind11::object noise_groups(const std::vector<at::Tensor>& grads, int64_t block) {
  TORCH_CHECK(block > 0 && block % 4 == 0, "noise_groups: block must be a positive multiple of 4, got ", block);
  const int64_t quarter = block / 4;
  std::vector<Group> groups;
  pybind11::list writebacks;
  int64_t counter = 0;
  for (const at::Tensor& g : grads) {
    if (!g.is_floating_point()) return pybind11::none();
    const int64_t n_blocks = (g.numel() + block - 1) / block;
    if (n_blocks) {
      at::Tensor target = g;
      if (!g.is_contiguous()) {
        target = g.contiguous();
        writebacks.append(pybind11::make_tuple(g, target));
      }
      Group* group = nullptr;
      for (Group& known : groups) {  // (one or two groups: a linear search)
        if (known.first.device() == g.device() && known.first.scalar_type() == g.scalar_type()) {
          group = &known;
          break;
        }
      }
      if (group == nullptr) {
        groups.emplace_back();
        group = &groups.back();
        group->first = target;
      }
      group->ptrs.push_back(reinterpret_cast<int64_t>(target.data_ptr()));
      group->numels.push_back(target.numel());
      group->counters.push_back(counter);
      group->first_blocks.push_back(group->blocks);
      group->blocks += n_blocks;
    }
    counter += n_blocks * quarter;
  }
  pybind11::list out;
  for (Group& group : groups) {
    std::vector<int64_t> values;
    values.reserve(4 * group.ptrs.size());
    for (const auto* row : {&group.ptrs, &group.numels, &group.counters, &group.first_blocks}) {
      values.insert(values.end(), row->begin(), row->end());
    }
    out.append(pybind11::make_tuple(group.first, pybind11::cast(values), group.blocks,
                                    static_cast<int64_t>(group.ptrs.size())));
  }
  return pybind11::make_tuple(out, writebacks);
}

}  // namespace noise
}  // namespace pdpfast

void register_noise(pybind11::module_& m) {
  m.def("noise_groups", &pdpfast::noise::noise_groups, pybind11::arg("grads"), pybind11::arg("block"),
        "kernels/noise.py's launch plan of add_noise_: ([(first tensor, table values, blocks, tensors)] one per "
        "device and dtype, [(tensor, its contiguous copy)]), or None where a tensor is not floating point.");
}
