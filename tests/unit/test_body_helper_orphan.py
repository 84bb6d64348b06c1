"""The body-decoding helper process (server.api.http.body) exits once the front-end that started
it is gone, even when that front-end was killed outright and could not shut it down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import asyncio, os, sys
from server.api.http.body import BodyDecoder

async def main():
    decoder = BodyDecoder(inline_bytes=0)
    print(await decoder.decode(1, os.getpid), flush=True)  # runs in the helper: its pid
    await asyncio.sleep(60)

asyncio.run(main())
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_helper_exits_when_its_front_end_is_killed() -> None:
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        helper = int(child.stdout.readline())
        assert helper != child.pid and alive(helper)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        deadline = time.monotonic() + 10
        while alive(helper) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(helper), "the helper outlived its front-end"
    finally:
        if child.poll() is None:
            child.kill()
