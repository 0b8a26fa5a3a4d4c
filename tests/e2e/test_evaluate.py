"""launch.evaluate, trainer.evaluation, trainer.checkpoint.backbone: embeddings, metrics,
gathering across ranks, the CLI."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import yaml
from eval_helpers import (
    MeanColour,
    make_color_bin,
    make_run,
)
from spawn import run_ranks
from torch import nn

from data_pipeline.codec import decode_image
from data_pipeline.verification_bin import read_bin, write_bin
from launch.evaluate import main
from partial_fc.eval.verification import evaluate_pairs
from trainer.checkpoint import find_verified
from trainer.checkpoint.backbone import CheckpointError, load_backbone
from trainer.checkpoint.integrity import META, sha256
from trainer.evaluation import embed_images, evaluate_bins


def _reference(model, path):
    """Single-process reference: f(x) + f(flip x), normalised, per image, no batching."""
    encoded, issame = read_bin(path)
    embs = []
    with torch.no_grad():
        for b in encoded:
            x = torch.tensor(decode_image(b, 112, "pil").transpose(2, 0, 1))[None] / 127.5 - 1
            e = model(x) + model(torch.flip(x, dims=[3]))
            embs.append(torch.nn.functional.normalize(e, dim=1)[0])
    emb = torch.stack(embs).numpy()
    return evaluate_pairs(emb[0::2], emb[1::2], issame)


def test_colour_pairs_are_separated(tmp_path):
    make_color_bin(tmp_path / "colours.bin", num_pairs=40)
    model = MeanColour().train()
    out = evaluate_bins(model, [tmp_path / "colours.bin"], batch_size=16, device="cpu")
    assert list(out) == ["colours"]
    assert out["colours"]["accuracy"] == 1.0 and out["colours"]["auc"] == 1.0
    assert model.training  # mode restored


def test_matches_unbatched_reference_and_restores_mode(tmp_path):
    make_color_bin(tmp_path / "a.bin", num_pairs=12)
    model, _ = load_backbone(make_run(tmp_path))
    out = evaluate_bins(model, [tmp_path / "a.bin"], batch_size=5, device="cpu")["a"]
    ref = _reference(model, tmp_path / "a.bin")
    assert out.keys() == ref.keys()
    for key in out:
        assert out[key] == pytest.approx(ref[key], abs=1e-6), key
    assert not model.training


class _LeftRight(nn.Module):
    """Mean colour of the left and of the right half: NOT invariant to a horizontal flip."""

    def __init__(self) -> None:
        super().__init__()
        self.right = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        halves = x[..., :56].mean(dim=(2, 3)), self.right * x[..., 56:].mean(dim=(2, 3))
        return torch.cat(halves, 1)


def test_embed_images_sums_the_flip_and_normalises():
    model, images = _LeftRight(), torch.randint(0, 256, (3, 3, 112, 112), dtype=torch.uint8)
    emb = embed_images(model, images, batch_size=2, device="cpu")
    x = images.float() / 127.5 - 1
    want = torch.nn.functional.normalize(model(x) + model(x.flip(3)), dim=1)
    torch.testing.assert_close(emb, want)
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(3))
    torch.testing.assert_close(emb, embed_images(model, images.flip(3), 2, "cpu"))
    assert not torch.allclose(model(x), model(x.flip(3)))  # the model alone is not invariant


def test_load_backbone_paths_and_errors(tmp_path):
    run = make_run(tmp_path)
    ref, cfg = load_backbone(run)
    assert cfg["backbone"]["name"] == "iresnet_tiny" and not ref.training
    x = torch.rand(2, 3, 112, 112) * 2 - 1
    for path in (run / "checkpoints" / "step-00000010",
                 run / "checkpoints" / "step-00000010" / "backbone.pt"):
        torch.testing.assert_close(load_backbone(path)[0](x), ref(x))
    (run / "config.yaml").write_text(yaml.safe_dump({"name": "t"}))
    with pytest.raises(CheckpointError, match="config.yaml: no 'backbone' section"):
        load_backbone(run)
    (run / "config.yaml").write_text(yaml.safe_dump(
        {"backbone": {"name": "iresnet_tiny", "embedding_size": 32}}))
    with pytest.raises(CheckpointError, match="backbone.pt: does not fit backbone 'iresnet_tiny'"):
        load_backbone(run)
    (run / "config.yaml").write_text(yaml.safe_dump({"backbone": {"name": "iresnet_tiny"}}))
    with pytest.raises(CheckpointError, match="config.yaml: missing key backbone.embedding_size"):
        load_backbone(run)
    with pytest.raises(CheckpointError, match="meta.json: not a backbone.pt"):
        load_backbone(run / "checkpoints" / "step-00000010" / "meta.json")
    shutil.rmtree(run / "checkpoints" / "step-00000010")
    with pytest.raises(CheckpointError, match="run: no checkpoint there") as err:
        load_backbone(run)
    assert "`make train`" in str(err.value)  # what makes one
    with pytest.raises(CheckpointError, match="runs: no such folder"):
        load_backbone(tmp_path / "runs")


def test_a_missing_bin_names_what_makes_one(tmp_path, capsys):
    from launch.evaluate import main

    with pytest.raises(SystemExit) as exit_:
        main(["--checkpoint", str(tmp_path), "--bin", str(tmp_path / "lfw.bin")])
    assert exit_.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert f"--bin {tmp_path / 'lfw.bin'}: no such file" in line
    assert "`make data/orl_s31-s40.bin`" in line


def _corrupt(file):
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def test_corrupt_checkpoint_falls_back_or_is_refused_in_one_line(tmp_path, capsys):
    """The trainer's resume rules (``trainer.checkpoint.find_verified``): a corrupt newest
    checkpoint of a RUN is reported and the newest intact one loaded; one named explicitly
    is refused; none intact is refused. Each refusal is one line, also through the CLI."""
    run = make_run(tmp_path)  # step-10
    make_run(tmp_path, tag="step-00000020", seed=1)  # newer, other weights; latest names it
    x = torch.rand(2, 3, 112, 112) * 2 - 1
    older = load_backbone(run / "checkpoints" / "step-00000010")[0](x)
    newer = load_backbone(run)[0](x)
    assert not torch.allclose(older, newer)  # the two checkpoints are told apart
    assert capsys.readouterr().err == ""  # latest verifies: nothing to report
    new = run / "checkpoints" / "step-00000020"
    _corrupt(new / "backbone.pt")
    torch.testing.assert_close(load_backbone(run)[0](x), older)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"warning: {new / 'backbone.pt'}: SHA-256 differs"), err
    assert "using step-00000010" in err[1] and len(err) == 2, err
    for explicit in (new, new / "backbone.pt"):
        with pytest.raises(CheckpointError, match="backbone.pt: SHA-256 differs") as caught:
            load_backbone(explicit)
        assert "\n" not in str(caught.value)
    make_color_bin(tmp_path / "v.bin", num_pairs=4)
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(new), "--bin", str(tmp_path / "v.bin"), "--device", "cpu"])
    assert caught.value.code == 2  # a bad input, as every program's bad input
    assert capsys.readouterr().err == f"error: {new / 'backbone.pt'}: SHA-256 differs from " \
                                      "meta.json: corrupted or replaced\n"
    _corrupt(run / "checkpoints" / "step-00000010" / "backbone.pt")
    with pytest.raises(CheckpointError, match=r"checkpoints: no checkpoint verifies \(see the "
                       r"warnings above\)$"):
        load_backbone(run)


def test_evaluation_hashes_only_the_backbone_it_reads(tmp_path, capsys):
    """A checkpoint's head rows are listed in meta.json but evaluation never opens them: a
    corrupt row file leaves the newest checkpoint usable here (training's resume, which
    reads it, still refuses the folder); a file missing from the listing is still refused."""
    run = make_run(tmp_path)
    folder = run / "checkpoints" / "step-00000010"
    (folder / "head").mkdir()
    (folder / "head" / "rows.0.4").write_bytes(b"rows of the head")
    meta = json.loads((folder / META).read_text())
    meta["files"]["head/rows.0.4"] = sha256(folder / "head" / "rows.0.4")
    (folder / META).write_text(json.dumps(meta))
    _corrupt(folder / "head" / "rows.0.4")
    x = torch.rand(2, 3, 112, 112) * 2 - 1
    assert load_backbone(run)[0](x).shape == (2, 16)
    assert capsys.readouterr().err == ""  # no warning, no fallback
    with pytest.raises(CheckpointError, match=r"rows.0.4: SHA-256 differs"):
        find_verified(folder)
    (folder / "head" / "stray.pt").write_bytes(b"planted")
    with pytest.raises(CheckpointError, match=r"stray.pt: not listed in meta.json"):
        load_backbone(folder)


def test_embed_images_keeps_the_norm_when_asked():
    model, images = _LeftRight(), torch.randint(0, 256, (3, 3, 112, 112), dtype=torch.uint8)
    x = images.float() / 127.5 - 1
    raw = embed_images(model, images, batch_size=2, device="cpu", normalise=False)
    torch.testing.assert_close(raw, model(x) + model(x.flip(3)))
    assert not torch.allclose(raw.norm(dim=1), torch.ones(3))


def test_cli_rfw_groups_and_fairness_table(tmp_path, capsys):
    run = make_run(tmp_path)
    (tmp_path / "rfw").mkdir()
    for seed, group in enumerate(("African", "Asian", "Caucasian")):
        make_color_bin(tmp_path / "rfw" / f"{group}_test.bin", num_pairs=10, seed=seed)
    args = ["--checkpoint", str(run), "--rfw", str(tmp_path / "rfw"), "--device", "cpu"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no Indian_test.bin, Indian.bin or txts/Indian/Indian_pairs.txt" in err
    make_color_bin(tmp_path / "rfw" / "Indian.bin", num_pairs=10, seed=3)
    assert main([*args, "--json", str(tmp_path / "r.json")]) == 0
    verification, fairness = capsys.readouterr().out.split("\n\n")
    assert [ln.split()[0] for ln in verification.splitlines()[2:6]] == [
        "RFW/African", "RFW/Asian", "RFW/Caucasian", "RFW/Indian"]
    assert "gap (%)" in fairness and fairness.splitlines()[2].startswith("RFW ")
    saved = json.loads((tmp_path / "r.json").read_text())
    accuracy = [saved[f"RFW/{g}"]["accuracy"] for g in ("African", "Asian", "Caucasian", "Indian")]
    assert saved["RFW"]["mean"] == pytest.approx(np.mean(accuracy))
    assert saved["RFW"]["gap"] == pytest.approx(max(accuracy) - min(accuracy))


def test_cli_prints_table_and_json(tmp_path, capsys):
    run = make_run(tmp_path)
    make_color_bin(tmp_path / "lfw.bin", num_pairs=10)
    make_color_bin(tmp_path / "cfp.bin", num_pairs=10, seed=1)
    assert main(["--checkpoint", str(run), "--bin", str(tmp_path / "lfw.bin"),
                 str(tmp_path / "cfp.bin"), "--device", "cpu", "--json",
                 str(tmp_path / "r.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["set", "pairs", "accuracy"]
    assert [ln.split()[0] for ln in lines[2:4]] == ["lfw", "cfp"]
    # 5 impostor pairs cannot resolve FAR 1e-3: the TAR is printed, marked, with a note.
    assert "TAR@1e-03 (%)" in lines[0] and lines[2].split()[-1].endswith("*"), lines
    assert lines[4].startswith("* fewer than 1/FAR impostor pairs") and len(lines) == 5
    saved = json.loads((tmp_path / "r.json").read_text())
    assert set(saved) == {"lfw", "cfp"} and saved["lfw"]["num_pairs"] == 10
    assert saved["lfw"]["impostor_pairs"] == 5
    # The JSON holds the TAR the table prints (last column: FAR 1e-3, marked).
    assert lines[2].split()[-1] == f"{100 * saved['lfw']['tar@far=1e-03']:.2f}*", lines


def _ranks(rank, world, run, bin_path):
    model, _ = load_backbone(run)
    seen = []
    model.register_forward_hook(lambda m, inputs, out: seen.append(len(inputs[0])))
    out = evaluate_bins(model, [bin_path], batch_size=4, device="cpu")
    return out, sum(seen)


@pytest.mark.slow
def test_three_ranks_match_one_process(tmp_path):
    # 11 pairs = 22 images over 3 ranks: shares of 8, the last one padded by two images.
    run = make_run(tmp_path)
    make_color_bin(tmp_path / "v.bin", num_pairs=11)
    results = run_ranks(_ranks, 3, args=(run, tmp_path / "v.bin"))
    outs = [out for out, _ in results]
    assert outs[0] == outs[1] == outs[2]
    assert [n for _, n in results] == [2 * 8] * 3  # each rank embeds its share (+ flips) only
    model, _ = load_backbone(run)
    ref = evaluate_bins(model, [tmp_path / "v.bin"], batch_size=22, device="cpu")["v"]
    for key, value in ref.items():
        assert outs[0]["v"][key] == pytest.approx(value, abs=1e-6), key
    assert np.isfinite(list(ref.values())).all()


@pytest.mark.parametrize("program", ["launch.evaluate", "launch.export"])
def test_help(program, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(program).main(["--help"])
    text = capsys.readouterr().out
    assert exit_info.value.code == 0 and "--checkpoint" in text
    assert "``" not in text and ":func:" not in text and "::" not in text  # plain text, not reST


def test_repeated_images_are_embedded_once(tmp_path):
    # Pairs reuse images (as real sets do: one face in several pairs): each distinct image
    # is embedded once, and the metrics equal the per-entry reference.
    make_color_bin(tmp_path / "u.bin", num_pairs=6)
    encoded, issame = read_bin(tmp_path / "u.bin")
    entries = [encoded[(5 * i) % len(encoded)] for i in range(2 * 20)]  # 12 distinct images
    write_bin(tmp_path / "r.bin", entries, [bool(i % 2) for i in range(20)])
    model, _ = load_backbone(make_run(tmp_path))
    seen = []
    model.register_forward_hook(lambda m, inputs, out: seen.append(len(inputs[0])))
    out = evaluate_bins(model, [tmp_path / "r.bin"], batch_size=64, device="cpu")["r"]
    assert sum(seen) == 2 * len(set(entries)) == 2 * 12  # image + flip, once per distinct image
    ref = _reference(model, tmp_path / "r.bin")
    for key in out:
        assert out[key] == pytest.approx(ref[key], abs=1e-6), key
