"""`python -m server`: see server/main.py."""

import os
import sys

# TensorFlow's C++ start-up chatter (CUDA probing, oneDNN notices) hides our own start-up line.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from server.main import main

if __name__ == "__main__":  # the model worker, spawned by multiprocessing, must not run main again
    sys.exit(main())
