"""What the test forkserver imports once per session before it forks ranks (tests/forked.py): everything a rank of
`tests/_worker.py` imports, and the model code of the Hugging Face families most jobs build."""

from __future__ import annotations

import contextlib

import _worker  # noqa: F401  (torch, Lightning, lightning_par and the reference models)

with contextlib.suppress(ImportError):  # transformers is a dev extra
    import transformers.models.llama.modeling_llama
    import transformers.models.mixtral.modeling_mixtral  # noqa: F401
