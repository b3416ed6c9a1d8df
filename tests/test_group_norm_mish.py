"""diffpolicy.ops.group_norm_mish: the compiled CPU kernel against ATen's group_norm + mish evaluated in
float64 (an independent reference: ATen's float64 kernels, not the code under test), its fallbacks, and the
U-Net's block running it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from diffpolicy.ops import group_norm_mish, group_norm_mish_reference, kernel_status


def _grads(fn, x, weight, bias, groups, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias) if t is not None]
    it = iter(leaves)
    xx = next(it)
    ww = next(it) if weight is not None else None
    bb = next(it) if bias is not None else None
    y = fn(xx, ww, bb, groups)
    return (y.detach(), *torch.autograd.grad(y, leaves, grad.to(y.dtype)))


def _case(shape, groups, affine, scale=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, c, length = shape
    x = torch.randn(b, c, length, generator=g) * scale + 0.3
    weight = 1 + 0.5 * torch.randn(c, generator=g) if affine else None
    bias = 0.5 * torch.randn(c, generator=g) if affine else None
    grad = torch.randn(b, c, length, generator=g)
    return x, weight, bias, groups, grad


CASES = [
    ((128, 64, 16), 8, True),  # the U-Net's levels at batch 128
    ((128, 256, 4), 8, True),
    ((3, 128, 8), 8, True),
    ((2, 24, 5), 3, True),  # L not a multiple of the vector width, odd group size
    ((4, 16, 7), 1, True),  # one group (LayerNorm over C, L)
    ((5, 32, 3), 8, False),  # no affine (AdaNorm's first block)
    ((2, 8, 1), 8, True),  # one element a group
]


def test_the_cpu_kernel_is_built():
    x = torch.randn(2, 16, 4, requires_grad=True)
    group_norm_mish(x, None, None, 8).sum().backward()
    assert kernel_status("group_norm_mish")["cpu"] == "compiled", kernel_status("group_norm_mish")


@pytest.mark.parametrize("shape,groups,affine", CASES)
def test_forward_and_gradients_match_float64_aten(shape, groups, affine):
    """Output and the gradients of x, weight and bias against ATen in float64, held to the error ATen's own
    float32 kernels make against the same reference (a kernel with a wrong term is off by O(1))."""
    x, weight, bias, groups, grad = _case(shape, groups, affine)
    dbl = [t.double() if t is not None else None for t in (x, weight, bias)]
    ref = _grads(group_norm_mish_reference, *dbl, groups, grad)
    ours = _grads(group_norm_mish, x, weight, bias, groups, grad)
    aten = _grads(group_norm_mish_reference, x, weight, bias, groups, grad)
    for name, o, a, r in zip(("y", "dx", "dweight", "dbias"), ours, aten, ref):
        err = (o.double() - r).abs().max().item()
        aten_err = (a.double() - r).abs().max().item()
        scale = r.abs().max().item() + 1.0
        assert err <= max(4 * aten_err, 2e-6 * scale), (name, err, aten_err)


def test_the_kernel_is_tracked_by_autograd_and_beats_aten_only_in_speed():
    """The fused path runs (its autograd node is the op's) and gives ATen's float32 answer closely."""
    x, weight, bias, groups, grad = _case((16, 64, 8), 8, True)
    x.requires_grad_()
    y = group_norm_mish(x, weight, bias, groups)
    assert type(y.grad_fn).__name__ == "_GroupNormMishBackward"
    assert torch.allclose(y, group_norm_mish_reference(x, weight, bias, groups), atol=2e-6)


def test_extreme_inputs_saturate_like_mish():
    """Pre-activations far outside the exp's clamp: mish(z) = z and mish'(z) = 1 for large z, 0 for very
    negative z, no NaN or inf."""
    x = torch.zeros(1, 2, 4)
    x[0, 0] = torch.tensor([-1.0, 1.0, -1.0, 1.0])
    x[0, 1] = torch.tensor([-1.0, 1.0, -1.0, 1.0])
    weight = torch.tensor([300.0, -300.0])  # z = +-300
    bias = torch.zeros(2)
    x.requires_grad_()
    y = group_norm_mish(x, weight, bias, 2)
    y.sum().backward()
    ref = group_norm_mish_reference(x.detach().double(), weight.double(), bias.double(), 2)
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert torch.allclose(y.double(), ref, atol=1e-3, rtol=1e-6)


def test_non_contiguous_input_and_weight_only_gradient():
    x, weight, bias, groups, grad = _case((6, 32, 8), 8, True)
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, C, L) strides of (B, L, C)
    assert not xt.is_contiguous()
    w = weight.clone().requires_grad_()
    y = group_norm_mish(xt, w, bias, groups)
    (dw,) = torch.autograd.grad(y, [w], grad)
    w_ref = weight.double().requires_grad_()
    (dw_ref,) = torch.autograd.grad(
        group_norm_mish_reference(x.double(), w_ref, bias.double(), groups), [w_ref], grad.double()
    )
    assert torch.allclose(dw.double(), dw_ref, atol=1e-4, rtol=1e-5)


def test_other_dtypes_and_autocast_run_atens_ops_exactly():
    x, weight, bias, groups, _ = _case((4, 16, 8), 8, True)
    x64, w64, b64 = x.double(), weight.double(), bias.double()
    assert torch.equal(group_norm_mish(x64, w64, b64, groups), F.mish(F.group_norm(x64, groups, w64, b64)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = group_norm_mish(x, weight, bias, groups)
        ref = F.mish(F.group_norm(x, groups, weight, bias))
    assert torch.equal(out, ref)


def test_a_groups_count_that_does_not_divide_the_channels_is_one_line():
    x = torch.randn(2, 10, 4)
    with pytest.raises(RuntimeError, match="groups"):
        torch.ops.diffpolicy.group_norm_mish(x, None, None, 3, 1e-5)


def test_the_unet_block_runs_the_op_and_matches_atens_block():
    """Conv1dBlock with the kernel: output and parameter gradients equal ATen's conv -> group_norm -> mish;
    without it (the default) the block is ATen's ops."""
    from diffpolicy.models.unet1d import Conv1dBlock

    torch.manual_seed(0)
    block = Conv1dBlock(7, 64, 5, 8, norm_kernel=True)
    x = torch.randn(32, 7, 16)
    y = block(x)
    assert type(y.grad_fn).__name__ == "_GroupNormMishBackward"
    assert type(Conv1dBlock(7, 64, 5, 8)(x).grad_fn).__name__ == "MishBackward0"
    grads = torch.autograd.grad(y.square().sum(), list(block.parameters()))
    ref_y = F.mish(block.norm(block.conv(x)))
    ref_grads = torch.autograd.grad(ref_y.square().sum(), list(block.parameters()))
    assert torch.allclose(y, ref_y, atol=2e-6)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


def test_disabled_kernel_falls_back_with_one_warning(tmp_path):
    """A fresh process with DIFFPOLICY_NORM_BACKEND=torch: ATen's answer, one warning over several calls."""
    script = textwrap.dedent(
        """
        import warnings
        import torch
        import torch.nn.functional as F
        from diffpolicy.ops import KernelFallbackWarning, group_norm_mish, kernel_status
        x, w, b = torch.randn(4, 16, 8), torch.randn(16), torch.randn(16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = [group_norm_mish(x, w, b, 8) for _ in range(3)]
        fallback = [m for m in caught if issubclass(m.category, KernelFallbackWarning)]
        assert len(fallback) == 1, [str(m.message) for m in caught]
        assert all(torch.equal(o, F.mish(F.group_norm(x, 8, w, b))) for o in outs)
        print(kernel_status("group_norm_mish")["cpu"])
        """
    )
    env = {**os.environ, "DIFFPOLICY_NORM_BACKEND": "torch"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "disabled by DIFFPOLICY_NORM_BACKEND=torch" in proc.stdout


def test_group_norm_mish_benchmark_tiny():
    from diffpolicy.benchmarks.group_norm_mish import run

    out = run(repeats=1, shapes=[[4, 16, 8]])
    row = out["shapes"]["4x16x8"]
    assert row["op_ms"] > 0 and row["aten_ms"] > 0 and row["speedup"] > 0
    assert row["max_abs_error"] < 1e-4 and out["kernel"] == "compiled"
    with pytest.raises(ValueError, match="shapes"):
        run(repeats=1, size=3)


def test_policy_train_kernels_switches_the_blocks_and_the_bc_optimiser():
    """policy.train_kernels=true: every U-Net block runs the operator and BC's AdamW is fused; off (the
    default), neither; the flag enters the BC cache key only when on."""
    from diffpolicy.bc import bc_optimiser
    from diffpolicy.config import BCConfig, PolicyConfig
    from diffpolicy.models.unet1d import Conv1dBlock
    from diffpolicy.policy_io import build_policy

    for on in (False, True):
        policy = build_policy(
            PolicyConfig(horizon=16, train_kernels=on), {"state": [5]}, 3, text_backend="hash"
        )
        blocks = [m for m in policy.modules() if isinstance(m, Conv1dBlock)]
        assert blocks and all(b.norm_kernel is on for b in blocks)
        _, optim, _ = bc_optimiser(policy, None, BCConfig(), 10)
        assert bool(optim.defaults["fused"]) is on
    from diffpolicy.bc import bc_key
    from diffpolicy.cli import compose

    base = compose("train", ["env=mujoco_pick"])
    on = compose("train", ["env=mujoco_pick", "policy.train_kernels=true"])
    off = compose("train", ["env=mujoco_pick", "policy.train_kernels=false"])
    keys = [bc_key(c.env, c.policy, c.bc, c.seed) for c in (base, off, on)]
    assert keys[0] == keys[1] != keys[2]
