"""The README stays true: CI runs exactly its quick-start commands, and the code is ruff-clean."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", quick, flags=re.S)]


def test_ci_runs_exactly_the_readme_commands():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in commands:
        assert command in ci_lines, f"README command not run verbatim by .ci/run: {command}"


def test_readme_install_uses_the_lock_and_the_default_flagfile():
    install = _readme_commands()[0]
    assert "requirements/cpu.lock" in install and "--no-deps" in install
    flagfile = re.search(r"--flagfile=(\S+)", install).group(1)
    assert (ROOT / flagfile).is_file()


def test_lock_pins_every_package_and_has_no_gpu_builds():
    lines = [
        line.strip()
        for line in (ROOT / "requirements" / "cpu.lock").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[A-Za-z0-9_.+\-]+", line) for line in lines), (
        lines
    )
    names = {line.split("==")[0].lower().replace("_", "-") for line in lines}
    assert "tensorflow" not in names and "tensorflow-cpu" in names
    assert not {n for n in names if n.startswith(("nvidia-", "jax-cuda")) or "cuda" in n}


def test_pyproject_pins_match_the_lock():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lock = {}
    for line in (ROOT / "requirements" / "cpu.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.strip().split("==")
            lock[name.lower().replace("_", "-")] = version
    for dep in project["dependencies"] + project["optional-dependencies"]["test"]:
        name, version = dep.split("==")
        assert lock[name.lower().replace("_", "-")] == version, dep


def test_ruff_clean():
    ruff = Path(sys.executable).with_name("ruff")  # installed by the lock
    for args in (["check", "."], ["format", "--check", "."]):
        result = subprocess.run(
            [str(ruff), *args], cwd=ROOT, capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_crosscheck_lock_matches_the_extra():
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    lines = [
        line.strip()
        for line in (ROOT / "requirements" / "crosscheck.lock").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert sorted(lines) == sorted(extra["crosscheck"])
    assert all("==" in line for line in lines)
