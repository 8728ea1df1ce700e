"""vLLM's own prefill chunk loop on the CPU, fed the plugin's plans, against our float64 oracle.

What runs: `DeepseekV4FlashMLAAttention._forward_prefill` of vLLM 0.33.0 (the V4.0 NVIDIA
consumer) as shipped, with its own Triton kernels `dequantize_and_gather_k_cache` (paged
`fp8_ds_mla` cache -> bf16 workspace) and `combine_topk_swa_indices` (top-k + window -> workspace
indices) in Triton's interpreter on CPU tensors, and vLLM's own workspace manager on the CPU.
What is replaced, and why:
- `flash_mla_sparse_fwd` -> `dsv4_torch.sparse_attention(..., backend="reference")`: FlashMLA is a
  CUDA binary for SM90/SM100 and cannot run on a CPU.
- the gather's CuteDSL branch is bypassed (`has_cutedsl` -> False), so the Triton kernel runs:
  CuteDSL compiles for a GPU only.
- the layer object is a namespace with the attributes `_forward_prefill` reads (compress_ratio,
  window_size, scale, attn_sink, topk_indices_buffer, ...): building a real `DeepseekV4Attention`
  needs a model config, weights and a GPU platform. Its inputs (metadata, caches, top-k rows) are
  built here as vLLM's builders lay them out (real-formats.md section 1).
The kernels' worker counts are lowered (NUM_WORKERS, the second grid axis: each worker strides
over rows, any count gives the same result) so the interpreter runs fewer empty programs.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from planner import oracle
from tests.parity.tolerances import compare_out

W = 8  # window (vLLM's index kernel wants a power of two)
H = 16  # query heads (the reference backend takes any count; FlashMLA would need 64/128)
D = 512  # latent: 448 fp8 dims + 64 bf16 RoPE dims
TOPK = 16  # CSA top-k width
HCA_WIDTH = 8  # width of the HCA layers' precomputed index rows
SWA_BLOCK = 64  # tokens per SWA cache page
BLOCK = 256  # tokens per compressed-cache block (slots per page = BLOCK // ratio)
CHUNK_SIZE = 4  # DeepseekV4Attention.PREFILL_CHUNK_SIZE
MAX_MODEL_LEN, MAX_BATCHED = 512, 32  # the step has 25 tokens (vLLM: <= max_num_batched_tokens)

KINDS = {1: "SWA", 4: "CSA", 128: "HCA"}  # vLLM's V4.0 layers: SWA asks with ratio 1

# One decode request, then the prefills; requests 2 and 4 are KV-transfer loads (no queries).
DECODE_SEQ = [50]
SEQ = [140, 9, 300, 30, 70, 260]
QRY = [6, 9, 0, 5, 0, 4]


def page_bytes(slots: int) -> int:
    return -(-slots * 584 // 576) * 576


def random_latents(rng, n: int):
    """n latents as fp8_ds_mla slot bytes (448 e4m3, 64 bf16, 7 scale exponents) and their values."""
    fp8 = rng.integers(0, 256, (n, 448), dtype=np.uint8)
    fp8[(fp8 & 0x7F) == 0x7F] = 0  # no NaN codes
    scale = rng.integers(121, 127, (n, 7), dtype=np.uint8)
    rope = torch.randn(n, 64, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30)))).to(torch.bfloat16)
    nope = torch.from_numpy(fp8).view(torch.float8_e4m3fn).double().numpy()
    nope = nope * np.exp2(np.repeat(scale.astype(np.float64) - 127, 64, axis=1))
    values = np.concatenate([nope, rope.double().numpy()], axis=1)  # exact in bf16
    return fp8, rope.view(torch.uint8).numpy(), scale, values


def write_cache(rng, lengths, slots: int, pages_per_req: list[int]):
    """A paged fp8_ds_mla cache holding `lengths[i]` random entries of request i; its block table."""
    total = sum(pages_per_req) + 3
    cache = np.zeros((total, page_bytes(slots)), dtype=np.uint8)
    order = rng.permutation(total)  # physical pages in random order
    table = np.zeros((len(lengths), max(pages_per_req) + 1), dtype=np.int32)
    values, used = [], 0
    for i, n in enumerate(lengths):
        table[i, : pages_per_req[i]] = order[used : used + pages_per_req[i]]
        used += pages_per_req[i]
        fp8, rope, scale, vals = random_latents(rng, n)
        for pos in range(n):
            page, slot = table[i, pos // slots], pos % slots
            cache[page, slot * 576 : slot * 576 + 448] = fp8[pos]
            cache[page, slot * 576 + 448 : slot * 576 + 576] = rope[pos]
            cache[page, slots * 576 + slot * 8 : slots * 576 + slot * 8 + 7] = scale[pos]
        values.append(vals)
    return torch.from_numpy(cache), torch.from_numpy(table), values


@pytest.fixture(scope="module")
def vllm_loop(vllm_plugins, sparse_swa):
    import vllm.models.deepseek_v4.common.ops.cache_utils as cache_utils
    import vllm.models.deepseek_v4.nvidia.flashmla as flashmla
    from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device("cpu"))
    kernel_rows = []

    def sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, out=None):
        from dsv4_torch import sparse_attention

        assert d_v == 512
        kernel_rows.append(int(q.shape[0]))
        o, max_logits, lse = sparse_attention(q, kv, indices, sm_scale, attn_sink, topk_length, backend="reference")
        if out is not None:
            out.copy_(o)
        return o, max_logits, lse

    mp = pytest.MonkeyPatch()
    mp.setattr(flashmla, "flash_mla_sparse_fwd", sparse_fwd)
    mp.setattr(cache_utils, "has_cutedsl", lambda: False)
    mp.setattr(cache_utils._DEQUANTIZE_AND_GATHER_K_CACHE_KERNEL, "NUM_WORKERS", 4)
    mp.setattr(cache_utils._COMBINE_TOPK_SWA_INDICES_KERNEL, "NUM_WORKERS", 4)
    yield SimpleNamespace(cls=flashmla.DeepseekV4FlashMLAAttention, kernel_rows=kernel_rows, sparse_swa=sparse_swa)
    mp.undo()


def build_step(rng, sparse_swa, seq, qry, ratio):
    """A step's inputs for one layer: metadata, caches, q, top-k rows; and the logical KV."""
    all_seq, all_qry = DECODE_SEQ + list(seq), [1] * len(DECODE_SEQ) + list(qry)
    nd, nt_d = len(DECODE_SEQ), len(DECODE_SEQ)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(all_qry)]), dtype=torch.int32)
    seq_t = torch.tensor(all_seq, dtype=torch.int32)
    swa_cache, swa_table, raw = write_cache(rng, all_seq, SWA_BLOCK, [-(-s // SWA_BLOCK) for s in all_seq])
    p_seq, p_qry = np.array(seq), np.array(qry)
    md = sparse_swa.DeepseekSparseSWAMetadata(
        block_table=swa_table,
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        block_size=SWA_BLOCK,
        seq_lens=seq_t,
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        num_decodes=nd,
        num_prefills=len(seq),
        num_decode_tokens=nt_d,
        num_prefill_tokens=int(p_qry.sum()),
        prefill_seq_lens=seq_t[nd:],
        prefill_seq_lens_cpu=seq_t[nd:].clone(),
        prefill_gather_lens=torch.tensor(p_qry + np.minimum(p_seq - p_qry, W - 1), dtype=torch.int32),
        prefill_query_lens_cpu=torch.tensor(p_qry, dtype=torch.int32),
        prefill_window_size=W,
        prefill_max_model_len=MAX_MODEL_LEN,
        prefill_max_num_batched_tokens=MAX_BATCHED,
    )
    T = int(p_qry.sum())
    pos = np.concatenate([np.arange(s - q, s) for s, q in zip(p_seq, p_qry)]).astype(np.int64)
    q = (torch.randn(T, H, D, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30)))) * 0.5).to(
        torch.bfloat16
    )
    topk_buffer = torch.full((nt_d + T, TOPK), -1, dtype=torch.int32)
    attn_md, comp_cache, comp, topk_rows = None, None, None, None
    if ratio > 1:
        slots = BLOCK // ratio
        comp_cache, comp_table, comp = write_cache(
            rng, [s // ratio for s in all_seq], slots, [-(-s // BLOCK) for s in all_seq]
        )
        visible = (pos + 1) // ratio
        if ratio == 4:  # the indexer's request-local top-k rows
            topk_rows = np.full((T, TOPK), -1, dtype=np.int64)
            for t, v in enumerate(visible):
                k = min(int(v), TOPK)
                topk_rows[t, :k] = rng.choice(int(v), k, replace=False)
            topk_buffer[nt_d:] = torch.from_numpy(topk_rows.astype(np.int32))
            c128a = None
        else:  # HCA: every visible entry, precomputed per token
            assert visible.max() <= HCA_WIDTH
            cols = np.arange(HCA_WIDTH)[None, :]
            c128a = torch.from_numpy(np.where(cols < visible[:, None], cols, -1).astype(np.int32))
        attn_md = SimpleNamespace(block_table=comp_table, block_size=BLOCK, c128a_prefill_topk_indices=c128a)
    layer = SimpleNamespace(
        compress_ratio=ratio,
        window_size=W,
        max_image_tokens=0,
        max_num_batched_tokens=MAX_BATCHED,
        PREFILL_CHUNK_SIZE=CHUNK_SIZE,
        scale=D**-0.5,
        topk_indices_buffer=topk_buffer,
        attn_sink=torch.from_numpy(rng.normal(size=H).astype(np.float32)),
    )
    inputs = dict(
        q=q,
        positions=torch.from_numpy(pos),
        compressed_k_cache=comp_cache,
        swa_k_cache=swa_cache,
        attn_metadata=attn_md,
        swa_metadata=md,
    )
    logical = dict(raw=raw[nd:], comp=None if comp is None else comp[nd:], topk_rows=topk_rows)
    return layer, inputs, logical


def run_loop(loop, layer, inputs):
    out = torch.full_like(inputs["q"], float("nan"))
    loop.kernel_rows.clear()
    loop.cls._forward_prefill(layer, output=out, **inputs)
    return out, list(loop.kernel_rows)


@pytest.mark.parametrize("ratio", [1, 4, 128], ids=["SWA", "CSA", "HCA"])
def test_vllm_chunk_loop_with_plugin_plans_matches_oracle(vllm_loop, vllm_plan, ratio):
    rng = np.random.default_rng(ratio)
    layer, inputs, logical = build_step(rng, vllm_loop.sparse_swa, SEQ, QRY, ratio)
    md = inputs["swa_metadata"]
    plan = md.get_prefill_chunk_plan(compress_ratio=ratio, prefill_chunk_size=CHUNK_SIZE)
    # the plan skips the two loads: three chunks, request slicing starts past 0 and past a load
    assert [(s, e) for s, e, _, _ in plan] == [(0, 2), (3, 4), (5, 6)]
    assert len(vllm_plan(md, ratio, CHUNK_SIZE)) == 1  # vLLM's: one chunk that gathers the loads too

    out, kernel_rows = run_loop(vllm_loop, layer, inputs)
    assert kernel_rows == [15, 5, 4]  # one kernel call per chunk, never an empty one
    ref, _, _ = oracle.prefill_attention(
        inputs["q"].double().numpy(),
        logical["raw"],
        logical["comp"],
        SEQ,
        QRY,
        kind=KINDS[ratio],
        compress_ratio=ratio if ratio > 1 else 0,
        window_size=W,
        sm_scale=layer.scale,
        attn_sink=layer.attn_sink.double().numpy(),
        topk_rows=logical["topk_rows"],
    )
    agreement = compare_out(out.double().numpy(), ref, ref, "bfloat16")
    assert agreement.passed, agreement


def test_step_of_loads_only_computes_nothing(vllm_loop, vllm_plan, monkeypatch):
    """Prefill requests all without queries: the plan is empty and the guarded loop returns; vLLM's
    own plan would have sent a chunk of zero query rows to the kernel (vLLM #51486)."""
    rng = np.random.default_rng(0)
    layer, inputs, _ = build_step(rng, vllm_loop.sparse_swa, [20, 30], [0, 0], 4)
    assert inputs["swa_metadata"].get_prefill_chunk_plan(4, CHUNK_SIZE) == []
    out, kernel_rows = run_loop(vllm_loop, layer, inputs)
    assert kernel_rows == [] and out.shape[0] == 0

    # vLLM as shipped (its plan, its unguarded loop): an empty kernel call
    from dsv4_torch.vllm.plugin import original

    monkeypatch.setattr(vllm_loop.sparse_swa.DeepseekSparseSWAMetadata, "get_prefill_chunk_plan", vllm_plan)
    monkeypatch.setattr(vllm_loop.cls, "_forward_prefill", original(vllm_loop.cls._forward_prefill))
    layer, inputs, _ = build_step(rng, vllm_loop.sparse_swa, [20, 30], [0, 0], 4)
    _, kernel_rows = run_loop(vllm_loop, layer, inputs)
    assert kernel_rows == [0]
