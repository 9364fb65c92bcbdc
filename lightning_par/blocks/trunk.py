"""Find the trunk of repeated blocks in a model the user wrote.

The trunk is the container (``ModuleList``, ``Sequential`` or ``ModuleDict``) whose children are at least two
modules of one class and that holds the most parameters among such containers. Containers of composite blocks
win over containers of leaf modules: the token and position embeddings of a small-width, large-vocabulary model
are two ``nn.Embedding``s that can outweigh every transformer block together. ZeRO-3 wraps each block as one
communication unit, activation checkpointing recomputes whole blocks, and the pipeline cuts between blocks.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclasses.dataclass(frozen=True)
class Trunk:
    """The repeated blocks of a model.

    Args:
        path: qualified name of the container (``"transformer.h"``).
        names: qualified names of the blocks, in execution order.
        blocks: the block modules, in the same order.
    """

    path: str
    names: tuple[str, ...]
    blocks: tuple[nn.Module, ...]

    def calls(self, order: Sequence[int]) -> Trunk:
        """The trunk as one forward runs it: an entry per call of a block, ``order`` giving the block of each call
        (ALBERT's one layer called at every depth: ``[0, 0, 0, 0]``; a recurrent-depth loop: ``[0, 1, 0, 1]``). A
        block called more than once appears at each of its calls, the same module under the same name."""
        return Trunk(self.path, tuple(self.names[i] for i in order), tuple(self.blocks[i] for i in order))

    @property
    def repeated(self) -> dict[str, nn.Module]:
        """The blocks that appear more than once (a trunk of calls, `calls`), by name, in first-call order."""
        seen = Counter(self.names)
        return {n: b for n, b in zip(self.names, self.blocks) if seen[n] > 1}


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _one_block(child: nn.Module, total: int) -> bool:
    # A block of its own: composite, with matrices (not a lone norm), holding a quarter of the model or more.
    return (
        not isinstance(child, _CONTAINERS)
        and any(True for _ in child.children())
        and any(p.dim() >= 2 for p in child.parameters())
        and 4 * _numel(child) >= total
    )


def find_trunk(model: nn.Module) -> Trunk | None:
    """Return the model's trunk, or ``None`` when it has no container of >= 2 same-class blocks and none of one
    composite block (the trunk of a one-layer model, or of a model that calls one layer at every depth).

    Args:
        model: any module; it is only inspected.
    """
    best: tuple[tuple[bool, int], Trunk] | None = None
    single: tuple[int, Trunk] | None = None
    total = _numel(model)
    for path, container in model.named_modules():
        if not isinstance(container, _CONTAINERS):
            continue
        children = list(container.named_children())
        if len(children) == 1 and _one_block(children[0][1], total):
            # One composite block: a model of one layer, or one layer's weights called at every depth (ALBERT).
            # The innermost such container wins a tie (ALBERT's layer, not the group around it).
            name, child = children[0]
            one = Trunk(path, (f"{path}.{name}" if path else name,), (child,))
            if single is None or _numel(child) >= single[0]:
                single = (_numel(child), one)
            continue
        if len(children) < 2:
            continue
        prefix = f"{path}." if path else ""
        if isinstance(children[0][1], _CONTAINERS):
            # Lists of lists (x-transformers: each depth a list of [norms, block, residual]): the trunk is each
            # entry's one composite module with matrices, when every entry has exactly one.
            nested = _nested_blocks(children, prefix)
            if nested is not None:
                score = (True, sum(_numel(b) for b in nested.blocks))
                if best is None or score > best[0]:
                    best = (score, nested)
            continue
        kinds = Counter(type(child) for _, child in children)
        kind, count = kinds.most_common(1)[0]
        # A trunk is made of one repeated block class (a final norm in a Sequential must not count).
        if count < 2:
            continue
        picked = [(name, child) for name, child in children if type(child) is kind]
        trunk = Trunk(path, tuple(prefix + name for name, _ in picked), tuple(child for _, child in picked))
        composite = any(True for _ in picked[0][1].children())
        score = (composite, sum(_numel(child) for _, child in picked))
        if best is None or score > best[0]:
            best = (score, trunk)
    if best is None:
        return None if single is None else single[1]
    return best[1]


def _nested_blocks(children: list[tuple[str, nn.Module]], prefix: str) -> Trunk | None:
    """The blocks of a container whose children are containers, one block per child: the child's only composite
    module with matrices (the rest being norms, residual functions, ``None``); ``None`` when a child has none or
    several, or the blocks are fewer than two."""
    names, blocks = [], []
    for name, entry in children:
        if not isinstance(entry, _CONTAINERS):
            return None
        inner = [(n, m) for n, m in entry.named_children() if not isinstance(m, _CONTAINERS)
                 and any(True for _ in m.children()) and any(p.dim() >= 2 for p in m.parameters())]  # fmt: skip
        if len(inner) != 1:
            return None
        names.append(f"{prefix}{name}.{inner[0][0]}")
        blocks.append(inner[0][1])
    return Trunk(prefix.rstrip("."), tuple(names), tuple(blocks)) if len(blocks) >= 2 else None


def trunk_at(model: nn.Module, path: str) -> Trunk | None:
    """The trunk whose container is ``model``'s submodule ``path`` (its blocks: the children of its most common
    class), or ``None`` when there is no such container."""
    try:
        container = model.get_submodule(path)
    except AttributeError:
        return None
    if not isinstance(container, _CONTAINERS):
        return None
    children = list(container.named_children())
    if not children:
        return None
    prefix = f"{path}." if path else ""
    if isinstance(children[0][1], _CONTAINERS):
        return _nested_blocks(children, prefix)
    kind = Counter(type(child) for _, child in children).most_common(1)[0][0]
    picked = [(name, child) for name, child in children if type(child) is kind]
    return Trunk(path, tuple(prefix + name for name, _ in picked), tuple(child for _, child in picked))


def named_trunk(model: nn.Module, path: str) -> Trunk:
    """The trunk the user named (``ParallelStrategy(trunk="model.layers")``): the container at ``path``, its blocks
    the children of its most common class (or, in a list of lists, each entry's one composite module).

    Raises:
        ValueError: ``path`` names no ``ModuleList`` / ``Sequential`` / ``ModuleDict`` of >= 1 block, listing
            the containers the model has.
    """
    trunk = trunk_at(model, path)
    if trunk is not None and trunk.blocks:
        return trunk
    found = [n for n, m in model.named_modules() if isinstance(m, _CONTAINERS) and n and len(list(m.children())) > 1]
    raise ValueError(
        f"trunk={path!r} is not a ModuleList / Sequential / ModuleDict of blocks in {type(model).__name__}; its "
        f"containers of several modules: {', '.join(found[:8]) or 'none'}"
    )


def other_trunks(model: nn.Module, main: str, share: float = 0.1) -> list[Trunk]:
    """Containers of >= 2 same-class composite blocks with matrices outside the trunk at ``main`` and not inside one
    another, each holding at least ``share`` of the model's parameters: an encoder-decoder's encoder (T5's
    ``encoder.block``, BART's ``encoder.layers``), a vision tower. Largest first."""
    total = _numel(model)
    found: list[tuple[int, Trunk]] = []
    for path, container in model.named_modules():
        if not isinstance(container, _CONTAINERS) or path == main:
            continue
        if _within(path, main) or _within(main, path) or any(_within(path, t.path) for _, t in found):
            continue
        trunk = trunk_at(model, path)
        if trunk is None or len(trunk.blocks) < 2 or isinstance(trunk.blocks[0], _CONTAINERS):
            continue
        size = sum(_numel(b) for b in trunk.blocks)
        if any(True for _ in trunk.blocks[0].children()) and any(
            p.dim() >= 2 for p in trunk.blocks[0].parameters()
        ) and size >= share * total:  # fmt: skip
            found.append((size, trunk))
    return [t for _, t in sorted(found, key=lambda st: -st[0])]


def _within(path: str, root: str) -> bool:
    return not root or path == root or path.startswith(root + ".")
