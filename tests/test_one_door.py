"""Every file from outside comes in through the door (data_pipeline.door and the formats'
homes that read through it; docs/readers.md): a module of data_pipeline/, trainer/, offline/,
launch/ or partial_fc/ that reads a file another way fails here, read from its syntax tree.

What counts as a read: ``open(...).read()`` (or ``f.read()`` of a ``with open(...) as f``)
with no bound, ``Path.read_text``/``read_bytes``, ``json.load(s)``, ``yaml.*load*``,
``np.load``, ``Image.open``, ``loadmat``, ``pickle.load(s)``, ``torch.load`` and ``tarfile``.
:data:`ALLOWED` names each exception and why it is one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data_pipeline", "trainer", "offline", "launch", "partial_fc")

DOOR = {
    "data_pipeline/door.py": "the door: bounded bytes and UTF-8 text",
    "data_pipeline/json_file.py": "JSON, parsed from the door's bytes",
    "data_pipeline/npz_file.py": "NumPy archives, each member sized from its header first",
    "data_pipeline/mat_file.py": "MATLAB files, inflated and walked within bounds first",
    "data_pipeline/verification_bin.py": "pickled .bin, every length checked, no globals",
    "data_pipeline/codec.py": "images: an allow-list of formats, the pixel limit first",
    "trainer/yaml_file.py": "YAML, composed within its node and depth bounds",
}

# (module, the read as :func:`reads` names it) -> why it is not a file from outside
ALLOWED = {
    ("data_pipeline/writer.py", "tarfile"):
        "writes the shards (mode 'w'); tar_reader reads them, checked against the file",
    ("trainer/checkpoint/backbone.py", "torch.load"):
        "a checkpoint's backbone.pt, read with weights_only=True after its SHA-256 matched "
        "the meta.json that lists it (trainer.checkpoint.integrity)",
    ("trainer/checkpoint/layout.py", "torch.load"):
        "a checkpoint's rng-RANK.pt, weights_only=True, its SHA-256 checked first",
    ("offline/insightface/checkpoint.py", "torch.load"):
        "an arcface_torch backbone.pth, weights_only=True: tensors only, nothing runs; "
        "its size is the model's",
    ("trainer/measured_figures.py", "json.loads"):
        "plan_figures.json, package data the project ships",
    ("trainer/measured_figures.py", ".read_text"):
        "plan_figures.json, package data the project ships",
    ("offline/plan_engine.py", "json.loads"): "engine_speeds.json, package data",
    ("offline/plan_engine.py", ".read_text"): "engine_speeds.json, package data",
    ("partial_fc/tiles/tuning.py", "json.loads"):
        "tuned.json, package data, or the tuning file the project's own tuner wrote",
    ("partial_fc/tiles/tuning.py", ".read_text"):
        "tuned.json, package data, or the tuning file the project's own tuner wrote",
    ("launch/torchrun.py", ".read_text"): "/proc/PID/task/*/children: the kernel's",
    ("launch/torchrun.py", ".read_bytes"): "/proc/PID/environ: the kernel's",
    ("trainer/telemetry/sinks.py", ".read_text"):
        "the run's wandb id file, which the run itself writes",
    ("trainer/telemetry/wandb_log.py", ".read_bytes"):
        "a .wandb run file the run's own W&B client wrote, read back by its tests",
    ("trainer/telemetry/wandb_log.py", "json.loads"):
        "a history value inside that run file, not a file",
    ("trainer/telemetry/run_files.py", ".read_bytes"):
        "metrics.jsonl and histograms.jsonl, the run's own line files: a long run's is "
        "gigabytes and read whole is what resume does; each line is bounded",
}

_NAMED = {("json", "load"), ("json", "loads"), ("np", "load"), ("numpy", "load"),
          ("Image", "open"), ("pickle", "load"), ("pickle", "loads"), ("torch", "load")}


def reads(source: str) -> list[tuple[int, str]]:
    """The unbounded reads in ``source`` as ``(line, name)``: ``.read_text`` for a method,
    ``json.loads`` for a module's function, ``open().read`` for an unbounded read of a file
    ``open`` returned."""
    found: list[tuple[int, str]] = []
    opened: set[str] = set()  # names bound by `with open(...) as NAME`
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.withitem) and _is_open(node.context_expr) and \
                isinstance(node.optional_vars, ast.Name):
            opened.add(node.optional_vars.id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id == "tarfile":
            found.append((node.lineno, "tarfile"))
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "loadmat":
            found.append((node.lineno, "loadmat"))
        if not isinstance(func, ast.Attribute):
            continue
        owner = func.value.id if isinstance(func.value, ast.Name) else None
        if (owner, func.attr) in _NAMED or owner == "yaml" and "load" in func.attr:
            found.append((node.lineno, f"{owner}.{func.attr}"))
        elif func.attr in ("read_text", "read_bytes"):
            found.append((node.lineno, f".{func.attr}"))
        elif func.attr == "loadmat":
            found.append((node.lineno, "loadmat"))
        elif func.attr == "read" and not node.args and not node.keywords and (
                _is_open(func.value) or owner in opened):
            found.append((node.lineno, "open().read"))
    return sorted(set(found))


def _is_open(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
        node.func.id == "open"


def _modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for package in PACKAGES
                  for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("module", _modules())
def test_a_module_reads_files_through_the_door(module):
    if module in DOOR:
        return
    found = [(line, name) for line, name in reads((ROOT / module).read_text())
             if (module, name) not in ALLOWED]
    assert not found, (f"{module} reads a file outside the door at line(s) "
                       f"{[line for line, _ in found]} ({sorted({n for _, n in found})}); "
                       "read it with data_pipeline.door (docs/readers.md), or name why not "
                       "in tests/test_one_door.py's ALLOWED")


def test_every_exception_is_still_one():
    """An allow-list entry whose read is gone goes too."""
    stale = [(m, n) for m, n in ALLOWED
             if not (ROOT / m).is_file() or n not in {x for _, x in reads((ROOT / m).read_text())}]
    assert not stale, stale


@pytest.mark.parametrize("added", [
    "json.loads(path.read_text())",
    "yaml.safe_load(open(path).read())",
    "np.load(path)",
    "Image.open(path)",
    "scipy.io.loadmat(path)",
    "pickle.loads(path.read_bytes())",
    "torch.load(path)",
    "tarfile.open(path)",
])
def test_the_check_fails_where_a_reader_reads_a_file_another_way(added):
    """A plain read added to a reader is found: the check can fail."""
    module = "data_pipeline/rfw.py"
    source = (ROOT / module).read_text()
    assert reads(source) == []
    changed = source + f"\n\ndef read_more(path):\n    return {added}\n"
    assert reads(changed), added


def test_a_bounded_read_of_an_opened_file_is_not_one():
    source = ("def head(path):\n    with open(path, 'rb') as f:\n        return f.read(4096)\n"
              "def whole(path):\n    with open(path, 'rb') as g:\n        return g.read()\n")
    assert reads(source) == [(6, "open().read")]
