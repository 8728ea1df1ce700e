"""Training through our path inside transformers' DeepSeek-V4 (issue 15), on the tiny checkpoint.

Gradients against transformers' eager attention: every parameter's gradient, and the very same
set of parameters without one (the indexer's: its top-k is an integer selection in eager too).
float64: equal to rounding (measured max relative error 1.8e-15). float32: every parameter within
1e-5 relative except the three (3,)-element mHC `ffn_hc.scale` gradients of the layers after a
compressed layer, whose sums cancel: they sit at float32's noise floor, where eager's own float32
gradient is up to 2.5e-5 from its float64 one (ours: 1.8e-5 from eager's, 1.6e-5 from float64).
Gradient checkpointing (both checkpoint modes) gives bitwise the plain backward's gradients.
Train mode without grad, attention dropout, `torch.compile`, models cast to fp16 / bf16.
"""

import contextlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from dsv4_torch.hf import integration as I  # noqa: E402

T = 150  # one HCA entry, 37 CSA entries (top-8 selects)
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 512, (1, T), generator=torch.Generator().manual_seed(0))


def load(ckpt, dtype=torch.float32, **kw):
    m = transformers.DeepseekV4ForCausalLM.from_pretrained(ckpt, experts_implementation="eager", **kw)
    return m.to(dtype)


def gradients(model, ids, sparse, checkpointing=None):
    """(loss, {name: grad}) of one training step's backward (train mode, labels = ids)."""
    model.zero_grad(set_to_none=True)
    model.train()
    if checkpointing is not None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": checkpointing})
    if sparse:
        I.enable_sparse_prefill(model, backend="reference")
    try:
        out = model(ids, labels=ids)
        out.loss.backward()
    finally:
        if sparse:
            I.disable_sparse_prefill(model)
        if checkpointing is not None:
            model.activation_checkpointing_disable()
        model.eval()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel_errors(got, want):
    assert set(got) == set(want), f"parameters with gradients differ: {sorted(set(got) ^ set(want))}"
    return {n: ((got[n].double() - want[n].double()).abs().max() / want[n].double().abs().max()).item() for n in want}


@pytest.fixture(scope="module")
def model64(tiny_checkpoint_dir):
    return load(tiny_checkpoint_dir, torch.float64)


@pytest.fixture(scope="module")
def eager64(model64, ids):
    return gradients(model64, ids, sparse=False)


@pytest.fixture(scope="module")
def model32(tiny_checkpoint_dir):
    return load(tiny_checkpoint_dir)


@pytest.fixture(scope="module")
def ours32(model32, ids):
    return gradients(model32, ids, sparse=True)


@pytest.mark.parametrize(
    "checkpointing", [None, False, True], ids=["plain", "checkpointing", "checkpointing-reentrant"]
)
def test_gradients_equal_eager_in_float64(model64, ids, eager64, checkpointing):
    loss, grads = gradients(model64, ids, sparse=True, checkpointing=checkpointing)
    eager_loss, eager_grads = eager64
    assert abs(loss.item() - eager_loss.item()) < 1e-12
    n_params = sum(1 for _ in model64.parameters())
    assert 100 < len(eager_grads) < n_params  # some parameters get none (the indexer's), in eager too
    assert not any(".indexer." in n for n in eager_grads)
    assert any(n.endswith("self_attn.sinks") for n in grads) and any(".compressor.kv_proj" in n for n in grads)
    errs = rel_errors(grads, eager_grads)
    worst = max(errs, key=errs.get)
    assert errs[worst] < 1e-10, f"{worst}: max relative error {errs[worst]:.3g}"


def test_gradients_equal_eager_in_float32(model32, ids, ours32):
    eager_loss, eager = gradients(model32, ids, sparse=False)
    loss, ours = ours32
    assert abs(loss.item() - eager_loss.item()) < TOL
    errs = rel_errors(ours, eager)
    noise_floor = {n for n in errs if n.endswith("ffn_hc.scale")}  # see the module doc
    worst = max(set(errs) - noise_floor, key=errs.get)
    assert errs[worst] < TOL, f"{worst}: max relative error {errs[worst]:.3g}"
    assert max(errs[n] for n in noise_floor) < 5e-5


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_plain_gradients_bitwise(model32, ids, ours32, reentrant):
    loss, grads = gradients(model32, ids, sparse=True, checkpointing=reentrant)
    plain_loss, plain = ours32
    assert torch.equal(loss, plain_loss)
    assert set(grads) == set(plain) and all(torch.equal(grads[n], plain[n]) for n in plain)


def test_train_mode_forward_without_grad(model32, ids):
    with torch.no_grad():
        eval_logits = model32(ids).logits
        with contextlib.ExitStack() as stack:
            I.enable_sparse_prefill(model32, backend="reference")
            stack.callback(I.disable_sparse_prefill, model32)
            ours_eval = model32(ids).logits
            model32.train()
            stack.callback(model32.eval)
            ours_train = model32(ids).logits  # attention_dropout = 0: train mode changes nothing
    assert torch.equal(ours_train, ours_eval)
    assert (ours_train - eval_logits).abs().max().item() < TOL


def test_attention_dropout(tiny_checkpoint_dir, ids):
    """config.attention_dropout in train mode: dropped, reproducible from torch's seed, eval
    untouched, and checkpointing recomputes the same mask (bitwise the same gradients)."""
    model = load(tiny_checkpoint_dir, attention_dropout=0.5)
    ids = ids[:, :80]
    I.enable_sparse_prefill(model, backend="reference")
    with torch.no_grad():
        eval_logits = model(ids).logits
        model.train()
        torch.manual_seed(3)
        a = model(ids).logits
        torch.manual_seed(3)
        b = model(ids).logits
        c = model(ids).logits
        model.eval()
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, eval_logits)
    I.disable_sparse_prefill(model)
    results = []
    for checkpointing in (None, False, True):
        torch.manual_seed(4)
        results.append(gradients(model, ids, sparse=True, checkpointing=checkpointing))
    (loss, plain), *rest = results
    torch.manual_seed(5)
    other_loss, _ = gradients(model, ids, sparse=True)
    assert not torch.equal(loss, other_loss)  # another mask
    for loss_c, grads in rest:
        assert torch.equal(loss_c, loss) and all(torch.equal(grads[n], plain[n]) for n in plain)


def test_torch_compile_agrees_with_eager(model32, ids):
    mask = torch.ones((2, T), dtype=torch.long)
    mask[1, :40] = 0  # a left-padded row
    batch = ids.repeat(2, 1)
    with torch.no_grad():
        eager = model32(ids).logits
    I.enable_sparse_prefill(model32, backend="reference")
    try:
        compiled = torch.compile(model32, backend="eager")
        with torch.no_grad():
            ours = model32(batch, attention_mask=mask).logits
            got = compiled(batch, attention_mask=mask).logits
            got_short = compiled(ids[:, :60]).logits  # another length: a retrace, same results
            ours_short = model32(ids[:, :60]).logits
        assert torch.equal(got, ours) and torch.equal(got_short, ours_short)
        assert (got[:1] - eager).abs().max().item() < TOL
        model32.zero_grad(set_to_none=True)
        model32.train()
        compiled(ids, labels=ids).loss.backward()
        grads = {n: p.grad for n, p in model32.named_parameters() if p.grad is not None}
    finally:
        model32.eval()
        I.disable_sparse_prefill(model32)
    _, plain = gradients(model32, ids, sparse=True)
    assert set(grads) == set(plain) and all(torch.equal(grads[n], plain[n]) for n in plain)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_models_cast_to_16_bits_run(tiny_checkpoint_dir, model32, ids, dtype):
    """`.to(dtype)` casts the sinks too; they reach the kernel in float32. Our logits are as close
    to the float32 model's as eager's are (mean abs error within 1.5x of eager's), and the sinks
    (16-bit parameters now) get gradients."""
    with torch.no_grad():
        want = model32(ids).logits
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_checkpoint_dir).to(dtype).eval()
    assert model.model.layers[0].self_attn.sinks.dtype == dtype
    with torch.no_grad():
        eager = model(ids).logits.float()
    _, grads = gradients(model, ids, sparse=True)
    I.enable_sparse_prefill(model, backend="reference")
    with torch.no_grad():
        ours = model(ids).logits.float()
    assert torch.isfinite(ours).all()
    assert (ours - want).abs().mean() <= 1.5 * (eager - want).abs().mean()
    sink_grad = grads["model.layers.2.self_attn.sinks"]
    assert sink_grad.dtype == dtype and sink_grad.abs().sum() > 0


def test_checkpointing_refuses_a_cache_with_tokens(model32, ids):
    cache = DynamicCache(config=model32.config)
    I.enable_sparse_prefill(model32, backend="reference")
    try:
        with torch.no_grad():
            model32(ids[:, :10], past_key_values=cache, use_cache=True)
        model32.activation_checkpointing_enable()
        model32.train()
        with pytest.raises(ValueError, match="past_key_values: holds 10 tokens, but with gradient checkpointing"):
            model32(ids[:, 10:20], past_key_values=cache, labels=ids[:, 10:20])
        empty = DynamicCache(config=model32.config)
        model32(ids[:, :20], past_key_values=empty, labels=ids[:, :20])
        assert empty.get_seq_length() == 0  # left untouched, as transformers' checkpointed layers leave it
    finally:
        model32.activation_checkpointing_disable()
        model32.eval()
        I.disable_sparse_prefill(model32)


def test_a_layer_run_twice_replays_its_input_state_or_refuses(model32, ids):
    """A second call of a layer in one forward (what a checkpoint's recomputation is) replays the
    state the first call saw when a gradient is recorded, and is refused otherwise."""
    attn = model32.model.layers[2].self_attn  # CSA: window, compressor, indexer and overlap state
    seen = []

    def again(module, args, kwargs, output):
        seen.append((output[0], module.forward(*args, **kwargs)[0]))

    I.enable_sparse_prefill(model32, backend="reference")
    try:
        with torch.no_grad():
            want = model32(ids).logits
        handle = attn.register_forward_hook(again, with_kwargs=True)
        try:
            got = model32(ids).logits  # grad mode: replayable
            assert torch.equal(seen[0][0], seen[0][1]) and torch.equal(got, want)
            with torch.no_grad(), pytest.raises(RuntimeError, match="layer 2: called twice in one forward"):
                model32(ids)
        finally:
            handle.remove()
    finally:
        I.disable_sparse_prefill(model32)
