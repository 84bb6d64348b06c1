"""Shared test settings: keep TensorFlow's C++ start-up chatter out of test output."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
