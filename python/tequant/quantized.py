"""QuantizedTensor: the result of te.ops.quantize, a plain holder of torch tensors.

Not a torch.Tensor subclass (no __torch_dispatch__ cost): it holds the quantized data of one or
both directions, their scales and amaxes, the QuantizerConfig that made them and the logical
shape of the high-precision tensor. Layouts are the core's (csrc/include/tequant/tequant.h);
the accessors codes() and scales() give canonical forms that tests compare bit for bit.
It also keeps the (recipe, role) pair te.ops.quantize was given, which names the config: under
torch.compile one is built in traced code without the config (a C object Dynamo cannot trace)
and resolves `config` on first read outside the compiled region (tequant/_compile_trace.py).
Tests: tests/test_ops.py, tests/test_quantize_*.py and tests/test_compile_ops.py.
"""
import torch

from . import _C

ROWWISE, COLUMNWISE = _C.USAGE_ROWWISE, _C.USAGE_COLUMNWISE  # tq_usage bits
_MEMBERS = ("data", "scale_inv", "data_t", "scale_inv_t", "amax", "amax_t")
_DIRECTIONS = {"rowwise": ROWWISE, "columnwise": COLUMNWISE}


def _direction(direction):
    try:
        return _DIRECTIONS[direction]
    except (KeyError, TypeError):
        raise ValueError(f"direction must be 'rowwise' or 'columnwise', got {direction!r}") from None


def _ceil_div(a, b):
    return -(-a // b)


class QuantizedTensor:
    """A tensor quantized by te.ops.quantize.

    Attributes:
        config: the tequant.QuantizerConfig (format, scaling, block shape, flags) that made it.
        recipe, role: what te.ops.quantize was given (recipe None: Float8CurrentScaling());
            None for one built from a config alone, which torch.compile cannot take.
        shape: the logical shape of the high-precision tensor ([..., K]); rows = prod(shape[:-1]).
        dtype: the high-precision dtype it came from.
        data, scale_inv: the rowwise direction ([M, K], blocks along K), or None.
        data_t, scale_inv_t: the columnwise direction, the physical transpose [K, M] with blocks
            along M (NVFP4 with RHT: the quantized RHT(x^T)), or None.
        amax, amax_t: float32 [1, 1] amaxes where the format has them (per-tensor FP8: amax;
            NVFP4: amax rowwise, amax_t columnwise), else None.
    """

    __slots__ = ("_config", "recipe", "role", "shape", "dtype", "_member_tuple", "_rows",
                 "_cols") + _MEMBERS

    def __init__(self, config, shape, dtype, members, recipe=None, role=None):
        self._config = config  # None when built under torch.compile: see the config property
        self.recipe = recipe
        self.role = role
        self.shape = torch.Size(shape)
        self.dtype = dtype
        members = tuple(members)
        for name, value in zip(_MEMBERS, members):
            setattr(self, name, value)
        self._member_tuple = members  # what the C calls take, built once
        shape = self.shape
        self._rows = shape[:-1].numel() if len(shape) > 1 else 1
        self._cols = shape[-1] if len(shape) else 1

    @property
    def config(self):
        """The QuantizerConfig; looked up from (recipe, role) on first read if not given (as
        for one built under torch.compile)."""
        config = self._config
        if config is None:
            config = self._config = _C.quantizer_config(self.recipe, self.role)
        return config

    @config.setter
    def config(self, config):
        self._config = config

    @property
    def rows(self):
        """M: the product of the leading dims."""
        return self._rows

    @property
    def cols(self):
        """K: the last dim."""
        return self._cols

    @property
    def device(self):
        """The torch.device the members live on."""
        return (self.data if self.data is not None else self.data_t).device

    def has(self, direction):
        """Whether the 'rowwise' or 'columnwise' direction was produced."""
        return (self.data if _direction(direction) == ROWWISE else self.data_t) is not None

    def _members(self):
        return self._member_tuple

    def _fields(self):
        """(format, scaling, block, two_d) of the config, also inside torch.compile."""
        if torch.compiler.is_compiling():
            from . import _compile_trace
            return _compile_trace.config_fields(self)
        config = self.config
        return config.format, config.scaling, config.block, config.two_d

    def dequantize_direction(self, direction, dtype=torch.float32):
        """The values of one direction in its physical shape: [M, K] rowwise, [K, M] columnwise."""
        usage = _direction(direction)
        if not self.has(direction):
            raise ValueError(f"this QuantizedTensor has no {direction} data; quantize with "
                             f"{direction}=True")
        if torch.compiler.is_compiling():
            from . import _compile_trace
            return _compile_trace.dequantize(self, usage, dtype)
        shape = (self.rows, self.cols) if usage == ROWWISE else (self.cols, self.rows)
        out = torch.empty(shape, dtype=dtype, device=self.device)
        _C._dequantize(self.config, self.rows, self.cols, self._members(), usage, out)
        return out

    def dequantize(self, dtype=torch.float32):
        """The high-precision values in the logical shape, from the rowwise data when present,
        else from the columnwise data (transposed back; with NVFP4's RHT these are the values
        of the transformed tensor, not of x)."""
        if self.data is not None:
            return self.dequantize_direction("rowwise", dtype).reshape(self.shape)
        return self.dequantize_direction("columnwise", dtype).t().reshape(self.shape)

    def codes(self, direction="rowwise"):
        """The element codes of one direction as uint8 in its physical shape ([M, K] or [K, M]):
        FP8 bit patterns, or E2M1 codes 0..15 unpacked from the nibbles (even column low)."""
        data = self.data if _direction(direction) == ROWWISE else self.data_t
        if data is None:
            raise ValueError(f"this QuantizedTensor has no {direction} data")
        bits = data.view(torch.uint8)
        if self._fields()[0] != "E2M1":
            return bits
        return torch.stack((bits & 0xF, bits >> 4), dim=-1).reshape(bits.shape[0], 2 * bits.shape[1])

    def scales(self, direction="rowwise"):
        """The scales of one direction in a compact [rows, blocks] form of that direction, in
        their storage dtype (float32, float8_e8m0fnu, float8_e4m3fn): [1, 1] per tensor;
        FP8 1x128: [M, ceil(K/128)] rowwise, [K, ceil(M/128)] columnwise; FP8 128x128:
        [ceil(M/128), ceil(K/128)] rowwise and its transpose columnwise; MXFP8: [M, K/32] /
        [K, M/32], a view of the stored block-major [K/32, M] / [M/32, K]; NVFP4: the stored
        [M, K/16] / [K, M/16] (2D tiles repeat their scale on each row)."""
        usage = _direction(direction)
        if not self.has(direction):
            raise ValueError(f"this QuantizedTensor has no {direction} data")
        _, scaling, block, two_d = self._fields()
        scale = self.scale_inv if usage == ROWWISE or block is None else self.scale_inv_t
        if scaling == "mxfp8":
            return scale.t()
        if scaling != "block":
            return scale
        m, k = (self.rows, self.cols) if usage == ROWWISE else (self.cols, self.rows)
        if two_d:  # [ceil(m/128), pad4(ceil(k/128))]
            return scale[:, :_ceil_div(k, 128)]
        return scale[:, :m].t()  # stored [ceil(k/128), pad4(m)], m contiguous

    def __repr__(self):
        dirs = [d for d in ("rowwise", "columnwise") if self.has(d)]
        return (f"QuantizedTensor(shape={tuple(self.shape)}, format={self.config.format}, "
                f"scaling={self.config.scaling!r}, block={self.config.block}, "
                f"directions={dirs}, device={self.device})")
