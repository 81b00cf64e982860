"""What one recipe asks of a te.Linear (its plan), shared by the eager path (linear.py), the
compiled path (_compile_linear.py) and the ops' fake kernels (_compile_ops.py).

A plan is looked up once per recipe: the three quantizer configs, the feature alignment, the GEMM
flags and the tuple the C calls take (csrc/ext/linear.c). The `needs` bits and the layout facts
(which quantized members linear_forward keeps) mirror linear.c. This module imports only the C
extension and _compile (which imports no other tequant module), so every te.Linear path imports
it, and it imports none of them. Tests: tests/test_linear.py, tests/test_compile.py.
"""
from . import _C, _compile

ROWWISE, COLUMNWISE = _C.USAGE_ROWWISE, _C.USAGE_COLUMNWISE

# Feature dims must be multiples of these (the quantizers' and cuBLASLt's rules); rows are padded
# to them (FP8 wgrad contracts over rows: cuBLASLt needs K % 16; MXFP8 / NVFP4 quantize 32 / 16).
ALIGN = {"delayed": 16, "current": 16, "block": 16, "mxfp8": 32, "nvfp4": 16}
# Scalings whose fused outputs are a quantization's members in both directions, without amax
BLOCK_FORMATS = ("block", "mxfp8")

NEED_DGRAD, NEED_WGRAD = _C.LINEAR_NEED_DGRAD, _C.LINEAR_NEED_WGRAD  # csrc/ext/module.h
KEEP_X_ROWWISE, PACKED = _C.LINEAR_KEEP_X_ROWWISE, _C.LINEAR_PACKED
DEFER_UPDATE = _C.LINEAR_DEFER_UPDATE  # the in-place backward ops: update at the pass's end


class Plan:
    """What one recipe asks of a Linear, looked up once per recipe and cached."""

    __slots__ = ("recipe", "key", "x", "w", "dy", "align", "flags", "backward_override",
                 "delayed", "c_args", "act_blocks", "dy_blocks")

    def __init__(self, recipe):
        self.recipe = recipe
        self.key = _C.recipe_key(recipe)
        self.x = _C.quantizer_config(recipe, "input")
        self.w = _C.quantizer_config(recipe, "weight")
        self.dy = _C.quantizer_config(recipe, "grad_output")
        self.align = ALIGN.get(self.x.scaling)
        split = _C.gemm_split_accumulator(recipe)
        self.flags = tuple(0 if s else _C.GEMM_FAST_ACCUM for s in split)  # fprop, dgrad, wgrad
        self.backward_override = getattr(recipe, "backward_override", None)
        self.delayed = self.x.scaling == "delayed"
        # Float8BlockScaling (1x128) or MXFP8BlockScaling (1x32) whose E4M3 input blocks an
        # activation's pass can write (tq_act_forward's block formats, _act_fn.ActInput.fusable)
        self.act_blocks = _fusable_blocks(self.x)
        # ... and whose grad_output blocks the activation's backward can write (tq_act_backward)
        self.dy_blocks = _fusable_blocks(self.dy)
        emulated = self.x.scaling in ("mxfp8", "nvfp4")
        self.c_args = (self.key, self.x, self.w, self.dy, self.align) + self.flags + (emulated,)


def _fusable_blocks(config):
    """Whether a fused kernel writes this quantizer's blocks: 1x128 (Float8BlockScaling) or 1x32
    (MXFP8BlockScaling) E4M3 blocks."""
    return config.format == "E4M3" and not config.two_d and (
        (config.scaling == "block" and config.block == (1, 128))
        or (config.scaling == "mxfp8" and config.block == (1, 32)))


_BY_ID = {}  # recipe id (the registry key as a str, as compiled code names recipes) -> Plan


def of_id(recipe_id):
    """The plan of the recipe registered under recipe_id (a str or int registry key)."""
    plan = _BY_ID.get(recipe_id)
    if plan is None:
        plan = _BY_ID[recipe_id] = Plan(_C._recipe_of_key(int(recipe_id)))
    return plan


@_compile.constant
def blocks_of(recipe_id):
    """(x quantized in a block format, grad_output in a block format, the feature alignment) of
    the recipe registered under recipe_id: literals, which traced code asks for (a constant
    under Dynamo) instead of reading _BY_ID, of which Dynamo keeps the snapshot it first read
    (a second recipe's plan added since would then be traced as a new Plan)."""
    plan = of_id(recipe_id)
    return plan.x.scaling in BLOCK_FORMATS, plan.dy.scaling in BLOCK_FORMATS, plan.align


def padded(rows, align):
    return (rows + align - 1) // align * align


def _shared_scale(config):
    return config.scaling in ("delayed", "current")


def x_kept(plan, needs):
    """Which of x's six members linear_forward keeps for `needs` (linear.c keep_columnwise)."""
    if needs & KEEP_X_ROWWISE:
        usage = ROWWISE | ((needs & NEED_WGRAD) and COLUMNWISE)
        return tuple(m is not None for m in _C._quantize_layout(plan.x, 128, 128, usage))
    if not needs & NEED_WGRAD:
        return (False,) * 6
    full = _C._quantize_layout(plan.x, 128, 128, ROWWISE | COLUMNWISE)
    return tuple(m is not None and (i >= 2 or (i == 1 and _shared_scale(plan.x)))
                 for i, m in enumerate(full))


def w_kept(plan):
    """Which of W's six members linear_forward keeps (both directions)."""
    both = ROWWISE | COLUMNWISE
    return tuple(m is not None for m in _C._quantize_layout(plan.w, 128, 128, both))
