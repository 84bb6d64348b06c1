"""The serving core, in the protocol process: resolve -> batch -> worker, in plain types.

No protocol knowledge here: the front-ends in server.api translate protos to these types and
back, and every decision (which version, loading, not found, queue full) is made once, here. The
model worker itself (TensorFlow) is server.worker, in its own process; model_process is this
side's handle on it, and worker_protocol the messages both sides share.
"""
