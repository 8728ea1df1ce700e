"""Safetensors checkpoints read lazily with NumPy + ml_dtypes: headers parsed here, bytes memory-mapped.

    files = CheckpointFiles("path/to/checkpoint")     # one file, a directory, or a sharded index
    files.info("layers.0.attn.wq_a.weight")            # TensorInfo: dtype, shape, file, byte range
    a = files.array("layers.0.attn.wq_a.weight")       # read-only NumPy view of the mapped bytes
    files.release("layers.0.attn.wq_a.weight")         # drop its pages from this process's memory

A file is `8-byte little-endian header length N | N bytes of JSON | data`; the JSON maps each
tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets into the data) plus an
optional `__metadata__`. Nothing is read but the headers until `array` is called, and `array`
only maps: the pages a caller touches are read then, and `release` (madvise MADV_DONTNEED) gives
them back, so streaming a checkpoint through host memory costs about one tensor, not the model.

The safetensors package's NumPy API cannot return float8 tensors (NumPy has no such dtype); this
reader views them with `ml_dtypes` (`float8_e4m3fn`, `float8_e5m2`, `float8_e8m0fnu`, `bfloat16`).
Every malformed input raises `ValueError` naming the file (and the tensor): a truncated file, a
header length past the end, JSON that is not a tensor table, an unknown dtype, a shape that does
not match its byte range, overlapping or out-of-range offsets, a missing shard of an index, a
tensor an index promises that its shard lacks, the same tensor in two files.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit

ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: `file`, absolute byte offset `start`, `nbytes`; its `dtype`
    (NumPy / ml_dtypes), `st_dtype` (the header's name, e.g. "F8_E4M3") and `shape`."""

    name: str
    file: Path
    st_dtype: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


def _bad(path, msg) -> ValueError:
    return ValueError(f"{path}: {msg}")


def read_header(path) -> tuple[dict[str, TensorInfo], dict]:
    """The tensor table of one safetensors file (nothing else is read) and its `__metadata__`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path: no such safetensors file {str(path)!r}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _bad(path, f"not a safetensors file ({size} bytes, shorter than the 8-byte header length)")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise _bad(path, f"corrupt header: header length {n} does not fit a file of {size} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(path, f"corrupt header: not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _bad(path, f"corrupt header: expected a JSON object, got {type(header).__name__}")
    data_start, data_size = 8 + n, size - 8 - n
    meta = header.pop("__metadata__", None) or {}
    table: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise _bad(path, f"corrupt header: tensor {name!r} needs dtype, shape and data_offsets, got {entry!r:.200}")
        st = entry["dtype"]
        if st not in ST_DTYPES:
            raise _bad(path, f"tensor {name!r} has unknown dtype {st!r} (known: {sorted(ST_DTYPES)})")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise _bad(path, f"corrupt header: tensor {name!r} has shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_size
        ):
            raise _bad(path, f"tensor {name!r} has data_offsets {offsets!r} outside the {data_size} data bytes")
        dtype = ST_DTYPES[st]
        nbytes = math.prod(shape) * dtype.itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise _bad(
                path, f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for shape {shape} {st} ({nbytes} expected)"
            )
        table[name] = TensorInfo(name, path, st, dtype, tuple(shape), data_start + offsets[0], nbytes)
        if nbytes:
            spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise _bad(path, f"corrupt header: tensors {a!r} and {b!r} overlap")
    return table, meta


class CheckpointFiles:
    """Every tensor of a checkpoint, by name, mapped lazily (see the module docstring).

    path: a `.safetensors` file; or a directory holding `model.safetensors.index.json` (its
    `weight_map` says which shard holds each tensor; every shard must exist and hold what it
    promises), else `model.safetensors`, else every `*.safetensors` file in it (a name in two
    files is an error). Use as a context manager, or call `close()`, to unmap the files.
    """

    def __init__(self, path):
        p = Path(path)
        self.path = p
        self.metadata: dict[Path, dict] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        self.tensors: dict[str, TensorInfo] = {}
        if p.is_file():
            files = [p]
            wanted = None
        elif (p / INDEX_NAME).is_file():
            files, wanted = self._read_index(p / INDEX_NAME)
        elif (p / SINGLE_NAME).is_file():
            files, wanted = [p / SINGLE_NAME], None
        elif p.is_dir():
            files, wanted = sorted(p.glob("*.safetensors")), None
        else:
            raise ValueError(f"path: no such checkpoint file or directory {str(p)!r}")
        if not files:
            raise ValueError(f"path: no safetensors files in {str(p)!r}")
        for f in files:
            table, meta = read_header(f)
            self.metadata[f] = meta
            for name, info in table.items():
                if wanted is not None:
                    if wanted.get(name) != f:
                        continue  # the index names another file (or none): it is not part of the checkpoint
                elif name in self.tensors:
                    raise ValueError(f"path: tensor {name!r} is in both {self.tensors[name].file} and {f}")
                self.tensors[name] = info
        if wanted is not None:
            lost = sorted(n for n in wanted if n not in self.tensors)
            if lost:
                raise ValueError(
                    f"{wanted[lost[0]]}: the index lists tensor {lost[0]!r} there, but the file lacks it"
                    + (f" ({len(lost) - 1} more)" if len(lost) > 1 else "")
                )

    @staticmethod
    def _read_index(index_path: Path) -> tuple[list[Path], dict[str, Path]]:
        try:
            index = json.loads(index_path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{index_path}: not JSON ({e})") from None
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ValueError(f"{index_path}: expected a 'weight_map' object of tensor name -> file name")
        wanted = {name: index_path.parent / f for name, f in wm.items()}
        files = sorted(set(wanted.values()))
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise ValueError(
                f"{index_path}: missing shard {missing[0].name!r} (holds e.g. tensor "
                f"{next(n for n, f in wanted.items() if f == missing[0])!r})"
            )
        return files, wanted

    # ------------------------------------------------------------------ access

    def __contains__(self, name) -> bool:
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise ValueError(f"tensors: no tensor {name!r} in {self.path}")
        return self.tensors[name]

    def _map(self, file: Path) -> mmap.mmap:
        m = self._maps.get(file)
        if m is None:
            with open(file, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[file] = m
        return m

    def array(self, name: str) -> np.ndarray:
        """The tensor as a read-only view of the mapped file (no bytes are read until touched)."""
        info = self.info(name)
        if info.nbytes == 0:
            return np.zeros(info.shape, info.dtype)
        raw = np.frombuffer(self._map(info.file), dtype=np.uint8, count=info.nbytes, offset=info.start)
        return raw.view(info.dtype).reshape(info.shape)

    def read(self, name: str, index: tuple | None = None, chunk_bytes: int = 64 << 20) -> np.ndarray:
        """A copy of `array(name)[index]` (index: slices, one per dimension, steps of 1), copied a
        block of rows at a time, each block's file pages released once copied: the process holds
        the copy plus at most `chunk_bytes` of the file, however big the tensor."""
        a = self.array(name)
        sub = a if index is None else a[tuple(index)]
        out = np.empty(sub.shape, sub.dtype)
        if sub.ndim == 0 or sub.size == 0:
            out[...] = sub
            return out
        info = self.info(name)
        row_bytes = info.nbytes // max(1, info.shape[0])
        first = 0 if index is None or index[0].start is None else int(index[0].start)
        step = max(1, chunk_bytes // max(1, row_bytes))
        for r in range(0, sub.shape[0], step):
            out[r : r + step] = sub[r : r + step]
            begin = info.start + (first + r) * row_bytes
            self._release_range(info.file, begin, begin + min(step, sub.shape[0] - r) * row_bytes)
        return out

    def _release_range(self, file: Path, begin: int, end: int) -> None:
        m = self._maps.get(file)
        if m is None or end <= begin or not hasattr(mmap, "MADV_DONTNEED"):
            return
        begin -= begin % _PAGE
        m.madvise(mmap.MADV_DONTNEED, begin, min(len(m), end) - begin)

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process (they are re-read from the file if touched)."""
        info = self.info(name)
        self._release_range(info.file, info.start, info.start + info.nbytes)

    def close(self) -> None:
        """Unmap the files. Views from `array` must be gone (copied) by then."""
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a caller still holds a view: leave it mapped, the GC unmaps it
                pass
        self._maps.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.tensors.values())


def read_safetensors(path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint (directory, index or file) as read-only memory-mapped views."""
    files = CheckpointFiles(path)
    return {name: files.array(name) for name in files.names()}


def write_safetensors(path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> Path:
    """Write `tensors` (NumPy / ml_dtypes arrays) as one safetensors file, in name order.

    The inverse of `read_header`; used by the fixture writers (no torch). Each tensor's bytes are
    written straight from the array (C order), so writing needs no copy of the whole file.
    """
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    order = sorted(tensors)
    for name in order:
        a = tensors[name]
        dt = np.dtype(a.dtype)
        if dt not in ST_NAMES:
            raise ValueError(f"tensors: {name!r} has dtype {dt}, which safetensors cannot store")
        header[name] = {"dtype": ST_NAMES[dt], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned, as the safetensors writer does
    path = Path(path)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in order:
            f.write(np.ascontiguousarray(tensors[name]).view(np.uint8).reshape(-1).data)
    return path


def file_bytes(path) -> int:
    """Bytes on disk of a checkpoint's safetensors files."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
    return sum(os.path.getsize(f) for f in files)
