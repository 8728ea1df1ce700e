"""The reference backend of dsv4_torch.sparse_attention (dsv4_torch/kernels/reference/attention.py): no host
sync, bitwise tile invariance, its backward against dense autograd, attention dropout."""

from __future__ import annotations

import pytest
import torch

from dsv4_torch import BackendUnavailableError, resolve_backend, sparse_attention
from dsv4_torch.kernels.reference import attention as ref_kernel
from tests.torch.sparse_cases import (
    check,
    make_case,
)

# ----------------------------------------------------------------------------- host syncs


def test_reference_backend_never_syncs_with_the_host(monkeypatch):
    """`auto` reaches the reference backend on GPUs too (float64, no Triton): it must queue work
    without reading device values on the host (nonzero, int(), bool())."""
    from tests.no_host_sync import forbid_host_sync

    case = make_case(150, 16, 64, 90, 200, seed=22, topk=True, sink="random")  # several token tiles
    case["indices"][:, 130:] = -1  # trailing all-invalid key blocks
    want = sparse_attention(**case, backend="reference")  # CPU: skips the empty blocks
    monkeypatch.setattr(ref_kernel, "SKIP_EMPTY_BLOCKS_ON_CPU", False)  # what runs on a GPU
    with forbid_host_sync():
        got = sparse_attention(**case, backend="reference")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_reference_odd_sizes():
    # H, D not multiples of anything; a head dim above 512 that is not 576.
    check(make_case(5, 3, 33, 20, 70, seed=12, topk=True, sink="random"), "reference")
    out, _, _ = check(make_case(2, 2, 600, 20, 70, seed=13, sink="random"), "reference")
    assert out.shape == (2, 2, 512)


# ----------------------------------------------------------------------------- tile invariance


@pytest.mark.parametrize("H, D", [(16, 64), (3, 33)])
def test_reference_is_bitwise_tile_invariant(H, D):
    T, S, K = 300, 200, 128
    tile = ref_kernel.token_tile(H, D, torch.float32)
    assert tile < T, "the call must span more than one token tile"
    case = make_case(T, H, D, S, K, seed=14, topk=True, sink="random")
    full = sparse_attention(**case, backend="reference")

    def sub(lo, hi, extra_cols=0):
        c = {
            **case,
            "q": case["q"][lo:hi],
            "indices": case["indices"][lo:hi],
            "topk_length": case["topk_length"][lo:hi],
        }
        if extra_cols:  # pad the row width with invalid entries, as a wider chunk would
            pad = torch.full((hi - lo, extra_cols), -1, dtype=torch.int32)
            c["indices"] = torch.cat([c["indices"], pad], dim=1)
        return sparse_attention(**c, backend="reference")

    for lo, hi, extra in [(7, 8, 0), (3, 40, 0), (250, 300, 0), (5, 290, 0), (100, 101, 192), (11, 59, 64)]:
        part = sub(lo, hi, extra)
        for a, b in zip(part, full):
            assert torch.equal(a, b[lo:hi]), f"tokens {lo}:{hi} (+{extra} invalid columns) differ from the full call"


def test_reference_token_tile_depends_only_on_heads_dim_dtype():
    assert ref_kernel.token_tile(64, 512, torch.bfloat16) == ref_kernel.token_tile(64, 512, torch.float32)
    assert ref_kernel.token_tile(64, 512, torch.float32) >= 16


# ----------------------------------------------------------------------------- backward (reference)


def dense_attention(q, kv, indices, sm_scale, attn_sink=None, topk_length=None, keep=None, p=0.0):
    """Plain autograd torch: gathered keys, masked logits, softmax with the sink column, optional
    dropout mask keep (T, H, K) on the probabilities (transformers' eager formula)."""
    T, H, D = q.shape
    S, K = kv.shape[0], indices.shape[1]
    d_v = 512 if D >= 512 else D
    valid = (indices >= 0) & (indices < S)
    if topk_length is not None:
        valid &= torch.arange(K)[None, :] < topk_length[:, None]
    keys = kv[torch.where(valid, indices, 0).long()]  # (T, K, D)
    s = torch.einsum("thd,tkd->thk", q, keys) * sm_scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    sink = torch.full((H,), float("-inf"), dtype=s.dtype) if attn_sink is None else attn_sink.to(s.dtype)
    probs = torch.softmax(torch.cat([s, sink.view(1, H, 1).expand(T, H, 1)], -1), dim=-1)[..., :K]
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no key and no sink
    if keep is not None:
        probs = probs * keep / (1 - p)
    return torch.einsum("thk,tkd->thd", probs, keys[..., :d_v]), lse


def _grads(fn, case, seed=0):
    """Gradients of a random linear function of (out, finite lse) w.r.t. q, kv, attn_sink."""
    leaves = {k: case[k].detach().clone().requires_grad_(True) for k in ("q", "kv", "attn_sink") if case[k] is not None}
    args = {**case, **leaves}
    out, lse = fn(args)
    g = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)  # the same weights at any dtype
    w_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    loss = (out * w_out).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * w_lse).sum()
    loss.backward()
    return out.detach(), {k: v.grad for k, v in leaves.items()}


def _ours(args, **kw):
    out, _, lse = sparse_attention(**args, backend="reference", **kw)
    return out, lse


def _dense(args):
    return dense_attention(
        args["q"], args["kv"], args["indices"], args["sm_scale"], args["attn_sink"], args["topk_length"]
    )


@pytest.mark.parametrize(
    "T, H, D, S, K, sink, topk",
    [
        (70, 3, 33, 40, 150, "random", True),
        (5, 16, 64, 30, 64, None, False),
        (130, 4, 576, 50, 80, "random", True),
        (9, 2, 16, 12, 40, 2.0, True),
    ],
)
def test_reference_backward_matches_dense_autograd_in_float64(T, H, D, S, K, sink, topk):
    """Several token tiles and key blocks, invalid entries of every kind, rows with no valid key
    (row 3), duplicated indices, topk_length, sinks, D = 576 (value = first 512 dims), and lse's
    own gradient: q, kv and the sink's gradients equal plain autograd's to float64 rounding."""
    case = make_case(T, H, D, S, K, seed=40 + T, dtype=torch.float64, topk=topk, sink=sink)
    if case["attn_sink"] is not None:
        case["attn_sink"] = case["attn_sink"].double()
    case["indices"][3] = -1
    case["indices"][1, 1::2] = case["indices"][1, 0]  # duplicates count once per occurrence
    out, ours = _grads(_ours, case)
    want_out, want = _grads(_dense, case)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    assert set(ours) == set(want)
    for k in want:
        err = ((ours[k] - want[k]).abs().max() / want[k].abs().max()).item()
        assert err < 1e-12, f"d{k}: max rel error {err:.3g}"


def test_reference_backward_float32_and_bfloat16():
    case = make_case(70, 16, 64, 60, 130, seed=50, topk=True, sink="random")
    want_out, want = _grads(_dense, {**case, **{k: case[k].double() for k in ("q", "kv", "attn_sink")}})
    _, ours = _grads(_ours, case)
    for k in want:
        assert ((ours[k].double() - want[k]).abs().max() / want[k].abs().max()).item() < 1e-5, k
    bf = {**case, "q": case["q"].bfloat16(), "kv": case["kv"].bfloat16()}
    _, ours_bf = _grads(_ours, bf)
    assert ours_bf["q"].dtype == ours_bf["kv"].dtype == torch.bfloat16 and ours_bf["attn_sink"].dtype == torch.float32
    for k in want:  # bf16 inputs, float32 accumulation: within bf16's rounding of the inputs
        assert ((ours_bf[k].double() - want[k]).abs().max() / want[k].abs().max()).item() < 5e-2, k


def test_forward_under_autograd_is_bitwise_the_no_grad_kernel():
    case = make_case(150, 16, 64, 90, 200, seed=51, topk=True, sink="random")
    with torch.no_grad():
        want = sparse_attention(**case, backend="reference")
    q = case["q"].clone().requires_grad_(True)
    got = sparse_attention(**{**case, "q": q}, backend="reference")
    assert got[0].requires_grad and not got[1].requires_grad and got[2].requires_grad
    for a, b in zip(got, want):
        assert torch.equal(a.detach(), b)


def test_backward_of_zero_tokens_and_untouched_rows():
    case = make_case(0, 4, 16, 10, 8)
    q, kv = case["q"].requires_grad_(True), case["kv"].requires_grad_(True)
    out, _, _ = sparse_attention(**{**case, "q": q, "kv": kv}, backend="reference")
    out.sum().backward()
    assert q.grad.shape == q.shape and torch.equal(kv.grad, torch.zeros_like(kv))
    case = make_case(4, 4, 16, 10, 8, seed=52, invalid=0.0)
    case["indices"][:] = 2  # only row 2 is read
    kv = case["kv"].requires_grad_(True)
    sparse_attention(**{**case, "kv": kv}, backend="reference")[0].sum().backward()
    assert kv.grad[2].abs().sum() > 0 and torch.equal(kv.grad[torch.arange(10) != 2], torch.zeros(9, 16))


def test_backends_without_a_backward_refuse_when_a_gradient_is_required():
    q = torch.zeros(2, 16, 64, requires_grad=True)
    for name in ("triton", "flashmla"):
        with pytest.raises(BackendUnavailableError, match=rf"backend='{name}' has no backward.*backend='reference'"):
            resolve_backend(name, q, needs_grad=True)
        with pytest.raises(BackendUnavailableError, match=rf"backend='{name}' has no attention dropout"):
            resolve_backend(name, q, dropout_p=0.1)
    assert resolve_backend("auto", q, needs_grad=True) == "reference"
    case = make_case(3, 16, 64, 10, 8)
    with pytest.raises(BackendUnavailableError, match="has no backward"):
        sparse_attention(**{**case, "q": case["q"].requires_grad_(True)}, backend="triton")
    with torch.no_grad():  # no gradient needed: the usual availability check (here: CPU)
        with pytest.raises(BackendUnavailableError, match="cannot run here"):
            sparse_attention(**case, backend="flashmla")


def test_reference_backward_never_syncs_with_the_host(monkeypatch):
    """The backward on the device path (every key block, as on a GPU) reads nothing on the host."""
    from tests.no_host_sync import forbid_host_sync

    case = make_case(150, 16, 64, 90, 200, seed=55, topk=True, sink="random")
    monkeypatch.setattr(ref_kernel, "SKIP_EMPTY_BLOCKS_ON_CPU", False)
    leaves = {k: case[k].detach().clone().requires_grad_(True) for k in ("q", "kv", "attn_sink")}
    out, _, _ = sparse_attention(**{**case, **leaves}, backend="reference")
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    with forbid_host_sync():
        torch.autograd.backward(out, w)
    assert all(leaves[k].grad is not None and torch.isfinite(leaves[k].grad).all() for k in leaves)


def _dropout_mask(T, H, K, p, seed, dtype=torch.float64):
    """The mask the reference kernel draws, laid out (T, H, K)."""
    tile = ref_kernel.token_tile(H, 64, dtype)
    heads = -(-H // 16) * 16
    drop = ref_kernel._Dropout(p, seed, (tile, heads, ref_kernel.KEY_BLOCK), dtype, torch.device("cpu"))
    nb = -(-K // ref_kernel.KEY_BLOCK)
    keep = torch.zeros(T, H, nb * ref_kernel.KEY_BLOCK, dtype=dtype)
    for t0 in range(0, T, tile):
        n = min(tile, T - t0)
        for b in range(nb):
            keep[t0 : t0 + n, :, b * ref_kernel.KEY_BLOCK : (b + 1) * ref_kernel.KEY_BLOCK] = drop.keep_scale(t0, b)[
                :n, :H
            ] * (1 - p)
    return keep[:, :, :K]


def test_dropout_is_eagers_formula_and_its_backward_regenerates_the_mask(monkeypatch):
    """out = sum_j dropout(P_j) v_j with P = softmax([logits, sink]) (sink column dropped, kept
    probabilities scaled by 1 / (1 - p), the denominator untouched), the mask drawn per token tile
    and key block from the seed; the backward uses the same mask."""
    p, seed = 0.3, 1234
    T, H, D, S, K = 70, 3, 64, 40, 150
    case = make_case(T, H, D, S, K, seed=53, dtype=torch.float64, topk=True, sink="random")
    case["attn_sink"] = case["attn_sink"].double()
    monkeypatch.setattr("dsv4_torch.backends._dropout_seed", lambda: seed)
    keep = _dropout_mask(T, H, K, p, seed)
    assert 0.6 < keep.mean().item() < 0.8  # about 1 - p kept
    out, ours = _grads(lambda a: _ours(a, dropout_p=p), case)
    want_out, want = _grads(
        lambda a: dense_attention(
            a["q"], a["kv"], a["indices"], a["sm_scale"], a["attn_sink"], a["topk_length"], keep=keep, p=p
        ),
        case,
    )
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    for k in want:
        assert ((ours[k] - want[k]).abs().max() / want[k].abs().max()).item() < 1e-12, k
    with torch.no_grad():
        nograd, _, _ = sparse_attention(**case, backend="reference", dropout_p=p)
    assert torch.equal(nograd, out)
    with pytest.raises(ValueError, match=r"dropout_p: expected a float in \[0, 1\)"):
        sparse_attention(**case, backend="reference", dropout_p=1.0)


def test_dropout_seed_follows_torch_manual_seed():
    case = make_case(20, 4, 16, 10, 30, seed=54)
    torch.manual_seed(7)
    a = sparse_attention(**case, backend="reference", dropout_p=0.5)[0]
    b = sparse_attention(**case, backend="reference", dropout_p=0.5)[0]
    torch.manual_seed(7)
    c = sparse_attention(**case, backend="reference", dropout_p=0.5)[0]
    assert torch.equal(a, c) and not torch.equal(a, b)
