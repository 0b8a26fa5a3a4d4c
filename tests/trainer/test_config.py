"""trainer.config: every shipped recipe validates; bad configs fail with the expected one-liner."""

from pathlib import Path

import pytest
import yaml

from partial_fc.margins.registry import normface_scale_bound
from trainer.config import (
    ConfigError,
    ConfigWarning,
    dump_config,
    load_config,
)

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates(path):
    cfg = load_config(path, resolve=False)
    assert load_config(path, ["optim.lr=0.05"], resolve=False).optim.lr == 0.05
    if path.name != "base.yaml":  # each recipe's runs go to their own folder, named after it
        assert cfg.name == path.stem and cfg.run_dir == Path("runs") / path.stem


def _merged(base: dict, tree: dict) -> dict:
    """``tree`` over ``base`` as a recipe's ``base:`` merges (mappings key by key)."""
    out = dict(base)
    for key, value in tree.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def test_recipes_hold_only_differences_from_base():
    """A recipe key equal to what the recipe holds without it (its base's value, or the
    schema's default: for a margin key, its margin.type's) is a silent duplicate."""
    from trainer.config import Config
    from trainer.config.files import load_tree

    for path in CONFIGS:
        tree = yaml.safe_load(path.read_text())
        parent = path.parent / tree.pop("base") if "base" in tree else None
        base = load_tree(parent, {}) if parent else {}
        for section, values in tree.items():
            for key in values if isinstance(values, dict) else [None]:
                without = {s: v for s, v in tree.items() if s != section}
                if key is not None:
                    without[section] = {k: v for k, v in values.items() if k != key}
                have = Config.model_validate(_merged(base, without)).model_dump(mode="json")
                have = have[section] if key is None else have[section][key]
                value = values if key is None else values[key]
                assert have != value, f"{path.name}: {section}.{key}={value!r} repeats its base"


def _stated(tree: dict, prefix: str = "") -> dict:
    """``{"section.key": value}`` of every value a recipe's YAML states itself."""
    out = {}
    for key, value in tree.items():
        if key == "base" and not prefix:
            continue
        if isinstance(value, dict):
            out.update(_stated(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_value_a_recipe_states_is_the_value_it_trains_with(path):
    """Read from the YAML itself, not copied here: a key the loader drops, renames or lets
    its base override fails."""
    cfg = load_config(path, resolve=False).model_dump(mode="json")
    stated = _stated(yaml.safe_load(path.read_text()))
    assert stated or path.name == "base.yaml"
    for dotted, value in stated.items():
        have = cfg
        for part in dotted.split("."):
            have = have[part]
        want = list(value) if isinstance(value, tuple) else value
        assert have == want, (path.name, dotted, have, want)


def test_the_documented_vit_b_variant_validates():
    """docs/vit.md's 8-GPU variant of wf42m_vit_b (accumulation at r = 0.3)."""
    load_config(CONFIGS[0].parent / "wf42m_vit_b.yaml",
                ["train.batch_size=256", "train.grad_accum=12"], resolve=False)


def _write(tmp_path, name, tree):
    path = tmp_path / name
    path.write_text(tree if isinstance(tree, str) else yaml.safe_dump(tree))
    return path


# (file contents, overrides, fragments every one of which the error must contain)
BAD = [
    (
        {"margin": {"tpye": "cosface"}},
        [],
        ["cfg.yaml: margin.tpye: unknown key", "valid keys: type"],
    ),
    ({"bogus": 1}, [], ["cfg.yaml: bogus: unknown key", "valid keys: name, output"]),
    ({"optim": {"lr": "fast"}}, [], ["cfg.yaml: optim.lr='fast'", "valid number"]),
    ({"optim": {"lr": -0.1}}, [], ["optim.lr=-0.1", "greater than 0"]),
    ({"train": {"batch_size": 1.5}}, [], ["train.batch_size=1.5", "valid integer"]),
    ({"train": {"batch_size": "8"}}, [], ["train.batch_size='8'", "valid integer"]),
    ({"log": {"progress": 1}}, [], ["log.progress=1", "valid boolean"]),
    ({}, ["margin.type=foo"], ["command line: margin.type='foo': not one of normface|",
                               "|cosface|", "|adacos|"]),
    ({}, ["margin.type=arcfce"], ["margin.type='arcfce'", "(did you mean 'arcface'?)"]),
    (  # a key of another margin type: the types that read it, and this type's own keys
        {"margin": {"type": "cosface", "ema": 0.1}},
        [],
        ["cfg.yaml: margin.ema=0.1: only read by margin.type=adaface|curricularface "
         "(cosface's own keys: m)"],
    ),
    ({}, ["engine.zero_stage=3"], ["engine.zero_stage=3", "0, 1 or 2"]),
    ({}, ["head.sample_rate=-0.5"], ["head.sample_rate=-0.5: must be a finite number >= 0"]),
    ({}, ["head.sample_rate=1.5"], ["head.sample_rate=1.5: must be a finite number >= 0 and <= 1"]),
    ({}, ["optim.betas=[0.9]"], ["optim.betas=[0.9]", "at least 2"]),
    ({}, ["lr=0.1"], ["command line: lr: unknown key"]),
    ({}, ["optim.lrr=0.1"],
     ["optim.lrr: unknown key (did you mean optim.lr? valid keys: name, lr"]),
    ("", [], ["cfg.yaml: empty config: start from configs/smoke.yaml or a recipe"]),
    ("# only a comment\n", [], ["cfg.yaml: empty config: start from configs/smoke.yaml"]),
    ({}, ["margin.s"], ["command line: 'margin.s': overrides are dotted.key=value"]),
    ({}, ["train=3"], ["command line: train=3", "dictionary"]),
    ({}, ["backbone.name=resnet9"], ["backbone.name='resnet9': unknown", "iresnet50"]),
    (
        {"margin": {"type": "sphereface", "m": 0.5}},
        [],
        ["cfg.yaml: margin.m=0.5: sphereface needs an integer >= 1"],
    ),
    (
        {"margin": {"type": "sphereface", "m": 2.5}},
        [],
        ["cfg.yaml: margin.m=2.5: sphereface needs an integer >= 1"],
    ),
    ({}, ["margin.m=3.2"], ["command line: margin.m=3.2: arcface needs a finite number >= 0 "
                            "and < pi"]),
    ({"margin": {"type": "adacos"}}, [], ["margin.adacos=None", "fixed|dynamic"]),
    (
        {"margin": {"type": "adacos", "adacos": "dynamic"}, "train": {"grad_accum": 4}},
        [],
        ["cfg.yaml: train.grad_accum=4: not exact", "dynamic AdaCos"],
    ),
    ({}, ["engine.precision=fp16"], ["engine.precision='fp16': needs engine.type=deepspeed"]),
    ({}, ["backbone.checkpointing=1", "backbone.name=mobilefacenet"],
     ["command line: backbone.checkpointing=1: 'mobilefacenet' has no checkpointed blocks"]),
    ({}, ["backbone.depth=3"], ["command line: backbone.depth=3: a positive block count for "
                                "vit_* only"]),
    ({}, ["optim.decay=some"], ["optim.decay='some'", "'all' or 'weights'"]),
    ({}, ["margin.warmup_steps=-1"], ["margin.warmup_steps=-1: must be an integer >= 0"]),
    (  # a rule of partial_fc.margins, reported by the config check
        {"margin": {"type": "combined", "m1": 2.0, "m2": 0.5, "easy_margin": True}},
        [],
        ["cfg.yaml: margin.m2=0.5: easy_margin needs m1*pi/2 + m2 <= pi (m1=2.0)"],
    ),
    ("a: [1, 2\nb: 3\n", [], ["cfg.yaml: invalid YAML"]),
    ("- 1\n- 2\n", [], ["cfg.yaml: top level must be a mapping"]),
    ({"base": "missing.yaml"}, [], ["cfg.yaml: base='missing.yaml': no such file"]),
    ({"base": "cfg.yaml"}, [], ["base: cycle"]),
]


@pytest.mark.parametrize("tree,overrides,fragments", BAD)
def test_bad_config(tmp_path, tree, overrides, fragments):
    path = _write(tmp_path, "cfg.yaml", tree)
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides, resolve=False)
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, message


def test_all_errors_reported_together_and_attributed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "base.yaml", {"optim": {"lr": "x"}})
    path = _write(tmp_path, "cfg.yaml", {"base": "base.yaml", "train": {"epochs": 0}})
    with pytest.raises(ConfigError) as err:
        load_config(path, ["margin.typo=1", "log.every=-1"], resolve=False)
    lines = str(err.value).splitlines()
    assert len(lines) == 4, lines
    assert any(line.startswith("base.yaml: optim.lr='x'") for line in lines), lines
    assert any(line.startswith("cfg.yaml: train.epochs=0") for line in lines), lines
    assert any(line.startswith("command line: margin.typo: unknown key") for line in lines)
    assert any(line.startswith("command line: log.every=-1") for line in lines), lines


def test_inheritance_and_overrides(tmp_path):
    sub = tmp_path / "sub"
    sub.mkdir()
    _write(tmp_path, "base.yaml", {"margin": {"type": "cosface", "m": 0.3}, "optim": {"lr": 0.2}})
    _write(sub, "mid.yaml", {"base": "../base.yaml", "margin": {"m": 0.35}})
    path = _write(sub, "top.yaml", {"base": "mid.yaml", "eval": {"bins": ["a.bin"]}})
    cfg = load_config(path, ["optim.lr=1e-3", "eval.bins=[b.bin, c.bin]"], resolve=False)
    assert (cfg.margin.type, cfg.margin.m, cfg.margin.s) == ("cosface", 0.35, 64.0)
    assert cfg.optim.lr == 1e-3 and cfg.eval.bins == ["b.bin", "c.bin"]
    again = _write(tmp_path, "dumped.yaml", dump_config(cfg))
    assert load_config(again, resolve=False) == cfg


def test_theory_warnings(tmp_path):
    c = 100_000
    bound = normface_scale_bound(c, 0.9)
    assert bound == pytest.approx((c - 1) / c * __import__("math").log((c - 1) * 9))
    path = _write(tmp_path, "cfg.yaml", {"data": {"num_classes": c}})
    with pytest.warns(ConfigWarning, match=r"margin.s=10.0 is below .* bound 13.71"):
        load_config(path, ["margin.s=10.0"], resolve=False)
    with pytest.warns(ConfigWarning, match=r"CosFace range \[0, C/\(C-1\)\]"):
        load_config(path, ["margin.type=cosface", "margin.m=1.5"], resolve=False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(
            path, ["margin.type=adacos", "margin.adacos=fixed", "margin.s=1.0"], resolve=False
        )
        load_config(path, ["margin.s=14.0"], resolve=False)


def _manifest(folder, num_classes: int, num_samples: int):
    from data_pipeline.manifest import Manifest, ShardInfo, write_manifest

    folder.mkdir()
    shards = (ShardInfo("a.tar", num_samples, 1),)
    write_manifest(folder, Manifest(num_classes, num_samples, shards))
    return folder


def test_backbone_weights_must_be_a_local_file(tmp_path):
    path = _write(tmp_path, "cfg.yaml", {"data": {"source": "synthetic", "num_classes": 10},
                                         "log": {"wandb": "disabled"}})
    missing = tmp_path / "nope.pth"
    with pytest.raises(ConfigError, match=f"backbone.weights='{missing}': no such file"):
        load_config(path, [f"backbone.weights={missing}", f"output={tmp_path / 'run'}"])


def test_manifest_fills_checks_and_feeds_theory_checks(tmp_path):
    data = _manifest(tmp_path / "data", num_classes=1000, num_samples=5000)
    path = _write(tmp_path, "cfg.yaml", {"data": {"dir": str(data)}, "device": "cpu"})
    with pytest.warns(ConfigWarning, match=r"margin.s=5.0 is below .* for C=1000"):
        cfg = load_config(path, ["margin.s=5.0"])  # C known only from manifest.json
    assert (cfg.data.num_classes, cfg.data.num_samples) == (1000, 5000)
    with pytest.raises(ConfigError) as err:
        load_config(path, ["data.num_classes=999", "data.num_samples=4999", "eval.bins=[x.bin]"])
    lines = str(err.value).splitlines()
    assert (f"command line: data.num_classes=999: manifest.json in {data} says 1000; set "
            "data.num_classes=1000 or drop the key (the manifest fills it)") in lines
    assert f"command line: data.num_samples=4999: manifest.json in {data} says 5000; " \
           "set data.num_samples=5000" in str(err.value)
    assert any(line.startswith("command line: eval.bins[0]='x.bin': no such file (")
               for line in lines)  # all errors together
    with pytest.raises(ConfigError, match=rf"eval.rfw='{tmp_path}': no African_test.bin or "
                                          r"African.bin \(training evaluates RFW's .bin form"):
        load_config(path, [f"eval.rfw={tmp_path}"])


def _data_dir_error(tmp_path, folder) -> str:
    path = _write(tmp_path, "cfg.yaml", {"device": "cpu"})
    with pytest.raises(ConfigError) as err:
        load_config(path, [f"data.dir={folder}"])
    (line,) = [x for x in str(err.value).splitlines() if f"data.dir='{folder}'" in x]
    return line


def test_a_data_dir_without_a_data_set_says_what_is_there_and_what_makes_one(tmp_path):
    data = _manifest(tmp_path / "synthetic", num_classes=10, num_samples=20)
    typo = _data_dir_error(tmp_path, tmp_path / "synthtic")
    assert "no such folder" in typo and f"data.dir='{data}'" in typo  # the near name
    for line in (typo, _data_dir_error(tmp_path, tmp_path)):  # the folder exists, no data set
        assert "`python -m launch.convert insightface SRC DIR`" in line and "`make train`" in line
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "shard-000000.tar").write_bytes(b"")
    half = _data_dir_error(tmp_path, tmp_path / "half")
    assert "1 shard(s)" in half and "did not finish" in half and "launch.convert" in half


def test_malformed_manifest_is_a_config_error_among_others(tmp_path):
    data = _manifest(tmp_path / "data", num_classes=10, num_samples=20)
    (data / "manifest.json").write_text("{")
    path = _write(tmp_path, "cfg.yaml", {"data": {"dir": str(data)}, "device": "cpu"})
    with pytest.raises(ConfigError) as err:
        load_config(path, ["checkpoint.resume=nowhere"])
    lines = str(err.value).splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"{path}: data.dir='{data}': ") and "malformed manifest" in lines[0]
    assert lines[1].startswith("command line: checkpoint.resume='nowhere': no such folder (")



def _cpu():
    from trainer.config import Machine
    from trainer.config.machine import OPTIONAL_PACKAGES

    return Machine(installed=frozenset(OPTIONAL_PACKAGES))  # one CPU rank, every package


def test_resolve_returns_a_new_config_and_leaves_its_input_as_it_was(tmp_path):
    """The checks are pure: the sizes are filled in a copy, and the same config and machine
    give the same answer twice."""
    from trainer.config import resolve_config
    from trainer.config.on_disk import read_data_manifest

    data = _manifest(tmp_path / "data", num_classes=1000, num_samples=5000)
    path = _write(tmp_path, "cfg.yaml", {"data": {"dir": str(data)}, "device": "cpu"})
    cfg = load_config(path, resolve=False)
    before = cfg.model_dump()
    manifest, found = read_data_manifest(cfg)
    assert found == []
    first = resolve_config(cfg, manifest, _cpu())
    assert cfg.model_dump() == before and cfg.data.num_classes is None  # untouched
    assert (first.cfg.data.num_classes, first.cfg.data.num_samples) == (1000, 5000)
    assert first.cfg.data is not cfg.data and first.cfg.train is not cfg.train  # no sharing
    assert resolve_config(cfg, manifest, _cpu()) == first
    synthetic = load_config(path, ["data.source=synthetic", "data.num_classes=10"],
                            resolve=False)
    sized = resolve_config(synthetic, None, _cpu())
    assert sized.cfg.data.num_samples == 40 and synthetic.data.num_samples is None


def test_the_checks_answer_for_the_machine_they_are_given(tmp_path):
    """A snapshot of a GPU node with fewer GPUs than ranks is refused; the same config on a
    snapshot with enough passes; classes fewer than a world of 4 are refused, with no
    environment variable set."""
    from trainer.config import Machine, resolve_config
    from trainer.config.machine import OPTIONAL_PACKAGES

    path = _write(tmp_path, "cfg.yaml", {"data": {"source": "synthetic", "num_classes": 3}})
    cfg = load_config(path, ["device=cuda", "engine.type=ddp", "train.batch_size=2"],
                      resolve=False)
    packages = frozenset(OPTIONAL_PACKAGES)
    two_gpus = Machine(gpus=2, bf16=True, nccl=True, installed=packages)
    assert resolve_config(cfg, None, two_gpus.launching(2)).errors == []
    (refused,) = resolve_config(cfg, None, two_gpus.launching(3)).errors
    assert refused[0] == "device" and "3 ranks on this node but 2 GPU(s)" in refused[1]
    keys = [key for key, _ in resolve_config(cfg, None, two_gpus.launching(2, 2)).errors]
    assert keys == ["data.num_classes"]  # 4 ranks, 3 classes


def test_load_config_observes_the_machine_only_when_given_none(tmp_path, monkeypatch):
    from trainer.config import Machine

    seen = []
    monkeypatch.setattr(Machine, "observe", classmethod(lambda cls, *a: seen.append(a) or _cpu()))
    path = _write(tmp_path, "cfg.yaml", {"data": {"source": "synthetic", "num_classes": 10},
                                         "train": {"batch_size": 4}, "device": "cpu",
                                         "output": str(tmp_path / "run")})
    load_config(path, machine=_cpu())
    load_config(path, resolve=False)
    assert seen == []
    load_config(path)
    assert seen == [()]


def test_observe_reads_torchruns_launch_and_wandb_mode(monkeypatch):
    """The edge: the one place that reads the environment."""
    import sys

    from trainer.config import Machine

    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    here = Machine.observe()
    assert (here.world_size, here.local_ranks, here.wandb_mode) == (6, 3, "disabled")
    assert not here.has("tensorboard")
    assert here.launching(2, 4).world_size == 8 and here.launching(2, 4).local_ranks == 2


def test_observe_reads_the_gpus_from_torch(monkeypatch):
    """The edge's device calls (the one place in trainer.config that makes them), faked: what
    torch says is what the snapshot holds."""
    import torch

    from trainer.config import Machine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("Props", (), {"total_memory": 80 << 30}))
    here = Machine.observe()
    assert (here.cuda, here.gpus, here.bf16, here.nccl) == (True, 8, False, True)
    assert here.gpu_memory == 80 << 30 and here.host_memory > 1 << 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Machine.observe().gpus == 0 and not Machine.observe().cuda


def test_help_lists_every_key_with_its_description(capsys):
    """``launch.train --help`` is generated from the schema: every key has a description and
    appears with its type and default; a margin type's own keys under ``margin.type=TYPE:``."""
    from pydantic import BaseModel

    from launch.train import parse_args
    from trainer.config import MARGIN_MODELS, Config

    keys = {}
    for name, field in Config.model_fields.items():
        assert field.description, f"{name}: Field(description=...) missing"
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            for key, sub in section.model_fields.items():
                assert sub.description, f"{name}.{key}: Field(description=...) missing"
                keys[f"{name}.{key}"] = sub.description
        elif name != "margin":
            keys[name] = field.description
    with pytest.raises(SystemExit) as done:
        parse_args(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    shown = {ln.split(":")[0].strip(): i for i, ln in enumerate(lines) if ln.startswith("  ")
             and not ln.startswith("   ") and ": " in ln}
    missing = sorted(set(keys) - set(shown))
    assert not missing, f"not in --help: {missing}"
    for key, description in keys.items():  # the description follows its key line
        following = " ".join(ln.strip() for ln in lines[shown[key] + 1 : shown[key] + 6])
        assert following.startswith(" ".join(description.split())[:40]), key
    assert lines[shown["margin.type"]].endswith("|elasticface_cos_plus = arcface")
    assert lines[shown["train.max_steps"]] == "  train.max_steps: int (> 0) | null = null"
    assert lines[shown["optim.betas"]].endswith("(length 2) = [0.9, 0.999]")
    shared = MARGIN_MODELS["normface"].model_fields
    for key in shared:
        assert f"margin.{key}" in shown, key
    for kind, model in MARGIN_MODELS.items():  # each type's own keys, under its heading
        own = [k for k in model.model_fields if k not in shared]
        at = next(i for i, ln in enumerate(lines) if ln.startswith(f"  margin.type={kind}:"))
        block = [ln.strip() for ln in lines[at + 1:] if ln.startswith("    margin.")]
        assert [ln.split(":")[0] for ln in block[:len(own)]] == [f"margin.{k}" for k in own]
        if own:
            default = model.model_fields[own[0]].default
            assert block[0].endswith(f"= {'true' if default is True else default}"), block[0]
    sphere = lines.index("  margin.type=sphereface:")
    assert lines[sphere + 1] == "    margin.m: float (>= 1) = 4"


def test_margin_schema_is_one_model_per_registered_type():
    """The margin section holds, for each type of the registry, exactly the keys that type's
    margin reads (plus p_w), no more: a key of another type is refused."""
    from pydantic import ValidationError

    from partial_fc.margins.registry import MARGIN_TYPES, SHARED_KEYS, own_keys
    from trainer.config import MARGIN_MODELS, Config

    assert tuple(MARGIN_MODELS) == MARGIN_TYPES
    for kind, model in MARGIN_MODELS.items():
        assert set(model.model_fields) == {"type", *SHARED_KEYS, *own_keys(kind), "p_w"}, kind
        assert Config.model_validate({"margin": {"type": kind}}).margin.type == kind
    with pytest.raises(ValidationError, match="union_tag_invalid|does not match"):
        Config.model_validate({"margin": {"type": "focal"}})
    with pytest.raises(ValidationError, match="extra"):
        Config.model_validate({"margin": {"type": "cosface", "h": 0.3}})
    assert Config.model_validate({"margin": {"type": "adaface", "h": 0.3}}).margin.h == 0.3


def test_margin_schema_defaults_are_the_registrys():
    """Every default of every type's margin section is its registry declaration's (the
    type's dataclass, the shared keys'), and what the margin reads from the schema's defaults
    is exactly those."""
    import dataclasses

    from partial_fc.margins.keys import SharedConfig
    from partial_fc.margins.registry import REGISTRY, effective
    from trainer.config import MARGIN_MODELS

    for kind, spec in REGISTRY.items():
        fields = MARGIN_MODELS[kind].model_fields
        declared = [*dataclasses.fields(SharedConfig), *dataclasses.fields(spec.config)]
        for f in declared:
            assert fields[f.name].default == f.default, (kind, f.name)
            assert fields[f.name].description == f.metadata["description"], (kind, f.name)
        read = effective(MARGIN_MODELS[kind]().model_dump(exclude={"p_w"}))
        assert read == {"type": kind, **{f.name: f.default for f in declared}}, kind


def test_data_dirs_sum_their_manifests_and_check_each(tmp_path):
    a = _manifest(tmp_path / "a", num_classes=10, num_samples=20)
    b = _manifest(tmp_path / "b", num_classes=7, num_samples=30)
    path = _write(tmp_path, "cfg.yaml", {"data": {"dirs": [str(a), str(b)]}, "device": "cpu"})
    cfg = load_config(path, ["data.weights=[1, 2]", f"data.exclude=[null, {path}]",
                             "train.batch_size=8"])
    assert (cfg.data.num_classes, cfg.data.num_samples) == (17, 50)
    assert cfg.data.folders() == [str(a), str(b)] and cfg.data.exclusions() == [None, str(path)]
    with pytest.raises(ConfigError) as err:
        load_config(path, [f"data.dirs=[{a}, {tmp_path / 'c'}]", "data.weights=[1]",
                           f"data.exclude={path}", "data.dir=x", "data.num_classes=16"])
    lines = str(err.value).splitlines()
    for text in ("data.dirs[1]=", "data.weights=[1.0]: one weight per folder of data.dirs "
                 "(2 folders)", f"data.exclude='{path}': a list names labels of one folder",
                 "data.dir='x': give data.dir or data.dirs, not both"):
        assert any(text in line for line in lines), (text, lines)
    with pytest.raises(ConfigError, match=r"data.exclude\[1\]=.nope.: no such file"):
        load_config(path, ["data.exclude=[null, nope]"])


SMOKE = CONFIGS[0].parent / "smoke.yaml"


def test_subcenters_with_the_triton_kernels_are_refused():
    """The kernels have no K-way max: head.kernel=triton (fatal on a kernel failure) cannot
    run a sub-center head; auto takes the torch path and says so at start-up."""
    with pytest.raises(ConfigError, match=r"head.kernel='triton': the Triton kernels have no "
                                          r"K-way max for margin.subcenters=3"):
        load_config(SMOKE, ["margin.subcenters=3", "head.kernel=triton"], resolve=False)
    cfg = load_config(SMOKE, ["margin.subcenters=3"], resolve=False)
    assert cfg.partial_fc_kwargs()["subcenters"] == 3
