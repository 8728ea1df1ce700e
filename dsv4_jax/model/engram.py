"""DeepSeek-V4.1's Engram n-gram hashing, on the host (NumPy, int64), and its per-slot token
history, so a request's look-back crosses prefill chunks and decode steps.

`EngramHasher(config, tokenizer_file, num_slots, max_model_len)` builds what transformers'
`DeepseekV41NgramHashState` builds: the compressed token map of the checkpoint's tokenizer
(each token decoded, NFKC / NFD / accents stripped / lower-cased / whitespace runs folded /
stripped, tokens that normalize alike share one id; partial UTF-8 tokens keyed by their raw
form), the prime bucket sizes (drawn in order above `engram_vocab_size`, never reused), the
per-layer bucket offsets and the hash multipliers (`np.random.default_rng(10007 * layer)`,
odd, bounded so `id * multiplier` fits int64). The compressed vocabulary must have
`engram_compressed_vocab_size` entries (ValueError otherwise: the hashes would address other
rows than the table was trained with).

`hash_ids(slots, prefix_lens, tokens)` records each request's new tokens at their positions in
its slot's history and returns, per new token, the `(max_ngram_size - 1) * n_heads` table rows
of every Engram layer: for n = 2..N the n-gram ending at the token (look-back stops at position
0, earlier tokens become `engram_pad_id`'s id), XOR of id * multiplier, modulo each head's prime,
plus the layer's offset of that (n, head) range.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DEAD = -1


def is_prime(n: int) -> bool:
    """Deterministic primality for n < 3.3e24 (Miller-Rabin with the first 13 prime bases)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(cfg) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """[engram layer][n-gram size - 2][head] bucket sizes: primes above engram_vocab_size - 1,
    drawn in order and never reused."""
    seen: set[int] = set()
    out = []
    for _ in cfg.engram_layer_ids:
        per_ngram = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            sizes, current = [], cfg.engram_vocab_size - 1
            for _ in range(cfg.engram_n_heads):
                current += 1
                while not is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                sizes.append(current)
            per_ngram.append(tuple(sizes))
        out.append(tuple(per_ngram))
    return tuple(out)


def table_rows(cfg) -> list[int]:
    """Rows each Engram layer's table needs (the sum of its bucket sizes)."""
    return [sum(sum(per) for per in layer) for layer in engram_primes(cfg)]


def hash_multipliers(layer_ids, max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """(layers, max_ngram_size) int64 odd multipliers, one generator per layer id."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = []
    for layer_id in layer_ids:
        g = np.random.default_rng(10007 * layer_id)
        rows.append(g.integers(low=0, high=bound, size=(max_ngram_size,), dtype=np.int64) * 2 + 1)
    return np.stack(rows).astype(np.int64)


def compressed_token_map(tokenizer_file) -> tuple[np.ndarray, int]:
    """(token id -> compressed id (vocab,) int64, compressed vocabulary size) of a tokenizer.json."""
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(str(tokenizer_file))
    sentinel = "\ue000"  # a lone space survives Strip() as itself
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    n = tok.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    lookup = np.zeros(n, np.int64)
    for i in range(n):
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(i)
        else:
            key = normalizer.normalize_str(text) or text
        lookup[i] = keys.setdefault(key, len(keys))
    return lookup, len(keys)


class EngramHasher:
    """Engram hash ids of each step's new tokens, with a token history per cache slot."""

    def __init__(self, cfg, tokenizer_file, num_slots: int, max_model_len: int):
        if not cfg.engram_layer_ids:
            raise ValueError("config: no engram_layer_ids, nothing to hash")
        path = Path(tokenizer_file) if tokenizer_file is not None else None
        if path is None or not path.is_file():
            raise ValueError(
                f"tokenizer_file: the Engram layers {list(cfg.engram_layer_ids)} hash token ids through the "
                f"checkpoint's tokenizer (its compressed vocabulary), and there is no tokenizer.json at {tokenizer_file!r}"
            )
        lookup, size = compressed_token_map(path)
        if size != cfg.engram_compressed_vocab_size:
            raise ValueError(
                f"engram_compressed_vocab_size: the tokenizer's compressed vocabulary has {size} entries, the config "
                f"says {cfg.engram_compressed_vocab_size} (the hashes would address other table rows)"
            )
        if lookup.shape[0] < cfg.vocab_size:  # ids past the tokenizer's vocabulary hash as the pad id (ours)
            lookup = np.concatenate([lookup, np.full(cfg.vocab_size - lookup.shape[0], lookup[cfg.engram_pad_id])])
        self.token_map = lookup
        self.pad_id = int(lookup[cfg.engram_pad_id])
        self.N = cfg.engram_max_ngram_size
        primes = engram_primes(cfg)
        self.primes = np.array(primes, np.int64)  # (L, N-1, heads)
        offsets = []
        for layer in primes:
            flat = [p for per in layer for p in per]
            offsets.append(np.concatenate([[0], np.cumsum(flat)[:-1]]))
        self.offsets = np.array(offsets, np.int64)  # (L, cols)
        self.multipliers = hash_multipliers(cfg.engram_layer_ids, self.N, size)  # (L, N)
        rows = [sum(sum(per) for per in layer) for layer in primes]
        for k, (have, need) in enumerate(zip(cfg.engram_num_embeddings, rows)):
            if have < need:
                raise ValueError(
                    f"engram_num_embeddings[{k}]: {have} rows, but layer {cfg.engram_layer_ids[k]}'s buckets need {need}"
                )
        self.history = np.full((num_slots, max_model_len), DEAD, np.int64)

    @property
    def num_columns(self) -> int:
        return int(self.offsets.shape[1])

    def hash_ids(self, slots, prefix_lens, tokens) -> np.ndarray:
        """(T, engram layers, columns) int64 table rows of the step's new tokens (request-major)."""
        out = []
        for slot, prefix, ids in zip(slots, prefix_lens, tokens):
            ids = np.asarray(ids, np.int64)
            pos = prefix + np.arange(ids.shape[0])
            self.history[slot, pos] = self.token_map[ids]
            grams, blocked = [], np.zeros(pos.shape, bool)
            for shift in range(self.N):
                src = self.history[slot, np.maximum(pos - shift, 0)]
                blocked = blocked | (pos < shift) | (src == DEAD)
                grams.append(np.where(blocked, self.pad_id, src))
            grams = np.stack(grams, axis=-1)  # (q, N)
            products = grams[:, None, :] * self.multipliers[None]  # (q, L, N)
            rolling, hashes = products[..., 0], []
            for i in range(1, self.N):
                rolling = np.bitwise_xor(rolling, products[..., i])
                hashes.append(rolling[..., None] % self.primes[None, :, i - 1])  # (q, L, heads)
            out.append(np.concatenate(hashes, axis=-1) + self.offsets[None])
        return np.concatenate(out, axis=0)
