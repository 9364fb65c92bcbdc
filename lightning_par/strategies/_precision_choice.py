"""Let our strategies choose their precision plugin, as Lightning's own FSDP and DeepSpeed strategies do.

Lightning picks the precision plugin in ``_AcceleratorConnector._check_and_init_precision`` with ``isinstance``
checks for its built-in strategies only, and on CPU it silently turns ``16-mixed`` into ``bf16-mixed``. Lightning
has no hook for third-party strategies here, so we wrap that one method: for a strategy that defines
``precision_plugin_for(flag, device)`` it asks the strategy; for every other strategy it is unchanged.
``tests/test_precision.py`` fails if a Lightning upgrade moves this method.
"""

from __future__ import annotations

import functools
from typing import Any

from lightning_par import _compat

_PATCHED = "_lightning_par_patched"


def install() -> None:
    """Wrap the connector's precision choice once per process (idempotent)."""
    original = _compat.connector_precision_choice()
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def choose_precision(self: Any) -> Any:
        choose = getattr(getattr(self, "strategy", None), "precision_plugin_for", None)
        if choose is None:
            return original(self)
        plugin_flag, accelerator_flag, precision_flag = _compat.connector_flags(self)
        if plugin_flag is not None:
            return original(self)
        device = "cuda" if accelerator_flag in ("cuda", "gpu") else "cpu"
        return choose(precision_flag, device)

    setattr(choose_precision, _PATCHED, True)
    _compat.set_connector_precision_choice(choose_precision)
