"""The example app's one task type: ``make_thumbnail``. Synthetic: it computes the size and the
name a thumbnail of an image would have; it reads and writes no file.

Run a worker for it: ``dtq worker run --queue thumbnails --tasks examples.fastapi_app.tasks``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dtq_tasks import PermanentError, TaskContext, task

QUEUE = "thumbnails"
FORMATS = frozenset({"png", "jpg", "jpeg", "webp"})


class ThumbnailRequest(BaseModel):
    """An image (its name and size in pixels) and the longest side its thumbnail may have."""

    model_config = ConfigDict(extra="forbid")
    image: str = Field(pattern=r"^[A-Za-z0-9_./-]{1,200}$")
    width: int = Field(ge=1, le=100_000)
    height: int = Field(ge=1, le=100_000)
    max_side: int = Field(default=128, ge=8, le=1024)


@task("make_thumbnail", payload_model=ThumbnailRequest)
async def make_thumbnail(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """The thumbnail's name and size: the image scaled down (never up) so that its longer side
    is at most ``max_side``, its aspect ratio kept. An image format it cannot read is a
    permanent error: retrying would not help."""
    image: str = payload["image"]
    stem, _, ext = image.rpartition(".")
    if not stem or ext.lower() not in FORMATS:
        raise PermanentError(f"unsupported image format: {image}")
    width, height = payload["width"], payload["height"]
    scale = min(1.0, payload["max_side"] / max(width, height))
    w, h = max(1, round(width * scale)), max(1, round(height * scale))
    return {"thumbnail": f"thumbs/{stem}_{w}x{h}.{ext.lower()}", "width": w, "height": h}
