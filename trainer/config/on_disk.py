"""The file-system facts the config checks need, read in this one place: the data's
``manifest.json`` (and what is at ``data.dir`` instead of one; at a URL, also its shards), and
the paths a run will open (``backbone.weights``, ``checkpoint.resume``, ``eval.bins``) or write
(the run folder).

Each function returns (dotted key, message) pairs as the checks in
:mod:`trainer.config.checks` do; :func:`trainer.config.load_config` reports them together.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from data_pipeline.store import in_store
from trainer.config.schema import Config
from trainer.yaml_file import shown_value

if TYPE_CHECKING:
    from data_pipeline.manifest import Manifest

MAKE_DATA = ("convert a data set with `python -m launch.convert insightface SRC DIR` (or "
             "`imagefolder SRC DIR`), or `make train` for the synthetic set in data/synthetic")


def read_data_manifest(cfg: Config) -> tuple[Manifest | None, list[tuple[str, str]]]:
    """``data.dir/manifest.json`` for ``data.source=shards`` (None for synthetic data), or
    None and one line saying what is there instead; with ``data.dirs`` their manifests
    summed (classes, samples, shards), each checked."""
    if cfg.data.source != "shards":
        return None, []
    from data_pipeline import read_manifest
    from data_pipeline.errors import DataError
    from data_pipeline.manifest import Manifest
    from data_pipeline.remote import is_url
    from data_pipeline.remote_shards import check_remote_folder

    keyed = [(f"data.dirs.{i}", f"data.dirs[{i}]", d) for i, d in enumerate(cfg.data.dirs)] \
        if cfg.data.dirs else [("data.dir", "data.dir", cfg.data.dir)]
    manifests, out = [], []
    for key, name, folder in keyed:
        if is_url(folder):  # a URL: its manifest, then its shards' presence and sizes
            try:
                manifests.append(check_remote_folder(folder))
            except DataError as err:  # denied, missing, no credentials: one line, the URL
                out.append((key, f"{name}: {err}"))
            continue
        data_dir = Path(folder)
        if not os.path.isfile(data_dir / "manifest.json"):
            out.append((key, f"{name}={shown_value(folder)}: {_no_manifest(data_dir)}"))
            continue
        try:
            manifests.append(read_manifest(data_dir))
        except DataError as err:  # a malformed manifest is one more line of the report
            out.append((key, f"{name}={shown_value(folder)}: {err}"))
    if out:
        return None, out
    classes = sum(m.num_classes for m in manifests)
    if cfg.data.merge is not None:
        classes, out = _merged_classes(cfg, manifests)
    if len(manifests) == 1 and classes == manifests[0].num_classes:
        return manifests[0], out
    return Manifest(num_classes=classes, num_samples=sum(m.num_samples for m in manifests),
                    shards=tuple(s for m in manifests for s in m.shards)), out


def _merged_classes(cfg: Config, manifests: list[Manifest]) -> tuple[int, list[tuple[str,
                                                                                       str]]]:
    """The classes of ``data.dirs`` once ``data.merge`` joins its pairs (one per person), or
    their sum and the one line that refuses the list (``file:line`` of a bad line, a set
    that is not its folder or no longer holds what the list was made from, a class out of
    range)."""
    from data_pipeline.errors import DataError
    from data_pipeline.merge import check_contents, check_folders, merged_count, read_merge

    try:
        merge = read_merge(cfg.data.merge)
        check_folders(merge, cfg.data.folders())
        check_contents(merge, cfg.data.folders(), manifests)
        # counted, not mapped: the head's memory check is after
        return merged_count(merge, [m.num_classes for m in manifests]), []
    except DataError as err:
        return sum(m.num_classes for m in manifests), [("data.merge", f"data.merge: {err}")]


def with_merge_digest(cfg: Config) -> tuple[Config, list[tuple[str, str]]]:
    """``cfg`` with ``data.merge_digest`` filled from the list ``data.merge`` names (a run
    records what it merged, not only where the list was), or the line saying a given digest
    is not the list's; unchanged without a readable list (:func:`read_data_manifest` says
    why)."""
    from data_pipeline.errors import DataError
    from data_pipeline.merge import read_merge

    data = cfg.data
    if data.merge is None or data.source != "shards":
        return cfg, []
    try:
        digest = read_merge(data.merge).digest
    except DataError:
        return cfg, []
    if data.merge_digest is None:
        return cfg.model_copy(update={"data": data.model_copy(
            update={"merge_digest": digest})}, deep=True), []
    if data.merge_digest != digest:
        return cfg, [("data.merge_digest", f"data.merge_digest={data.merge_digest}: "
                      f"data.merge={data.merge} holds other pairs now (digest {digest}); a "
                      "run's list cannot change under it: drop the key to start a new run")]
    return cfg, []


def _no_manifest(data_dir: Path) -> str:
    """What is at ``data_dir`` instead of a converted data set, and what makes one. The
    manifest is written last (data_pipeline.writer), so shards without it are a conversion
    that did not finish."""
    if not os.path.exists(data_dir):
        import difflib

        parent = data_dir.parent if os.path.isdir(data_dir.parent) else None
        sets = [p.name for p in parent.iterdir() if (p / "manifest.json").is_file()] if parent \
            else []
        near = difflib.get_close_matches(data_dir.name, sets, n=1)
        near_dir = str(data_dir.parent / near[0]) if near else ""
        hint = f" (did you mean data.dir={shown_value(near_dir)}?)" if near else ""
        return f"no such folder{hint}; {MAKE_DATA}"
    shards = len(list(data_dir.glob("*.tar"))) if os.path.isdir(data_dir) else 0
    if shards:
        return (f"no manifest.json there but {shards} shard(s): the conversion did not finish; "
                "run the same `python -m launch.convert` command again (it keeps finished "
                "shards)")
    return f"no manifest.json there (the folder holds no converted data set); {MAKE_DATA}"


def path_errors(cfg: Config) -> list[tuple[str, str]]:
    """The run folder must be writable; the weights, resume folder and eval sets must exist."""
    # os.path's tests, not pathlib's: they answer False for a name the system refuses (too
    # long, a NUL in it), where Path.is_file raises
    out = _output_errors(cfg)
    weights = cfg.backbone.weights
    if weights is not None and not os.path.isfile(weights):
        out.append(("backbone.weights", f"backbone.weights={shown_value(weights)}"
                                        ": no such file (a local "
                    "state_dict; nothing is downloaded)"))
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not in_store(resume) and not os.path.isdir(resume):
        out.append(("checkpoint.resume", f"checkpoint.resume={shown_value(resume)}"
                                         ": no such folder (give "
                    "a run folder or one of its checkpoints/step-* folders, or auto / none)"))
    listed = isinstance(cfg.data.exclude, list)
    lists = cfg.data.exclude if listed else [cfg.data.exclude]
    for i, x in enumerate(lists if cfg.data.source == "shards" else []):
        if x is not None and not os.path.isfile(x):
            key, name = (f"data.exclude.{i}", f"data.exclude[{i}]") if listed else \
                ("data.exclude", "data.exclude")
            out.append((key, f"{name}={shown_value(x)}: no such file (an exclusion list: python -m "
                        "launch.overlap writes one)"))
    for i, b in enumerate(cfg.eval.bins):
        if not os.path.isfile(b):
            from data_pipeline.verification_bin import MISSING_BIN_FIX

            out.append((f"eval.bins.{i}", f"eval.bins[{i}]={shown_value(b)}: no such file "
                        f"({MISSING_BIN_FIX})"))
    if cfg.eval.rfw is not None:
        from data_pipeline.rfw import find_rfw_bin
        from partial_fc.eval.fairness import RFW_GROUPS

        missing = [g for g in RFW_GROUPS if find_rfw_bin(Path(cfg.eval.rfw), g) is None]
        if missing:
            out.append(("eval.rfw", f"eval.rfw={shown_value(cfg.eval.rfw)}"
                                    f": no {missing[0]}_test.bin or "
                        f"{missing[0]}.bin (training evaluates RFW's .bin form: one per group, "
                        f"{', '.join(RFW_GROUPS)})"))
    return out


def _output_errors(cfg: Config) -> list[tuple[str, str]]:
    """The run folder must be creatable and writable (checked before any process group);
    in a store, by writing and removing one small object there (its client installed, the
    bucket there, the credentials allowed to write)."""
    key = "output" if cfg.output is not None else "name"
    if in_store(cfg.run_location):
        from data_pipeline.store import StorageError, open_store

        try:
            store = open_store(cfg.run_location)
            probe = f".write-check-{uuid.uuid4().hex}"
            store.put(probe, b"")
            store.remove(probe)
        except StorageError as err:
            return [(key, f"output={shown_value(cfg.run_location)}: cannot write there: {err}")]
        return []
    folder = cfg.run_dir.absolute()
    try:
        existing = next(p for p in (folder, *folder.parents) if p.exists())
    except (OSError, ValueError) as exc:  # a name too long (ENAMETOOLONG), a NUL in it
        return [(key, f"output={shown_value(str(cfg.run_dir))}: not a path this system takes "
                      f"({getattr(exc, 'strerror', None) or exc})")]
    if not existing.is_dir():
        return [(key, f"output={shown_value(str(cfg.run_dir))}: {existing} is not a folder")]
    try:  # a real write: permission bits say nothing for root, read-only mounts or NFS
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return [(key, f"output={shown_value(str(cfg.run_dir))}: cannot write in {existing} "
                      f"({exc.strerror})")]
    return []
