import os


def pytest_configure(config):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    from dsv4_torch.hf.integration import enable_sparse_prefill, is_sparse_prefill_enabled

    backend = os.environ.get("DSV4_SUITE_BACKEND", "reference")
    call = m.DeepseekV4PreTrainedModel.__call__

    def __call__(self, *args, **kwargs):
        if isinstance(self, (m.DeepseekV4Model, m.DeepseekV4ForCausalLM)) and not is_sparse_prefill_enabled(self):
            enable_sparse_prefill(self, backend=backend)
        return call(self, *args, **kwargs)

    m.DeepseekV4PreTrainedModel.__call__ = __call__
