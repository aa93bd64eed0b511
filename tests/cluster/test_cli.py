"""The `duet` command line, run as a user runs it (a subprocess of the installed entry point)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DUET = [sys.executable, "-m", "cluster.cli"]
ROOT = Path(__file__).resolve().parents[2]


def duet(*args, check=True):
    return subprocess.run([*DUET, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=check)


def test_make_tiny_model_then_generate(tmp_path):
    model = tmp_path / "tiny"
    out = duet("make-tiny-model", str(model), "--arch", "mistral")
    assert Path(out.stdout.strip()) == model and (model / "config.json").is_file()
    res = duet("generate", "--model", str(model), "--prompt", "the river", "--max-tokens", "12")
    assert res.stdout.strip(), res.stderr
    assert "12 tokens" in res.stderr
    # the same prompt through the Python API gives the same text
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import SamplingParams

    e = Engine(EngineConfig(model=str(model), num_blocks=32))
    want = e.generate(["the river"], SamplingParams(max_tokens=12, temperature=0))[0]["text"]
    assert res.stdout.rstrip("\n") == want


def test_generate_reports_user_errors_cleanly(tmp_path):
    res = duet("generate", "--model", str(tmp_path), "--prompt", "x", check=False)
    assert res.returncode == 2
    assert "duet: error:" in res.stderr and "config.json" in res.stderr
    assert "Traceback" not in res.stderr
