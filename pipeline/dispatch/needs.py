"""What a prompt set needs of the fleet beyond text, told before the first prompt so that the preflight checks it
(probes.py): tools (`PromptSetReader.has_tools`, run.py) and images (here).

Images: the prompt set's own count when it has one (the store's reader's `has_images()`, if it has it; else its
`images` column, each prompt's count of image parts: a few bytes a prompt); a set without it is read from its
messages (the `parts` of schema 6's MESSAGE6, a row group at a time; a set written before image prompts has no
`parts` and is answered at once)."""
from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ..core.images import IMAGE

IMAGES_COLUMN = "images"  # the prompt set's count of each prompt's image parts (store/prompt_reader.py)


def has_images(prompts: Any) -> bool:
    """Some prompt of the set has an image part."""
    counted = getattr(prompts, "has_images", None)
    if callable(counted):
        return bool(counted())
    if IMAGES_COLUMN in prompts.schema.names:
        return any(pc.max(table.column(IMAGES_COLUMN)).as_py() or 0 for _, table in prompts.scan([IMAGES_COLUMN]))
    return messages_have_images(prompts)


def messages_have_images(prompts: Any) -> bool:
    """Derived from the messages column (a PromptSetReader: `schema`, `scan`)."""
    if "messages" not in prompts.schema.names:
        return False
    message = prompts.schema.field("messages").type.value_type
    if not pa.types.is_struct(message) or message.get_field_index("parts") < 0:
        return False
    for _, table in prompts.scan(["messages"]):
        if any_image(table.column("messages")):
            return True
    return False


def any_image(messages: pa.ChunkedArray | pa.Array) -> bool:
    """Whether a list<MESSAGE6> column holds an image part."""
    if isinstance(messages, pa.ChunkedArray):
        messages = messages.combine_chunks()
    parts = pc.list_flatten(pc.struct_field(pc.list_flatten(messages), "parts"))
    if len(parts) == 0:
        return False
    return bool(pc.any(pc.equal(pc.struct_field(parts, "type"), IMAGE)).as_py())
