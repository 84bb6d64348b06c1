"""A SavedModel's serving_default called in-process on each array of a file: the answers a server
must match. Runs in its own process, so the caller chooses its devices (CUDA_VISIBLE_DEVICES).

usage: python -m bench.model_outputs MODEL_BASE INPUTS.npz OUTPUTS.npz
Calls the highest version on each array "<key>" (the signature's one input) and writes
"<key>/<output>" for each output.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import tensorflow as tf


def main() -> None:
    base, inputs_path, outputs_path = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    version = max(int(p.name) for p in base.iterdir() if p.name.isdigit())
    signature = tf.saved_model.load(str(base / str(version))).signatures["serving_default"]
    (name,) = signature.structured_input_signature[1]
    results = {}
    with np.load(inputs_path) as arrays:
        for key in arrays.files:
            for output, value in signature(**{name: tf.constant(arrays[key])}).items():
                results[f"{key}/{output}"] = value.numpy()
    np.savez(outputs_path, **results)


if __name__ == "__main__":
    main()
