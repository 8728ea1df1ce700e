"""Inputs shared by tests/jax/test_model.py and its 8-device subprocess (no torch here)."""

import numpy as np

MODEL_OPTIONS = dict(
    max_batch_size=4,
    max_model_len=512,
    max_num_batched_tokens=320,
    backend="xla",
    min_tokens=64,
    min_workspace_rows=1024,
    token_tile=64,
    gather_tile=256,
)


def _prompt(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [0] + rng.integers(3, 512, size=n - 1).tolist()  # <bos> then random ids


PROMPT_A, PROMPT_B, PROMPT_C = _prompt(254, 1), _prompt(37, 2), _prompt(200, 3)
DECODE_A = [17, 230, 5, 411]  # fed after prompt A; positions 254..257


# Chunk boundaries 37, 101, 130, 190 are not multiples of 4, 128 or W = 8; every step holds <= 64
# tokens (one bucket). The decode steps (query_len 1) complete a ratio-4 block and HCA entry 1.
CHUNK_BOUNDS = [0, 37, 101, 130, 190, 254]


def chunked_then_decode(model) -> np.ndarray:
    """Logits of PROMPT_A + DECODE_A: chunked prefill in slot 3, then one decode step per token."""
    cache, logits = model.init_cache(), []
    for a, b in zip(CHUNK_BOUNDS[:-1], CHUNK_BOUNDS[1:]):
        cache, out = model.step(cache, [3], [a], [PROMPT_A[a:b]], all_tokens=True)
        logits.append(out.request_logits()[0])
    for i, tok in enumerate(DECODE_A):
        cache, out = model.step(cache, [3], [len(PROMPT_A) + i], [[tok]])
        logits.append(out.request_logits()[0][None])
    return np.concatenate(logits)
