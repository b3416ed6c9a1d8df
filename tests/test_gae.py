"""diffpolicy.ops.gae: the compiled CPU kernel against the pure-torch reference and two independent
answers (a case worked by hand, a plain-Python loop), properties, torch.compile, bad input, fallback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diffpolicy.ops import gae, gae_reference, kernel_status

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None


def gae_python(rewards, values, dones, last_value, gamma, lam):
    """Independent oracle: plain Python loops over environments and reversed time, no tensors."""
    r, v, d, last = rewards.tolist(), values.tolist(), dones.tolist(), last_value.tolist()
    T, N = len(r), len(last)
    adv = [[0.0] * N for _ in range(T)]
    for n in range(N):
        next_value, next_adv = last[n], 0.0
        for t in range(T - 1, -1, -1):
            not_done = 1.0 - d[t][n]
            delta = r[t][n] + gamma * next_value * not_done - v[t][n]
            next_adv = delta + gamma * lam * not_done * next_adv
            adv[t][n] = next_adv
            next_value = v[t][n]
    ret = [[adv[t][n] + v[t][n] for n in range(N)] for t in range(T)]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def rollout(T, N, seed=0, dtype=torch.float64, p_done=0.2, ends_at_edges=True):
    """Random (T, N) rewards/values/dones and (N,) last value; episodes end at the first and last step."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(T, N, generator=g, dtype=dtype)
    values = torch.randn(T, N, generator=g, dtype=dtype)
    dones = (torch.rand(T, N, generator=g) < p_done).to(dtype)
    if ends_at_edges:
        dones[0, ::2] = 1.0  # ends at the first decision
        dones[-1, 1::3] = 1.0  # ends at the last decision: last_value must not leak in
    last_value = torch.randn(N, generator=g, dtype=dtype)
    return rewards, values, dones, last_value


def test_hand_computed():
    # gamma = 0.5, lam = 0.5 (gamma * lam = 0.25); T = 3 decisions, N = 2 environments.
    # env 0: r = 1, 2, 3; V = 1, 1, 1; no dones; last value 2.
    #   t=2: delta = 3 + 0.5*2 - 1 = 3        A = 3
    #   t=1: delta = 2 + 0.5*1 - 1 = 1.5      A = 1.5 + 0.25*3    = 2.25
    #   t=0: delta = 1 + 0.5*1 - 1 = 0.5      A = 0.5 + 0.25*2.25 = 1.0625
    # env 1: r = 1, 0, 1; V = 0.5, 1, 2; done at t=1; last value 4.
    #   t=2: delta = 1 + 0.5*4 - 2 = 1        A = 1
    #   t=1: done, delta = 0 - 1 = -1         A = -1 (nothing bootstrapped from t=2)
    #   t=0: delta = 1 + 0.5*1 - 0.5 = 1      A = 1 + 0.25*(-1) = 0.75
    # returns = A + V.
    rewards = torch.tensor([[1.0, 1.0], [2.0, 0.0], [3.0, 1.0]])
    values = torch.tensor([[1.0, 0.5], [1.0, 1.0], [1.0, 2.0]])
    dones = torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    last_value = torch.tensor([2.0, 4.0])
    expected_adv = torch.tensor([[1.0625, 0.75], [2.25, -1.0], [3.0, 1.0]])
    expected_ret = torch.tensor([[2.0625, 1.25], [3.25, 0.0], [4.0, 3.0]])
    for fn in (gae, gae_reference):
        adv, ret = fn(rewards, values, dones, last_value, 0.5, 0.5)
        assert adv.dtype == torch.float32 and ret.dtype == torch.float32
        torch.testing.assert_close(adv, expected_adv, rtol=0, atol=0)
        torch.testing.assert_close(ret, expected_ret, rtol=0, atol=0)


@pytest.mark.parametrize("T,N", [(1, 1), (4, 3), (9, 1), (17, 13)])
def test_reference_matches_python_loop(T, N):
    inputs = rollout(T, N, seed=T * 100 + N)
    for gamma, lam in [(0.99, 0.95), (0.0, 1.0), (1.0, 0.0)]:
        expected = gae_python(*inputs, gamma, lam)
        got = gae_reference(*inputs, gamma, lam)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the pure-torch fallback runs")
def test_cpu_kernel_is_compiled():
    gae(*rollout(2, 2), 0.9, 0.9)
    assert kernel_status()["cpu"] == "compiled"
    assert torch._C._dispatch_has_kernel_for_dispatch_key("diffpolicy::gae", "CPU")


SHAPES = [(1, 1), (1, 9), (2, 1), (3, 7), (17, 16), (33, 31), (64, 257), (130, 1030), (5, 3000)]
COEFFICIENTS = [(0.0, 0.0), (0.0, 1.0), (1.0, 0.0), (1.0, 1.0), (0.99, 0.95)]


@pytest.mark.parametrize("T,N", SHAPES)
@pytest.mark.parametrize("gamma,lam", COEFFICIENTS)
def test_kernel_matches_reference_float64(T, N, gamma, lam):
    inputs = rollout(T, N, seed=T * 7 + N)
    adv, ret = gae(*inputs, gamma, lam)
    ref_adv, ref_ret = gae_reference(*inputs, gamma, lam)
    assert adv.shape == ret.shape == (T, N) and adv.is_contiguous() and ret.is_contiguous()
    torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T,N", [(1, 5), (256, 16), (300, 67)])
def test_kernel_matches_reference_float32(T, N):
    inputs = rollout(T, N, seed=3, dtype=torch.float32)
    for got, ref in zip(gae(*inputs, 0.99, 0.95), gae_reference(*inputs, 0.99, 0.95)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_non_contiguous_inputs():
    rewards, values, dones, last_value = rollout(11, 6, seed=5)
    # (N, T) storage viewed as (T, N), and every other element of a longer last-value vector
    views = (rewards.t().contiguous().t(), values.t().contiguous().t(), dones.t().contiguous().t())
    last_strided = torch.stack([last_value, last_value], 1).reshape(-1)[::2]
    assert not views[0].is_contiguous() and not last_strided.is_contiguous()
    for got, ref in zip(gae(*views, last_strided, 0.9, 0.8), gae_reference(*views, last_strided, 0.9, 0.8)):
        assert got.is_contiguous()
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T,N", [(0, 4), (3, 0)])
def test_empty(T, N):
    adv, ret = gae(torch.zeros(T, N), torch.zeros(T, N), torch.zeros(T, N), torch.zeros(N), 0.9, 0.9)
    assert adv.shape == ret.shape == (T, N)


def test_meta_tensors_give_shapes():
    x = torch.empty(7, 5, device="meta")
    adv, ret = gae(x, x, x, torch.empty(5, device="meta"), 0.9, 0.9)
    assert adv.shape == ret.shape == (7, 5) and adv.device.type == "meta"


@pytest.mark.parametrize("T,N", [(1, 1), (7, 7), (4, 8 * 48 + 3), (300, 67), (2048, 64)])
def test_accelerator_kernel_matches_reference(device, T, N):
    """``pytest --device=cuda|npu``: the device's compiled kernel against the CPU reference."""
    if device.type == "cpu":
        pytest.skip("accelerator-only: run with --device=cuda or --device=npu")
    inputs = rollout(T, N, seed=11, dtype=torch.float32)
    got = gae(*(x.to(device) for x in inputs), 0.99, 0.95)
    assert kernel_status()[device.type] == "compiled", kernel_status()
    for g, ref in zip(got, gae_reference(*inputs, 0.99, 0.95)):
        assert g.device == device
        torch.testing.assert_close(g.cpu(), ref, rtol=1e-5, atol=1e-5)


# ---- properties ---------------------------------------------------------------------------------

shapes = st.tuples(st.integers(1, 40), st.integers(1, 20))
seeds = st.integers(0, 2**31 - 1)
unit = st.floats(0.0, 1.0)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=seeds, gamma=unit)
def test_lambda_zero_is_one_step_td(shape, seed, gamma):
    rewards, values, dones, last_value = rollout(*shape, seed=seed)
    adv, _ = gae(rewards, values, dones, last_value, gamma, 0.0)
    next_values = torch.cat([values[1:], last_value[None]])  # (T, N): V_{t+1}
    td = rewards + gamma * next_values * (1.0 - dones) - values
    torch.testing.assert_close(adv, td, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=seeds)
def test_undiscounted_no_dones_gives_reversed_cumulative_sums(shape, seed):
    rewards, values, _, last_value = rollout(*shape, seed=seed, ends_at_edges=False)
    adv, ret = gae(rewards, values, torch.zeros_like(rewards), last_value, 1.0, 1.0)
    reward_to_go = rewards.flip(0).cumsum(0).flip(0)  # (T, N): sum_{k >= t} r_k
    torch.testing.assert_close(ret, reward_to_go + last_value, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(adv, reward_to_go + last_value - values, rtol=1e-10, atol=1e-10)


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=seeds, gamma=unit, lam=unit)
def test_every_step_done_bootstraps_nothing(shape, seed, gamma, lam):
    rewards, values, _, last_value = rollout(*shape, seed=seed)
    adv, ret = gae(rewards, values, torch.ones_like(rewards), last_value, gamma, lam)
    torch.testing.assert_close(adv, rewards - values, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, rewards, rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=seeds, gamma=unit, lam=unit)
def test_matches_python_loop(shape, seed, gamma, lam):
    inputs = rollout(*shape, seed=seed)
    for got, expected in zip(gae(*inputs, gamma, lam), gae_python(*inputs, gamma, lam)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


# ---- composition --------------------------------------------------------------------------------


def _compile_and_check(backend):
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend=backend)
    def normalised_advantages(rewards, values, dones, last_value):
        adv, ret = gae(rewards, values, dones, last_value, 0.99, 0.95)
        return (adv - adv.mean()) / (adv.std() + 1e-8), ret

    inputs = rollout(32, 8, dtype=torch.float32)
    adv, ret = normalised_advantages(*inputs)
    ref_adv, ref_ret = gae_reference(*inputs, 0.99, 0.95)
    torch.testing.assert_close(adv, (ref_adv - ref_adv.mean()) / (ref_adv.std() + 1e-8), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-5, atol=1e-5)


def test_torch_compile_fullgraph():
    """Dynamo traces the op as one node (fake impl for shapes), AOTAutograd functionalises it."""
    _compile_and_check("aot_eager")


@pytest.mark.slow
def test_torch_compile_fullgraph_inductor():
    """Same through Inductor (generates and compiles C++ around the op: ~30 s cold on 2 cores)."""
    _compile_and_check("inductor")


def test_opcheck():
    inputs = rollout(6, 5, dtype=torch.float32)
    torch.library.opcheck(torch.ops.diffpolicy.gae.default, (*inputs, 0.99, 0.95))


# ---- bad input ----------------------------------------------------------------------------------


def _good():
    return list(rollout(4, 3, dtype=torch.float32))


def _with(i, value):
    args = _good()
    args[i] = value
    return args


BAD_INPUTS = {
    "int dones": (_with(2, torch.zeros(4, 3, dtype=torch.int64)), TypeError, "float32 or float64"),
    "bool dones": (_with(2, torch.zeros(4, 3, dtype=torch.bool)), TypeError, "float32 or float64"),
    "half rewards": (_with(0, torch.zeros(4, 3, dtype=torch.float16)), TypeError, "float32 or float64"),
    "mixed dtypes": (_with(1, torch.zeros(4, 3, dtype=torch.float64)), TypeError, "one dtype"),
    "list rewards": (_with(0, [[0.0] * 3] * 4), TypeError, "torch.Tensor"),
    "1-D rewards": (_with(0, torch.zeros(12)), ValueError, "2-D"),
    "3-D values": (_with(1, torch.zeros(4, 3, 1)), ValueError, "2-D"),
    "2-D last_value": (_with(3, torch.zeros(1, 3)), ValueError, "1-D"),
    "values shape": (_with(1, torch.zeros(5, 3)), ValueError, "shape"),
    "dones shape": (_with(2, torch.zeros(4, 2)), ValueError, "shape"),
    "last_value length": (_with(3, torch.zeros(4)), ValueError, "last_value"),
    "mixed devices": (_with(3, torch.zeros(3, device="meta")), ValueError, "one device"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_tensors_raise(case):
    args, error, match = BAD_INPUTS[case]
    with pytest.raises(error, match=match):
        gae(*args, 0.99, 0.95)


@pytest.mark.parametrize(
    "gamma,lam,error",
    [
        (-0.1, 0.9, ValueError),
        (1.01, 0.9, ValueError),
        (0.9, float("nan"), ValueError),
        (0.9, 2, ValueError),
        ("0.9", 0.9, TypeError),
        (0.9, None, TypeError),
        (True, 0.9, TypeError),
    ],
)
def test_bad_coefficients_raise(gamma, lam, error):
    with pytest.raises(error):
        gae(*_good(), gamma, lam)


# ---- fallback -----------------------------------------------------------------------------------


def test_pure_torch_fallback_warns_once(tmp_path):
    """A fresh process with the kernels disabled, run from another directory: the pure-torch path
    gives the reference's answer and warns exactly once over several calls."""
    script = textwrap.dedent(
        """
        import warnings
        import torch
        from diffpolicy.ops import KernelFallbackWarning, gae, gae_reference, kernel_status
        inputs = (torch.randn(9, 4), torch.randn(9, 4), (torch.rand(9, 4) < 0.3).float(), torch.randn(4))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = [gae(*inputs, 0.99, 0.95) for _ in range(3)]
        fallback = [w for w in caught if issubclass(w.category, KernelFallbackWarning)]
        assert len(fallback) == 1, [str(w.message) for w in caught]
        assert "DIFFPOLICY_GAE_BACKEND" in str(fallback[0].message)
        for adv, ret in results:
            ref_adv, ref_ret = gae_reference(*inputs, 0.99, 0.95)
            assert torch.equal(adv, ref_adv) and torch.equal(ret, ref_ret)
        assert not torch._C._dispatch_has_kernel_for_dispatch_key("diffpolicy::gae", "CPU")
        print(kernel_status()["cpu"])
        """
    )
    env = {**os.environ, "DIFFPOLICY_GAE_BACKEND": "torch"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "disabled by DIFFPOLICY_GAE_BACKEND=torch" in proc.stdout
