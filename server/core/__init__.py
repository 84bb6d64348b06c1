"""The serving core: model lifecycle, batching and the model worker, in plain types.

No protocol knowledge here: the front-ends in server.api translate protos to these types and
back, and every decision (which version, loading, not found, queue full) is made once, here.
"""
