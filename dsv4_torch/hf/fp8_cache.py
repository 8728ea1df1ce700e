"""The integration's window and compressed caches as vLLM's fp8_ds_mla pages
(`enable_sparse_prefill(model, kv_cache_dtype="fp8_ds_mla")`).

What changes against the default (caches in the model's dtype, `dsv4_torch.hf.ragged`):

  window   per layer, the last min(seen, W-1) raw latents of every request: fp8 pages of
           ENTRY_PAGE slots, window row i in slot i (same row order as the float window).
  raw      per call, the pages `prefill_attention` reads: the old window's slots (bytes copied)
           and the new tokens, quantized once by `dsv4_torch.kvcache.quantize_and_insert_k_cache`
           (the bf16-rounded latents, as DeepSeek's model and vLLM store them), laid out by the
           forward's `ragged.RawPlan` exactly like the float pages.
  entries  per compressor (not the indexer's keys, which stay in the model's dtype): fp8 pages
           of ENTRY_PAGE slots at the float layout's rows; new entries quantized into their
           slots, old ones moved as bytes when the layout grows.

So every latent the attention reads was written once by the fp8 writer and is read back through
the prefill's dequantizing gather (`PagedKV(kv_cache_dtype="fp8_ds_mla")`): the attention sees
what an fp8_ds_mla serving engine's sees. Device ops only; no host reads.
"""

from __future__ import annotations

import torch

from dsv4_torch import kvcache
from dsv4_torch.hf import ragged
from dsv4_torch.prefill import PagedKV

FORMAT = "fp8_ds_mla"
S = ragged.ENTRY_PAGE  # slots per page of every fp8 page array here (= ragged.RAW_PAGE)
assert ragged.RAW_PAGE == S


def _quantize(x: torch.Tensor) -> torch.Tensor:
    """Fresh pages holding rows x (n, 512) in slots 0 .. n-1 (the bf16-rounded values)."""
    n = x.shape[0]
    pages = torch.zeros((max(1, -(-n // S)), kvcache.page_bytes(S)), dtype=torch.uint8, device=x.device)
    slots = torch.arange(n, device=x.device)
    kvcache.quantize_and_insert_k_cache(x.to(torch.bfloat16), pages, slots, S, validate=False)
    return pages


def raw_kv(lstate: ragged.LayerState, kv: torch.Tensor, dev: dict[str, torch.Tensor], n_old: int) -> PagedKV:
    """This call's raw pages (old window + new tokens) and the layer's new window, fp8.

    kv: (Tr, 512) the new tokens' latents; dev: the forward's device indices ("raw_src",
    "raw_keep": rows of the stream = the n_old old window rows, then the new tokens;
    "raw_table": the pages' block table).
    """
    new = _quantize(kv)
    if lstate.window is None:
        stream, n_old, old_pages = new, 0, 0
    else:
        stream = torch.cat([lstate.window, new])
        old_pages = lstate.window.shape[0]

    def stream_slot(rows):  # stream row -> slot of `stream` (the old pages, then the new ones)
        return torch.where(rows < n_old, rows, rows - n_old + old_pages * S)

    pages = kvcache.gather_slots(stream, stream_slot(dev["raw_src"]), S)
    lstate.window = kvcache.gather_slots(stream, stream_slot(dev["raw_keep"]), S)
    return PagedKV(pages, dev["raw_table"], kv_cache_dtype=FORMAT, block_size=S)


def store_entries(
    cs: ragged.CompressorState,
    plan: ragged.CompressPlan,
    dev: dict[str, torch.Tensor],
    new_entries: torch.Tensor | None,
    device: torch.device,
    copy: bool = False,
) -> torch.Tensor:
    """The compressor's entry pages after this call: moved when the layout grew, new entries
    quantized. copy: write into a new tensor (a replayable forward keeps the old one as a layer's
    input state), else in place."""
    if plan.relayout or cs.entries is None:
        grown = torch.zeros((plan.layout.total_rows // S, kvcache.page_bytes(S)), dtype=torch.uint8, device=device)
        if cs.entries is not None and plan.move_src.size:
            kvcache.copy_slots(cs.entries, dev["move_src"], grown, dev["move_dst"], S)
        cs.entries = grown
    elif copy and new_entries is not None:
        cs.entries = cs.entries.clone()
    if new_entries is not None:
        kvcache.quantize_and_insert_k_cache(
            new_entries.to(torch.bfloat16), cs.entries, dev["append_dst"], S, validate=False
        )
    return cs.entries


def entries_kv(entries: torch.Tensor, table: torch.Tensor) -> PagedKV:
    return PagedKV(entries, table, kv_cache_dtype=FORMAT, block_size=S)
