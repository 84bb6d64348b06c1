"""TF Serving's small config files (--monitoring_config_file, --ssl_config_file): one protobuf
message in text format, read as TF Serving reads them, with a ValueError (the server exits 2)
naming the flag, the file and what is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from google.protobuf import text_format
from google.protobuf.message import Message

M = TypeVar("M", bound=Message)


def read(path: str, message_type: type[M], flag: str) -> M:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None
    message: M = message_type()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as exc:
        name = message_type.DESCRIPTOR.name
        article = "an" if name[0] in "AEIOU" else "a"
        raise ValueError(f"{flag} {path} is not {article} {name}: {exc}") from None
    return message
