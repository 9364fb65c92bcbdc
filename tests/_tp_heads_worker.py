"""Gradients of what tp splits with the heads, under torchrun (2 ranks): ``python _tp_heads_worker.py OUT MODEL...``.

Each model is built twice from one seed: a copy stays whole (the one-process reference, run on every rank) and
the other goes through `lightning_par.parallel.compose.parallelize` with tp=2, then one forward and backward on
the same batch and the run's own gradient reduction (`ParallelRun.after_backward`, what the strategy calls before
clipping). Every parameter's gradient must then be laid out as its parameter (a Partial gradient left unsummed
fails here) and equal the reference's: a per-head norm's weight gradient summed over the heads of both ranks, a
full-width norm's and the ``sinks``' gradients this rank's slice. Rank 0 writes, per model, the relative error of
the loss and of each gradient, and the styles applied.
"""

from __future__ import annotations

import copy
import sys

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _job_models import MODELS  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from lightning_par.config import ParallelConfig  # noqa: E402
from lightning_par.mesh import build_mesh  # noqa: E402
from lightning_par.parallel.compose import parallelize  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if hasattr(out, "loss"):  # Hugging Face MoE families: the model's own loss, aux term included
        return out.loss
    return F.cross_entropy(out[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def main() -> None:
    dist.init_process_group("gloo")
    out_path, names = sys.argv[1], sys.argv[2:]
    config = ParallelConfig(tp=2).resolve(dist.get_world_size())
    mesh = build_mesh(config, "cpu")
    results: dict[str, dict[str, object]] = {}
    for name in names:
        torch.manual_seed(0)
        model = MODELS[name]()
        ref = copy.deepcopy(model)
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        ref_loss = _loss(ref, x)
        ref_loss.backward()
        run = parallelize(model, mesh, config)
        loss = _loss(run.model, x)
        loss.backward()
        run.after_backward(False)
        grads: dict[str, float] = {}
        ref_grads = dict(ref.named_parameters())
        layouts: dict[str, str] = {}
        for pname, p in model.named_parameters():
            g = p.grad
            assert g is not None, pname
            if isinstance(g, DTensor):
                assert isinstance(p, DTensor)
                layouts[pname] = str(p.placements)
                # Laid out as the parameter: a Partial left over would be a sum nobody did.
                assert g.placements == p.placements, (pname, g.placements, p.placements)
                g = g.full_tensor()
            grads[pname] = _rel(g, ref_grads[pname].grad)
        results[name] = {"loss": _rel(loss.detach(), ref_loss.detach()), "grads": grads, "layouts": layouts}
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    clean_exit()


if __name__ == "__main__":
    main()
