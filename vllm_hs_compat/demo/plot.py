"""A PNG line plot of the drafter's loss, drawn with Pillow (already installed with every vLLM: it is one of
vLLM's own dependencies), so the demo needs no plotting stack."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def loss_png(path: str | Path, losses: Sequence[float], accuracies: Sequence[float] = (), title: str = "") -> None:
    """Write ``losses`` (and, on a second 0-1 axis, ``accuracies``) against the step to ``path``."""
    from PIL import Image, ImageDraw, ImageFont

    w, h = 720, 400
    left, right, top, bottom = 70, 70, 40, 50
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    pw, ph = w - left - right, h - top - bottom
    d.rectangle([left, top, left + pw, top + ph], outline="black")
    if title:
        d.text((left, 12), title, fill="black", font=font)
    n = len(losses)
    if n:
        lo, hi = min(losses), max(losses)
        pad = (hi - lo) * 0.05 or 0.5
        lo, hi = lo - pad, hi + pad

        def xy(i: int, v: float, vmin: float, vmax: float) -> tuple[float, float]:
            x = left + (pw * i / max(1, n - 1))
            y = top + ph - ph * (v - vmin) / (vmax - vmin)
            return x, y

        for k in range(5):  # y ticks of the loss
            v = lo + (hi - lo) * k / 4
            _, y = xy(0, v, lo, hi)
            d.line([left - 4, y, left, y], fill="black")
            d.line([left, y, left + pw, y], fill=(230, 230, 230))
            d.text((8, y - 6), f"{v:.2f}", fill=(30, 80, 200), font=font)
        for k in range(6):  # x ticks: steps
            i = round((n - 1) * k / 5)
            x, _ = xy(i, lo, lo, hi)
            d.line([x, top + ph, x, top + ph + 4], fill="black")
            d.text((x - 6, top + ph + 8), str(i), fill="black", font=font)
        d.text((left + pw // 2 - 15, h - 20), "step", fill="black", font=font)
        d.line([xy(i, v, lo, hi) for i, v in enumerate(losses)], fill=(30, 80, 200), width=2)
        d.text((left + 8, top + 6), "loss: KL(verifier || drafter), nats/token", fill=(30, 80, 200), font=font)
        if len(accuracies) == n:
            for k in range(5):
                v = k / 4
                _, y = xy(0, v, 0.0, 1.0)
                d.text((left + pw + 8, y - 6), f"{v:.2f}", fill=(200, 90, 30), font=font)
            d.line([xy(i, v, 0.0, 1.0) for i, v in enumerate(accuracies)], fill=(200, 90, 30), width=2)
            d.text(
                (left + 8, top + 20), "top-1 agreement with the verifier (right axis)", fill=(200, 90, 30), font=font
            )
    img.save(str(path), format="PNG")
