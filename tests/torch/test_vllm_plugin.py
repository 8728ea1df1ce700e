"""The vLLM plugin's own logic, without vLLM installed (the default run): version checks, modes,
the signature guards, and the chunk plan on a metadata object with vLLM's prefill fields.

What needs vLLM itself (its loader, its real classes, its own plan to compare against) stays in
tests/vllm/ (`make test-vllm`). Here the reference for the tuples is `planner.get_prefill_chunk_plan`,
which tests/planner/test_planner.py and tests/vllm/ check against vLLM's plan.
"""

from __future__ import annotations

import logging
import sys
import types

import numpy as np
import pytest
import torch

import planner
from dsv4_torch.vllm import _import_hooks, chunk_plan, plugin


class Metadata:
    """The fields of vLLM 0.33.0's DeepseekSparseSWAMetadata the plan reads, with the plugin's method."""

    get_prefill_chunk_plan = chunk_plan.get_prefill_chunk_plan

    def __init__(self, seq_lens, query_lens, *, window_size, max_model_len, max_num_batched_tokens):
        self.prefill_seq_lens_cpu = torch.as_tensor(np.asarray(seq_lens, dtype=np.int32))
        self.prefill_query_lens_cpu = torch.as_tensor(np.asarray(query_lens, dtype=np.int32))
        self.num_prefills = len(seq_lens)
        self.num_prefill_tokens = int(np.sum(query_lens))
        self.prefill_window_size = window_size
        self.prefill_max_model_len = max_model_len
        self.prefill_max_num_batched_tokens = max_num_batched_tokens


LIMITS = dict(window_size=64, max_model_len=16384, max_num_batched_tokens=4096)


# ----------------------------------------------------------------------------- versions and modes


@pytest.fixture
def fresh(monkeypatch):
    """register() as in a new process, its import hooks recorded instead of installed."""
    monkeypatch.setattr(plugin, "_registered", False)
    hooks = []
    monkeypatch.setattr(_import_hooks, "when_imported", lambda name, hook: hooks.append((name, hook)))
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    return monkeypatch, hooks


def test_checked_release_and_local_builds_only():
    assert plugin.is_supported("0.33.0") and plugin.is_supported("0.33.0+cu130")
    for v in ("0.33.1", "0.33.0rc1", "0.34.0", "0.32.1", None):
        assert not plugin.is_supported(v), v


def test_register_on_a_checked_version_arranges_the_patches(fresh):
    m, hooks = fresh
    m.setattr(plugin, "vllm_version", lambda: "0.33.0")
    assert plugin.register() is True and plugin._registered
    assert [name for name, _ in hooks] == [
        plugin.SPARSE_SWA_MODULE,
        plugin.INDEXER_MODULE,
        plugin.SPARSE_INDEXER_MODULE,
    ] + [mod for mod, _, _ in plugin.PREFILL_CONSUMERS]
    assert plugin.register() is True and len(hooks) == 3 + len(plugin.PREFILL_CONSUMERS)  # idempotent
    assert not any(name == "vllm" or name.startswith("vllm.") for name in sys.modules)  # nothing of vLLM imported


def test_other_version_changes_nothing_and_warns(fresh, caplog):
    m, hooks = fresh
    m.setattr(plugin, "vllm_version", lambda: "0.34.0")
    with caplog.at_level(logging.WARNING, logger="vllm.dsv4_prefill"):
        assert plugin.register() is False
    assert "found vLLM 0.34.0" in caplog.text and "0.33.0" in caplog.text
    assert hooks == [] and not plugin._registered


def test_modes(fresh):
    m, hooks = fresh
    m.setattr(plugin, "vllm_version", lambda: "0.32.1")
    m.setenv(plugin.ENV_VAR, "require")
    with pytest.raises(plugin.UnsupportedVLLMVersionError, match=r"found vLLM 0\.32\.1.*=require"):
        plugin.register()
    m.setenv(plugin.ENV_VAR, "off")
    m.setattr(plugin, "vllm_version", lambda: "0.33.0")
    assert plugin.register() is False and hooks == []
    m.setenv(plugin.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match=plugin.ENV_VAR):
        plugin.register()


# ----------------------------------------------------------------------------- signature guards


def test_indexer_plan_patched_only_with_vllms_signature():
    from dsv4_torch.vllm import indexer_plan

    class Good:
        @staticmethod
        def _split_indexer_prefill_chunks(
            compressed_seq_lens_cpu, prefill_query_lens_cpu, workspace_size, max_logits_bytes, request_offset=0
        ):
            return "vllm's"

    theirs = Good.__dict__["_split_indexer_prefill_chunks"].__func__
    plugin._patch_indexer_plan(types.SimpleNamespace(__name__="vllm.fake", DeepseekV32IndexerMetadataBuilder=Good))
    assert Good._split_indexer_prefill_chunks is indexer_plan.split_indexer_prefill_chunks
    assert plugin.original(Good._split_indexer_prefill_chunks) is theirs
    assert Good._split_indexer_prefill_chunks([4, 4], [1, 2], 100, 1 << 20) == [(slice(0, 2), slice(0, 3))]

    class Changed:
        @staticmethod
        def _split_indexer_prefill_chunks(compressed_seq_lens_cpu, prefill_query_lens_cpu, workspace_size):
            return []

    fake = types.SimpleNamespace(__name__="vllm.fake", DeepseekV32IndexerMetadataBuilder=Changed)
    with pytest.raises(plugin.UnsupportedVLLMVersionError, match="_split_indexer_prefill_chunks takes"):
        plugin._patch_indexer_plan(fake)
    with pytest.raises(plugin.UnsupportedVLLMVersionError, match="no static DeepseekV32IndexerMetadataBuilder"):
        plugin._patch_indexer_plan(types.SimpleNamespace(__name__="vllm.fake"))


def test_sparse_indexer_lens_patched_only_with_vllms_signature():
    """DeepSeek-V4.1's sparse-logits builder: its clamp becomes KeysAtLeast for our split; a
    subclass with a split of its own keeps vLLM's clamp."""
    from dsv4_torch.vllm import indexer_plan
    from planner.indexer_plan import KeysAtLeast

    class Builder:
        _split_indexer_prefill_chunks = staticmethod(indexer_plan.split_indexer_prefill_chunks)
        min_split_seq_len = 8192

        def _prefill_split_seq_lens(self, seq_lens_cpu):
            return seq_lens_cpu.clamp(min=self.min_split_seq_len)

    class OwnSplit(Builder):
        @staticmethod
        def _split_indexer_prefill_chunks(*args, **kwargs):
            return "its own"

    theirs = Builder.__dict__["_prefill_split_seq_lens"]
    fake = types.SimpleNamespace(__name__="vllm.fake", DeepseekV41SparseIndexerMetadataBuilder=Builder)
    plugin._patch_sparse_indexer_lens(fake)
    plugin._patch_sparse_indexer_lens(fake)  # idempotent
    assert Builder._prefill_split_seq_lens is indexer_plan.prefill_split_seq_lens
    assert plugin.original(Builder._prefill_split_seq_lens) is theirs
    lens = torch.tensor([5, 10000, 0], dtype=torch.int32)
    got = Builder()._prefill_split_seq_lens(lens)
    assert isinstance(got, KeysAtLeast) and got.values is lens and got.minimum == 8192
    b = Builder()
    qry = torch.tensor([1000, 1000, 1], dtype=torch.int32)
    assert b._split_indexer_prefill_chunks(b._prefill_split_seq_lens(lens), qry, 1 << 20, 64 << 20) == (
        indexer_plan.split_indexer_prefill_chunks(lens.clamp(min=8192), qry, 1 << 20, 64 << 20)
    )
    assert torch.equal(OwnSplit()._prefill_split_seq_lens(lens), torch.tensor([8192, 10000, 8192]))

    class Changed:
        def _prefill_split_seq_lens(self, seq_lens_cpu, minimum):
            return seq_lens_cpu

    with pytest.raises(plugin.UnsupportedVLLMVersionError, match="_prefill_split_seq_lens takes"):
        plugin._patch_sparse_indexer_lens(
            types.SimpleNamespace(__name__="vllm.fake", DeepseekV41SparseIndexerMetadataBuilder=Changed)
        )
    with pytest.raises(plugin.UnsupportedVLLMVersionError, match="has no DeepseekV41SparseIndexerMetadataBuilder"):
        plugin._patch_sparse_indexer_lens(types.SimpleNamespace(__name__="vllm.fake"))


def test_plan_method_patched_only_with_vllms_signature():
    class Good:
        def get_prefill_chunk_plan(self, compress_ratio, prefill_chunk_size, has_compressed=None):
            return "vllm's"

    theirs = Good.get_prefill_chunk_plan
    plugin._patch_sparse_swa(types.SimpleNamespace(__name__="vllm.fake", DeepseekSparseSWAMetadata=Good))
    assert Good.get_prefill_chunk_plan is chunk_plan.get_prefill_chunk_plan
    assert plugin.original(Good.get_prefill_chunk_plan) is theirs

    class Changed:
        def get_prefill_chunk_plan(self, compress_ratio, prefill_chunk_size):
            return []

    fake = types.SimpleNamespace(__name__="vllm.fake", DeepseekSparseSWAMetadata=Changed)
    with pytest.raises(plugin.UnsupportedVLLMVersionError, match="get_prefill_chunk_plan takes"):
        plugin._patch_sparse_swa(fake)
    assert plugin.original(Changed.get_prefill_chunk_plan) is None
    with pytest.raises(plugin.UnsupportedVLLMVersionError, match="has no DeepseekSparseSWAMetadata"):
        plugin._patch_sparse_swa(types.SimpleNamespace(__name__="vllm.fake"))


def test_consumer_guard_skips_steps_without_prefill_tokens():
    calls = []

    class Attention:
        def _forward_prefill(self, q, swa_metadata, output=None):
            calls.append(swa_metadata.num_prefill_tokens)
            return "ran"

    module = types.SimpleNamespace(__name__="vllm.fake_model", Attention=Attention)
    plugin._guard_consumer(module, cls="Attention", method="_forward_prefill")
    plugin._guard_consumer(module, cls="Attention", method="_forward_prefill")  # idempotent
    a = Attention()
    assert a._forward_prefill(None, types.SimpleNamespace(num_prefill_tokens=0)) is None
    assert a._forward_prefill(None, swa_metadata=types.SimpleNamespace(num_prefill_tokens=5)) == "ran"
    assert calls == [5] and plugin.original(Attention._forward_prefill) is not None

    class NoMetadata:
        def _forward_prefill(self, q, metadata):
            return None

    with pytest.raises(plugin.UnsupportedVLLMVersionError, match="no swa_metadata parameter"):
        plugin._guard_consumer(types.SimpleNamespace(__name__="m", A=NoMetadata), cls="A", method="_forward_prefill")
    with pytest.raises(plugin.UnsupportedVLLMVersionError, match="not found"):
        plugin._guard_consumer(types.SimpleNamespace(__name__="m"), cls="A", method="_forward_prefill")


# ----------------------------------------------------------------------------- the chunk plan


def test_plan_equals_the_planners_tuples_on_random_batches():
    rng = np.random.default_rng(33)
    for _ in range(60):
        n = int(rng.integers(1, 40))
        seq = rng.integers(1, LIMITS["max_model_len"] + 1, n)
        qry = np.minimum(seq, rng.integers(1, 512, n))
        pcs = int(rng.choice([1, 2, 4]))
        for r, hc in [(1, None), (4, None), (128, None), (1, True), (2, True), (4, False)]:
            got = Metadata(seq, qry, **LIMITS).get_prefill_chunk_plan(r, pcs, hc)
            want = planner.get_prefill_chunk_plan(
                seq, qry, compress_ratio=r, prefill_chunk_size=pcs, has_compressed=hc, **LIMITS
            )
            assert got == want, (seq.tolist(), qry.tolist(), r, hc, pcs)


def test_spec_example_and_zero_query_requests():
    seq, qry = [256, 320, 448, 640, 1024, 1536, 3072, 4096, 6144, 8192], [4, 8, 8, 8, 16, 16, 32, 32, 32, 32]
    md = Metadata(seq, qry, **LIMITS)
    assert md.get_prefill_chunk_plan(compress_ratio=4, prefill_chunk_size=4) == [(0, 10, 2048, 2143)]  # vLLM #45061
    assert md.get_prefill_chunk_plan(compress_ratio=1, prefill_chunk_size=4) == [(0, 10, 0, 95)]
    limits = dict(window_size=128, max_model_len=65536, max_num_batched_tokens=8192)
    # a KV-transfer load (no queries) between two prefills never forms or widens a chunk
    md = Metadata([100, 60000, 100], [10, 0, 10], **limits)
    assert md.get_prefill_chunk_plan(4, 4) == [(0, 1, 25, 125), (2, 3, 25, 125)]
    assert Metadata([500, 700], [0, 0], **limits).get_prefill_chunk_plan(4, 4) == []
    assert Metadata([], [], **limits).get_prefill_chunk_plan(4, 4) == []


def test_one_plan_per_kind_per_step(monkeypatch):
    chunk_plan.forget_steps()
    calls = []
    real = chunk_plan.StepPlans.plan
    monkeypatch.setattr(
        chunk_plan.StepPlans, "plan", lambda self, r, pcs, hc: calls.append(r if hc else 0) or real(self, r, pcs, hc)
    )
    ratios = [max(1, spec.compress_ratio) for spec in planner.ModelShape.from_name("V4-Flash").layers]
    assert len(ratios) == 44  # 43 layers and the MTP layer; SWA layers ask with ratio 1
    md = Metadata(
        np.arange(100, 164), np.full(64, 32), window_size=128, max_model_len=1 << 20, max_num_batched_tokens=8192
    )
    plans = [md.get_prefill_chunk_plan(r, 4) for r in ratios]
    assert sorted(calls) == [0, 4, 128] and chunk_plan.step_plans(md).planned == 3
    assert all(p is plans[ratios.index(r)] for r, p in zip(ratios, plans))  # shared within the step
    md.prefill_seq_lens_cpu = torch.full((64,), 1000, dtype=torch.int32)  # vLLM reassigned the field
    assert md.get_prefill_chunk_plan(4, 4) == Metadata(
        np.full(64, 1000), np.full(64, 32), window_size=128, max_model_len=1 << 20, max_num_batched_tokens=8192
    ).get_prefill_chunk_plan(4, 4)


def test_equal_metadata_objects_share_one_step(monkeypatch):
    """DeepSeek-V4.1's replay batch: vLLM builds two metadata objects for the kept rows (the cut's
    and the later layers'), with equal prefill lengths but their own tensors; they share one step's
    plans. Different lengths or limits plan afresh; forget_steps() drops the shared steps."""
    chunk_plan.forget_steps()
    calls = []
    real = chunk_plan.StepPlans.plan
    monkeypatch.setattr(
        chunk_plan.StepPlans, "plan", lambda self, r, pcs, hc: calls.append(r if hc else 0) or real(self, r, pcs, hc)
    )
    seq, qry = np.array([300, 5000, 129, 64]), np.array([300, 200, 129, 1])
    kept = np.minimum(qry, LIMITS["window_size"])  # each request's last min(query_len, W) rows
    batch, cut, past = (Metadata(seq, q, **LIMITS) for q in (qry, kept, kept))
    assert cut.prefill_query_lens_cpu is not past.prefill_query_lens_cpu
    assert [batch.get_prefill_chunk_plan(r, 4, r != 0) for r in (0, 2)] and calls == [0, 2]
    first = cut.get_prefill_chunk_plan(1, 4, True)
    assert [past.get_prefill_chunk_plan(1, 4, True) for _ in range(19)] == [first] * 19
    assert past.get_prefill_chunk_plan(1, 4, True) is first and calls == [0, 2, 1]
    assert chunk_plan.step_plans(cut) is chunk_plan.step_plans(past) is not chunk_plan.step_plans(batch)
    assert first == planner.get_prefill_chunk_plan(
        seq, kept, compress_ratio=1, prefill_chunk_size=4, has_compressed=True, **LIMITS
    )
    # other limits, other lengths: planned afresh
    assert Metadata(seq, kept, **dict(LIMITS, window_size=32)).get_prefill_chunk_plan(1, 4, True) is not first
    assert Metadata(seq + 1, kept, **LIMITS).get_prefill_chunk_plan(1, 4, True) is not first
    assert calls == [0, 2, 1, 1, 1]
    # a binding follows reassigned fields, and the shared step is kept only for a few steps
    past.prefill_query_lens_cpu = torch.as_tensor(qry.astype(np.int32))
    assert past.get_prefill_chunk_plan(2, 4, True) is batch.get_prefill_chunk_plan(2, 4, True)
    for i in range(chunk_plan._RECENT_MAX):
        Metadata(seq + 2 + i, kept, **LIMITS).get_prefill_chunk_plan(1, 4, True)
    assert len(chunk_plan._RECENT) == chunk_plan._RECENT_MAX
    assert Metadata(seq, kept, **LIMITS).get_prefill_chunk_plan(1, 4, True) == first  # evicted: planned again
    assert calls.count(1) == 3 + chunk_plan._RECENT_MAX + 1
    chunk_plan.forget_steps()
    assert not chunk_plan._RECENT


def test_bad_arguments_and_fields():
    md = Metadata([10], [5], window_size=128, max_model_len=1024, max_num_batched_tokens=64)
    for args, match in [
        ((4.0, 4), "compress_ratio"),
        ((4, 4, "yes"), "has_compressed"),
        ((0, 4, True), "compress_ratio"),
        ((4, 2.0), "prefill_chunk_size"),
    ]:
        with pytest.raises(ValueError, match=match):
            md.get_prefill_chunk_plan(*args)
    with pytest.raises(ValueError, match="query_lens"):
        Metadata([10], [11], window_size=128, max_model_len=1024, max_num_batched_tokens=64).get_prefill_chunk_plan(
            4, 4
        )
    md.prefill_seq_lens_cpu = md.prefill_seq_lens_cpu.to("meta")  # not on the host: reading it would sync
    with pytest.raises(ValueError, match="prefill_seq_lens_cpu: expected a CPU tensor"):
        md.get_prefill_chunk_plan(4, 4)
    md = Metadata([10, 20], [5, 5], window_size=128, max_model_len=1024, max_num_batched_tokens=64)
    md.prefill_query_lens_cpu = None
    with pytest.raises(ValueError, match="prefill_query_lens_cpu: None on a step with 2 prefill requests"):
        md.get_prefill_chunk_plan(4, 4)
