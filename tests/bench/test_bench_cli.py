"""``xferkit bench`` driven as a user drives it: a subprocess per command, its output parsed."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from xferkit.bench.models import PRESETS

SMALL = ["--requests", "3", "--concurrency", "2", "--tokens", "64"]


def xferkit(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "xferkit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def bench_json(*args: str) -> dict[str, Any]:
    run = xferkit("bench", *args, "--quiet", "--json", "-")
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def _consistent(data: dict[str, Any], requests: int) -> None:
    """What every case must satisfy, whatever the model and driver."""
    assert data["states"] == ["handshake", "waiting", "transfer"]
    assert data["stages"] == [
        "handshake", "plan", "pack", "post", "wire", "notify", "unpack", "control"
    ]  # fmt: skip
    for case in data["cases"]:
        records = case["records"]
        assert len(records) == requests + 1  # one warm-up
        assert [r["warmup"] for r in records].count(True) == 1
        src = case["tp"][0] * case["pp"][0]
        dst = case["tp"][1] * case["pp"][1]
        for r in records:
            assert r["verified"] is True
            assert len(r["decode"]) == dst and len(r["prefill"]) == src
            assert r["routes"]["plan"] == {"bytes": r["bytes"], "descriptors": r["descriptors"]}
            assert all(s <= e for s, e in r["decode"] + r["prefill"])
            assert 0 < r["latency_s"] <= r["end"] - r["start"]
            # the last decode rank's states, in order, within the request's span
            spans = [r["states"][s] for s in data["states"]]
            assert all(a <= b for a, b in spans) and spans[0][0] >= 0
            assert all(x[1] == pytest.approx(y[0]) for x, y in itertools.pairwise(spans))
            assert spans[-1][1] <= r["end"] - r["start"]  # DONE, then its reporter saw it
            # every rank's stages: each inside the request's span on some rank (a prefill
            # rank sees its last write complete after the decode rank's DONE), its work
            # inside its span unless pieces ran at once (writes in flight together)
            assert {"plan", "post", "wire", "landed"} <= set(r["timeline"]), r["timeline"]
            last = max(e for _, e in r["decode"] + r["prefill"]) - r["start"]
            for stage, (a, b, busy) in r["timeline"].items():
                assert 0 <= a <= b <= last, (stage, a, b)
                assert busy >= 0 and (stage in ("wire", "post") or busy <= b - a + 1e-6)
            split = r["split"]
            assert list(split) == data["stages"] and all(v >= 0 for v in split.values())
            assert split["handshake"] == pytest.approx(spans[0][1] - spans[0][0])
            assert split["control"] <= r["latency_s"] + 1e-9
        measured = [r for r in records if not r["warmup"]]
        span = max(r["end"] for r in measured) - min(r["start"] for r in measured)
        assert case["span_s"] == pytest.approx(span)
        assert case["gbps"] == pytest.approx(sum(r["bytes"] for r in measured) / span / 1e9)
        assert case["verified"] is True and case["requests"] == requests
        assert case["ceiling"]["bytes"] == case["bytes_per_request"]
        assert case["ratio"] == pytest.approx(case["gbps"] / case["ceiling"]["driver_gbps"])


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_hands_over_byte_checked_on_the_loopback(preset: str) -> None:
    layers = {"tiny": "4", "lfm2": "6", "qwen3next": "4"}.get(preset, "2")
    data = bench_json("--preset", preset, "--layers", layers, "--tp", "2:1", *SMALL)
    _consistent(data, 3)
    case = data["cases"][0]
    # MLA's latent is replicated: one prefill rank serves it; a sharded model needs both.
    both = ["prefill rank 0"] if preset == "mla" else ["prefill rank 0", "prefill rank 1"]
    assert case["readers"] == {"decode rank 0": both}
    if preset == "lfm2":  # the empty temporal state of every conv layer, named
        assert len(case["dropped"]) == 3 * 4  # 4 conv layers of 6, on each of the 3 ranks
        assert all("state/temporal[" in d and "0 bytes" in d for d in case["dropped"])
    else:
        assert case["dropped"] == []


def test_bytes_are_the_models_bytes() -> None:
    """Llama-70B shape, 2 layers, 64 tokens, TP 2 -> 4 with NHD -> HND pages of 16 -> 32: each
    request moves k and v of every token, 8 heads of 128, bf16, whatever the pairing."""
    data = bench_json(
        "--preset", "llama70b", "--layers", "2", "--tp", "2:4", "--page", "16:32",
        "--layout", "nhd:hnd", "--chunks", "2", *SMALL,
    )  # fmt: skip
    _consistent(data, 3)
    case = data["cases"][0]
    assert case["bytes_per_request"] == 2 * 2 * 64 * 8 * 128 * 2
    assert all(r["bytes"] == case["bytes_per_request"] for r in case["records"])


@pytest.mark.parametrize("driver", ["mooncake", "nixl"])
def test_a_real_driver_hands_over_byte_checked(driver: str) -> None:
    data = bench_json("--driver", driver, "--tp", "1:2", "--staging", "never,always", *SMALL)
    _consistent(data, 3)
    assert [c["label"] for c in data["cases"]] == [
        f"{driver} tp 1:2 never",
        f"{driver} tp 1:2 always",
    ]
    never, always = data["cases"]  # the routes each request took, from its handles
    assert never["staged_chunks"] == 0 and never["direct_chunks"] > 0
    assert always["direct_chunks"] == 0 and always["staged_chunks"] > 0
    for r in always["records"]:
        assert r["routes"]["staged_chunks"] > 0 and r["routes"]["staging_wait_s"] >= 0
        assert r["routes"]["staged_bytes"] + r["routes"]["direct_bytes"] == r["bytes"]


def test_plot_writes_a_png_with_the_expected_series(tmp_path: Path) -> None:
    from PIL import Image

    out = tmp_path / "bench.png"
    run = xferkit("bench", "--tp", "1:1,1:2", *SMALL, "--plot", str(out), "--quiet")
    assert run.returncode == 0, run.stderr
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size[0] > 600
        series = json.loads(image.info["Description"])
    assert series["throughput"] == ["bench GB/s", "driver, 1 descriptor", "memcpy, 1 core"]
    assert series["cdf"] == ["loopback tp 1:1 auto", "loopback tp 1:2 auto"]


def test_pipeline_stages_and_curve_keys_hand_over_byte_checked() -> None:
    """--pp 2:1: two prefill stages (each its own layers) into one decode stage; --keys: every
    Session with CurveZMQ, the prefill ranks trusting the bench's key."""
    data = bench_json("--pp", "2:1", "--tp", "1:2", "--keys", *SMALL)
    _consistent(data, 3)
    (case,) = data["cases"]
    assert case["pp"] == [2, 1] and data["model"]["keys"] is True
    assert all(len(r["prefill"]) == 2 for r in case["records"])  # one per stage


def test_a_token_range_draws_each_request_length() -> None:
    args = ["--tokens", "16-512", "--requests", "12", "--concurrency", "4", "--chunks", "2"]
    data = bench_json("--tp", "1:2", *args)
    _consistent(data, 12)
    assert data["model"]["min_tokens"] == 16 and data["model"]["tokens"] == 512
    sizes = {r["bytes"] for r in data["cases"][0]["records"]}
    assert len(sizes) > 3  # lengths differ (and every byte of each was checked)


def test_the_table_names_every_column() -> None:
    run = xferkit("bench", "--tp", "1:1", *SMALL)
    assert run.returncode == 0, run.stderr
    for column in (
        "bytes/req", "descs/req", "GB/s", "req/s", "p50 ms", "p99 ms", "staged", "ratio",
        "CPU s/GB",
    ):  # fmt: skip
        assert column in run.stdout
    assert "loopback tp 1:1 auto" in run.stdout and "checked" in run.stdout


@pytest.mark.parametrize("driver", ["loopback", "mooncake", "nixl"])
def test_raw_check_on_each_driver(driver: str) -> None:
    run = xferkit(
        "bench", "raw", "--driver", driver, "--blocks", "4K,1M", "--batches", "1,8",
        "--check", "--json", "-", "--quiet",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)["rows"]
    assert [(r["block_bytes"], r["batch"]) for r in rows] == [
        (4096, 1), (4096, 8), (1 << 20, 1), (1 << 20, 8),
    ]  # fmt: skip
    for r in rows:
        assert r["checked"] is True and r["gbps"] > 0
        assert r["avg_lat_us"] == pytest.approx(r["avg_post_us"] + r["avg_tx_us"])
        assert r["p99_post_us"] >= r["avg_post_us"] * 0 and r["p99_tx_us"] > 0


def test_raw_prints_nixlbench_columns() -> None:
    run = xferkit("bench", "raw", "--blocks", "64K", "--batches", "1,4")
    assert run.returncode == 0, run.stderr
    for column in ("Block Size (B)", "Batch Size", "B/W (GB/Sec)", "Avg Lat. (us)", "P99 Tx (us)"):
        assert column in run.stdout


def test_calibrate_a_third_party_driver() -> None:
    """The example distribution (examples/driver, installed as a plugin like any third
    party's) declares no costs; calibrate measures what it should declare."""
    run = xferkit("bench", "calibrate", "example", "--json", "-", "--quiet")
    assert run.returncode == 0, run.stderr
    c = json.loads(run.stdout)
    assert c["driver"] == "example" and c["landed"] is True
    assert c["descriptor_bytes"] > 0 and c["copy_cost"] > 0
    assert c["declared"] == {"descriptor_bytes": 4096, "copy_cost": 1.0}  # the defaults


def _one_line(run: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    assert run.returncode == code, (run.returncode, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("xferkit")
    for w in words:
        assert w in lines[0]
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["--tp", "0:2"], 2, ["--tp", "0:2"]),
        (["--staging", "sometimes"], 2, ["sometimes"]),
        (["--preset", "gpt5"], 2, ["gpt5"]),
        (["--preset", "mla", "--layout", "hnd"], 2, ["mla", "head axis"]),
        (["--page", "16:24"], 2, ["16:24", "multiple"]),
        (["--tokens", "64-16"], 2, ["64-16", "below"]),
        (["--tp", "3:1", "--quiet"], 2, ["ManifestError", "tp_size 3"]),
        (["--driver", "nope"], 3, ["'nope'", "backends: ["]),
        (["--driver", "example"], 3, ["cross_process=False"]),
        (["--driver", "loopback", "-o", "colour=blue"], 3, ["bad option", "colour"]),
        (["raw", "--blocks", "4Q"], 2, ["4Q"]),
        (["calibrate", "nope"], 3, ["'nope'"]),
    ],
)
def test_a_bad_option_or_driver_is_one_line_and_an_exit_code(
    args: list[str], code: int, words: list[str]
) -> None:
    _one_line(xferkit("bench", *args), code, *words)


def test_a_missing_extra_is_named() -> None:
    code = "import sys; sys.modules['rich'] = None; from xferkit.cli import main; "
    code += "sys.exit(main(['bench']))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    _one_line(run, 2, "xferkit[cli]")


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_every_rank_process() -> None:
    # A Ctrl-C at a terminal: the child takes SIGINT's default even where this run was
    # started in the background (an ignored SIGINT is inherited through make and exec).
    proc = subprocess.Popen(
        [sys.executable, "-m", "xferkit", "bench", "--requests", "100000", "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.monotonic() + 60
        ranks: list[int] = []
        while time.monotonic() < deadline and len(ranks) < 6:  # tiny: prefill 2, decode 4
            time.sleep(0.2)
            ranks = [p for p in _children(proc.pid) if "spawn_main" in _cmdline(p)]
        assert len(ranks) >= 6, "the rank processes did not start"
        time.sleep(3)  # requests in flight
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [
        "xferkit bench: interrupted; every rank process was stopped"
    ]
    assert [p for p in ranks if _alive(p)] == []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
