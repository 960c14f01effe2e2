"""`metrale bench` on the CPU engine with the tiny preset: every figure is measured and reported."""

from __future__ import annotations

import json

import pytest

from metrale_cli.bench import preset_path, run_bench
from metrale_cli.cli import main
from metrale_cli.errors import UsageError


def test_run_bench_cpu_measures_every_figure():
    r = run_bench("tiny-llama", device="cpu", context=32, ks=(1, 4), prefill_tokens=32, repeats=3)
    names = [f.name for f in r.figures]
    assert names[:4] == ["read bandwidth", "decode floor", "GEMM rate", "decode step"]
    assert {"verify k=1", "verify k=4", "prefill 32"} <= set(names)
    for f in r.figures:
        assert f.value > 0, f
    step = r.get("decode step")
    assert step.ratio == pytest.approx(step.value / r.get("decode floor").value)
    assert r.get("verify k=4").met is not None  # k=4 is held to its target


def test_bench_cli_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as e:
        main(["bench", "--device", "cpu", "--preset", "tiny-llama", "--context", "16", "--prefill", "16",
              "--repeats", "2", "--ks", "2", "--format", "json", "--json", str(out)])
    assert e.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["preset"] == "tiny-llama" and printed["device"] == "cpu"


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(UsageError, match="llama-3.1-8b"):
        preset_path("gpt-5")


@pytest.mark.parametrize("args, code", [(["--ks", "a,b"], 2), (["--context", "0"], 2), (["--prefill", "0"], 2),
                                        (["--repeats=-1"], 2), (["--ks", "0"], 2)])
def test_bench_bad_options(args, code, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--device", "cpu", *args])
    assert e.value.code == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
