"""A converted folder's label-to-identity map: ``OUT/identities.json``, named in the manifest.

Labels are what the loader and the head see; a person reads names. The converter writes the
map beside the shards (before ``manifest.json``, which names it under ``"identities"``), so a
tool that lists training identities (``launch.overlap``) can print ``s12`` or
``m.0abc12`` instead of ``class 11``::

    {"origin": "the identity folder names of /data/faces", "names": ["s1", "s10", ...]}

``names[label]`` is the identity of ``label``; ``origin`` says where the names come from: an
image folder's sub-folder names, or, where the source holds no names (an insightface
``.rec`` stores labels only; the synthetic set), the stated fallback of the label itself.
A separate file, not a manifest field: WebFace42M's 2M names would make every loader read
tens of MB it never uses. Folders converted before the map existed have none; readers get
None and say so where it matters.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from data_pipeline.errors import DataError
from data_pipeline.json_file import MAX_IDENTITIES_BYTES, fetch_json, read_json
from data_pipeline.manifest import Manifest
from data_pipeline.remote import RemoteFolder, open_folder, scrub

IDENTITIES_NAME = "identities.json"


@dataclass(frozen=True)
class Identities:
    """``names[label]``: the identity of each label; ``origin``: where the names come from."""

    names: tuple[str, ...]
    origin: str


def numbered(num_classes: int, origin: str) -> Identities:
    """The fallback map of a source that holds no names: each label's name is the label."""
    return Identities(tuple(str(label) for label in range(num_classes)), origin)


def identities_bytes(identities: Identities) -> bytes:
    """The map as ``identities.json`` stores it (the manifest names that file)."""
    payload = {"origin": identities.origin, "names": list(identities.names)}
    return (json.dumps(payload) + "\n").encode()


def read_identities(data_dir: str | os.PathLike | RemoteFolder,
                    manifest: Manifest) -> Identities | None:
    """The map ``manifest`` names in ``data_dir`` (a local folder or a URL), None for a folder
    converted before maps were written. DataError naming the file when it is missing,
    malformed, or does not hold one name per class."""
    if not manifest.identities:
        return None
    folder = data_dir if isinstance(data_dir, RemoteFolder) else open_folder(data_dir)
    if isinstance(folder, Path):
        path = folder / manifest.identities
        where = str(path)
        if not path.is_file():
            raise DataError(f"{path}: missing, though manifest.json names it (copy it with the "
                            "shards, or convert the folder again)")
        raw = read_json(path, "identity map", limit=MAX_IDENTITIES_BYTES)
    else:
        where = scrub(folder.url_of(manifest.identities))
        raw = fetch_json(folder, manifest.identities, "identity map", limit=MAX_IDENTITIES_BYTES)
    try:
        identities = Identities(tuple(str(n) for n in raw["names"]), str(raw["origin"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{where}: malformed identity map ({type(exc).__name__}: {exc})") from exc
    if len(identities.names) != manifest.num_classes:
        raise DataError(f"{where}: {len(identities.names)} names for "
                        f"{manifest.num_classes} classes (convert the folder again)")
    return identities
