"""Schedule: bucket small collectives and overlap them with compute, on a lowered program."""

from __future__ import annotations

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket cap
