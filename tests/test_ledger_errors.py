"""A ledger part that cannot be read (a disk mangled it) is named in the error a resume stops with, which exits
with the storage error's code and no traceback."""
from __future__ import annotations

from tests.helpers import data_parts, emulators, prompt_source, run_regen, write_config


def test_a_resume_whose_ledger_has_an_unreadable_part_names_that_part(tmp_path, ray_cluster):
    with emulators(1, preset="kimi") as (server,):
        config = write_config(tmp_path, [{"url": server.url, "concurrency": 4, "name": "emu"}],
                              [prompt_source(tmp_path, 40)], model="moonshotai/Kimi-K2.5")
        assert run_regen("generate", "--config", str(config)).returncode == 0
        parts = data_parts(tmp_path / "out" / "t")
        assert len(parts) >= 3
        parts[-1].unlink()  # some prompts pending again
        parts[1].write_bytes(b"not a parquet part" * 8)  # a part the disk mangled
        resumed = run_regen("generate", "--config", str(config), timeout=120)
        assert resumed.returncode != 0
        assert parts[1].name in resumed.stderr, resumed.stderr[-2000:]
        assert "Traceback" not in resumed.stderr, resumed.stderr[-2000:]
