"""TensorFlow Serving's APIs: PredictionService and ModelService over gRPC, its REST API, and
tf.Example inputs (Classify, Regress, MultiInference)."""
