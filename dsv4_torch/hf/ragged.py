"""Per-request attention state of a ragged batch: layouts planned on the host, tensors on the device.

`dsv4_torch.hf.integration` keeps, for every request (batch row) and every attention layer, what
transformers' DeepSeek-V4 cache layers keep for a batch of one (docs/transformers-dsv4.md,
sections 8 and 13), but without padding between requests:

  window            the last min(seen, W-1) raw latents (or more)  regions of whole RAW_PAGEs
  buffer kv / gate  projected tokens of the unfinished block        flat (sum_i seen_i % r, C)
  overlap kv / gate CSA: the Ca half of the last complete block     (B, r, C/2), gate with its bias
  entries           compressed entries 0 .. seen_i // r - 1         pages of ENTRY_PAGE rows

All requests' rows sit in one tensor per item, request after request, so one `index_select` with
a host-built index serves the whole batch. The row counts depend only on each request's token
count and the layer's ratio (every layer sees the same tokens), so the indices are planned once
per forward (`plan_window`, `plan_compress`) and shared by every layer of that ratio. Entries live in
per-request regions of whole pages that grow by doubling (amortised O(new entries) per call, no
re-copy of the history per layer), read through a `PagedKV` block table. Raw windows live in
per-request regions too, with room for W tokens past the call that made them: a call writes its
new tokens in place after the request's rows (a decode step: one row per request and layer), and
only a full region is rebuilt from its last W-1 rows (`plan_window`); `prefill_attention` reads
them as a `LogicalKV` (one offset per request). With fp8_ds_mla caches (`dsv4_torch.hf.fp8_cache`)
the windows are packed fp8 pages and each call gathers old window and new tokens into fresh
pages (`plan_raw`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dsv4_torch import kvcache
from planner.contract import round_up

RAW_PAGE = 64  # rows per page of the per-call raw array
ENTRY_PAGE = 64  # rows per page of the compressed-entry regions


def _excl_cumsum(a: np.ndarray) -> np.ndarray:
    out = np.zeros(a.shape[0], dtype=np.int64)
    np.cumsum(a[:-1], out=out[1:])
    return out


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """concat(arange(s, s + n) for s, n in zip(starts, lengths)), int64."""
    lengths = lengths.astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    owner = np.repeat(np.arange(lengths.shape[0]), lengths)
    return (starts.astype(np.int64)[owner] + np.arange(total) - _excl_cumsum(lengths)[owner]).astype(np.int64)


@dataclass
class EntryLayout:
    """Host view of one ratio's entry regions: request i owns rows start[i] .. start[i] + cap[i] - 1
    (cap a multiple of ENTRY_PAGE), of which the first `count[i]` hold entries."""

    start: np.ndarray
    cap: np.ndarray
    count: np.ndarray

    @classmethod
    def empty(cls, B: int) -> EntryLayout:
        z = np.zeros(B, dtype=np.int64)
        return cls(z, z.copy(), z.copy())

    @property
    def total_rows(self) -> int:
        return max(int(self.cap.sum()), ENTRY_PAGE)

    def block_table(self) -> np.ndarray:
        pages = self.cap // ENTRY_PAGE
        table = np.zeros((self.start.shape[0], max(1, int(pages.max(initial=0)))), dtype=np.int64)
        for i, n in enumerate(pages.tolist()):
            table[i, :n] = self.start[i] // ENTRY_PAGE + np.arange(n)
        return table


@dataclass
class RawPlan:
    """Host indices of one forward's raw rows (shared by all layers).

    stream = cat([old windows, new tokens]); pages = stream[src] viewed (pages, RAW_PAGE, D);
    table = block table of the pages; keep = stream rows that form the new windows.
    """

    src: np.ndarray
    table: np.ndarray
    keep: np.ndarray


def _owners(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, k) of concat(arange(n) for n in lengths): the request and the index within it."""
    lengths = lengths.astype(np.int64)
    owner = np.repeat(np.arange(lengths.shape[0]), lengths)
    return owner, np.arange(owner.shape[0], dtype=np.int64) - _excl_cumsum(lengths)[owner]


def plan_raw(prefix: np.ndarray, query: np.ndarray, W: int) -> RawPlan:
    """Raw rows of every request: positions prefix - min(prefix, W-1) .. seq - 1, page aligned.

    Vectorized over requests (no per-request loop: this runs every forward, decode included)."""
    B = prefix.shape[0]
    seq = prefix + query
    nwin = np.minimum(prefix, W - 1)
    win_off = _excl_cumsum(nwin)
    new_off = int(nwin.sum()) + _excl_cumsum(query)
    gstart = prefix - nwin
    active = query > 0
    first_page = np.where(active, gstart // RAW_PAGE, 0)
    pages = np.where(active, -(-seq // RAW_PAGE) - first_page, 0)
    page_base = _excl_cumsum(pages)
    src = np.zeros(max(int(pages.sum()), 1) * RAW_PAGE, dtype=np.int64)
    table = np.zeros((B, max(1, int(-(-seq.max(initial=0) // RAW_PAGE)))), dtype=np.int64)

    def stream_row(b, pos):  # pos: absolute positions of requests b, each >= gstart[b]
        return np.where(pos < prefix[b], win_off[b] + pos - gstart[b], new_off[b] + pos - prefix[b])

    b, k = _owners(np.where(active, seq - gstart, 0))  # the rows of active requests
    pos = gstart[b] + k
    src[(page_base[b] - first_page[b]) * RAW_PAGE + pos] = stream_row(b, pos)
    b, k = _owners(pages)
    table[b, first_page[b] + k] = page_base[b] + k
    kept = np.minimum(seq, W - 1)
    b, k = _owners(kept)
    keep = stream_row(b, seq[b] - kept[b] + k)
    return RawPlan(src, table, keep.astype(np.int64))


@dataclass
class WindowLayout:
    """Host view of the raw-window regions (caches in the model's dtype): request i owns rows
    start[i] .. start[i] + cap[i] - 1 and holds its last count[i] positions, seen - count ..
    seen - 1, in rows start[i] .. start[i] + count[i] - 1 (at least min(seen, W-1) of them)."""

    start: np.ndarray
    cap: np.ndarray
    count: np.ndarray

    @classmethod
    def empty(cls, B: int) -> WindowLayout:
        z = np.zeros(B, dtype=np.int64)
        return cls(z, z.copy(), z.copy())

    @property
    def total_rows(self) -> int:
        return max(int(self.cap.sum()), 1)


@dataclass
class WindowPlan:
    """Host indices of one forward's raw rows in the window regions (shared by all layers).

    New tokens (packed, request-major) are written to rows append_dst of the regions; when a
    region cannot take them (relayout), every request's last min(seen, W-1) rows first move to
    a new set of regions (move_src -> move_dst), each with room for W more tokens past this call's.
    offsets: entry (position) e of request i is row offsets[i] + e (negative when the region
    holds only recent positions): the regions read as a `LogicalKV`.
    """

    layout: WindowLayout
    relayout: bool
    move_src: np.ndarray
    move_dst: np.ndarray
    append_dst: np.ndarray
    offsets: np.ndarray


def plan_window(prefix: np.ndarray, query: np.ndarray, W: int, old: WindowLayout) -> WindowPlan:
    """Where this call's tokens go in the raw-window regions (see `WindowPlan`), O(requests).

    Decode writes one row per request and layer in place; a region is rebuilt (its last W-1 rows
    copied) only when it is full, about once every W + RAW_PAGE decode steps."""
    seq = prefix + query
    relayout = bool((old.count + query > old.cap).any())
    if relayout:
        keep = np.minimum(prefix, W - 1)
        cap = round_up(keep + query + W, RAW_PAGE)
        start = _excl_cumsum(cap)
        move_src = _ranges(old.start + old.count - keep, keep)
        move_dst = _ranges(start, keep)
        held = keep
    else:
        cap, start, held = old.cap, old.start, old.count
        move_src = move_dst = np.zeros(0, np.int64)
    count = held + query
    return WindowPlan(
        layout=WindowLayout(start, cap, count),
        relayout=relayout,
        move_src=move_src,
        move_dst=move_dst,
        append_dst=_ranges(start + held, query),
        offsets=(start - (seq - count)).astype(np.int64),
    )


@dataclass
class CompressPlan:
    """Host indices of one forward for one compress ratio r (shared by all layers of that ratio).

    stream = cat([old buffers, new tokens]) (kv and gate alike); usable = stream rows of every
    complete block (window-major, request after request), leftover = the new buffers.
    Overlapped (r = 4): prev = source of each window's first half in
    cat([this call's Ca halves (n_windows), old overlaps (B), one empty slot]); overlap = source of
    each request's new overlap in cat([Ca halves, old overlaps]).
    Entries: positions (entry w at w * r), the new layout, moves of old entries when the layout
    grew (move_src -> move_dst), and append_dst for the new entries.
    """

    ratio: int
    n_windows: int
    usable: np.ndarray
    leftover: np.ndarray
    prev: np.ndarray
    overlap: np.ndarray
    positions: np.ndarray
    layout: EntryLayout
    relayout: bool
    move_src: np.ndarray
    move_dst: np.ndarray
    append_dst: np.ndarray


def plan_compress(prefix: np.ndarray, query: np.ndarray, r: int, old: EntryLayout) -> CompressPlan:
    B = prefix.shape[0]
    nbuf = prefix % r
    buf_off = _excl_cumsum(nbuf)
    new_off = int(nbuf.sum()) + _excl_cumsum(query)
    comb = nbuf + query
    nw = comb // r
    # request b's stream rows: its old buffer, then its new tokens; the first nw[b] * r are usable
    b, k = _owners(comb)
    rows = np.where(k < nbuf[b], buf_off[b] + k, new_off[b] + k - nbuf[b])
    used = k < nw[b] * r
    n_windows = int(nw.sum())
    win_off = _excl_cumsum(nw)
    count_old = prefix // r
    count_new = count_old + nw
    local = np.arange(n_windows) - np.repeat(win_off, nw)
    req = np.repeat(np.arange(B), nw)
    positions = (count_old[req] + local) * r
    prev = np.where(local > 0, np.arange(n_windows) - 1, np.where(count_old[req] > 0, n_windows + req, n_windows + B))
    overlap = np.where(nw > 0, win_off + nw - 1, n_windows + np.arange(B))

    grow = count_new > old.cap
    cap = np.where(grow, round_up(np.maximum(count_new, 2 * old.cap), ENTRY_PAGE), old.cap)
    relayout = bool(grow.any())
    start = _excl_cumsum(cap) if relayout else old.start
    move_src = _ranges(old.start, count_old) if relayout else np.zeros(0, np.int64)
    move_dst = _ranges(start, count_old) if relayout else np.zeros(0, np.int64)
    return CompressPlan(
        ratio=r,
        n_windows=n_windows,
        usable=rows[used].astype(np.int64),
        leftover=rows[~used].astype(np.int64),
        prev=prev.astype(np.int64),
        overlap=overlap.astype(np.int64),
        positions=positions.astype(np.int64),
        layout=EntryLayout(start, cap, count_new),
        relayout=relayout,
        move_src=move_src,
        move_dst=move_dst,
        append_dst=_ranges(start + count_old, nw),
    )


def to_device(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """All int64 host arrays in one host-to-device copy; returns views by name. On the CPU the
    arrays are used as they are (int64, contiguous, writable: the forward's own, never changed
    after), without a copy."""
    if device.type == "cpu":
        out = {}
        for n, a in arrays.items():
            a = np.ascontiguousarray(a, dtype=np.int64)
            out[n] = torch.from_numpy(a if a.flags.writeable else a.copy())
        return out
    names = list(arrays)
    parts = [np.ascontiguousarray(arrays[n], dtype=np.int64).reshape(-1) for n in names]
    host = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    views = torch.split(flat, [p.shape[0] for p in parts])
    return {n: v.view(arrays[n].shape) for n, v in zip(names, views)}


# ----------------------------------------------------------------------------- device state


@dataclass
class CompressorState:
    """One compressor's (or indexer's) state for all requests of a cache (see the module doc)."""

    ratio: int
    buf_kv: torch.Tensor | None = None
    buf_gate: torch.Tensor | None = None
    overlap_kv: torch.Tensor | None = None
    overlap_gate: torch.Tensor | None = None
    entries: torch.Tensor | None = None


@dataclass
class LayerState:
    window: torch.Tensor | None = None
    compressors: dict[str, CompressorState] = field(default_factory=dict)


@dataclass
class RaggedCacheState:
    """Everything our attention keeps between calls for one cache (one batch of requests).

    seen: real tokens each request has been fed; columns: padded columns fed (transformers' own
    `get_seq_length`); layouts: entry layout per compress ratio; layers: per-layer tensors.
    """

    num_requests: int
    seen: np.ndarray
    columns: int = 0
    layouts: dict[int, EntryLayout] = field(default_factory=dict)
    layers: dict[int, LayerState] = field(default_factory=dict)
    in_forward: bool = False
    window_layout: WindowLayout | None = None  # the raw-window regions (caches in the model's dtype)

    @classmethod
    def fresh(cls, B: int) -> RaggedCacheState:
        return cls(num_requests=B, seen=np.zeros(B, dtype=np.int64))

    def layout(self, r: int) -> EntryLayout:
        return self.layouts.get(r) or EntryLayout.empty(self.num_requests)

    def windows(self) -> WindowLayout:
        return self.window_layout or WindowLayout.empty(self.num_requests)

    def layer(self, idx: int) -> LayerState:
        if idx not in self.layers:
            self.layers[idx] = LayerState()
        return self.layers[idx]

    def select(self, rows: np.ndarray, W: int) -> RaggedCacheState:
        """A new state holding requests `rows` (any order, repeats allowed): beam-search reorder."""
        rows = np.asarray(rows, dtype=np.int64)
        B = self.num_requests
        if rows.ndim != 1 or (rows.size and (rows.min() < 0 or rows.max() >= B)):
            raise ValueError(f"beam_idx: expected indices in 0..{B - 1}, got {rows.tolist()}")
        out = RaggedCacheState(num_requests=rows.shape[0], seen=self.seen[rows].copy(), columns=self.columns)
        nwin = np.minimum(self.seen, W - 1)
        win_idx = _ranges(_excl_cumsum(nwin)[rows], nwin[rows])  # fp8 windows: the last W-1 rows, packed
        if self.window_layout is not None:  # float windows: each request's held rows, in new regions
            wl = self.window_layout
            count = wl.count[rows]
            cap = round_up(count, RAW_PAGE)
            out.window_layout = WindowLayout(_excl_cumsum(cap), cap, count)
            region_src = torch.from_numpy(_ranges(wl.start[rows], count))
            region_dst = torch.from_numpy(_ranges(out.window_layout.start, count))
        new_layouts, entry_idx = {}, {}
        for r, lay in self.layouts.items():
            count = lay.count[rows]
            cap = round_up(count, ENTRY_PAGE)
            start = _excl_cumsum(cap)
            new_layouts[r] = EntryLayout(start, cap, count)
            entry_idx[r] = (_ranges(lay.start[rows], count), _ranges(start, count), max(int(cap.sum()), ENTRY_PAGE))
        out.layouts = new_layouts
        for idx, ls in self.layers.items():
            new = out.layer(idx)
            if ls.window is not None:
                if ls.window.dtype == torch.uint8:  # fp8_ds_mla pages (dsv4_torch.hf.fp8_cache)
                    new.window = select_window(ls.window, torch.from_numpy(win_idx).to(ls.window.device))
                else:
                    dev = ls.window.device
                    new.window = ls.window.new_zeros((out.window_layout.total_rows, ls.window.shape[1]))
                    new.window[region_dst.to(dev)] = ls.window[region_src.to(dev)]
            for name, cs in ls.compressors.items():
                r = cs.ratio
                nbuf = self.seen % r
                buf_idx = torch.from_numpy(_ranges(_excl_cumsum(nbuf)[rows], nbuf[rows]))
                sel = torch.from_numpy(rows)
                ns = CompressorState(r)
                if cs.buf_kv is not None:
                    ns.buf_kv, ns.buf_gate = (t[buf_idx.to(t.device)] for t in (cs.buf_kv, cs.buf_gate))
                if cs.overlap_kv is not None:
                    ns.overlap_kv, ns.overlap_gate = (t[sel.to(t.device)] for t in (cs.overlap_kv, cs.overlap_gate))
                if cs.entries is not None and cs.entries.dtype == torch.uint8:  # fp8_ds_mla pages
                    src, dst, total = (
                        torch.from_numpy(a).to(cs.entries.device) if isinstance(a, np.ndarray) else a
                        for a in entry_idx[r]
                    )
                    ns.entries = select_entries(cs.entries, src, dst, total)
                elif cs.entries is not None:
                    src, dst, total = entry_idx[r]
                    ns.entries = cs.entries.new_zeros((total, cs.entries.shape[1]))
                    ns.entries[torch.from_numpy(dst).to(cs.entries.device)] = cs.entries[
                        torch.from_numpy(src).to(cs.entries.device)
                    ]
                new.compressors[name] = ns
        return out


# fp8_ds_mla pages (dsv4_torch.hf.fp8_cache) of ENTRY_PAGE slots, reordered by the beam search


def select_window(window: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Beam-search reorder: new window pages holding window rows `rows` (device tensor)."""
    return kvcache.gather_slots(window, rows, ENTRY_PAGE)


def select_entries(entries: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, total_rows: int) -> torch.Tensor:
    """New entry pages of `total_rows` slots: slot dst[i] holds slot src[i] of `entries`."""
    out = torch.zeros(
        (total_rows // ENTRY_PAGE, kvcache.page_bytes(ENTRY_PAGE)), dtype=torch.uint8, device=entries.device
    )
    kvcache.copy_slots(entries, src, out, dst, ENTRY_PAGE)
    return out
