"""Client for mirrorserve (and any TensorFlow Serving gRPC endpoint): numpy in, numpy out."""

from client.api import AsyncPredictClient, PredictClient, PredictError

__all__ = ["AsyncPredictClient", "PredictClient", "PredictError"]
