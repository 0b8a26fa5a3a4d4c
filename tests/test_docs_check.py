"""tools/docs_check (``make docs-check``): how it reads the docs' blocks and markers, rewrites
placeholders and ``--check`` commands, finds printed commands, and that it fails, naming
file:line, the command and the reason, when a documented command breaks."""

from __future__ import annotations

import pytest

from tools.docs_check.blocks import CHECK_OVERRIDES, RUN_OVERRIDES, read_doc, strip_comment
from tools.docs_check.fixtures import BUILDERS, DOC_PLACEHOLDERS, PLACEHOLDERS
from tools.docs_check.rewrite import CannotRewrite, for_check, for_run, printed_commands, substitute
from tools.docs_check.runner import ROOT, main

DOC = """# a doc

<!-- docs-check: skip make test: CI runs it -->
```bash
make train   # a comment
make test
```

```text
python -m launch.train   # output, never run
```

<!-- docs-check: --check launch.train -->
```bash
common="--config configs/smoke.yaml \\
  data.dir=data/synthetic"
python -m launch.overlap --checkpoint runs/x \\
    --out o.txt
python -m launch.train $common
```

```console
$ python -m launch.plan --gpus 8
93,431 classes on 8 GPUs
```
"""


def test_blocks_markers_continuations_and_preludes(tmp_path):
    (tmp_path / "d.md").write_text(DOC)
    commands, errors = read_doc(tmp_path / "d.md", "d.md")
    assert errors == []
    assert [(c.where, c.text, c.mode) for c in commands] == [
        ("d.md:5", "make train", "run"), ("d.md:6", "make test", "skip"),
        ("d.md:17", "python -m launch.overlap --checkpoint runs/x --out o.txt", "run"),
        ("d.md:19", "python -m launch.train $common", "check"),
        ("d.md:23", "python -m launch.plan --gpus 8", "run")]
    assert commands[1].reason == "CI runs it"
    assert commands[3].prelude == ('common="--config configs/smoke.yaml data.dir=data/synthetic"',)


@pytest.mark.parametrize("text, error", [
    ("<!-- docs-check: --check make x -->\n```bash\nmake train\n```\n",
     "d.md:1: docs-check marker selects 'make x', which no command of the block contains"),
    ("<!-- docs-check: skip make test -->\n```bash\nmake test\n```\n",
     "d.md:1: docs-check marker 'skip make test': expected '--check [SELECT]' or "
     "'skip [SELECT]: REASON'"),
    ("<!-- docs-check: --check -->\nprose\n```bash\nmake train\n```\n",
     "d.md:1: docs-check marker not followed by a code block"),
    ("text\n\n```\n# a comment\ntorchrun --nproc_per_node 8 -m launch.train\n```\n",
     "d.md:3: untagged code block starts with a command: tag it ```bash (the check runs it) or "
     "```text"),
])
def test_a_doc_the_check_cannot_read_is_named_by_file_and_line(tmp_path, text, error):
    (tmp_path / "d.md").write_text(text)
    _, errors = read_doc(tmp_path / "d.md", "d.md")
    assert [str(e) for e in errors] == [error]


def test_placeholders_replace_whole_words_and_path_heads_only():
    table = {"/data/faces_emore": "emore", "lfw.bin": "bins/lfw.bin", "NODE_RANK=i": "=NODE_RANK=0"}
    out = substitute("a /data/faces_emore/lfw.bin lfw.bin x/lfw.bin lfw.bins /data/faces_emore2 "
                     "NODE_RANK=i", table, lambda v: f"<{v}>")
    assert out == ("a <emore>/lfw.bin <bins/lfw.bin> x/lfw.bin lfw.bins /data/faces_emore2 "
                   "<=NODE_RANK=0>")


def test_every_placeholder_names_a_fixture():
    values = [*PLACEHOLDERS.values(), *(v for d in DOC_PLACEHOLDERS.values() for v in d.values())]
    assert all(v.startswith("=") or v.partition("/")[0] in BUILDERS for v in values)


def test_check_mode_rewrites_each_kind_of_launch():
    extra = " ".join(CHECK_OVERRIDES)
    assert for_check("python -m launch.train --config c.yaml a=1", ROOT) == (
        f"python -m launch.train --check --config c.yaml a=1 {extra}")
    assert for_check("torchrun --nproc_per_node=8 --nnodes 2 -m launch.train --config c.yaml",
                     ROOT) == (f"python -m launch.train --check --nproc-per-node 8 --nnodes 2 "
                               f"--config c.yaml {extra}")
    assert for_check("make ms1mv2-r50 DATA=d", ROOT) == (
        f"make ms1mv2-r50 DATA=d NPROC_PER_NODE=8 TORCHRUN=true 'ARGS+={extra}'")
    assert for_check("make ms1mv2-r50 NPROC_PER_NODE=4", ROOT) == (
        f"make ms1mv2-r50 NPROC_PER_NODE=4 TORCHRUN=true 'ARGS+={extra}'")
    assert for_check("sbatch scripts/slurm/train.sbatch c.yaml x=1", ROOT).startswith(
        "bash -n scripts/slurm/train.sbatch && python -m launch.train --check --nproc-per-node 8 "
        "--nnodes 2 --config c.yaml x=1")
    with pytest.raises(CannotRewrite):
        for_check("python -m launch.evaluate --checkpoint r", ROOT)
    assert for_run("torchrun -m launch.train --config c") == (
        f"torchrun -m launch.train --config c {' '.join(RUN_OVERRIDES)}")
    assert for_run("python -m launch.report r") == "python -m launch.report r"


def test_printed_commands_end_where_the_prose_goes_on():
    out = ("note: python -m launch.convert insightface /a OUT, then data.dir=OUT\n"
           "evaluate: python -m launch.evaluate --checkpoint r --bin ...; export: python -m "
           "launch.export --checkpoint r --out m.onnx\n"
           "report: python -m launch.report runs/s; W&B\n"
           "check (python -m launch.plan --bins a,b --gpus 8).")
    assert printed_commands(out) == [
        "python -m launch.convert insightface /a OUT",
        "python -m launch.export --checkpoint r --out m.onnx", "python -m launch.report runs/s",
        "python -m launch.plan --bins a,b --gpus 8"]


def test_strip_comment_leaves_quoted_hashes():
    assert strip_comment("""python -c "print('# x')"  # why""") == """python -c "print('# x')\""""


def test_a_broken_command_fails_the_check_with_its_place_and_reason(tmp_path, capsys):
    doc = tmp_path / "broken.md"
    doc.write_text("```bash\npython -c \"print('fine')\"\npython -c \"import launch.nope\"\n"
                   "python -c \"print('next: python -m launch.plan --nope')\"\n```\n")
    assert main([str(doc), "--keep", str(tmp_path / "work")]) == 1
    out = capsys.readouterr().out
    assert f"{doc}:2  python -c \"print('fine')\"" in out
    assert (f"FAIL  {doc}:3  python -c \"import launch.nope\": exit 1; a Python traceback in its "
            "output") in out
    assert (f"FAIL  {doc}:4  python -c \"print('next: python -m launch.plan --nope')\": the "
            "command it printed, `python -m launch.plan --nope`, then failed: exit 2") in out
    assert out.rstrip().endswith("docs-check: 2 failed")
