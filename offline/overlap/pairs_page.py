"""What ``launch.overlap --between --json/--html`` writes for a person deciding which pairs
are one person: the calibration, the counts, and each pair with its two classes' images side
by side (the page), so that the merge list can be struck before training.

The page is one self-contained file: each class shows its first :data:`PER_CLASS` images
(in shard order; the JPEG bytes the shards hold, inlined), read on rank 0 by one pass over
each set's shards that decodes nothing.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from offline.folder_scan import labelled_samples
from offline.overlap.figure import calibration_json
from offline.overlap.pairs import FoundPairs

PER_CLASS = 4  # images of each class on the page


def pairs_json(checkpoint: str, found: FoundPairs) -> dict:
    """The JSON: the ``checkpoint`` searched with, the sets (folder, classes, searched),
    ``within``, the threshold, the calibration (``offline.overlap.figure.calibration_json``),
    the searches and the false pairs expected (at most), and every pair: both sides' set,
    class, name, images, and the cosine."""
    sets = found.sets

    def side(node: tuple[int, int]) -> dict:
        s, c = node
        return {"set": s, "class": c, "name": None if sets[s].names is None
                else sets[s].names[c], "images": int(sets[s].counts[c])}

    return {"checkpoint": str(checkpoint), "within": found.within,
            "sets": [{"folder": s.folder, "classes": len(s.counts),
                      "searched": len(s.searched)} for s in sets],
            "threshold": found.threshold, "calibration": calibration_json(found.calibration),
            "searches": found.searches, "expected_false": found.expected_false,
            "pairs": [{"a": side(p.a), "b": side(p.b), "cosine": round(p.score, 6)}
                      for p in found.pairs]}


def class_images(folder: str, classes: set[int], per_class: int = PER_CLASS
                 ) -> dict[int, list[bytes]]:
    """The first ``per_class`` encoded images of each of ``classes`` in ``folder``'s shards."""
    found: dict[int, list[bytes]] = {c: [] for c in classes}
    for label, sample in labelled_samples(folder, 0, 1, exts=("jpg", "cls")):
        if label in found and len(found[label]) < per_class:
            found[label].append(bytes(sample["jpg"]))
    return found


def write_pairs_page(path: Path, summary: str, found: FoundPairs) -> None:
    """A page: the calibration line, the ``summary``, then one row per pair, highest cosine
    first: the cosine, then each side's name, set and class above its images."""
    sets, pairs, calibration = found.sets, found.pairs, found.calibration
    wanted: dict[int, set[int]] = {}
    for p in pairs:
        for s, c in (p.a, p.b):
            wanted.setdefault(s, set()).add(c)
    images = {s: class_images(sets[s].folder, classes) for s, classes in wanted.items()}

    def side(node: tuple[int, int]) -> str:
        s, c = node
        pictures = "".join(f'<img src="data:image/jpeg;base64,{base64.b64encode(b).decode()}"'
                           ' width="84" height="84">' for b in images[s][c])
        return (f"<td><b>{html.escape(sets[s].describe(c))}</b><br>set {s} class {c}"
                f"<br>{pictures}</td>")

    rows = "\n".join(f"<tr><td>{p.score:.3f}</td>{side(p.a)}{side(p.b)}</tr>" for p in pairs)
    how = "--threshold" if calibration is None else calibration.describe()
    legend = "".join(f"<li>set {i}: {html.escape(s.folder)}</li>" for i, s in enumerate(sets))
    path.write_text(f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>launch.overlap --between</title>
<style>body{{font-family:sans-serif}} td{{vertical-align:top;padding:4px 10px}}
img{{margin:1px}} tr:nth-child(even){{background:#f2f2f2}}</style></head>
<body><h1>Identities held twice</h1>
<p>{html.escape(how)}</p>
<p>{html.escape(summary)} at cosine {found.threshold:.4f}.</p><ul>{legend}</ul>
<p>Strike a pair that is two people with a leading <code>-</code> in the list.</p>
<table><tr><th>cosine</th><th>one class</th><th>the other</th></tr>
{rows}
</table></body></html>
""")
