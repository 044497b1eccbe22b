"""The package's layers import in one direction only, and no import cycle exists.

Every ``import`` and ``from ... import`` in hvd_qsgd/ is read from the source (AST), at module level
and inside functions alike, and turned into edges between the package's modules:

* an import names the module it loads (``from hvd_qsgd import codec`` -> hvd_qsgd.codec; ``from
  hvd_qsgd.torch import EFSGDM`` -> the package hvd_qsgd.torch, since EFSGDM is no module);
* loading a module first runs the packages above it, so those are edges too (``import
  hvd_qsgd.adapters.torch`` -> hvd_qsgd.adapters), except the root package ``hvd_qsgd``, the entry
  point every import starts from: it is an edge only where a module names it
  (``import hvd_qsgd``, ``from hvd_qsgd import QSGD``).

Then no strongly connected component may hold more than one module (no cycle, however lazy its
back edge), and every edge must go to the same or a lower layer of ``LAYERS``, the order
docs/architecture.md describes. A new module must be placed in a layer.
"""
import ast
import os

import pytest

from tests.helpers import ROOT

PACKAGE = "hvd_qsgd"

# lowest first; docs/architecture.md explains each
LAYERS = [
    ("native binding", {"hvd_qsgd._native", "hvd_qsgd._tf_ops", "hvd_qsgd.errors"}),
    ("codec kernels on arrays", {"hvd_qsgd.codec", "hvd_qsgd.codec_params", "hvd_qsgd.codec_segments", "hvd_qsgd.cuda",
                                 "hvd_qsgd.cuda_headers", "hvd_qsgd.cuda_verdicts", "hvd_qsgd.threads"}),
    ("protocol, chunk steps, codec backends", {"hvd_qsgd.protocol", "hvd_qsgd.reduction", "hvd_qsgd.cost_model",
                                                "hvd_qsgd.result_pool",
                                                "hvd_qsgd.error_feedback", "hvd_qsgd.backends", "hvd_qsgd.backend_host"}),
    ("settings and state objects", {"hvd_qsgd.settings", "hvd_qsgd.dynamic", "hvd_qsgd.policy",
                                    "hvd_qsgd.state", "hvd_qsgd.driver", "hvd_qsgd.report",
                                    "hvd_qsgd.horovod_caller", "hvd_qsgd.step_built", "hvd_qsgd.unnamed_calls",
                                    "hvd_qsgd.install_check", "hvd_qsgd.install_selftest"}),
    ("the exchange, framework-free", {"hvd_qsgd.exchange", "hvd_qsgd.exchange.collectives",
                                      "hvd_qsgd.exchange.chains", "hvd_qsgd.exchange.runner",
                                      "hvd_qsgd.exchange.hierarchical", "hvd_qsgd.exchange.fused",
                                      "hvd_qsgd.exchange.buffers", "hvd_qsgd.exchange.residuals",
                                      "hvd_qsgd.exchange.openings", "hvd_qsgd.exchange.joined",
                                      "hvd_qsgd.exchange.deferred", "hvd_qsgd.exchange.buffer_plan"}),
    ("framework adapters", {"hvd_qsgd.adapters", "hvd_qsgd.adapters.torch", "hvd_qsgd.adapters.torch_params",
                            "hvd_qsgd.adapters.torch_places",
                            "hvd_qsgd.adapters.torch_collectives", "hvd_qsgd.adapters.tensorflow",
                            "hvd_qsgd.adapters.tensorflow.compressor", "hvd_qsgd.adapters.tensorflow.graph",
                            "hvd_qsgd.adapters.tensorflow.state", "hvd_qsgd.adapters.tensorflow.schedule",
                            "hvd_qsgd.adapters.tensorflow.accumulators", "hvd_qsgd.adapters.tensorflow.collectives",
                            "hvd_qsgd.adapters.tensorflow.verdict", "hvd_qsgd.adapters.tensorflow.tally",
                            "hvd_qsgd.adapters.tensorflow.uncompressed",
                            "hvd_qsgd.mpi"}),
    ("front objects and optimizers", {"hvd_qsgd", "hvd_qsgd.__main__", "hvd_qsgd.compressor", "hvd_qsgd.block_sign",
                                      "hvd_qsgd.torch", "hvd_qsgd.torch.ef_sgdm", "hvd_qsgd.torch.periodic",
                                      "hvd_qsgd.torch.elastic", "hvd_qsgd.tensorflow",
                                      "hvd_qsgd.tensorflow.ops", "hvd_qsgd.tensorflow.tape",
                                      "hvd_qsgd.tensorflow.keras", "hvd_qsgd.tensorflow.keras_base",
                                      "hvd_qsgd.tensorflow.periodic", "hvd_qsgd.tensorflow.ef_sgdm", "hvd_qsgd.tensorflow.elastic",
                                      "hvd_qsgd.tensorflow.keras_callbacks", "hvd_qsgd.tensorflow.keras_elastic"}),
]


def package_modules(root=ROOT):
    """{module name: path} of every .py file of the package."""
    out = {}
    for folder, _, files in os.walk(os.path.join(root, PACKAGE)):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), root)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(folder, f)
    return out


def _resolve(modules, importer, node):
    """The internal modules an import node names (before adding parent packages)."""
    is_package = modules[importer].endswith("__init__.py")
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = importer.split(".")
        anchor = parts if is_package else parts[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    names = []
    for a in node.names:
        sub = f"{base}.{a.name}"
        names.append(sub if sub in modules else base)
    return names


def import_graph(modules):
    """{module: set of internal modules it imports}, function-level imports included."""
    graph = {m: set() for m in modules}
    for m, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _resolve(modules, m, node):
                if target != PACKAGE and not target.startswith(PACKAGE + "."):
                    continue
                parts = target.split(".")
                while parts and ".".join(parts) not in modules:  # a name inside a module
                    parts.pop()
                named = ".".join(parts)
                if named:
                    graph[m].add(named)
                for k in range(2, len(parts)):  # the packages between the root and the module
                    graph[m].add(".".join(parts[:k]))
        graph[m].discard(m)
    return graph


def cycles(graph):
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def layer_of(module):
    for i, (_, members) in enumerate(LAYERS):
        if module in members:
            return i
    return None


def upward_edges(graph):
    return sorted((a, b) for a, targets in graph.items() for b in targets
                  if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a))


def test_the_package_has_no_import_cycle():
    graph = import_graph(package_modules())
    assert cycles(graph) == []


def test_every_module_is_in_a_layer_and_imports_only_downward():
    modules = package_modules()
    assert sorted(m for m in modules if layer_of(m) is None) == [], "place new modules in LAYERS"
    assert upward_edges(import_graph(modules)) == []


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path):
    """The same checks on a copy of the package with one deliberate back edge: a function-level
    import of the front object in the codec (layer 1 -> layer 5, and codec -> compressor -> ... ->
    codec is a cycle)."""
    modules = package_modules()
    copy = {}
    for m, path in modules.items():
        dest = tmp_path / os.path.relpath(path, ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        text = open(path).read()
        if m == "hvd_qsgd.codec":
            text += "\n\ndef _late():\n    from hvd_qsgd.compressor import QSGD\n    return QSGD\n"
        dest.write_text(text)
        copy[m] = str(dest)
    graph = import_graph(copy)
    assert "hvd_qsgd.compressor" in graph["hvd_qsgd.codec"]
    found = cycles(graph)
    assert any({"hvd_qsgd.codec", "hvd_qsgd.compressor"} <= set(c) for c in found), found
    assert ("hvd_qsgd.codec", "hvd_qsgd.compressor") in upward_edges(graph)


@pytest.mark.parametrize("source, expected", [
    ("from hvd_qsgd import codec", {"hvd_qsgd.codec"}),
    ("import hvd_qsgd", {"hvd_qsgd"}),
    ("from hvd_qsgd import QSGD", {"hvd_qsgd"}),
    ("from hvd_qsgd.torch import EFSGDM", {"hvd_qsgd.torch"}),
    ("from hvd_qsgd.adapters.torch import QSGD", {"hvd_qsgd.adapters.torch", "hvd_qsgd.adapters"}),
    ("def f():\n    import hvd_qsgd.torch.elastic", {"hvd_qsgd.torch.elastic", "hvd_qsgd.torch"}),
    ("from . import codec", {"hvd_qsgd.codec"}),
    ("import numpy, torch", set()),
])
def test_imports_become_edges(tmp_path, source, expected):
    modules = package_modules()
    probe = tmp_path / "probe.py"
    probe.write_text(source + "\n")
    modules["hvd_qsgd.probe"] = str(probe)
    assert import_graph(modules)["hvd_qsgd.probe"] == expected


# -- the exchange is framework-free; modules and functions stay small -----------------------------

FRAMEWORKS = ("torch", "tensorflow", "horovod", "keras", "tf_keras", "jax", "mpi4py")

# modules over MAX_MODULE_LINES and functions over MAX_FUNCTION_LINES, each with its reason
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60
LONG_MODULES = {}
LONG_FUNCTIONS = {
    "hvd_qsgd/_native.py:load": "one table of the C ABI's ctypes prototypes, read top to bottom",
    "hvd_qsgd/tensorflow/periodic.py:PeriodicQuantizedAveraging": "a factory whose body is the class it builds "
                                                                  "(Keras 2 and 3 optimizers differ in base class)",
    "hvd_qsgd/tensorflow/keras_base.py:distributed_optimizer": "a factory whose body is the optimizer subclass it "
                                                               "builds, as Horovod's own create_distributed_optimizer",
}


def _imported_roots(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]


def test_the_exchange_imports_no_framework():
    modules = {m: p for m, p in package_modules().items() if m == "hvd_qsgd.exchange" or
               m.startswith("hvd_qsgd.exchange.")}
    assert len(modules) >= 4, sorted(modules)
    found = {m: sorted(set(_imported_roots(ast.parse(open(p).read()))) & set(FRAMEWORKS)) for m, p in modules.items()}
    assert {m: f for m, f in found.items() if f} == {}


def test_the_framework_check_sees_a_lazy_import():
    tree = ast.parse("def f():\n    import horovod.torch as hvd\n    from torch import nn\n")
    assert set(_imported_roots(tree)) == {"horovod", "torch"}


def _sizes():
    """(relative path, lines) of every module and (path:function, lines) of every function."""
    modules, functions = {}, {}
    for m, path in package_modules().items():
        rel = os.path.relpath(path, ROOT)
        text = open(path).read()
        modules[rel] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{rel}:{node.name}"
                functions[key] = max(functions.get(key, 0), node.end_lineno - node.lineno + 1)
    return modules, functions


def test_modules_and_functions_stay_small_or_say_why():
    modules, functions = _sizes()
    assert {k: n for k, n in modules.items() if n > MAX_MODULE_LINES and k not in LONG_MODULES} == {}
    assert {k: n for k, n in functions.items() if n > MAX_FUNCTION_LINES and k not in LONG_FUNCTIONS} == {}
    # an exception whose module or function has become small again is struck off the list
    assert [k for k in LONG_MODULES if modules.get(k, 0) <= MAX_MODULE_LINES] == []
    assert [k for k in LONG_FUNCTIONS if functions.get(k, 0) <= MAX_FUNCTION_LINES] == []


def test_adapters_on_the_exchange_are_glue():
    """An adapter whose reductions run through hvd_qsgd.exchange is glue (tensor conversion, its
    library's collectives, framework state): about 300 lines at most."""
    modules, _ = _sizes()
    glue = ("hvd_qsgd/adapters/torch.py", "hvd_qsgd/adapters/torch_collectives.py", "hvd_qsgd/mpi.py",
            "hvd_qsgd/adapters/tensorflow/compressor.py", "hvd_qsgd/adapters/tensorflow/graph.py",
            "hvd_qsgd/adapters/tensorflow/verdict.py")
    assert {k: modules[k] for k in glue if modules[k] > 300} == {}
    for path in glue:
        text = open(os.path.join(ROOT, path)).read()
        assert "hvd_qsgd.exchange" in text, f"{path} does not run its reductions through the exchange"


# class names defined in more than one module, each a public name a user meets in one namespace
SHARED_CLASS_NAMES = {
    "EFSGDM": "the public optimizer of each framework: hvd_qsgd.torch.EFSGDM, hvd_qsgd.tensorflow.EFSGDM",
    "TensorFlowKerasState": "Horovod's names: hvd_qsgd.tensorflow.elastic and hvd_qsgd.tensorflow.keras.elastic",
}


def test_internal_classes_have_names_of_their_own():
    """No two classes of the package share a name (the framework adapters are TorchCompressor and
    TensorFlowCompressor, re-exported as each framework's public QSGD), but the public names listed."""
    where = {}
    for m, path in package_modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(m)
    assert {k: v for k, v in where.items() if len(v) > 1 and k not in SHARED_CLASS_NAMES} == {}
    assert where.get("QSGD") == ["hvd_qsgd.compressor"]


# -- the exchange says each thing once -----------------------------------------------------------

def repeated_runs(paths, n=6):
    """Pairs of places (path, line) where the same n code lines (stripped; blank lines and comments
    skipped) stand twice: in two files, or twice in one file without overlapping."""
    seen, pairs = {}, []
    for path in paths:
        with open(path) as f:
            code = [(i + 1, line.strip()) for i, line in enumerate(f)]
        code = [(i, line) for i, line in code if line and not line.startswith("#")]
        for k in range(len(code) - n + 1):
            run = tuple(line for _, line in code[k:k + n])
            here = (path, code[k][0])
            first = seen.setdefault(run, here)
            if first != here and (first[0] != path or here[1] - first[1] >= n):
                pairs.append((first, here))
    return pairs


def test_the_exchange_writes_no_run_of_six_lines_twice():
    paths = sorted(p for m, p in package_modules().items() if m.startswith("hvd_qsgd.exchange"))
    assert repeated_runs(paths) == []


def test_the_repeat_check_sees_a_repeated_run(tmp_path):
    body = "".join(f"    x{i} = f(x{i - 1})\n" for i in range(1, 7))
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("def f(x0):\n" + body)
    b.write_text("def g(x0):\n    # the same steps\n" + body)
    assert repeated_runs([str(a), str(b)]) == [((str(a), 2), (str(b), 3))]
    assert repeated_runs([str(a)]) == []
