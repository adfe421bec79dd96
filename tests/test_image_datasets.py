"""Image datasets (issue 28): `datasets` Image columns read from a save_to_disk folder and from Parquet, the image
presets (LLaVA-Instruct-150K, ShareGPT4V, ALLaVA-4V) on samples in their datasets' real shapes and folder layouts,
checked against speculators' own `sharegpt4v_coco` loader, the project's image sample, the spec keys, and what
`regen validate` says about images."""
from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path

import pytest
import yaml
from PIL import Image

from pipeline.prompts.errors import SourceError
from pipeline.prompts.presets import recognise
from pipeline.prompts.probe import probe_source
from pipeline.prompts.prompt_set import PromptSet, build_into, build_prompt_set
from pipeline.prompts.sources import SourceSpec, load_source_spec
from tests.test_dataset_presets import IMAGE_PRESETS, speculators_configs

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "prompts_sources"
PRESET_DATA = Path(__file__).parent / "data" / "presets"
PICTURES = PRESET_DATA / "images"


def kinds(prompt) -> list:
    return [m["content"] if isinstance(m["content"], str) else
            [p["text"] if p["type"] == "text" else f"image:{p['media_type']}" for p in m["content"]]
            for m in prompt.messages]


def png_bytes(colour) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 12), colour).save(out, "PNG")
    return out.getvalue()


class Sink(PromptSet):
    def __init__(self):
        super().__init__()
        self.handed: list = []

    def add_image(self, sha256, source):
        self.handed.append((sha256, type(source).__name__))


# --- a `datasets` Image column ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def image_dataset(tmp_path_factory):
    """A dataset of an Image column ({bytes, path}), a path-only row, and TRL's placeholders beside an `images`
    list, saved with save_to_disk (which embeds the path-only picture's bytes) and written as Parquet by `datasets`
    itself (which keeps its absolute path)."""
    import datasets

    folder = tmp_path_factory.mktemp("hf")
    (folder / "pictures").mkdir()
    Image.new("RGB", (16, 12), (0, 200, 0)).save(folder / "pictures" / "green.png")
    red, blue = png_bytes((200, 0, 0)), png_bytes((0, 0, 200))
    placeholder = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "Colour?"}]}]
    text_only = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    features = datasets.Features({
        "id": datasets.Value("string"), "image": datasets.Image(), "images": datasets.List(datasets.Image()),
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.List(
            {"type": datasets.Value("string"), "text": datasets.Value("string")})})})
    rows = {"id": ["bytes", "path", "list", "text"],
            "image": [{"bytes": red, "path": "red.png"},
                      {"bytes": None, "path": str(folder / "pictures" / "green.png")}, None, None],
            "images": [None, None, [{"bytes": blue, "path": None}], None],
            "messages": [placeholder, placeholder, placeholder, text_only]}
    ds = datasets.Dataset.from_dict(rows, features=features)
    ds.save_to_disk(str(folder / "saved"))
    ds.to_parquet(str(folder / "rows.parquet"))
    return folder


def test_a_datasets_image_column_reads_the_same_from_save_to_disk_and_from_parquet(image_dataset):
    kw = dict(format="openai", field="messages", id_field="id", spec_file=image_dataset / "s.yaml", image_field=None)
    saved = SourceSpec("hf", "hf", "saved", **kw)
    parquet = SourceSpec("pq", "parquet", "rows.parquet", **kw)
    results = []
    for spec, handed in ((saved, ["bytes", "bytes", "bytes"]), (parquet, ["bytes", "str", "bytes"])):
        sink = Sink()
        build_into(sink, [(spec, None)])
        assert sink.rejects == [], sink.rejects
        assert [p.source_ref for p in sink.prompts] == ["bytes", "path", "list", "text"]
        assert [kinds(p) for p in sink.prompts][:3] == [[["image:image/png", "Colour?"]]] * 3
        assert kinds(sink.prompts[3]) == [["Name a colour."]], "a list of text parts stays parts"
        assert [kind for _, kind in sink.handed] == handed, "bytes as bytes, a path as a path"
        results.append([p.prompt_id for p in sink.prompts])
    assert results[0] == results[1] and len(set(results[0])) == 4


def test_datasets_bytes_in_a_rejected_record_are_shown_by_their_count(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    huge = png_bytes((1, 2, 3)) + b"\x00" * 5000
    pq.write_table(pa.Table.from_pylist([{"image": {"bytes": b"not a picture", "path": None},
                                          "conversations": [{"from": "human", "value": "<image>\nWhat?"}]},
                                         {"image": {"bytes": huge, "path": "x.png"},
                                          "conversations": [{"from": "human", "value": "<image>"}] * 2},
                                         {"image": None, "conversations": [{"from": "human", "value": "Hi"}]}]),
                   tmp_path / "d.parquet")
    ps = build_prompt_set([(SourceSpec("d", "parquet", "d.parquet", "sharegpt", spec_file=tmp_path / "d.yaml"),
                            None)])
    first, second = ps.rejects
    assert first.code == "not_an_image" and first.reason.startswith("d.parquet#0: message 1: the image of 13 bytes")
    assert '"bytes":"<13 bytes>"' in first.raw and second.code == "image_marker_mismatch"
    assert f"<{len(huge):,} bytes>" in second.raw and len(second.raw) < 500


# --- the presets ---------------------------------------------------------------------------------------------------
IMAGE_ROOTS = {"llava_instruct_150k": PICTURES / "coco" / "train2017", "sharegpt4v": PICTURES, "allava_4v": PICTURES}
EXPECTED = {  # (source_ref, the messages sent), the rejects
    "llava_instruct_150k": ([("000000033471", [["image:image/jpeg", "What colour is the background of the picture?"],
                                               "The background is red.", "What shape is drawn on it?"]),
                             ("000000033471", [["What do you see happening in this image?", "image:image/jpeg"]]),
                             ("000000052846", [["image:image/jpeg", "What colour is the background of the picture?"]])],
                            {"image_missing": 1}),
    "sharegpt4v": ([("000000033471", [["What do you see happening in this image?", "image:image/jpeg"]]),
                    ("sa_227013", [["image:image/jpeg", "Analyze the image in a comprehensive and detailed manner."]])],
                   {"image_missing": 1}),
    "allava_4v": ([("allava_laion_cap_100277305", [["image:image/jpeg", "Please depict the image in words."]]),
                   ("allava_laion_cap_100760552", [["image:image/jpeg", "Please depict the image in words."]])], {}),
}


def preset(name: str) -> SourceSpec:
    return dataclasses.replace(load_source_spec(SOURCES / f"{name}.yaml"), path=str(PRESET_DATA / IMAGE_PRESETS[name]),
                               image_root=str(IMAGE_ROOTS[name]))


@pytest.mark.parametrize("name", sorted(IMAGE_PRESETS))
def test_each_image_preset_reads_its_sample_from_its_datasets_folder_layout(name):
    ps = build_prompt_set([(preset(name), None)])
    prompts, rejected = EXPECTED[name]
    assert [(p.source_ref, kinds(p)) for p in ps.prompts] == prompts
    assert ps.reports[0].rejected_by_reason == rejected and ps.reports[0].uncarried == {}
    for reject in ps.rejects:
        assert "is not there (looked for " in reject.reason and reject.reason.startswith(f"{reject.origin}: message 1")
        assert reject.origin.endswith(f"{IMAGE_PRESETS[name]}#{len(prompts)}")
    assert {recognise(r).name for r in yaml.safe_load((PRESET_DATA / IMAGE_PRESETS[name]).read_text())} == {name}
    assert load_source_spec(SOURCES / f"{name}.yaml").image_root.startswith("/data/"), "a placeholder to set"


def test_the_sharegpt4v_preset_sends_what_speculators_sharegpt4v_coco_builds(monkeypatch):
    config = speculators_configs()["sharegpt4v_coco"]
    shipped = load_source_spec(SOURCES / "sharegpt4v.yaml")
    assert (shipped.path, shipped.subset, shipped.split) == (config.hf_path, config.subset, config.split)
    monkeypatch.setenv("COCO_DIR", str(PICTURES / "coco"))
    ours = {p.source_ref: p for p in build_prompt_set([(preset("sharegpt4v"), None)]).prompts}
    for record in yaml.safe_load((PRESET_DATA / "sharegpt4v.json").read_text()):
        if not config.filter_fn(record):
            continue
        theirs = config.normalize_fn(record)["conversations"][0]["value"]
        mine = ours[record["id"]].messages[0]["content"]
        assert [p["type"] for p in theirs] == [p["type"] for p in mine]
        texts = [[p["text"] for p in parts if p["type"] == "text"] for parts in (theirs, mine)]
        assert texts[0] == texts[1]
        (image,) = [p for p in theirs if p["type"] == "image"]
        assert Path(image["path"]).read_bytes() == (PICTURES / record["image"]).read_bytes()


# --- the project's image sample ------------------------------------------------------------------------------------
def test_the_image_sample_builds_clean_with_each_shape():
    ps = build_prompt_set([(load_source_spec(SOURCES / "sample_images.yaml"), None)])
    assert ps.rejects == [] and len(ps.prompts) == 8
    by_id = {p.source_ref: kinds(p) for p in ps.prompts}
    question = "What shapes do you see, and what colour is each?"
    assert by_id["img-001"] == [["image:image/png", question]] and by_id["img-002"] == [["image:image/jpeg", question]]
    assert by_id["img-005"] == [["Here are two pictures.", "image:image/jpeg", "image:image/jpeg",
                                 "Which one has warmer colours?"]]
    assert by_id["img-008"] == ["Name the three primary colours of paint."]
    counts = ps.reports[0].image_counts
    assert (counts["images"], counts["prompts_with_images"], counts["from_data_url"]) == (9, 7, 1)
    assert len(ps.images) == 5 and all(size < 8192 for size in (os.path.getsize(p) for p in ps.images.values()
                                                                   if isinstance(p, str)))


# --- spec keys and regen validate ----------------------------------------------------------------------------------
def test_image_root_and_image_field_are_read_from_the_spec_file_folder(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "pics").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "pics" / "a.png")
    (tmp_path / "data" / "x.jsonl").write_text('{"picture": "a.png", "conversations": [{"from": "human", '
                                               '"value": "<image>\\nWhat?"}]}\n')
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text("name: s\nkind: jsonl\npath: data/x.jsonl\nformat: sharegpt\nimage_root: pics\n"
                         "image_field: picture\n")
    spec = load_source_spec(spec_file)
    assert (spec.image_root, spec.image_field) == ("pics", "picture")
    assert kinds(build_prompt_set([(spec, None)]).prompts[0]) == [["image:image/png", "What?"]]
    spec_file.write_text(spec_file.read_text().replace("image_root: pics", "image_root: nowhere"))
    with pytest.raises(SourceError) as exc:
        build_prompt_set([(load_source_spec(spec_file), None)])
    assert str(exc.value) == (f"source 's': image_root {tmp_path / 'nowhere'} is not a folder; set the spec's "
                              "`image_root` to the folder its images are in")


def test_validate_reads_and_counts_the_images_of_the_first_records_but_fetches_none(tmp_path):
    probe = probe_source(preset("llava_instruct_150k"))
    assert probe.rejected == {"image_missing": 1} and probe.valid == 3
    assert "  images: 3 read in 3 prompts, " in "\n".join(probe.lines())
    (tmp_path / "x.jsonl").write_text('{"image": "https://example.org/a.jpg", "conversations": [{"from": "human", '
                                      '"value": "<image>\\nWhat?"}]}\n')
    remote = probe_source(SourceSpec("r", "jsonl", "x.jsonl", "sharegpt", spec_file=tmp_path / "r.yaml"))
    assert remote.valid == 1 and remote.no_valid is None
    assert "1 http(s) images not fetched (validate contacts nothing)" in "\n".join(remote.lines())


def test_a_downloaded_repository_read_through_load_dataset_gives_its_images_undecoded(image_dataset, monkeypatch):
    """A folder without `data_files` goes through `datasets.load_dataset` (streamed), which would decode the Image
    column into Pillow objects: regen turns decoding off and reads the stored bytes, as from the Parquet file."""
    import shutil

    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(image_dataset / "cache"))
    (image_dataset / "repo" / "data").mkdir(parents=True, exist_ok=True)
    shutil.copy(image_dataset / "rows.parquet", image_dataset / "repo" / "data" / "train-00000-of-00001.parquet")
    kw = dict(format="openai", field="messages", id_field="id", spec_file=image_dataset / "s.yaml")
    repo = build_prompt_set([(SourceSpec("repo", "hf", "repo", image_root=".", **kw), None)])
    parquet = build_prompt_set([(SourceSpec("pq", "parquet", "rows.parquet", **kw), None)])
    assert repo.rejects == [] and repo.reports[0].containers == {"repo[train]": "Hugging Face dataset (streamed), "
                                                                              "columns id, image, images, messages"}
    assert [p.prompt_id for p in repo.prompts] == [p.prompt_id for p in parquet.prompts]
