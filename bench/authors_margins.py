"""The adaptive margins against their authors' released code, on the same inputs.

Usage::

    python bench/authors_margins.py --src AdaFace CurricularFace MagFace ElasticFace

``--src`` takes checkouts of mk-minchul/AdaFace (``head.py``), HuangYG123/CurricularFace
(``head/metrics.py``), IrvingMeng/MagFace (``models/magface.py``) and fdbtrs/ElasticFace
(``utils/losses.py``), recognised by those files; each module is read from the checkout (never
copied into this repository) and runs on the CPU, its ``.cuda()`` calls removed at load time.
One process, ``head.sample_rate`` 1 (every class in the softmax), fp32: for each margin the
authors' head and ``PartialFC`` with ``build_margin`` take the same embeddings (un-normalised,
norms spread over MagFace's [l_a, u_a]), the same class matrix and labels for ``--steps``
training forwards with new embeddings each, so the EMAs (AdaFace's norm moments,
CurricularFace's t) evolve as in training. ElasticFace's draws are ours
(``partial_fc.margins.elasticface.elastic_generator``) handed to the authors' code in place of
its ``torch.normal``. Printed per margin: the largest relative difference over the steps of the
loss, of the embedding gradient and of the class-matrix gradient (each gradient's difference
relative to its largest entry), and the commit of each checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from partial_fc import PartialFC, build_margin
from partial_fc.margins.elasticface import elastic_generator

N, C, D = 64, 50, 32
FILES = {"adaface": "head.py", "curricularface": "head/metrics.py",
         "magface": "models/magface.py", "elasticface": "utils/losses.py"}


def load(path: Path) -> types.ModuleType:
    """``path`` as a module, its ``.cuda(...)`` calls removed; imports it cannot satisfy here
    (MagFace's backbone module and ``termcolor``, unused by the head) are stubs."""
    text = re.sub(r"\.cuda\([^()]*\)", "", path.read_text())
    module = types.ModuleType(f"authors_{path.stem}")
    module.__file__ = str(path)
    stubs = {"termcolor": types.SimpleNamespace(cprint=print),
             "models": types.SimpleNamespace(iresnet=None), "models.iresnet": None}
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        exec(compile(text, str(path), "exec"), module.__dict__)  # noqa: S102 - the user's checkout
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module


def commit(src: Path) -> str:
    out = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True,
                         text=True, check=False)
    return out.stdout.strip() or "(not a git checkout)"


def batches(steps: int) -> Iterator[tuple[Tensor, Tensor]]:
    """``steps`` batches of embeddings with norms over [6, 120] and labels (repeats)."""
    g = torch.Generator().manual_seed(0)
    for k in range(steps):
        x = torch.randn(N, D, generator=g)
        x = x / x.norm(dim=1, keepdim=True) * torch.empty(N, 1).uniform_(6, 120, generator=g)
        yield x * (1 + 0.1 * k), torch.randint(0, C, (N,), generator=g)


def class_matrix() -> Tensor:
    return torch.randn(C, D, generator=torch.Generator().manual_seed(1))


def ours(cfg: dict, steps: int) -> list[tuple[float, Tensor, Tensor]]:
    head = PartialFC(D, C, build_margin(cfg), kernel="torch")
    with torch.no_grad():
        head.weight.copy_(class_matrix())
    out = []
    for x, y in batches(steps):
        x = x.clone().requires_grad_()
        head.weight.grad = None
        loss = head(x, y)
        loss.backward()
        out.append((loss.item(), x.grad, head.weight.grad.to_dense()))
    return out


def theirs(step: Callable[[Tensor, Tensor], Tensor], kernel: Tensor,
           steps: int) -> list[tuple[float, Tensor, Tensor]]:
    """``step(x, y)`` -> the authors' loss of raw embeddings ``x``; ``kernel`` ``[D, C]``."""
    out = []
    for x, y in batches(steps):
        x = x.clone().requires_grad_()
        kernel.grad = None
        loss = step(x, y)
        loss.backward()
        out.append((loss.item(), x.grad, kernel.grad.t()))
    return out


def _kernel(head: torch.nn.Module, name: str) -> Tensor:
    kernel = getattr(head, name)
    with torch.no_grad():
        kernel.copy_(class_matrix().t())
    return kernel


def adaface(mod, steps, **kw):
    with contextlib.redirect_stdout(sys.stderr):  # its constructor prints its settings
        head = mod.AdaFace(embedding_size=D, classnum=C, m=0.4, h=0.333, s=64.0, t_alpha=0.01)

    def step(x, y):  # the AdaFace backbone returns x / ||x|| and ||x|| (its net.py)
        norm = x.norm(dim=1, keepdim=True)
        return F.cross_entropy(head(x / norm, norm, y), y)
    return theirs(step, _kernel(head, "kernel"), steps)


def curricularface(mod, steps, **kw):
    head = mod.CurricularFace(D, C, m=0.5, s=64.0)
    return theirs(lambda x, y: F.cross_entropy(head(x, y)[0], y), _kernel(head, "kernel"), steps)


def magface(mod, steps, easy_margin=True, **kw):
    l_a, u_a, l_m, u_m, lambda_g = 10.0, 110.0, 0.45, 0.8, 35.0  # run/run.sh
    fc = mod.MagLinear(D, C, scale=64.0, easy_margin=easy_margin)
    loss = mod.MagLoss(l_a, u_a, l_m, u_m)

    def margin(a):  # SoftmaxBuilder._margin
        return (u_m - l_m) / (u_a - l_a) * (a - l_a) + l_m

    def step(x, y):
        logits, x_norm = fc(x, margin, l_a, u_a)
        loss_id, loss_g, _ = loss(logits, y, x_norm)
        return loss_id + lambda_g * loss_g  # run/trainer.py
    return theirs(step, _kernel(fc, "weight"), steps)


@contextlib.contextmanager
def our_draws(m: float, sigma: float) -> Iterator[None]:
    """``torch.normal`` returns the draws ``build_margin``'s ElasticFace makes at the same
    step, in the authors' ``[N, 1]`` shape."""
    real, calls = torch.normal, iter(range(1 << 30))

    def normal(mean, std, size, device=None):
        draws = torch.randn(size[0], generator=elastic_generator(next(calls), 0),
                            dtype=torch.float64) * sigma + m
        return draws.float().reshape(size).to(device)
    torch.normal = normal
    try:
        yield
    finally:
        torch.normal = real


def elasticface(mod, steps, kind="arc", plus=False, m=0.5, sigma=0.05, **kw):
    cls = mod.ElasticArcFace if kind == "arc" else mod.ElasticCosFace
    head = cls(D, C, s=64.0, m=m, std=sigma, plus=plus)
    with our_draws(m, sigma):
        return theirs(lambda x, y: F.cross_entropy(head(x, y), y), _kernel(head, "kernel"), steps)


# name -> (the authors' repository, their head, its keyword arguments, our config)
CASES = {
    "adaface": ("adaface", adaface, {}, dict(type="adaface")),
    "curricularface": ("curricularface", curricularface, {}, dict(type="curricularface")),
    "magface": ("magface", magface, {}, dict(type="magface")),
    "magface easy_margin=false": ("magface", magface, dict(easy_margin=False),
                                  dict(type="magface", easy_margin=False)),
    "elasticface_arc": ("elasticface", elasticface, dict(kind="arc"),
                        dict(type="elasticface_arc")),
    "elasticface_cos": ("elasticface", elasticface, dict(kind="cos", m=0.35),
                        dict(type="elasticface_cos")),
    "elasticface_arc_plus": ("elasticface", elasticface,
                             dict(kind="arc", plus=True, sigma=0.0175),
                             dict(type="elasticface_arc_plus")),
    "elasticface_cos_plus": ("elasticface", elasticface,
                             dict(kind="cos", plus=True, m=0.35, sigma=0.02),
                             dict(type="elasticface_cos_plus")),
}


def relative(a: Tensor, b: Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def compare(got, want) -> tuple[float, float, float]:
    """The largest relative difference over the steps of the loss and both gradients."""
    rel = [(abs(g[0] - w[0]) / abs(w[0]), relative(g[1], w[1]), relative(g[2], w[2]))
           for g, w in zip(got, want, strict=True)]
    return tuple(max(r[i] for r in rel) for i in range(3))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", nargs="+", type=Path, required=True, metavar="DIR",
                   help="checkouts of the authors' repositories")
    p.add_argument("--steps", type=int, default=4, help="training forwards per margin")
    args = p.parse_args(argv)
    found = {}
    for src in args.src:
        for repo, rel in FILES.items():
            path = src / rel
            if path.is_file() and repo not in found and (
                    repo != "adaface" or "class AdaFace" in path.read_text()):
                found[repo] = (load(path), commit(src), src)
    missing = sorted(set(FILES) - set(found))
    if missing:
        print(f"note: no checkout given for {', '.join(missing)}", file=sys.stderr)
    torch.manual_seed(0)
    print(f"N={N} C={C} D={D}, {args.steps} steps, fp32, CPU, sample_rate 1")
    print(f"{'margin':28} {'loss':>9} {'d emb':>9} {'d W':>9}  authors' code")
    for name, (repo, fn, kw, cfg) in CASES.items():
        if repo not in found:
            continue
        module, sha, src = found[repo]
        diff = compare(ours(cfg, args.steps), fn(module, args.steps, **kw))
        print(f"{name:28} {diff[0]:9.1e} {diff[1]:9.1e} {diff[2]:9.1e}  {src.name}@{sha[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
