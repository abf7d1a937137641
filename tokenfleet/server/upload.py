"""A multipart/form-data upload received straight into a file on disk: its one file part is
written as it arrives (never whole in memory) and refused with 413 past a size limit; its
other fields are small strings."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from fastapi import Request
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from tokenfleet.server.errors import APIError

FORM_OVERHEAD = 64 << 10  # boundaries, part headers and small fields around the file
MAX_FIELD_BYTES = 4096
MAX_FIELDS = 16
WRITE_BYTES = 1 << 20  # file data is written in pieces of about this size


@dataclass
class Upload:
    """What came with the file: its name as the client gave it, its size, and the fields."""

    filename: str | None = None
    num_bytes: int = 0
    fields: dict[str, str] = field(default_factory=dict)


class _Form:
    """python-multipart callbacks: file data is queued in `pending` for the caller to
    write; field values are kept (bounded)."""

    def __init__(self, file_field: str, limit: int, upload: Upload) -> None:
        self.file_field = file_field
        self.limit = limit
        self.upload = upload
        self.pending: list[bytes] = []
        self.num_pending = 0
        self.ended = False
        self._header = [b"", b""]
        self._disposition = b""
        self._name: str | None = None
        self._in_file = False
        self._value = bytearray()

    def on_part_begin(self) -> None:
        self._disposition, self._name, self._in_file = b"", None, False
        self._value.clear()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header[0] += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header[1] += data[start:end]

    def on_header_end(self) -> None:
        name, value = self._header
        if name.lower() == b"content-disposition":
            self._disposition = value
        self._header = [b"", b""]

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise _bad("each part needs a Content-Disposition name")
        self._name = options[b"name"].decode("utf-8", "replace")
        if b"filename" in options:
            if self._name != self.file_field or self.upload.filename is not None:
                raise _bad(f"one file is expected, in the field {self.file_field!r}")
            self.upload.filename = options[b"filename"].decode("utf-8", "replace")
            self._in_file = True
        elif len(self.upload.fields) >= MAX_FIELDS:
            raise _bad(f"at most {MAX_FIELDS} form fields")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if not self._in_file:
            if len(self._value) + end - start > MAX_FIELD_BYTES:
                raise _bad(f"form field {self._name!r} exceeds {MAX_FIELD_BYTES} bytes")
            self._value += data[start:end]
            return
        self.upload.num_bytes += end - start
        if self.upload.num_bytes > self.limit:
            raise APIError(413, "request_too_large", f"file exceeds {self.limit} bytes")
        self.pending.append(data[start:end])
        self.num_pending += end - start

    def on_part_end(self) -> None:
        if not self._in_file and self._name is not None:
            self.upload.fields[self._name] = self._value.decode("utf-8", "replace")

    def on_end(self) -> None:
        self.ended = True

    def take(self) -> bytes:
        data = b"".join(self.pending)
        self.pending.clear()
        self.num_pending = 0
        return data


async def receive_upload(request: Request, path: Path, limit: int, file_field: str) -> Upload:
    """Reads the form, its file part into `path` (created whole, synced to disk, or not at
    all: removed again on any failure)."""
    ctype, params = parse_options_header(request.headers.get("content-type"))
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise _bad("the body must be multipart/form-data")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + FORM_OVERHEAD:
        raise APIError(413, "request_too_large", f"upload of {declared} bytes exceeds {limit}")
    upload = Upload()
    form = _Form(file_field, limit, upload)
    parser = MultipartParser(
        params[b"boundary"],
        {
            "on_part_begin": form.on_part_begin,
            "on_part_data": form.on_part_data,
            "on_part_end": form.on_part_end,
            "on_header_field": form.on_header_field,
            "on_header_value": form.on_header_value,
            "on_header_end": form.on_header_end,
            "on_headers_finished": form.on_headers_finished,
            "on_end": form.on_end,
        },
    )
    # Written under a temporary name, synced, then renamed into place (and the folder
    # synced): `path` is either absent or whole, whatever crash comes in between.
    part = path.with_name(f".{path.name}.part")
    out: IO[bytes] = part.open("wb")
    try:
        with out:
            async for chunk in request.stream():
                parser.write(chunk)
                if form.num_pending >= WRITE_BYTES:
                    await asyncio.to_thread(out.write, form.take())
            parser.finalize()
            if form.pending:
                await asyncio.to_thread(out.write, form.take())
            if not form.ended:
                raise _bad("the multipart body ends early")
            await asyncio.to_thread(_sync, out)
        await asyncio.to_thread(_publish, part, path)
    except FormParserError as exc:
        part.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        raise _bad(f"malformed multipart body: {exc}") from exc
    except BaseException:
        part.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        raise
    return upload


def _sync(out: IO[bytes]) -> None:
    out.flush()
    os.fsync(out.fileno())


def _publish(part: Path, path: Path) -> None:
    """Renames the synced `part` to `path` and syncs the folder, so the name lasts too."""
    os.replace(part, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _bad(message: str) -> APIError:
    return APIError(400, "invalid_request", message)
