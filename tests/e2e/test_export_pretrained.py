"""launch.export --format safetensors: the folder round-trips to the same embeddings through
trainer.pretrained.load_pretrained, and its model card is Hub-format YAML filled from the run."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from eval_helpers import make_run

from launch.export import main
from trainer.checkpoint.backbone import load_backbone
from trainer.pretrained import load_pretrained
from trainer.telemetry.run_files import METRICS


def _front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_folder_round_trips_to_the_same_embeddings(tmp_path, capsys):
    run = make_run(tmp_path, embedding_size=16)
    rows = [{"step": 10, "loss": 1.0},
            {"step": 10, "val/orl/accuracy": 0.9125, "val/orl/tar@far=1e-02": 0.5}]
    (run / METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "shipped"
    assert main(["--checkpoint", str(run), "--format", "safetensors", "--license",
                 "CC-BY-NC-4.0", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}/")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json",
                                                       "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert (config["architecture"], config["embedding_size"]) == ("iresnet_tiny", 16)
    assert config["input_size"] == [112, 112] and config["flip_tta"] is True

    got_model = load_pretrained(out)
    want_model, _ = load_backbone(run)
    x = torch.rand(3, 3, 112, 112, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        assert torch.equal(got_model(x), want_model(x))

    card = (out / "README.md").read_text()
    meta = _front_matter(card)
    assert meta["license"] == "cc-by-nc-4.0" and meta["library_name"] == "partial-fc"
    result = meta["model-index"][0]["results"][0]
    assert result["dataset"]["name"] == "orl"
    assert {"type": "accuracy", "value": 0.9125} in result["metrics"]
    assert "steps: 10 " in card and "| orl | 91.25 | 50.00 |" in card


def test_an_unlisted_licence_is_other_with_its_name(tmp_path):
    run = make_run(tmp_path)
    out = tmp_path / "shipped"
    assert main(["--checkpoint", str(run), "--format", "safetensors", "--license",
                 "InsightFace non-commercial", "--out", str(out)]) == 0
    meta = _front_matter((out / "README.md").read_text())
    assert (meta["license"], meta["license_name"]) == ("other", "insightface-non-commercial")
    assert "model-index" not in meta  # the run never evaluated
    assert "not evaluated" in (out / "README.md").read_text()


def test_safetensors_needs_a_licence(tmp_path, capsys):
    run = make_run(tmp_path)
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(run), "--format", "safetensors", "--out", str(tmp_path / "o")])
    assert caught.value.code == 2 and "--license" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["no config", "foreign config", "other architecture"])
def test_load_pretrained_refuses_a_bad_folder_in_one_line(tmp_path, damage):
    run = make_run(tmp_path)
    out = tmp_path / "shipped"
    main(["--checkpoint", str(run), "--format", "safetensors", "--license", "mit",
          "--out", str(out)])
    config = json.loads((out / "config.json").read_text())
    if damage == "no config":
        (out / "config.json").unlink()
    elif damage == "foreign config":
        (out / "config.json").write_text(json.dumps({"model_type": "bert"}))
    else:
        (out / "config.json").write_text(json.dumps({**config, "architecture": "mbf"}))
    with pytest.raises(ValueError) as caught:
        load_pretrained(out)
    assert len(str(caught.value).splitlines()) == 1
    assert {"no config": "missing", "foreign config": "not a partial-fc",
            "other architecture": "does not fit 'mbf'"}[damage] in str(caught.value)
