"""Every benchmark script (benchmarks/scripts/*.py) still runs against the package as it is now, on the CPU:

- it imports (each `from nibble... import` resolves) and ``--help`` prints its usage without doing any work;
- every global a function of it reads is defined (pyflakes' undefined-name check, without pyflakes);
- every attribute it reads or sets on a nibble module exists (a renamed function, a removed knob such
  as a module constant that a script sets before a run), one it sets is still read by that module (else
  an A/B of two settings compares one with itself), every call of a nibble function or class takes
  the arguments given (a removed or renamed keyword: ``w4a4_matmul_triton(w_int8=...)``,
  ``gptq_quantize_model(true_sequential=...)``), and every ``torch.ops.nibble`` op it calls exists
  and takes that many arguments.

The scripts run in this process (runpy, torch imported once), not one interpreter each: the whole file
takes seconds. A script must keep its work under ``if __name__ == "__main__":`` and parse its arguments
before touching a GPU.
"""
from __future__ import annotations

import ast
import builtins
import functools
import inspect
import runpy
import symtable
import sys
import types
from pathlib import Path

import pytest
import torch

SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "scripts"
SCRIPTS = sorted(SCRIPTS_DIR.glob("*.py"))
MODULE_NAMES = {"__file__", "__name__", "__doc__", "__spec__", "__loader__", "__package__", "__builtins__",
                "__cached__"}


def test_the_scripts_are_found():
    assert len(SCRIPTS) > 50, SCRIPTS_DIR


class _Isolated:
    """sys.path, sys.argv and the scripts' own modules (one script imports another's helpers) as they were."""

    def __init__(self, argv):
        self.argv = argv

    def __enter__(self):
        self.path, self.old_argv, self.modules = list(sys.path), sys.argv, set(sys.modules)
        sys.argv = self.argv
        # as `PYTHONPATH=. python benchmarks/scripts/x.py` has it: the script's folder first, then the repository
        sys.path[:0] = [str(SCRIPTS_DIR), str(SCRIPTS_DIR.parents[1])]
        return self

    def __exit__(self, *exc):
        sys.path[:], sys.argv = self.path, self.old_argv
        for name in set(sys.modules) - self.modules:
            if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(SCRIPTS_DIR)):
                del sys.modules[name]


@functools.lru_cache(maxsize=None)
def _namespace(path: Path) -> dict:
    """The script's globals after running it as a module (not as __main__: nothing of its work runs)."""
    with _Isolated([str(path)]):
        return runpy.run_path(str(path), run_name="benchmark_script")


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _ids(paths):
    return [p.name for p in paths]


@pytest.mark.parametrize("path", SCRIPTS, ids=_ids(SCRIPTS))
def test_help(path, capsys):
    with _Isolated([str(path), "--help"]):
        with pytest.raises(SystemExit) as exit_:
            runpy.run_path(str(path), run_name="__main__")
    assert exit_.value.code in (0, None), capsys.readouterr()
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("path", SCRIPTS, ids=_ids(SCRIPTS))
def test_globals_are_defined(path):
    top = symtable.symtable(path.read_text(), str(path), "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    missing = set()

    def walk(table):
        for child in table.get_children():
            for s in child.get_symbols():
                if (s.is_global() and s.is_referenced() and s.get_name() not in bound
                        and not hasattr(builtins, s.get_name()) and s.get_name() not in MODULE_NAMES):
                    missing.add(f"{s.get_name()} (in {child.get_name()}, line {child.get_lineno()})")
            walk(child)
    walk(top)
    assert not missing, f"{path.name}: undefined globals {sorted(missing)}"


def _locally_bound(tree: ast.Module) -> set:
    """Names bound anywhere but at the module's top level (parameters, local assignments, loop and
    comprehension variables, nested imports): a global of that name is not checked through them."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            names.update(x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x)
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                    names.add(sub.id)
                elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names.update((al.asname or al.name).split(".")[0] for al in sub.names)
                elif isinstance(sub, ast.ExceptHandler) and sub.name:
                    names.add(sub.name)
        elif isinstance(node, ast.comprehension):
            names.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
    return names


@functools.lru_cache(maxsize=None)
def _globals_read(module_file: str) -> frozenset:
    """Names a module reads as bare names (its globals, looked up at each call): the knobs and functions a
    script can set on it to change what it runs."""
    tree = ast.parse(Path(module_file).read_text())
    return frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))


def _chain(node):
    """``a.b.c`` as ["a", "b", "c"]; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def _is_nibble(obj) -> bool:
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    return isinstance(name, str) and (name == "nibble" or name.startswith("nibble."))


def _resolve(chain, ns, problems, line):
    """The object ``chain`` names in the script's globals ``ns`` while it goes through nibble modules
    (an attribute missing from one is a problem); None where it leaves them."""
    if chain is None or chain[0] not in ns:
        return None
    obj = ns[chain[0]]
    if chain[:3] == ["torch", "ops", "nibble"] and len(chain) >= 4:
        if not hasattr(torch.ops.nibble, chain[3]):
            problems.append(f"line {line}: torch.ops.nibble.{chain[3]} does not exist")
            return None
        return getattr(torch.ops.nibble, chain[3])
    for i, attr in enumerate(chain[1:], 1):
        if not (isinstance(obj, types.ModuleType) and _is_nibble(obj)):
            return None
        if not hasattr(obj, attr):
            problems.append(f"line {line}: {'.'.join(chain[:i + 1])} does not exist")
            return None
        obj = getattr(obj, attr)
    return obj


def _check_call(node: ast.Call, target, problems, launch: bool = False):
    """``launch``: ``target[grid](...)``, a Triton kernel's launch, whose keywords may also be launch options."""
    line = node.lineno
    starred = any(isinstance(a, ast.Starred) for a in node.args)
    splat = any(k.arg is None for k in node.keywords)
    names = [k.arg for k in node.keywords if k.arg is not None]
    jit = getattr(target, "fn", None) if type(target).__name__ == "JITFunction" else None
    if launch and jit is None:  # an autotuned kernel takes some arguments from its configs
        return
    if isinstance(target, torch._ops.OpOverloadPacket):
        schema = target.default._schema
        if not starred and not splat:
            n = len(node.args) + len(names)
            required = sum(1 for a in schema.arguments if not a.has_default_value() and not a.kwarg_only)
            if not required <= n <= len(schema.arguments):
                problems.append(f"line {line}: {schema.name} takes {required}..{len(schema.arguments)} arguments, "
                                f"given {n}")
        unknown = set(names) - {a.name for a in schema.arguments}
        if unknown:
            problems.append(f"line {line}: {schema.name} has no argument {sorted(unknown)}")
        return
    if not _is_nibble(target) or not callable(target):
        return
    try:
        sig = inspect.signature(jit or target)
    except (TypeError, ValueError):
        return
    params = sig.parameters
    if launch:  # num_warps, num_stages, launch_pdl, ...
        names = [k for k in names if k in params]
    if not starred and not splat:
        try:
            sig.bind(*[None] * len(node.args), **{k: None for k in names})
        except TypeError as e:
            problems.append(f"line {line}: {getattr(target, '__qualname__', target)}{sig}: {e}")
        return
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = [k for k in names if k not in params or params[k].kind is inspect.Parameter.POSITIONAL_ONLY]
        if unknown:
            problems.append(f"line {line}: {getattr(target, '__qualname__', target)} has no argument {unknown}")


@pytest.mark.parametrize("path", SCRIPTS, ids=_ids(SCRIPTS))
def test_package_api_in_use_exists(path):
    ns, tree = _namespace(path), _tree(path)
    local = _locally_bound(tree)
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] not in local:
                _resolve(chain, ns, problems, node.lineno)
                owner = _resolve(chain[:-1], ns, [], node.lineno) if len(chain) > 1 else None
                if (isinstance(node.ctx, ast.Store) and isinstance(owner, types.ModuleType) and _is_nibble(owner)
                        and hasattr(owner, chain[-1]) and chain[-1] not in _globals_read(owner.__file__)):
                    problems.append(f"line {node.lineno}: {'.'.join(chain)} is set, but {owner.__name__} no longer "
                                    f"reads it as a global: setting it changes nothing")
        if isinstance(node, ast.Call):
            launch = isinstance(node.func, ast.Subscript)  # kernel[grid](...)
            chain = _chain(node.func.value if launch else node.func)
            if chain and chain[0] not in local:
                target = _resolve(chain, ns, [], node.lineno)  # (a missing attribute is reported above)
                if target is not None:
                    _check_call(node, target, problems, launch)
    problems = sorted(dict.fromkeys(problems), key=lambda p: int(p.split()[1].rstrip(":")))
    assert not problems, f"{path.name}: " + "; ".join(problems)


@pytest.mark.parametrize("prefills, says", [("8x128,2x512", "must be one of --batches"),
                                            ("1-128", "BATCHxPROMPT shapes"), ("1x128x4", "must be one of --batches")])
def test_engine_ab_refuses_prefill_shapes_it_would_not_time_before_it_needs_a_gpu(prefills, says, capsys):
    path = SCRIPTS_DIR / "engine_ab.py"
    with _Isolated([str(path), "--other", "old=old_engine.py", "--batches", "1,8", "--prefills", prefills]):
        with pytest.raises(SystemExit) as exit_:
            runpy.run_path(str(path), run_name="__main__")
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
