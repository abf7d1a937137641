"""An uploaded file is written under a temporary name, synced, and renamed into place (its
folder synced too): the file's name appears only once all of it is on disk, and a failed
upload leaves nothing behind. A real multipart body through the real parser."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from tokenfleet.server.errors import APIError
from tokenfleet.server.upload import receive_upload

BOUNDARY = "tokenfleetboundary"


def form(content: bytes) -> bytes:
    return (
        (
            f"--{BOUNDARY}\r\n"
            'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f"--{BOUNDARY}\r\n"
            'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + content
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )


def request(body: bytes, piece: int = 1000) -> Request:
    chunks = [body[i : i + piece] for i in range(0, len(body), piece)]

    async def receive() -> dict[str, Any]:
        if chunks:
            return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)}
        return {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/files",
        "headers": [
            (b"content-type", f"multipart/form-data; boundary={BOUNDARY}".encode()),
            (b"content-length", str(len(body)).encode()),
        ],
    }
    return Request(scope, receive)


def test_an_upload_is_synced_then_renamed_into_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    content = b'{"custom_id": "a"}\n' * 5000
    path = tmp_path / "file-1"
    upload = asyncio.run(receive_upload(request(form(content)), path, 1 << 20, "file"))

    assert path.read_bytes() == content and upload.num_bytes == len(content)
    assert upload.fields == {"purpose": "batch"}
    assert synced == [str(tmp_path / ".file-1.part"), str(tmp_path)]  # the data, then the name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file-1"]


def test_an_upload_over_the_limit_leaves_nothing_behind(tmp_path: Path) -> None:
    path = tmp_path / "file-1"
    with pytest.raises(APIError) as refused:
        asyncio.run(receive_upload(request(form(b"x" * 5000)), path, 2048, "file"))
    assert refused.value.status == 413
    assert list(tmp_path.iterdir()) == []
