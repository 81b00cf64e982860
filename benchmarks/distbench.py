"""What bench_fsdp.py and bench_distributed.py share: `import distbench`.

The block stacks they train (GPT and Llama-style, te.Linear for every GEMM, TransformerEngine's
[s, b, h] layout), with TransformerEngine's tensor parallelism when given a group; copying a
whole model's weights into a tensor-parallel one; FSDP2 sharding as both benchmarks do it; and a
counter of the bytes a rank puts into torch.distributed's all-gathers; the same stacks with
torch.nn.Linear converted to torchao's float8 training (torchao_stack, bench_distributed.py's
"torchao" recipe; torchao is optional and imported there only). Not a model library: no
embeddings, head or rotary embeddings (they touch neither te.Linear nor the collectives), and the
Llama stack has as many key/value heads as query heads. Exercised on CPU by
tests/test_bench_distributed.py (bench_distributed.py --device cpu).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tequant as te

KINDS = ("gpt", "llama")


class Attention(torch.nn.Module):
    """QKV (column parallel) -> causal SDPA over this rank's heads -> proj (row parallel)."""

    def __init__(self, d, heads, bias, device, tp, linear=te.Linear):
        super().__init__()
        self.heads = heads // tp.get("tp_size", 1)
        col, row = _modes(tp)
        self.qkv = linear(d, 3 * d, bias=bias, device=device, **col)
        self.proj = linear(d, d, bias=bias, device=device, **row)
        self.qkv.regroup_heads = True  # load_whole: rows [q; k; v] of this rank's heads

    def forward(self, x):
        h = self.qkv(x)  # [s, b, 3 * heads * head_dim] (all tokens under sequence parallelism)
        s, b, _ = h.shape
        # q, k, v: the thirds of h's features, each [b, heads, s, head_dim] views. chunk's
        # backward writes the three grads into h's grad in one cat; the earlier
        # view(s, b, 3, heads, -1).permute(...).unbind(0) (the same q, k, v) took a stack and a
        # contiguous copy there (~0.7 ms a step at d = 4096, 8192 tokens: NOTES.md, 34th session)
        q, k, v = (t.view(s, b, self.heads, -1).permute(1, 2, 0, 3) for t in h.chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, head_dim]
        return self.proj(a.permute(2, 0, 1, 3).reshape(s, b, -1))


class Block(torch.nn.Module):
    """GPT: LayerNorm, attention with biases, LayerNorm, fc1 -> GELU(tanh) -> fc2.
    Llama: RMSNorm, attention without biases, RMSNorm, SwiGLU (down(silu(gate) * up))."""

    def __init__(self, kind, d, ffn, heads, device, tp, linear=te.Linear):
        super().__init__()
        self.kind = kind
        gpt = kind == "gpt"
        norm = torch.nn.LayerNorm if gpt else torch.nn.RMSNorm
        self.norm1, self.norm2 = norm(d, device=device), norm(d, device=device)
        self.attn = Attention(d, heads, gpt, device, tp, linear)
        col, row = _modes(tp)
        if gpt:
            self.fc1 = linear(d, ffn, device=device, **col)
            self.fc2 = linear(ffn, d, device=device, **row)
        else:
            self.gate = linear(d, ffn, bias=False, device=device, **col)
            self.up = linear(d, ffn, bias=False, device=device, **col)
            self.down = linear(ffn, d, bias=False, device=device, **row)
        if tp.get("sequence_parallel"):  # replicated, applied to this rank's tokens
            for p in (*self.norm1.parameters(), *self.norm2.parameters()):
                p.sequence_parallel = True  # summed by reduce_sequence_parallel_grads

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        if self.kind == "gpt":
            return x + self.fc2(F.gelu(self.fc1(h), approximate="tanh"))
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _modes(tp):
    if not tp:
        return {}, {}
    return {**tp, "parallel_mode": "column"}, {**tp, "parallel_mode": "row"}


class Stack(torch.nn.Module):
    """`layers` blocks of `kind` on [s, b, d] input; with tp_group, TransformerEngine's tensor
    parallelism (sequence parallel: the input and output are this rank's tokens along dim 0).
    linear builds every GEMM layer, linear(in, out, bias=, device=): te.Linear, or
    torch.nn.Linear (the same parameter names and shapes; no tp_group then)."""

    def __init__(self, kind, d, ffn, heads, layers, device, tp_group=None,
                 sequence_parallel=True, linear=te.Linear):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        tp = {}
        if tp_group is not None:
            if linear is not te.Linear:
                raise ValueError("tensor parallelism is te.Linear's (tp_group, parallel_mode)")
            tp = {"tp_group": tp_group, "tp_size": dist.get_world_size(tp_group),
                  "sequence_parallel": sequence_parallel}
            if heads % tp["tp_size"]:
                raise ValueError(f"{heads} heads do not split over {tp['tp_size']} ranks")
        self.blocks = torch.nn.ModuleList(Block(kind, d, ffn, heads, device, tp, linear)
                                          for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@torch.no_grad()
def load_whole(model, whole, rank, size):
    """Copies the whole (not parallel) Stack `whole` into the tensor-parallel Stack `model` of
    this rank: column layers take their rows (QKV: the q, k and v rows of this rank's heads),
    row layers their columns and the whole bias; norms are copied."""
    for mine, full in zip(model.modules(), whole.modules()):
        if isinstance(mine, te.Linear):
            w, b = full.weight, full.bias
            if mine.parallel_mode == "column":
                if getattr(mine, "regroup_heads", False):
                    w = w.view(3, size, -1, w.shape[1])[:, rank].reshape(-1, w.shape[1])
                    b = None if b is None else b.view(3, size, -1)[:, rank].reshape(-1)
                else:
                    w = w.chunk(size, 0)[rank]
                    b = None if b is None else b.chunk(size, 0)[rank]
            elif mine.parallel_mode == "row":
                w = w.chunk(size, 1)[rank]
            mine.weight.copy_(w)
            if b is not None:
                mine.bias.copy_(b)
        elif isinstance(mine, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
            mine.load_state_dict(full.state_dict())


def torchao_stack(whole, kind, d, ffn, heads, layers, *, float8_all_gather):
    """The Stack(kind, d, ffn, heads, layers) `whole` (not tensor parallel) rebuilt from
    torch.nn.Linear on its very tensors (load_state_dict with assign: the same names, shapes and
    storage), converted to torchao's float8 training: convert_to_float8_training with
    Float8LinearConfig's defaults (tensorwise dynamic scaling, e4m3 forward, e5m2 gradients)
    but enable_fsdp_float8_all_gather=float8_all_gather (FSDP2 then gathers the weights in
    float8; off without FSDP2). Raises ImportError without torchao."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    model = Stack(kind, d, ffn, heads, layers, "meta", linear=torch.nn.Linear)
    model.load_state_dict(whole.state_dict(), strict=True, assign=True)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=float8_all_gather)
    return convert_to_float8_training(model, config=config)


def fully_shard_stack(model, *, quantized, mesh=None, param_dtype=torch.bfloat16):
    """FSDP2 over `mesh` (default: every rank) for each block and then the stack, parameters
    cast to param_dtype for compute (MixedPrecisionPolicy); with quantized, te.Linear weights
    all-gather in the recipe's format inside te.autocast (enable_quantized_all_gather)."""
    import tequant.distributed  # noqa: F401  (te.distributed)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if quantized:
        te.distributed.enable_quantized_all_gather(model)
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype)}
    if mesh is not None:
        kwargs["mesh"] = mesh
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


class AllGatherBytes:
    """Bytes this rank puts into torch.distributed's all-gathers (FSDP2's, and the
    sequence-parallel ones of te.Linear in eager code), counted by wrapping the functions on
    the torch.distributed module while installed. Collectives inside a compiled graph
    (functional collectives) are not seen."""

    NAMES = ("all_gather_into_tensor", "all_gather_single")

    def __init__(self):
        self.sent = 0
        self.saved = {name: getattr(dist, name) for name in self.NAMES if hasattr(dist, name)}
        for name, fn in self.saved.items():
            setattr(dist, name, self._counted(fn))

    def _counted(self, fn):
        def counted(*args, **kwargs):
            inp = kwargs["input_tensor"] if "input_tensor" in kwargs else args[1]
            self.sent += inp.numel() * inp.element_size()
            return fn(*args, **kwargs)
        return counted

    def restore(self):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)
