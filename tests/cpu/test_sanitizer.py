"""`make test-sanitize` really runs under AddressSanitizer: a deliberate out-of-bounds read through
the library's unchecked per-thread gather (`dsv4_gather_dequant_rows`, which the public entry points
only call after checking) must kill the process with an AddressSanitizer report. Without it, a
sanitizer run that silently lost its instrumentation would pass everything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_cpu import build

ROOT = Path(__file__).resolve().parents[2]

OOB = """
import numpy as np
from dsv4_cpu import binding
lib = binding.library()
cache = np.zeros((1, 584), np.uint8)      # one slot of page 0
out = np.zeros((1, 2, 512), np.uint16)
seq, cum, bt = np.array([2], np.int64), np.array([0, 2], np.int64), np.array([[0]], np.int32)
# page_stride 584 but 2 slots per page claimed: slot 1 reads past the cache's one slot
lib.dsv4_gather_dequant_rows(out.ctypes.data, 1024, 512, 2, 0, 0, cache.ctypes.data, 584 * 2, 1, 2,
                             seq.ctypes.data, cum.ctypes.data, bt.ctypes.data, 0, 1, 1, 0, 1, 0, 2)
print("NOT CAUGHT")
"""


def test_an_out_of_bounds_read_is_caught():
    if not build.sanitized():
        pytest.skip("runs in make test-sanitize (the AddressSanitizer build of the library)")
    res = subprocess.run(
        [sys.executable, "-c", OOB],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode != 0 and "NOT CAUGHT" not in res.stdout, res.stdout
    assert "AddressSanitizer" in res.stderr and "heap-buffer-overflow" in res.stderr, res.stderr[-3000:]
