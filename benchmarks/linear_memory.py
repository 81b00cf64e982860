"""P7 for benchmarks/bench_linear.py: the bytes a Linear's forward leaves held for its backward.

held_bytes() counts them two ways, the allocator's view and the autograd graph's (graph_bytes():
the storages saved by the graph's nodes and custom Functions' ctx), leaving out parameters and
buffers; cached_weight_bytes() measures te.Linear's kept quantized weight.
"""
import torch

import tequant as te

import benchutil


def alloc_counter(device):
    """A function returning the bytes the torch allocator has handed out: on CUDA the requested
    (unrounded) bytes when this torch counts them, else memory_allocated(); None on CPU."""
    if device != "cuda":
        return None
    if "requested_bytes.all.current" in torch.cuda.memory_stats():
        return lambda: torch.cuda.memory_stats()["requested_bytes.all.current"]
    return torch.cuda.memory_allocated


def tensors_in(obj, out, depth=0):
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)) and depth < 4:
        for v in obj:
            tensors_in(v, out, depth + 1)


def graph_bytes(y, stop, exclude):
    """Bytes of the distinct storages the autograd graph of y holds from y back to the node stop:
    tensors saved by built-in nodes (_saved_* attributes), saved_tensors and tensor attributes
    (also in tuples) of custom Functions' ctx; storages in exclude (parameters, buffers) skipped."""
    seen_nodes, storages, todo = set(), {}, [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node is stop or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if type(node).__name__ == "AccumulateGrad":
            continue
        found = []
        for name in dir(node):
            if name.startswith("_saved_") and not name.endswith(("_sizes", "_strides")):
                try:
                    tensors_in(getattr(node, name), found)
                except RuntimeError:  # freed already
                    pass
        try:
            tensors_in(tuple(node.saved_tensors), found)
        except (AttributeError, RuntimeError):
            pass
        tensors_in(list(getattr(node, "__dict__", {}).values()), found)
        for t in found:
            s = t.untyped_storage()
            if s.data_ptr() not in exclude:
                storages[s.data_ptr()] = s.nbytes()
        todo.extend(fn for fn, _ in node.next_functions)
    return sum(storages.values())


def held_bytes(module, x_src, dy, counter, recipe=None, is_first_microbatch=None):
    """(allocator bytes or None, graph bytes) that one forward leaves allocated besides its output,
    with the input x dropped by the caller right after the forward (as a layer's input is, when
    nothing else keeps it). x is a non-leaf clone of x_src, so only the graph can keep it:
    nn.Linear keeps x itself; te.Linear its quantized x (and the quantized W, unless
    is_first_microbatch=False reuses the cached one). Allocator: allocated after - before + x's
    bytes - y's storage bytes; graph: graph_bytes() without the module's parameters and buffers.
    Runs the backward afterwards (DelayedScaling's state stays consistent)."""
    exclude = {t.untyped_storage().data_ptr()
               for t in list(module.parameters()) + list(module.buffers())}
    x = x_src.clone()  # a non-leaf (x_src requires grad; the clone's node saves nothing)
    x_bytes = x.untyped_storage().nbytes()
    if counter is not None:
        torch.cuda.synchronize()
        before = counter()
    kw = {} if is_first_microbatch is None else {"is_first_microbatch": is_first_microbatch}
    if recipe is None:
        y = module(x)
    else:
        with te.autocast(recipe=recipe):
            y = module(x, **kw)
    stop = x.grad_fn
    del x
    allocated = None
    if counter is not None:
        torch.cuda.synchronize()
        allocated = counter() - before + x_bytes - y.untyped_storage().nbytes()
    graph = graph_bytes(y, stop, exclude)
    y.backward(dy)
    benchutil.clear_grads(module, x_src)
    return allocated, graph


def drop_weight_cache(lin, recipe, x):
    """A forward with is_first_microbatch=None: te.Linear drops a cached quantized W."""
    with torch.no_grad(), te.autocast(recipe=recipe):
        lin(x[:16].detach())


def cached_weight_bytes(module):
    """Bytes of the quantized W a te.Linear holds in its weight cache (after a forward with
    is_first_microbatch=True): the storage it quantized W into, both directions, as a step's
    backward also keeps it (one packed buffer, csrc/ext/packed.c); parameters and buffers (the
    DelayedScaling amax slot) left out, as graph_bytes() leaves them out."""
    exclude = {t.untyped_storage().data_ptr()
               for t in list(module.parameters()) + list(module.buffers())}
    found = []
    tensors_in(list(module._weight_cache[1:]), found)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in found}
    return sum(n for ptr, n in storages.items() if ptr not in exclude)
