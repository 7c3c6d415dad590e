"""Cache management endpoints: /v1/cache (list, get, delete, warm)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
