"""REST bodies that cost far more than they weigh: compressed bombs, unknown encodings, and a huge
but valid JSON body. Before issue 30, aiohttp decompressed a refused body to the end on the event
loop (a 16 KB body froze every client for about 11 s), and a 63 MB JSON body stalled every client
for 3.9 s while taking 1.13 GB."""

from __future__ import annotations

import concurrent.futures
import gzip
import json
import os
import time
import zlib

from tests.security.conftest import RSS_SLACK_MB, Attack, Bystander, assert_unharmed, post

MIB = 1 << 20


def gzip_bomb(decompressed: int) -> bytes:
    """About decompressed / 1000 bytes of gzip, of valid JSON's first byte and then zeros (made a
    megabyte at a time, so the test never holds the gigabyte)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    parts = [packer.compress(b"[")]
    zeros = b"\0" * (1 << 20)
    for _ in range(decompressed >> 20):
        parts.append(packer.compress(zeros))
    return b"".join([*parts, packer.flush()])


BOMB_P99_FACTOR = 4.5
"""The bystander's p99 against its baseline while bombs are decompressed, instead of 3x: three 1 GB
bombs at a time are inflated (to the limit) on a low-priority thread of the two cores the attacker
and the bystander share. Measured on 2026-12-06, at this commit and at the one before it alike:
1.8-3.0x alone, 3.0-3.7x among other tests (the baseline is a 1 s window, about 250 calls)."""


def test_compressed_bombs_are_refused_at_the_limit_without_stalling_anyone(attack_server, bystander) -> None:
    server = attack_server
    bomb = gzip_bomb(1 << 30)  # 1 GB in 1 MB, gzip's best ratio
    assert len(bomb) < 1100 * 1024
    refused_before = server.metric("mirrorserve_requests_total", protocol="tfserving-rest", code="RESOURCE_EXHAUSTED")
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    answers: list[tuple[int, bytes]] = []
    rounds = []
    with Attack(server, bystander) as attack, concurrent.futures.ThreadPoolExecutor(3) as pool:
        while time.monotonic() - attack.started < 1.5:  # three at once, again and again
            time.sleep(0.05)  # bombs, not a bandwidth flood of them (test_refusals has floods)
            started = time.monotonic()
            answers += pool.map(lambda body: post(server.rest_port, "/v1/models/demo:predict", body, headers),
                                (bomb, bomb, bomb))
            rounds.append(time.monotonic() - started)
        # What froze the loop for 11 s was 16 KB in an encoding with a far higher ratio (br): now
        # refused before a byte of it is read.
        brotli_status, _ = post(server.rest_port, "/v1/models/demo:predict", b"\x1b" * 16384,
                                {"Content-Encoding": "br"})
    print(f"{len(rounds)} rounds of three bombs at once, each answered in {max(rounds):.2f} s or less")
    assert {status for status, _ in answers} == {413}, answers
    assert brotli_status == 415
    assert all(b"decompresses to over the limit" in body for _, body in answers)
    assert max(rounds) < 5.0
    assert_unharmed(attack, p99_factor=BOMB_P99_FACTOR)
    assert attack.memory_returned() <= RSS_SLACK_MB
    refused = server.metric("mirrorserve_requests_total", protocol="tfserving-rest", code="RESOURCE_EXHAUSTED")
    assert refused - refused_before == len(answers)
    assert "refused tfserving-rest Predict (RESOURCE_EXHAUSTED, TooLarge) from 127.0.0.1" in attack.log()


def test_an_unknown_encoding_is_refused_before_the_body_is_read(attack_server) -> None:
    for path in ("/v1/models/demo:predict", "/v2/models/demo/infer"):
        status, body = post(attack_server.rest_port, path, b"\x1b" * 1000, {"Content-Encoding": "br"})
        assert status == 415, (status, body)
        assert "Content-Encoding 'br' is not supported; send the body as it is, or in gzip" in json.loads(body)["error"]


def test_a_63_mb_json_body_is_decoded_off_the_event_loop(attack_server, bystander: Bystander) -> None:
    """63 MB of valid JSON in a 0.2 MB gzip body. It is decoded in the helper process, so the
    loop only copies the body out and the verdict back; its 3.5 million rows decode to 112 MB of
    float32, over the 64 MiB limit, and are refused as too large (INVALID_ARGUMENT)."""
    server = attack_server
    rows = b"[0,0,0,0,0,0,0,0]," * 3_500_000
    body = gzip.compress(b'{"instances": [' + rows[:-1] + b"]}", 6)
    assert len(body) < 400 * 1024
    with Attack(server, bystander) as attack:
        started = time.monotonic()
        status, answer = post(server.rest_port, "/v1/models/demo:predict", body,
                              {"Content-Encoding": "gzip", "Content-Type": "application/json"})
        elapsed = time.monotonic() - started
    print(f"63 MB of JSON answered {status} in {elapsed:.2f} s: {answer[:160]!r}")
    assert status == 400 and b"the limit is 67108864 bytes per tensor" in answer, answer[:300]
    # The bar the issue left open for this body is met: off the loop, it costs the loop only the
    # copies of its bytes (measured: 1.0-1.7x the baseline p99).
    verdict = assert_unharmed(attack)
    print(f"63 MB body: bystander p99 {verdict.p99_ms:.1f} ms against {verdict.baseline_p99_ms:.1f}")
    assert attack.memory_returned() <= RSS_SLACK_MB


BUDGET = 200 * MIB
"""The byte budget of the flood's server: one 30 MB JSON body at a time (counted 6 x its size)."""


def test_16_concurrent_30_mb_json_bodies_stay_within_the_byte_budget(
        security_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each body is refused on arrival (429, naming --request-bytes-budget) while the budget is
    taken, or served (its 1.7 million rows are then more than the queue holds: 429 too); nothing
    is lost, the bystander's p99 stays within 3x, and the serving process grows by less than the
    budget."""
    import threading

    from tests.integration.conftest import start_server
    from tests.security.conftest import LOOPBACK, config_file, rss_mb

    body = b'{"instances": [' + (b"[0,0,0,0,0,0,0,0]," * 1_670_000)[:-1] + b"]}"
    assert 29_000_000 < len(body) < 31_000_000
    config = config_file(tmp_path / "models.config", {"demo": security_models / "demo"})
    server = start_server(["--model-config-file", str(config), "--request-bytes-budget", str(BUDGET),
                           "--drain-delay-s", "0", *LOOPBACK], tmp_path / "server.log")
    try:
        watcher = Bystander(server)
    except BaseException:
        server.stop()
        raise
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb(server.process.pid))
            time.sleep(0.02)

    try:
        # A 3 s baseline (about 750 calls) as the attack lasts about as long: a 1 s one (250 calls)
        # put the baseline p99 anywhere from 2.9 to 7.8 ms in five runs.
        with Attack(server, watcher, baseline_s=3.0) as attack:
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            def send(_: int) -> tuple[int, bytes]:
                # The attacker's own CPU (sending 480 MB) is not the server's on a real network: here
                # it shares the two cores, so its threads yield them (per-thread niceness, Linux).
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
                return post(server.rest_port, "/v1/models/demo:predict", body, {"Content-Type": "application/json"})

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(send, range(16)))
            done.set()
            sampler.join()
        statuses = sorted(status for status, _ in answers)
        budget_refusals = sum(b"--request-bytes-budget" in answer for _, answer in answers)
        grown = peak[0] - attack.rss_before
        verdict = attack.verdict()
        print(f"16 x 30 MB JSON: statuses {statuses}, {budget_refusals} refused by the byte budget; serving "
              f"process RSS +{grown:.0f} MB at its peak (budget {BUDGET // MIB} MiB); {verdict}")
        assert all(status == 429 for status in statuses), answers[0][1][:300]  # none lost, each answered
        assert budget_refusals >= 8
        assert grown < BUDGET / MIB, grown
        assert_unharmed(attack)
    finally:
        done.set()
        watcher.stop()
        server.stop()
