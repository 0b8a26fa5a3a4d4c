"""``python -m launch.convert insightface-config``: arcface_torch configs (Python files, written
here in its format: ``configs/base.py`` plus a job file) are read with ``ast``, never run,
merged as its ``get_config`` merges them, mapped, and pass ``launch.train --check``."""

from __future__ import annotations

import pytest
import yaml

from launch.convert import main as convert

BASE = """from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.5, 0.0)
config.network = "r50"
config.resume = False
config.embedding_size = 512
config.sample_rate = 1
config.fp16 = False
config.batch_size = 128
config.optimizer = "sgd"
config.lr = 0.1
config.momentum = 0.9
config.weight_decay = 5e-4
config.dali = False
config.gradient_acc = 1
config.seed = 2048
config.num_workers = 2
config.using_wandb = False
"""


def _job(rec, extra=""):
    return f"""from easydict import EasyDict as edict

config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.network = "r18"
config.sample_rate = 0.5
config.fp16 = True
config.batch_size = 4
config.lr = 0.02
config.rec = {str(rec)!r}
config.num_classes = 20
config.num_image = 160
config.num_epoch = 20
config.warmup_epoch = config.num_epoch // 10
config.val_targets = ['lfw', 'cfp_fp', "agedb_30"]
{extra}"""


def _configs(tmp_path, job):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "base.py").write_text(BASE)
    (folder / "job.py").write_text(job)
    return folder / "job.py"


def test_merged_and_mapped_and_passes_the_check(tmp_path, synthetic_data, capsys):
    from launch.train import main as train

    out = tmp_path / "job.yaml"
    assert convert(["insightface-config", str(_configs(tmp_path, _job(synthetic_data))),
                    str(out), f"output={tmp_path / 'run'}"]) == 0
    printed = capsys.readouterr().out
    tree = yaml.safe_load(out.read_text())
    assert tree["margin"] == {"gradient": "straight_through", "type": "cosface", "m": 0.4,
                              "s": 64.0}
    assert tree["backbone"] == {"name": "iresnet18", "embedding_size": 512}
    assert tree["head"]["sample_rate"] == 0.5 and tree["optim"]["lr"] == 0.02  # job wins
    assert tree["optim"]["weight_decay"] == 5e-4 and tree["optim"]["name"] == "sgd"  # base
    assert tree["schedule"] == {"type": "poly", "power": 1.0, "warmup_epochs": 2.0}
    assert tree["train"]["epochs"] == 20 and tree["train"]["grad_accum"] == 1
    assert tree["engine"]["precision"] == "bf16" and tree["seed"] == 2048
    assert tree["data"] == {"num_workers": 2, "dir": str(synthetic_data), "num_classes": 20,
                            "num_samples": 160}
    for key in ("resume = False", "using_wandb = False", "val_targets = ['lfw'"):
        assert f"no counterpart: {key}" in printed and f"# no counterpart: {key}" in \
            out.read_text()
    assert "note: fp16 = True" in printed
    # its rec is a converted folder here: the printed check needs no data.dir
    assert printed.rstrip().endswith(f"python -m launch.train --config {out} --check")
    assert train(["--config", str(out), "--check", "backbone.name=iresnet_tiny",
                  "engine.precision=fp32"]) == 0


def test_the_printed_check_names_the_shards_an_unconverted_rec_needs(tmp_path, capsys):
    out = tmp_path / "job.yaml"
    assert convert(["insightface-config", str(_configs(tmp_path, _job(tmp_path / "x.rec"))),
                    str(out)]) == 0
    assert capsys.readouterr().out.rstrip().endswith(
        f"python -m launch.train --config {out} data.dir=YOUR_SHARDS --check")


def test_nothing_is_executed_and_every_other_statement_is_named(tmp_path, capsys):
    planted = tmp_path / "planted"
    job = _job(tmp_path, f"open({str(planted)!r}, 'w')\nconfig.lr = float('0.1')\n")
    path = _configs(tmp_path, job)
    assert convert(["insightface-config", str(path), str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"import error: {path}:16: `open({str(planted)!r}, 'w')` is not an assignment to "
        "config.KEY; not executed, so not converted",
        f"{path}:17: `config.lr = float('0.1')`: the value is not a literal or arithmetic "
        "over literals and earlier config keys"]
    assert not planted.exists() and not (tmp_path / "job.yaml").exists()


@pytest.mark.parametrize("margins, want", [
    ((1.0, 0.5, 0.0), {"type": "arcface", "m": 0.5}),
    ((1.0, 0.0, 0.35), {"type": "cosface", "m": 0.35}),
    ((1.0, 0.3, 0.2), {"type": "cosface", "m": 0.2}),  # arcface_torch ignores m2 then
])
def test_margin_list_as_combined_margin_loss_reads_it(tmp_path, margins, want):
    job = _job(tmp_path).replace("(1.0, 0.0, 0.4)", repr(margins))
    out = tmp_path / "job.yaml"
    assert convert(["insightface-config", str(_configs(tmp_path, job)), str(out)]) == 0
    margin = yaml.safe_load(out.read_text())["margin"]
    assert {k: margin[k] for k in want} == want


def test_a_margin_list_arcface_torch_cannot_run_is_refused(tmp_path, capsys):
    job = _job(tmp_path).replace("(1.0, 0.0, 0.4)", "(1.35, 0.0, 0.0)")
    path = _configs(tmp_path, job)
    assert convert(["insightface-config", str(path), str(tmp_path / "job.yaml")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"import error: {path}:4: margin_list=[1.35, 0.0, 0.0]: arcface_torch's "
        "CombinedMarginLoss supports m1 == 1 with m3 == 0 (ArcFace) or m3 > 0 (CosFace) only")


def test_its_special_values_map_to_what_its_code_does(tmp_path, capsys):
    """``sample_rate = 0`` (PartialFC_V2: positives only), ``warmup_epoch = -1`` (never warms
    up, decays from lr x 20/21), ``rec = 'synthetic'`` (its synthetic loader) and the
    inter-class filter all convert, and the recipe passes ``launch.train --check``."""
    from launch.train import main as train

    job = _job("synthetic", "config.sample_rate = 0\nconfig.warmup_epoch = -1\n"
               "config.interclass_filtering_threshold = 0.4\n")
    out = tmp_path / "job.yaml"
    assert convert(["insightface-config", str(_configs(tmp_path, job)), str(out)]) == 0
    printed = capsys.readouterr().out
    tree = yaml.safe_load(out.read_text())
    assert tree["head"]["sample_rate"] == 0.0 and tree["margin"]["interclass_filter"] == 0.4
    assert tree["schedule"]["warmup_epochs"] == 0.0
    assert tree["optim"]["lr"] == pytest.approx(0.02 * 20 / 21)
    assert tree["data"] == {"num_workers": 2, "source": "synthetic", "num_classes": 20}
    assert "no counterpart: interclass" not in printed and "launch.convert insightface " \
        "synthetic" not in printed
    assert "note: rec = 'synthetic': data.source=synthetic" in printed
    assert train(["--config", str(out), "--check", "backbone.name=iresnet_tiny",
                  "engine.precision=fp32", f"output={tmp_path / 'run'}"]) == 0


@pytest.mark.parametrize("network, want", [
    ("vit_t", {"name": "vit_t", "drop_path": 0.1, "mask_ratio": 0.1}),
    ("vit_t_dp005_mask0", {"name": "vit_t"}),  # ours as built
])
def test_its_vits_keep_their_drop_path_and_mask(tmp_path, network, want):
    job = _job(tmp_path).replace('"r18"', repr(network))
    out = tmp_path / "job.yaml"
    assert convert(["insightface-config", str(_configs(tmp_path, job)), str(out)]) == 0
    assert yaml.safe_load(out.read_text())["backbone"] == {**want, "embedding_size": 512}


@pytest.mark.parametrize("value", ["10 ** 10 ** 10", "'a' * 10 ** 10", "1 / 0", "10.0 ** 400",
                                   "[0] * 10 ** 9", "2 ** 64 * 2 ** 64"])
def test_arithmetic_that_would_not_end_is_refused_in_one_line(tmp_path, capsys, value):
    """``10 ** 10 ** 10`` took the converter's memory and hours: a config's numbers are counts
    and rates, so a power above 64, a repeated string or list and a number past 2^64 are
    refused, and 1 / 0 or a float overflow is a line too, not a traceback."""
    path = _configs(tmp_path, _job(tmp_path, f"config.lr = {value}\n"))
    assert convert(["insightface-config", str(path), str(tmp_path / "job.yaml")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"import error: {path}:16: `config.lr = {value}`: the value is not a literal or "
        "arithmetic over literals and earlier config keys"]


def test_a_refused_value_names_its_file_and_line(tmp_path, capsys):
    path = _configs(tmp_path, _job(tmp_path, "config.sample_rate = 1.5\n"))
    assert convert(["insightface-config", str(path), str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"{path}:16: head.sample_rate=1.5: must be a finite number >= 0 and <= 1" in err
