"""Capture what one DeepSeek-V4 attention layer of transformers feeds its attention core.

`capture_attention(model, input_ids, layer_idx)` runs one forward of a transformers
`DeepseekV4ForCausalLM` (eager attention, batch of one request) and returns, for the chosen
decoder layer, the exact tensors transformers' eager attention consumes and produces:

  query (T, H, D)          after q_a_proj, q_a_norm, q_b_proj, per-head unweighted RMSNorm, RoPE
  window_kv (L, D)         raw latents (kv_proj, kv_norm, RoPE) of positions window_start .. seq_len-1:
                           the cached min(prefix, W-1) tokens, then the T new ones
  compressed_kv (N, D)     compressed entries 0 .. N-1 (N = seq_len // r) for CSA/HCA, else None
  topk_indices (T, k)      CSA only: the indexer's request-local entry ids, -1 = none
  sink (H,), sm_scale      the per-head sink logit and the softmax scale
  attention_mask (T, L+N)  transformers' additive mask over [window | compressed entries]
  output (T, H, D)         eager attention output BEFORE the inverse RoPE: this is what our
                           kernel (`sparse_attention` / `prefill_attention`) computes
  output_derotated (T,H,D) the same after the inverse RoPE: what o_a_proj receives

Nothing of transformers is copied: the layer's attention function is wrapped for the duration of
the call (it is looked up by name in `modeling_deepseek_v4` at every call), the indexer and the
output projection are observed with forward hooks. With `past_key_values` (a `DynamicCache`
from earlier calls) this captures one step of a chunked prefill or a decode step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dsv4_torch.hf.versions import require_supported_transformers
from planner.contract import LayerKind


@dataclass
class AttentionCapture:
    """One call's attention inputs and outputs for one layer and one request (see module doc)."""

    layer_idx: int
    kind: LayerKind
    compress_ratio: int  # 0 for SWA
    window_size: int  # W (config.sliding_window)
    seq_len: int  # tokens in context after this call
    query_len: int  # T, new tokens of this call
    positions: torch.Tensor  # (T,) int64, seq_len - T .. seq_len - 1
    query: torch.Tensor  # (T, H, D)
    window_kv: torch.Tensor  # (L, D)
    window_start: int  # absolute position of window_kv[0]
    compressed_kv: torch.Tensor | None  # (N, D)
    topk_indices: torch.Tensor | None  # (T, k) int64
    sink: torch.Tensor  # (H,)
    sm_scale: float
    attention_mask: torch.Tensor  # (T, L + N), additive: 0 = attend
    output: torch.Tensor  # (T, H, D), before inverse RoPE
    output_derotated: torch.Tensor  # (T, H, D), after inverse RoPE

    def raw_kv(self, fill: float = float("nan")) -> torch.Tensor:
        """(seq_len, D): window_kv at its absolute positions, `fill` where transformers keeps no row.

        The default NaN makes any read of a position outside the window visible in a result.
        """
        out = self.window_kv.new_full((self.seq_len, self.window_kv.shape[-1]), fill)
        out[self.window_start :] = self.window_kv
        return out

    def visible_keys(self) -> list[tuple[list[int], list[int]]]:
        """Per query token, (raw positions, compressed entry ids) transformers' mask lets it see."""
        L = self.window_kv.shape[0]
        allowed = self.attention_mask > torch.finfo(self.attention_mask.dtype).min / 2  # 0 vs min/-inf
        out = []
        for t in range(self.query_len):
            raw = (torch.nonzero(allowed[t, :L]).flatten() + self.window_start).tolist()
            comp = torch.nonzero(allowed[t, L:]).flatten().tolist()
            out.append((raw, comp))
        return out


def _decoder_layers(model):
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None or type(model).__name__ not in ("DeepseekV4ForCausalLM", "DeepseekV4Model"):
        raise TypeError(
            f"model: expected a transformers DeepseekV4ForCausalLM or DeepseekV4Model, got {type(model).__name__}"
        )
    return layers


@contextlib.contextmanager
def _wrapped_attention_function(records: dict):
    """Temporarily wrap `modeling_deepseek_v4.eager_attention_forward` to record the calls of the
    attention modules in `records` ({module: dict})."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mod

    original = mod.eager_attention_forward

    def recording(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        out, weights = original(module, query, key, value, attention_mask, scaling, dropout=dropout, **kwargs)
        if module in records:
            records[module].update(
                query=query,
                key=key,
                attention_mask=attention_mask,
                scaling=scaling,
                sink=kwargs.get("s_aux"),
                output=out,
            )
        return out, weights

    mod.eager_attention_forward = recording
    try:
        yield
    finally:
        mod.eager_attention_forward = original


def capture_attention(model, input_ids: torch.Tensor, layer_idx: int, past_key_values=None, **forward_kwargs):
    """Run `model(input_ids, past_key_values=..., **forward_kwargs)` and capture one layer's attention.

    Args:
      model: a transformers `DeepseekV4ForCausalLM` (or `DeepseekV4Model`) with eager attention.
      input_ids: (1, T) int64, the new tokens of this call (one request).
      layer_idx: the decoder layer to capture.
      past_key_values: optional `DynamicCache` holding the earlier tokens (chunked prefill, decode).
      forward_kwargs: passed to the forward (e.g. use_cache=True).

    Returns:
      (AttentionCapture, the forward's output).
    """
    captures, result = capture_attention_layers(model, input_ids, [layer_idx], past_key_values, **forward_kwargs)
    return captures[layer_idx], result


def capture_attention_layers(model, input_ids: torch.Tensor, layer_idxs, past_key_values=None, **forward_kwargs):
    """`capture_attention` for several layers in one forward: returns ({layer_idx: AttentionCapture}, output)."""
    require_supported_transformers()
    layers = _decoder_layers(model)
    layer_idxs = list(layer_idxs)
    if not layer_idxs:
        raise ValueError("layer_idxs: no layer to capture")
    for i in layer_idxs:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(layers):
            raise ValueError(f"layer_idx: expected an int in 0..{len(layers) - 1}, got {i!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[0] != 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids: expected a (1, T) tensor (one request), got {shape}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids: no tokens")
    impl = model.config._attn_implementation
    if impl != "eager":
        raise ValueError(f"model: capture needs config._attn_implementation == 'eager', got {impl!r}")
    if "position_ids" in forward_kwargs or "attention_mask" in forward_kwargs:
        raise ValueError(
            "forward_kwargs: position_ids / attention_mask are not supported (positions come from the cache)"
        )

    records = {layers[i].self_attn: {} for i in layer_idxs}
    handles = []
    for attn, record in records.items():
        handles.append(
            attn.register_forward_pre_hook(
                lambda m, args, kwargs, record=record: record.update(position_ids=kwargs["position_ids"]),
                with_kwargs=True,
            )
        )
        handles.append(
            attn.o_a_proj.register_forward_pre_hook(lambda m, args, record=record: record.update(derotated=args[0]))
        )
        if attn.layer_type == "compressed_sparse_attention":
            handles.append(
                attn.compressor.indexer.register_forward_hook(lambda m, a, out, record=record: record.update(topk=out))
            )
    try:
        with torch.no_grad(), _wrapped_attention_function(records):
            result = model(input_ids, past_key_values=past_key_values, **forward_kwargs)
    finally:
        for h in handles:
            h.remove()
    captures = {i: _to_capture(model.config, i, records[layers[i].self_attn], input_ids.shape[1]) for i in layer_idxs}
    return captures, result


def _to_capture(cfg, layer_idx: int, record: dict, T: int) -> AttentionCapture:
    """Cut one layer's recorded tensors into the capture, checking the layout we rely on."""
    if "output" not in record:
        raise RuntimeError(f"layer {layer_idx}: the eager attention function was not called")
    ltype = cfg.layer_types[layer_idx]
    kind = LayerKind.of(ltype)
    ratio = 0 if kind is LayerKind.SWA else int(cfg.compress_rates[ltype])
    W = int(cfg.sliding_window)
    positions = record["position_ids"].reshape(-1)[-T:].to(torch.int64).cpu()
    seq_len = int(positions[-1]) + 1
    if not torch.equal(positions, torch.arange(seq_len - T, seq_len)):
        raise RuntimeError(f"position_ids: expected {seq_len - T} .. {seq_len - 1}, got {positions.tolist()}")
    key = record["key"][0, 0]  # (L + N, D): window rows then compressed entries
    n_comp = 0 if kind is LayerKind.SWA else seq_len // ratio
    L = key.shape[0] - n_comp
    prefix = seq_len - T
    if L != T + min(prefix, W - 1):
        raise RuntimeError(
            f"layer {layer_idx}: {key.shape[0]} keys do not split into T + min(prefix, W-1) = "
            f"{T + min(prefix, W - 1)} window rows and seq_len // r = {n_comp} entries"
        )
    mask = record["attention_mask"]
    if mask is None:
        raise RuntimeError(f"layer {layer_idx}: no attention mask reached the attention function")
    mask = mask[0, 0]
    if mask.shape != (T, key.shape[0]):
        raise RuntimeError(f"layer {layer_idx}: mask shape {tuple(mask.shape)}, expected {(T, key.shape[0])}")
    topk = record.get("topk")
    H, D = record["query"].shape[1], record["query"].shape[3]
    return AttentionCapture(
        layer_idx=layer_idx,
        kind=kind,
        compress_ratio=ratio,
        window_size=W,
        seq_len=seq_len,
        query_len=T,
        positions=positions,
        query=record["query"][0].transpose(0, 1),
        window_kv=key[:L],
        window_start=seq_len - L,
        compressed_kv=None if kind is LayerKind.SWA else key[L:],
        topk_indices=None if topk is None else topk[0].to(torch.int64),
        sink=record["sink"].detach(),
        sm_scale=float(record["scaling"]),
        attention_mask=mask,
        output=record["output"][0],
        output_derotated=record["derotated"][0].reshape(T, H, D),
    )
