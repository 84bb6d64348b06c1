"""The model worker process: TensorFlow, the replicas and loaded SavedModels.

Only this package imports TensorFlow, and it never imports the generated protos: what it exchanges
with the serving process is plain data (server.core.worker_protocol, the one contract both sides
import)."""
