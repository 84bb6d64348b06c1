"""The HTTP server both REST APIs run in (aiohttp), request bodies decoded off the event loop, and
the JSON codec they share."""
