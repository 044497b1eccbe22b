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
    ("codec kernels on arrays", {"hvd_qsgd.codec", "hvd_qsgd.cuda"}),
    ("protocol, chunk steps, codec backends", {"hvd_qsgd.protocol", "hvd_qsgd.reduction", "hvd_qsgd.cost_model",
                                                "hvd_qsgd.error_feedback", "hvd_qsgd.backends"}),
    ("settings and state objects", {"hvd_qsgd.settings", "hvd_qsgd.dynamic", "hvd_qsgd.policy",
                                    "hvd_qsgd.state", "hvd_qsgd.driver", "hvd_qsgd.report",
                                    "hvd_qsgd.horovod_caller", "hvd_qsgd.step_built"}),
    ("framework adapters", {"hvd_qsgd.adapters", "hvd_qsgd.adapters.torch", "hvd_qsgd.adapters.torch_params",
                            "hvd_qsgd.adapters.tensorflow", "hvd_qsgd.adapters.tf_schedule",
                            "hvd_qsgd.mpi"}),
    ("front objects and optimizers", {"hvd_qsgd", "hvd_qsgd.compressor", "hvd_qsgd.block_sign",
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
