"""Kernel level: `sparse_attention` on random and adversarial inputs, every backend, every pair.

One test per report row (case class · dtype). Unavailable backends do not run here; each one
shows up as a skip with its reason in test_parity_backends.py.
"""

import pytest

from tests.parity import backends as B
from tests.parity import cases as C
from tests.parity import harness as H

CASES = C.kernel_cases()
ROWS = list(dict.fromkeys(c.row for c in CASES))


# Triton's interpreter evaluates exp2 of huge sink logits in NumPy (the result, 0 weight, is right)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
@pytest.mark.parametrize("row", ROWS, ids=[r.replace(" · ", "-") for r in ROWS])
def test_every_backend_pair_agrees(row):
    cases = [c for c in CASES if c.row == row]
    (result,) = H.run_kernel_cases(cases)
    assert result.passed, "\n".join(result.failures())
    # every backend that can take one of the row's cases ran it, and was compared with every other
    expected = {b.name for b in B.BACKENDS if any(B.why_not(b, c.dtype, c.head_dim, c.tiny) is None for c in cases)}
    assert result.ran == expected, (result.ran, expected)
    for a in expected:
        for b in expected:
            if B.BACKENDS.index(B.BY_NAME[a]) < B.BACKENDS.index(B.BY_NAME[b]):
                assert (a, b) in result.pairs, (a, b)
    if any(b.framework == "jax" for b in map(B.BY_NAME.get, result.ran)):
        assert result.crossings >= 3  # q, kv, indices at least: bitwise equal after DLPack
