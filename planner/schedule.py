"""DeepSeek-V4.1's layer schedule: which layer owns, reads and reindexes which compressed cache.

V4.1 layers differ by their compress ratio (`compress_ratios[i]`: 0 window only, 2 pooled pairs,
1 unpooled) and by their role in the shared caches:

* a **KV source** (`kv_source_layer_ids`) owns a compressor and writes the compressed cache (and,
  with its indexer, the index keys) that every later compressed layer reads until the next source;
* an **index source** (`index_source_layer_ids`) runs its own indexer and publishes the top-k the
  layers after it reuse; one that is not a KV source is a "Reindex" layer (its own `wq_b` and
  `weights_proj` against the preceding KV source's index keys);
* any other compressed layer is a "Reuse" layer: it reads its KV source's cache with its index
  source's top-k;
* the **candidate source** (`candidate_source_layer_id`, None: the last KV source, negative: off)
  keeps the top `candidate_topk_blocks` blocks of `candidate_block_size` entries per query, and
  every later index source (a candidate consumer) takes its top-k inside them.

A layer's KV source is the last KV source at or before it, its index source the last index
source at or before it (None for ratio 0), as vLLM 0.32's `DeepseekV4Attention.__init__`
(`vllm/models/deepseek_v41/attention.py`) and transformers' `DeepseekV41Attention` resolve them.

`Schedule.from_config` reads a config.json dict: transformers' `DeepseekV41TextConfig` fields
flat, or the official release's composite (`model_type` "deepseek_v41", the text fields under
`text_config`, vLLM's `DeepseekV41Config` flattens it; its `n_mtp_layers` counts the DSpark draft
layers where transformers says `num_nextn_predict_layers`). Missing fields take transformers'
defaults (`configuration_deepseek_v41.py`: the released schedule for 40 layers, a scaled one
otherwise; KV sources: the first layer of each run of one ratio > 0; index sources: the KV
sources; candidate source: the last KV source). vLLM reads the fields as given, with other
defaults where one is absent (`getattr(config, "candidate_source_layer_id", -1)`: off; no KV or
index sources: it refuses every compressed layer), so the two agree on configs that spell the
schedule out, as the released one does. Every rule below raises ValueError naming the field and
the bad value:

* transformers': `compress_ratios` has `num_hidden_layers` entries, plus at most
  `num_nextn_predict_layers` draft entries (0 here: the draft layers are window only); KV sources
  lie in [0, num_hidden_layers) with ratio > 0; index sources have ratio > 0 and a KV source at or
  before them; a non-negative candidate source is an index source; every ratio > 0 layer has a KV
  source at or before it;
* vLLM's: ratios are 0, 1 or 2 (`DeepseekV4Attention.__init__` raises otherwise); every KV source
  is an index source (its indexer owns the index keys: a Reindex layer whose KV source has none
  finds no `{source}.indexer.k_cache`, NotImplementedError there; transformers assumes it);
* this module's: index sources and Engram layers lie in [0, num_hidden_layers); a compressed
  layer's ratio equals its KV source's (it reads that cache, whose entries pool the source's
  ratio; neither implementation checks it); `index_topk`, `sliding_window`,
  `candidate_topk_blocks`, `candidate_block_size` are >= 1.

Decoder bounded replay (vLLM's `swa_bounded_replay`, on by default), read from vLLM 0.32:
* `DeepseekV4Model.__init__` (`models/deepseek_v41/nvidia/model.py`): the cut is
  `max(kv_source_layer_ids)`; replay runs only if a layer follows the cut (`cut < end_layer - 1`),
  no Engram layer sits at or after the cut (`_decoder_replay_supported`), and it asserts
  `compress_ratios[cut] <= 1`. `replay_off_reason` says which of these fails.
* The cut layer computes its attention (and indexer top-k, output projection, MoE) on the kept
  rows only: `DecoderReplayLayers.__call__` (`models/deepseek_v41/decoder_replay_layers.py`) first
  calls the cut layer's `write_kv` -> `DeepseekV4Attention.forward_kv` (`attention.py`), which
  writes the window KV, compressed KV and index keys of every row and skips `wq_b`, the top-k and
  attention; then `_run_replay_layers` runs layers cut .. last on the replay batch.
* The kept rows are each request's last min(query_len, sliding_window) rows
  (`DeepseekV41ModelState._prepare_replay_batch`, `models/deepseek_v41/nvidia/model_state.py`; a
  request with prompt logprobs keeps all, which this planner does not model). Layers past the cut
  hold window KV of the kept rows only: `_gather_replay_batch_kernel` sets a trimmed request's
  window floor to `max(replay_start, seq_len - window)`; the cut layer's windows keep the batch's
  `replay_start` (`attn_metadata[first_swa_prefix]`), since it wrote every row's window KV.
  `contract.BANDS` names the three row sets ("full", "cut", "replay").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.checks import as_int
from planner.contract import LayerKind, LayerSpec, PlanKey, preset

V41_RATIOS = (0, 1, 2)
MODES = ("window", "source", "reindex", "reuse")  # `LayerRole.mode`

# transformers' defaults (DeepseekV41TextConfig): the released 40-layer schedule.
RELEASED_COMPRESS_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
RELEASED_KV_SOURCES = (2, 8, 14, 20)
RELEASED_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)
DEFAULTS = dict(
    num_hidden_layers=40,
    num_nextn_predict_layers=3,
    sliding_window=128,
    index_topk=512,
    candidate_topk_blocks=2048,
    candidate_block_size=8,
)


def text_config(config: dict) -> dict:
    """The flat text fields of a V4.1 config.json dict (a copy).

    The official composite keeps them under `text_config`: they are read as vLLM's
    `DeepseekV41Config` reads them (the text fields, then the top-level ones over them). The
    official `n_mtp_layers` stands for `num_nextn_predict_layers` when that is absent.
    """
    if not isinstance(config, dict):
        raise TypeError(f"config: expected a config.json dict, got {type(config).__name__}")
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise TypeError(f"config.text_config: expected a dict, got {type(text).__name__}")
    flat = dict(text or {})
    flat.update((k, v) for k, v in config.items() if k not in ("text_config", "vision_config", "model_type"))
    flat.setdefault("model_type", "deepseek_v41_text")
    if flat.get("num_nextn_predict_layers") is None and flat.get("n_mtp_layers") is not None:
        flat["num_nextn_predict_layers"] = flat["n_mtp_layers"]
    return flat


@dataclass(frozen=True)
class LayerRole:
    """One decoder layer's place in the schedule.

    kv_source_layer_id / index_source_layer_id: the last KV / index source at or before the layer
      (None for ratio 0): whose compressed cache it reads, whose top-k it uses.
    is_candidate_source: it keeps the candidate blocks (level 1 of the two-level top-k).
    uses_candidates: an index source after the candidate source: its top-k is taken inside them.
    is_cut: the last KV source (the replay cut); past_cut: after it.
    """

    layer_id: int
    compress_ratio: int
    kv_source_layer_id: int | None
    index_source_layer_id: int | None
    is_kv_source: bool
    is_index_source: bool
    is_candidate_source: bool
    uses_candidates: bool
    is_cut: bool
    past_cut: bool

    @property
    def has_compressed(self) -> bool:
        """Whether the layer reads a compressed cache (ratio 0: window only)."""
        return self.compress_ratio != 0

    @property
    def mode(self) -> str:
        """ "window" (ratio 0), "source" (KV source), "reindex" (index source only) or "reuse"."""
        if not self.has_compressed:
            return "window"
        if self.is_kv_source:
            return "source"
        return "reindex" if self.is_index_source else "reuse"

    @property
    def spec(self) -> LayerSpec:
        """The kind and ratio a plan serves: every compressed V4.1 layer takes a top-k (CSA)."""
        return LayerSpec(LayerKind.CSA, self.compress_ratio) if self.has_compressed else LayerSpec(LayerKind.SWA, 0)

    def band(self, replay: bool) -> str:
        """The rows this layer computes: "cut" / "replay" at / past the cut under replay, else "full"."""
        if not replay:
            return "full"
        return "cut" if self.is_cut else "replay" if self.past_cut else "full"


def _ids(value, name: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name}: expected a list of layer ids, got {value!r}")
    return tuple(as_int(v, f"{name}[{i}]") for i, v in enumerate(value))


@dataclass(frozen=True)
class Schedule:
    """A validated DeepSeek-V4.1 layer schedule (the decoder layers; no DSpark draft layers).

    Fields are the config's, as tuples; `layers` holds every layer's `LayerRole`, `cut` the last
    KV source (None without one), `replay_off_reason` why vLLM would not replay (None: it does).
    Build it with `Schedule.from_config(config_json)` (defaults and the official field names) or
    directly from the fields (the same checks, no defaults).
    """

    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = DEFAULTS["candidate_topk_blocks"]
    candidate_block_size: int = DEFAULTS["candidate_block_size"]
    index_topk: int = DEFAULTS["index_topk"]
    sliding_window: int = DEFAULTS["sliding_window"]
    engram_layer_ids: tuple[int, ...] = ()
    layers: tuple[LayerRole, ...] = field(init=False, repr=False)
    cut: int | None = field(init=False)
    replay_off_reason: str | None = field(init=False)

    def __post_init__(self):
        ratios = _ids(self.compress_ratios, "compress_ratios")
        n = len(ratios)
        if n == 0:
            raise ValueError("compress_ratios: expected one entry per decoder layer, got []")
        for i, r in enumerate(ratios):
            if r not in V41_RATIOS:
                raise ValueError(f"compress_ratios[{i}]: expected 0, 1 or 2 (DeepSeek-V4.1's ratios), got {r}")
        kv = tuple(sorted(set(_ids(self.kv_source_layer_ids, "kv_source_layer_ids"))))
        ix = tuple(sorted(set(_ids(self.index_source_layer_ids, "index_source_layer_ids"))))
        cand = as_int(self.candidate_source_layer_id, "candidate_source_layer_id")
        engram = tuple(sorted(set(_ids(self.engram_layer_ids, "engram_layer_ids"))))
        for name in ("candidate_topk_blocks", "candidate_block_size", "index_topk", "sliding_window"):
            as_int(getattr(self, name), name, minimum=1)

        def in_range(ids, name):
            bad = [i for i in ids if not 0 <= i < n]
            if bad:
                raise ValueError(f"{name}: layer {bad[0]} out of range [0, {n}) (num_hidden_layers), got {list(ids)}")

        # transformers' rules, in its order
        in_range(kv, "kv_source_layer_ids")
        for i in kv:
            if ratios[i] == 0:
                raise ValueError(
                    f"kv_source_layer_ids: layer {i} has compress_ratios[{i}] = 0 (a KV source needs a ratio > 0), "
                    f"got {list(kv)}"
                )
        in_range(ix, "index_source_layer_ids")
        for i in ix:
            if ratios[i] == 0:
                raise ValueError(
                    f"index_source_layer_ids: layer {i} has compress_ratios[{i}] = 0 (an index source needs a "
                    f"ratio > 0), got {list(ix)}"
                )
            if not any(s <= i for s in kv):
                raise ValueError(
                    f"index_source_layer_ids: layer {i} has no KV source at or before it to publish its index keys "
                    f"(kv_source_layer_ids {list(kv)}), got {list(ix)}"
                )
        if cand >= 0 and cand not in ix:
            raise ValueError(
                f"candidate_source_layer_id: {cand} is not an index source (index_source_layer_ids {list(ix)}); "
                "a negative id turns the two-level top-k off"
            )
        for i, r in enumerate(ratios):
            if r and not any(s <= i for s in kv):
                raise ValueError(
                    f"kv_source_layer_ids: compress_ratios[{i}] = {r} needs a KV source at or before layer {i}, "
                    f"got {list(kv)}"
                )
        # vLLM's
        for i in kv:
            if i not in ix:
                raise ValueError(
                    f"index_source_layer_ids: KV source layer {i} is not an index source (vLLM: its indexer owns "
                    f"the index keys later index sources read), got {list(ix)}"
                )
        # this module's
        in_range(engram, "engram_layer_ids")
        roles = []
        cut = kv[-1] if kv else None
        for i, r in enumerate(ratios):
            src = max((s for s in kv if s <= i), default=None) if r else None
            isrc = max((s for s in ix if s <= i), default=None) if r else None
            if r and ratios[src] != r:
                raise ValueError(
                    f"compress_ratios[{i}]: {r} differs from its KV source layer {src}'s ratio {ratios[src]} (it "
                    f"reads that cache, whose entries pool {ratios[src]} tokens), got {list(ratios)}"
                )
            roles.append(
                LayerRole(
                    layer_id=i,
                    compress_ratio=r,
                    kv_source_layer_id=src,
                    index_source_layer_id=isrc,
                    is_kv_source=i in kv,
                    is_index_source=i in ix,
                    is_candidate_source=i == cand,
                    uses_candidates=i in ix and 0 <= cand < i,
                    is_cut=i == cut,
                    past_cut=cut is not None and i > cut,
                )
            )
        if cut is None:
            reason = "no KV source: nothing to cut at"
        elif cut >= n - 1:
            reason = f"the last KV source (layer {cut}) is the last layer: no layer after it to replay"
        elif ratios[cut] > 1:
            reason = f"compress_ratios[{cut}] = {ratios[cut]} at the cut: vLLM asserts its ratio is <= 1"
        elif any(e >= cut for e in engram):
            reason = f"Engram layer {max(engram)} sits at or after the last KV source (layer {cut})"
        else:
            reason = None
        for name, value in (
            ("compress_ratios", ratios),
            ("kv_source_layer_ids", kv),
            ("index_source_layer_ids", ix),
            ("candidate_source_layer_id", cand),
            ("engram_layer_ids", engram),
            ("layers", tuple(roles)),
            ("cut", cut),
            ("replay_off_reason", reason),
        ):
            object.__setattr__(self, name, value)
        for name in ("candidate_topk_blocks", "candidate_block_size", "index_topk", "sliding_window"):
            object.__setattr__(self, name, int(getattr(self, name)))

    @classmethod
    def from_config(cls, config: dict) -> Schedule:
        """The schedule of a V4.1 config.json dict (transformers' or the official fields, module doc)."""
        cfg = {k: v for k, v in text_config(config).items() if v is not None}  # None (JSON null): the default
        cfg = {**DEFAULTS, **cfg}
        n = as_int(cfg["num_hidden_layers"], "num_hidden_layers", minimum=1)
        n_draft = as_int(cfg["num_nextn_predict_layers"], "num_nextn_predict_layers", minimum=0)
        ratios = cfg.get("compress_ratios")
        if ratios is None:
            if n == len(RELEASED_COMPRESS_RATIOS):
                ratios = RELEASED_COMPRESS_RATIOS
            else:  # transformers' scaling of the released pattern to n layers
                n_slide = min(2, n)
                n_enc = max(0, (n - n_slide + 1) // 2)
                ratios = (0,) * n_slide + (2,) * n_enc + (1,) * max(0, n - n_slide - n_enc)
        ratios = _ids(ratios, "compress_ratios")
        if len(ratios) < n:
            raise ValueError(f"compress_ratios: needs num_hidden_layers = {n} entries, got {len(ratios)}")
        if len(ratios) > n + n_draft:
            raise ValueError(
                f"compress_ratios: {len(ratios)} entries for num_hidden_layers + num_nextn_predict_layers = "
                f"{n} + {n_draft} layers"
            )
        for i in range(n, len(ratios)):
            if ratios[i] != 0:
                raise ValueError(
                    f"compress_ratios[{i}]: the DSpark draft layers (entries from num_hidden_layers = {n} on) are "
                    f"window only (0), got {ratios[i]}"
                )
        backbone = ratios[:n]
        kv = cfg.get("kv_source_layer_ids")
        if kv is None:
            if backbone == RELEASED_COMPRESS_RATIOS[:n]:
                kv = RELEASED_KV_SOURCES
            else:  # the first layer of each run of one ratio > 0
                kv = [i for i in range(n) if backbone[i] > 0 and (i == 0 or backbone[i - 1] != backbone[i])]
        kv = _ids(kv, "kv_source_layer_ids")
        ix = cfg.get("index_source_layer_ids")
        if ix is None:
            ix = RELEASED_INDEX_SOURCES if kv == RELEASED_KV_SOURCES else kv
        cand = cfg.get("candidate_source_layer_id")
        if cand is None:
            cand = max(kv) if kv else -1
        return cls(
            compress_ratios=backbone,
            kv_source_layer_ids=kv,
            index_source_layer_ids=_ids(ix, "index_source_layer_ids"),
            candidate_source_layer_id=cand,
            engram_layer_ids=cfg.get("engram_layer_ids", ()),
            **{k: cfg[k] for k in ("candidate_topk_blocks", "candidate_block_size", "index_topk", "sliding_window")},
        )

    @classmethod
    def from_name(cls, name: str) -> Schedule:
        """The schedule of a preset (`contract.V41_PRESETS`: "V4.1", "V4.1-tiny")."""
        return cls.from_config(preset(name))

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer_id: int) -> LayerRole:
        i = as_int(layer_id, "layer_id")
        if not 0 <= i < len(self.layers):
            raise ValueError(f"layer_id: expected 0..{len(self.layers) - 1}, got {i}")
        return self.layers[i]

    def __iter__(self):
        return iter(self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """Every layer's `LayerSpec`: (SWA, 0) for ratio 0, (CSA, r) otherwise."""
        return tuple(role.spec for role in self.layers)

    @property
    def can_replay(self) -> bool:
        """Whether vLLM's decoder bounded replay applies to this schedule (`replay_off_reason`)."""
        return self.replay_off_reason is None

    def resolve_replay(self, replay: bool | None) -> bool:
        """Whether replay runs: None = vLLM's default (on where it applies), True = required
        (ValueError naming `replay_off_reason` where it does not), False = off (the exact
        computation: every row, full windows, as transformers computes)."""
        if replay is None:
            return self.can_replay
        if not isinstance(replay, bool):
            raise ValueError(f"replay: expected True, False or None, got {replay!r}")
        if replay and not self.can_replay:
            raise ValueError(f"replay: True, but vLLM's bounded replay does not apply: {self.replay_off_reason}")
        return replay

    def plan_key(self, layer_id: int, replay: bool | None = None) -> PlanKey:
        """The plan layer `layer_id` reads in a step (`replay` as `resolve_replay` takes it)."""
        role = self[layer_id]
        return PlanKey(role.spec, role.band(self.resolve_replay(replay)))
