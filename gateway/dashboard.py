"""The live dashboard at `/`, served from files inside the package (no CDN)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
