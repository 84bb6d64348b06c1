"""The Open Inference Protocol (v2, KServe) over gRPC and REST, with Triton's extensions (model
config, statistics, repository)."""
