"""What this torch can do, asked of torch itself (a feature, not a version number), where the oldest torch the pipeline
runs on (2.4, ``pyproject.toml``) lacks something the newest has. ``scripts/oldest_torch.sh`` runs the tests on 2.4.1.

Imports no more of torch than the question needs.
"""

from __future__ import annotations

import importlib
import inspect

_FSDP2_PARAM_GROUP = (
    "torch.distributed.fsdp._fully_shard._fsdp_param_group",  # torch 2.6 and later
    "torch.distributed._composable.fsdp._fsdp_param_group",  # torch 2.4, 2.5
)


def fsdp2_runs_on_cpu() -> bool:
    """Whether this torch's FSDP2 (``fully_shard``) trains on the CPU, over gloo.

    It does where FSDP2's communication context makes its streams for the device it is given
    (``FSDPCommContext.lazy_init(device)``, torch 2.6 and later). Before, it made CUDA streams whatever the device:
    torch 2.4's ``init()`` calls ``torch.cuda.Stream`` (a CPU run fails at its first forward, "CUDA driver version is
    insufficient" or a dummy-class error), torch 2.5's ``lazy_init()`` refuses where CUDA is not available. Where the
    class is in neither known place (a torch newer than this check), FSDP2 is taken to run on the CPU, as it has since
    torch 2.6; where torch has no FSDP2 at all, ``distributed.fsdp_api`` says so.
    """
    for name in _FSDP2_PARAM_GROUP:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        context = getattr(module, "FSDPCommContext", None)
        if context is None:
            continue
        lazy_init = getattr(context, "lazy_init", None)
        if lazy_init is None:
            return False
        try:
            return "device" in inspect.signature(lazy_init).parameters
        except (TypeError, ValueError):  # no signature to read: assume the newer form
            return True
    return True
