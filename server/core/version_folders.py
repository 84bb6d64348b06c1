"""Which version folders a model's base path holds (TensorFlow Serving's BASE/<version>/ layout).

Which of them are served is the version policy's business (server.core.model_config); what a
version folder may hold besides its SavedModel is named here too."""

from __future__ import annotations

import re
from pathlib import Path

from server.limits import ascii_int64

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)


def local_path(path: str, what: str) -> str:
    """A base path as a local folder: `file:///models/m` is `/models/m`; any other scheme (gs://,
    s3://, hdfs://), which TF Serving reads through TensorFlow's file systems, is refused with a
    ValueError naming it and why (`what` says whose path it is)."""
    match = _SCHEME.match(path)
    if match is None:
        return path
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme == "file":
        host, slash, local = rest.partition("/")
        if host in ("", "localhost") and slash:
            return "/" + local
        raise ValueError(f"{what} {path}: a file:// path names a local folder (file:///models/m); "
                          f"'{host}' is another host")
    raise ValueError(f"{what} {path}: the {scheme}:// scheme is not served here. Version folders are listed, "
                      f"and warmup files read, from the local file system, where TF Serving reads {scheme}:// "
                      f"through TensorFlow's file systems; copy or mount the model into a local folder (a "
                      f"volume, an init container) and give that path")


WARMUP_FILE = Path("assets.extra") / "tf_serving_warmup_requests"
"""TF Serving's warmup file in a version folder: requests replayed before the version serves."""


def scan_versions(base_path: str | Path) -> dict[int, Path]:
    """The numeric version folders under base_path that hold a saved_model.pb. Anything else is
    ignored, so a version copied in under a dot-name (.3) and then renamed appears only whole."""
    base = Path(base_path)
    if not base.is_dir():
        raise FileNotFoundError(f"model base path {base} is not a folder")
    versions = {}
    for path in base.iterdir():
        version = ascii_int64(path.name)
        if version is not None and (path / "saved_model.pb").is_file():
            versions[version] = path
    return versions
