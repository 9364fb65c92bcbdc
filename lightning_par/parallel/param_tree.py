"""A bare module tree holding given parameters under given dotted names.

`torch.distributed.checkpoint` and optimizer-state helpers key state by ``named_parameters()`` of a module. Where
the parameters an engine steps (ZeRO-1/2 masters, a pipeline's tied copies) must be seen under other names than
the model's own, a tree of empty ``nn.Module`` nodes registers them under those names, without copying.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def parameter_tree(named: Iterable[tuple[str, nn.Parameter]]) -> nn.Module:
    """An ``nn.Module`` whose ``named_parameters()`` are ``named``, in order, with empty modules as the path nodes.

    Args:
        named: (dotted name, parameter) pairs; the parameters are registered as they are (shared, not copied).
    """
    root = nn.Module()
    for name, param in named:
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, param)
    return root
