"""bench/gpu_session.sh's control flow on CPU: the steps of each stage, a failing step that does
not stop the next, the time budget that skips what cannot finish, and gpu_summary.json.

The script runs as on the GPU machine, with ``PY`` a fake interpreter that answers each step
as the real tools would (a JUnit report, bench/head.py's table, bench/train.py's JSON, a run's
metrics.jsonl) and fails bench/head.py at 1M classes r=0.1 (not in the pace stage's test).
What the tools compute is their own tests' business.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_session.sh"
STEPS = {
    "1": ["setup", "versions", "cuda-tests", "recipe", "head-1m-r1", "head-1m-r0.1",
          "head-1m-r1-bf16-state", "head-4m-r0.1"],
    "2": ["setup", "versions", "train-overheads", "train-deepspeed-settings",
          "profile-train-deepspeed", "train-r100-ddp", "train-r100-deepspeed", "train-ddp",
          "train-deepspeed", "demo", "train-compile", "train-bf16-state", "loader"],
    "3": ["setup", "versions", "cuda-tests", "cpu-suite", "peak-r0.1", "peak-r1", "recipe",
          "train-deepspeed", "train-compile", "loader"],
    # the steps gpu-pace.json's figures come from first, what the budget may skip after them
    "pace": ["setup", "versions", "tune", "head-pace-r1", "head-pace-r0.1", "train-pace",
             "arcface-torch", "recipe", "largest", "head-pace-peers", "filtered", "profile-head",
             "profile-train"],
}
PACE_KEYS = {"head_r1_over_matmuls", "head_r01_ms", "textbook_r01_ms", "trainer_1k_of_ceiling",
             "trainer_1m_r01_of_ceiling", "recipe_img_s", "arcface_torch_img_s", "device",
             "date", "arcface_torch_peak_gib", "recipe_peak_gb", "largest_c_local_r01",
             "planned_c_local_r01", "head_r1_ms", "torch_lce_r1_ms", "cce_r1_ms",
             "liger_r1_ms"}
KEYS = {"stage", "date", "dry_run", "budget_s", "elapsed_s", "ok", "versions", "steps", "tests",
        "recipe", "demo", "head", "train"}

FAKE = r'''
import json, os, sys
from pathlib import Path

argv = sys.argv[1:]
value = lambda prefix: next(a.split("=", 1)[1] for a in argv if a.startswith(prefix))
after = lambda flag: argv[argv.index(flag) + 1]


def metrics(run):
    run.mkdir(parents=True, exist_ok=True)
    rows = [{"step": s, "loss": 20.0 - s, "img_per_s": 1000.0 * s, "memory_mb": 2000.0 * s,
             "scale": 64.0} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if argv[:2] == ["-m", "pytest"]:
    Path(value("--junitxml=")).write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.a.test_x" name="test_ok" time="1.5"/>'
        '<testcase classname="tests.a.test_x" name="test_bad[p]" time="0.1">'
        '<failure message="boom">trace</failure></testcase>'
        '<testcase classname="tests.b.test_y" name="test_gpu" time="0">'
        '<skipped message="needs a CUDA device"/></testcase></testsuite></testsuites>')
    sys.exit(1)
if argv[:1] == ["bench/gpu_summary.py"]:
    Path(after("--out")).write_text(json.dumps({"python": "3", "torch": "2.11.0+cu130"}))
elif argv[:1] == ["bench/head.py"]:
    if f"{after('-C')}:{after('-r')}" == os.environ.get("FAKE_HEAD_FAILS"):
        sys.exit("head.py: boom")
    print(f"C={after('-C')} D=512 N/rank=1024 P=1 r={after('-r')} device=cuda")
    print("ours          8.00 [7.50, 9.00]       100.0 [90.0, 100.0]        5000")
    print("textbook     16.00 [15.00, 17.00]     400.0 [390.0, 400.0]        2000")
    print("matmuls       6.00 [5.90, 6.10]")
    peers = after("--peers").split(",") if "--peers" in argv else []
    for i, name in enumerate(peers):
        print(f"{name:<9} {20.0 + i:9.2f} [19.00, 30.00]     500.0 [500.0, 500.0]        1000")
elif argv[:1] == ["bench/train.py"] and after("--json").endswith("train-pace.json"):
    runs = [{"classes": 0, "sample_rate": 1.0, "img_per_s": 2000.0},
            {"classes": 1000, "sample_rate": 1.0, "img_per_s": 1800.0},
            {"classes": 1000000, "sample_rate": 0.1, "img_per_s": 1500.0}]
    Path(after("--json")).write_text(json.dumps({"runs": runs}))
elif argv[:1] == ["bench/train.py"]:
    Path(after("--json")).write_text(json.dumps({"runs": [{"run": "trainer", "img_per_s": 2e3}]}))
elif argv[:2] == ["bench/pace.py", "tune"]:
    Path(after("--out")).write_text(json.dumps({"devices": {"Fake": {"buckets": {}}}}))
    Path(after("--report")).write_text("{}")
elif argv[:1] == ["bench/pace.py"] and argv[1].startswith("profile-"):
    name = argv[1].removeprefix("profile-")
    Path(after("--out")).mkdir(parents=True, exist_ok=True)
    (Path(after("--out")) / f"{name}-trace.json.gz").write_bytes(b"trace")
    (Path(after("--out")) / f"{name}-kernels.txt").write_text("kernels")
elif argv[:2] == ["bench/pace.py", "filtered"]:
    Path(after("--json")).write_text(json.dumps({"runs": []}))
elif argv[:2] == ["bench/pace.py", "largest"]:
    Path(after("--json")).write_text(json.dumps({"largest_trained": 40, "planned": 50}))
elif argv[:1] == ["bench/arcface_torch_pace.py"]:
    Path(after("--json")).write_text(json.dumps({"img_per_s": 1250.0, "peak_gib": 9.5}))
elif argv[:2] == ["-m", "launch.torchrun"]:
    metrics(Path(value("output=")))
elif argv[:1] == ["bench/scale_demo.py"]:
    for name in ("arcface_r0.1", "adacos_dynamic_r1"):
        metrics(Path(after("--work")) / name)
'''


def _session(tmp_path: Path, stage: str, *flags: str, budget: int = 500,
             head_fails: str = "1000000:0.1", extra_env: dict | None = None):
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\n{FAKE}")
    fake.chmod(0o755)
    out, work = tmp_path / f"out{stage}", tmp_path / f"work{stage}"
    env = {**os.environ, "PY": str(fake), "OUT": str(out), "GPU_SESSION_WORK": str(work),
           "GPU_SESSION_BUDGET": str(budget), "FAKE_HEAD_FAILS": head_fails}
    env.pop("GPU_SESSION_DRY", None)
    env.pop("GPU_SESSION_STEPS", None)
    env.update(extra_env or {})
    result = subprocess.run(["bash", str(SCRIPT), stage, *flags], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    summary = json.loads((out / "gpu_summary.json").read_text())
    assert set(summary) == KEYS and summary["stage"] == stage
    pace = ["gpu-pace.json"] if stage == "pace" else []  # and what its steps wrote there
    written = sorted(p.name for p in out.iterdir() if p.name not in ("profile", "tuned.json"))
    assert written == sorted(["gpu_summary.json", f"session-{stage}.log", f"logs-{stage}.tgz",
                              *pace])
    return result, summary, {s["name"]: s for s in summary["steps"]}


@pytest.mark.parametrize("stage", ["1", "2", "3", "pace"])
def test_dry_run_names_every_step_and_runs_none(tmp_path, stage):
    result, summary, steps = _session(tmp_path, stage, "--dry-run")
    assert result.returncode == 0, result.stdout + result.stderr
    assert list(steps) == STEPS[stage] and summary["dry_run"] and summary["ok"]
    assert all(s["status"] == "dry" and s["command"] for s in steps.values())
    assert summary["tests"]["cases"] == [] and summary["versions"] is None
    assert "would run:" in result.stdout
    if stage == "2":  # the overheads' and DeepSpeed's variants, and the traced DeepSpeed step
        command = {name: s["command"].split(" --json ", 1)[0] for name, s in steps.items()}
        assert command["profile-train-deepspeed"].split()[1:4] == [
            "bench/pace.py", "profile-train", "--engine"]
        for name, count in (("train-overheads", 4), ("train-deepspeed-settings", 3)):
            assert steps[name]["command"].count("--variant ") == count
        assert "--engine deepspeed" in steps["train-r100-deepspeed"]["command"]
    if stage != "2":  # the recipe's overrides are keys and values the schema takes
        from trainer.config import load_config

        args = steps["recipe"]["command"].split("'ARGS=", 1)[1].rstrip("'").split()
        cfg = load_config(ROOT / "configs" / "ms1mv3_r50.yaml", args, resolve=False)
        assert cfg.data.source == "synthetic"
        assert cfg.train.max_steps == (80 if stage == "pace" else 150)


def test_a_failing_step_does_not_stop_the_next(tmp_path):
    result, summary, steps = _session(tmp_path, "1")
    assert result.returncode != 0 and not summary["ok"]  # the exit status: not all held
    assert list(steps) == STEPS["1"]
    status = {name: s["status"] for name, s in steps.items()}
    assert status["cuda-tests"] == status["head-1m-r0.1"] == "failed"
    assert status["recipe"] == status["head-1m-r1-bf16-state"] == status["head-4m-r0.1"] == "ok"
    assert steps["head-1m-r0.1"]["rc"] == 1
    assert summary["versions"]["torch"] == "2.11.0+cu130"
    tests = summary["tests"]
    assert (tests["passed"], tests["failed"], tests["skipped"]) == (1, 1, 1)
    assert {c["id"]: c["outcome"] for c in tests["cases"]} == {
        "tests/a/test_x.py::test_ok": "passed", "tests/a/test_x.py::test_bad[p]": "failed",
        "tests/b/test_y.py::test_gpu": "skipped"}
    assert summary["recipe"] == {"steps": 3, "img_per_s": 2500.0, "peak_gb": 6.29,
                                 "loss_first": 19.0, "loss_last": 17.0, "scale_last": 64.0}
    head = {h["step"]: h for h in summary["head"]}
    assert set(head) == {"head-1m-r1", "head-1m-r0.1", "head-1m-r1-bf16-state", "head-4m-r0.1"}
    assert head["head-1m-r1"]["ms"] == {"ours": 8.0, "textbook": 16.0, "matmuls": 6.0}
    assert head["head-1m-r1"]["gemm_share"] == 0.75
    assert head["head-1m-r1"]["ours_over_textbook"] == 0.5
    assert head["head-1m-r1"]["extra_peak_mib"] == {"ours": 100.0, "textbook": 400.0}
    assert head["head-1m-r0.1"]["ms"] == {} and head["head-1m-r0.1"]["gemm_share"] is None
    with tarfile.open(tmp_path / "out1" / "logs-1.tgz") as tgz:
        names = set(tgz.getnames())
    assert {"logs-1/cuda-tests.xml", "logs-1/head-1m-r0.1.log",
            "logs-1/metrics-recipe.jsonl"} <= names
    assert "head.py: boom" in (tmp_path / "out1" / "session-1.log").read_text()


def test_benches_and_demo_are_merged_and_the_budget_skips_what_cannot_finish(tmp_path):
    result, summary, steps = _session(tmp_path, "2")
    assert all(steps[name]["status"] == "ok" for name in STEPS["2"][2:]), steps
    assert [t["step"] for t in summary["train"]] == [  # the files' order
        "train-bf16-state", "train-compile", "train-ddp", "train-deepspeed-settings",
        "train-deepspeed", "train-overheads", "train-r100-ddp", "train-r100-deepspeed"]
    assert summary["train"][0]["runs"] == [{"run": "trainer", "img_per_s": 2000.0}]
    assert set(summary["demo"]) == {"arcface_r0.1", "adacos_dynamic_r1"}
    assert summary["demo"]["arcface_r0.1"]["loss_last"] == 17.0
    # DeepSpeed's trace comes back in $OUT, its per-kernel table in the logs (as pace's)
    assert (tmp_path / "out2" / "profile" / "train-trace.json.gz").is_file()
    with tarfile.open(tmp_path / "out2" / "logs-2.tgz") as tgz:
        assert "logs-2/train-kernels.txt" in tgz.getnames()
    # 120 s: 95 s left after the reserve; the demo (200 s) would get less than half its
    # limit, the others run with theirs clipped to what is left (compile: 150 s to 95).
    (tmp_path / "budget").mkdir()
    _, summary, steps = _session(tmp_path / "budget", "2", budget=120)
    # setup's fate depends on whether wheels.sh has filled .gpu/ in this checkout.
    assert [name for name, s in steps.items()
            if s["status"] != "ok" and name != "setup"] == ["demo"]
    assert steps["demo"]["status"] == "skipped" and summary["demo"] == {}
    assert all(s["limit_s"] <= 95 for s in steps.values() if s["status"] != "skipped")


def test_the_pace_stage_writes_its_figures_and_brings_back_its_files(tmp_path):
    """The stage's figures in gpu-pace.json from what its steps left (head ms from bench/
    head.py's table, img/s from bench/train.py's JSON and the recipe's metrics), the tuned
    table and the traces in $OUT, the per-kernel tables in the logs; no more files come
    back than the device machine returns (8)."""
    result, summary, steps = _session(tmp_path, "pace", head_fails="none")
    status = {name: s["status"] for name, s in steps.items() if name != "setup"}
    assert set(status.values()) == {"ok"}, status
    out = tmp_path / "outpace"
    pace = json.loads((out / "gpu-pace.json").read_text())
    assert set(pace) == PACE_KEYS
    assert pace["head_r1_over_matmuls"] == pytest.approx(8.0 / 6.0, abs=1e-3)
    assert (pace["head_r01_ms"], pace["textbook_r01_ms"]) == (8.0, 16.0)
    assert (pace["trainer_1k_of_ceiling"], pace["trainer_1m_r01_of_ceiling"]) == (0.9, 0.75)
    assert (pace["recipe_img_s"], pace["arcface_torch_img_s"]) == (2500.0, 1250.0)
    assert (pace["recipe_peak_gb"], pace["arcface_torch_peak_gib"]) == (6.29, 9.5)
    assert (pace["largest_c_local_r01"], pace["planned_c_local_r01"]) == (40, 50)
    assert pace["head_r1_ms"] == 8.0  # ours at 1M r=1, then the peers beside it (no margin)
    assert (pace["torch_lce_r1_ms"], pace["cce_r1_ms"], pace["liger_r1_ms"]) == (20.0, 21.0, 22.0)
    assert json.loads((out / "tuned.json").read_text())["devices"] == {"Fake": {"buckets": {}}}
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and {"head-trace.json.gz", "train-trace.json.gz"} <= {
        p.name for p in files}
    with tarfile.open(out / "logs-pace.tgz") as tgz:
        assert {"logs-pace/head-kernels.txt", "logs-pace/train-kernels.txt",
                "logs-pace/tune.json"} <= set(tgz.getnames())


def test_versions_name_what_imports_and_null_what_does_not(monkeypatch):
    import torch
    from launch_helpers import bench_module

    module = bench_module("gpu_summary")
    monkeypatch.setattr(module, "PACKAGES", ("torch", "partial_fc_no_such_package"))
    found = module.versions()
    assert found["torch"] == torch.__version__ and found["cuda"] == torch.version.cuda
    assert found["partial_fc_no_such_package"] is None
    assert "ModuleNotFoundError" in found["import_errors"]["partial_fc_no_such_package"]


def test_train_bench_writes_the_json_the_summary_merges(tmp_path, monkeypatch):
    """bench/train.py --json on CPU at the smallest size: the fields gpu_summary.json carries."""
    from launch_helpers import bench_module

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")  # init_distributed would set it for good
    module = bench_module("train")
    out = tmp_path / "train.json"
    module.main(["--device", "cpu", "--runs", "50:1.0", "--steps", "1", "--warmup", "0",
                 "--batch", "4", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["batch"] == 4
    ceiling, run = result["runs"]
    assert (ceiling["classes"], run["classes"], run["sample_rate"]) == (0, 50, 1.0)
    assert run["planned_gib"] > 0 and ceiling["planned_gib"] is None
    assert run["img_per_s"] == pytest.approx(4 / run["step_ms"] * 1e3)
    assert {"bb fwd", "head fwd", "head bwd", "bb bwd", "optim"} <= set(run["phases_ms"])


def test_profile_train_passes_the_engine_and_variants_to_the_train_bench(tmp_path, monkeypatch):
    """bench/pace.py profile-train (bench/train.py's ``main`` and the profiler faked): its
    ``--engine`` and each ``--variant`` reach bench/train.py, and the trace is named after
    them, so DeepSpeed's trace sits beside DDP's."""
    from types import SimpleNamespace

    from launch_helpers import bench_module

    pace = bench_module("pace")
    calls = []
    monkeypatch.setattr(sys, "path", list(sys.path))  # profile-train puts bench/ first
    monkeypatch.setitem(sys.modules, "train", SimpleNamespace(main=calls.append))
    monkeypatch.setattr(pace, "_profiled",
                        lambda run, out, name: calls.append((out, name)) or run())
    pace.main(["profile-train", "--steps", "2", "--out", str(tmp_path)])
    pace.main(["profile-train", "--engine", "deepspeed", "--variant", "a=prefetch=false",
               "--variant", "b=zero_settings.overlap_comm=1", "--out", str(tmp_path)])
    common = ["--runs", "1000:1.0", "--steps", "2", "--warmup", "1", "--engine"]
    assert calls == [(tmp_path, "train"), [*common, "ddp"],
                     (tmp_path, "train-deepspeed-a-b"),
                     [*common[:3], "5", *common[4:], "deepspeed", "--variant=a=prefetch=false",
                      "--variant=b=zero_settings.overlap_comm=1"]]


def test_a_second_call_runs_only_the_steps_it_names(tmp_path):
    """GPU_SESSION_STEPS: the pace stage's tail (the peers, the filtered backward) alone, as a
    second device call runs it when the first call's budget skipped it; setup and versions
    still run, every other step is skipped, and gpu-pace.json holds the peers' figures."""
    steps_env = {"GPU_SESSION_STEPS": "head-pace-peers filtered"}
    _, _, steps = _session(tmp_path, "pace", head_fails="none", extra_env=steps_env)
    ran = [name for name, s in steps.items() if s["status"] != "skipped"]
    assert ran[-2:] == ["head-pace-peers", "filtered"] and set(ran[:-2]) <= {"setup", "versions"}
    assert "versions" in ran
    pace = json.loads((tmp_path / "outpace" / "gpu-pace.json").read_text())
    assert (pace["cce_r1_ms"], pace["head_r1_ms"]) == (21.0, None)
