"""Image runs end to end, as a user runs them: `regen generate` (the real command) on a local fleet of two SGLang
emulators serving Kimi-K2.5 (`local_fleet.engine: emulator`, preset kimi: configs/local_images.yaml's fleet) over
the project's image sample beside a text source, SIGKILLed at a data part's commit and resumed: every prompt is
committed once, each image record's prompt ids hold Kimi's <|media_pad|> (163605) as many times as the emulator's
rule (SGLang's navit_resize_config) gives for each image's size, and each answer names the images it was sent
(size, sha256) that the record holds and the run directory stores. A text-only emulator (`plain`) in the fleet is
refused by the preflight, named, with its reason. The real engine: tests/test_vlm_engine.py."""
from __future__ import annotations

import collections
import hashlib
import re
from pathlib import Path

import orjson
import pyarrow.parquet as pq

from pipeline.core.images import IMAGE, stored_image_path
from pipeline.emulator import start_emulator
from pipeline.emulator.media import MEDIA_PAD_ID, kimi_image_tokens
from pipeline.endpoints.localfleet import port_in_use
from pipeline.store.faults import kill_at_data_part
from tests.helpers import (all_prompt_ids, committed_ids, data_parts, free_port, prompt_source, run_regen, wait_for,
                           write_config)

REPO = Path(__file__).resolve().parent.parent
SAMPLE_IMAGES = REPO / "prompts_sources" / "sample_images.yaml"
KIMI = "moonshotai/Kimi-K2.5"
MENTION = re.compile(r"I see an image \((\d+)x(\d+), sha256 ([0-9a-f]{16})\)\.")
SAMPLE_IMAGE_PROMPTS = 7  # of the sample's 8 records, one is text only
STOPPED_AT_PREFLIGHT = 1


def images_of(record: dict) -> list[dict]:
    """The image parts of a record's conversation, in order."""
    return [p for m in record["messages"] for p in (m["parts"] or []) if p["type"] == IMAGE]


def rows(run: Path) -> list[dict]:
    return [r for part in data_parts(run) for r in pq.read_table(part).to_pylist()]


def test_an_image_run_on_a_local_emulator_fleet_killed_and_resumed_answers_each_prompt_once_about_its_images(
        tmp_path, ray_cluster):
    fleet = {"engine": "emulator", "emulator_preset": "kimi", "model_alias": KIMI, "servers": 2,
             "base_port": free_port(), "slots": 4, "ctx_per_slot": 16384}
    config = write_config(tmp_path, [], [SAMPLE_IMAGES, prompt_source(tmp_path, 24)], model=KIMI,
                          local_fleet=fleet, return_token_ids=True, flush_records=4,
                          sampling={"temperature": 0.0, "max_tokens": 256})
    run = tmp_path / "out" / "t"
    killed = run_regen("generate", "--config", str(config), env=kill_at_data_part(3))
    assert killed.returncode == -9, killed.stderr
    before = committed_ids(run)
    assert 0 < len(before) < len(all_prompt_ids(run)), "killed in the middle of the run"
    ports = [fleet["base_port"], fleet["base_port"] + 1]
    wait_for(lambda: not any(map(port_in_use, ports)), 30, what="the emulators to die with their driver")

    resumed = run_regen("generate", "--config", str(config))
    assert resumed.returncode == 0, resumed.stderr
    records = rows(run)
    keys = collections.Counter((r["prompt_id"], r["turn_index"], r["sample_index"]) for r in records)
    assert max(keys.values()) == 1 and set(committed_ids(run)) == all_prompt_ids(run), "every prompt exactly once"
    assert set(before) <= set(committed_ids(run))
    with_images = [r for r in records if images_of(r)]
    assert len(with_images) == SAMPLE_IMAGE_PROMPTS and {r["source"] for r in with_images} == {"sample_images"}
    named = 0
    for record in records:
        images = images_of(record)
        ids = record["prompt_token_ids"]
        assert ids and ids.count(MEDIA_PAD_ID) == sum(kimi_image_tokens(i["width"], i["height"]) for i in images)
        assert record["prompt_tokens"] == len(ids)
        for image in images:  # each image the record holds is in the run directory, whole
            assert hashlib.sha256((run / stored_image_path(image["sha256"])).read_bytes()).hexdigest() == \
                image["sha256"]
        if record["content"]:  # an answer cut inside its reasoning names nothing
            seen = [(int(w), int(h), sha) for w, h, sha in MENTION.findall(record["content"])]
            assert seen == [(i["width"], i["height"], i["sha256"][:16]) for i in images], record["content"][:300]
            named += bool(images)
    assert named >= SAMPLE_IMAGE_PROMPTS - 2, "most image answers finished and named their images"
    status = orjson.loads(run_regen("status", str(run), "--json").stdout)
    assert status["image_prompts"] == {"total": SAMPLE_IMAGE_PROMPTS, "done": SAMPLE_IMAGE_PROMPTS, "pending": 0,
                                       "failed": 0}
    assert status["done"] == len(all_prompt_ids(run))


def test_a_text_only_emulator_in_the_fleet_is_refused_for_an_image_prompt_set_by_name(tmp_path, ray_cluster):
    servers = [start_emulator(preset="kimi"), start_emulator(preset="plain")]
    try:
        endpoints = [{"url": servers[0].url, "name": "kimi-vision"}, {"url": servers[1].url, "name": "text-only"}]
        config = write_config(tmp_path, endpoints, [SAMPLE_IMAGES], model=KIMI)
        refused = run_regen("generate", "--config", str(config))
    finally:
        for server in servers:
            server.stop()
    assert refused.returncode == STOPPED_AT_PREFLIGHT, refused.stderr
    assert ("text-only: the prompt set has images, and this server takes none (/model_info reports "
            "has_image_understanding: false)") in refused.stderr, refused.stderr
    assert "kimi-vision:" not in refused.stderr and "1 of 2 endpoints pass" in refused.stderr
    assert not data_parts(tmp_path / "out" / "t"), "no prompt was sent"
