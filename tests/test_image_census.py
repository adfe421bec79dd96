"""`regen validate`'s count of images (prompts/census.py): of the records it reads, the images read, distinct, by
format, and the records rejected for an image. (The probe of the sources' branch calls it: see census.py.)"""
from __future__ import annotations

from pipeline.prompts.census import ImageCensus
from tests.image_store_helpers import image_prompt, part_of, picture, text_prompt


def test_validate_counts_images_read_distinct_by_format_and_image_rejects():
    census = ImageCensus()
    jpeg = part_of(picture(2, fmt="JPEG"), media_type="image/jpeg")
    for p in (image_prompt("a", [part_of(picture(0)), jpeg]), image_prompt("b", [part_of(picture(0))]),
              text_prompt("no image")):
        census.add(p.messages)
    for code in ("image_missing", "image_missing", "image_outside_root", "blank_content"):
        census.reject(code)
    assert (census.images, census.distinct, census.prompts) == (3, 2, 2)
    assert census.lines() == ["  distinct images 2 of 3 (png 2, jpeg 1); records rejected for an image: "
                              "image_missing 2, image_outside_root 1"]
    assert ImageCensus().lines() == [], "a text source's validate says nothing of images"
