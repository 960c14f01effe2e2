"""Make tests/fixtures/llamacpp/: what llama.cpp's own tools print and save for metrale's embedded default
model, for `metrale compare --from llamacpp` and its tests.

    PYTHONPATH=. python scripts/make_llamacpp_fixtures.py LLAMA_CPP_SOURCE_DIR [--prompt "The for statement"]
        [--version "what to record as the llama.cpp build"]

LLAMA_CPP_SOURCE_DIR is a llama.cpp checkout built for the CPU (the one vendored in the llama-cpp-python
sdist works: `pip download llama-cpp-python --no-binary :all: --no-deps`, unpack, then in
vendor/llama.cpp `cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target llama-eval-callback
llama-debug -j 2`). The script
  1. converts the default model to an F32 GGUF with the checkout's convert_hf_to_gguf.py (needs torch,
     numpy, sentencepiece importable, and the checkout's gguf-py). The model's tokenizer is GPT-2's
     byte-level BPE, which the converter does not recognise by its hash, so it is told "gpt-2"; a
     tokenizer_config.json beside a copy of the model says the BOS token is added, as the model's own
     tokenizer does (tokenizer.json's post-processor);
  2. runs `llama-eval-callback` on the prompt in fp32 (F32 KV cache, flash attention off) into
     eval-callback.txt: every graph node's name, op, shape, edge values and sum (stdout and stderr in one
     file, rerun until the printout is whole: llama.cpp's logger can lose its tail at exit);
  3. runs `llama-debug --save-logits` into debug/ (the last position's logits as raw float32, the token
     ids as int32);
  4. writes VERSION.txt: the llama.cpp commit or sdist version and the commands run.
Outputs are small (a few hundred KB); the GGUF itself is not kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from metrale_cli.readers.llamacpp import read_eval_callback

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "metrale_cli" / "assets" / "models" / "default"
OUT = ROOT / "tests" / "fixtures" / "llamacpp"

CONVERT = """
import sys
sys.path[:0] = [{src!r}, {gguf!r}]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import runpy
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outtype", "f32", "--outfile", {out!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("--prompt", default="The for statement")
    ap.add_argument("--version", default="", help="what to record as the llama.cpp version (default: git or dir)")
    args = ap.parse_args()
    src = args.source.resolve()
    bins = src / "build" / "bin"
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "default"
        shutil.copytree(MODEL, model)
        (model / "tokenizer_config.json").write_text(json.dumps(
            {"add_bos_token": True, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}))
        gguf = Path(tmp) / "default-f32.gguf"
        code = CONVERT.format(src=str(src), gguf=str(src / "gguf-py"), model=str(model), out=str(gguf),
                              script=str(src / "convert_hf_to_gguf.py"))
        subprocess.run([sys.executable, "-c", code], check=True)
        # fp32 like metrale's: an F32 KV cache (llama.cpp's default is F16), and flash attention off (on the
        # CPU it rounds through F16: the attention outputs then differ from fp32 by ~2e-4 relative)
        common = ["-m", str(gguf), "-p", args.prompt, "-t", "2", "-c", "64", "--temp", "0", "-ctk", "f32",
                  "-ctv", "f32", "-fa", "off"]
        env = dict(os.environ)
        # stdout and stderr into one file, as a shell's `> out.txt 2>&1` does: llama.cpp's logger thread can
        # drop its last lines at exit (its log singleton is never flushed), which it did here with two pipes;
        # and as it can still lose the tail, it is run until the printout reaches the logits node
        for _ in range(20):
            subprocess.run(["sh", "-c", 'exec "$0" "$@" > "$OUT_FILE" 2>&1', str(bins / "llama-eval-callback"),
                            *common], env=dict(env, OUT_FILE=str(OUT / "eval-callback.txt")), check=True)
            cb = read_eval_callback(OUT / "eval-callback.txt", "llama-eval-callback")
            if not cb.notes and cb.nodes[-1].name == "result_output":
                break
        else:
            raise SystemExit("llama-eval-callback's printout lost its last nodes 20 times")
        debug = OUT / "debug"
        shutil.rmtree(debug, ignore_errors=True)
        subprocess.run([str(bins / "llama-debug"), *common, "--save-logits", "--logits-output-dir", str(debug)],
                       capture_output=True, text=True, env=env, check=True)
        for f in debug.glob("*.txt"):
            if not f.name.endswith("-prompt.txt"):
                f.unlink()  # the logits again as text: the .bin holds them exactly
    version = args.version or _git(src)
    (OUT / "VERSION.txt").write_text(
        f"llama.cpp: {version}\nmodel: metrale_cli/assets/models/default, converted to F32 GGUF\n"
        f"prompt: {args.prompt}\n"
        f"commands: llama-eval-callback {shlex.join(common[2:])}; llama-debug (the same) --save-logits\n"
        f"made by: python scripts/make_llamacpp_fixtures.py\n")
    print(f"{OUT}: eval-callback.txt, debug/, VERSION.txt ({version})")


def _git(src: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(src), "describe", "--always", "--tags"], capture_output=True,
                             text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return src.name


if __name__ == "__main__":
    main()
