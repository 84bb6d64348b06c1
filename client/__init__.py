"""Client for mirrorserve (and any TensorFlow Serving gRPC endpoint): numpy in, numpy out."""

from client.api import AsyncPredictClient, PredictClient, PredictError, Tls

__all__ = ["AsyncPredictClient", "PredictClient", "PredictError", "Tls"]
