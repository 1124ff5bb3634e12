"""``python -m pdpfast.info``: which implementation each op runs, and why the others do not."""
from __future__ import annotations

import platform

import torch

from .ops import dispatch


def report() -> str:
    """What this installation runs: versions, the CUDA device, and each op's implementation.

    Returns:
        a multi-line str: the pdpfast / torch / python versions, the CUDA device (or "not available"),
        then one line per registered op ("triton kernel", or "torch reference (why)"), one for the
        Poisson sampler's backend (with the reason its compiled path is not used, if any), one for the
        loader's draw from thresholds (``sampling.loader_route``), one for the
        CPU GroupNorm per-sample gradients, one per device for the clip weights (C++ kernel or
        torch, and why), and one each for the routes of the linear clipped sums, the layer calls'
        hooks, the linear layers' private forward and the noise kernel's launch plan.
    """
    import pdpfast
    from pdpfast import _ext, sampling
    from pdpfast.nn import layers
    from pdpfast.ops import clip, linear, norm

    lines = [f"pdpfast {pdpfast.__version__}, torch {torch.__version__}, python {platform.python_version()}"]
    cuda = torch.cuda.is_available()
    lines.append(f"CUDA: {torch.cuda.get_device_name(0) if cuda else 'not available'}")
    reason = None
    if dispatch.triton_disabled():
        reason = "disabled by PDPFAST_DISABLE_TRITON=1"
    elif not (cuda or dispatch.triton_interpret()):
        reason = "no CUDA device (TRITON_INTERPRET=1 runs the kernels on the CPU, for tests)"
    else:
        reason = dispatch.triton_import_error()
    for name, op in sorted(dispatch.registered(load_kernels=reason is None).items()):
        impl = "triton kernel" if reason is None and op.kernel is not None else \
            f"torch reference ({reason or 'no kernel registered'})"
        lines.append(f"  {name:<28} {impl}")
    why = sampling.unavailable_reason()
    lines.append(f"  {'poisson_sample':<28} {sampling.backend()}" + (f" ({why})" if why else ""))
    lines.append(f"  {'poisson_sample (loader, CPU)':<28} {sampling.loader_route()}")
    cpu = torch.zeros(1, 1)
    lines.append(f"  {'group_norm (CPU)':<28} {norm.group_norm_kernel(cpu, cpu)}")
    for device in ["cpu"] + (["cuda"] if cuda else []):
        w = torch.zeros(1, device=device)
        lines.append(f"  {f'clip_weights ({device.upper()})':<28} {clip.clip_weights_route(w, w)}")
        x = torch.zeros(1, 1, device=device)
        lines.append(f"  {f'clip_scale ({device.upper()})':<28} {clip.clip_scale_route(x, clip.PendingWeights(w, w))}")
    lines.append(f"  {'linear_clipped_into':<28} {linear.linear_clipped_into_route()}")
    lines.append(f"  {'layer call hooks':<28} {layers.call_hook_route()}")
    # a linear layer's private forward (nn/linear.py) and the noise kernel's launch plan (kernels/noise.py)
    for what, function, source in (("linear layer calls", "linear_call", "hooks.cpp"),
                                   ("noise launch plan", "noise_groups", "noise_plan.cpp")):
        why = _ext.missing(function, source)
        lines.append(f"  {what:<28} " + ("C++ (pdpfast._C)" if why is None else f"Python ({why})"))
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
