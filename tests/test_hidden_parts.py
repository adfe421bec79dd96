"""The hidden parts `regen capture` writes (hidden/parts.py), their bf16 conversion and the free-space check, as
units: a part written by one actor reads back bit for bit, a part no ledger row names is garbage, a sample larger
than a chunk spans rows, and the bytes on disk stay near the ideal 2 x width x rows."""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.errors import StorageError
from pipeline.hidden import parts as hidden_store
from pipeline.hidden.bf16 import f32_to_bf16
from pipeline.hidden.errors import InsufficientStorage
from pipeline.hidden.parts import (HiddenPartWriter, garbage_hidden_parts, hidden_parts, iter_hidden,
                                   referenced_hidden_parts)
from pipeline.hidden.space import check_free_space, estimate_bytes
from pipeline.store import schema
from pipeline.store.rundir import RunDir, now_utc


def _sample(pid, turn, width, n_tokens=7, n_prompt=4, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, n_tokens).astype(np.int32)
    return pid, turn, ids, n_prompt, rng.integers(0, 1 << 16, (n_tokens, width)).astype(np.uint16)


def _commit_ledger(cap: RunDir, refs: dict) -> None:
    rows = [{"prompt_id": pid, "turn_index": turn, "sample_id": f"{pid}#turn{turn}", "hidden_part": part,
             "hidden_row": row, "created_at": now_utc()} for (pid, turn), (part, row) in refs.items()]
    cap.write_part(cap.data, pa.Table.from_pylist(rows, schema=schema.CAPTURE))


def test_writer_loader_roundtrip_and_garbage(tmp_path):
    cap = RunDir(tmp_path / "capture")
    cap.create()
    a, b = HiddenPartWriter(cap, tag="actor-0"), HiddenPartWriter(cap, tag="actor-1")
    samples = {}
    for i in range(3):
        s = _sample(f"p{i}", i % 2, 64, seed=i)
        a.add(*s)
        samples[(s[0], s[1])] = s
    part_a, rows_a = a.commit()
    assert a.commit() == ("", {}) and len(a) == 0
    s = _sample("q0", 0, 64, seed=9)
    b.add(*s)
    samples[("q0", 0)] = s
    part_b, rows_b = b.commit()
    b.add(*_sample("orphan", 0, 64, seed=5))
    part_c, _ = b.commit()  # a committed hidden part whose ledger row never made it
    assert len({part_a, part_b, part_c}) == 3 and part_a.startswith("part-actor0")
    assert [p.name for p in hidden_parts(cap)] == sorted([part_a, part_b, part_c])
    _commit_ledger(cap, {k: (part_a, v) for k, v in rows_a.items()} | {k: (part_b, v) for k, v in rows_b.items()})
    Path(cap.path / "hidden" / ".tmp-part-x.parquet.1234abcd").write_bytes(b"torn")
    assert referenced_hidden_parts(cap) == {part_a, part_b}
    garbage = garbage_hidden_parts(cap)
    assert sorted(p.name for p in garbage) == sorted([part_c, ".tmp-part-x.parquet.1234abcd"])
    for p in garbage:
        p.unlink()
    got = list(iter_hidden(cap.path))
    assert len(got) == 4
    for g in got:
        _, _, ids, n_prompt, hidden = samples[(g.prompt_id, g.turn_index)]
        assert np.array_equal(g.token_ids, ids) and g.n_prompt == n_prompt and g.hidden.dtype == ml_dtypes.bfloat16
        assert np.array_equal(g.hidden.view(np.uint16), hidden) and g.hidden.shape == (len(ids), 64)
        assert g.loss_mask.tolist() == [0] * n_prompt + [1] * (len(ids) - n_prompt)
    pf = pq.ParquetFile(cap.path / "hidden" / part_a)
    assert pf.schema_arrow.equals(schema.HIDDEN) and pf.metadata.num_row_groups == 3


def test_a_sample_larger_than_a_chunk_spans_rows_and_reads_back_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(hidden_store, "CHUNK_BYTES", 64 * 2 * 5)  # five rows of width 64 a chunk
    cap = RunDir(tmp_path / "capture")
    w = HiddenPartWriter(cap)
    big, small = _sample("big", 0, 64, n_tokens=17, seed=1), _sample("small", 1, 64, n_tokens=3)
    w.add(*big)
    w.add(*small)
    name, rows = w.commit()
    pf = pq.ParquetFile(cap.path / "hidden" / name)
    assert pf.metadata.num_row_groups == 4 + 1, "17 rows in chunks of 5, then a 3-row sample in one chunk"
    assert rows == {("big", 0): 0, ("small", 1): 4}
    for sample in (big, small):
        got = hidden_store.read_sample(cap.path / "hidden" / name, rows[(sample[0], sample[1])], pf)
        assert np.array_equal(got.hidden.view(np.uint16), sample[4]) and np.array_equal(got.token_ids, sample[2])


def test_writer_refuses_a_matrix_that_is_not_one_row_a_token(tmp_path):
    w = HiddenPartWriter(RunDir(tmp_path))
    pid, turn, ids, n_prompt, hidden = _sample("p", 0, 8)
    with pytest.raises(ValueError, match="7 hidden rows for 6 tokens; expected one a token"):
        w.add(pid, turn, ids[:-1], n_prompt, hidden)


def test_disk_bytes_near_ideal(tmp_path):
    cap = RunDir(tmp_path / "capture")
    w = HiddenPartWriter(cap)
    ideal = 0
    for i in range(4):
        s = _sample(f"p{i}", 0, 2048, n_tokens=160, n_prompt=100, seed=i)
        w.add(*s)
        ideal += s[4].nbytes
    name, _ = w.commit()
    assert (cap.path / "hidden" / name).size() <= 1.02 * ideal


def test_f32_to_bf16_rounds_to_nearest_even_as_ml_dtypes_does():
    rng = np.random.default_rng(3)
    f32 = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * 10.0 ** rng.integers(-40, 30, 10_000),
                          np.array([0.0, -0.0, 1.0, -2.5, 1e-40, 65280.0, np.inf, -np.inf, 3.3895313892515355e38],
                                   dtype=np.float32),
                          # exact ties: 1 + 2^-8 rounds down to 1 (even), 1 + 3 * 2^-8 up to 1 + 2^-6
                          np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8], dtype=np.float32)]).astype(np.float32)
    bits, inexact = f32_to_bf16(f32)
    assert np.array_equal(bits, f32.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert bits[-2:].tolist() == [0x3F80, 0x3F82]
    assert inexact == int(np.count_nonzero(bits.astype(np.uint32) << 16 != f32.view(np.uint32)))
    nan_bits, _ = f32_to_bf16(np.array([np.nan, np.float32(np.uint32(0x7F800001).view(np.float32))]))
    assert np.isnan((nan_bits.astype(np.uint32) << 16).view(np.float32)).all(), "a NaN stays a NaN"


def test_estimate_and_free_space(tmp_path):
    need = estimate_bytes(88_000, 2048, 21504)
    assert need == 88_000 * 2048 * (2 * 21504 + 4) and 7.7e12 < need < 7.8e12
    with pytest.raises(InsufficientStorage, match=r"need about [0-9.]+ [kMGTP]?B \([0-9,]+ bytes\); "
                                                  r"[0-9.]+ [kMGTP]?B free at .*Free space, or pass --force") as e:
        check_free_space(tmp_path / "not" / "yet", need * 10**6, force=False, advice="Free space")
    assert isinstance(e.value, StorageError)
    forced = check_free_space(tmp_path, need * 10**6, force=True, advice="")
    assert forced["fits"] is False and "B free at" in forced["message"]
    assert "need about 612 kB (612,000 bytes)" in check_free_space(tmp_path, 612_000, False, "")["message"]


def test_hidden_exports_of_a_run_without_capture_name_the_capture_command(tmp_path):
    from pipeline.core.errors import ConfigError
    from pipeline.export.hidden import export_hidden

    rd = RunDir(tmp_path / "run")
    rd.create()
    rd.write_manifest({"generation": {}})
    for fmt in ("specforge-offline", "speculators-hidden"):
        with pytest.raises(ConfigError, match="regen capture"):
            export_hidden(rd, fmt, tmp_path / fmt)
    with pytest.raises(ConfigError, match="unknown hidden-state export format"):
        export_hidden(tmp_path, "nope", tmp_path / "o")
