"""`python -m server`: see server/main.py."""

import os
import sys

if __name__ == "__main__":  # spawned processes (the model worker, front-ends) import this module too
    # TensorFlow's C++ start-up chatter (CUDA probing, oneDNN notices) hides our own start-up line.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from server.config import parse_settings

    settings = parse_settings()
    if settings.frontends > 1:  # before prometheus_client is imported: it picks its storage then
        from server import metrics_dir

        metrics_dir.prepare()
    from server.main import main

    sys.exit(main(settings=settings))
