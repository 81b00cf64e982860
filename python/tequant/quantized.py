"""QuantizedTensor: the result of te.ops.quantize, a plain holder of torch tensors.

Not a torch.Tensor subclass (no __torch_dispatch__ cost): it holds the quantized data of one or
both directions, their scales and amaxes, the QuantizerConfig that made them and the logical
shape of the high-precision tensor. Layouts are the core's (csrc/include/tequant/tequant.h);
the accessors codes() and scales() give canonical forms that tests compare bit for bit.
It also keeps the (recipe, role) pair te.ops.quantize was given, which names the config: under
torch.compile one is built in traced code without the config (a C object Dynamo cannot trace)
and resolves `config` on first read outside the compiled region (tequant/_compile_trace.py).
Tests: tests/test_ops.py, tests/test_quantize_*.py, tests/test_compile_ops.py and (copies, pickles,
assigned members) tests/test_quantized_edges.py.
"""
import torch

from . import _C

ROWWISE, COLUMNWISE = _C.USAGE_ROWWISE, _C.USAGE_COLUMNWISE  # tq_usage bits
_MEMBERS = ("data", "scale_inv", "data_t", "scale_inv_t", "amax", "amax_t")
_DIRECTIONS = {"rowwise": ROWWISE, "columnwise": COLUMNWISE}
_DEQUANTIZED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _direction(direction):
    try:
        return _DIRECTIONS[direction]
    except (KeyError, TypeError):
        raise ValueError(f"direction must be 'rowwise' or 'columnwise', got {direction!r}") from None


def _ceil_div(a, b):
    return -(-a // b)


def _member(index):
    """A property over member `index` of _member_tuple (see QuantizedTensor.__slots__)."""
    def get(self):
        return self._member_tuple[index]

    def put(self, value):
        members = list(self._member_tuple)
        members[index] = value
        self._member_tuple = tuple(members)
    return property(get, put, doc=f"The {_MEMBERS[index]} member (a torch.Tensor) or None.")


def _bytewise(member):
    """Whether a member pickles as its bytes: any one-byte dtype other than uint8 (float8_*)."""
    return member.element_size() == 1 and member.dtype != torch.uint8


def _rebuild(config, shape, dtype, members, recipe, role):
    """The inverse of QuantizedTensor.__reduce__ (module level, so pickle can name it)."""
    members = [m[0].view(m[1]) if isinstance(m, tuple) else m for m in members]
    return QuantizedTensor(config, shape, dtype, members, recipe, role)


def _allow_weights_only_load():
    """torch.load's default (weights_only=True since torch 2.6) unpickles only allowlisted
    globals, so torch.load(path) of a saved te.ops.quantize result failed unless the caller
    allowlisted tequant's names by hand. These are what its pickle names (see __reduce__): the
    rebuild function, the config factory (recipe, role) and the recipe dataclasses with their
    parameter types; each only rebuilds data, none runs code it is handed. CustomRecipe is left
    out: it holds a user's callable, which a weights-only load cannot admit."""
    from . import recipe
    from ._recipe_params import Format, MMParams, QParams, _Derived
    torch.serialization.add_safe_globals([
        _rebuild, _C.quantizer_config, Format, MMParams, QParams, _Derived,
        recipe.DelayedScaling, recipe.Float8CurrentScaling, recipe.Float8BlockScaling,
        recipe.MXFP8BlockScaling, recipe.NVFP4BlockScaling])


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

    # The six members live only in _member_tuple (what the C calls take, built once); data,
    # scale_inv, ... are properties over it, so assigning one (q.data = ...) changes what
    # dequantize() and te.ops.gemm read, not only what codes() reads. Likewise rows / cols
    # follow an assigned shape.
    __slots__ = ("_config", "recipe", "role", "_shape", "dtype", "_member_tuple", "_rows",
                 "_cols")

    def __init__(self, config, shape, dtype, members, recipe=None, role=None):
        self._config = config  # None when built under torch.compile: see the config property
        self.recipe = recipe
        self.role = role
        self.dtype = dtype
        members = tuple(members)
        if len(members) != len(_MEMBERS):
            raise ValueError(f"members must be the {len(_MEMBERS)} tensors (or None) "
                             f"{', '.join(_MEMBERS)}; got {len(members)}")
        self._member_tuple = members
        self._set_shape(shape)

    def _set_shape(self, shape):
        shape = self._shape = torch.Size(shape)
        self._rows = shape[:-1].numel() if len(shape) > 1 else 1
        self._cols = shape[-1] if len(shape) else 1

    shape = property(lambda self: self._shape, _set_shape,
                     doc="The logical shape [..., K] of the high-precision tensor.")
    data = _member(0)
    scale_inv = _member(1)
    data_t = _member(2)
    scale_inv_t = _member(3)
    amax = _member(4)
    amax_t = _member(5)

    def __reduce__(self):
        """pickle, copy.copy / copy.deepcopy and torch.save: the members travel as uint8 views
        of their bytes, because torch cannot unpickle a float8 tensor (pickle.loads fails in
        torch.storage._load_from_bytes: UntypedStorage has no dtype); torch.save of the views
        still honours torch.load's map_location."""
        members = tuple(None if m is None else (m.view(torch.uint8), m.dtype) if _bytewise(m)
                        else m for m in self._member_tuple)
        return (_rebuild, (self._config, self._shape, self.dtype, members, self.recipe,
                           self.role))

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
        if dtype not in _DEQUANTIZED_DTYPES:  # (else C's error would name an `out` not passed)
            raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, "
                             f"got {dtype}")
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


_allow_weights_only_load()
