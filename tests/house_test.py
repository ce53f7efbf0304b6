"""The shape of the house, read from the code: the package's import graph has no circles and no import from a lower
layer to a higher one (the layers below), and its rooms stay readable (file, class and function lengths). A
change that breaks either fails here, naming the module, the import or the function."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lowest first. A module may import modules of its own layer or lower; a new module must be placed here, which is
# the moment to decide what it may depend on. A package is listed by its name: all its modules share the layer.
LAYERS = (
    ("foundation", ("transformer.errors", "transformer.files", "transformer.defaults", "transformer.console",
                    "transformer.tokenizer", "transformer.corpus", "transformer.sweep", "transformer.mbr",
                    "transformer.marian")),
    ("schema", ("transformer.config_files",)),
    ("parts", ("transformer.model", "transformer.optim", "transformer.sharding", "transformer.sources",
               "transformer.workdir", "transformer.metrics", "transformer.token_cache", "transformer.data", "transformer.mixture",
               "transformer.checkpoint", "transformer.throughput", "transformer.batching", "transformer.search_ops")),
    ("steps", ("transformer.steps", "transformer.decode", "transformer.loop", "transformer.risk")),
    ("run", ("transformer.settings", "transformer.plan", "transformer.evaluation", "transformer.restore",
             "transformer.trainer")),
    ("tools", ("transformer.sweep_runner", "transformer.sweep_results", "transformer.translate", "transformer.back_translate",
               "transformer.features", "transformer.cli")),
    ("configs", ("configs",)),
    ("entry points", ("train", "eval")),
)
LINE_LIMIT, CLASS_LIMIT, FUNCTION_LIMIT = 700, 200, 60
LONG_FILES = ("transformer/corpus.py",)  # the built-in corpus's word tables


def modules() -> dict[str, str]:
    """module name -> path, for the package, the configs and the two entry points."""
    found = {"train": os.path.join(ROOT, "train.py"), "eval": os.path.join(ROOT, "eval.py")}
    for top in ("transformer", "configs"):
        for directory, _, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    found[module.removesuffix(".__init__")] = path
    return found


def imports(path: str, module: str, known: dict[str, str]) -> set[str]:
    """The known modules `path` imports, anywhere in the file (imports inside functions count)."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & set(known)
            names.update(submodules)
            if len(submodules) < len(node.names):  # a name the package's __init__ defines: the package itself
                names.add(base)
    # `transformer` and `configs` are empty packages, in no layer of their own.
    return {name for name in names if name in known and name != module and name not in ("transformer", "configs")}


def layer_of(module: str) -> int:
    for index, (_, members) in enumerate(LAYERS):
        if any(module == member or module.startswith(member + ".") for member in members):
            return index
    raise AssertionError(f"{module} is in no layer of tests/house_test.py's LAYERS: place it there")


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {module: imports(path, module, known) for module, path in known.items()}


def test_every_import_runs_down_the_layers():
    upward = [f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
              for module, targets in sorted(import_graph().items()) for target in sorted(targets)
              if layer_of(target) > layer_of(module)]
    assert not upward, "imports from a lower layer to a higher one:\n  " + "\n  ".join(upward)


def test_the_imports_have_no_circle():
    graph, state, circles = import_graph(), {}, []

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"
    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n  " + "\n  ".join(circles)


def test_the_library_never_imports_a_config_file():
    offenders = [f"{module} imports {target}" for module, targets in import_graph().items()
                 if module.startswith("transformer") for target in targets if target.startswith("configs")]
    assert not offenders, offenders


def package_files() -> list[str]:
    return sorted(os.path.relpath(path, ROOT) for module, path in modules().items() if module.startswith("transformer"))


@pytest.mark.parametrize("path", package_files())
def test_rooms_of_a_readable_size(path):
    source = open(os.path.join(ROOT, path), encoding="utf-8").read()
    too_long = []
    if path not in LONG_FILES and source.count("\n") > LINE_LIMIT:
        too_long.append(f"{path}: {source.count(chr(10))} lines (limit {LINE_LIMIT})")
    for node in ast.walk(ast.parse(source)):
        limit = (CLASS_LIMIT if isinstance(node, ast.ClassDef) else
                 FUNCTION_LIMIT if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
        if limit and node.end_lineno - node.lineno + 1 > limit:
            too_long.append(f"{path}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines "
                            f"(limit {limit})")
    assert not too_long, "\n".join(too_long)
