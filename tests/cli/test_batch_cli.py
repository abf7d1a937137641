"""`tokenfleet batch submit / status / results` as a subprocess against a real server: each
custom id answered exactly once with the text the sync API gives for the same params, the
server's refusals passed on with exit status 1, usage errors with 2; and the streamed
create body built from a file without a server."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.live_server import MODEL, LiveServer, live_server

from tokenfleet.client.batch import BatchError, anthropic_body, detect_format

PROMPTS = {
    "two-plus-two": "What is 2+2?",
    "count": "Count to 5.",
    "hello": "Say hello.",
}
PARAMS = {"model": MODEL, "max_tokens": 8, "temperature": 0}


def _messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def _write_jsonl(path: Path, items: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def _anthropic_line(custom_id: str, prompt: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "params": {**PARAMS, "messages": _messages(prompt)}}


def _openai_line(custom_id: str, prompt: str) -> dict[str, Any]:
    body = {**PARAMS, "messages": _messages(prompt)}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _cli(server: LiveServer, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "tokenfleet.cli", "batch", *args, "--url", server.url]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_folder: Path) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("batch-cli")
    with live_server(tmp, "--ttft-target", "60", model_folder=model_folder) as s:
        yield s


# -- without a server ----------------------------------------------------------------------


def test_create_body_is_the_file_lines_as_one_requests_array(tmp_path: Path) -> None:
    # ~30 kB a line: the first three fill a 64 KiB chunk, the other two go with the end.
    lines = [_anthropic_line(f"r{i}", "x" * 30_000) for i in range(5)]
    path = tmp_path / "in.jsonl"
    path.write_text("\n" + "\n\n".join(json.dumps(line) for line in lines) + "\n  \n")
    chunks = list(anthropic_body(path))
    assert len(chunks) == 2
    assert json.loads(chunks[0] + b"]}") == {"requests": lines[:3]}
    assert json.loads(b"".join(chunks)) == {"requests": lines}
    assert detect_format(path).api == "anthropic"


def test_openai_file_is_detected_with_its_endpoint(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "in.jsonl", [_openai_line("a", "hi")])
    fmt = detect_format(path)
    assert (fmt.api, fmt.endpoint) == ("openai", "/v1/chat/completions")


def test_broken_line_is_named_by_its_number(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(_anthropic_line("a", "hi")) + "\n\n{not json\n")
    with pytest.raises(BatchError, match=r"in.jsonl line 3: malformed JSON"):
        list(anthropic_body(path))


# -- against a server ----------------------------------------------------------------------


def _run_batch(server: LiveServer, path: Path, states: str) -> tuple[str, list[dict[str, Any]]]:
    """submit --wait, then results -o: the batch id and its results lines, checking what
    the two commands print (`states`: the batch's last status line after its id)."""
    submitted = _cli(server, "submit", str(path), "--wait")
    assert submitted.returncode == 0, submitted.stderr
    batch_id, status = submitted.stdout.splitlines()
    assert status == f"{batch_id} {states}"
    out = path.with_name("results.jsonl")
    fetched = _cli(server, "results", batch_id, "-o", str(out))
    assert fetched.returncode == 0, fetched.stderr
    assert fetched.stdout == f"wrote {len(PROMPTS)} lines to {out}\n"
    results = _read_jsonl(out)
    assert sorted(r["custom_id"] for r in results) == sorted(PROMPTS)
    return batch_id, results


def _sync(server: LiveServer, route: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.url + route, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json())


@pytest.mark.slow
def test_anthropic_batch_answers_each_custom_id_as_the_messages_api_does(
    server: LiveServer, tmp_path: Path
) -> None:
    lines = [_anthropic_line(cid, prompt) for cid, prompt in PROMPTS.items()]
    path = _write_jsonl(tmp_path / "anthropic.jsonl", lines)
    counts = "0 processing, 3 succeeded, 0 errored, 0 canceled, 0 expired"
    batch_id, results = _run_batch(server, path, f"ended: 3/3 done ({counts})")
    assert batch_id.startswith("msgbatch_")
    for result in results:
        assert result["result"]["type"] == "succeeded"
        params = _anthropic_line("", PROMPTS[result["custom_id"]])["params"]
        sync = _sync(server, "/v1/messages", params)
        assert result["result"]["message"]["content"] == sync["content"]


@pytest.mark.slow
def test_openai_batch_answers_each_custom_id_as_chat_completions_does(
    server: LiveServer, tmp_path: Path
) -> None:
    lines = [_openai_line(cid, prompt) for cid, prompt in PROMPTS.items()]
    path = _write_jsonl(tmp_path / "openai.jsonl", lines)
    batch_id, results = _run_batch(server, path, "completed: 3/3 done (3 completed, 0 failed)")
    assert batch_id.startswith("batch_")
    for result in results:
        assert result["error"] is None
        assert result["response"]["status_code"] == 200
        body = _openai_line("", PROMPTS[result["custom_id"]])["body"]
        sync = _sync(server, "/v1/chat/completions", body)
        got = result["response"]["body"]["choices"][0]["message"]["content"]
        assert got == sync["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_duplicate_custom_id_is_refused_naming_the_request_and_its_line(
    server: LiveServer, tmp_path: Path
) -> None:
    lines = [_anthropic_line("same", "hi"), _anthropic_line("same", "hello")]
    path = _write_jsonl(tmp_path / "dup.jsonl", lines)
    refused = _cli(server, "submit", str(path), "--wait")
    assert (refused.returncode, refused.stdout) == (1, "")
    # The server names the index in the create body; the CLI adds the file line.
    assert refused.stderr == (
        "tokenfleet batch submit: HTTP 400: requests[1].custom_id: custom_id 'same' appears "
        f"twice in the batch ({path} line 2)\n"
    )


@pytest.mark.slow
def test_duplicate_custom_id_in_an_openai_file_fails_the_batch_naming_its_line(
    server: LiveServer, tmp_path: Path
) -> None:
    lines = [_openai_line("same", "hi"), _openai_line("same", "hello")]
    path = _write_jsonl(tmp_path / "dup.jsonl", lines)
    refused = _cli(server, "submit", str(path))
    # OpenAI creates the batch, as failed: its id, then why.
    assert refused.returncode == 1
    batch_id = refused.stdout.strip()
    assert batch_id.startswith("batch_")
    why = (
        f"{batch_id} failed: 0/0 done (0 completed, 0 failed)\n"
        "  line 2, custom_id: custom_id 'same' appears twice in the batch\n"
    )
    assert refused.stderr == f"tokenfleet batch submit: {why}"
    waited = _cli(server, "status", batch_id, "--wait")
    assert waited.returncode == 1
    assert waited.stderr.endswith(f"tokenfleet batch status: {why}")


@pytest.mark.slow
@pytest.mark.parametrize("batch_id", ["msgbatch_0123456789abcdef01234567", "batch_nonesuch"])
def test_unknown_batch_id_exits_1_with_the_servers_message(
    server: LiveServer, batch_id: str
) -> None:
    for command in (["status", batch_id], ["results", batch_id, "-o", "unused.jsonl"]):
        refused = _cli(server, *command)
        assert refused.returncode == 1
        assert refused.stderr.startswith(f"tokenfleet batch {command[0]}: HTTP 404: ")
        assert batch_id in refused.stderr


@pytest.mark.slow
def test_usage_errors_exit_2(server: LiveServer, tmp_path: Path) -> None:
    no_id = _cli(server, "status", "job-17")
    assert (no_id.returncode, no_id.stderr) == (
        2,
        "tokenfleet batch status: 'job-17' is no batch id: they start with msgbatch_ or batch_\n",
    )
    missing = _cli(server, "submit", str(tmp_path / "absent.jsonl"))
    assert missing.returncode == 2
    assert missing.stderr.endswith("absent.jsonl: no such file\n")
    assert _cli(server, "results", "msgbatch_x").returncode == 2  # no -o
