"""OpenAI Files and Batches: /v1/files and /v1/batches."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
