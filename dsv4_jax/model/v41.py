"""DeepSeek-V4.1 in JAX, on the dsv4-prefill attention path: `DeepseekV41`, one ragged step at a time.

The math is transformers' `DeepseekV41ForCausalLM` (text backbone; docs/jax-model.md,
"DeepSeek-V4.1"); the attention core is the planner + `dsv4_jax.prefill.prefill_attention`, as
for V4. What differs from V4 (`dsv4_jax.model.model`):

* The layer schedule is the planner's `Schedule` (`V41Config.schedule`): ratios 0, 2, 1; only
  KV sources own a compressor and a compressed cache, which the compressed layers after them
  read; index sources score (Reindex: with their own weights against the KV source's index
  keys), the others reuse the last index source's top-k; the candidate source keeps candidate
  blocks that later index sources choose inside (`dsv4_jax.model.v41_attention`).
* Single-pass mHC: each site computes (pre, post, comb) from one projection of the streams; a
  site's `pre` collapses the streams for the *next* sublayer (the first attention collapses
  stream 0), and the last one for the head. No hyper head.
* MoE: top-k routing only (no hash layers), a router temperature, the routing weight applied
  before the down projection; Engram layers add gated n-gram table rows to the streams before
  their block (hash ids from `dsv4_jax.model.engram`, on the host, with the look-back kept per
  slot across chunks).
* Plans: one `planner.plan_step` per step over the schedule: one plan per (ratio, band), each
  built into device metadata once and shared by its layers. `replay`: False (default) computes
  every row with full windows, as transformers does; None / True is vLLM's decoder bounded
  replay: layers from the cut (the last KV source) on compute each request's last min(query_len,
  W) rows only (the cut still writes every row's window, compressed KV and index keys), where
  the schedule allows it and some request has more than W new rows.
* `fake_quant` (default True, transformers' forward): the window KV, compressed KV and indexer
  q / k pass through their FP8 / FP4 grids; False keeps them unquantized.

Per-request caches (`init_cache`): every layer a window ring (S, W-1, D); KV sources also
entries (S, cdiv(L, r), D), index_keys (S, cdiv(L, r), index_head_dim) and (ratio 2) the
projections of an unfinished pair. Steps, buckets, compiles and sharding are V4's (`mesh=`,
`axis=`: `dsv4_jax.model.parallel`); programs are shared by layers of one variant (ratio, source
roles, band, Engram).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dsv4_jax import backends
from dsv4_jax.model import parallel
from dsv4_jax.model.attention import StepInputs
from dsv4_jax.model.checkpoint import DTYPES
from dsv4_jax.model.engram import EngramHasher
from dsv4_jax.model.layers import EXPERT_MATMULS, linear, resolve_expert_matmul, rms_norm
from dsv4_jax.model.model import COMPILES, StepOutput, _embed
from dsv4_jax.model.v41_attention import attention_v41, init_cache_v41
from dsv4_jax.model.v41_blocks import engram_v41, hc_collapse, hc_expand, hc_mixes, moe_v41
from dsv4_jax.model.v41_checkpoint import load_checkpoint
from dsv4_jax.model.v41_config import V41Config
from dsv4_jax.prefill_metadata import QUERY_TILE, KindMetadata, _kind_table
from planner import POLICIES, PlanConfig, PrefillBatch, band_local_plan, plan_step
from planner.kvcache import KV_CACHE_DTYPES
from planner.sizes import bucket, pow2_bucket

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST

# ----------------------------------------------------------------------------- jitted pieces


class Variant(NamedTuple):
    """What makes two layers' programs differ (the layer id does not)."""

    compress_ratio: int
    is_kv_source: bool
    is_index_source: bool
    is_candidate_source: bool
    uses_candidates: bool
    engram: bool

    @property
    def name(self) -> str:
        mode = (
            "window"
            if not self.compress_ratio
            else "source"
            if self.is_kv_source
            else "reindex"
            if self.is_index_source
            else "reuse"
        )
        extra = ("+cand" if self.is_candidate_source else "") + ("+in-cand" if self.uses_candidates else "")
        return f"r{self.compress_ratio}.{mode}{extra}{'+engram' if self.engram else ''}"


def variant_of(role, cfg: V41Config) -> Variant:
    return Variant(
        role.compress_ratio,
        role.is_kv_source,
        role.is_index_source,
        role.is_candidate_source,
        role.uses_candidates,
        role.layer_id in cfg.engram_layer_ids,
    )


@functools.partial(jax.jit, static_argnames=("cfg", "variant", "n_entries", "opts"), donate_argnames=("cache",))
def _layer(p, cache, source, shared, X, pre, kv_rows, rows, keep, meta, hash_ids, *, cfg, variant, n_entries, opts):
    """One V4.1 decoder layer: (X (T, n, hidden), pre (T, n)) -> (X, pre) on its rows, cache, shared.

    keep: None, or (at the replay cut) the rows of X it computes: X, pre and `shared` are cut
    down to them (the layer still writes every row's window, compressed KV and index keys)."""
    COMPILES[f"v41.layer[{variant.name}{'' if keep is None else '.cut'}]"] += 1
    opts = dict(opts)
    mesh, axis = opts["mesh"], opts["axis"]
    expert_matmul = opts.pop("expert_matmul")
    p = parallel.gather_for_use(p, mesh)
    eps = cfg.rms_norm_eps
    if variant.engram:
        X = engram_v41(p["engram"], X, hash_ids, cfg)
    x_all = rms_norm(hc_collapse(X, pre), p["attn_norm"], eps)
    if keep is not None:
        X, pre = X[keep], pre[keep]
        shared = {k: v[keep] for k, v in shared.items()}
    attn_pre, attn_post, attn_comb = hc_mixes(p["attn_hc"], X, cfg)
    y, cache, _, shared = attention_v41(
        p["attn"], cache, source, shared, x_all, kv_rows, keep, rows, meta, cfg, variant, n_entries, opts
    )
    X = hc_expand(y, X, attn_post, attn_comb)
    ffn_pre, ffn_post, ffn_comb = hc_mixes(p["ffn_hc"], X, cfg)
    y = moe_v41(p["ffn"], rms_norm(hc_collapse(X, attn_pre), p["ffn_norm"], eps), cfg, mesh, axis, expert_matmul)
    X = hc_expand(y, X, ffn_post, ffn_comb)
    if mesh is not None:
        X, ffn_pre, cache, shared = jax.lax.with_sharding_constraint(
            (X, ffn_pre, cache, shared), NamedSharding(mesh, P())
        )
    return X, ffn_pre, cache, shared


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"))
def _head(p, X, pre, rows, *, cfg: V41Config, mesh):
    """Logits (R, vocab) float32 of token rows `rows`, and their greedy next tokens (R,)."""
    COMPILES["v41.head"] += 1
    p = parallel.gather_for_use(p, mesh)
    h = rms_norm(hc_collapse(X[rows], pre[rows]), p["norm"], cfg.rms_norm_eps)
    logits = linear(h, p["head"]).astype(F32)
    return logits, jnp.argmax(logits, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------- the model


@dataclass
class V41StepInputs:
    """Host-built arrays of one step (device arrays): the full rows, the replay rows (or None)."""

    full: StepInputs
    band: StepInputs | None
    keep: jax.Array | None
    head_rows: jax.Array
    metas: dict
    n_entries: dict
    hash_ids: jax.Array | None
    plan: object


class DeepseekV41:
    """A DeepSeek-V4.1 model with per-request caches, run one ragged step at a time.

    As `dsv4_jax.model.DeepseekV4` (same step API, buckets, backends, mesh), plus:
      replay: False (default: every row, full windows, as transformers computes), None (vLLM's
        default: bounded replay where the schedule allows it) or True (required; ValueError
        where the schedule does not allow it). See the module docstring.
      fake_quant: transformers' FP8 / FP4 fake quantization of the window KV, compressed KV and
        indexer q / k (default True); False computes them unquantized.
      tokenizer_file: the checkpoint's tokenizer.json, needed by Engram layers (their hashes).
      indexer_backend: the index sources' top-k, both levels (`dsv4_jax.indexer.indexer_topk`):
        "auto" or a backend of `dsv4_jax.backends.INDEXER`; "auto" is the fused C kernel on CPU
        arrays where it builds, else "xla", and "xla" with a mesh. `self.indexer_backend` names
        the one that runs.
      kv_cache_dtype: "auto" (the window and compressed caches in the model dtype) or
        "fp8_ds_mla": both as DeepSeek-V4.1's 528-byte mxfp8 records (vLLM 0.33.0's V4.1 pages,
        interleaved; `dsv4_jax.model.mxfp8_cache`), written by `dsv4_jax.kvcache_v41` and read in
        place by the prefill.
      expert_matmul: the routed experts' grouped matmul, "auto", "ragged_dot" or "dense_tiles"
        (`dsv4_jax.model.layers.EXPERT_MATMULS`; "auto": dense tiles on the CPU, ragged_dot
        elsewhere); `self.expert_matmul` names the one that runs.
    """

    def __init__(
        self,
        config: V41Config,
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
        replay: bool | None = False,
        fake_quant: bool = True,
        tokenizer_file=None,
        kv_cache_dtype: str = "auto",
        indexer_backend: str = "auto",
        expert_matmul: str = "auto",
    ):
        if not isinstance(config, V41Config):
            raise TypeError(f"config: expected a V41Config, got {type(config).__name__}")
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
                f"kv_cache_dtype: mxfp8 records hold 512-dim latents, config.head_dim is {config.head_dim}"
            )
        if kv_cache_dtype == "fp8_ds_mla" and backend == "mosaic_tpu":
            raise ValueError("backend: 'mosaic_tpu' does not read V4.1's mxfp8 pages: use kv_cache_dtype='auto'")
        backends.check_name(indexer_backend, backends.INDEXER, "indexer_backend")
        if expert_matmul not in EXPERT_MATMULS:
            raise ValueError(f"expert_matmul: expected one of {EXPERT_MATMULS}, got {expert_matmul!r}")
        if not isinstance(fake_quant, bool):
            raise ValueError(f"fake_quant: expected True or False, got {fake_quant!r}")
        config.schedule.resolve_replay(replay)  # ValueError: replay=True where vLLM would not replay
        if not isinstance(params, dict) or len(params.get("layers", ())) != config.num_hidden_layers:
            raise ValueError(
                f"params: expected the tree of dsv4_jax.model.v41_checkpoint.load_params for {config.num_hidden_layers} layers"
            )
        backends.check_name(backend, backends.ATTENTION)
        if backend == "mosaic_tpu" and config.schedule.resolve_replay(replay):
            raise ValueError(
                "backend: 'mosaic_tpu' tiles the step's full rows; with bounded replay (replay=None / True) the "
                "layers past the cut compute the kept rows only: use replay=False or another backend"
            )
        mesh, axis = parallel.resolve_mesh(mesh, axis)
        if mesh is not None:
            parallel.check_divisible(config, mesh, axis)
            if indexer_backend == "cpu":
                raise ValueError(
                    "indexer_backend: 'cpu' (an XLA FFI call) is not partitioned over a mesh: use 'auto' or 'xla'"
                )
        if dtype is None:
            dtype = params["embed"].dtype
        elif dtype in DTYPES:
            dtype = DTYPES[dtype]
        else:
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
        if token_buckets not in ("fine", "pow2"):
            raise ValueError(f"token_buckets: expected 'fine' or 'pow2', got {token_buckets!r}")
        self._placement = None if mesh is None else NamedSharding(mesh, P())
        self.mesh, self.axis = mesh, axis
        self.config = config
        self.schedule = config.schedule
        self.params = params if mesh is None else parallel.place(params, mesh, axis)
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.dtype = jnp.dtype(dtype)
        self.replay = replay
        self.fake_quant = fake_quant
        self.plan_config = PlanConfig(
            window_size=config.sliding_window,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            policy=policy,
            replay=replay,
        )
        self._min_requests = min(pow2_bucket(min_requests), pow2_bucket(max_batch_size))
        self._token_buckets = token_buckets
        self._min_tokens = min_tokens
        self._min_workspace_rows = min_workspace_rows
        self._token_tile, self._gather_tile = token_tile, gather_tile
        self.expert_matmul = resolve_expert_matmul(
            expert_matmul, jax.devices()[0].platform if mesh is None else mesh.devices.flat[0].platform
        )
        # The indexer backend, resolved once here and reported (V4's rule: "auto" is the fused C
        # kernel on CPU arrays where it builds, else "xla"; with a mesh "xla", the FFI call is
        # not partitioned).
        if mesh is not None:
            self.indexer_backend = "xla"
        else:
            self.indexer_backend = backends.resolve_indexer_backend(indexer_backend, jnp.zeros((1, 1, 1), F32))
        self._opts = (
            ("backend", backend),
            ("interpret", interpret),
            ("mesh", mesh),
            ("axis", axis),
            ("fake_quant", fake_quant),
            ("indexer_backend", self.indexer_backend),
            ("expert_matmul", self.expert_matmul),
        )
        self.kv_cache_dtype = kv_cache_dtype
        if kv_cache_dtype != "auto":  # static: the raw pages' block tables span max_model_len
            self._opts += (("kv_cache_dtype", kv_cache_dtype), ("max_model_len", max_model_len))
        self._variants = [variant_of(role, config) for role in self.schedule]
        self.engram = None
        if config.engram_layer_ids:
            self.engram = EngramHasher(config, tokenizer_file, max_batch_size, max_model_len)

    @classmethod
    def from_checkpoint(cls, path, dtype="float32", *, weights: str = "stored", **kwargs) -> DeepseekV41:
        """Load a V4.1 checkpoint directory (either format, `dsv4_jax.model.v41_checkpoint`) and
        build the model; its tokenizer.json serves the Engram layers."""
        config, params = load_checkpoint(
            path, dtype=dtype, weights=weights, mesh=kwargs.get("mesh"), axis=kwargs.get("axis")
        )
        kwargs.setdefault("tokenizer_file", Path(path) / "tokenizer.json")
        return cls(config, params, dtype=dtype, **kwargs)

    def init_cache(self) -> list[dict]:
        cache = init_cache_v41(self.config, self.max_batch_size, self.max_model_len, self.dtype, self.kv_cache_dtype)
        return cache if self._placement is None else jax.device_put(cache, self._placement)

    def _tokens_bucket(self, n: int) -> int:
        if self._token_buckets == "fine":
            return bucket(n, self._min_tokens)
        return pow2_bucket(n, self._min_tokens)

    def prepare_step(self, slots, prefix_lens, tokens, all_tokens: bool = False) -> V41StepInputs:
        """Host side of a step: plan it once (`planner.plan_step` over the schedule), build each
        plan's metadata once, pad and copy the step's arrays, hash the Engram n-grams."""
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
        plan = plan_step(batch, self.plan_config, self.schedule)  # once per step
        if all_tokens and plan.replay:
            raise ValueError(
                "all_tokens: bounded replay computes only each request's last rows past the cut; "
                "build the model with replay=False for every row's logits"
            )
        T, S, W = int(q_lens.sum()), self.max_batch_size, self.config.sliding_window
        T_pad, B_pad = self._tokens_bucket(T), pow2_bucket(B, self._min_requests)

        def pad(a, n, fill):
            out = np.full(n, fill, dtype=np.int32)
            out[: len(a)] = a
            return out

        def inputs(n_pad, ids_, positions, kept):
            starts = np.concatenate([[0], np.cumsum(kept)[:-1]])
            return StepInputs(
                token_ids=pad(ids_, n_pad, 0),
                positions=pad(positions, n_pad, 0),
                token_request=pad(np.repeat(np.arange(B), kept), n_pad, 0),
                token_valid=pad(np.ones(int(kept.sum())), n_pad, 0).astype(bool),
                slot=pad(slots, B_pad, S),
                prefix=pad(seq - kept, B_pad, 0),
                seq_len=pad(seq, B_pad, 0),
                token_start=pad(starts, B_pad, int(kept.sum())),
                index_entries=0,
            )

        full = inputs(T_pad, ids, batch.token_position, q_lens)
        band = keep = None
        last_rows_of = q_lens
        if plan.replay:
            rows_b = batch.band("replay", W)
            kept = rows_b.query_lens
            R_pad = self._tokens_bucket(int(kept.sum()))
            band = inputs(R_pad, ids[rows_b.token_index], rows_b.token_position, kept)
            keep = pad(rows_b.token_index, R_pad, 0)
            last_rows_of = kept
        if all_tokens:
            head_rows = np.arange(T_pad)
        else:
            head_rows = pad(np.cumsum(last_rows_of) - 1, B_pad, 0)
        metas = {}
        for key, kp in plan.plans.items():
            # A "cut" / "replay" plan runs on its band's rows only (q, top-k: each request's kept
            # rows, packed in the step's order): `planner.band_local_plan`, as
            # `dsv4_jax.build_step_metadata` builds a V4.1 step's metadata.
            kp = band_local_plan(kp)
            n_pad = T_pad if key.band == "full" else band.token_ids.shape[0]
            rows = max(self._min_workspace_rows, pow2_bucket(kp.max_workspace_rows))
            shape, table = _kind_table(
                kp,
                n_pad,
                self.config.index_topk,
                "bucket",
                self._token_tile,
                self._gather_tile,
                rows,
                QUERY_TILE,
            )
            metas[key] = (shape, table, kp)
        tables = jax.device_put([t for _, t, _ in metas.values()], self._placement)
        metas = {
            key: KindMetadata(
                table, shape, kp, kp.token_index.shape[0], B, allow_invalid=True, step_tokens=batch.num_tokens
            )
            for (key, (shape, _, kp)), table in zip(metas.items(), tables)
        }
        max_seq = int(seq.max())
        n_entries = {
            r: min(pow2_bucket(max_seq // r, 128), -(-self.max_model_len // r))
            for r in set(self.config.compress_ratios)
            if r
        }
        hash_ids = None
        if self.engram is not None:
            h = self.engram.hash_ids(slots, prefix, tokens)
            hash_ids = np.zeros((T_pad,) + h.shape[1:], np.int32)
            hash_ids[:T] = h
        arrays = (full, band, keep, head_rows.astype(np.int32), hash_ids)
        full, band, keep, head_rows, hash_ids = jax.device_put(arrays, self._placement)
        return V41StepInputs(full, band, keep, head_rows, metas, n_entries, hash_ids, plan)

    def step(self, cache: list[dict], slots, prefix_lens, tokens, all_tokens: bool = False, timings=None):
        """Run one ragged step; returns (new cache, StepOutput). The old cache may be donated.

        timings: None, or a list that gets one (layer id, variant name, band, seconds) per layer,
        each layer waited for (for benchmarks: it serializes the dispatch)."""
        s = self.prepare_step(slots, prefix_lens, tokens, all_tokens)
        cfg = self.config
        X = _embed(self.params["embed"], s.full.token_ids, cfg=cfg, dtype=self.dtype, mesh=self.mesh, axis=self.axis)
        pre = jax.device_put(np.eye(1, cfg.hc_mult, dtype=np.float32).repeat(X.shape[0], 0), self._placement)
        cache = list(cache)
        shared: dict = {}
        replay = s.plan.replay
        for i, role in enumerate(self.schedule):
            band = role.band(replay)
            key = s.plan.layer_keys[i]
            if band == "full":
                kv_rows, rows, keep = s.full, s.full, None
            elif band == "cut":
                kv_rows, rows, keep = s.full, s.band, s.keep
            else:
                kv_rows, rows, keep = s.band, s.band, None
            source = None
            if role.has_compressed and not role.is_kv_source:
                source = cache[role.kv_source_layer_id]
            k = cfg.engram_layer_ids.index(i) if i in cfg.engram_layer_ids else None
            t0 = None if timings is None else time.perf_counter()
            X, pre, cache[i], shared = _layer(
                self.params["layers"][i],
                cache[i],
                source,
                shared,
                X,
                pre,
                kv_rows,
                rows,
                keep,
                s.metas[key],
                None if k is None else s.hash_ids[:, k],
                cfg=cfg,
                variant=self._variants[i],
                n_entries=s.n_entries.get(role.compress_ratio, 0),
                opts=self._opts,
            )
            if timings is not None:
                jax.block_until_ready((X, cache[i]))
                timings.append((i, self._variants[i].name, band, time.perf_counter() - t0))
        head = {k: self.params[k] for k in ("norm", "head")}
        logits, next_tokens = _head(head, X, pre, s.head_rows, cfg=cfg, mesh=self.mesh)
        q_lens = [len(t) for t in tokens]
        return cache, StepOutput(logits, next_tokens, all_tokens, q_lens, s.plan)


def is_v41_checkpoint(path) -> bool:
    """Whether a checkpoint directory's config.json is DeepSeek-V4.1's."""
    import json

    from planner.contract import is_v41_config

    p = Path(path) / "config.json"
    return p.is_file() and is_v41_config(json.loads(p.read_text()))


__all__ = ["DeepseekV41", "Variant", "is_v41_checkpoint"]
