"""The layers stay honest (an AST walk over every module's imports).

- the core (vpsd.pipeline) imports no role, no launcher, no report and no model code;
- a role imports no other role's module except the shared pieces, and nothing from vpsd.launch;
- nothing outside vpsd.launch imports vpsd.launch (the launcher sits on top);
- reports read what jobs wrote: they import neither roles nor the launcher;
- integrations (vpsd.integrations: vpsd inside other programs) sit on top of everything: nothing else imports them;
- the benchmarks (vpsd.bench) sit on top beside the launcher: only the `vpsd` command imports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vpsd"


def vpsd_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {n for n in names if n == "vpsd" or n.startswith("vpsd.")}


def modules(subpackage: str) -> list[Path]:
    return sorted((PACKAGE / subpackage).rglob("*.py"))


def layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize("path", modules("pipeline"), ids=lambda p: p.name)
def test_core_imports_only_the_core(path):
    outside = {n for n in vpsd_imports(path) if layer(n) not in ("pipeline",)}
    assert not outside, f"{path.relative_to(PACKAGE)} imports {sorted(outside)}"


@pytest.mark.parametrize("path", [p for sub in ("roles", "models", "decoders", "transport", "video", "reports", "pipeline")
                                  for p in modules(sub)] + [PACKAGE / "tracing.py", PACKAGE / "config.py"],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_nothing_below_the_launcher_imports_it(path):
    assert not {n for n in vpsd_imports(path) if layer(n) == "launch"}, f"{path.relative_to(PACKAGE)} imports vpsd.launch"


@pytest.mark.parametrize("path", modules("reports"), ids=lambda p: p.name)
def test_reports_import_no_role(path):
    assert not {n for n in vpsd_imports(path) if layer(n) == "roles"}


@pytest.mark.parametrize("path", modules("roles"), ids=lambda p: p.name)
def test_roles_do_not_import_each_other(path):
    loops = {"vpsd.roles.target", "vpsd.roles.draft", "vpsd.roles.pruner"}
    own = f"vpsd.roles.{path.stem}"
    assert not (vpsd_imports(path) & loops) - {own}, f"{path.name} imports another role's loop"


def test_only_the_command_imports_the_benchmarks():
    """The benchmarks measure the runtime from outside, as a user runs it (torchrun jobs, or forwards timed alone):
    nothing the runtime runs may depend on them."""
    users = {str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py"))
             if "bench" not in p.relative_to(PACKAGE).parts and any(layer(n) == "bench" for n in _all_imports(p))}
    assert users <= {"launch/cli.py", "launch/entry.py", "launch/launcher.py"}, sorted(users)


def test_nothing_imports_an_integration():
    """An integration's host (lmms-eval...) is an optional install: vpsd must import and run without it."""
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if "integrations" not in p.relative_to(PACKAGE).parts]
    offenders = {str(p.relative_to(PACKAGE)): sorted(n for n in vpsd_imports(p) if layer(n) == "integrations")
                 for p in outside}
    assert not {k: v for k, v in offenders.items() if v}


# The commands that run the oracle as their check: `python -m vpsd.launch.lossless` (a run against `ar`) and
# `vpsd grow` (a grown checkpoint decodes as its source). The benchmarks (vpsd/bench/) may too: `vpsd bench pruning`
# and `trees` decode one item at a time with it, outside any job.
ORACLE_CHECKS = {"launch/lossless.py", "launch/grow.py"}


def test_only_the_checks_import_the_reference_decoders():
    """decoders/ is the oracle the engine is held to (short loops, one item at a time): production code decodes
    with the engine alone, so the oracle stays independent of what it checks."""
    users = {str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py"))
             if not {"decoders", "bench"} & set(p.relative_to(PACKAGE).parts)  # a bench measures from outside
             and any(layer(n) == "decoders" for n in vpsd_imports(p))}
    assert users <= ORACLE_CHECKS, sorted(users - ORACLE_CHECKS)


def _all_imports(path: Path) -> set[str]:
    """Every vpsd module `path` imports, at module level or inside a function (not under TYPE_CHECKING, which
    never runs): a circle closed by a function-local import is a circle all the same."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n.startswith("vpsd.")}


def test_no_module_imports_itself_through_others():
    modules = {".".join(("vpsd",) + p.relative_to(PACKAGE).with_suffix("").parts): p
               for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    graph = {m: {n for n in _all_imports(p) if n in modules and n != m} for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n] if n in path else [m, n]
            if n not in state and (circle := visit(n, path + [n])):
                return circle
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (circle := visit(m, [m])):
            raise AssertionError(" -> ".join(circle))


@pytest.mark.parametrize("path", modules("models"), ids=lambda p: p.name)
def test_models_import_nothing_above_them(path):
    """The adapters sit under the config (config.py reads models/spec.py) and under everything that decodes with
    them: what a config means for a forward is said by the engine or a role, which pass the values down."""
    above = {"config", "engine", "roles", "launch", "decoders", "reports", "api", "integrations"}
    assert not {n for n in vpsd_imports(path) if layer(n) in above}, f"{path.name} imports {sorted(vpsd_imports(path))}"


def test_only_the_command_imports_the_server():
    """`vpsd serve` (vpsd.serve) sits on top beside the launcher, over the Python API and the engine's wiring:
    nothing the runtime runs may depend on it (its FastAPI and uvicorn are an optional extra) but the commands
    that start it (`vpsd serve`, and `./torchrun.sh serve`: the rank entry's leader, the launcher's --help), and it
    imports no role (the roles are the engine's business)."""
    users = {str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py"))
             if "serve" not in p.relative_to(PACKAGE).parts and any(layer(n) == "serve" for n in _all_imports(p))}
    assert users <= {"launch/cli.py", "launch/entry.py", "launch/launcher.py"}, sorted(users)
    below = {str(p.relative_to(PACKAGE)): sorted(n for n in vpsd_imports(p) if layer(n) == "roles")
             for p in modules("serve")}
    assert not {k: v for k, v in below.items() if v}
