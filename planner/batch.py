"""A validated prefill batch: the requests of one step (spec section 3)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from planner import contract
from planner.contract import _as_int, cdiv  # noqa: F401  (cdiv: part of this module's API)


def _as_int_vector(x, name: str) -> np.ndarray:
    """A 1-D int64 copy of a list, NumPy array or anything with `__array__` (torch CPU tensors)."""
    try:
        a = np.asarray(x)
    except Exception as e:
        raise ValueError(f"{name}: cannot be read as a 1-D integer array ({e})") from None
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {a.shape}")
    if a.dtype.kind in "iu":
        return a.astype(np.int64)
    if a.size == 0 and a.dtype.kind == "f":  # np.asarray([]) is float64
        return a.astype(np.int64)
    raise ValueError(f"{name}: expected integers, got dtype {a.dtype} ({a[:4].tolist()}...)")






@dataclass(frozen=True)
class PrefillBatch:
    """The prefill requests of one step, in batch order.

    Request i has `seq_lens[i]` tokens of context after this step, `query_lens[i]` of them new
    (the query tokens, positions prefix_i .. seq_len_i - 1). Requests with `query_len == 0`
    (KV-transfer loads, for instance) are allowed; plans skip them.

    `max_model_len` and `max_num_batched_tokens`, when given, are checked here too.
    """

    seq_lens: np.ndarray
    query_lens: np.ndarray
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    query_start_loc: np.ndarray = field(init=False, repr=False)
    token_request: np.ndarray = field(init=False, repr=False)
    token_position: np.ndarray = field(init=False, repr=False)
    token_arange: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        seq = _as_int_vector(self.seq_lens, "seq_lens")
        qry = _as_int_vector(self.query_lens, "query_lens")
        if seq.shape != qry.shape:
            raise ValueError(f"seq_lens and query_lens: lengths differ ({seq.shape[0]} vs {qry.shape[0]})")
        for name, a in (("seq_lens", seq), ("query_lens", qry)):
            if a.size and a.min() < 0:
                i = int(np.argmin(a))
                raise ValueError(f"{name}: must be >= 0, got {name}[{i}] = {int(a[i])}")
        bad = np.nonzero(qry > seq)[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"query_lens: query_lens[{i}] = {int(qry[i])} exceeds seq_lens[{i}] = {int(seq[i])}")
        if self.max_model_len is not None:
            mml = _as_int(self.max_model_len, "max_model_len", minimum=1)
            bad = np.nonzero(seq > mml)[0]
            if bad.size:
                i = int(bad[0])
                raise ValueError(f"seq_lens: seq_lens[{i}] = {int(seq[i])} exceeds max_model_len = {mml}")
        if self.max_num_batched_tokens is not None:
            mnbt = _as_int(self.max_num_batched_tokens, "max_num_batched_tokens", minimum=1)
            bad = np.nonzero(qry > mnbt)[0]
            if bad.size:
                i = int(bad[0])
                raise ValueError(
                    f"query_lens: query_lens[{i}] = {int(qry[i])} exceeds max_num_batched_tokens = {mnbt}"
                )
        seq.setflags(write=False)
        qry.setflags(write=False)
        qsl = np.zeros(seq.shape[0] + 1, dtype=np.int64)
        np.cumsum(qry, out=qsl[1:])
        # Per-token arrays in int32, what device index builders take.
        tok_req = np.repeat(np.arange(seq.shape[0], dtype=np.int32), qry)
        tok_arange = np.arange(int(qsl[-1]), dtype=np.int32)
        tok_pos = (tok_arange + (seq - qry - qsl[:-1]).astype(np.int32)[tok_req]).astype(np.int32)
        for a in (qsl, tok_req, tok_pos, tok_arange):
            a.setflags(write=False)
        object.__setattr__(self, "seq_lens", seq)
        object.__setattr__(self, "query_lens", qry)
        object.__setattr__(self, "query_start_loc", qsl)
        object.__setattr__(self, "token_request", tok_req)
        object.__setattr__(self, "token_position", tok_pos)
        object.__setattr__(self, "token_arange", tok_arange)

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

    def gather_lens(self, window_size: int) -> np.ndarray:
        """Raw rows each request gathers: its new tokens plus up to W-1 tokens of history."""
        w = _as_int(window_size, "window_size", minimum=1)
        return contract.gather_len(self.seq_lens, self.query_lens, w)
