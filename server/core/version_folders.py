"""Which version folders a model's base path holds (TensorFlow Serving's BASE/<version>/ layout).

Which of them are served is the version policy's business (server.core.model_config); what a
version folder may hold besides its SavedModel is named here too."""

from __future__ import annotations

from pathlib import Path

from server.limits import ascii_int64

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
