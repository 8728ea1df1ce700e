"""DeepSeek-V4 in JAX, on the dsv4-prefill attention path: `DeepseekV4`, one ragged step at a time.

The math is transformers' `DeepseekV4ForCausalLM` (docs/transformers-dsv4.md, section numbers
below refer to it); the attention core is the planner + `dsv4_jax.prefill.prefill_attention`
(which calls `dsv4_jax.sparse_attention`'s backends, or runs the C kernel, "cpu").

Batches are ragged: one call (a *step*) takes any number of requests, each with its own cache
slot, context length (`prefix`) and new tokens (`query_len` >= 1). The new tokens of all
requests are flattened request-major into one token axis; a one-call prefill, a chunk of a
chunked prefill and a decode step (query_len 1) are the same computation. Nothing pads a
request: per-token work is per token, and every per-request state lives in its own slot.

Per-request caches (`init_cache`), one dict per layer, slot-major (`S` = max_batch_size):
  window      (S, W-1, D)   ring of the last W-1 raw latents: position q at row q % (W-1)
  entries     (S, cdiv(max_model_len, r), D)            CSA/HCA: compressed entries, by id
  ring_kv, ring_gate (S, 2r or r, C)                    CSA/HCA: the compressor's projected kv
                gate of the last 2r (CSA: the ratio-4 overlap needs the previous block) or r
                (HCA) positions, ring-indexed like the window. Unfinished blocks wait here.
  index_entries, index_ring_kv, index_ring_gate         CSA: the same for the indexer (width 128)
Rows a request has not written are never read, so a slot needs no reset between requests.

A step (`DeepseekV4.step`) plans attention once on the host (`planner.plan_step`, one plan per
layer kind, turned into device metadata by `dsv4_jax.prefill.build_step_metadata`), then runs
one jitted function per layer: compiled once per (layer kind, bucketed shapes) and shared by
every layer of that kind (hash and top-k MoE routing share it: the choice is a traced flag),
plus the jitted embedding and head. Buckets: tokens by `planner.sizes.bucket` (or powers of
two), requests, workspace rows and indexer entries by powers of two; `compile_counts()` says
how many traces each function took.

Precision follows transformers' float32 islands: RMSNorm statistics, mHC, RoPE, gate softmaxes,
router scores and indexer scores run in float32 whatever the model dtype.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dsv4_jax import backends
from dsv4_jax.model import parallel
from dsv4_jax.model.attention import StepInputs, attention, init_cache
from dsv4_jax.model.checkpoint import DTYPES, load_checkpoint
from dsv4_jax.model.config import ModelConfig
from dsv4_jax.model.layers import (
    embed_lookup,
    hyper_head,
    hyper_post,
    hyper_pre,
    linear,
    moe,
    resolve_expert_matmul,
    rms_norm,
)
from dsv4_jax.prefill import build_step_metadata
from planner import (
    POLICIES,
    LayerKind,
    PlanConfig,
    PrefillBatch,
    StepPlan,
    plan_step,
)
from planner.kvcache import KV_CACHE_DTYPES
from planner.sizes import pow2_bucket

F32 = jnp.float32
COMPILES: Counter = Counter()  # traces (= compilations) of each jitted function, by name

# ----------------------------------------------------------------------------- jitted pieces


@functools.partial(jax.jit, static_argnames=("cfg", "kind", "opts"), donate_argnames=("cache",))
def _layer(p, cache, X, step, meta, hash_experts, use_hash, *, cfg: ModelConfig, kind: LayerKind, opts):
    """One decoder layer (section 4): X (T, n, hidden) -> X, cache."""
    COMPILES[f"layer[{kind.name}]"] += 1
    opts = dict(opts)
    mesh, axis = opts["mesh"], opts["axis"]
    expert_matmul = opts.pop("expert_matmul")
    p = parallel.gather_for_use(p, mesh)  # storage-split weights whole (FSDP-style); TP/EP ones stay split
    post, comb, x = hyper_pre(p["attn_hc"], X, cfg)
    y, cache = attention(p["attn"], cache, rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), step, meta, cfg, kind, opts)
    X = hyper_post(X, y, post, comb)
    post, comb, x = hyper_pre(p["ffn_hc"], X, cfg)
    y = moe(
        p["ffn"], rms_norm(x, p["ffn_norm"], cfg.rms_norm_eps), hash_experts, use_hash, cfg, mesh, axis, expert_matmul
    )
    X = hyper_post(X, y, post, comb)
    if mesh is not None:  # the residual stream and the caches stay replicated between programs
        X, cache = jax.lax.with_sharding_constraint((X, cache), NamedSharding(mesh, P()))
    return X, cache


@functools.partial(jax.jit, static_argnames=("mesh",))
def _hash_route(tid2eid, token_ids, *, mesh):
    routes = parallel.gather_for_use({"ffn": {"tid2eid": tid2eid}}, mesh)["ffn"]["tid2eid"][token_ids]
    return routes if mesh is None else jax.lax.with_sharding_constraint(routes, NamedSharding(mesh, P()))


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "mesh", "axis"))
def _embed(embed, token_ids, *, cfg: ModelConfig, dtype, mesh, axis):
    COMPILES["embed"] += 1
    x = embed_lookup(embed, token_ids, dtype, mesh, axis)
    return jnp.broadcast_to(x[:, None, :], (x.shape[0], cfg.hc_mult, x.shape[1]))


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"))
def _head(p, X, rows, *, cfg: ModelConfig, mesh):
    """Logits (R, vocab) float32 of token rows `rows`, and their greedy next tokens (R,)."""
    COMPILES["head"] += 1
    p = parallel.gather_for_use(p, mesh)
    h = rms_norm(hyper_head(p["hc_head"], X[rows], cfg), p["norm"], cfg.rms_norm_eps)
    logits = linear(h, p["head"]).astype(F32)
    return logits, jnp.argmax(logits, axis=-1).astype(jnp.int32)


def compile_counts() -> dict[str, int]:
    """Traces (each one a compilation) of the model's jitted functions so far, by name."""
    return dict(COMPILES)


# ----------------------------------------------------------------------------- the model


@dataclass
class StepOutput:
    """What one step returns. logits: (R, vocab) float32 device array, rows = `rows` of the
    step (all tokens, request-major, or each request's last token); next_tokens: (R,) argmax.
    query_lens: the real tokens of each request. plan: the host `planner.StepPlan`."""

    logits: jax.Array
    next_tokens: jax.Array
    all_tokens: bool
    query_lens: list[int]
    plan: object

    def request_logits(self) -> list[np.ndarray]:
        """Per request: (query_len, vocab) if all_tokens else (vocab,), as NumPy."""
        logits = np.asarray(self.logits)
        if not self.all_tokens:
            return [logits[b] for b in range(len(self.query_lens))]
        starts = np.concatenate([[0], np.cumsum(self.query_lens)])
        return [logits[a:b] for a, b in zip(starts[:-1], starts[1:])]


class DeepseekV4:
    """A DeepSeek-V4 model with per-request caches, run one ragged step at a time.

    Args:
      config: `ModelConfig`. params: the tree of `dsv4_jax.model.checkpoint.load_params` (plain or
        quantized weights; placed per `dsv4_jax.model.parallel` if a mesh is given and they are not).
      dtype: the compute dtype ("float32", "bfloat16", "float16"; default: the embedding's dtype).
      max_batch_size: cache slots (requests in flight). max_model_len: tokens per request.
      max_num_batched_tokens: most new tokens of one request in one step (planner limit).
      backend: "auto" or a backend of `dsv4_jax.backends.ATTENTION` (see `dsv4_jax.sparse_attention`;
        "auto" on the CPU is "cpu" for bf16 / float32 where the C kernel builds).
      interpret: run a Pallas backend in its interpreter (tests; `dsv4_jax.sparse_attention`).
      policy: "adaptive", "fixed" or "per_request" (`planner.PlanConfig.policy`).
      mesh, axis: optional; split the model over mesh axis `axis` (default the mesh's first):
        attention heads and the dense MLP tensor-parallel, routed experts expert-parallel,
        embedding and head on the vocabulary (`dsv4_jax.model.parallel`); other axes replicate.
      min_tokens, min_workspace_rows, min_requests: the smallest token / workspace / request
        buckets (fewer compiles; requests are padded to a power of two, at most max_batch_size's).
      token_buckets: "fine" (`planner.sizes.bucket`: pads tokens at most 1.25x) or "pow2" (at
        most 2x, but about 4x fewer token shapes, so fewer compilations for varied batches).
      token_tile, gather_tile: the largest attention / gather tiles of `build_step_metadata`
        (smaller ladders compile faster; the defaults suit long prefills).
      kv_cache_dtype: "auto" (the caches in the model's dtype) or "fp8_ds_mla" (the window and
        compressed caches as vLLM's DeepSeek-V4 pages, `dsv4_jax.model.fp8_cache`).
      indexer_backend: the CSA layers' Lightning Indexer, "auto" or a backend of
        `dsv4_jax.backends.INDEXER` (`dsv4_jax.indexer`; "auto" on the CPU is the fused C kernel
        where it builds; with a mesh, "xla").
      expert_matmul: the routed experts' grouped matmul, "auto", "ragged_dot" or "dense_tiles"
        (`dsv4_jax.model.layers.EXPERT_MATMULS`; "auto": dense tiles on the CPU, where XLA's
        ragged_dot is slow, ragged_dot elsewhere); `self.expert_matmul` names the one that runs.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: dict,
        *,
        max_batch_size: int = 8,
        max_model_len: int = 4096,
        max_num_batched_tokens: int = 512,
        backend: str = "auto",
        interpret=False,
        policy: str = "adaptive",
        mesh: Mesh | None = None,
        axis: str | None = None,
        dtype=None,
        min_tokens: int = 16,
        min_workspace_rows: int = 128,
        token_tile: int = 256,
        gather_tile: int = 4096,
        min_requests: int = 8,
        token_buckets: str = "fine",
        kv_cache_dtype: str = "auto",
        indexer_backend: str = "auto",
        expert_matmul: str = "auto",
    ):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
        for name, v in (
            ("max_batch_size", max_batch_size),
            ("max_model_len", max_model_len),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        if kv_cache_dtype == "fp8_ds_mla" and config.head_dim != 512:
            raise ValueError(
                f"kv_cache_dtype: fp8_ds_mla pages hold 512-dim latents, config.head_dim is {config.head_dim}"
            )
        if not isinstance(params, dict) or len(params.get("layers", ())) != config.num_hidden_layers:
            raise ValueError(
                f"params: expected the tree of dsv4_jax.model.checkpoint.load_params for {config.num_hidden_layers} layers"
            )
        backends.check_name(backend, backends.ATTENTION)
        backends.check_name(indexer_backend, backends.INDEXER, "indexer_backend")
        mesh, axis = parallel.resolve_mesh(mesh, axis)
        if mesh is not None:
            parallel.check_divisible(config, mesh, axis)
        if dtype is None:
            dtype = params["embed"].dtype
        elif dtype in DTYPES:
            dtype = DTYPES[dtype]
        else:
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
        # With a mesh every input lives replicated on it, so each layer program sees one input
        # sharding (else outputs of one call, placed by XLA, would retrace the next).
        self._placement = None if mesh is None else NamedSharding(mesh, P())
        self.mesh, self.axis = mesh, axis
        self.config = config
        self.params = params if mesh is None else parallel.place(params, mesh, axis)
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.dtype = jnp.dtype(dtype)
        self.plan_config = PlanConfig(
            window_size=config.sliding_window,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            policy=policy,
        )
        self._min_requests = min(pow2_bucket(min_requests), pow2_bucket(max_batch_size))
        if token_buckets not in ("fine", "pow2"):
            raise ValueError(f"token_buckets: expected 'fine' or 'pow2', got {token_buckets!r}")
        self._token_buckets = token_buckets
        self._min_tokens = min_tokens
        self._min_workspace_rows = min_workspace_rows
        self._bucket_options = dict(token_tile=token_tile, gather_tile=gather_tile)
        self.kv_cache_dtype = kv_cache_dtype
        self.expert_matmul = resolve_expert_matmul(
            expert_matmul, None if mesh is None else mesh.devices.flat[0].platform
        )
        self._opts = (
            ("backend", backend),
            ("interpret", interpret),
            ("mesh", mesh),
            ("axis", axis),
            ("expert_matmul", self.expert_matmul),
        )
        if indexer_backend != "auto" or mesh is not None:  # (the FFI call is not partitioned: xla on a mesh)
            self._opts += (("indexer_backend", "xla" if indexer_backend == "auto" else indexer_backend),)
        if kv_cache_dtype != "auto":  # static: the fp8 raw pages' block tables span max_model_len
            self._opts += (("kv_cache_dtype", kv_cache_dtype), ("max_model_len", max_model_len))
        # Hash layers keep their tid2eid table out of the layer parameters (a zero bias stands
        # in), so hash and top-k layers of a kind have one parameter structure and one program.
        self._layer_params, self._hash_tables = [], []
        bias_dtype = next((lp["ffn"]["bias"].dtype for lp in self.params["layers"] if "bias" in lp["ffn"]), F32)
        for lp in self.params["layers"]:
            ffn = dict(lp["ffn"])
            table = ffn.pop("tid2eid", None)
            if "bias" not in ffn:  # placed like a loaded bias, so both layer kinds share one program
                where = parallel.sharding(mesh, axis, "ffn.bias", (config.n_routed_experts,))
                ffn["bias"] = jax.device_put(jnp.zeros((config.n_routed_experts,), bias_dtype), where)
            self._layer_params.append({**lp, "ffn": ffn})
            self._hash_tables.append(table)

    @classmethod
    def from_checkpoint(cls, path, dtype="float32", *, weights: str = "stored", **kwargs) -> DeepseekV4:
        """Load `path` (`dsv4_jax.model.checkpoint.load_checkpoint`: weights "stored" keeps FP8 /
        FP4 as shipped, "dequantized" puts every linear weight in `dtype`) straight onto the
        devices of `mesh=` (if given), then build the model; `dtype` is the compute dtype."""
        config, params = load_checkpoint(
            path, dtype=dtype, weights=weights, mesh=kwargs.get("mesh"), axis=kwargs.get("axis")
        )
        return cls(config, params, dtype=dtype, **kwargs)

    def init_cache(self) -> list[dict]:
        cache = init_cache(self.config, self.max_batch_size, self.max_model_len, self.dtype, self.kv_cache_dtype)
        return cache if self._placement is None else jax.device_put(cache, self._placement)

    def prepare_step(
        self,
        slots: Sequence[int],
        prefix_lens: Sequence[int],
        tokens: Sequence[Sequence[int]],
        all_tokens: bool = False,
    ):
        """Host side of a step: plan attention, pad and copy the step's arrays.

        slots[b], prefix_lens[b]: request b's cache slot and tokens already in it; tokens[b]: its
        new tokens (>= 1). Returns (StepInputs, logit rows (R,) int32 = the token rows whose logits
        the head computes, {LayerKind: KindMetadata}, the step's `planner.StepPlan`). The rows are kept out of
        StepInputs: their count (all tokens or one per request) is no business of the layers.
        """
        B = len(slots)
        if B == 0 or len(prefix_lens) != B or len(tokens) != B:
            raise ValueError(
                f"slots, prefix_lens, tokens: need the same non-zero length, got {B}, {len(prefix_lens)}, {len(tokens)}"
            )
        slots = [int(s) for s in slots]
        if len(set(slots)) != B or min(slots) < 0 or max(slots) >= self.max_batch_size:
            raise ValueError(f"slots: need distinct slots in 0..{self.max_batch_size - 1}, got {slots}")
        q_lens = np.array([len(t) for t in tokens], dtype=np.int64)
        if q_lens.min() < 1:
            raise ValueError(f"tokens: every request needs >= 1 new token, got lengths {q_lens.tolist()}")
        prefix = np.array([int(p) for p in prefix_lens], dtype=np.int64)
        if prefix.min() < 0:
            raise ValueError(f"prefix_lens: must be >= 0, got {prefix.tolist()}")
        seq = prefix + q_lens
        ids = np.concatenate([np.asarray(t, dtype=np.int64).reshape(-1) for t in tokens])
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(
                f"tokens: ids must be in 0..{self.config.vocab_size - 1}, got {int(ids.min())}..{int(ids.max())}"
            )
        batch = PrefillBatch(seq, q_lens, self.max_model_len, self.plan_config.max_num_batched_tokens)
        plan = plan_step(batch, self.plan_config, self.config.layers)  # once per step
        # Per kind, the workspace is padded to a power of two: its size is a compile key but costs
        # only its allocation (gathers and attention cover the real rows), so coarse buckets are
        # cheap here, unlike the token buckets, which pad compute.
        meta = {}
        min_tokens = (
            self._min_tokens if self._token_buckets == "fine" else pow2_bucket(batch.num_tokens, self._min_tokens)
        )
        for key, kp in plan.plans.items():
            kind = key.kind
            rows = max(self._min_workspace_rows, pow2_bucket(kp.max_workspace_rows))
            one = StepPlan(batch=batch, config=self.plan_config, plans={key: kp})
            m = build_step_metadata(
                one,
                index_topk=self.config.index_topk,
                device=self._placement,
                min_workspace_rows=rows,
                min_tokens=min_tokens,
                **self._bucket_options,
            )
            meta[kind] = m[kind]
        T, T_pad, B_pad = int(q_lens.sum()), m.padded_tokens, pow2_bucket(B, self._min_requests)
        S = self.max_batch_size

        def pad(a, n, fill):
            out = np.full(n, fill, dtype=np.int32)
            out[: len(a)] = a
            return out

        token_request = np.repeat(np.arange(B), q_lens)
        positions = batch.token_position
        starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
        if all_tokens:
            rows = np.arange(T_pad)
        else:
            rows = pad(starts + q_lens - 1, B_pad, 0)
        r_csa = self.config.compress_rate_csa  # the indexer scores CSA's compressed entries
        max_entries = int(seq.max()) // r_csa
        index_entries = min(pow2_bucket(max_entries, 128), -(-self.max_model_len // r_csa))
        step = StepInputs(
            token_ids=pad(ids, T_pad, 0),
            positions=pad(positions, T_pad, 0),
            token_request=pad(token_request, T_pad, 0),
            token_valid=pad(np.ones(T), T_pad, 0).astype(bool),
            slot=pad(slots, B_pad, S),
            prefix=pad(prefix, B_pad, 0),
            seq_len=pad(seq, B_pad, 0),
            token_start=pad(starts, B_pad, T),
            index_entries=index_entries,
        )
        step, rows = jax.device_put((step, rows.astype(np.int32)), self._placement)
        return step, rows, meta, plan

    def step(self, cache: list[dict], slots, prefix_lens, tokens, all_tokens: bool = False):
        """Run one ragged step; returns (new cache, StepOutput). The old cache may be donated."""
        step, rows, meta, plan = self.prepare_step(slots, prefix_lens, tokens, all_tokens)
        cfg = self.config
        X = _embed(self.params["embed"], step.token_ids, cfg=cfg, dtype=self.dtype, mesh=self.mesh, axis=self.axis)
        cache = list(cache)
        no_route = jax.device_put(np.zeros((X.shape[0], cfg.num_experts_per_tok), np.int32), self._placement)
        flags = [jax.device_put(np.bool_(t is not None), self._placement) for t in self._hash_tables]
        for i, (kind, lp) in enumerate(zip(cfg.kinds, self._layer_params)):
            table = self._hash_tables[i]
            route = no_route if table is None else _hash_route(table, step.token_ids, mesh=self.mesh)
            X, cache[i] = _layer(
                lp, cache[i], X, step, meta[kind], route, flags[i], cfg=cfg, kind=kind, opts=self._opts
            )
        head = {k: self.params[k] for k in ("hc_head", "norm", "head")}
        logits, next_tokens = _head(head, X, rows, cfg=cfg, mesh=self.mesh)
        q_lens = [len(t) for t in tokens]
        return cache, StepOutput(logits, next_tokens, all_tokens, q_lens, plan)
