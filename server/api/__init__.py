"""Protocol front-ends over server.core: each only translates a wire format to the core's plain
types and back, and the core's domain errors to status codes."""
