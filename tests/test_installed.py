"""metrale works when installed, away from the source tree (issue 11, item 1).

The other CLI tests run in the repository root, where configs/ and the embedded models sit next to the
package; they would pass even if `pip install .` shipped neither. Here the repository's files are copied
to a temp directory, installed (built as a wheel by pip) into a fresh venv, and the `metrale` script is
run from another empty temp directory.

The venv borrows pip, setuptools and the dependencies of the interpreter running the tests (a .pth
line naming its site-packages), so pip finds the requirements already satisfied and the test needs no
network; metrale itself comes only from the fresh install (checked below). One venv serves every test
of this module.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                     ".pytest_cache", ".hypothesis", "out", ".whl")


def _copy_sources(dest: Path) -> Path:
    """The repository as a fresh clone would have it: git's tracked and not-ignored files when git can
    tell, else the tree minus build products and caches."""
    try:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(REPO, dest, ignore=COPY_IGNORE)
        return dest
    for name in filter(None, listed.decode().split("\0")):
        src = REPO / name
        if src.is_file():  # a tracked file deleted in the work tree is not part of it
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _can_build_here() -> bool:
    """Whether this interpreter's setuptools can build the wheel (>= 70.1 builds wheels by itself, older
    ones need the wheel package). Then pip builds without isolation and needs no index; otherwise (a venv
    made by Python >= 3.12 has no setuptools) pip builds in isolation and fetches setuptools."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    from importlib.metadata import version

    major, minor = (int(x) for x in version("setuptools").split(".")[:2])
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("installed")
    src = _copy_sources(root / "src")
    venv_dir = root / "venv"
    # --without-pip: pip, like setuptools and the dependencies, comes from the running interpreter (a
    # bundled setuptools in the venv would shadow a newer one), and ensurepip's seconds are saved.
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv_dir)])
    assert made.returncode == 0, made.stderr
    bindir = venv_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / "python"
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    assert site.returncode == 0, site.stderr
    # The dependencies of the running interpreter, appended to the new venv's sys.path.
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    Path(site.stdout.strip(), "_metrale_test_deps.pth").write_text("\n".join(sorted(ours)) + "\n")
    flags = ["--no-build-isolation"] if _can_build_here() else []
    pip = _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *flags, str(src)])
    assert pip.returncode == 0, pip.stdout + pip.stderr
    cwd = root / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}", METRALE_DISABLE_CUDA="1", COLUMNS="120")
    return SimpleNamespace(root=root, venv=venv_dir, python=python, metrale=bindir / "metrale", cwd=cwd, env=env)


def metrale(inst: SimpleNamespace, *args: str) -> subprocess.CompletedProcess:
    return _run([str(inst.metrale), *args], cwd=inst.cwd, env=inst.env)


@pytest.mark.slow
def test_the_installed_package_is_the_one_run(installed):
    """metrale_cli, its embedded model and the presets all come from the venv, not from the source tree."""
    probe = _run([str(installed.python), "-c",
                  "import metrale_cli, metrale_cli.model as m, metrale_cli.bench as b; "
                  "print(metrale_cli.__file__); print(m.DEFAULT_MODEL_DIR); print(b.presets_dir())"],
                 cwd=installed.cwd, env=installed.env)
    assert probe.returncode == 0, probe.stderr
    package, model_dir, presets = (Path(line) for line in probe.stdout.split())
    for path in (package, model_dir, presets):
        assert path.is_relative_to(installed.venv), path
    assert (model_dir / "model.safetensors").is_file() and (model_dir.parent / "default-draft" / "config.json").is_file()
    assert sorted(p.name for p in presets.glob("*.json")) == sorted(p.name for p in (REPO / "configs").glob("*.json"))


@pytest.mark.slow
def test_installed_help(installed):
    r = metrale(installed, "--help")
    assert r.returncode == 0, r.stderr
    for word in ("decode", "verify", "forward", "inspect", "bench", "Exit codes"):
        assert word in r.stdout


@pytest.mark.slow
def test_installed_decode_on_the_embedded_model(installed):
    r = metrale(installed, "decode", "--steps", "2", "--format", "plain")
    assert r.returncode == 0, r.stderr
    assert "model: default" in r.stdout and "device: cpu" in r.stdout
    assert "stopped: after 2 tokens (--steps)" in r.stdout


@pytest.mark.slow
def test_installed_bench_finds_its_presets(installed):
    r = metrale(installed, "bench", "--device", "cpu", "--repeats", "1", "--format", "plain")
    assert r.returncode == 0, r.stderr
    assert "tiny-llama on cpu" in r.stdout
    for figure in ("read bandwidth", "decode step", "verify k=4", "prefill 2048"):
        assert figure in r.stdout


def test_every_package_directory_is_listed_in_pyproject():
    """pyproject.toml lists the packages (so configs/ can be mapped into one): a new subpackage must be
    added there, or the wheel would silently lack it."""
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "metrale_cli").rglob("__init__.py")}
    assert on_disk <= listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert "metrale_cli.assets.presets" in listed


def test_presets_come_from_configs_in_a_source_checkout():
    from metrale_cli.bench import preset_path, presets_dir

    assert presets_dir() == REPO / "configs"
    assert preset_path("tiny-llama") == REPO / "configs" / "tiny-llama.json"
