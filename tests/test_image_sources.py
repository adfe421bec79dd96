"""Image prompts read from sources (issue 28): the shapes (LLaVA `image`/`images` with `<image>` markers, OpenAI and
TorchSpec content parts, speculators' image paths), the image's identity (sha256 of its bytes), and each reject with
its own code, naming the record and the image. Pure: real files and real images made with Pillow, no HTTP."""
from __future__ import annotations

import base64
import io
import os
import struct
import zlib
from pathlib import Path

import orjson
import pytest
from PIL import Image

from pipeline.core.config_sections import Images
from pipeline.core.errors import ImageFetchFailed
from pipeline.core.work import affinity_key
from pipeline.prompts.normalise import prompt_id
from pipeline.prompts.prompt_set import PromptSet, build_into, build_prompt_set
from pipeline.prompts.report import report_lines
from pipeline.prompts.sources import SourceSpec


def picture(path: Path, size=(32, 24), colour=(200, 30, 30), fmt: str | None = None, **save) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path, fmt, **save)
    return path


def data_url(size=(8, 8), colour=(0, 0, 250)) -> str:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def build(tmp: Path, records: list, fmt: str = "sharegpt", images: Images | None = None, fetch=None, **spec):
    data = tmp / "data.jsonl"
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    source = SourceSpec("imgs", "jsonl", "data.jsonl", fmt, id_field="id", spec_file=tmp / "imgs.yaml", **spec)
    return build_prompt_set([(source, None)], images=images, fetch=fetch)


def human(text: str) -> dict:
    return {"from": "human", "value": text}


def kinds(prompt) -> list:
    """Each message's content as text and `image:<media type>` items (a string content as it is)."""
    return [m["content"] if isinstance(m["content"], str) else
            [p["text"] if p["type"] == "text" else f"image:{p['media_type']}" for p in m["content"]]
            for m in prompt.messages]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    picture(tmp_path / "coco" / "red.png")
    picture(tmp_path / "coco" / "green.jpg", colour=(20, 200, 20))
    picture(tmp_path / "coco" / "blue.png", colour=(20, 20, 200))
    return tmp_path


# --- LLaVA, ShareGPT4V, ALLaVA: an images field and <image> markers ----------------------------------------------
def test_llava_record_puts_its_image_at_the_marker_and_the_newline_after_it_goes_with_it(folder):
    ps = build(folder, [
        {"id": "a", "image": "coco/red.png", "conversations": [human("<image>\nWhat colour?"), {"from": "gpt",
                                                                                               "value": "Red."}]},
        {"id": "b", "image": "coco/green.jpg", "conversations": [human("Look at this:\n<image>")]},
        {"id": "c", "images": ["coco/red.png", "coco/green.jpg"],
         "conversations": [human("<image> and <image>: same?")]},
    ])
    assert ps.rejects == []
    a, b, c = ps.prompts
    assert kinds(a) == [["image:image/png", "What colour?"]] and a.reference == "Red."
    assert kinds(b) == [["Look at this:", "image:image/jpeg"]]
    assert kinds(c) == [["image:image/png", "and", "image:image/jpeg", ": same?"]]
    assert a.messages[0]["content"][0] == {"type": "image", "sha256": a.messages[0]["content"][0]["sha256"],
                                           "media_type": "image/png", "width": 32, "height": 24,
                                           "bytes": (folder / "coco" / "red.png").stat().st_size}


def test_a_record_without_a_marker_gets_its_images_before_the_first_user_text(folder):
    ps = build(folder, [{"id": "a", "image": ["coco/red.png", "coco/blue.png"], "conversations": [
        {"from": "system", "value": "Be brief."}, human("Which is darker?"), {"from": "gpt", "value": "Blue."},
        human("Why?")]}])
    (p,) = ps.prompts
    assert kinds(p) == ["Be brief.", ["image:image/png", "image:image/png", "Which is darker?"], "Blue.", "Why?"]
    assert ps.reports[0].image_counts["images_placed_before_text"] == 2


@pytest.mark.parametrize("record, says", [
    ({"image": "coco/red.png", "conversations": [human("<image> vs <image>")]},
     "the user turns hold 2 <image> markers (or empty image parts), and the record's 'image' field 1 image "
     "('coco/red.png')"),
    ({"images": ["coco/red.png", "coco/blue.png"], "conversations": [human("<image> alone")]},
     "1 <image> marker (or empty image parts), and the record's 'images' field 2 images ('coco/red.png', "
     "'coco/blue.png')"),
    ({"image": None, "conversations": [human("<image>\nWhat is it?")]}, "the record's 'image' field 0 images"),
    ({"image": "coco/red.png", "images": ["coco/blue.png"], "conversations": [human("Hi")]},
     "images under both 'image' and 'images'"),
])
def test_more_or_fewer_markers_than_images_is_a_mismatch_naming_the_record_and_the_images(folder, record, says):
    ps = build(folder, [{"id": "x", **record}, {"id": "ok", "conversations": [human("Fine.")]}])
    (reject,) = ps.rejects
    assert reject.code == "image_marker_mismatch" and reject.reason.startswith("data.jsonl:1: ")
    assert says in reject.reason, reject.reason
    assert ps.images == {}, "nothing of a rejected record is handed on"


def test_a_record_without_an_images_field_is_the_text_prompt_it_was(folder):
    ps = build(folder, [{"id": "a", "conversations": [human("What does <image> do in SVG?")]},
                        {"id": "b", "image": None, "conversations": [human("Hello")]},
                        {"id": "c", "conversations": [human("Hello")], "images": []}])
    a, b = ps.prompts
    assert a.messages == ({"role": "user", "content": "What does <image> do in SVG?"},)
    assert b.prompt_id == prompt_id([{"role": "user", "content": "Hello"}]) == "91f211dd935540984a523a5ee3b89b50"
    assert ps.reports[0].duplicates == 1 and ps.reports[0].image_counts == {} and ps.reports[0].uncarried == {}


def test_same_text_with_another_image_is_another_prompt_and_the_same_image_at_two_paths_is_one(folder):
    (folder / "copies").mkdir()
    (folder / "copies" / "red-again.png").write_bytes((folder / "coco" / "red.png").read_bytes())
    question = [human("<image>\nWhat colour is it?")]
    ps = build(folder, [{"id": n, "image": path, "conversations": question} for n, path in (
        ("1", "coco/red.png"), ("2", "coco/blue.png"), ("3", "copies/red-again.png"), ("4", "coco/../coco/red.png"))])
    assert [p.source_ref for p in ps.prompts] == ["1", "2"] and ps.reports[0].duplicates == 2
    assert ps.prompts[0].prompt_id != ps.prompts[1].prompt_id
    assert kinds(ps.prompts[0]) == kinds(ps.prompts[1]), "the same text: only the image tells them apart"


# --- OpenAI, TorchSpec and speculators content parts -------------------------------------------------------------
def test_every_image_part_shape_is_read_and_what_is_not_sent_is_counted(folder):
    red = str(folder / "coco" / "red.png")
    shapes = [{"type": "image_url", "image_url": {"url": "coco/red.png", "detail": "high"}},
              {"type": "image_url", "image_url": "coco/red.png"}, {"type": "image", "image": "coco/red.png"},
              {"type": "image", "path": red}, {"type": "image", "url": "file://" + red},
              {"type": "input_image", "image_url": data_url()}, {"type": "image", "image": {"bytes": None,
                                                                                            "path": "coco/red.png"}}]
    records = [{"id": str(k), "messages": [{"role": "user", "content": [shape, {"type": "text", "text": "Colour?"}]}]}
               for k, shape in enumerate(shapes)]
    ps = build(folder, records, "openai")
    assert ps.rejects == [] and len(ps.prompts) == 2, "six shapes of one picture are one prompt; the data: URL another"
    assert kinds(ps.prompts[0]) == [["image:image/png", "Colour?"]]
    report = ps.reports[0]
    assert report.uncarried == {"part.image_url.detail": 1} and report.duplicates == 5
    assert report.image_counts["from_files"] == 6 and report.image_counts["from_data_url"] == 1


def test_a_list_of_text_parts_is_kept_as_parts_and_cleaned_as_text_is(folder):
    parts = [{"type": "text", "text": " Cafe\u0301\x00? "}, {"type": "text", "text": "  "},
             {"type": "text", "text": "Ok"}]
    ps = build(folder, [{"id": "a", "messages": [{"role": "user", "content": parts}]}], "openai")
    (p,) = ps.prompts
    assert p.messages == ({"role": "user", "content": [{"type": "text", "text": "Caf\u00e9?"},
                                                       {"type": "text", "text": "Ok"}]},)
    assert ps.reports[0].dropped_turns == {"blank_text_part": 1} and ps.reports[0].nul_removed == 1
    assert p.prompt_id != prompt_id([{"role": "user", "content": "Caf\u00e9?\nOk"}]), "parts are sent as parts"


@pytest.mark.parametrize("part, code", [
    ({"type": "video_url", "video_url": {"url": "clip.mp4"}}, "video_part"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio_part"),
    ({"type": "audio_url", "audio_url": {"url": "a.mp3"}}, "audio_part"),
    ({"type": "file", "file": {"file_id": "f"}}, "file_part"),
    ({"type": "refusal", "refusal": "no"}, "unknown_part"),
])
def test_parts_regen_cannot_carry_are_rejected_under_their_own_code_naming_the_type(folder, part, code):
    ps = build(folder, [{"id": "a", "messages": [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}]},
                        {"id": "b", "messages": [{"role": "user", "content": "Fine."}]}], "openai")
    (reject,) = ps.rejects
    assert reject.code == code and reject.reason.startswith("data.jsonl:1: message 1: part 1 is")
    assert repr(part["type"]) in reject.reason or f"a {part['type']} part" in reject.reason


def test_images_in_system_and_tool_messages_are_read_and_in_an_assistant_turn_rejected(folder):
    image = {"type": "image_url", "image_url": {"url": "coco/red.png"}}
    call = {"id": "c1", "type": "function", "function": {"name": "snap", "arguments": "{}"}}
    ps = build(folder, [
        {"id": "sys", "messages": [{"role": "system", "content": [{"type": "text", "text": "Logo:"}, image]},
                                   {"role": "user", "content": "Describe the logo."}]},
        {"id": "tool", "messages": [{"role": "user", "content": "Take a picture."},
                                    {"role": "assistant", "content": None, "tool_calls": [call]},
                                    {"role": "tool", "tool_call_id": "c1", "content": [image]}]},
        {"id": "asst", "messages": [{"role": "user", "content": "Draw."}, {"role": "assistant", "content": [image]},
                                    {"role": "user", "content": "Again."}]}], "openai")
    assert [p.source_ref for p in ps.prompts] == ["sys", "tool"]
    assert kinds(ps.prompts[0])[0] == ["Logo:", "image:image/png"]
    assert ps.prompts[1].messages[-1]["content"][0]["media_type"] == "image/png"
    (reject,) = ps.rejects
    assert reject.code == "image_in_assistant_turn" and "message 2 (assistant) holds an image" in reject.reason


def test_empty_image_parts_take_the_records_images_in_order(folder):
    """TRL's datasets: `{"type": "image"}` placeholders in the messages, the pictures in an `images` column."""
    content = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]
    ps = build(folder, [{"id": "a", "images": ["coco/blue.png", "coco/green.jpg"],
                         "messages": [{"role": "user", "content": content}]},
                        {"id": "b", "messages": [{"role": "user", "content": content}]}], "openai")
    assert kinds(ps.prompts[0]) == [["image:image/png", "and", "image:image/jpeg"]]
    (reject,) = ps.rejects
    assert reject.code == "image_marker_mismatch" and "holds no image" in reject.reason


# --- where the bytes go, and the identity -------------------------------------------------------------------------
class Sink(PromptSet):
    def __init__(self):
        super().__init__()
        self.handed: list[tuple[str, str | bytes]] = []

    def add_image(self, sha256, source):
        self.handed.append((sha256, source))


def test_copy_hands_each_image_once_a_file_by_its_path_bytes_as_bytes_and_reference_hands_none(folder):
    source = folder / "data.jsonl"
    url = data_url()
    records = [{"id": str(k), "image": ref, "conversations": [human(f"Picture {k}?")]}
               for k, ref in enumerate(["coco/red.png", "coco/red.png", url, url])]
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    spec = SourceSpec("imgs", "jsonl", "data.jsonl", "sharegpt", spec_file=folder / "imgs.yaml")
    sink = Sink()
    build_into(sink, [(spec, None)])
    red = os.path.realpath(folder / "coco" / "red.png")
    assert [type(s).__name__ for _, s in sink.handed] == ["str", "bytes"] and sink.handed[0][1] == red
    assert base64.b64encode(sink.handed[1][1]).decode() == url.split(",", 1)[1]
    assert all("path" not in m["content"][0] for p in sink.prompts for m in p.messages)
    sink = Sink()
    build_into(sink, [(spec, None)], images=Images(store="reference"))
    assert [type(s).__name__ for _, s in sink.handed] == ["bytes"], "a data: URL is always copied"
    assert sink.prompts[0].messages[0]["content"][0]["path"] == red


def test_http_images_are_fetched_once_through_the_callable_and_a_failure_names_its_status(folder):
    body = (folder / "coco" / "green.jpg").read_bytes()
    asked: list[str] = []

    def fetch(url: str) -> bytes:
        asked.append(url)
        if url.endswith("gone.jpg"):
            raise ImageFetchFailed(url, "the server answered 404 Not Found", 404)
        return body

    records = [{"id": str(k), "image": f"https://example.org/{name}", "conversations": [human(f"Q{k}?")]}
               for k, name in enumerate(["x.jpg", "x.jpg", "gone.jpg", "gone.jpg"])]
    ps = build(folder, records, fetch=fetch)
    assert asked == ["https://example.org/x.jpg", "https://example.org/gone.jpg"], "each URL once"
    assert len(ps.prompts) == 2 and ps.reports[0].image_counts["from_http"] == 2
    assert [r.code for r in ps.rejects] == ["remote_image"] * 2
    assert ps.rejects[1].reason == ("data.jsonl:4: message 1: the image 'https://example.org/gone.jpg' could not be "
                                    "fetched: the server answered 404 Not Found (HTTP 404)")
    refused = build(folder, records[:1] + [{"id": "t", "conversations": [human("Text.")]}],
                    images=Images(remote="refuse"), fetch=fetch)
    assert "refused by images.remote: refuse" in refused.rejects[0].reason and len(asked) == 2
    unfetched = build(folder, records[:1] + [{"id": "t", "conversations": [human("Text.")]}])
    assert "nothing fetches images here" in unfetched.rejects[0].reason


def test_the_affinity_key_of_a_text_prompt_is_unchanged_and_parts_do_not_break_it(folder):
    text = [{"role": "user", "content": "Hello"}]
    assert affinity_key(text, 64) == affinity_key([{"role": "user", "content": "Hello"}], 64) != 0
    (p,) = build(folder, [{"id": "a", "image": "coco/red.png", "conversations": [human("<image>\nHello")]}]).prompts
    assert affinity_key(list(p.messages), 256) != affinity_key(text, 256)


# --- rejects: each its own code, naming the record and the image ---------------------------------------------------
def bomb_png(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims width x height pixels, with a few bytes of data: decoding it would take GBs."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
                     + chunk(b"IEND", b""))
    return path


def rejected(folder: Path, ref, images: Images | None = None) -> tuple[str, str]:
    ps = build(folder, [{"id": "x", "image": ref, "conversations": [human("<image>\nWhat is it?")]},
                        {"id": "ok", "conversations": [human("Text.")]}], images=images)
    (reject,) = ps.rejects
    return reject.code, reject.reason


def test_each_image_reject_has_its_code_and_names_the_record_and_the_image(folder):
    outside = picture(folder.parent / f"{folder.name}-outside" / "secret.png")
    (folder / "coco" / "folder.jpg").mkdir()
    (folder / "coco" / "notes.jpg").write_text("these are notes, not a picture")
    picture(folder / "coco" / "scan.tif", fmt="TIFF")
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    frames[0].save(folder / "coco" / "moving.gif", save_all=True, append_images=frames[1:], duration=100)
    noise = io.BytesIO()
    Image.effect_noise((256, 192), 64).convert("RGB").save(noise, "JPEG")  # its data is most of the file
    (folder / "coco" / "cut.jpg").write_bytes(noise.getvalue()[: len(noise.getvalue()) * 2 // 3])
    picture(folder / "coco" / "big.png", size=(300, 200))
    bomb_png(folder / "coco" / "bomb.png", 100_000, 100_000)
    bomb_png(folder / "coco" / "tall.png", 8000, 6000)
    os.symlink(outside, folder / "coco" / "link.png")
    cases = {
        "coco/none.png": ("image_missing", f"is not there (looked for {os.path.realpath(folder)}/coco/none.png)"),
        "coco/folder.jpg": ("image_unreadable", "is a folder"),
        "coco/cut.jpg": ("image_unreadable", "is cut short or corrupt (OSError: image file is truncated"),
        "coco/notes.jpg": ("not_an_image", "is not an image (Pillow cannot identify it)"),
        "coco/scan.tif": ("image_format", "is a TIFF image; the formats sent are JPEG, PNG, WEBP, GIF, BMP"),
        "coco/moving.gif": ("image_format", "is an animated GIF (2 frames): video is out of scope"),
        "coco/bomb.png": ("image_too_large", "has more than twice images.max_pixels 40,000,000 pixels (refused by "
                                             "Pillow's decompression-bomb guard, before decoding)"),
        "coco/tall.png": ("image_too_large", "is 8000x6000 pixels, over images.max_pixels 40,000,000"),
        "../" + outside.parent.name + "/secret.png": ("image_outside_root", "outside image_root"),
        "coco/link.png": ("image_outside_root", f"resolves to {os.path.realpath(outside)}, outside image_root"),
        str(outside): ("image_outside_root", "outside image_root"),
        "s3://bucket/x.png": ("remote_image", "is a s3:// URL, which regen does not read"),
        "data:image/png;base64,%%%": ("image_unreadable", "whose base64 does not decode"),
        "": ("image_missing", "is an empty path"),
    }
    for ref, (code, says) in cases.items():
        got = rejected(folder, ref)
        assert got[0] == code and got[1].startswith("data.jsonl:1: message 1: the image ") and says in got[1], \
            (ref, got)
    assert rejected(folder, "coco/big.png", Images(max_bytes=100))[1].endswith(
        f"is {(folder / 'coco' / 'big.png').stat().st_size:,} bytes, over images.max_bytes 100")
    assert rejected(folder, "coco/big.png", Images(max_pixels=50_000))[1].endswith(
        "is 300x200 pixels, over images.max_pixels 50,000")
    assert "Pillow's decompression-bomb guard" in rejected(folder, "coco/big.png", Images(max_pixels=20_000))[1]


def test_too_many_images_in_one_prompt_is_rejected_before_any_is_read(folder):
    ps = build(folder, [{"id": "x", "images": ["coco/none.png"] * 3, "conversations": [human("<image><image><image>")]},
                        {"id": "ok", "conversations": [human("Text.")]}], images=Images(max_per_prompt=2))
    assert [(r.code, r.reason) for r in ps.rejects] == [
        ("too_many_images", "data.jsonl:1: the prompt holds 3 images, over images.max_per_prompt 2")]


def test_the_report_counts_images_and_rejects_and_status_shows_them(folder):
    ps = build(folder, [{"id": "a", "image": "coco/red.png", "conversations": [human("<image>\nColour?")]},
                        {"id": "b", "image": "coco/none.png", "conversations": [human("<image>\nColour?")]}])
    report = ps.reports[0]
    assert report.rejected_by_reason == {"image_missing": 1}
    assert report.image_counts == {"images": 1, "from_files": 1, "prompts_with_images": 1, "images_at_markers": 1,
                                   "messages_with_parts": 1,
                                   "image_bytes": (folder / "coco" / "red.png").stat().st_size}
    line = report_lines([report.as_dict()])[0]
    assert "rejected 1 (image_missing 1)" in line and "; images: " in line and "images 1" in line


def test_a_jpeg_with_bytes_after_its_end_marker_is_read_and_one_cut_short_is_not(folder):
    noise = io.BytesIO()
    Image.effect_noise((128, 96), 64).convert("RGB").save(noise, "JPEG")
    whole = noise.getvalue()
    (folder / "coco" / "padded.jpg").write_bytes(whole + b"\x00" * 64)
    (folder / "coco" / "trailer.jpg").write_bytes(whole + b"camera maker's trailer")
    (folder / "coco" / "cut.jpg").write_bytes(whole[:-300])
    ps = build(folder, [{"id": name, "image": f"coco/{name}.jpg", "conversations": [human(f"<image>\n{name}?")]}
                        for name in ("padded", "trailer", "cut")])
    assert [p.source_ref for p in ps.prompts] == ["padded", "trailer"]
    assert [(r.code, "is cut short or corrupt" in r.reason) for r in ps.rejects] == [("image_unreadable", True)]
