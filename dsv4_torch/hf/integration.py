"""Our sparse prefill inside transformers' DeepSeek-V4 model, with ragged (padded) batches.

    model = DeepseekV4ForCausalLM.from_pretrained(ckpt)
    enable_sparse_prefill(model, backend="auto", policy="adaptive")
    model.generate(**tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt"))
    last_step_plan(model), last_forward(model).backends   # what the last forward planned and ran
    disable_sparse_prefill(model)                           # back to transformers' eager attention

What changes. Every `DeepseekV4Attention.forward` is replaced (on the instance) by one that reuses
the module's own projections, norms, RoPE tables, compressor and indexer weights and scorer, and
computes attention with `dsv4_torch.prefill.prefill_attention` (the planner's chunks,
`sparse_attention` on the chosen backend) instead of a dense masked softmax. The model is
switched to a registered attention implementation that transformers builds no mask for (the
dense (B, 1, T, L) window mask is never materialised), so nothing of transformers' masking is
used: windows, entry visibility and top-k come from the modules and our own metadata.

One forward = one step. A forward pre-hook on the `DeepseekV4Model` reads the 2-D
`attention_mask` (one host read, before the layer loop), derives every request's real tokens
(`query_len`), its past (`seen`) and positions, plans the step once (`plan_step` +
`build_step_metadata` for every layer kind the model has) and plans the ragged state updates
(`dsv4_torch.hf.ragged`); all index arrays go to the device in one copy. Every layer of a kind then
reuses that metadata; nothing in the layer loop reads device memory on the host.

Ragged batches. A batch row is one request; its real tokens are the columns with
`attention_mask == 1` (all columns without a mask), wherever the pads are. Pads never reach the
attention: the layer packs the real tokens (request-major), runs on them, and scatters the
output back (pads get 0). Positions are request-local (`seen + rank among the row's real tokens`);
`position_ids`, if given, must agree at the real tokens (`cumsum(mask) - 1`, what `generate`
passes) and are replaced by ours (pads at 0) so transformers' RoPE tables match.

Per-request compressor / indexer state. transformers keeps one state per batch row and pools
the row's slots including pads, with block boundaries counted from column 0, which is why its
compressed layers are wrong for left-padded batches (docs/transformers-dsv4.md, section 10).
Here each request has its own state, kept next to transformers' cache (on the `DynamicCache`
object, attribute `_dsv4_sparse_state`): the last W-1 raw latents, the projected kv/gate of its
unfinished ratio-r block, CSA's overlap half, and its compressed entries (compressor and
indexer), all without padding between requests (layout: `dsv4_torch.hf.ragged`). Per call, each
request's buffered tokens plus its new real tokens are cut into complete blocks at the request's
own positions (entry w covers tokens r*w .. r*w+r-1; CSA entries also the previous block's Ca
half), pooled exactly as transformers' compressor does (its kv_proj, gate_proj, position_bias,
float32 softmax, kv_norm and compress RoPE at w*r), for all requests in one batched op; the
indexer scores each request's queries against that request's own entries only (transformers'
scorer, its future mask and topk, queries in slices of `indexer_chunk_elems` scores). So a
request in a padded batch gets the same tokens as alone, during prefill and decode, and chunked
prefill equals one call.

The `DynamicCache` (created by `generate`, by the pre-hook when `use_cache`, or passed by the
user) keeps its layer objects unused apart from `cumulative_length` (padded columns, what
`get_seq_length` and `generate` expect). The cache is tied to this path: its `update` refuses
(so transformers' own attention cannot silently continue it), `reorder_cache` reorders our
per-request state (beam search), `crop` refuses. A cache filled by transformers' attention is
refused here. `output_attentions` and 4-D masks are refused.

Training. Everything stays on autograd's graph (the reference backend's kernel has a backward;
`dsv4_torch.sparse_attention`), so every parameter gets the gradient transformers' eager attention
gives it, and the same ones get none: the indexer's weights (its top-k is an integer selection,
run here under `no_grad`), like eager. Backends without a backward ("triton", "flashmla", "cpu")
raise when a gradient is required; "auto" then runs "reference" (on CPU, "auto" runs "cpu" only
under `torch.no_grad()` / inference mode, e.g. in `generate`). In training mode the attention
dropout is eager's (`config.attention_dropout` on the probabilities, the sink excluded;
reference backend only). Gradient checkpointing: transformers drops the cache in checkpointed
layers, and so does this path (a fresh per-forward state, the given cache left untouched; a cache
that already holds tokens is refused); a layer's recomputation replays the state the layer first
saw (`ForwardContext.layer_inputs`), so the recomputed forward is the original one. The host planning
(pre-hook, post-hook, the attention layer) is excluded from `torch.compile` tracing
(`torch.compiler.disable`): a compiled model runs it eagerly between graphs. A model cast to
float16 / bfloat16 passes its sinks to the kernel in float32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from dsv4_torch.attention import BACKENDS, resolve_backend
from dsv4_torch.backends import resolve_indexer_backend
from dsv4_torch.devices import warn_emulated_bf16_gemm
from dsv4_torch.hf import layer as hf_layer
from dsv4_torch.hf import ragged
from dsv4_torch.hf.layer import ForwardContext
from dsv4_torch.hf.versions import require_supported_transformers
from dsv4_torch.prefill import build_step_metadata
from planner import (
    POLICIES,
    LayerSpec,
    PlanConfig,
    PrefillBatch,
    StepPlan,
    layer_specs,
)
from planner.checks import shape_of
from planner.kvcache import KV_CACHE_DTYPES

ATTN_IMPLEMENTATION = "dsv4_sparse_prefill"
INDEXER_CHUNK_ELEMS = 1 << 24  # indexer scores (query x head x entry) computed at once per request
_MODEL_ATTR = "_dsv4_sparse_prefill"
_CACHE_ATTR = "_dsv4_sparse_state"
_CONTEXT_ATTR = "_dsv4_sparse_context"  # on the forward's position_ids tensor: its ForwardContext


@dataclass
class ForwardRecord:
    """What the last forward ran: its step plan, the concrete backend per layer kind, the batch."""

    step_plan: StepPlan
    backends: dict[str, str]
    seq_lens: list[int]
    query_lens: list[int]


# ----------------------------------------------------------------------------- public API


def enable_sparse_prefill(
    model,
    backend: str = "auto",
    policy: str = "adaptive",
    *,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    prefill_chunk_size: int = 4,
    budget_rows: int | None = None,
    indexer_chunk_elems: int = INDEXER_CHUNK_ELEMS,
    kv_cache_dtype: str = "auto",
    indexer_backend: str = "auto",
):
    """Route every attention layer of a transformers DeepSeek-V4 model through our sparse prefill.

    Args:
      model: a loaded `DeepseekV4ForCausalLM` or `DeepseekV4Model` (transformers >=5.23.0,<5.24).
      backend: "auto", "flashmla", "triton", "cpu" or "reference" (`dsv4_torch.sparse_attention`); a named
        backend that cannot run on the model's device/dtype is refused here.
      policy: "adaptive", "fixed" or "per_request" (`planner.PlanConfig.policy`).
      max_model_len, max_num_batched_tokens: the engine limits the plans are sized from; None =
        each step's own (its longest request, its token count). Given values are enforced.
      prefill_chunk_size, budget_rows: `planner.PlanConfig` fields.
      indexer_chunk_elems: bound on the reference indexer's float32 score block (queries x heads x entries).
      indexer_backend: the CSA layers' Lightning Indexer (`dsv4_torch.indexer`): "auto" (the fused
        C kernel on CPU tensors, else the reference), "cpu" or "reference".
      kv_cache_dtype: "auto" (default: the window and compressed caches in the model's dtype) or
        "fp8_ds_mla" (vLLM's DeepSeek-V4 pages: written by the fp8 quantizer, read through the
        prefill's dequantizing gather; `dsv4_torch.hf.fp8_cache`). The indexer's keys stay in
        the model's dtype.

    Returns the model. Calling it again replaces the settings; `disable_sparse_prefill` undoes it.
    """
    require_supported_transformers()
    base = _base_model(model)
    if not isinstance(backend, str) or backend not in ("auto",) + BACKENDS:
        raise ValueError(f"backend: expected one of 'auto', {', '.join(map(repr, BACKENDS))}; got {backend!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    for name, v in (
        ("max_model_len", max_model_len),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("budget_rows", budget_rows),
    ):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name}: expected a positive int or None, got {v!r}")
    for name, v in (("prefill_chunk_size", prefill_chunk_size), ("indexer_chunk_elems", indexer_chunk_elems)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if budget_rows is not None and policy == "fixed":
        raise ValueError("budget_rows: the fixed plan has its own workspace size; use policy='adaptive'")
    layers = _check_config(base.config)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "fp8_ds_mla" and base.config.head_dim != 512:
        raise ValueError(
            f"kv_cache_dtype: fp8_ds_mla pages hold 512-dim latents, config.head_dim is {base.config.head_dim}"
        )
    if getattr(base, _MODEL_ATTR, None) is not None:
        disable_sparse_prefill(model)
    p = next(base.parameters())
    cfg = base.config
    warn_emulated_bf16_gemm(p.dtype, p.device, "enable_sparse_prefill: the model")
    resolve_backend(backend, torch.empty((0, cfg.num_attention_heads, cfg.head_dim), dtype=p.dtype, device=p.device))
    idx_dtype = torch.float32 if p.dtype == torch.float16 else p.dtype  # (float16 models index in float32)
    resolve_indexer_backend(indexer_backend, torch.empty((0, 1, 1), dtype=idx_dtype, device=p.device))

    integ = _Integration(
        base=base,
        backend=backend,
        policy=policy,
        layers=layers,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        prefill_chunk_size=prefill_chunk_size,
        budget_rows=budget_rows,
        indexer_chunk_elems=indexer_chunk_elems,
        previous_attn_implementation=cfg._attn_implementation,
        kv_cache_dtype=kv_cache_dtype,
        indexer_backend=indexer_backend,
    )
    _register_attention_function()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for layer in base.layers:
        attn = layer.self_attn
        attn.forward = torch.compiler.disable(functools.partial(_attention_forward, integ, attn))
    integ.handles = [
        base.register_forward_pre_hook(torch.compiler.disable(integ.pre_forward), with_kwargs=True),
        base.register_forward_hook(torch.compiler.disable(integ.post_forward), with_kwargs=True, always_call=True),
    ]
    integ.owner = model
    setattr(base, _MODEL_ATTR, integ)
    return model


def disable_sparse_prefill(model):
    """Undo `enable_sparse_prefill`: transformers' own attention again. Caches filled by our path
    stay tied to it (their `update` refuses). Returns the model."""
    base = _base_model(model)
    integ = getattr(base, _MODEL_ATTR, None)
    if integ is None:
        raise ValueError("model: sparse prefill is not enabled on this model")
    for h in integ.handles:
        h.remove()
    for layer in base.layers:
        layer.self_attn.__dict__.pop("forward", None)
    integ.owner.set_attn_implementation(integ.previous_attn_implementation)
    setattr(base, _MODEL_ATTR, None)
    return model


def is_sparse_prefill_enabled(model) -> bool:
    return getattr(_base_model(model), _MODEL_ATTR, None) is not None


def last_forward(model) -> ForwardRecord | None:
    """The last completed forward's `ForwardRecord` (None before the first)."""
    return _integration(model).last


def last_step_plan(model) -> StepPlan | None:
    """The `planner.StepPlan` of the last completed forward (None before the first)."""
    rec = _integration(model).last
    return None if rec is None else rec.step_plan


# ----------------------------------------------------------------------------- checks


def _base_model(model):
    from transformers import DeepseekV4ForCausalLM, DeepseekV4Model

    if isinstance(model, DeepseekV4ForCausalLM):
        return model.model
    if isinstance(model, DeepseekV4Model):
        return model
    raise TypeError(
        f"model: expected a transformers DeepseekV4ForCausalLM or DeepseekV4Model, got {type(model).__name__}"
    )


def _integration(model) -> _Integration:
    integ = getattr(_base_model(model), _MODEL_ATTR, None)
    if integ is None:
        raise ValueError("model: sparse prefill is not enabled on this model (call enable_sparse_prefill first)")
    return integ


def _check_config(cfg) -> tuple[LayerSpec, ...]:
    """The model's per-layer kinds and ratios; ValueError for what our path does not implement."""
    layers = layer_specs({"layer_types": list(cfg.layer_types), "compress_rates": dict(cfg.compress_rates or {})})
    if cfg.head_dim > 512:
        raise ValueError(
            f"config.head_dim: {cfg.head_dim} > 512 is not supported (the kernel's value is the first 512 dims)"
        )
    if int(cfg.sliding_window) < 1:
        raise ValueError(f"config.sliding_window: expected >= 1, got {cfg.sliding_window}")
    return layers


def _register_attention_function():
    from transformers import AttentionInterface

    def refuse(module, *args, **kwargs):
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} runs only through the layers patched by "
            "dsv4_torch.hf.enable_sparse_prefill; call enable_sparse_prefill(model) on this model"
        )

    AttentionInterface.register(ATTN_IMPLEMENTATION, refuse)


_FORWARD_ARGS = ("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "use_cache")


@dataclass(eq=False)
class _Integration:
    base: object
    backend: str
    policy: str
    layers: tuple[LayerSpec, ...]  # per decoder layer
    max_model_len: int | None
    max_num_batched_tokens: int | None
    prefill_chunk_size: int
    budget_rows: int | None
    indexer_chunk_elems: int
    previous_attn_implementation: str
    owner: object = None
    handles: list = field(default_factory=list)
    current: ForwardContext | None = None
    last: ForwardRecord | None = None
    kv_cache_dtype: str = "auto"  # "fp8_ds_mla": window and compressed caches as vLLM's pages
    indexer_backend: str = "auto"  # dsv4_torch.indexer's backend

    # -- hooks on DeepseekV4Model

    def pre_forward(self, module, args, kwargs):
        from transformers import DynamicCache

        kwargs = dict(kwargs)
        for name, value in zip(_FORWARD_ARGS, args):
            if name in kwargs:
                raise TypeError(f"forward: got multiple values for argument {name!r}")
            kwargs[name] = value
        if len(args) > len(_FORWARD_ARGS):
            raise TypeError(f"forward: at most {len(_FORWARD_ARGS)} positional arguments, got {len(args)}")
        if kwargs.get("output_attentions") or getattr(module.config, "output_attentions", False):
            raise ValueError(
                "output_attentions: not available with the sparse prefill path (no dense attention weights)"
            )
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        if (ids is None) == (embeds is None):
            raise ValueError("input_ids / inputs_embeds: give exactly one")
        ref = ids if ids is not None else embeds
        if ref.dim() < 2 or ref.shape[1] == 0:
            raise ValueError(f"input_ids: expected (batch, tokens) with tokens >= 1, got shape {tuple(ref.shape)}")
        B, T = int(ref.shape[0]), int(ref.shape[1])
        cfg = module.config
        cache = kwargs.get("past_key_values")
        if cache is not None and not isinstance(cache, DynamicCache):
            raise TypeError(
                f"past_key_values: expected a transformers DynamicCache (or None), got {type(cache).__name__}"
            )
        # transformers' checkpointed layers run without the cache (past_key_values=None): so do we
        checkpointing = module.training and any(
            getattr(layer, "gradient_checkpointing", False) for layer in module.layers
        )
        if checkpointing:
            if cache is not None and cache.get_seq_length():
                raise ValueError(
                    f"past_key_values: holds {cache.get_seq_length()} tokens, but with gradient checkpointing in "
                    "training mode transformers' layers run without the cache; pass no cache (or an empty one)"
                )
            state = ragged.RaggedCacheState.fresh(B)
            cache = None  # left as it is (empty), as transformers leaves it
        else:
            use_cache = kwargs.get("use_cache")
            use_cache = cfg.use_cache if use_cache is None else use_cache
            if cache is None and use_cache:
                cache = DynamicCache(config=cfg)
                kwargs["past_key_values"] = cache
            state = _state_for(cache, B, int(cfg.sliding_window))
        real, positions = _real_tokens(kwargs.get("attention_mask"), kwargs.get("position_ids"), state, B, T)

        query = real.sum(axis=1).astype(np.int64)
        seq = state.seen + query
        batch = PrefillBatch(seq, query)
        plan_cfg = PlanConfig(
            window_size=int(cfg.sliding_window),
            max_model_len=self.max_model_len or max(1, int(seq.max())),
            max_num_batched_tokens=self.max_num_batched_tokens or max(1, int(query.sum())),
            prefill_chunk_size=self.prefill_chunk_size,
            policy=self.policy,
            budget_rows=self.budget_rows,
        )
        device = ref.device
        meta = build_step_metadata(
            batch, device=device, index_topk=int(cfg.index_topk), config=plan_cfg, layers=self.layers
        )
        W = int(cfg.sliding_window)
        compress = {
            r: ragged.plan_compress(state.seen, query, r, state.layout(r))
            for r in sorted({s.compress_ratio for s in self.layers if s.has_compressed})
        }
        arrays = {
            "position_ids": np.where(real, positions, 0),
            "token_positions": positions[real],
        }
        raw = window = None
        if self.kv_cache_dtype == "fp8_ds_mla":  # packed fp8 windows, fresh raw pages per call
            raw = ragged.plan_raw(state.seen, query, W)
            arrays.update(raw_src=raw.src, raw_table=raw.table, raw_keep=raw.keep)
        else:  # window regions, new tokens written in place
            window = ragged.plan_window(state.seen, query, W, state.windows())
            arrays.update(
                window_append=window.append_dst,
                window_offsets=window.offsets,
                window_move_src=window.move_src,
                window_move_dst=window.move_dst,
            )
        for r, c in compress.items():
            arrays.update(
                {
                    f"{r}.{k}": getattr(c, k)
                    for k in (
                        "usable",
                        "leftover",
                        "prev",
                        "overlap",
                        "positions",
                        "move_src",
                        "move_dst",
                        "append_dst",
                    )
                }
            )
            arrays[f"{r}.table"] = c.layout.block_table()
        all_real = bool(real.all())
        if not all_real:
            arrays["real_index"] = np.flatnonzero(real.reshape(-1))
        dev = ragged.to_device(arrays, device)
        position_ids = dev.pop("position_ids")
        qsl = np.concatenate([[0], np.cumsum(query)]).astype(np.int64)
        ctx = ForwardContext(
            state=state,
            cache=cache,
            B=B,
            T=T,
            num_tokens=int(query.sum()),
            qsl=qsl,
            seq=seq,
            query=query,
            meta=meta,
            raw=raw,
            window=window,
            compress=compress,
            dev=dev,
            real_index=None if all_real else dev["real_index"],
            replayable=checkpointing or torch.is_grad_enabled(),
            token_request=np.repeat(np.arange(B), query),
            token_position=positions[real],
        )
        self.current = ctx
        state.in_forward = True
        # The layers find their context on the tensor they are given (also when a checkpoint
        # recomputes one during the backward, after this forward has ended).
        setattr(position_ids, _CONTEXT_ATTR, ctx)
        kwargs["position_ids"] = position_ids
        return (), kwargs

    def post_forward(self, module, args, kwargs, output):
        ctx, self.current = self.current, None
        if ctx is None or output is None:  # the forward failed: the state stays marked in_forward
            return
        st = ctx.state
        st.seen = ctx.seq
        st.columns += ctx.T
        for r, c in ctx.compress.items():
            st.layouts[r] = c.layout
        if ctx.window is not None:
            st.window_layout = ctx.window.layout
        st.in_forward = False
        if ctx.cache is not None:
            for layer in ctx.cache.layers:
                if hasattr(layer, "cumulative_length"):
                    layer.cumulative_length += ctx.T
        backends = {k.name: km.last_backend for k, km in ctx.meta.kinds.items() if km.last_backend is not None}
        self.last = ForwardRecord(ctx.meta.step_plan, backends, ctx.seq.tolist(), ctx.query.tolist())


def _state_for(cache, B: int, W: int) -> ragged.RaggedCacheState:
    if cache is None:
        return ragged.RaggedCacheState.fresh(B)
    state = getattr(cache, _CACHE_ATTR, None)
    seen_columns = cache.get_seq_length()
    if state is None:
        if seen_columns:
            raise ValueError(
                f"past_key_values: holds {seen_columns} tokens written by transformers' own attention; "
                "a cache cannot change attention paths, start a new one"
            )
        state = ragged.RaggedCacheState.fresh(B)
        setattr(cache, _CACHE_ATTR, state)
        _tie_cache(cache, W)
        return state
    if state.in_forward:
        raise ValueError("past_key_values: an earlier forward with this cache failed midway; its state is inconsistent")
    if seen_columns != state.columns:
        raise ValueError(
            f"past_key_values: reports {seen_columns} tokens but the sparse path fed it {state.columns} "
            "(was it reset or cropped?); start a new cache"
        )
    if state.num_requests != B:
        raise ValueError(f"input_ids: batch of {B} rows, but past_key_values holds {state.num_requests} requests")
    return state


def _tie_cache(cache, W: int):
    """Make the cache refuse transformers' attention and follow beam-search reorders."""

    def update(*args, **kwargs):
        raise RuntimeError(
            "past_key_values: this cache was filled by dsv4_torch.hf's sparse prefill path; transformers' "
            "own attention cannot continue it (re-enable sparse prefill or start a new cache)"
        )

    def reorder_cache(beam_idx):
        rows = beam_idx.tolist() if isinstance(beam_idx, torch.Tensor) else list(beam_idx)
        setattr(cache, _CACHE_ATTR, getattr(cache, _CACHE_ATTR).select(np.asarray(rows, dtype=np.int64), W))

    def crop(*args, **kwargs):
        raise NotImplementedError("past_key_values: the compressor state cannot be rolled back (no crop)")

    cache.update, cache.reorder_cache, cache.crop = update, reorder_cache, crop


def _real_tokens(mask, position_ids, state, B: int, T: int):
    """(real (B, T) bool, positions (B, T) int64) on the host; one device read if anything is given."""
    seen = state.seen
    parts = []
    if mask is not None:
        if isinstance(mask, dict) or not isinstance(mask, torch.Tensor):
            raise TypeError(f"attention_mask: expected a 2-D tensor (batch, columns), got {type(mask).__name__}")
        if mask.dim() != 2:
            raise ValueError(
                f"attention_mask: only 2-D (batch, columns) padding masks are supported, got shape {tuple(mask.shape)}"
            )
        if mask.shape[0] != B or mask.shape[1] not in (T, state.columns + T):
            raise ValueError(
                f"attention_mask: expected ({B}, {state.columns + T}) (past and new columns) or ({B}, {T}), "
                f"got {tuple(mask.shape)}"
            )
        parts.append(mask[:, -T:].to(torch.int64))
    if position_ids is not None:
        if (
            not isinstance(position_ids, torch.Tensor)
            or position_ids.dim() != 2
            or position_ids.shape[1] != T
            or position_ids.shape[0] not in (1, B)
        ):
            raise ValueError(f"position_ids: expected ({B}, {T}) or (1, {T}), got {shape_of(position_ids)}")
        parts.append(position_ids.to(torch.int64).expand(B, T))
    host = torch.stack([p.to(parts[0].device) for p in parts]).cpu().numpy() if parts else None
    real = np.ones((B, T), dtype=bool) if mask is None else host[0] != 0
    positions = seen[:, None] + np.cumsum(real, axis=1) - 1
    if position_ids is not None:
        given = host[-1]
        bad = real & (given != positions)
        if bad.any():
            b, t = (int(x[0]) for x in np.nonzero(bad))
            raise ValueError(
                f"position_ids: row {b} column {t} has position {int(given[b, t])}, but it is token "
                f"{int(positions[b, t])} of its request (positions count each request's real tokens: "
                "cumsum(attention_mask) - 1)"
            )
    return real, positions.astype(np.int64)


# ----------------------------------------------------------------------------- the attention layer


def _attention_forward(
    integ: _Integration,
    module,
    hidden_states,
    position_embeddings=None,
    position_ids=None,
    attention_mask=None,
    past_key_values=None,
    **kwargs,
):
    ctx = getattr(position_ids, _CONTEXT_ATTR, None) or integ.current
    if ctx is None:
        raise RuntimeError(
            f"layer {module.layer_idx}: the sparse prefill attention runs only inside a DeepseekV4Model forward "
            "(its pre-hook plans the step)"
        )
    if tuple(hidden_states.shape[:2]) != (ctx.B, ctx.T):
        raise RuntimeError(
            f"hidden_states: shape {tuple(hidden_states.shape)} differs from the forward's ({ctx.B}, {ctx.T})"
        )
    idx = module.layer_idx
    if idx in ctx.layer_inputs:  # a checkpoint recomputes this layer: replay it from its input state
        lstate = hf_layer.copy_layer_state(ctx.layer_inputs[idx])
    elif idx in ctx.layers_done:
        raise RuntimeError(
            f"layer {idx}: called twice in one forward, and its input state was not kept (a reentrant "
            "torch.utils.checkpoint around it under no_grad?); use transformers' gradient checkpointing "
            "(model.activation_checkpointing_enable()) or use_reentrant=False"
        )
    else:
        lstate = ctx.state.layer(idx)
        if ctx.replayable:
            ctx.layer_inputs[idx] = hf_layer.copy_layer_state(lstate)
        ctx.layers_done.add(idx)
    return hf_layer.sparse_layer(integ, ctx, module, lstate, hidden_states, position_embeddings), None
