"""--model given a Hugging Face repo id (issue 11, item 17): the error says how to get a local copy."""

from __future__ import annotations

import pytest

from metrale_cli.model import hub_hint


@pytest.mark.parametrize("command", [["decode", "--model"], ["verify", "--draft-model"], ["inspect"]])
def test_a_repo_id_gets_the_download_hint(run_cli, command):
    r = run_cli(*command, "HuggingFaceTB/SmolLM2-135M")
    assert r.exit_code == 3
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(
        "metrale: checkpoint error: HuggingFaceTB/SmolLM2-135M: no such file or directory (")
    assert "metrale reads local checkpoint directories only" in r.stderr
    assert "`hf download HuggingFaceTB/SmolLM2-135M --local-dir DIR`" in r.stderr
    assert "`huggingface-cli download HuggingFaceTB/SmolLM2-135M --local-dir DIR`" in r.stderr


@pytest.mark.parametrize("path", ["Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B", "org_1/model.v2"])
def test_repo_id_shapes(path):
    assert f"hf download {path} --local-dir DIR" in hub_hint(path)


@pytest.mark.parametrize("path", [None, "nowhere", "./org/model", "../org/model", "/abs/model", "a/b/c",
                                  "org/", "/model", "-org/model", "org/.model", "org model/x"])
def test_other_paths_get_no_hint(path):
    assert hub_hint(path) == ""


def test_an_existing_path_of_that_shape_is_read_as_a_path(run_cli):
    r = run_cli("inspect", "tests/fixtures")  # exists (run_cli runs in the repository root), no checkpoint
    assert r.exit_code != 0 and "config.json" in r.stderr and "hf download" not in r.stderr
