"""A validated prefill batch: the requests of one step (spec section 3)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from planner import contract
from planner.checks import INT32_MAX, as_int, as_int_vector, check_at_most


@dataclass(frozen=True)
class PrefillBatch:
    """The prefill requests of one step, in batch order.

    Request i has `seq_lens[i]` tokens of context after this step, `query_lens[i]` of them new
    (the query tokens, positions prefix_i .. seq_len_i - 1). Requests with `query_len == 0`
    (KV-transfer loads, for instance) are allowed; plans skip them.

    `max_model_len` and `max_num_batched_tokens`, when given, are checked here too. Lengths, their
    total (the step's tokens) and the limits must fit int32 (`planner.checks.INT32_MAX`): the
    per-token arrays and plans are int32.

    `replay_start` (B,) (DeepSeek-V4.1's bounded replay; None: zeros): the lowest position whose
    window KV request i holds (vLLM's `Request.replay_start`: a prefix hit's last W tokens are
    recomputed from there, `contract.prefix_hit_replay`); no window reaches below it. Checked:
    0 <= replay_start[i] <= seq_lens[i] - query_lens[i].
    """

    seq_lens: np.ndarray
    query_lens: np.ndarray
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    replay_start: np.ndarray | None = None

    def __post_init__(self):
        seq = as_int_vector(self.seq_lens, "seq_lens")
        qry = as_int_vector(self.query_lens, "query_lens")
        if seq.shape != qry.shape:
            raise ValueError(f"seq_lens and query_lens: lengths differ ({seq.shape[0]} vs {qry.shape[0]})")
        # One cheap pass for valid batches; the culprit is looked for only when a check fails.
        qmin = int(qry.min()) if qry.size else 0
        if seq.size and (qmin < 0 or (qry > seq).any()):
            for name, a in (("seq_lens", seq), ("query_lens", qry)):
                if a.min() < 0:
                    i = int(np.argmin(a))
                    raise ValueError(f"{name}: must be >= 0, got {name}[{i}] = {int(a[i])}")
            i = int(np.argmax(qry > seq))
            raise ValueError(f"query_lens: query_lens[{i}] = {int(qry[i])} exceeds seq_lens[{i}] = {int(seq[i])}")
        check_at_most(seq, "seq_lens", INT32_MAX)  # query_lens <= seq_lens
        if qry.size and int(qry.sum()) > INT32_MAX:
            raise ValueError(
                f"query_lens: {int(qry.sum())} query tokens in all exceed {INT32_MAX} (the int32 range of token arrays)"
            )
        if self.max_model_len is not None:
            mml = as_int(self.max_model_len, "max_model_len", minimum=1, maximum=INT32_MAX)
            if seq.size and seq.max() > mml:
                i = int(np.argmax(seq > mml))
                raise ValueError(f"seq_lens: seq_lens[{i}] = {int(seq[i])} exceeds max_model_len = {mml}")
        if self.max_num_batched_tokens is not None:
            mnbt = as_int(self.max_num_batched_tokens, "max_num_batched_tokens", minimum=1, maximum=INT32_MAX)
            if qry.size and qry.max() > mnbt:
                i = int(np.argmax(qry > mnbt))
                raise ValueError(f"query_lens: query_lens[{i}] = {int(qry[i])} exceeds max_num_batched_tokens = {mnbt}")
        if self.replay_start is not None:
            rs = as_int_vector(self.replay_start, "replay_start")
            if rs.shape != seq.shape:
                raise ValueError(f"replay_start: {rs.shape[0]} entries for {seq.shape[0]} requests")
            bad = (rs < 0) | (rs > seq - qry)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(
                    f"replay_start: replay_start[{i}] = {int(rs[i])} is outside 0 .. seq_lens[{i}] - query_lens[{i}] "
                    f"= {int(seq[i] - qry[i])} (the request's prefix)"
                )
            rs.setflags(write=False)
            object.__setattr__(self, "replay_start", rs)
        seq.setflags(write=False)
        qry.setflags(write=False)
        self.__dict__["_min_query_len"] = qmin  # planners ask whether any request has no queries
        object.__setattr__(self, "seq_lens", seq)
        object.__setattr__(self, "query_lens", qry)

    # Per-token arrays (int32, what device index builders take) are made on first use: a plan that
    # only needs its chunks (vLLM's tuples) never pays for them. All read-only.

    @cached_property
    def query_start_loc(self) -> np.ndarray:
        """(B+1,) int64: request i's query tokens are rows query_start_loc[i] .. [i+1] - 1."""
        qsl = np.zeros(self.seq_lens.shape[0] + 1, dtype=np.int64)
        np.cumsum(self.query_lens, out=qsl[1:])
        qsl.setflags(write=False)
        return qsl

    @cached_property
    def token_request(self) -> np.ndarray:
        """(T,) int32: the request of each query token."""
        t = np.repeat(np.arange(self.seq_lens.shape[0], dtype=np.int32), self.query_lens)
        t.setflags(write=False)
        return t

    @cached_property
    def token_arange(self) -> np.ndarray:
        """(T,) int32: 0 .. T-1."""
        t = np.arange(self.num_tokens, dtype=np.int32)
        t.setflags(write=False)
        return t

    @cached_property
    def token_position(self) -> np.ndarray:
        """(T,) int32: the absolute position of each query token."""
        base = (self.seq_lens - self.query_lens - self.query_start_loc[:-1]).astype(np.int32)
        t = (self.token_arange + base[self.token_request]).astype(np.int32)
        t.setflags(write=False)
        return t

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def prefix_lens(self) -> np.ndarray:
        return self.seq_lens - self.query_lens

    @property
    def active(self) -> np.ndarray:
        """Requests with at least one query token (the only ones a plan places in chunks)."""
        return self.query_lens > 0

    def compressed_lens(self, compress_ratio: int, has_compressed: bool | None = None) -> np.ndarray:
        """Rows of compressed KV each request gathers: seq_len // r, 0 without a compressed cache
        (`has_compressed` as vLLM 0.33: None means r > 1)."""
        hc = contract.has_compressed(compress_ratio, has_compressed)
        return contract.compressed_len(self.seq_lens, int(compress_ratio), hc)

    @property
    def window_floor(self) -> np.ndarray | int:
        """`replay_start`, or 0 where none was given."""
        return 0 if self.replay_start is None else self.replay_start

    def gather_lens(self, window_size: int) -> np.ndarray:
        """Raw rows each request gathers: its new tokens plus up to W-1 tokens of history (none
        below `replay_start`)."""
        w = as_int(window_size, "window_size", minimum=1, maximum=INT32_MAX)
        return contract.gather_len(self.seq_lens, self.query_lens, w, self.window_floor)

    def band(self, band: str, window_size: int) -> BandRows:
        """The rows layers of `band` compute in this step (`contract.BANDS`), made once per band."""
        if band not in contract.BANDS:
            raise ValueError(f"band: expected one of {contract.BANDS}, got {band!r}")
        w = as_int(window_size, "window_size", minimum=1, maximum=INT32_MAX)
        memo = self.__dict__.setdefault("_band_memo", {})
        rows = memo.get((band, w))
        if rows is None:
            rows = memo[(band, w)] = BandRows.of(self, band, w)
        return rows


@dataclass(frozen=True, eq=False)
class BandRows:
    """The query rows one band of layers computes in a step, and where their windows start.

    band: "full" (every new row), "cut" or "replay" (each request's last min(query_len, W) rows;
      `contract.BANDS`, `planner.schedule` for vLLM's sources).
    query_lens: (B,) int64, rows computed per request: the last query_lens[i] of its new tokens.
    query_offsets: (B,) int64, the first of them within the request's new tokens
      (`batch.query_lens - query_lens`).
    window_starts: (B,) int64, the lowest position whose window KV these layers hold: a row at
      position p attends the window max(0, p - W + 1, window_starts[i]) .. p. "full" and "cut":
      the batch's `replay_start`; "replay": `max(replay_start, seq_len - W)` for a request whose
      rows were trimmed (vLLM's `_gather_replay_batch_kernel`), else `replay_start`.
    gather_lens: (B,) int64, raw rows each request gathers for them (`contract.gather_len` with
      the window starts): the workspace's window part, never below a window start.
    token_index: (T_band,) int32, the rows' places in the step's token array (request-major).
    token_position: (T_band,) int32, their absolute positions.
    """

    band: str
    window_size: int
    query_lens: np.ndarray
    query_offsets: np.ndarray
    window_starts: np.ndarray
    gather_lens: np.ndarray
    token_index: np.ndarray
    token_position: np.ndarray

    @classmethod
    def of(cls, batch: PrefillBatch, band: str, window_size: int) -> BandRows:
        qry, seq = batch.query_lens, batch.seq_lens
        floor = np.broadcast_to(np.asarray(batch.window_floor, dtype=np.int64), qry.shape)
        if band == "full":
            kept, starts = qry, floor
        else:
            kept = np.minimum(qry, window_size)
            starts = floor if band == "cut" else np.where(kept < qry, np.maximum(floor, seq - window_size), floor)
        offsets = qry - kept
        if band == "full":
            token_index, token_position = batch.token_arange, batch.token_position
        else:
            keep = (
                np.arange(batch.num_tokens) - batch.query_start_loc[:-1][batch.token_request]
                >= offsets[batch.token_request]
            )
            token_index = np.flatnonzero(keep).astype(np.int32)
            token_position = batch.token_position[token_index]
        gath = contract.gather_len(seq, kept, window_size, starts)
        arrays = [np.array(a, dtype=np.int64) for a in (kept, offsets, starts, gath)] + [
            np.asarray(token_index, dtype=np.int32),
            np.asarray(token_position, dtype=np.int32),
        ]
        for a in arrays:
            a.setflags(write=False)
        return cls(band, int(window_size), *arrays)

    @property
    def num_tokens(self) -> int:
        return int(self.token_index.shape[0])
