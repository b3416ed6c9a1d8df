"""CPU fast path of the denoiser for sampling: prepacked convolutions on token-major activations.

:class:`FastUnet1D` is a drop-in ``forward_film`` for :func:`~diffpolicy.diffusion.sampler.ddim_sample`:
``(x (B, Ta, Da), film (B, R)) -> eps (B, Ta, Da)``, the same function as
:meth:`ConditionalUnet1D.forward_film` evaluated by different kernels. Activations stay token-major
(B, L, C) from the input chunk to the output, so the network needs no transposes, and every convolution is
one of

- ``gemm``: im2col of the padded (B, L, C) activation (one copy) and one ``addmm`` with a weight reshaped
  once to (k C_in, C_out); the stride-2 transposed convolution becomes a single GEMM over 3-tap windows
  whose (L, 2 C_out) output is the interleaved (2 L, C_out) result. Lowest per-call overhead: wins for the
  small layers;
- ``mkldnn``: oneDNN convolution (as a Conv2d with H = 1 in channels-last, the same memory as (B, L, C))
  with its weight reordered once into oneDNN's blocked layout. Wins for the wide layers, where PyTorch's
  batch-1 heuristics otherwise pick the unpacked im2col path or reorder the weight on every call.

The choice is per layer by size (``impl="auto"``: oneDNN above :data:`MKLDNN_MIN_MFLOP`). Packed weights
are a snapshot: :func:`fast_unet` keeps one :class:`FastUnet1D` per denoiser and repacks it in place when
a parameter changes (optimizer steps and ``load_state_dict`` bump tensor versions), so a PPO learner can
sample between updates without doing anything. Numerics are those of the eager network up to fp32
summation order (about 1e-6).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from diffpolicy.models.unet1d import ConditionalUnet1D, CondResBlock1d, sample_to_eps

MKLDNN_MIN_MFLOP = 8.0
"""Layers with more MFLOP per call than this use oneDNN (measured crossover on AVX-512, 1-2 threads)."""


def fast_path_available(denoiser: nn.Module, cond: torch.Tensor) -> bool:
    """Whether :class:`FastUnet1D` may stand in for ``denoiser.forward_film`` for this call.

    CPU, float32, no autograd, no CPU autocast (under autocast the eager network runs in bf16 and the fast
    path would silently change precision).
    """
    return (
        isinstance(denoiser, ConditionalUnet1D)
        and cond.device.type == "cpu"
        and cond.dtype == torch.float32
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and next(denoiser.parameters()).dtype == torch.float32
    )


class _Conv:
    """One Conv1d / ConvTranspose1d(k=4, s=2, p=1) on token-major activations: (B, L, C_in) -> (B, L', C_out)."""

    def __init__(self, conv: nn.Conv1d | nn.ConvTranspose1d, length: int, impl: str) -> None:
        self.conv, self.length = conv, length
        self.transposed = isinstance(conv, nn.ConvTranspose1d)
        if self.transposed:
            c_in, c_out, k = conv.weight.shape
            ok = (k, conv.stride[0], conv.padding[0], conv.output_padding[0]) == (4, 2, 1, 0)
            if not ok or conv.groups != 1 or conv.dilation[0] != 1:
                raise ValueError("FastUnet1D supports ConvTranspose1d(k=4, stride=2, padding=1) only")
            mflop = 2 * c_in * c_out * k * length / 1e6
        else:
            c_out, c_in, k = conv.weight.shape
            if conv.groups != 1 or conv.dilation[0] != 1 or not isinstance(conv.padding[0], int):
                raise ValueError("FastUnet1D supports ungrouped, undilated, int-padded Conv1d only")
            mflop = 2 * c_in * c_out * k * length / conv.stride[0] / 1e6
        if impl == "auto":
            impl = "mkldnn" if mflop > MKLDNN_MIN_MFLOP and torch.backends.mkldnn.is_available() else "gemm"
        if impl not in ("gemm", "mkldnn"):
            raise ValueError(f"impl={impl!r} is not allowed; choose auto, gemm or mkldnn")
        self.impl, self.c_in, self.c_out = impl, c_in, c_out
        self.k, self.stride, self.pad = k, conv.stride[0], conv.padding[0]
        if impl == "mkldnn":
            self.pad2, self.stride2, self.dil2 = [0, self.pad], [1, self.stride], [1, 1]
        elif self.transposed:  # the 3-tap GEMM form below is a stride-1 "conv" with padding 1
            self.k, self.pad, self.stride = 3, 1, 1
        self.weight, self.bias = self._packed()

    def _packed(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight in this kernel's layout, bias) from the module's current parameters."""
        w = self.conv.weight.detach().float()
        b = None if self.conv.bias is None else self.conv.bias.detach().float()
        if self.impl == "mkldnn":
            w4 = w.unsqueeze(2).contiguous()  # (.., .., 1, k): a Conv2d with H = 1
            size = [1, self.c_in, 1, self.length]
            mk = torch.ops.mkldnn
            if self.transposed:
                w = mk._reorder_convolution_transpose_weight(
                    w4, self.pad2, [0, 0], self.stride2, self.dil2, 1, size
                )
            else:
                w = mk._reorder_convolution_weight(w4, self.pad2, self.stride2, self.dil2, 1, size)
            return w, None if b is None else b.clone()
        if self.transposed:
            # Output 2m takes taps (x[m-1], x[m]) through (w3, w1), output 2m+1 takes (x[m], x[m+1]) through
            # (w2, w0): one GEMM over 3-tap windows with the two phases side by side.
            wc = w.new_zeros(3, self.c_in, 2, self.c_out)  # (tap, C_in, phase, C_out)
            wc[0, :, 0], wc[1, :, 0] = w[:, :, 3], w[:, :, 1]
            wc[1, :, 1], wc[2, :, 1] = w[:, :, 2], w[:, :, 0]
            return wc.reshape(3 * self.c_in, 2 * self.c_out), None if b is None else torch.cat([b, b])
        w = w.permute(2, 1, 0).reshape(self.k * self.c_in, self.c_out).contiguous()  # (k C_in, C_out)
        return w, None if b is None else b.clone()

    def repack(self) -> None:
        """Copy the module's current parameters into the packed tensors (same storage, same layout)."""
        w, b = self._packed()
        self.weight.copy_(w)
        if b is not None:
            self.bias.copy_(b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        if self.impl == "mkldnn":
            x4 = x.permute(0, 2, 1).unsqueeze(2)  # (B, C, 1, L) channels-last view of the same memory
            mk = torch.ops.mkldnn
            if self.transposed:
                y = mk._convolution_transpose_pointwise(
                    x4, self.weight, self.bias, self.pad2, [0, 0], self.stride2, self.dil2, 1, "none", [], ""
                )
            else:
                y = mk._convolution_pointwise(
                    x4, self.weight, self.bias, self.pad2, self.stride2, self.dil2, 1, "none", [], ""
                )
            return y.squeeze(2).permute(0, 2, 1)  # (B, L', C_out), contiguous
        k, p, s = self.k, self.pad, self.stride
        if k == 1 and s == 1:
            cols = x.reshape(B * L, C)
        else:
            xp = F.pad(x, (0, 0, p, p)) if p else x.contiguous()  # (B, L + 2p, C)
            Lout = (L + 2 * p - k) // s + 1
            win = xp.as_strided((B, Lout, k * C), (xp.shape[1] * C, s * C, 1))  # overlapping windows
            cols = win.reshape(B * Lout, k * C)  # im2col copy
        y = torch.mm(cols, self.weight) if self.bias is None else torch.addmm(self.bias, cols, self.weight)
        return y.view(B, -1, self.c_out)  # transposed: (B, L, 2 C_out) -> (B, 2 L, C_out)


class _Block:
    """A :class:`CondResBlock1d` on token-major activations."""

    def __init__(self, blk: CondResBlock1d, length: int, impl: str) -> None:
        self.c = blk.c_out
        self.film = blk.conditioning == "film"
        self.conv0, self.norm0 = _Conv(blk.block0.conv, length, impl), blk.block0.norm
        self.conv1, self.norm1 = _Conv(blk.block1.conv, length, impl), blk.block1.norm
        res = blk.residual
        self.residual = None if isinstance(res, nn.Identity) else _Conv(res, length, impl)

    def __call__(self, x: torch.Tensor, film: torch.Tensor) -> torch.Tensor:
        """x (B, L, C_in), film (B, 2 C_out) -> (B, L, C_out)."""
        scale, shift = film[:, None, : self.c], film[:, None, self.c :]  # (B, 1, C_out)
        h = _group_norm(self.conv0(x), self.norm0)
        if self.film:
            h = torch.addcmul(shift, F.mish(h), scale)
        else:
            h = F.mish(torch.addcmul(shift + h, h, scale))  # (1 + scale) h + shift
        h = F.mish(_group_norm(self.conv1(h), self.norm1))
        return h + (x if self.residual is None else self.residual(x))


def _group_norm(x: torch.Tensor, norm: nn.GroupNorm) -> torch.Tensor:
    """GroupNorm of token-major x (B, L, C) through PyTorch's channels-last kernel -> (B, L, C)."""
    y = F.group_norm(x.permute(0, 2, 1).unsqueeze(2), norm.num_groups, norm.weight, norm.bias, norm.eps)
    return y.squeeze(2).permute(0, 2, 1)


class FastUnet1D:
    """Sampling-only copy of a :class:`ConditionalUnet1D` with prepacked weights (CPU, fp32, no grad).

    ``FastUnet1D(denoiser, horizon)(x, film)`` equals ``denoiser.forward_film(x, film)`` for x (B, Ta, Da)
    and film (B, R) from :meth:`ConditionalUnet1D.film_tables`; ``horizon`` (Ta) only guides the per-layer
    kernel choice, any length divisible by the U-Net's downsampling works. ``impl``: ``auto`` | ``gemm`` |
    ``mkldnn``. Packed weights are a snapshot; :meth:`repack` refreshes them in place (the GroupNorm
    affines are read live from the denoiser).
    """

    def __init__(self, denoiser: ConditionalUnet1D, horizon: int = 64, impl: str = "auto") -> None:
        self.horizon, self.impl = horizon, impl
        self.fold = denoiser.fold
        self.sample = denoiser.prediction == "sample"
        with torch.inference_mode(False), torch.no_grad():  # ordinary tensors: repack may run anywhere
            self.splits = denoiser.film_splits()
            length = horizon // self.fold
            self.down: list[tuple[_Block, _Block, _Conv | None]] = []
            for (b0, b1), down in zip(denoiser.down, denoiser.downsample):
                pair = _Block(b0, length, impl), _Block(b1, length, impl)
                self.down.append(
                    (*pair, None if isinstance(down, nn.Identity) else _Conv(down, length, impl))
                )
                length = length if isinstance(down, nn.Identity) else length // 2
            self.mid = [_Block(b, length, impl) for b in denoiser.mid]
            self.up: list[tuple[_Block, _Block, _Conv]] = []
            for (b0, b1), up in zip(denoiser.up, denoiser.upsample):
                self.up.append((_Block(b0, length, impl), _Block(b1, length, impl), _Conv(up, length, impl)))
                length *= 2
            self.final_conv = _Conv(denoiser.final_block.conv, length, impl)
            self.final_norm = denoiser.final_block.norm
            self.final_proj = _Conv(denoiser.final_proj, length, impl)
        self._compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def convs(self) -> list[_Conv]:
        """Every convolution (blocks in execution order, then down/upsampling, then the head)."""
        blocks = (
            [b for lvl in self.down for b in lvl[:2]] + self.mid + [b for lvl in self.up for b in lvl[:2]]
        )
        out: list[_Conv] = []
        for blk in blocks:
            out += [blk.conv0, blk.conv1] + ([] if blk.residual is None else [blk.residual])
        out += [c for lvl in self.down if (c := lvl[2]) is not None] + [lvl[2] for lvl in self.up]
        return [*out, self.final_conv, self.final_proj]

    def impls(self) -> list[str]:
        """Kernel (``gemm`` / ``mkldnn``) of every convolution, in :meth:`convs` order."""
        return [c.impl for c in self.convs()]

    def repack(self) -> None:
        """Refresh every packed weight from the denoiser's current parameters, in place.

        The tensors keep their storage, so a :meth:`compiled` forward stays valid without recompiling.
        """
        with torch.inference_mode(False), torch.no_grad():
            for conv in self.convs():
                conv.repack()

    def __call__(self, x: torch.Tensor, film: torch.Tensor) -> torch.Tensor:
        """x (B, Ta, Da), film (B, R) -> eps (B, Ta, Da) in fp32."""
        films = iter(film.split(self.splits, dim=-1))
        b, ta, da = x.shape
        h, skips = x.reshape(b, ta // self.fold, self.fold * da), []  # h (B, L, C) token-major throughout
        for b0, b1, down in self.down:
            h = b1(b0(h, next(films)), next(films))
            skips.append(h)
            if down is not None:
                h = down(h)
        for blk in self.mid:
            h = blk(h, next(films))
        for b0, b1, up in self.up:
            h = torch.cat([h, skips.pop()], dim=-1)  # (B, L, 2 C)
            h = up(b1(b0(h, next(films)), next(films)))
        h = F.mish(_group_norm(self.final_conv(h), self.final_norm))
        out = self.final_proj(h).reshape(b, ta, da)  # (B, Ta / f, f Da) -> (B, Ta, Da)
        return sample_to_eps(x, out, next(films)) if self.sample else out

    def compiled(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """This forward through ``torch.compile`` (Inductor, static shapes), built once and then reused.

        Inductor fuses the GroupNorm / FiLM / Mish / residual elementwise work between the convolutions,
        which stay calls into the packed kernels above. The weights are graph inputs, not constants, so
        :meth:`repack` needs no recompilation. Compiles on the first call of each input shape.
        """
        if self._compiled is None:
            self._compiled = torch.compile(self.__call__, dynamic=False)
        return self._compiled


_CACHE: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, FastUnet1D]] = weakref.WeakKeyDictionary()


def _param_versions(denoiser: nn.Module) -> tuple:
    return tuple((p.data_ptr(), p._version) for p in denoiser.parameters())


def fast_unet(denoiser: ConditionalUnet1D, horizon: int = 64, impl: str = "auto") -> FastUnet1D:
    """The cached :class:`FastUnet1D` of ``denoiser``, repacked in place when a parameter changed.

    Optimizer steps and ``load_state_dict`` bump the parameters' version counters; a replaced parameter
    changes its data pointer. Either triggers :meth:`FastUnet1D.repack` (tens of ms for 65 M parameters)
    before the next chunk; a different ``horizon`` or ``impl`` builds a new instance.
    """
    versions = _param_versions(denoiser)
    hit = _CACHE.get(denoiser)
    if hit is not None and hit[1].horizon == horizon and hit[1].impl == impl:
        if hit[0] != versions:
            hit[1].repack()
            _CACHE[denoiser] = (versions, hit[1])
        return hit[1]
    fast = FastUnet1D(denoiser, horizon, impl)
    _CACHE[denoiser] = (versions, fast)
    return fast
