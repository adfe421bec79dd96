"""The driver's opt-in /metrics, scraped from a live run on SGLang emulators and parsed with prometheus_client's
own parser; the shipped Grafana dashboard names only series that scrape holds."""
from __future__ import annotations

import json
import re
import signal
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import emulators, prompt_source, start_regen, wait_for, write_config

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "configs" / "grafana" / "regen.json"
MODEL = "moonshotai/Kimi-K2.5"
PROMPTS = 60


def status_of(run: Path) -> dict:
    try:
        return orjson.loads((run / "status.json").read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return {}


@pytest.fixture(scope="module")
def scrape(tmp_path_factory, ray_cluster):
    """A run with `metrics: {port: 0}` over two emulators, one of which often answers 503 (though not to the
    preflight: fault_seed); /metrics is scraped once a third of the prompts are done and that one has erred,
    then the run is stopped (SIGINT)."""
    tmp = tmp_path_factory.mktemp("metrics")
    # The last prompt never gets an answer (it hangs on both, well within its request deadline): the run is still
    # live when it is scraped and stopped, however late the test gets there (the rest takes about 5 s).
    last = dict(poison_text=f"(#{PROMPTS - 1})", poison_fault="hang")
    with emulators(1, preset="kimi", tok_per_s=80, **last) as (good,), \
            emulators(1, preset="kimi", tok_per_s=80, fault_503=0.6, fault_seed=5, **last) as (flaky,):
        endpoints = [{"url": good.url, "concurrency": 2, "name": "good"},
                     {"url": flaky.url, "concurrency": 2, "name": "flaky"}]
        config = write_config(tmp, endpoints, [prompt_source(tmp, PROMPTS)], model=MODEL,
                              sampling={"temperature": 0.0, "max_tokens": 16}, metrics={"port": 0},
                              status_interval_s=0.2, request_timeout_s=600)
        run = tmp / "out" / "t"
        proc = start_regen("generate", "--config", str(config), log=tmp / "console.txt")
        try:
            def ready(status: dict) -> bool:
                flaky_errors = status.get("endpoints", {}).get("flaky", {}).get("errors", {})
                return status.get("done", 0) >= PROMPTS // 3 and bool(flaky_errors) and "metrics_url" in status

            wait_for(lambda: ready(status_of(run)), 120, 0.2, "a third of the prompts done and an error")
            url = status_of(run)["metrics_url"]
            scraped = []

            def scraped_a_third_done() -> bool:  # /metrics is refreshed on its own beat: wait for what it says
                scraped[:] = [urllib.request.urlopen(url, timeout=30).read().decode()]
                done = [s.value for f in text_string_to_metric_families(scraped[0]) for s in f.samples
                        if s.name == "regen_prompts" and s.labels.get("state") == "done"]
                return bool(done) and done[0] >= PROMPTS // 3

            wait_for(scraped_a_third_done, 120, 0.2, "/metrics to show a third of the prompts done")
            text = scraped[0]
            proc.send_signal(signal.SIGINT)  # a stop asked for: the buffer is committed, the run ends with 130
            proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = [s for f in families.values() for s in f.samples]
    return SimpleNamespace(url=url, families=families, samples=samples, code=proc.returncode, run=run)


def values(scrape, name: str, **labels: str) -> list[float]:
    return [s.value for s in scrape.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def test_metrics_show_progress_rates_and_eta_of_the_live_run(scrape):
    done, = values(scrape, "regen_prompts", state="done", run="t")
    total, = values(scrape, "regen_prompts", state="total", run="t")
    pending, = values(scrape, "regen_prompts", state="pending", run="t")
    assert total == PROMPTS and done >= PROMPTS // 3 and pending < total
    assert values(scrape, "regen_prompts_per_second", window="recent")[0] > 0
    assert values(scrape, "regen_tokens_per_second", window="overall")[0] > 0
    assert values(scrape, "regen_eta_seconds")[0] > 0, "the run had work left when it was scraped"
    assert values(scrape, "regen_run_info", run="t", model=MODEL) == [1.0]


def test_metrics_show_each_endpoints_state_in_flight_latency_and_error_classes(scrape):
    for label in ("good", "flaky"):
        states = {s.labels["state"]: s.value for s in scrape.samples
                  if s.name == "regen_endpoint_state" and s.labels["endpoint"] == label}
        assert sum(states.values()) == 1 and set(states) >= {"healthy", "open", "probing", "fatal"}
        assert values(scrape, "regen_endpoint_in_flight", endpoint=label)
        latencies, = values(scrape, "regen_request_latency_seconds_count", endpoint=label)
        assert latencies > 0
    assert values(scrape, "regen_endpoint_errors_total", endpoint="flaky", **{"class": "retryable"})[0] > 0
    assert values(scrape, "regen_endpoint_errors_total", endpoint="good", **{"class": "retryable"}) == [0.0]
    assert values(scrape, "regen_request_latency_seconds_bucket", endpoint="good", le="+Inf")


def test_metrics_listen_on_loopback_by_default_and_stop_with_the_run(scrape):
    assert scrape.url.startswith("http://127.0.0.1:") and scrape.url.endswith("/metrics")
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(scrape.url, timeout=5)
    assert "metrics_url" not in status_of(scrape.run), "status.json names no dead address"


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    return exprs


def test_metrics_show_the_share_of_generated_tokens_that_became_training_data(scrape):
    """docs/goodput.md: tokens by purpose, and their share kept by the default export."""
    training = values(scrape, "regen_generated_tokens", run="t", purpose="training")
    by_purpose = {s.labels["purpose"]: s.value for s in scrape.samples if s.name == "regen_generated_tokens"}
    assert training and training[0] > 0 and {"truncated", "duplicate", "hedge_cancelled"} <= set(by_purpose)
    (share,) = values(scrape, "regen_goodput_ratio", run="t")
    kept = by_purpose["training"] + by_purpose["flagged"]
    assert share == pytest.approx(kept / sum(by_purpose.values()), abs=1e-3)


def test_every_series_the_grafana_dashboard_queries_is_in_a_live_scrape(scrape):
    exprs = dashboard_queries()
    assert len(exprs) >= 12
    names = {s.name for s in scrape.samples}
    for expr in exprs:
        used = set(re.findall(r"\bregen_[a-z0-9_]+", expr))
        assert used, expr
        assert used <= names, f"{expr}: {sorted(used - names)} not in the scrape"
        labels_of = {name: set().union(*(s.labels for s in scrape.samples if s.name == name)) for name in used}
        for name, matchers in re.findall(r"\b(regen_[a-z0-9_]+)\{([^}]*)\}", expr):
            for label, op, value in re.findall(r'(\w+)\s*(=~|!=|=)\s*"([^"]*)"', matchers):
                assert label in labels_of[name], f"{expr}: {name} has no label {label}"
                if op == "=":
                    assert values(scrape, name, **{label: value}), f"{expr}: no {name} with {label}={value!r}"
        for grouped in re.findall(r"by \(([^)]*)\)", expr):
            for label in (g.strip() for g in grouped.split(",")):
                assert any(label in labels_of[name] for name in used), f"{expr}: no series has label {label}"
        for label in re.findall(r"label_values\(\s*regen_\w+\s*,\s*(\w+)\)", expr):
            assert any(label in labels_of[name] for name in used), expr


def test_a_stopped_run_ends_its_log_with_interrupted_the_counts_and_exit_130(scrape):
    assert scrape.code == 130
    last = (scrape.run / "logs" / "regen.log").read_text().splitlines()[-1]
    assert re.search(r"run ended \(exit 130\): interrupted: \d+ new records committed; \d+ done, 0 failed, \d+ "
                     rf"pending of {PROMPTS}; rerun to resume ", last), last


def operand_series(scrape, operand: str) -> set[frozenset]:
    """The label sets PromQL gives one side of a binary operator: `NAME{matchers}` or
    `sum by (labels) (rate(NAME{matchers}[range]))`, evaluated over the scrape ($run matches every run)."""
    operand = operand.strip()
    grouped = re.fullmatch(r"sum by \(([^)]*)\) \(\w+\((.*)\[\w+\]\)\)", operand)
    selector = grouped.group(2) if grouped else operand
    name, matchers = re.fullmatch(r"(regen_\w+)\{([^}]*)\}", selector).groups()
    wanted = re.findall(r'(\w+)\s*(=~|=)\s*"([^"]*)"', matchers)
    series = set()
    for s in scrape.samples:
        if s.name == name and all(re.fullmatch(v.replace("$run", ".*"), s.labels.get(k, "")) if op == "=~"
                                  else s.labels.get(k) == v for k, op, v in wanted):
            kept = [label.strip() for label in grouped.group(1).split(",")] if grouped else list(s.labels)
            series.add(frozenset((k, v) for k, v in s.labels.items() if k in kept))
    return series


def test_every_division_in_the_grafana_dashboard_matches_series_on_both_sides(scrape):
    """PromQL divides series whose labels agree (but those `ignoring(...)` names): a ratio of two states of one
    metric without `ignoring(state)` is an empty panel in Grafana."""
    divisions = [expr for expr in dashboard_queries() if " / " in expr]
    assert divisions
    for expr in divisions:
        left, right = expr.split(" / ")
        ignoring = re.match(r"\s*ignoring\(([^)]*)\)\s*", right)
        dropped = {label.strip() for label in ignoring.group(1).split(",")} if ignoring else set()
        right = right[ignoring.end():] if ignoring else right
        sides = [{frozenset((k, v) for k, v in labels if k not in dropped)
                  for labels in operand_series(scrape, side)} for side in (left, right)]
        assert sides[0] and sides[0] <= sides[1], f"{expr}: no series match across the division ({sides})"


def test_a_metrics_port_already_taken_stops_the_run_before_ray_starts(tmp_path):
    """The port is bound before Ray: the refusal comes at once, with the keys to change, even where joining the
    cluster would take minutes (here an address nothing answers on)."""
    import socket
    import subprocess

    from tests.helpers import run_regen

    with socket.socket() as taken, emulators(1, preset="kimi") as (server,):
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(tmp_path, [{"url": server.url, "name": "emu-0"}], [prompt_source(tmp_path, 3)],
                              model=MODEL, metrics={"port": port}, ray={"address": "127.0.0.1:1"})
        try:
            # joining that address takes Ray about 7 minutes to give up; the refusal took over 90 s on a loaded
            # 2-core machine
            result = run_regen("generate", "--config", str(config), timeout=240)
        except subprocess.TimeoutExpired:
            pytest.fail("the run waited for Ray before it found the metrics port taken")
    assert result.returncode == 2, result.stderr
    assert f"metrics: cannot listen on 127.0.0.1:{port}" in result.stderr and "metrics.port" in result.stderr
    # a new run refused before its first commit leaves no run directory (test_refusals.py), its log with it
    assert not (tmp_path / "out" / "t").exists()
