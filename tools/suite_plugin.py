"""pytest plugin for a run of transformers' own DeepSeek-V4 model tests (`tools.transformers_suite`).

Loaded with `-p tools.suite_plugin` in a pytest run inside the assembled transformers test tree.
Environment:
  DSV4_SUITE_MODE    "ours": every DeepSeek-V4 model the tests call runs through
                     `dsv4_torch.hf.enable_sparse_prefill(model, backend=$DSV4_SUITE_BACKEND)`;
                     "plain": transformers as it is (the baseline). Both record outcomes.
  DSV4_SUITE_BACKEND the backend for "ours" (default "reference").
  DSV4_SUITE_REPORT  where to write the JSON report: per test id its outcome ("passed", "failed",
                     "skipped"; a test with a failed subtest counts as failed) and the first
                     failure's exception line; plus how many models and layer calls ran our path.

"ours" enables the path when a model is first called (the `__call__` of DeepseekV4PreTrainedModel),
not in `__init__`: a test that inspects a freshly built model's config sees it as transformers
built it, and every forward, `generate` included, runs through our path.
"""

from __future__ import annotations

import json
import os

_outcomes: dict[str, dict] = {}
_counts = {"models_enabled": 0, "sparse_layer_calls": 0}


def pytest_configure(config):
    if os.environ.get("DSV4_SUITE_MODE", "ours") != "ours":
        return
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    from dsv4_torch.hf import integration
    from dsv4_torch.hf import layer as hf_layer

    backend = os.environ.get("DSV4_SUITE_BACKEND", "reference")
    call = m.DeepseekV4PreTrainedModel.__call__

    def __call__(self, *args, **kwargs):
        if isinstance(self, (m.DeepseekV4Model, m.DeepseekV4ForCausalLM)) and not integration.is_sparse_prefill_enabled(
            self
        ):
            integration.enable_sparse_prefill(self, backend=backend)
            _counts["models_enabled"] += 1
        return call(self, *args, **kwargs)

    layer = hf_layer.sparse_layer

    def counted(*args, **kwargs):
        _counts["sparse_layer_calls"] += 1
        return layer(*args, **kwargs)

    m.DeepseekV4PreTrainedModel.__call__ = __call__
    hf_layer.sparse_layer = counted


def _first_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message).splitlines()[0] if crash.message else ""
    return str(report.longrepr).strip().splitlines()[-1] if report.longrepr else ""


def pytest_runtest_logreport(report):
    rec = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if report.failed:
        if rec["outcome"] != "failed":
            rec["outcome"], rec["message"] = "failed", _first_line(report)
    elif (
        report.skipped
        and report.when in ("setup", "call")
        and rec["outcome"] == "passed"
        and not getattr(report, "context", None)
    ):
        rec["outcome"] = "skipped"


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("DSV4_SUITE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"tests": _outcomes, **_counts}, f, indent=1, sort_keys=True)
