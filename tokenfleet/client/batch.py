"""The Batch API from the caller's side, for `tokenfleet batch`: submit a JSONL file, follow
a batch until it ends, fetch its results. HTTP only (no server code, no torch); request
files and results are streamed, never held whole in memory.

The file's first request line decides the API:

    {"custom_id", "params"}                -> Anthropic: POST /v1/messages/batches
    {"custom_id", "method", "url", "body"} -> OpenAI: POST /v1/files, then POST /v1/batches

and a batch id's prefix decides it afterwards: `msgbatch_` Anthropic, `batch_` OpenAI.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx
from tqdm import tqdm

BODY_CHUNK = 1 << 16  # bytes per write of a streamed create body
FIRST_POLL_S = 0.5
MAX_POLL_S = 5.0
OPENAI_ENDED = ("completed", "failed", "expired", "cancelled")
_REQUEST_INDEX = re.compile(r"requests\[(\d+)\]")


class BatchError(Exception):
    """The server refused a call, could not be reached, or the input file is not a batch;
    the message says which (the command exits 1)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.message = message
        self.status = status  # the HTTP status of a refusal


class UsageError(Exception):
    """The command cannot be carried out as asked: a missing file, an id of no known API
    (the command exits 2)."""


@dataclass(frozen=True)
class BatchStatus:
    """One batch's state, from either API."""

    id: str
    state: str  # processing_status (Anthropic) or status (OpenAI), as the server says it
    ended: bool
    num_done: int
    num_total: int
    counts: dict[str, int]  # the API's own request_counts, in its order
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[str] = field(default_factory=list)  # why an OpenAI batch failed

    @property
    def failed(self) -> bool:
        """The batch as a whole was refused (OpenAI checks a batch's file after creating
        it; Anthropic's batches are checked before)."""
        return self.state == "failed"

    def describe(self) -> str:
        counts = ", ".join(f"{n} {name}" for name, n in self.counts.items())
        lines = [f"{self.id} {self.state}: {self.num_done}/{self.num_total} done ({counts})"]
        return "\n".join(lines + [f"  {e}" for e in self.errors])


@dataclass(frozen=True)
class InputFormat:
    api: str  # "anthropic" or "openai"
    endpoint: str  # what every request calls


def api_of(batch_id: str) -> str:
    if batch_id.startswith("msgbatch_"):
        return "anthropic"
    if batch_id.startswith("batch_"):
        return "openai"
    raise UsageError(f"{batch_id!r} is no batch id: they start with msgbatch_ or batch_")


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of each non-blank line, read as it goes."""
    try:
        with path.open("rb") as source:
            for number, line in enumerate(source, start=1):
                if line.strip():
                    yield number, line
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from exc


def _parse(path: Path, number: int, line: bytes) -> dict[str, Any]:
    try:
        item = json.loads(line)
    except ValueError as exc:
        raise BatchError(f"{path} line {number}: malformed JSON: {exc}") from exc
    if not isinstance(item, dict):
        raise BatchError(f"{path} line {number}: each line must be a JSON object")
    return item


def detect_format(path: Path) -> InputFormat:
    """The API of a batch file, from its first non-blank line."""
    for number, line in _lines(path):
        item = _parse(path, number, line)
        if "params" in item:
            return InputFormat("anthropic", "/v1/messages")
        if "body" in item and isinstance(item.get("url"), str):
            return InputFormat("openai", item["url"])
        raise BatchError(
            f"{path} line {number}: neither an Anthropic request (custom_id, params) nor an "
            "OpenAI one (custom_id, method, url, body)"
        )
    raise BatchError(f"{path}: no requests in it")


def anthropic_body(path: Path) -> Iterator[bytes]:
    """`{"requests": [line, line, ...]}` from a JSONL file of Anthropic requests, a chunk at
    a time. Each line is checked to be one JSON object, so that a broken line is reported
    by its number, not as a broken body."""
    chunk = bytearray(b'{"requests": [')
    first = True
    for number, line in _lines(path):
        _parse(path, number, line)
        if not first:
            chunk += b","
        chunk += line.strip()
        first = False
        if len(chunk) >= BODY_CHUNK:
            yield bytes(chunk)
            chunk.clear()
    chunk += b"]}"
    yield bytes(chunk)


def _line_of_request(path: Path, index: int) -> int | None:
    """The file line that became requests[index] of the create body."""
    for i, (number, _) in enumerate(_lines(path)):
        if i == index:
            return number
    return None


def _check(response: httpx.Response) -> httpx.Response:
    """The response, or a BatchError with the API's message ({"error": {"message"}} in
    both APIs' error bodies)."""
    if response.status_code < 400:
        return response
    response.read()
    try:
        message = str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = response.text.strip()[:500] or response.reason_phrase
    raise BatchError(message, response.status_code)


class BatchClient:
    """Calls to one server's Batch APIs, with one API key."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 60.0) -> None:
        headers = {}
        if api_key:
            headers = {"x-api-key": api_key, "authorization": f"Bearer {api_key}"}
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def __enter__(self) -> BatchClient:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._http.close()

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return _check(self._http.request(method, path, **kwargs))
        except httpx.TransportError as exc:
            raise BatchError(f"cannot reach {self.url}: {exc}") from exc

    # -- submit ---------------------------------------------------------------------------

    def submit(self, path: Path, idempotency_key: str | None = None) -> str:
        """Create a batch from a JSONL file; its id."""
        if not path.is_file():
            raise UsageError(f"{path}: no such file")
        fmt = detect_format(path)
        headers = {"idempotency-key": idempotency_key} if idempotency_key else {}
        # Creating a batch checks every request before it answers: no read timeout.
        timeout = httpx.Timeout(None, connect=10.0)
        if fmt.api == "anthropic":
            try:
                response = self._send(
                    "POST",
                    "/v1/messages/batches",
                    content=anthropic_body(path),
                    headers={**headers, "content-type": "application/json"},
                    timeout=timeout,
                )
            except BatchError as exc:
                raise _with_line(exc, path) from exc
            return str(response.json()["id"])
        with path.open("rb") as source:  # httpx streams an open file in 64 KiB reads
            upload = self._send(
                "POST",
                "/v1/files",
                data={"purpose": "batch"},
                files={"file": (path.name, source, "application/jsonl")},
                timeout=timeout,
            )
        create = {
            "input_file_id": upload.json()["id"],
            "endpoint": fmt.endpoint,
            "completion_window": "24h",
        }
        response = self._send("POST", "/v1/batches", json=create, headers=headers, timeout=timeout)
        return str(response.json()["id"])

    # -- status ---------------------------------------------------------------------------

    def status(self, batch_id: str) -> BatchStatus:
        if api_of(batch_id) == "anthropic":
            body = self._send("GET", f"/v1/messages/batches/{batch_id}").json()
            counts = {k: int(v) for k, v in body["request_counts"].items()}
            num_done = sum(counts[k] for k in ("succeeded", "errored", "canceled", "expired"))
            return BatchStatus(
                id=batch_id,
                state=body["processing_status"],
                ended=body["processing_status"] == "ended",
                num_done=num_done,
                num_total=num_done + counts["processing"],
                counts=counts,
            )
        body = self._send("GET", f"/v1/batches/{batch_id}").json()
        raw = body.get("request_counts") or {}
        counts = {k: int(raw.get(k, 0)) for k in ("completed", "failed")}
        errors = (body.get("errors") or {}).get("data") or []
        return BatchStatus(
            id=batch_id,
            state=body["status"],
            ended=body["status"] in OPENAI_ENDED,
            num_done=counts["completed"] + counts["failed"],
            num_total=int(raw.get("total", 0)),
            counts=counts,
            output_file_id=body.get("output_file_id"),
            error_file_id=body.get("error_file_id"),
            errors=[_openai_batch_error(e) for e in errors],
        )

    def wait(
        self,
        batch_id: str,
        progress: bool = True,
        sleep: Callable[[float], None] = time.sleep,
    ) -> BatchStatus:
        """Poll until the batch has ended, every 0.5 s at first and every 5 s at most, with a
        progress bar over its requests on stderr."""
        interval = FIRST_POLL_S
        status = self.status(batch_id)
        bar = tqdm(
            desc=batch_id, total=status.num_total, unit="req", file=sys.stderr, disable=not progress
        )
        with bar:
            while True:
                bar.total = status.num_total
                bar.n = status.num_done
                bar.set_postfix_str(status.state, refresh=True)
                if status.ended:
                    return status
                sleep(interval)
                interval = min(interval * 1.5, MAX_POLL_S)
                status = self.status(batch_id)

    # -- results --------------------------------------------------------------------------

    def write_results(self, batch_id: str, out: Path) -> int:
        """Stream an ended batch's results into `out` (Anthropic: its results lines; OpenAI:
        its output file's lines, then its error file's); the number of lines written."""
        status = self.status(batch_id)
        if not status.ended:
            raise BatchError(f"{batch_id} is {status.state}: no results before it ends")
        if api_of(batch_id) == "anthropic":
            paths = [f"/v1/messages/batches/{batch_id}/results"]
        else:
            file_ids = [status.output_file_id, status.error_file_id]
            paths = [f"/v1/files/{f}/content" for f in file_ids if f]
            if not paths and status.state != "completed":
                raise BatchError(status.describe())
        partial = out.with_name(out.name + ".part")  # `out` appears only once complete
        num_lines = 0
        try:
            with partial.open("w", encoding="utf-8") as sink:
                for path in paths:
                    num_lines += self._copy_lines(path, sink)
            partial.replace(out)
        finally:
            if partial.exists():
                partial.unlink()
        return num_lines

    def _copy_lines(self, path: str, sink: IO[str]) -> int:
        num_lines = 0
        try:
            with self._http.stream("GET", path) as response:
                _check(response)
                for line in response.iter_lines():
                    if line.strip():
                        sink.write(line + "\n")
                        num_lines += 1
        except httpx.TransportError as exc:
            raise BatchError(f"cannot reach {self.url}: {exc}") from exc
        return num_lines


def _with_line(error: BatchError, path: Path) -> BatchError:
    """The server names Anthropic requests by their index in the create body; add the file
    line it came from."""
    found = _REQUEST_INDEX.match(error.message)
    number = None if found is None else _line_of_request(path, int(found.group(1)))
    if number is None:
        return error
    return BatchError(f"{error.message} ({path} line {number})", error.status)


def _openai_batch_error(error: dict[str, Any]) -> str:
    message = str(error.get("message") or error.get("code"))
    line = error.get("line")
    if line is None or message.startswith(f"line {line}"):
        return message
    return f"line {line}: {message}"
