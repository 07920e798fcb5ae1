"""The package's architecture holds: sub-packages import only those below them, no module reaches
into another's private names, every module has a row in the README's Layout table, and the
curated API (`kvgraft_jax.__all__`) is what the README's Python section uses."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvgraft_jax"

# Which sub-packages each may import (besides itself). `main.py` (the entry point) may import all.
ALLOWED = {
    "core": set(),
    "store": {"core"},
    "exact": {"core", "store"},
    "library": {"core", "store", "exact", "run"},  # run: only the settings' defaults
    "run": {"core"},
    "bench": {"core", "store", "exact", "run"},
    "cli": {"core", "store", "exact", "library", "run", "bench"},
}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imported_packages(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "kvgraft_jax" and len(parts) > 1 and parts[1] in ALLOWED:
                out.add(parts[1])
    return out


def test_every_module_lives_in_a_sub_package_with_a_known_layer():
    top = {p.name for p in PACKAGE.glob("*.py")}
    assert top == {"__init__.py", "main.py"}, top
    assert {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} == set(ALLOWED)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_sub_package_imports_one_above_it(package):
    for path in sorted((PACKAGE / package).glob("*.py")):
        used = _imported_packages(ast.parse(path.read_text())) - {package}
        assert used <= ALLOWED[package], (
            f"{path.relative_to(ROOT)} imports {used - ALLOWED[package]}"
        )


def test_no_private_name_is_used_across_modules():
    found = []
    for path in [*_modules(), *sorted((ROOT / "tests").glob("*.py"))]:
        tree = ast.parse(path.read_text())
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvgraft_jax"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{path.name}:{node.lineno} imports {a.name}")
                    aliases.add(a.asname or a.name)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not found, found


def test_every_module_has_a_row_in_the_readme_layout():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Layout") :]
    for path in _modules():
        rel = path.relative_to(PACKAGE)
        if rel.name == "__init__.py" and rel.parent != Path("."):
            assert f"`kvgraft_jax/{rel.parent}/`" in table, f"no row for {rel.parent}/"
            continue
        shown = f"`kvgraft_jax/{rel}`" if rel.parent == Path(".") else f"`{rel}`"
        assert shown in table, f"README Layout has no row for {shown}"


def test_the_readme_python_section_uses_only_the_curated_api():
    import kvgraft_jax

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Python API") : readme.index("## Layout")]
    code = "\n".join(re.findall(r"```python\n(.*?)```", section, re.S))
    used = set(re.findall(r"\bkv\.([A-Za-z_]\w*)", code))
    assert used, "the Python section shows no kv.* call"
    assert used <= set(kvgraft_jax.__all__), used - set(kvgraft_jax.__all__)
    for name in kvgraft_jax.__all__:
        assert getattr(kvgraft_jax, name) is not None


def test_importing_the_package_does_not_start_jax():
    """The CLI sets XLA flags before JAX starts; `import kvgraft_jax` must leave that possible."""
    probe = "import sys, kvgraft_jax; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_unknown_fault_point_is_an_error_not_a_silent_no_op():
    from kvgraft_jax.core import faults

    with pytest.raises(ValueError, match="unknown fault point"):
        faults.pause_point("after_stat")
    faults.pause_point("after_state")  # known, not armed: returns at once


def _examples(path: Path) -> list[tuple[str, str]]:
    """(scope, code) for every indented code example in a module's docstrings."""
    tree = ast.parse(path.read_text())
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef))]
    out = []
    for node in nodes:
        doc = ast.get_docstring(node) or ""
        block = [line[4:] for line in doc.splitlines() if line.startswith("    ")]
        code = "\n".join(line.split("  #")[0] for line in block)
        try:
            ast.parse(code)
        except SyntaxError:
            continue  # a directory listing or a shell line, not Python
        if "(" in code:
            out.append((f"{path.relative_to(ROOT)}:{getattr(node, 'name', 'module')}", code))
    return out


def _module_named(name: str):
    import importlib

    import kvgraft_jax

    if name == "kv":
        return kvgraft_jax
    name = name.removesuffix("_lib")
    found = [p for p in PACKAGE.rglob(f"{name}.py")]
    assert len(found) == 1, f"no single kvgraft_jax module named {name}: {found}"
    rel = found[0].relative_to(ROOT).with_suffix("")
    return importlib.import_module(".".join(rel.parts))


def test_docstring_examples_call_what_exists_with_arguments_it_takes():
    """Every `module.function(...)` and `obj.method(...)` (obj bound by `x = module.Class(...)`)
    in a docstring example names something real and passes arguments its signature accepts."""
    import inspect

    checked = 0
    for path in _modules():
        for scope, code in _examples(path):
            classes = {}
            for stmt in ast.parse(code).body:
                for call in [n for n in ast.walk(stmt) if isinstance(n, ast.Call)]:
                    func = call.func
                    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
                        continue
                    owner = func.value.id
                    if owner in classes:
                        target = getattr(classes[owner], func.attr, None)
                        bound_self = (None,)
                    elif owner == "kv" or any(PACKAGE.rglob(f"{owner.removesuffix('_lib')}.py")):
                        target = getattr(_module_named(owner), func.attr, None)
                        bound_self = ()
                    else:
                        continue
                    assert target is not None, f"{scope}: {owner}.{func.attr} does not exist"
                    args = [None] * len(call.args)
                    kwargs = {k.arg: None for k in call.keywords if k.arg}
                    try:
                        inspect.signature(target).bind(*bound_self, *args, **kwargs)
                    except TypeError as e:
                        raise AssertionError(f"{scope}: {owner}.{func.attr}(...): {e}") from None
                    checked += 1
                if (
                    isinstance(stmt, ast.Assign)
                    and isinstance(stmt.value, ast.Call)
                    and isinstance(stmt.value.func, ast.Attribute)
                    and isinstance(stmt.value.func.value, ast.Name)
                ):
                    made = getattr(
                        _module_named(stmt.value.func.value.id), stmt.value.func.attr, None
                    )
                    if inspect.isclass(made):
                        classes[stmt.targets[0].id] = made
    assert checked >= 15, checked  # the examples exist and were read
