"""Gradients through our path against transformers' eager attention, every parameter.

    python -m tools.grad_parity [--ckpt DIR] [--tokens 150]

Writes the tiny checkpoint (seed 0) if no --ckpt is given, runs one training step's backward
(train mode, labels = the input) with eager attention and with `enable_sparse_prefill(backend=
"reference")`, in float64 and float32, plain and with gradient checkpointing, and prints per
comparison the max relative error (max |a - b| / max |b| per parameter, worst parameter) and how
many parameters got a gradient. `tests/hf/test_training.py` asserts the same comparisons.
"""

from __future__ import annotations

import argparse
import tempfile

import torch


def _grads(ckpt, ids, dtype, sparse, checkpointing=None):
    import transformers

    from dsv4_torch.hf import integration as I

    m = transformers.DeepseekV4ForCausalLM.from_pretrained(ckpt, experts_implementation="eager").to(dtype).train()
    if checkpointing is not None:
        m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": checkpointing})
    if sparse:
        I.enable_sparse_prefill(m, backend="reference")
    m(ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in m.named_parameters() if p.grad is not None}, sum(1 for _ in m.parameters())


def _cmp(a, b):
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    errs = {n: ((a[n].double() - b[n].double()).abs().max() / b[n].double().abs().max()).item() for n in b}
    worst = max(errs, key=errs.get)
    return errs[worst], worst, errs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt")
    ap.add_argument("--tokens", type=int, default=150)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ckpt = args.ckpt
    if ckpt is None:
        from tools.tiny_checkpoint import write_tiny_checkpoint

        ckpt = write_tiny_checkpoint(tempfile.mkdtemp(prefix="tiny-"), seed=0)
    ids = torch.randint(3, 512, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    e64, n = _grads(ckpt, ids, torch.float64, False)
    e32, _ = _grads(ckpt, ids, torch.float32, False)
    print(f"{len(e64)} of {n} parameters get a gradient from eager")
    rows = [
        ("float64 ours vs eager", _grads(ckpt, ids, torch.float64, True)[0], e64),
        ("float64 ours+checkpointing vs eager", _grads(ckpt, ids, torch.float64, True, False)[0], e64),
        ("float64 ours+checkpointing(reentrant) vs eager", _grads(ckpt, ids, torch.float64, True, True)[0], e64),
        ("float32 ours vs eager", _grads(ckpt, ids, torch.float32, True)[0], e32),
        ("float32 eager vs float64 eager (eager's own noise)", e32, e64),
    ]
    for name, a, b in rows:
        err, worst, errs = _cmp(a, b)
        above = sorted(k for k, v in errs.items() if v > 1e-5)
        print(f"{name}: {len(a)} parameters with gradients, max rel error {err:.3g} ({worst}); above 1e-5: {above}")


if __name__ == "__main__":
    main()
