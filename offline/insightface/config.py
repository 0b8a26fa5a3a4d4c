"""Read an insightface arcface_torch config (a Python file) without running it, and map it.

arcface_torch's ``utils_config.get_config`` imports ``configs/base.py``, then the named file,
and ``dict.update``s the first with the second. Here both are parsed with :mod:`ast`: a
statement is either an import, ``config = edict()`` or ``config.KEY = VALUE`` where VALUE is
a literal or arithmetic over literals and keys assigned before it (``config.num_epoch // 10``);
anything else is reported, one line naming the file, the line and the statement, and nothing
is executed. The merged keys then map onto partial-fc's schema (:data:`MAPPED`); each key with
no counterpart is listed. Besides the keys, the conversion sets what train_v2.py does in code
(:func:`arcface_torch_behaviour`): the scale 64, the straight-through margin gradient, LR
decay power 1, gradient clipping at 5 and the arcface_torch-behaviour options.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data_pipeline.door import read_bytes
from offline.insightface.backbones import ImportRefused, network_keys

LOSS_CAP = -math.log(1e-30)  # DistCrossEntropyFunc: loss.clamp_min_(1e-30).log_()
LARGEST = 2.0**64  # an arithmetic result past this is refused (no count or rate is near it)
MAX_BYTES = 1 << 20  # a config file larger than this is refused before it is parsed
MAX_SIZE = 1 << 16  # characters of a computed string, items of a computed list
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}
# arcface_torch key -> partial-fc dotted key, for the ones that carry over as they are.
MAPPED = {
    "sample_rate": "head.sample_rate", "batch_size": "train.batch_size", "lr": "optim.lr",
    "optimizer": "optim.name", "momentum": "optim.momentum",
    "weight_decay": "optim.weight_decay", "num_epoch": "train.epochs",
    "warmup_epoch": "schedule.warmup_epochs", "embedding_size": "backbone.embedding_size",
    "num_classes": "data.num_classes", "num_image": "data.num_samples", "rec": "data.dir",
    "gradient_acc": "train.grad_accum", "seed": "seed", "num_workers": "data.num_workers",
    "frequent": "log.every", "verbose": "eval.every", "output": "output",
    "interclass_filtering_threshold": "margin.interclass_filter",
}
# Keys read below with a conversion of their own; the rest of arcface_torch's have no
# counterpart and are listed.
_CONVERTED = {"margin_list", "network", "fp16", "dali"}
_INT_KEYS = {"train.epochs", "train.batch_size", "train.grad_accum", "data.num_classes",
             "data.num_samples", "seed", "data.num_workers", "log.every", "eval.every",
             "backbone.embedding_size"}
_FLOAT_KEYS = {"head.sample_rate", "optim.lr", "optim.momentum", "optim.weight_decay",
               "schedule.warmup_epochs", "margin.interclass_filter"}


@dataclass
class Converted:
    """A converted config: the partial-fc tree, where each of its dotted keys came from
    (``file:line``), arcface_torch's network name, and the lines to print (keys without a
    counterpart, notes on conversions that are not one to one)."""

    tree: dict = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    network: str | None = None
    unmapped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def parse_file(path: Path, into: dict[str, Any], errors: list[str],
               lines: dict[str, str]) -> None:
    """Add ``path``'s ``config.KEY = VALUE`` assignments to ``into`` (later ones win, as
    ``dict.update`` would) and each one's ``path:line`` to ``lines``; one error line per
    statement that is anything else."""
    try:
        text = read_bytes(path, "an arcface_torch config", limit=MAX_BYTES, error=ImportRefused)
        module = ast.parse(text.decode(), filename=str(path))
    except ImportRefused as exc:
        errors.append(str(exc))
        return
    except (SyntaxError, UnicodeDecodeError, RecursionError, MemoryError) as exc:
        errors.append(f"{path}: not readable Python ({type(exc).__name__}: "
                      f"{str(exc)[:200]})")
        return
    known: dict[str, tuple[Any, int]] = {}  # key -> (value, its size), for later statements
    for node in module.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring
        if _is_new_config(node):
            continue
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 \
            else None
        if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                and target.value.id == "config"):
            errors.append(f"{path}:{node.lineno}: `{_statement(node)}` is not an assignment "
                          "to config.KEY; not executed, so not converted")
            continue
        try:
            known[target.attr] = _value(node.value, known)
            into[target.attr] = known[target.attr][0]
            lines[target.attr] = f"{path}:{node.lineno}"
        except ValueError:
            errors.append(f"{path}:{node.lineno}: `{_statement(node)}`: the value is not a "
                          "literal or arithmetic over literals and earlier config keys")


def _statement(node: ast.stmt) -> str:
    """A statement as a message quotes it: its first 100 characters."""
    text = ast.unparse(node)
    return text if len(text) <= 100 else f"{text[:97]}..."


def _is_new_config(node: ast.stmt) -> bool:
    """``config = edict()`` (or ``EasyDict()`` / ``dict()``)."""
    return (isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "config"
            and isinstance(node.value, ast.Call) and not node.value.args
            and not node.value.keywords)


def _value(node: ast.expr, known: dict[str, tuple[Any, int]]) -> tuple[Any, int]:
    """A literal, a tuple/list of them, arithmetic over them, or an earlier ``config.KEY``;
    with its size (a string's characters, a list's items counted through its nested lists,
    1 for a number), at most :data:`MAX_SIZE`."""
    if isinstance(node, ast.Constant):
        value = node.value
        return value, len(value) if isinstance(value, str | bytes) else 1
    if isinstance(node, ast.Tuple | ast.List):
        items = [_value(x, known) for x in node.elts]
        return [v for v, _ in items], _sized(1 + sum(n for _, n in items))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _arithmetic(_OPS[type(node.op)], _value(node.operand, known))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _arithmetic(_OPS[type(node.op)], _value(node.left, known),
                           _value(node.right, known))
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "config" and node.attr in known):
        return known[node.attr]
    raise ValueError(ast.unparse(node))


def _sized(size: int) -> int:
    """``size``, or a ``ValueError`` past :data:`MAX_SIZE`."""
    if size > MAX_SIZE:
        raise ValueError(f"a value of {size} characters or items")
    return size


def _arithmetic(op: Any, *args: tuple[Any, int]) -> tuple[Any, int]:
    """``op`` over the values of ``args`` (``(value, size)`` pairs, as :func:`_value` gives
    them) where its cost and size stay those of a config's: numbers under any operator (a
    power above 64, a number past :data:`LARGEST`, a division by zero or an overflow
    refused), strings or lists joined by ``+`` up to :data:`MAX_SIZE`, sized before they are
    joined; anything else, a repeated string (``*``) or one formatted (``%``: ``"%0500000000d"
    % 0`` is 500 MB), is a ``ValueError``. ``10 ** 10 ** 10`` would take the converter's memory
    and hours; arcface_torch's configs hold counts, rates, names and short lists."""
    values = [v for v, _ in args]
    if all(isinstance(v, int | float) for v in values):
        if op is operator.pow and abs(values[1]) > 64:
            raise ValueError(op.__name__)
        try:
            result = op(*values)
        except ArithmeticError as exc:  # 1 / 0, 10.0 ** 400
            raise ValueError(str(exc)) from None
        if abs(result) > LARGEST:
            raise ValueError(op.__name__)
        return result, 1
    if op is operator.add and len(values) == 2 and (
            all(isinstance(v, str) for v in values) or all(isinstance(v, list) for v in values)):
        size = _sized(args[0][1] + args[1][1] - isinstance(values[0], list))
        return op(*values), size
    raise ValueError(op.__name__)


def merged(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """``base.py`` (beside ``path``, if there) updated by ``path``, as get_config merges them,
    and the ``file:line`` each value came from; refuses with every statement it would have
    had to run."""
    values: dict[str, Any] = {}
    errors: list[str] = []
    lines: dict[str, str] = {}
    base = path.parent / "base.py"
    if base.is_file() and base.resolve() != path.resolve():
        parse_file(base, values, errors, lines)
    job: dict[str, Any] = {}
    parse_file(path, job, errors, lines)
    if errors:
        raise ImportRefused("\n".join(errors))
    values.update(job)
    return values, lines


def margin_of(margin_list: Any, where: str, notes: list[str]) -> dict[str, Any]:
    """``CombinedMarginLoss(64, m1, m2, m3)`` as train_v2 builds it: ``m1 == 1, m3 == 0`` is
    ArcFace with ``m2``; ``m3 > 0`` is CosFace with ``m3`` (``m1`` and ``m2`` are then ignored
    by its code); anything else raises there, and is refused here."""
    if not (isinstance(margin_list, list) and len(margin_list) == 3
            and all(isinstance(m, int | float) for m in margin_list)):
        raise ImportRefused(f"{where}: margin_list={margin_list!r} is not three numbers")
    m1, m2, m3 = (float(m) for m in margin_list)
    if m1 == 1.0 and m3 == 0.0:
        return {"type": "arcface", "m": m2, "s": 64.0}
    if m3 > 0:
        if (m1, m2) != (1.0, 0.0):
            notes.append(f"margin_list={margin_list}: arcface_torch applies only m3 when m3 > 0 "
                         f"(CosFace); m1={m1}, m2={m2} are ignored here as there")
        return {"type": "cosface", "m": m3, "s": 64.0}
    raise ImportRefused(f"{where}: margin_list={margin_list!r}: arcface_torch's "
                        "CombinedMarginLoss supports m1 == 1 with m3 == 0 (ArcFace) or m3 > 0 "
                        "(CosFace) only")


def arcface_torch_behaviour() -> dict[str, Any]:
    """What train_v2.py, partial_fc_v2.py and losses.py fix in code, as partial-fc keys
    (dotted; docs/insightface.md says which of them matter for its numbers)."""
    return {"margin.gradient": "straight_through", "schedule.type": "poly",
            "schedule.power": 1.0, "train.clip_grad_norm": 5.0, "optim.decay": "all",
            "head.update": "dense", "head.init": "per_rank", "head.loss_cap": LOSS_CAP,
            "engine.type": "ddp", "engine.broadcast_buffers": False,
            "engine.grad_compression": "fp16"}


def put(tree: dict, dotted: str, value: Any) -> None:
    """``tree[a][b] = value`` for ``dotted = "a.b"``, creating sections."""
    *parents, leaf = dotted.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


def _typed(dotted: str, value: Any) -> Any:
    """Python's ``1`` for a float key is YAML's int: make the schema's strict types hold."""
    if dotted in _FLOAT_KEYS and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if dotted in _INT_KEYS and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def read_config(path: Path) -> Converted:
    """``path`` (an arcface_torch config) merged with its ``base.py`` and mapped; each key's
    ``file:line`` is kept, so that a refused value names the line to edit."""
    path = Path(path)
    if not path.is_file():
        raise ImportRefused(f"{path}: no such file")
    values, lines = merged(path)
    out = Converted()
    for key, value in arcface_torch_behaviour().items():
        put(out.tree, key, value)
    for key, value in values.items():
        if key in MAPPED and value is not None:
            put(out.tree, MAPPED[key], _typed(MAPPED[key], value))
            out.origin[MAPPED[key]] = lines[key]
        elif key not in _CONVERTED and key not in MAPPED:
            out.unmapped.append(f"{key} = {value!r}")
    if "margin_list" in values:
        margin = margin_of(values["margin_list"], lines["margin_list"], out.notes)
        out.tree["margin"] = {**out.tree.get("margin", {}), **margin}
        out.origin.update({f"margin.{k}": lines["margin_list"] for k in margin})
    if values.get("network") is not None:
        out.network = values["network"]
        for key, value in network_keys(out.network, lines["network"]).items():
            put(out.tree, key, value)
            out.origin[key] = lines["network"]
    if values.get("fp16"):
        put(out.tree, "engine.precision", "bf16")
        out.origin["engine.precision"] = lines["fp16"]
    _special_values(values, lines, out)
    _notes(values, out.notes)
    return out


def negative_warmup_lr(lr: float, total: float, warmup: float, power: float) -> float:
    """The peak lr of our poly decay (no warm-up) equal to arcface_torch's
    ``PolynomialLRWarmup`` at ``warmup_iters = warmup < 0``: its ``last_epoch <= warmup``
    never holds, so from step 1 it decays ``lr * ((t - l) / (t - warmup)) ** power``, which
    is ``lr * (t / (t - warmup)) ** power`` decayed as ours, ``(1 - l / t) ** power`` (its
    step 0 alone keeps ``lr``)."""
    return lr * (total / (total - warmup)) ** power


def _special_values(values: dict[str, Any], lines: dict[str, str], out: Converted) -> None:
    """Values that arcface_torch's code reads as a switch rather than a number, mapped to
    what that code does."""
    warmup, epochs = values.get("warmup_epoch"), values.get("num_epoch")
    if isinstance(warmup, int | float) and warmup < 0 and isinstance(epochs, int | float):
        lr = negative_warmup_lr(float(values.get("lr", 0.1)), epochs, warmup, 1.0)
        put(out.tree, "schedule.warmup_epochs", 0.0)
        put(out.tree, "optim.lr", lr)
        out.origin["optim.lr"] = lines["warmup_epoch"]
        out.notes.append(f"warmup_epoch = {warmup!r}: arcface_torch never warms up and decays "
                         f"from lr x num_epoch / (num_epoch - warmup_epoch): "
                         f"schedule.warmup_epochs=0, optim.lr={lr:.6g}")
    if values.get("sample_rate") == 0:
        out.notes.append("sample_rate = 0: PartialFC_V2 keeps the batch's own classes only; "
                         "head.sample_rate=0 does the same (one random class on a rank that "
                         "owns none of them, where it keeps none)")
    if values.get("rec") == "synthetic":  # train_v2's get_dataloader: no files at all
        put(out.tree, "data.source", "synthetic")
        out.origin["data.source"] = lines["rec"]
        for key in ("data.dir", "data.num_samples"):
            *section, leaf = key.split(".")
            out.tree[section[0]].pop(leaf, None)
            out.origin.pop(key, None)
        out.notes.append("rec = 'synthetic': data.source=synthetic (generated identities, no "
                         "folder); its epoch is num_image images of one repeated random batch, "
                         "ours num_classes x data.synthetic_images_per_class learnable images, "
                         "so train.max_steps sets the length")


def _notes(values: dict[str, Any], notes: list[str]) -> None:
    """What converts without a key, said once each."""
    if values.get("fp16"):
        notes.append("fp16 = True (autocast fp16 with a GradScaler): engine.precision=bf16, "
                     "which needs no loss scale; engine.precision=fp16 needs "
                     "engine.type=deepspeed")
    if (values.get("gradient_acc") or 1) > 1:
        notes.append(f"gradient_acc = {values['gradient_acc']}: arcface_torch sums the "
                     "micro-batches' gradients (an SGD step k times larger); "
                     "train.grad_accum averages them")
    if values.get("dali"):
        notes.append("dali = True: partial-fc's loader decodes the webdataset shards itself "
                     "(no DALI); nothing to set")
    if values.get("rec") not in (None, "synthetic"):
        notes.append(f"rec = {values['rec']!r}: data.dir must name a converted folder: "
                     f"python -m launch.convert insightface {values['rec']} OUT, then "
                     "data.dir=OUT")
