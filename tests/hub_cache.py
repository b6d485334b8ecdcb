"""A Hugging Face Hub cache laid out as `huggingface_hub` writes it, for offline tests of models by Hub id.

`hf download org/name` leaves `<HF_HOME>/hub/models--org--name/` with `blobs/<etag>` (the file's bytes; the
etag is the sha256 of a file stored with LFS, else its git blob sha1), `snapshots/<commit>/<file>` (relative
symlinks to the blobs) and `refs/main` (the commit the main branch pointed at). `from_pretrained` and
`try_to_load_from_cache` read exactly that, online after the first download and offline always.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def etag(path: Path) -> str:
    """The etag the Hub gives a file: sha256 for LFS files (weights), the git blob sha1 for the rest."""
    data = path.read_bytes()
    if path.suffix in LFS_SUFFIXES:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def put_in_hub_cache(hf_home: Path, repo_id: str, source: Path, commit: str,
                     refs: tuple[str, ...] = ("main",)) -> Path:
    """Lay the files of the model directory `source` out under `hf_home` as the Hub's `repo_id` at `commit`
    (each of `refs` pointing at it); returns the snapshot directory."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        relative = file.relative_to(source)
        blob = repo / "blobs" / etag(file)
        blob.write_bytes(file.read_bytes())
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot
