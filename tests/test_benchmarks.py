"""The benchmarks in benchmarks/ live outside the runtime package and run only on a GPU machine (bench_cpu:
with torch and transformers); here they are at least imported (no CuPy needed at import time), so that a moved
or renamed runtime module breaks this suite rather than the next GPU session.

Importing is not enough: the GPU tools call the kernels inside functions that only run on a GPU, so a kernel
method or keyword argument removed from `Kernels` (issue 35 removed `gemv_stream`, `load_extra`, `config=`,
`threads=`, `only=`, ...) would go unnoticed until then.  The tests below read each tool's source (AST) and
check every call on a `Kernels` object (and on the CUDA engine, and every name taken from a metrale_cli module)
against today's API: the method exists and the call binds to its signature (inspect.signature).  No CuPy is
needed: nothing is constructed."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from pathlib import Path

import pytest

from metrale_cli.backends.cuda.engine import CudaEngine
from metrale_cli.backends.cuda.kernels import Kernels

REPO = Path(__file__).resolve().parent.parent

BENCHMARKS = ("bench_kernels", "bench_prefill", "bench_attention", "bench_moe_layer",
              "profile_kernels", "bench_cpu", "bench_widen", "activation_quant_kl")
# The tools that launch metrale's CUDA kernels (or its CUDA engine), checked against the API below.
GPU_TOOLS = ("bench_kernels", "bench_prefill", "bench_attention", "bench_moe_layer", "profile_kernels")
SHELL_TOOLS = ("scripts/gpu_check.sh",)
# Names the tools give a Kernels object where it arrives as a parameter (a section function's `K`); names
# assigned from a `...Kernels()` call are found in the source.
KERNEL_PARAMS = frozenset({"K", "k", "kern"})


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_imports(name):
    mod = importlib.import_module(f"benchmarks.{name}")
    assert callable(mod.main)


def _instance_attributes(cls: type) -> set[str]:
    """Attributes the classes of cls's MRO assign on `self` (instance data such as Kernels.pdl, num_sms)."""
    names: set[str] = set()
    for c in cls.__mro__:
        if c is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(c)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        names.add(sub.attr)
    return names


def _signature(cls: type, name: str) -> inspect.Signature | None:
    """The signature of method `name` as called on an instance (self dropped); None if it is not a method."""
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, staticmethod):
        return inspect.signature(raw.__func__)
    if isinstance(raw, classmethod):
        params = list(inspect.signature(raw.__func__).parameters.values())[1:]
        return inspect.Signature(params)
    if inspect.isfunction(raw):
        params = list(inspect.signature(raw).parameters.values())[1:]
        return inspect.Signature(params)
    return None


def _receivers(tree: ast.AST) -> dict[str, type]:
    """Names bound to a Kernels object or a CUDA engine in this source: `X = ...Kernels()`,
    `X = ...build_engine(..., "cuda", ...)`, and the conventional parameter names of KERNEL_PARAMS."""
    found: dict[str, type] = {n: Kernels for n in KERNEL_PARAMS}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        func = node.value.func
        fname = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        cls = None
        if fname == "Kernels":
            cls = Kernels
        elif fname == "build_engine" and any(isinstance(a, ast.Constant) and a.value == "cuda"
                                             for a in node.value.args + [k.value for k in node.value.keywords]):
            cls = CudaEngine
        if cls is not None:
            for t in node.targets:
                if isinstance(t, ast.Name):
                    found[t.id] = cls
    return found


def _project_modules(tree: ast.AST) -> tuple[dict[str, object], list[str]]:
    """(alias -> module for every metrale_cli / benchmarks module the source binds to a name, problems with its
    `from metrale_cli... import NAME` lines: a name the module no longer has)."""
    aliases: dict[str, object] = {}
    problems: list[str] = []
    ours = ("metrale_cli", "benchmarks")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ours and a.asname:
                    aliases[a.asname] = importlib.import_module(a.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in ours:
            mod = importlib.import_module(node.module)
            for a in node.names:
                bound = a.asname or a.name
                if hasattr(mod, a.name):
                    obj = getattr(mod, a.name)
                else:
                    try:
                        obj = importlib.import_module(f"{node.module}.{a.name}")
                    except ImportError:
                        problems.append(f"line {node.lineno}: `from {node.module} import {a.name}`: no such name")
                        continue
                if inspect.ismodule(obj):
                    aliases[bound] = obj
    return aliases, problems


def api_problems(source: str) -> list[str]:
    """What in `source` does not match today's API: attributes read or methods called on a Kernels object or a
    CUDA engine that the class does not have, calls that do not bind to the method's signature (unknown keyword,
    too many positional arguments, a required one missing), names imported from or read off a metrale_cli module
    that it does not have."""
    tree = ast.parse(source)
    receivers = _receivers(tree)
    instance_attrs = {cls: _instance_attributes(cls) for cls in set(receivers.values())}
    aliases, problems = _project_modules(tree)
    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
            continue
        who, attr = node.value.id, node.attr
        if who in aliases:
            if not hasattr(aliases[who], attr):
                problems.append(f"line {node.lineno}: {who}.{attr}: {aliases[who].__name__} has no {attr!r}")
            continue
        cls = receivers.get(who)
        if cls is None:
            continue
        if not hasattr(cls, attr) and attr not in instance_attrs[cls]:
            problems.append(f"line {node.lineno}: {who}.{attr}: {cls.__name__} has no {attr!r}")
            continue
        call = calls.get(id(node))
        if call is None or not hasattr(cls, attr):
            continue
        sig = _signature(cls, attr)
        if sig is None:
            continue
        starred = any(isinstance(a, ast.Starred) for a in call.args)
        kw_splat = any(k.arg is None for k in call.keywords)
        kwargs = {k.arg: None for k in call.keywords if k.arg is not None}
        try:
            if starred:
                sig.bind_partial(**kwargs)
            elif kw_splat:
                sig.bind_partial(*([None] * len(call.args)), **kwargs)
            else:
                sig.bind(*([None] * len(call.args)), **kwargs)
        except TypeError as exc:
            problems.append(f"line {node.lineno}: {who}.{attr}(...): {exc} (signature {attr}{sig})")
    return problems


def _python_snippets(shell: str) -> list[str]:
    """The `python3 -c "..."` programs of a shell script (backslash-newline continuations joined, as bash does
    inside double quotes)."""
    out = []
    for m in re.finditer(r'python3?\s+-c\s+"((?:[^"\\]|\\.)*)"', shell, re.S):
        body = m.group(1).replace("\\\n", "").replace('\\"', '"').replace("\\$", "$").replace("\\\\", "\\")
        out.append(body)
    return out


@pytest.mark.parametrize("name", GPU_TOOLS)
def test_tool_calls_match_kernel_api(name):
    source = (REPO / "benchmarks" / f"{name}.py").read_text()
    problems = api_problems(source)
    assert not problems, f"benchmarks/{name}.py calls what the CUDA backend no longer has:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("path", SHELL_TOOLS)
def test_shell_tool_snippets_match_kernel_api(path):
    snippets = _python_snippets((REPO / path).read_text())
    assert snippets, f"{path}: no python3 -c programs found (the pattern of this test is out of date)"
    problems = []
    for i, body in enumerate(snippets):
        problems += [f"snippet {i + 1}, {p}" for p in api_problems(body)]
    assert not problems, f"{path} calls what the CUDA backend no longer has:\n  " + "\n  ".join(problems)


def test_api_check_catches_removed_things():
    """The check itself: it flags a removed method, a removed keyword and a removed module name, and passes
    what exists."""
    bad = textwrap.dedent("""
        from metrale_cli.backends.cuda.kernels import GEMV_TC_EXTRA, Kernels
        def f(K, x, w, out):
            K.gemv_stream(x, w, out)
            K.gemv(x, w, out, config=(1, 8))
            K.attention_decode(x, w, w, x, out, 1.0, only="split")
            k = Kernels()
            k.load_extra()
    """)
    found = "\n".join(api_problems(bad))
    for what in ("GEMV_TC_EXTRA", "gemv_stream", "config", "only", "load_extra"):
        assert what in found, (what, found)
    good = textwrap.dedent("""
        from metrale_cli.backends.cuda.kernels import GEMV_DEFAULT, Kernels
        def f(K, x, w, out, kw):
            K.gemv(x, w, out, accumulate=True, stream=None)
            K.gemv_ring(x, w, out, chunks=K.ring_chunks(8, 8, False), stream=None, **kw)
            K.pdl = K.pdl_supported and K.num_sms > 0
    """)
    assert api_problems(good) == []


def _usage_flags(doc: str) -> set[str]:
    """The options the usage lines of a tool's docstring show (after `python3 -m benchmarks.X` or
    `python3 benchmarks/X.py`, comments dropped)."""
    flags: set[str] = set()
    for line in doc.splitlines():
        m = re.search(r"python3\s+(?:-m\s+benchmarks\.\w+|benchmarks/\w+\.py)(.*)$", line)
        if m:
            flags |= set(re.findall(r"--[a-z][a-z0-9-]*", m.group(1).split("#")[0]))
    return flags


@pytest.mark.parametrize("name", GPU_TOOLS)
def test_tool_usage_docstring_is_true(name):
    """Every option a tool's usage lines show is one the tool reads, and every option it tests sys.argv for is
    shown there."""
    source = (REPO / "benchmarks" / f"{name}.py").read_text()
    tree = ast.parse(source)
    doc = ast.get_docstring(tree) or ""
    literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    argv_flags = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant)
                and str(node.left.value).startswith("--") and "sys.argv" in ast.unparse(node.comparators[0])):
            argv_flags.add(node.left.value)
    shown = _usage_flags(doc)
    assert not shown - literals, f"{name}: the usage shows options the tool does not read: {sorted(shown - literals)}"
    assert not argv_flags - shown, f"{name}: options missing from the usage: {sorted(argv_flags - shown)}"


def test_moe_tool_paths_exist():
    from benchmarks import bench_moe_layer
    from metrale_cli.backends.cuda.paths import ROWS_PATHS

    assert set(bench_moe_layer.PATHS) <= set(ROWS_PATHS)


def test_activation_quant_kl_runs_on_the_cpu(tmp_path):
    """benchmarks/activation_quant_kl.py on a shrunken qwen3-8b-fp8 config (its block FP8, 2 layers): the two modes'
    logits differ (the emulation is applied) and the figures are written."""
    import json
    import subprocess
    import sys

    cfg = json.loads((REPO / "configs" / "qwen3-8b-fp8.json").read_text())
    cfg.update(vocab_size=500, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "kl.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "activation_quant_kl.py"), "--preset",
                        str(tmp_path / "config.json"), "--device", "cpu", "--tokens", "12", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    fig = json.loads(out.read_text())
    assert fig["tokens"] == 12 and 0 < fig["kl_mean"] <= fig["kl_max"] and 0 <= fig["top1_agree"] <= 1
    assert "mean KL" in r.stdout


def test_the_widening_benchmark_compiles_for_sm90(tmp_path):
    """benchmarks/bench_widen.py's CUDA source with every mode's instance (nvcc -ptx), so a GPU session does not
    spend its time on a compile error."""
    import shutil
    import subprocess

    from benchmarks.bench_widen import MODES, source

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    src = tmp_path / "widen.cu"
    src.write_text(source() + "\nvoid* const inst[] = {" + ", ".join(f"(void*)&gemv1<{m}>" for m in MODES.values())
                   + "};\n")
    r = subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "-ptx", "-o", str(tmp_path / "w.ptx"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "w.ptx").read_text().count(".entry") == len(MODES) + 1  # and widen_all
