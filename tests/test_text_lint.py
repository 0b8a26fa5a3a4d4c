"""``tools.text_lint`` (part of ``make lint``): the repository passes, and each kind of rot
it looks for is found where it is planted."""

from __future__ import annotations

from pathlib import Path

from tools.text_lint import main, problems

ROOT = Path(__file__).resolve().parents[1]


def test_the_repository_has_no_issue_numbers_in_code_and_no_dead_test_paths():
    assert problems(ROOT) == []


def test_planted_rot_is_found_with_its_place(tmp_path, capsys):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "tests" / "offline").mkdir(parents=True)
    (tmp_path / "tests" / "offline" / "test_plan.py").write_text("")
    (tmp_path / "docs").mkdir()
    issue, gone = "Issue" + " 12", "tests/offline/" + "test_gone.py"
    old = "tests/" + "test_old.py"
    (tmp_path / "trainer" / "step.py").write_text(
        f'"""Since {issue} the step agrees once."""\n'
        f"# see tests/offline/test_plan.py and {gone}\n")
    (tmp_path / "docs" / "a.md").write_text(f"{issue} is fine in docs; {old}\n"
                                            "tests/made_up/test_x.py is test data\n")
    assert problems(tmp_path) == [
        f"trainer/step.py:1: an issue number in code ({issue!r}); say why instead",
        f"trainer/step.py:2: {gone} does not exist",
        f"docs/a.md:1: {old} does not exist",
    ]
    assert main([str(tmp_path)]) == 1 and capsys.readouterr().err.count("\n") == 3
    assert main([str(ROOT)]) == 0
