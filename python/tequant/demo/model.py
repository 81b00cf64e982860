"""The demo's model: a small GPT whose projections are te.Linear.

Token and position embeddings, LayerNorm and attention (torch's scaled_dot_product_attention,
causal) are torch; the QKV projection, the attention output projection and the MLP's fc1 and
fc2 are te.Linear, so inside te.autocast every GEMM of every block runs in the recipe's format.
With fused=True a block is built as TransformerEngine users build theirs: te.LayerNormLinear
(ln1 + qkv), te.Linear (proj) and te.LayerNormMLP (ln2 + fc1 + gelu + fc2), whose norm and
activation kernels write the GEMMs' quantized inputs themselves; the same math.
The LM head is torch and weight-tied to the token embedding (why: see GPT's docstring).
Tests: tests/test_demo.py (through the demo).
"""
import functools
import math

import torch
import torch.nn.functional as F

from .. import LayerNormLinear, LayerNormMLP, Linear

# d_model, layers, heads, seq_len, batch, default steps, peak LR. Every dim is a multiple of 32,
# MXFP8's block (te.Linear's strictest rule).
SIZES = {
    "tiny": dict(d_model=64, layers=1, heads=2, seq_len=32, batch=8, steps=30, lr=3e-3),
    "small": dict(d_model=128, layers=2, heads=4, seq_len=64, batch=8, steps=120, lr=3e-3),
    "medium": dict(d_model=512, layers=6, heads=8, seq_len=256, batch=32, steps=1000, lr=1e-3),
    "large": dict(d_model=3072, layers=4, heads=24, seq_len=256, batch=32, steps=600, lr=2e-4),
}


class Block(torch.nn.Module):
    def __init__(self, d_model, heads, init_std, out_std, fused=False):
        super().__init__()
        self.head_dim, self.fused = d_model // heads, fused
        # a partial, not a closure: the module keeps init_method, and the model stays picklable
        normal = lambda std: functools.partial(torch.nn.init.normal_, std=std)  # noqa: E731
        if fused:
            self.qkv = LayerNormLinear(d_model, 3 * d_model, init_method=normal(init_std))
            self.mlp = LayerNormMLP(d_model, 4 * d_model, init_method=normal(init_std),
                                    output_layer_init_method=normal(out_std))
        else:
            self.ln1 = torch.nn.LayerNorm(d_model)
            self.ln2 = torch.nn.LayerNorm(d_model)
            self.qkv = Linear(d_model, 3 * d_model, init_method=normal(init_std))
            self.fc1 = Linear(d_model, 4 * d_model, init_method=normal(init_std))
            self.fc2 = Linear(4 * d_model, d_model, init_method=normal(out_std))
        self.proj = Linear(d_model, d_model, init_method=normal(out_std))

    def forward(self, x):
        fused = self.fused
        # sizes from qkv's output: under tensor parallelism (examples/train_fsdp.py --tp) it holds
        # this rank's heads [q; k; v], and with sequence parallelism all the tokens
        qkv = self.qkv(x) if fused else self.qkv(self.ln1(x))
        b, t = qkv.shape[:2]
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in qkv.chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        if fused:
            return x + self.mlp(x)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(torch.nn.Module):
    """A GPT-2-style decoder (pre-LayerNorm, GELU MLP of 4 * d_model, GPT-2's initialization).

    The LM head is a torch matmul with the token embedding's weight (tied), not a te.Linear: the
    vocabulary (VOCAB, 57 characters) is no multiple of 32, tying halves the parameters of the
    embedding/head pair, and keeping the first and last layers in high precision is what
    TransformerEngine recipes do in practice (the logits are the most quantization-sensitive
    GEMM). Everything between is quantized. fused=True builds the blocks from te.LayerNormLinear
    and te.LayerNormMLP (see the module docstring).
    """

    def __init__(self, vocab_size, d_model, layers, heads, seq_len, fused=False):
        super().__init__()
        if d_model % 32 or d_model % heads:
            raise ValueError(f"d_model={d_model} must be a multiple of 32 and of heads={heads}")
        self.seq_len = seq_len
        std = 0.02
        self.tok = torch.nn.Embedding(vocab_size, d_model)
        self.pos = torch.nn.Embedding(seq_len, d_model)
        torch.nn.init.normal_(self.tok.weight, std=std)
        torch.nn.init.normal_(self.pos.weight, std=std)
        # GPT-2 scales the residual projections by 1/sqrt(2 * layers): the residual stream's
        # variance then stays O(1) with depth.
        self.blocks = torch.nn.ModuleList(
            Block(d_model, heads, std, std / math.sqrt(2 * layers), fused) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d_model)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.tok.weight.t()
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def param_groups(self, weight_decay):
        """AdamW groups: decay on matrices (projections; the tied embedding too, as GPT-2), none
        on biases, LayerNorm and position embedding."""
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            (decay if p.dim() == 2 and not name.startswith("pos") else no_decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]
