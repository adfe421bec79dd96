"""Hand-made image prompts for the store's tests: real PNG and JPEG bytes made with Pillow, prompts whose messages
hold image parts (core/images.py), staged into a prompt set as the sources' reader stages them (`add_image`)."""
from __future__ import annotations

import hashlib
import io
from pathlib import Path

from PIL import Image

from pipeline.core.images import image_part, text_part
from pipeline.prompts.prompt_set import Prompt
from pipeline.store.promptset import StagedPromptSet
from pipeline.store.rundir import RunDir


def picture(seed: int, size: tuple[int, int] = (24, 16), fmt: str = "PNG") -> bytes:
    """A small real image, different for every seed."""
    image = Image.new("RGB", size, ((seed * 53) % 256, (seed * 97) % 256, (seed * 31) % 256))
    image.putpixel((seed % size[0], (seed // size[0]) % size[1]), (255 - seed % 256, 0, 0))
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def part_of(data: bytes, path: str | None = None, media_type: str = "image/png",
            size: tuple[int, int] = (24, 16)) -> dict:
    return image_part(sha(data), media_type, size[0], size[1], len(data), path)


def pid(*what: object) -> str:
    return hashlib.sha256(repr(what).encode()).hexdigest()[:32]


def image_prompt(question: str, parts: list[dict], ref: str | None = None, source: str = "img") -> Prompt:
    content = [*parts, text_part(question)]
    messages = ({"role": "system", "content": "Look closely."}, {"role": "user", "content": content})
    return Prompt(pid(question, [p.get("sha256") for p in parts]), source, messages, None, f"{source}.jsonl:1",
                  ref)


def text_prompt(question: str, ref: str | None = None) -> Prompt:
    return Prompt(pid(question), "txt", ({"role": "user", "content": question},), "an answer", "txt.jsonl:1", ref)


def local_images(folder: Path, seeds: range) -> dict[str, Path]:
    """Image files on local disk: sha256 -> path."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for seed in seeds:
        data = picture(seed)
        path = folder / f"img-{seed}.png"
        path.write_bytes(data)
        files[sha(data)] = path
    return files


def stage(prompts: list[Prompt], local: dict[str, Path] | None = None, held: list[bytes] = (),
          store: str = "copy") -> StagedPromptSet:
    """A staged set as the sources' build makes it: prompts, and each distinct image once (a path or bytes)."""
    staged = StagedPromptSet(images_store=store)
    for p in prompts:
        staged.add_prompt(p)
    for digest, path in (local or {}).items():
        staged.add_image(digest, str(path))
    for data in held:
        staged.add_image(sha(data), data)
    return staged


def new_run(where) -> RunDir:
    run = RunDir(where)
    run.create()
    return run


def stored_images(run: RunDir) -> dict[str, bytes]:
    """Every image under RUN/images/<xx>/, by name (and no temporary file left in RUN/images/)."""
    out = {}
    entries = run.images.iterdir()
    assert not [e.name for e in entries if e.name.startswith(".tmp-")], "a temporary image file was left"
    for prefix in entries:
        for entry in prefix.iterdir():
            assert entry.name[:2] == prefix.name, entry
            out[entry.name] = entry.read_bytes()
    return out
