"""mirrorserve: a TensorFlow Serving-compatible gRPC prediction server with dynamic batching
and fan-out over tf.distribute replicas. Importing this package loads nothing heavy."""
