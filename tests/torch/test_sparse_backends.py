"""dsv4_torch's sparse-attention backends: which one runs (resolve_backend, available_backends,
logging), the Triton kernel's launch configurations and compilation, the FlashMLA wrapper
(padding, its signature check; the kernel itself on SM90/SM100 GPUs only)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from dsv4_torch import BackendUnavailableError, available_backends, resolve_backend, sparse_attention
from dsv4_torch.kernels.reference import attention as ref_kernel
from tests.torch.sparse_cases import (
    AVAILABLE,
    DEVICE,
    GPU,
    assert_out_fp32_close,
    assert_stats_close,
    check,
    make_case,
    needs_flashmla,
    needs_triton,
    on,
    run_oracle,
)


@needs_triton
@pytest.mark.parametrize("cfg", [(16, 16, 4, 1), (32, 64, 4, 2), (64, 32, 8, 2)])
def test_triton_launch_configs_agree(cfg):
    # H = 40: several head blocks, the last one partly masked; D = 48: masked value dims.
    from dsv4_torch.kernels.triton import attention as ts

    case = make_case(5, 40, 48, 60, 150, seed=17, topk=True, sink="random")
    got = ts.sparse_attention_triton(**on(DEVICE, case), config=ts.TritonConfig(*cfg))
    want_out, want_max, want_lse = run_oracle(case)
    assert_out_fp32_close(got[0], want_out)
    assert_stats_close(got[1], want_max, 1e-5, "max_logits")
    assert_stats_close(got[2], want_lse, 1e-5, "lse")


@needs_triton
def test_triton_two_head_blocks_per_token():
    # H = 128 with block_h = 64: two programs per token, pid -> (token, head block) on a 1-D grid.
    from dsv4_torch.kernels.triton import attention as ts

    case = make_case(3, 128, 32, 40, 64, seed=19, topk=True, sink="random")
    got = ts.sparse_attention_triton(**on(DEVICE, case), config=ts.TritonConfig(64, 32, 4, 1))
    want_out, want_max, want_lse = run_oracle(case)
    assert_out_fp32_close(got[0], want_out)
    assert_stats_close(got[1], want_max, 1e-5, "max_logits")
    assert_stats_close(got[2], want_lse, 1e-5, "lse")


@needs_triton
def test_triton_grid_fits_cuda_limits(monkeypatch):
    """CUDA caps grid axes y and z at 65,535 (the interpreter does not): T > 65,535 tokens must
    launch on axis x. The launch is recorded, not run."""
    from dsv4_torch.kernels.triton import attention as ts

    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(ts, "_sparse_attention_kernel", Recorder())
    T, H = 70_000, 40
    q = torch.zeros(T, H, 16)
    ts.sparse_attention_triton(
        q, torch.zeros(4, 16), torch.zeros(T, 16, dtype=torch.int32), 1.0, config=ts.TritonConfig(16, 16, 4, 1)
    )
    (grid,) = grids
    assert all(n <= 65_535 for n in grid[1:]) and grid[0] < 2**31, grid
    assert int(np.prod(grid)) == T * 3  # 3 head blocks of 16 for H = 40


@pytest.mark.skipif(not GPU, reason="needs an SM90/SM100 GPU")
@pytest.mark.gpu
def test_triton_more_tokens_than_grid_axis_y_on_gpu():
    T = 70_000  # > 65,535, the CUDA limit of grid axes y and z
    case = make_case(T, 16, 32, 256, 32, seed=20, topk=True, sink="random")
    got = sparse_attention(**on("cuda", case), backend="triton")
    want = sparse_attention(**on("cuda", case), backend="reference")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got[2][-1]).any()  # the last tokens were computed, not left as garbage


@pytest.mark.parametrize(
    "fields, match",
    [
        ((24, 32, 4, 2), "block_h: must be a power of two, got 24"),
        ((32, 48, 4, 2), "block_k: must be a power of two, got 48"),
        ((8, 32, 4, 2), "block_h: expected an int >= 16, got 8"),
        ((32, 32, 3, 2), "num_warps: must be a power of two, got 3"),
        ((32, 32, 4, 0), "num_stages: expected an int >= 1, got 0"),
    ],
)
def test_triton_config_rejects_bad_fields(fields, match):
    from dsv4_torch.kernels.triton import attention as ts

    with pytest.raises(ValueError, match=match):
        ts.TritonConfig(*fields)


# ----------------------------------------------------------------------------- FlashMLA (GPU only)


@needs_flashmla
@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 64, 128, 192])
@pytest.mark.parametrize("D", [512, 576])
def test_flashmla_matches_oracle(H, D):
    case = make_case(64, H, D, 4096, 200, seed=15, dtype=torch.bfloat16, topk=True, sink="random", kv_scale=0.1)
    case["indices"][0] = -1
    check(case, "flashmla", "cuda")


@needs_flashmla
@pytest.mark.gpu
@pytest.mark.parametrize("sink", [float("-inf"), 0.0, 30.0])
def test_flashmla_sinks_and_edge_rows(sink):
    case = make_case(8, 64, 512, 100, 128, seed=16, dtype=torch.bfloat16, invalid=0.0, sink=sink, kv_scale=0.1)
    case["topk_length"] = torch.tensor([0, 1, 5, 64, 127, 128, 200, 3], dtype=torch.int32)
    case["indices"][7] = torch.arange(100, 228, dtype=torch.int32)  # all >= S
    case["indices"][6, :8] = 3  # duplicates
    check(case, "flashmla", "cuda")


def test_flashmla_wrapper_pads_and_strips(monkeypatch):
    """The wrapper's padding, index clean-up and head split, run on CPU against a stand-in kernel
    that enforces FlashMLA's input constraints and computes with the reference."""
    from dsv4_torch.kernels.flashmla import attention as flashmla

    calls = []

    def fake_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, use_legacy=False):
        T, H, D = q.shape
        S = kv.shape[0]
        assert q.dtype == kv.dtype == torch.bfloat16 and q.is_contiguous() and kv.is_contiguous()
        assert H in (64, 128) and D in (512, 576) and d_v == 512 and kv.shape[1:] == (1, D)
        assert indices.dtype == torch.int32 and indices.shape[:2] == (T, 1) and indices.shape[2] % 128 == 0
        assert bool(((indices == -1) | ((indices >= 0) & (indices < S))).all()), "only -1 may be invalid"
        assert attn_sink is None or (attn_sink.dtype == torch.float32 and attn_sink.shape == (H,))
        assert topk_length is None or bool(((topk_length >= 0) & (topk_length <= indices.shape[2])).all())
        calls.append((H, indices.shape[2], use_legacy))
        return ref_kernel.sparse_attention_reference(q, kv[:, 0], indices[:, 0], sm_scale, attn_sink, topk_length)

    monkeypatch.setitem(flashmla._cache, "fn", fake_sparse_fwd)
    monkeypatch.setattr(flashmla, "unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for H, K in ((16, 200), (64, 128), (192, 130)):
        case = make_case(4, H, 512, 300, K, seed=18, dtype=torch.bfloat16, topk=True, sink="random", kv_scale=0.1)
        case["indices"][0, :5] = torch.tensor([-9, 300, 301, -1, 5], dtype=torch.int32)
        calls.clear()
        got = flashmla.sparse_attention_flashmla(**case)
        want = ref_kernel.sparse_attention_reference(**case)
        for a, b in zip(got, want):  # heads padded with zeros: same values up to rounding
            torch.testing.assert_close(a, b)
        expect_heads = [64] if H <= 64 else [128, 64]
        assert [c[0] for c in calls] == expect_heads
        assert all(c[1] == -(-K // 128) * 128 and c[2] is True for c in calls)  # SM90: use_legacy=True


def test_flashmla_wrapper_inspects_the_signature_once(monkeypatch):
    """Upstream FlashMLA's flash_mla_sparse_fwd has no use_legacy: it is not passed, and the
    signature is looked up once per function, not per call."""
    import inspect

    from dsv4_torch.kernels.flashmla import attention as flashmla

    def upstream_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        return ref_kernel.sparse_attention_reference(q, kv[:, 0], indices[:, 0], sm_scale, attn_sink, topk_length)

    lookups = []
    real_signature = inspect.signature

    def counting_signature(fn, *args, **kwargs):
        lookups.append(fn)
        return real_signature(fn, *args, **kwargs)

    flashmla._parameters.cache_clear()
    monkeypatch.setattr(flashmla.inspect, "signature", counting_signature)
    monkeypatch.setitem(flashmla._cache, "fn", upstream_sparse_fwd)
    monkeypatch.setattr(flashmla, "unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    case = make_case(2, 64, 512, 50, 128, seed=23, dtype=torch.bfloat16, sink="random", kv_scale=0.1)
    for _ in range(3):
        flashmla.sparse_attention_flashmla(**case)  # TypeError if use_legacy were passed
    assert lookups.count(upstream_sparse_fwd) == 1


@pytest.mark.skipif(not GPU, reason="needs an SM90/SM100 GPU")
@pytest.mark.gpu
def test_auto_prefers_flashmla_on_sm90_sm100():
    q = torch.zeros(1, 64, 576, dtype=torch.bfloat16, device="cuda")
    want = "flashmla" if AVAILABLE["flashmla"] is None else "triton"
    assert resolve_backend("auto", q) == want


# ----------------------------------------------------------------------------- backend selection


def test_resolve_backend_on_cpu():
    q = torch.zeros(1, 16, 64)
    # fp32 on CPU: the C kernel where it builds (tests/torch/test_cpu_attention.py), else reference
    assert resolve_backend("auto", q) == ("cpu" if AVAILABLE["cpu"] is None else "reference")
    assert resolve_backend("auto", q.double()) == "reference"
    assert resolve_backend("reference", q) == "reference"
    if not GPU:
        with pytest.raises(BackendUnavailableError, match="SM90/SM100"):
            resolve_backend("flashmla", q)
        with pytest.raises((TypeError, BackendUnavailableError), match="bfloat16|float64"):
            resolve_backend("triton", q.double())  # TypeError where Triton runs here (interpreted), else unavailable
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda", q)


def test_available_backends_reports_reasons():
    av = available_backends()
    assert set(av) == {"flashmla", "triton", "cpu", "reference"}
    assert av["reference"] is None
    for name, reason in av.items():
        assert reason is None or (isinstance(reason, str) and reason), name
    if not GPU:
        assert av["flashmla"] is not None


def test_backend_choice_is_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger="dsv4_torch"):
        sparse_attention(**make_case(2, 16, 64, 10, 16, dtype=torch.float64), backend="auto")
    assert any("backend=reference (asked 'auto')" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(GPU, reason="CPU-only check")
def test_triton_on_cpu_without_interpreter_raises():
    code = (
        "import torch, dsv4_torch\n"
        "q = torch.zeros(1, 16, 64); kv = torch.zeros(4, 64); idx = torch.zeros(1, 16, dtype=torch.int32)\n"
        "try:\n"
        "    dsv4_torch.sparse_attention(q, kv, idx, 1.0, backend='triton')\n"
        "except dsv4_torch.BackendUnavailableError as e:\n"
        "    print('RAISED', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "RAISED" in res.stdout and "TRITON_INTERPRET=1" in res.stdout, res.stdout + res.stderr


def _ptxas_available():
    try:
        from tools.triton_compile import triton_bin_dir

        return os.path.exists(os.path.join(triton_bin_dir(), "ptxas"))
    except ImportError:
        return False


@pytest.mark.skipif(not _ptxas_available(), reason="needs Triton's bundled ptxas (NVIDIA build of triton)")
@pytest.mark.parametrize("arch", [90, 80])
def test_triton_kernel_compiles_for_gpus(arch):
    """Ahead-of-time compile (no GPU needed) catches what the interpreter cannot: layouts, types,
    register and shared-memory limits of the default launch config on H100 / A100."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-m", "bench.checks.triton_resources_torch", "--arch", str(arch), "--dim", "512"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    row = res.stdout.strip().splitlines()[-1].split()
    assert len(row) >= 12 and row[7] == "yes", res.stdout  # compiled, fits shared memory
    regs, spill, wgmma, loop_spill = int(row[4]), int(row[5]), int(row[8]), int(row[11])
    assert 0 < regs <= 255
    assert spill == 0 and loop_spill == 0, res.stdout  # the default config does not spill at D=512
    assert (wgmma > 0) == (arch == 90), "BLOCK_H=64 on sm_90 should give wgmma"


def test_default_config_follows_the_triton_version_on_hopper():
    """Triton 3.6 (torch 2.11) spills 64,16,8,2 inside the key loop on sm_90 and not 64,16,8,1;
    Triton 3.9 the other way round (offline compiles, see default_config's docstring)."""
    from dsv4_torch.kernels.triton import attention as ts

    old = ts.default_config(64, 512, torch.bfloat16, 90, triton_version=(3, 6))
    new = ts.default_config(64, 512, torch.bfloat16, 90, triton_version=(3, 9))
    assert (old.block_h, old.block_k, old.num_stages) == (64, 16, 1)
    assert (new.block_h, new.block_k, new.num_stages) == (64, 16, 2)
    assert ts.default_config(64, 512, torch.bfloat16, 100, triton_version=(3, 6)).num_stages == 2


def test_old_triton_interpreter_is_reported_not_run(monkeypatch):
    """Interpreters before Triton 3.9 cannot run the kernel: the backend says why instead."""
    from dsv4_torch.kernels.triton import attention as ts

    if not ts.INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1 (set by the test suite's conftest)")
    monkeypatch.setattr(ts, "INTERPRETER_UNSUPPORTED", "Triton 3.6.0's interpreter cannot run this kernel")
    case = make_case(3, 4, 16, 10, 8, topk=True, sink="random")
    assert "3.6.0" in available_backends()["triton"]
    with pytest.raises(BackendUnavailableError, match="3.6.0"):
        sparse_attention(**case, backend="triton")
    with pytest.raises(RuntimeError, match="3.6.0"):
        ts.sparse_attention_triton(case["q"], case["kv"], case["indices"], case["sm_scale"])
