"""A count of the CPU's allocated tensor bytes, read as a GPU's caching allocator is read.

On a GPU, per-layer clipping lets a held run of layer calls grow while the caching allocator counts no
more bytes than where the backward began (``pdpfast.clipping._below_backward_start``, which reads
``pdpfast.clipping._allocated_bytes``). The CPU's allocator keeps no such count, so the CPU's stand-in
for a GPU's step (``bench.bench_overhead.large_call_route``) would otherwise take the GPU's route with
the CPU's run bounds. ``counted_cpu_bytes()`` installs a CPU allocator that counts the bytes it hands
out and takes back (built once with ``torch.utils.cpp_extension.load_inline``; a C++ compiler is
needed) and has ``_allocated_bytes`` read it for CPU tensors (0.5 µs a read).
"""
from __future__ import annotations

import contextlib
import functools
import subprocess

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace {
std::atomic<int64_t> live{0};
std::mutex sizes_lock;
std::unordered_map<void*, size_t> sizes;  // what each live pointer was handed out with
c10::DeleterFnPtr inner_delete = nullptr;

// the context stays the data pointer (raw_allocate's callers, oneDNN's scratch, assert it)
void release(void* data) {
  {
    std::lock_guard<std::mutex> guard(sizes_lock);
    auto it = sizes.find(data);
    if (it != sizes.end()) {  // (else handed out before the count began, freed through raw_deleter())
      live -= static_cast<int64_t>(it->second);
      sizes.erase(it);
    }
  }
  inner_delete(data);
}

struct Counting final : c10::Allocator {
  explicit Counting(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(size_t bytes) override {
    c10::DataPtr d = inner_->allocate(bytes);
    TORCH_CHECK(d.get() == d.get_context(), "the wrapped CPU allocator's pointers carry a context");
    void* data = d.release_context();
    if (data == nullptr) {
      return {nullptr, nullptr, &release, c10::Device(c10::DeviceType::CPU)};
    }
    {
      std::lock_guard<std::mutex> guard(sizes_lock);
      sizes[data] = bytes;
    }
    live += static_cast<int64_t>(bytes);
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

 private:
  c10::Allocator* inner_;
};

Counting* installed = nullptr;
}  // namespace

void install() {
  if (installed == nullptr) {
    c10::Allocator* inner = c10::GetCPUAllocator();
    inner_delete = inner->raw_deleter();
    TORCH_CHECK(inner_delete != nullptr, "the CPU allocator has no raw deleter to wrap");
    installed = new Counting(inner);
    c10::SetCPUAllocator(installed, /*priority=*/1);
  }
}

int64_t allocated() { return live.load(std::memory_order_relaxed); }
"""


@functools.cache
def _extension():
    from torch.utils.cpp_extension import load_inline

    ext = load_inline("pdpfast_bench_cpu_bytes", _SOURCE, functions=["install", "allocated"])
    ext.install()  # (for the rest of the process: tensors it hands out outlive any block)
    return ext


@functools.cache
def why_not_counted() -> str | None:
    """None where the counting allocator builds (once a process; torch caches the build), else why
    not (no C++ compiler or ninja, say): ``counted_cpu_bytes`` then raises it."""
    try:
        _extension()
    except (ImportError, OSError, RuntimeError, subprocess.SubprocessError) as exc:
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0] if lines else 'no message'}"
    return None


@contextlib.contextmanager
def counted_cpu_bytes():
    """Within the block, ``pdpfast.clipping._allocated_bytes`` counts a CPU device's tensor bytes
    (those allocated since the counting allocator was installed: the first block of the process)."""
    import pdpfast.clipping as clipping

    why = why_not_counted()
    if why is not None:
        raise RuntimeError(f"the CPU's tensor bytes cannot be counted: {why}")
    allocated = _extension().allocated
    reads = clipping._allocated_bytes

    def counted(device: torch.device) -> int | None:
        return allocated() if device.type == "cpu" else reads(device)

    clipping._allocated_bytes = counted
    try:
        yield
    finally:
        clipping._allocated_bytes = reads
