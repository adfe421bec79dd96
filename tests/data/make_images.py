"""Makes the project's small sample images with Pillow (their output is committed; rerun to remake them):
prompts_sources/sample/images/ for the image sample source (prompts_sources/sample_images.yaml), and
tests/data/presets/images/ in the folder layouts of the image presets' datasets (COCO train2017, ShareGPT4V's
data folder, ALLaVA's repository). Simple drawings a few KB each: enough for a vision model to say something
true about them.

    .venv/bin/python tests/data/make_images.py
"""
from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "prompts_sources" / "sample" / "images"
PRESETS = ROOT / "tests" / "data" / "presets" / "images"


def shapes() -> Image.Image:
    image = Image.new("RGB", (128, 96), "white")
    draw = ImageDraw.Draw(image)
    draw.ellipse((10, 20, 60, 70), fill=(220, 30, 30))
    draw.rectangle((72, 24, 118, 70), fill=(30, 60, 220))
    return image


def stripes() -> Image.Image:
    image = Image.new("RGB", (128, 96), "white")
    draw = ImageDraw.Draw(image)
    for k, colour in enumerate([(0, 140, 70), (250, 250, 250), (230, 120, 0)]):
        draw.rectangle((k * 43, 0, k * 43 + 42, 95), fill=colour)
    return image


def sunset() -> Image.Image:
    image = Image.new("RGB", (128, 96))
    draw = ImageDraw.Draw(image)
    for y in range(96):
        draw.line((0, y, 127, y), fill=(255, 120 + y, 60 + y))
    draw.ellipse((44, 50, 84, 90), fill=(255, 230, 80))
    draw.rectangle((0, 80, 127, 95), fill=(20, 40, 90))
    return image


def chart() -> Image.Image:
    image = Image.new("RGB", (128, 96), "white")
    draw = ImageDraw.Draw(image)
    for k, height in enumerate((30, 70, 50)):
        draw.rectangle((14 + k * 38, 90 - height, 40 + k * 38, 90), fill=(60, 60, 60))
    draw.line((8, 90, 120, 90), fill="black")
    return image


def tile(colour: tuple[int, int, int], mark: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", (96, 64), colour)
    ImageDraw.Draw(image).polygon([(48, 8), (84, 56), (12, 56)], fill=mark)
    return image


def main() -> None:
    SAMPLE.mkdir(parents=True, exist_ok=True)
    shapes().save(SAMPLE / "shapes.png", optimize=True)
    stripes().save(SAMPLE / "stripes.jpg", quality=85)
    sunset().save(SAMPLE / "sunset.jpg", quality=85)
    chart().save(SAMPLE / "chart.png", optimize=True)
    layouts = {  # path under PRESETS: the picture
        "coco/train2017/000000033471.jpg": tile((200, 40, 40), (255, 255, 255)),
        "coco/train2017/000000052846.jpg": tile((40, 160, 60), (250, 220, 0)),
        "sam/images/sa_227013.jpg": tile((40, 60, 200), (255, 140, 0)),
        "allava_laion/images/100277305.jpeg": tile((90, 90, 90), (0, 200, 200)),
        "allava_laion/images/100760552.jpeg": tile((240, 240, 240), (120, 0, 160)),
    }
    for name, image in layouts.items():
        (PRESETS / name).parent.mkdir(parents=True, exist_ok=True)
        image.save(PRESETS / name, "JPEG", quality=85)


if __name__ == "__main__":
    main()
