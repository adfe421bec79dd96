"""Hidden states: byte-level parsing, alignment, bf16 parts, garbage collection, loader, storage check, exports."""
from __future__ import annotations

import json
import urllib.request

import numpy as np
from pathlib import Path
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import EndpointFatal, StorageError, TerminalForPrompt
from pipeline.emulator.hidden import full_hidden_states, hidden_rows
from pipeline.hidden import parse as H
from pipeline.hidden import kernel as hk
from pipeline.hidden import parts as hidden_store
from pipeline.store import schema
from pipeline.store.rundir import RunDir, now_utc

KERNELS = ["c", "python"]


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setenv("REGEN_HIDDEN_KERNEL", "python")
    elif hk.c_kernel() is None:
        pytest.skip("no C compiler here: only the Python fallback kernel can run")
    return request.param


def body_for(prompt, output, width, start=0, dumps=orjson.dumps, text="hello", **meta):
    hs = full_hidden_states(prompt, output, start, width)
    mi = {"id": "r1", "prompt_tokens": len(prompt), "completion_tokens": len(output), "cached_tokens": start,
          **meta, "hidden_states": [np.asarray(x).tolist() for x in hs] if dumps is json.dumps else hs}
    obj = {"text": text, "output_ids": output, "meta_info": mi}
    if dumps is json.dumps:
        return json.dumps(obj).encode()
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


def expected_bits(prompt, output, width, start=0):
    ids = list(prompt) + list(output)
    f32 = hidden_rows(ids[start:len(ids) - 1], range(start, len(ids) - 1), width)
    return (f32.view(np.uint32) >> 16).astype(np.uint16)


# --- parsing ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dumps", [orjson.dumps, json.dumps], ids=["orjson", "json-with-spaces"])
def test_parse_is_bit_exact(kernel, dumps):
    prompt, output = list(range(5, 22)), list(range(900, 913))
    body = body_for(prompt, output, 64, dumps=dumps, text='tricky "hidden_states": [1,2] text')
    r = H.parse_generate_response(body, 64, chunk_rows=5)  # several output chunks
    assert r.hidden.dtype == np.uint16 and r.hidden.shape == (17 + 13 - 1, 64)
    assert np.array_equal(r.hidden, expected_bits(prompt, output, 64))
    assert r.n_prefill == 17 and r.n_inexact == 0
    assert r.text == 'tricky "hidden_states": [1,2] text' and r.output_ids == output
    assert "hidden_states" not in r.meta and r.meta["prompt_tokens"] == 17
    H.align(r.meta["prompt_tokens"], r.meta["completion_tokens"], r.n_prefill, r.n_rows)


def test_parse_full_width_few_tokens(kernel):
    prompt, output = [7, 8, 9], [100, 101, 102]
    r = H.parse_generate_response(body_for(prompt, output, 21504), 21504)
    assert r.hidden.shape == (5, 21504) and np.array_equal(r.hidden, expected_bits(prompt, output, 21504))


def test_number_forms_and_rounding(kernel):
    vals = [0.0, -0.0, 1.0, -2.5, 3.0517578125e-05, 1e-40, 65280.0, 1.5e3, 2E-3, -1.1754943508222875e-38,
            0.1, 1.0000001, 12345678901234567890.0, 3.3895313892515355e+38]
    body = orjson.dumps({"text": "", "output_ids": [1, 2], "meta_info": {"hidden_states": [[vals], vals]}})
    body = body.replace(b"1500.0", b"1.5e3").replace(b"0.002", b"2E-3")
    r = H.parse_generate_response(body, len(vals))
    f32 = np.array(vals, dtype=np.float32)
    want, _ = hk.f32_to_bf16(f32)
    assert np.array_equal(r.hidden[0], want) and np.array_equal(r.hidden[1], want)
    exact = [v for v in vals if float(np.float32(v)) == v and not (np.float32(v).view(np.uint32) & 0xFFFF)]
    assert r.n_inexact == 2 * (len(vals) - len(exact))
    with pytest.raises(H.HiddenStateMismatch, match="not bf16-exact"):
        H.parse_generate_response(body, len(vals), strict=True)


def test_width_mismatch_names_both_widths(kernel):
    body = body_for([1, 2, 3], [4, 5], 64)
    with pytest.raises(H.HiddenWidthMismatch, match=r"width 64 does not match expected_width 192") as e:
        H.parse_generate_response(body, 192)
    assert isinstance(e.value, EndpointFatal)
    # one short decode row among good ones
    obj = orjson.loads(body)
    obj["meta_info"]["hidden_states"][1] = obj["meta_info"]["hidden_states"][1][:-1]
    with pytest.raises(H.HiddenWidthMismatch, match=r"width 63 .* expected_width 64 \(row 3\)"):
        H.parse_generate_response(orjson.dumps(obj), 64)


@pytest.mark.parametrize("bad", [b'[[[1,2],[3,x]]]', b'[[[1,2],[3,4]],[5,6]', b'[[1,2]]', b'[[[1,2],"a"]]',
                                 b'[[[1,2],[3,[4]]]]', b'[[[1,2]],[null,1]]', b'[[[1,2]] [3,4]]'])
def test_malformed_hidden_states(kernel, bad):
    body = b'{"text":"","output_ids":[1],"meta_info":{"hidden_states":' + bad + b'}}'
    with pytest.raises(H.HiddenStateMismatch) as e:
        H.parse_generate_response(body, 2)
    assert isinstance(e.value, TerminalForPrompt)


def test_missing_and_misplaced_hidden_states():
    with pytest.raises(H.HiddenStateMismatch, match="no meta_info.hidden_states"):
        H.parse_generate_response(b'{"text":"","output_ids":[1],"meta_info":{}}', 2)
    with pytest.raises(H.HiddenStateMismatch, match="not a key of meta_info"):
        H.parse_generate_response(b'{"text":"","hidden_states":[],"meta_info":{}}', 2)


def test_edge_layouts(kernel):
    one = H.parse_generate_response(b'{"text":"a","output_ids":[9],"meta_info":{"hidden_states":[[[1,2]]]}}', 2)
    assert one.n_prefill == 1 and one.hidden.shape == (1, 2)
    H.align(1, 1, one.n_prefill, one.n_rows)
    empty = H.parse_generate_response(b'{"text":"","output_ids":[],"meta_info":{"hidden_states":[]}}', 2)
    assert empty.hidden.shape == (0, 2) and empty.n_prefill == 0


# --- alignment ----------------------------------------------------------------------------------------
def test_alignment_errors():
    H.align(10, 5, 10, 14)
    with pytest.raises(H.HiddenPrefixShortfall, match=r"prefix cache served 4 of 10 prompt tokens.*--disable-radix-cache"):
        H.align(10, 5, 6, 10)
    with pytest.raises(H.HiddenStateMismatch, match="expected 14"):
        H.align(10, 5, 10, 15)
    with pytest.raises(H.HiddenStateMismatch):
        H.align(10, 5, 11, 15)


def _post(url, body):
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read()


def test_real_emulator_bodies():
    from pipeline.emulator import encode, start_emulator

    eagle = start_emulator(preset="kimi-eagle3", hidden_width=64)
    cached = start_emulator(preset="kimi", enable_return_hidden_states=True, hidden_width=64)
    try:
        req = {"text": "Hidden states for this prompt, please.", "return_hidden_states": True,
               "sampling_params": {"max_new_tokens": 9}}
        raw = _post(eagle.url, req)
        r = H.parse_generate_response(raw, 192)
        pt, ct = r.meta["prompt_tokens"], r.meta["completion_tokens"]
        H.align(pt, ct, r.n_prefill, r.n_rows)
        assert np.array_equal(r.hidden, expected_bits(encode(req["text"]), r.output_ids, 192))
        with pytest.raises(H.HiddenWidthMismatch, match="width 192 does not match expected_width 21504"):
            H.parse_generate_response(raw, 21504)
        # radix cache on: the second request's prefill block is short
        _post(cached.url, req)
        again = H.parse_generate_response(_post(cached.url, req), 64)
        assert again.n_prefill < again.meta["prompt_tokens"]
        with pytest.raises(H.HiddenPrefixShortfall, match="--disable-radix-cache"):
            H.align(again.meta["prompt_tokens"], again.meta["completion_tokens"], again.n_prefill, again.n_rows)
    finally:
        eagle.stop()
        cached.stop()


# --- parts, garbage, loader ---------------------------------------------------------------------------
def _sample(pid, turn, width, n_prompt=4, n_out=3, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, n_prompt + n_out).astype(np.int32)
    hidden = rng.integers(0, 1 << 16, (n_prompt + n_out - 1, width)).astype(np.uint16)
    return pid, turn, ids, n_prompt, hidden


def _commit_data(rd: RunDir, refs: dict) -> None:
    rows = [{"prompt_id": pid, "turn_index": turn, "hidden_part": part, "hidden_row": row, "created_at": now_utc()}
            for (pid, turn), (part, row) in refs.items()]
    rd.write_part(rd.data, pa.Table.from_pylist(rows, schema=schema.RECORDS))


def test_writer_loader_roundtrip_and_garbage(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.create()
    a, b = H.HiddenPartWriter(rd, tag="actor-0"), H.HiddenPartWriter(rd, tag="actor-1")
    samples = {}
    for i in range(3):
        s = _sample(f"p{i}", i % 2, 64, seed=i)
        a.add(*s)
        samples[(s[0], s[1])] = s
    assert a.pending_bytes == sum(s[4].nbytes for s in samples.values())
    part_a, rows_a = a.commit()
    assert a.commit() == ("", {}) and len(a) == 0
    s = _sample("q0", 0, 64, seed=9)
    b.add(*s)
    samples[("q0", 0)] = s
    part_b, rows_b = b.commit()
    b.add(*_sample("orphan", 0, 64, seed=5))
    part_c, _ = b.commit()  # committed hidden part whose data row never made it
    assert len({part_a, part_b, part_c}) == 3
    assert part_a.startswith("part-actor0") and part_a.endswith("-p0-0-000001.parquet")
    assert [p.name for p in H.hidden_parts(rd)] == sorted([part_a, part_b, part_c])
    refs = {k: (part_a, v) for k, v in rows_a.items()} | {k: (part_b, v) for k, v in rows_b.items()}
    _commit_data(rd, refs)
    Path(rd.path / "hidden" / ".tmp-part-x.parquet.1234abcd").write_bytes(b"torn")
    assert H.referenced_hidden_parts(rd) == {part_a, part_b}
    garbage = H.garbage_hidden_parts(rd, H.referenced_hidden_parts(rd))
    assert sorted(p.name for p in garbage) == sorted([part_c, ".tmp-part-x.parquet.1234abcd"])
    for p in garbage:
        p.unlink()
    got = list(H.iter_hidden(rd.path))
    assert len(got) == 4
    for g in got:
        _, _, ids, n_prompt, hidden = samples[(g.prompt_id, g.turn_index)]
        assert np.array_equal(g.token_ids, ids) and g.token_ids.dtype == np.int32 and g.n_prompt == n_prompt
        assert np.array_equal(g.hidden.view(np.uint16), hidden) and g.hidden.shape == (len(ids) - 1, 64)
        assert g.loss_mask.tolist() == [0] * n_prompt + [1] * (len(ids) - n_prompt)
    try:
        import ml_dtypes
        assert got[0].hidden.dtype == ml_dtypes.bfloat16
    except ImportError:
        assert got[0].hidden.dtype == np.uint16
    # the part matches the HIDDEN schema, one row group per chunk (here one chunk a sample)
    pf = pq.ParquetFile(rd.path / "hidden" / part_a)
    assert pf.schema_arrow.equals(schema.HIDDEN) and pf.metadata.num_row_groups == 3


def test_a_sample_larger_than_a_chunk_spans_rows_and_reads_back_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(hidden_store, "CHUNK_BYTES", 64 * 2 * 5)  # five rows of width 64 a chunk
    rd = RunDir(tmp_path / "run")
    w = H.HiddenPartWriter(rd)
    big, small = _sample("big", 0, 64, n_prompt=9, n_out=9, seed=1), _sample("small", 1, 64, n_prompt=2, n_out=2)
    w.add(*big)
    w.add(*small)
    name, rows = w.commit()
    pf = pq.ParquetFile(rd.path / "hidden" / name)
    assert pf.metadata.num_row_groups == 4 + 1, "17 rows in chunks of 5, then a 3-row sample in one chunk"
    assert rows == {("big", 0): 0, ("small", 1): 4}
    for key, sample in (("big", big), ("small", small)):
        got = hidden_store.read_sample(rd.path / "hidden" / name, rows[(key, sample[1])], pf)
        assert np.array_equal(got.hidden.view(np.uint16), sample[4]) and np.array_equal(got.token_ids, sample[2])


def test_writer_refuses_misaligned(tmp_path):
    w = H.HiddenPartWriter(RunDir(tmp_path))
    pid, turn, ids, n_prompt, hidden = _sample("p", 0, 8)
    with pytest.raises(ValueError, match="tokens - 1"):
        w.add(pid, turn, ids[:-2], n_prompt, hidden)


def test_disk_bytes_near_ideal(tmp_path):
    rd = RunDir(tmp_path / "run")
    w = H.HiddenPartWriter(rd)
    ideal = 0
    for i in range(4):
        s = _sample(f"p{i}", 0, 2048, n_prompt=100, n_out=60, seed=i)
        w.add(*s)
        ideal += s[4].nbytes
    name, _ = w.commit()
    size = (rd.path / "hidden" / name).size()
    assert size <= 1.02 * ideal, size / ideal


# --- storage ------------------------------------------------------------------------------------------
def test_estimate_and_free_space(tmp_path):
    need = H.estimate_bytes(88_000, 2048, 21504)
    assert need == 88_000 * 2048 * (2 * 21504 + 4) and 7.7e12 < need < 7.8e12
    with pytest.raises(H.InsufficientStorage, match=r"need about [0-9.]+ [kMGTP]?B \([0-9,]+ bytes\); [0-9.]+ [kMGTP]?B free at") as e:
        H.check_free_space(tmp_path / "not" / "yet", need * 10**6, force=False)
    assert isinstance(e.value, StorageError)
    forced = H.check_free_space(tmp_path, need * 10**6, force=True)
    assert forced["fits"] is False and "B free at" in forced["message"]
    assert H.check_free_space(tmp_path, 1024, force=False)["fits"] is True
    assert "need about 612 kB (612,000 bytes)" in H.check_free_space(tmp_path, 612_000, force=False)["message"]


# --- exports ------------------------------------------------------------------------------------------
# The hidden-state exports read RUN/capture (tests/test_capture.py, through the libraries' own loaders); the
# parts the generating request wrote (this module's layout, T - 1 rows) are no longer exported.
def test_hidden_exports_of_a_run_without_capture_name_the_capture_command(tmp_path):
    from pipeline.core.errors import ConfigError
    from pipeline.export.hidden import export_hidden

    rd = RunDir(tmp_path / "run")
    rd.create()
    rd.write_manifest({"generation": {}})
    for fmt in ("specforge-offline", "speculators-hidden"):
        with pytest.raises(ConfigError, match="regen capture"):
            export_hidden(rd, fmt, tmp_path / fmt)


def test_export_unknown_format(tmp_path):
    from pipeline.core.errors import ConfigError
    from pipeline.export.hidden import export_hidden

    with pytest.raises(ConfigError, match="unknown hidden-state export format"):
        export_hidden(tmp_path, "nope", tmp_path / "o")


def test_parse_when_the_row_estimate_falls_short(kernel, monkeypatch):
    # 20 long rows first (the size estimate), then short ones: more rows than estimated, the sink grows by chunks
    short, long = [0.0] * 8, [3.0517578125e-05] * 8
    hs = [[long] * 20] + [short] * 60
    body = orjson.dumps({"text": "", "output_ids": list(range(61)), "meta_info": {"hidden_states": hs}})
    concatenated = []
    real = np.concatenate
    monkeypatch.setattr(np, "concatenate", lambda parts: concatenated.append(len(parts)) or real(parts))
    r = H.parse_generate_response(body, 8, chunk_rows=4)
    assert concatenated and concatenated[0] > 2
    want = np.array([long] * 20 + [short] * 60, dtype=np.float32)
    assert np.array_equal(r.hidden, (want.view(np.uint32) >> 16).astype(np.uint16)) and r.n_prefill == 20
