"""A stream moved to another replica mid-way, with the real model: its text is the text of
the same request never moved, greedy and seeded alike. Two replicas on a 2-node Ray
cluster on this machine (one on the head, one on a worker node), one gateway; the replica
serving the stream is SIGKILLed after 10 tokens, and the other goes on from the tokens the
caller has (the engine computes them like prompt tokens, and a seeded request's draws are
keyed by seed and output position)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from support.live_server import HTTP_TIMEOUT_S, MODEL, LiveServer, live_server, wait_until
from support.ray_cluster import (
    RayTestCluster,
    busiest,
    fleet_rows,
    ray_cluster,
    wait_fleet_ready,
)

pytestmark = pytest.mark.slow

MAX_TOKENS = 64
KILL_AFTER = 10  # text pieces (a token each, but for a character split over tokens)
PROMPT = "Tell me a long story about a dragon and a knight."
STREAM_S = 120.0
BACK_S = 120.0  # a restarted replica loads the model again


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayTestCluster]:
    with ray_cluster(tmp_path_factory.mktemp("ray"), [1], head_replicas=1) as c:
        yield c


@pytest.fixture(scope="module")
def gateway(
    cluster: RayTestCluster, model_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    args = ["--ray-address", cluster.address, "--replicas", "2"]
    with live_server(tmp_path_factory.mktemp("gateway"), *args, model_folder=model_folder) as s:
        rows = wait_fleet_ready(s, 2, timeout=BACK_S)
        assert len({r["node"] for r in rows}) == 2  # one replica a node
        yield s


# What a stream reader returns once the stream ended: the reason it stopped and the
# number of tokens generated, as the API reports them. It appends text as it comes.
Read = Callable[[list[str]], tuple[str | None, int | None]]


class Reading:
    """A stream read in a thread, so that the test can kill its replica mid-way."""

    def __init__(self, read: Read) -> None:
        self.pieces: list[str] = []
        self.end: tuple[str | None, int | None] = (None, None)
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._run, args=(read,), daemon=True)
        self._thread.start()

    def _run(self, read: Read) -> None:
        try:
            self.end = read(self.pieces)
        except Exception as exc:  # the test looks at it
            self.error = exc

    def join(self) -> tuple[Exception | None, str, tuple[str | None, int | None]]:
        self._thread.join(STREAM_S)
        assert not self._thread.is_alive(), "the stream still runs: a hang"
        return self.error, "".join(self.pieces), self.end


def anthropic_greedy(server: LiveServer) -> Read:
    def read(pieces: list[str]) -> tuple[str | None, int | None]:
        client = anthropic.Anthropic(
            base_url=server.url, api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S
        )
        with client.messages.stream(
            model=MODEL,
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": PROMPT}],
            extra_body={"temperature": 0},  # not among this client's stream() parameters
        ) as stream:
            for text in stream.text_stream:
                pieces.append(text)
            final = stream.get_final_message()
        return final.stop_reason, final.usage.output_tokens

    return read


def openai_seeded(server: LiveServer) -> Read:
    def read(pieces: list[str]) -> tuple[str | None, int | None]:
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S
        )
        chunks = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=MAX_TOKENS,
            temperature=0.8,
            seed=1234,
            stream=True,
            stream_options={"include_usage": True},
        )
        reason, tokens = None, None
        for chunk in chunks:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                reason = choice.finish_reason or reason
        return reason, tokens

    return read


@pytest.mark.parametrize(
    ("reader", "length"),
    [(anthropic_greedy, "max_tokens"), (openai_seeded, "length")],
    ids=["greedy-anthropic", "seeded-openai"],
)
def test_a_stream_moved_mid_way_has_the_text_of_the_unmoved_stream(
    gateway: LiveServer, reader: Callable[[LiveServer], Read], length: str
) -> None:
    """The request runs once unmoved (to its length: the comparison covers every token);
    then again, and the replica serving it is SIGKILLed once 10 pieces arrived: the moved
    stream's whole text, stop reason and token count equal the unmoved run's."""
    wait_fleet_ready(gateway, 2, timeout=BACK_S)
    unmoved = Reading(reader(gateway)).join()
    assert unmoved[0] is None and unmoved[2] == (length, MAX_TOKENS), unmoved

    moved = Reading(reader(gateway))
    wait_until(lambda: len(moved.pieces) >= KILL_AFTER, STREAM_S, f"{KILL_AFTER} pieces")
    victim = busiest(fleet_rows(gateway))
    os.kill(victim["pid"], signal.SIGKILL)
    assert len(moved.pieces) < MAX_TOKENS - 10  # far from its end when killed
    assert moved.join() == unmoved

    def back() -> bool:
        now = next(r for r in fleet_rows(gateway) if r["id"] == victim["id"])
        return bool(now["state"] == "ready" and now["incarnation"] != victim["incarnation"])

    wait_until(back, BACK_S, "the killed replica back")
