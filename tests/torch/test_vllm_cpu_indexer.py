"""dsv4_torch.vllm.cpu_indexer on vLLM-shaped indexer metadata (no vLLM here): the rows it hands our
kernel (decode tokens, then the prefill chunk) and the top-k it writes, against the float64 oracle."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dsv4_torch.indexer import available_backends
from dsv4_torch.vllm import cpu_indexer
from planner import indexer_oracle as orc
from tests.indexer_cases import make_batch

pytestmark = pytest.mark.skipif(
    available_backends()["cpu"] is not None, reason="the C kernels cannot be built here (no compiler)"
)


def vllm_metadata(seq, qry, nd, r, bt):
    """DeepseekV32IndexerMetadata-like: decode requests first (one token each), then one prefill
    chunk with vLLM's row bounds (cu_seqlen_ks / ke into the requests' concatenated entries)."""
    decode = SimpleNamespace(seq_lens=torch.tensor([s // r for s in seq[:nd]], dtype=torch.int32))
    comp = np.array([s // r for s in seq[nd:]])
    cu = np.concatenate([[0], np.cumsum(comp)])
    ks, ke = [], []
    for b, (s, q) in enumerate(zip(seq[nd:], qry[nd:])):
        for p in range(s - q, s):
            ks.append(cu[b])
            ke.append(cu[b] + (p + 1) // r)
    t = lambda a: torch.tensor(np.asarray(a), dtype=torch.int32)  # noqa: E731
    chunk = SimpleNamespace(cu_seqlen_ks=t(ks), cu_seqlen_ke=t(ke), cu_seq_lens=t(cu))
    return SimpleNamespace(
        num_decodes=nd, num_decode_tokens=nd, num_prefills=len(seq) - nd, decode=decode,
        prefill=SimpleNamespace(chunks=[chunk]), block_table=torch.from_numpy(bt),
    )  # fmt: skip


@pytest.mark.parametrize("topk", [512, 1024])
def test_decode_and_prefill_rows_through_our_kernel(topk):
    r, H, D = 4, 8, 128
    seq = [4 * topk + 300, 900, 4 * topk + 40, 200, 4 * 2 * topk]
    qry = [1, 1, 40, 17, 9]  # two decode requests, then three prefill requests
    case = make_batch(np.random.default_rng(topk), seq=seq, qry=qry, H=H, D=D, r=r, page=64)
    T = sum(qry)
    q8 = torch.from_numpy(case["q"].astype(np.float32)).clamp(-448, 448).to(torch.float8_e4m3fn)
    layer = SimpleNamespace(
        compress_ratio=r, topk_tokens=topk, k_cache=SimpleNamespace(kv_cache=torch.from_numpy(case["cache"])),
        topk_indices_buffer=torch.full((T + 5, topk), 7, dtype=torch.int32),
    )  # fmt: skip
    md = vllm_metadata(seq, qry, 2, r, case["bt"])
    req, pos = cpu_indexer.indexer_tokens(md, r)
    assert req.tolist() == case["req"].tolist()
    assert ((pos + 1) // r).tolist() == ((case["pos"] + 1) // r).tolist()
    out = cpu_indexer.select(layer, md, q8, torch.from_numpy(case["w"]))
    assert out is layer.topk_indices_buffer and (out[T:] == 7).all()
    c = orc.compare_topk(
        out[:T].numpy(), q8.float().numpy(), case["w"], case["deq"], case["req"], case["pos"], r, rel=orc.fp32_rel(D, H)
    )
    print(f"vLLM rows, k={topk}: {c.near_ties} near-tie tokens of {c.tokens}")
    assert c.near_ties <= 2
