"""What TensorFlow may fold in a traced step: Horovod's TensorFlow collectives are not stateful ops,
so one whose inputs are all constants is evaluated once, when the function is optimized, and its
result kept for every later step (seen with Horovod 0.28.1: an allreduce of a ``tf.constant`` in a
``tf.function`` gives the same result after a rank has joined). Every collective of a compressed
exchange must run at every step."""
from tensorflow.python.framework import op_def_registry

COLLECTIVES = {"HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather", "HorovodGroupedAllgather",
               "HorovodAlltoall", "HorovodReducescatter", "HorovodGroupedReducescatter", "HorovodBroadcast"}


def foldable_collectives(graph_def):
    """The names of the Horovod collectives in ``graph_def`` (and the functions of its library) whose
    data inputs depend on constants alone: no function argument, placeholder or stateful op (nor a
    call of a function, taken as opaque) above them."""
    graphs = [(graph_def.node, set())]
    graphs += [(f.node_def, {a.name for a in f.signature.input_arg}) for f in graph_def.library.function]
    found = []
    for nodes, args in graphs:
        by_name = {n.name: n for n in nodes}
        memo = {}

        def foldable(ref):
            name = ref.split(":")[0]
            if name in args or name not in by_name:
                return False
            if name not in memo:
                memo[name] = False  # (a cycle: a loop's back edge is not constant)
                node = by_name[name]
                op_def = op_def_registry.get(node.op)
                memo[name] = (op_def is not None and not op_def.is_stateful and node.op != "Placeholder"
                              and all(foldable(i) for i in node.input if not i.startswith("^")))
            return memo[name]

        found += [n.name for n in nodes
                  if n.op in COLLECTIVES and all(foldable(i) for i in n.input if not i.startswith("^"))]
    return found
