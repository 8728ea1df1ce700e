"""dsv4_torch.vllm.cpu.indexer on vLLM-shaped indexer metadata (no vLLM here): the rows it hands our
kernel (decode tokens, then the prefill chunk) and the top-k it writes, against the float64 oracle."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dsv4_torch.indexer import available_backends
from dsv4_torch.vllm.cpu import indexer as cpu_indexer
from dsv4_torch.vllm.cpu.metadata import IndexerPrefill
from planner import indexer_oracle as orc
from tests.indexer_cases import make_batch

pytestmark = pytest.mark.skipif(
    available_backends()["cpu"] is not None, reason="the C kernels cannot be built here (no compiler)"
)


def vllm_metadata(seq, qry, nd, r, bt):
    """DeepseekV32IndexerMetadata-like, as the plugin's builder (`cpu_engine.indexer_build`) fills it:
    decode requests first (one token each), then one prefill chunk from `cpu_metadata.IndexerPrefill`
    (it spans the prefill requests with compressed entries; its block table the rows of those)."""
    qsl = np.concatenate([[0], np.cumsum(qry)])
    rows = IndexerPrefill(qsl, np.asarray(seq), nd, len(seq) - nd, r)
    bt = torch.from_numpy(bt)
    t = torch.from_numpy
    chunk = SimpleNamespace(
        cu_seqlen_ks=t(rows.cu_seqlen_ks), cu_seqlen_ke=t(rows.cu_seqlen_ke), cu_seq_lens=t(rows.cu_seq_lens),
        token_start=rows.token_start, token_end=rows.token_end,
        block_table=bt[rows.request_start : rows.request_start + rows.num_reqs],
    )  # fmt: skip
    decode = SimpleNamespace(seq_lens=torch.tensor([s // r for s in seq[:nd]], dtype=torch.int32), block_table=bt[:nd])
    return SimpleNamespace(
        num_decodes=nd, num_decode_tokens=nd, num_prefills=len(seq) - nd, decode=decode,
        prefill=SimpleNamespace(chunks=[chunk]), block_table=bt,
    )  # fmt: skip


@pytest.mark.parametrize("topk", [512, 1024])
def test_decode_and_prefill_rows_through_our_kernel(topk):
    r, H, D = 4, 8, 128
    seq = [4 * topk + 300, 900, 3, 4 * topk + 40, 200, 2, 4 * 2 * topk, 1]
    qry = [1, 1, 3, 40, 17, 2, 9, 1]  # two decode requests, then prefill requests (some without entries)
    case = make_batch(np.random.default_rng(topk), seq=seq, qry=qry, H=H, D=D, r=r, page=64)
    T = sum(qry)
    q8 = torch.from_numpy(case["q"].astype(np.float32)).clamp(-448, 448).to(torch.float8_e4m3fn)
    layer = SimpleNamespace(
        compress_ratio=r, topk_tokens=topk, k_cache=SimpleNamespace(kv_cache=torch.from_numpy(case["cache"])),
        topk_indices_buffer=torch.full((T + 5, topk), 7, dtype=torch.int32),
    )  # fmt: skip
    md = vllm_metadata(seq, qry, 2, r, case["bt"])
    rows, req, pos, bt = cpu_indexer.indexer_tokens(md, r)
    # decode rows, then the chunk's: the prefill request at row 2 (3 tokens, no entry) is outside it
    assert rows.tolist() == [0, 1] + list(range(5, T - 1))
    assert ((pos + 1) // r).tolist() == ((case["pos"][rows] + 1) // r).tolist()
    for t, b in zip(rows, req):  # each token's block-table row is its own request's (when it sees entries)
        if (case["pos"][t] + 1) // r:
            assert (bt[b, : case["bt"].shape[1]].numpy() == case["bt"][case["req"][t]]).all()
    layer.topk_indices_buffer[:T] = -1  # (forward_cpu's reset)
    out = cpu_indexer.select(layer, md, q8, torch.from_numpy(case["w"]))
    assert out is layer.topk_indices_buffer and (out[T:] == 7).all()
    c = orc.compare_topk(
        out[:T].numpy(), q8.float().numpy(), case["w"], case["deq"], case["req"], case["pos"], r, rel=orc.fp32_rel(D, H)
    )
    print(f"vLLM rows, k={topk}: {c.near_ties} near-tie tokens of {c.tokens}")
    assert c.near_ties <= 2
