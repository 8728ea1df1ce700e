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
saw (`_Context.layer_inputs`), so the recomputed forward is the original one. The host planning
(pre-hook, post-hook, the attention layer) is excluded from `torch.compile` tracing
(`torch.compiler.disable`): a compiled model runs it eagerly between graphs. A model cast to
float16 / bfloat16 passes its sinks to the kernel in float32.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from dsv4_torch.attention import BACKENDS, resolve_backend
from dsv4_torch.hf import fp8_cache, ragged
from dsv4_torch.hf.versions import require_supported_transformers
from dsv4_torch.prefill import (
    PagedKV,
    StepMetadata,
    build_step_metadata,
    prefill_attention,
)
from planner import (
    POLICIES,
    LayerKind,
    LayerSpec,
    PlanConfig,
    PrefillBatch,
    StepPlan,
    layer_specs,
)
from planner.kvcache import KV_CACHE_DTYPES

ATTN_IMPLEMENTATION = "dsv4_sparse_prefill"
INDEXER_CHUNK_ELEMS = 1 << 24  # indexer scores (query x head x entry) computed at once per request
_MODEL_ATTR = "_dsv4_sparse_prefill"
_CACHE_ATTR = "_dsv4_sparse_state"
_CONTEXT_ATTR = "_dsv4_sparse_context"  # on the forward's position_ids tensor: its _Context


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
      indexer_chunk_elems: bound on the indexer's float32 score block (queries x heads x entries).
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
    for name, v in (("max_model_len", max_model_len), ("max_num_batched_tokens", max_num_batched_tokens),
                    ("budget_rows", budget_rows)):  # fmt: skip
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
        raise ValueError(f"kv_cache_dtype: fp8_ds_mla pages hold 512-dim latents, config.head_dim is {base.config.head_dim}")
    if getattr(base, _MODEL_ATTR, None) is not None:
        disable_sparse_prefill(model)
    p = next(base.parameters())
    cfg = base.config
    resolve_backend(backend, torch.empty((0, cfg.num_attention_heads, cfg.head_dim), dtype=p.dtype, device=p.device))

    integ = _Integration(
        base=base, backend=backend, policy=policy, layers=layers, max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens, prefill_chunk_size=prefill_chunk_size,
        budget_rows=budget_rows, indexer_chunk_elems=indexer_chunk_elems,
        previous_attn_implementation=cfg._attn_implementation, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
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
    raise TypeError(f"model: expected a transformers DeepseekV4ForCausalLM or DeepseekV4Model, got {type(model).__name__}")


def _integration(model) -> "_Integration":
    integ = getattr(_base_model(model), _MODEL_ATTR, None)
    if integ is None:
        raise ValueError("model: sparse prefill is not enabled on this model (call enable_sparse_prefill first)")
    return integ


def _check_config(cfg) -> tuple[LayerSpec, ...]:
    """The model's per-layer kinds and ratios; ValueError for what our path does not implement."""
    layers = layer_specs({"layer_types": list(cfg.layer_types), "compress_rates": dict(cfg.compress_rates or {})})
    if cfg.head_dim > 512:
        raise ValueError(f"config.head_dim: {cfg.head_dim} > 512 is not supported (the kernel's value is the first 512 dims)")
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


# ----------------------------------------------------------------------------- per-forward context


@dataclass(eq=False)
class _Context:
    """One forward's plan: host integers, device index tensors, the step metadata, the state."""

    state: ragged.RaggedCacheState
    cache: object
    B: int
    T: int
    num_tokens: int  # real tokens (Tr)
    qsl: np.ndarray  # (B + 1,) token offsets of each request in the packed order
    seq: np.ndarray
    query: np.ndarray
    meta: StepMetadata
    raw: ragged.RawPlan
    compress: dict[int, ragged.CompressPlan]
    dev: dict[str, torch.Tensor]  # device index tensors: "raw_src", ..., and per ratio "4.usable", ...
    real_index: torch.Tensor | None  # (Tr,) rows of the (B*T) flattening; None = every token is real
    replayable: bool = False  # keep each layer's input state, so a checkpoint can recompute the layer
    layer_inputs: dict = field(default_factory=dict)  # layer_idx -> copy of the LayerState it first saw
    layers_done: set = field(default_factory=set)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.reshape(self.B * self.T, *t.shape[2:])
        return flat if self.real_index is None else flat.index_select(0, self.real_index)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        if self.real_index is None:
            return y.view(self.B, self.T, -1)
        out = y.new_zeros((self.B * self.T, y.shape[-1]))
        out.index_copy_(0, self.real_index, y)
        return out.view(self.B, self.T, -1)


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
    current: _Context | None = None
    last: ForwardRecord | None = None
    kv_cache_dtype: str = "auto"  # "fp8_ds_mla": window and compressed caches as vLLM's pages

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
            raise ValueError("output_attentions: not available with the sparse prefill path (no dense attention weights)")
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
            raise TypeError(f"past_key_values: expected a transformers DynamicCache (or None), got {type(cache).__name__}")
        # transformers' checkpointed layers run without the cache (past_key_values=None): so do we
        checkpointing = module.training and any(getattr(layer, "gradient_checkpointing", False) for layer in module.layers)
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
            prefill_chunk_size=self.prefill_chunk_size, policy=self.policy, budget_rows=self.budget_rows,
        )  # fmt: skip
        device = ref.device
        meta = build_step_metadata(batch, device=device, index_topk=int(cfg.index_topk), config=plan_cfg,
                                   layers=self.layers)  # fmt: skip
        raw = ragged.plan_raw(state.seen, query, int(cfg.sliding_window))
        compress = {r: ragged.plan_compress(state.seen, query, r, state.layout(r)) for r in sorted({s.compress_ratio for s in self.layers if s.has_compressed})}
        arrays = {
            "position_ids": np.where(real, positions, 0),
            "token_positions": positions[real],
            "raw_src": raw.src, "raw_table": raw.table, "raw_keep": raw.keep,
        }  # fmt: skip
        for r, c in compress.items():
            arrays.update({f"{r}.{k}": getattr(c, k) for k in
                           ("usable", "leftover", "prev", "overlap", "positions", "move_src", "move_dst", "append_dst")})
            arrays[f"{r}.table"] = c.layout.block_table()
        all_real = bool(real.all())
        if not all_real:
            arrays["real_index"] = np.flatnonzero(real.reshape(-1))
        dev = ragged.to_device(arrays, device)
        position_ids = dev.pop("position_ids")
        qsl = np.concatenate([[0], np.cumsum(query)]).astype(np.int64)
        ctx = _Context(
            state=state, cache=cache, B=B, T=T, num_tokens=int(query.sum()), qsl=qsl, seq=seq, query=query,
            meta=meta, raw=raw, compress=compress, dev=dev, real_index=None if all_real else dev["real_index"],
            replayable=checkpointing or torch.is_grad_enabled(),
        )  # fmt: skip
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
            raise ValueError(f"attention_mask: only 2-D (batch, columns) padding masks are supported, got shape {tuple(mask.shape)}")
        if mask.shape[0] != B or mask.shape[1] not in (T, state.columns + T):
            raise ValueError(
                f"attention_mask: expected ({B}, {state.columns + T}) (past and new columns) or ({B}, {T}), "
                f"got {tuple(mask.shape)}"
            )
        parts.append(mask[:, -T:].to(torch.int64))
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[1] != T \
                or position_ids.shape[0] not in (1, B):  # fmt: skip
            raise ValueError(f"position_ids: expected ({B}, {T}) or (1, {T}), got {_shape(position_ids)}")
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


def _shape(x):
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


# ----------------------------------------------------------------------------- the attention layer


def _attention_forward(integ: _Integration, module, hidden_states, position_embeddings=None, position_ids=None,
                       attention_mask=None, past_key_values=None, **kwargs):  # fmt: skip
    ctx = getattr(position_ids, _CONTEXT_ATTR, None) or integ.current
    if ctx is None:
        raise RuntimeError(
            f"layer {module.layer_idx}: the sparse prefill attention runs only inside a DeepseekV4Model forward "
            "(its pre-hook plans the step)"
        )
    if tuple(hidden_states.shape[:2]) != (ctx.B, ctx.T):
        raise RuntimeError(f"hidden_states: shape {tuple(hidden_states.shape)} differs from the forward's ({ctx.B}, {ctx.T})")
    idx = module.layer_idx
    if idx in ctx.layer_inputs:  # a checkpoint recomputes this layer: replay it from its input state
        lstate = _copy_layer_state(ctx.layer_inputs[idx])
    elif idx in ctx.layers_done:
        raise RuntimeError(
            f"layer {idx}: called twice in one forward, and its input state was not kept (a reentrant "
            "torch.utils.checkpoint around it under no_grad?); use transformers' gradient checkpointing "
            "(model.activation_checkpointing_enable()) or use_reentrant=False"
        )
    else:
        lstate = ctx.state.layer(idx)
        if ctx.replayable:
            ctx.layer_inputs[idx] = _copy_layer_state(lstate)
        ctx.layers_done.add(idx)
    return _sparse_layer(integ, ctx, module, lstate, hidden_states, position_embeddings), None


def _copy_layer_state(ls: ragged.LayerState) -> ragged.LayerState:
    """A new LayerState holding the same tensors (in a replayable forward the layer code assigns
    new tensors and never edits these in place)."""
    return ragged.LayerState(ls.window, {n: dataclasses.replace(cs) for n, cs in ls.compressors.items()})


def _sparse_layer(integ: _Integration, ctx: _Context, module, lstate: ragged.LayerState, hidden_states,
                  position_embeddings):  # fmt: skip
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb as rope

    cfg = module.config
    if ctx.num_tokens == 0:  # only padding in this call
        return hidden_states.new_zeros((ctx.B, ctx.T, cfg.hidden_size))
    x = ctx.pack(hidden_states)  # (Tr, hidden): the real tokens, request-major
    cos, sin = (ctx.pack(t) for t in position_embeddings[module.rope_layer_type])  # (Tr, R/2)
    Tr, H, D = x.shape[0], module.num_heads, module.head_dim

    q_residual = module.q_a_norm(module.q_a_proj(x))
    q = rope(module.q_b_norm(module.q_b_proj(q_residual).view(Tr, H, D)), cos, sin)  # (Tr, H, D)
    kv = rope(module.kv_norm(module.kv_proj(x))[:, None], cos, sin)[:, 0]  # (Tr, D)

    fp8 = integ.kv_cache_dtype == "fp8_ds_mla"
    if fp8 and kv.requires_grad:
        raise ValueError(
            "kv_cache_dtype: the fp8_ds_mla caches hold bytes, so no gradient reaches the latents through "
            "them; run the model under torch.no_grad() / torch.inference_mode(), or train with kv_cache_dtype='auto'"
        )
    if fp8:
        raw = fp8_cache.raw_kv(lstate, kv, ctx.dev, int(np.minimum(ctx.state.seen, cfg.sliding_window - 1).sum()))
    else:
        stream = kv if lstate.window is None else torch.cat([lstate.window, kv])  # old windows, then new tokens
        raw = PagedKV(stream[ctx.dev["raw_src"]].view(-1, ragged.RAW_PAGE, D), ctx.dev["raw_table"])
        lstate.window = stream[ctx.dev["raw_keep"]]

    compressed = topk = None
    comp = module.compressor
    spec = integ.layers[module.layer_idx]
    ratio = spec.compress_ratio
    if spec.has_compressed:
        if comp is None or int(comp.compress_rate) != ratio:
            raise RuntimeError(f"layer {module.layer_idx}: a {spec.kind.name} layer of ratio {ratio} without that compressor")
        csa = spec.kind is LayerKind.CSA
        entries = _compress(comp, x, lstate, "compressor", ctx, ratio, overlapped=csa, fp8=fp8)
        if fp8:
            compressed = fp8_cache.entries_kv(entries, ctx.dev[f"{ratio}.table"])
        else:
            compressed = PagedKV(entries.view(-1, ragged.ENTRY_PAGE, entries.shape[1]), ctx.dev[f"{ratio}.table"])
        if csa:  # the indexer's output is an integer selection: no gradient, as in eager
            with torch.no_grad():
                index_entries = _compress(comp.indexer, x, lstate, "indexer", ctx, ratio, overlapped=True)
                topk = _indexer_topk(comp.indexer, x, q_residual, index_entries, ctx, integ.indexer_chunk_elems)

    sink = module.sinks
    if sink.dtype not in (torch.float32, torch.float64):  # a model cast to 16 bits: the kernel takes float32
        sink = sink.float()
    out = prefill_attention(
        q, ctx.meta[spec.kind], raw, compressed, sm_scale=module.scaling, attn_sink=sink,
        topk_indices=topk, backend=integ.backend, dropout_p=float(module.attention_dropout) if module.training else 0.0,
    )  # fmt: skip
    out = rope(out, cos, -sin)  # undo the values' RoPE at the query position, as transformers does
    y = module.o_b_proj(module.o_a_proj(out.reshape(Tr, cfg.o_groups, -1)).flatten(1))
    return ctx.unpack(y)


def _compress(cmod, x, lstate: ragged.LayerState, name: str, ctx: _Context, r: int, overlapped: bool, fp8=False):
    """Pool every request's newly completed blocks (transformers' compressor math, ragged) and
    append the entries to the request's region; returns the layer's entry rows."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        apply_rotary_pos_emb as rope,
    )

    plan = ctx.compress[r]
    dev = {k: ctx.dev[f"{r}.{k}"] for k in ("usable", "leftover", "prev", "overlap", "positions", "move_src",
                                            "move_dst", "append_dst")}  # fmt: skip
    cs = lstate.compressors.setdefault(name, ragged.CompressorState(r))
    kv, gate = cmod.kv_proj(x), cmod.gate_proj(x)  # (Tr, C), without the position bias
    stream_kv = kv if cs.buf_kv is None else torch.cat([cs.buf_kv, kv])
    stream_gate = gate if cs.buf_gate is None else torch.cat([cs.buf_gate, gate])
    cs.buf_kv, cs.buf_gate = stream_kv[dev["leftover"]], stream_gate[dev["leftover"]]
    n, C = plan.n_windows, kv.shape[1]
    new_entries = None
    if n:
        chunk_kv = stream_kv[dev["usable"]].view(n, r, C)
        chunk_gate = stream_gate[dev["usable"]].view(n, r, C) + cmod.position_bias
        if overlapped:  # entry w pools the Ca half of block w-1 and the Cb half of block w
            half = cmod.head_dim
            ca_kv, ca_gate = chunk_kv[..., :half], chunk_gate[..., :half]
            if cs.overlap_kv is None:
                cs.overlap_kv = ca_kv.new_zeros((ctx.B, r, half))
                cs.overlap_gate = ca_gate.new_zeros((ctx.B, r, half))
            prev_kv = torch.cat([ca_kv, cs.overlap_kv, ca_kv.new_zeros((1, r, half))])[dev["prev"]]
            prev_gate = torch.cat([ca_gate, cs.overlap_gate, ca_gate.new_full((1, r, half), float("-inf"))])[dev["prev"]]
            cs.overlap_kv = torch.cat([ca_kv, cs.overlap_kv])[dev["overlap"]]
            cs.overlap_gate = torch.cat([ca_gate, cs.overlap_gate])[dev["overlap"]]
            chunk_kv = torch.cat([prev_kv, chunk_kv[..., half:]], dim=1)  # (n, 2r, half)
            chunk_gate = torch.cat([prev_gate, chunk_gate[..., half:]], dim=1)
        weights = chunk_gate.softmax(dim=1, dtype=torch.float32).to(chunk_kv.dtype)
        pooled = cmod.kv_norm((chunk_kv * weights).sum(dim=1))  # (n, head_dim)
        cos, sin = cmod.rotary_emb(pooled, position_ids=dev["positions"][None], layer_type=cmod.rope_layer_type)
        new_entries = rope(pooled[None, None], cos, sin)[0, 0]
    if fp8:  # the entries as fp8_ds_mla pages
        return fp8_cache.store_entries(cs, plan, dev, new_entries, x.device, copy=ctx.replayable)
    if plan.relayout or cs.entries is None:
        grown = x.new_zeros((plan.layout.total_rows, cmod.head_dim))
        if cs.entries is not None and plan.move_src.size:
            grown[dev["move_dst"]] = cs.entries[dev["move_src"]]
        cs.entries = grown
    if n:
        if ctx.replayable:  # a new tensor: the one before is kept as a layer's input state
            cs.entries = cs.entries.index_put((dev["append_dst"],), new_entries)
        else:
            cs.entries[dev["append_dst"]] = new_entries
    return cs.entries


def _indexer_topk(ind, x, q_residual, entries, ctx: _Context, chunk_elems: int):
    """(Tr, index_topk) request-local top-k entry ids per token, -1 = none (transformers' indexer,
    each request against its own entries only)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        apply_rotary_pos_emb as rope,
    )

    Tr = x.shape[0]
    positions = ctx.dev["token_positions"]
    cos, sin = ind.rotary_emb(x, position_ids=positions[None], layer_type=ind.rope_layer_type)
    q = ind.q_b_proj(q_residual).view(1, Tr, -1, ind.head_dim).transpose(1, 2)
    q = rope(q, cos, sin).transpose(1, 2)  # (1, Tr, index_n_heads, index_head_dim)
    out = torch.full((Tr, ind.index_topk), -1, dtype=torch.int64, device=x.device)
    layout = ctx.compress[ind.compress_rate].layout
    for b in range(ctx.B):
        t0, t1, n = int(ctx.qsl[b]), int(ctx.qsl[b + 1]), int(layout.count[b])
        if t1 == t0 or n == 0:
            continue
        keys = entries[int(layout.start[b]) : int(layout.start[b]) + n][None]  # (1, n, index_head_dim)
        k = min(ind.index_topk, n)
        ids = torch.arange(n, device=x.device)
        step = max(1, chunk_elems // (ind.num_heads * n))
        for a in range(t0, t1, step):
            e = min(t1, a + step)
            scores = ind.scorer(q[:, a:e], keys, x[None, a:e])  # (1, e - a, n), float32
            visible = (positions[a:e] + 1) // ind.compress_rate
            scores = scores.masked_fill(ids[None, None, :] >= visible[None, :, None], float("-inf"))
            top = scores.topk(k, dim=-1).indices[0]
            out[a:e, :k] = torch.where(top >= visible[:, None], -1, top)
    return out
