"""Every program's ``--help`` exits 0, reads as plain text (no reST roles or literals) and
says what its exit status means."""

import importlib

import pytest

PROGRAMS = ["launch.train", "launch.evaluate", "launch.export", "launch.convert",
            "tools.chaos.__main__", "tools.slurm.__main__", "launch.plan", "launch.report",
            "launch.torchrun", "launch.overlap.__main__", "launch.clean", "launch.embed"]


@pytest.mark.parametrize("program", PROGRAMS)
def test_help_is_plain_text(program, capsys):
    with pytest.raises(SystemExit) as done:
        importlib.import_module(program).main(["--help"])
    text = capsys.readouterr().out
    command = program.removesuffix(".__main__")
    assert done.value.code == 0 and text.startswith(f"usage: python -m {command}")
    if program.startswith("launch."):
        assert "exit status: 0 done; 2 bad input" in " ".join(text.split()), program
    for markup in ("``", ":func:", ":class:", "::"):
        assert markup not in text, f"{program} --help shows reST {markup!r}"
