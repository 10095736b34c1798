"""Third-party noise, silenced at its source: the few log records named here, never the user's warnings.

Every stage that builds a Hugging Face model imports torchao (transformers does, where it is installed), and
torchao's first import logs lines nobody can act on. Each is dropped by a filter on the logger that emits it,
matched on its message, so that any other record of those loggers, and every ``warnings.warn``, still shows.

- logger ``torchao``: ``Failed to load .../torchao/_C_*.so: ...``, a native extension built for another CUDA or
  Python. float8 training here calls ``torch._scaled_mm``, none of these.
- logger ``torch.utils._pytree``: ``<enum '...'> is an Enum subclass and is now natively supported ...
  register_constant() ... deprecated``, for an Enum of torchao's only. torchao 0.18 registers its enums the older
  way; torch 2.13 says so once per enum, per process.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

_EXTENSION = re.compile(r"^Failed to load \S*[/\\]torchao[/\\]_C\w*[^/\\]*\.(so|pyd|dylib)\b")


def _torchao_extension(record: logging.LogRecord) -> bool:
    return bool(_EXTENSION.match(record.getMessage()))


def _torchao_enum(record: logging.LogRecord) -> bool:
    args = record.args if isinstance(record.args, tuple) else ()
    module = getattr(args[0], "__module__", "") if args else ""
    text = str(record.msg)
    ours = module == "torchao" or module.startswith("torchao.")
    return ours and "is an Enum subclass" in text and "register_constant()" in text


NOISE: dict[str, Callable[[logging.LogRecord], bool]] = {
    "torchao": _torchao_extension,
    "torch.utils._pytree": _torchao_enum,
}
"""Logger name -> the records of it that are noise."""


class _Drop(logging.Filter):
    def __init__(self, noise: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__()
        self.noise = noise

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.noise(record)


def silence_third_party_noise() -> None:
    """Install the filters of ``NOISE`` (once per process; imports nothing: the loggers exist before their libraries)."""
    for name, noise in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(noise))
